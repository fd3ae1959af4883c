"""The GEMM error bounds of :mod:`moeref.compare.gemm_bounds` on torch float64 tensors (a CUDA GPU, or the
CPU with the Triton kernels interpreted): the same bound, bit for bit.

The NumPy functions are the specification; this module performs the same IEEE operations in the same
order. Every reduction whose order matters is declared there and followed here: the operand-radius and
worst-case sums are :func:`~moeref.compare.summation_order.ordered_dot` (column order within 32-column
steps, steps within 128-column chunks, then chunks); the aligned-adder recurrence sums a step's
products in column order, steps and chunks in order; the contiguous-tree walks are sequential prefix
sums per lane (maxima and minima are exact in any order). The per-element arithmetic runs in the Triton
kernels of :mod:`moeref.compare.device._bound_kernels` (no FMA contraction, float64 constants read from a
tensor); the element-wise rest is torch operations, with every division by a 0-d tensor (torch on CUDA
divides by a Python float through its rounded reciprocal).

Memory: experts in groups (:data:`WEIGHT_GROUP_BYTES`). The aligned-adder bound reads the uint8 codes of
:class:`~moeref.gemm.StackedExperts` (K-major) through the decode table, times the block scale in the kernel
(the exact domain and the scaled form alike), so it forms no float64 copy of the weights; the other models
decode a group's weights to float64 ``[G, K, N]`` (K-major, so each kernel's column loads are coalesced) just
before its bound and drop them after.
"""
from __future__ import annotations

import math

import numpy as np

from ..gemm_bounds import TREE_LANES, U_F64, gamma, gemm_coefficient
from ..summation_order import ORDER_CHUNK, ORDER_STEP
from .adder import adder_bound, radius_dots
from .operands import (
    DeviceBlock,
    _abs_stack,
    _Experts,
    _kt,
    _or_zeros,
    _put_rows,
    _row_stats,
    _rows_of,
    _stacked_block,
    _StackedExpert,
    _torch,
    _weights_kt,
    _with_parts,
)

__all__ = ["DeviceBlock", "device_gemm_error_bound", "device_rows_error_bound", "device_rows_radius_term",
           "device_quantum_and_max"]


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


WEIGHT_GROUP_BYTES = 1 << 32
"""Largest float64 stack of decoded expert weights formed at once (experts are bounded in groups)."""


def device_gemm_error_bound(a: DeviceBlock, w: DeviceBlock, profile, *, a_radius=None, b_abs=None):
    """:func:`moeref.compare.gemm_error_bound` of ``a`` ``[M, K]`` against ``w`` ``[N, K]`` (float64
    tensors on one device; ``a_radius`` ``[M, K]`` >= 0, ``b_abs`` ``[N]`` = ``|bias|``): float64 ``[M, N]``."""
    torch = _torch()
    m, k = (int(d) for d in a.values.shape)
    n = int(w.values.shape[0])
    if int(w.values.shape[1]) != k:
        raise ValueError(f"a has K={k} columns but w has K={int(w.values.shape[1])}")
    b = torch.zeros((1, n), dtype=torch.float64, device=a.values.device) if b_abs is None else b_abs.reshape(1, n)
    return _group_bound(a, [m], [w], profile, a_radius, b)


