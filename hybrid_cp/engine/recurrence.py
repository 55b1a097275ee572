"""Linear recurrences (Gated DeltaNet, Mamba2, Mamba, lightning attention) and causal short convolutions under
context parallelism.

One mechanism, written once (docs/linear.md). A rank's local rows are *runs* of the global sequence
(`Layout.token_runs`: under zigzag two chunks per rank, packed rows several documents or pieces of
them, adjacent pieces of one document merged into one run), and a run never crosses a document. A linear recurrence is affine in the state it receives,
so over a run S_out = M S_in + E (M the run's transition, E its final state from zero). Each rank

1. runs its runs from a zero state; a run that *continues* a document started elsewhere is run once
   with the transition probed alongside (the kind's `probe`), a run that starts its document plainly;
2. all-gathers (M, E) of every run that *exports* (its document goes on after it), one collective
   over the cp group with the summaries of every rank (`comm.gather_summaries`);
3. composes locally, in global order, the state each of its continuing runs receives (a few small
   products per run, no serial chain of whole-shard computations across ranks), and
4. corrects those runs' outputs by the true incoming state (the kind's `correct`).

The backward is autograd through the same steps; the gather's backward is a reduce-scatter, so
each rank gets the gradient of its summaries from every rank that used them. A document start
resets the state: a run that starts its document neither receives a state nor exports a
transition (only E). Padding rows are their own documents: zero output, and zero gradients (not
missing ones, which a rank holding only padding would otherwise give FSDP's gradient reduction).

Causal depthwise convolutions of kernel K need the K - 1 pre-conv tokens before each continuing
run: the exporting runs' last K - 1 rows travel by the same all-gather (`causal_conv`), and a
document start pads with zeros.

The kinds take the kernel they run on a run as an argument with fla's signature (transformers'
torch reference functions have it too): the engine stays free of any model library.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from topology.layouts import PAD, Layout
from topology.summary_scan import SummaryScan, exchange_kind, summary_scan

from .comm import exchange_summaries, gather_summaries

if TYPE_CHECKING:
    from .mesh import CPMesh


@dataclass(frozen=True)
class Run:
    """Consecutive local rows of one document: `start` (local row), `n`, `tok` (global index of the
    first token, or PAD), `continues` (the document started before it), `exports` (it goes on after)."""

    start: int
    n: int
    tok: int
    continues: bool
    exports: bool


@dataclass(frozen=True)
class ScanPlan:
    """The runs of every cp rank, and the exporting runs as gather slots: `slots` per rank (the
    largest count), `slot_of[(rank, run index)]` = (rank, slot), `pred[(rank, run index)]` the slot of
    the run before a continuing run, `slot_pred` the same between slots, `order` the slots in global
    token order, `lens[(rank, slot)]` their lengths."""

    runs: tuple[tuple[Run, ...], ...]
    slots: int
    slot_of: dict
    pred: dict
    slot_pred: dict
    order: tuple
    lens: dict


@lru_cache(maxsize=256)
def scan_plan(lay: Layout, size: int) -> ScanPlan:
    """Runs and gather slots of `lay` on `size` cp ranks (torch-free, the same on every rank)."""
    starts, lens_of_doc = lay.doc_starts, lay.doc_lens
    runs, slot_of, by_end, slot_tok, lens = [], {}, {}, {}, {}
    for rank in range(size):
        mine, local, nslot = [], 0, 0
        for tok, pos, n in lay.document_runs(rank):
            if tok == PAD:
                mine.append(Run(local, n, PAD, False, False))
            else:
                doc = bisect.bisect_right(starts, tok) - 1
                run = Run(local, n, tok, pos > 0, pos + n < lens_of_doc[doc])
                if run.exports:
                    slot_of[(rank, len(mine))] = (rank, nslot)
                    by_end[tok + n] = (rank, nslot)
                    slot_tok[(rank, nslot)] = tok
                    lens[(rank, nslot)] = n
                    nslot += 1
                mine.append(run)
            local += n
        runs.append(tuple(mine))
    pred = {}
    for rank, mine in enumerate(runs):
        for i, run in enumerate(mine):
            if run.continues:
                pred[(rank, i)] = by_end[run.tok]
    slot_pred = {slot_of[key]: p for key, p in pred.items() if key in slot_of}
    return ScanPlan(
        tuple(runs),
        max((sum(r.exports for r in m) for m in runs), default=0),
        slot_of,
        pred,
        slot_pred,
        tuple(sorted(slot_tok, key=slot_tok.get)),
        lens,
    )


class RecurrenceKind(Protocol):
    """One kind of linear recurrence over a run of tokens (inputs [B, n, ...], sequence dim 1)."""

    def shapes(self, inputs: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(transition M, state E) shapes, batch first."""

    def plain(self, xs: Sequence[torch.Tensor], final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, final state or None) from a zero state."""

    def probe(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output from zero, E, M, what `correct` needs)."""

    def apply(self, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """M applied to a state."""

    def chain(self, late: torch.Tensor, early: torch.Tensor) -> torch.Tensor:
        """The transition of two runs in a row (`late` after `early`)."""

    def correct(self, out: torch.Tensor, aux: torch.Tensor, s_in: torch.Tensor) -> torch.Tensor:
        """The output of a run that receives `s_in`, from its zero-state output."""


def state_dtype(x: torch.Tensor) -> torch.dtype:
    """Summaries travel and compose in fp32 (fp64 for fp64 inputs): bf16 transitions lose the state."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gathered_states(
    cp: "CPMesh", plan: ScanPlan, kind: RecurrenceKind, inputs: Sequence[torch.Tensor], exports: dict, stage: str
) -> tuple[dict, torch.Tensor]:
    """All-gather (M, E) of every exporting run and compose, in global order, the state after each."""
    m_shape, e_shape = kind.shapes(inputs)
    dtype = state_dtype(inputs[0])
    m_numel, e_numel = _numel(m_shape), _numel(e_shape)
    rows = [inputs[0].new_zeros(m_numel + e_numel, dtype=dtype) for _ in range(plan.slots)]
    for slot, (m, e) in exports.items():
        m = torch.zeros(m_shape, dtype=dtype, device=e.device) if m is None else m
        rows[slot] = torch.cat([m.to(dtype).reshape(-1), e.to(dtype).reshape(-1)])
    gathered = gather_summaries(cp, torch.stack(rows), stage)
    after = {}
    for key in plan.order:
        m, e = gathered[key].split([m_numel, e_numel])
        prev = plan.slot_pred.get(key)
        after[key] = e.view(e_shape) if prev is None else kind.apply(m.view(m_shape), after[prev]) + e.view(e_shape)
    return after, gathered


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def linear_scan(
    cp: "CPMesh", lay: Layout, kind: RecurrenceKind, inputs: Sequence[torch.Tensor], stage: str = "linear_state"
) -> torch.Tensor:
    """The recurrence `kind` over the whole (global) sequence, for this rank's rows of `inputs`
    ([B, local rows, ...] each): exact, documents reset the state; see the module docstring. The summaries
    travel by all-gather or by a log-step scan, whichever `topology.summary_scan.exchange_kind` picks."""
    plan = scan_plan(lay, cp.size)
    outs, probes, exports = [], {}, {}
    for i, run in enumerate(plan.runs[cp.rank]):
        xs = [x.narrow(1, run.start, run.n) for x in inputs]
        if run.tok == PAD:  # zero output, but every input gets a (zero) gradient on every rank
            outs.append(kind.plain(xs, final=False)[0] * 0)
            continue
        if run.continues:
            out, final, trans, probes[i] = kind.probe(xs)
        else:
            (out, final), trans = kind.plain(xs, final=run.exports), None
        outs.append(out)
        if run.exports:
            exports[i] = (trans, final)
    if not plan.slots:
        return torch.cat(outs, dim=1)
    m_shape, e_shape = kind.shapes(inputs)
    if exchange_kind(lay, cp.size, plan.slots, _numel(m_shape), _numel(e_shape)) == "scan":
        incoming, tie = _scanned_states(
            cp,
            summary_scan(lay, cp.size),
            kind,
            (m_shape, e_shape),
            exports,
            inputs[0].new_zeros((), dtype=state_dtype(inputs[0])),
            stage,
        )
        for i, aux in probes.items():
            outs[i] = kind.correct(outs[i], aux, incoming[i])
        outs[0] = outs[0] + tie.to(outs[0].dtype)  # every rank runs every round's backward, in order
        return torch.cat(outs, dim=1)
    slots = {plan.slot_of[(cp.rank, i)][1]: summary for i, summary in exports.items()}
    after, gathered = _gathered_states(cp, plan, kind, inputs, slots, stage)
    for i, aux in probes.items():
        outs[i] = kind.correct(outs[i], aux, after[plan.pred[(cp.rank, i)]])
    if not probes:  # the gather's backward (a collective) must run on every rank
        outs[0] = outs[0] + (gathered.sum() * 0).to(outs[0].dtype)
    return torch.cat(outs, dim=1)


Summary = tuple["torch.Tensor | None", torch.Tensor]  # (M, or None where it is zero or not needed; E)


def _then(kind: RecurrenceKind, late: Summary, early: Summary | None) -> Summary:
    """`late o early` (`early` None: nothing before); a None M is zero (a document start) or unused."""
    if early is None:
        return late
    m = None if late[0] is None or early[0] is None else kind.chain(late[0], early[0])
    return m, late[1] if late[0] is None else kind.apply(late[0], early[1]) + late[1]


def _scanned_states(
    cp: "CPMesh", scan: SummaryScan, kind: RecurrenceKind, shapes: tuple, exports: dict, tie: torch.Tensor, stage: str
) -> tuple[dict, torch.Tensor]:
    """The state entering each of this rank's continuing runs ({run index: E}) by the log-step scan
    (`topology.summary_scan`), and the rounds' tie (0, to add to the output; `tie` a zero of the summaries'
    dtype): a summary sent in one round is this rank's window, its own (M, E) after what it has received."""
    (m_shape, e_shape), me = shapes, cp.rank
    owner = [rank for rank, _, _ in scan.elements]
    own = {e: exports.get(index, (None, None)) for e, (rank, index, _) in enumerate(scan.elements) if rank == me}
    own = {
        e: (None if m is None else m.to(tie.dtype), None if s is None else s.to(tie.dtype)) for e, (m, s) in own.items()
    }
    prefix: dict = {}
    if torch.is_grad_enabled():
        tie.requires_grad_()
    for transfers in scan.rounds:
        send: dict[int, list] = {}
        local, sizes = [], {}
        for j, i, with_m in transfers:
            if owner[j] == me:
                m, e = _then(kind, own[j], prefix.get(j))
                parts = [e.reshape(-1)] + ([m.reshape(-1)] if with_m else [])
                if owner[i] == me:
                    local.append((i, (m if with_m else None, e)))
                else:
                    send.setdefault(owner[i], []).append(torch.cat(parts))
            elif owner[i] == me:
                sizes[owner[j]] = sizes.get(owner[j], 0) + _numel(e_shape) + (_numel(m_shape) if with_m else 0)
        tie, got = exchange_summaries(cp, tie, {r: torch.cat(p) for r, p in send.items()}, sizes, stage)
        at = dict.fromkeys(got, 0)
        for j, i, with_m in transfers:
            if owner[i] == me and owner[j] != me:
                flat, start = got[owner[j]], at[owner[j]]
                e = flat[start : start + _numel(e_shape)].view(e_shape)
                m = flat[start + e.numel() : start + e.numel() + _numel(m_shape)].view(m_shape) if with_m else None
                at[owner[j]] = start + e.numel() + (m.numel() if with_m else 0)
                local.append((i, (m, e)))
        for i, window in local:
            prefix[i] = _then(kind, prefix[i], window) if i in prefix else window
    incoming = {scan.elements[e][1]: prefix[e][1] for e in own if scan.elements[e][2]}
    return incoming, tie * 0


