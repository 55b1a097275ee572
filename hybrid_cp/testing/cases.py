"""The case lists of the distributed parity tests, shared with the benchmarks that tabulate them
(benchmarks/accuracy_table.py, benchmarks/mask_accuracy_table.py): one list, so that a table says
what the suite checks. Each case is a plain dict for the `dist_cases` tasks of tests/."""

from __future__ import annotations

__all__ = ["MESHES", "attention_cases", "doc_mix", "packed_cases", "window_cases"]

# The (ulysses, ring) meshes of 1 to 8 ranks that the parity tests run each case on.
MESHES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)]


def attention_cases(u: int, dtype: str = "fp32", lengths=(512, 1000)) -> list[dict]:
    """Dense attention: MHA, GQA, MQA and uneven head splits, causal and full (tests/test_attention.py)."""
    heads = [(8, 8), (8, 2), (8, 1)]  # MHA, GQA, MQA
    heads += [(h, 2) for h in (6, 10) if h >= u]  # uneven splits (10 on u=4 gives ragged GQA groups)
    return [
        dict(b=2, n=n, h=h, hkv=hkv, d=64 if n == 512 else 32, causal=c, dtype=dtype)
        for n in lengths
        for h, hkv in heads
        for c in (True, False)
    ]


def doc_mix(seed: int, n_docs: int, total: int) -> list[int]:
    """`n_docs` document lengths summing to `total`: mostly short, one long, a length-1 document."""
    import random

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), n_docs - 1))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    if n_docs > 2:
        lens[rng.randrange(n_docs - 1)] += lens.pop() - 1
        lens.insert(rng.randrange(n_docs), 1)
    return lens


def packed_cases(u: int, seed: int) -> list[dict]:
    """Packed documents: a random mix, tiny and single documents (tests/test_packing.py)."""
    mixes = [doc_mix(seed, 7, 301), [1, 2, 3, u * 2 + 1, 150] + [1] * 3, [97]]
    heads = [(8, 2), (8, 1)] + [(h, 2) for h in (6, 10) if h >= u]
    return [
        dict(docs=list(m), h=h, hkv=hkv, d=16, causal=c, seed=seed + i)
        for i, m in enumerate(mixes)
        for h, hkv in heads[:3]
        for c in (True, False)
    ]


def window_cases(u: int) -> list[dict]:
    """Sliding windows, dense and packed, causal W and non-causal (left, right) (tests/test_windows.py)."""
    heads = [(8, 2), (8, 1)] + ([(10, 2)] if u <= 10 else [])
    dense = [
        dict(n=n, causal=c, window=w)
        for n in (61, 256)
        for c, w in [
            (True, 1),
            (True, 5),
            (True, 40),
            (True, 300),
            (False, (3, 7)),
            (False, (0, 50)),
            (False, (400, 2)),
        ]
    ]
    packed = [dict(docs=[30, 1, 90, 7, 50], causal=c, window=w) for c, w in [(True, 3), (True, 33), (False, (5, 2))]]
    return [
        dict(**case, h=heads[i % len(heads)][0], hkv=heads[i % len(heads)][1], d=16, seed=i)
        for i, case in enumerate(dense + packed)
    ]
