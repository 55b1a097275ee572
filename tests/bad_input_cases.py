"""The rank side of the bad-input campaign (tests/test_bad_inputs.py): every case's code runs on every rank of
a 4-rank gloo pool, and what it ended in (returned, or which error with which message, after how long) comes
back for grading. One task runs every case, so the pool is started and the meshes are built once.

A case is one line of Python run with the names of `namespace()`: `rank`; meshes `M` (2 x 2 zigzag, the
default validate=True), `A` (2 x 2 zigzag, validate="always": cases where one rank differs), `C` (1 x 4
contiguous, validate="always") and `D` (destroyed); `fresh(u, r, **kw)` builds a mesh that is destroyed after
the case; `qkv(n, ...)` full fp64 q, k, v; `ref(...)` single-device attention; `near(got, want, tol)` asserts.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybrid_cp as hcp
from hybrid_cp.engine.layout import forget_shards

_STATE: dict = {}
_ERRORS: list[tuple[float, float]] = []  # (error, tol) of each `near` in the current case (reported with its outcome)
TIMEOUT_S = 6.0  # the campaign meshes' group timeout


def _meshes() -> dict:
    """The campaign's meshes, built once per worker (every rank builds them in the same order)."""
    if not _STATE:
        short = datetime.timedelta(seconds=TIMEOUT_S)  # a case that leaves ranks waiting fails, it does not hang
        _STATE["M"] = hcp.init_cp_mesh(2, 2, timeout=short)
        _STATE["A"] = hcp.init_cp_mesh(2, 2, validate="always", timeout=short)
        _STATE["C"] = hcp.init_cp_mesh(1, 4, layout="contiguous", validate="always", timeout=short)
        _STATE["D"] = hcp.init_cp_mesh(2, 2)
        hcp.destroy_cp_mesh(_STATE["D"])
        _STATE["sync"] = dist.new_group(backend="gloo")  # the harness's own: no case uses it
        tiny()  # imports transformers' models once, so that no case's time holds it
    return _STATE


def qkv(n: int, h: int = 4, hkv: int | None = None, d: int = 8, b: int = 1, seed: int = 0, dtype=torch.float64):
    """Full-row q, k, v [b, n, h, d], the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, n, h, d), (b, n, hkv or h, d), (b, n, hkv or h, d)]
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes)


def ref(q, k, v, causal: bool = True, cu=None, scale: float | None = None, window=None) -> torch.Tensor:
    """Single-device attention in fp64 on full rows [B, S, H, D] (documents of `cu` kept apart)."""
    q, k, v = (x.double() for x in (q, k, v))
    n, h = q.shape[1], q.shape[2]
    k, v = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or 1 / math.sqrt(q.shape[3]))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if cu is not None:
        doc = torch.bucketize(torch.arange(n), torch.tensor(list(cu[1:])), right=True)
        allowed &= doc[:, None] == doc[None]
    if window is not None:
        left, right = (window - 1, 0) if causal else window
        allowed &= (j >= i - left) & (j <= i + right)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(~allowed, float("-inf")), -1), v)


def near(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Assert the largest error relative to the largest reference magnitude is within `tol`."""
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()
    _ERRORS.append((err, tol))
    assert err <= tol, f"error {err:.3g} > {tol:g}"


def attend(
    cp,
    n: int,
    *,
    causal: bool = True,
    cu=None,
    dtype=torch.float64,
    h: int = 4,
    hkv: int | None = None,
    tol: float = 1e-10,
    **kwargs,
) -> None:
    """Shard, attend, unshard and compare with `ref` (a legal input must give the right result)."""
    q, k, v = qkv(n, h, hkv, dtype=dtype)
    ql, kl, vl = (hcp.shard(x, cp, cu_seqlens=cu) for x in (q, k, v))
    out = hcp.attention(ql, kl, vl, cp, causal=causal, cu_seqlens=cu, seq_len=None if cu is not None else n, **kwargs)
    full = hcp.unshard(out, cp, seq_len=None if cu is not None else n, cu_seqlens=cu)
    near(full, ref(q, k, v, causal, cu, kwargs.get("softmax_scale"), kwargs.get("window")), tol)


