"""Published measurements the cost model is checked against (tests/test_topology_published.py asserts them;
benchmarks/results/planner.md shows the tables). Test data, not product: nothing in `topology` reads it.

Each case records the source, the published figure and what the model predicts for the same setup.
``python tests/published_data.py`` prints the comparison table that benchmarks/results/planner.md reproduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from topology.cluster import Cluster
from topology.cost import estimate
from topology.model_shape import ModelShape

__all__ = [
    "Case",
    "Explanation",
    "cases",
    "table",
    "explanations",
    "explanation_table",
    "modelscope_relative",
    "modelscope_with",
]


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    published: str
    predicted: str
    agree: bool
    why: str


def prime_rl_relative() -> dict[tuple[int, str], float]:
    """prime-rl PR #2418: GLM-4.5-Air, FA3, 8x H200, 64K tokens; throughput relative to cp=1 (dp=8)."""
    return prime_rl_with()


PRIME_RL_PUBLISHED = {(2, "ulysses"): -0.08, (2, "ring"): -0.29, (4, "ulysses"): 0.01, (4, "ring"): -0.32}


# ms-swift (ModelScope article "Ulysses + Ring-Attention", modelscope/modelscope-classroom,
# Blogs/Articles/Ulysses_Ring_Attention/report.md): 8x A100, Qwen2.5-3B-Instruct, LoRA on all linear layers,
# bf16, flash-attn varlen, padding-free rows of 4 documents of ~9,000 tokens (per_device_train_batch_size 4),
# --sequence_parallel_size 1/2/4/8 with the framework's split (ulysses 2, the rest ring), same job each time.
MODELSCOPE_MODEL = ModelShape(
    name="qwen2.5-3b", heads=16, kv_heads=2, head_dim=128, hidden=2048, layers=36, intermediate=11008, vocab=151936
)  # Qwen2.5-3B config.json
MODELSCOPE_SPLITS = {2: (2, 1), 4: (2, 2), 8: (2, 4)}  # SP size -> (ulysses, ring)
MODELSCOPE_LABEL = {2: "u2", 4: "u2r2", 8: "u2r4"}
MODELSCOPE_SECONDS = {1: 19 * 60 + 41, 2: 24 * 60 + 16, 4: 37 * 60 + 48, 8: 67 * 60 + 20}  # published training time
MODELSCOPE_PUBLISHED = {sp: t / MODELSCOPE_SECONDS[1] for sp, t in MODELSCOPE_SECONDS.items() if sp > 1}
MODELSCOPE_DOC_TOKENS, MODELSCOPE_DOCS = 9000, 4  # documents per packed row (one row per SP group and micro-step)


