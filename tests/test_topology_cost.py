"""Cost formulas: exact bytes (against an independent set-based count), time and memory model."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import relative_difference, within

from topology import Cluster, ModelShape, comm_bytes, estimate, head_split
from topology.layouts import make_layout
from topology.units import dtype_bytes

MiB = 1 << 20


# Model predictions compared with `within(relative_difference(...))`: the same closed form evaluated two ways,
# so fp64 round-off only (rel 1e-12, 1e-9, or pytest.approx's 1e-6): worst 5.1e-16 (at 1e-12), 2.2e-16 (at 1e-9)


def reference_bytes(H, Hkv, D, N, B, u, r, e, layout="zigzag"):
    """Independent count: build each rank's query-head set, derive the KV heads it needs as a set."""
    g = (2 if layout == "zigzag" else 1) * u * r
    S = math.ceil(N / g) * g // (u * r)
    heads = list(range(H))
    q_sets, pos = [], 0
    for i in range(u):
        n = len(heads[i::u])  # same counts as an even split with the remainder first
        q_sets.append(set(range(pos, pos + n)))
        pos += n
    kv_sets = [{h // (H // Hkv) for h in q} for q in q_sets]
    res = []
    for i in range(u):
        others = [p for p in range(u) if p != i]
        fwd = sum(B * S * D * e * (len(q_sets[p]) + 2 * len(kv_sets[p])) for p in others)
        fwd += B * S * D * e * len(q_sets[i]) * (u - 1)
        bwd = sum(B * S * D * e * len(q_sets[p]) for p in others)
        bwd += B * S * D * e * (len(q_sets[i]) + 2 * len(kv_sets[i])) * (u - 1)
        blk = B * u * S * 2 * len(kv_sets[i]) * D
        rf = (r - 1) * blk * e
        rb = rf + r * blk * 4 if r > 1 else 0
        res.append({"ulysses_fwd": fwd, "ulysses_bwd": bwd, "ring_fwd": rf, "ring_bwd": rb})
    return res


def test_llama3_8b_1m_on_32_gpus_by_hand():
    b = comm_bytes(32, 8, 128, 1 << 20, 1, 8, 4, 2)
    # S = 32768 tokens, unit = S*D*e = 8 MiB; c=4 query heads, k=1 KV head per rank
    assert b == {"ulysses_fwd": 560 * MiB, "ulysses_bwd": 560 * MiB, "ring_fwd": 384 * MiB, "ring_bwd": 1408 * MiB}


@settings(max_examples=150, deadline=None)
@given(
    kv=st.sampled_from([1, 2, 3, 4, 8]),
    grp=st.integers(1, 6),
    u=st.integers(1, 12),
    r=st.integers(1, 4),
    n=st.integers(1, 5000),
    b=st.integers(1, 3),
    layout=st.sampled_from(["zigzag", "contiguous"]),
)
def test_comm_bytes_match_independent_count(kv, grp, u, r, n, b, layout):
    H = kv * grp
    if u > H:
        return
    ref = reference_bytes(H, kv, 64, n, b, u, r, 2, layout)
    # a row so short that other ring ranks' queries read none of a block's rows sends only what is read
    # (the halo, tests/test_sparse_ring.py): then the streamed ring's count is an upper bound
    halo = make_layout(layout, u, r, seq_len=n).halo(True, None)
    for i in range(u):
        got = comm_bytes(H, kv, 64, n, b, u, r, 2, layout, ulysses_rank=i)
        if halo:
            assert all(got[k] <= ref[i][k] for k in ("ring_fwd", "ring_bwd")), (got, ref[i])
            got = {**got, "ring_fwd": ref[i]["ring_fwd"], "ring_bwd": ref[i]["ring_bwd"]}
        assert got == ref[i]
    worst = comm_bytes(H, kv, 64, n, b, u, r, 2, layout)
    for key in ("ulysses_fwd", "ulysses_bwd") if halo else worst:
        assert worst[key] == max(x[key] for x in ref)


def test_uneven_heads_and_gqa_replication():
    # H=10, Hkv=2 (groups of 5), u=4 -> counts 3,3,2,2; rank 1 holds heads 3-5 and needs both KV heads
    assert head_split(10, 2, 4) == [(3, 0, 0, 1), (3, 3, 0, 2), (2, 6, 1, 1), (2, 8, 1, 1)]
    # MQA: every rank receives the single KV head, never H copies
    assert all(k == 1 for *_, k in head_split(32, 1, 8))


def test_padding_and_degenerate_degrees():
    # 1001 tokens: zigzag granularity 8 -> 1008 (S=252); contiguous granularity 4 -> 1004 (S=251)
    z = comm_bytes(4, 4, 1, 1001, 1, 2, 2, 1, "zigzag", ulysses_rank=0)
    c = comm_bytes(4, 4, 1, 1001, 1, 2, 2, 1, "contiguous", ulysses_rank=0)
    assert z["ulysses_fwd"] == 252 * (2 + 4 + 2) and c["ulysses_fwd"] == 251 * (2 + 4 + 2)
    assert comm_bytes(8, 8, 64, 4096, 1, 4, 1, 2)["ring_bwd"] == 0
    assert comm_bytes(8, 8, 64, 4096, 1, 1, 4, 2)["ulysses_fwd"] == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(heads=6, kv_heads=4), "multiple of kv_heads"),
        (dict(ulysses=16), "exceeds heads"),
        (dict(ulysses_rank=4), "ulysses_rank"),
        (dict(layout="stripe"), "layout"),
        (dict(seq_len=0), "seq_len"),
    ],
)
def test_comm_bytes_errors(kw, match):
    args = dict(heads=8, kv_heads=8, head_dim=64, seq_len=1024, batch=1, ulysses=4, ring=2, dtype_bytes=2)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        comm_bytes(**args)


