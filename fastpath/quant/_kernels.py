"""The ``@triton.jit`` kernels of :mod:`fastpath.quant` (launched by its host API and by
:mod:`fastpath.fused`):

* ``_quant_kernel``: one kernel for every blockwise scheme; every knob of the preset is a
  ``tl.constexpr`` (:mod:`fastpath.quant._preset_map`), so each preset compiles to its own
  straight-line code;
* ``_row_loop_kernel``: FP8 with one scale per long row, swept twice;
* ``_amax_partial_kernel``, ``_amax_final_kernel``: the tensor amax (per-tensor FP8, NVFP4);
* ``_per_tensor_scale_kernel``: the per-tensor scale of each matrix;
* ``_nvfp4_factors``: NVFP4's tensor factors and the data factor of each UE4M3 code;
* ``_dequant_kernel``: decode(code) x decode(scale) [x global], rounded once.

The device functions they inline are in :mod:`fastpath.quant._jit_scales` (amax, scales) and
:mod:`fastpath.quant._jit_codes` (data scaling, element codes, activations).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _packed_fp4 as PK
from .. import _triton_rounding as R
from ._jit_codes import (_activation, _fp4_bytes, _fp4_pair_codes, _fp8_codes, _swiglu,
                         _unpack_pair)
from ._jit_scales import (_amax3, _amax3_bits, _amax_loaded, _amax_pair, _block_scales, _max_nan,
                          _tile_scales)


@triton.jit
def _quant_kernel(
    x_ptr, stride_xb, stride_xm, stride_xk,
    c_ptr, stride_cb, stride_cm,
    s_ptr, stride_sb, stride_sm, stride_sg,
    amax_ptr, static_ptr, nv_ptr, skip_ptr,
    M, K, NG, M_PAD, NG_PAD, ROWS_PER_SCALE,
    GS: tl.constexpr, GB: tl.constexpr, GPP: tl.constexpr, BLOCK_M: tl.constexpr,
    ELEM: tl.constexpr, ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr,
    MBITS: tl.constexpr, SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr,
    FP32_POW2: tl.constexpr, E8_RULE: tl.constexpr, E8_LO: tl.constexpr, E8_HI: tl.constexpr,
    E8_NF: tl.constexpr, AMAX_FLOOR: tl.constexpr, ZERO_BLOCK: tl.constexpr,
    NONFINITE: tl.constexpr, APPLY: tl.constexpr, SATURATE: tl.constexpr, ROUND: tl.constexpr,
    DROP_NEG_ZERO: tl.constexpr, NAN_CODE: tl.constexpr, FILL_CODE: tl.constexpr,
    HW_FP8: tl.constexpr, SF_LAYOUT: tl.constexpr, AMAX_SRC: tl.constexpr, STATIC: tl.constexpr,
    TWO_LEVEL: tl.constexpr, NV_ORDER: tl.constexpr, WRITE_SCALES: tl.constexpr, ROW_SKIP: tl.constexpr,
    ACT: tl.constexpr, ACT_ALPHA: tl.constexpr, ACT_LIMIT: tl.constexpr,
    PAIR: tl.constexpr, IN16: tl.constexpr, DIV: tl.constexpr, PACKED_BF16: tl.constexpr,
    E2M1_PTX: tl.constexpr, HW_SCALE: tl.constexpr, WORD_RUN: tl.constexpr, ROW_GATHER: tl.constexpr = 0,
    GDC_WAIT: tl.constexpr = False,
):
    """Quantize a [BLOCK_M, GPP groups of GS] tile of one matrix of x; see the module docstring.

    AMAX_SRC: 0 = block amax from the tile, 1 = per-scale amax read from ``amax_ptr`` (per-tensor:
    one amax per ROWS_PER_SCALE rows). ACT: 0 = x is the input; 1 = silu_and_mul of a gate_up
    input [.., 2K]; 2 = swigluoai of an interleaved input [.., 2K]; 3 / 4 = erf / tanh gelu_and_mul of a
    gate_up input (fastpath.fused).

    PAIR picks how element pairs are read (FP4 packs pairs into a byte; swigluoai's (gate, up) are
    adjacent): 0 = plain [BLOCK_M, GPP, GB] tiles (FP8); 1 = 16-bit input read as int32 words,
    each word one pair (contiguous rows, even K: 16-byte loads, no shuffles); 2 = generic
    [BLOCK_M, GPP, GB/2, 2] tiles split on the last axis (any strides, any K; slower).

    PACKED_BF16 (GPU only; see ``_constexprs_cached``): with PAIR 1 bfloat16 words and E8M0
    factors, the FP4 branch takes the block amax and the E2M1 RNE codes straight from the words
    with packed bf16x2 PTX (:mod:`fastpath._packed_fp4`, two elements per instruction), the
    same codes as the integer path (tests/test_mxfp4_packed_encode.py emulates the PTX over
    every pattern and factor; the GPU suite compares both paths).

    ROW_SKIP: ``skip_ptr`` holds one int label per row of x (``[B, M]``); a program whose rows all have a
    label < 0 (layout padding: :mod:`fastpath.moe`) returns at once, writing no code and no scale.

    ROW_GATHER > 0 (one matrix, row-major scales with ``M_PAD == M``; not with ROW_SKIP): ``skip_ptr`` holds
    ROW_GATHER row indices of x (a MoE layer's slot -> row map; < 0: no row), program ``pid_m`` quantizes the
    rows of entries ``pid_m * BLOCK_M ...`` (the grid covers the entries, not x's rows); every other row is
    left unwritten. Each row's codes and scales are the full grid's (rows are independent). 0: the code is
    compiled out.

    GDC_WAIT (launched with Programmatic Dependent Launch: ``pdl`` of :mod:`fastpath.fused`): every program
    first lets the kernel after it launch and waits for the kernel before it (:func:`fastpath._host.pdl_launch`).

    E2M1_PTX (GPU only): the other FP4 paths (NVFP4, float16/float32 input) encode each scaled
    float32 value with :func:`fastpath._packed_fp4.e2m1_lane_f32` (``xorsign`` min/max, one FMA,
    integer steps: about 7 instructions, the sign carried along) instead of the integer path,
    and bfloat16 words take the block amax with ``amax_bf16x2``; same codes (emulated on the
    CPU, compared with the integer path on the GPU).
    """
    if GDC_WAIT:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_b = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROW_GATHER > 0:  # rows from the index list; an entry < 0 (or past the list) is row M: masked off
        sel = tl.load(skip_ptr + rows, mask=rows < ROW_GATHER, other=-1)
        rows = tl.where(sel >= 0, sel, M)
        if tl.min(rows, axis=0) >= M:
            return
    gidx = pid_g * GPP + tl.arange(0, GPP)
    rmask = rows < M
    if ROW_SKIP:
        label = tl.load(skip_ptr + pid_b.to(tl.int64) * M + rows, mask=rmask, other=-1)
        if tl.max(label, axis=0) < 0:
            return
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
        elif ACT != 2:  # the gate_up activations (SiLU, GELU)
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
def _amax_partial_kernel(x_ptr, stride_xb, stride_xm, stride_xk, p_ptr, M, K, NPROG,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NONFINITE: tl.constexpr):
    """Partial amax (float32 bits max; NaN above Inf, so it propagates unless NONFINITE 1
    ignores it) of one [BLOCK_M, BLOCK_K] tile of one matrix of x:
    ``p[b * NPROG + pid_m * cdiv(K, BLOCK_K) + pid_k]``. One tile per program and no loop, like
    the data pass (a looped accumulator held 64 registers per thread and the loads waited)."""
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
def _partials_max(p_ptr, NPROG_M, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """The max of ``NPROG_M`` partial amax bit patterns at ``p_ptr``, as float32."""
    acc = tl.zeros((BLOCK,), tl.uint32)
    for it in range(ITERS):
        idx = it * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(p_ptr + idx, mask=idx < NPROG_M, other=0)
        acc = tl.maximum(acc, v)
    return tl.max(acc, axis=0).to(tl.float32, bitcast=True)


@triton.jit
def _amax_final_kernel(p_ptr, out_ptr, NPROG_M, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """out[b] = max of the partial amax bit patterns of matrix b, as float32."""
    pid_b = tl.program_id(0)
    tl.store(out_ptr + pid_b, _partials_max(p_ptr + pid_b * NPROG_M, NPROG_M, BLOCK, ITERS))


@triton.jit
def _per_tensor_scale_kernel(amax_ptr, s_ptr, static_ptr, B, p_ptr, NPROG_M,
                             BLOCK: tl.constexpr, P_ITERS: tl.constexpr,
                             ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr,
                             MBITS: tl.constexpr, SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr,
                             FP32_POW2: tl.constexpr, E8_RULE: tl.constexpr, E8_LO: tl.constexpr,
                             E8_HI: tl.constexpr, E8_NF: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                             ZERO_BLOCK: tl.constexpr, NONFINITE: tl.constexpr, APPLY: tl.constexpr,
                             STATIC: tl.constexpr):
    """The stored per-tensor scale of each matrix (the same _block_scales as the data pass).

    P_ITERS 0: ``amax_ptr`` holds the B amaxes. P_ITERS > 0: the amax pass's last step first
    (:func:`_amax_final_kernel`'s reduction, one launch fewer): matrix b's amax is the max of the
    ``NPROG_M`` partials at ``p_ptr + b * NPROG_M``, stored to ``amax_ptr[b]`` for the data pass."""
    idx = tl.arange(0, BLOCK)
    m = idx < B
    if P_ITERS > 0:
        amax = tl.zeros((BLOCK,), tl.float32)
        for b in range(BLOCK):  # BLOCK >= B matrices (a constexpr bound: no runtime-length loop)
            n_b = tl.where(b < B, NPROG_M, 0)
            a_b = _partials_max(p_ptr + b * NPROG_M, n_b, 1024, P_ITERS)
            tl.store(amax_ptr + b, a_b, mask=b < B)
            amax = tl.where(idx == b, a_b, amax)
    else:
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
def _nvfp4_factors(a_ptr, b_ptr, nv_ptr, glob_ptr, NPROG_M, FROM_AMAX: tl.constexpr, ORDER: tl.constexpr,
                   GLOB: tl.constexpr, P_ITERS: tl.constexpr):
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
    0 for a zero tensor amax. (float64 ``/`` is ``div.rn.f64``.)

    P_ITERS > 0 (with FROM_AMAX): ``a_ptr`` holds the amax pass's ``NPROG_M`` partials, reduced
    here (:func:`_amax_final_kernel`'s step, one launch fewer)."""
    if P_ITERS > 0:
        a_val = _partials_max(a_ptr, NPROG_M, 1024, P_ITERS)
    else:
        a_val = tl.load(a_ptr)
    if FROM_AMAX:
        amax = a_val
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
        glob = (tl.zeros((2,), tl.float32) + a_val).to(tl.float64) / (one64 * 2688.0)
    elif GLOB == 1:
        glob = (tl.zeros((2,), tl.float32) + g_dec).to(tl.float64)
    else:
        glob = one64 / (tl.zeros((2,), tl.float32) + g_enc).to(tl.float64)
    if FROM_AMAX:
        glob = tl.where(a_val == 0.0, 0.0, glob)
    tl.store(glob_ptr + head, glob, mask=head == 0)


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
            # barrier) between the load and the store
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
