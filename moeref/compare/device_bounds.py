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

Memory: experts in groups (:data:`WEIGHT_GROUP_BYTES`). The aligned-adder bound reads the uint8 codes of
:class:`~moeref.gemm.StackedExperts` (K-major) through the decode table, times the block scale in the kernel
(the exact domain and the scaled form alike), so it forms no float64 copy of the weights; the other models
decode a group's weights to float64 ``[G, K, N]`` (K-major, so each kernel's column loads are coalesced) just
before its bound and drop them after.
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
    finite: bool | None = None
    quantum_max: tuple | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[0]), int(self.values.shape[1])

    def dequantize(self):
        """:meth:`moeref.gemm.BlockOperand.dequantize`: each element times its block scale (one multiply)."""
        r, k = self.shape
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


def _row_stats(values):
    """Per row of float64 ``values`` ``[R, K]``: all finite, bf16-representable, and
    :func:`moeref.gemm.exact.quantum_and_max` (``(inf, 0)`` for a zero row) as NumPy arrays: one pass of
    :func:`moeref.compare._stats_kernels.row_stats_t`, one host copy."""
    from ._stats_kernels import row_stats_t

    out = row_stats_t(values).cpu().numpy()
    return out[0] > 0, out[1] > 0, out[2], out[3]


def _consts(device, *vals):
    torch = _torch()
    return torch.tensor([float(x) for x in vals], dtype=torch.float64, device=device)


def _kt(x):
    """K-major contiguous copy ``[K, R]`` of ``[R, K]``."""
    return x.t().contiguous()


def _weights_kt(ws, sel=None, *, scaled: bool = True, magnitude: bool = False):
    """``[G, K, N]`` float64 K-major stack of experts ``ws[g]`` (``g`` in ``sel``, default all): their values
    times their block scales (``scaled``; else the element values), ``|.|`` if ``magnitude``. Experts of one
    :class:`~moeref.gemm.StackedExperts` are decoded together from their codes (:func:`_decode_kt`); others
    one by one (:meth:`DeviceBlock.dequantize`). The same numbers either way: one multiply per element, and
    ``|v * s| = |v| * |s|``."""
    torch = _torch()
    if isinstance(ws, _Experts) and scaled and not magnitude and (sel is None or list(sel) == list(range(len(ws)))):
        if ws.full is None:
            ws.full = _weights_kt(list(ws))
        return ws.full
    items = [ws[g] for g in (range(len(ws)) if sel is None else sel)]
    if items and all(isinstance(w, _StackedExpert) and w.stack is items[0].stack for w in items):
        return _decode_kt(items[0].stack, [w.e for w in items], scaled, magnitude)
    out = torch.stack([(w.dequantize() if scaled else w.values).t() for w in items]).contiguous()
    return out.abs() if magnitude else out


class _Experts(list):
    """The experts of one group (:func:`_expert_groups`) with their dequantized ``[G, K, N]`` stack, decoded at
    most once (``full``) for the GEMM2 radius term and error bound, which both read it."""

    full = None


def _abs_stack(ws):
    """``(stack, abs_w)`` for a kernel that reads ``|W|``: the group's decoded stack read through ``|.|`` when
    it exists (:class:`_Experts`), else a magnitude stack."""
    if isinstance(ws, _Experts) and ws.full is not None:
        return ws.full, True
    return _weights_kt(ws, magnitude=True), False


