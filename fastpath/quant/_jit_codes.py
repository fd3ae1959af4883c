"""Device functions of the quantizers: the data pass (``@triton.jit``, inlined into the kernels of
:mod:`fastpath.quant._kernels`).

* scaling the data by the block factor: a product, or the exact quotient ``x / s``
  (``_div_exact``: one reciprocal per group and one FMA correction per element, with the proof);
* element codes (FP8 by the integer rounding of :mod:`fastpath._triton_rounding` or the hardware
  cast; E2M1 by the integer rounding or the lane encode of :mod:`fastpath._packed_fp4`), then the
  block policies (NaN blocks, signed zeros);
* the gated activations the fused kernels apply while loading (``_activation``, ``_swiglu``, ``_gelu``).

Integer constexprs are positions in the tuples of :mod:`moeref.quant.scheme`
(:mod:`fastpath.quant._preset_map`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _packed_fp4 as PK
from .. import _triton_rounding as R


@triton.jit
def _encode_elem(y, ELEM: tl.constexpr, SATURATE: tl.constexpr, ROUND: tl.constexpr,
                 NAN_CODE: tl.constexpr, HW_FP8: tl.constexpr, NAN_FREE: tl.constexpr):
    """Element codes (uint32) of already-scaled float32 values. NAN_FREE: a NaN ``y`` only occurs
    in NaN blocks, whose codes the caller overwrites (FP4 skips its NaN select then)."""
    if ELEM == 0:
        if HW_FP8:
            hw = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.uint32)
            sgn = R.f32_bits(y) >> 31
            c = tl.where(y != y, 0x7F | (sgn << 7), hw)
        else:
            c = R.encode_minifloat(y, 4, 3, 7, 0x7E, SATURATE, 0x7F, 0x7F, True, ROUND, False)
    elif ELEM == 1:
        if HW_FP8:
            hw = y.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.uint32)
            sgn = R.f32_bits(y) >> 31
            c = tl.where(y != y, 0x7E | (sgn << 7), hw)
        else:
            c = R.encode_minifloat(y, 5, 2, 15, 0x7B, SATURATE, 0x7C, 0x7E, True, ROUND, False)
    else:
        # E2M1 by R.encode_e2m1 (RNE: one float add; other tie rules: count of the midpoints
        # below |y|), equal bit for bit to the integer minifloat path (tested on every bf16
        # pattern and 200k random float32 values) at a fraction of its cost
        if NAN_FREE:
            c = R.encode_e2m1_nonnan(y, ROUND, False)
        else:
            c = R.encode_e2m1(y, ROUND, NAN_CODE, False)
    return c


@triton.jit
def _swiglu(g, u, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """gpt-oss SwiGLU in float32: ``(clip(u, -L, L) + 1) * min(g, L) * sigmoid(ALPHA * min(g, L))``;
    NaN propagates through the clamps as NumPy's ``minimum``/``clip`` do."""
    g = tl.minimum(g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                   propagate_nan=tl.PropagateNan.ALL)
    return (u + 1.0) * g * tl.sigmoid(ALPHA * g)


@triton.jit
def _gelu(g, ACT: tl.constexpr):
    """GELU of float32 gates ``g``, the formulas of PyTorch's CUDA kernel (``GeluCUDAKernelImpl``,
    ``at::native``, float32 opmath) and vLLM's ``gelu_kernel`` / ``gelu_tanh_kernel``
    (``csrc/activation_kernels.cu``), every constant a float32 literal as there:

    ACT 3 (erf, ``approximate="none"``): ``g * 0.5 * (1 + erf(g * M_SQRT1_2))``. ``tl.math.erf`` is
    libdevice's ``__nv_erff`` on the GPU (CUDA documents at most 2 ulp; torch and vLLM call the CUDA math
    library's ``erff``, the same bound: the two can differ by an ulp or two of ``erf``) and, under Triton's
    interpreter, float64 ``math.erf`` rounded to float32.

    ACT 4 (tanh, ``approximate="tanh"``): ``0.5 g (1 + tanh(z))``, ``z = sqrt(2/pi) (g + 0.044715 g^3)``
    (``g * g * g``), evaluated through the identity ``0.5 (1 + tanh(z)) = sigmoid(2 z)`` as
    ``g * sigmoid(2 z)``: Triton has no portable ``tanh`` (libdevice's ``tanhf`` is GPU-only and the
    interpreter runs no extern function), and the identity has no cancellation where ``1 + tanh(z)`` does
    (negative gates). The value is the formula's; its float32 evaluation differs from torch's ``tanhf``
    form by a few float32 ulps of ``|g|``.

    Both stay within the declared activation unit of the layer's profiles (16 float32 ulps of
    ``|g| |u|``; :func:`fastpath.moe.reference_config`)."""
    if ACT == 4:
        z = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        out = g * tl.sigmoid(2.0 * z)
    else:
        out = g * 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
    return out


