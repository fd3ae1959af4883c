"""Triton quantizers and dequantizers for the blockwise schemes of :mod:`moeref.quant`.

One kernel, :func:`_quant_kernel`, serves FP8 per-tensor / per-token / 1xG groups, MXFP8, MXFP4
and NVFP4: every knob of the scheme's :class:`~moeref.quant.scheme.Preset` (scale rule, amax floor,
zero-block and non-finite policy, how the scale is applied, element rounding, overflow, signed
zero, NaN code) becomes a ``tl.constexpr``, so each preset compiles to its own straight-line code.
The scale output is written directly in the layout the consuming GEMM reads:

``"row_major"``      the reference's scale grid ``[..., M, groups]`` (float32 or uint8 codes).
``"mn_major"``       DeepGEMM SM90 / cuBLAS 1x128: storage ``[..., groups, align(M, 16/itemsize)]``,
                     padding zero (:func:`moeref.layouts.to_mn_major_tma_aligned`).
``"packed_ue8m0"``   DeepGEMM SM100: int32 storage ``[..., ceil(groups/4), align(M, 4)]``, four
                     E8M0 bytes per word, K padding 0x00 (:func:`moeref.layouts.pack_ue8m0`).
``"swizzled_128x4"`` cuBLAS / CUTLASS block-scaled: flat ``[..., roundup(M,128) * roundup(groups,4)]``
                     bytes, padding zero (:func:`moeref.layouts.swizzle_128x4`).

Every padding element is WRITTEN by the kernel (the grid covers the padded extents), so output
buffers come from ``torch.empty`` and the tests poison them first.

Exactness: the arithmetic is the reference's, operation for operation, in float32:
``tl.math.div_rn`` for a division (Triton's ``/`` is an approximate ``div.full.f32`` on the
GPU), or, for the data divided by a per-group scale, :func:`_div_exact` (reciprocal per group,
one FMA correction per element, which gives the codes of ``RN(x / s)`` in a proven window,
``div_rn`` outside it), products and the block amax as in :mod:`moeref.quant.blockwise`, the
amax a NaN-propagating max of ``|x|`` (the integer max of the bit patterns: non-negative floats
order like their bits and NaN patterns sort above Inf; or ``max.NaN.f32`` where a NaN amax's
payload is not kept), E8M0 scales from exponent bits, and element codes from
:mod:`fastpath._triton_rounding`. On a GPU the FP8 element cast may instead use the hardware
``cvt.rn.satfinite`` (``hw_fp8=True``, the default on CUDA for saturating RNE presets): the GPU
suite checks that both give identical codes. NaN element codes are compared modulo their sign
bit: IEEE leaves the sign of a NaN produced by arithmetic unspecified (x86 yields -NaN for
0 * Inf, CUDA +NaN).

Tiles: a program quantizes ``BLOCK_M`` rows x ``GPP`` groups (about 4096 elements). FP8 uses
plain ``[BLOCK_M, GPP, GB]`` tiles. FP4 packs element pairs into bytes, and ``swigluoai`` reads
interleaved (gate, up) pairs: for contiguous 16-bit input both read int32 words, one pair per
word (16-byte loads, no shuffles; ``PAIR=1``); other inputs (float32, strided, odd K) take a
generic ``[.., GB/2, 2]`` tile split on its last axis (``PAIR=2``). Per-tensor and NVFP4 first
reduce the tensor amax (partial-amax kernel, one-program reduction), then quantize, unless the
scale is static (``scale=``; NVFP4 ``global_scale=``): then x is read once. NVFP4's data
factor is a function of the block's UE4M3 code alone: :func:`_nvfp4_factors` tabulates it per
tensor (127 codes, the order's own float32 divisions) and the data pass loads it. FP8 rows with
one scale per row longer than 4096 columns (per-token) take :func:`_row_loop_kernel` (two sweeps
per row, the second from cache). Tiles and warps come from sweeps on an H200 and an H100; the
device-specific choices are in :data:`_DEVICE_TILES`.
Measured speeds and their limits: docs/fastpaths.md.

Unsupported combinations (INT/FP6 elements, 2-D blocks, the ``signed_minmax`` and
``encode_decode_pair`` FP32 rules, groups wider than 32768) are refused by :func:`supports` with the
reason; :func:`quantize` raises ``ValueError`` with it. Nothing falls back silently.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from moeref.quant.scheme import Scheme

from . import _packed_fp4 as PK
from ._host import alloc as _alloc  # every buffer the kernels write (the tests' poisoning hook)
from ._host import next_pow2 as _next_pow2
from . import _triton_rounding as R

__all__ = [
    "SCALE_LAYOUTS",
    "FastQuantized",
    "supports",
    "quantize",
    "dequantize",
    "scale_storage_shape",
]

SCALE_LAYOUTS = ("row_major", "mn_major", "packed_ue8m0", "swizzled_128x4")
MAX_GROUP = 32768


_ELEM = {"e4m3fn": 0, "e5m2": 1, "e2m1": 2}
_ELEM_MAX = {"e4m3fn": 448.0, "e5m2": 57344.0, "e2m1": 6.0}
_ELEM_EMAX = {"e4m3fn": 8, "e5m2": 15, "e2m1": 2}
_ELEM_MBITS = {"e4m3fn": 3, "e5m2": 2, "e2m1": 1}
_SCALE_KIND = {"fp32": 0, "ue8m0": 1, "ue4m3": 2}
_E8M0_RULE = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3, "ceil_div": 4}
_E8M0_NONFINITE = {"nan": 0, "satfinite": 1, "clamp": 2}
_NONFINITE = {"nan_block": 0, "ignore_nan": 1, "propagate": 2}
_ZERO_BLOCK = {"rule": 0, "one": 1, "zero": 2}
_APPLY = {"mul_recip": 0, "div": 1, "mul_encode": 2}
_FP32_RULE = {"amax_over_max": 0, "te": 1, "amax_times_recip_max": 2}
_ROUND = {"rne": 0, "ties_toward_zero": 1, "ties_away": 2}
_SF_LAYOUT = {"row_major": 0, "mn_major": 0, "packed_ue8m0": 2, "swizzled_128x4": 3}
# NVFP4 op orders (moeref.quant.nvfp4 options "order"): see _nvfp4_block_scale
_NVFP4_ORDER = {"te": 0, "flashinfer": 1, "vllm": 1, "torchao": 2}


def _f32(v: float) -> float:
    """Python float holding exactly the float32 nearest to ``v`` (constants are passed this way so
    the kernel and the NumPy reference use the same float32 constant)."""
    return float(np.float32(v))


# ============================================================================ device helpers


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
        elif FP32_RULE == 0 or FP32_RULE == 2:
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
        else:  # "te": e = M / a (FLT_MAX on overflow, 1 for a == 0 or Inf), dec = 1 / e
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
def _swiglu(g, u, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """gpt-oss SwiGLU in float32: ``(clip(u, -L, L) + 1) * min(g, L) * sigmoid(ALPHA * min(g, L))``;
    NaN propagates through the clamps as NumPy's ``minimum``/``clip`` do."""
    g = tl.minimum(g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                   propagate_nan=tl.PropagateNan.ALL)
    return (u + 1.0) * g * tl.sigmoid(ALPHA * g)


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
    """
    if ACT == 1:
        g = tl.load(rp + k * stride_xk, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(rp + (k + N) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        out = g * tl.sigmoid(g) * u
    else:
        g = tl.load(rp + (2 * k) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(rp + (2 * k + 1) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        out = _swiglu(g, u, ALPHA, LIMIT)
    return out


# ============================================================================ the kernel


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
def _quant_kernel(
    x_ptr, stride_xb, stride_xm, stride_xk,
    c_ptr, stride_cb, stride_cm,
    s_ptr, stride_sb, stride_sm, stride_sg,
    amax_ptr, static_ptr, nv_ptr,
    M, K, NG, M_PAD, NG_PAD, ROWS_PER_SCALE,
    GS: tl.constexpr, GB: tl.constexpr, GPP: tl.constexpr, BLOCK_M: tl.constexpr,
    ELEM: tl.constexpr, ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr,
    MBITS: tl.constexpr, SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr,
    FP32_POW2: tl.constexpr, E8_RULE: tl.constexpr, E8_LO: tl.constexpr, E8_HI: tl.constexpr,
    E8_NF: tl.constexpr, AMAX_FLOOR: tl.constexpr, ZERO_BLOCK: tl.constexpr,
    NONFINITE: tl.constexpr, APPLY: tl.constexpr, SATURATE: tl.constexpr, ROUND: tl.constexpr,
    DROP_NEG_ZERO: tl.constexpr, NAN_CODE: tl.constexpr, FILL_CODE: tl.constexpr,
    HW_FP8: tl.constexpr, SF_LAYOUT: tl.constexpr, AMAX_SRC: tl.constexpr, STATIC: tl.constexpr,
    TWO_LEVEL: tl.constexpr, NV_ORDER: tl.constexpr, WRITE_SCALES: tl.constexpr,
    ACT: tl.constexpr, ACT_ALPHA: tl.constexpr, ACT_LIMIT: tl.constexpr,
    PAIR: tl.constexpr, IN16: tl.constexpr, DIV: tl.constexpr, PACKED_BF16: tl.constexpr,
    E2M1_PTX: tl.constexpr, HW_SCALE: tl.constexpr, WORD_RUN: tl.constexpr,
):
    """Quantize a [BLOCK_M, GPP groups of GS] tile of one matrix of x; see the module docstring.

    AMAX_SRC: 0 = block amax from the tile, 1 = per-scale amax read from ``amax_ptr`` (per-tensor:
    one amax per ROWS_PER_SCALE rows). ACT: 0 = x is the input; 1 = silu_and_mul of a gate_up
    input [.., 2K]; 2 = swigluoai of an interleaved input [.., 2K] (fastpath.fused).

    PAIR picks how element pairs are read (FP4 packs pairs into a byte; swigluoai's (gate, up) are
    adjacent): 0 = plain [BLOCK_M, GPP, GB] tiles (FP8); 1 = 16-bit input read as int32 words,
    each word one pair (contiguous rows, even K: 16-byte loads, no shuffles); 2 = generic
    [BLOCK_M, GPP, GB/2, 2] tiles split on the last axis (any strides, any K; slower).

    PACKED_BF16 (GPU only; see ``_constexprs_cached``): with PAIR 1 bfloat16 words and E8M0
    factors, the FP4 branch takes the block amax and the E2M1 RNE codes straight from the words
    with packed bf16x2 PTX (:mod:`fastpath._packed_fp4`, two elements per instruction), the
    same codes as the integer path (tests/test_mxfp4_packed_encode.py emulates the PTX over
    every pattern and factor; the GPU suite compares both paths).

    E2M1_PTX (GPU only): the other FP4 paths (NVFP4, float16/float32 input) encode each scaled
    float32 value with :func:`fastpath._packed_fp4.e2m1_lane_f32` (``xorsign`` min/max, one FMA,
    integer steps: about 7 instructions, the sign carried along) instead of the integer path,
    and bfloat16 words take the block amax with ``amax_bf16x2``; same codes (emulated on the
    CPU, compared with the integer path on the GPU).
    """
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_b = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    gidx = pid_g * GPP + tl.arange(0, GPP)
    rmask = rows < M
    xb = x_ptr + pid_b.to(tl.int64) * stride_xb
    cb = c_ptr + pid_b.to(tl.int64) * stride_cb
    # 1. load the tile and take its block amax (per layout of the element pairs)
    if PAIR == 1 and ELEM == 2 and ACT == 0:
        # ---- FP4 from 16-bit words: word w of a row = elements (2w, 2w+1) = output byte w
        jw = tl.arange(0, GB // 2)
        # (jw // RUN) * RUN + jw % RUN is jw, but Triton's contiguity analysis then sees runs of
        # RUN words, which sets how many contiguous words each thread loads per group (RUN 4:
        # 16 bytes, and a warp's load instruction covers contiguous memory; RUN GB/2: the whole
        # group per thread, no shuffles for its amax but 2-4x the cache lines per instruction)
        RUN: tl.constexpr = min(WORD_RUN, GB // 2) if WORD_RUN > 0 else GB // 2
        jw = (jw // RUN) * RUN + jw % RUN
        w = gidx[:, None] * (GS // 2) + jw[None, :]  # [GPP, GB/2]
        wm = (jw[None, :] < GS // 2) & (w < K // 2)
        m3 = rmask[:, None, None] & wm[None, :, :]
        words = tl.load(xb + rows.to(tl.int64)[:, None, None] * stride_xm + w[None, :, :] * stride_xk,
                        mask=m3, other=0)
        PACKED: tl.constexpr = PACKED_BF16 and IN16 == 1 and SCALE_KIND == 1 and not TWO_LEVEL
        if not PACKED:
            xe, xo = _unpack_pair(words, IN16)
        if AMAX_SRC == 0:
            if PACKED or (E2M1_PTX and IN16 == 1):
                amax = PK.amax_bf16x2(words, NONFINITE == 1)
            else:
                amax = _amax_pair(xe, xo, NONFINITE)
    elif PAIR == 2 and ELEM == 2:
        # ---- FP4, generic strides: [BM, GPP, GB/2, 2] tile split into the pair halves
        jj = tl.arange(0, GB // 2)
        tt = tl.arange(0, 2)
        kin = 2 * jj[:, None] + tt[None, :]  # [GB/2, 2]
        k = gidx[:, None, None] * GS + kin[None, :, :]
        kmask = (kin[None, :, :] < GS) & (k < K)
        m4 = rmask[:, None, None, None] & kmask[None, :, :, :]
        x = tl.load(xb + rows.to(tl.int64)[:, None, None, None] * stride_xm + k[None, :, :, :] * stride_xk,
                    mask=m4, other=0.0).to(tl.float32)
        xe, xo = tl.split(x)
        if AMAX_SRC == 0:
            amax = _amax_pair(xe, xo, NONFINITE)
    else:
        # ---- FP8 codes, one per byte: a [BM, GPP, GB] tile
        kin = tl.arange(0, GB)
        k = gidx[:, None] * GS + kin[None, :]  # [GPP, GB]
        kmask = (kin[None, :] < GS) & (k < K)
        m3 = rmask[:, None, None] & kmask[None, :, :]
        rp = xb + rows.to(tl.int64)[:, None, None] * stride_xm
        k3 = k[None, :, :]
        if ACT == 0:
            x = tl.load(rp + k3 * stride_xk, mask=m3, other=0.0).to(tl.float32)
        elif ACT == 1:
            x = _activation(rp, k3, stride_xk, K, m3, ACT, ACT_ALPHA, ACT_LIMIT)
        elif PAIR == 1:  # swigluoai from int32 words: word k = (gate_k, up_k)
            words = tl.load(rp + k3 * stride_xk, mask=m3, other=0)
            g, u = _unpack_pair(words, IN16)
            x = _swiglu(g, u, ACT_ALPHA, ACT_LIMIT)
        else:
            x = _activation(rp, k3, stride_xk, K, m3, ACT, ACT_ALPHA, ACT_LIMIT)
        if AMAX_SRC == 0:
            amax = _amax3(x, NONFINITE)
    if AMAX_SRC != 0:
        amax = _amax_loaded(amax_ptr, pid_b, M, rows, rmask, ROWS_PER_SCALE, GPP, BLOCK_M)

    # 2. the scales (written in their layout) and the data factor
    factor, nan_block = _tile_scales(
        amax, rows, gidx, pid_b, s_ptr, stride_sb, stride_sm, stride_sg, static_ptr, nv_ptr,
        M, NG, M_PAD, NG_PAD, GPP, BLOCK_M, ELEM_MAX, INV_M, EMAX, MBITS,
        SCALE_KIND, FP32_RULE, FP32_POW2, E8_RULE, E8_LO, E8_HI, E8_NF, AMAX_FLOOR,
        ZERO_BLOCK, NONFINITE, APPLY, SF_LAYOUT, STATIC, TWO_LEVEL, NV_ORDER, WRITE_SCALES,
        HW_SCALE)

    # 3. the codes, stored
    if PAIR == 1 and ELEM == 2 and ACT == 0:
        f3 = factor[:, :, None]
        nb3 = nan_block[:, :, None]
        if PACKED:  # E2M1 RNE on the bf16 pairs (fastpath._packed_fp4), NaN policy included
            ow, ov = PK.nan_overwrite(words, f3, nb3, NONFINITE, FILL_CODE, NAN_CODE)
            byte = PK.encode_e2m1x4_rne(words, PK.bf16x2_factor(factor)[:, :, None], ow, ov)
        else:
            ce, co = _fp4_pair_codes(xe, xo, f3, nb3, SATURATE, ROUND, NAN_CODE, NONFINITE,
                                     FILL_CODE, TWO_LEVEL, NV_ORDER, DROP_NEG_ZERO, SCALE_KIND,
                                     APPLY, DIV, STATIC, E2M1_PTX)
            byte = _fp4_bytes(ce, co, E2M1_PTX)
        tl.store(cb + rows.to(tl.int64)[:, None, None] * stride_cm + w[None, :, :], byte, mask=m3)
    elif PAIR == 2 and ELEM == 2:
        ce, co = _fp4_pair_codes(xe, xo, factor[:, :, None], nan_block[:, :, None], SATURATE,
                                 ROUND, NAN_CODE, NONFINITE, FILL_CODE, TWO_LEVEL, NV_ORDER,
                                 DROP_NEG_ZERO, SCALE_KIND, APPLY, DIV, STATIC, E2M1_PTX)
        me, mo = tl.split(m4)
        ce = tl.where(me, ce, 0)
        co = tl.where(mo, co, 0)  # the nibble padding an odd K is a +0 code
        byte = _fp4_bytes(ce, co, E2M1_PTX)
        kp = gidx[:, None] * (GS // 2) + jj[None, :]
        pm = (jj[None, :] < (GS + 1) // 2) & (kp < (K + 1) // 2)
        tl.store(cb + rows.to(tl.int64)[:, None, None] * stride_cm + kp[None, :, :], byte,
                 mask=rmask[:, None, None] & pm[None, :, :])
    else:
        code8 = _fp8_codes(x, factor, nan_block, ELEM, SATURATE, ROUND, NAN_CODE, HW_FP8,
                           NONFINITE, FILL_CODE, DROP_NEG_ZERO, SCALE_KIND, APPLY, DIV, STATIC)
        tl.store(cb + rows.to(tl.int64)[:, None, None] * stride_cm + k3, code8, mask=m3)


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


@triton.jit
def _row_loop_kernel(
    x_ptr, stride_xb, stride_xm, stride_xk,
    c_ptr, stride_cb, stride_cm,
    s_ptr, stride_sb, stride_sm,
    static_ptr, M, K, M_PAD,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
    ELEM: tl.constexpr, ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr,
    MBITS: tl.constexpr, SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr,
    FP32_POW2: tl.constexpr, E8_RULE: tl.constexpr, E8_LO: tl.constexpr, E8_HI: tl.constexpr,
    E8_NF: tl.constexpr, AMAX_FLOOR: tl.constexpr, ZERO_BLOCK: tl.constexpr,
    NONFINITE: tl.constexpr, APPLY: tl.constexpr, SATURATE: tl.constexpr, ROUND: tl.constexpr,
    DROP_NEG_ZERO: tl.constexpr, NAN_CODE: tl.constexpr, FILL_CODE: tl.constexpr,
    HW_FP8: tl.constexpr, STATIC: tl.constexpr, DIV: tl.constexpr,
):
    """FP8 with ONE scale per row (per-token, or a 1xG group as wide as the row) for long rows:
    ``BLOCK_M`` rows per program, swept twice in ``BLOCK_K``-column chunks, first for the row
    amax, then for the codes (the second sweep re-reads the rows, which the first has just
    brought into L1/L2: HBM sees each byte once). Unlike one [BM, 1, next_pow2(K)] tile, no
    lanes idle on padding (7168 columns in an 8192 tile waste 12.5%), and any K fits. Same
    helpers, hence the same arithmetic and codes, as :func:`_quant_kernel`; scales row-major
    (``stride_sm``: MN-major storage of one group is the same vector, padded to M_PAD)."""
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rp = x_ptr + pid_b.to(tl.int64) * stride_xb + rows.to(tl.int64)[:, None, None] * stride_xm
    cp = c_ptr + pid_b.to(tl.int64) * stride_cb + rows.to(tl.int64)[:, None, None] * stride_cm
    kk = tl.arange(0, BLOCK_K)[None, None, :]
    amax = tl.zeros((BLOCK_M, 1), tl.float32)
    for i in range(K_ITERS):
        k = i * BLOCK_K + kk
        m = rmask[:, None, None] & (k < K)
        x = tl.load(rp + k * stride_xk, mask=m, other=0.0).to(tl.float32)
        if NONFINITE != 1:
            amax = _max_nan(amax, _amax3(x, NONFINITE))
        else:  # the integer max of the bits (NaN ignored)
            amax = tl.maximum(R.f32_bits(amax), _amax3_bits(x, NONFINITE)).to(tl.float32, bitcast=True)
    gidx = tl.arange(0, 1)
    factor, nan_block = _tile_scales(
        amax, rows, gidx, pid_b, s_ptr, stride_sb, stride_sm, 0, static_ptr, static_ptr,
        M, 1, M_PAD, 1, 1, BLOCK_M, ELEM_MAX, INV_M, EMAX, MBITS,
        SCALE_KIND, FP32_RULE, FP32_POW2, E8_RULE, E8_LO, E8_HI, E8_NF, AMAX_FLOOR,
        ZERO_BLOCK, NONFINITE, APPLY, 0, STATIC, False, 0, True, False)
    for i in range(K_ITERS):
        k = i * BLOCK_K + kk
        m = rmask[:, None, None] & (k < K)
        x = tl.load(rp + k * stride_xk, mask=m, other=0.0).to(tl.float32)
        code8 = _fp8_codes(x, factor, nan_block, ELEM, SATURATE, ROUND, NAN_CODE, HW_FP8,
                           NONFINITE, FILL_CODE, DROP_NEG_ZERO, SCALE_KIND, APPLY, DIV, STATIC)
        tl.store(cp + k, code8, mask=m)


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


@triton.jit
def _amax_partial_kernel(x_ptr, stride_xb, stride_xm, stride_xk, p_ptr, M, K, NPROG,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NONFINITE: tl.constexpr):
    """Partial amax (float32 bits max; NaN above Inf, so it propagates unless NONFINITE 1
    ignores it) of one [BLOCK_M, BLOCK_K] tile of one matrix of x:
    ``p[b * NPROG + pid_m * cdiv(K, BLOCK_K) + pid_k]``. One tile per program and no loop, like
    the data pass: a looped accumulator held 64 registers per thread and the loads waited
    (H200, 2026-11-21: 69% of copy)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows < M)[:, None] & (kk < K)[None, :]
    base = x_ptr + pid_b.to(tl.int64) * stride_xb + rows.to(tl.int64)[:, None] * stride_xm
    x = tl.load(base + kk[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)
    a = R.f32_bits(x) & 0x7FFFFFFF
    if NONFINITE == 1:
        a = tl.where(a > 0x7F800000, 0, a)
    pid = pid_m * tl.num_programs(1) + pid_k
    tl.store(p_ptr + pid_b * NPROG + pid, tl.max(tl.max(a, axis=1), axis=0))


@triton.jit
def _amax_final_kernel(p_ptr, out_ptr, NPROG_M, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """out[b] = max of the partial amax bit patterns of matrix b, as float32."""
    pid_b = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.uint32)
    for it in range(ITERS):
        idx = it * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(p_ptr + pid_b * NPROG_M + idx, mask=idx < NPROG_M, other=0)
        acc = tl.maximum(acc, v)
    tl.store(out_ptr + pid_b, tl.max(acc, axis=0).to(tl.float32, bitcast=True))


@triton.jit
def _per_tensor_scale_kernel(amax_ptr, s_ptr, static_ptr, B,
                             BLOCK: tl.constexpr,
                             ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr,
                             MBITS: tl.constexpr, SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr,
                             FP32_POW2: tl.constexpr, E8_RULE: tl.constexpr, E8_LO: tl.constexpr,
                             E8_HI: tl.constexpr, E8_NF: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                             ZERO_BLOCK: tl.constexpr, NONFINITE: tl.constexpr, APPLY: tl.constexpr,
                             STATIC: tl.constexpr):
    """The stored per-tensor scale of each matrix (the same _block_scales as the data pass)."""
    idx = tl.arange(0, BLOCK)
    m = idx < B
    amax = tl.load(amax_ptr + idx, mask=m, other=0.0)
    if STATIC:
        static_dec = tl.load(static_ptr)
    else:
        static_dec = 0.0
    stored_f, stored_i, factor, nan_block = _block_scales(
        amax, ELEM_MAX, INV_M, EMAX, MBITS, SCALE_KIND, FP32_RULE, FP32_POW2, E8_RULE, E8_LO,
        E8_HI, E8_NF, AMAX_FLOOR, ZERO_BLOCK, NONFINITE, APPLY, STATIC, static_dec, 1.0, 1.0, 0,
        static_ptr, False)
    if SCALE_KIND == 0:
        tl.store(s_ptr + idx, stored_f, mask=m)
    else:
        tl.store(s_ptr + idx, stored_i.to(tl.uint8), mask=m)


@triton.jit
def _nvfp4_factors(a_ptr, b_ptr, nv_ptr, glob_ptr, FROM_AMAX: tl.constexpr, ORDER: tl.constexpr,
                   GLOB: tl.constexpr):
    """The NVFP4 tensor factors the data pass reads, as one float32 buffer ``nv[130]``:
    ``nv[0]`` = S_enc, ``nv[1]`` = the decode scale pts, ``nv[2 + c]`` = the data factor of a
    block whose UE4M3 scale code is ``c`` (c < 127; ``nv[129]``, the NaN code's, is NaN).

    FROM_AMAX: ``a_ptr`` holds the tensor amax A (moeref.quant.nvfp4._nvfp4_rule's global step):
    TE: S_enc = min(fl(2688 / A), FLT_MAX), 1 if that is 0 or A == 0; FlashInfer/vLLM:
    S_enc = fl(2688 / A), 1 if A == 0 (no clamp); torchao: pts = fl(A / 2688). Otherwise S_enc
    and pts are read from ``a_ptr`` and ``b_ptr`` (a static scale: an order reads only its own).

    The data factor depends on the block only through its scale code ``s`` (decoded exactly), so
    the division the reference does per block is done here once per code, in the order's float32
    operations: TE ``min(1 / fl(s * fl(1/S_enc)), FLT_MAX)``; FlashInfer/vLLM
    ``rcp0(fl(s * rcp0(S_enc)))`` with ``rcp0(0) := 0``; torchao ``fl(fl(1/pts) / s)`` (0 for
    pts == 0, the zero tensor). All divisions are ``div_rn`` (correctly rounded).

    ``glob_ptr`` gets the reference's float64 decode factor (``QuantizedTensor.global_scale``):
    GLOB 0 ``fl64(A / 2688)`` (an amax convention), 1 ``pts`` (torchao), 2 ``fl64(1 / S_enc)``;
    0 for a zero tensor amax. (float64 ``/`` is ``div.rn.f64``.)"""
    if FROM_AMAX:
        amax = tl.load(a_ptr)
        s_enc = tl.math.div_rn(2688.0, amax)
        if ORDER == 0:
            s_enc = tl.minimum(s_enc, 3.4028234663852886e38)
            s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)
        g_enc = tl.where(amax == 0.0, 1.0, s_enc)
        g_dec = tl.math.div_rn(amax, 2688.0)
    else:
        g_enc = tl.load(a_ptr)
        g_dec = tl.load(b_ptr)
    code = tl.arange(0, 128)
    sdec = R.decode_minifloat(code, 4, 3, 7, False, 1)
    one = tl.full(sdec.shape, 1.0, tl.float32)
    ge = tl.zeros(sdec.shape, tl.float32) + g_enc
    if ORDER == 0:
        gd = tl.math.div_rn(one, ge)
        factor = tl.minimum(tl.math.div_rn(one, sdec * gd), 3.4028234663852886e38)
    elif ORDER == 1:
        gd = tl.where(ge == 0.0, 0.0, tl.math.div_rn(one, ge))
        den = sdec * gd
        factor = tl.where(den == 0.0, 0.0, tl.math.div_rn(one, den))
    else:
        gp = tl.zeros(sdec.shape, tl.float32) + g_dec
        factor = tl.math.div_rn(tl.math.div_rn(one, gp), sdec)
        factor = tl.where(gp == 0.0, 0.0, factor)
    factor = tl.where(code == 127, float("nan"), factor)
    tl.store(nv_ptr + 2 + code, factor)
    head = tl.arange(0, 2)
    tl.store(nv_ptr + head, tl.where(head == 0, g_enc, g_dec))
    one64 = tl.full((2,), 1.0, tl.float64)
    if GLOB == 0:
        glob = (tl.zeros((2,), tl.float32) + tl.load(a_ptr)).to(tl.float64) / (one64 * 2688.0)
    elif GLOB == 1:
        glob = (tl.zeros((2,), tl.float32) + g_dec).to(tl.float64)
    else:
        glob = one64 / (tl.zeros((2,), tl.float32) + g_enc).to(tl.float64)
    if FROM_AMAX:
        glob = tl.where(tl.load(a_ptr) == 0.0, 0.0, glob)
    tl.store(glob_ptr + head, glob, mask=head == 0)


