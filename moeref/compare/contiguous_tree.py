"""The contiguous-tree model of :mod:`moeref.compare.gemm_bounds` (``accum_model="contiguous_tree"``):
:func:`contiguous_tree_gemm_bound`, FP32 accumulation over any tree whose nodes sum contiguous K ranges (or SIMD
lanes of them), bounded from the ranges the exact partial sums reach, and the walks of the prefix sums that give
those ranges (:func:`_tree_walks`). Brackets of that bound, narrowed one lane count at a time for the outputs
that need it, are in :mod:`moeref.compare.tree_brackets`. Its inputs are validated by
:func:`moeref.compare.gemm_bounds.gemm_error_bound` (or :func:`~moeref.compare.gemm_bounds.contiguous_tree_parts`),
which re-exports the public names.
"""
from __future__ import annotations

import numpy as np

from ..gemm.exact import BlockOperand
from .summation_order import U_F64, gamma, ordered_dot

__all__ = ["TREE_LANES", "contiguous_tree_gemm_bound"]

TREE_LANES = (1, 2, 4, 8, 16, 32)
"""SIMD lane counts covered by :func:`contiguous_tree_gemm_bound` (interleaved accumulators)."""
_WALK_OUTPUTS = 4096  # outputs of one [K, outputs] product tile of the contiguous-tree bound (measured)
_WALK_ROWS = 32  # K rows of a tile walked at a time (a multiple of 4)


def _products_exact_in_fp32(a: BlockOperand, w: BlockOperand) -> bool:
    """Element products fit an FP32 significand when both operands' elements are bf16 values (at most 8
    significant bits: every FP8/FP4/MX/INT8/bf16 element) and finite."""
    import ml_dtypes

    def bf16_exact(v):
        v = np.asarray(v, dtype=np.float64)
        head = np.ascontiguousarray(v.reshape(-1)[:256]).view(np.int64)
        if np.any(head & np.int64((1 << 45) - 1)):  # a significand bit below bf16's 8: not a bf16 value
            return False
        return bool(np.all(np.isfinite(v)) and np.array_equal(v.astype(ml_dtypes.bfloat16).astype(np.float64), v))

    return bf16_exact(a.values) and bf16_exact(w.values)