def _decode_kt(w, experts: list, scaled: bool, magnitude: bool):
    """Experts ``experts`` of the :class:`StackedExperts` ``w`` as float64 ``[G, K, N]``: the codes gathered and
    transposed (one byte each), decoded in one pass, then multiplied in place by their block scales broadcast
    over the blocks (no element-sized scale tensor)."""
    torch = _torch()
    from ..gemm.device import _decode

    n, k = (int(d) for d in w.shape)
    v = _decode(_codes_kt(w, experts), w.element, w.magnitude)
    if magnitude:
        v = v.abs_()
    if not scaled:
        return v
    st = w.scales.index_select(0, torch.as_tensor(experts, dtype=torch.int64, device=w.scales.device)).transpose(1, 2)
    st = st.abs() if magnitude else st
    br, bk = (int(b) for b in w.block)
    g = len(experts)
    if k % bk == 0 and n % br == 0:
        v.view(g, k // bk, bk, n // br, br).mul_(st[:, :, None, :, None])
    else:
        v.mul_(st.repeat_interleave(bk, dim=1)[:, :k].repeat_interleave(br, dim=2)[:, :, :n])
    return v


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
    (:func:`moeref.compare.device_adder.adder_bound`); ``center`` appends the product ``a W^T`` (without bias) when
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
        from .device_adder import adder_bound

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


def _put_rows(dst, rows, part, total: int, *, whole: bool = False):
    """``dst`` with ``part`` (float64 ``[len(rows), N]``) at rows ``rows``: ``part`` itself where it holds every row in
    order and nothing is written yet (``whole``), else scattered into ``dst``, made here as zeros ``[total, N]`` on
    first use (``dst`` None). Results are made only where some rows are scattered (no float64 ``[R, N]`` of zeros
    that a whole result would replace)."""
    if whole and dst is None:
        return part
    if dst is None:
        dst = _torch().zeros((total, int(part.shape[1])), dtype=part.dtype, device=part.device)
    dst[rows] = part
    return dst


def _or_zeros(x, total: int, n: int, device):
    """``x``, or float64 zeros ``[total, n]`` where no row was put (None)."""
    torch = _torch()
    return torch.zeros((total, n), dtype=torch.float64, device=device) if x is None else x


def _with_parts(bound, term, product, rterm: bool, center: bool):
    """``bound``, or the tuple of it with the radius ``term`` (``rterm``) and the ``product`` (``center``) after it:
    what the bound functions return for those flags."""
    extra = ((term,) if rterm else ()) + ((product,) if center else ())
    return (bound,) + extra if extra else bound


def _rows_of(per_expert, counts):
    """``[G, N]`` -> ``[R, N]``: expert ``g``'s row repeated ``counts[g]`` times."""
    torch = _torch()
    return per_expert.repeat_interleave(torch.as_tensor(np.asarray(counts, dtype=np.int64), device=per_expert.device),
                                        dim=0)


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


def _codes_kt(w, experts: list):
    """uint8 codes ``[G, K, N]`` (unpacked, K-major) of experts ``experts`` of the :class:`StackedExperts` ``w``."""
    torch = _torch()
    from ..gemm.device import _unpack_nibbles

    codes = w.codes.index_select(0, torch.as_tensor(experts, dtype=torch.int64, device=w.codes.device))
    if w.packed:
        codes = _unpack_nibbles(codes, int(w.shape[1]))
    return codes.transpose(1, 2).contiguous()


def _chunk_scales(scales, rows, block, blk, *, magnitude: bool = True):
    """``|scales|`` (the scales themselves without ``magnitude``) of each row's block at each chunk's first column,
    ``[R, NCH]``."""
    torch = _torch()
    s = scales.index_select(0, torch.div(rows, block[0], rounding_mode="floor")) \
        .index_select(1, torch.div(blk, block[1], rounding_mode="floor"))
    return (s.abs() if magnitude else s).contiguous()


def _finite(op: DeviceBlock) -> bool:
    return op.finite if op.finite is not None else bool(_row_stats(op.values)[0].all())


def _quantum_max(op: DeviceBlock) -> tuple[float, float]:
    if op.quantum_max is not None:
        return op.quantum_max
    _, _, q, mx = _row_stats(op.values)
    return (float(q.min(initial=math.inf)), float(mx.max(initial=0.0)))


# ------------------------------------------------------------------------------ rows against experts


def _expert_block(weights, e: int) -> DeviceBlock:
    """Expert ``e`` of a device stack (:class:`moeref.gemm.StackedExperts`, or a float ``[E, N, K]`` tensor:
    one block of scale 1) as a :class:`DeviceBlock` (decoded now, one expert)."""
    torch = _torch()
    from ..gemm.stacked import StackedExperts

    if isinstance(weights, StackedExperts):
        return _stacked_block(weights, e)
    we = weights[e].to(torch.float64)
    n, k = (int(d) for d in we.shape)
    return DeviceBlock(we, torch.ones((1, 1), dtype=torch.float64, device=we.device), (max(n, 1), max(k, 1)))


def _stacked_block(w, e: int) -> "_StackedExpert":
    return _StackedExpert(w, e)


class _StackedExpert:
    """Expert ``e`` of a :class:`StackedExperts` as a :class:`DeviceBlock` whose values are decoded only when
    read (stacks of experts are decoded together by :func:`_weights_kt`). ``finite``, ``quantum_max``
    (:func:`moeref.gemm.exact.quantum_and_max`) and ``bf16`` (every value bf16-representable) come from the
    codes present (a histogram of the codes read through the decode table: the same numbers as over the
    values)."""

    def __init__(self, w, e: int):
        self.stack, self.e = w, int(e)
        self.scales = w.scales[e]
        self.block = tuple(int(b) for b in w.block)
        finite, qm, bf16 = _stack_expert_stats(w)
        self.finite = bool(finite[e])
        self.quantum_max = (float(qm[e, 0]), float(qm[e, 1])) if self.finite else None
        self.bf16 = bool(bf16[e])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(d) for d in self.stack.shape)

    @property
    def values(self):
        """float64 element values ``[N, K]`` (a view of a K-major tensor: codes transposed, then decoded)."""
        return _decode_kt(self.stack, [self.e], scaled=False, magnitude=False)[0].t()

    dequantize = DeviceBlock.dequantize


