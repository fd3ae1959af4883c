"""A GEMM's interval before its store (stage 1 of :mod:`moeref.compare.bounds`), bracketed by the store's ends."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gemm.exact import as_operand, block_gemm, in_order_sum
from ..gemm.grouped import ExpertOperands, check_row_expert, expert_rows_gemm
from .gemm_bounds import contiguous_tree_parts, gemm_error_bound
from .operand_radius import exact_radius, radius_dot
from .stores import _abs_range, _store_ends_box


def _rows_error_bound(a, a_radius, row_expert, weights, bias, profile) -> np.ndarray:
    """:func:`gemm_error_bound` of every row against its expert's weights (the row -> expert map of
    :func:`moeref.gemm.grouped.expert_rows_gemm`), float64 ``[R, N]``, 0 on padding rows."""
    a = as_operand(a, "a")
    w = ExpertOperands(weights)
    b = None if bias is None else np.asarray(bias, dtype=np.float64)
    out = np.zeros((row_expert.size, w[0].shape[0] if len(w) else 0))
    for e in np.unique(row_expert[row_expert >= 0]).tolist():  # a loop over experts
        idx = np.flatnonzero(row_expert == e)
        out[idx] = gemm_error_bound(a.take_rows(idx), w[e], profile,
                                    a_radius=None if a_radius is None else a_radius[idx],
                                    bias=None if b is None else b[e])
    return out


def _rows_gemm_interval(a, a_radius, row_expert, weights, bias, profile, ends=None):
    """``(center, radius)`` float64 ``[R, N]`` of a GEMM's interval before its store: the center
    :func:`moeref.gemm.grouped.expert_rows_gemm` of ``a`` (with ``bias``), the radius ``_rows_radius_term`` (with
    ``a_radius``) plus :func:`_rows_error_bound`; 0 on padding rows. The same bits, with one pass over the products
    where they coincide: under ``"contiguous_tree"`` the walk's in-order sum is the center wherever
    :func:`moeref.gemm.exact.in_order_sum` holds, and its ``ordered_dot`` of the radius is the radius term wherever
    :func:`moeref.compare.operand_radius.exact_radius` is None (:func:`moeref.compare.operand_radius.radius_dot`).

    ``ends``: optional, for a caller that only stores the interval: a :class:`_StoreEnds` (:func:`_ends_of`), the
    least and greatest of the two ends the store rounds (after any elementwise step between) over brackets of the
    center and of the radius. Under ``"contiguous_tree"`` the radius is then exact where its ends depend on it, and
    elsewhere a value with the same ends: the bound's brackets (:class:`moeref.compare.tree_brackets._TreeBrackets`,
    which skip the walks of ``L >= 2``) give the same ends (both signs of zero told apart, every bracket and end
    finite, the radius brackets positive), so they are the exact radius's ends; the other outputs walk the next lane
    count and are bracketed again, and those still open after every lane count get the exact radius (or the whole GEMM
    is walked where more than :data:`_EXACT_ALL_FROM` of its outputs are open at first). With ``ends.exact_center``
    False the walk of ``L = 1`` is skipped as well where the store's ends do not depend on it: the in-order sum (the
    center) and the range of ``L = 1`` are bracketed from BLAS block sums, and where the ends agree over the whole box
    of center and radius brackets the center is the BLAS sum (with the bias), a value with the store's ends but not
    the center's bits; elsewhere the outputs walk ``L = 1`` (their center's bits) and go on as above."""
    if profile.accum_model != "contiguous_tree":
        center = expert_rows_gemm(a, row_expert, weights, bias)
        bound = _rows_error_bound(a, a_radius, row_expert, weights, bias, profile)
        return center, bound if a_radius is None else _rows_radius_term(a_radius, row_expert, weights) + bound
    a = as_operand(a, "a")
    w = ExpertOperands(weights)
    rows = check_row_expert(row_expert, a.shape[0], len(w))
    b = None if bias is None else np.asarray(bias, dtype=np.float64)
    n = w[0].shape[0] if len(w) else 0
    center = np.zeros((rows.size, n))
    radius = np.zeros((rows.size, n))
    for e in np.unique(rows[rows >= 0]).tolist():  # a loop over experts
        idx = np.flatnonzero(rows == e)
        a_e, r_e = a.take_rows(idx), None if a_radius is None else a_radius[idx]
        b_e = None if b is None else b[e]
        grid = r_e is not None and r_e.shape[1] and n and exact_radius(r_e, w[e]) is not None
        if ends is not None and n:
            c_e, rad = _tree_interval_by_ends(a_e, w[e], r_e, b_e, profile, grid, ends, idx)
        else:
            bound, total, rdot = contiguous_tree_parts(a_e, w[e], profile, a_radius=r_e, bias=b_e)
            c_e = total + 0.0 if in_order_sum(a_e, w[e]) else block_gemm(a_e, w[e])
            if b_e is not None:
                c_e += b_e
            rad = bound
            if r_e is not None:
                if grid:  # radius_dot's grid
                    rdot = radius_dot(r_e, w[e])
                rad = rdot + bound
        center[idx] = c_e
        radius[idx] = rad
    return center, radius


_BRACKET_MORE = 0.06
"""Fraction of a GEMM's outputs whose store ends the brackets leave open from which :func:`_tree_interval_by_ends`
brackets one more lane count from block sums (:meth:`moeref.compare.tree_brackets._TreeBrackets.bracket_more`, for
every output: it costs about what refining 3 % of the outputs does; on the layers of
``bench/studies/bench_layer_bound_cpu.py`` ``L = 2`` takes the open outputs from 20-27 % to 10-13 % at K = 512 and
1024, ``L = 4`` to 8 %, while at K = 256 5 % are open with ``L = 1`` alone; measured on the 2-core VM, 2026-11-29)."""
_EXACT_ALL_FROM = 0.5
"""Fraction of a GEMM's outputs whose store ends the first brackets leave open from which :func:`_rows_gemm_interval`
walks the whole GEMM (:func:`contiguous_tree_parts`) instead of those outputs' products gathered."""


