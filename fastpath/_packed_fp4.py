"""E2M1 (RNE) encoders in inline PTX: MXFP4 from bfloat16 PAIRS with packed bf16x2 instructions (two
elements per instruction; this docstring), and one float32 lane at a time for NVFP4 and the other
FP4 inputs (:func:`e2m1_lane_f32`, described beside it at the end of the module).

Used by :func:`fastpath.quant._kernels._quant_kernel` (constexpr ``PACKED_BF16``) for bfloat16
input read as int32 words (two elements per word, even element in the low half), E8M0 scales
and RNE rounding, on a GPU only: Triton's interpreter cannot run inline PTX, so there the
integer path of :mod:`fastpath._triton_rounding` stays. Every instruction needs sm_90 (``mul/add .bf16x2``) or
sm_86 (``min/max .xorsign.abs``); the targets are Hopper and later.

Why it is exact. The data are multiplied by an E8M0 factor ``f = 2^-e`` (a power of two, or 0 /
1 for zero blocks, NaN for NaN blocks), so ``y = x * f`` is EXACT in bfloat16 whenever it is a
normal bfloat16 (8 significant bits times a power of two); when it is not, either ``|y| < 2^-126``
(code 0 whatever the rounding, the sign taken from the product, whose sign is x's) or it
overflows to +-Inf (saturates to +-6, as the exact product does). The whole E2M1 rounding then
runs on the bf16 pair (:data:`ENCODE_E2M1X4_PTX`), lane by lane; per lane (``sg`` the sign):

1. ``y = x * f``                  ``mul.rn.bf16x2`` (exact, see above; subnormals are kept: the
                                  PTX half-precision ``mul`` has no ``.ftz``, SASS ``HMUL2``
                                  without ``.FTZ`` supports denormals).
2. ``m = sg * min(|y|, 6)``       ``min.xorsign.abs`` with +6: saturation (+-Inf too). A NaN lane
                                  becomes +-6 (PTX ``min`` without ``.NaN`` returns the non-NaN
                                  operand), so it stays finite and cannot disturb the other lane;
                                  its code is replaced by the caller's NaN policy.
3. ``t = sg * max(|m|, 1)``       ``max.xorsign.abs`` with +1: ``|t|`` in [1, 6] has the binade k
                                  (0, 1, 2) of ``|m|`` (k = 0 also for ``|m| < 1``).
4. ``b = sg * 2^k``               ``t & 0xFF80FF80``: sign and exponent of t.
5. ``s = RN(b * 64 + m)``         ``fma.rn.bf16x2``: ``b * 64 = sg * 2^(6+k)`` exactly, and
                                  ``ulp(2^(6+k)) = 2^(k-1)`` is E2M1's spacing on binade k (0.5
                                  below 2, 1 on [2, 4), 2 on [4, 6]); m has the same sign, so
                                  ``|s| = RNE(|m| + 2^(6+k))`` rounds ``|m|`` to a multiple n of
                                  the spacing (``|m| + 2^(6+k) < 2^(7+k)``: the ulp is constant).
6. ``r = s - b + (b >> 6) - 0x03FE03FE``  integer, per lane, with ``c = b + 0x0300`` the bits
                                  of ``sg * 2^(6+k)``: ``s - c = n`` (sign and exponent cancel,
                                  no borrow since ``|s| >= |c|``) and ``c >> 6 = (b >> 6) + 0xC``
                                  puts ``2 (133 + k)`` in bits 1..8 and the sign in bit 9 of the
                                  lane (b's low 7 bits are 0: nothing crosses lanes), so each
                                  16-bit lane of r is ``(n + 2k) | sg << 9``: ``0x03FE =
                                  0x0300 + 266 - 0xC``. ``n + 2k`` is the E2M1 code (0..7): it has
                                  the parity of n, which is the parity of s's mantissa, so RNE
                                  ties go to the even CODE.
   Then ``r = (r & ~mask) | fill`` (one ``lop3``): the caller's overwrite of NaN lanes / NaN
   blocks, in the same lane form (:func:`lanes_of_code`).
7. bytes, four words per call (``pack=4``: one output register holds the four bytes):
   ``prmt`` gathers the code bytes of words a, b as ``[a.lo, b.lo, a.hi, b.hi]`` and their sign
   bytes (sign in bit 1) likewise; ``W + (S << 2)`` puts each sign in bit 3 of its nibble; adding
   ``>> 12`` moves the high nibbles next to the low ones (``[byte a, byte b]`` in the low half;
   no overlapping bits, so ``+`` is ``|``); a last ``prmt`` joins the two halves.

Every intermediate lane stays below 2^16 and non-negative, so no carry or borrow crosses from
the low lane into the high one, NaN lanes included. ``tests/test_mxfp4_packed_encode.py``
emulates this exact PTX text instruction by instruction in NumPy (a small interpreter, bf16
rounding done exactly) over all 65536 bf16 patterns in both lanes x every power-of-two factor
bfloat16 holds (2^-133..2^127; E8M0 factors are 2^-127..2^127) and 0, against
:func:`moeref.formats.encode` of the exact product; ``property_tests/test_fastpath_mxfp4_packed.py``
runs the real instructions on a GPU over every pattern and factor code and compares with the
integer path and the reference.

The block amax (:func:`amax_bf16x2`) is a ``tl.reduce`` of ``max{.NaN}.xorsign.abs.bf16x2`` over
the words (one instruction per two elements), then the larger lane of ``|r|``: with ``.NaN``
(NaN-block and propagate policies) a NaN element makes the lane NaN, as the float32 max.NaN path
does (its payload is not kept there either); without it (``ignore_nan``) a NaN only survives a
combine with another NaN, so a lane is NaN exactly when all its elements are, and such a lane
counts as 0, the integer path's value for an all-NaN block.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._triton_rounding import f32_bits

__all__ = ["ENCODE_E2M1X4_PTX", "bf16x2_factor", "lanes_of_code", "nan_overwrite",
           "encode_e2m1x4_rne", "amax_bf16x2", "lane_of_code", "E2M1_LANE_F32_PTX", "E2M1_LANE_F32_ZERO_PTX",
           "NAN_LANE", "e2m1_lane_f32", "bytes_of_lanes"]


def _word_ptx(j: int) -> str:
    """Steps 1-6 for word j: %e2m1_r<j> gets the lanes ``code | sign << 9``, then the overwrite.

    Every local register is named ``%e2m1_*``: a scope that declared, say, ``%r1`` would shadow
    the caller's ``%r1`` (Triton numbers its registers ``%r<N>``) whenever that register is
    passed in as an operand, and the asm would read its own uninitialised local instead (seen
    on an H200, 2026-11-21: the first bytes of every row came out wrong)."""
    return f"""mul.rn.bf16x2 %e2m1_y, ${1 + j}, ${5 + j};
