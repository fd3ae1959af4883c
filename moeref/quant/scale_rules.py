"""Every block-scale rule in one place: block amax (and min/max) -> stored scale, decode multiplier,
and the factor the data are scaled by before the element cast.

The rules reproduce the anchors' arithmetic operation by operation, in their precision: the
working dtype is float32 for float16/bfloat16/float32 input (every anchor computes scales in
float32) and float64 for float64 input (no anchor takes float64; that mode exists so that
``quantize(dequantize(q, float64))`` sees exact values). Powers of two (E8M0) are read from the
exponent bits through the codec's ``floor``/``ceil`` modes (:func:`moeref.formats.encode`),
never with ``log2`` (``2**ceil(log2(x))`` is not bit-exact: sgl-project/sglang#29954, fixed the
same way in DeepGEMM commit 7f2a703).

A rule is a function ``rule(amax, ctx) -> ScaleResult``; :func:`compute_scales` picks the rule
from the scheme's scale format and preset, then applies the zero-block and non-finite policies
(:func:`finalize_scales`). Families with their own scale pipeline (NVFP4) pass their own rule to
:func:`moeref.quant.blockwise.quantize_blockwise` and reuse :func:`finalize_scales`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..formats import decode_table, encode, get_format
from ..formats.spec import ElementFormat
from .scheme import Preset, Scheme

__all__ = [
    "RuleContext",
    "ScaleResult",
    "element_max",
    "element_emax",
    "compute_scales",
    "finalize_scales",
    "fp32_scales",
    "e8m0_scales",
    "e8m0_codes_from_amax",
    "FLT_MAX",
]

FLT_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class RuleContext:
    """What a rule may read besides the amax grid.

    Attributes:
        scheme, preset: the scheme being quantized and its preset.
        element: the element format.
        work: working float dtype (float32 or float64).
        bmin, bmax: signed block min / max grids (only when the rule asked for them).
        static_scale: fixed decode scale, or None.
    """

    scheme: Scheme
    preset: Preset
    element: ElementFormat
    work: np.dtype
    bmin: np.ndarray | None = None
    bmax: np.ndarray | None = None
    static_scale: float | None = None


@dataclass(frozen=True)
class ScaleResult:
    """Output of a scale rule, all on the block grid.

    Attributes:
        stored: what the tensor stores: float32 decode scales (``"fp32"``) or uint8 codes.
        decode: float64 decode multiplier of each block (global factor NOT included).
        factor: array in the working dtype the data are multiplied by (``op="mul"``) or divided
            by (``op="div"``) before the element cast.
        op: ``"mul"`` or ``"div"``.
        global_scale: per-tensor decode factor (two-level schemes), or None.
        zero_point: integer zero points on the grid (asymmetric integers), or None: the data
            are then cast as ``clamp(round(x / s) + zp, 0, qmax)`` (GPTQ order).
        extra: further :class:`~moeref.quant.tensor.QuantizedTensor` fields
            (``channel_scales``).
    """

    stored: np.ndarray
    decode: np.ndarray
    factor: np.ndarray
    op: str
    global_scale: float | None = None
    zero_point: np.ndarray | None = None
    extra: dict = field(default_factory=dict)


def element_max(element: ElementFormat, preset: Preset) -> float:
    """``M``: the element value the block amax maps to (format max, or the preset's override)."""
    return float(preset.element_max) if preset.element_max is not None else element.max_finite


def element_emax(element: ElementFormat) -> int:
    """Exponent of the element's largest normal binade (E4M3 8, E5M2 15, E2M3 2, E3M2 4, E2M1 2;
    torchao ``constants.py`` ``*_MAX_POW2``)."""
    return int(np.frexp(element.max_finite)[1]) - 1


# ---- FP32 scales -----------------------------------------------------------------------------

def fp32_scales(amax: np.ndarray, ctx: RuleContext) -> ScaleResult:
    """FP32 scale rules (``Preset.fp32_rule``); see :class:`~moeref.quant.scheme.Preset`."""
    p, w = ctx.preset, ctx.work
    M = w.type(element_max(ctx.element, p))
    a = amax.astype(w, copy=False)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if ctx.static_scale is not None:
            dec = np.full(a.shape, np.float32(ctx.static_scale), np.float32)
            return _fp32_apply(dec, None, p, w)
        if p.fp32_rule == "amax_over_max":
            dec = (a / M).astype(np.float32)
            enc = None
        elif p.fp32_rule == "amax_times_recip_max":
            dec = (a.astype(np.float32) * np.float32(1.0 / np.float32(M))).astype(np.float32)
            enc = None
        elif p.fp32_rule == "signed_minmax":
            qmax = w.type(ctx.element.max_finite)
            qmin = w.type(ctx.element.min_value)
            dec = np.maximum(np.abs(ctx.bmax.astype(w) / qmax), np.abs(ctx.bmin.astype(w) / qmin))
            dec = dec.astype(np.float32)
            enc = None
        elif p.fp32_rule == "deepep":
            a32 = a.astype(np.float32)
            dec = (a32 * np.float32(1.0 / np.float32(M))).astype(np.float32)
            enc = (np.float32(M) / a32).astype(w)
        elif p.fp32_rule == "encode_decode_pair":
            dec = (a / M).astype(np.float32)
            enc = (M / a).astype(w)
        else:  # "te": TransformerEngine compute_scale_from_amax (float32)
            a32 = a.astype(np.float32)
            e = np.float32(M) / a32
            e = np.where(np.isinf(e), np.float32(FLT_MAX), e).astype(np.float32)
            e = np.where((a32 == 0) | np.isinf(a32), np.float32(1.0), e).astype(np.float32)
            if p.fp32_pow2:
                e = (e.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
            dec = (np.float32(1.0) / e).astype(np.float32)
            enc = e.astype(w)
        if p.fp32_pow2 and p.fp32_rule != "te":
            # round the decode scale UP to a power of two (same as the encode scale down)
            dec = _pow2_ceil32(dec)
            enc = None
    return _fp32_apply(dec, enc, p, w)


def _pow2_ceil32(s: np.ndarray) -> np.ndarray:
    code = encode(s.astype(np.float32), "e8m0", rounding="ceil", overflow="saturate")
    return decode_table("e8m0")[code].astype(np.float32)


def _fp32_apply(dec32: np.ndarray, enc, p: Preset, w: np.dtype) -> ScaleResult:
    d = dec32.astype(w)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if p.apply == "div":
            factor, op = d, "div"
        elif p.apply == "mul_encode" and enc is not None:
            factor, op = enc, "mul"
        else:  # mul_recip (and mul_encode for rules with no separate encode factor)
            factor, op = (w.type(1.0) / d).astype(w), "mul"
    return ScaleResult(stored=dec32, decode=dec32.astype(np.float64), factor=factor, op=op)


# ---- UE8M0 scales ----------------------------------------------------------------------------

def e8m0_codes_from_amax(amax: np.ndarray, ctx: RuleContext) -> np.ndarray:
    """Biased UE8M0 bytes (uint8) for each block amax under ``Preset.e8m0_rule``.

    Finite blocks are clamped to ``Preset.e8m0_clamp``; blocks whose amax is Inf/NaN get the
    byte ``Preset.e8m0_nonfinite`` says (0xFF, satfinite, or the clamp's upper bound).
    """
    p, w = ctx.preset, ctx.work
    rule = p.e8m0_rule
    a = amax.astype(w, copy=False)
    nonfinite = ~np.isfinite(a)
    with np.errstate(invalid="ignore", over="ignore"):
        if rule in ("floor", "ceil", "even"):
            emax = element_emax(ctx.element)
            src = np.where(nonfinite, w.type(0), a)
            if rule == "even":
                # torchao EVEN: (bits + 2^(22-mbits)) & 0xFF800000 on the float32 amax
                bits = src.astype(np.float32).view(np.uint32)
                bits = (bits + np.uint32(1 << (22 - ctx.element.man_bits))) & np.uint32(0xFF800000)
                src = bits.view(np.float32)
                nonfinite = nonfinite | ~np.isfinite(src)  # rounded past FLT_MAX: torchao -> 0xFF
                src = np.where(np.isfinite(src), src, np.float32(0))
            fl = encode(src, "e8m0", rounding="floor", overflow="saturate").astype(np.int32)
            if rule == "ceil":
                fl = fl + (decode_table("e8m0")[fl] != src.astype(np.float64))
            code = fl - emax
        else:
            M = w.type(element_max(ctx.element, p))
            if rule == "rceil":
                descale = a * w.type(1.0 / float(M))
            else:  # ceil_div
                descale = a / M
            src = np.where(nonfinite, w.type(0), descale)
            code = encode(src, "e8m0", rounding="ceil", overflow="saturate").astype(np.int32)
            # a finite amax whose descale overflows float (cannot happen for M >= 1) is Inf-like
        lo, hi = p.e8m0_clamp
        code = np.clip(code, lo, hi)
        if nonfinite.any():
            if p.e8m0_nonfinite == "nan":
                bad = np.int32(0xFF)
                code = np.where(nonfinite, bad, code)
            elif p.e8m0_nonfinite == "satfinite":
                code = np.where(np.isnan(a), 0xFF, np.where(nonfinite, 0xFE, code))
            else:  # clamp: exponent 255 (+1) clamped to hi (DeepGEMM ceil_to_ue8m0)
                code = np.where(nonfinite, hi, code)
    return code.astype(np.uint8)


def e8m0_scales(amax: np.ndarray, ctx: RuleContext) -> ScaleResult:
    """UE8M0 scale rule: bytes from :func:`e8m0_codes_from_amax` (or a static power of two).

    The data are scaled by the exact reciprocal ``2^-k`` (``mul_recip``; torchao builds 2^127's
    reciprocal as the FP32 subnormal 2^-127) or divided by ``2^k`` (``div``); both are exact
    except where the quotient is an FP32 subnormal, where float32 rounds as the anchors do.
    """
    p, w = ctx.preset, ctx.work
    if ctx.static_scale is not None:
        k = int(np.frexp(ctx.static_scale)[1]) - 1
        codes = np.full(amax.shape, k + 127, np.uint8)
    else:
        codes = e8m0_codes_from_amax(amax, ctx)
    dec = decode_table("e8m0")[codes]
    with np.errstate(divide="ignore", invalid="ignore"):
        if p.apply == "div":
            factor, op = dec.astype(w), "div"
        else:
            factor, op = (1.0 / dec).astype(w), "mul"
    return ScaleResult(stored=codes, decode=dec, factor=factor, op=op)


# ---- dispatch and policies -------------------------------------------------------------------

def compute_scales(amax: np.ndarray, ctx: RuleContext) -> ScaleResult:
    """Scale rule for ``ctx.scheme.scale_format`` (FP32 or UE8M0), then :func:`finalize_scales`.

    UE4M3 scales belong to two-level schemes (NVFP4) whose module supplies its own rule.
    """
    fmt = ctx.scheme.scale_format
    if fmt == "fp32":
        res = fp32_scales(amax, ctx)
    elif fmt == "ue8m0":
        res = e8m0_scales(amax, ctx)
    else:
        raise ValueError(
            f"scheme {ctx.scheme.name!r}: scale_format {fmt!r} needs its family's own rule "
            "(NVFP4: moeref.quant.nvfp4); the generic rules cover 'fp32' and 'ue8m0'"
        )
    return finalize_scales(res, amax, ctx)


def finalize_scales(res: ScaleResult, amax: np.ndarray, ctx: RuleContext) -> ScaleResult:
    """Apply ``Preset.zero_block`` and ``Preset.nonfinite='nan_block'`` to a rule's result.

    * an FP32 decode scale that underflows to 0 for a nonzero block becomes 2^-149.
    * zero blocks (amax == 0 after the floor): ``"one"`` -> scale 1.0 (UE8M0 byte 127),
      ``"zero"`` -> scale 0 (FP32/UE4M3 only; data factor 0 so codes are 0), ``"rule"`` -> as
      computed; if the rule's factor is not finite there (``0 * Inf``), it is replaced by 0
      (multiply) or 1 (divide) so the block's codes are signed zeros, as TE/FlashInfer's
      ``1/0 := 0`` does.
    * ``nan_block``: a block whose amax is NaN/Inf gets a NaN scale (FP32 NaN, 0xFF, 0x7F).
    """
    p = ctx.preset
    fmt = ctx.scheme.scale_format
    stored, dec, factor = res.stored, res.decode, res.factor
    zero = amax == 0
    if ctx.static_scale is None and zero.any():
        if p.zero_block == "one":
            one_code = {"fp32": np.float32(1.0), "ue8m0": 127, "ue4m3": 0x38}[fmt]
            stored = np.where(zero, one_code, stored).astype(stored.dtype)
            dec = np.where(zero, 1.0, dec)
            factor = np.where(zero, factor.dtype.type(1.0), factor)
        elif p.zero_block == "zero":
            if fmt == "ue8m0":
                raise ValueError("Preset.zero_block='zero' is impossible with UE8M0 scales (no zero)")
            stored = np.where(zero, 0, stored).astype(stored.dtype)
            dec = np.where(zero, 0.0, dec)
            factor = np.where(zero, factor.dtype.type(0.0 if res.op == "mul" else 1.0), factor)
        else:
            bad = zero & ~np.isfinite(factor) | zero & (factor == 0) & (res.op == "div")
            if bad.any():
                factor = np.where(bad, factor.dtype.type(0.0 if res.op == "mul" else 1.0), factor)
    if fmt == "fp32" and ctx.static_scale is None:
        # amax / M can underflow float32 to 0 for a nonzero FP32-subnormal amax (no anchored
        # preset gets there: DeepGEMM and vLLM floor the amax, TE's 1/FLT_MAX is > 0); a zero
        # scale would turn the block's zeros into 0/0 = NaN, so use the smallest subnormal
        under = (dec == 0) & (amax > 0) & np.isfinite(amax)
        if under.any():
            tiny = np.float32(2.0 ** -149)
            stored = np.where(under, tiny, stored).astype(stored.dtype)
            dec = np.where(under, float(tiny), dec)
            if res.op == "div":
                factor = np.where(under, factor.dtype.type(tiny), factor)
            elif p.apply == "mul_recip":  # 2^149 is not a float32: scale those blocks in float64
                factor = np.where(under, 2.0 ** 149, factor.astype(np.float64))
    if p.nonfinite == "nan_block":
        nf = ~np.isfinite(amax)
        if nf.any():
            nan_code = {"fp32": np.float32(np.nan), "ue8m0": 0xFF, "ue4m3": 0x7F}[fmt]
            stored = np.where(nf, nan_code, stored).astype(stored.dtype)
            dec = np.where(nf, np.nan, dec)
            factor = np.where(nf, factor.dtype.type(np.nan), factor)
    return replace(res, stored=stored, decode=dec, factor=factor)