def test_dtype_bytes():
    import torch

    assert dtype_bytes("bf16") == 2 and dtype_bytes(torch.float32) == 4 and dtype_bytes(2) == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("int3")


def fast_cluster(nodes=1, bw=1e3, **acc):
    c = Cluster.preset("dgx-h100", nodes=nodes)
    link = {"kind": "nvlink", "bandwidth_gb_s": bw, "latency_us": 0.0}
    return c.model_copy(
        update={
            "intra_node": c.intra_node.model_copy(update=link),
            "inter_node": c.inter_node.model_copy(update={"bandwidth_gb_s": bw, "latency_us": 0.0}),
            "accelerator": c.accelerator.model_copy(update=acc),
        }
    )


MODEL = ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32)


def test_estimate_uses_comm_bytes_and_sums_components():
    c = Cluster.preset("dgx-h100", nodes=4)
    e = estimate(c, MODEL, 1 << 20, 8, 4)
    assert e.bytes_per_rank == comm_bytes(32, 8, 128, 1 << 20, 1, 8, 4, 2)
    assert e.total_bytes == sum(e.bytes_per_rank.values())
    within(
        relative_difference(
            e.time_s, e.attention_s + e.ring_overhead_s + e.rest_s + e.a2a_s + e.ring_exposed_s, floor=1e-6
        ),
        1e-6,
        "e.time_s",
    )
    assert e.a2a_link == "intra-node" and e.ring_link == "inter-node"


def test_attention_flops_causal_half_and_backward_factor():
    c = fast_cluster(ring_step_overhead_us=0.0)
    N, P = 65536, 8
    e = estimate(c, MODEL, N, 8, 1)
    rate = c.accelerator.peak_tflops * 1e12 * c.accelerator.attention_efficiency
    fwd = 0.5 * 4 * N * N * 128 * 32 / P / rate
    within(relative_difference(e.attention_s, 3.5 * fwd, floor=1e-6), 1e-6, "e.attention_s")
    full = estimate(c, MODEL, N, 8, 1, causal=False)
    within(relative_difference(full.attention_s, 2 * e.attention_s, floor=1e-6), 1e-6, "full.attention_s")
    fwd_only = estimate(c, MODEL, N, 8, 1, backward=False)
    within(relative_difference(fwd_only.attention_s, fwd, floor=1e-6), 1e-6, "fwd_only.attention_s")
    assert fwd_only.bytes_per_rank["ulysses_bwd"] == 0
    within(relative_difference(fwd_only.rest_s, e.rest_s / 3, floor=1e-6), 1e-6, "fwd_only.rest_s")


def test_contiguous_causal_ring_is_imbalanced():
    c = fast_cluster()
    z = estimate(c, MODEL, 65536, 2, 4)
    k = estimate(c, MODEL, 65536, 2, 4, layout="contiguous")
    within(relative_difference(k.attention_s, z.attention_s * (2 - 1 / 4), floor=1e-6), 1e-6, "k.attention_s")
    assert any("contiguous" in n for n in k.notes)