min.xorsign.abs.bf16x2 %e2m1_m, %e2m1_y, %e2m1_k6;
max.xorsign.abs.bf16x2 %e2m1_t, %e2m1_m, %e2m1_k1;
and.b32 %e2m1_c, %e2m1_t, 0xFF80FF80;
fma.rn.bf16x2 %e2m1_s, %e2m1_c, %e2m1_k64, %e2m1_m;
sub.u32 %e2m1_r{j}, %e2m1_s, %e2m1_c;
sub.u32 %e2m1_r{j}, %e2m1_r{j}, 0x03FE03FE;
shr.u32 %e2m1_u, %e2m1_c, 6;
add.u32 %e2m1_r{j}, %e2m1_r{j}, %e2m1_u;
lop3.b32 %e2m1_r{j}, %e2m1_r{j}, ${9 + j}, ${13 + j}, 0xBA;
"""


def _bytes_ptx(a: int, b: int, out: str) -> str:
    """Two bytes (words a, b) into the low half of ``out`` (step 7)."""
    return f"""prmt.b32 {out}, %e2m1_r{a}, %e2m1_r{b}, 0x6240;
prmt.b32 %e2m1_v, %e2m1_r{a}, %e2m1_r{b}, 0x7351;
shl.b32 %e2m1_v, %e2m1_v, 2;
add.u32 {out}, {out}, %e2m1_v;
shr.u32 %e2m1_v, {out}, 12;
add.u32 {out}, {out}, %e2m1_v;
"""


# Four elements per call (pack=4). $0: the four FP4 bytes (byte j from word j); $1-$4: words of
# two bfloat16 (element 2i low); $5-$8: the factors as bf16 pairs; $9-$12: overwrite masks;
# $13-$16: the lanes written where the mask is set (see :func:`encode_e2m1x4_rne`).
ENCODE_E2M1X4_PTX = ("{\n.reg .b32 %e2m1_y, %e2m1_m, %e2m1_t, %e2m1_c, %e2m1_s, %e2m1_u, %e2m1_v,"
                     " %e2m1_k6, %e2m1_k1, %e2m1_k64, %e2m1_r0, %e2m1_r1, %e2m1_r2, %e2m1_r3,"
                     " %e2m1_b0, %e2m1_b1;\nmov.b32 %e2m1_k6, 0x40C040C0;\nmov.b32 %e2m1_k1, 0x3F803F80;\n"
                     "mov.b32 %e2m1_k64, 0x42804280;\n"
                     + "".join(_word_ptx(j) for j in range(4))
                     + _bytes_ptx(0, 1, "%e2m1_b0") + _bytes_ptx(2, 3, "%e2m1_b1")
                     + "prmt.b32 $0, %e2m1_b0, %e2m1_b1, 0x5410;\n}")

_MAX_ABS_NAN_PTX = "max.NaN.xorsign.abs.bf16x2 $0, $1, $2;"
_MAX_ABS_PTX = "max.xorsign.abs.bf16x2 $0, $1, $2;"
# the same strings as constexpr globals (what a @triton.jit function may read)
_ENCODE_C = tl.constexpr(ENCODE_E2M1X4_PTX)
_ENCODE_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 16))
_MAX_ABS_NAN_C = tl.constexpr(_MAX_ABS_NAN_PTX)
_MAX_ABS_C = tl.constexpr(_MAX_ABS_PTX)


@triton.jit
def bf16x2_factor(factor):
    """int32 word holding the bfloat16 pattern of a float32 factor in both halves. Exact for the
    factors of E8M0 scales: 2^k (k in [-127, 127]; 2^-127 is the bf16 subnormal 0x0040), 0, 1,
    NaN (its low 16 float32 bits are zero)."""
    b = f32_bits(factor) >> 16
    return (b | (b << 16)).to(tl.int32, bitcast=True)


@triton.constexpr_function
def lane_of_code(code):
    """The lane form of the E2M1 code ``code`` (0..15): ``(code & 7) | (code >> 3) << 9``, code
    bits 0-2 and the sign in bit 9 (step 6's form, and :func:`e2m1_lane_f32`'s). A compile-time
    function: kernels call it on constexpr codes, Python on ints."""
    return (code & 7) | (((code >> 3) & 1) << 9)


@triton.constexpr_function
def lanes_of_code(code):
    """The two-lane word a mask overwrite writes for the E2M1 code ``code`` (0..15) in both
    16-bit lanes (:func:`lane_of_code` in each)."""
    return lane_of_code(code) * 0x10001


@triton.jit
def nan_overwrite(words, f3, nb3, NONFINITE: tl.constexpr, FILL_CODE: tl.constexpr,
                  NAN_CODE: tl.constexpr):
    """(mask, fill) for :func:`encode_e2m1x4_rne`: the policy's code for NaN lanes, in the lane
    form of :func:`lanes_of_code` (code bits 0-2, sign bit 9 of each 16-bit lane). ``words``:
    the int32 bf16 pairs; ``f3``/``nb3``: per-group factor and NaN-block flag, broadcastable.
    Since ``y = x * f`` is exact in bf16, a NaN y comes from a NaN x or a NaN factor (an Inf x
    never meets a 0 factor: those are all-zero blocks). NONFINITE 0 (NaN blocks, the only place a
    NaN y then occurs): the whole block gets FILL_CODE; otherwise each NaN element gets
    NAN_CODE, as :func:`fastpath._triton_rounding.encode_e2m1` does."""
    if NONFINITE == 0:
        fill_lanes: tl.constexpr = lanes_of_code(FILL_CODE)
        ow = tl.where(nb3, -1, 0)
        ov = tl.where(nb3, fill_lanes, 0)
    else:
        nan_lanes: tl.constexpr = lanes_of_code(NAN_CODE)
        u = words.to(tl.uint32, bitcast=True) & 0x7FFF7FFF
        fnan = f3 != f3
        ow = tl.where(((u & 0xFFFF) > 0x7F80) | fnan, 0xFFFF, 0).to(tl.uint32) \
            | tl.where((u > 0x7F80FFFF) | fnan, 0xFFFF0000, 0).to(tl.uint32)
        ov = (ow & nan_lanes).to(tl.int32, bitcast=True)
        ow = ow.to(tl.int32, bitcast=True)
    return ow, ov


@triton.jit
def encode_e2m1x4_rne(words, f2, mask, fill):
    """FP4 bytes (uint8: low nibble element 2i, high nibble 2i+1) of int32 words of two bfloat16
    times the bf16-pair factor ``f2`` (:func:`bf16x2_factor`): E2M1, RNE, saturating, sign kept
    (-0 -> 0x8). ``mask``/``fill`` (int32, broadcastable): where a bit of ``mask`` is set the
    lanes take ``fill``'s bit instead, one ``lop3`` per word; a lane of ``0xFFFF`` with the fill
    lane ``lanes_of_code(c) & 0xFFFF`` writes code c there (NaN elements, NaN blocks). NaN lanes
    not overwritten get code 7 up to the sign. See the module docstring."""
    return tl.inline_asm_elementwise(_ENCODE_C, _ENCODE_CONSTRAINTS,
                                     [words, f2, mask, fill], dtype=tl.uint8, is_pure=True,
                                     pack=4)


@triton.jit
def _max_abs_nan(a, b):
    return tl.inline_asm_elementwise(_MAX_ABS_NAN_C, "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _max_abs(a, b):
    return tl.inline_asm_elementwise(_MAX_ABS_C, "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def amax_bf16x2(words, IGNORE_NAN: tl.constexpr):
    """Block amax (float32) over the last axis of int32 words of bfloat16 pairs, both lanes.
    IGNORE_NAN False: NaN if any element is NaN (payload unspecified); True: NaN elements are
    left out (an all-NaN block gives 0). Exact otherwise: the max of the |x| patterns, widened."""
    if IGNORE_NAN:
        r = tl.reduce(words, len(words.shape) - 1, _max_abs)
    else:
        r = tl.reduce(words, len(words.shape) - 1, _max_abs_nan)
    r = r.to(tl.uint32, bitcast=True) & 0x7FFF7FFF
    lo = r & 0xFFFF
    hi = r >> 16
    if IGNORE_NAN:
        lo = tl.where(lo > 0x7F80, 0, lo)
        hi = tl.where(hi > 0x7F80, 0, hi)
    return (tl.maximum(lo, hi) << 16).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------ float32 values, one lane
#
# The same rounding for scaled float32 values (NVFP4, whose data factor is not a power of two,
# and MXFP4 from float16/float32 input), one element per asm call, on a GPU only (the
# interpreter keeps the integer path). Per element y (``sg`` its sign; float32 ops on .b32
# registers):
#
# 1. ``m = sg * min(|y|, 6)``      ``min.NaN.xorsign.abs.f32`` with +6: saturation (+-Inf too);
#                                  a NaN y gives a NaN m.
# 2. ``t = sg * max(|m|, 1)``      ``max.xorsign.abs.f32`` with +1: |t| in [1, 6] has the binade k
#                                  (0, 1, 2) of |m| (k = 0 also for |m| < 1).
# 3. ``c = t & 0xFF800000``        sign and exponent of t: ``sg * 2^k``.
# 4. ``s = RN(c * 2^22 + m)``      ``fma.rn.f32``: ``c * 2^22 = sg * 2^(22+k)`` exactly, whose ulp
#                                  2^(k-1) is E2M1's spacing on binade k, and |m| + 2^(22+k) stays
#                                  below 2^(23+k): the one rounding (RNE, symmetric) takes |m| to
#                                  a multiple n of the spacing, ``bits(s) = bits(sg * 2^(22+k)) + n``.
# 5. ``r = s - c + (c >> 22) - ((22 << 23) + 254)``  integer: ``bits(s) - c = (22 << 23) + n``
#                                  (sign and exponent fields cancel), ``c >> 22 = sg << 9 |
#                                  (127 + k) << 1``, so ``r = (n + 2k) | sg << 9``: the E2M1 code
#                                  in bits 0-2 (n + 2k <= 7 since |m| <= 6; n and the code have the
#                                  same parity, so RNE ties go to the even CODE), the sign in bit 9,
#                                  bits 3-8 zero: :func:`lane_of_code`'s lane form.
# 6. ``r = min.u32(r, NAN_LANE)``  every non-NaN lane is at most ``7 | 1 << 9 = 519``; a NaN y
#                                  makes s NaN, and for ANY NaN pattern of s and each c that step 2
#                                  can leave (+-1, or +-Inf should the max return NaN) r is at least
#                                  0x35000001 (see the tests), so NaN lanes become ``NAN_LANE``,
#                                  0x400: code 0, sign 0, and bit 10, which :func:`bytes_of_lanes`
#                                  drops. (ptxas fuses 5's last add with 6: ``VIADDMNMX``.)
#
# The ZERO variant first adds +0 (``add.rn.f32``): -0 + 0 = +0 under RN, so an exact zero of
# either sign gets code 0 (TransformerEngine's cast_to_fp4x2), every other value is unchanged.
# tests/test_mxfp4_packed_encode.py emulates the text over every bfloat16-derived float32
# pattern and a million random ones against moeref.formats.encode.

NAN_LANE = 0x400

_E2M1_LANE_BODY = """min.NaN.xorsign.abs.f32 %e2m1f_m, %e2m1f_y, 0f40C00000;
max.xorsign.abs.f32 %e2m1f_t, %e2m1f_m, 0f3F800000;
and.b32 %e2m1f_c, %e2m1f_t, 0xFF800000;
fma.rn.f32 %e2m1f_s, %e2m1f_c, 0f4A800000, %e2m1f_m;
sub.u32 %e2m1f_s, %e2m1f_s, %e2m1f_c;
shr.u32 %e2m1f_u, %e2m1f_c, 22;
add.u32 %e2m1f_s, %e2m1f_s, %e2m1f_u;
sub.u32 %e2m1f_s, %e2m1f_s, 0x0B0000FE;
min.u32 $0, %e2m1f_s, 0x400;
}"""
_E2M1_LANE_REGS = "{\n.reg .b32 %e2m1f_y, %e2m1f_m, %e2m1f_t, %e2m1f_c, %e2m1f_s, %e2m1f_u;\n"
# $0: the lane (uint32); $1: the float32 value's bits
E2M1_LANE_F32_PTX = _E2M1_LANE_REGS + "mov.b32 %e2m1f_y, $1;\n" + _E2M1_LANE_BODY
E2M1_LANE_F32_ZERO_PTX = _E2M1_LANE_REGS + "add.rn.f32 %e2m1f_y, $1, 0f00000000;\n" + _E2M1_LANE_BODY
_LANE_C = tl.constexpr(E2M1_LANE_F32_PTX)
_LANE_ZERO_C = tl.constexpr(E2M1_LANE_F32_ZERO_PTX)


@triton.jit
def e2m1_lane_f32(y, ZERO_PLUS: tl.constexpr):
    """E2M1 RNE (saturating) of float32 ``y`` in lane form (uint32: code bits 0-2, sign bit 9;
    NaN -> :data:`NAN_LANE`). ZERO_PLUS: +-0 -> code 0 (TE's order); otherwise -0 keeps its
    sign (0x8). See the comment above."""
    if ZERO_PLUS:
        r = tl.inline_asm_elementwise(_LANE_ZERO_C, "=r,r", [y.to(tl.int32, bitcast=True)],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    else:
        r = tl.inline_asm_elementwise(_LANE_C, "=r,r", [y.to(tl.int32, bitcast=True)],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    return r


@triton.jit
def bytes_of_lanes(le, lo):
    """FP4 bytes (uint8: low nibble ``le``'s code, high nibble ``lo``'s) of two lane-form tensors.
    ``v = le + (lo << 4)`` has the codes in bits 0-2 and 4-6, the signs in bits 9 and 13 (no
    overlap, so ``+`` is ``|``), bits 3 and 7 zero; ``(v >> 6) & 0x88`` moves the signs to bits 3
    and 7 (one LOP3 with the OR); bits 8 and up are dropped by the narrowing."""
    v = le + (lo << 4)
    return (v | ((v >> 6) & 0x88)).to(tl.uint8)
