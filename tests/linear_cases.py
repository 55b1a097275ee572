"""Worker-side cases for the linear recurrences and short convolutions under context parallelism (run on
every rank of the session pool, see conftest.py); they return errors and the tests assert on them.

The references are written here from the definitions, independent of the engine: the gated delta rule
token by token, the convolution as a padded conv1d, both over the full sequence (dense) or each
document on its own (packed), in fp64."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from dist_cases import mesh

import hybrid_cp as hcp
from hybrid_cp.engine.layout import shard_tokens
from hybrid_cp.engine.recurrence import GatedDelta, Mamba2, causal_conv, linear_scan
from hybrid_cp.testing.parity import shared
from topology.layouts import layout_of
from topology.linear_cost import linear_layer_bytes


def naive_gated_delta(
    q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **_
):
    """The gated delta rule token by token, in the inputs' dtype (fla's signature); g [B, n, Hv] (Gated DeltaNet's
    decay per head) or [B, n, Hv, dk] (Kimi Delta Attention's per channel: it scales the state's rows)."""
    hv, dk = v.shape[2], k.shape[-1]
    q, k = (x.repeat_interleave(hv // x.shape[2], dim=2) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * dk**-0.5
    b, n, _, dv = v.shape
    s = v.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.to(v.dtype)
    outs = []
    for t in range(n):
        s = s * (g[:, t].exp()[..., None] if g.dim() == 4 else g[:, t].exp()[..., None, None])
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], s)
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - pred) * beta[:, t, :, None])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, 1), (s if output_final_state else None)


def _kernel(name: str):
    if name == "naive":
        return naive_gated_delta
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def _per_document(fn, tensors, docs):
    """fn over each document on its own (packed) or the whole row (docs None), concatenated."""
    if docs is None:
        return fn(*tensors)
    outs, pos = [], 0
    for n in docs:
        if n:
            outs.append(fn(*(x[:, pos : pos + n] for x in tensors)))
        pos += n
    return torch.cat(outs, 1)


def _gdn_inputs(seed: int, b: int, n: int, per_channel: bool = False):
    """q, k, v, g, beta and the output's gradient; `per_channel`: Kimi Delta Attention's decay, g [B, n, Hv, dk]."""
    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = 2, 4, 8, 6
    q, k = (torch.randn(b, n, hk, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, n, hv, dv, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(b, n, hv, *([dk] if per_channel else []), generator=gen, dtype=torch.float64)) * 0.3
    beta = torch.rand(b, n, hv, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, n, hv, dv, generator=gen, dtype=torch.float64)
    return (q, k, v, g, beta), dout


def _conv_inputs(seed: int, b: int, n: int, c: int = 5, width: int = 4):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, n, c, generator=gen, dtype=torch.float64)
    w = torch.randn(c, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(c, generator=gen, dtype=torch.float64)
    return x, w, bias, torch.randn(b, n, c, generator=gen, dtype=torch.float64)


def _grads(fn, inputs, dout):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    (out * dout).sum().backward()
    return [out.detach()] + [x.grad for x in leaves]


def _errors(cp, lay, got, ref) -> list[float]:
    """max |cp - reference| over this rank's rows, relative to the reference's largest magnitude."""
    out = []
    for a, b in zip(got, ref):
        local = shard_tokens(b, cp, 1, lay)
        out.append(((a.double() - local).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return out


def _conv_ref(x, w, bias):
    return F.conv1d(x.transpose(1, 2), w.unsqueeze(1), bias, padding=w.shape[-1] - 1, groups=x.shape[-1])[
        ..., : x.shape[1]
    ].transpose(1, 2)


def scan_parity(u: int, r: int, cases: list[tuple[str, tuple[int, ...] | None, str]]) -> list[dict]:
    """`scan_case` for each (layout, documents or None, kernel) on one mesh (the layouts are computed, not
    the mesh's: one mesh serves both)."""
    cp = mesh(u, r)
    return [scan_case(cp, *case) for case in cases]


def scan_case(
    cp,
    layout: str,
    docs: tuple[int, ...] | None,
    kernel: str,
    exchange: str | None = None,
    n: int = 37,
    b: int = 2,
    per_channel: bool = False,
) -> dict:
    """Errors (forward, then the gradient of each input) of the gated delta rule and the causal conv
    against the fp64 references; kernel "naive" runs in fp64, "hf" (transformers' chunked torch
    function) in fp32; `exchange` forces the summaries' "gather" or "scan" (None: the cost model's choice);
    `per_channel`: Kimi Delta Attention's decay per key channel (naive kernel only), the rule's part named "kda"."""
    cu = None
    if docs is not None:
        b, n = 1, sum(docs)
        cu = [0]
        for d in docs:
            cu.append(cu[-1] + d)
    lay = layout_of(layout, cp.ulysses_size, cp.ring_size, seq_len=None if cu else n, cu_seqlens=cu)
    dtype = torch.float64 if kernel == "naive" else torch.float32

    def local(x):
        return shard_tokens(x.to(dtype), cp, 1, lay)

    inputs, dout = _gdn_inputs(17 + n, b, n, per_channel)
    kind = GatedDelta(_kernel(kernel))
    hcp.reset_comm_bytes(cp)

    def ref_gdn(*xs):
        return _per_document(lambda *t: naive_gated_delta(*t, use_qk_l2norm_in_kernel=True)[0], xs, docs)

    ref = _grads(ref_gdn, inputs, dout)
    forced = mock.patch("hybrid_cp.engine.recurrence.exchange_kind", lambda *a: exchange)
    with forced if exchange else contextlib.nullcontext():
        got = _grads(lambda *xs: linear_scan(cp, lay, kind, xs), [local(x) for x in inputs], local(dout))
    x, w, bias, dconv = _conv_inputs(n, b, n)
    conv_ref = _grads(
        lambda xx, ww, bb: _per_document(lambda t: _conv_ref(t, ww, bb), (xx,), docs), (x, w, bias), dconv
    )
    conv_got = _grads(
        lambda xx, ww, bb: causal_conv(cp, lay, xx, ww, bb), (local(x), w.to(dtype), bias.to(dtype)), local(dconv)
    )
    # weight and bias gradients are partial sums over this rank's rows: sum them over the cp group
    for t in conv_got[2:]:
        torch.distributed.all_reduce(t, group=cp.cp_group)
    sent = {k: v for k, v in hcp.comm_bytes(cp).items() if v}
    hv, dk, dv = inputs[2].shape[2], inputs[1].shape[-1], inputs[2].shape[-1]
    size = torch.finfo(dtype).bits // 8
    predicted = linear_layer_bytes(
        lay,
        cp.size,
        b,
        hv * dk * (dk + dv),
        w.shape[-1] - 1,
        x.shape[-1],
        size,
        size,
        transition_numel=hv * dk * dk,
        rank=cp.rank,
        exchange=exchange,
    )
    conv_err = _errors(cp, lay, conv_got[:2], conv_ref[:2])
    conv_err += [((a.double() - e).abs().max() / e.abs().max()).item() for a, e in zip(conv_got[2:], conv_ref[2:])]
    return {
        "kda" if per_channel else "gdn": dict(
            zip(("out", "dq", "dk", "dv", "dg", "dbeta"), _errors(cp, lay, got, ref))
        ),
        "conv": dict(zip(("out", "dx", "dw", "dbias"), conv_err)),
        "bytes": (sent, predicted),
    }


# ---- Mamba2 (SSD): conv -> silu -> scan, the mixer's token-mixing core ------------------------------------------

SSD_DIMS = dict(h=4, p=3, g=2, n=5, width=4)


def naive_ssd(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=None,
    D=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    **_,
):
    """The SSD recurrence token by token in the inputs' dtype (mamba_ssm's chunk-scan signature):
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t, state [B, H, P, N]."""
    b, n, h, p = x.shape
    dt = dt if dt_bias is None else dt + dt_bias
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit)
    B, C = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (B, C))
    s = x.new_zeros(b, h, p, B.shape[-1]) if initial_states is None else initial_states.to(x.dtype)
    outs = []
    for t in range(n):
        s = s * (dt[:, t] * A).exp()[..., None, None] + torch.einsum(
            "bhp,bhn->bhpn", x[:, t] * dt[:, t, :, None], B[:, t]
        )
        outs.append(torch.einsum("bhpn,bhn->bhp", s, C[:, t]) + (0 if D is None else D[:, None] * x[:, t]))
    out = torch.stack(outs, 1)
    return (out, s) if return_final_states else out


