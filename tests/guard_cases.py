"""The guard's run-time checks on every rank of the worker pool: they return what each rank raised."""

from __future__ import annotations

from unittest import mock

import torch.distributed as dist
from dist_cases import mesh
from linear_more_cases import MORE
from train_cases import packed_row, tiny_model

from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing import families
from hybrid_cp.training.batch import shard_batch


def packed_row_without_boundaries(u: int, r: int) -> str:
    """Jamba with its Mamba decoder layer left unrouted (as the pure Mamba / Mamba2 models are: their blocks call
    the mixer without `**kwargs`), on a packed row: the routed mixer gets no boundaries; what it raised."""
    cp = mesh(u, r)
    local = shard_batch(packed_row(4321), cp)
    with mock.patch("hybrid_cp.integrations.linear_layers._LAYERS_WITHOUT_KWARGS", ()):
        model = apply_context_parallel(tiny_model("jamba", 2, generic=True, **MORE["jamba"]), cp)
    try:
        model(**{k: local[k] for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")})
    except Exception as exc:  # the test asserts the type and the message
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


def packed_row_refused(u: int, r: int, kinds: list[str]) -> dict:
    """Families whose model drops the packed row's boundaries before the blocks (pure Mamba / Mamba2): what a
    packed-row forward raised, per family."""
    cp = mesh(u, r)
    local = shard_batch(packed_row(4321), cp)
    out = {}
    for kind in kinds:
        model = apply_context_parallel(tiny_model(kind, 2, generic=True, **MORE[kind]), cp)
        try:
            model(**{k: local[k] for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")})
            out[kind] = "nothing raised"
        except Exception as exc:  # the test asserts the type and the message
            out[kind] = f"{type(exc).__name__}: {exc}"
    return out


def walk_share() -> dict:
    """This rank's share of `families.walk` (every world-size-th family from its rank): the walk builds every
    family of transformers, which one process took 11-15 s to do."""
    types = families.causal_lm_types()
    return families.walk(types[dist.get_rank() :: dist.get_world_size()])
