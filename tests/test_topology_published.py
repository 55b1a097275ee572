"""The cost model against published measurements (details and sources in benchmarks/results/planner.md)."""

import published_data as published


def test_prime_rl_ulysses_beats_ring_at_every_cp():
    """prime-rl PR #2418 (8x H200, GLM-4.5-Air, 64K): Ulysses cp=2/4 beat ring cp=2/4; Ulysses cp=4 ~ cp=1."""
    pred = published.prime_rl_relative()
    for cp in (2, 4):
        assert pred[(cp, "ulysses")] > pred[(cp, "ring")]
    assert abs(pred[(4, "ulysses")] - published.PRIME_RL_PUBLISHED[(4, "ulysses")]) < 0.05


def test_prime_rl_ring_gap_is_a_documented_disagreement():
    """The model predicts a far smaller ring penalty than the measured 32%; see docs/planner.md."""
    pred = published.prime_rl_relative()
    assert -0.10 < pred[(4, "ring")] < 0 and published.PRIME_RL_PUBLISHED[(4, "ring")] < -0.3


def test_yunchang_l20_prefers_a_hybrid():
    """yunchang on 8x L20 PCIe: a hybrid beats pure Ulysses (a2a over QPI) and pure ring."""
    t = published.yunchang_l20_forward()
    best = min(t, key=t.get)
    assert 1 < best < 8 and t[best] < t[8] and t[best] < t[1]
    assert best == 4  # issue #73: u=4 x r=2 matches the 2 x 4 PCIe-switch/QPI grid


def test_ring_flash_attn_zigzag_efficiency():
    """ring-flash-attn on 8x H800: zigzag reaches 93.6% (fwd) and 85.9% (fwd+bwd) of ideal."""
    fwd, both = published.ring_flash_attn_efficiency()
    assert abs(fwd - 0.936) < 0.05 and abs(both - 0.859) < 0.08


def test_ulysses_paper_tflops_level():
    """DeepSpeed-Ulysses: 7B at 131K on 64 A100s reached 165.5 TFLOP/s per GPU."""
    assert abs(published.ulysses_7b_tflops() - 165.5) / 165.5 < 0.10


def test_table_renders_every_case():
    table = published.table()
    assert table.count("\n") == len(published.cases()) + 1 and "prime-rl" in table


def test_calibrated_terms_explain_the_prime_rl_gap():
    """A per-step cost reproduces ring cp=4's 32% but not cp=2's 29%; one ring-path kernel efficiency
    reproduces both, and every explanation keeps Ulysses ahead of ring (docs/planner.md section 5)."""
    step = published.prime_rl_step_overhead_us()
    rel = published.prime_rl_with(ring_step_overhead_us=step)
    assert abs(rel[(4, "ring")] + 0.32) < 0.005 and rel[(2, "ring")] > -0.2  # cp=2 under-explained
    eff = published.prime_rl_ring_efficiency()
    rel = published.prime_rl_ring_path(eff)
    assert 0.5 < eff < 0.8 and abs(rel[(4, "ring")] + 0.32) < 0.005 and abs(rel[(2, "ring")] + 0.29) < 0.05
    for cp in (2, 4):
        assert rel[(cp, "ulysses")] > rel[(cp, "ring")]
    call, kernel_eff = published.prime_rl_kernel_efficiency()
    assert call > 0 and 0 < kernel_eff < 1


def test_explanation_table_renders():
    rows = published.explanations()
    assert len(rows) == 5 + len(published.modelscope_explanations())
    assert all(r.value and "nan" not in r.value for r in rows)
    fwd, both = published.ring_flash_attn_step_overhead_us()
    assert 0 < fwd < both < 200
    assert published.explanation_table().count("\n") == len(rows) + 1


def _close(a: float, b: float, tol: float = 0.01) -> bool:
    return abs(a / b - 1) < tol


def test_modelscope_orders_the_splits_but_misses_the_size():
    """ms-swift on 8x A100 (Qwen2.5-3B LoRA, packed 9K-token documents): SP=1 < u2 < u2r2 < u2r4 in training
    time, 1.23x / 1.92x / 3.42x; the model keeps the order and predicts only a few percent (docs/planner.md)."""
    pub = published.MODELSCOPE_PUBLISHED
    assert [round(pub[sp], 2) for sp in (2, 4, 8)] == [1.23, 1.92, 3.42]
    pred = published.modelscope_relative()
    assert published.modelscope_ordered(pred) and published.modelscope_ordered(pub)
    assert pred[8] < 1.1  # the documented disagreement ("no" row)
    one_row = published.modelscope_with(doc_tokens=65536, docs=1)
    assert published.modelscope_ordered(one_row) and one_row[8] < 1.03  # the "at most 1.02x"


def test_modelscope_single_terms_reproduce_their_target_and_keep_the_order():
    """Each single term, solved for its row, reproduces it within 1% and keeps the ordering; the ring-only
    terms leave u2 (no ring) near 1.0x, the all-to-all latency leaves the ring rows short."""
    pub, w = published.MODELSCOPE_PUBLISHED, published.modelscope_with
    step = published.modelscope_step_overhead_us()
    call, eff = published.modelscope_kernel_efficiency()
    head = published.modelscope_head_call_us()
    ring_eff = published.modelscope_ring_efficiency()
    fixed = published.modelscope_fixed_layer_us(8)
    for rel in (
        w(ring_step_overhead_us=step),
        w(kernel_call_overhead_us=call),
        w(head_call_us=head),
        w(ring_efficiency=ring_eff),
        w(fixed_layer_us=fixed),
    ):
        assert _close(rel[8], pub[8]) and published.modelscope_ordered(rel)
    assert 0 < eff < 1 and 0 < ring_eff < 1
    for rel in (w(ring_step_overhead_us=step), w(head_call_us=head), w(ring_efficiency=ring_eff)):
        assert rel[2] < 1.05  # no ring step at u2
    assert w(ring_efficiency=ring_eff)[4] > 0.95 * pub[8]  # a ring-path factor makes u2r2 as slow as u2r4
    assert w(ring_step_overhead_us=step)[4] < 0.9 * pub[4]  # a per-step cost alone leaves u2r2 short
    best = w(fixed_layer_us=fixed)  # the best single term: the other rows within 10%
    assert _close(best[2], pub[2], 0.10) and _close(best[4], pub[4], 0.10)
    lat = published.modelscope_a2a_latency_us()
    rel = w(a2a_latency_us=lat)
    assert _close(rel[2], pub[2]) and published.modelscope_ordered(rel) and rel[8] < 0.6 * pub[8]


def test_modelscope_pair_explains_all_three_rows():
    """A fixed cost per layer and micro-step (solved for u2) plus a per-ring-step cost (solved for u2r4)
    reproduces both within 1% and u2r2, which neither was solved for, within 2%."""
    pub, w = published.MODELSCOPE_PUBLISHED, published.modelscope_with
    fixed, step = published.modelscope_fixed_and_step()
    assert fixed > 0 and step > 0
    rel = w(fixed_layer_us=fixed, ring_step_overhead_us=step)
    assert _close(rel[2], pub[2]) and _close(rel[8], pub[8]) and _close(rel[4], pub[4], 0.02)
    assert published.modelscope_ordered(rel)
    lat, step2 = published.modelscope_a2a_and_step()
    rel = w(a2a_latency_us=lat, ring_step_overhead_us=step2)
    assert _close(rel[2], pub[2]) and _close(rel[8], pub[8]) and published.modelscope_ordered(rel)