def test_ring_overlap_hides_transfers_on_fast_links_only():
    fast = estimate(fast_cluster(nodes=4, bw=1000.0), MODEL, 1 << 18, 8, 4)
    slow_c = fast_cluster(nodes=4, bw=0.5)
    slow = estimate(slow_c, MODEL, 1 << 18, 8, 4)
    kv = 1 * 8 * (1 << 18) // 32 * 2 * 1 * 128  # elements of one K/V block (u*S tokens, 1 KV head)
    # fast: only the final fp32 dK/dV hop home is exposed
    within(relative_difference(fast.ring_exposed_s, kv * 4 / 1000e9, floor=1e-6), 1e-6, "fast.ring_exposed_s")
    # slow: each of the r-1 steps exposes comm - compute, forward and backward
    step_f, step_b = slow.attention_s / 3.5 / 4, slow.attention_s * 2.5 / 3.5 / 4
    want = 3 * (max(0, kv * 2 / 0.5e9 - step_f) + max(0, kv * 6 / 0.5e9 - step_b)) + kv * 4 / 0.5e9
    within(relative_difference(slow.ring_exposed_s, want, floor=1e-6), 1e-6, "slow.ring_exposed_s")
    assert slow.ring_comm_s > slow.ring_exposed_s > fast.ring_exposed_s


def test_all_to_all_over_nic_is_slower_than_nvlink():
    c = Cluster.preset("dgx-h100", nodes=2)
    inside = estimate(c, MODEL, 1 << 17, 8, 1, dp=2)
    across = estimate(c, MODEL, 1 << 17, 16, 1, dp=1)
    assert across.a2a_link == "inter-node" and inside.a2a_link == "intra-node"
    # u=16 sends about the same bytes per rank as u=8 but 8/15 of them at 50 instead of 450 GB/s
    assert across.a2a_s > 3 * inside.a2a_s


def test_estimate_errors():
    c = Cluster.preset("dgx-h100", nodes=4)
    with pytest.raises(ValueError, match="cluster 'dgx-h100' has 32 GPUs"):
        estimate(c, MODEL, 1 << 20, 8, 4, dp=2)
    with pytest.raises(ValueError, match="exceeds heads"):
        estimate(c, ModelShape(heads=4, head_dim=64), 1 << 20, 8, 1)


def test_model_shape_validation_and_presets():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelShape(heads=32, kv_heads=6, head_dim=128)
    llama = ModelShape.preset("llama3-8b")
    assert 7.9e9 < llama.params < 8.1e9  # Llama-3-8B has 8.03B parameters
    assert ModelShape(heads=8, head_dim=64).d_model == 512
    with pytest.raises(ValueError, match="llama3-8b"):
        ModelShape.preset("gpt-5")


# ---- hybrid models: linear-attention / state-space layers (docs/linear.md, docs/planner.md) ------------------------

GDN = dict(linear_kind="gated_delta", linear_heads=4, linear_key_heads=2, linear_key_dim=16, linear_value_dim=32)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(layers=4, linear_layers=5, **GDN), "linear_layers=5 exceeds layers=4"),
        (dict(layers=4, linear_layers=3), "needs linear_kind"),
        (dict(layers=4, linear_layers=3, linear_kind="mamba2", linear_heads=8), "needs linear_key_heads"),
        (dict(layers=4, linear_layers=3, **{**GDN, "linear_key_heads": 3}), "multiple of linear_key_heads=3"),
        (dict(layers=4, **GDN), "linear_layers=0"),
    ],
)
def test_linear_layers_are_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelShape(heads=4, head_dim=16, **bad)


def test_qwen3_next_preset_matches_the_worked_count():
    """docs/linear.md's table: 32 x 128 x 256 state numbers per slot, conv over 8192 channels, 36 of 48 linear."""
    m = ModelShape.preset("qwen3-next-80b")
    assert (m.linear_state_numel, m.linear_conv_channels, m.attention_layers) == (32 * 128 * 256, 8192, 12)
    mamba = ModelShape(
        heads=32,
        head_dim=128,
        layers=4,
        linear_layers=3,
        linear_kind="mamba2",
        linear_heads=128,
        linear_key_heads=1,
        linear_key_dim=256,
        linear_value_dim=64,
    )
    assert (mamba.linear_state_numel, mamba.linear_conv_channels) == (2_097_280, 8704)  # BambaConfig() sizes