def contiguous_tree_gemm_bound(a: BlockOperand, w: BlockOperand, profile, radius, b_abs) -> np.ndarray:
    """Data-dependent bound for FP32 accumulation in any order built from contiguous K ranges.

    **Declared arithmetic.** Each output element ``C = sum_i p_i (+ b)``, ``p_i = a_i s_a(i) w_i s_w(i)``,
    is computed by a tree over its K products in which every node's exact value is the sum of the
    products of one *lane of a contiguous range*: ``{i in [lo, hi) : i = r mod L}`` for some
    ``L`` in :data:`TREE_LANES` (``L = 1``: a contiguous range). That covers sequential FMA chains
    forward or backward, any K chunking or split-K with the chunk sums added in any order of
    contiguous ranges, pairwise trees, tensor-core MMAs (the accumulator and the MMA's products are
    contiguous ranges) and SIMD dot products with ``L`` interleaved accumulators reduced by halving
    (lane ``r`` + lane ``r + L/2`` is lane ``r`` of ``L/2``). A node adds ``m >= 2`` children with a local
    error at most ``lambda_m u max(|children|, |result|)``: ``lambda_2 = 1`` for an IEEE
    round-to-nearest add or FMA; a tensor-core aligned adder that cuts every addend toward zero to the
    FP32 ulp of the largest (grid ``2^(e + 1) u``, ``e = floor(log2 max)``: each of the other ``m - 1``
    addends loses less than ``2 u max``, the largest, an FP32 value of that binade, nothing) and
    truncates the normalised sum to 24 bits (less than ``2 u |result|``) has ``lambda_m = 2m`` (Fasi,
    Higham, Mikaitis and Pranesh, PeerJ CS 2021, for the model). ``profile.adder_factor`` is
    ``rho >= lambda_m / (m - 1)`` (1 for IEEE adds; 2.25 covers aligned adders of ``m >= 9`` addends: an
    8-or-wider MMA plus its accumulator). Products of elements are exact when both operands hold
    bf16-representable elements (FP8, FP4, INT8, bf16); otherwise each is rounded once (``u``) or, in an
    aligned adder, is a largest addend off the grid (less than ``2 u |p|``, once per product), so
    ``u_prod = 2 u``; each product meets its two scale factors once, in FP32 multiplications on a node
    inside one scale block (per product, or per chunk as DeepGEMM does); the bias is added once.

    **Bound.** Let ``P^(L,r)_j`` be the exact prefix sums of lane ``r`` of ``L`` and ``R`` the largest
    range ``max_j P - min_j P`` (with ``P_0 = 0``) over every lane of every ``L``: every node's exact
    value ``|c(v)| <= R``. ``W = sum_i |p_i|``. Let ``e(v)`` be the local error of node ``v`` (in the
    scaled domain: a node below its scale multiplication counts at its exact scale, a change of unit)
    and ``B = sum_v |e(v)|``; the error of the root is at most ``B``, and every node's computed value is
    within ``B`` of its exact value, so ``|child|, |result| <= R + B``. There are ``K - 1`` adds in a
    binary tree; a node of ``m`` children stands for ``m - 1`` of them, so the adds contribute at most
    ``rho (K - 1) u (R + B)``. The scaled nodes are disjoint ranges: their exact values sum to at most
    ``W`` and the errors below them to at most ``B``, so the two scale roundings contribute
    ``gamma(2, u_fp32) (W + B)``; inexact products ``u_prod W``. Solving for ``B``::

        B <= (rho (K - 1) u R + (gamma(2, u_fp32) + u_prod) W) / (1 - rho (K - 1) u - gamma(2, u_fp32))

    and the bias add contributes ``u_fp32 (|C| + B + |b|)``. A bias that is the accumulator's initial value
    (``profile.bias_add == "accumulator_init"``) is instead a leaf before column 0: ``K`` adds, and a node
    that holds it has an exact value ``b + P^(L,r)_j`` (a prefix of one lane), so ``R`` grows by ``|b|``:
    ``B <= (rho K u (R + |b|) + (gamma(2, u_fp32) + u_prod) W) / (1 - rho K u - gamma(2, u_fp32))`` and no
    separate bias add. For random signs ``R ~ 2.5 sqrt(K) |p|`` while
    ``W ~ 0.8 K |p|``: the bound is ``O(K^1.5)`` instead of the worst case's ``O(K^2)``, and ``R <= W``
    always, so it is never looser than the same count of roundings applied to ``W``.

    With ``a_radius`` (``A~`` anywhere in the box) every range sum and ``W`` grow by at most
    ``D = a_radius |W|^T``. The float64 evaluation (products, prefix sums) is covered by widening ``R``
    and ``W`` by ``2 gamma(K + 2, 2^-53) W``; FP32 underflow by ``(K + 2) 2^-149``.

    Evaluation (float64, every output independent of the others): the prefix sums of each lane in K order
    (``P_j = P_{j-1} + p_j`` from ``P_0 = p_0``: the bits of ``np.cumsum`` along K), ``W`` and the last prefix
    sum of ``L = 1`` in K order. Cost: per tile of :data:`_WALK_OUTPUTS` outputs and chunk of :data:`_WALK_ROWS` K
    rows, the products, ``|p|`` summed in K order (one ``np.add.reduce`` along K onto the running sum) and the
    walks of ``L = 1, 2, 4`` (and of ``L`` from ``K >= 16 L^2``, :data:`_WALK_ALL_FROM`) with their maxima and minima;
    the other lane counts only for the lanes of the outputs whose ``(sum |p| + |sum p|) / 2`` over the lane
    (:func:`_lane_sums`) leaves room above the range already reached (the same bits as every lane walked for every
    output).
    """
    return _contiguous_tree(a, w, radius, b_abs, profile)[0]


