"""The MoE router's load-balancing loss over the whole row under context parallelism.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, ... : every family whose modeling module defines
`load_balancing_loss_func`) add, with ``output_router_logits=True``, the Switch Transformer auxiliary loss

    aux = E * sum_e (picks_e / N) * (probs_e / N)

where, summed over the MoE layers and the tokens of the whole batch (padding excluded by the attention mask),
``picks_e`` counts the tokens whose top-k experts include e, ``probs_e`` sums the router's softmax for e, and N
counts the token rows. Under context parallelism each rank's model sees its shard only, and the loss is not a sum
over tokens (a product of two means), so the per-rank value is not the row's. Here the three sums of each rank's
real tokens (layout pad slots and right padding excluded; in a packed row every document's tokens, as transformers'
one-process call on the packed row counts them) are all-reduced over the cp group, once per forward, and the loss
is computed from the totals: the value one process computes, on every rank.

A forward hook on the model replaces `aux_loss` in the model's output with that value and moves `loss` (which the
model computed as its cross entropy plus the coefficient times its per-shard aux) by the coefficient times the
difference; the per-shard aux's gradient then cancels exactly. Gradients follow the loss's convention
(`training.loss`): with `hcp.cross_entropy`'s group mean each rank's share is scaled by the cp size (average the
ranks' gradients); with ``num_items_in_batch`` (the Trainer's per-rank share of the global count) it is not (sum).

A family is accepted only if its own `load_balancing_loss_func` gives the formula's value on a probe input
(`matches_family`): a future variant of the function is refused, never approximated.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from topology.layouts import PAD

from ..engine.comm import comm_guard
from ..engine.layout import positions, recorded_lengths, row_layout
from ..engine.mesh import CPMesh
from ..errors import ConfigError
from ..training.batch import MASK_KEY
from ..training.loss import GroupReduced

AUX_FUNCTION = "load_balancing_loss_func"
# the model attributes transformers' forward passes to the function (the coefficient: JetMoe's is aux_loss_coef)
COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")
_HOOK = "_hybrid_cp_router_aux_hook"


def router_statistics(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three sums of the load-balancing loss over the given tokens and every layer: (picks [E], probs [E],
    rows), fp32; `weights` [rows] is 1 at a token that counts, 0 elsewhere (only `probs` carries a gradient).

    Args:
        router_logits: One [tokens, E] tensor per MoE layer (the model's ``router_logits`` output).
        num_experts: E.
        top_k: The experts each token is routed to.
        weights: [tokens] 0/1 (the tokens of every layer's rows, in the same order).

    Returns:
        (picks, probs, rows).
    """
    device = router_logits[0].device
    w = weights.reshape(-1).to(device=device, dtype=torch.float32)
    picks = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for layer in router_logits:
        p = F.softmax(layer.reshape(-1, layer.shape[-1]).to(device), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        picks = picks.scatter_add(0, chosen, w.repeat_interleave(top_k))
        probs = probs + (p.float() * w[:, None]).sum(0)
    return picks, probs, w.sum() * len(router_logits)


def switch_loss(picks: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The Switch Transformer loss from the sums (`router_statistics`, over every token that counts)."""
    return (picks / rows * (probs / rows)).sum() * num_experts


def matches_family(function: Any) -> bool:
    """Whether a family's `load_balancing_loss_func` is the formula above (with and without a padding mask), on a
    fixed random probe: two layers of 10 token rows, 6 experts, top-2."""
    g = torch.Generator().manual_seed(7)
    logits = tuple(torch.randn(10, 6, generator=g) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    for m in (None, mask):
        try:
            theirs = function(logits, 6, 2, m)
        except Exception:  # another signature: not the formula we compute
            return False
        ours = switch_loss(*router_statistics(logits, 6, 2, torch.ones(10) if m is None else m.reshape(-1)), 6)
        if not isinstance(theirs, torch.Tensor) or abs(theirs.item() - ours.item()) > 1e-6 * abs(ours.item()):
            return False
    return True


def aux_settings(model: torch.nn.Module) -> tuple[str, str]:
    """(the name of the coefficient's attribute, "") when the model's family computes the load-balancing loss
    made exact here, else ("", why not)."""
    function = getattr(sys.modules.get(type(model).__module__), AUX_FUNCTION, None)
    if function is None:
        return "", (
            f"{type(model).__name__} computes no load-balancing loss in transformers (its router logits "
            f"would be this rank's shard only)"
        )
    coefficient = next((c for c in COEFFICIENTS if isinstance(getattr(model, c, None), (int, float))), None)
    if coefficient is None or not all(
        isinstance(getattr(model, a, None), int) for a in ("num_experts", "num_experts_per_tok")
    ):
        return "", (
            f"{type(model).__name__} does not hold the attributes its {AUX_FUNCTION} is called with "
            f"(num_experts, num_experts_per_tok, one of {COEFFICIENTS})"
        )
    if not matches_family(function):
        return "", (
            f"{type(model).__module__}.{AUX_FUNCTION} is not the Switch Transformer loss hybrid-cp "
            f"reduces over the cp group"
        )
    return coefficient, ""


def router_aux_refusal(model: torch.nn.Module) -> str | None:
    """Why `output_router_logits=True` cannot be made exact for `model`, or None (the guard's message)."""
    coefficient, why = aux_settings(model)
    return None if coefficient else why


def row_tokens(cp: CPMesh, kwargs: dict, padding: torch.Tensor | None) -> torch.Tensor:
    """[B, S_local] bool: this rank's tokens that count in the row's statistics (not layout pad slots, not
    right padding of `padding`, the model call's 2-D attention mask)."""
    ref = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    b, s = ref.shape[:2]
    cu, mask = kwargs.get("cu_seq_lens_q"), kwargs.get(MASK_KEY)
    if cu is not None or mask is not None:
        lay = row_layout(
            cp, local_len=s, cu_seqlens=cu, mask=mask, causal=True, what="the router's load-balancing loss"
        )
        real = torch.cat([torch.full((n,), tok != PAD) for tok, _, n in lay.token_runs(cp.rank)])
    else:
        lay = row_layout(cp, local_len=s, causal=True, what="the router's load-balancing loss")
        seen = sorted(recorded_lengths(cp).get(lay.padded_len, ()))
        if len(seen) > 1 and padding is None:
            raise ConfigError(
                f"output_router_logits=True: the row's length is ambiguous (hcp.shard_batch has sharded "
                f"lengths {seen} that all pad to {lay.padded_len} tokens on this mesh), so which tokens "
                f"count in the load-balancing loss is not known; pass shard_batch's attention_mask"
            )
        real = positions(lay.seq_len, cp, device="cpu") < lay.seq_len
    real = real.to(ref.device)[None].expand(b, s)
    return real & padding.bool() if padding is not None else real


def cp_switch_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    tokens: torch.Tensor,
    cp: CPMesh,
    gradient_scale: float,
) -> torch.Tensor:
    """The load-balancing loss of the whole row: this rank's sums all-reduced over the cp group (one collective),
    the same value on every rank; the gradient reaching this rank's router probabilities is `gradient_scale`
    times the single-process one."""
    picks, probs, rows = router_statistics(router_logits, num_experts, top_k, tokens)
    local = torch.cat([picks, probs.detach(), rows[None]])
    total = local.clone()
    if cp.size > 1:
        with comm_guard(cp, "the router load-balancing loss's all-reduce"):
            dist.all_reduce(total, group=cp.cp_group)
    scale = torch.tensor(gradient_scale, dtype=torch.float32, device=probs.device)
    probs = GroupReduced.apply(probs, total[num_experts : 2 * num_experts], scale)
    return switch_loss(total[:num_experts], probs, total[-1], num_experts)


def install_router_aux(model: torch.nn.Module, ref: Any) -> None:
    """Make `model`'s `aux_loss` (and the `loss` that includes it) the whole row's on every rank; `ref` is the
    mesh holder of `apply_context_parallel` (its `cp`, and `padding`: the call's attention mask, which the
    forward pre-hook drops). A family without that loss refuses ``output_router_logits=True`` passed to a call
    (the config's is the guard's), before any collective.

    Args:
        model: A transformers causal LM that `check_model` accepted.
        ref: `apply_context_parallel`'s mesh holder.
    """
    for handle in model.__dict__.pop(_HOOK, ()):
        handle.remove()
    coefficient, why = aux_settings(model)

    def refuse(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("output_router_logits"):
            raise ConfigError(
                f"output_router_logits=True: {why}, so no auxiliary loss over the row can be made exact "
                f"under context parallelism; do not pass it"
            )

    def replace(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        aux = getattr(output, "aux_loss", None)
        if not isinstance(aux, torch.Tensor) or getattr(output, "router_logits", None) is None:
            return output
        tokens = row_tokens(ref.cp, kwargs, ref.padding)
        scale = ref.cp.size if kwargs.get("num_items_in_batch") is None else 1
        exact = cp_switch_loss(
            tuple(output.router_logits), module.num_experts, module.num_experts_per_tok, tokens, ref.cp, scale
        )
        if getattr(output, "loss", None) is not None:
            # the model added coefficient * aux (its shard's); this removes it, gradient included, exactly
            output.loss = output.loss + getattr(module, coefficient) * (exact.to(output.loss.device) - aux)
        output.aux_loss = exact
        return output

    model.__dict__[_HOOK] = (
        [model.register_forward_hook(replace, with_kwargs=True)]
        if coefficient
        else [model.register_forward_pre_hook(refuse, with_kwargs=True)]
    )


__all__ = [
    "AUX_FUNCTION",
    "aux_settings",
    "cp_switch_loss",
    "install_router_aux",
    "matches_family",
    "router_aux_refusal",
    "router_statistics",
    "row_tokens",
    "switch_loss",
]