def _ssd_kernel(name: str):
    if name == "naive":
        return naive_ssd
    from transformers.models.bamba import modeling_bamba

    return getattr(modeling_bamba.mamba2_chunk_scan, "__wrapped__", modeling_bamba.mamba2_chunk_scan)


def _ssd_inputs(seed: int, b: int, n: int):
    d = SSD_DIMS
    conv_dim = d["h"] * d["p"] + 2 * d["g"] * d["n"]
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    seq = [rnd(b, n, conv_dim), rnd(b, n, d["h"])]
    params = [
        rnd(conv_dim, d["width"], scale=0.5),
        rnd(conv_dim),
        -torch.rand(d["h"], generator=gen, dtype=torch.float64) - 0.2,
        rnd(d["h"]),
        rnd(d["h"], scale=0.5),
    ]  # conv weight, conv bias, A < 0, D, dt_bias
    return seq, params, rnd(b, n, d["h"], d["p"])


def _mamba_core(conv, scan, xbc, dt, w, bias, A, D, dt_bias):
    """The Mamba2 mixer between its projections: silu(causal conv), split into x | B | C, SSD."""
    d = SSD_DIMS
    h = F.silu(conv(xbc, w, bias))
    x, B, C = h.split([d["h"] * d["p"], d["g"] * d["n"], d["g"] * d["n"]], dim=-1)
    shape = (x.shape[0], x.shape[1])
    return scan(
        x.reshape(*shape, d["h"], d["p"]),
        dt,
        B.reshape(*shape, d["g"], d["n"]),
        C.reshape(*shape, d["g"], d["n"]),
        A,
        D,
        dt_bias,
    )


