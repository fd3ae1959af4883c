"""The device functions the fused FP8-block -> FP4 conversion's kernels share: the E4M3 decode
times a source scale, the source-block scale load, and one data tile. Both the two-kernel path
(:mod:`fastpath.requant`) and the persistent kernel (:mod:`fastpath._requant_persistent`) call
them; neither imports the other."""
from __future__ import annotations

import triton
import triton.language as tl

from . import _triton_rounding as R
from .quant import _jit_codes as JC
from .quant import _jit_scales as JS

__all__ = []


@triton.jit
def _e4m3_times(code, s):
    """``fl32(e4m3(code) * s)`` for integer codes (exact decode; one float32 RNE product)."""
    return R.decode_minifloat(code, 4, 3, 7, True, 1) * s


# The hardware decode of an E4M3 pair (GPU only; Triton's interpreter runs no inline asm):
# ``cvt.rn.f16x2.e4m3x2`` widens the 16-bit word's two codes into float16 (the low byte into the
# low half), exact (every E4M3 value, subnormals included, is a float16; the NaN codes become a
# float16 NaN), and ``cvt.f32.f16`` widens each half exactly. Equal to decode_minifloat's value
# for every code up to the NaN payload, which nothing downstream reads (the amax and E2M1 steps
# treat every NaN pattern alike, as they do for bfloat16 input).
_E4M3X2_PTX = tl.constexpr("""{
.reg .b16 %e4p_w, %e4p_lo, %e4p_hi;
.reg .b32 %e4p_h;
cvt.u16.u32 %e4p_w, $2;
cvt.rn.f16x2.e4m3x2 %e4p_h, %e4p_w;
mov.b32 {%e4p_lo, %e4p_hi}, %e4p_h;
cvt.f32.f16 $0, %e4p_lo;
cvt.f32.f16 $1, %e4p_hi;
}""")


@triton.jit
def _e4m3_pair_times(words, s, HW_DECODE: tl.constexpr):
    """``(fl32(e4m3(lo byte) * s), fl32(e4m3(hi byte) * s))`` of uint32 ``words`` holding a code
    pair in their low 16 bits: through :data:`_E4M3X2_PTX` (HW_DECODE) or the integer fields."""
    if HW_DECODE:
        xe, xo = tl.inline_asm_elementwise(_E4M3X2_PTX, "=r,=r,r", [words],
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        return xe * s, xo * s
    else:
        return _e4m3_times(words & 0xFF, s), _e4m3_times(words >> 8, s)


@triton.jit
def _block_scale(s_ptr, stride_sm, row0, col0, M, K, SBM: tl.constexpr, SBK: tl.constexpr):
    """The source scale of the block holding element (row0, col0): one scalar load (0 outside
    the tensor, where every code is masked to 0)."""
    return tl.load(s_ptr + (row0 // SBM) * stride_sm + col0 // SBK,
                   mask=(row0 < M) & (col0 < K), other=0.0)


@triton.jit
def _data_tile(w_ptr, stride_wm, s_ptr, stride_sm, q_ptr, stride_qm,
               o_ptr, stride_om, stride_og, dummy_ptr, nv_ptr, M, K, NG, M_PAD, NG_PAD, pid_m, pid_g,
               SBM: tl.constexpr, SBK: tl.constexpr,
               GS: tl.constexpr, GB: tl.constexpr, GPP: tl.constexpr, BLOCK_M: tl.constexpr,
               ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
               SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr, FP32_POW2: tl.constexpr,
               E8_RULE: tl.constexpr, E8_LO: tl.constexpr, E8_HI: tl.constexpr, E8_NF: tl.constexpr,
               AMAX_FLOOR: tl.constexpr, ZERO_BLOCK: tl.constexpr, NONFINITE: tl.constexpr,
               APPLY: tl.constexpr, SATURATE: tl.constexpr, ROUND: tl.constexpr,
               DROP_NEG_ZERO: tl.constexpr, NAN_CODE: tl.constexpr, FILL_CODE: tl.constexpr,
               SF_LAYOUT: tl.constexpr, TWO_LEVEL: tl.constexpr, NV_ORDER: tl.constexpr,
               DIV: tl.constexpr, E2M1_PTX: tl.constexpr, HW_SCALE: tl.constexpr,
               HW_DECODE: tl.constexpr, GDC_WAIT: tl.constexpr = False):
    """One [BLOCK_M rows, GPP groups of GS] tile. The codes are read as 16-bit words, word w of
    a row holding elements (2w, 2w+1) (little-endian: the even one low), which is output byte w
    (the layout of :mod:`fastpath.quant`'s ``PAIR == 1`` path: contiguous loads and stores, no
    shuffles); decode with the tile's one source scale, then :mod:`fastpath.quant`'s FP4 steps
    (block amax, scales in their layout, E2M1 codes, packed bytes). Tiles over the padding
    (rows < M_PAD, groups < NG_PAD) write the zero scales of the swizzled layout's padding."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    gidx = pid_g * GPP + tl.arange(0, GPP)
    rmask = rows < M
    jw = tl.arange(0, GB // 2)
    w = gidx[:, None] * (GS // 2) + jw[None, :]  # [GPP, GB/2] word (= output byte) index
    wm = (jw[None, :] < GS // 2) & (w < K // 2)
    m3 = rmask[:, None, None] & wm[None, :, :]
    off = rows.to(tl.int64)[:, None, None] * stride_wm + w[None, :, :]
    words = tl.load(w_ptr + off, mask=m3, other=0).to(tl.uint32)
    s = _block_scale(s_ptr, stride_sm, pid_m * BLOCK_M, pid_g * GPP * GS, M, K, SBM, SBK)
    xe, xo = _e4m3_pair_times(words, s, HW_DECODE)
    amax = JS._amax_pair(xe, xo, NONFINITE)
    if GDC_WAIT:  # launched dependent on the amax kernel: its factors (nv) are complete after this
        tl.extra.cuda.gdc_wait()
    factor, nan_block = JS._tile_scales(
        amax, rows, gidx, pid_m * 0, o_ptr, 0, stride_om, stride_og, dummy_ptr, nv_ptr,
        M, NG, M_PAD, NG_PAD, GPP, BLOCK_M, ELEM_MAX, INV_M, EMAX, MBITS,
        SCALE_KIND, FP32_RULE, FP32_POW2, E8_RULE, E8_LO, E8_HI, E8_NF, AMAX_FLOOR,
        ZERO_BLOCK, NONFINITE, APPLY, SF_LAYOUT, False, TWO_LEVEL, NV_ORDER, True, HW_SCALE)
    ce, co = JC._fp4_pair_codes(xe, xo, factor[:, :, None], nan_block[:, :, None], SATURATE,
                                ROUND, NAN_CODE, NONFINITE, FILL_CODE, TWO_LEVEL, NV_ORDER,
                                DROP_NEG_ZERO, SCALE_KIND, APPLY, DIV, False, E2M1_PTX)
    byte = JC._fp4_bytes(ce, co, E2M1_PTX)
    tl.store(q_ptr + rows.to(tl.int64)[:, None, None] * stride_qm + w[None, :, :], byte, mask=m3)

