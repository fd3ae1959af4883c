"""Device functions of the quantizers: block amaxes and block scales (``@triton.jit``, inlined
into the kernels of :mod:`fastpath.quant._kernels`).

* the block amax of a tile, NaN-propagating or not (``_amax3``, ``_amax3_bits``, ``_amax_pair``),
  or read back from a first pass (``_amax_loaded``);
* the scale of each block amax, as :mod:`moeref.quant.scale_rules` and :mod:`moeref.quant.nvfp4`
  compute it (``_block_scales``: FP32 rules, E8M0 codes from exponent bits, NVFP4's UE4M3 block
  scale), operation for operation in float32;
* the scales written in the consumer's layout, padding included (``_tile_scales``).

The integer constexprs (``SCALE_KIND``, ``FP32_RULE``, ``E8_RULE``, ``NONFINITE`` ...) are the
positions of the preset's choices in the tuples of :mod:`moeref.quant.scheme`
(:mod:`fastpath.quant._preset_map` derives them; the comments name each value).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _triton_rounding as R


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _pow2(e):
    """float32 2^e for integer e in [-149, 127] (int32 tensor), built from bits."""
    bits = tl.where(e >= -126, (e + 127) << 23, 1 << tl.maximum(e + 149, 0))
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_code(amax, RULE: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
               INV_M: tl.constexpr, ELEM_MAX: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
               NF: tl.constexpr):
    """UE8M0 byte (int32) of a block amax (moeref.quant.scale_rules.e8m0_codes_from_amax)."""
    abits = R.f32_bits(amax) & 0x7FFFFFFF
    nonfinite = abits >= 0x7F800000
    src = tl.where(nonfinite, 0.0, amax)
    if RULE <= 2:
        if RULE == 2:  # EVEN: (bits + 2^(22-mbits)) & 0xFF800000, then FLOOR
            b = R.f32_bits(src) + (1 << (22 - MBITS))
            b = b & 0xFF800000
            ovf = b >= 0x7F800000
            nonfinite = nonfinite | ovf
            src = tl.where(ovf, 0.0, b.to(tl.float32, bitcast=True))
        sb = R.f32_bits(src)
        fl = (sb >> 23).to(tl.int32)  # floor exponent; 0 for zero/subnormal (saturated to 0x00)
        if RULE == 1:  # CEIL: +1 unless src is exactly 2^(fl-127) (2^-127 is the subnormal 0x00400000)
            exact = tl.where(fl == 0, sb == 0x00400000, (sb & 0x7FFFFF) == 0)
            fl = fl + tl.where(exact, 0, 1)
        code = fl - EMAX
    else:
        if RULE == 3:  # RCEIL: amax * fl(1/M)
            d = src * INV_M
        else:  # ceil_div: amax / M
            d = tl.math.div_rn(src, tl.full(src.shape, ELEM_MAX, tl.float32))
        code = R.e8m0_from_f32(d, R.E8M0_RCEIL).to(tl.int32)  # exact ceil to a power of two
        code = tl.minimum(code, 254)  # finite overflow saturates (encode saturate)
    code = tl.minimum(tl.maximum(code, LO), HI)
    if NF == 0:
        code = tl.where(nonfinite, 255, code)
    elif NF == 1:
        code = tl.where(abits > 0x7F800000, 255, tl.where(nonfinite, 254, code))
    else:
        code = tl.where(nonfinite, HI, code)
    return code


@triton.jit
def _e4m3_code_hw(x):
    """E4M3 code (int32) of float32 ``x`` by the hardware: ``cvt.rn.satfinite.e4m3x2.f32``, one
    value per instruction (RNE; NaN -> 0x7F). Not ``x.to(tl.float8e4nv)``: Triton pairs the
    values of a reduced (sliced-layout) tensor for the two-lane cvt, and on an H200
    (2026-11-21) every other NVFP4 block scale of some tiles came out 0 that way."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 e4m3_t; cvt.rn.satfinite.e4m3x2.f32 e4m3_t, 0f00000000, $1; "
        "cvt.u32.u16 $0, e4m3_t; }",
        "=r,r", [x], dtype=tl.uint32, is_pure=True, pack=1).to(tl.int32) & 0xFF


