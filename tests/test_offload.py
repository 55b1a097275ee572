"""Offloaded checkpoints (hybrid_cp.training.offload): bitwise the same step as without offload, the
layer inputs counted as host bytes instead of device bytes, reused host buffers, the prefetch order,
and the refusals."""

import warnings

import memory_cases
import pytest
import torch
from tolerance import relative_error, within

from hybrid_cp.errors import ConfigError
from hybrid_cp.training.memory import StorageTracker, host_buffer, is_host
from hybrid_cp.training.offload import offload_checkpoints, offloader_of, unoffload_checkpoints

LAYERS, TOKENS, HIDDEN = 4, 128, 64


def _model(checkpoint: dict | None = None, dtype=torch.float64):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.train()
    if checkpoint is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint)
    return model


IDS = torch.randint(0, 64, (1, TOKENS), generator=torch.Generator().manual_seed(1))
INPUT_BYTES = TOKENS * HIDDEN * 8  # one layer input, fp64


def _step(model, tracker=None):
    """Forward and backward; the device-resident and host bytes alive between them."""
    loss = model(input_ids=IDS).logits.square().mean()
    between = (tracker.device_live, tracker.host_live) if tracker is not None else None
    loss.backward()
    return loss.detach(), between


def _run(steps: int = 2, **offload):
    model = _model({"use_reentrant": False})
    if offload:
        offload_checkpoints(model, **offload)
    rows = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        t = StorageTracker()
        with t:
            t.track(list(model.parameters()))
            loss, between = _step(model, t)
        rows.append(dict(loss=loss, between=between, device_peak=t.device_peak, host_peak=t.host_peak))
    return model, rows, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("offload", [dict(prefetch=False), dict(prefetch=True), dict(keep_first=True, keep_last=True)])
def test_offload_is_bitwise_and_moves_the_layer_inputs_to_host(offload):
    _, ref_rows, ref = _run()
    model, rows, got = _run(**offload)
    assert all(torch.equal(got[n], ref[n]) for n in ref) and torch.equal(rows[-1]["loss"], ref_rows[-1]["loss"])
    moved = (LAYERS - offload.get("keep_first", False) - offload.get("keep_last", False)) * INPUT_BYTES
    for row, base in zip(rows, ref_rows):
        dev, host = row["between"]
        assert host == moved and base["between"][1] == 0  # the layer inputs, on the host
        assert base["between"][0] - dev == moved, (base["between"], row["between"])  # ... and off the device
        assert row["device_peak"] <= base["device_peak"]
    pool = offloader_of(model).pool
    assert pool.allocated == moved and len(pool.free) * INPUT_BYTES == moved  # one buffer per input, reused


def test_offload_prefetches_the_previous_layer_while_this_one_runs_backward():
    log: list = []
    model = offload_checkpoints(_model({"use_reentrant": False}), prefetch=True, log=log)
    _step(model)
    offloads = [("offload", i) for i in range(LAYERS)]
    backward = [("fetch", LAYERS - 1)]
    for i in range(LAYERS - 2, -1, -1):
        backward += [("prefetch", i), ("fetch", i)]
    assert log == offloads + backward, log
    log.clear()
    _step(model)  # the next step reuses every buffer
    assert log == offloads + backward and offloader_of(model).pool.allocated == LAYERS * INPUT_BYTES


def test_two_forwards_before_backward_get_their_own_buffers():
    """A second forward while the first graph is alive must not overwrite the first one's host copies."""
    ref_model = _model({"use_reentrant": False})
    (ref_model(input_ids=IDS).logits.sum() + ref_model(input_ids=IDS.flip(1)).logits.square().sum()).backward()
    model = offload_checkpoints(_model({"use_reentrant": False}))
    a = model(input_ids=IDS).logits.sum()
    b = model(input_ids=IDS.flip(1)).logits.square().sum()
    assert offloader_of(model).pool.allocated == 2 * LAYERS * INPUT_BYTES
    (a + b).backward()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad), n
    unoffload_checkpoints(model)
    assert offloader_of(model) is None


@pytest.mark.parametrize(
    "checkpoint,match", [(None, "gradient_checkpointing=False"), ({"use_reentrant": True}, "use_reentrant=True")]
)
def test_offload_refuses_a_layer_that_is_not_checkpointed_non_reentrantly(checkpoint, match):
    model = offload_checkpoints(_model(checkpoint))
    with pytest.raises(ConfigError, match=match):
        model(input_ids=IDS)
    with torch.no_grad():  # no backward, nothing to offload: runs
        model(input_ids=IDS)
    with pytest.raises(ConfigError, match="decoder layers"):
        offload_checkpoints(torch.nn.Linear(2, 2))


def test_tracker_tells_host_buffers_from_the_rest():
    t = StorageTracker()
    with t:
        buf = host_buffer(4000)
        x = torch.empty(250, dtype=torch.float32)  # 1000 B, device-resident
        buf[:1000].view(torch.float32).copy_(x)
        assert (t.host_live, t.device_live) == (4000, 1000) and is_host(buf[8:]) and not is_host(x)
        del buf
        assert (t.host_live, t.device_live) == (0, 1000)
    assert (t.host_peak, t.device_peak, t.peak) == (4000, 1000, 5000)