@pytest.mark.parametrize("layout, u, r", [("zigzag", 2, 2), ("contiguous", 1, 4), ("zigzag", 4, 1)])
def test_linear_layer_bytes_and_the_hybrid_average(layout, u, r):
    """An all-linear model's estimate sends exactly linear_layer_bytes (what hcp.comm_bytes is tested equal
    to); a 3:1 hybrid is the layer-weighted average of its softmax and linear layers, time and bytes."""
    from topology.layouts import make_layout
    from topology.linear_cost import linear_layer_bytes

    c = Cluster.preset("dgx-h100")
    base = dict(heads=8, kv_heads=2, head_dim=64, hidden=512, intermediate=1024, **GDN)
    lin = estimate(c, ModelShape(layers=4, linear_layers=4, **base), 4096, u, r, layout=layout)
    attn = estimate(
        c,
        ModelShape(layers=4, **{k: v for k, v in base.items() if not k.startswith("linear")}),
        4096,
        u,
        r,
        layout=layout,
    )
    lay = make_layout(layout, u, r, seq_len=4096)
    assert lin.bytes_per_rank == linear_layer_bytes(
        lay, u * r, 1, 4 * 16 * 48, 3, 2 * 2 * 16 + 4 * 32, 2, 4, transition_numel=4 * 16 * 16
    )
    # the summaries travel by the log-step scan here, under the all-gather's (P - 1) x slots x (M + E)
    gather = linear_layer_bytes(lay, u * r, 1, 4 * 16 * 48, 3, 2 * 2 * 16 + 4 * 32, 2, 4, exchange="gather")
    assert gather["linear_state_fwd"] == (u * r - 1) * (2 if layout == "zigzag" else 1) * 4 * 16 * 48 * 4
    assert lin.bytes_per_rank["linear_state_fwd"] < gather["linear_state_fwd"]
    assert lin.attention_s == lin.a2a_s == lin.ring_exposed_s == 0 and lin.linear_s > 0 and lin.linear_comm_s > 0
    hyb = estimate(c, ModelShape(layers=4, linear_layers=3, **base), 4096, u, r, layout=layout)
    assert hyb.linear_share == 0.75
    within(relative_difference(hyb.time_s, 0.25 * attn.time_s + 0.75 * lin.time_s), 1e-12, "hyb.time_s")
    assert hyb.bytes_per_rank["linear_state_fwd"] == round(0.75 * lin.bytes_per_rank["linear_state_fwd"])
    assert hyb.bytes_per_rank["ring_fwd"] == round(0.25 * attn.bytes_per_rank["ring_fwd"])
    within(relative_difference(hyb.attention_time_s, 0.25 * attn.attention_time_s), 1e-12, "hyb.attention_time_s")


def test_linear_compute_counts_the_probe_on_continuing_runs():
    """One rank: every run starts its document, no probe, no exchange; on 4 ranks (contiguous) ranks
    1-3 probe all their tokens: the busiest rank pays f(dv + dk) per token instead of f(dv)."""
    from topology.linear_cost import linear_flops_per_token

    m = ModelShape(heads=8, head_dim=64, layers=2, linear_layers=2, **GDN)
    c, C, K = 64, 64, m.linear_conv
    f0 = 4 * (6 * 16 * 32 + 4 * c * (16 + 32)) + 2 * K * m.linear_conv_channels
    f1 = 4 * (6 * 16 * 48 + 4 * c * (16 + 48) + 2 * 16 * 32) + 2 * K * m.linear_conv_channels
    assert (linear_flops_per_token(m, False), linear_flops_per_token(m, True)) == (f0, f1)
    acc = Cluster.preset("dgx-h100").accelerator
    one = estimate(Cluster.preset("dgx-h100"), m, 8192, 1, 1)
    four = estimate(Cluster.preset("dgx-h100"), m, 8192, 1, 4, layout="contiguous")
    within(relative_difference(one.linear_s, 8192 * f0 * 3 / acc.dense_flops), 1e-12, "one.linear_s")
    within(relative_difference(four.linear_s, 2048 * f1 * 3 / acc.dense_flops), 1e-12, "four.linear_s")
    assert one.linear_comm_s == 0 and one.bytes_per_rank == {}
    mamba = ModelShape(
        heads=8,
        head_dim=64,
        layers=2,
        linear_layers=2,
        linear_kind="mamba2",
        linear_heads=8,
        linear_key_heads=2,
        linear_key_dim=16,
        linear_value_dim=32,
        linear_chunk=C,
    )
    assert linear_flops_per_token(mamba, False) == 8 * (4 * 16 * 32 + 2 * C * 32 + 2 * C * 16 * 2 / 8) + 2 * K * (
        2 * 2 * 16 + 8 * 32
    )
    assert linear_flops_per_token(mamba, True) - linear_flops_per_token(mamba, False) == 8 * 2 * 16 * 32


def test_plan_explains_the_linear_share():
    from topology import plan

    best = plan(Cluster.preset("dgx-h100", nodes=4), ModelShape.preset("qwen3-next-80b"), 131072, world_size=32).best
    assert best.estimate.linear_share == 0.75
    assert "linear layers (75% of layers)" in best.explain() and "36 of 48 layers are linear" in best.explain()