@triton.jit
def _block_scales(amax, ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr,
                  MBITS: tl.constexpr, SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr,
                  FP32_POW2: tl.constexpr, E8_RULE: tl.constexpr, E8_LO: tl.constexpr,
                  E8_HI: tl.constexpr, E8_NF: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                  ZERO_BLOCK: tl.constexpr, NONFINITE: tl.constexpr, APPLY: tl.constexpr,
                  STATIC: tl.constexpr, static_dec, G_ENC, G_DEC, NV_ORDER: tl.constexpr,
                  FTAB, HW_SCALE: tl.constexpr):
    """(stored, factor, nan_block) for a grid of block amaxes; stored is float32 (FP32 scales) or
    int32 codes (UE8M0/UE4M3). ``factor`` multiplies (APPLY 0/2) or divides (APPLY 1) the data.
    Mirrors moeref.quant.scale_rules (compute_scales + finalize_scales) and moeref.quant.nvfp4.
    NVFP4 (SCALE_KIND 2): ``FTAB`` points at the 128 data factors of the UE4M3 codes
    (:func:`_nvfp4_factors`); ``HW_SCALE`` takes the code from the hardware E4M3 cast."""
    abits = R.f32_bits(amax) & 0x7FFFFFFF
    if AMAX_FLOOR > 0.0:
        amax = tl.where(abits > 0x7F800000, amax, tl.maximum(amax, AMAX_FLOOR))
    abits = R.f32_bits(amax) & 0x7FFFFFFF
    is_nf = abits >= 0x7F800000
    is_zero = abits == 0
    one = tl.full(amax.shape, 1.0, tl.float32)
    if SCALE_KIND == 0:
        if STATIC:
            dec = tl.zeros(amax.shape, tl.float32) + static_dec
            enc = dec
            has_enc = False
        elif FP32_RULE == 0 or FP32_RULE == 1:  # positions in moeref.quant.scheme.FP32_RULES
            if FP32_RULE == 0:  # amax_over_max: fl(a / M)
                dec = tl.math.div_rn(amax, tl.full(amax.shape, ELEM_MAX, tl.float32))
            else:  # amax_times_recip_max: fl(a * fl(1/M)) (torch CUDA's a / 448.0)
                dec = amax * INV_M
            enc = dec
            has_enc = False
            if FP32_POW2:
                pc = R.e8m0_from_f32(dec, R.E8M0_RCEIL)
                pc = tl.where(dec != dec, 255, tl.minimum(pc, 254))
                dec = R.e8m0_to_f32(pc)
        else:  # 2, "te": e = M / a (FLT_MAX on overflow, 1 for a == 0 or Inf), dec = 1 / e
            e = tl.math.div_rn(tl.full(amax.shape, ELEM_MAX, tl.float32), amax)
            ebits = R.f32_bits(e) & 0x7FFFFFFF
            e = tl.where(ebits == 0x7F800000, 3.4028234663852886e38, e)
            e = tl.where(is_zero | (abits == 0x7F800000), 1.0, e)
            if FP32_POW2:
                e = (R.f32_bits(e) & 0xFF800000).to(tl.float32, bitcast=True)
            dec = tl.math.div_rn(one, e)
            enc = e
            has_enc = True
        if APPLY == 1:
            factor = dec
        elif APPLY == 2 and has_enc:
            factor = enc
        else:
            factor = tl.math.div_rn(one, dec)
        stored_f = dec
        stored_i = abits.to(tl.int32)  # unused
    elif SCALE_KIND == 1:
        if STATIC:
            code = tl.zeros(amax.shape, tl.int32) + static_dec.to(tl.int32)
        else:
            code = _e8m0_code(amax, E8_RULE, EMAX, MBITS, INV_M, ELEM_MAX, E8_LO, E8_HI, E8_NF)
        dec = R.e8m0_to_f32(code)
        # x / 2^k == x * 2^-k exactly (2^-k is representable for every code, the product and the
        # quotient round the same exact value once), so "div" multiplies too
        factor = tl.where(code == 255, float("nan"), _pow2(127 - code))
        stored_i = code
        stored_f = dec
    else:  # UE4M3 block scale of a two-level (NVFP4) scheme (moeref.quant.nvfp4._nvfp4_rule)
        if NV_ORDER == 0:  # TE: e4m3(min(a * fl(S_enc * fl(1/6)), 448)), one rounding
            sf = amax * (G_ENC * 0.1666666716337204)
        elif NV_ORDER == 1:  # FlashInfer/vLLM ref: e4m3(min(S_enc * fl(a * fl(1/6)), 448))
            sf = G_ENC * (amax * 0.1666666716337204)
        else:  # torchao: e4m3(clamp(fl(a / 6) / pts, 2^-6, 448)); pts == 0: the zero tensor
            sf = tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)),
                                tl.zeros(amax.shape, tl.float32) + G_DEC)
            sf = tl.where(G_DEC == 0.0, 0.0, sf)
            sf = tl.maximum(sf, 0.015625)
        sf = tl.minimum(sf, 448.0)
        if HW_SCALE:
            code = _e4m3_code_hw(sf)
        else:
            code = R.encode_ue4m3(sf).to(tl.int32)
        # the data factor of the order (a function of the code and the tensor's factors only)
        factor = tl.load(FTAB + code)
        stored_i = code
        stored_f = sf  # unused (UE4M3 scales are stored as codes)
    # finalize_scales: zero blocks and non-finite blocks (NVFP4's rule has its own)
    if (not STATIC) and SCALE_KIND != 2:
        if ZERO_BLOCK == 1:
            if SCALE_KIND == 0:
                stored_f = tl.where(is_zero, 1.0, stored_f)
            elif SCALE_KIND == 1:
                stored_i = tl.where(is_zero, 127, stored_i)
            else:
                stored_i = tl.where(is_zero, 0x38, stored_i)
            factor = tl.where(is_zero, 1.0, factor)
        elif ZERO_BLOCK == 2:
            if SCALE_KIND == 0:
                stored_f = tl.where(is_zero, 0.0, stored_f)
            else:
                stored_i = tl.where(is_zero, 0, stored_i)
            if APPLY == 1:
                factor = tl.where(is_zero, 1.0, factor)
            else:
                factor = tl.where(is_zero, 0.0, factor)
        else:
            fbits = R.f32_bits(factor) & 0x7FFFFFFF
            if APPLY == 1:
                bad = is_zero & ((fbits >= 0x7F800000) | (fbits == 0))
                factor = tl.where(bad, 1.0, factor)
            else:
                bad = is_zero & (fbits >= 0x7F800000)
                factor = tl.where(bad, 0.0, factor)
    if NONFINITE == 0:
        nan_block = is_nf
        if SCALE_KIND == 0:
            stored_f = tl.where(is_nf, float("nan"), stored_f)
        elif SCALE_KIND == 1:
            # a finite amax can still get the NaN scale 0xFF (torchao EVEN rounding past
            # FLT_MAX): the reference fills every block whose scale decodes to NaN
            nan_block = is_nf | (stored_i == 255)
            stored_i = tl.where(is_nf, 255, stored_i)
        else:
            stored_i = tl.where(is_nf, 0x7F, stored_i)
    else:
        nan_block = is_zero & (abits != abits)  # all False
    return stored_f, stored_i, factor, nan_block