def _halo(plan: ScanPlan, gathered: torch.Tensor, key: tuple, width: int) -> list[torch.Tensor]:
    """The last `width` rows before a continuing run, walking back over the runs before it (a run
    shorter than the halo takes rows from the one before it), oldest first."""
    parts, need = [], width
    while key is not None and need > 0:
        take = min(need, plan.lens[key])
        parts.insert(0, gathered[key][:, width - take :])
        need -= take
        key = plan.slot_pred.get(key)
    return parts


def causal_conv(
    cp: "CPMesh",
    lay: Layout,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stage: str = "linear_halo",
) -> torch.Tensor:
    """The depthwise causal convolution (weight [C, K], x [B, local rows, C]) of the global sequence
    at this rank's rows, documents starting from zeros; no activation. The K - 1 rows before each
    continuing run come from the ranks that hold them (one all-gather of every exporting run's tail)."""
    plan = scan_plan(lay, cp.size)
    width, (b, _, c) = weight.shape[-1] - 1, x.shape
    mine, halos, gathered = plan.runs[cp.rank], {}, None
    if plan.slots and width:
        tails = [x.new_zeros(b, width, c) for _ in range(plan.slots)]
        for i, run in enumerate(mine):
            if run.exports:
                take = min(width, run.n)
                tail = x.narrow(1, run.start + run.n - take, take)
                tails[plan.slot_of[(cp.rank, i)][1]] = F.pad(tail, (0, 0, width - take, 0))
        gathered = gather_summaries(cp, torch.stack(tails), stage)
        for i, run in enumerate(mine):
            if run.continues:
                parts = _halo(plan, gathered, plan.pred[(cp.rank, i)], width)
                have = sum(p.shape[1] for p in parts)
                halos[i] = torch.cat([x.new_zeros(b, width - have, c)] + parts, dim=1)
    outs = []
    for i, run in enumerate(mine):
        pre = halos.get(i)
        pre = x.new_zeros(b, width, c) if pre is None else pre
        xe = torch.cat([pre, x.narrow(1, run.start, run.n)], dim=1).transpose(1, 2)
        out = F.conv1d(xe, weight.unsqueeze(1), bias, groups=c).transpose(1, 2)
        outs.append(out * 0 if run.tok == PAD else out)  # padding: zero output, zero (not missing) gradients
    out = torch.cat(outs, dim=1)
    if gathered is not None and not halos:  # the gather's backward must run on every rank
        out = out + gathered.sum() * 0
    return out


Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class GatedDelta:
    """The gated delta rule (Gated DeltaNet): inputs (q, k [B, n, Hk, dk], v [B, n, Hv, dv], g, beta
    [B, n, Hv]); state [B, Hv, dk, dv], S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T.

    `kernel` has fla's `chunk_gated_delta_rule` signature (q, k, v, g=, beta=, initial_state=,
    output_final_state=, use_qk_l2norm_in_kernel=). The probe runs it once on [v | 0] from [0 | I]: the
    state columns of I evolve as P_t I (M at the end) and their outputs are P_t^T q_t, so the true
    output is o_t + S_in^T (P_t^T q_t): one kernel call per run, then a small GEMM."""

    def __init__(self, kernel: Kernel, use_qk_l2norm_in_kernel: bool = True):
        self.kernel, self.l2 = kernel, use_qk_l2norm_in_kernel

    def _call(self, xs, v, initial, final):
        q, k, _, g, beta = xs
        return self.kernel(
            q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=final, use_qk_l2norm_in_kernel=self.l2
        )

    def shapes(self, inputs):
        b, _, hv, dv = inputs[2].shape
        dk = inputs[1].shape[-1]
        return (b, hv, dk, dk), (b, hv, dk, dv)

    def plain(self, xs, final):
        out, state = self._call(xs, xs[2], None, final)
        return out, state

    def probe(self, xs):
        v = xs[2]
        b, n, hv, dv = v.shape
        dk = xs[1].shape[-1]
        dtype = state_dtype(v)
        eye = torch.eye(dk, dtype=dtype, device=v.device).expand(b, hv, dk, dk)
        initial = torch.cat([torch.zeros(b, hv, dk, dv, dtype=dtype, device=v.device), eye], dim=-1)
        out, state = self._call(xs, torch.cat([v, v.new_zeros(b, n, hv, dk)], dim=-1), initial, True)
        return out[..., :dv], state[..., :dv], state[..., dv:], out[..., dv:]

    def apply(self, m, s):
        return m @ s

    def chain(self, late, early):
        return late @ early

    def correct(self, out, aux, s_in):
        return out + torch.einsum("bthk,bhkv->bthv", aux.to(s_in.dtype), s_in).to(out.dtype)


