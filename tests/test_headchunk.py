"""Head-chunked attention (UPipe-style, with overlapped all-to-alls) equals head_chunks=1."""

import memory_cases
import pytest
import train_cases
from tolerance import within

from hybrid_cp.engine.headchunk import chunk_heads
from hybrid_cp.engine.heads import head_split

# fp32 round-off of head chunks vs one chunk (another order of the same sums): worst 1.6e-6 in one run of this
# file (gemma3 grads with module chunks; engine-level out 4.6e-7): a 6.4x margin
# (the same figures in a second run: fixed seeds, deterministic on CPU)
TOL = 1e-5


def test_chunk_schedule_is_gqa_aware_and_uneven():
    split = head_split(32, 8, 8)  # 4 query heads (one KV head) per rank
    ch = chunk_heads(split, 4, rank=3)
    assert ch.count == 4 and ch.q[0][3] == (12, 13) and ch.q[3][3] == (15, 16)
    assert all(kv == (0, 1) for kv in ch.kv_local)  # the same KV head in every chunk: exchanged once
    assert chunk_heads(split, 16, 0).count == 4  # clamped: every rank needs a head in every chunk
    uneven = chunk_heads(head_split(10, 2, 4), 2, rank=0)  # ranks hold 3, 3, 2, 2 heads
    assert uneven.q[0] == ((0, 2), (3, 5), (6, 7), (8, 9)) and uneven.q[1] == ((2, 3), (5, 6), (7, 8), (9, 10))
    # a rank whose heads straddle two KV groups uses only the group(s) of each chunk's heads
    straddle = chunk_heads(head_split(10, 2, 4), 2, rank=1)  # rank 1: heads 3, 4 (KV 0), 5 (KV 1)
    assert straddle.kv_local == ((0, 1), (1, 2)) and straddle.kv_index == ((0, 0), (0,))


@pytest.mark.parametrize(
    "u,r,h,hkv,chunks",
    [
        (4, 2, 8, 2, (2,)),  # GQA with H_kv < u
        (2, 2, 8, 8, (2, 4)),  # MHA, ulysses x ring
        (8, 1, 16, 1, (2,)),  # MQA, pure ulysses
        (4, 1, 10, 2, (2,)),  # uneven heads (3, 3, 2, 2) and a GQA group straddling ranks
        (1, 8, 6, 3, (2, 4)),  # pure ring: chunks of a rank's 6 heads (uneven 2, 2, 1, 1 at k=4)
    ],
)
def test_head_chunks_equal_one_chunk(pool, u, r, h, hkv, chunks):
    for rank, rows in enumerate(
        pool.run(memory_cases.headchunk_parity, u=u, r=r, h=h, hkv=hkv, chunks=chunks, causal=(u, r) != (2, 2))
    ):
        for kc in chunks:
            for key in ("out", "dq", "dk", "dv"):
                within(rows[kc][key], TOL, f"rank {rank} chunks {kc} {key}", rows[kc])


def test_head_chunks_lse_padding_and_no_overlap(pool):
    # s=90 is not a multiple of the zigzag granularity 16: padding is masked in every chunk
    for rank, rows in enumerate(
        pool.run(memory_cases.headchunk_parity, u=2, r=2, h=4, hkv=2, chunks=(2,), s=90, return_lse=True, overlap=False)
    ):
        for key in ("out", "lse", "dq", "dk", "dv"):
            within(rows[2][key], TOL, f"rank {rank} {key}", rows)
        # K/V cross the all-to-all once in forward, like head_chunks=1
        assert rows[2]["bytes"]["ulysses_fwd"] == rows["ref_bytes"]["ulysses_fwd"]