@triton.jit
def _tile_scales(amax, rows, gidx, pid_b, s_ptr, stride_sb, stride_sm, stride_sg, static_ptr,
                 nv_ptr, M, NG, M_PAD, NG_PAD,
                 GPP: tl.constexpr, BLOCK_M: tl.constexpr, ELEM_MAX: tl.constexpr,
                 INV_M: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                 SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr, FP32_POW2: tl.constexpr,
                 E8_RULE: tl.constexpr, E8_LO: tl.constexpr, E8_HI: tl.constexpr,
                 E8_NF: tl.constexpr, AMAX_FLOOR: tl.constexpr, ZERO_BLOCK: tl.constexpr,
                 NONFINITE: tl.constexpr, APPLY: tl.constexpr, SF_LAYOUT: tl.constexpr,
                 STATIC: tl.constexpr, TWO_LEVEL: tl.constexpr, NV_ORDER: tl.constexpr,
                 WRITE_SCALES: tl.constexpr, HW_SCALE: tl.constexpr):
    """Scales of a [BLOCK_M, GPP] grid of block amaxes: computes them (_block_scales), writes them
    in the requested layout (padding included: rows < M_PAD, groups < NG_PAD get 0), and returns
    (factor, nan_block) for the data. ``nv_ptr`` (NVFP4): the tensor's factors as
    :func:`_nvfp4_factors` writes them."""
    if STATIC:
        static_dec = tl.load(static_ptr)
    else:
        static_dec = 0.0
    if TWO_LEVEL:  # one global factor for the whole tensor (moeref: the tensor amax)
        g_enc = tl.load(nv_ptr)
        g_dec = tl.load(nv_ptr + 1)
    else:
        g_enc = 1.0
        g_dec = 1.0
    stored_f, stored_i, factor, nan_block = _block_scales(
        amax, ELEM_MAX, INV_M, EMAX, MBITS, SCALE_KIND, FP32_RULE, FP32_POW2, E8_RULE, E8_LO,
        E8_HI, E8_NF, AMAX_FLOOR, ZERO_BLOCK, NONFINITE, APPLY, STATIC, static_dec, g_enc, g_dec,
        NV_ORDER, nv_ptr + 2, HW_SCALE)
    if WRITE_SCALES:
        valid = (rows < M)[:, None] & (gidx < NG)[None, :]
        sb = s_ptr + pid_b.to(tl.int64) * stride_sb
        if SCALE_KIND == 0:
            sval = tl.where(valid, stored_f, 0.0)
        else:
            sval = tl.where(valid, stored_i, 0)
        smask = (rows < M_PAD)[:, None] & (gidx < NG_PAD)[None, :]
        if SF_LAYOUT == 0:  # strided: row-major or MN-major storage
            off = rows[:, None] * stride_sm + gidx[None, :] * stride_sg
            if SCALE_KIND == 0:
                tl.store(sb + off, sval, mask=smask)
            else:
                tl.store(sb + off, sval.to(tl.uint8), mask=smask)
        elif SF_LAYOUT == 2:  # packed UE8M0: word (row, g // 4), byte g % 4; MN-major words
            w4 = tl.reshape(sval.to(tl.uint32), (BLOCK_M, GPP // 4, 4))
            sh = (tl.arange(0, 4) * 8).to(tl.uint32)
            words = tl.reduce(w4 << sh[None, None, :], 2, _or)
            widx = tl.program_id(1) * (GPP // 4) + tl.arange(0, GPP // 4)
            off = rows[:, None] * stride_sm + widx[None, :] * stride_sg
            wmask = (rows < M_PAD)[:, None] & (widx < NG_PAD // 4)[None, :]
            tl.store(sb + off, words.to(tl.int32, bitcast=True), mask=wmask)
        else:  # 128x4 swizzle: (r//128)*(NG_PAD/4)*512 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4
            r = rows[:, None]
            c = gidx[None, :]
            off = (r // 128) * (NG_PAD // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 \
                + ((r % 128) // 32) * 4 + (c % 4)
            tl.store(sb + off, sval.to(tl.uint8), mask=smask)
    return factor, nan_block


@triton.jit
def _amax3_bits(x, NONFINITE: tl.constexpr):
    """Block amax over the last axis of a [BM, GPP, G] tile as uint32 bits [BM, GPP]: an integer
    max of |x|'s bits (non-negative floats order like their bits; NaN sorts above Inf, so NaN
    propagates unless ignore_nan, TE's fmaxf). Combine partial amaxes in this integer domain:
    a float ``max`` would drop NaN on the GPU (max.f32 is maxNum)."""
    a = R.f32_bits(x) & 0x7FFFFFFF
    if NONFINITE == 1:
        a = tl.where(a > 0x7F800000, 0, a)
    return tl.max(a, axis=2)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax3(x, NONFINITE: tl.constexpr):
    """Block amax [BM, GPP] of a [BM, GPP, G] tile. When NaN propagates (NONFINITE 0, the NaN
    block, and 2) a float max that propagates NaN (``max.NaN.f32``: one FMNMX with the |x|
    operand modifier per element) gives the integer max of the bits (:func:`_amax3_bits`) up to
    the payload of a NaN amax, which nothing downstream keeps (NaN blocks store the NaN
    constant or code 0xFF/0x7F; GPU arithmetic on NaN returns the canonical NaN; the tests
    compare NaN scales as NaN). ``ignore_nan`` (1) needs the integer max."""
    if NONFINITE != 1:
        amax = tl.reduce(tl.abs(x), 2, _max_nan)
    else:
        amax = _amax3_bits(x, NONFINITE).to(tl.float32, bitcast=True)
    return amax


@triton.jit
def _amax_pair(xe, xo, NONFINITE: tl.constexpr):
    if NONFINITE != 1:
        amax = _max_nan(_amax3(xe, NONFINITE), _amax3(xo, NONFINITE))
    else:
        amax = tl.maximum(_amax3_bits(xe, NONFINITE),
                          _amax3_bits(xo, NONFINITE)).to(tl.float32, bitcast=True)
    return amax


@triton.jit
def _amax_loaded(amax_ptr, pid_b, M, rows, rmask, ROWS_PER_SCALE, GPP: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    sidx = (pid_b * M + rows) // ROWS_PER_SCALE
    amax1 = tl.load(amax_ptr + sidx, mask=rmask, other=0.0)
    return tl.zeros((BLOCK_M, GPP), tl.float32) + amax1[:, None]