def _open_ends(ends, rows, c_lo, c_hi, lo, hi) -> np.ndarray:
    """Where the center brackets ``c_lo <= center <= c_hi`` and the radius brackets ``lo <= radius <= hi`` leave the
    store's ends open (either end's least and greatest differ, a zero's sign included, or a bracket or an end is not
    finite: a store whose end is not finite keeps the center itself), bool of ``c_lo``'s shape."""
    with np.errstate(invalid="ignore"):
        out = ~(np.isfinite(lo) & np.isfinite(hi))
        lo_min, lo_max, hi_min, hi_max = ends(rows, c_lo, c_hi, lo, hi)
        for x, y in ((lo_min, lo_max), (hi_min, hi_max)):
            out |= ~((x == y) & (np.signbit(x) == np.signbit(y)) & np.isfinite(x))
    return out


def _tree_interval_by_ends(a_e, w_e, r_e, b_e, profile, grid: bool, ends, idx):
    """One expert's ``(center, radius)`` of :func:`_rows_gemm_interval` with ``ends`` (rows ``idx``): the exact
    radius where the brackets' ends differ after every lane count is walked, the upper bracket of the first lane count
    that closes them elsewhere; the center's bits where ``ends.exact_center`` or the walk of ``L = 1`` was needed."""
    from .tree_brackets import _TreeBrackets
    from .gemm_bounds import _checked

    a_c, w_c, radius, b_abs = _checked(a_e, w_e, r_e, b_e)
    tree = _TreeBrackets(a_c, w_c, radius, b_abs, profile, walk_first=ends.exact_center)
    fixed = None if in_order_sum(a_e, w_e) else block_gemm(a_e, w_e)  # a center that is not the walk's sum
    if fixed is not None and b_e is not None:
        fixed += b_e
    rdot = radius_dot(r_e, w_e) if grid else None

    def centers(totals, at=None):
        """The center from ``totals`` (in-order sums or their brackets) at the outputs ``at`` (all when None)."""
        if fixed is not None:
            return fixed if at is None else fixed[at]
        c = (totals if at is None else totals[at]) + 0.0
        if b_e is not None:
            c += b_e if at is None else b_e[at[1]]
        return c

    def with_rdot(lo, hi, at=None):
        if r_e is None:
            return lo, hi
        if grid:
            rd = rdot if at is None else rdot[at]
            return rd + lo, rd + hi
        return tuple((v if at is None else v[at]) + x for v, x in zip(tree.rdot, (lo, hi)))

    lo, hi = with_rdot(*tree.bounds(1))
    open_ = _open_ends(ends, idx[:, None], *(centers(v) for v in tree.c), lo, hi)
    radius = hi

    def settle(mi, ni, lo, hi):
        lo, hi = with_rdot(lo, hi, at=(mi, ni))
        shut = ~_open_ends(ends, idx[mi], *(centers(v, (mi, ni)) for v in tree.c), lo, hi)
        radius[mi[shut], ni[shut]] = hi[shut]
        return shut

    mi, ni = np.nonzero(open_)
    # more lane counts bracketed while many outputs are open (brackets only narrow: the others stay settled)
    while mi.size > _BRACKET_MORE * open_.size and tree.bracket_more():
        keep = ~settle(mi, ni, *tree.bounds(1, mi, ni))
        mi, ni = mi[keep], ni[keep]
    if mi.size > _EXACT_ALL_FROM * open_.size:
        bound, total, rdot_all = contiguous_tree_parts(a_e, w_e, profile, a_radius=r_e, bias=b_e)
        return centers(total), bound if r_e is None else (rdot if grid else rdot_all) + bound
    mi, ni, bound, rdot_p = tree.refine(mi, ni, settle)
    if mi.size:
        radius[mi, ni] = bound if r_e is None else (rdot[mi, ni] if grid else rdot_p) + bound
    return centers(tree.total), radius


