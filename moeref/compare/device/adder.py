"""The aligned-adder bound (:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound`, the data-dependent model)
and GEMM2's operand-radius term (:func:`moeref.compare.operand_radius.radius_dot`) on torch float64 tensors: the
NumPy numbers bit for bit, each expert group in its form (:func:`moeref.compare.gemm_bounds.adder_form`):

* exact and steps forms: every step sum exact, so on the float64 tensor cores (:mod:`moeref.compare.device._adder_mma`),
  the weights read as their codes from the stack itself, all experts of a layer in one launch;
* scaled form: the column-order kernel (:func:`moeref.compare.device._bound_kernels.adder_bound_t`), codes read through
  the decode table where the weights have them;
* the radius term from the bound's own kernel where it can give it, else per expert: exact chunk sums on the
  radius's grid as float64 matrix products, or :func:`~moeref.compare.device._bound_kernels.ordered_dot_t`.

Called by :mod:`moeref.compare.device.bounds` (which holds the operands, the expert statistics and the other
models).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..aligned_adder import _MIN_NORMAL, adder_exact, adder_setup
from ..summation_order import ORDER_CHUNK, ORDER_STEP
from ._constants import float64_constants
from .operands import (
    DeviceBlock,
    _chunk_scales,
    _codes_kt,
    _finite,
    _kt,
    _or_zeros,
    _put_rows,
    _quantum_max,
    _row_stats,
    _rows_of,
    _StackedExpert,
    _torch,
    _weights_kt,
    _with_parts,
)

__all__ = ["adder_bound", "radius_dots"]


@dataclass(frozen=True)
class _Forms:
    """Per expert group: its form (:func:`moeref.compare.gemm_bounds.adder_form`), the radius grid's bits where
    :func:`moeref.compare.operand_radius.exact_radius` rounds the group's radius (None elsewhere; any form) and the
    exponent offsets of its rows and weights and the quantum of their products ``q_a q_w`` (exact form)."""

    form: list
    grid: list
    offsets: list
    quanta: list


def _adder_forms(a: DeviceBlock, counts, ws, st, radius) -> _Forms:
    """:func:`moeref.compare.gemm_bounds.adder_form` of each group (rows ``counts[g]`` of ``a`` against ``ws[g]``),
    from the same statistics: the rows' finiteness, quantum and largest value (:func:`_row_stats`), the experts'
    (:func:`_quantum_max`, from the codes present for stacked experts), finite scales and radius."""
    from ..operand_radius import RADIUS_CHUNK, chunk_scales_constant

    torch = _torch()
    k = int(a.values.shape[1])
    g_n = len(ws)
    forms, grid, offs, quanta = ["scaled"] * g_n, [None] * g_n, [(0, 0)] * g_n, [0.0] * g_n
    starts = np.cumsum(counts) - np.asarray(counts)
    if radius is not None:  # per group: the radius finite (the grid's condition), and the rows' scales too
        dev = a.values.device
        rows_of = torch.as_tensor(np.repeat(np.arange(g_n), counts), device=dev)
        sa_fin = torch.isfinite(a.scales).all(dim=1).index_select(
            0, torch.div(torch.arange(int(a.values.shape[0]), device=dev), a.block[0], rounding_mode="floor"))
        r_fin = torch.isfinite(radius).all(dim=1)

        def per_group(ok):
            return torch.zeros(g_n, dtype=torch.int64, device=dev).index_add_(0, rows_of, (~ok).to(torch.int64)) == 0

        fin_r, fin_sa = torch.stack([per_group(r_fin), per_group(sa_fin)]).cpu().numpy()
        grid = [_weight_grid_bits(w, k) if fin_r[g] else None for g, w in enumerate(ws)]
    if not st.const_scales:
        return _Forms(forms, grid, offs, quanta)
    fin, _, q, mx = _row_stats(a.values)
    chunks_ok = chunk_scales_constant(k, RADIUS_CHUNK, st.chunk)
    for g, (s0, c) in enumerate(zip(starts, counts)):
        if not (c and fin[s0:s0 + c].all() and _finite(ws[g])):
            continue
        qm_w = _quantum_max(ws[g])
        qm_a = (float(q[s0:s0 + c].min()), float(mx[s0:s0 + c].max()))
        if not adder_exact(qm_a, qm_w, st.chunk):
            continue
        if radius is None:
            forms[g] = "exact"
            offs[g] = (_top_exponent(qm_a[1]), _top_exponent(qm_w[1]))
            quanta[g] = qm_a[0] * qm_w[0]
        elif grid[g] is not None and fin_sa[g] and chunks_ok:
            forms[g] = "steps"
    return _Forms(forms, grid, offs, quanta)


def _top_exponent(m: float) -> int:
    """``floor(log2 m)`` of a positive finite float (0 for 0)."""
    return math.frexp(m)[1] - 1 if m > 0 else 0


def _finite_scales(op) -> bool:
    """Every block scale of ``op`` is finite; for stacked experts one flag an expert, computed once for the stack
    and cached on its scales tensor (weights are constant between calls; a new tensor is a new cache)."""
    torch = _torch()
    if not isinstance(op, _StackedExpert):
        return bool(torch.isfinite(op.scales).all())
    from ...gemm.device import _cached_on

    sc = op.stack.scales
    flags = _cached_on(sc, "_moeref_scales_finite",
                       lambda: torch.isfinite(sc).reshape(sc.shape[0], -1).all(dim=1).cpu().numpy())
    return bool(flags[op.e])


def adder_bound(a: DeviceBlock, counts, ws, profile, radius, b_abs, *, rterm: bool = False, center: bool = False):
    """:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound`, operation for operation, each expert group in
    its form (:func:`_adder_forms`): the exact and steps forms on the float64 tensor cores
    (:mod:`moeref.compare.device._adder_mma`), the scaled form in the column-order kernel
    (:func:`~moeref.compare.device._bound_kernels.adder_bound_t`, from the weights' codes where they have them:
    :func:`_scaled_weights`). ``rterm`` (with a radius): ``(bound, radius term)``, the term
    (:func:`moeref.compare.operand_radius.radius_dot`'s numbers) from the bound's own kernel where it can give it
    (steps form with the radius's chunk as the promotion chunk; scaled form without the radius grid, with
    :func:`~moeref.compare.summation_order.ordered_dot`'s chunk and step), else :func:`_radius_dot` per expert.
    ``center`` appends the product ``a W^T`` without bias (:func:`moeref.gemm.device.device_expert_rows_gemm`'s
    numbers) when the float64 tensor-core kernel gives it for every row (every group in the exact or steps form, the
    promotion chunk the product's segment), else None."""
    torch = _torch()
    from ._adder_mma import NORMAL_QUANTUM
    from ...gemm.device import _segment
    from ._bound_kernels import adder_bound_t, items
    from ..operand_radius import RADIUS_CHUNK

    m, k = (int(d) for d in a.values.shape)
    n = int(ws[0].shape[0])
    dev = a.values.device
    st = adder_setup(k, a.block, ws[0].block, profile)
    if k == 0:
        out = _rows_of(st.g_prom * b_abs, counts).clone()
        return _with_parts(out, None, torch.zeros_like(out), rterm, center)
    want_term = rterm and radius is not None
    out = term = ctr = None  # made where a form holds only some rows (_put_rows)
    forms = _adder_forms(a, counts, ws, st, radius)
    starts = np.cumsum(counts) - np.asarray(counts)
    consts = float64_constants(dev, 2.0 * profile.accum_unit, st.g_prom, 1.0 + 2.0**-40, _MIN_NORMAL, 1.0 + 1e-9, 1.0, 0.0)
    blk = torch.arange(-(-k // st.chunk), device=dev) * st.chunk
    termless = []  # groups whose radius term is computed apart (_radius_dot)
    # the product from the kernel: its chunks must be the product's segments
    center_here = center and max(1, min(st.chunk, k)) == _segment(a.block[1], ws[0].block[1], k)
    for form in ("exact", "steps", "scaled"):
        sel = [g for g in range(len(ws)) if forms.form[g] == form and counts[g]]
        if not sel:
            continue
        rows = torch.as_tensor(np.concatenate([np.arange(starts[g], starts[g] + counts[g]) for g in sel]), device=dev)
        cnt = [counts[g] for g in sel]
        b_sel = b_abs[torch.as_tensor(sel, device=dev)].contiguous()
        whole = int(rows.numel()) == m  # one form holds every row, in order: the kernel's outputs are the results
        if form == "scaled":
            fuse = (want_term and st.mma == ORDER_STEP and st.chunk == max(1, min(ORDER_CHUNK, k))
                    and all(forms.grid[g] is None for g in sel))
            it, bm = items(cnt, dev)
            res, tr = adder_bound_t(a.dequantize().index_select(0, rows),
                                    None if radius is None else radius.index_select(0, rows), _scaled_weights(ws, sel),
                                    b_sel, consts, it, bm, chunk=st.chunk, mma=st.mma, rterm=fuse)
            out = _put_rows(out, rows, res, m, whole=whole)
            if fuse:
                term = _put_rows(term, rows, tr, m, whole=whole)
            elif want_term:
                termless += sel
            center_here = False
            continue
        fuse = want_term and form == "steps" and st.chunk == min(RADIUS_CHUNK, k)
        if want_term and not fuse:
            termless += sel
        normal = form == "exact" and all(forms.quanta[g] * 2.0 * profile.accum_unit >= NORMAL_QUANTUM for g in sel)
        res, tr, cc = _adder_elements(a, rows, cnt, [ws[g] for g in sel], forms, sel, radius, st, blk, b_sel,
                                      consts, form, fuse, normal, center_here)
        out = _put_rows(out, rows, res, m, whole=whole)
        if fuse:
            term = _put_rows(term, rows, tr, m, whole=whole)
        if center_here:
            ctr = _put_rows(ctr, rows, cc, m, whole=whole)
    for g in termless:
        r = torch.arange(starts[g], starts[g] + counts[g], device=dev)
        term = _put_rows(term, r, _radius_dot(radius.index_select(0, r), ws[g]), m)
    return _with_parts(_or_zeros(out, m, n, dev), _or_zeros(term, m, n, dev) if want_term else None,
                       _or_zeros(ctr, m, n, dev) if center_here else None, rterm, center)


def _adder_elements(a, rows, cnt, wsel, forms, sel, radius, st, blk, b_sel, consts, form: str, fuse: bool,
                    normal: bool, center: bool):
    """The exact or steps form of the groups ``sel`` (rows ``rows``, ``cnt`` a group): the element values, their
    step summaries, the rounded radius (steps form), the signed chunk scales and the weights as
    :func:`~moeref.compare.device._adder_mma.adder_mma_bound_t` reads them; ``fuse`` (its ``rterm``), ``normal`` and
    ``center`` as it takes them. Returns its ``(bound, term, product)``."""
    torch = _torch()
    from ._adder_mma import EXACT_ROWS, TILE, adder_mma_bound_t, step_summaries
    from ._bound_kernels import items
    from ..operand_radius import rounded_radius

    dev = a.values.device
    n = int(wsel[0].shape[0])
    k = int(a.values.shape[1])
    whole = int(rows.numel()) == int(a.values.shape[0])  # every row, in order (groups ascending): no gathers

    def take(x):
        return (x if whole else x.index_select(0, rows)).contiguous()

    av = take(a.values)
    sa = _chunk_scales(a.scales, rows, a.block, blk, magnitude=False)
    sw = _experts_chunk_scales(wsel, n, blk, magnitude=False)
    r_hat = None
    if form == "steps":
        bits_rows = torch.as_tensor(np.repeat([forms.grid[g] for g in sel], cnt), device=dev)
        r_hat = rounded_radius(take(radius), bits_rows).contiguous()
        summ = step_summaries(take(a.dequantize()).abs() + r_hat, k, st.chunk, st.mma)
    else:
        summ = step_summaries(av.abs(), k, st.chunk, st.mma)
    offsets = torch.as_tensor([forms.offsets[g] for g in sel], dtype=torch.int32, device=dev).reshape(-1, 2)
    it, bm = items(cnt, dev, sizes=list(EXACT_ROWS) if form == "exact" else [TILE.rows])
    return adder_mma_bound_t(av, r_hat, summ, _mma_weights(wsel), sa, sw, b_sel, offsets, consts, it, n=n,
                             chunk=st.chunk, mma=st.mma, rterm=fuse, center=center, tile=replace(TILE, rows=bm),
                             normal=normal)


def _experts_chunk_scales(wsel, n: int, blk, *, magnitude: bool = True):
    """``|scales|`` (the scales themselves without ``magnitude``) of experts ``wsel`` at each output row and each
    chunk's first column, ``[G, N, NCH]`` in the scales' dtype (:func:`~moeref.compare.device.operands._chunk_scales`
    of each expert, stacked): one gather from the stack's scales when they are experts of one
    :class:`StackedExperts`."""
    torch = _torch()
    dev = blk.device
    st = _one_stack(wsel)
    if st is None:
        return torch.stack([_chunk_scales(w.scales, torch.arange(n, device=dev), w.block, blk, magnitude=magnitude)
                            for w in wsel]).contiguous()
    br, bk = (int(b) for b in st.block)
    idx = torch.as_tensor([w.e for w in wsel], dtype=torch.int64, device=st.scales.device)
    rows = torch.div(torch.arange(n, device=dev), br, rounding_mode="floor")
    s = st.scales.index_select(0, idx).index_select(1, rows).index_select(2, torch.div(blk, bk, rounding_mode="floor"))
    return (s.abs() if magnitude else s).contiguous()


def _one_stack(wsel):
    """The :class:`StackedExperts` all of ``wsel`` are experts of, else None."""
    if wsel and all(isinstance(w, _StackedExpert) and w.stack is wsel[0].stack for w in wsel):
        return wsel[0].stack
    return None


def _mma_weights(wsel):
    """:class:`~moeref.compare.device._adder_mma.MmaWeights` of the experts ``wsel``: the codes of their stack itself and
    their indices in it when they are experts of one :class:`StackedExperts` (no copy), else their float64 element
    values stacked ``[G, N, K]``."""
    torch = _torch()
    from ...gemm.device import _table
    from ._adder_mma import MmaWeights

    st = _one_stack(wsel)
    if st is not None:
        idx = torch.as_tensor([w.e for w in wsel], dtype=torch.int32, device=st.codes.device)
        return MmaWeights(st.codes, _table(st.element, st.magnitude, st.codes.device), idx, bool(st.packed))
    vals = torch.stack([w.values for w in wsel]).contiguous()
    return MmaWeights(vals, None, torch.arange(len(wsel), dtype=torch.int32, device=vals.device))


def _weight_grid_bits(w, k: int):
    """The radius grid's bits for expert ``w`` (:func:`moeref.compare.operand_radius.exact_radius`'s conditions on the
    weights: finite elements and scales, scales constant over each 128-column chunk, a wide enough grid), None where
    the grid does not apply; from the expert's statistics (no host sync for stacked experts)."""
    from ..operand_radius import RADIUS_CHUNK, chunk_scales_constant, radius_grid_bits

    if not (_finite(w) and _finite_scales(w) and chunk_scales_constant(k, w.block[1], RADIUS_CHUNK)):
        return None
    return radius_grid_bits(_quantum_max(w))


def _radius_grid_applies(w, radius) -> bool:
    """Whether :func:`moeref.compare.operand_radius.exact_radius` rounds ``radius`` for expert ``w``."""
    return _weight_grid_bits(w, int(radius.shape[1])) is not None and bool(_torch().isfinite(radius).all())


def _radius_dot(radius, w):
    """:func:`moeref.compare.operand_radius.radius_dot` of rows ``radius`` ``[R, K]`` against one expert ``w`` on the
    device: with the grid, each chunk's exact sum as a float64 matrix product (exact in any order), times the chunk's
    ``|scale_w|``, chunks added in order; else :func:`~moeref.compare.device._bound_kernels.ordered_dot_t`."""
    torch = _torch()
    from ._bound_kernels import items, ordered_dot_t
    from ..operand_radius import RADIUS_CHUNK, rounded_radius

    r, k = (int(d) for d in radius.shape)
    n = int(w.shape[0])
    dev = radius.device
    if r == 0 or n == 0 or k == 0 or not _radius_grid_applies(w, radius):
        it, bm = items([r], dev)
        return ordered_dot_t(_kt(radius), _weights_kt([w], magnitude=True), it, bm, ORDER_CHUNK, ORDER_STEP)
    r_hat = rounded_radius(radius, _weight_grid_bits(w, k))
    wv = w.values.abs()
    blk = torch.arange(-(-k // RADIUS_CHUNK), device=dev) * RADIUS_CHUNK
    sw = _chunk_scales(w.scales, torch.arange(n, device=dev), w.block, blk)              # [N, G]
    out = torch.zeros((r, n), dtype=torch.float64, device=dev)
    for c in range(int(blk.numel())):  # chunks in order
        cols = slice(c * RADIUS_CHUNK, min((c + 1) * RADIUS_CHUNK, k))
        out = out + (r_hat[:, cols] @ wv[:, cols].t()) * sw[None, :, c]
    return out


def _scaled_weights(ws, sel):
    """The scaled form's weights of experts ``sel``: :class:`~moeref.compare.device._bound_kernels.CodedWeights` when they
    are experts of one :class:`StackedExperts` (their codes, the decode table and the block scales: no float64
    copy), else float64 ``[G, K, N]`` (:func:`_weights_kt`)."""
    torch = _torch()
    items = [ws[g] for g in sel]
    w = _one_stack(items)
    if w is None:
        return _weights_kt(ws, sel)
    from ...gemm.device import _table
    from ._bound_kernels import CodedWeights

    experts = [x.e for x in items]
    n = int(w.shape[0])
    br, bk = (int(b) for b in w.block)
    st = w.scales.index_select(0, torch.as_tensor(experts, dtype=torch.int64, device=w.scales.device)).transpose(1, 2)
    st = st.repeat_interleave(br, dim=2)[:, :, :n].to(torch.float64).contiguous()      # [G, ceil(K / bk), N]
    return CodedWeights(_codes_kt(w, experts), _table(w.element, w.magnitude, w.codes.device), st, bk)


def radius_dots(radius, counts, ws):
    """:func:`_radius_dot` of consecutive rows ``counts[g]`` of ``radius`` against each expert ``ws[g]``."""
    torch = _torch()
    out = torch.zeros((int(radius.shape[0]), int(ws[0].shape[0]) if ws else 0), dtype=torch.float64,
                      device=radius.device)
    s0 = 0
    for c, w in zip(counts, ws):
        if c:
            out[s0:s0 + c] = _radius_dot(radius[s0:s0 + c], w)
        s0 += c
    return out
