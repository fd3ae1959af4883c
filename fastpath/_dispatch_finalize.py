"""The finalize side of :mod:`fastpath.dispatch` (its public names are re-exported there; contracts:
:mod:`moeref.dispatch.finalize`): :func:`moe_unpermute`, :func:`weight_and_reduce` (both through one
weighted-reduce kernel, ``_reduce_kernel``: FP32 sums in slot order, the output dtype stored by the kernel)
and :func:`apply_router_weight_on_input` (the router weight on the token rows before the experts, top-1)."""
from __future__ import annotations

import numpy as np
import torch

from moeref import _interop
from moeref._checks import check_positive_int, check_token_rows
from moeref.dispatch.finalize import weight_and_reduce as _ref_weight_and_reduce

from . import _launch_plan as _plan
from ._dispatch_kernels import _invert_kernel, _reduce_kernel
from ._dispatch_sort import _alloc, _check_int, _cuda, _cuda_key, _full, _ints, _launch, _row_config, _tkey
from ._host import cdiv, pdl_launch

__all__ = ["apply_router_weight_on_input", "moe_unpermute", "weight_and_reduce"]


def _reduce(rows: torch.Tensor, dst: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor, *,
            nvalid_ptr=None, nvalid: int = 0, apply_weights: bool = True, pdl: bool = False) -> None:
    """``_reduce_kernel`` into ``out``; ``pdl``: launched with Programmatic Dependent Launch where it runs
    (:func:`fastpath._host.pdl_launch`; the same sums)."""
    m, k = topk_weights.shape
    K = rows.shape[1]
    bt, bk, nw = _row_config("reduce", K, max(rows.element_size(), 2), m)
    out_bf16 = out.dtype == torch.bfloat16
    _launch(_reduce_kernel, (cdiv(m, bt), cdiv(K, bk)), rows, topk_weights, dst,
            nvalid_ptr if nvalid_ptr is not None else dst, out.view(torch.int16) if out_bf16 else out, m, K, nvalid,
            rows.stride(0), rows.stride(1), topk_weights.stride(0), topk_weights.stride(1), K,
            TOPK=k, BLOCK_T=bt, BLOCK_K=bk, APPLY_W=apply_weights, NV_FROM_PTR=nvalid_ptr is not None,
            OUT_BF16=out_bf16, num_warps=nw,
            **pdl_launch(out.device, pdl))


def _out_dtype(out_dtype) -> torch.dtype:
    if not isinstance(out_dtype, torch.dtype):
        out_dtype = _interop.torch_dtype_for(out_dtype)
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"out_dtype must be float32, bfloat16, float16 or float64; got {out_dtype}")
    return out_dtype


def _check_float(x, name: str, ndim: int | None) -> torch.Tensor:
    if not torch.is_tensor(x):
        raise TypeError(f"{name} must be a torch tensor; got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{name} must be float16/bfloat16/float32/float64; got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(x.shape)}")
    return x


def moe_unpermute(permuted_out, topk_weights, inv_permuted_idx, expert_first_token_offset, *,
                  out_dtype=torch.float32) -> torch.Tensor:
    """Weight and reduce permuted expert outputs back to tokens ``[M, K]`` (``out_dtype``); contract:
    :func:`moeref.dispatch.moe_unpermute`. Sums in float32 in slot order (the reference: float64),
    so the result is within ``gamma_k * sum_j |w_j y_j|`` plus one rounding to ``out_dtype``.
    Slots whose destination is ``>= offset[-1]`` contribute exactly 0, NaN rows included; the
    offset is read on the device (no sync)."""
    y, w, inv, off = permuted_out, topk_weights, inv_permuted_idx, expert_first_token_offset
    key = None
    if isinstance(out_dtype, torch.dtype) and y is not None and _cuda(y, w, inv, off):
        key = _cuda_key("unpermute", _tkey(y), _tkey(w), _tkey(inv), _tkey(off), out_dtype)
    plan = _plan.lookup(key)
    if plan is None:
        _check_float(y, "permuted_out", 2)
        _check_float(w, "topk_weights", 2)
        _check_int(inv, "inv_permuted_idx", 1)
        _check_int(off, "expert_first_token_offset", 1)
        m, k = w.shape
        if inv.numel() != m * k:
            raise ValueError(f"inv_permuted_idx must have M*k = {m * k} entries; got {inv.numel()}")
        dtype = _out_dtype(out_dtype)
    else:
        dtype = plan.layout
    if inv.dtype != torch.int32:
        inv = inv.to(torch.int32)
    if not inv.is_contiguous():
        inv = inv.contiguous()
    out = _alloc((w.shape[0], y.shape[1]), dtype, y.device)
    _plan.execute(key, plan, (y, w, inv, off, out), key and key[-1],
                  lambda: _reduce(y, inv, w, out, nvalid_ptr=off[off.numel() - 1:]), dtype)
    return out


