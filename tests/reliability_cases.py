"""Task functions for the reliability tests: fault scenarios (own short-lived process groups),
error-catalogue examples and validation checks (on the session pool)."""

from __future__ import annotations

import datetime
import math
import os
import time
import traceback

import torch
import torch.distributed as dist

import hybrid_cp as hcp
from hybrid_cp.engine.agreement import history as validation_history
from hybrid_cp.engine.kernels import get_kernel, register_kernel


def mesh(u: int, r: int, layout: str = "zigzag", validate="always") -> hcp.CPMesh:
    """The pool's cached meshes (dist_cases.mesh); the error and fuzz cases make single ranks call
    differently, so by default they check every call."""
    from dist_cases import mesh as cached

    return cached(u, r, layout, validate)


# ----------------------------------------------------------------------------- fault injection


class _FaultyKernel:
    """The math kernel, except that on the victim rank it dies (os._exit) or raises, in forward or
    backward, once armed: a fault in the middle of hcp.attention, after the first collectives."""

    name = "faulty"

    def __init__(self):
        self.inner = get_kernel("math", torch.device("cpu"), torch.float32, 16)
        self.fault: tuple[str, str] | None = None  # (phase, kind)

    def supports(self, *args, **kwargs):
        return self.inner.supports(*args, **kwargs)

    def _maybe_fail(self, phase: str) -> None:
        if self.fault is not None and self.fault[0] == phase:
            if self.fault[1] == "kill":
                os._exit(17)
            raise RuntimeError(f"injected failure in {phase} on this rank only")

    def forward(self, *args, **kwargs):
        self._maybe_fail("forward")
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self._maybe_fail("backward")
        return self.inner.backward(*args, **kwargs)

    def __getattr__(self, item):  # anything else the engine asks of a kernel (keywords it takes, ...)
        return getattr(self.__dict__["inner"], item)


