"""Training a transformers model on rows under an `hcp.AttnMask` (`hcp.shard_batch(batch, cp, mask=m)`, then
`model(**shard)`) equals running each prompt + completion alone on one process (tests/mask_model_cases.py), and
the calls a mask cannot make exact raise a named error on every rank."""

import mask_model_cases
import pytest
import torch
from tolerance import within

import hybrid_cp as hcp
from hybrid_cp.engine.layout import row_layout
from hybrid_cp.engine.mesh import CPMesh
from hybrid_cp.errors import ConfigError, InputTypeError, ShapeError
from hybrid_cp.training.batch import MASK_KEY

pytest.importorskip("transformers")

# fp32 round-off of a tiny Llama, one masked row vs five prompt + completion rows run alone: worst loss 8.6e-8
# (116x under), worst gradient 5.2e-7 (u=2 r=2 through lm_loss; 190x under) in a recorded run (fixed seeds:
# the model(**shard) figures repeated exactly in a second run)
LOSS = 1e-5
GRAD = 1e-4


@pytest.mark.parametrize(
    "u,r,tiled_loss", [(2, 2, False), (1, 4, False), (2, 2, True)], ids=["2x2", "1x4", "2x2-lm_loss"]
)
def test_shared_prefix_llama_step_matches_per_completion_reference(pool, u, r, tiled_loss):
    # tiled_loss: hcp.lm_loss(model, shard, cp) must hand the mask to the model as model(**shard) does
    rows = pool.run(mask_model_cases.tree_model_parity, u=u, r=r, tiled_loss=tiled_loss)
    for rank, row in enumerate(rows):
        assert not row["missing"] and row["carried"], (u, r, row)
        within(row["loss"], LOSS, f"u={u} r={r} rank {rank} loss", row)
        within(row["grad"], GRAD, f"u={u} r={r} rank {rank} grad", row)
        # teeth: completions that saw each other (a mask lost on the way) would move some gradient far more
        assert row["leak"] > 1e2 * GRAD, row
    assert len({row["cp_loss"] for row in rows}) == 1, [row["cp_loss"] for row in rows]


def test_masked_model_calls_that_cannot_be_exact_raise(pool):
    rows = pool.run(mask_model_cases.tree_model_refusals, u=2, r=2)
    for row in rows:
        assert row["ok_after"][1] > 0
        for case in ("mask_4d", "mask_4d_with_mask", "wrong_type", "padding_with_mask"):
            assert row[case][0] == "ConfigError", (case, row[case])  # each rank's own check, the same everywhere
        assert "prepared 4-D mask" in row["mask_4d"][1], row["mask_4d"]
        assert "drop ['attention_mask']" in row["mask_4d_with_mask"][1], row["mask_4d_with_mask"]
        assert "must be an hcp.AttnMask" in row["wrong_type"][1], row["wrong_type"]
        assert row["bidirectional_config"][0] == "ConfigError", row["bidirectional_config"]
        assert "not causal" in row["bidirectional_config"][1], row["bidirectional_config"]
        assert row["bidirectional_config_with_mask"] == row["ok_after"]
    # rank 0 alone given another tree of the same length: it raises its own error, the others the agreement's
    for row in rows:
        want = ("ShapeError", "InconsistentRanksError") if row["cp_rank"] == 0 else ("InconsistentRanksError",)
        assert row["other_mask_on_rank0"][0] in want, row["other_mask_on_rank0"]


def _described_mesh(u: int, r: int, rank: int = 0) -> CPMesh:
    """A mesh description without process groups: shard_batch does no communication."""
    ring_rank, ulysses_rank = divmod(rank, u)
    return CPMesh(
        ulysses_size=u,
        ring_size=r,
        dp_size=1,
        layout="zigzag",
        device=torch.device("cpu"),
        device_mesh=None,
        ulysses_group=None,
        ring_group=None,
        ring_group_bwd=None,
        cp_group=None,
        ulysses_rank=ulysses_rank,
        ring_rank=ring_rank,
        dp_rank=0,
    )


_MASK = hcp.AttnMask.shared_prefix(6, [3, 1, 4])
_IDS = torch.arange(14)[None].expand(2, -1) + 10
_POS = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 6, 6, 7, 8, 9]])
_TARGETS = torch.tensor([[11, 12, 13, 14, 15, -100, 17, 18, -100, -100, 21, 22, 23, -100]]).expand(2, -1)


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4), (4, 1)])
def test_masked_shard_batch_keeps_positions_and_targets(u, r):
    """Every rank's tokens, positions and targets are the mask layout's slots of the given rows; the positions are
    kept as given (completions continue from the prompt), the mask is carried; padding slots get pad ids,
    ignore_index targets."""
    batch = {"input_ids": _IDS, "position_ids": _POS, "shift_labels": _TARGETS}
    seen = torch.zeros(14, dtype=torch.long)
    for rank in range(u * r):
        cp = _described_mesh(u, r, rank)
        out = hcp.shard_batch(batch, cp, mask=_MASK, pad_token_id=-1)
        assert out[MASK_KEY] is _MASK and out["labels"] is out["shift_labels"]
        real = out["input_ids"][0] >= 0
        assert out["input_ids"].shape == (2, row_layout(cp, mask=_MASK).local_len)
        index = out["input_ids"][0, real] - 10  # the tokens' indices in the row
        seen[index] += 1
        assert torch.equal(out["position_ids"][0, real], _POS[0, index])
        assert torch.equal(out["labels"][:, real], _TARGETS[:, index])
        assert bool((out["labels"][:, ~real] == -100).all())
    assert bool((seen == 1).all())  # every token on exactly one rank