def _group_bound(a: DeviceBlock, counts, ws: list, profile, radius, b_abs, *, rterm: bool = False,
                 center: bool = False):
    """The bound of rows ``a`` (``counts[g]`` consecutive rows against expert ``ws[g]``), float64 ``[R, N]``;
    ``rterm``: ``(bound, radius term or None)``, the term from the aligned-adder kernel when it can give it
    (:func:`moeref.compare.device.adder.adder_bound`); ``center`` appends the product ``a W^T`` (without bias) when
    that kernel gives it too, else None."""
    model = profile.accum_model
    if model not in ("worst_case", "contiguous_tree", "data_dependent"):
        raise ValueError(f"accum_model must be one of worst_case, contiguous_tree, data_dependent; got {model!r}")
    from ._bound_kernels import items, ordered_dot_t

    torch = _torch()
    k = int(a.values.shape[1])
    n = int(ws[0].shape[0])
    dev = a.values.device
    r = int(a.values.shape[0])
    if r == 0 or n == 0:
        z = torch.zeros((r, n), dtype=torch.float64, device=dev)
        return _with_parts(z, None, z.clone(), rterm, center)
    if model == "data_dependent":
        return adder_bound(a, counts, ws, profile, radius, b_abs, rterm=rterm, center=center)
    it, bm = items(counts, dev)
    if model == "worst_case":
        bk = max(1, min(a.block[1], ws[0].block[1], max(k, 1)))
        coef = gemm_coefficient(profile, k, -(-k // bk))
        a_abs = a.dequantize().abs() + (0.0 if radius is None else radius)
        wa, abs_w = _abs_stack(ws)
        dot = ordered_dot_t(_kt(a_abs), wa, it, bm, ORDER_CHUNK, ORDER_STEP, abs_w=abs_w)
        out = coef * (dot + _rows_of(b_abs, counts))
    else:
        out = _tree(a, counts, ws, profile, radius, b_abs, it, bm)
    return _with_parts(out, None, None, rterm, center)


def _tree(a: DeviceBlock, counts, ws, profile, radius, b_abs, it, bm):
    """:func:`moeref.compare.gemm_bounds.contiguous_tree_gemm_bound`, operation for operation."""
    torch = _torch()
    from ._bound_kernels import ordered_dot_t, tree_walks_t

    m, k = (int(d) for d in a.values.shape)
    n = int(ws[0].shape[0])
    dev = a.values.device
    u = float(profile.accum_unit)
    rho = float(profile.adder_factor)
    u_prom = float(profile.promote_unit)
    lanes = max(TREE_LANES)
    kp = -(-max(k, 1) // lanes) * lanes
    wd = _weights_kt(ws)
    if radius is None:
        d = torch.zeros((m, n), dtype=torch.float64, device=dev)
    else:
        d = ordered_dot_t(_kt(radius), wd, it, bm, ORDER_CHUNK, ORDER_STEP, abs_w=True) * (1.0 + gamma(k + 2, U_F64))
    rng, wsum, csum = tree_walks_t(_kt(a.dequantize()), wd, it, bm, kp)
    slack = 2.0 * gamma(kp + 2, U_F64) * wsum
    r_hi = rng + slack + d
    w_hi = wsum * (1.0 + gamma(kp + 2, U_F64)) + d
    c_hi = csum.abs() + slack + d
    sigma = gamma(2, u_prom)
    _, a_bf, _, _ = _row_stats(a.values)
    w_bf = [w.bf16 if isinstance(w, _StackedExpert) else bool(_row_stats(w.values)[1].all()) for w in ws]
    starts = np.cumsum(counts) - np.asarray(counts)
    exact_p = [bool(a_bf[s:s + c].all()) and wb for s, c, wb in zip(starts, counts, w_bf)]
    u_rows = np.repeat(np.where(exact_p, 0.0, 2.0 * u), counts)
    t = rho * max(k - 1, 0) * u
    denom = 1.0 - t - sigma
    if denom <= 0:
        return torch.full((m, n), math.inf, dtype=torch.float64, device=dev)
    coef = (sigma + torch.as_tensor(u_rows, dtype=torch.float64, device=dev))[:, None]
    acc = (t * r_hi + coef * w_hi) / torch.tensor(denom, dtype=torch.float64, device=dev)
    out = acc + u_prom * (c_hi + acc + _rows_of(b_abs, counts)) + (k + 2) * 2.0**-149
    return out * (1.0 + 1e-9)


# ------------------------------------------------------------------------------ rows against experts


def _expert_block(weights, e: int) -> DeviceBlock:
    """Expert ``e`` of a device stack (:class:`moeref.gemm.StackedExperts`, or a float ``[E, N, K]`` tensor:
    one block of scale 1) as a :class:`DeviceBlock` (decoded now, one expert)."""
    torch = _torch()
    from ...gemm.stacked import StackedExperts

    if isinstance(weights, StackedExperts):
        return _stacked_block(weights, e)
    we = weights[e].to(torch.float64)
    n, k = (int(d) for d in we.shape)
    return DeviceBlock(we, torch.ones((1, 1), dtype=torch.float64, device=we.device), (max(n, 1), max(k, 1)))


def _expert_groups(row_expert, weights, profile=None):
    """``(experts, row index array, counts)`` per group of experts whose decoded weights fit
    :data:`WEIGHT_GROUP_BYTES`, or all experts at once where the bound reads the weights' codes without a float64
    copy (the aligned-adder bound of a :class:`StackedExperts`: fewer, larger launches); rows sorted by expert."""
    from ...gemm.stacked import StackedExperts

    rows = np.asarray(row_expert, dtype=np.int64)
    experts = np.unique(rows[rows >= 0])
    if experts.size == 0:
        return
    n, k = _shape(weights)
    coded = isinstance(weights, StackedExperts) and profile is not None and profile.accum_model == "data_dependent"
    per = experts.size if coded else max(1, WEIGHT_GROUP_BYTES // max(1, 8 * n * k))
    for i in range(0, experts.size, per):
        es = experts[i:i + per]
        idx = [np.flatnonzero(rows == e) for e in es.tolist()]
        yield es.tolist(), np.concatenate(idx), [x.size for x in idx]


def device_rows_error_bound(a, a_radius, row_expert, weights, bias, profile, *, radius_term: bool = False,
                            center: bool = False):
    """:func:`moeref.compare.gemm_intervals._rows_error_bound` on a device: ``a`` a
    :class:`moeref.gemm.device.DeviceOperand` ``[R, K]``, ``a_radius`` float64 ``[R, K]`` or None,
    ``row_expert`` int ``[R]`` (NumPy), ``weights`` a device stack, ``bias`` float64 ``[E, N]`` or None.
    Returns float64 ``[R, N]``, 0 on padding rows. ``radius_term=True`` (with ``a_radius``) returns
    ``(device_rows_radius_term(a_radius, ...), bound)``, the term from the bound's own kernel where it gives it.
    ``center=True`` appends the product ``a W^T`` without the bias, :func:`moeref.gemm.device.device_expert_rows_gemm`
    bit for bit (0 on padding rows), when the aligned-adder kernel forms it for every row along the bound
    (:func:`moeref.compare.device.adder.adder_bound`), else None: the caller computes it."""
    torch = _torch()
    dev = a.device
    n = _n_out(weights)
    rows_all = len(row_expert)
    out = rad = prod = None  # made where a group's rows are scattered (_put_rows)
    with_prod = center  # the kernel gives the product for every group so far
    for es, idx, counts in _expert_groups(row_expert, weights, profile):
        # every row, already in expert order, one row a scale row: the operand itself (no gathers, no scatters)
        whole = int(a.block[0]) == 1 and idx.size == rows_all and bool((idx == np.arange(rows_all)).all())
        it = torch.as_tensor(idx, device=dev)
        ag = DeviceBlock.of(a if whole else a.take_rows(it))
        ws = _Experts(_expert_block(weights, e) for e in es)
        r = a_radius if a_radius is None or whole else a_radius.index_select(0, it)
        b = (torch.zeros((len(es), n), dtype=torch.float64, device=dev) if bias is None
             else bias.index_select(0, torch.as_tensor(es, device=dev)).abs())
        got = _group_bound(ag, counts, ws, profile, r, b, rterm=radius_term, center=with_prod)
        got = got if radius_term or with_prod else (got,)
        out = _put_rows(out, it, got[0], rows_all, whole=whole)
        if radius_term:
            term = got[1]
            if term is None:
                term = radius_dots(r, counts, ws)
            rad = _put_rows(rad, it, term, rows_all, whole=whole)
        if with_prod and got[-1] is None:  # not from the kernel for these rows: the caller computes the product
            with_prod, prod = False, None
        elif with_prod:
            prod = _put_rows(prod, it, got[-1], rows_all, whole=whole)
        del ws
    out = _or_zeros(out, rows_all, n, dev)
    res = ((_or_zeros(rad, rows_all, n, dev), out) if radius_term else (out,)) + \
        ((_or_zeros(prod, rows_all, n, dev) if with_prod else None,) if center else ())
    return res if len(res) > 1 else out


def device_rows_radius_term(radius, row_expert, weights):
    """:func:`moeref.compare.gemm_intervals._rows_radius_term` on a device: ``radius[r] @ |W[e(r)]|^T`` as
    :func:`moeref.compare.operand_radius.radius_dot` sums it, float64 ``[R, N]``."""
    torch = _torch()
    n = _n_out(weights)
    out = torch.zeros((len(row_expert), n), dtype=torch.float64, device=radius.device)
    for es, idx, counts in _expert_groups(row_expert, weights):
        it_rows = torch.as_tensor(idx, device=radius.device)
        out[it_rows] = radius_dots(radius.index_select(0, it_rows), counts, [_expert_block(weights, e) for e in es])
    return out


def _shape(weights) -> tuple[int, int]:
    from ...gemm.stacked import StackedExperts

    if isinstance(weights, StackedExperts):
        return tuple(int(d) for d in weights.shape)
    return int(weights.shape[1]), int(weights.shape[2])


def _n_out(weights) -> int:
    from ...gemm.stacked import StackedExperts

    if isinstance(weights, StackedExperts):
        return int(weights.shape[0])
    return int(weights.shape[1]) if len(weights) else 0
