"""Published measurements the cost model is checked against (tests and docs/planner.md use these).

Each case records the source, the published figure and what the model predicts for the same setup.
``python -m topology.published`` prints the comparison table that docs/planner.md reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .cost import ModelShape, estimate

__all__ = ["Case", "cases", "table"]


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
    cluster, model, n = Cluster.preset("dgx-h200"), ModelShape.preset("glm-4.5-air"), 65536
    base = estimate(cluster, model, n, 1, 1, dp=8).tokens_per_s
    out = {}
    for cp in (2, 4):
        out[(cp, "ulysses")] = estimate(cluster, model, n, cp, 1, dp=8 // cp).tokens_per_s / base - 1
        out[(cp, "ring")] = estimate(cluster, model, n, 1, cp, dp=8 // cp).tokens_per_s / base - 1
    return out


PRIME_RL_PUBLISHED = {(2, "ulysses"): -0.08, (2, "ring"): -0.29, (4, "ulysses"): 0.01, (4, "ring"): -0.32}


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


def cases() -> list[Case]:
    """All comparisons, computed now from the current model."""
    pr = prime_rl_relative()
    yc = yunchang_l20_forward()
    best_u = min(yc, key=yc.get)
    fwd, both = ring_flash_attn_efficiency()
    tf = ulysses_7b_tflops()
    fmt = lambda d: ", ".join(f"cp{cp} {s} {v:+.1%}" for (cp, s), v in sorted(d.items()))  # noqa: E731
    return [
        Case(
            "prime-rl 8xH200 64K, ranking",
            "PrimeIntellect-ai/prime-rl PR #2418",
            fmt(PRIME_RL_PUBLISHED),
            fmt(pr),
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
            "smaller per-step kernels, synchronisation), which a bandwidth model does not see",
        ),
        Case(
            "yunchang 8xL20 PCIe, best split",
            "feifeibear/long-context-attention README and issue #73",
            "hybrid best: README says u=2 r=4, maintainer (issue #73) says u=4 r=2",
            f"u={best_u} r={8 // best_u} best (fwd, 32K, 32 heads); "
            + ", ".join(f"u{u} {t * 1e3:.0f} ms" for u, t in yc.items()),
            1 < best_u < 8,
            "agrees that a hybrid beats pure Ulysses (all-to-all over QPI) and pure ring; the two sources "
            "disagree on u=2 vs u=4, the model sides with issue #73 at 32K and calls them even at 128K",
        ),
        Case(
            "ring-flash-attn 8xH800 zigzag",
            "zhuzilin/ring-flash-attention README",
            "fwd 93.6%, fwd+bwd 85.9% of ideal",
            f"fwd {fwd:.1%}, fwd+bwd {both:.1%}",
            abs(fwd - 0.936) < 0.05 and abs(both - 0.859) < 0.08,
            "ring_step_overhead_us=30 comes from this benchmark's forward gap (~28 us per step); the model adds the "
            "softmax-merge traffic on top (fwd 3 points pessimistic) and assumes a backward step costs 2x a "
            "forward one (fwd+bwd 3 points optimistic)",
        ),
        Case(
            "Ulysses 7B 131K on A100 (64 GPUs)",
            "DeepSpeed-Ulysses arXiv 2309.14509",
            "165.5 TFLOP/s per GPU at 64 GPUs, 136.1 at 256",
            f"{tf:.1f} TFLOP/s per GPU (ulysses=8 per node), same at 256",
            abs(tf - 165.5) / 165.5 < 0.1,
            "level agrees (FlashAttention-2 efficiency on A100); the drop at 256 GPUs comes from ZeRO-3 "
            "parameter gathers and gradient reduction across more nodes, outside this per-layer CP model",
        ),
    ]


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
