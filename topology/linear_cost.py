"""Linear-attention and state-space layers of hybrid models (docs/linear.md): the bytes a linear layer's
summary exchange sends, the FLOPs of its chunked recurrence, and the bytes its mixer keeps for backward.

The cost model (`topology.cost`) prices a linear layer's time from these; the memory model
(`topology.step_model`) its saved tensors.
"""

from __future__ import annotations

import bisect
from typing import Any

from .model_shape import ModelShape
from .summary_scan import exchange_kind, scan_bytes
from .units import FP32_BYTES

__all__ = [
    "exporting_runs",
    "linear_layer_bytes",
    "LINEAR_BWD_FACTOR",
    "linear_flops_per_token",
    "linear_tokens",
    "linear_kernel_bytes",
    "linear_mixer_token_bytes",
    "linear_mixer_saved",
    "linear_runs",
    "linear_summary_bytes",
]


def exporting_runs(lay: Any, size: int) -> int:
    """Gather slots of a linear layer's summary exchange: the most runs of one document on a rank that
    the document continues after (the engine's `recurrence.scan_plan(...).slots`, tested equal)."""
    starts, lens = lay.doc_starts, lay.doc_lens
    return max(
        sum(
            tok >= 0 and pos + n < lens[bisect.bisect_right(starts, tok) - 1] for tok, pos, n in lay.document_runs(rank)
        )
        for rank in range(size)
    )


def linear_layer_bytes(  # noqa: PLR0913 (public entry point)
    lay: Any,
    size: int,
    batch: int,
    state_numel: int,
    halo_rows: int = 0,
    channels: int = 0,
    act_bytes: int = 2,
    state_bytes: int = FP32_BYTES,
    *,
    transition_numel: int = 0,
    rank: int | None = None,
    exchange: str | None = None,
) -> dict[str, int]:
    """Bytes one rank sends per linear layer, forward and backward: the exchange of every exporting run's summary
    (`state_numel` numbers per batch row, of which `transition_numel` are M: Gated DeltaNet Hv*dk*(dk+dv) with
    Hv*dk*dk, Mamba2 H*(1+P*N) with H) in fp32, and the all-gather of its last `halo_rows` pre-convolution rows
    of `channels`. The summaries travel as `topology.summary_scan.exchange_kind` picks (`exchange` forces one):
    all-gathered, each direction (P - 1) x slots x the summary on every rank, or by the log-step scan, what
    `rank` sends (None: the busiest rank, per stage). Keys as `hcp.comm_bytes` reports them; stages that send
    nothing are left out."""
    if size == 1:
        return {}
    slots = exporting_runs(lay, size)
    if not slots:
        return {}
    m, e = transition_numel, state_numel - transition_numel
    if (exchange or exchange_kind(lay, size, slots, m, e)) == "scan":
        sent = [scan_bytes(lay, size, r, m, e) for r in (range(size) if rank is None else [rank])]
        fwd, bwd = (max(x[d] for x in sent) * batch * state_bytes for d in (0, 1))
    else:
        fwd = bwd = (size - 1) * slots * batch * state_numel * state_bytes
    out = {"linear_state_fwd": fwd, "linear_state_bwd": bwd}
    if halo_rows and channels:
        halo = (size - 1) * slots * batch * halo_rows * channels * act_bytes
        out.update(linear_halo_fwd=halo, linear_halo_bwd=halo)
    return {k: v for k, v in out.items() if v}


# FLOPs per token of the chunked recurrences (forward; backward is LINEAR_BWD_FACTOR x forward: each forward
# product has two in backward, the inputs' and the weights'/states' gradients). C is the kernel's chunk.
#   Gated DeltaNet, per value head (fla's chunked delta rule, WY form): the three state products (the
#   output q S, the delta term k S, the update k^T v) 3 x 2 dk dv, and the intra-chunk C x C products
#   (k k^T, q k^T against dk; A u and the masked attention times the values against dv) 4 C (dk + dv).
#   Mamba2 SSD, per head: the state update and the output against the state 2 x 2 N P, the masked
#   intra-chunk C B^T (2 C N, shared by the H/G heads of a group) and its product with x (2 C P).
# The probe of a continuing Gated DeltaNet run widens the values from dv to dv + dk (same formula with
# dv + dk); the correction of a continuing run is one state product per token (2 dk dv, or 2 N P).
LINEAR_BWD_FACTOR = 2.0


def linear_flops_per_token(model: ModelShape, probed: bool) -> float:
    """Forward FLOPs of one linear layer's recurrence for one token (all heads), the causal convolution
    included (2 K per channel); ``probed``: the token is on a run that continues its document."""
    h, g, dk, dv, c = (
        model.linear_heads,
        model.linear_key_heads,
        model.linear_key_dim,
        model.linear_value_dim,
        model.linear_chunk,
    )
    if model.linear_kind == "gated_delta":
        width = dv + dk if probed else dv
        head = 6 * dk * width + 4 * c * (dk + width) + (2 * dk * dv if probed else 0)
    else:  # mamba2: dk is the state size N, dv the head dim P, g the groups
        head = 4 * dk * dv + 2 * c * dv + 2 * c * dk * g / h + (2 * dk * dv if probed else 0)
    return h * head + 2 * model.linear_conv * model.linear_conv_channels


