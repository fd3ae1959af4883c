"""Per-element bounds on the arithmetic error of one GEMM ``C = A @ W.T (+ bias)``, one function per
error model (:func:`gemm_error_bound` picks the one a :class:`moeref.compare.Profile` declares):

* :func:`worst_case_gemm_bound` (``accum_model="worst_case"``): ``coef * (|A||W|^T + |bias|)``, any
  summation order (Higham's ``gamma``);
* :func:`contiguous_tree_gemm_bound` (``accum_model="contiguous_tree"``): FP32 accumulation over any
  tree whose nodes sum contiguous K ranges (or SIMD lanes of them), bounded from the ranges the
  exact partial sums actually reach, so a random-sign sum is not bounded as if every term had one sign;
* :func:`aligned_adder_gemm_bound` (``accum_model="data_dependent"``): the Hopper FP8 tensor-core
  model (aligned multi-term adder per 32-wide MMA, promotion to FP32 every 128 columns), computed
  from the actual products and partial sums.

Every function takes validated operands (:class:`moeref.gemm.exact.BlockOperand`), the profile, the
optional operand radius ``a_radius`` float ``[M, K]`` and ``|bias|`` float ``[N]``, and returns float64
``[M, N]``. The bounds are vectorised NumPy over rows, columns and K (row blocks only cap memory).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..gemm.exact import BlockOperand, as_operand, quantum_and_max
from .operand_radius import RADIUS_CHUNK, chunk_scales_constant, exact_radius
from .summation_order import ORDER_CHUNK, ORDER_STEP  # noqa: F401  (their home is summation_order)
from .summation_order import _BLOCK_ELEMS, _gather_cols, grouped_columns, ordered_dot

__all__ = [
    "gamma",
    "gemm_coefficient",
    "gemm_error_bound",
    "worst_case_gemm_bound",
    "contiguous_tree_gemm_bound",
    "aligned_adder_gemm_bound",
    "contiguous_tree_parts",
    "TREE_LANES",
]

U_FP32 = 2.0**-24
U_F64 = 2.0**-53
TREE_LANES = (1, 2, 4, 8, 16, 32)
"""SIMD lane counts covered by :func:`contiguous_tree_gemm_bound` (interleaved accumulators)."""
_WALK_OUTPUTS = 4096  # outputs of one [K, outputs] product tile of the contiguous-tree bound (measured)
_WALK_ROWS = 32  # K rows of a tile walked at a time (a multiple of 4)


@dataclass(frozen=True)
class AdderSetup:
    """The shape-only parameters of :func:`aligned_adder_gemm_bound` (shared by both engines)."""

    chunk: int
    mma: int
    steps: int
    g_prom: float
    const_scales: bool


def adder_setup(k: int, a_block, w_block, profile) -> AdderSetup:
    """Promotion chunk ``c``, MMA width, steps per chunk, the FP32 promotion coefficient and whether every
    chunk lies in one scale block of each operand."""
    bk = max(1, min(a_block[1], w_block[1], max(k, 1)))
    s_blocks = -(-k // bk)
    c = max(1, k if profile.promote_every is None else min(int(profile.promote_every), k))
    n_prom = -(-k // c) + s_blocks + 3
    mma = int(profile.mma_k)
    const = all(chunk_scales_constant(k, b[1], c) for b in (a_block, w_block))
    return AdderSetup(c, mma, -(-c // mma), gamma(n_prom, profile.promote_unit), const)


def adder_exact(qm_a, qm_w, chunk: int) -> bool:
    """The unscaled element products and chunk sums are exact in float64 (``quantum_and_max`` of each
    operand's element values): ``c max|a| max|w| <= 2^53 q_a q_w``."""
    (qa, ma), (qw, mw) = qm_a, qm_w
    return ma == 0 or mw == 0 or chunk * ma * mw <= 2.0**53 * qa * qw


_MIN_NORMAL = 2.0**-1022


def _grid_exact(x):
    """``2^floor(log2 y)``, ``y = x (1 + 2^-40)`` (widened for the float64 sums of E), from the exponent
    bits; ``y`` itself below the normal range (0 for 0): an upper bound, the same bits on every engine."""
    y = x * (1.0 + 2.0**-40)
    p2 = (y.view(np.int64) & np.int64(0x7FF0000000000000)).view(np.float64)
    return np.where(y >= _MIN_NORMAL, p2, y)


def _grid_scaled(x):
    """Scaled domain: ``2^floor(log2 x_unscaled) * scale <= x``."""
    return x


def gamma(n, u: float) -> float:
    """``n u / (1 - n u)`` (Higham's gamma_n); ``inf`` when ``n u >= 1``.

    >>> gamma(128, 2.0**-24) < 128 * 2.0**-24 * 1.00001
    True
    """
    nu = float(n) * u
    return math.inf if nu >= 1 else nu / (1.0 - nu)


def num_k_blocks(a: BlockOperand, w: BlockOperand) -> int:
    """Scale blocks along K of the finer of the two operands' K blockings."""
    k = a.values.shape[1]
    bk = max(1, min(a.block[1], w.block[1], max(k, 1)))
    return -(-k // bk)


def gemm_coefficient(profile, k: int, num_k_blocks: int = 1) -> float:
    """``coef`` of the worst-case model: ``|C~ - C| <= coef * (|A||B|^T + |bias|)`` (bounds module
    docstring, stage 1)."""
    c = k if profile.promote_every is None else min(profile.promote_every, k)
    c = max(c, 1)
    # c products + one aligned-adder term per 32-wide MMA + the final add: see the module docstring
    g_acc = gamma(c + -(-c // 32) + 1, profile.accum_unit)
    n_prom = -(-k // c) + num_k_blocks + 3
    return g_acc + (1.0 + g_acc) * gamma(n_prom, profile.promote_unit)


def gemm_error_bound(a, w, profile, *, a_radius=None, bias=None) -> np.ndarray:
    """Bound on the arithmetic error of ``C = A @ W.T (+ bias)`` computed as ``profile`` declares,
    float64 ``[M, N]``: validates the inputs and calls the function of ``profile.accum_model``.

    ``a``: ``[M, K]`` and ``w``: ``[N, K]`` operands (:func:`moeref.gemm.exact.as_operand` input);
    ``a_radius``: optional float ``[M, K]`` (>= 0): the kernel multiplies some ``A~`` with
    ``|A~ - A| <= a_radius`` elementwise (the uncertain re-quantized intermediate of GEMM2); the bound
    covers the arithmetic error of ``A~ @ W.T`` for every such ``A~`` (the operand difference itself,
    ``a_radius @ |W|.T``, is not included); ``bias``: optional float ``[N]``.

    >>> from moeref.compare.bounds import PROFILES
    >>> hop = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    >>> a = np.array([[1.0, 1.0, 0.0]]); w = np.array([[1.0, -1.0, 0.0]])
    >>> round(float(gemm_error_bound(a, w, hop)[0, 0]) / 2.0**-13, 4)  # 2 products, M = 1: 2 * 2 u_acc
    4.001
    """
    a, w, radius, b_abs = _checked(a, w, a_radius, bias)
    models = {"worst_case": worst_case_gemm_bound, "contiguous_tree": contiguous_tree_gemm_bound,
              "data_dependent": aligned_adder_gemm_bound}
    if profile.accum_model not in models:
        raise ValueError(f"accum_model must be one of {sorted(models)}; got {profile.accum_model!r}")
    return models[profile.accum_model](a, w, profile, radius, b_abs)


def _checked(a, w, a_radius, bias):
    """:func:`gemm_error_bound`'s inputs validated: ``(a, w, radius, |bias|)`` (operands, float64 radius or None,
    float64 ``[N]``)."""
    a = as_operand(a, "a")
    w = as_operand(w, "w")
    m, k = a.values.shape
    n = w.values.shape[0]
    if w.values.shape[1] != k:
        raise ValueError(f"a has K={k} columns but w has K={w.values.shape[1]}")
    b_abs = np.zeros(n) if bias is None else np.abs(np.asarray(bias, dtype=np.float64)).reshape(-1)
    if b_abs.shape != (n,):
        raise ValueError(f"bias must have shape ({n},); got {np.shape(bias)}")
    radius = None
    if a_radius is not None:
        radius = np.asarray(a_radius, dtype=np.float64)
        if radius.shape != (m, k):
            raise ValueError(f"a_radius must have the shape of a, ({m}, {k}); got {radius.shape}")
        if np.any(radius < 0):
            raise ValueError("a_radius must be >= 0")
    return a, w, radius, b_abs


def contiguous_tree_parts(a, w, profile, *, a_radius=None, bias=None):
    """:func:`gemm_error_bound` under ``accum_model="contiguous_tree"`` with two by-products of its walk, the
    same inputs: ``(bound, total, radius_dot)``, float64 ``[M, N]`` each. ``total``: ``sum_k a_k w_k`` of the
    dequantized operands, in K order from the first product (every add rounded; the last prefix sum of the walk of
    ``L = 1``); ``radius_dot``: :func:`moeref.compare.summation_order.ordered_dot` of ``a_radius`` and ``|W|``
    (None without a radius). A caller that needs either (the GEMM's in-order sum, the operand's own uncertainty)
    takes it from here instead of computing it again."""
    if profile.accum_model != "contiguous_tree":
        raise ValueError(f"contiguous_tree_parts needs accum_model='contiguous_tree'; got {profile.accum_model!r}")
    return _contiguous_tree(*_checked(a, w, a_radius, bias), profile)


def worst_case_gemm_bound(a: BlockOperand, w: BlockOperand, profile, radius, b_abs) -> np.ndarray:
    """``coef * ((|A| + a_radius) |W|^T + |bias|)`` with ``coef`` of :func:`gemm_coefficient`: any
    summation order, any chunking (one rounding per add, or 33 ``u_acc`` per 32-wide aligned MMA)."""
    coef = gemm_coefficient(profile, a.values.shape[1], num_k_blocks(a, w))
    a_abs = np.abs(a.dequantize()) + (0.0 if radius is None else radius)
    return coef * (ordered_dot(a_abs, np.abs(w.dequantize())) + b_abs[None, :])


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
    u = float(profile.accum_unit)
    rho = float(profile.adder_factor)
    u_prom = float(profile.promote_unit)
    ad, wd = a.dequantize(), w.dequantize()
    lanes = max(TREE_LANES)
    kp = -(-max(k, 1) // lanes) * lanes
    at, wt = _k_major(ad, kp), _k_major(wd, kp)
    rdot = None if radius is None else ordered_dot(radius, None, w_t=np.abs(wt))
    d = np.zeros((m, n)) if radius is None else rdot * (1.0 + gamma(k + 2, U_F64))
    rng, wsum, csum = _tree_walks(at, wt)
    slack = 2.0 * gamma(kp + 2, U_F64) * wsum
    r_hi = rng + slack + d
    w_hi = wsum * (1.0 + gamma(kp + 2, U_F64)) + d
    c_hi = np.abs(csum) + slack + d
    sigma = gamma(2, u_prom)
    u_prod = 0.0 if _products_exact_in_fp32(a, w) else 2.0 * u
    init = getattr(profile, "bias_add", "epilogue") == "accumulator_init" and bool(b_abs.any())
    t = rho * max(k - 1 + int(init), 0) * u
    denom = 1.0 - t - sigma
    if denom <= 0:
        return np.full((m, n), np.inf), csum, rdot
    if init:  # the bias is the tree's first leaf: one more add, every node holding it within |b| + R
        acc = (t * (r_hi + b_abs[None, :]) + (sigma + u_prod) * w_hi) / np.float64(denom)
        out = acc + (k + 2) * 2.0**-149
    else:
        acc = (t * r_hi + (sigma + u_prod) * w_hi) / np.float64(denom)
        out = acc + u_prom * (c_hi + acc + b_abs[None, :]) + (k + 2) * 2.0**-149
    return out * (1.0 + 1e-9), csum, rdot


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


def _lane_sums(at: np.ndarray, wt: np.ndarray, r0: int, r1: int):
    """``(sum |p|, sum p)`` over each lane of 32 for rows ``r0:r1``, float64 ``[32, r1 - r0, N]`` each, from BLAS
    (any order, with or without fused multiply-adds), at most :data:`_CAP_MACS` multiply-adds a product."""
    kp, n = at.shape[0], wt.shape[1]
    lanes = max(TREE_LANES)
    t = kp // lanes
    a3 = np.ascontiguousarray(at[:, r0:r1].reshape(t, lanes, r1 - r0).transpose(1, 2, 0))   # [32, rows, t]
    w3 = wt.reshape(t, lanes, n).transpose(1, 0, 2)             # [32, t, N] views (row stride 32 N: BLAS reads them)
    sp = np.empty((lanes, r1 - r0, n))
    sa = np.empty((lanes, r1 - r0, n))
    a_abs, w_abs = np.abs(a3), np.abs(wt).reshape(t, lanes, n).transpose(1, 0, 2)
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


def _lane_top(q: np.ndarray) -> np.ndarray:
    """``max(max P, 0) - min(min P, 0)`` of the prefix sums ``P`` in K order of each column of ``q`` ``[R, X]``."""
    wb = np.empty_like(q)
    hi = np.full(q.shape[1], -np.inf)
    lo = np.full(q.shape[1], np.inf)
    prev = np.empty(q.shape[1])
    rows = max(1, _WALK_ROWS)
    for i0 in range(0, q.shape[0], rows):
        _walk_rows(q[i0:i0 + rows], wb[i0:i0 + rows], prev, hi, lo, i0 == 0)
    top = np.maximum(hi, 0.0)
    top -= np.minimum(lo, 0.0)
    return top


class _WalkTile:
    """The buffers of :func:`_tree_walks` for tiles of ``x`` outputs and chunks of ``rows`` K rows, with the row views
    of every walked lane count made once (a tile of the same width reuses them): the products ``pc``, ``|p|`` under
    the running ``sum |p|`` (``pa``), the walk ``wb``, and per lane count the last prefix sums, maxima and minima."""

    def __init__(self, rows: int, x: int, walked: tuple):
        self.x = x
        self.pc = np.empty((rows, x))
        self.pa = np.zeros((rows + 1, max(x, 2)))  # two columns at least: NumPy sums one column pairwise
        self.wb = np.empty((rows, x))
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


def _tree_walks(at: np.ndarray, wt: np.ndarray):
    """``(R, W, S)`` float64 ``[M, N]`` of :func:`contiguous_tree_gemm_bound` from the K-major operands ``at``
    ``[kp, M]`` and ``wt`` ``[kp, N]`` (``kp`` a multiple of 32): the largest range over every lane of every lane
    count, ``sum |p|`` and ``sum p`` in K order."""
    kp, m = at.shape
    n = wt.shape[1]
    lanes = max(TREE_LANES)
    rng = np.empty((m, n))
    wsum = np.empty((m, n))
    csum = np.empty((m, n))
    nb = max(1, min(n, _WALK_OUTPUTS))
    rb = max(1, _WALK_OUTPUTS // nb)
    walked = _walked_lanes(kp)
    rows = min(kp, -(-_WALK_ROWS // walked[-1]) * walked[-1])  # a multiple of every walked lane count
    tiles = {}
    for r0 in range(0, m, rb):  # tiles of [K, rb * nb] products, K in chunks of `rows`
        r1 = min(r0 + rb, m)
        for n0 in range(0, n, nb):
            n1 = min(n0 + nb, n)
            x = (r1 - r0) * (n1 - n0)
            tile = tiles.get(x)
            if tile is None:
                tile = tiles[x] = _WalkTile(rows, x, walked)
            tile.start()
            for k0 in range(0, kp, rows):
                r = min(rows, kp - k0)
                tile.chunk(at[k0:k0 + r, r0:r1], wt[k0:k0 + r, n0:n1], k0 == 0)
            wsum[r0:r1, n0:n1] = tile.acc[:x].reshape(r1 - r0, n1 - n0)
            csum[r0:r1, n0:n1] = tile.prev[1].reshape(r1 - r0, n1 - n0)
            rng[r0:r1, n0:n1] = tile.ranges().reshape(r1 - r0, n1 - n0)
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


def aligned_adder_gemm_bound(a: BlockOperand, w: BlockOperand, profile, radius, b_abs) -> np.ndarray:
    """The Hopper FP8 hardware model, from the actual products (docs/error-bounds.md).

    K is cut into promotion chunks of ``c = promote_every`` columns (``K`` when None), each into MMA
    steps of ``mma_k`` columns. Each chunk starts a fresh accumulator (DeepGEMM issues the first WGMMA
    of a promotion block with the accumulator cleared). One MMA step adds its products (exact:
    FP8/FP4/bf16 products fit an FP32 significand) and the incoming accumulator (steps after the first)
    in an aligned multi-term adder: every addend is aligned to the largest addend's exponent
    ``e = floor(log2 max|addend|)`` and cut to a grid no finer than ``2^(e + 1) * u_acc``
    (``u_acc = 2^-13``: 14 bits kept, plus one bit of headroom for a carry or a 13-bit alignment: twice
    the grid of a 14-bit significand of the largest), any rounding direction; the sum is exact and then
    normalised, losing less than ``2 u_acc`` of its magnitude (again one bit of headroom). Block scales
    are constant over a chunk (DeepGEMM's 1x128 and 128x128 blocks); each chunk is multiplied by its
    scales and added in FP32. Sources: DeepSeek-V3 technical report §3.3.2 (~14 bits, promotion every
    128 columns); Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores" (PeerJ CS
    2021: alignment to the largest exponent, truncation). Per output element, chunk and step ``j``
    (``P_j`` the products of the step, ``S_j`` the exact partial sum of the chunk through step ``j``,
    ``E_j`` the error bound so far, ``p2(x) = 2^floor(log2 x)``), with per-step summaries of the operands in
    place of the step's largest product and its nonzero count (:func:`adder_summaries`: the step's row and
    column maxima and nonzero counts, and in the exact domain the largest exponent sum of its nonzero
    products; docs/error-bounds.md "Cheaper summaries of a step"):

        T_j     >= p2(max |P_j|): min(2^(m_j + 1), p2(max_step |a| * max_step |w|)) in the exact domain,
                  m_j the largest floor(log2|a|) + floor(log2|w|) over the step's nonzero products
                  (|a w| < 2^(m_j + 2)); max_step |a| * max_step |w| in the scaled form
        n_j     = min(nonzero a, nonzero w of the step) (>= its nonzero products), plus 1 for the
                  accumulator when j > 0
        M_j     = max(T_j, p2(|S_{j-1}| + E_{j-1}))                (the largest addend's grid, at most)
        align_j = n_j * 2 u_acc * M_j                                (>= n_j * 2^(e + 1) * u_acc)
        E_j     = E_{j-1} + align_j + 2 u_acc p2(|S_j| + E_{j-1} + align_j)

    and the chunk's accumulator satisfies ``|acc| <= |S| + E``. Three forms (:func:`adder_form`):

    * **exact** (no radius; the element values finite, every partial sum of a chunk of them exact in float64,
      ``c * max|a| * max|w| <= 2^53 q_a q_w`` with :func:`moeref.gemm.exact.quantum_and_max`, and the scales
      constant over each chunk): the recurrence runs on the unscaled elements and is multiplied by the chunk's
      ``|scale_a scale_w|``;
    * **scaled** (otherwise: a scale block shorter than a chunk, inexact partial sums, non-finite values): it
      runs on the scaled products with ``p2`` replaced by the identity (``2^floor(log2 x_unscaled) * scale <=
      x``, whatever the scale, so the bound holds whether the kernel scales before or after accumulating), the
      step sums in column order;
    * **steps** (an ``a_radius`` under the exact form's conditions, finite scales, the radius rounded up onto the
      grid of :mod:`moeref.compare.operand_radius`, every chunk inside one of its 128-column chunks): the scaled
      form's recurrence, with ``|S_j| = |s_j sa sw|`` and the radius's partial sum ``d_j |sw|``, where ``s_j`` and
      ``d_j`` are the exact partial sums of the element values ``a w`` and of ``r^ |w|`` (one rounding each
      instead of one per column: the same bits in any summation order, so on the tensor cores too).

    The promotions, scale products and the bias add are FP32:
    ``gamma(ceil(K/c) + S + 3, u_fp32) (sum_chunks scale (|S| + E) + |bias|)`` (as in
    :func:`gemm_coefficient`). With ``a_radius``, ``max |P_j|`` uses ``(|A| + a_radius) |W|`` and ``|S_j|``
    grows by the partial sums of ``a_radius |W|``. ``M_j`` is widened by ``2^-40`` before ``p2`` and the
    result by ``1e-9`` relative, for the float64 rounding of the bound's own arithmetic (in the steps form
    ``|S_j|`` and the radius's sums are within two roundings of their exact values: inside that margin).

    Every term is monotone in ``T_j`` and ``n_j``, so these summaries give a bound >= the one from the step's
    largest product and nonzero count themselves (the definition until 2026-11-25, about 11 % tighter on the
    layer bound: bench/studies/study_adder_summaries.py); they leave one exact step sum as the only per-product work,
    which a GPU does on its tensor cores (:mod:`moeref.compare.device.bounds`).

    Cost: the products in float64 (in row blocks of at most 2^22) and an ``O(M N K / mma_k)`` recurrence: fine
    for test-sized layers; production shapes run on the GPU.
    """
    m, k = a.values.shape
    n = w.values.shape[0]
    if m == 0 or n == 0 or k == 0:
        return np.broadcast_to(adder_setup(k, a.block, w.block, profile).g_prom * b_abs, (m, n)).copy()
    op = adder_operands(a, w, profile, radius)
    out = np.empty((m, n))
    for r0, r1 in op.row_blocks():  # row blocks bound the memory of the [rb, N, K] product tensor
        t_s, t_d = adder_step_sums(op, r0, r1)
        top, cnt = adder_summaries(op, r0, r1)
        out[r0:r1] = adder_rows(op, r0, t_s, t_d, top, cnt, b_abs)
    return out * (1.0 + 1e-9)


@dataclass(frozen=True)
class AdderOperands:
    """The operands of :func:`aligned_adder_gemm_bound` as its recurrence reads them, in one of three forms
    (``form``; the function's docstring): ``"exact"`` (element values; chunk scales ``sa`` ``[M, nch]`` / ``sw``
    ``[N, nch]`` applied after the recurrence), ``"steps"`` (element values for the exact step sums, the chunk
    scales applied to the partial sums; the radius rounded up onto its grid) or ``"scaled"`` (scaled values).
    ``ac`` ``[M, nch, steps, mma]`` / ``bd`` ``[N, nch, steps, mma]`` the operands of the step sums, ``ar`` the
    radius (or None) in the same layout, ``au = |a| + ar`` and ``bd_abs = |w|`` (scaled, except in the exact form)
    for the step summaries, ``bu_abs`` the ``|w|`` of the radius's step sums (``|bd|``); ``a_steps`` / ``w_steps``
    :func:`step_maxima` of ``au`` / ``bd_abs``, and in the exact form ``exponents`` :func:`step_exponents` of
    ``ac`` and ``bd``."""

    st: AdderSetup
    form: str
    ac: np.ndarray
    bd: np.ndarray
    sa: np.ndarray | None
    sw: np.ndarray | None
    ar: np.ndarray | None
    au: np.ndarray
    bd_abs: np.ndarray
    bu_abs: np.ndarray
    u2: float
    a_steps: tuple
    w_steps: tuple
    exponents: tuple | None

    @property
    def exact(self) -> bool:
        """The exact form: element values, a power-of-two grid, the chunk scales after."""
        return self.form == "exact"

    def row_blocks(self):
        """``(r0, r1)`` blocks of rows whose ``[rb, N, K]`` product tensor has at most 2^22 elements."""
        m, n = self.ac.shape[0], self.bd.shape[0]
        rb = max(1, _BLOCK_ELEMS // max(1, n * int(np.prod(self.ac.shape[1:]))))
        return [(r0, min(r0 + rb, m)) for r0 in range(0, m, rb)]


def adder_form(a: BlockOperand, w: BlockOperand, st: AdderSetup, radius):
    """``(form, r^)`` of :func:`aligned_adder_gemm_bound` (its docstring): ``"exact"`` when the operands' element
    values are finite, every partial sum of a chunk of them is exact in float64 (:func:`adder_exact`), the scales
    are constant over each chunk and there is no radius; ``"steps"`` under the same conditions with a radius that
    :func:`moeref.compare.operand_radius.exact_radius` rounds onto its grid (returned as ``r^``), finite scales and
    every chunk inside one :data:`~moeref.compare.operand_radius.RADIUS_CHUNK`; ``"scaled"`` otherwise."""
    k = a.values.shape[1]
    if not (st.const_scales and np.all(np.isfinite(a.values)) and np.all(np.isfinite(w.values))):
        return "scaled", None
    if not adder_exact(quantum_and_max(a.values), quantum_and_max(w.values), st.chunk):
        return "scaled", None
    if radius is None:
        return "exact", None
    if not (np.all(np.isfinite(a.scales)) and chunk_scales_constant(k, RADIUS_CHUNK, st.chunk)):
        return "scaled", None
    r_hat = exact_radius(radius, w)
    return ("scaled", None) if r_hat is None else ("steps", r_hat)


def adder_operands(a: BlockOperand, w: BlockOperand, profile, radius) -> AdderOperands:
    """The operands of the aligned-adder recurrence (:class:`AdderOperands`) in the form of :func:`adder_form`."""
    m, k = a.values.shape
    n = w.values.shape[0]
    st = adder_setup(k, a.block, w.block, profile)
    form, r_hat = adder_form(a, w, st, radius)
    cols = grouped_columns(k, st.chunk, st.mma)
    sa = sw = None
    if form == "scaled":
        ac, bd = _gather_cols(a.dequantize(), cols), _gather_cols(w.dequantize(), cols)
    else:  # the element values; the chunk scales apply after the recurrence (exact) or to its partial sums (steps)
        ac, bd = _gather_cols(a.values.astype(np.float64), cols), _gather_cols(w.values.astype(np.float64), cols)
        blk = np.arange(cols.shape[0]) * st.chunk
        sa = np.abs(a.scales[(np.arange(m) // a.block[0])[:, None], (blk // a.block[1])[None, :]])
        sw = np.abs(w.scales[(np.arange(n) // w.block[0])[:, None], (blk // w.block[1])[None, :]])
    ar = None if radius is None else _gather_cols(r_hat if form == "steps" else radius, cols)
    if form == "steps":  # the step summaries of the scaled operands, as the scaled form takes them
        a_abs, bd_abs = np.abs(_gather_cols(a.dequantize(), cols)), np.abs(_gather_cols(w.dequantize(), cols))
    else:
        a_abs, bd_abs = np.abs(ac), np.abs(bd)
    au = a_abs if ar is None else a_abs + ar
    exps = (step_exponents(ac), step_exponents(bd)) if form == "exact" else None
    return AdderOperands(st, form, ac, bd, sa, sw, ar, au, bd_abs, np.abs(bd), 2.0 * profile.accum_unit,
                         step_maxima(au), step_maxima(bd_abs), exps)


def adder_step_sums(op: AdderOperands, r0: int, r1: int):
    """Rows ``r0:r1``: the steps' sums ``t_s`` of ``a w`` (and ``t_d`` of ``radius |w|``, None without a radius), each
    ``[rb, N, nch, steps]``, every step summed in column order: exact in the exact and steps forms (any order gives
    these bits), the declared order of the device kernel in the scaled form."""
    shape = (r1 - r0, op.bd.shape[0]) + op.ac.shape[1:3]                   # [rb, N, nch, steps]
    t_s = np.zeros(shape)
    t_d = None if op.ar is None else np.zeros(shape)
    for i in range(op.st.mma):  # the step's columns in order
        t_s = t_s + op.ac[r0:r1, None, :, :, i] * op.bd[None, :, :, :, i]
        if op.ar is not None:
            t_d = t_d + op.ar[r0:r1, None, :, :, i] * op.bu_abs[None, :, :, :, i]
    return t_s, t_d


NO_EXPONENT = -(1 << 20)
"""The exponent :func:`step_exponents` gives a zero element: any sum with it stays below ``NO_EXPONENT // 2``."""


def step_maxima(x: np.ndarray):
    """``(largest, nonzero)`` of each step of ``x`` ``[R, nch, steps, mma]`` (nonnegative; NaN allowed): the largest
    element ignoring NaN (from +0, ``where(v > acc, v, acc)``) and the count of elements ``!= 0`` (NaN counts),
    float64 ``[R, nch, steps]``."""
    big = np.zeros(x.shape[:-1])
    cnt = np.zeros(x.shape[:-1])
    for i in range(x.shape[-1]):
        v = x[..., i]
        big = np.where(v > big, v, big)
        cnt = cnt + (v != 0)
    return big, cnt


def step_exponents(x: np.ndarray) -> np.ndarray:
    """``floor(log2|x|)`` of finite elements as int64, :data:`NO_EXPONENT` for zeros."""
    return np.where(x != 0, np.frexp(x)[1].astype(np.int64) - 1, NO_EXPONENT)


def adder_summaries(op: AdderOperands, r0: int, r1: int):
    """Rows ``r0:r1``: ``(T, n)`` ``[rb, N, nch, steps]`` of :func:`aligned_adder_gemm_bound` (its docstring).
    ``T``: the grid of the product of the step's row and column maxima (0 where either is 0: no nonzero product,
    also against an infinite or NaN maximum on the other side), in the exact domain the smaller of that and
    ``2^(m_j + 1)`` (0 without a nonzero product); ``n``: the smaller of the step's nonzero counts of
    ``|a| (+ radius)`` and ``|w|``."""
    grid = _grid_exact if op.exact else _grid_scaled
    a_max, a_nz = op.a_steps
    w_max, w_nz = op.w_steps
    am, wm = a_max[r0:r1, None], w_max[None]
    with np.errstate(invalid="ignore"):  # inf * 0, replaced by 0
        top = grid(np.where((am == 0) | (wm == 0), 0.0, am * wm))
    if op.exact:
        ea, ew = op.exponents
        m = np.full(top.shape, NO_EXPONENT, dtype=np.int64)
        for i in range(op.st.mma):
            m = np.maximum(m, ea[r0:r1, None, :, :, i] + ew[None, :, :, :, i])
        p2m = np.where(m > NO_EXPONENT // 2, np.ldexp(1.0, np.maximum(m, -1021) + 1), 0.0)
        top = np.where(p2m < top, p2m, top)
    return top, np.minimum(a_nz[r0:r1, None], w_nz[None])


def adder_rows(op: AdderOperands, r0: int, t_s, t_d, top, cnt, b_abs, *, radius_term: bool = False):
    """The recurrence over the steps of every chunk, the chunk scales, the sum over chunks in order and the
    promotion term, for rows ``r0:`` (``t_s``/``t_d`` of :func:`adder_step_sums`, ``top``/``cnt`` of
    :func:`adder_summaries`, each ``[rb, N, nch, steps]``): ``[rb, N]``, before the final ``1 + 1e-9``. A step's
    largest addend enters as ``where(top > g, top, g)`` with ``g`` the grid of ``|S_{j-1}| + E_{j-1}``: the grid of
    their maximum, since the grid is nondecreasing. In the steps form ``|S_j|`` is ``|s sa sw|`` and the radius's
    partial sum ``d sw`` (``s``, ``d`` the exact partial sums of the element values, one rounding each);
    ``radius_term`` (steps form) also returns the sum over chunks of each chunk's ``d sw``, in order
    (:func:`moeref.compare.operand_radius.radius_dot`'s numbers when the chunk is its chunk)."""
    grid = _grid_exact if op.exact else _grid_scaled
    steps = op.form == "steps"
    if steps:
        r1 = r0 + t_s.shape[0]
        sc = op.sa[r0:r1, None, :] * op.sw[None, :, :]                     # [rb, N, nch]
        swc = op.sw[None, :, :]
    err = np.zeros(t_s.shape[:3])                                           # [rb, N, nch]
    prev = np.zeros_like(err)                                               # |S_{j-1}| + E_{j-1}
    s_sum = np.zeros_like(err)
    d_sum = np.zeros_like(err)
    for j in range(op.st.steps):  # <= promote_every / mma_k steps (4 for DeepGEMM): the recurrence
        s_sum = s_sum + t_s[..., j]
        if steps:
            d_sum = d_sum + t_d[..., j]
            s_part = np.abs(s_sum * sc) + d_sum * swc
        else:
            s_part = np.abs(s_sum)
            if t_d is not None:
                d_sum = d_sum + t_d[..., j]
                s_part = s_part + d_sum
        g = grid(prev)
        align = ((cnt[..., j] + float(j > 0)) * op.u2) * np.where(top[..., j] > g, top[..., j], g)
        err = (err + align) + op.u2 * grid((s_part + err) + align)
        prev = s_part + err
    if op.exact:
        r1 = r0 + t_s.shape[0]
        scale = op.sa[r0:r1, None, :] * op.sw[None, :, :]
        err, prev = err * scale, prev * scale
    tot_e = np.zeros(t_s.shape[:2])
    tot_p = np.zeros(t_s.shape[:2])
    tot_r = np.zeros(t_s.shape[:2])
    for c in range(t_s.shape[2]):  # chunks in order
        tot_e = tot_e + err[..., c]
        tot_p = tot_p + prev[..., c]
        if radius_term:
            tot_r = tot_r + d_sum[..., c] * swc[..., c]
    out = tot_e + op.st.g_prom * (tot_p + b_abs[None, :])
    return (out, tot_r) if radius_term else out
