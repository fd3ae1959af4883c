"""quantize / dequantize / requantize, the quantizer registry, and the requantization report.

:class:`QuantizedTensor` (codes + scales + scheme, exact decode) is defined in :mod:`.quantized` and
re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..formats import decode_table, encode
from .blocks import block_amax, block_view, expand_to_elements
from .blockwise import quantize_blockwise
from .lossless import find_lossless, global_storable, sample_blocks_representable
from .quantized import QuantizedTensor
from .scheme import Scheme, _check_static_scale

__all__ = [
    "QuantizedTensor",
    "RequantReport",
    "quantize",
    "dequantize",
    "requantize",
    "QUANTIZERS",
    "register_quantizer",
    "PRECISIONS",
    "quantize_and_report",
    "sum_of_squares",
]

# ---- quantize dispatch -------------------------------------------------------------------------

QUANTIZERS: dict[str, Callable] = {}


def register_quantizer(family: str, fn: Callable) -> Callable:
    """Register ``fn(x, scheme, **static) -> QuantizedTensor`` for ``Scheme.family == family``."""
    QUANTIZERS[family] = fn
    return fn


def _quantize_blockwise_family(x, scheme: Scheme, scale=None):
    static = scheme.static_scale if scale is None else _check_static_scale(scale, scheme.scale_format, "scale")
    return quantize_blockwise(x, scheme, static_scale=static,
                              need_minmax=scheme.preset.fp32_rule == "signed_minmax")


register_quantizer("blockwise", _quantize_blockwise_family)


def quantize(x, scheme: Scheme, **static) -> QuantizedTensor:
    """Quantize ``x`` (NumPy/ml_dtypes/torch CPU float array, any leading shape) with ``scheme``.

    ``static``: ``scale=`` a fixed positive decode scale (per-tensor static FP8; a power of two
    for UE8M0), overriding ``scheme.static_scale``.

    >>> from moeref.quant import fp8_group
    >>> q = quantize(np.array([[1.0, -2.0, 448.0, 0.0]], np.float32), fp8_group(2))
    >>> q.scales.tolist(), q.dequantize().tolist()
    ([[0.004464285913854837, 1.0]], [[1.0, -2.0, 448.0, 0.0]])
    """
    if not isinstance(scheme, Scheme):
        raise TypeError(f"scheme must be a Scheme (see moeref.quant.SCHEMES); got {type(scheme).__name__}")
    fn = QUANTIZERS.get(scheme.family)
    if fn is None:
        raise ValueError(f"no quantizer registered for family {scheme.family!r} "
                         f"(registered: {', '.join(QUANTIZERS)})")
    return fn(x, scheme, **static)


def dequantize(q: QuantizedTensor, dtype=np.float32) -> np.ndarray:
    """``q.dequantize(dtype)``."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor; got {type(q).__name__}")
    return q.dequantize(dtype)


# ---- requantize --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequantReport:
    """How faithful a requantization was (every figure against the EXACT source values).

    Attributes:
        lossless: every element decodes to exactly the source value (NaN to NaN).
        max_abs_error: max |target - source| over finite elements (0.0 when lossless).
        error: per-element exact error ``target - source`` (float64, logical shape; 0 where
            both are NaN, NaN where only one is).
        method: ``"rule"`` (the target scheme's scale rule on the source values),
            ``"exact_rescale"`` (each target block takes its source block's decode scale,
            re-expressed in the target scale format, and the data are re-encoded with it) or
            ``"lossless_search"`` (:func:`moeref.quant.lossless.find_lossless` found scales that
            make every element exact).
        rel_l2: ``||error||_2 / ||source||_2`` over finite elements (0.0 for a zero source).
        sqnr_db: ``10 log10(||source||^2 / ||error||^2)`` (``inf`` when lossless). Both norms are
            :func:`sum_of_squares` (a fixed summation order, so the device report gives the same float).
        worst_block: index (on the target's block grid) of the block holding the first element
            (C order) of largest |error|, i.e. a block with the largest max |error|; None when
            lossless.
        precision: ``"exact"`` or ``"float32"`` (see :func:`requantize`).
    """

    lossless: bool
    max_abs_error: float
    error: np.ndarray = field(repr=False)
    method: str
    rel_l2: float = 0.0
    sqnr_db: float = float("inf")
    worst_block: tuple | None = None
    precision: str = "exact"


SUM_ROW = 1 << 14
"""Row length of :func:`sum_of_squares`' fixed summation order (a power of two)."""


def _sum_row(n: int) -> int:
    """The row length of a fixed-order sum of ``n >= 1`` terms: the power of two at least ``n``, at most
    :data:`SUM_ROW`."""
    return min(SUM_ROW, 1 << max(0, (n - 1).bit_length()))