def linear_tokens(lay: Any, size: int) -> list[tuple[int, int]]:
    """(plain, probed) real tokens of each cp rank: probed ones sit on runs that continue their document
    (`recurrence.scan_plan`'s `continues`). One rank is no context parallelism: the plain kernel throughout."""
    if size == 1:
        return [(lay.seq_len, 0)]
    out = []
    for rank in range(size):
        runs = [(pos, n) for tok, pos, n in lay.document_runs(rank) if tok >= 0]
        out.append((sum(n for pos, n in runs if pos == 0), sum(n for pos, n in runs if pos > 0)))
    return out


def linear_kernel_bytes(model: ModelShape, probed: bool, e: int) -> tuple[int, int, int]:
    """(saved, forward and backward working set) bytes per head and token of a run of the chunked kernel."""
    C, g, h, fp32 = model.linear_chunk, model.linear_key_heads, model.linear_heads, e >= FP32_BYTES
    if model.linear_kind == "gated_delta":
        dk, dv = model.linear_key_dim, model.linear_value_dim
        w = dv + dk if probed else dv
        extra = 16 * dk + (0 if g < h else 4 * dv + 4) if fp32 else 0
        return 32 * dk + 12 * w + 20 * C + 4 * dk * w // C + 24 + extra, 8 * dk + 16 * w, 16 * dk + 16 * w + 8 * C
    P, N = model.linear_value_dim, model.linear_key_dim
    saved = (
        20 * P + 20 * N + 12 * C + 8 * P * N // C + 30 + (8 * g * N // h if fp32 else 0) + (4 * N + 12 if probed else 0)
    )
    return saved, 20 * P + 8 * N + 4 * P * N // C + 32, 12 * P + 8 * P * N // C


def linear_mixer_token_bytes(model: ModelShape, e: int) -> tuple[int, int]:
    """Bytes per token a linear mixer saves outside the kernel, and per probed token on top.

    Both kinds: the convolution's input (with the halo) and the silu's input, its output (conv channels each).
    Gated DeltaNet: the gates (softplus in and out in fp32, sigmoid out), the gated RMSNorm (its fp32 input,
    normalised value, weighted value, fp32 gate and silu(gate); the output projection's input); a probed run's
    correction keeps the probe's output (fp32) or, cast, its fp32 aux (dk). Mamba2: the gate (fp32; in fp32 the
    whole in_proj output, of which it is a view), the gated norm (y, silu(gate), their product, the normalised
    value, all fp32; the output projection's input) and dt; a probed run keeps its decayed C (N, fp32)."""
    c, h = model.linear_conv_channels, model.linear_heads
    inner = h * model.linear_value_dim
    if model.linear_kind == "gated_delta":
        dk, w = model.linear_key_dim, model.linear_value_dim + model.linear_key_dim
        return 2 * c * e + h * (8 + e) + inner * (12 + 3 * e), h * (4 * w if e >= FP32_BYTES else 4 * dk)
    gate = inner * FP32_BYTES + ((c + h) * FP32_BYTES if e >= FP32_BYTES else 0)
    return 2 * c * e + gate + inner * (16 + e) + h * (8 + e), h * (4 * model.linear_key_dim + 4)


def linear_mixer_saved(model: ModelShape, runs: list[tuple[int, bool]], e: int) -> int:
    """Bytes one linear mixer keeps for backward over one batch row of `runs` ((tokens, probed) each, as
    `topology.linear_cost.linear_runs` gives them) in a compute dtype of `e` bytes, the gathered summaries apart: the
    per-token terms (`linear_mixer_token_bytes`), the kernel's per run and the convolution's halo rows."""
    token, probed_extra = linear_mixer_token_bytes(model, e)
    h, c = model.linear_heads, model.linear_conv_channels
    return (
        sum(n * (token + h * linear_kernel_bytes(model, p, e)[0] + (probed_extra if p else 0)) for n, p in runs)
        + len(runs) * (model.linear_conv - 1) * c * e
    )


def linear_runs(lay: Any, size: int, rank: int) -> list[tuple[int, bool]]:
    """(tokens, probed) of each run of `rank`'s local rows, as `recurrence.linear_scan` runs them
    (`Layout.document_runs`: adjacent pieces of one document are one run, so on one rank a zigzag row is one
    unprobed run): probed runs continue their document (the probe's wider values), padding runs go
    through the plain kernel."""
    return [(n, tok >= 0 and pos > 0) for tok, pos, n in lay.document_runs(rank)]


def linear_summary_bytes(lay: Any, size: int, batch: int, model: ModelShape, state_bytes: int = FP32_BYTES) -> int:
    """Bytes of the gathered summaries one rank holds per linear layer: P x slots x B x numel."""
    return size * exporting_runs(lay, size) * batch * model.linear_state_numel * state_bytes if size > 1 else 0