def weight_and_reduce(expert_rows, src, topk_weights, num_tokens: int, *, apply_weights: bool = True,
                      out_dtype=torch.float32, validate: bool = True) -> torch.Tensor:
    """Finalize any layout (``[..., K]`` rows with ``src`` = slot of each row or -1) back to tokens;
    contract: :func:`moeref.dispatch.weight_and_reduce`. ``validate`` checks on the host that each
    slot appears at most once (the reference's ``ValueError``); with ``validate=False`` a repeated
    slot keeps one of its rows."""
    key = None
    if _ints(num_tokens) and isinstance(out_dtype, torch.dtype) and expert_rows is not None and src is not None \
            and _cuda(expert_rows, src, topk_weights):
        key = _cuda_key("reduce", _tkey(expert_rows), _tkey(src), _tkey(topk_weights), num_tokens, bool(apply_weights),
                        out_dtype)
    plan = _plan.lookup(key)
    w = topk_weights
    if plan is None:
        num_tokens = check_positive_int(num_tokens, "num_tokens", allow_zero=True)
        _check_float(w, "topk_weights", 2)
        if w.shape[0] != num_tokens:
            raise ValueError(f"topk_weights must have num_tokens={num_tokens} rows; got shape {tuple(w.shape)}")
        _check_float(expert_rows, "expert_rows", None)
        _check_int(src, "src", None)
        if expert_rows.ndim < 1 or tuple(src.shape) != tuple(expert_rows.shape[:-1]):
            raise ValueError(f"src must have the leading shape of expert_rows {tuple(expert_rows.shape[:-1])}; "
                             f"got {tuple(src.shape)}")
        dtype = _out_dtype(out_dtype)
    else:
        dtype = plan.layout
    y = expert_rows if expert_rows.ndim == 2 else expert_rows.reshape(-1, expert_rows.shape[-1])
    s = src if src.ndim == 1 else src.reshape(-1)
    if not s.is_contiguous():
        s = s.contiguous()
    if validate:  # the reference's own checks (range, each slot at most once), on one-column rows
        _ref_weight_and_reduce(np.zeros((s.numel(), 1)), _interop.to_numpy(s),
                               np.zeros(tuple(w.shape), dtype=np.float32), num_tokens)
    dst = _full(num_tokens * w.shape[1], -1, torch.int32, y.device)
    out = _alloc((num_tokens, y.shape[1]), dtype, y.device)
    R = s.numel()

    def launches():
        _launch(_invert_kernel, (cdiv(R, 1024),), s, dst, R, BLOCK=1024)
        _reduce(y, dst, w, out, nvalid=R, apply_weights=apply_weights)
    _plan.execute(key, plan, (y, s, w, dst, out), key and key[-1], launches, dtype)
    return out


def apply_router_weight_on_input(hidden: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token row times its router weight (``top_k`` must be 1), rounded once to float32 ``[M, K]``:
    contract :func:`moeref.dispatch.apply_router_weight_on_input` (the exact product rounded to float32;
    finalize then sums with ``apply_weights=False``). Both operands float32 or narrower: one IEEE float32
    multiply, which is that rounding, since the product of two float32 values is exact in float64 (48 of its
    53 bits); either one float64: the product in float64, then the rounding. Elementwise torch ops, no host
    sync."""
    x = _check_float(hidden, "hidden", 2)
    w = _check_float(topk_weights, "topk_weights", 2)
    if w.shape[1] != 1:
        raise ValueError("apply_router_weight_on_input needs top_k == 1 (weight-on-input is exact only then); "
                         f"got top_k={w.shape[1]}")
    check_token_rows(x, w, None)
    t = torch.float64 if torch.float64 in (x.dtype, w.dtype) else torch.float32
    return (x.to(t) * w.to(device=x.device, dtype=t)).to(torch.float32)