def fault_worker(
    rank: int,
    world: int,
    init_method: str,
    u: int,
    r: int,
    phase: str,
    kind: str,
    victim: int,
    timeout_s: float,
    results,
    head_chunks: int = 1,
) -> None:
    """One rank of a fault scenario: one call (forward, backward) with the victim's kernel armed, or
    (kind "deviate") after one agreed call, the victim alone calling with another mask, which the
    default validation (validate=True) does not check on the other ranks; every rank reports
    (error type, message, seconds from the call to the error)."""
    try:
        torch.set_num_threads(1)
        # A patient store (processes start slowly on a loaded machine), a short collective timeout.
        store = dist.FileStore(init_method.removeprefix("file://"), world)
        store.set_timeout(datetime.timedelta(seconds=90))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90)
        )  # only the barriers use it
        cp = hcp.init_cp_mesh(u, r, timeout=datetime.timedelta(seconds=timeout_s))
        dist.barrier()
        kernel = _FaultyKernel()
        register_kernel("faulty", kernel, overwrite=True)
        g = torch.Generator().manual_seed(rank)
        n_local, h, d = 8, 4, 16
        q, k, v = (torch.randn(1, n_local, h, d, generator=g, requires_grad=True) for _ in range(3))
        seq = n_local * cp.size
        causal = True
        if kind == "deviate":  # the first call agrees (and is checked); the next is predicted the same
            hcp.attention(q, k, v, cp, causal=True, backend="faulty", seq_len=seq).sum().backward()
            causal = rank != victim
        dist.barrier()  # on the default group (90 s): no other warm-up call, so that a rank descheduled
        # for longer than the short timeout on a loaded machine cannot fail before the fault is armed
        if rank == victim and kind != "deviate":
            kernel.fault = (phase, kind)
        t0 = time.monotonic()
        try:
            out = hcp.attention(q, k, v, cp, causal=causal, backend="faulty", seq_len=seq, head_chunks=head_chunks)
            out.sum().backward()
            results.put((rank, "no error", "", time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001 - the test asserts on the type
            results.put((rank, type(exc).__name__, str(exc)[:400], time.monotonic() - t0))
            if rank == victim and kind == "raise":
                time.sleep(2 * timeout_s)  # stay alive without calling: peers must still time out
    except BaseException:  # noqa: BLE001
        results.put((rank, "harness", traceback.format_exc()[-600:], -1.0))


# ----------------------------------------------------------------------------- error catalogue


def run_examples(examples: list[dict]) -> list[dict]:
    """Run each docs/errors.md example on every rank; report what each raised."""
    import hybrid_cp.errors as errors

    out = []
    for ex in examples:
        env = {
            "hcp": hcp,
            "torch": torch,
            "dist": dist,
            "mesh": mesh,
            "rank": dist.get_rank(),
            "datetime": datetime,
            "math": math,
        }
        try:
            exec(compile(ex["code"], f"<errors.md: {ex['name']}>", "exec"), env)
            out.append({"name": ex["name"], "raised": None, "message": ""})
        except Exception as exc:  # noqa: BLE001
            expected = getattr(errors, ex["name"])
            out.append(
                {
                    "name": ex["name"],
                    "raised": type(exc).__name__,
                    "ok": isinstance(exc, expected),
                    "message": str(exc)[:300],
                }
            )
    return out


def group_timeouts(seconds: float | None) -> dict:
    """The timeouts of every group a mesh holds (to check `timeout=` and its default)."""
    t = None if seconds is None else datetime.timedelta(seconds=seconds)
    cp = hcp.init_cp_mesh(2, 2, timeout=t)
    dev = torch.device("cpu")
    got = {
        name: getattr(cp, name)._get_backend(dev).options._timeout.total_seconds()
        for name in ("ulysses_group", "ring_group", "ring_group_bwd", "cp_group", "check_group")
    }
    default = hcp.engine.mesh.default_timeout().total_seconds()
    hcp.destroy_cp_mesh(cp)
    return {"groups": got, "default": default}


def validation_counts(u: int, r: int, steps: int, validate) -> dict:
    """Run `steps` identical calls and report how many checks of each kind ran."""
    cp = mesh(u, r, validate=validate)
    history = validation_history(cp)
    history.validation_calls.clear()
    history.signatures.clear()  # a shared mesh: start from nothing learned
    history.signature_period = None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4, 16, generator=g) for _ in range(3))
    for _ in range(steps):
        hcp.attention(q, k, v, cp, causal=True, seq_len=8 * cp.size)
    return dict(history.validation_calls)


def learned_validation(u: int, r: int) -> dict:
    """validate=True on real calls: checks per step of a loop whose steps start with a non-causal
    call and then alternate full and sliding-window layers (forward and backward); then a first
    call that differs on one rank, which is new to every rank, so every rank checks and raises."""
    cp = hcp.init_cp_mesh(u, r)  # a fresh mesh: nothing learned yet
    g = torch.Generator().manual_seed(0)
    n = 8 * cp.size
    q, k, v = (torch.randn(1, 8, 4, 16, generator=g, requires_grad=True) for _ in range(3))
    per_step = []
    for _ in range(4):
        before = validation_history(cp).validation_calls["hash"]
        out = hcp.attention(q, k, v, cp, causal=False, seq_len=n)
        for layer in range(4):
            out = out + hcp.attention(q, k, v, cp, causal=True, seq_len=n, window=4 if layer % 2 else None)
        out.sum().backward()
        per_step.append(validation_history(cp).validation_calls["hash"] - before)
    fresh = hcp.init_cp_mesh(u, r)
    try:
        hcp.attention(q, k, v, fresh, causal=dist.get_rank() % cp.size != 1, seq_len=n)
        first = "no error"
    except hcp.InconsistentRanksError as exc:
        first = str(exc)
    skipped = validation_history(cp).validation_calls["skipped"]
    hcp.destroy_cp_mesh(cp)
    hcp.destroy_cp_mesh(fresh)
    return {"per_step": per_step, "skipped": skipped, "first_call": first}


