"""Worker-side cases for the layer kinds beyond Gated DeltaNet and Mamba2 (run on every rank of the session
pool, see conftest.py): LFM2's gated short convolution, Jamba's Mamba-1 selective scan, MiniMax's lightning
attention. They return errors; tests/test_recurrence_kinds.py and tests/test_hybrid_more.py assert on them.

The operator references are written here from the definitions, token by token in fp64 over the full
sequence (each document on its own for packed rows), independent of the engine and of transformers."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from dist_cases import mesh
from linear_cases import _conv_ref, _errors, _grads, _per_document, step_errors

import hybrid_cp as hcp
from hybrid_cp.engine.layout import shard_tokens
from hybrid_cp.engine.recurrence import Lightning, Mamba, causal_conv, linear_scan
from hybrid_cp.testing.parity import replica_part, shared
from topology.layouts import layout_of
from topology.linear_cost import linear_layer_bytes

# sizes of the operator cases: channels, conv kernel, Mamba state, lightning heads and head dims
DIMS = dict(c=6, width=4, n_state=5, heads=3, dk=4, dv=5)


def naive_selective_scan(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False, **_
):
    """Mamba-1's selective scan token by token in the inputs' dtype (mamba_ssm's `selective_scan_fn`
    layout: u, delta [B, D, n], A [D, N], B, C [B, N, n]); S_t = exp(dt_t A) S_{t-1} + dt_t u_t B_t."""
    dt = delta if delta_bias is None else delta + delta_bias[:, None]
    dt = F.softplus(dt) if delta_softplus else dt
    s = u.new_zeros(u.shape[0], u.shape[1], A.shape[-1])
    outs = []
    for t in range(u.shape[-1]):
        s = (dt[:, :, t, None] * A).exp() * s + (dt[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        outs.append((s * C[:, None, :, t]).sum(-1))
    out = torch.stack(outs, -1) + (0 if D is None else D[:, None] * u)
    out = out if z is None else out * F.silu(z)
    return (out, s) if return_last_state else out


def naive_lightning(q, k, v, slope, block=None):
    """Decayed linear attention token by token: S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t."""
    b, n, h, dk = q.shape
    s = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(n):
        s = (-slope).exp()[:, None, None] * s + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, 1), s


def _hf_selective_scan():
    from transformers.models.jamba import modeling_jamba

    return getattr(modeling_jamba.mamba_selective_scan, "__wrapped__", modeling_jamba.mamba_selective_scan)


def _inputs(seed: int, b: int, n: int) -> dict:
    d, gen = DIMS, torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    return {
        "conv": (
            [rnd(b, n, d["c"]) for _ in range(3)],
            [rnd(d["c"], d["width"], scale=0.5), rnd(d["c"])],
            rnd(b, n, d["c"]),
        ),
        "mamba": (
            [rnd(b, n, d["c"]), rnd(b, n, d["c"]), rnd(b, n, d["n_state"]), rnd(b, n, d["n_state"])],
            [
                rnd(d["c"], d["width"], scale=0.5),
                rnd(d["c"]),
                -torch.rand(d["c"], d["n_state"], generator=gen, dtype=torch.float64) - 0.2,
                rnd(d["c"]),
                rnd(d["c"], scale=0.5),
            ],
            rnd(b, n, d["c"]),
        ),
        "lightning": (
            [
                rnd(b, n, d["heads"], d["dk"], scale=0.5),
                rnd(b, n, d["heads"], d["dk"], scale=0.5),
                rnd(b, n, d["heads"], d["dv"]),
            ],
            [],
            rnd(b, n, d["heads"], d["dv"]),
        ),
    }


SLOPE = torch.tensor([0.5, 0.1, 0.02], dtype=torch.float64)  # per head: fast, medium, slow decay


def _short_conv(conv, bgate, cgate, x, w, bias):
    """LFM2's short convolution between its projections: C * conv(B * x)."""
    return cgate * conv(bgate * x, w, bias)


def _mamba(conv, scan, x, dt, bmat, cmat, w, bias, A, D, dt_bias):
    """Jamba's mixer between its projections: silu(causal conv(x)), the selective scan with dt, B, C."""
    return scan(F.silu(conv(x, w, bias)), dt, bmat, cmat, A, D, dt_bias)


