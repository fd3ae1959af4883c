"""Triton device helpers that turn float32 values into low-precision codes with INTEGER rounding.

Why integer arithmetic instead of ``x.to(tl.float8e4nv)``:

* Hopper (sm_90) has no FP4 (E2M1) and no UE8M0 conversion instruction (``cvt.*.e2m1x2`` and
  ``cvt.*.ue8m0x2`` are sm_100a+, PTX ISA ``cvt``), so those must be emulated anyway.
* Triton's interpreter (``TRITON_INTERPRET=1``, the CPU CI) rounds fp32 -> fp8 casts wrongly: it
  drops the carry when rounding overflows the mantissa (31.28 -> 16), 2-5% of random values are off
  by a factor of two, and NaN/Inf come out finite (triton-lang/triton#8322, PR #11897).
* One integer algorithm gives the same codes in the interpreter, on the GPU and in the NumPy
  reference (:func:`moeref.formats.encode`), bit for bit, with every rounding/overflow/NaN choice
  written down here instead of inherited from a cast whose semantics changed between versions
  (torch <= 2.12 non-saturating, >= 2.13 saturating).

All helpers take float32 tensors (or their uint32 bit patterns) and return ``uint32`` tensors
holding the code in the low bits; callers narrow to ``uint8`` when storing.

Minifloat encode (:func:`encode_minifloat`), for a target with ``EXP`` exponent bits, ``MAN``
mantissa bits and bias ``BIAS``:

* normal results: the float32 bit pattern ``a = |x|`` is rounded at bit ``23 - MAN`` and rebiased
  (``(a >> s) - ((127 - BIAS) << MAN)``); a carry out of the mantissa moves into the exponent by
  itself, which is the carry the interpreter's cast drops;
* subnormal results: the 24-bit significand (implicit one included) is shifted right by the
  distance to the target's smallest quantum ``2^(1 - BIAS - MAN)``; a round-up of the largest
  subnormal yields the smallest normal code, as it must;
* the round decision uses the exact remainder (``rem > half``, ties by ``ROUND``), so a value one
  float32 ulp above a midpoint rounds up (the sticky-bit failure of tenstorrent/tt-metal#51971
  cannot happen). ``ROUND``: 0 = nearest-even (IEEE/OCP/PTX ``cvt.rn``), 1 = nearest with ties
  toward zero (DeepGEMM's FP4 helper), 2 = nearest with ties away (microxcaling "nearest").
* overflow (rounded magnitude above ``MAX_CODE``, and +-Inf): ``SATURATE`` -> ``MAX_CODE`` (PTX
  ``satfinite``), else ``OVF_CODE`` (E4M3FN NaN 0x7F, E5M2 Inf 0x7C).
* NaN -> ``NAN_CODE`` (sign kept when ``NAN_SIGNED``); negative values keep the sign bit, also
  when they round to zero, unless ``DROP_NEG_ZERO`` (DeepGEMM's FP4: sign only if code != 0).

Shift amounts are clamped to <= 31: a shift by 32 or more is undefined in LLVM (and NumPy, which
the interpreter uses, masks it to 5 bits on x86).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "ROUND_NEAREST_EVEN",
    "ROUND_TIES_TOWARD_ZERO",
    "ROUND_TIES_AWAY",
    "E8M0_CEIL",
    "E8M0_RCEIL",
    "E8M0_RCEIL_SATFINITE",
    "E8M0_FLOOR",
    "encode_minifloat",
    "encode_e4m3",
    "encode_e5m2",
    "encode_e2m1",
    "encode_e2m1_nonnan",
    "encode_ue4m3",
    "e8m0_from_f32",
    "e8m0_to_f32",
    "decode_minifloat",
    "f32_bits",
]

ROUND_NEAREST_EVEN = 0
ROUND_TIES_TOWARD_ZERO = 1
ROUND_TIES_AWAY = 2

# E8M0 scale rules (applied to a positive float32 decode scale such as amax/448):
E8M0_CEIL = 0           # DeepGEMM ceil_to_ue8m0: exp + (mantissa != 0), clamped to [1, 254]
E8M0_RCEIL = 1          # torchao RCEIL (cvt.rp.ue8m0x2, no satfinite): NaN/Inf -> 0xFF
E8M0_RCEIL_SATFINITE = 2  # TransformerEngine float_to_e8m0 (cvt.rp.satfinite): Inf -> 0xFE, NaN -> 0xFF
E8M0_FLOOR = 3          # biased exponent field of the value (OCP MX v1.0 §6.3 FLOOR when applied to amax)


@triton.jit
def f32_bits(x):
    """uint32 bit pattern of a float32 tensor."""
    return x.to(tl.float32).to(tl.uint32, bitcast=True)


@triton.jit
def encode_minifloat(x, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
                     MAX_CODE: tl.constexpr, SATURATE: tl.constexpr, OVF_CODE: tl.constexpr,
                     NAN_CODE: tl.constexpr, NAN_SIGNED: tl.constexpr, ROUND: tl.constexpr,
                     DROP_NEG_ZERO: tl.constexpr):
    """Codes (uint32) of float32 ``x`` in a signed minifloat; see the module docstring."""
    bits = f32_bits(x)
    sign = bits >> 31
    a = bits & 0x7FFFFFFF
    exp_f = a >> 23
    # normal-range rounding: at bit (23 - MAN) of the float32 pattern, exponent rebiased afterwards
    s_norm: tl.constexpr = 23 - MAN
    min_normal_bits: tl.constexpr = (127 + 1 - BIAS) << 23
    # subnormal-range rounding: the significand shifted to units of 2^(1 - BIAS - MAN)
    sig = tl.where(exp_f == 0, a, (a & 0x7FFFFF) | 0x800000)
    e_eff = tl.maximum(exp_f, 1).to(tl.int32)
    s_sub = tl.minimum(151 - BIAS - MAN - e_eff, 26)  # >= 24 - MAN >= 1 in this branch
    is_norm = a >= min_normal_bits
    m = tl.where(is_norm, a, sig)
    s = tl.where(is_norm, s_norm, s_sub).to(tl.uint32)
    q = m >> s
    rem = m & ((tl.full(m.shape, 1, tl.uint32) << s) - 1)
    half = tl.full(m.shape, 1, tl.uint32) << (s - 1)
    if ROUND == 0:
        tie_up = (q & 1) == 1
    elif ROUND == 1:
        tie_up = q != q  # never
    else:
        tie_up = q == q  # always
    up = (rem > half) | ((rem == half) & tie_up)
    code = q + up.to(tl.uint32)
    code = tl.where(is_norm, code - ((127 - BIAS) << MAN), code)
    # overflow and +-Inf (a == 0x7F800000 rounds far above MAX_CODE)
    if SATURATE:
        code = tl.minimum(code, MAX_CODE)
    else:
        code = tl.where(code > MAX_CODE, OVF_CODE, code)
    sign_bit: tl.constexpr = 1 << (EXP + MAN)
    if DROP_NEG_ZERO:
        code = tl.where((sign == 1) & (code != 0), code | sign_bit, code)
    else:
        code = tl.where(sign == 1, code | sign_bit, code)
    is_nan = a > 0x7F800000
    if NAN_SIGNED:
        code = tl.where(is_nan, NAN_CODE | (sign << (EXP + MAN)), code)
    else:
        code = tl.where(is_nan, NAN_CODE, code)
    return code


@triton.jit
def encode_e4m3(x, SATURATE: tl.constexpr):
    """OFP8 E4M3FN, RNE. SATURATE: finite overflow and +-Inf -> +-448 (0x7E/0xFE, PTX satfinite,
    Triton, torch >= 2.13); else -> NaN (0x7F/0xFF, ml_dtypes, torch <= 2.12). NaN -> 0x7F/0xFF."""
    return encode_minifloat(x, 4, 3, 7, 0x7E, SATURATE, 0x7F, 0x7F, True, 0, False)


@triton.jit
def encode_e5m2(x, SATURATE: tl.constexpr):
    """OFP8 E5M2, RNE. SATURATE: overflow/Inf -> +-57344 (0x7B); else -> +-Inf (0x7C).
    NaN -> 0x7E/0xFE (the codec's canonical quiet NaN, sign kept)."""
    return encode_minifloat(x, 5, 2, 15, 0x7B, SATURATE, 0x7C, 0x7E, True, 0, False)


@triton.jit
def encode_e2m1(x, ROUND: tl.constexpr, NAN_CODE: tl.constexpr, DROP_NEG_ZERO: tl.constexpr):
    """See :func:`encode_e2m1_nonnan`; NaN -> ``NAN_CODE``."""
    return tl.where(x != x, NAN_CODE, encode_e2m1_nonnan(x, ROUND, DROP_NEG_ZERO))


@triton.jit
def encode_e2m1_nonnan(x, ROUND: tl.constexpr, DROP_NEG_ZERO: tl.constexpr):
    """OCP FP4 E2M1 (max 6, saturating: the format has no Inf/NaN) of non-NaN ``x`` (a NaN gets an
    unspecified code: for callers whose NaN elements are overwritten anyway, see
    :func:`encode_e2m1`).

    E2M1 has eight magnitudes, so the nearest one is the count of midpoints below ``|x|``:
    0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5. A tie (``|x|`` equal to a midpoint) goes up when the
    upper neighbour's code is even (RNE: 0.75, 1.75, 3.5), never (ties toward zero), or always
    (ties away). Float comparisons are exact, so this equals :func:`encode_minifloat` bit for bit
    (the tests check every bf16 pattern) at half the instructions; |x| > 5 (Inf too) gives 7.
    RNE (``ROUND == 0``, the OCP/NVFP4 default) instead rounds with one FMA adding a
    binade-dependent magic constant (see the code), about 7 instructions instead of 14.
    """
    a = tl.abs(x)
    if ROUND == 0:
        # RNE by one rounding in hardware: E2M1's spacing is 2^(k-1) on the binade [2^k, 2^(k+1)),
        # k = 0..2 (k = 0 also covers [0, 1): the subnormal step 0.5). With m = min(|x|, 6)
        # (saturation, +Inf included; a NaN gives 6 or NaN, the caller's NaN policy decides) and
        # p = 2^k, the exponent of max(m, 1) (one AND of its bits), fma(p, 2^22, m) adds
        # C = 2^(22+k) to m exactly before its one rounding: ulp(C) = 2^(k-1) while m + C stays
        # below 2^(23+k), so m is rounded to a multiple n of the spacing by the hardware's RNE,
        # and the code is n + 2k (<= 7 since m <= 6): both have the same parity, so ties go to
        # the even CODE as RNE demands. The product p * 2^22 is exact, so Triton's interpreter,
        # whose fma rounds the product first, computes the same. About 7 instructions.
        m = tl.minimum(a, 6.0)
        p = f32_bits(tl.maximum(m, 1.0)) & 0x7F800000  # 2^k, k = 0..2 (m <= 6 < 8)
        s = tl.fma(p.to(tl.float32, bitcast=True), 4194304.0, m)
        # n = bits(s) - bits(2^(22+k)) = bits(s) - p - (22 << 23); 2k = (p >> 22) - 254 (p holds
        # the exponent field alone)
        c = (f32_bits(s) - p + (p >> 22) - ((22 << 23) + 254)).to(tl.uint32)
    elif ROUND == 1:
        c = (a > 0.25).to(tl.uint32) + (a > 0.75).to(tl.uint32) + (a > 1.25).to(tl.uint32) \
            + (a > 1.75).to(tl.uint32) + (a > 2.5).to(tl.uint32) + (a > 3.5).to(tl.uint32) \
            + (a > 5.0).to(tl.uint32)
    else:
        c = (a >= 0.25).to(tl.uint32) + (a >= 0.75).to(tl.uint32) + (a >= 1.25).to(tl.uint32) \
            + (a >= 1.75).to(tl.uint32) + (a >= 2.5).to(tl.uint32) + (a >= 3.5).to(tl.uint32) \
            + (a >= 5.0).to(tl.uint32)
    sign = f32_bits(x) >> 31
    if DROP_NEG_ZERO:
        c = tl.where((sign == 1) & (c != 0), c | 0x8, c)
    else:
        c = c | (sign << 3)
    return c


@triton.jit
def encode_ue4m3(x):
    """NVFP4 block scale: E4M3 of a non-negative float32, RNE, satfinite at 448 (0x7E); NaN -> 0x7F."""
    return encode_minifloat(x, 4, 3, 7, 0x7E, True, 0x7E, 0x7F, False, 0, False) & 0x7F


@triton.jit
def e8m0_from_f32(x, RULE: tl.constexpr):
    """E8M0 code (uint32) of a non-negative float32 value under an E8M0 rule (constants above).

    * ``E8M0_CEIL`` (DeepGEMM ``ceil_to_ue8m0``): ``((bits >> 23) & 0xFF) + (mantissa != 0)``,
      clamped to [1, 254]: 0 and float32 subnormals -> 1, NaN/Inf/overflow -> 254.
    * ``E8M0_RCEIL`` (torchao ``_f32_to_e8m0_rceil``): exponent + 1 if the mantissa is nonzero;
      for float32 subnormals (+1 only if mantissa > 0x400000); NaN/Inf -> 0xFF; 0 -> 0x00.
    * ``E8M0_RCEIL_SATFINITE`` (TransformerEngine ``float_to_e8m0``): as RCEIL but Inf -> 0xFE and
      no round-up from 0xFE.
    * ``E8M0_FLOOR``: the biased exponent field (0 for zero and subnormals); NaN/Inf -> 0xFF.
    """
    bits = f32_bits(x) & 0x7FFFFFFF
    e = bits >> 23
    mant = bits & 0x7FFFFF
    if RULE == 0:
        c = e + (mant != 0).to(tl.uint32)
        c = tl.minimum(tl.maximum(c, 1), 254)
    elif RULE == 1:
        up = tl.where(e == 0, mant > 0x400000, mant != 0)
        c = e + up.to(tl.uint32)
        c = tl.where(e == 255, 255, c)
    elif RULE == 2:
        up = tl.where(e == 0, mant > 0x400000, (mant != 0) & (e != 254))
        c = e + up.to(tl.uint32)
        c = tl.where(bits == 0x7F800000, 254, c)
        c = tl.where(bits > 0x7F800000, 255, c)
    else:
        c = e
    return c


@triton.jit
def e8m0_to_f32(code):
    """float32 value ``2^(code - 127)`` of E8M0 codes; code 0 is the subnormal 2^-127 (pytorch/ao
    PR #4725), code 255 is NaN (OCP MX v1.0 §5.4.1)."""
    c = code.to(tl.uint32)
    bits = tl.where(c == 0, 0x00400000, c << 23)
    bits = tl.where(c == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def decode_minifloat(code, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
                     SIGNED: tl.constexpr, SPECIALS: tl.constexpr):
    """float32 value of minifloat codes, built from integer fields (the interpreter decodes the fp8
    specials wrongly: 0x7F -> 480). SPECIALS: 0 none (E2M1), 1 "fn" (E4M3FN: S.1111.111 NaN),
    2 "ieee" (E5M2: top exponent Inf/NaN)."""
    c = code.to(tl.uint32)
    mag_mask: tl.constexpr = (1 << (EXP + MAN)) - 1
    mag = c & mag_mask
    e = mag >> MAN
    m = mag & ((1 << MAN) - 1)
    normal_bits = ((e + (127 - BIAS)) << 23) | (m << (23 - MAN))
    sub_q: tl.constexpr = 2.0 ** (1 - BIAS - MAN)
    val = tl.where(e == 0, m.to(tl.float32) * sub_q, normal_bits.to(tl.float32, bitcast=True))
    if SPECIALS == 1:
        val = tl.where(mag == mag_mask, float("nan"), val)
    elif SPECIALS == 2:
        top: tl.constexpr = (1 << EXP) - 1
        val = tl.where((e == top) & (m == 0), float("inf"), val)
        val = tl.where((e == top) & (m != 0), float("nan"), val)
    if SIGNED:  # set the sign bit (``-val`` is ``0 - val`` in Triton: it would turn -0 into +0)
        sbit = ((c >> (EXP + MAN)) & 1) << 31
        val = (f32_bits(val) | sbit).to(tl.float32, bitcast=True)
    return val