def nonfinite_debug(u: int, r: int, bad_rank: int, tensor: str) -> str:
    """validate="debug": NaN in one rank's q/k/v raises NonFiniteError on every rank."""
    cp = mesh(u, r, validate="debug")
    g = torch.Generator().manual_seed(1)
    t = {name: torch.randn(1, 8, 4, 16, generator=g) for name in "qkv"}
    if dist.get_rank() == bad_rank:
        t[tensor][0, 3, 1, 2] = float("nan")
    try:
        hcp.attention(t["q"], t["k"], t["v"], cp, causal=True, seq_len=8 * cp.size)
        return "no error"
    except hcp.NonFiniteError as exc:
        return str(exc)


# ----------------------------------------------------------------------------- numerics


def _ref_fp64(q, k, v, causal: bool, scale: float):
    """fp64 attention on the full sequence (masked scores filled with -inf)."""
    h = q.shape[2]
    ke, ve = (x.double().repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), ke) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), ve)


def _run_cp(cp, q, k, v, causal, scale, dtype, backend="auto", grad=False):
    n = q.shape[1]
    ql, kl, vl = (hcp.shard(x.to(dtype), cp).detach().requires_grad_(grad) for x in (q, k, v))
    out = hcp.attention(ql, kl, vl, cp, causal=causal, softmax_scale=scale, seq_len=n, backend=backend)
    keep = torch.nonzero(hcp.positions(n, cp) < n).flatten()
    return out, ql, kl, vl, keep


def numerics_extremes(u: int, r: int) -> dict:
    """Relative errors against fp64 for extreme logits, all-equal scores, fp16/bf16 inputs."""
    cp = mesh(u, r)
    n, h, d = 24 * cp.size, 4, 16
    g = torch.Generator().manual_seed(7)
    unit = lambda: torch.nn.functional.normalize(torch.randn(1, n, h, d, generator=g, dtype=torch.float64), dim=-1)
    res = {}
    for causal in (True, False):
        for scale in (1.0, 1e2, 1e4):
            q, k, v = unit(), unit(), unit()
            out, *_, keep = _run_cp(cp, q, k, v, causal, scale, torch.float32)
            ref = hcp.shard(_ref_fp64(q, k, v, causal, scale), cp)
            # the error budget: the same fp32 inputs on one device, through the math kernel
            one = get_kernel("math", q.device, torch.float32, d).forward(
                q.float(), k.float(), v.float(), causal=causal, scale=scale
            )[0]
            base = (hcp.shard(one.double(), cp) - ref).abs().index_select(1, keep).max().item()
            res[f"scale={scale:g} causal={causal}"] = (out.double() - ref).abs().index_select(1, keep).max().item()
            res[f"base scale={scale:g} causal={causal}"] = base
            res[f"finite scale={scale:g} causal={causal}"] = bool(torch.isfinite(out).all())
        q = torch.zeros(1, n, h, d, dtype=torch.float64)  # all scores equal: out = mean of the visible v
        k, v = unit(), unit()
        out, *_, keep = _run_cp(cp, q, k, v, causal, None, torch.float32)
        ref = hcp.shard(_ref_fp64(q, k, v, causal, 1.0), cp)
        res[f"equal scores causal={causal}"] = (out.double() - ref).abs().index_select(1, keep).max().item()
        for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            q, k, v = (torch.randn(1, n, h, d, generator=g, dtype=torch.float64) * 3 for _ in range(3))
            out, *_, keep = _run_cp(cp, q, k, v, causal, None, dt)
            ref = hcp.shard(_ref_fp64(q.to(dt), k.to(dt), v.to(dt), causal, d**-0.5), cp)
            res[f"{name} causal={causal}"] = (
                (out.double() - ref).abs().index_select(1, keep).max() / ref.abs().max()
            ).item()
            res[f"{name} finite causal={causal}"] = bool(torch.isfinite(out).all())
    return res