def _contiguous_tree(a: BlockOperand, w: BlockOperand, radius, b_abs, profile):
    """``(bound, total, radius_dot)`` of :func:`contiguous_tree_parts` for validated inputs."""
    m, k = a.values.shape
    n = w.values.shape[0]
    if m == 0 or n == 0:
        return np.zeros((m, n)), np.zeros((m, n)), None if radius is None else np.zeros((m, n))
    ad, wd = a.dequantize(), w.dequantize()
    lanes = max(TREE_LANES)
    kp = -(-max(k, 1) // lanes) * lanes
    at, wt = _k_major(ad, kp), _k_major(wd, kp)
    rdot = None if radius is None else ordered_dot(radius, None, w_t=np.abs(wt))
    d = np.zeros((m, n)) if radius is None else rdot * (1.0 + gamma(k + 2, U_F64))
    rng, wsum, csum = _tree_walks(at, wt)
    return _tree_bound(rng, wsum, np.abs(csum), d, b_abs[None, :], _bias_init(profile, b_abs), k, kp, profile,
                       _products_exact_in_fp32(a, w)), csum, rdot


def _bias_init(profile, b_abs) -> bool:
    """Whether the bias is the accumulator's initial value (``bias_add="accumulator_init"`` and a nonzero bias)."""
    return getattr(profile, "bias_add", "epilogue") == "accumulator_init" and bool(b_abs.any())


def _tree_bound(rng, wsum, c_abs, d, b_abs, init: bool, k: int, kp: int, profile, exact_products: bool) -> np.ndarray:
    """The bound of :func:`contiguous_tree_gemm_bound` from its walks, elementwise (any shape, broadcast): the range
    ``rng``, ``wsum`` (``sum |p|``), ``c_abs`` (``|sum p|``), ``d`` (the radius term ``a_radius |W|^T`` widened for
    its float64 evaluation, 0 without a radius) and ``b_abs`` (``|bias|``); ``init``: :func:`_bias_init` of the GEMM's
    whole bias. Nondecreasing in each of them (every
    operation an add, a product with a nonnegative constant or a division by a positive one, each rounded to
    nearest), so inputs that bracket the walks' values bracket the bound."""
    u = float(profile.accum_unit)
    rho = float(profile.adder_factor)
    u_prom = float(profile.promote_unit)
    slack = 2.0 * gamma(kp + 2, U_F64) * wsum
    r_hi = rng + slack + d
    w_hi = wsum * (1.0 + gamma(kp + 2, U_F64)) + d
    c_hi = c_abs + slack + d
    sigma = gamma(2, u_prom)
    u_prod = 0.0 if exact_products else 2.0 * u
    t = rho * max(k - 1 + int(init), 0) * u
    denom = 1.0 - t - sigma
    if denom <= 0:
        return np.full(np.broadcast(rng, b_abs).shape, np.inf)
    if init:  # the bias is the tree's first leaf: one more add, every node holding it within |b| + R
        acc = (t * (r_hi + b_abs) + (sigma + u_prod) * w_hi) / np.float64(denom)
        out = acc + (k + 2) * 2.0**-149
    else:
        acc = (t * r_hi + (sigma + u_prod) * w_hi) / np.float64(denom)
        out = acc + u_prom * (c_hi + acc + b_abs) + (k + 2) * 2.0**-149
    return out * (1.0 + 1e-9)


_WALKED = (1, 2, 4)
"""Lane counts whose prefix sums :func:`_tree_walks` walks for every output (on random signs each one raises the
range of 5-20 % of the outputs, so no cheap test skips them); the wider ones are walked lane by lane where needed,
except ``L`` with ``kp >= _WALK_ALL_FROM * L^2`` (:func:`_walked_lanes`)."""
_WALK_ALL_FROM = 16
"""``L`` is walked for every output from ``K >= 16 L^2`` (``L = 8`` from ``K = 1024``, ``L = 16`` from 4096): on
random signs the range of ``L = 1`` grows as ``sqrt(K)`` and a lane's ``(sum |p| + |sum p|) / 2`` as ``K / L``, so
beyond that most lanes of ``L`` pass their cap and walking them one by one (gathered) costs more than walking them
all (measured on the 2-core VM, 2026-11-28: 8 x 512 outputs at K = 7168, 0.17 s against 0.21 s with ``32 L^2``)."""
_LANE_ELEMS = 1 << 21
"""Products of the lanes walked one by one held at once (float64: 16 MiB)."""
_CAP_MACS = 1 << 18
"""Multiply-adds of one BLAS product of :func:`_lane_sums` (at most): OpenBLAS runs a product of up to 2^18 on the
calling thread, so an oversubscribed machine does not wait on BLAS threads (on the loaded 2-core VM, 2026-11-28, the
lane sums as 32 whole-row products took the bound from 1.0 s to 4-13 s of CPU)."""


def _walked_lanes(kp: int) -> tuple:
    """The lane counts :func:`_tree_walks` walks for every output at ``K = kp`` (:data:`_WALKED`,
    :data:`_WALK_ALL_FROM`)."""
    return tuple(lane for lane in TREE_LANES if lane in _WALKED or kp >= _WALK_ALL_FROM * lane * lane)


def _k_major(v: np.ndarray, kp: int) -> np.ndarray:
    """``[R, k] -> [kp, R]`` float64, zero rows ``k..kp`` (the walks run along axis 0)."""
    out = np.zeros((kp, v.shape[0]))
    for i in range(0, v.shape[0], 16):  # 16 rows at a time: 8x faster than one whole-array transposed copy
        out[:v.shape[1], i:i + 16] = v[i:i + 16].T
    return out


def _lane_sums(at: np.ndarray, wt: np.ndarray, r0: int, r1: int, lanes: int = max(TREE_LANES), out=None,
               wt_abs=None):
    """``(sum |p|, sum p)`` over each lane of ``lanes`` (default 32) for rows ``r0:r1``, float64 ``[lanes, r1 - r0, N]``
    each, from BLAS (any order, with or without fused multiply-adds), at most :data:`_CAP_MACS` multiply-adds a
    product; ``out``: optional pair of float64 buffers of at least that many elements each (written, and returned as
    views); ``wt_abs``: optional ``|wt|``, computed once by a caller that has it."""
    kp, n = at.shape[0], wt.shape[1]
    t = kp // lanes
    a3 = np.ascontiguousarray(at[:, r0:r1].reshape(t, lanes, r1 - r0).transpose(1, 2, 0))   # [lanes, rows, t]
    w3 = wt.reshape(t, lanes, n).transpose(1, 0, 2)        # [lanes, t, N] views (row stride lanes N: BLAS reads them)
    shape = (lanes, r1 - r0, n)
    if out is None:
        sp, sa = np.empty(shape), np.empty(shape)
    else:
        size = lanes * (r1 - r0) * n
        sa, sp = out[0][:size].reshape(shape), out[1][:size].reshape(shape)
    a_abs = np.abs(a3)
    w_abs = (np.abs(wt) if wt_abs is None else wt_abs).reshape(t, lanes, n).transpose(1, 0, 2)
    step = max(1, _CAP_MACS // max(1, n * t))
    for i in range(0, r1 - r0, step):
        np.matmul(a3[:, i:i + step], w3, out=sp[:, i:i + step])
        np.matmul(a_abs[:, i:i + step], w_abs, out=sa[:, i:i + step])
    return sa, sp


def _walk_rows(q, wb, prev, hi, lo, first: bool) -> None:
    """One chunk of a walk: ``wb[i] = wb[i - 1] + q[i]`` from ``prev`` (the chunk before; ``q[0]`` itself when
    ``first``), ``prev``, ``hi``, ``lo`` updated to the last row, the maxima and the minima (exact in any order)."""
    i0, p = 0, prev
    if first:
        wb[0] = q[0]
        i0, p = 1, wb[0]
    for i in range(i0, q.shape[0]):  # sequential in K
        np.add(p, q[i], out=wb[i])
        p = wb[i]
    np.maximum(hi, wb.max(axis=0), out=hi)
    np.minimum(lo, wb.min(axis=0), out=lo)
    prev[...] = wb[-1]


def _lane_top(q: np.ndarray, buf: np.ndarray | None = None, last: np.ndarray | None = None) -> np.ndarray:
    """``max(max P, 0) - min(min P, 0)`` of the prefix sums ``P`` in K order of each column of ``q`` ``[R, X]``;
    ``buf``: optional float64 work space of at least ``q.size`` elements; ``last``: optional ``[X]``, written with the
    last prefix sums."""
    wb = np.empty_like(q) if buf is None else buf[:q.size].reshape(q.shape)
    hi = np.full(q.shape[1], -np.inf)
    lo = np.full(q.shape[1], np.inf)
    prev = np.empty(q.shape[1])
    rows = max(1, _WALK_ROWS)
    for i0 in range(0, q.shape[0], rows):
        _walk_rows(q[i0:i0 + rows], wb[i0:i0 + rows], prev, hi, lo, i0 == 0)
    if last is not None:
        last[...] = prev
    top = np.maximum(hi, 0.0)
    top -= np.minimum(lo, 0.0)
    return top


class _WalkTile:
    """The buffers of :func:`_tree_walks` for tiles of ``x`` outputs and chunks of ``rows`` K rows, with the row views
    of every walked lane count made once (a tile of the same width reuses them): the products ``pc``, ``|p|`` under
    the running ``sum |p|`` (``pa``), the walk ``wb``, and per lane count the last prefix sums, maxima and minima."""

    def __init__(self, rows: int, x: int, walked: tuple, abs_sum: bool = True):
        self.x = x
        self.abs_sum = abs_sum
        self.pc = np.empty((rows, x))
        self.pa = np.zeros((rows + 1, max(x, 2)))  # two columns at least: NumPy sums one column pairwise
        # one walk and no sum |p|: the walk overwrites the products in place (half the tile's memory)
        self.wb = self.pc if walked == (1,) and not abs_sum else np.empty((rows, x))
        self.acc = np.zeros(self.pa.shape[1])
        self.tmp = np.empty(max(walked) * x)
        self.walked = walked
        self.prev = {lane: np.empty(lane * x) for lane in walked}
        self.hi = {lane: np.empty(lane * x) for lane in walked}
        self.lo = {lane: np.empty(lane * x) for lane in walked}
        self._views = {}

    def _rows(self, r: int, lane: int):
        """Row lists of ``pc[:r]`` and ``wb[:r]`` as ``[r / lane, lane x]`` (lane ``i`` of ``lane`` at column block
        ``i``), and the second as one array."""
        v = self._views.get((r, lane))
        if v is None:
            q = self.pc[:r].reshape(r // lane, lane * self.x)
            w = self.wb[:r].reshape(r // lane, lane * self.x)
            v = self._views[(r, lane)] = (list(q), list(w), w)
        return v

    def start(self) -> None:
        self.acc.fill(0.0)
        for lane in self.walked:
            self.hi[lane].fill(-np.inf)
            self.lo[lane].fill(np.inf)

    def chunk(self, a_rows: np.ndarray, w_rows: np.ndarray, first: bool) -> None:
        """K rows ``a_rows`` ``[r, tile rows]`` x ``w_rows`` ``[r, tile columns]``: their products (``einsum``:
        ``a w`` each, a zero product possibly +0.0, which no range, sum or bound below tells from -0.0), ``sum |p|``
        in K order onto the running sum, and every walked lane count's walk ``wb[i] = wb[i - 1] + q[i]`` from the
        chunk before (``q[0]`` itself when ``first``), with its maxima and minima (exact in any order)."""
        r = a_rows.shape[0]
        x = self.x
        pc = self.pc[:r]
        np.einsum("kr,kn->krn", a_rows, w_rows, out=pc.reshape(r, a_rows.shape[1], w_rows.shape[1]))
        if self.abs_sum:
            self.pa[0] = self.acc
            np.abs(pc, out=self.pa[1:r + 1, :x])
            np.add.reduce(self.pa[:r + 1], axis=0, out=self.acc)  # sum |p| in K order onto the running sum
        add = np.add
        for lane in self.walked:
            qv, wv, w = self._rows(r, lane)
            prev, tmp = self.prev[lane], self.tmp[:lane * x]
            if first:
                wv[0][...] = qv[0]
            else:
                add(prev, qv[0], out=wv[0])
            p = wv[0]
            for i in range(1, len(qv)):  # sequential in K
                add(p, qv[i], out=wv[i])
                p = wv[i]
            prev[...] = p
            np.maximum.reduce(w, axis=0, out=tmp)
            np.maximum(self.hi[lane], tmp, out=self.hi[lane])
            np.minimum.reduce(w, axis=0, out=tmp)
            np.minimum(self.lo[lane], tmp, out=self.lo[lane])

    def ranges(self) -> np.ndarray:
        """The largest ``max(max P, 0) - min(min P, 0)`` over every walked lane, ``[x]``."""
        best = np.zeros(self.x)
        for lane in self.walked:  # the maximum over lanes and lane counts does not depend on the order
            top = np.maximum(self.hi[lane], 0.0)
            top -= np.minimum(self.lo[lane], 0.0)
            best = np.maximum(best, top.reshape(lane, self.x).max(axis=0))
        return best


def _tree_walks(at: np.ndarray, wt: np.ndarray, first_only: bool = False):
    """``(R, W, S)`` float64 ``[M, N]`` of :func:`contiguous_tree_gemm_bound` from the K-major operands ``at``
    ``[kp, M]`` and ``wt`` ``[kp, N]`` (``kp`` a multiple of 32): the largest range over every lane of every lane
    count, ``sum |p|`` and ``sum p`` in K order. ``first_only``: the walk of ``L = 1`` alone, ``(R_1, None, S)``
    (its range, a lower bound of ``R``, and the same ``S``)."""
    kp, m = at.shape
    n = wt.shape[1]
    lanes = max(TREE_LANES)
    rng = np.empty((m, n))
    wsum = np.empty((m, n))
    csum = np.empty((m, n))
    nb = max(1, min(n, _WALK_OUTPUTS))
    rb = max(1, _WALK_OUTPUTS // nb)
    walked = (1,) if first_only else _walked_lanes(kp)
    rows = min(kp, -(-_WALK_ROWS // walked[-1]) * walked[-1])  # a multiple of every walked lane count
    tiles = {}
    for r0 in range(0, m, rb):  # tiles of [K, rb * nb] products, K in chunks of `rows`
        r1 = min(r0 + rb, m)
        for n0 in range(0, n, nb):
            n1 = min(n0 + nb, n)
            x = (r1 - r0) * (n1 - n0)
            tile = tiles.get(x)
            if tile is None:
                tile = tiles[x] = _WalkTile(rows, x, walked, not first_only)
            tile.start()
            for k0 in range(0, kp, rows):
                r = min(rows, kp - k0)
                tile.chunk(at[k0:k0 + r, r0:r1], wt[k0:k0 + r, n0:n1], k0 == 0)
            if not first_only:
                wsum[r0:r1, n0:n1] = tile.acc[:x].reshape(r1 - r0, n1 - n0)
            csum[r0:r1, n0:n1] = tile.prev[1].reshape(r1 - r0, n1 - n0)
            rng[r0:r1, n0:n1] = tile.ranges().reshape(r1 - r0, n1 - n0)
    if first_only:
        return rng, None, csum
    if walked[-1] == lanes:
        return rng, wsum, csum
    rb = max(1, _WALK_OUTPUTS // nb)
    cap_rows = max(rb, (1 << 21) // max(1, lanes * n) // rb * rb)  # rows whose caps are held at once
    for c0 in range(0, m, cap_rows):
        c1 = min(c0 + cap_rows, m)
        # A lane's range (max - min of its prefix sums, 0 included) is the sum of one contiguous run of its
        # products, at most the larger of its positive and negative parts, C = (sum |p| + |sum p|) / 2. With the
        # lane sums from BLAS (any order, products rounded or not), the computed range is at most
        # C (1 + 4 gamma_kp)(1 + u) plus 2^-1075 for each product that underflows, and the cap below at least
        # C (1 - 2 gamma_kp)(1 - u)^2 grow (u = 2^-53): a lane whose cap is at most the range already reached
        # cannot raise it and is skipped. A non-finite output walks every lane (a NaN cap is never skipped).
        grow = 1.0 + 64.0 * (kp + 2) * U_F64
        sa, sp = _lane_sums(at, wt, c0, c1)                               # [32, rows, N]
        out = rng[c0:c1]
        walk_all = ~np.isfinite(wsum[c0:c1])
        for lane in sorted(TREE_LANES, reverse=True):                  # 32, 16, 8 (those not walked)
            if lane in walked:
                break
            # (sum |p| + |sum p|) / 2 <= sum |p|: outputs whose every lane's sum |p| is low enough skip at once
            oi = np.flatnonzero(~(sa.max(axis=0) * grow + (kp + 16) * 2.0**-1074 <= out) | walk_all)
            sa_o, sp_o, out_o, all_o = sa.reshape(lane, -1), sp.reshape(lane, -1), out.reshape(-1), walk_all.reshape(-1)
            if 2 * oi.size < out.size:  # few outputs left: their lanes only (else every output, without a gather)
                sa_o, sp_o, out_o, all_o = sa_o[:, oi], sp_o[:, oi], out_o[oi], all_o[oi]
            else:
                oi = np.arange(out.size)
            cap = np.abs(sp_o)
            cap += sa_o
            cap *= 0.5 * grow
            cap += (kp + 16) * 2.0**-1074
            li, j = np.nonzero(~(cap <= out_o) | all_o)
            mi, ni = np.divmod(oi[j], n)
            step = max(1, _LANE_ELEMS // (kp // lane))
            for s in range(0, li.size, step):  # the lanes that can still raise their output's range, gathered
                sl = slice(s, s + step)
                q = np.take(at.reshape(kp // lane, lane * m), li[sl] * m + (mi[sl] + c0), axis=1)
                q *= np.take(wt.reshape(kp // lane, lane * n), li[sl] * n + ni[sl], axis=1)
                np.maximum.at(out.reshape(-1), oi[j[sl]], _lane_top(q))
            h = lane // 2
            sa, sp = sa[:h] + sa[h:], sp[:h] + sp[h:]                       # lane r of L/2: r and r + L/2 of L
    return rng, wsum, csum
