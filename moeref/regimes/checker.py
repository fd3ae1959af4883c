"""Whether given GEMM inputs are in an exact regime for a declared arithmetic, and why not.

The argument (docs/exact-regimes.md). Write every term of an output element as
``t_k = a_k * w_k`` with the operands' *real* values (element times its block scale, global and channel
factors included, :class:`moeref.gemm.BlockOperand`). Let ``Q`` be the largest power of two dividing
every term (the product of the lowest set bits of the operands: ``lsb(a) * lsb(w)``, both
significands odd), and ``S`` the larger of the sum of the positive terms and the sum of the
magnitudes of the negative ones. Every partial sum over any subset of the terms, in any order, is
then an integer multiple of ``Q`` of magnitude at most ``S``. An accumulator that keeps ``p``
significant bits below its largest addend (FP32: 24; Hopper's FP8 WGMMA: 14) therefore represents
every partial sum it can form, in every order and split, exactly when ``S <= 2^p * Q``. Applied per
promotion interval for an MMA accumulator (DeepGEMM: 128 columns of K), and over the whole K for
the FP32 accumulator that sums the promoted partials. The result is then the exact dot product, the
same for every conforming kernel, and a declared store rounds that exact value once (RNE): the same
bits for every kernel again.

The checks are sufficient, not necessary, and conservative in one more way: ``Q`` is bounded below
per output element by ``min_k lsb(a[m, k]) * min_k lsb(w[n, k])``. A first test needs no matmul: ``S`` is at
most ``max_k |a[m, k]| * sum_k |w[n, k]|`` (per promotion interval: that interval's sum), so when the largest
``log2(max|a[m]| / lsb a[m])`` plus the largest ``log2(sum|w[n]| / lsb w[n])`` fits the accumulator, every
output does; only when it does not are ``S`` and ``Q`` formed per output (two matmuls per interval).
Everything is float64 NumPy, exact (sums of non-negative terms far below 2^53 ulps of slack only decide a
comparison with a power of two).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..gemm.exact import BlockOperand, as_operand
from .arithmetic import Arithmetic, get_arithmetic

__all__ = ["RegimeCheck", "in_exact_regime", "lsb_exponents", "significant_bits", "operand_real_values"]

_ZERO_LSB = 1 << 20  # lsb exponent given to zeros (they never set a quantum)
_STORE_MAX = {"bfloat16": 3.3895313892515355e38, "float16": 65504.0, "float32": 3.4028234663852886e38,
              None: np.inf}


class RegimeCheck(NamedTuple):
    """``(ok, reasons)``: ``ok`` True when the inputs are in the regime; ``reasons`` lists, when not,
    what fails and where (empty when ``ok``). Unpacks as a pair: ``ok, why = in_exact_regime(...)``."""

    ok: bool
    reasons: list

    def __bool__(self) -> bool:
        return bool(self.ok)


def lsb_exponents(x) -> np.ndarray:
    """``e`` with ``x = odd * 2^e`` for every nonzero finite ``x`` (int64, ``x``'s shape); zeros get a huge
    exponent (``2^20``: never the minimum). Exact: from the float64 bits (the significand's trailing zeros;
    subnormals included).

    >>> lsb_exponents(np.array([448.0, 0.375, 1.0, 0.0])).tolist()
    [6, -3, 0, 1048576]
    """
    v = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(v)):
        raise ValueError("values must be finite to have a lowest bit")
    bits = np.ascontiguousarray(v).reshape(v.shape).view(np.uint64) & np.uint64(0x7FFFFFFFFFFFFFFF)
    field = (bits >> np.uint64(52)).astype(np.int64)  # biased exponent (0: zero or subnormal)
    sig = (bits & np.uint64(0xFFFFFFFFFFFFF)) | np.where(field > 0, np.uint64(1 << 52), np.uint64(0))
    low = sig & (~sig + np.uint64(1))  # the lowest set bit, a power of two, exact as a float64
    tz = (low.astype(np.float64).view(np.uint64) >> np.uint64(52)).astype(np.int64) - 1023
    return np.where(bits == 0, _ZERO_LSB, tz + np.maximum(field, 1) - 1075)


def significant_bits(x) -> np.ndarray:
    """Significant bits of each value (``floor(log2|x|) - lsb + 1``; 0 for zeros), int64.

    >>> significant_bits(np.array([448.0, 449.0, 0.0, 0.5])).tolist()
    [3, 9, 0, 1]
    """
    v = np.abs(np.asarray(x, dtype=np.float64))
    top = np.frexp(v)[1].astype(np.int64) - 1
    return np.where(v == 0, 0, top - lsb_exponents(v) + 1)


def operand_real_values(op: BlockOperand) -> np.ndarray:
    """float64 ``[R, K]``: element times its block's decode scale (exact: at most 8 + 2 x 24 bits...
    in practice element bits plus scale bits, well inside 53)."""
    r, k = op.shape
    br, bk = op.block
    s = np.repeat(np.repeat(op.scales, br, axis=0)[:r], bk, axis=1)[:, :k]
    return np.asarray(op.values, dtype=np.float64) * s


def _pos_neg_sums(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``max(sum of positive terms, |sum of negative terms|)`` of ``a @ w.T`` per output (float64)."""
    ap, an = np.maximum(a, 0.0), np.maximum(-a, 0.0)
    wp, wn = np.maximum(w, 0.0), np.maximum(-w, 0.0)
    both = np.concatenate([ap, an], axis=1)
    pos = both @ np.concatenate([wp, wn], axis=1).T
    neg = both @ np.concatenate([wn, wp], axis=1).T
    return np.maximum(pos, neg)


