"""CPMesh construction and the local kernels (single process, against autograd references)."""

import math

import dist_cases
import pytest
import torch
from dist_cases import reference
from tolerance import allclose_ratio, relative_error, within

import hybrid_cp as hcp
from hybrid_cp.engine.kernels import MathKernel, SDPAKernel, get_kernel
from hybrid_cp.engine.kernels.merge import merge_


def test_mesh_validation_and_plan(pool8):
    for rank, res in enumerate(pool8.run(dist_cases.mesh_errors)):
        assert "does not divide the world size 8" in res["not_divisor"] and "ulysses=4, ring=2" in res["not_divisor"]
        assert "use dp=2" in res["bad_dp"]
        assert "positive integer" in res["zero"]
        assert "spiral" in res["layout"] and "zigzag" in res["layout"]
        assert res["plan"] == (2, 2, 2, 4, ["dp", "ring", "ulysses"])
        g, dp, ring, uly, nxt, prv = res["ranks"]
        assert g == rank and g == (dp * 2 + ring) * 2 + uly  # ulysses innermost
        assert nxt == prv == dp * 4 + (1 - ring) * 2 + uly  # the other ring rank (ring = 2)
        assert res["planned"][0] == res["planned"][1]  # a topology plan builds its mesh


def test_destroyed_mesh_frees_its_groups_and_refuses_use(pool):
    for res in pool.run(dist_cases.destroyed_mesh, u=2, r=2):
        assert res["alive"] == 0 and res["fsdp_again"], res  # nothing holds the groups; a new mesh trains
        for use in ("attention", "loss"):
            assert "destroyed by hcp.destroy_cp_mesh" in res[use], res


# a kernel against the fp64 reference on 33 keys: fp64 round-off (worst 7.5e-16, 1300x), fp32 round-off (worst
# 5.7e-7, sdpa dk: 18x)
FP64, FP32 = 1e-12, 1e-5
# the hand-computed merges in fp32: torch.allclose's defaults (fp32 round-off of one exp and one division; worst 0:
# these small values are exact in fp32)
MERGE_RTOL, MERGE_ATOL = 1e-5, 1e-8


@pytest.mark.parametrize(
    "kernel,dtype,tol",
    [(MathKernel(), torch.float64, FP64), (MathKernel(), torch.float32, FP32), (SDPAKernel(), torch.float32, FP32)],
    ids=["math64", "math32", "sdpa32"],
)
@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_forward_backward(kernel, dtype, tol, hkv, causal):
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 33, 4, 16, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 33, hkv, 16, generator=g, dtype=dtype) for _ in range(2))
    scale = 0.3
    ref = reference(q, k, v, dout, causal, scale)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    for name, got, want in zip(["out", "lse", "dq", "dk", "dv"], (out, lse) + tuple(grads), ref):
        assert got.shape == want.shape, name
        within(relative_error(got, want), tol, name)


def test_merge_is_safe_for_rows_without_keys():
    out = torch.zeros(1, 3, 1, 2)
    lse = torch.full((1, 1, 3), float("-inf"))
    block_out = torch.tensor([[[[1.0, 2.0]], [[0.0, 0.0]], [[3.0, 4.0]]]])
    block_lse = torch.tensor([[[0.5, float("-inf"), 1.0]]])
    merge_(out, lse, block_out, block_lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0, 1], torch.zeros(1, 2)) and lse[0, 0, 1] == float("-inf")
    within(allclose_ratio(out[0, 0, 0], torch.tensor([1.0, 2.0]), MERGE_RTOL, MERGE_ATOL), 1.0, "one block out")
    assert lse[0, 0, 0] == 0.5
    # merging two halves equals attention over the union
    merge_(out, lse, torch.tensor([[[[3.0, 0.0]], [[5.0, 5.0]], [[1.0, 0.0]]]]), torch.tensor([[[0.5, 2.0, 1.0]]]))
    within(allclose_ratio(out[0, 0, 0], torch.tensor([2.0, 1.0]), MERGE_RTOL, MERGE_ATOL), 1.0, "two blocks out")
    within(allclose_ratio(lse[0, 0, 0], torch.tensor(0.5 + math.log(2)), MERGE_RTOL, MERGE_ATOL), 1.0, "two blocks lse")
    within(allclose_ratio(out[0, 1, 0], torch.tensor([5.0, 5.0]), MERGE_RTOL, MERGE_ATOL), 1.0, "empty then one out")
    assert lse[0, 0, 1] == 2.0


def test_backend_selection_errors_and_custom_kernel():
    cpu = torch.device("cpu")
    assert get_kernel("auto", cpu, torch.float32, 64).name == "sdpa"
    assert get_kernel("auto", cpu, torch.float64, 64).name == "math"
    with pytest.raises(ValueError, match="backend='math' for fp64"):
        get_kernel("sdpa", cpu, torch.float64, 64)
    with pytest.raises(ValueError, match="not a registered attention kernel"):
        get_kernel("nope", cpu, torch.float32, 64)
    with pytest.raises(ValueError, match="flash-attn"):
        get_kernel("flash", cpu, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="already registered"):
        hcp.register_kernel("math", MathKernel())

    class Counting(MathKernel):
        name = "counting"
        calls = 0

        def forward(self, *a, **kw):
            Counting.calls += 1
            return super().forward(*a, **kw)

    hcp.register_kernel("counting-test", Counting(), overwrite=True)
    assert get_kernel("counting-test", cpu, torch.float64, 8).name == "counting"
    with pytest.raises(TypeError, match="must provide"):
        hcp.register_kernel("broken", object())