class Mamba2:
    """Mamba2's state-space duality (SSD) recurrence: inputs (x [B, n, H, P], dt [B, n, H] before the
    bias and softplus, B and C [B, n, G, N]); the parameters A, D, dt_bias [H] are fixed per layer and
    held here. State [B, H, P, N], S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t.

    The transition is a scalar per head, M = exp(sum of dt A over the run), so no probe state is
    needed: a continuing run is run once from zero and corrected by `(exp(cumsum dt A)_t C_t) . S_in`,
    one [P x N] product per token. `kernel` has mamba_ssm's `mamba_chunk_scan_combined` signature
    (x, dt, A, B, C, chunk_size, D=, dt_bias=, initial_states=, dt_softplus=, dt_limit=,
    return_final_states=); on CPU transformers' torch `mamba2_chunk_scan`."""

    def __init__(
        self,
        kernel: Kernel,
        A: torch.Tensor,
        chunk_size: int,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
    ):
        self.kernel, self.A, self.chunk, self.D, self.dt_bias, self.limit = kernel, A, chunk_size, D, dt_bias, dt_limit

    def _call(self, xs, final):
        x, dt, b, c = xs
        return self.kernel(
            x,
            dt,
            self.A,
            b,
            c,
            chunk_size=self.chunk,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            dt_limit=self.limit,
            return_final_states=final,
        )

    def shapes(self, inputs):
        b, _, h, p = inputs[0].shape
        return (b, h), (b, h, p, inputs[2].shape[-1])

    def plain(self, xs, final):
        return self._call(xs, True) if final else (self._call(xs, False), None)

    def probe(self, xs):
        out, state = self._call(xs, True)
        dt = xs[1] if self.dt_bias is None else xs[1] + self.dt_bias.to(xs[1].dtype)  # as the kernel does
        dt = F.softplus(dt).clamp(*self.limit).to(state_dtype(xs[0]))
        decay = torch.cumsum(dt * self.A.to(dt.dtype), dim=1).exp()  # [B, n, H]: prefix transitions
        h = xs[0].shape[2]
        c = xs[3].to(dt.dtype).repeat_interleave(h // xs[3].shape[2], dim=2)
        return out, state, decay[:, -1], c * decay[..., None]

    def apply(self, m, s):
        return m[..., None, None] * s

    def chain(self, late, early):
        return late * early

    def correct(self, out, aux, s_in):
        return out + torch.einsum("bthn,bhpn->bthp", aux, s_in.to(aux.dtype)).to(out.dtype)


class Mamba:
    """Mamba-1's selective scan (Jamba): inputs (x, dt [B, n, D] with dt before the bias and softplus, B and C
    [B, n, N]); the parameters A [D, N], D and dt_bias [D] are fixed per layer and held here. State [B, D, N],
    S_t = exp(dt_t A) * S_{t-1} + dt_t x_t B_t (elementwise per channel d and state n), y_t = S_t C_t + D x_t.

    The transition is diagonal, M = exp(A * sum of dt over the run) elementwise ([B, D, N], the state's
    size), so no probe is needed: a continuing run is run once from zero and corrected by
    `y_t += sum_n C_t[n] exp(A cumsum dt)_t[d, n] S_in[d, n]`, elementwise work of the size the scan itself
    spends on its discretised A. `kernel` has mamba_ssm's `selective_scan_fn` signature (u, delta [B, D, n],
    A, B, C [B, N, n], D=, z=, delta_bias=, delta_softplus=, return_last_state=); on CPU transformers' torch
    `mamba_selective_scan` (its token loop, in the inputs' dtype). The gate z stays outside (elementwise)."""

    def __init__(
        self, kernel: Kernel, A: torch.Tensor, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None
    ):
        self.kernel, self.A, self.D, self.dt_bias = kernel, A, D, dt_bias

    def _call(self, xs, final):
        x, dt, b, c = (t.transpose(1, 2) for t in xs)
        got = self.kernel(
            x, dt, self.A, b, c, D=self.D, delta_bias=self.dt_bias, delta_softplus=True, return_last_state=final
        )
        return (got[0].transpose(1, 2), got[1]) if final else (got.transpose(1, 2), None)

    def shapes(self, inputs):
        b, _, d = inputs[0].shape
        return (b, d, self.A.shape[-1]), (b, d, self.A.shape[-1])

    def plain(self, xs, final):
        return self._call(xs, final)

    def probe(self, xs):
        out, state = self._call(xs, True)
        dt = xs[1] if self.dt_bias is None else xs[1] + self.dt_bias.to(xs[1].dtype)  # as the kernel does
        dt = F.softplus(dt).to(state_dtype(xs[0]))
        decay = torch.cumsum(dt[..., None] * self.A.to(dt.dtype), dim=1).exp()  # [B, n, D, N]
        return out, state, decay[:, -1], decay * xs[3].to(dt.dtype)[:, :, None, :]

    def apply(self, m, s):
        return m * s

    def chain(self, late, early):
        return late * early

    def correct(self, out, aux, s_in):
        return out + torch.einsum("btdn,bdn->btd", aux, s_in.to(aux.dtype)).to(out.dtype)


class Lightning:
    """Lightning attention (MiniMax): decayed linear attention with a fixed decay per head. Inputs (q, k
    [B, n, H, dk], v [B, n, H, dv]); `slope` [H] > 0 fixed per layer. State [B, H, dk, dv],
    S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t (no scale, no normalisation).

    A scalar transition per head, M = exp(-slope n) for a run of n tokens, so no probe is needed: a
    continuing run is run once from zero and corrected by `o_t += S_in^T (exp(-slope (t + 1)) q_t)`
    (t counted from the run's start). `kernel(q, k, v, slope, block)` returns (output, final state)
    from a zero state; by default `Lightning.blocks`, the block-wise torch computation MiniMax's module
    does inline (intra-block masked q k^T with the decay, inter-block through the state)."""

    def __init__(self, slope: torch.Tensor, block_size: int = 256, kernel: Kernel | None = None):
        self.slope, self.block, self.kernel = slope, block_size, kernel or Lightning.blocks

    @staticmethod
    def blocks(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [B, n, H, dv], final state [B, H, dk, dv]) from zero, `block` tokens at a time."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, n, d]
        s = slope.to(q.dtype)[:, None, None]
        state = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
        outs = []
        for start in range(0, q.shape[2], block):
            qb, kb, vb = (t[:, :, start : start + block] for t in (q, k, v))
            t = torch.arange(1, qb.shape[2] + 1, device=q.device, dtype=q.dtype)
            diff = t[:, None] - t[None, :]
            mask = torch.where(diff >= 0, (-s * diff.clamp_min(0)).exp(), torch.zeros((), dtype=q.dtype))
            outs.append((qb @ kb.transpose(-1, -2) * mask) @ vb + (qb * (-s * t[:, None]).exp()) @ state)
            key_decay = (-s * (qb.shape[2] - t[:, None])).exp()
            state = state * (-s * qb.shape[2]).exp() + (kb * key_decay).transpose(-1, -2) @ vb
        return torch.cat(outs, dim=2).transpose(1, 2), state

    def shapes(self, inputs):
        b, _, h, dk = inputs[1].shape
        return (b, h), (b, h, dk, inputs[2].shape[-1])

    def plain(self, xs, final):
        out, state = self.kernel(*xs, self.slope, self.block)
        return out, (state if final else None)

    def probe(self, xs):
        out, state = self.kernel(*xs, self.slope, self.block)
        dtype = state_dtype(xs[0])
        s = self.slope.to(dtype)
        t = torch.arange(1, xs[0].shape[1] + 1, device=s.device, dtype=dtype)
        decay = (-t[:, None] * s).exp()  # [n, H]: prefix transitions
        m = decay[-1].expand(xs[0].shape[0], -1)
        return out, state, m, xs[0].to(dtype) * decay[None, :, :, None]

    def apply(self, m, s):
        return m[..., None, None] * s

    def chain(self, late, early):
        return late * early

    def correct(self, out, aux, s_in):
        return out + torch.einsum("bthk,bhkv->bthv", aux, s_in.to(aux.dtype)).to(out.dtype)


__all__ = [
    "Run",
    "ScanPlan",
    "scan_plan",
    "RecurrenceKind",
    "linear_scan",
    "causal_conv",
    "GatedDelta",
    "Mamba2",
    "state_dtype",
    "Mamba",
    "Lightning",
]