def _halve_rows(b) -> None:
    """Row sums into column 0 of the 2-D array ``b`` (NumPy, or a torch tensor: the same operations), whose
    row length is a power of two: ``b[:, :h] += b[:, h:2h]`` for ``h`` = half the row, a quarter, ..., 1."""
    h = b.shape[1] // 2
    while h:
        b[:, :h] += b[:, h:2 * h]
        h //= 2


def sum_of_squares(v: np.ndarray) -> float:
    """``sum(v * v)`` over the float64 array ``v`` (any shape, C order), in a fixed order that any IEEE 754
    implementation reproduces bit for bit: the report's ``||x||^2`` and ``||err||^2``.

    Each square is one correctly rounded product; the squares, zero-padded to whole rows of
    ``r = _sum_row(n)`` elements (a power of two, at most :data:`SUM_ROW`), are summed within each row by
    halving (element ``i`` plus element ``i + r/2``, then ``i + r/4``, ...: a pairwise tree), and the row
    sums, as a new sequence, the same way, until one number is left. Every step is an elementwise IEEE
    addition, so the device report (:func:`moeref.quant.device_report.device_sum_of_squares`, torch on a
    GPU or the CPU) gives the same float64 as this one, where a BLAS ``dot`` (the order of its SIMD lanes
    and blocks) would not. The pairwise tree's error bound is ``log2(n) * eps`` relative (Higham,
    *Accuracy and Stability of Numerical Algorithms*, section 4.2). Squares are computed a block of rows
    at a time, so the host reads ``v`` once. Zero for an empty ``v``; NaN or Inf when a square is (or the
    sum overflows)."""
    a = np.asarray(v, np.float64).reshape(-1)
    square = True
    while True:
        n = a.size
        if n == 0:
            return 0.0
        if n == 1 and not square:
            return float(a[0])
        r = _sum_row(n)
        rows = -(-n // r)
        sums = np.empty(rows, np.float64)
        per = max(1, (1 << 18) // r)  # 256 Ki elements (2 MB, in cache) at a time
        buf = np.empty((min(per, rows), r), np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            for r0 in range(0, rows, per):
                r1 = min(rows, r0 + per)
                b = buf[: r1 - r0]
                flat = b.reshape(-1)
                e0, e1 = r0 * r, min(n, r1 * r)
                if square:
                    np.multiply(a[e0:e1], a[e0:e1], out=flat[: e1 - e0])
                else:
                    flat[: e1 - e0] = a[e0:e1]
                flat[e1 - e0:] = 0.0
                _halve_rows(b)
                sums[r0:r1] = b[:, 0]
        a, square = sums, False


@dataclass(frozen=True)
class ReportSums:
    """The array part of a report, as host numbers (what the host and the device report compute alike).

    ``lossless``: no element of the error is nonzero (NaN counts); ``hi``/``lo``: max/min of the finite
    errors (non-finite ones as 0); ``flat``: C-order index of the first element of largest ``|error|``
    (``argmax`` where ``hi >= -lo``, else ``argmin``); ``e2``/``x2``: :func:`sum_of_squares` of the finite
    errors and of the source values there (of all elements when both sums are finite)."""

    lossless: bool
    hi: float
    lo: float
    flat: int
    e2: float
    x2: float


def report_from_sums(sums: ReportSums, error, shape: tuple, block: tuple, method: str,
                     precision: str) -> RequantReport:
    """The :class:`RequantReport` of ``sums`` (scalar arithmetic on host floats only, shared by the host
    and the device report, so the two give the same figures): ``max_abs_error = max(hi, -lo)`` (+0.0 for
    a zero), ``worst_block`` from ``flat`` on the grid of ``block``, ``rel_l2 = sqrt(e2 / x2)``,
    ``sqnr_db = 10 log10(x2 / e2)``."""
    mx, rel, sqnr, worst = 0.0, 0.0, float("inf"), None
    if not sums.lossless:
        hi, lo, e2, x2 = sums.hi, sums.lo, sums.e2, sums.x2
        mx = max(hi, -lo) + 0.0  # +0.0 whatever the sign of a zero maximum
        pos = np.unravel_index(sums.flat, shape)
        nl = len(shape) - len(block)
        worst = tuple(int(p) for p in pos[:nl]) + tuple(
            int(p) // b for p, b in zip(pos[nl:], block))
        rel = float(np.sqrt(e2 / x2)) if x2 > 0 else float("inf")
        sqnr = float(10 * np.log10(x2 / e2)) if e2 > 0 and x2 > 0 else float("inf")
    return RequantReport(lossless=bool(sums.lossless), max_abs_error=mx, error=error, method=method,
                         rel_l2=rel, sqnr_db=sqnr, worst_block=worst, precision=precision)


def _report(target: QuantizedTensor, x: np.ndarray, method: str, precision: str = "exact") -> RequantReport:
    err = target.dequantize(np.float64)  # y, then y - x in place
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(err, x, out=err)
        x2 = sum_of_squares(x)
        e2 = sum_of_squares(err)
    allfin = np.isfinite(x2) and np.isfinite(e2)  # a NaN/Inf anywhere makes a sum non-finite
    if not allfin:
        y = err + x
        both_nan = np.isnan(x) & np.isnan(y)
        err = np.where(both_nan | (np.isinf(x) & (x == y)), 0.0, err)
        fin = np.isfinite(err)
        ef, xf = err[fin], np.where(fin, x, 0.0)[fin]
        with np.errstate(invalid="ignore", over="ignore"):
            e2, x2 = sum_of_squares(ef), sum_of_squares(xf)
    lossless = not np.any(err)  # NaN counts as an error
    hi = lo = 0.0
    flat = 0
    if not lossless:
        ef = err if allfin else np.where(np.isfinite(err), err, 0.0)
        hi, lo = float(ef.max()), float(ef.min())
        flat = int(np.argmax(ef)) if hi >= -lo else int(np.argmin(ef))  # first largest |err|
    err.setflags(write=False)
    return report_from_sums(ReportSums(bool(lossless), hi, lo, flat, float(e2), float(x2)), err,
                            tuple(err.shape), tuple(target.block_shape), method, precision)


PRECISIONS = ("exact", "float32")


def requantize(q: QuantizedTensor, target: Scheme, *, prefer_exact: bool = True,
               precision: str = "exact", quantizer: Callable | None = None, global_scale=None):
    """Convert ``q`` to ``target`` by requantizing the DATA: exact dequantization, then quantization.

    Rounding a scale without re-encoding the data shipped two silently wrong checkpoints
    (huggingface/transformers#47030, sgl-project/sglang PR #28307); this never does
    that. ``precision`` says what the target's rule runs on:

    * ``"exact"`` (default): the exact source values, as float32 when every value is a float32
      (so the anchors' float32 arithmetic applies), float64 otherwise.
    * ``"float32"``: the source dequantized to float32 (one RNE rounding of the exact product),
      which is what the producing libraries do before they requantize a checkpoint: vLLM
      ``requant_weight_ue8m0`` (``weight.float() * scale``), DeepSeek ``fp8_cast_bf16.py``,
      compressed-tensors ``FP8BlockDequantizer``. Identical to ``"exact"`` whenever the source
      values are float32 (MX, UE8M0 and power-of-two scales; FP8 with FP32 scales usually not).

    The report always measures against the exact source values. When the rule's result is lossy
    and ``prefer_exact``, two further candidates are tried and used only if exact: the source
    block scales re-expressed in the target (target blocks nested in source blocks; MXFP4 ->
    NVFP4 is lossless this way whenever the exponents of the nonzero blocks span at most 17
    binades, UE4M3 holds 2^-9 .. 2^8), then :func:`moeref.quant.lossless.find_lossless`, which
    finds a lossless encoding whenever the target can hold the values (its docstring says how).

    ``quantizer(values, target) -> QuantizedTensor`` replaces :func:`quantize` for the rule step
    (the checkpoint converter passes the Triton fast path there, which is bit-identical).

    ``global_scale`` (NVFP4 targets): a static global scale in the target preset's convention
    (:func:`moeref.quant.nvfp4.quantize_nvfp4`), given to the rule; the lossless candidates then
    keep the global factor the rule used, so tensors that must share one (ModelOpt's fused
    gate/up and q/k/v) still do.

    Returns:
        ``(QuantizedTensor, RequantReport)``.
    """
    from .._checks import check_choice

    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor; got {type(q).__name__}")
    if not isinstance(target, Scheme):
        raise TypeError(f"target must be a Scheme; got {type(target).__name__}")
    check_choice(precision, PRECISIONS, "requantize precision")
    x = q.dequantize(np.float64)
    if precision == "float32":
        with np.errstate(invalid="ignore", over="ignore"):
            src = x.astype(np.float32)  # one RNE rounding of the exact value = dequantize(float32)
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            x32 = x.astype(np.float32)
            src = x32 if np.array_equal(x32.astype(np.float64), x, equal_nan=True) else x
    return _requantize_values(x, src, target, q, prefer_exact, precision, quantizer, global_scale)


def quantize_and_report(x, target: Scheme, *, prefer_exact: bool = True,
                        quantizer: Callable | None = None, global_scale=None):
    """Quantize float values ``x`` (float16/bfloat16/float32/float64) with ``target`` and report
    against ``x`` exactly, as :func:`requantize` does for a quantized source (same report, same
    lossless search). Returns ``(QuantizedTensor, RequantReport)``."""
    from .blockwise import as_input

    xa = as_input(x)
    src = xa if xa.dtype in (np.float32, np.float64) else xa.astype(np.float32)
    return _requantize_values(xa.astype(np.float64), src, target, None, prefer_exact, "exact",
                              quantizer, global_scale)


def _requantize_values(x, src, target, q, prefer_exact, precision, quantizer, global_scale=None):
    if global_scale is not None:
        if target.family != "nvfp4":
            raise ValueError(f"global_scale is for NVFP4 targets; got scheme {target.name!r}")
        first = (quantizer or quantize)(src, target, global_scale=global_scale)
    else:
        first = (quantizer or quantize)(src, target)
    fixed = first.global_scale if global_scale is not None else None
    rep = _report(first, x, "rule", precision)
    if rep.lossless or not prefer_exact:
        return first, rep
    if not sample_blocks_representable(x, target):
        return first, rep  # a few blocks already have no exact encoding: neither candidate can be
    alt = _exact_rescale(q, x, target, fixed) if q is not None else None
    if alt is not None:
        rep2 = _report(alt, x, "exact_rescale", precision)
        if rep2.lossless:
            return alt, rep2
    alt = find_lossless(x, target, fixed)
    if alt is not None:
        rep3 = _report(alt, x, "lossless_search", precision)
        if rep3.lossless:
            return alt, rep3
    return first, rep


def _exact_rescale(q: QuantizedTensor, x: np.ndarray, target: Scheme, fixed_global=None):
    """Candidate for :func:`requantize` that reuses the source block scales (None if impossible)."""
    if target.family not in ("blockwise", "nvfp4") or target.zero_point or target.channel_block:
        return None
    try:
        tb = target.resolve_block(q.shape)
    except ValueError:
        return None
    sb = q.block_shape
    kk = max(len(tb), len(sb))
    tb = (1,) * (kk - len(tb)) + tuple(tb)  # unblocked leading axes are blocks of 1
    sb = (1,) * (kk - len(sb)) + tuple(sb)
    if any(s % t for s, t in zip(sb, tb)):
        return None  # a target block would straddle two source blocks
    cand = q.scale_values()  # grid ndim == tensor ndim for every scheme
    nl = len(q.shape) - kk
    for i in range(kk):
        n_t = -(-q.shape[nl + i] // tb[i])
        idx = (np.arange(n_t) * tb[i]) // sb[i]
        cand = np.take(cand, idx, axis=nl + i)
    # an all-zero target block decodes to zeros under any scale: give it the largest live one
    tblock = target.resolve_block(q.shape)
    with np.errstate(invalid="ignore"):
        zero_blk = block_amax(block_view(x, tblock), len(tblock)) == 0
    live = ~zero_blk
    if live.any():
        cand = np.where(zero_blk, np.max(np.where(live, cand, -np.inf)), cand)
    else:
        cand = np.ones_like(cand)
    if not np.all(np.isfinite(cand)) or np.any(cand <= 0):
        return None
    fmt = target.scale_format
    glob = None
    if fmt == "fp32":
        stored = cand.astype(np.float32)
        if not np.array_equal(stored.astype(np.float64), cand):
            return None
        per_block = cand
    else:
        name = "e8m0" if fmt == "ue8m0" else "ue4m3"
        base = cand
        if target.global_scale and fixed_global is not None:
            glob = float(fixed_global)
            if glob <= 0:
                return None
            base = cand / glob
        elif target.global_scale:
            top = float(cand.max())
            m, e = np.frexp(top)
            glob = float(np.ldexp(1.0, int(e) - 1 - 8)) if m == 0.5 else top / 448.0
            if not global_storable(glob, target):
                return None
            base = cand / glob
        stored = encode(base, name, overflow="saturate", rounding="rne")
        if not np.array_equal(decode_table(name)[stored] * (glob or 1.0), cand):
            return None
        per_block = cand
    sv = expand_to_elements(per_block, target.resolve_block(q.shape), q.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = x / sv
    from .blockwise import encode_elements
    el = target.element_format
    try:
        codes = encode_elements(y, el, target.preset)
    except ValueError:
        return None
    from ..formats import pack_nibbles
    if el.bits == 4:
        if q.shape[-1] % 2:
            codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
        codes = pack_nibbles(codes)
    return QuantizedTensor(codes=codes, scales=stored, scheme=target, shape=q.shape, global_scale=glob)