def modelscope_with(
    *,
    fixed_layer_us: float = 0.0,
    a2a_latency_us: float = 0.0,
    head_call_us: float = 0.0,
    ring_efficiency: float = 1.0,
    doc_tokens: int = MODELSCOPE_DOC_TOKENS,
    docs: int = MODELSCOPE_DOCS,
    **acc: float,
) -> dict[int, float]:
    """Training time of SP = 2, 4, 8 relative to SP = 1 for the same tokens (the published ratios' form).

    dp = 8 / SP, so a larger SP runs more micro-steps of fewer tokens per rank: the ratio is
    ``tokens_per_s(SP=1) / tokens_per_s(SP)``. A packed row of ``docs`` documents, each padded and split
    zigzag on its own (ms-swift's padding-free SP), is priced as ``batch=docs`` sequences of ``doc_tokens``:
    the same attention work, bytes and padding, one kernel call per step for the whole row.

    ``acc`` replaces accelerator fields (``ring_step_overhead_us``, ``kernel_call_overhead_us``, ...);
    the other terms are added per layer and micro-step on top of :func:`topology.cost.estimate`:
    ``fixed_layer_us`` at every split, SP = 1 included (time that does not shrink with a rank's tokens);
    ``a2a_latency_us`` per all-to-all (2 forward, 2 backward per layer, ulysses > 1 only; the same as a
    fixed cost per SP attention call); ``head_call_us`` per query head per kernel call (section 4.1's
    ``head_call_overhead_us``: H/u heads, r forward and r backward calls); ``ring_efficiency`` divides the
    attention time of splits with a ring (the ring path's kernels at that fraction of the one-call rate).
    """
    cluster = _with_acc(Cluster.preset("dgx-a100"), **acc) if acc else Cluster.preset("dgx-a100")
    model = MODELSCOPE_MODEL

    def tokens_per_s(u: int, r: int) -> float:
        e = estimate(cluster, model, doc_tokens, u, r, dp=8 // (u * r), batch=docs)
        layer = e.time_s + (1.0 / ring_efficiency - 1.0) * e.attention_s * (r > 1)
        layer += 1e-6 * (fixed_layer_us + 4 * a2a_latency_us * (u > 1) + head_call_us * (model.heads // u) * 2 * r)
        return e.dp * e.batch * e.seq_len / (layer * e.layers)

    base = tokens_per_s(1, 1)
    return {sp: base / tokens_per_s(u, r) for sp, (u, r) in MODELSCOPE_SPLITS.items()}


def modelscope_relative() -> dict[int, float]:
    """The model's training time of SP = 2 (u2), 4 (u2r2), 8 (u2r4) relative to SP = 1, ms-swift's setup."""
    return modelscope_with()


def modelscope_ordered(rel: dict[int, float]) -> bool:
    """The published ordering: SP = 1 < u2 < u2r2 < u2r4 in training time."""
    return 1.0 < rel[2] < rel[4] < rel[8]


def _fmt_x(rel: dict[int, float], digits: int = 2) -> str:
    return ", ".join(f"{MODELSCOPE_LABEL[sp]} {v:.{digits}f}x" for sp, v in sorted(rel.items()))


def yunchang_l20_forward(seq_len: int = 32768, head_dim: int = 128) -> dict[int, float]:
    """yunchang benchmark shape (32 heads, MHA, batch 1, forward only) on an 8x L20 PCIe box: time per ulysses degree."""
    cluster, model = Cluster.preset("pcie-8gpu"), ModelShape(heads=32, head_dim=head_dim, layers=1)
    return {u: estimate(cluster, model, seq_len, u, 8 // u, backward=False).time_s for u in (8, 4, 2, 1)}


def ring_flash_attn_efficiency(flash_tflops: float = 208.0) -> tuple[float, float]:
    """ring-flash-attn README, 8x H800, zigzag, 8K tokens/GPU (64K total), 5 heads x 128, causal.

    Returns the model's (forward, forward+backward) fraction of ideal (1/8 of single-GPU flash-attn).
    ``flash_tflops`` is the single-GPU flash-attn rate implied by the README's own baseline
    (2418 fwd/s on 8K tokens x 5 heads = ~208 TFLOP/s), so kernel speed is not a free parameter.
    """
    base = Cluster.preset("dgx-h100")
    acc = base.accelerator.model_copy(update={"attention_efficiency": flash_tflops / base.accelerator.peak_tflops})
    h800 = base.model_copy(
        update={"accelerator": acc, "intra_node": base.intra_node.model_copy(update={"bandwidth_gb_s": 200.0})}
    )  # H800: NVLink 400 GB/s bidirectional
    model = ModelShape(heads=5, head_dim=128, layers=1)
    out = []
    for backward in (False, True):
        single = estimate(h800, model, 65536, 1, 1, backward=backward)
        ring = estimate(h800, model, 65536, 1, 8, backward=backward)
        ideal = single.attention_s / 8
        out.append(ideal / (ring.attention_s + ring.ring_overhead_s + ring.ring_exposed_s))
    return out[0], out[1]


def ulysses_7b_tflops(ulysses: int = 8) -> float:
    """Ulysses paper (arXiv 2309.14509): 7B at 131K tokens on A100; model's achieved TFLOP/s per GPU."""
    cluster, model = Cluster.preset("dgx-a100", nodes=8), ModelShape.preset("llama2-7b")
    e = estimate(cluster, model, 131072, ulysses, 1, dp=64 // ulysses)
    return e.model_flops / e.time_s / e.cp / 1e12


def _prime_rl_fmt(d: dict[tuple[int, str], float]) -> str:
    """prime-rl's relative throughputs, one signed percentage per (cp, strategy)."""
    return ", ".join(f"cp{cp} {s} {v:+.1%}" for (cp, s), v in sorted(d.items()))


def _prime_rl_cases() -> list[Case]:
    pr = prime_rl_relative()
    return [
        Case(
            "prime-rl 8xH200 64K, ranking",
            "PrimeIntellect-ai/prime-rl PR #2418",
            _prime_rl_fmt(PRIME_RL_PUBLISHED),
            _prime_rl_fmt(pr),
            all(pr[(cp, "ulysses")] > pr[(cp, "ring")] for cp in (2, 4)),
            "same order for the question asked (Ulysses beats ring at cp=2 and cp=4; Ulysses cp=4 within 2% of "
            "cp=1); the model does not reproduce cp=2 Ulysses being 8% slower than cp=4 (noise or memory effects)",
        ),
        Case(
            "prime-rl 8xH200 64K, ring gap",
            "PrimeIntellect-ai/prime-rl PR #2418",
            "ring cp=4 32% slower than cp=1",
            f"ring cp=4 {-pr[(4, 'ring')]:.1%} slower",
            False,
            "model hides ring K/V traffic (a few ms per step over NVLink) behind 13-33 ms ring steps and prices only launches and the "
            "softmax merge; the measured gap comes from the ring implementation (packed varlen RL batches, "
            "smaller per-step kernels, synchronisation), which a bandwidth model does not see; the calibrated terms "
            "explain it (docs/planner.md section 5.1: a ring path at ~0.64 of the one-call kernel rate reproduces both "
            "ring rows)",
        ),
    ]


def _yunchang_case() -> Case:
    yc = yunchang_l20_forward()
    best_u = min(yc, key=yc.get)
    return Case(
        "yunchang 8xL20 PCIe, best split",
        "feifeibear/long-context-attention README and issue #73",
        "hybrid best: README says u=2 r=4, maintainer (issue #73) says u=4 r=2",
        f"u={best_u} r={8 // best_u} best (fwd, 32K, 32 heads); "
        + ", ".join(f"u{u} {t * 1e3:.0f} ms" for u, t in yc.items()),
        1 < best_u < 8,
        "agrees that a hybrid beats pure Ulysses (all-to-all over QPI) and pure ring; the two sources "
        "disagree on u=2 vs u=4, the model sides with issue #73 at 32K and calls them even at 128K",
    )


def _ring_flash_attn_case() -> Case:
    fwd, both = ring_flash_attn_efficiency()
    return Case(
        "ring-flash-attn 8xH800 zigzag",
        "zhuzilin/ring-flash-attention README",
        "fwd 93.6%, fwd+bwd 85.9% of ideal",
        f"fwd {fwd:.1%}, fwd+bwd {both:.1%}",
        abs(fwd - 0.936) < 0.05 and abs(both - 0.859) < 0.08,
        "ring_step_overhead_us=30 comes from this benchmark's forward gap (~28 us per step); the model adds the "
        "softmax-merge traffic on top (fwd 3 points pessimistic) and assumes a backward step costs 2x a "
        "forward one (fwd+bwd 3 points optimistic)",
    )


def _ulysses_7b_case() -> Case:
    tf = ulysses_7b_tflops()
    return Case(
        "Ulysses 7B 131K on A100 (64 GPUs)",
        "DeepSpeed-Ulysses arXiv 2309.14509",
        "165.5 TFLOP/s per GPU at 64 GPUs, 136.1 at 256",
        f"{tf:.1f} TFLOP/s per GPU (ulysses=8 per node), same at 256",
        abs(tf - 165.5) / 165.5 < 0.1,
        "level agrees (FlashAttention-2 efficiency on A100); the drop at 256 GPUs comes from ZeRO-3 "
        "parameter gathers and gradient reduction across more nodes, outside this per-layer CP model",
    )


def _modelscope_cases() -> list[Case]:
    ms = modelscope_relative()
    ms_row = modelscope_with(doc_tokens=65536, docs=1)
    fixed, step = modelscope_fixed_and_step()
    return [
        Case(
            "ms-swift 8xA100 Qwen2.5-3B packed 9K docs, SP ordering",
            "modelscope/modelscope-classroom Blogs/Articles/Ulysses_Ring_Attention/report.md (ms-swift)",
            _fmt_x(MODELSCOPE_PUBLISHED) + " SP=1's training time",
            _fmt_x(ms),
            modelscope_ordered(ms),
            "same order (SP=1 < u2 < u2r2 < u2r4): the model gets it only from small terms (all-to-all, ring "
            "step launches and merges, zigzag padding of each document), not from anything of the measured size",
        ),
        Case(
            "ms-swift 8xA100 Qwen2.5-3B packed 9K docs, slowdown size",
            "modelscope/modelscope-classroom Blogs/Articles/Ulysses_Ring_Attention/report.md (ms-swift)",
            "u2r4 3.42x, u2 1.23x SP=1's training time",
            f"u2r4 {ms[8]:.2f}x, u2 {ms[2]:.2f}x ({ms_row[8]:.2f}x, {ms_row[2]:.2f}x if the row were one "
            "65K-token sequence)",
            False,
            "over NVLink the model hides every ring transfer behind its step and prices the all-to-all at under a ms "
            "per layer, so SP looks nearly free; the measured time grows almost in proportion to SP, even at u2 "
            f"with no ring: section 5.1 explains it with a fixed cost per layer and micro-step (~{fixed / 1e3:.0f} ms, "
            f"at every split) plus a per-ring-step cost (~{step / 1e3:.1f} ms per forward step)",
        ),
    ]


def cases() -> list[Case]:
    """All comparisons, computed now from the current model."""
    return [*_prime_rl_cases(), _yunchang_case(), _ring_flash_attn_case(), _ulysses_7b_case(), *_modelscope_cases()]


@dataclass(frozen=True)
class Explanation:
    """What value of one calibrated term makes the model reproduce a published gap."""

    case: str
    measured: str
    term: str
    value: str
    then: str


def _solve(f: Callable[[float], float], lo: float, hi: float, iters: int = 80) -> float:
    """Root of an increasing ``f`` on [lo, hi] by bisection (geometric when lo > 0); nan if none."""
    if f(lo) > 0 or f(hi) < 0:
        return math.nan
    for _ in range(iters):
        mid = math.sqrt(lo * hi) if lo > 0 else (lo + hi) / 2
        lo, hi = (lo, mid) if f(mid) >= 0 else (mid, hi)
    return (lo + hi) / 2


def _with_acc(cluster: Cluster, **update: float) -> Cluster:
    return cluster.model_copy(update={"accelerator": cluster.accelerator.model_copy(update=update)})


def prime_rl_with(**update: float) -> dict[tuple[int, str], float]:
    """:func:`prime_rl_relative` with accelerator fields replaced (the calibrated terms)."""
    cluster = Cluster.preset("dgx-h200")
    cluster, model, n = _with_acc(cluster, **update) if update else cluster, ModelShape.preset("glm-4.5-air"), 65536
    base = estimate(cluster, model, n, 1, 1, dp=8).tokens_per_s
    out = {}
    for cp in (2, 4):
        out[(cp, "ulysses")] = estimate(cluster, model, n, cp, 1, dp=8 // cp).tokens_per_s / base - 1
        out[(cp, "ring")] = estimate(cluster, model, n, 1, cp, dp=8 // cp).tokens_per_s / base - 1
    return out


def prime_rl_step_overhead_us(target: float = PRIME_RL_PUBLISHED[(4, "ring")]) -> float:
    """Per-ring-step fixed cost (us, forward step; a backward step costs 2x) that makes ring cp=4
    exactly ``target`` slower than cp=1 in prime-rl's setup."""
    return _solve(lambda x: target - prime_rl_with(ring_step_overhead_us=x)[(4, "ring")], 0.0, 1e6)


def prime_rl_kernel_efficiency(target: float = PRIME_RL_PUBLISHED[(4, "ring")]) -> tuple[float, float]:
    """The per-kernel-call cost (us) that reproduces ``target``, and the efficiency it implies for one
    ring-step kernel of cp=4 (useful time / (useful time + call cost)) against the same block on one GPU."""
    call = _solve(lambda x: target - prime_rl_with(kernel_call_overhead_us=x)[(4, "ring")], 0.0, 1e6)
    cluster, model = Cluster.preset("dgx-h200"), ModelShape.preset("glm-4.5-air")
    e = estimate(cluster, model, 65536, 1, 4, dp=2)
    per_call = e.attention_s / (2 * 4)  # r forward + r backward calls, mean
    return call, per_call / (per_call + call * 1e-6)


def prime_rl_ring_path(efficiency: float) -> dict[tuple[int, str], float]:
    """prime-rl relative throughputs when every ring-step kernel runs at ``efficiency`` of the
    single-GPU kernel (attention time of ring splits divided by it; Ulysses and cp=1 unchanged)."""
    cluster, model, n = Cluster.preset("dgx-h200"), ModelShape.preset("glm-4.5-air"), 65536
    base = estimate(cluster, model, n, 1, 1, dp=8)
    rate = lambda e, slow: e.dp * e.batch * e.seq_len / ((e.time_s + slow * e.attention_s) * e.layers)  # noqa: E731
    out = {}
    for cp in (2, 4):
        u, r = estimate(cluster, model, n, cp, 1, dp=8 // cp), estimate(cluster, model, n, 1, cp, dp=8 // cp)
        out[(cp, "ulysses")] = rate(u, 0.0) / rate(base, 0.0) - 1
        out[(cp, "ring")] = rate(r, 1.0 / efficiency - 1.0) / rate(base, 0.0) - 1
    return out


def prime_rl_ring_efficiency(target: float = PRIME_RL_PUBLISHED[(4, "ring")]) -> float:
    """The ring-path kernel efficiency that reproduces ``target`` at cp=4."""
    return _solve(lambda x: prime_rl_ring_path(x)[(4, "ring")] - target, 0.05, 1.0)


def ring_flash_attn_step_overhead_us() -> tuple[float, float]:
    """Per-step cost (us) reproducing ring-flash-attn's forward (93.6%) and forward+backward (85.9%) gaps."""

    def eff(x: float, backward: bool) -> float:
        base = Cluster.preset("dgx-h100")
        acc = base.accelerator.model_copy(
            update={"attention_efficiency": 208.0 / base.accelerator.peak_tflops, "ring_step_overhead_us": x}
        )
        h800 = base.model_copy(
            update={"accelerator": acc, "intra_node": base.intra_node.model_copy(update={"bandwidth_gb_s": 200.0})}
        )
        model = ModelShape(heads=5, head_dim=128, layers=1)
        single = estimate(h800, model, 65536, 1, 1, backward=backward)
        ring = estimate(h800, model, 65536, 1, 8, backward=backward)
        return single.attention_s / 8 / (ring.attention_s + ring.ring_overhead_s + ring.ring_exposed_s)

    fwd = _solve(lambda x: 0.936 - eff(x, False), 0.0, 1e5)
    both = _solve(lambda x: 0.859 - eff(x, True), 0.0, 1e5)
    return fwd, both


def ulysses_7b_efficiency(target: float = 165.5) -> float:
    """Attention efficiency of A100 that makes the Ulysses 7B 131K case reach ``target`` TFLOP/s per GPU."""

    def tf(x: float) -> float:
        cluster, model = (
            _with_acc(Cluster.preset("dgx-a100", nodes=8), attention_efficiency=x),
            ModelShape.preset("llama2-7b"),
        )
        e = estimate(cluster, model, 131072, 8, 1, dp=8)
        return e.model_flops / e.time_s / e.cp / 1e12

    return _solve(lambda x: tf(x) - target, 0.05, 1.0)


def _modelscope_solve(term: str, sp: int, lo: float, hi: float, decreasing: bool = False, **fixed: float) -> float:
    """Value of ``term`` (a :func:`modelscope_with` keyword) that makes split ``sp`` exactly as slow as published."""
    target = MODELSCOPE_PUBLISHED[sp]
    sign = -1.0 if decreasing else 1.0
    return _solve(lambda x: sign * (modelscope_with(**{term: x}, **fixed)[sp] - target), lo, hi)


def modelscope_step_overhead_us() -> float:
    """Per-ring-step fixed cost (us per forward step; a backward step costs 2x) reproducing u2r4's 3.42x."""
    return _modelscope_solve("ring_step_overhead_us", 8, 0.0, 1e6)


def modelscope_kernel_efficiency() -> tuple[float, float]:
    """The per-kernel-call cost (us) reproducing u2r4's 3.42x, and the efficiency it implies for one
    u2r4 ring-step kernel (useful time / (useful time + call cost))."""
    call = _modelscope_solve("kernel_call_overhead_us", 8, 0.0, 1e6)
    e = estimate(Cluster.preset("dgx-a100"), MODELSCOPE_MODEL, MODELSCOPE_DOC_TOKENS, 2, 4, dp=1, batch=MODELSCOPE_DOCS)
    per_call = e.attention_s / (2 * 4)  # r forward + r backward calls, mean
    return call, per_call / (per_call + call * 1e-6)


def modelscope_ring_efficiency() -> float:
    """Ring-path kernel efficiency (prime-rl's explanation) reproducing u2r4's 3.42x."""
    return _modelscope_solve("ring_efficiency", 8, 0.01, 1.0, decreasing=True)


def modelscope_head_call_us() -> float:
    """Cost per query head and kernel call (us) reproducing u2r4's 3.42x."""
    return _modelscope_solve("head_call_us", 8, 0.0, 1e6)


def modelscope_a2a_latency_us() -> float:
    """Latency per all-to-all (us; 4 per layer) reproducing u2's 1.23x, the split without a ring."""
    return _modelscope_solve("a2a_latency_us", 2, 0.0, 1e7)


def modelscope_fixed_layer_us(sp: int = 8) -> float:
    """Fixed cost per layer and micro-step at every split (SP = 1 included) reproducing split ``sp``."""
    return _modelscope_solve("fixed_layer_us", sp, 0.0, 1e7)


def modelscope_fixed_and_step() -> tuple[float, float]:
    """The pair: the fixed cost per layer and micro-step reproducing u2 (no ring), then the per-ring-step
    cost that, on top of it, reproduces u2r4; u2r2 is left as the check."""
    fixed = modelscope_fixed_layer_us(2)
    return fixed, _modelscope_solve("ring_step_overhead_us", 8, 0.0, 1e6, fixed_layer_us=fixed)


def modelscope_a2a_and_step() -> tuple[float, float]:
    """The same pair with the all-to-all latency (a cost only SP splits pay) in place of the fixed cost."""
    lat = modelscope_a2a_latency_us()
    return lat, _modelscope_solve("ring_step_overhead_us", 8, 0.0, 1e6, a2a_latency_us=lat)


_MODELSCOPE_CASE = "ms-swift 8xA100 Qwen2.5-3B LoRA, packed 9K docs"


def _kept(rel: dict[int, float]) -> str:
    """Whether the published ordering survives, as the explanation table says it."""
    return "yes" if modelscope_ordered(rel) else "NO"


def _off(rel: dict[int, float], sp: int) -> float:
    """The model's ratio at split ``sp`` relative to the published one, minus 1."""
    return rel[sp] / MODELSCOPE_PUBLISHED[sp] - 1


def _ms_step_explanation() -> Explanation:
    measured = "u2 1.23x, u2r2 1.92x, u2r4 3.42x SP=1's time (model today: " + _fmt_x(modelscope_relative()) + ")"
    step = modelscope_step_overhead_us()
    with_step = modelscope_with(ring_step_overhead_us=step)
    return Explanation(
        _MODELSCOPE_CASE,
        measured + "; solved for u2r4",
        "per-ring-step fixed cost",
        f"{step / 1e3:.2f} ms per forward step (x2 backward; 6 step units per layer at r=2, 12 at r=4)",
        f"{_fmt_x(with_step)}; ordering kept: {_kept(with_step)}; u2 has no ring step, so it stays at "
        f"{with_step[2]:.2f}x (measured 1.23x), and u2r2 comes out {with_step[4]:.2f}x (1.92x): the slowdown "
        "grows with SP even without a ring, so a per-step cost alone does not explain it",
    )


def _ms_solved_for_u2r4(what: str, term: str, value: float, shown: str, tail) -> Explanation:
    """A single extra term solved for u2r4's speedup: its value, and the speedups the model then gives
    (`tail(speedups)` says what they show)."""
    speedups = modelscope_with(**{term: value})
    return Explanation(
        _MODELSCOPE_CASE,
        "same; solved for u2r4",
        what,
        shown,
        f"{_fmt_x(speedups)}; ordering kept: {_kept(speedups)}{tail(speedups)}",
    )


def _ms_single_term_explanations() -> list[Explanation]:
    """The per-call, ring-efficiency and per-head terms, each solved alone for u2r4."""
    call, eff = modelscope_kernel_efficiency()
    ring_eff = modelscope_ring_efficiency()
    head = modelscope_head_call_us()
    terms = [  # (what, the term, its value, the value in words, what the speedups then show)
        (
            "kernel efficiency vs block size (fixed cost per kernel call)",
            "kernel_call_overhead_us",
            call,
            f"{call / 1e3:.2f} ms per call, i.e. a u2r4 ring-step kernel at {eff:.0%} of the single-GPU kernel's rate",
            lambda _: (
                "; SP=1 and u2 pay it too (one call each way), u2 and u2r2 stay short, and a kernel at this "
                "efficiency is not plausible for calls of ~9K packed rows x 8 heads"
            ),
        ),
        (
            "kernel efficiency of the ring path (prime-rl's explanation)",
            "ring_efficiency",
            ring_eff,
            f"{ring_eff:.2f} of the single-GPU kernel rate",
            lambda x: (
                f" (by {x[8] / x[4] - 1:.0%}); u2r2 and u2r4 pay it on the same share of the layer, so it makes "
                "them equal, unlike the measurement (1.92x vs 3.42x): here the ring cost grows with r, unlike "
                "prime-rl's"
            ),
        ),
        (
            "efficiency vs heads per call (cost per query head and call)",
            "head_call_us",
            head,
            f"{head / 1e3:.2f} ms per head and call (8 heads per call at u=2)",
            lambda _: (
                "; u2 halves the heads per call and doubles the ranks, so it leaves u2 where it was: it cannot "
                "give u2's 1.23x"
            ),
        ),
    ]
    return [_ms_solved_for_u2r4(*term) for term in terms]


def _ms_a2a_explanation() -> Explanation:
    lat = modelscope_a2a_latency_us()
    with_lat = modelscope_with(a2a_latency_us=lat)
    lat2, step2 = modelscope_a2a_and_step()
    with_lat_step = modelscope_with(a2a_latency_us=lat2, ring_step_overhead_us=step2)
    return Explanation(
        _MODELSCOPE_CASE,
        "u2 1.23x (no ring); solved for u2",
        "all-to-all latency (= a fixed cost per SP attention call)",
        f"{lat / 1e3:.2f} ms per all-to-all, {4 * lat / 1e3:.1f} ms per layer (model: "
        f"{modelscope_a2a_model_ms():.2f} ms per layer with the bytes)",
        f"{_fmt_x(with_lat)}; ordering kept: {_kept(with_lat)}; every split here has u=2, so it adds the same "
        f"per layer to all three and leaves the ring rows short; with a per-ring-step cost of {step2 / 1e3:.2f} ms "
        f"solved on top for u2r4: {_fmt_x(with_lat_step)} (u2r2 {_off(with_lat_step, 4):+.0%})",
    )


def _ms_fixed_explanation() -> Explanation:
    fixed = modelscope_fixed_layer_us(8)
    with_fixed = modelscope_with(fixed_layer_us=fixed)
    layers = MODELSCOPE_MODEL.layers
    return Explanation(
        _MODELSCOPE_CASE,
        "u2 1.23x, u2r2 1.92x, u2r4 3.42x; solved for u2r4",
        "fixed cost per layer and micro-step at every split, SP=1 included "
        "(outside section 4.1: time that does not shrink with a rank's tokens)",
        f"{fixed / 1e3:.1f} ms per layer ({fixed * layers / 1e6:.2f} s per {layers}-layer micro-step)",
        f"{_fmt_x(with_fixed)}; ordering kept: {_kept(with_fixed)}; the best single term (u2 "
        f"{_off(with_fixed, 2):+.0%}, u2r2 {_off(with_fixed, 4):+.0%}): "
        "the measured time per micro-step shrinks far less than the rank's tokens do",
    )


def _ms_pair_explanation() -> Explanation:
    fixed2, step3 = modelscope_fixed_and_step()
    with_fixed_only = modelscope_with(fixed_layer_us=fixed2)
    with_pair = modelscope_with(fixed_layer_us=fixed2, ring_step_overhead_us=step3)
    ring_share = (with_pair[8] - with_fixed_only[8]) / (with_pair[8] - modelscope_relative()[8])
    layers = MODELSCOPE_MODEL.layers
    return Explanation(
        _MODELSCOPE_CASE,
        "u2 1.23x and u2r4 3.42x; u2r2 left as the check",
        "the pair: fixed cost per layer and micro-step (from u2) + per-ring-step fixed cost (from u2r4)",
        f"{fixed2 / 1e3:.1f} ms per layer ({fixed2 * layers / 1e6:.2f} s per micro-step) + "
        f"{step3 / 1e3:.2f} ms per forward step",
        f"{_fmt_x(with_pair)}; ordering kept: {_kept(with_pair)}; u2r2 within "
        f"{abs(_off(with_pair, 4)):.1%} of the measured 1.92x; the fixed cost alone gives "
        f"{_fmt_x(with_fixed_only)}, the per-step cost adds the rest (the ring part grows with r, as a per-step "
        f"cost does, but it is only {ring_share:.0%} of u2r4's excess over the model)",
    )


def modelscope_explanations() -> list[Explanation]:
    """The ms-swift rows of :func:`explanations`: one calibrated term each, then the pair that fits."""
    return [
        _ms_step_explanation(),
        *_ms_single_term_explanations(),
        _ms_a2a_explanation(),
        _ms_fixed_explanation(),
        _ms_pair_explanation(),
    ]


def modelscope_a2a_model_ms() -> float:
    """The model's all-to-all time per layer (ms) at u2, ms-swift's setup (bytes over NVLink + 4 latencies)."""
    e = estimate(Cluster.preset("dgx-a100"), MODELSCOPE_MODEL, MODELSCOPE_DOC_TOKENS, 2, 1, dp=4, batch=MODELSCOPE_DOCS)
    return e.a2a_s * 1e3


def explanations() -> list[Explanation]:
    """For each published gap: the value of one calibrated term that reproduces it, and what follows."""
    step = prime_rl_step_overhead_us()
    with_step = prime_rl_with(ring_step_overhead_us=step)
    call, eff = prime_rl_kernel_efficiency()
    with_call = prime_rl_with(kernel_call_overhead_us=call)
    fmt = lambda d: ", ".join(f"cp{cp} {s} {v:+.0%}" for (cp, s), v in sorted(d.items()))  # noqa: E731
    order = lambda d: all(d[(cp, "ulysses")] > d[(cp, "ring")] for cp in (2, 4))  # noqa: E731
    ring_eff = prime_rl_ring_efficiency()
    with_eff = prime_rl_ring_path(ring_eff)
    rf_fwd, rf_both = ring_flash_attn_step_overhead_us()
    eff7b = ulysses_7b_efficiency()
    return [
        Explanation(
            "prime-rl 8xH200 64K (GLM-4.5-Air, FA3)",
            "ring cp=4 32% slower than cp=1 (model today: 1.7%)",
            "per-ring-step fixed cost",
            f"{step / 1e3:.2f} ms per forward step (x2 backward; 12 step units per layer)",
            f"{fmt(with_step)}; Ulysses beats ring at cp=2 and cp=4: {'yes' if order(with_step) else 'NO'}; but ring "
            f"cp=2 comes out {with_step[(2, 'ring')]:+.0%} (measured -29%): a cost per step grows with r, the measured "
            "gap does not, so a per-step cost alone does not explain prime-rl",
        ),
        Explanation(
            "prime-rl 8xH200 64K (GLM-4.5-Air, FA3)",
            "same gap",
            "kernel efficiency vs block size (fixed cost per kernel call)",
            f"{call / 1e3:.2f} ms per call, i.e. a cp=4 ring-step kernel at {eff:.0%} of the single-GPU kernel's rate",
            f"{fmt(with_call)}; ordering kept: {'yes' if order(with_call) else 'NO'}; this also slows cp=1 and "
            "Ulysses (one call each per layer), so it needs a larger value than the per-step term",
        ),
        Explanation(
            "prime-rl 8xH200 64K (GLM-4.5-Air, FA3)",
            "ring cp=2 29% and cp=4 32% slower than cp=1",
            "kernel efficiency of the ring path (every ring-step kernel at a fraction of the one-GPU rate)",
            f"{ring_eff:.2f} of the single-GPU kernel rate",
            f"{fmt(with_eff)}; ordering kept: {'yes' if order(with_eff) else 'NO'}; one factor reproduces both ring rows "
            "(cp=2 and cp=4 pay it on the same share of the layer): the measured gap behaves like a less efficient "
            "kernel path (prime-rl packs variable-length RL samples; ring-flash-attn's README calls its varlen variants "
            "slow), not like a cost per step or per byte",
        ),
        Explanation(
            "ring-flash-attn 8xH800 zigzag 64K",
            "fwd 93.6%, fwd+bwd 85.9% of ideal",
            "per-ring-step fixed cost",
            f"{rf_fwd:.0f} us from the forward gap, {rf_both:.0f} us from fwd+bwd",
            "with the merge traffic priced separately the forward gap needs less than the preset's 30 us, and the "
            "fwd+bwd gap needs more: a backward ring step costs more than the model's 2 forward step units (two "
            "exchanges and an fp32 dK/dV accumulation per step)",
        ),
        Explanation(
            "DeepSpeed-Ulysses 7B 131K, 64 A100",
            "165.5 TFLOP/s per GPU",
            "attention kernel efficiency (long blocks)",
            f"{eff7b:.2f} of A100 peak (preset: 0.55)",
            "a Ulysses-only split has no ring steps, so only the kernel rate moves it; the 256-GPU drop is outside a "
            "per-layer CP model (ZeRO-3 gathers)",
        ),
        *modelscope_explanations(),
    ]


def explanation_table() -> str:
    """Markdown table of :func:`explanations`."""
    rows = ["| case | measured | term | value that reproduces it | then |", "|---|---|---|---|---|"]
    rows += [f"| {x.case} | {x.measured} | {x.term} | {x.value} | {x.then} |" for x in explanations()]
    return "\n".join(rows)


def table() -> str:
    """Markdown table of :func:`cases`."""
    rows = ["| case | source | published | model | agree | why |", "|---|---|---|---|---|---|"]
    rows += [
        f"| {c.name} | {c.source} | {c.published} | {c.predicted} | {'yes' if c.agree else 'no'} | {c.why} |"
        for c in cases()
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
    print()
    print(explanation_table())
