"""The cost model against published measurements (details and sources in docs/planner.md)."""

from topology import published


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
    assert len(rows) == 5 and all(r.value and "nan" not in r.value for r in rows)
    fwd, both = published.ring_flash_attn_step_overhead_us()
    assert 0 < fwd < both < 200
    assert published.explanation_table().count("\n") == len(rows) + 1