def _ops(cp, lay, dtype: torch.dtype, block: int):
    """(reference, context-parallel) functions of each kind: name -> (inputs, params) -> output."""
    hf = dtype != torch.float64

    def ref_conv(t, w, bias):
        return _conv_ref(t, w, bias)

    def cp_conv(t, w, bias):
        return causal_conv(cp, lay, t, w, bias)

    def ref_scan(x, dt, bmat, cmat, A, D, dt_bias):
        out = naive_selective_scan(
            *(t.transpose(1, 2) for t in (x, dt)),
            A,
            bmat.transpose(1, 2),
            cmat.transpose(1, 2),
            D=D,
            delta_bias=dt_bias,
            delta_softplus=True,
        )
        return out.transpose(1, 2)

    def cp_scan(x, dt, bmat, cmat, A, D, dt_bias):
        kind = Mamba(_hf_selective_scan() if hf else naive_selective_scan, A, D, dt_bias)
        return linear_scan(cp, lay, kind, (x, dt, bmat, cmat))

    kind = Lightning(SLOPE.to(dtype), block)
    return {
        "conv": (lambda *a: _short_conv(ref_conv, *a), lambda *a: _short_conv(cp_conv, *a)),
        "mamba": (lambda *a: _mamba(ref_conv, ref_scan, *a), lambda *a: _mamba(cp_conv, cp_scan, *a)),
        "lightning": (
            lambda q, k, v: naive_lightning(q, k, v, SLOPE)[0],
            lambda q, k, v: linear_scan(cp, lay, kind, (q, k, v)),
        ),
    }


def kinds_parity(u: int, r: int, cases: list[tuple[str, tuple[int, ...] | None, str]]) -> list[dict]:
    """`kinds_case` for each (layout, documents or None, precision) on one mesh."""
    cp = mesh(u, r)
    return [kinds_case(cp, *case) for case in cases]


def _layout(cp, layout: str, docs, b: int, n: int):
    cu = None
    if docs is not None:
        b, n, cu = 1, sum(docs), [0]
        for doc in docs:
            cu.append(cu[-1] + doc)
    return layout_of(layout, cp.ulysses_size, cp.ring_size, seq_len=None if cu else n, cu_seqlens=cu), b, n


def kinds_case(
    cp,
    layout: str,
    docs: tuple[int, ...] | None,
    precision: str,
    n: int = 37,
    b: int = 2,
    kinds: tuple[str, ...] = ("conv", "mamba", "lightning"),
) -> dict:
    """Per kind (of `kinds`): errors of the forward and of the gradient of every input and parameter against the fp64
    token-by-token reference, and (bytes sent, bytes the cost model predicts). The lightning kind runs its
    block-wise kernel (blocks of 4 tokens); the selective scan runs the reference's token loop in "fp64",
    transformers' torch `mamba_selective_scan` in "fp32"."""
    lay, b, n = _layout(cp, layout, docs, b, n)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    d, size = DIMS, torch.finfo(dtype).bits // 8
    state = {"conv": 0, "mamba": 2 * d["c"] * d["n_state"], "lightning": d["heads"] * (1 + d["dk"] * d["dv"])}
    out = {}
    for name, (ref_fn, cp_fn) in _ops(cp, lay, dtype, 4).items():
        if name not in kinds:
            continue
        seq, params, dout = _inputs(41 + n, b, n)[name]
        want = _grads(
            lambda *a: _per_document(lambda *t: ref_fn(*t, *a[len(seq) :]), a[: len(seq)], docs), seq + params, dout
        )
        hcp.reset_comm_bytes(cp)
        local = [shard_tokens(x.to(dtype), cp, 1, lay) for x in seq]
        got = _grads(cp_fn, local + [p.to(dtype) for p in params], shard_tokens(dout.to(dtype), cp, 1, lay))
        sent = {k: v for k, v in hcp.comm_bytes(cp).items() if v}
        for t in got[1 + len(seq) :]:  # parameter gradients are partial sums over this rank's rows
            torch.distributed.all_reduce(t, group=cp.cp_group)
        errs = _errors(cp, lay, got[: 1 + len(seq)], want[: 1 + len(seq)])
        errs += [
            ((a.double() - e).abs().max() / e.abs().max()).item()
            for a, e in zip(got[1 + len(seq) :], want[1 + len(seq) :])
        ]
        halo = (d["width"] - 1, d["c"]) if name != "lightning" else (0, 0)
        predicted = linear_layer_bytes(
            lay,
            cp.size,
            b,
            state[name],
            *halo,
            size,
            size,
            rank=cp.rank,
            transition_numel={"conv": 0, "mamba": state["mamba"] // 2, "lightning": d["heads"]}[name],
        )
        out[name] = {"errors": errs, "bytes": (sent, predicted)}
    return out


# ---- models: one training step under CP equals one process --------------------------------------------------------

# tiny configurations: every layer kind once, runs of the tests' rows span several lightning blocks; layer 0 of
# MiniMax is the lightning one (its decay rate shrinks to ~0 at the last layer)
MORE = {
    "lfm2": dict(layer_types=["conv", "full_attention"], conv_bias=True),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1, conv_bias=True),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        mamba_d_state=8,
        mamba_dt_rank=4,
        initializer_range=0.2,
    ),
    "minimax": dict(layer_types=["linear_attention", "full_attention"], block_size=4, initializer_range=0.2),
    # #32: mixers identical to routed ones (Qwen3.5's Gated DeltaNet, Bamba's Mamba2, LFM2's short convolution)
    "qwen3_5_moe_text": dict(
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        initializer_range=0.2,
    ),
    "lara_mini": dict(
        num_hidden_layers=2,
        layer_types=["linear_attention", "sliding_attention"],
        sliding_window=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        initializer_range=0.2,
    ),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=4,
        initializer_range=0.2,
    ),
    "lfm3": dict(layer_types=["conv", "full_attention"], conv_bias=True),
    # KDA (per-channel decay) next to MLA, a dense then an MoE MLP; Ling's safe gate (lower bound) is its default
    "kimi_linear": dict(
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        linear_num_heads=4,
        linear_head_dim=8,
        num_key_value_heads=4,
        initializer_range=0.2,
    ),
    "bailing_hybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        num_key_value_heads=4,
        initializer_range=0.2,
    ),
    "olmo_hybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        initializer_range=0.2,
    ),
    # two hybrid layers share one attention block (tied weights), each with its own LoRA adapters; rotary on;
    # heads x head dim = the attention width 2 x hidden, as the adapters' outputs (Zamba2's own sizes)
    "zamba2": dict(
        num_hidden_layers=4,
        head_dim=32,
        num_key_value_heads=4,
        layers_block_type=["linear_attention", "hybrid"] * 2,
        num_mem_blocks=1,
        use_shared_attention_adapter=True,
        adapter_rank=8,
        use_mem_rope=True,
        n_mamba_heads=8,
        mamba_d_state=8,
        mamba_ngroups=2,
        chunk_size=4,
        initializer_range=0.2,
    ),
    "mamba2": dict(
        num_hidden_layers=2, num_heads=8, head_dim=16, state_size=8, n_groups=2, chunk_size=4, initializer_range=0.2
    ),
    "mamba": dict(state_size=8, time_step_rank=4, initializer_range=0.2),
    "falcon_mamba": dict(state_size=8, time_step_rank=4, initializer_range=0.2),
}


