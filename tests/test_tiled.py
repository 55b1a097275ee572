"""Tiled loss and tiled MLP equal their untiled computations (forward and every gradient)."""

import memory_cases
import pytest
import torch
import torch.nn.functional as F
from tolerance import relative_error, within

import hybrid_cp as hcp
from hybrid_cp.engine.mesh import CPMesh
from hybrid_cp.training.loss import cross_entropy
from hybrid_cp.training.tiled import (
    default_loss_chunk,
    lm_loss,
    tile_mlp,
    tiled_cross_entropy,
    tiled_mlp_chunk,
    untile_mlp,
)

pytest.importorskip("transformers")

# fp32 round-off of a chunked sum/recomputation vs the untiled one: worst 6.0e-7 over the recorded runs (grads on
# (4, 2) with FSDP2; the last session measured 7.1e-7; tiled MLP outputs 2.1e-7): a 14x margin
TOL = 1e-5


def _one() -> CPMesh:
    """A 1-rank mesh description (no process groups: nothing is communicated at cp.size == 1)."""
    from test_training import _fake_mesh

    return _fake_mesh(1, 1, 0)


def _rel(a, b):
    return relative_error(a, b, floor=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_loss_equals_full_logits(dtype, chunk, reduction):
    g = torch.Generator().manual_seed(3)
    h0 = torch.randn(3, 29, 24, generator=g, dtype=dtype)
    w0 = torch.randn(101, 24, generator=g, dtype=dtype) / 5
    b0 = torch.randn(101, generator=g, dtype=dtype)
    labels = torch.randint(0, 101, (3, 29), generator=g)
    labels[1, 10:] = -100
    labels[2, :] = -100
    cp = _one()
    outs = []
    for tiled in (False, True):
        h, w, b = (x.clone().requires_grad_() for x in (h0, w0, b0))
        if tiled:
            loss = tiled_cross_entropy(h, w, labels, cp, reduction=reduction, bias=b, chunk_tokens=chunk)
        else:
            loss = cross_entropy(F.linear(h, w, b), labels, cp, reduction=reduction)
        loss.backward()
        outs.append((loss.detach(), h.grad, w.grad, b.grad))
    (l0, *g0), (l1, *g1) = outs
    full = F.cross_entropy(F.linear(h0, w0, b0).reshape(-1, 101).float(), labels.reshape(-1), reduction=reduction)
    within(_rel(l1, full), TOL, "loss vs F.cross_entropy")
    within(_rel(l1, l0), TOL, "loss vs untiled")
    for name, a, b in zip(("hidden", "weight", "bias"), g1, g0):
        assert a.dtype == b.dtype
        within(_rel(a, b), TOL, f"d{name}")
    assert (g1[0][2] == 0).all()  # a row without a valid label gets no gradient


def test_tiled_loss_no_valid_token_and_bf16():
    cp = _one()
    h = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    loss = tiled_cross_entropy(h, w, torch.full((2, 8), -100), cp, chunk_tokens=3)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0
    hb, wb = (x.detach().bfloat16().requires_grad_() for x in (h, w))
    labels = torch.randint(0, 40, (2, 8))
    lb = tiled_cross_entropy(hb, wb, labels, cp, chunk_tokens=5)
    lb.backward()
    ref = F.cross_entropy(F.linear(hb.float(), wb.float()).reshape(-1, 40), labels.reshape(-1))
    # bf16 logits (one rounding, 4e-3 relative, of values near the loss's log(40) = 3.7): worst 3.2e-4, 62x
    within(abs(lb.item() - ref.item()) / ref.item(), 2e-2, "bf16 loss")
    assert wb.grad.dtype == torch.bfloat16
    assert default_loss_chunk(128256) == 523 and default_loss_chunk(1) == 64 << 20


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(reduction="none"), "reduction='none'"),
        (dict(chunk_tokens=0), "chunk_tokens=0"),
        (dict(weight=torch.randn(40, 15)), r"weight.shape=\(40, 15\)"),
        (dict(labels=torch.zeros(2, 7, dtype=torch.long)), r"labels.shape=\(2, 7\)"),
        (dict(labels=torch.full((2, 8), 40)), "outside the vocabulary"),
        (dict(bias=torch.zeros(3)), r"bias must be a \[40\]"),
    ],
)
def test_tiled_loss_rejects_bad_input(kwargs, match):
    args = dict(
        hidden=torch.randn(2, 8, 16), weight=torch.randn(40, 16), labels=torch.zeros(2, 8, dtype=torch.long), cp=_one()
    )
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        tiled_cross_entropy(**args)