# ============================================================================ host side


@dataclass(frozen=True)
class FastQuantized:
    """Output of :func:`quantize`: device tensors plus what is needed to read them.

    Attributes:
        codes: uint8 ``[..., M, K]`` (FP8) or ``[..., M, ceil(K/2)]`` (FP4, even element low).
        scales: the scale storage in ``scale_layout`` (see the module docstring); for per-tensor
            schemes ``[..., 1, 1]`` float32/uint8.
        scale_layout: one of :data:`SCALE_LAYOUTS`.
        scheme: the :class:`~moeref.quant.scheme.Scheme`.
        shape: logical shape of x.
        global_scale: float64 tensor ``[1]``: the NVFP4 decode factor exactly as the reference's
            ``QuantizedTensor.global_scale`` (``A/2688``, ``1/S_enc`` or torchao's ``pts``,
            computed in float64 from the float32 quantity of the preset's convention), or None.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    scale_layout: str
    scheme: Scheme
    shape: tuple
    global_scale: torch.Tensor | None = None

    @property
    def grid(self) -> tuple[int, ...]:
        """Logical scale grid shape (the reference's ``QuantizedTensor.scales.shape``)."""
        from moeref.quant.blockwise import grid_shape
        return grid_shape(self.shape, self.scheme.resolve_block(self.shape))

    def scales_logical(self) -> np.ndarray:
        """The scales as the reference's grid (NumPy), read back through moeref.layouts inverses."""
        from moeref import layouts
        from moeref._interop import to_numpy

        g = self.grid
        s = to_numpy(self.scales.cpu())
        if self.scale_layout == "row_major":
            return np.ascontiguousarray(s).reshape(g)
        mn, ng = g[-2], g[-1]
        if self.scale_layout == "mn_major":
            return layouts.from_mn_major_tma_aligned(s, mn=mn).reshape(g)
        if self.scale_layout == "packed_ue8m0":
            v = np.swapaxes(s, -1, -2)[..., :mn, :]
            return layouts.unpack_ue8m0(v, ng, as_codes=True).reshape(g)
        return layouts.unswizzle_128x4(s, mn, ng).reshape(g)

    def to_reference(self):
        """A :class:`moeref.quant.QuantizedTensor` with these codes and scales (host copies)."""
        from moeref.quant import QuantizedTensor

        gs = None
        if self.global_scale is not None:
            gs = float(self.global_scale.reshape(-1)[0].item())
        return QuantizedTensor(codes=self.codes.cpu().numpy(), scales=self.scales_logical(),
                               scheme=self.scheme, shape=self.shape, global_scale=gs)


def _kind(scheme: Scheme) -> str | None:
    """"per_tensor", "rows" (per-token / 1xG groups) or None for unsupported blocks."""
    b = scheme.block
    if len(b) == 2 and b[0] is None and b[1] is None:
        return "per_tensor"
    if len(b) == 2 and b[0] == 1:
        return "rows"
    if len(b) == 1:
        return "rows"
    return None


def supports(scheme: Scheme | None = None, x=None, scale_layout: str = "row_major", **_) -> tuple[bool, str]:
    """Whether :func:`quantize` can run ``scheme`` on ``x`` with ``scale_layout`` here, and why not.

    Checks the environment (a CUDA device, or TRITON_INTERPRET=1 for CPU tensors), the scheme
    (element, block shape, preset knobs) and the layout (packed UE8M0 needs UE8M0 scales; the
    swizzle needs 1-byte scales).
    """
    import os

    if x is not None and isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return False, "x is a CPU tensor and TRITON_INTERPRET=1 is not set (no GPU to run on)"
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False, f"x dtype {x.dtype} not supported (float32, bfloat16, float16)"
        if x.dim() < 1 or x.dim() > 3:
            return False, f"x must have 1 to 3 dims; got {x.dim()}"
    elif not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return False, "no CUDA device and TRITON_INTERPRET is not 1"
    if scheme is None:
        return True, "ok"
    if not isinstance(scheme, Scheme):
        return False, f"scheme must be a moeref Scheme; got {type(scheme).__name__}"
    if scale_layout not in SCALE_LAYOUTS:
        return False, f"scale_layout {scale_layout!r} is not one of {SCALE_LAYOUTS}"
    if scheme.element not in _ELEM:
        return False, f"element {scheme.element!r} has no Triton kernel (supported: {', '.join(_ELEM)})"
    if scheme.family not in ("blockwise", "nvfp4"):
        return False, f"family {scheme.family!r} has no Triton kernel"
    if scheme.zero_point or scheme.channel_block:
        return False, "zero points / channel scales have no Triton kernel"
    kind = _kind(scheme)
    if kind is None:
        return False, f"block {scheme.block} has no Triton kernel (per-tensor, per-token and 1xG only)"
    p = scheme.preset
    if scheme.scale_format == "fp32" and p.fp32_rule not in _FP32_RULE:
        return False, f"fp32_rule {p.fp32_rule!r} has no Triton kernel"
    if p.element_max is not None and p.element_max != _ELEM_MAX[scheme.element]:
        return False, "element_max override has no Triton kernel"
    if scheme.family == "nvfp4":
        if scheme.scale_format != "ue4m3" or scheme.block[-1] != 16 or kind != "rows":
            return False, "NVFP4 kernel covers the 1x16 UE4M3 recipe only"
        if p.option("nvfp4_order") not in _NVFP4_ORDER:
            return False, f"NVFP4 order {p.option('nvfp4_order')!r} has no Triton kernel"
    elif scheme.scale_format == "ue4m3":
        return False, "UE4M3 scales belong to the nvfp4 family"
    if scheme.element == "e2m1" and p.overflow != "saturate":
        pass  # E2M1 always saturates (the codec refuses inf_nan for it)
    if kind == "per_tensor" and scale_layout != "row_major":
        return False, "per-tensor scales have only the row_major layout"
    if scale_layout == "packed_ue8m0" and scheme.scale_format != "ue8m0":
        return False, "packed_ue8m0 needs UE8M0 scales"
    if scale_layout == "swizzled_128x4" and scheme.scale_format == "fp32":
        return False, "the 128x4 swizzle holds 1-byte scales (UE8M0/UE4M3), not FP32"
    if x is not None:
        K = int(x.shape[-1])
        gs = scheme.resolve_block(tuple(x.shape))[-1]
        if kind == "rows" and gs > MAX_GROUP and not _row_loop_applies(
                -(-K // gs), gs, K, scheme.element == "e2m1", scale_layout):
            return False, (f"group of {gs} elements exceeds the tile kernel's limit {MAX_GROUP} "
                           "(only one FP8 scale per row, row_major/mn_major, has a looped kernel)")
        if scheme.element == "e2m1" and gs % 2 and gs < K:
            return False, "FP4 groups of odd size are not supported"
        if scheme.element == "e2m1" and kind == "per_tensor" and K % 2:
            return False, "per-tensor FP4 with odd K is not supported"
        if kind == "per_tensor" and scheme.static_scale is None and x.dim() < 1:
            return False, "per-tensor needs at least one axis"
    return True, "ok"


def scale_storage_shape(shape, scheme: Scheme, scale_layout: str) -> tuple[tuple[int, ...], torch.dtype, tuple]:
    """(storage shape, dtype, (M_PAD, NG_PAD, stride_sm, stride_sg)) of the scale output."""
    from moeref.quant.blockwise import grid_shape
    g = grid_shape(tuple(shape), scheme.resolve_block(tuple(shape)))
    mn, ng = (g[-2], g[-1]) if len(g) >= 2 else (1, g[-1])
    lead = tuple(g[:-2])
    fp32 = scheme.scale_format == "fp32"
    dt = torch.float32 if fp32 else torch.uint8
    if scale_layout == "row_major":
        return g, dt, (mn, ng, ng, 1)
    if scale_layout == "mn_major":
        align = 4 if fp32 else 16
        mp = -(-mn // align) * align
        return lead + (ng, mp), dt, (mp, ng, 1, mp)
    if scale_layout == "packed_ue8m0":
        mp = -(-mn // 4) * 4
        nw = -(-ng // 4)
        return lead + (nw, mp), torch.int32, (mp, nw * 4, 1, mp)
    mp = -(-mn // 128) * 128
    gp = -(-ng // 4) * 4
    return lead + (mp * gp,), torch.uint8, (mp, gp, 0, 0)


# Triton decides at decoration (import) time whether the kernels run in its interpreter
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _constexprs(scheme: Scheme, hw_fp8: bool) -> dict:
    """The kernel's compile-time knobs for ``scheme`` (cached per scheme, cast path and
    interpreter mode). ``DIV``: how ``x / s`` is computed (see :func:`_scale_data`): 1 with the
    hardware FMA, 2 under Triton's interpreter (float64-emulated FMA)."""
    return _constexprs_cached(scheme, bool(hw_fp8), _INTERPRETED)


@functools.lru_cache(maxsize=256)
def _constexprs_cached(scheme: Scheme, hw_fp8: bool, interp: bool) -> dict:
    p = scheme.preset
    el = scheme.element
    M = _ELEM_MAX[el]
    rounding = p.rounding_for(el) if hasattr(p, "rounding_for") else p.rounding
    signed_zero = p.signed_zero_for(el) if hasattr(p, "signed_zero_for") else p.signed_zero
    nan_code = p.nan_code_for(el) if p.nan_code_for(el) is not None else 0
    if el == "e4m3fn":
        fill = 0x7F
    elif el == "e5m2":
        fill = 0x7E
    else:
        fill = nan_code
    return dict(
        ELEM=_ELEM[el], ELEM_MAX=M, INV_M=_f32(1.0 / M), EMAX=_ELEM_EMAX[el],
        MBITS=_ELEM_MBITS[el], SCALE_KIND=_SCALE_KIND[scheme.scale_format],
        FP32_RULE=_FP32_RULE.get(p.fp32_rule, 0), FP32_POW2=bool(p.fp32_pow2),
        E8_RULE=_E8M0_RULE[p.e8m0_rule], E8_LO=int(p.e8m0_clamp[0]), E8_HI=int(p.e8m0_clamp[1]),
        E8_NF=_E8M0_NONFINITE[p.e8m0_nonfinite], AMAX_FLOOR=_f32(p.amax_floor),
        ZERO_BLOCK=_ZERO_BLOCK[p.zero_block], NONFINITE=_NONFINITE[p.nonfinite],
        APPLY=_APPLY[p.apply], SATURATE=(p.overflow == "saturate") or el == "e2m1",
        ROUND=_ROUND[rounding], DROP_NEG_ZERO=(signed_zero == "drop"), NAN_CODE=nan_code,
        FILL_CODE=fill,
        HW_FP8=bool(hw_fp8 and el != "e2m1" and p.overflow == "saturate" and rounding == "rne"),
        DIV=2 if interp else 1,
        # packed bf16x2 PTX encode for MXFP4 (fastpath._packed_fp4): GPU only (the interpreter
        # runs no inline asm), E2M1 + E8M0 + RNE + signed zero kept, single-level; the kernel
        # also requires bfloat16 words (PAIR 1, IN16 1) and no activation. hw_fp8=False keeps the
        # integer path (the GPU tests compare the two).
        PACKED_BF16=bool(hw_fp8 and not interp and el == "e2m1" and scheme.scale_format == "ue8m0"
                         and rounding == "rne" and signed_zero != "drop"
                         and scheme.family != "nvfp4"),
        # the other E2M1 RNE paths (NVFP4, 16-bit float16 / float32 input) encode through
        # fastpath._packed_fp4.e2m1_lane_f32 (GPU only, signed zeros kept or TE's +0 rule)
        E2M1_PTX=bool(hw_fp8 and not interp and el == "e2m1" and rounding == "rne"
                      and signed_zero != "drop"),
        # NVFP4's UE4M3 block scale by the hardware cast (cvt.rn.satfinite.e4m3x2.f32, exact
        # RNE of a value in [0, 448]); the interpreter's FP8 cast is wrong, so not there
        HW_SCALE=bool(hw_fp8 and not interp and scheme.scale_format == "ue4m3"),
    )


# dequantize tiles: elements per program and warps (H200 sweep, bench_quant_gpu.py --tune,
# 2026-11-21: 4096-element tiles; with the 8-byte code loads 3.62 TB/s on 8 warps vs 3.58 on 4,
# about the run-to-run spread; 1x128 groups: see _tile)
_DQ_ELEMS = 4096
_DQ_WARPS = 8


def _tile(gs: int, block_m: int | None, gpp: int | None, layout: str, ng: int, elems: int = 4096,
          role: str = "quant"):
    """(GB, GPP, BLOCK_M): pow2 group block, groups per program, rows per program (about
    ``elems`` elements per program; the packed UE8M0 layout needs whole int32 words, 4 groups).

    1x128 groups (``role``: "quant", "dequant" or "fused"), from sweeps on an H100 and an H200
    (bench_quant_gpu.py --tune, 2026-11-21, 16384 x 7168): one row segment per program reads and
    writes contiguous runs. Quantize 1 row x 32 groups (4 warps): `deepgemm` FP32 3.99 TB/s on
    the H200 (94% of copy; 4 rows x 8 groups 3.79) and 2.84 on the H100 (2.75), `default` 3.53
    (3.45), packed UE8M0 3.93 (3.86). Dequantize 1 row x 64 groups on 8 warps: 3.87 (3.60) and
    2.84 (2.66). MN-major scales keep 4 rows x 8 groups (one row per program would scatter its
    4-byte scale writes with stride M), and so do the fused kernels (swigluoai 3.44 vs 3.36).
    Devices measured to prefer other 1x128 quantize tiles: :data:`_DEVICE_TILES`."""
    gb = max(2, _next_pow2(gs))
    if gpp is None:
        gpp = max(1, min(_next_pow2(ng), 512 // gb)) if gb < 512 else 1
        if gb == 128 and block_m is None and ng >= 8 and elems == 4096:
            if role == "dequant" and layout == "row_major":
                gpp, block_m = 64, 1
            elif role == "quant" and layout in ("row_major", "packed_ue8m0"):
                gpp, block_m = 32, 1
            else:
                gpp, block_m = 8, 4
    if layout == "packed_ue8m0":
        gpp = max(gpp, 4)
    if block_m is None:
        block_m = max(1, min(max(16, elems // 512), elems // (gb * gpp)))
    return gb, gpp, block_m


def _pair_view(x3: torch.Tensor, want_pairs: bool):
    """(tensor to pass, PAIR, IN16): int32 words of 16-bit pairs when possible (PAIR 1), else the
    generic split tile (PAIR 2) where pairs are needed, else plain tiles (PAIR 0)."""
    if not want_pairs:
        return x3, 0, 0
    ok = (x3.dtype in (torch.bfloat16, torch.float16) and x3.stride(2) == 1 and x3.shape[2] % 2 == 0
          and x3.stride(1) % 2 == 0 and x3.stride(0) % 2 == 0 and x3.data_ptr() % 4 == 0)
    if ok:
        return x3.view(torch.int32), 1, 1 if x3.dtype == torch.bfloat16 else 2
    return x3, 2, 0


def _warps(gb: int, gpp: int, bm: int, num_warps: int | None, fp8: bool = True) -> int:
    """Warps per program, from a tile sweep on an H200 (bench_quant_gpu.py --tune, 2026-11-21):
    4096-element tiles run best with 4 warps for FP8 codes and 2 for FP4 (whose packing doubles
    the work per thread); larger tiles (per-token rows) get more."""
    if num_warps:
        return num_warps
    n = gb * gpp * bm
    if n <= 4096:
        return 4 if fp8 else 2
    return 8 if n <= 8192 else 16


def _nvfp4_static_params(global_scale, scheme: Scheme, dev: torch.device | None = None):
    """Host side of a static NVFP4 global scale (no allocation, no device work).

    Returns ``("host", genc, gdec, glob, zero_tensor)`` for a real number:
    ``genc``/``gdec`` the float32 S_enc / decode scale the kernel's NVFP4 block rule reads (the
    preset's order uses one of them, as :func:`_nvfp4_factors` produces them), ``glob`` the
    reference's float64 decode factor, ``zero_tensor`` True when a static ``amax`` rounds to a
    float32 0 (the reference then treats x as an all-zero tensor). Or ``("device", t)`` for a
    one-element float32 tensor: validated as the number it holds when on the CPU, used as is on
    x's device (validating it there would cost a host sync).

    Validation is the reference's own: :func:`moeref.quant.nvfp4._static_value` (TypeError /
    ValueError for a non-real, non-positive or non-finite number), then
    :func:`moeref.quant.nvfp4._nvfp4_rule` on a one-block grid, which raises the reference's
    ValueError (with its reason) for a derived encode/decode scale that is zero or non-finite in
    float32, and yields ``glob``. The float32 factors are then ``_nvfp4_rule``'s global step in
    NumPy float32 (bit-identical to it).
    """
    if scheme.family != "nvfp4":
        raise ValueError(f"global_scale={global_scale!r} is the NVFP4 per-tensor factor; scheme "
                         f"{scheme.name!r} is of family {scheme.family!r} (for a static FP8/MX "
                         "scale pass scale=)")
    if isinstance(global_scale, torch.Tensor):
        t = global_scale
        if t.dtype != torch.float32 or t.numel() != 1:
            raise TypeError(f"global_scale tensor must hold one float32 value; got dtype {t.dtype}, "
                            f"shape {tuple(t.shape)}")
        if t.device.type == "cpu":
            _nvfp4_static_params(float(t.reshape(-1)[0]), scheme)  # the reference's checks
        elif dev is not None and t.device != torch.device(dev):
            raise ValueError(f"global_scale is on {t.device}, x on {dev}: pass it on x's "
                             "device (or on the CPU, or as a number)")
        return ("device", t)
    from moeref.quant.nvfp4 import _static_value

    return ("host",) + _nvfp4_static_host(_static_value(global_scale), scheme)


@functools.lru_cache(maxsize=64)
def _nvfp4_static_host(v: float, scheme: Scheme) -> tuple[float, float, float, bool]:
    """(genc, gdec, glob, zero_tensor) of a validated static value ``v`` (see
    :func:`_nvfp4_static_params`): :func:`moeref.quant.nvfp4.global_factors`, the reference's own
    per-tensor step (its float32 S_enc and decode scale, float64 ``glob``, and its ValueErrors);
    cached, a static scale being the same call after call (a refused value raises every time)."""
    from moeref.quant.nvfp4 import global_factors

    s_enc, pts, glob, zero = global_factors(scheme.preset, static=v)
    return float(s_enc), float(pts), float(glob), zero


def global_scale_supports(scheme: Scheme | None = None, x=None, global_scale=None, **_) -> tuple[bool, str]:
    """Whether :func:`quantize` accepts ``global_scale`` for ``scheme`` (NVFP4 only; a valid
    number or one-element float32 tensor), and why not: the ``supports`` of the registry's
    ``quantize``/``triton`` entry adds this to :func:`supports`."""
    if global_scale is None or scheme is None:
        return True, "ok"
    try:
        _nvfp4_static_params(global_scale, scheme, getattr(x, "device", None))
    except (TypeError, ValueError) as e:
        return False, str(e)
    return True, "ok"


def _nvfp4_static_factors(global_scale, scheme: Scheme, dev: torch.device):
    """(nv, glob, zero_tensor) for a static NVFP4 global scale (:func:`_nvfp4_static_params`):
    ``nv`` the float32 factor buffer of :func:`_nvfp4_factors` for the data kernel, ``glob`` the
    float64 ``[1]`` reference decode factor. A number costs one fill (``glob``, the caller's to
    keep): ``nv`` is made once per value and device (:func:`_nvfp4_static_nv`), no host sync;
    a device tensor no host sync either (``amax``: :func:`_nvfp4_factors` from it as a tensor
    amax; ``encode_scale`` / ``decode_scale``: from the tensor itself)."""
    params = _nvfp4_static_params(global_scale, scheme, dev)
    if params[0] == "host":
        _, s_enc, pts, glob, zero = params
        return (_nvfp4_static_nv(s_enc, pts, scheme, torch.device(dev)),
                torch.full((1,), glob, dtype=torch.float64, device=dev), zero)
    t = params[1].reshape(1).to(dev)
    if scheme.preset.option("global_convention") == "amax":  # the tensor amax, as if reduced
        return _nvfp4_device_globals(scheme, amax=t) + (False,)
    # the order reads only its own quantity (TE/FlashInfer S_enc, torchao pts)
    return _nvfp4_device_globals(scheme, quantity=t) + (False,)


@functools.lru_cache(maxsize=64)
def _nvfp4_static_nv(s_enc: float, pts: float, scheme: Scheme, dev: torch.device) -> torch.Tensor:
    """:func:`_nvfp4_factors`'s buffer for host float32 factors, made once per (value, scheme,
    device) and kept: read-only for the kernels, a static scale being the same call after call
    (so later calls launch nothing for it)."""
    src = torch.tensor([s_enc, pts], dtype=torch.float32).to(dev)
    nv = torch.empty(130, dtype=torch.float32, device=dev)
    unused = torch.empty(1, dtype=torch.float64, device=dev)
    _nvfp4_factors[(1,)](src, src[1:], nv, unused, FROM_AMAX=False,
                         ORDER=_NVFP4_ORDER[scheme.preset.option("nvfp4_order")], GLOB=1)
    return nv


# elements per program and warps of the partial-amax pass (per-tensor FP8, dynamic NVFP4)
_AMAX_TILE = 8192
_AMAX_WARPS = 8


def _tensor_amax(x3: torch.Tensor, nonfinite: int, per_matrix: bool) -> torch.Tensor:
    """float32 amax of ``|x3|`` on its device (``[B, M, K]``; the NaN policy ``nonfinite`` as
    the kernels' constexpr): one per matrix (``[B]``, per-tensor FP8) or one for the whole
    tensor (``[1]``, NVFP4). A partial-amax pass over [BM, BK] tiles, then a one-program
    reduction of the partials."""
    B, M, K = (int(d) for d in x3.shape)
    BKa = min(1024, _next_pow2(K))
    BMa = min(_next_pow2(M), max(1, _AMAX_TILE // BKa))
    grid = (triton.cdiv(M, BMa), triton.cdiv(K, BKa), B)
    nprog = grid[0] * grid[1]
    part = _alloc(B * nprog, dtype=torch.int32, device=x3.device)
    amax = _alloc(B if per_matrix else 1, dtype=torch.float32, device=x3.device)
    _amax_partial_kernel[grid](x3, x3.stride(0), x3.stride(1), x3.stride(2), part, M, K, nprog,
                               BLOCK_M=BMa, BLOCK_K=BKa, NONFINITE=nonfinite, num_warps=_AMAX_WARPS)
    per_out = nprog if per_matrix else B * nprog  # partials per output amax
    _amax_final_kernel[(amax.numel(),)](part, amax, per_out, BLOCK=1024, ITERS=triton.cdiv(per_out, 1024))
    return amax


def _nvfp4_device_globals(scheme: Scheme, amax=None, quantity=None):
    """(nv, glob) on the device: the float32 factor buffer the NVFP4 data pass reads
    (:func:`_nvfp4_factors`: S_enc, decode scale, the data factor of each UE4M3 code) and the
    reference's float64 decode factor. From a float32 ``[1]`` tensor ``amax`` (the reduced
    tensor amax, or a static amax tensor): :func:`moeref.quant.nvfp4.global_factors` on the
    device; or from a static ``quantity`` tensor in the preset's own convention (encode scale;
    torchao: decode scale), read as it is."""
    p = scheme.preset
    order = _NVFP4_ORDER[p.option("nvfp4_order")]
    src = amax if amax is not None else quantity
    nv = _alloc(130, dtype=torch.float32, device=src.device)
    glob = _alloc(1, dtype=torch.float64, device=src.device)
    # the reference's float64 decode factor, from the float32 quantity of the convention
    if amax is not None and p.option("global_convention") == "amax":
        kind = 0
    else:
        kind = 1 if order == 2 else 2
    _nvfp4_factors[(1,)](src, src, nv, glob, FROM_AMAX=amax is not None, ORDER=order, GLOB=kind)
    return nv, glob


def _signed_zero_codes(x3: torch.Tensor, te: bool) -> torch.Tensor:
    """Packed E2M1 codes of ``x * 0`` (the reference's all-zero data factor): 0x0, or 0x8 for a
    negative x (sign bit set) except under TE's order (an exact zero product is 0x0)."""
    B, M, K = x3.shape
    s = torch.zeros((B, M, K + K % 2), dtype=torch.uint8, device=x3.device)
    if not te:
        s[..., :K] = torch.signbit(x3).to(torch.uint8) * 8
    return s[..., 0::2] | (s[..., 1::2] << 4)


def _launch_knobs(ce: dict, gb: int, gpp: int, bm: int, num_warps: int | None) -> dict:
    """``num_warps`` and the constexprs of a :func:`_quant_kernel` launch. The packed-bf16 FP4
    encode (``PACKED_BF16``) groups four int32 words per asm call; it is kept only where every
    thread holds at least four words of the tile (tiles and thread counts are powers of two, so
    then a multiple of four): with fewer, Triton pads the packed call and the bytes came out
    wrong (H200, 2026-11-21, 2-element blocks on 64-word tiles)."""
    nw = _warps(gb, gpp, bm, num_warps, ce["ELEM"] != 2)
    if ce.get("PACKED_BF16") and bm * gpp * max(gb // 2, 1) < 4 * 32 * nw:
        ce = dict(ce, PACKED_BF16=False)
    if not _E2M1_PTX_ON and ce.get("E2M1_PTX"):
        ce = dict(ce, E2M1_PTX=False)
    knobs = dict(ce, num_warps=nw, WORD_RUN=_WORD_RUN.get(ce["SCALE_KIND"], 0))
    if _MAXNREG is not None and not _INTERPRETED:
        knobs["maxnreg"] = _MAXNREG
    return knobs


# False turns the float32 lane E2M1 encode (E2M1_PTX) off in every launch: an A/B knob for
# bench_quant_gpu.py --tune ({'_E2M1_PTX_ON': False}), not a shipped setting.
_E2M1_PTX_ON = True

# Register cap per thread (ptxas .maxnreg) for every _quant_kernel launch; None: the compiler's
# choice. For register sweeps (bench_quant_gpu.py --tune --maxnreg), not a shipped setting.
_MAXNREG: int | None = None

# FP4 from 16-bit words: contiguous words per thread and group (see _quant_kernel's WORD_RUN;
# 0: the whole group), by scale kind (1 UE8M0: MXFP4, 2 UE4M3: NVFP4)
# (H200, 2026-11-21, bench_quant_gpu.py --tune: MXFP4 3.55 TB/s with whole 16-word groups,
# 3.63 with runs of 8, 2.30 with runs of 4; NVFP4's 8-word groups: runs of 4 1.93 vs 2.70)
_WORD_RUN = {1: 8, 2: 0}


# 1x128 tiles (groups per program, rows per program, warps) that a device was measured to run
# faster than the general choice (quantize: _tile's 1 row x 32 groups on 4 warps, 4 x 8 for
# MN-major scales; fused activation + quantize: 4 rows x 8 groups), keyed by (kernel: "quant" or
# "fused", scale layout, whether x is divided by FP32 scales): bench_quant_gpu.py --tune,
# 2026-11-21, 16384 x 7168 bf16. Only FP32-scale kernels and the packed UE8M0 layout are
# looked up (other UE8M0 kernels were not swept per device); everything else takes the
# general choice.
# * H200, `default` (x / s, exact division): 1 row x 8 groups on 2 warps (16 elements per
#   thread: the division's registers stay down, and a 56-group row has no idle lanes, where a
#   32-group program idles 12.5% of them): quantize 3.64 -> 3.77 TB/s; `deepgemm` (a product)
#   there: 3.98 on the general tile, 3.79 on that one. The fused kernels, after the division
#   lost its sign select (fifth round), on 1 row x 8 groups with ONE warp (32 elements per
#   thread): silu_and_mul 3.68 -> 4.00 TB/s, swigluoai 3.51 -> 3.90 (on 2 warps: 3.96, 3.71).
#   MN-major `deepgemm`: 8 rows x 8 groups on 8 warps, 3.83-3.85 -> 3.88-3.91 TB/s (four
#   interleaved pairs of runs).
# * H100: the same narrow tile is slower for `default` (2.84 -> 2.75, memory-bound either
#   way); `deepgemm` gains from 1 row x 64 groups on 8 warps: row-major 2.84 -> 2.92 TB/s,
#   MN-major 2.77 -> 2.86 (MXFP8 found nothing better than its tile, 2.75). Fifth round:
#   `default` 2.86 -> 2.91 and packed UE8M0 2.84 -> 2.89 on 1 row x 64 groups, 4 warps
#   (8 warps: the same; one warp: 2.73, 2.78). The packed layout is the one UE8M0 entry.
_DEVICE_TILES = {
    "NVIDIA H200": {("quant", "row_major", True): (8, 1, 2), ("fused", "row_major", True): (8, 1, 1),
                    ("quant", "mn_major", False): (8, 8, 8)},
    "NVIDIA H100 80GB HBM3": {("quant", "row_major", False): (64, 1, 8),
                              ("quant", "mn_major", False): (64, 1, 8),
                              ("quant", "row_major", True): (64, 1, 4),
                              ("quant", "packed_ue8m0", False): (64, 1, 4)},
}


def _device_tile(kernel: str, dev: torch.device, scale_layout: str, ce: dict, gs: int, ng: int,
                 overrides: tuple) -> tuple[int, int, int] | None:
    """(groups per program, rows per program, warps) from :data:`_DEVICE_TILES` for a launch of
    ``kernel`` ("quant" or "fused") with constexprs ``ce``; None unless the groups are 1x128
    over at least 8 groups, no tile override (block_m, groups_per_program, num_warps) is given,
    and the scales are FP32 or in the packed UE8M0 layout."""
    if overrides != (None, None, None) or gs != 128 or ng < 8:
        return None
    fp32 = ce["SCALE_KIND"] == 0
    if not fp32 and scale_layout != "packed_ue8m0":
        return None
    return _DEVICE_TILES.get(_device_name(dev), {}).get((kernel, scale_layout, fp32 and ce["APPLY"] == 1))


@functools.lru_cache(maxsize=16)
def _device_name(dev: torch.device) -> str:
    """CUDA device name (``torch.cuda.get_device_name``), "" for other devices."""
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""


# Rows longer than this with one scale per row (per-token) take _row_loop_kernel; tile
# (rows per program, columns per chunk, warps). H200 sweeps (bench_quant_gpu.py --tune,
# 2026-11-21, 16384 x 7168 bf16, per-token): before the register cut of _div_exact, one
# 8192-wide tile per row 3.46 TB/s against 3.43 for the loop at (1, 4096, 4); after it, the
# single tile 3.46 and the loop 3.55 at (1, 4096, 4), 3.52 at (1, 2048, 2), 3.40 at
# (1, 2048, 1), 2.4-2.8 with 1024-column chunks. So rows over 4096 columns loop.
_ROW_LOOP_MIN_K = 4096
_ROW_LOOP_TILE = (1, 4096, 4)


def _row_loop_applies(ng: int, gs: int, K: int, packed: bool, scale_layout: str) -> bool:
    """One FP8 scale per row over a row longer than one tile: :func:`_row_loop_kernel`."""
    return (ng == 1 and gs >= K and K > _ROW_LOOP_MIN_K and not packed
            and scale_layout in ("row_major", "mn_major"))


def _launch_row_loop(x3, codes, scales, ssb, ssm, m_pad, static_t, static, ce, block_m, num_warps):
    B, M, K = (int(d) for d in x3.shape)
    bm, bk, nw = _ROW_LOOP_TILE
    bm = block_m or bm
    grid = (triton.cdiv(m_pad, bm), B)
    names = _row_loop_kernel.arg_names
    _row_loop_kernel[grid](
        x3, x3.stride(0), x3.stride(1), x3.stride(2), codes, codes.stride(0), codes.stride(1),
        scales, ssb, ssm, static_t, M, K, m_pad, BLOCK_M=bm, BLOCK_K=bk,
        K_ITERS=triton.cdiv(K, bk), STATIC=static is not None, num_warps=num_warps or nw,
        **{k_: v_ for k_, v_ in ce.items() if k_ in names})


def quantize(x: torch.Tensor, scheme: Scheme, *, scale_layout: str = "row_major", scale=None,
             hw_fp8: bool | None = None, block_m: int | None = None, groups_per_program: int | None = None,
             num_warps: int | None = None, global_scale=None) -> FastQuantized:
    """Quantize ``x`` (CUDA tensor, or CPU under TRITON_INTERPRET=1) with ``scheme``.

    Args:
        x: float32/bfloat16/float16 ``[K]``, ``[M, K]`` or ``[B, M, K]``, any strides.
        scheme: a :mod:`moeref.quant` scheme (FP8 per-tensor/per-token/1xG, MXFP8, MXFP4, NVFP4).
        scale_layout: where the scales go (:data:`SCALE_LAYOUTS`).
        scale: static per-tensor decode scale (overrides ``scheme.static_scale``).
        global_scale: NVFP4 only (ValueError for other families): a static per-tensor quantity
            in the scheme's convention, as :func:`moeref.quant.nvfp4.quantize_nvfp4` takes it
            (``amax``; ``encode_scale`` S_enc = 2688 / amax, e.g. vLLM's ``a1_gscale`` for
            ``scaled_fp4_quant(x, input_global_scale)``; ``decode_scale``). A real number is
            validated like the reference (TypeError / ValueError, with the reason, where it
            raises); a one-element float32 tensor holds the float32 quantity: on the CPU it is
            validated the same way, on x's device it is used as is, with no host sync (it must be
            positive and give a finite nonzero encode/decode scale; nothing checks it). The
            data pass is then the only pass over x (None: dynamic, the tensor amax is reduced in
            a first pass). Codes, scales and ``global_scale`` equal the reference's.
        hw_fp8: use the hardware FP8 cast on CUDA (default: yes on CUDA for saturating RNE presets).
        block_m, groups_per_program, num_warps: tile overrides (benchmarks).

    Returns:
        :class:`FastQuantized`; ``.to_reference()`` gives the :class:`moeref.quant.QuantizedTensor`.
    """
    ok, why = supports(scheme, x, scale_layout)
    if not ok:
        raise ValueError(f"fastpath.quant.quantize cannot run {getattr(scheme, 'name', scheme)!r}: {why}")
    static_global = None
    if global_scale is not None:  # validated before any allocation or launch
        static_global = _nvfp4_static_factors(global_scale, scheme, x.device)
    shape = tuple(int(d) for d in x.shape)
    x3 = x.reshape((1, 1) + shape) if x.dim() == 1 else (x.unsqueeze(0) if x.dim() == 2 else x)
    B, M, K = (int(d) for d in x3.shape)
    dev = x.device
    if hw_fp8 is None:
        hw_fp8 = dev.type == "cuda"
    ce = _constexprs(scheme, bool(hw_fp8))
    kind = _kind(scheme)
    p = scheme.preset
    static = scheme.static_scale if scale is None else scale
    if static is not None:
        from moeref.quant.scheme import _check_static_scale
        static = _check_static_scale(static, scheme.scale_format, "scale")
    packed = scheme.element == "e2m1"
    cshape = (B, M, (K + 1) // 2 if packed else K)
    codes = _alloc(cshape, dtype=torch.uint8, device=dev)
    dummy = _alloc(1, dtype=torch.float32, device=dev)
    static_t = dummy
    if static is not None:
        sv = float(np.float32(static)) if scheme.scale_format == "fp32" else \
            float(int(np.frexp(static)[1]) - 1 + 127)
        static_t = torch.full((1,), sv, dtype=torch.float32, device=dev)

    if kind == "per_tensor":
        # one scale per matrix: amax pass, scale kernel, then the data pass with AMAX_SRC=1
        need_amax = static is None or p.nonfinite == "nan_block"
        if need_amax:
            amax = _tensor_amax(x3, ce["NONFINITE"], per_matrix=True)
        else:
            amax = torch.zeros(B, dtype=torch.float32, device=dev)
        sdt = torch.float32 if scheme.scale_format == "fp32" else torch.uint8
        scales = _alloc((B, 1, 1), dtype=sdt, device=dev)
        keys = ("ELEM_MAX", "INV_M", "EMAX", "MBITS", "SCALE_KIND", "FP32_RULE", "FP32_POW2",
                "E8_RULE", "E8_LO", "E8_HI", "E8_NF", "AMAX_FLOOR", "ZERO_BLOCK", "NONFINITE", "APPLY")
        _per_tensor_scale_kernel[(1,)](amax, scales, static_t, B,
                                       BLOCK=_next_pow2(max(B, 2)), STATIC=static is not None,
                                       **{k_: ce[k_] for k_ in keys})
        gs = min(K, 128) if not packed else max(2, min(_next_pow2(K), 128))
        gs = _next_pow2(gs)
        ng = triton.cdiv(K, gs)
        gb, gpp, bm = _tile(gs, block_m, groups_per_program, "row_major", ng)
        grid = (triton.cdiv(M, bm), triton.cdiv(ng, gpp), B)
        xk, pair, in16 = _pair_view(x3, packed)
        _quant_kernel[grid](
            xk, xk.stride(0), xk.stride(1), xk.stride(2), codes, codes.stride(0), codes.stride(1),
            dummy, 0, 0, 0, amax, static_t, dummy, M, K, ng, M, ng, M,
            GS=gs, GB=gb, GPP=gpp, BLOCK_M=bm, SF_LAYOUT=0, AMAX_SRC=1, STATIC=static is not None,
            TWO_LEVEL=False, NV_ORDER=0, WRITE_SCALES=False, ACT=0, ACT_ALPHA=0.0, ACT_LIMIT=0.0,
            PAIR=pair, IN16=in16,
            **_launch_knobs(ce, gb, gpp, bm, num_warps))
        out_codes = codes.reshape(shape[:-1] + (cshape[-1],))
        return FastQuantized(out_codes, scales.reshape(_grid_of(shape, scheme)), "row_major", scheme, shape)

    gs = scheme.resolve_block(shape)[-1]
    ng = triton.cdiv(K, gs)
    sshape, sdt, (m_pad, ng_pad, ssm, ssg) = scale_storage_shape((B, M, K), scheme, scale_layout)
    scales = _alloc(sshape, dtype=sdt, device=dev)
    ssb = scales.stride(0)
    tile = _device_tile("quant", dev, scale_layout, ce, gs, ng, (block_m, groups_per_program, num_warps))
    if tile is not None:
        groups_per_program, block_m, num_warps = tile
    gb, gpp, bm = _tile(gs, block_m, groups_per_program, scale_layout, ng)
    two_level = scheme.family == "nvfp4"
    order = _NVFP4_ORDER[p.option("nvfp4_order")] if two_level else 0
    nv = dummy
    zero_tensor = False
    if two_level and static_global is not None:
        # static global scale: no amax pass, the data pass below is the only read of x
        nv, glob, zero_tensor = static_global
    elif two_level:
        amax = _tensor_amax(x3, ce["NONFINITE"], per_matrix=False)
        nv, glob = _nvfp4_device_globals(scheme, amax=amax)
    if _row_loop_applies(ng, gs, K, packed, scale_layout) and groups_per_program is None:
        _launch_row_loop(x3, codes, scales, ssb, ssm, m_pad, static_t, static, ce, block_m, num_warps)
    else:
        grid = (triton.cdiv(m_pad, bm), triton.cdiv(ng_pad, gpp), B)
        xk, pair, in16 = _pair_view(x3, packed)
        _quant_kernel[grid](
            xk, xk.stride(0), xk.stride(1), xk.stride(2), codes, codes.stride(0), codes.stride(1),
            scales, ssb, ssm, ssg, dummy, static_t, nv, M, K, ng, m_pad, ng_pad, 1,
            GS=gs, GB=gb, GPP=gpp, BLOCK_M=bm, SF_LAYOUT=_SF_LAYOUT[scale_layout], AMAX_SRC=0,
            STATIC=static is not None, TWO_LEVEL=two_level, NV_ORDER=order, WRITE_SCALES=True,
            ACT=0, ACT_ALPHA=0.0, ACT_LIMIT=0.0, PAIR=pair, IN16=in16,
            **_launch_knobs(ce, gb, gpp, bm, num_warps))
    if zero_tensor:  # a static amax that is 0 in float32: the reference's data factor is 0
        codes.copy_(_signed_zero_codes(x3, order == 0))
    lead = shape[:-2] if len(shape) >= 2 else ()
    out_codes = codes.reshape(shape[:-1] + (cshape[-1],))
    if scale_layout == "row_major":
        scales = scales.reshape(_grid_of(shape, scheme))
    elif len(shape) == 2:
        scales = scales[0]
    elif len(shape) == 1:
        scales = scales[0]
    return FastQuantized(out_codes, scales, scale_layout, scheme, shape,
                         global_scale=glob if two_level else None)


def _grid_of(shape, scheme):
    from moeref.quant.blockwise import grid_shape
    return grid_shape(tuple(shape), scheme.resolve_block(tuple(shape)))


# ============================================================================ dequantize


@triton.jit
def _round_f32_to_16(p, e, OUT: tl.constexpr):
    """Round the exact value ``p + e`` (``p = fl32(p + e)``, ``|e| <= ulp32(p)/2``) to bfloat16
    (OUT=1) or float16 (OUT=2) bits with RNE, ``e`` deciding ties and sticky bits: one rounding,
    like the reference's float64 -> dtype cast. float16 overflow gives Inf, subnormals are exact."""
    bits = R.f32_bits(p)
    sign = bits & 0x80000000
    a = bits & 0x7FFFFFFF
    ebits = R.f32_bits(e)
    e_nz = (ebits & 0x7FFFFFFF) != 0
    same = e_nz & ((ebits & 0x80000000) == sign)
    opp = e_nz & ((ebits & 0x80000000) != sign)
    if OUT == 1:
        s = tl.full(a.shape, 16, tl.uint32)
        base = a
    else:
        ef = (a >> 23).to(tl.int32)
        s = tl.where(ef >= 113, 13, tl.minimum(126 - ef, 31)).to(tl.uint32)
        base = tl.where(ef >= 113, a, tl.where(ef == 0, a, (a & 0x7FFFFF) | 0x800000))
    q = base >> s
    rem = base & ((tl.full(a.shape, 1, tl.uint32) << s) - 1)
    half = tl.full(a.shape, 1, tl.uint32) << (s - 1)
    tie_up = same | ((opp == 0) & ((q & 1) == 1))
    up = (rem > half) | ((rem == half) & tie_up)
    r = q + up.to(tl.uint32)
    if OUT == 1:
        out = (sign >> 16) | r
        out = tl.where(a > 0x7F800000, 0x7FC0 | (sign >> 16), out)
    else:
        ef2 = (a >> 23).to(tl.int32)
        mag = tl.where(ef2 >= 113, r - (112 << 10), r)
        mag = tl.where(mag >= 0x7C00, 0x7C00, mag)
        out = (sign >> 16) | mag
        out = tl.where(a > 0x7F800000, 0x7E00 | (sign >> 16), out)
    return out.to(tl.uint16)


@triton.jit
def _dequant_kernel(c_ptr, stride_cb, stride_cm, s_ptr, stride_sb, stride_sm, stride_sg, g_ptr,
                    o_ptr, stride_ob, stride_om, M, K, NG_PAD, ROWS_PER_SCALE,
                    GS: tl.constexpr, GB: tl.constexpr, GPP: tl.constexpr, BLOCK_M: tl.constexpr,
                    ELEM: tl.constexpr, SCALE_KIND: tl.constexpr, SF_LAYOUT: tl.constexpr,
                    PER_TENSOR: tl.constexpr, TWO_LEVEL: tl.constexpr, OUT: tl.constexpr,
                    HW: tl.constexpr):
    """out = decode(code) * decode(scale) [* global], rounded once to the output dtype.

    HW (GPU only): FP8 codes decoded by the hardware conversion (``cvt`` e4m3/e5m2 -> f16, exact:
    every FP8 value is a float16; NaN and Inf as the format says) and the float32 -> bfloat16
    rounding by ``cvt.rn.bf16.f32`` (RNE, subnormals kept), NaN codes rewritten to the integer
    path's ``0x7FC0 | sign``. The interpreter decodes FP8 specials wrongly, so it keeps the
    integer path (HW = False)."""
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_b = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    gidx = pid_g * GPP + tl.arange(0, GPP)
    kin = tl.arange(0, GB)
    k = gidx[:, None] * GS + kin[None, :]
    kmask = (kin[None, :] < GS) & (k < K)
    rmask = rows < M
    m3 = rmask[:, None, None] & kmask[None, :, :]
    cb = c_ptr + pid_b.to(tl.int64) * stride_cb + rows.to(tl.int64)[:, None, None] * stride_cm
    if ELEM == 2:
        byte = tl.load(cb + (k // 2)[None, :, :], mask=m3, other=0).to(tl.uint32)
        code = tl.where((k % 2)[None, :, :] == 1, byte >> 4, byte & 0xF)
        v = R.decode_minifloat(code, 2, 1, 1, True, 0)
    else:
        kc = k
        if HW and GB >= 8:
            # a hint, true of k (runs of GB consecutive columns): 8 codes per vector load, the
            # layout of the 8-wide 16-bit stores, so no shared-memory layout conversion (and
            # barrier) between the load and the store (H200: 3.52 -> 3.57 TB/s, 4 warps)
            kc = tl.max_contiguous(k, [1, 8])
        code = tl.load(cb + kc[None, :, :], mask=m3, other=0)
        if HW:
            if ELEM == 0:
                v = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                v = code.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
        elif ELEM == 0:
            v = R.decode_minifloat(code, 4, 3, 7, True, 1)
        else:
            v = R.decode_minifloat(code, 5, 2, 15, True, 2)
    # scales [BLOCK_M, GPP]
    sb = s_ptr + pid_b.to(tl.int64) * stride_sb
    smask = rmask[:, None] & (gidx < NG_PAD)[None, :]
    if PER_TENSOR:
        raw = tl.load(s_ptr + pid_b + 0 * rows, mask=rmask, other=0)
        raw = raw[:, None] + tl.zeros((BLOCK_M, GPP), raw.dtype)
    elif SF_LAYOUT == 0:
        raw = tl.load(sb + rows[:, None] * stride_sm + gidx[None, :] * stride_sg, mask=smask, other=0)
    elif SF_LAYOUT == 2:
        w = tl.load(sb + rows[:, None] * stride_sm + (gidx // 4)[None, :] * stride_sg, mask=smask,
                    other=0).to(tl.uint32, bitcast=True)
        raw = (w >> ((gidx % 4) * 8).to(tl.uint32)[None, :]) & 0xFF
    else:
        r = rows[:, None]
        c = gidx[None, :]
        off = (r // 128) * (NG_PAD // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 \
            + ((r % 128) // 32) * 4 + (c % 4)
        raw = tl.load(sb + off, mask=smask, other=0)
    if SCALE_KIND == 0:
        s = raw.to(tl.float32)
    elif SCALE_KIND == 1:
        s = R.e8m0_to_f32(raw.to(tl.uint32))
    else:
        s = R.decode_minifloat(raw.to(tl.uint32), 4, 3, 7, False, 1)
    if TWO_LEVEL:
        gsc = tl.load(g_ptr)  # float64
    else:
        gsc = 1.0
    s3 = s[:, :, None] + tl.zeros(v.shape, tl.float32)
    # exact product v * s (* g): split s into 12-bit halves so each partial product is exact
    # (v has <= 4 significant bits), then Fast2Sum gives p = fl32(v*s) and the exact error e.
    if TWO_LEVEL:
        # the reference: element * fl64(block scale * global), in float64, then the cast
        d = v.to(tl.float64) * (s3.to(tl.float64) * gsc)
        p = d.to(tl.float32)
        if OUT == 2:
            e = (d - p.to(tl.float64)).to(tl.float32)
        else:
            e = tl.zeros(p.shape, tl.float32)
    elif OUT == 2:
        # float16: the exact product as a float32 pair (scale split into 12-bit halves, each
        # partial product exact, Fast2Sum), rounded once below
        sh = (R.f32_bits(s3) & 0xFFFFF000).to(tl.float32, bitcast=True)
        sl = s3 - sh
        hi = v * sh
        lo = v * sl
        p = hi + lo
        e = lo - (p - hi)
        sfin = (R.f32_bits(s3) & 0x7FFFFFFF) < 0x7F800000
        p = tl.where(sfin, p, v * s3)
        e = tl.where(sfin, e, 0.0)
    else:
        # float32 (and bfloat16, which the reference reaches through float32: ml_dtypes casts
        # float64 -> bfloat16 via float32): one correctly rounded float32 product
        p = v * s3
        e = tl.zeros(p.shape, tl.float32)
    ob = o_ptr + pid_b.to(tl.int64) * stride_ob + rows.to(tl.int64)[:, None, None] * stride_om
    if OUT == 0:
        tl.store(ob + k[None, :, :], p, mask=m3)
    elif OUT == 1 and HW and not TWO_LEVEL:
        pb = R.f32_bits(p)
        hb = p.to(tl.bfloat16).to(tl.uint16, bitcast=True)
        hb = tl.where(p != p, (0x7FC0 | ((pb >> 16) & 0x8000)).to(tl.uint16), hb)
        tl.store(ob + k[None, :, :], hb.to(tl.bfloat16, bitcast=True), mask=m3)
    else:
        r16 = _round_f32_to_16(p, e, OUT)
        if OUT == 1:
            tl.store(ob + k[None, :, :], r16.to(tl.bfloat16, bitcast=True), mask=m3)
        else:
            tl.store(ob + k[None, :, :], r16.to(tl.float16, bitcast=True), mask=m3)


_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dequantize(q: FastQuantized, dtype: torch.dtype = torch.float32, *, block_m: int | None = None,
               groups_per_program: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``decode(codes) * scale`` (x global factor), rounded ONCE to ``dtype`` (float32, bfloat16,
    float16), like :meth:`moeref.quant.QuantizedTensor.dequantize`: the product is formed exactly
    as a float32 pair (hi, lo) and rounded with integer RNE. Exact wherever the float32 partial
    products stay normal (|value| >= 2^-100 or so; a subnormal product may round twice).
    ``block_m``, ``groups_per_program``, ``num_warps``: tile overrides (benchmarks)."""
    if dtype not in _OUT:
        raise ValueError(f"dtype must be float32, bfloat16 or float16; got {dtype}")
    scheme = q.scheme
    shape = q.shape
    x3shape = (1, 1) + shape if len(shape) == 1 else ((1,) + shape if len(shape) == 2 else shape)
    B, M, K = x3shape
    codes = q.codes.reshape(B, M, -1)
    out = _alloc((B, M, K), dtype=dtype, device=codes.device)
    kind = _kind(scheme)
    packed = scheme.element == "e2m1"
    ce = dict(ELEM=_ELEM[scheme.element], SCALE_KIND=_SCALE_KIND[scheme.scale_format],
              HW=codes.device.type == "cuda")
    if kind == "per_tensor":
        gs = 128
        ng = triton.cdiv(K, gs)
        gb, gpp, bm = _tile(gs, block_m, groups_per_program, "row_major", ng, _DQ_ELEMS, "dequant")
        s = q.scales.reshape(B)
        grid = (triton.cdiv(M, bm), triton.cdiv(ng, gpp), B)
        _dequant_kernel[grid](codes, codes.stride(0), codes.stride(1), s, 1, 0, 0, s, out,
                              out.stride(0), out.stride(1), M, K, ng, M, GS=gs, GB=gb, GPP=gpp,
                              BLOCK_M=bm, SF_LAYOUT=0, PER_TENSOR=True, TWO_LEVEL=False,
                              OUT=_OUT[dtype], num_warps=num_warps or _DQ_WARPS, **ce)
        return out.reshape(shape)
    gs = scheme.resolve_block(shape)[-1]
    ng = triton.cdiv(K, gs)
    _, _, (m_pad, ng_pad, ssm, ssg) = scale_storage_shape((B, M, K), scheme, q.scale_layout)
    s = q.scales
    if q.scale_layout == "row_major":
        s = s.reshape(B, M, ng)
        ssb = s.stride(0)
    else:
        s = s.reshape((B,) + tuple(s.shape[-2:]) if q.scale_layout != "swizzled_128x4" else (B, -1))
        ssb = s.stride(0)
    gb, gpp, bm = _tile(gs, block_m, groups_per_program, q.scale_layout, ng, _DQ_ELEMS, "dequant")
    g = q.global_scale if q.global_scale is not None else s
    grid = (triton.cdiv(M, bm), triton.cdiv(ng, gpp), B)
    _dequant_kernel[grid](codes, codes.stride(0), codes.stride(1), s, ssb, ssm, ssg, g, out,
                          out.stride(0), out.stride(1), M, K, ng_pad, 1, GS=gs, GB=gb, GPP=gpp,
                          BLOCK_M=bm, SF_LAYOUT=_SF_LAYOUT[q.scale_layout], PER_TENSOR=False,
                          TWO_LEVEL=q.global_scale is not None, OUT=_OUT[dtype],
                          num_warps=num_warps or _DQ_WARPS, **ce)
    return out.reshape(shape)


# ============================================================================ DeepGEMM adapter


def deep_gemm_supports(scheme: Scheme | None = None, x=None, scale_layout: str = "row_major", **_) -> tuple[bool, str]:
    """Whether DeepGEMM's own quantizer (``deep_gemm.utils.per_token_cast_to_fp8``) can produce
    ``scheme``: DeepGEMM installed, a CUDA tensor, FP8 E4M3 1xG with the ``deepgemm`` preset."""
    try:
        import deep_gemm  # noqa: F401
    except Exception as e:  # ImportError, or a broken build
        return False, f"deep_gemm is not importable ({type(e).__name__}: {e})"
    if x is not None and (not isinstance(x, torch.Tensor) or x.device.type != "cuda" or x.dim() != 2):
        return False, "deep_gemm's quantizer takes a 2-D CUDA tensor"
    if scheme is None:
        return True, "ok"
    if scheme.element != "e4m3fn" or scheme.family != "blockwise" or len(scheme.block) != 2 \
            or scheme.block[0] != 1 or scheme.block[1] is None:
        return False, "deep_gemm's per_token_cast_to_fp8 produces E4M3 1xG groups only"
    if scheme.preset.name != "deepgemm":
        return False, f"deep_gemm computes the 'deepgemm' preset, not {scheme.preset.name!r}"
    if scale_layout not in ("row_major", "mn_major", "packed_ue8m0"):
        return False, f"scale_layout {scale_layout!r} is not produced by deep_gemm"
    if scale_layout == "packed_ue8m0" and scheme.scale_format != "ue8m0":
        return False, "packed_ue8m0 needs UE8M0 scales"
    return True, "ok"


def deep_gemm_quantize(x: torch.Tensor, scheme: Scheme, *, scale_layout: str = "row_major") -> FastQuantized:
    """DeepGEMM's torch quantizer (``per_token_cast_to_fp8``, then ``get_mn_major_tma_aligned_tensor``
    or ``get_mn_major_tma_aligned_packed_ue8m0_tensor``) wrapped as a :class:`FastQuantized`.

    Used to cross-check the Triton kernels on the GPU and as a speed baseline. The storage of
    mn_major / packed layouts is DeepGEMM's (its MN padding is not written: ``torch.empty_strided``)."""
    ok, why = deep_gemm_supports(scheme, x, scale_layout)
    if not ok:
        raise ValueError(f"deep_gemm quantize cannot run: {why}")
    import deep_gemm

    gs = scheme.block[1]
    ue8m0 = scheme.scale_format == "ue8m0"
    q, sf = deep_gemm.utils.per_token_cast_to_fp8(x, use_ue8m0=ue8m0, gran_k=gs)
    codes = q.view(torch.uint8)
    if scale_layout == "row_major":
        scales = sf if not ue8m0 else ((sf.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    elif scale_layout == "mn_major":
        if ue8m0:
            raise ValueError("deep_gemm's MN-major FP32 layout holds FP32 scales; use packed_ue8m0")
        v = deep_gemm.utils.get_mn_major_tma_aligned_tensor(sf)
        scales = torch.as_strided(v, (v.shape[1], v.stride(1)), (v.stride(1), 1))
    else:
        v = deep_gemm.utils.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
        scales = torch.as_strided(v, (v.shape[1], v.stride(1)), (v.stride(1), 1))
    return FastQuantized(codes, scales, scale_layout, scheme, tuple(x.shape))