def tiny(kind: str = "llama"):
    from hybrid_cp.testing.families import tiny_model

    return tiny_model(kind, seed=0).double()


def folder(name: str) -> str:
    """A folder every rank names alike (under the pytest process's id): checkpoint cases."""
    return os.path.join(tempfile.gettempdir(), f"hybrid-cp-bad-inputs-{os.getppid()}", name)


def fault_save(where: str) -> None:
    """Save step 1, then step 2 with a full disk on one rank (rank 0 while publishing, or rank 2 while DCP writes
    its shard): every rank must raise SetupError saying so, and step 1 must still load (asserted here)."""
    import warnings

    import hybrid_cp.training.checkpoint as ckpt

    cp, d = _STATE["M"], folder(f"fault-{where}")
    model = torch.nn.Linear(4, 4).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hcp.save_checkpoint(d, 1, model, opt, cp)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    target, name = (ckpt, "_write_durably") if where == "publish" else (os, "fsync")
    original = getattr(target, name)
    if dist.get_rank() == (0 if where == "publish" else 2):
        setattr(target, name, full)
    try:
        hcp.save_checkpoint(d, 2, model, opt, cp)
        raise AssertionError("save_checkpoint went on with a full disk")
    except hcp.SetupError as exc:
        assert "No space left" in str(exc), exc
    finally:
        setattr(target, name, original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "skipping partial checkpoint ...step-00000002.tmp"
        info = hcp.load_checkpoint(d, model, opt, cp)
    assert info is not None and info.step == 1, info


def namespace(fresh_meshes: list) -> dict:
    def fresh(u: int, r: int, timeout_s: float = TIMEOUT_S, **kwargs):  # 2 s timed out once at load ~105
        cp = hcp.init_cp_mesh(u, r, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        fresh_meshes.append(cp)
        return cp

    import numpy as np

    return dict(
        hcp=hcp,
        torch=torch,
        F=F,
        np=np,
        math=math,
        rank=dist.get_rank(),
        qkv=qkv,
        ref=ref,
        near=near,
        attend=attend,
        tiny=tiny,
        folder=folder,
        fresh=fresh,
        fault_save=fault_save,
        os=os,
        **{k: v for k, v in _meshes().items() if k != "sync"},
    )


class _Logged(logging.Handler):
    """The warnings hybrid-cp logs during one case."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:600])


def _outcome(code: str) -> dict:
    """Run one case's code; what it ended in."""
    made: list = []
    for cp in (_STATE["M"], _STATE["A"], _STATE["C"]):  # rows other cases sharded would make guesses right
        forget_shards(cp)
    torch.manual_seed(0)  # the same "random" tensors on every rank
    _ERRORS.clear()
    logged = _Logged()
    logging.getLogger("hybrid_cp").addHandler(logged)
    start = time.perf_counter()
    try:
        exec(compile(code, "<case>", "exec"), namespace(made))
        result = {"raised": None, "message": ""}
    except BaseException as exc:  # noqa: BLE001 (graded, including AssertionError of a wrong result)
        result = {"raised": type(exc).__name__, "message": str(exc)[:600], "typed": isinstance(exc, hcp.CPError)}
    result["seconds"] = round(time.perf_counter() - start, 2)
    logging.getLogger("hybrid_cp").removeHandler(logged)
    result["warnings"] = logged.messages
    result["errors"] = list(_ERRORS)
    for cp in made:
        try:
            hcp.destroy_cp_mesh(cp)
        except Exception:  # noqa: BLE001 (a mesh that timed out may not tear down cleanly)
            pass
    return result


def run_cases(codes: list[str]) -> list[dict]:
    """Every case on this rank, in order; the ranks meet on a group of their own after each case, so a
    case that left some ranks waiting (until the pool's short timeout) cannot pair with the next one."""
    _meshes()
    out = []
    for code in codes:
        out.append(_outcome(code))
        dist.barrier(group=_STATE["sync"])
    return out