def test_masked_shard_batch_default_positions_are_token_indices():
    cp = _described_mesh(2, 2, 1)
    out = hcp.shard_batch({"input_ids": _IDS[:1]}, cp, mask=_MASK, pad_token_id=-1)
    real = out["input_ids"][0] >= 0
    assert torch.equal(out["position_ids"][0, real], out["input_ids"][0, real] - 10)
    assert "labels" not in out and "shift_labels" not in out  # no targets given: none made up


@pytest.mark.parametrize(
    "batch,kwargs,error,match",
    [
        ({"input_ids": _IDS, "labels": _IDS}, {}, ConfigError, r"last prompt token has no single next token"),
        ({"input_ids": _IDS}, {}, None, None),
        ({"input_ids": _IDS, "labels": _TARGETS}, {"shift": False}, None, None),
        (
            {"input_ids": _IDS, "shift_labels": _TARGETS, "attention_mask": torch.ones(2, 14, dtype=torch.long)},
            {},
            ConfigError,
            r"takes no batch\['attention_mask'\]",
        ),
        (
            {"input_ids": _IDS[:1], "shift_labels": _TARGETS[:1], "cu_seq_lens_q": [0, 6, 14]},
            {},
            ConfigError,
            r"replaces packed-document boundaries",
        ),
        ({"input_ids": _IDS[:, :13], "shift_labels": _TARGETS[:, :13]}, {}, ShapeError, r"mask describes a row of 14"),
        ({"input_ids": _IDS, "shift_labels": _TARGETS, "position_ids": _POS.float()}, {}, ConfigError, "integers"),
        (
            {"input_ids": _IDS, "shift_labels": _TARGETS},
            {"mask": [(0, 14, 0, 14, None, 0)]},
            InputTypeError,
            "must be an hcp.AttnMask",
        ),
    ],
    ids=[
        "labels-to-shift",
        "no-labels",
        "labels-already-targets",
        "attention-mask",
        "packed",
        "length",
        "float-positions",
        "mask-type",
    ],
)
def test_masked_shard_batch_refusals(batch, kwargs, error, match):
    kwargs = {"mask": _MASK, **kwargs}
    if error is None:
        hcp.shard_batch(batch, _described_mesh(2, 2), **kwargs)
        return
    with pytest.raises(error, match=match):
        hcp.shard_batch(batch, _described_mesh(2, 2), **kwargs)


def test_transformers_mask_interface_reads_only_what_the_call_carries():
    """transformers hands hybrid-cp the mask function it composed: causal, sliding windows, attention chunks and
    packed documents are rebuilt from the call's own arguments (None); anything else (image blocks, bidirectional
    rows, a user's or_mask_function) comes back as an UnreadMask naming its parts, which the attention function
    refuses unless the batch carries the row's hcp.AttnMask."""
    from transformers import masking_utils as mu

    from hybrid_cp.integrations.mask_interface import UnreadMask, transformers_mask

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    for read in (
        mu.causal_mask_function,
        mu.sliding_window_causal_mask_function(4),
        mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
        mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos),
    ):
        assert transformers_mask(mask_function=read, batch_size=1) is None, read
    blocks = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(torch.tensor([[-1, 0, 0, -1]])))
    for unread, part in (
        (blocks, "blockwise_overlay"),
        (mu.bidirectional_mask_function, "bidirectional_mask_function"),
        (mu.sliding_window_bidirectional_mask_function(3), "bidirectional"),
    ):
        got = transformers_mask(mask_function=unread)
        assert isinstance(got, UnreadMask) and part in got.describe(), (part, got)


def test_transformers_mask_interface_under_torch_compile():
    """While torch.compile traces, the mask function's closures are hidden: plain causal, transformers' own
    sliding/chunked builders (the causal skip still allowed) and, for a model whose modeling code never passes
    or/and masks, packing are read; an or-mask, or an and-mask with the skip cleared in a model that may pass
    extra parts (Gemma 3), is an UnreadMask. Each case traced fullgraph with the eager backend."""
    from transformers import GemmaConfig, LlamaConfig, LlamaForCausalLM
    from transformers import masking_utils as mu

    from hybrid_cp.integrations.mask_interface import _COMPOSES_EXTRA, UnreadMask, note_model, transformers_mask

    note_model(
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=16,
                hidden_size=8,
                intermediate_size=8,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
            )
        )
    )
    assert _COMPOSES_EXTRA[LlamaConfig] is False
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    llama, gemma = LlamaConfig(), GemmaConfig()

    def packed(p):
        return mu.and_masks(
            mu.remap_positions_for_packed_sequence(mu.causal_mask_function, p), mu.packed_sequence_mask_function(p)
        )

    def blocks(p):
        return mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(p - 1))

    cases = [
        (lambda p: mu.causal_mask_function, True, llama, None),
        (lambda p: mu.sliding_window_causal_mask_function(4), True, gemma, None),
        (packed, False, llama, None),
        (packed, False, gemma, "and_mask"),
        (blocks, False, llama, "or_mask"),
        (lambda p: mu.bidirectional_mask_function, False, llama, "bidirectional"),
    ]
    for build, skip, config, unread in cases:
        got = {}

        def traced(p, build=build, skip=skip, config=config, got=got):  # the function built while tracing
            got["mask"] = transformers_mask(mask_function=build(p), allow_is_causal_skip=skip, config=config)
            return p + 1

        torch.compile(traced, backend="eager", fullgraph=True)(pos)
        if unread is None:
            assert got["mask"] is None, (build, got)
        else:
            assert isinstance(got["mask"], UnreadMask) and unread in got["mask"].describe(), (build, got)
