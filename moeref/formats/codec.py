"""Bit-exact encode/decode for every element format, through one generic minifloat codec.

``encode`` maps real numbers to codes (``uint8`` bit patterns) and ``decode`` maps codes back to
float32/float64. One algorithm serves every format in :data:`moeref.formats.FORMATS`; formats
differ only in their :class:`~moeref.formats.spec.ElementFormat` fields.

Algorithm (exact; no ``log2``): the input is widened to float64 (exact for float16, bfloat16 and
float32). ``frexp`` reads the binary exponent ``e`` from the bits, the exponent is clamped below
to the format's smallest normal exponent (which is how subnormals arise), and the magnitude is
scaled by the power of two ``2**(man_bits - e)`` (exact) so that its integer part ``n`` is the
truncated significand and ``frac = scaled - n`` (exact) is what is left over. The rounding mode
decides from ``n``, ``frac`` and the sign whether to add one ulp; a carry out of the significand
moves to the next binade. Because ``frac`` is exact, a value one float32 ulp above a midpoint
rounds up (the sticky-bit bug tt-metal#51971 shipped cannot occur).

Rounding modes (``rounding=``):

``"rne"``               round to nearest, ties to even (IEEE/OCP/PTX ``cvt.rn``; the default).
``"rtz"``               toward zero (truncate).
``"ties_toward_zero"``  nearest, ties toward zero: DeepGEMM's torch FP4 helper counts
                        ``|x| > boundary`` (deep_gemm/utils/math.py ``_quantize_to_fp4_e2m1``).
``"ties_away"``         nearest, ties away from zero: microxcaling's default ``"nearest"``.
``"ceil"``              toward +Inf (E8M0 scale rules: RCEIL, ``ceil_to_ue8m0``).
``"floor"``             toward -Inf (OCP MX §6.3 FLOOR scale rule).
``"stochastic"``        up with probability ``frac``: up iff ``frac + rbits / 2**R >= 1`` where
                        ``rbits`` are caller-supplied unsigned random integers of R bits (the
                        array's dtype width: uint8 gives TransformerEngine's FP4 gradient recipe,
                        ``u = (rbits & 0xFF) / 256; floor((|x| + u*step) / step)``).

Overflow (``overflow=``, required, because the field disagrees; docs/formats.md tabulates who does what):

``"saturate"``  finite overflow and ±Inf go to ±max finite (PTX ``satfinite``, Triton, torch >= 2.13
                for E4M3FN, OFP8 saturating mode). For E8M0 it also clamps underflow to 0x00.
``"inf_nan"``   OFP8 non-saturating mode: overflow and ±Inf give Inf (E5M2) or NaN (E4M3FN, FNUZ,
                E8M0), as ml_dtypes and torch <= 2.12 do. Refused for formats that have neither
                (E2M1, FP6): there is nothing to overflow to.
``"error"``     raise ``ValueError`` naming the first element that does not fit.

Overflow is decided on the value rounded with an unbounded exponent range (the OFP8 rule): in
E4M3FN, 464 rounds to 448 (a tie, to even) and is finite; 465 rounds to 480 and overflows.

Special inputs:

* NaN: formats with a NaN give their canonical NaN, keeping the sign where the format has a
  sign and more than one NaN (E5M2 0x7E/0xFE, E4M3FN 0x7F/0xFF), 0x80 for FNUZ, 0xFF for E8M0.
  Formats with no NaN (E2M1, FP6, integers) raise ``ValueError`` unless ``nan_code=`` says which
  code to write: the anchors disagree (ml_dtypes 0x8 = -0, torchao 0x3, TE reference 0x0, PTX
  ``cvt`` +6 = 0x7), so moeref refuses to guess. Block quantizers handle NaN at the block level.
* -0.0 and negative values that round to zero keep the sign bit (E4M3FN 0x80, E2M1 0x8), except
  FNUZ formats, which have no -0 (0x80 is their NaN): they give 0x00.
* Unsigned float formats (E8M0, UE4M3) refuse negative inputs (``ValueError``); -0.0 is zero.
  UINT8/UINT4 treat a negative input like any integer out of range: ``"saturate"`` clamps it to 0
  (what a zero-point quantizer's ``clamp(q, 0, 2**b - 1)`` does), ``"error"`` raises.
  E8M0 has no zero: 0 and values that round below 2^-127 give 0x00 under ``"saturate"`` (as torch's
  cast and the [-127, 127] clamp of OCP/gfloat do) and raise otherwise.
* Subnormal inputs are ordinary numbers; subnormal results are exact.
* Integers (INT8/INT4, UINT8/UINT4) round with the same modes and have no Inf/NaN; codes are the
  two's complement bit pattern (INT4 -1 is 0xF).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import ml_dtypes

from .._checks import as_float_array, check_choice
from .. import _interop
from .spec import ElementFormat, get_format

__all__ = [
    "ROUNDING_MODES",
    "OVERFLOW_MODES",
    "encode",
    "decode",
    "decode_table",
    "round_to_format",
    "representable_values",
    "code_table_f32",
]

ROUNDING_MODES = ("rne", "rtz", "ties_toward_zero", "ties_away", "ceil", "floor", "stochastic")
OVERFLOW_MODES = ("saturate", "inf_nan", "error")

# Markers the generic path writes where a code cannot be produced; turned into errors at the end.
_OVERFLOW, _NAN, _NEGATIVE = -1, -2, -3


def _round_up(n, frac, negative, rounding, rbits):
    """Whether to add one unit to the truncated magnitude ``n`` (float64 integers)."""
    if rounding == "rne":
        return (frac > 0.5) | ((frac == 0.5) & (np.fmod(n, 2.0) == 1.0))
    if rounding == "rtz":
        return np.zeros(n.shape, dtype=bool)
    if rounding == "ties_toward_zero":
        return frac > 0.5
    if rounding == "ties_away":
        return frac >= 0.5
    if rounding == "ceil":
        return (frac > 0) & ~negative
    if rounding == "floor":
        return (frac > 0) & negative
    # stochastic: up iff frac + rbits * 2^-R >= 1 (both sides exact in float64)
    width = rbits.dtype.itemsize * 8
    return frac >= 1.0 - np.ldexp(rbits.astype(np.float64), -width)


def _encode_float64(x: np.ndarray, f: ElementFormat, rounding: str, overflow: str,
                    nan_code, rbits) -> np.ndarray:
    """Generic path: float64 array -> int16 codes with negative markers for errors."""
    negative = np.signbit(x)
    a = np.abs(x)
    isnan = np.isnan(x)
    isinf = np.isinf(x)
    finite = ~(isnan | isinf)
    a = np.where(finite, a, 0.0)

    if f.kind == "int":
        n = np.floor(a)
        mag = n + _round_up(n, a - n, negative, rounding, rbits)
        val = np.where(negative, -mag, mag)
        lo, hi = f.min_value, f.max_finite
        over = (val > hi) | (val < lo) | isinf
        val = np.clip(val, lo, hi)
        code = val.astype(np.int64) & (f.num_codes - 1)
        code = code.astype(np.int16)
        if overflow == "saturate":
            code = np.where(isinf, np.where(negative, int(lo) & (f.num_codes - 1), int(hi)), code)
        else:  # integers have no Inf: inf_nan is refused earlier, error marks
            code = np.where(over, _OVERFLOW, code)
        code = np.where(isnan, _NAN if nan_code is None else nan_code, code)
        return code.astype(np.int16)

    M = f.man_bits
    _, e = np.frexp(a)
    eff = np.maximum(e.astype(np.int32) - 1, f.emin)
    scaled = np.ldexp(a, (M - eff).astype(np.int32))  # exact: multiply by a power of two
    n = np.floor(scaled)
    mant = n + _round_up(n, scaled - n, negative, rounding, rbits)
    carry = mant >= float(1 << (M + 1))
    mant = np.where(carry, mant * 0.5, mant)
    eff = eff + carry
    mant_i = mant.astype(np.int32)
    normal = mant_i >= (1 << M)
    man_field = mant_i - (1 << M)
    over = (eff > f.emax) | ((eff == f.emax) & normal & (man_field > f.max_man_at_emax))
    code = np.where(normal, ((eff + f.bias) << M) | man_field, mant_i)

    sign_bits = f.sign_mask
    if f.specials == "e8m0":
        under = finite & ~normal  # rounds to zero: E8M0 has no zero
        code = np.where(under, 0 if overflow == "saturate" else _OVERFLOW, code)
    # overflow and infinities
    if overflow == "saturate":
        big = np.int32(f.max_code)
    elif overflow == "inf_nan":
        big = np.int32(f.inf_code if f.has_inf else f.nan_code)
    else:
        big = np.int32(_OVERFLOW)
    code = np.where(over | isinf, big, code)
    # sign
    if f.signed:
        keep_zero_unsigned = f.specials == "fnuz"
        apply_sign = negative & (code >= 0)
        if keep_zero_unsigned:
            apply_sign &= code != 0
            # FNUZ NaN (0x80) carries no sign
            apply_sign &= ~((over | isinf) & (overflow == "inf_nan"))
        code = np.where(apply_sign, code | sign_bits, code)
    else:
        code = np.where(negative & (x < 0), _NEGATIVE, code)  # -0.0 is zero
    # NaN
    if f.has_nan:
        nanc = f.nan_code
        if f.signed and f.specials in ("ieee", "fn"):
            nan_val = np.where(negative, nanc | sign_bits, nanc)
        else:
            nan_val = nanc
        code = np.where(isnan, nan_val, code)
    else:
        code = np.where(isnan, _NAN if nan_code is None else nan_code, code)
    return code.astype(np.int16)


@lru_cache(maxsize=64)
def _table16(fmt_name: str, dtype_name: str, rounding: str, overflow: str, nan_code) -> "_CodeTable":
    """Code table over all 65536 bit patterns of a 16-bit input dtype."""
    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.float16
    with np.errstate(invalid="ignore"):  # NaN patterns widen to NaN, as intended
        allx = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype).astype(np.float64)
    return _CodeTable(_encode_float64(allx, get_format(fmt_name), rounding, overflow, nan_code, None))


@lru_cache(maxsize=64)
def _table32(fmt_name: str, rounding: str, overflow: str, nan_code):
    """Code table for float32 inputs, keyed by the bits that can matter.

    For a target with ``p`` significant bits below the leading one (``man_bits`` for floats,
    ``bits - 1`` for integers), the rounding decision of every deterministic mode depends only on
    the float32 bits down to the round bit of the finest binade, ``22 - p``, and on whether any
    lower bit is set (the sticky bit). So ``key = (bits >> s) << 1 | sticky`` with ``s = 22 - p``
    indexes a table computed once by the generic float64 path on one representative per key
    (lower bits 0 or 1). NaN payloads confined to the sticky region land on a representative that
    is itself NaN, so they are classified correctly too. The tests compare this path with the
    generic one on random and boundary inputs.
    """
    f = get_format(fmt_name)
    p = f.man_bits if f.kind == "float" else f.bits - (1 if f.signed else 0)
    shift = 22 - p
    if f.kind == "float":
        # float32 subnormal inputs: the round bit of the format's smallest quantum, 2^(emin-M-1),
        # sits at bit emin - M - 1 + 149 (E8M0 reaches below float32's normal range).
        shift = min(shift, f.emin - f.man_bits + 148)
    keys = np.arange(1 << (32 - shift + 1), dtype=np.uint64)
    bits = ((keys >> np.uint64(1)) << np.uint64(shift)) | (keys & np.uint64(1))
    with np.errstate(invalid="ignore"):  # NaN patterns widen to NaN, as intended
        reps = bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return shift, _CodeTable(_encode_float64(reps, f, rounding, overflow, nan_code, None))


def code_table_f32(fmt, *, overflow: str, rounding: str = "rne", nan_code=None) -> tuple[int, np.ndarray]:
    """The table :func:`encode` reads float32 input through: ``(shift, codes)``.

    The code of a float32 value with bits ``u`` (as uint32) is ``codes[(u >> shift) << 1 | sticky]``,
    ``sticky = (u & (2**shift - 1)) != 0`` (:func:`_table32` says why those bits decide every
    deterministic rounding); ``codes`` is int16, and a negative entry marks a value the format cannot
    encode under these arguments (``encode`` raises there: a NaN without ``nan_code``, an overflow under
    ``"error"``, a negative value in an unsigned format). Read-only; one table per argument set, built
    once by the generic float64 path. A device engine that looks codes up in it gets :func:`encode`'s
    codes by construction (:mod:`moeref.quant.device`). ``rounding``: any deterministic mode (not
    ``"stochastic"``).
    """
    f = get_format(fmt)
    check_choice(rounding, tuple(m for m in ROUNDING_MODES if m != "stochastic"), "rounding mode")
    check_choice(overflow, OVERFLOW_MODES, "overflow mode")
    if overflow == "inf_nan" and not f.has_nan:
        raise ValueError(f"overflow='inf_nan' is impossible for {f.name}: it has no Inf or NaN")
    shift, table = _table32(f.name, rounding, overflow, None if nan_code is None else int(nan_code))
    codes = table.codes
    codes.setflags(write=False)
    return shift, codes


class _CodeTable:
    """A cached code table: int16 codes with error markers, their uint8 cast, and whether any
    marker is present (so the common case is one uint8 lookup with no extra pass)."""

    def __init__(self, codes: np.ndarray):
        self.codes = codes
        self.u8 = codes.astype(np.uint8)
        self.marked = bool((codes < 0).any())

    def lookup(self, key: np.ndarray, x: np.ndarray, f: ElementFormat, overflow: str) -> np.ndarray:
        if not self.marked:
            return self.u8[key]
        code = self.codes[key]
        _raise_markers(code, x, f, overflow)
        return code.astype(np.uint8)


def _raise_markers(code: np.ndarray, x: np.ndarray, f: ElementFormat, overflow: str) -> None:
    bad = code < 0
    if not bad.any():
        return
    idx = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad.ravel())[0]), code.shape))
    kind = int(code[idx])
    value = float(np.asarray(x)[idx]) if np.asarray(x).ndim else float(x)
    where = f"element {idx} = {value!r}"
    if kind == _OVERFLOW:
        if f.kind == "int":
            raise ValueError(
                f"{where} is outside the range of {f.name} ({int(f.min_value)}..{int(f.max_finite)}) "
                f"and overflow={overflow!r}; pass overflow='saturate' to clamp"
            )
        raise ValueError(
            f"{where} is outside the range of {f.name} (max {f.max_finite}"
            + (f", min {f.min_normal}" if f.specials == "e8m0" else "")
            + f") and overflow={overflow!r}; pass overflow='saturate' to clamp"
            + ("" if not f.has_nan else " or 'inf_nan' for Inf/NaN")
        )
    if kind == _NAN:
        raise ValueError(
            f"{where}: {f.name} has no NaN encoding; pass nan_code=<code> to choose one "
            "(ml_dtypes writes -0, torchao 0x3, TransformerEngine 0x0, PTX cvt +max), "
            "or mask NaN before encoding"
        )
    raise ValueError(f"{where} is negative, but {f.name} is unsigned")


def encode(x, fmt, *, overflow: str, rounding: str = "rne", rbits=None, nan_code=None):
    """Encode real numbers to the codes of an element format.

    Args:
        x: float16/bfloat16/float32/float64 array (NumPy, ml_dtypes, or a torch tensor), any shape.
        fmt: format name (see ``moeref formats``) or :class:`ElementFormat`.
        overflow: ``"saturate"``, ``"inf_nan"`` or ``"error"`` (module docstring); no default,
            because the field disagrees and the choice changes results.
        rounding: one of :data:`ROUNDING_MODES`; default round-to-nearest-even.
        rbits: unsigned random integers of x's shape, required for ``"stochastic"``.
        nan_code: code to write for NaN inputs in formats with no NaN (E2M1, FP6, integers).

    Returns:
        ``uint8`` codes of x's shape (a torch ``uint8`` tensor if x was a torch tensor).

    >>> encode([1.0, 0.75, -3.5, 7.0], "e2m1", overflow="saturate").tolist()
    [2, 2, 14, 7]
    >>> encode([0.75], "e2m1", overflow="saturate", rounding="ties_toward_zero").tolist()
    [1]
    >>> [hex(c) for c in encode([464.0, 465.0], "e4m3fn", overflow="inf_nan")]
    ['0x7e', '0x7f']
    """
    f = get_format(fmt)
    check_choice(rounding, ROUNDING_MODES, "rounding mode")
    check_choice(overflow, OVERFLOW_MODES, "overflow mode")
    if overflow == "inf_nan" and not f.has_nan:
        raise ValueError(
            f"overflow='inf_nan' is impossible for {f.name}: it has no Inf or NaN; "
            "use 'saturate' (what ml_dtypes and PTX satfinite do) or 'error'"
        )
    if nan_code is not None:
        if f.has_nan:
            raise ValueError(f"nan_code is only for formats without NaN; {f.name} has its own NaN")
        if not (0 <= int(nan_code) < f.num_codes):
            raise ValueError(f"nan_code must be a {f.name} code in [0, {f.num_codes}); got {nan_code}")
        nan_code = int(nan_code)
    was_torch = _interop.is_torch_tensor(x)
    xa = as_float_array(x, "x")
    if rounding == "stochastic":
        if rbits is None:
            raise ValueError("rounding='stochastic' needs rbits: unsigned random integers of x's shape")
        rb = _interop.to_numpy(rbits)
        rb = np.asarray(rb)
        if rb.dtype.kind != "u":
            raise TypeError(f"rbits must be an unsigned integer array; got {rb.dtype}")
        try:
            rb = np.broadcast_to(rb, xa.shape)
        except ValueError:
            raise ValueError(f"rbits shape {rb.shape} does not match x shape {xa.shape}") from None
    elif rbits is not None:
        raise ValueError(f"rbits is only used with rounding='stochastic'; got rounding={rounding!r}")
    else:
        rb = None

    if rb is None and xa.dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        table = _table16(f.name, "bfloat16" if xa.dtype != np.float16 else "float16",
                         rounding, overflow, nan_code)
        out = table.lookup(xa.view(np.uint16), xa, f, overflow)
    elif rb is None and xa.dtype == np.float32:
        shift, table = _table32(f.name, rounding, overflow, nan_code)
        u = np.ascontiguousarray(xa).view(np.uint32)
        key = u >> np.uint32(shift)
        key <<= np.uint32(1)
        key |= (u & np.uint32((1 << shift) - 1)) != 0
        out = table.lookup(key, xa, f, overflow).reshape(xa.shape)  # ascontiguousarray makes 0-d 1-d
    else:
        code = _encode_float64(np.asarray(xa, dtype=np.float64), f, rounding, overflow, nan_code, rb)
        _raise_markers(code, xa, f, overflow)
        out = code.astype(np.uint8)
    return _interop.to_torch(out) if was_torch else out


@lru_cache(maxsize=None)
def decode_table(fmt) -> np.ndarray:
    """float64 value of every code of ``fmt`` (read-only), built from the format's fields.

    >>> decode_table("e2m1")[:8].tolist()
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    """
    f = get_format(fmt)
    codes = np.arange(f.num_codes, dtype=np.int64)
    if f.kind == "int":
        vals = codes.astype(np.float64)
        if f.signed:
            vals = np.where(codes >= (f.num_codes >> 1), vals - f.num_codes, vals)
    else:
        mag_code = codes & ~f.sign_mask if f.signed else codes
        M = f.man_bits
        e_field = mag_code >> M
        m_field = mag_code & ((1 << M) - 1)
        if f.specials == "e8m0":
            vals = np.ldexp(1.0, (e_field - f.bias).astype(np.int32))
        else:
            sub = np.ldexp(m_field.astype(np.float64), f.emin - M)
            norm = np.ldexp((m_field + (1 << M)).astype(np.float64), (e_field - f.bias - M).astype(np.int32))
            vals = np.where(e_field == 0, sub, norm)
        if f.signed:
            vals = np.where(codes & f.sign_mask, -vals, vals)
        top = (1 << f.exp_bits) - 1
        if f.specials == "ieee":
            vals = np.where((e_field == top) & (m_field == 0), np.copysign(np.inf, vals), vals)
            vals = np.where((e_field == top) & (m_field != 0), np.copysign(np.nan, vals), vals)
        elif f.specials == "fn":
            vals = np.where(mag_code == f.nan_code, np.copysign(np.nan, vals), vals)
            if not f.signed:  # UE4M3: the sign bit is not part of the format
                pass
        elif f.specials == "fnuz":
            vals = np.where(codes == f.nan_code, np.nan, vals)
        elif f.specials == "e8m0":
            vals = np.where(codes == 0xFF, np.nan, vals)
    vals.setflags(write=False)
    return vals


def decode(codes, fmt, dtype=np.float32):
    """Decode codes of ``fmt`` to float32 (default) or float64.

    Args:
        codes: integer array of codes (any integer dtype) in ``[0, 2**bits)``; packed 4-bit data
            must be unpacked first (:func:`moeref.formats.unpack_nibbles`).
        fmt: format name or :class:`ElementFormat`.
        dtype: ``np.float32`` or ``np.float64``. Every format here is exact in float32.

    >>> decode([0x7E, 0x7F, 0x80, 0x01], "e4m3fn").tolist()
    [448.0, nan, -0.0, 0.001953125]
    >>> decode([0x00, 0x7F, 0x86], "e8m0", np.float64).tolist()
    [5.877471754111438e-39, 1.0, 128.0]
    """
    f = get_format(fmt)
    was_torch = _interop.is_torch_tensor(codes)
    c = np.asarray(_interop.to_numpy(codes))
    if c.dtype.kind not in "iu":
        raise TypeError(f"codes must be an integer array; got {c.dtype}")
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64; got {dtype}")
    if c.size:
        lo, hi = int(c.min()), int(c.max())
        if lo < 0 or hi >= f.num_codes:
            bad = (c < 0) | (c >= f.num_codes)
            idx = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad.ravel())[0]), c.shape))
            raise ValueError(
                f"code {int(c[idx])} at index {idx} is out of range for {f.name} "
                f"({f.bits}-bit codes are 0..{f.num_codes - 1})"
            )
    out = decode_table(f)[c.astype(np.intp)].astype(dtype)
    return _interop.to_torch(out) if was_torch else out


def round_to_format(x, fmt, *, overflow: str, rounding: str = "rne", rbits=None, nan_code=None,
                    dtype=np.float64):
    """``decode(encode(x))``: the nearest value of ``fmt`` under the mode ("fake quantization")."""
    codes = encode(x, fmt, overflow=overflow, rounding=rounding, rbits=rbits, nan_code=nan_code)
    return decode(_interop.to_numpy(codes), fmt, dtype)


def representable_values(fmt) -> np.ndarray:
    """Sorted distinct finite values of ``fmt`` (float64; -0 and +0 collapse to 0)."""
    v = decode_table(fmt)
    return np.unique(v[np.isfinite(v)] + 0.0)