def test_module_chunks_split_whole_gqa_groups():
    from topology.heads import module_chunks

    assert module_chunks(32, 8, 8, 8) == ([(0, 2), (2, 4), (4, 6), (6, 8)], 2)  # Llama-3-8B on u=8: 4 x 2 groups
    assert module_chunks(32, 8, 1, 8) == ([(i, i + 1) for i in range(8)], 1)
    assert module_chunks(8, 2, 2, 2) == ([(0, 1), (1, 2)], 1)
    assert module_chunks(8, 8, 2, 3) == ([(0, 3), (3, 6), (6, 8)], 1)  # uneven: 3, 3, 2 heads
    assert module_chunks(8, 1, 4, 4) == ([(0, 1)], 4)  # MQA: engine-level chunks only
    assert module_chunks(4, 4, 4, 2) == ([(0, 4)], 2)  # one head per ulysses rank


@pytest.mark.parametrize(
    "kind,heads,hkv,head_chunks,fsdp,checkpoint,widths,projections,overlap",
    [
        (
            "llama",
            8,
            2,
            2,
            True,
            True,
            [4 * 4],
            True,
            True,
        ),  # 2 module chunks of 4 query heads (head_dim 4); FSDP2 + ckpt
        ("llama", 8, 4, 4, False, False, [2 * 4], True, True),  # 4 module chunks of one GQA group each
        ("llama", 8, 4, 4, False, False, [2 * 4], True, False),  # the same, chunks one after another (no overlap)
        ("llama", 8, 8, 3, False, True, [2 * 4, 3 * 4], True, True),  # MHA, uneven chunks 3/3/2
        ("llama", 8, 2, 2, False, False, [8 * 4], False, True),  # chunk_projections=False: engine-level chunks only
        ("qwen2", 8, 8, 4, False, False, [2 * 4], True, True),  # q/k/v biases cut per chunk
        ("qwen3", 8, 2, 4, False, False, [4 * 8], True, True),  # q/k norms; 2 module chunks x 2 engine chunks
        ("gemma3", 8, 4, 2, True, False, [4 * 8], True, False),  # sliding-window and full layers, FSDP2, serial
    ],
)
def test_transformers_with_head_chunks_trains_like_single_process(
    pool, kind, heads, hkv, head_chunks, fsdp, checkpoint, widths, projections, overlap
):
    """Module-level chunks: the q projection only ever produces one chunk's heads (forward and the
    recomputation in backward), and loss and every gradient equal the single-process run."""
    for rank, row in enumerate(
        pool.run(
            memory_cases.tiled_model_parity,
            u=2,
            r=2,
            hkv=hkv,
            heads=heads,
            head_chunks=head_chunks,
            fsdp=fsdp,
            checkpoint=checkpoint,
            chunk_projections=projections,
            kind=kind,
            overlap=overlap,
        )
    ):
        assert not row["missing"], row
        within(row["loss"], TOL, f"rank {rank} loss", row)
        within(row["grad"], TOL, f"rank {rank} grad", row)
        assert row["q_widths"] == widths, row


def test_head_chunks_with_packed_documents_and_windows(pool8):
    cu = [0, 30, 31, 77, 120]  # packed row: documents of 30, 1, 46 and 43 tokens
    for rank, rows in enumerate(
        pool8.run(memory_cases.headchunk_parity, u=2, r=2, h=8, hkv=2, chunks=(2,), s=120, b=1, cu_seqlens=cu)
    ):
        for key in ("out", "dq", "dk", "dv"):
            within(rows[2][key], TOL, f"packed rank {rank} {key}", rows)
    for rank, rows in enumerate(
        pool8.run(memory_cases.headchunk_parity, u=2, r=4, h=4, hkv=1, chunks=(2,), s=128, window=9)
    ):
        for key in ("out", "dq", "dk", "dv"):
            within(rows[2][key], TOL, f"window rank {rank} {key}", rows)


def test_module_chunks_with_packed_documents(pool):
    for rank, row in enumerate(pool.run(train_cases.packed_model_parity, u=2, r=2, head_chunks=2)):
        assert not row["missing"], row
        within(row["loss"], TOL, f"rank {rank} loss", row)
        within(row["grad"], TOL, f"rank {rank} grad", row)


def test_module_chunks_refuse_a_module_that_does_more_than_o_proj(pool):
    for msg in pool.run(memory_cases.module_chunks_refuse_other_structure, u=2, r=2):
        assert msg is not None and "chunk_projections=False" in msg and "o_proj" in msg, msg