def _tiny(seed=0, **kw):
    from train_cases import tiny_model

    return tiny_model("llama", 2, seed=seed, **kw)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 13, 4096])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_tiled_mlp_matches_untiled(chunk, checkpoint):
    from train_cases import make_batch, reference

    batch = make_batch(5, 2, 50, pad=True)
    ref_logits, ref_loss, ref_grads = reference(_tiny(), batch)
    model = tile_mlp(_tiny(), chunk)
    assert tiled_mlp_chunk(model) == chunk
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logits, loss, grads = reference(model, batch)
    within(_rel(logits, ref_logits), TOL, "logits")
    within(_rel(loss, ref_loss), TOL, "loss")
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        within(_rel(grads[n], ref_grads[n]), TOL, f"grad {n}")
    untile_mlp(model)
    assert tiled_mlp_chunk(model) is None and "forward" not in model.model.layers[0].mlp.__dict__


def test_tiled_mlp_input_gradient_and_no_grad():
    mlp_ref = _tiny().model.layers[0].mlp
    model = tile_mlp(_tiny(), 5)
    mlp = model.model.layers[0].mlp
    x0 = torch.randn(3, 11, 32, dtype=torch.float32)
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ya, yb = mlp_ref(xa), mlp(xb)
    within(_rel(yb, ya), TOL, "output")
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    within(_rel(xb.grad, xa.grad), TOL, "input grad")
    for (n, p), q in zip(mlp.named_parameters(), mlp_ref.parameters()):
        within(_rel(p.grad, q.grad), TOL, f"grad {n}")
    with torch.no_grad():
        within(_rel(mlp(x0), mlp_ref(x0)), TOL, "no_grad output")
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        tile_mlp(model, 0)
    with pytest.raises(ValueError, match="no submodule named 'mlp'"):
        tile_mlp(torch.nn.Linear(2, 2))


def test_lm_loss_single_process_equals_logits_path():
    from train_cases import make_batch, reference

    batch = make_batch(9, 2, 40, pad=True)
    _, ref_loss, ref_grads = reference(_tiny(), batch)
    model = _tiny()
    local = hcp.shard_batch(batch, _one())
    loss = lm_loss(model, local, _one(), chunk_tokens=7)
    loss.backward()
    within(_rel(loss.detach(), ref_loss), TOL, "loss")
    grads = _grads(model)
    for n in ref_grads:
        within(_rel(grads[n], ref_grads[n]), TOL, f"grad {n}")
    assert "forward" not in model.lm_head.__dict__  # the head is restored


@pytest.mark.parametrize(
    "u,r,include_dp,reduction",
    [(2, 2, False, "mean"), (4, 2, False, "sum"), (1, 8, False, "mean"), (2, 2, True, "mean")],
)
def test_tiled_loss_on_meshes(pool, u, r, include_dp, reduction):
    for s in (37, 5):  # s=5 on u*r=8 leaves ranks with only padding
        for rank, row in enumerate(
            pool.run(memory_cases.tiled_loss_parity, u=u, r=r, s=s, include_dp=include_dp, reduction=reduction)
        ):
            assert row["finite"]
            for key in ("loss", "hidden", "weight", "bias"):
                within(row[key], TOL, f"s={s} rank {rank} {key}", row)


def test_tiled_loss_empty_group_and_bad_label(pool):
    for row in pool.run(memory_cases.tiled_loss_parity, u=2, r=2, s=16, empty=True):
        assert row["value"] == 0.0 and row["hidden"] == 0.0 and row["weight"] == 0.0
    for msg in pool.run(memory_cases.tiled_loss_bad_label, u=2, r=2):
        assert msg is not None and "outside the vocabulary" in msg


@pytest.mark.parametrize("u,r,fsdp,checkpoint", [(2, 2, True, False), (4, 2, True, True), (2, 1, False, False)])
def test_tiled_loss_and_mlp_train_like_single_process(pool, u, r, fsdp, checkpoint):
    hkv = 1 if u == 4 else 2
    for rank, row in enumerate(
        pool.run(memory_cases.tiled_model_parity, u=u, r=r, hkv=hkv, fsdp=fsdp, checkpoint=checkpoint)
    ):
        assert not row["missing"], row
        within(row["loss"], TOL, f"rank {rank} loss", row)
        within(row["grad"], TOL, f"rank {rank} grad", row)
