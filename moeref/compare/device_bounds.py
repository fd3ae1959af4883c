"""The GEMM error bounds of :mod:`moeref.compare.gemm_bounds` on torch float64 tensors (a CUDA GPU, or the
CPU with the Triton kernels interpreted): the same bound, bit for bit.

The NumPy functions are the specification; this module performs the same IEEE operations in the same
order. Every reduction whose order matters is declared there and followed here: the operand-radius and
worst-case sums are :func:`~moeref.compare.gemm_bounds.ordered_dot` (column order within 32-column
steps, steps within 128-column chunks, then chunks); the aligned-adder recurrence sums a step's
products in column order, steps and chunks in order; the contiguous-tree walks are sequential prefix
sums per lane (maxima and minima are exact in any order). The per-element arithmetic runs in the Triton
kernels of :mod:`moeref.compare._bound_kernels` (no FMA contraction, float64 constants read from a
tensor); the element-wise rest is torch operations, with every division by a 0-d tensor (torch on CUDA
divides by a Python float through its rounded reciprocal).

Memory: one expert at a time. Its weights are decoded to float64 ``[K, N]`` (K-major, so each kernel's
column loads are coalesced) just before its bound and dropped after; the rows of the expert likewise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .gemm_bounds import (
    ORDER_CHUNK,
    ORDER_STEP,
    TREE_LANES,
    U_F64,
    _MIN_NORMAL,
    adder_exact,
    adder_setup,
    gamma,
    gemm_coefficient,
)

__all__ = ["DeviceBlock", "device_gemm_error_bound", "device_rows_error_bound", "device_rows_radius_term",
           "device_quantum_and_max"]


def _torch():
    import torch

    return torch


@dataclass(frozen=True, eq=False)
class DeviceBlock:
    """A block-scaled ``[R, K]`` operand as float64 tensors: element ``values``, ``scales`` on the block grid
    ``block`` (:class:`moeref.gemm.BlockOperand` on a device)."""

    values: object
    scales: object
    block: tuple

    def dequantize(self):
        """:meth:`moeref.gemm.BlockOperand.dequantize`: each element times its block scale (one multiply)."""
        r, k = (int(d) for d in self.values.shape)
        br, bk = self.block
        s = self.scales.repeat_interleave(br, dim=0)[:r].repeat_interleave(bk, dim=1)[:, :k]
        return self.values * s

    @classmethod
    def of(cls, op) -> "DeviceBlock":
        """From a :class:`moeref.gemm.device.DeviceOperand`."""
        return cls(op.decode(), op.scales, tuple(int(b) for b in op.block))


def device_quantum_and_max(values) -> tuple[float, float]:
    """:func:`moeref.gemm.exact.quantum_and_max` of a float64 tensor (the same two numbers)."""
    torch = _torch()
    v = values.abs().reshape(-1)
    v = v[v != 0]
    if v.numel() == 0:
        return math.inf, 0.0
    if not bool(torch.isfinite(v).all()):
        raise ValueError("values must be finite to have a quantum")
    m, e = torch.frexp(v)
    mi = (m * 2.0**53).to(torch.int64)
    low = mi & -mi
    q = torch.ldexp(low.to(torch.float64), (e - 53).to(torch.float64))
    return float(q.min()), float(v.max())


def _bf16_exact(v) -> bool:
    torch = _torch()
    return bool(torch.isfinite(v).all()) and bool((v.to(torch.float32).to(torch.bfloat16).to(torch.float64) == v).all())


def _consts(device, *vals):
    torch = _torch()
    return torch.tensor([float(x) for x in vals], dtype=torch.float64, device=device)


def _kt(x):
    """K-major contiguous copy ``[K, R]`` of ``[R, K]``."""
    return x.t().contiguous()


def _ordered_dot(x, w):
    from ._bound_kernels import ordered_dot_t

    return ordered_dot_t(_kt(x), _kt(w), ORDER_CHUNK, ORDER_STEP)


def device_gemm_error_bound(a: DeviceBlock, w: DeviceBlock, profile, *, a_radius=None, b_abs=None):
    """:func:`moeref.compare.gemm_error_bound` of ``a`` ``[M, K]`` against ``w`` ``[N, K]`` (float64
    tensors on one device; ``a_radius`` ``[M, K]`` >= 0, ``b_abs`` ``[N]`` = ``|bias|``): float64 ``[M, N]``."""
    torch = _torch()
    m, k = (int(d) for d in a.values.shape)
    n = int(w.values.shape[0])
    if int(w.values.shape[1]) != k:
        raise ValueError(f"a has K={k} columns but w has K={int(w.values.shape[1])}")
    dev = a.values.device
    if b_abs is None:
        b_abs = torch.zeros(n, dtype=torch.float64, device=dev)
    model = profile.accum_model
    if model == "worst_case":
        bk = max(1, min(a.block[1], w.block[1], max(k, 1)))
        coef = gemm_coefficient(profile, k, -(-k // bk))
        a_abs = a.dequantize().abs() + (0.0 if a_radius is None else a_radius)
        return coef * (_ordered_dot(a_abs, w.dequantize().abs()) + b_abs[None, :])
    if model == "contiguous_tree":
        return _tree(a, w, profile, a_radius, b_abs)
    if model == "data_dependent":
        return _adder(a, w, profile, a_radius, b_abs)
    raise ValueError(f"accum_model must be one of worst_case, contiguous_tree, data_dependent; got {model!r}")


def _tree(a: DeviceBlock, w: DeviceBlock, profile, radius, b_abs):
    """:func:`moeref.compare.gemm_bounds.contiguous_tree_gemm_bound`, operation for operation."""
    torch = _torch()
    from ._bound_kernels import tree_walks_t

    m, k = (int(d) for d in a.values.shape)
    n = int(w.values.shape[0])
    dev = a.values.device
    if m == 0 or n == 0:
        return torch.zeros((m, n), dtype=torch.float64, device=dev)
    u = float(profile.accum_unit)
    rho = float(profile.adder_factor)
    u_prom = float(profile.promote_unit)
    lanes = max(TREE_LANES)
    kp = -(-max(k, 1) // lanes) * lanes
    wd = w.dequantize()
    if radius is None:
        d = torch.zeros((m, n), dtype=torch.float64, device=dev)
    else:
        d = _ordered_dot(radius, wd.abs()) * (1.0 + gamma(k + 2, U_F64))
    rng, wsum, csum = tree_walks_t(_kt(a.dequantize()), _kt(wd), kp)
    slack = 2.0 * gamma(kp + 2, U_F64) * wsum
    r_hi = rng + slack + d
    w_hi = wsum * (1.0 + gamma(kp + 2, U_F64)) + d
    c_hi = csum.abs() + slack + d
    sigma = gamma(2, u_prom)
    u_prod = 0.0 if (_bf16_exact(a.values) and _bf16_exact(w.values)) else 2.0 * u
    t = rho * max(k - 1, 0) * u
    denom = 1.0 - t - sigma
    if denom <= 0:
        return torch.full((m, n), math.inf, dtype=torch.float64, device=dev)
    acc = (t * r_hi + (sigma + u_prod) * w_hi) / torch.tensor(denom, dtype=torch.float64, device=dev)
    out = acc + u_prom * (c_hi + acc + b_abs[None, :]) + (k + 2) * 2.0**-149
    return out * (1.0 + 1e-9)


def _adder(a: DeviceBlock, w: DeviceBlock, profile, radius, b_abs):
    """:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound`, operation for operation."""
    torch = _torch()
    from ._bound_kernels import adder_bound_t

    m, k = (int(d) for d in a.values.shape)
    n = int(w.values.shape[0])
    dev = a.values.device
    st = adder_setup(k, a.block, w.block, profile)
    if m == 0 or n == 0 or k == 0:
        return (st.g_prom * b_abs).expand(m, n).clone()
    exact = (radius is None and st.const_scales and bool(torch.isfinite(a.values).all())
             and bool(torch.isfinite(w.values).all()))
    if exact:
        exact = adder_exact(device_quantum_and_max(a.values), device_quantum_and_max(w.values), st.chunk)
    if exact:
        av, wv = a.values, w.values
        blk = torch.arange(-(-k // st.chunk), device=dev) * st.chunk
        sa = a.scales.index_select(0, torch.div(torch.arange(m, device=dev), a.block[0], rounding_mode="floor")) \
            .index_select(1, torch.div(blk, a.block[1], rounding_mode="floor")).abs().contiguous()
        sw = w.scales.index_select(0, torch.div(torch.arange(n, device=dev), w.block[0], rounding_mode="floor")) \
            .index_select(1, torch.div(blk, w.block[1], rounding_mode="floor")).abs().contiguous()
    else:
        av, wv = a.dequantize(), w.dequantize()
        sa = sw = None
    consts = _consts(dev, 2.0 * profile.accum_unit, st.g_prom, 1.0 + 2.0**-40, _MIN_NORMAL, 1.0 + 1e-9, 1.0, 0.0)
    return adder_bound_t(_kt(av), _kt(wv), None if radius is None else _kt(radius), sa, sw,
                         b_abs.contiguous(), consts, chunk=st.chunk, mma=st.mma, steps=st.steps, exact=exact)


# ------------------------------------------------------------------------------ rows against experts


def _expert_block(weights, e: int) -> DeviceBlock:
    """Expert ``e`` of a device stack (:class:`moeref.gemm.StackedExperts`, or a float ``[E, N, K]`` tensor:
    one block of scale 1) as a :class:`DeviceBlock` (decoded now, one expert)."""
    torch = _torch()
    from ..gemm.device import _expert_values
    from ..gemm.stacked import StackedExperts

    if isinstance(weights, StackedExperts):
        v, s = _expert_values(weights, e)
        return DeviceBlock(v, s, tuple(int(b) for b in weights.block))
    we = weights[e].to(torch.float64)
    n, k = (int(d) for d in we.shape)
    return DeviceBlock(we, torch.ones((1, 1), dtype=torch.float64, device=we.device), (max(n, 1), max(k, 1)))


def _experts_rows(row_expert):
    rows = np.asarray(row_expert, dtype=np.int64)
    for e in np.unique(rows[rows >= 0]).tolist():  # a loop over experts
        yield e, np.flatnonzero(rows == e)


def device_rows_error_bound(a, a_radius, row_expert, weights, bias, profile):
    """:func:`moeref.compare.bounds._rows_error_bound` on a device: ``a`` a
    :class:`moeref.gemm.device.DeviceOperand` ``[R, K]``, ``a_radius`` float64 ``[R, K]`` or None,
    ``row_expert`` int ``[R]`` (NumPy), ``weights`` a device stack, ``bias`` float64 ``[E, N]`` or None.
    Returns float64 ``[R, N]``, 0 on padding rows."""
    torch = _torch()
    dev = a.device
    n = _n_out(weights)
    out = torch.zeros((len(row_expert), n), dtype=torch.float64, device=dev)
    for e, idx in _experts_rows(row_expert):
        it = torch.as_tensor(idx, device=dev)
        ae = DeviceBlock.of(a.take_rows(it))
        we = _expert_block(weights, e)
        r = None if a_radius is None else a_radius.index_select(0, it)
        b = None if bias is None else bias[e].abs()
        out[it] = device_gemm_error_bound(ae, we, profile, a_radius=r, b_abs=b)
    return out


def device_rows_radius_term(radius, row_expert, weights):
    """:func:`moeref.compare.bounds._rows_radius_term` on a device: ``radius[r] @ |W[e(r)]|^T`` in
    :func:`~moeref.compare.gemm_bounds.ordered_dot`'s order, float64 ``[R, N]``."""
    torch = _torch()
    n = _n_out(weights)
    out = torch.zeros((len(row_expert), n), dtype=torch.float64, device=radius.device)
    for e, idx in _experts_rows(row_expert):
        it = torch.as_tensor(idx, device=radius.device)
        out[it] = _ordered_dot(radius.index_select(0, it), _expert_block(weights, e).dequantize().abs())
    return out


def _n_out(weights) -> int:
    from ..gemm.stacked import StackedExperts

    if isinstance(weights, StackedExperts):
        return int(weights.shape[0])
    return int(weights.shape[1]) if len(weights) else 0