def more_parity(
    u: int, r: int, kinds: list[str], fsdp: bool = False, routed: bool = True, checkpoint: bool = False
) -> dict:
    """train_cases.model_parity (right-padded dense rows: logits, loss, every gradient) per family; `routed`
    False: the control, the mixers left to run over this rank's shard as if it were the whole sequence;
    `checkpoint`: under activation checkpointing."""
    from train_cases import model_parity

    cp = mesh(u, r)
    # FSDP2 shards over every rank: those runs are on every replica, the others on one each (replica_share)
    mine = kinds if fsdp else replica_part(cp, kinds)
    group = None if fsdp else cp.cp_group
    off = mock.patch("hybrid_cp.integrations.transformers.route_linear_layers", lambda model, cp: 0)
    with contextlib.nullcontext() if routed else off:
        return {
            kind: model_parity(
                u, r, kind, hkv=2, fsdp=fsdp, generic=True, config=MORE[kind], checkpoint=checkpoint, group=group
            )
            for kind in mine
        }


def more_packed_parity(u: int, r: int, kinds: list[str], doc_lens: tuple = (9, 1, 23, 4, 61, 2, 14)) -> dict:
    """One packed-row step under CP vs each document run on its own in one process: loss and every gradient."""
    from train_cases import packed_reference, packed_row, tiny_model

    from hybrid_cp.integrations.fsdp import average_gradients
    from hybrid_cp.integrations.transformers import apply_context_parallel
    from hybrid_cp.training.batch import shard_batch

    cp, batch, out = mesh(u, r), packed_row(4321, doc_lens), {}
    local = shard_batch(batch, cp)
    for kind in replica_part(cp, kinds):  # one replica each
        [(ref_loss, ref_grads)] = shared(
            [lambda: packed_reference(tiny_model(kind, 2, generic=True, **MORE[kind]), batch, doc_lens)], cp.cp_group
        )
        model = apply_context_parallel(tiny_model(kind, 2, generic=True, **MORE[kind]), cp)
        logits = model(
            **{
                k: local[k]
                for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
            }
        ).logits
        loss = hcp.cross_entropy(logits, local["labels"], cp)
        loss.backward()
        average_gradients(model, cp.cp_group)
        out[kind] = step_errors(model, loss, ref_loss, ref_grads)
    return out
