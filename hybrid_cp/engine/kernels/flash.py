"""flash-attn 2/3 kernels (optional; only on CUDA with fp16/bf16).

Import-guarded: the package works without flash-attn. flash-attn handles GQA natively, and packed
segments through its varlen entry points (flash-attn 3: the same entry points with cu_seqlens).
The private forward/backward entry points changed signature across releases, so arguments are
passed by name after inspecting the installed version. A logit soft-cap (`softcap`, Gemma 2) is
flash-attn's own `softcap` argument of both the forward and the backward (2.6+ and 3; an older
release without it raises instead of dropping a non-zero soft-cap).
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch

from ._cuda import fa_class_reason


@lru_cache(maxsize=1)
def _flash_module():
    """(module, version) of flash-attn 3 if installed, else flash-attn 2, else (None, None)."""
    try:
        import flash_attn_interface as fa3  # flash-attn 3 (Hopper)

        return fa3, 3
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_interface as fa2

        return fa2, 2
    except ImportError:
        return None, None


# Arguments the adapter always passes but that some releases lack; dropping them is harmless only at
# these values (flash-attn 3 has no dropout/ALiBi/rng_state, 2.5 no softcap).
_NEUTRAL = {
    "dropout_p": 0.0,
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "deterministic": False,
    "rng_state": None,
    "window_size_left": -1,
    "window_size_right": -1,
}
_RENAMED = {"causal": "is_causal"}  # flash-attn 3's backward since its custom-op rewrite (2025-11)


def _parameters(fn) -> dict[str, inspect.Parameter]:
    """The entry point's own parameters. flash-attn >= 2.7 (torch >= 2.4) and recent flash-attn 3 wrap
    them in `torch.library.custom_op`, whose signature is only (*args, **kwargs): read the wrapped one."""
    target = getattr(fn, "_init_fn", None) or inspect.unwrap(fn)
    params = dict(inspect.signature(target).parameters)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        raise TypeError(
            f"cannot read the parameters of flash-attn's {getattr(fn, '__name__', fn)!r} "
            f"(signature {inspect.signature(target)}); this flash-attn release is not supported"
        )
    return params


def _call(fn, **kwargs):
    """Call a flash-attn entry point by parameter name; parameters we have no value for and
    that have no default (varlen/paged/rotary inputs of flash-attn 3) get None. An argument the
    entry point has no parameter for raises, unless dropping it changes nothing (`_NEUTRAL`)."""
    params = _parameters(fn)
    if "window_size" in params:  # flash-attn 3 before 2025-11 and 2.x before 2.7 take a tuple
        kwargs["window_size"] = (kwargs.pop("window_size_left", -1), kwargs.pop("window_size_right", -1))
    for ours, theirs in _RENAMED.items():
        if ours in kwargs and ours not in params and theirs in params:
            kwargs[theirs] = kwargs.pop(ours)
    lost = [
        k
        for k, v in kwargs.items()
        if k not in params and not (k in _NEUTRAL and not isinstance(v, torch.Tensor) and v == _NEUTRAL[k])
    ]
    if lost:
        raise TypeError(
            f"flash-attn's {getattr(fn, '__name__', 'entry point')} has no parameter for {lost} "
            f"(it takes {list(params)}); this flash-attn release is not supported"
        )
    args = {k: v for k, v in kwargs.items() if k in params}
    for name, p in params.items():
        if (
            name not in args
            and p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ):
            args[name] = None
    return fn(**args)


class FlashAttnKernel:
    name = "flash"

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        mod, _ = _flash_module()
        if mod is None:
            return "flash-attn is not installed (pip install 'hybrid-cp[flash]')"
        return fa_class_reason("flash-attn", device, dtype, head_dim)

    def forward(  # noqa: PLR0913 (kernel protocol)
        self,
        q,
        k,
        v,
        *,
        causal: bool,
        scale: float,
        window=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        softcap: float | None = None,
    ):
        mod, version = _flash_module()
        q, k, v = (x.contiguous() for x in (q, k, v))
        left, right = window if window is not None else (-1, -1)
        common = dict(
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=left,
            window_size_right=right,
            softcap=float(softcap or 0.0),
            alibi_slopes=None,
            return_softmax=False,
        )
        if cu_seqlens_q is None:
            res = _call(mod._flash_attn_forward, q=q, k=k, v=v, **common)
        else:  # packed segments: [1, total, H, D] -> flash-attn's [total, H, D]
            fn = mod._flash_attn_forward if version == 3 else mod._flash_attn_varlen_forward
            res = _call(
                fn,
                q=q[0],
                k=k[0],
                v=v[0],
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                **common,
            )
        # 2.7+ and 3 return (out, lse, ...); before 2.7: (out, q, k, v, out_padded, lse, S, rng)
        out, lse = res[0], (res[5] if len(res) == 8 else res[1])
        if cu_seqlens_q is not None:  # varlen lse is [H, total_q]
            out, lse = out.unsqueeze(0), lse.unsqueeze(0)
        return out, lse.float()

    def backward(  # noqa: PLR0913 (kernel protocol)
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        *,
        causal: bool,
        scale: float,
        window=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        softcap: float | None = None,
    ):
        mod, version = _flash_module()
        q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        left, right = window if window is not None else (-1, -1)
        common = dict(
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=left,
            window_size_right=right,
            softcap=float(softcap or 0.0),
            alibi_slopes=None,
            rng_state=None,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        if cu_seqlens_q is None:
            _call(
                mod._flash_attn_backward,
                dout=dout,
                q=q,
                k=k,
                v=v,
                out=out,
                softmax_lse=lse.contiguous(),
                dq=dq,
                dk=dk,
                dv=dv,
                **common,
            )
        else:
            fn = mod._flash_attn_backward if version == 3 else mod._flash_attn_varlen_backward
            _call(
                fn,
                dout=dout[0],
                q=q[0],
                k=k[0],
                v=v[0],
                out=out[0],
                softmax_lse=lse[0].contiguous(),
                dq=dq[0],
                dk=dk[0],
                dv=dv[0],
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                **common,
            )
        return dq, dk, dv