def _add_bias_after_store(stored, radius, row_expert, bias, profile):
    """``bias_add="after_store"``: the stored GEMM output (interval ``stored`` +- ``radius``, float64
    ``[R, N]``) plus its row's expert bias (``bias`` ``[E, N]``), added in FP32: center ``stored + b``,
    radius ``radius + promote_unit (|stored + b| + radius)`` (one FP32 rounding of the sum); padding rows
    (``row_expert`` -1) stay 0. The caller stores the result again."""
    center = np.array(stored, dtype=np.float64)
    valid = np.asarray(row_expert) >= 0
    center[valid] += np.asarray(bias, dtype=np.float64)[np.asarray(row_expert)[valid]]
    return center, radius + profile.promote_unit * (np.abs(center) + radius)


def _rows_radius_term(radius, row_expert, weights) -> np.ndarray:
    """``radius[r] @ |W[e(r)]|^T`` (the operand's own uncertainty through GEMM2), float64 ``[R, N]``:
    :func:`moeref.compare.operand_radius.radius_dot` (exact chunk sums on the radius's grid, else
    :func:`moeref.compare.summation_order.ordered_dot`'s order), so the device bound gets the same bits."""
    w = ExpertOperands(weights)
    out = np.zeros((row_expert.size, w[0].shape[0] if len(w) else 0))
    for e in np.unique(row_expert[row_expert >= 0]).tolist():  # a loop over experts
        idx = np.flatnonzero(row_expert == e)
        out[idx] = radius_dot(radius[idx], w[e])
    return out


def _weighted(w, y_pre, dy, reduce_unit: float):
    """GEMM2's interval times its rows' top-k weights ``w`` (broadcast against ``y_pre``) in the epilogue (one FP32
    multiply, ``gemm2_weighted_store``), elementwise: ``(w y, |w| dy + reduce_unit (|w y| + |w| dy))``."""
    y_pre = w * y_pre
    return y_pre, _weighted_radius(np.abs(w) * dy, np.abs(y_pre), reduce_unit)