def mamba_parity(u: int, r: int, cases: list[tuple[str, tuple[int, ...] | None, str]]) -> list[dict]:
    """`mamba_case` for each (layout, documents or None, kernel) on one mesh."""
    cp = mesh(u, r)
    return [mamba_case(cp, *case) for case in cases]


def mamba_case(cp, layout: str, docs: tuple[int, ...] | None, kernel: str, n: int = 37, b: int = 2) -> dict:
    """Errors (forward, the gradient of xBC, dt and of each parameter) of the Mamba2 core under CP
    against the fp64 token-by-token reference over the full sequence (each document on its own);
    kernel "naive" in fp64, "hf" (transformers' chunked torch SSD, chunks of 8) in fp32."""
    cu = None
    if docs is not None:
        b, n, cu = 1, sum(docs), [0]
        for doc in docs:
            cu.append(cu[-1] + doc)
    lay = layout_of(layout, cp.ulysses_size, cp.ring_size, seq_len=None if cu else n, cu_seqlens=cu)
    dtype = torch.float64 if kernel == "naive" else torch.float32
    seq, params, dout = _ssd_inputs(29 + n, b, n)
    fn = _ssd_kernel(kernel)

    def ref_scan(x, dt, B, C, A, D, dt_bias):
        return naive_ssd(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)

    def ref(xbc, dt, *ps):
        return _per_document(
            lambda a, c: _mamba_core(lambda t, w, bb: _conv_ref(t, w, bb), ref_scan, a, c, *ps), (xbc, dt), docs
        )

    def cp_scan(x, dt, B, C, A, D, dt_bias):
        return linear_scan(cp, lay, Mamba2(fn, A, 8, D, dt_bias), (x, dt, B, C))

    def got_fn(xbc, dt, *ps):
        return _mamba_core(lambda t, w, bb: causal_conv(cp, lay, t, w, bb), cp_scan, xbc, dt, *ps)

    hcp.reset_comm_bytes(cp)
    want = _grads(ref, seq + params, dout)
    local = [shard_tokens(x.to(dtype), cp, 1, lay) for x in seq]
    got = _grads(got_fn, local + [p.to(dtype) for p in params], shard_tokens(dout.to(dtype), cp, 1, lay))
    sent = {k: v for k, v in hcp.comm_bytes(cp).items() if v}
    for t in got[3:]:  # parameter gradients are partial sums over this rank's rows
        torch.distributed.all_reduce(t, group=cp.cp_group)
    errs = _errors(cp, lay, got[:3], want[:3])
    errs += [((a.double() - e).abs().max() / e.abs().max()).item() for a, e in zip(got[3:], want[3:])]
    d, size = SSD_DIMS, torch.finfo(dtype).bits // 8
    conv_dim = seq[0].shape[-1]
    predicted = linear_layer_bytes(
        lay,
        cp.size,
        b,
        d["h"] * (1 + d["p"] * d["n"]),
        d["width"] - 1,
        conv_dim,
        size,
        size,
        transition_numel=d["h"],
        rank=cp.rank,
    )
    names = ("out", "dxbc", "ddt", "dconv_w", "dconv_b", "dA", "dD", "ddt_bias")
    return {"mamba2": dict(zip(names, errs)), "bytes": (sent, predicted)}


