"""The device bound's top-k weighted sums in one pass (Triton): the center, the propagated radius and the magnitude
of :func:`moeref.compare.device.layer._chunk_interval`'s stage 6, each :func:`moeref.dispatch.weight_and_reduce`'s
slot-order loop to float64, bit for bit.

Per token ``t`` and output column, for ``j = 0 .. k-1`` in order, from ``+0.0``::

    center += w[t, j] * y[row]             radius += |w[t, j]| * dy[row]        mag += |w[t, j]| * (|y[row]| + dy[row])

``row`` the expert row holding slot ``(t, j)``; a slot no row holds adds ``w * 0.0`` (as the reference's zero row:
the same signed zeros, and NaN for an infinite weight). Without ``apply_weights`` every weight is 1. Each product and
sum rounds once (compiled with ``enable_fp_fusion=False``: no multiply-add contraction).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["weighted_slot_sums_t"]


@triton.jit
def _weighted_slot_sums_kernel(y_ptr, dy_ptr, w_ptr, slot_ptr, c_ptr, d_ptr, m_ptr, D, K: tl.constexpr,
                               WEIGHTS: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = cols < D
    c = tl.zeros((BD,), dtype=tl.float64)
    d = tl.zeros((BD,), dtype=tl.float64)
    m = tl.zeros((BD,), dtype=tl.float64)
    for j in range(0, K):
        row = tl.load(slot_ptr + t * K + j)
        live = row >= 0
        off = tl.maximum(row, 0) * D + cols
        y = tl.load(y_ptr + off, mask=cm & live, other=0.0)
        dy = tl.load(dy_ptr + off, mask=cm & live, other=0.0)
        if WEIGHTS:
            w = tl.load(w_ptr + t * K + j)
        else:
            w = tl.load(w_ptr)  # 1.0
        wa = tl.abs(w)
        c = c + w * y
        d = d + wa * dy
        m = m + wa * (tl.abs(y) + dy)
    out = t.to(tl.int64) * D + cols
    tl.store(c_ptr + out, c, mask=cm)
    tl.store(d_ptr + out, d, mask=cm)
    tl.store(m_ptr + out, m, mask=cm)


def weighted_slot_sums_t(y, dy, slot_row, weights, apply_weights: bool):
    """``(center, radius, magnitude)`` float64 ``[T, D]`` (module docstring): ``y``, ``dy`` float64 ``[R, D]``
    expert rows, ``slot_row`` int64 ``[T * k]`` the row holding each slot (-1: none), ``weights`` ``[T, k]`` the
    top-k weights (any float dtype; read as float64)."""
    t, k = (int(x) for x in weights.shape)
    d = int(y.shape[1])
    dev = y.device
    outs = [torch.empty((t, d), dtype=torch.float64, device=dev) for _ in range(3)]
    if t == 0 or d == 0:
        return tuple(torch.zeros((t, d), dtype=torch.float64, device=dev) for _ in range(3))
    w = (weights.to(torch.float64) if apply_weights else torch.ones(1, dtype=torch.float64, device=dev)).contiguous()
    bd = 1024
    _weighted_slot_sums_kernel[(t, triton.cdiv(d, bd))](y.contiguous(), dy.contiguous(), w,
                                                       slot_row.to(torch.int64).contiguous(), *outs, d, K=k,
                                                       WEIGHTS=apply_weights, BD=bd, enable_fp_fusion=False)
    return tuple(outs)