def _weighted_radius(dy, mag, reduce_unit: float):
    """:func:`_weighted`'s radius from ``|w| dy`` and ``|w y|`` (nondecreasing in each)."""
    return dy + reduce_unit * (mag + dy)


_BRACKETED_STORES = ("bfloat16",)
"""Store dtypes whose GEMM intervals :func:`_rows_gemm_interval` brackets (``ends``): a bf16 ulp is wide against the
contiguous-tree bound, so a small fraction of the stores' ends depend on its exact bits (on the layers of
``bench/studies/bench_layer_bound_cpu.py``, 8 % at K = 512 and 1024 and 5 % at K = 256 before any walk); an FP32 or
FP16 ulp is not, and their GEMMs would mostly be walked twice."""


def _weighted_box(w, c_lo, c_hi, r_lo, r_hi, reduce_unit: float):
    """``(y_lo, y_hi, d_lo, d_hi)``: brackets of :func:`_weighted`'s ``(w y, radius)`` over every ``y`` in ``[c_lo,
    c_hi]`` and radius in ``[r_lo, r_hi]`` (elementwise; each of its float64 operations is monotone in each operand,
    ``w y`` nondecreasing or nonincreasing in ``y`` with the sign of ``w``); ``c_lo == c_hi`` gives :func:`_weighted`
    at ``r_lo`` and ``r_hi`` with their bits."""
    y1, y2 = w * c_lo, w * c_hi
    y_lo, y_hi = np.minimum(y1, y2), np.maximum(y1, y2)
    m_lo, m_hi = _abs_range(y_lo, y_hi)
    w_abs = np.abs(w)
    return (y_lo, y_hi, _weighted_radius(w_abs * r_lo, m_lo, reduce_unit),
            _weighted_radius(w_abs * r_hi, m_hi, reduce_unit))


@dataclass(frozen=True, eq=False)
class _StoreEnds:
    """The ``ends`` of :func:`_rows_gemm_interval` for a store to ``dtype`` (:func:`_ends_of`), after :func:`_weighted`
    by ``w_row`` (``[R]``) where given: called as ``ends(rows, c_lo, c_hi, r_lo, r_hi)``, it returns ``(lo_min,
    lo_max, hi_min, hi_max)``, the least and greatest of each end the store rounds over every center in ``[c_lo,
    c_hi]`` and radius in ``[r_lo, r_hi]`` of elements of the rows ``rows`` (broadcast against the brackets;
    :func:`moeref.compare.stores._store_ends_box`). ``exact_center``: whether the caller reads the interval's center
    (False: it only stores it, so a center with the same store's ends will do, :func:`_rows_gemm_interval`)."""

    dtype: str
    w_row: np.ndarray | None = None
    reduce_unit: float = 0.0
    exact_center: bool = True

    def __call__(self, rows, c_lo, c_hi, r_lo, r_hi):
        if self.w_row is not None:
            c_lo, c_hi, r_lo, r_hi = _weighted_box(self.w_row[rows], c_lo, c_hi, r_lo, r_hi, self.reduce_unit)
        return _store_ends_box(c_lo, c_hi, r_lo, r_hi, self.dtype)


def _ends_of(dtype, w_row=None, reduce_unit: float = 0.0, exact_center: bool = True):
    """The :class:`_StoreEnds` of :func:`_rows_gemm_interval` for a store to ``dtype``, after :func:`_weighted` by
    ``w_row`` where given; None (every radius exact) for a store that does not round (``dtype`` None) or one not in
    :data:`_BRACKETED_STORES`. ``exact_center=False``: the caller only stores the interval (the layer bound)."""
    if dtype not in _BRACKETED_STORES:
        return None
    return _StoreEnds(dtype, w_row, reduce_unit, exact_center)
