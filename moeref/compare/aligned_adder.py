"""The aligned-adder model of :mod:`moeref.compare.gemm_bounds` (``accum_model="data_dependent"``): the Hopper FP8
tensor-core model, :func:`aligned_adder_gemm_bound` (an aligned multi-term adder per MMA step, promotion to FP32
every ``promote_every`` columns, computed from the actual products and partial sums), and its pieces shared with the
device engine (:mod:`moeref.compare.device.adder`): the shape-only setup (:class:`AdderSetup`), the operands in their
form (:class:`AdderOperands`, :func:`adder_form`), the step sums and summaries and the recurrence
(:func:`adder_rows`). :mod:`moeref.compare.gemm_bounds` validates the inputs and re-exports the public names.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gemm.exact import BlockOperand, quantum_and_max
from .operand_radius import RADIUS_CHUNK, chunk_scales_constant, exact_radius
from .summation_order import _BLOCK_ELEMS, _gather_cols, gamma, grouped_columns

__all__ = ["AdderSetup", "adder_setup", "adder_exact", "aligned_adder_gemm_bound", "AdderOperands", "adder_form",
           "adder_operands", "adder_step_sums", "NO_EXPONENT", "step_maxima", "step_exponents", "adder_summaries",
           "adder_rows"]


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