# ---- hybrid models: one training step under CP equals one process -------------------------------------------------

QWEN3_NEXT = dict(
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    initializer_range=0.2,
)
# Mamba2 hybrids: several SSD chunks per run (chunks of 4 tokens), grouped B/C, attention layers
MAMBA2 = dict(mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=4, initializer_range=0.2)
HYBRIDS = {
    "qwen3_next": QWEN3_NEXT,
    "qwen3_5_text": QWEN3_NEXT,
    "bamba": dict(MAMBA2, mamba_n_heads=8, mamba_d_head=16, num_hidden_layers=2, attn_layer_indices=[1]),
    "falcon_h1": dict(MAMBA2, mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32, num_hidden_layers=2),
    "nemotron_h": dict(
        mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=4, initializer_range=0.2
    ),
}


def hybrid_parity(u: int, r: int, kind: str = "qwen3_next", fsdp: bool = False) -> dict:
    """train_cases.model_parity (right-padded dense rows, logits, loss, every gradient) for a hybrid family."""
    from train_cases import model_parity

    return model_parity(u, r, kind, hkv=2, fsdp=fsdp, generic=True, config=HYBRIDS[kind])


def hybrid_packed_parity(
    u: int, r: int, kind: str = "qwen3_next", doc_lens: tuple = (9, 1, 23, 4, 61, 2, 14), extra: dict | None = None
) -> dict:
    """One packed-row step under CP vs each document run on its own in one process: loss and every gradient
    (`extra` overrides the family's tiny configuration)."""
    from train_cases import packed_reference, packed_row, tiny_model

    from hybrid_cp.integrations.fsdp import average_gradients
    from hybrid_cp.integrations.transformers import apply_context_parallel
    from hybrid_cp.training.batch import shard_batch

    cp = mesh(u, r)
    batch = packed_row(4321, doc_lens)
    config = {**HYBRIDS[kind], **(extra or {})}
    [(ref_loss, ref_grads)] = shared(
        [lambda: packed_reference(tiny_model(kind, 2, generic=True, **config), batch, doc_lens)]
    )
    model = apply_context_parallel(tiny_model(kind, 2, generic=True, **config), cp)
    local = shard_batch(batch, cp)
    logits = model(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        cu_seq_lens_q=local["cu_seq_lens_q"],
        cu_seq_lens_k=local["cu_seq_lens_k"],
        max_length_q=local["max_length_q"],
        max_length_k=local["max_length_k"],
    ).logits
    loss = hcp.cross_entropy(logits, local["labels"], cp)
    loss.backward()
    average_gradients(model)
    return step_errors(model, loss, ref_loss, ref_grads)


def step_errors(model, loss, ref_loss, ref_grads) -> dict:
    """Relative errors of one step against the reference: the loss, the worst gradient (and its name), and every
    parameter's over 1e-4. A parameter without a gradient on both sides (Zamba2's adapters of the other uses of a
    shared block) is skipped; on one side only, its error is infinite."""
    errs = {
        n: float("inf")
        if p.grad is None or n not in ref_grads
        else ((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)).item()
        for n, p in model.named_parameters()
        if p.grad is not None or n in ref_grads
    }
    worst = max(errs, key=errs.get)
    return {
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad": errs[worst],
        "worst_param": worst,
        "bad": {n: e for n, e in errs.items() if e > 1e-4},
    }