def _excess(s: np.ndarray, qexp: np.ndarray, bits: int) -> np.ndarray:
    """log2(S) - log2(Q) - bits where S > 0 (positive: out of the regime), -inf elsewhere."""
    with np.errstate(divide="ignore"):
        ls = np.log2(np.where(s > 0, s, 1.0))
    return np.where(s > 0, ls - qexp - bits, -np.inf)


def _where(idx, shape) -> tuple:
    return tuple(int(i) for i in np.unravel_index(int(idx), shape))


def _log2_ratio_max(mag: np.ndarray, lsb_min: np.ndarray) -> float:
    """``max_r log2(mag[r] / 2^lsb_min[r])`` over rows with ``mag > 0`` (-inf when there are none)."""
    nz = mag > 0
    if not nz.any():
        return -np.inf
    return float(np.max(np.log2(mag[nz]) - lsb_min[nz]))


def _cheap_bound_holds(av, wv, la, lw, ar: Arithmetic, fp32_bits: int) -> bool:
    """A sufficient test in O(R K + N K): every term of output ``[r, n]`` has magnitude at most
    ``amax(a[r]) |w[n, k]|``, so every partial sum (any subset, any order) is at most ``amax(a[r]) sum_k |w[n, k]|``
    (over one promotion interval: that interval's sum), a multiple of ``2^(min lsb a[r] + min lsb w[n])``. With
    ``A[r] = log2 amax(a[r]) - min lsb a[r]`` and ``W[n]`` likewise from the weight sums, every output is inside
    the accumulator when ``max A + max W <= bits``: no matmul. Slack ``2^-30`` relative against float rounding
    of the sums (a tie with the limit falls through to the exact test)."""
    slack = 1e-9
    la_min, lw_min = la.min(axis=1), lw.min(axis=1)
    amax = np.abs(av).max(axis=1)
    aw = np.abs(wv)
    a_bits = _log2_ratio_max(amax, la_min)
    if a_bits == -np.inf:
        return True
    w_bits = _log2_ratio_max(aw.sum(axis=1), lw_min)
    if w_bits == -np.inf:
        return True
    if a_bits + w_bits > fp32_bits - slack:
        return False
    nz_a, nz_w = amax > 0, aw.max(axis=1) > 0
    if int(la_min[nz_a].min()) + int(lw_min[nz_w].min()) < -126:
        return False
    store_max = min(_STORE_MAX[ar.gemm_store], 2.0**127)
    if float(amax.max()) * float(aw.sum(axis=1).max()) * (1 + slack) >= store_max:
        return False
    if ar.accumulator == "fp32" or (ar.interval is None and fp32_bits == ar.mma_bits):
        return True
    k = aw.shape[1]
    length = k if ar.interval is None else min(int(ar.interval), k)
    pad = (-k) % length
    blocks = np.pad(aw, ((0, 0), (0, pad))).reshape(aw.shape[0], -1, length).sum(axis=2)
    return a_bits + _log2_ratio_max(blocks.max(axis=1), lw_min) <= ar.mma_bits - slack