def nan_confinement(u: int, r: int, tensor: str, causal: bool, where: str = "all") -> dict:
    """NaN at one token of one head of q, k or v (on the rank owning that token): which output rows
    and heads are NaN, against the rows the NaN reaches mathematically."""
    cp = mesh(u, r)
    n, h, hkv, d = 16 * cp.size, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, n, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    t, head = n // 3, 1  # token and (kv) head that get the NaN
    x = {"q": q, "k": k, "v": v}[tensor]
    x[0, t, head, 0] = float("nan")
    out, *_, keep = _run_cp(cp, q, k, v, causal, None, torch.float32)
    got = torch.isnan(hcp.unshard(out.detach(), cp, seq_len=n)).any(-1)[0]  # [n, h]
    expect = torch.zeros(n, h, dtype=torch.bool)
    rows = torch.arange(n)
    if tensor == "q":
        expect[t, head] = True
    else:  # keys/values at t reach the queries that see t, for the q heads of kv head `head`
        heads = slice(head * (h // hkv), (head + 1) * (h // hkv))
        seen = rows >= t if causal else torch.ones(n, dtype=torch.bool)
        expect[seen, heads] = True
    extra_rows = int((got.any(-1) & ~expect.any(-1)).sum())
    return {
        "exact": torch.equal(got, expect),
        "nan_rows": int(got.any(-1).sum()),
        "extra_rows": extra_rows,
        "block_rows": n // (2 * cp.ring_size) if cp.layout == "zigzag" else n // cp.ring_size,
        "expected_rows": int(expect.any(-1).sum()),
        "extra": int((got & ~expect).sum()),
        "missing": int((expect & ~got).sum()),
    }


def nan_confinements(u: int, r: int, combos: list) -> list[dict]:
    return [nan_confinement(u, r, tensor, causal) for tensor, causal in combos]


def determinism(u: int, r: int, layout: str, packed: bool, window) -> bool:
    """Two identical runs (forward and backward) are bitwise equal under deterministic algorithms."""
    torch.use_deterministic_algorithms(True)
    try:
        cp = mesh(u, r, layout)
        n, h, hkv, d = 20 * cp.size, 8, 2, 16
        cu = [0, n // 3, n // 3 + 5, n] if packed else None
        runs = []
        for _ in range(2):
            g = torch.Generator().manual_seed(11)
            q = torch.randn(1, n, h, d, generator=g)
            k, v = (torch.randn(1, n, hkv, d, generator=g) for _ in range(2))
            ql, kl, vl = (hcp.shard(x, cp, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
            kw = {"cu_seqlens": cu} if packed else {"seq_len": n}
            out = hcp.attention(ql, kl, vl, cp, causal=True, window=window, **kw)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            runs.append([out.detach(), ql.grad, kl.grad, vl.grad])
        return all(torch.equal(a, b) for a, b in zip(*runs))
    finally:
        torch.use_deterministic_algorithms(False)


# ----------------------------------------------------------------------------- loud configuration


def mesh_logs(local_world_size: int) -> list[tuple[str, str]]:
    """The hybrid_cp log records of one init_cp_mesh(4, 2) with LOCAL_WORLD_SIZE set as given."""
    import logging

    records: list = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    logger = logging.getLogger("hybrid_cp")
    handler, old_level, old_env = _Keep(), logger.level, os.environ.get("LOCAL_WORLD_SIZE")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    try:
        hcp.destroy_cp_mesh(hcp.init_cp_mesh(4, 2))
        cp = mesh(2, 2)
        hcp.shard(torch.zeros(1, 9, 2), cp)  # pads 9 tokens to 16: over 10%
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        if old_env is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = old_env
    return records


# ----------------------------------------------------------------------------- fuzzing

FUZZ_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
# relative error in the norm against fp64 on drawn shapes (down to one token, where dq is 0): fp64 round-off
# (worst 4.5e-15), fp32 round-off (worst 6.6e-7, 300x), bf16 one rounding of inputs and output (worst 4.0e-3, 7.6x)
FUZZ_LIMITS = {"fp64": 1e-9, "fp32": 2e-4, "bf16": 3e-2}


def fuzz_case(c: dict) -> dict:
    """One drawn call: matches the fp64 reference (relative error in the norm, forward and dq), or
    raises; reports which. A fault ("kind", who) breaks one argument on rank `who` (-1: all)."""
    from dist_cases import masked_reference, visibility

    cp = mesh(c["u"], c["r"])
    lens, h, hkv, d, causal, window = c["lens"], c["h"], c["hkv"], c["d"], c["causal"], c["window"]
    window = tuple(window) if isinstance(window, list) else window
    dtype = FUZZ_DTYPES[c["dtype"]]
    n = sum(lens)
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(1, n, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, n, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, n, h, d, generator=g, dtype=torch.float64)
    packed = c["packed"]
    skw = {"cu_seqlens": cu} if packed else {}
    ql, kl, vl = (hcp.shard(x.to(dtype), cp, **skw).requires_grad_() for x in (q, k, v))
    kw = dict(causal=causal, window=window, **({"cu_seqlens": cu} if packed else {"seq_len": n}))
    kind, who = c["fault"] if c["fault"] else (None, None)
    if kind is not None and who in (-1, dist.get_rank() % cp.size):
        if kind == "causal_flip":
            kw["causal"] = not causal
        elif kind == "bad_scale":
            kw["softmax_scale"] = -1.0
        elif kind == "int_dtype":
            ql = ql.detach().to(torch.int32)
        elif kind == "kv_heads":
            kl = vl = torch.zeros(kl.shape[0], kl.shape[1], h + 1, d, dtype=dtype)
        elif kind == "seq_len":
            kw.pop("cu_seqlens", None)
            kw["seq_len"] = n + 10 * cp.size * 2
        elif kind == "stride":
            ql = ql.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
        elif kind == "backend":
            kw["backend"] = "no-such-kernel"
        elif kind == "window_type":
            kw["window"] = "wide"
    try:
        out = hcp.attention(ql, kl, vl, cp, **kw)
        (out * hcp.shard(dout.to(dtype), cp, **skw)).sum().backward()
    except hcp.CPError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)[:200]}
    except Exception as exc:  # noqa: BLE001 - an undocumented error is a finding
        return {"raised": "UNDOCUMENTED " + type(exc).__name__, "message": str(exc)[:300]}
    ukw = {"cu_seqlens": cu} if packed else {"seq_len": n}
    full_out = hcp.unshard(out.detach().double(), cp, **ukw)
    full_dq = hcp.unshard(ql.grad.double(), cp, **ukw)
    ref = masked_reference(q.to(dtype), k.to(dtype), v.to(dtype), dout, d**-0.5, visibility(lens, causal, window))
    # relative to max(norm, 1): dq is exactly 0 for rows that see one key (a 1-token row), only round-off remains
    rel = lambda a, b: (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1.0)).item()  # noqa: E731
    return {"raised": None, "out": rel(full_out, ref[0]), "dq": rel(full_dq, ref[2])}


# ----------------------------------------------------------------------------- faults in save_checkpoint


def checkpoint_kill_worker(rank: int, world: int, init_method: str, folder: str, timeout_s: float, results) -> None:
    """One rank of "rank 0 killed in save_checkpoint right after the rename": steps 1 and 2 of a replicated
    model are saved; in step 2 rank 0 publishes (renames) the folder, then dies before telling the others.
    Every rank reports (error type, message, seconds, the step-2 weights it saved)."""
    import hybrid_cp.training.checkpoint as ckpt

    try:
        torch.set_num_threads(1)
        store = dist.FileStore(init_method.removeprefix("file://"), world)
        store.set_timeout(datetime.timedelta(seconds=90))
        # the checkpoint's collectives run on the default group: its timeout is the one the survivors wait out
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
        cp = hcp.init_cp_mesh(2, 2)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hcp.save_checkpoint(folder, 1, model, opt, cp, global_batch=4)
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        if rank == 0:
            publish = ckpt._publish

            def publish_then_die(tmp, final):
                publish(tmp, final)
                os._exit(9)  # killed after the rename, before the broadcast that tells the others

            ckpt._publish = publish_then_die
        t0 = time.monotonic()
        try:
            hcp.save_checkpoint(folder, 2, model, opt, cp, global_batch=4)
            results.put((rank, "no error", "", time.monotonic() - t0, model.weight.tolist()))
        except Exception as exc:  # noqa: BLE001 - the test asserts on the type
            results.put((rank, type(exc).__name__, str(exc)[:400], time.monotonic() - t0, model.weight.tolist()))
    except BaseException:  # noqa: BLE001
        results.put((rank, "harness", traceback.format_exc()[-600:], -1.0, None))