def _codes_present(w) -> np.ndarray:
    """bool ``[E, 256]``: which codes each expert holds, one histogram per expert and one host copy for the
    stack, cached on the codes tensor (weights are constant between calls; a new tensor is a new cache)."""
    torch = _torch()
    from ..gemm.device import _cached_on, _unpack_nibbles

    def compute():
        hist = []
        for e in range(int(w.codes.shape[0])):
            c = w.codes[e]
            c = _unpack_nibbles(c, w.shape[1]) if w.packed else c
            hist.append(torch.bincount(c.reshape(-1), minlength=256)[:256])
        return (torch.stack(hist) > 0).cpu().numpy() if hist else np.zeros((0, 256), dtype=bool)

    return _cached_on(w.codes, "_moeref_codes_present", compute)


def _stack_expert_stats(w):
    """Per expert of a :class:`StackedExperts`: ``(finite bool [E], quantum and max float64 [E, 2], bf16 bool [E])``
    over the values of the codes it holds (:func:`_codes_present`): all finite; ``(q, m)`` of
    :func:`moeref.gemm.exact.quantum_and_max` (the smallest per-value quantum and the largest magnitude over the
    nonzero codes present: the same numbers as over the values; ``(inf, 0)`` for an all-zero expert); every value
    bf16-representable. Computed for all experts at once and cached on the codes tensor beside the histogram."""
    import ml_dtypes

    from ..formats import decode_table
    from ..gemm.device import _cached_on
    from ..gemm.exact import quantum_and_max

    def compute():
        table = decode_table(w.element)
        table = np.abs(table) if w.magnitude else table
        present = _codes_present(w)[:, :table.size]
        fin_code = np.isfinite(table)
        finite = ~(present & ~fin_code[None, :]).any(axis=1)
        mag = np.where(fin_code, np.abs(table), 0.0)
        quantum = np.array([quantum_and_max([v])[0] if (f and v != 0) else math.inf for v, f in zip(table, fin_code)])
        qm = np.stack([np.where(present, quantum[None, :], math.inf).min(axis=1, initial=math.inf),
                       np.where(present, mag[None, :], 0.0).max(axis=1, initial=0.0)], axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            bf_code = fin_code & (table.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) == table)
        return finite, qm, finite & ~(present & ~bf_code[None, :]).any(axis=1)

    return _cached_on(w.codes, "_moeref_expert_stats", compute)


def _expert_groups(row_expert, weights, profile=None):
    """``(experts, row index array, counts)`` per group of experts whose decoded weights fit
    :data:`WEIGHT_GROUP_BYTES`, or all experts at once where the bound reads the weights' codes without a float64
    copy (the aligned-adder bound of a :class:`StackedExperts`: fewer, larger launches); rows sorted by expert."""
    from ..gemm.stacked import StackedExperts

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
    """:func:`moeref.compare.bounds._rows_error_bound` on a device: ``a`` a
    :class:`moeref.gemm.device.DeviceOperand` ``[R, K]``, ``a_radius`` float64 ``[R, K]`` or None,
    ``row_expert`` int ``[R]`` (NumPy), ``weights`` a device stack, ``bias`` float64 ``[E, N]`` or None.
    Returns float64 ``[R, N]``, 0 on padding rows. ``radius_term=True`` (with ``a_radius``) returns
    ``(device_rows_radius_term(a_radius, ...), bound)``, the term from the bound's own kernel where it gives it.
    ``center=True`` appends the product ``a W^T`` without the bias, :func:`moeref.gemm.device.device_expert_rows_gemm`
    bit for bit (0 on padding rows), when the aligned-adder kernel forms it for every row along the bound
    (:func:`moeref.compare.device_adder.adder_bound`), else None: the caller computes it."""
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
                from .device_adder import radius_dots

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
    """:func:`moeref.compare.bounds._rows_radius_term` on a device: ``radius[r] @ |W[e(r)]|^T`` as
    :func:`moeref.compare.operand_radius.radius_dot` sums it, float64 ``[R, N]``."""
    torch = _torch()
    from .device_adder import radius_dots

    n = _n_out(weights)
    out = torch.zeros((len(row_expert), n), dtype=torch.float64, device=radius.device)
    for es, idx, counts in _expert_groups(row_expert, weights):
        it_rows = torch.as_tensor(idx, device=radius.device)
        out[it_rows] = radius_dots(radius.index_select(0, it_rows), counts, [_expert_block(weights, e) for e in es])
    return out


def _shape(weights) -> tuple[int, int]:
    from ..gemm.stacked import StackedExperts

    if isinstance(weights, StackedExperts):
        return tuple(int(d) for d in weights.shape)
    return int(weights.shape[1]), int(weights.shape[2])


def _n_out(weights) -> int:
    from ..gemm.stacked import StackedExperts

    if isinstance(weights, StackedExperts):
        return int(weights.shape[0])
    return int(weights.shape[1]) if len(weights) else 0