def _check_pair(a: BlockOperand, w: BlockOperand, ar: Arithmetic, label: str) -> list:
    reasons = []
    m, k = a.shape
    n, kw = w.shape
    if k != kw:
        raise ValueError(f"{label}: a has K={k} columns but w has K={kw}")
    if m == 0 or n == 0 or k == 0:
        return reasons
    av, wv = operand_real_values(a), operand_real_values(w)
    la, lw = lsb_exponents(av), lsb_exponents(wv)
    fp32_bits = 24 if ar.accumulator in ("fp32", "hopper_fp8", "fp8_unpromoted") else ar.mma_bits
    if _cheap_bound_holds(av, wv, la, lw, ar, fp32_bits) and _scales_exact(a, w):
        return reasons
    # FP32 over the whole K (the promoted accumulator, or the only one)
    qa, qw = la.min(axis=1), lw.min(axis=1)
    qexp = (qa[:, None] + qw[None, :]).astype(np.float64)
    s = _pos_neg_sums(av, wv)
    x = _excess(s, qexp, fp32_bits)
    if np.any(x > 0):
        i = int(np.argmax(x))
        r, c = _where(i, x.shape)
        reasons.append(f"{label}: the {'FP32' if fp32_bits == 24 else ar.accumulator} accumulator: partial sums of "
                       f"output [{r}, {c}] reach 2^{np.log2(s[r, c]):.2f} = {x[r, c] + fp32_bits:.2f} bits above "
                       f"their quantum 2^{int(qexp[r, c])} ({fp32_bits} kept)")
    nz = s > 0
    if np.any(nz & (qexp < -126)):
        reasons.append(f"{label}: terms below FP32's normal range (quantum 2^{int(qexp[nz].min())} < 2^-126)")
    store_max = _STORE_MAX[ar.gemm_store]
    if np.any(s >= min(store_max, 2.0**127)):
        reasons.append(f"{label}: sums reach {float(s.max()):.4g}, beyond the {ar.gemm_store or 'FP32'} range")
    # scale products sa * sb, formed in FP32 by block-scaled kernels, must be exact
    if not _scales_exact(a, w):
        sb_a, sb_w = int(significant_bits(a.scales).max()), int(significant_bits(w.scales).max())
        reasons.append(f"{label}: block scales of {sb_a} and {sb_w} significant bits: their FP32 product "
                       f"is not exact (use powers of two, UE8M0 or UE4M3 scales)")
    # the low-precision MMA accumulator, per interval of K
    interval = ar.interval
    if ar.accumulator != "fp32" and not (interval is None and fp32_bits == ar.mma_bits):
        length = k if interval is None else min(int(interval), k)
        bits = ar.mma_bits
        worst = (-np.inf, None)
        for start in range(0, k, length):
            sl = slice(start, min(start + length, k))
            qi = (la[:, sl].min(axis=1)[:, None] + lw[:, sl].min(axis=1)[None, :]).astype(np.float64)
            si = _pos_neg_sums(av[:, sl], wv[:, sl])
            xi = _excess(si, qi, bits)
            j = int(np.argmax(xi))
            if xi.reshape(-1)[j] > worst[0]:
                worst = (float(xi.reshape(-1)[j]), (_where(j, xi.shape), start, float(si.reshape(-1)[j]),
                                                   int(qi.reshape(-1)[j])))
        if worst[0] > 0:
            (r, c), start, sv, qv = worst[1]
            reasons.append(f"{label}: the {ar.accumulator} accumulator ({bits} bits, "
                           f"{'never promoted' if interval is None else f'promoted every {interval} K'}): partial "
                           f"sums of output [{r}, {c}] in K [{start}, {start + length}) reach 2^{np.log2(sv):.2f}, "
                           f"{worst[0] + bits:.2f} bits above their quantum 2^{qv}")
    return reasons