@triton.jit
def _activation(rp, k, stride_xk, N, mask, ACT: tl.constexpr, ALPHA: tl.constexpr,
                LIMIT: tl.constexpr):
    """Gated activation in float32 at output columns ``k`` (any tile shape; ``rp`` the row
    pointers broadcastable to it) of rows whose input has 2N columns.

    ACT 1: ``silu(gate) * up`` with gate = x[:, :N], up = x[:, N:] (vLLM ``SiluAndMul``,
    :func:`moeref.activations.silu_and_mul` layout "gate_up").
    ACT 2: gpt-oss ``swigluoai``: gate = x[:, 0::2], up = x[:, 1::2] (:func:`moeref.activations.swigluoai`,
    layout "interleaved"); this generic path loads them with stride 2 (the fast path reads
    16-bit pairs as int32 words, see ``PAIR``).
    ACT 3 / 4: ``gelu(gate) * up``, erf / tanh GELU (:func:`_gelu`), layout "gate_up" (vLLM ``GeluAndMul``,
    :func:`moeref.activations.gelu_and_mul`).
    """
    if ACT != 2:
        g = tl.load(rp + k * stride_xk, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(rp + (k + N) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if ACT == 1:
            out = g * tl.sigmoid(g) * u
        else:
            out = _gelu(g, ACT) * u
    else:
        g = tl.load(rp + (2 * k) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(rp + (2 * k + 1) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        out = _swiglu(g, u, ALPHA, LIMIT)
    return out


@triton.jit
def _fma(a, b, c, DIV: tl.constexpr):
    """``fl(a * b + c)`` with one rounding. DIV 1: the hardware ``fma.rn.f32``. DIV 2 (Triton's
    interpreter, whose ``tl.fma`` rounds the product first): the float64 product ``a * b`` is exact
    (48 bits); ``w = fl64(a*b + c)`` and its exact error (Knuth's TwoSum) give the float64
    round-to-odd of the exact sum (w, or its neighbour toward the error when w is inexact and
    even), and rounding that to float32 is the correctly rounded result (round-to-odd at 53 bits
    followed by RN at 24 is RN: 53 >= 24 + 2; Boldo & Melquiond, IEEE TC 57(4), 2008). So the
    interpreter computes what the hardware FMA computes, bit for bit."""
    if DIV == 1:
        r = tl.fma(a, b, c)
    else:
        p = a.to(tl.float64) * b.to(tl.float64)
        cc = c.to(tl.float64)
        w = p + cc
        pv = w - cc
        err = (p - pv) + (cc - (w - pv))
        wb = w.to(tl.int64, bitcast=True)
        toward = tl.where((err > 0) == (w > 0), 1, -1).to(tl.int64)
        odd = tl.where((err != 0) & ((wb & 1) == 0) & (tl.abs(w) < float("inf")), wb + toward, wb)
        r = odd.to(tl.float64, bitcast=True).to(tl.float32)
    return r


@triton.jit
def _div_exact(x, s, DIV: tl.constexpr, BOUNDED: tl.constexpr):
    """FP8/FP4 codes of ``div_rn(x, s)`` for a tile ``x`` and per-group divisors ``s``
    (broadcastable, e.g. ``[BM, GPP, 1]``), without a division per element: returns a float32
    ``y`` whose code (any element format of :mod:`moeref.formats` with <= 3 mantissa bits, any
    of the kernel's roundings and overflow policies) equals the code of the correctly rounded
    quotient ``RN(x / s)``. (``y`` has equalled ``RN(x / s)`` itself in every test, near-midpoint
    pairs included, but only the codes are proven.)

    Per group: ``r = div_rn(1, s)`` (relative error <= 2^-24) and ``ns = -s``. Per element:
    ``q0 = fl(x*r)`` (within 2 ulp of x/s) and one Markstein correction
    ``q1 = fma(fma(q0, ns, x), r, q0)``: the remainder ``x - s q0`` is computed with one rounding,
    so ``q0 + rem * r = x/s + (x/s - q0) * theta`` with ``|theta| <= 2^-23 + 2^-48``, and
    ``q1 = RN(x/s + eta)``, ``|eta| < 2^-22 ulp(x/s)``. Hence ``q1 != RN(x/s)`` only if ``x/s``
    lies within ``2^-22`` ulp of a float32 midpoint T (and is never ON one: a quotient of two
    24-bit floats is never a float32 midpoint, whose odd significand has 25 bits); the two
    candidates are then adjacent floats, and their codes differ only if one of them is a rounding
    boundary B of the element format: a value with <= 5 significant bits (midpoints between
    codes of <= 3-bit-mantissa formats, subnormal ones included, and the overflow threshold).
    Writing s = S 2^a, T = N 2^b (N odd, 25 bits, adjacent to such a B: 32 patterns) and
    x = X 2^c, the condition becomes ``X 2^k - S N = delta`` with integers ``0 < |delta| < 8``:
    ``tests/test_exact_division.py`` enumerates every solution (S < 2^24, X < 2^24: 986 of them,
    29 for 8- and 11-bit X) exactly in rational arithmetic and finds ``q1 == RN(x/s)`` for all,
    so the codes always agree. (A second correction would make ``y`` itself correctly rounded:
    one costs two FMAs per element, the kernel's largest arithmetic cost.)

    Window (every intermediate normal, scale-invariant arithmetic): ``|s|`` in [2^-32, 2^33) and
    ``|q0|`` in [2^-32, 2^32]. Outside it:

    * ``|q0| < 2^-32`` (0 and -0 included): ``|x/s| < 2^-31``, so RN(x/s) and q0 both encode to
      a signed zero with the sign of x/s; q0 is kept (an FMA would lose the sign of -0).
    * ``|q0| > 2^32``, +-Inf, NaN: both far beyond the FP8 range (same overflow code) or NaN;
      q0 is kept.
    * a group with ``|s|`` outside the window (subnormal/tiny amax, static scales, Inf):
      the whole tile is recomputed with ``div_rn`` (a branch taken per program, not per element).
      A NaN ``s`` stays on the fast path: every step then gives NaN, as the division does.

    ``BOUNDED`` (NaN-block policy and a scale computed from the block's own amax, so a finite x
    of a finite block has ``|x| <= amax`` and ``|x/s| <= 2 * 448``; non-finite x only occur in
    NaN blocks, whose codes are replaced): ``|q0| > 2^32`` cannot occur, and for ``|q0| < 2^-32``
    the FMA steps stay below 2^-30 in magnitude, so only their sign could be off, and it is not:
    the remainder is formed negated, ``rem' = fma(q0, s, -x)``, and ``q1 = fma(rem', -r, q0)``:
    the same values as ``fma(fma(q0, -s, x), r, q0)`` for every nonzero result (RN is
    symmetric), but for a zero x, ``rem'`` is ``+0`` and ``q1 = -0 + q0`` keeps the sign of
    ``q0 = x r`` (a zero of x's sign), where the plain form gives ``+0`` for ``x = -0``;
    otherwise the exact value ``q0 + rem r`` lies within ``2^-22`` ulp of ``x/s`` (subnormal
    steps included: each FMA rounds once), so q1 has x's sign, or is a zero of that sign.
    No select is needed (one instruction per element fewer than copying the sign of ``q0``).

    For quantization only (the codes, not the float, are the contract); the property tests check
    the codes against the reference's division, and the float against RN(x/s).
    """
    sb = R.f32_bits(s) & 0x7FFFFFFF
    s_ok = (sb >= ((127 - 32) << 23)) & (sb < ((127 + 33) << 23))
    # one branch per program, decided before x is touched: x -> y in either branch, so x and y
    # are never live together (the register count sets the kernel's occupancy)
    if tl.max(tl.where(s_ok | (s != s), 0, 1)) > 0:
        y = tl.math.div_rn(x, s + tl.zeros(x.shape, tl.float32))
    else:
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        q0 = x * r
        if BOUNDED:  # s > 0 here (a scale of an amax). The negated remainder q0 s - x, then
            # q1 = fma(rem', -r, q0): the same values as below (RN is symmetric), but a zero x
            # keeps its sign (rem' is +0, so q1 = -0 + q0 or +0 + q0 with q0 = x * r, a zero of
            # x's sign; the form below gives +0 for x = -0). The negation of x is a multiply
            # by -1 (LLVM's fneg, an FFMA operand modifier: free); Triton's unary minus is
            # 0 - x, which is no negation for +0 (harmless here, but one more instruction)
            nr = r * -1.0
            y = _fma(_fma(q0, s, x * -1.0, DIV), nr, q0, DIV)
        else:
            ns = (R.f32_bits(s) ^ 0x80000000).to(tl.float32, bitcast=True)
            q1 = _fma(_fma(q0, ns, x, DIV), r, q0, DIV)
            aq = R.f32_bits(q0) & 0x7FFFFFFF
            win = (aq >= ((127 - 32) << 23)) & (aq <= ((127 + 32) << 23))
            y = tl.where(win, q1, q0)
    return y


@triton.jit
def _scale_data(x, f, APPLY: tl.constexpr, SCALE_KIND: tl.constexpr, DIV: tl.constexpr,
                NONFINITE: tl.constexpr, STATIC: tl.constexpr):
    """x / f (FP32 scales, "div": correctly rounded; DIV 0 ``div_rn`` per element, 1/2 the
    FMA-corrected reciprocal of :func:`_div_exact`, same codes) or x * f (dividing by an E8M0
    power of two equals multiplying by its exact reciprocal: 2^-k is representable for every
    code and both round the same exact value once)."""
    if APPLY == 1 and SCALE_KIND == 0:
        if DIV == 0:
            y = tl.math.div_rn(x, f + tl.zeros(x.shape, tl.float32))
        else:
            y = _div_exact(x, f, DIV, NONFINITE == 0 and not STATIC)
    else:
        y = x * f
    return y


@triton.jit
def _codes_of(y, nan_block, ELEM: tl.constexpr, SATURATE: tl.constexpr, ROUND: tl.constexpr,
              NAN_CODE: tl.constexpr, HW_FP8: tl.constexpr, NONFINITE: tl.constexpr,
              FILL_CODE: tl.constexpr, TWO_LEVEL: tl.constexpr, NV_ORDER: tl.constexpr,
              DROP_NEG_ZERO: tl.constexpr, SCALE_KIND: tl.constexpr):
    """Element codes of scaled data, then the block policies (moeref.quant.blockwise step 6).
    With the NaN-block policy and E8M0 factors (finite powers of two, NaN only for a NaN
    block), a NaN ``y`` lies in a NaN block, so the per-element NaN select is skipped."""
    code = _encode_elem(y, ELEM, SATURATE, ROUND, NAN_CODE, HW_FP8,
                        NONFINITE == 0 and SCALE_KIND == 1)
    if TWO_LEVEL:
        if NV_ORDER == 0:  # TE cast_to_fp4x2: an exact zero product (-0.0 too) is code 0x0
            code = tl.where(y == 0.0, 0, code)
    if NONFINITE == 0:
        code = tl.where(nan_block, FILL_CODE, code)
    if DROP_NEG_ZERO:
        sign_mask: tl.constexpr = 0x8 if ELEM == 2 else 0x80
        code = tl.where(code == sign_mask, 0, code)
    return code


@triton.jit
def _unpack_pair(w, IN16: tl.constexpr):
    """The two 16-bit floats of int32 words (little-endian: element 2i low), as float32.
    IN16: 1 bfloat16, 2 float16."""
    u = w.to(tl.uint32, bitcast=True)
    if IN16 == 1:
        lo = (u << 16).to(tl.float32, bitcast=True)
        hi = (u & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        lo = (u & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (u >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _fp4_pair_codes(xe, xo, f3, nb3, SATURATE: tl.constexpr, ROUND: tl.constexpr,
                    NAN_CODE: tl.constexpr, NONFINITE: tl.constexpr, FILL_CODE: tl.constexpr,
                    TWO_LEVEL: tl.constexpr, NV_ORDER: tl.constexpr, DROP_NEG_ZERO: tl.constexpr,
                    SCALE_KIND: tl.constexpr, APPLY: tl.constexpr, DIV: tl.constexpr,
                    STATIC: tl.constexpr, E2M1_PTX: tl.constexpr):
    """E2M1 codes (uint32) of the even and odd elements of a tile, scaled by the per-group
    ``f3`` (with the block policies of ``nb3``), in the form :func:`_fp4_bytes` packs (a code
    of 0 is +0 in both): E2M1_PTX (GPU only) the lane form of :func:`fastpath._packed_fp4.
    e2m1_lane_f32`, otherwise 4-bit codes by the integer rounding."""
    ye = _scale_data(xe, f3, APPLY, SCALE_KIND, DIV, NONFINITE, STATIC)
    yo = _scale_data(xo, f3, APPLY, SCALE_KIND, DIV, NONFINITE, STATIC)
    if E2M1_PTX:
        # TE's order: an exact zero product (-0.0 too) is code 0x0 (see _codes_of)
        ZP: tl.constexpr = TWO_LEVEL and NV_ORDER == 0
        ce = PK.e2m1_lane_f32(ye, ZP)
        co = PK.e2m1_lane_f32(yo, ZP)
        if NONFINITE != 0 and NAN_CODE != 0:  # NaN elements left NAN_LANE (code 0)
            NAN_L: tl.constexpr = PK.lane_of_code(NAN_CODE)
            ce = tl.where(ce == PK.NAN_LANE, NAN_L, ce)
            co = tl.where(co == PK.NAN_LANE, NAN_L, co)
        if NONFINITE == 0:
            FILL_L: tl.constexpr = PK.lane_of_code(FILL_CODE)
            ce = tl.where(nb3, FILL_L, ce)
            co = tl.where(nb3, FILL_L, co)
    else:
        ce = _codes_of(ye, nb3, 2, SATURATE, ROUND, NAN_CODE, False, NONFINITE, FILL_CODE,
                       TWO_LEVEL, NV_ORDER, DROP_NEG_ZERO, SCALE_KIND)
        co = _codes_of(yo, nb3, 2, SATURATE, ROUND, NAN_CODE, False, NONFINITE, FILL_CODE,
                       TWO_LEVEL, NV_ORDER, DROP_NEG_ZERO, SCALE_KIND)
    return ce, co


@triton.jit
def _fp4_bytes(ce, co, E2M1_PTX: tl.constexpr):
    """uint8 FP4 bytes (even element in the low nibble) of :func:`_fp4_pair_codes`' output."""
    if E2M1_PTX:
        byte = PK.bytes_of_lanes(ce, co)
    else:
        byte = (ce | (co << 4)).to(tl.uint8)
    return byte


@triton.jit
def _fp8_codes(x, factor, nan_block, ELEM: tl.constexpr, SATURATE: tl.constexpr,
               ROUND: tl.constexpr, NAN_CODE: tl.constexpr, HW_FP8: tl.constexpr,
               NONFINITE: tl.constexpr, FILL_CODE: tl.constexpr, DROP_NEG_ZERO: tl.constexpr,
               SCALE_KIND: tl.constexpr, APPLY: tl.constexpr, DIV: tl.constexpr,
               STATIC: tl.constexpr):
    """uint8 FP8 codes of a [BM, GPP, G] tile ``x`` with per-group ``factor``/``nan_block``
    [BM, GPP] (one-byte elements: E4M3/E5M2)."""
    if HW_FP8 and ELEM == 0 and not DROP_NEG_ZERO:
        # E4M3 through the hardware cast straight to bytes, no per-element select: a NaN
        # block's factor is NaN, so its data become NaN and the cast writes the NaN code
        # (0x7F up to its sign, which IEEE leaves open: FILL_CODE modulo the sign)
        if NONFINITE == 0:
            f = tl.where(nan_block, float("nan"), factor)
        else:
            f = factor
        y = _scale_data(x, f[:, :, None], APPLY, SCALE_KIND, DIV, NONFINITE, STATIC)
        code8 = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        y = _scale_data(x, factor[:, :, None], APPLY, SCALE_KIND, DIV, NONFINITE, STATIC)
        code8 = _codes_of(y, nan_block[:, :, None], ELEM, SATURATE, ROUND, NAN_CODE, HW_FP8,
                          NONFINITE, FILL_CODE, False, 0, DROP_NEG_ZERO, SCALE_KIND).to(tl.uint8)
    return code8
