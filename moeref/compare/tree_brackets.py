"""Brackets of the contiguous-tree bound (:mod:`moeref.compare.contiguous_tree`) for the layer bound's GEMM
intervals before a bf16 store (:func:`moeref.compare.gemm_intervals._rows_gemm_interval`): :class:`_TreeBrackets`,
the bound bracketed from BLAS block sums (:func:`_walk_brackets`: the in-order sum and the range of ``L = 1``, and per
lane those of ``L = 2, 4``) and BLAS lane sums (:func:`_lane_caps`), narrowed one lane count at a time by the walks of
:func:`moeref.compare.contiguous_tree._tree_walks` for the outputs whose store the brackets leave open.
"""
from __future__ import annotations

import math

import numpy as np

from ..gemm.exact import BlockOperand
from . import contiguous_tree as _ct  # _CAP_MACS read where used (tests set it there)
from .contiguous_tree import (TREE_LANES, _bias_init, _contiguous_tree, _k_major, _lane_sums, _lane_top,
                              _products_exact_in_fp32, _tree_bound, _tree_walks)
from .stores import _abs_range
from .summation_order import U_F64, gamma, ordered_dot_pairs


class _TreeBrackets:
    """Brackets of :func:`_contiguous_tree`'s bound without the walks of ``L >= 2`` (and, with ``walk_first`` False,
    without the walk of ``L = 1``), refined on request, for validated inputs (``a`` ``[M, K]``, ``w`` ``[N, K]``,
    ``M, N >= 1``).

    The bound is nondecreasing in the walks' range ``R``, in ``W = sum |p|``, in ``|S|`` (``S`` the in-order sum, the
    last prefix sum of ``L = 1``) and in the radius dot (:func:`_tree_bound`), so brackets of those bracket it. ``R``
    is the largest range over the lane counts: at least the range of ``L = 1`` (its exact bits where it was walked,
    else the lower bracket of :func:`_walk_brackets`), or of the lane counts walked so far (:meth:`refine`), at most
    that (the upper bracket of ``L = 1`` where it was not walked) or the caps ``(sum |p| + |sum p|) / 2`` of every lane
    of the lane counts not walked (BLAS lane sums with the margins of :func:`_tree_walks`' skip test,
    :func:`_lane_caps`). ``W`` and the radius dot are sums of nonnegative products, within ``gamma_K`` of their exact
    value in any order (BLAS, any blocking, fused or not, and the in-order sums alike) plus ``2^-1075`` a product for
    underflow: within :func:`_grow` and :func:`_tiny` of the BLAS sums. ``S`` is bracketed with the range of ``L = 1``
    (:func:`_walk_brackets`) where it was not walked.

    ``walk_first``: the walk of ``L = 1`` for every output at once (every ``S`` and range of ``L = 1`` exact from the
    start); else :meth:`refine` walks it for the outputs it is given first.

    Attributes: ``total`` (``S``, the bits of :func:`_contiguous_tree`'s where ``L = 1`` was walked, elsewhere the BLAS
    sum of :func:`_walk_brackets`), ``c`` and ``c_abs`` (``(lo, hi)`` around ``S`` and ``|S|``; a pair of one array
    with ``walk_first``), ``r1`` (with ``walk_first``: the range of ``L = 1``), ``r_lo`` and ``r_hi`` (lane count ->
    lower and upper bracket of its range, for the lane counts not walked at first; lower ones only from block sums),
    ``rdot`` (``(lo, hi)`` around the radius dot, None without a radius), all float64 ``[M, N]``. A non-finite input
    gives NaN or infinite brackets."""

    def __init__(self, a: BlockOperand, w: BlockOperand, radius, b_abs, profile, walk_first: bool = True):
        m, k = a.values.shape
        self.k = k
        self.kp = kp = -(-max(k, 1) // max(TREE_LANES)) * max(TREE_LANES)
        self.at, self.wt = _k_major(a.dequantize(), kp), _k_major(w.dequantize(), kp)
        self.wt_abs = wt_abs = np.abs(self.wt)
        caps, wblas = _lane_caps(self.at, self.wt, wt_abs)
        grow, tiny = _grow(kp), _tiny(kp)
        self.w = (np.maximum(wblas / grow - tiny, 0.0), wblas * grow + tiny)
        self.walked = walk_first  # whether every output's L = 1 is walked
        self.order = list(TREE_LANES[1:])  # the lane counts refine walks, in turn
        self.r_lo, self.r_hi = {}, dict(caps)  # brackets of each lane count's range not walked at first
        if walk_first:
            r1, _, self.total = _tree_walks(self.at, self.wt, first_only=True)
            c_abs = np.abs(self.total)
            self.r1, self.c, self.c_abs = r1, (self.total, self.total), (c_abs, c_abs)
        else:
            self.order.insert(self.order.index(_FIRST_AFTER) + 1 if _FIRST_AFTER in self.order else 0, 1)
            self._pending = list(_BRACKET_BLOCKS.items())
            self.bracket_more()  # L = 1: the in-order sum's brackets
            self.c_abs = _abs_range(*self.c)
        self.radius = radius
        self.rdot = None
        if radius is not None:
            self.w_abs = wt_abs[:k]
            rblas = _blas_dot(radius, self.w_abs)
            self.rdot = (np.maximum(rblas / _grow(k) - _tiny(k), 0.0), rblas * _grow(k) + _tiny(k))
        self.b_abs = b_abs
        self.args = (_bias_init(profile, b_abs), k, kp, profile, _products_exact_in_fp32(a, w))

    def bracket_more(self) -> bool:
        """Brackets the range of the next lane count of :data:`_BRACKET_BLOCKS` from block sums (:func:`_walk_brackets`;
        ``L = 1`` with the in-order sum at first), in place of its caps where lower; False when none is left (or
        ``walk_first``)."""
        if self.walked or not self._pending:
            return False
        lane, block = self._pending.pop(0)
        r, c, total = _walk_brackets(self.at, self.wt, self.wt_abs, self.w[1], lane, block)
        if r[0] is not None:
            self.r_lo[lane] = r[0]
        self.r_hi[lane] = r[1] if lane not in self.r_hi else np.minimum(r[1], self.r_hi[lane])
        if lane == 1:
            self.c, self.total = c, total
        return True

    def _walked_first(self, i, j, total) -> None:
        """The walk of ``L = 1`` at the outputs ``(i, j)``: their in-order sums ``total``, exact."""
        self.total[i, j] = total
        for v in self.c:
            v[i, j] = total
        for v in self.c_abs:
            v[i, j] = np.abs(total)

    def bounds(self, lane: int, mi=None, ni=None, r=None):
        """``(lo, hi)`` of the bound (float64 ``[M, N]``, or ``[X]`` at the outputs ``(mi, ni)``) with ``r`` their
        largest range over the lane counts :meth:`refine` has walked, through ``lane`` in its order (None: as at first,
        ``lane`` ignored; ``L = 1`` exact where ``walk_first``): every other lane count's range within its brackets
        (``r_lo``, ``r_hi``: block sums, :func:`_walk_brackets`, or lane caps, :func:`_lane_caps`)."""
        at = None if mi is None else (mi, ni)
        pick = (lambda v: v) if at is None else (lambda v: v[at])
        if r is None:
            rest = self.r_hi.keys()
            if self.walked:
                r = pick(self.r1)
        else:
            rest = self.order[self.order.index(lane) + 1:]
        r_lo, r_hi = r, r
        for other in rest:
            if other in self.r_lo:
                v = pick(self.r_lo[other])
                r_lo = v if r_lo is None else np.maximum(r_lo, v)
            v = pick(self.r_hi[other])
            r_hi = v if r_hi is None else np.maximum(r_hi, v)
        b = self.b_abs[None, :] if at is None else self.b_abs[ni]
        zero = 0.0
        d_lo = d_hi = zero
        if self.rdot is not None:
            d_lo, d_hi = (pick(v) * (1.0 + gamma(self.k + 2, U_F64)) for v in self.rdot)
        lo = _tree_bound(r_lo, pick(self.w[0]), pick(self.c_abs[0]), d_lo, b, *self.args)
        hi = _tree_bound(r_hi, pick(self.w[1]), pick(self.c_abs[1]), d_hi, b, *self.args)
        return lo, hi

    def _products(self, i, j) -> np.ndarray:
        """The products of the outputs ``(i, j)`` in K order, float64 ``[kp, X]`` (zero rows from ``K``); ``i`` sorted
        (row-major outputs) repeats each row's column of ``a`` instead of gathering it."""
        if i.size and np.all(i[1:] >= i[:-1]):
            rows, first = np.unique(i, return_index=True)
            q = np.repeat(self.at[:, rows], np.diff(np.append(first, i.size)), axis=1)
        else:
            q = np.take(self.at, i, axis=1)
        q *= np.take(self.wt, j, axis=1)
        return q

    def refine(self, mi, ni, settle):
        """Walks the lane counts in turn for the outputs ``(mi, ni)`` (``order``: ``2, 4, ..., 32``, and ``L = 1``
        after :data:`_FIRST_AFTER` unless walked at first, ``walk_first``; once walked, ``total``, ``c`` and ``c_abs``
        hold their exact values there), bracketing their bound again after each (:meth:`bounds`) and asking
        ``settle(mi, ni, lo, hi)`` which of them no longer need the exact bound (a bool mask); the exact ``(bound,
        radius_dot)`` of the others (the bits of :func:`_contiguous_tree`, ``radius_dot`` None without a radius) are
        returned as ``(mi, ni, bound, radius_dot)``."""
        rest = []
        step = max(2, _REFINE_ELEMS // self.kp)
        for s in range(0, mi.size, step):  # the outputs' products gathered once per batch
            i, j = mi[s:s + step], ni[s:s + step]
            q = self._products(i, j)
            buf = np.empty(q.size)
            r = self.r1[i, j] if self.walked else None
            for n_walked, lane in enumerate(self.order, 1):
                x = q.shape[1]
                if lane == 1:  # the in-order sums and ranges of L = 1 (the bits of _tree_walks')
                    total = np.empty(x)
                    top = _lane_top(q, buf, total)
                    self._walked_first(i, j, total)
                else:
                    top = _lane_top(q.reshape(self.kp // lane, lane * x), buf).reshape(lane, x).max(axis=0)
                r = top if r is None else np.maximum(r, top)
                if n_walked == len(self.order):  # every lane count walked: r is the range
                    rest.append((i, j) + self._exact(q, i, j, r))
                    break
                keep = ~settle(i, j, *self.bounds(lane, i, j, r))
                if not keep.any():
                    break
                if not keep.all():
                    i, j, r, q = i[keep], j[keep], r[keep], np.take(q, np.flatnonzero(keep), axis=1)
        if not rest:
            return mi[:0], ni[:0], np.zeros(0), None if self.radius is None else np.zeros(0)
        parts = list(zip(*rest))
        return (np.concatenate(parts[0]), np.concatenate(parts[1]), np.concatenate(parts[2]),
                None if self.radius is None else np.concatenate(parts[3]))

    def _exact(self, q, i, j, r):
        """``(bound, radius_dot)`` at the outputs ``(i, j)`` from their products ``q`` ``[kp, X]`` and ``r``, their
        largest range over every lane count."""
        x = q.shape[1]
        pa = np.zeros((self.kp + 1, max(x, 2)))  # two columns at least: NumPy sums one column pairwise
        np.abs(q, out=pa[1:, :x])
        wsum = np.add.reduce(pa, axis=0)[:x]    # sum |p| in K order from +0.0
        d, rdot = 0.0, None
        if self.radius is not None:
            rdot = ordered_dot_pairs(self.radius[i], np.take(self.w_abs, j, axis=1).T)
            d = rdot * (1.0 + gamma(self.k + 2, U_F64))
        return _tree_bound(r, wsum, self.c_abs[0][i, j], d, self.b_abs[j], *self.args), rdot


def _grow(k: int) -> float:
    """Relative margin of a bracket around a sum of ``k`` products (``1 + 64 (k + 2) 2^-53``: the ``gamma_k`` of two
    summation orders and the roundings of the margin itself, with room)."""
    return 1.0 + 64.0 * (k + 2) * U_F64


def _tiny(k: int) -> float:
    """Absolute margin of a bracket around a sum of ``k`` products for their underflow (``2^-1075`` a product in each
    of two orders, with room)."""
    return (k + 16) * 2.0**-1072


def _blas_dot(x: np.ndarray, y_t: np.ndarray) -> np.ndarray:
    """``x @ y_t`` (float64 ``[M, K]`` and ``[K, N]``) from BLAS, at most :data:`moeref.compare.contiguous_tree._CAP_MACS` multiply-adds a product."""
    m, k = x.shape
    n = y_t.shape[1]
    out = np.empty((m, n))
    if m >= n:
        step = max(1, _ct._CAP_MACS // max(1, n * k))
        for i in range(0, m, step):
            np.matmul(x[i:i + step], y_t, out=out[i:i + step])
    else:  # column blocks: each product reads x once
        step = max(1, _ct._CAP_MACS // max(1, m * k))
        for j in range(0, n, step):
            np.matmul(x, y_t[:, j:j + step], out=out[:, j:j + step])
    return out


_REFINE_ELEMS = 1 << 19
"""Products of the outputs :meth:`_TreeBrackets.refine` gathers at a time (float64: 4 MiB, reused across lane
counts; larger batches spend their time in fresh pages, measured on the 2-core VM, 2026-11-29)."""
_CAP_LANES = 16
"""Lane count of the BLAS lane sums of :func:`_lane_caps` (the narrower ones by adding lanes pairwise; the lanes of
16 and 32 capped by the ``sum |p|`` of the lane of 16 that holds them)."""


def _lane_caps(at: np.ndarray, wt: np.ndarray, wt_abs: np.ndarray):
    """``(caps, W)``: ``caps[L]`` float64 ``[M, N]`` for ``L = 2, ..., 32``, at least the computed range of every lane
    of ``L``, and ``W`` the BLAS ``sum |p|``. From the BLAS lane sums of :data:`_CAP_LANES` lanes (:func:`_lane_sums`),
    lanes added pairwise for the narrower lane counts: ``caps[L]`` is the largest ``(sum |p| + |sum p|) / 2`` over the
    lanes of ``L`` with the margins of :func:`_tree_walks`' skip test, applied after the maximum (they are
    nondecreasing); for ``L >= _CAP_LANES`` the largest ``sum |p|`` over the lanes of :data:`_CAP_LANES` (a lane of
    ``L`` lies in one of them, and its range is at most its own ``sum |p|``; with :func:`_grow` and :func:`_tiny`),
    which at these lane counts is still below the range of ``L = 1`` on random signs. ``wt_abs``: ``|wt|``."""
    kp, m = at.shape
    n = wt.shape[1]
    grow = 1.0 + 64.0 * (kp + 2) * U_F64
    caps = {lane: np.empty((m, n)) for lane in TREE_LANES if lane > 1}
    wsum = np.empty((m, n))
    rows = max(1, (1 << 18) // max(1, _CAP_LANES * n))  # [lanes, rows, N] tiles of 2^18 elements
    size = _CAP_LANES * min(rows, m) * n
    bufs = np.empty(size), np.empty(size), np.empty(size)  # reused: fresh pages cost more than the arithmetic
    for c0 in range(0, m, rows):
        c1 = min(c0 + rows, m)
        sa, sp = _lane_sums(at, wt, c0, c1, _CAP_LANES, bufs[:2], wt_abs)  # [16, rows, N]
        for lane in TREE_LANES:
            if lane >= _CAP_LANES:
                out = caps[lane][c0:c1]
                np.maximum.reduce(sa, axis=0, out=out)
                out *= _grow(kp)
                out += _tiny(kp)
        while sa.shape[0] > 1:                                        # L = 8, 4, 2
            if sa.shape[0] < _CAP_LANES:
                lane = sa.shape[0]
                t = bufs[2][:sp.size].reshape(sp.shape)
                np.abs(sp, out=t)
                t += sa
                out = caps[lane][c0:c1]
                np.maximum.reduce(t, axis=0, out=out)
                out *= 0.5 * grow
                out += (kp + 16) * 2.0**-1074
            h = sa.shape[0] // 2
            sa[:h] += sa[h:]                                          # lane r of L/2: r and r + L/2 of L
            sp[:h] += sp[h:]
            sa, sp = sa[:h], sp[:h]
        wsum[c0:c1] = sa[0]
    return caps, wsum


_FIRST_AFTER = 0
"""The lane count after which :meth:`_TreeBrackets.refine` walks ``L = 1`` where it was not walked at first (0:
before every other; after 2 or 4 measured the same, after 32 slower: 2-core VM, 2026-11-29)."""
_BRACKET_TILE = 1 << 16
"""Elements of one ``[blocks, lanes, rows, columns]`` tile of :func:`_walk_brackets` (four float64 buffers of 512 KiB:
larger tiles spend their time in the cache misses of their passes, measured on the 2-core VM, 2026-11-29)."""
_BRACKET_BLOCKS = {1: 32, 2: 64, 4: 128}
"""Lane counts whose ranges :class:`_TreeBrackets` brackets from BLAS block sums (:func:`_walk_brackets`) when
``L = 1`` is not walked at first, and their blocks' K rows (32 products of a lane a block: one BLAS product of inner
size 32 each)."""


def _walk_brackets(at: np.ndarray, wt: np.ndarray, wt_abs: np.ndarray, w_hi: np.ndarray, lane: int = 1,
                   block: int = 32):
    """``((r_lo, r_hi), (c_lo, c_hi), c)``, float64 ``[M, N]`` each: brackets of what the walks of :func:`_tree_walks`
    and :func:`_lane_top` compute for the lanes of ``lane``: the largest range over the lanes, ``R~ = max(max P~, 0) -
    min(min P~, 0)`` of each lane's prefix sums ``P~`` in K order, and for ``lane = 1`` the in-order sum ``S~`` (the
    last prefix sum; ``c`` a float64 sum of the products in another order, inside its bracket; None otherwise), from
    BLAS sums over blocks of ``block`` rows of K (a power of two from 32, lowered to the largest one that divides
    ``kp``); ``w_hi`` at least the exact ``W = sum |p|``; ``wt_abs``: ``|wt|``.

    With ``s_j`` and ``A_j`` the exact sums of a lane's ``p`` and ``|p|`` over block ``j`` and ``Q_j = s_0 + ... +
    s_{j-1}``, every exact prefix sum of the lane inside block ``j`` lies in ``[Q_j - (A_j - s_j) / 2, Q_j + (A_j + s_j)
    / 2]`` (the block's negative and positive parts), and ``Q_1, ..., Q_nb`` are exact prefix sums (``Q_nb`` the lane's
    sum): the exact range lies between ``max(max_j Q_j, 0) - min(min_j Q_j, 0)`` and ``max(max_j (Q_j + (A_j + s_j) /
    2), 0) - min(min_j (Q_j - (A_j - s_j) / 2), 0)``. Each computed value is off its exact value by at most: ``gamma_kp
    W`` (the walk's prefix sums, products rounded or not); ``gamma_t A_j`` (BLAS sums of ``t = block / lane``
    products, in any order, fused or not) and ``gamma_nb`` of ``sum |s_j|`` for the running sum of them; ``u`` of each
    later operation (at most ``2 W`` in magnitude); plus ``2^-1075`` for each product that underflows in each of the
    two sums. Both sides of a range together: ``2 (kp + 3 t + nb + 8) u W`` and ``4 kp 2^-1075``, below the margin
    ``64 (kp + 2) u w_hi + (kp + 16) 2^-1072`` (:func:`_grow`, :func:`_tiny`), which also covers the margin's own
    roundings (``u`` of at most ``4 W``). Cost: two BLAS products of the operands' blocks (as :func:`_lane_sums`) and
    about 14 passes over ``[kp / t, M, N]``. A non-finite element gives NaN or infinite brackets."""
    kp, m = at.shape
    n = wt.shape[1]
    block = math.gcd(kp, block)  # powers of two: the largest one up to block that divides kp (32 at least)
    nb, t = kp // block, block // lane
    c = np.empty((m, n)) if lane == 1 else None
    top_lo, bot_hi = (np.empty((1, m, n)) for _ in range(2))
    top_hi, bot_lo = (np.empty((lane, m, n)) for _ in range(2))
    w4 = wt.reshape(nb, t, lane, n).transpose(0, 2, 1, 3)      # [nb, lane, t, N] views (BLAS reads them)
    w4_abs = wt_abs.reshape(nb, t, lane, n).transpose(0, 2, 1, 3)
    cols = min(n, max(1, _BRACKET_TILE // (nb * lane * min(m, 8))))  # [nb, lane, rows, cols] tiles
    rows = min(m, max(1, _BRACKET_TILE // (nb * lane * cols)))
    step = max(1, _ct._CAP_MACS // max(1, t * cols))
    bufs = [np.empty(nb * lane * rows * cols) for _ in range(4)]  # reused: fresh pages cost more than the arithmetic
    for r0 in range(0, m, rows):
        r1 = min(r0 + rows, m)
        a4 = np.ascontiguousarray(at[:, r0:r1].reshape(nb, t, lane, r1 - r0).transpose(0, 2, 3, 1))  # [nb, L, r, t]
        a4_abs = np.abs(a4)
        for c0 in range(0, n, cols):
            c1 = min(c0 + cols, n)
            at_ = (slice(None), slice(r0, r1), slice(c0, c1))
            sp, sa, q, u = (v[:nb * lane * (r1 - r0) * (c1 - c0)].reshape(nb, lane, r1 - r0, c1 - c0) for v in bufs)
            for i in range(0, r1 - r0, step):
                np.matmul(a4[:, :, i:i + step], w4[..., c0:c1], out=sp[:, :, i:i + step])
                np.matmul(a4_abs[:, :, i:i + step], w4_abs[..., c0:c1], out=sa[:, :, i:i + step])
            q[0] = sp[0]                                        # q[j] = Q_{j+1} (np.cumsum along axis 0 is slow)
            for j in range(1, nb):
                np.add(q[j - 1], sp[j], out=q[j])
            if c is not None:  # one lane: the sum and the lower bracket (for more lanes, that of L = 1 will do)
                c[r0:r1, c0:c1] = q[-1, 0]
                np.maximum(np.max(q, axis=0), 0.0, out=top_lo[at_])
                np.minimum(np.min(q, axis=0), 0.0, out=bot_hi[at_])
            np.add(sa, sp, out=u)                               # Q_j + (A_j + s_j) / 2
            u *= 0.5
            u[1:] += q[:-1]
            np.maximum(np.max(u, axis=0), 0.0, out=top_hi[at_])
            np.subtract(sa, sp, out=u)                          # Q_j - (A_j - s_j) / 2
            u *= 0.5
            np.subtract(q[:-1], u[1:], out=u[1:])
            np.negative(u[0], out=u[0])
            np.minimum(np.min(u, axis=0), 0.0, out=bot_lo[at_])
    margin = w_hi * (64.0 * (kp + 2) * U_F64) + _tiny(kp)
    top_hi -= bot_lo
    r_hi = np.max(top_hi, axis=0)
    r_hi += margin
    if c is None:
        return (None, r_hi), None, None
    top_lo -= bot_hi
    r_lo = top_lo[0]
    r_lo -= margin
    np.maximum(r_lo, 0.0, out=r_lo)
    return (r_lo, r_hi), (c - margin, c + margin), c