def _scales_exact(a: BlockOperand, w: BlockOperand) -> bool:
    """Whether the FP32 product of any block scale of ``a`` and any of ``w`` is exact."""
    if not (a.scales.size and w.scales.size):
        return True
    sb_a = int(significant_bits(a.scales).max())
    sb_w = int(significant_bits(w.scales).max())
    return not (sb_a + sb_w > 24 and min(sb_a, sb_w) > 1)


def in_exact_regime(inputs, arithmetic="fp32") -> RegimeCheck:
    """Whether GEMM ``inputs`` are in the exact regime of ``arithmetic``, and why not.

    Args:
        inputs: ``(a, w)``: ``a [M, K]``, ``w [N, K]`` (NT: ``C = a @ w.T``), each a
            :class:`moeref.quant.QuantizedTensor`, a :class:`moeref.gemm.BlockOperand` or a float array;
            or ``(a, weights, row_expert)`` for a grouped GEMM: ``a [R, K]``, ``weights`` a list of
            per-expert ``[N, K]`` operands, ``row_expert`` int ``[R]`` (-1: padding row, not computed).
        arithmetic: an :class:`~moeref.regimes.Arithmetic` or a name of
            :data:`~moeref.regimes.ARITHMETICS` (``"fp32"``, ``"hopper_fp8"``, ``"fp8_unpromoted"``...).

    Returns:
        :class:`RegimeCheck` ``(ok, reasons)``. In the regime, every implementation of the arithmetic
        (any order, split-K, tile shape) computes the exact product, so its stored output equals the
        reference's (:func:`moeref.gemm.block_gemm` rounded to the store) bit for bit.

    >>> a = np.array([[1.0, -2.0, 3.0]]); w = np.array([[4.0, 5.0, -6.0]])
    >>> in_exact_regime((a, w), "fp32")
    RegimeCheck(ok=True, reasons=[])
    >>> ok, why = in_exact_regime((np.array([[1.0, 2.0**-30]]), np.array([[1.0, 1.0]])), "fp32")
    >>> ok, why[0][:60]
    (False, 'gemm: the FP32 accumulator: partial sums of output [0, 0] re')
    """
    ar = get_arithmetic(arithmetic)
    if not isinstance(inputs, (tuple, list)) or len(inputs) not in (2, 3):
        size = f" of length {len(inputs)}" if isinstance(inputs, (tuple, list)) else ""
        raise TypeError(f"inputs must be (a, w) or (a, weights, row_expert); got {type(inputs).__name__}{size}")
    if len(inputs) == 2:
        return RegimeCheck(*_result(_check_pair(as_operand(inputs[0], "a"), as_operand(inputs[1], "w"), ar, "gemm")))
    a, weights, rows = inputs
    op = as_operand(a, "a")
    rows = np.asarray(rows).astype(np.int64).reshape(-1)
    if rows.size != op.shape[0]:
        raise ValueError(f"row_expert has {rows.size} entries but a has {op.shape[0]} rows")
    if not isinstance(weights, (list, tuple)):
        raise TypeError(f"weights must be a list of per-expert operands; got {type(weights).__name__}")
    if rows.size and int(rows.max(initial=-1)) >= len(weights):
        raise ValueError(f"row_expert names expert {int(rows.max())} but weights has {len(weights)}")
    reasons = []
    # experts that share one weight object (a pool of distinct experts) are checked in one pass
    groups: dict = {}
    for e in np.unique(rows[rows >= 0]).tolist():
        groups.setdefault(id(weights[e]), []).append(e)
    for es in groups.values():
        idx = np.flatnonzero(np.isin(rows, es))
        label = f"expert {es[0]}" if len(es) == 1 else f"experts {es}"
        reasons += _check_pair(op.take_rows(idx), as_operand(weights[es[0]], f"weights[{es[0]}]"), ar, label)
    return RegimeCheck(*_result(reasons))


def _result(reasons: list) -> tuple:
    return (not reasons, reasons)