# ---- tiled RMSNorm (hybrid_cp.training.tiled.tile_norm) ----


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])  # block + final norms; q/k norms; (1 + w) norms
def test_tiled_norm_matches_the_stock_norms_in_fp64(kind):
    from train_cases import make_batch, reference, tiny_model

    from hybrid_cp.training.tiled import tile_norm, tiled_norm_chunk, untile_norm

    batch = make_batch(5, 2, 50, pad=True)
    ref_logits, ref_loss, ref_grads = reference(tiny_model(kind, 2).double(), batch)
    model = tile_norm(tiny_model(kind, 2).double(), 7)
    assert tiled_norm_chunk(model) == 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logits, loss, grads = reference(model, batch)
    rel = {n: relative_error(grads[n], ref_grads[n]) for n in ref_grads}
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)  # forward: the same arithmetic
    # fp64 round-off of the weight gradient's sum over chunks (worst 5.8e-16, 1700x); Gemma's norm computes in fp32
    # whatever the input, so its sum rounds in fp32 (worst 1.6e-7, 6.3x)
    within(
        max(rel.values()),
        1e-6 if kind == "gemma3" else 1e-12,
        "worst parameter grad",
        max(rel.items(), key=lambda kv: kv[1]),
    )
    untile_norm(model)
    assert tiled_norm_chunk(model) is None and "forward" not in model.model.norm.__dict__
    with pytest.raises(ConfigError, match="RMSNorm"):
        tile_norm(torch.nn.Linear(2, 2))


def test_tiled_norm_keeps_no_fp32_copy():
    """bf16 [T, E]: the stock norm keeps its fp32 upcast and the normalised value (6 bytes per element)
    for backward; tiled it keeps nothing beyond its input, and its working set is one chunk."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hybrid_cp.training.tiled import tile_norm

    tokens, hidden, chunk = 4096, 256, 256
    x0 = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    dy = torch.randn_like(x0)
    res = {}
    for tiled in (False, True):
        holder = torch.nn.Module()
        holder.norm = LlamaRMSNorm(hidden).to(torch.bfloat16)
        if tiled:
            tile_norm(holder, chunk)
        x = x0.clone().requires_grad_()
        t = StorageTracker()
        with t:
            t.track(x, dy, list(holder.parameters()))
            start = t.live
            y = holder.norm(x)
            kept = t.live - start - y.numel() * 2
            y.backward(dy)
        fixed = 2 * y.numel() * 2 + hidden * 2  # the output, d(input), d(weight): every variant has them
        res[tiled] = (kept, t.peak - start - fixed, x.grad.clone(), holder.norm.weight.grad.clone())
    element = tokens * hidden
    assert res[False][0] >= 6 * element and res[True][0] == 0, (res[False][0], res[True][0])
    # the recomputed chunk's fp32/bf16 temporaries (measured 26 bytes per chunk element) against about 88 per
    # element of the whole input for the stock norm
    assert res[True][1] <= 32 * chunk * hidden < res[False][1] / 10, (res[True][1], res[False][1])
    assert torch.equal(res[True][2], res[False][2])  # d(input): each token's own arithmetic, bitwise


# ---- module-level head chunks: attention forwards per layer ----


@pytest.mark.parametrize(
    "checkpoint,keep,expected", [(True, None, 2), (False, True, 1), (False, None, 2), (True, False, 3)]
)
def test_module_chunks_attention_forwards_per_layer(pool, checkpoint, keep, expected):
    """The chunk pipeline keeps each stage's output and lse (by default inside checkpointed layers): its
    backward then runs no attention forward, so a checkpointed layer runs attention twice (forward,
    recomputation) and, with keep_attention_output=True, an unchecked one once; the gradients are
    bitwise those of recomputing attention."""
    for row in pool.run(
        memory_cases.attention_forward_counts, u=2, r=2, head_chunks=2, checkpoint=checkpoint, keep=keep
    ):
        assert row["count"] == expected and row["diff"] == 0, row


def test_every_runtime_option_on_a_mesh_trains_like_single_process(pool):
    """Offload + tiled norm + tiled MLP + tiled loss + module head chunks + FSDP2 + checkpointing on u=2 x r=2."""
    for rank, row in enumerate(
        pool.run(
            memory_cases.tiled_model_parity,
            u=2,
            r=2,
            hkv=2,
            heads=8,
            head_chunks=2,
            fsdp=True,
            checkpoint=True,
            offload=True,
            norm_chunk=7,
            overlap=False,
        )
    ):
        assert not row["missing"], row
        # fp32 round-off of the tiled/chunked sums against one process: worst 6.0e-7 (grad; loss 0), 17x
        within(row["loss"], 1e-5, f"rank {rank} loss", row)
        within(row["grad"], 1e-5, f"rank {rank} grad", row)
