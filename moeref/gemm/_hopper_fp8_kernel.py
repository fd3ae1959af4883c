"""Triton kernel of :mod:`moeref.gemm.device_hopper_fp8`: Hopper's FP8 WGMMA accumulation and DeepGEMM's FP32
promotion per output element, the arithmetic of :mod:`moeref.gemm.hopper_fp8` (its NumPy code is the
specification; this kernel performs the same exact steps).

Every step is exact or one declared rounding, so the order of evaluation cannot change a bit:

* products of E4M3 values are exact in float64; a step's operand exponents come from the float64 bits
  (``floor(log2 |x|)``, clamped to E4M3's ``emin = -6``; zeros never set the alignment);
* each aligned addend ``x * 2^-q`` (a power-of-two scaling) is cut toward zero by the float64 -> int64
  conversion (C semantics), and the addends are summed as integers (below 2^22 in magnitude); or (``INTEGER``)
  the same integer in int32: a product of E4M3 values is ``sign * m * 2^(e - 6)`` with ``m = |A| |B| < 2^8`` the
  product of the significands as integers (``|x| 2^(3 - e_x)``: 8..15, 1..7 for subnormals) and ``e`` the sum
  of the operand exponents, so ``trunc(p * 2^-q) = sign * ((m << 14) >> (E - e + 20 - ALIGN))`` with
  ``q = E - ALIGN`` (a right shift of a non-negative integer is the floor; shifts past 31 clamped, which gives 0
  as any shift past 22 does; ``m << 14 < 2^22``, the sum of 32 below 2^27);
* the normalisation to 14 significant bits is one more power-of-two scaling and int64 conversion;
* the FP32 promotion is :func:`moeref.gemm.hopper_fp8.fp32_fma`'s: an exact float64 product, an error-free
  sum (compiled without FMA contraction: ``enable_fp_fusion=False``), round-to-odd on the float64 bits,
  one float64 -> float32 conversion (round to nearest even, on the GPU and in the interpreter alike).

With ``TC`` the block accumulators come from the tensor cores instead (:data:`moeref.gemm.device_hopper_fp8.
ACCUMULATOR_SOURCE`): per 128-column K block one ``tl.dot`` of two E4M3 tiles (uint8 codes bit-cast to
``float8e4nv``) with K = 128 into a cleared FP32 accumulator, which Triton lowers on sm_90 to four chained
``wgmma ... k32`` instructions, the instruction the emulator's model was calibrated on; a zero accumulator is
made ``+0`` as the emulator's integer sum gives it. Compiled for sm_90a (Triton 3.6) that dot is four
``wgmma.mma_async ... k32.f32.e4m3.e4m3`` on one accumulator, the first with ``scale-d = 0``
(``tests/test_device_hopper_fp8_tensor_cores.py`` compiles it and checks). The promotion, the scale term and the
stores that follow are the same code in both forms. The interpreter's ``tl.dot`` is not the tensor core (it is not Hopper's adder).

Powers of two are built from their exponent field (``(k + 1023) << 52``), never through ``exp2``/``ldexp``.
Runs under ``TRITON_INTERPRET=1`` on CPU tensors (CI).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pow2(k):
    """2^k as float64 for int64 ``k`` in [-1022, 1023] (from the exponent field: exact)."""
    return ((k + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _expo(x):
    """floor(log2 |x|) of a normal float64 ``x`` (int64; meaningless for 0)."""
    return ((x.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023


@triton.jit
def _operand_expo(x):
    """:func:`moeref.gemm.hopper_fp8.operand_exponents`: clamped to -6, -1000 for a zero."""
    return tl.where(x != 0, tl.maximum(_expo(x), -6), -1000)


@triton.jit
def _f32(x):
    return x.to(tl.float32).to(tl.float64)


@triton.jit
def _fma32(a, b, c):
    """:func:`moeref.gemm.hopper_fp8.fp32_fma`: ``fl32(a*b + c)`` rounded once (FP32 values in float64)."""
    p = a * b
    hi = p + c
    bb = hi - p
    lo = (p - (hi - bb)) + (c - bb)
    bits = hi.to(tl.int64, bitcast=True)
    step = tl.where((lo > 0) == (hi > 0), 1, -1).to(tl.int64)
    bits = tl.where((lo != 0) & ((bits & 1) == 0), bits + step, bits)  # round to odd: one ulp toward lo
    return _f32(bits.to(tl.float64, bitcast=True))


@triton.jit
def _emulated_block(a_ptr, codes_ptr, table_ptr, itab_ptr, r, rm, n, nm, e, ka, kb, stride_a, stride_ce, stride_cn,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr, NORM: tl.constexpr,
                    STEPS: tl.constexpr, INST: tl.constexpr, INTEGER: tl.constexpr):
    """The accumulator (float64 ``[ROWS, BLOCK_N]``, FP32 values) of ``a``'s K block ``ka`` with the weights' K
    block ``kb`` emulated: STEPS chained MMAs of INST columns from a cleared accumulator, ``a`` float64 E4M3
    values, the weights' codes through ``table_ptr`` (float64) or ``itab_ptr`` (``INTEGER``: significands and
    exponents, int32)."""
    kk = tl.arange(0, INST)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    for s in tl.static_range(STEPS):
        ka0 = ka * (STEPS * INST) + s * INST
        k0 = kb * (STEPS * INST) + s * INST
        a = tl.load(a_ptr + r[:, None] * stride_a + (ka0 + kk)[None, :], mask=rm[:, None], other=0.0)
        c = tl.load(codes_ptr + e * stride_ce + n[:, None].to(tl.int64) * stride_cn + (k0 + kk)[None, :],
                    mask=nm[:, None], other=0)
        if INTEGER:
            # a product is sign * m * 2^(e - 6), m = |A| |B| < 2^8 (the significands as integers), e the sum of
            # the operand exponents; cut to the grid 2^q, q = E - ALIGN: (m << 14) >> (E - e + 20 - ALIGN)
            ea = _operand_expo(a).to(tl.int32)
            am = tl.where(a != 0, tl.abs(a) * _pow2(3 - ea.to(tl.int64)), 0.0).to(tl.int32) << 14
            ci = c.to(tl.int32)
            bm = tl.load(itab_ptr + ci)
            ep = ea[:, None, :] + tl.load(itab_ptr + 256 + ci)[None, :, :]
            emax = tl.max(ep, axis=2).to(tl.int64)
            emax = tl.maximum(emax, tl.where(acc != 0, _expo(acc), -2000))
            top = tl.maximum(emax, -60)  # -60: an all-zero step (no addend sets the alignment)
            q = top - ALIGN
            inv = _pow2(-q)
            sh = tl.minimum((top + (20 - ALIGN)).to(tl.int32)[:, :, None] - ep, 31)
            mag = (am[:, None, :] * bm[None, :, :]) >> sh
            neg = (a < 0)[:, None, :] != (ci >= 128)[None, :, :]
            ssum = tl.sum(tl.where(neg, -mag, mag), axis=2).to(tl.int64) + (acc * inv).to(tl.int64)
        else:
            b = tl.load(table_ptr + c.to(tl.int32))
            p = a[:, None, :] * b[None, :, :]
            ep = _operand_expo(a)[:, None, :] + _operand_expo(b)[None, :, :]
            emax = tl.max(ep, axis=2)
            emax = tl.maximum(emax, tl.where(acc != 0, _expo(acc), -2000))
            q = tl.maximum(emax, -60) - ALIGN  # -60: an all-zero step (no addend sets the alignment)
            inv = _pow2(-q)
            ssum = tl.sum((p * inv[:, :, None]).to(tl.int64), axis=2) + (acc * inv).to(tl.int64)
        v = ssum.to(tl.float64) * _pow2(q)
        ev = tl.where(v != 0, _expo(v), -60)
        acc = (v * _pow2((NORM - 1) - ev)).to(tl.int64).to(tl.float64) * _pow2(ev - (NORM - 1))
    return acc


@triton.jit
def _tensor_core_block(a_ptr, codes_ptr, r, rm, n, nm, e, ka, kb, stride_a, stride_ce, stride_cn):
    """The accumulator (float64 ``[ROWS, BLOCK_N]``, FP32 values) of ``a``'s K block ``ka`` with the weights' K
    block ``kb`` from the tensor cores: one ``tl.dot`` of the rows' E4M3 codes (``a``, uint8) and the expert's
    (uint8) with K = 128 into a cleared FP32 accumulator (sm_90: four chained ``wgmma ... k32``); a zero made
    ``+0``."""
    kc = kb * 128 + tl.arange(0, 128)
    a8 = tl.load(a_ptr + r[:, None] * stride_a + (ka * 128 + tl.arange(0, 128))[None, :], mask=rm[:, None], other=0)
    c8 = tl.load(codes_ptr + e * stride_ce + n[:, None].to(tl.int64) * stride_cn + kc[None, :], mask=nm[:, None],
                 other=0)
    acc = tl.dot(a8.to(tl.float8e4nv, bitcast=True), tl.trans(c8.to(tl.float8e4nv, bitcast=True)),
                 out_dtype=tl.float32)
    return tl.where(acc == 0, 0.0, acc).to(tl.float64)


@triton.jit
def _emulate(a_ptr, sa_ptr, codes_ptr, table_ptr, itab_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr, shi_ptr, st_ptr,
             coef_ptr, acc_ptr, N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o,
             stride_ds, NB, W_BN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PROMO: tl.constexpr,
             SCALE_TERM: tl.constexpr, ALIGN: tl.constexpr, NORM: tl.constexpr, STEPS: tl.constexpr, INST: tl.constexpr,
             STORE_ACC: tl.constexpr, INTEGER: tl.constexpr, TC: tl.constexpr):
    """One work item (``item_ptr``: expert, first row, row count) = up to ROWS rows of the gathered operand
    ``a`` (float64 E4M3 values) against BLOCK_N columns of that expert's codes (read through the float64
    decode table ``table_ptr``). Per 128-column K block: STEPS chained MMAs of INST columns from a cleared
    accumulator, then the promotion (PROMO 0: ``fma(fl(sa*sb), acc, final)``, 1: ``fma(fl(acc*sa), sb,
    final)``; ``sb``: the weight scales rounded to FP32, as the kernel reads them). ``out[r, n]`` = the FP32
    result. SCALE_TERM: also ``st[r, n] = sum_b m_b ds[r, b] + coef * sum_b m_b shi[r, b]`` with
    ``m_b = |acc_b| * |sbr_b|`` (``sbr``: the weight scales as given), sums in block order from 0. STORE_ACC:
    also ``acc[r, kb, n]`` (float32 ``[rows, NB, N]``), every block accumulator (an FP32 value: exact). TC: ``a``
    holds the rows' uint8 E4M3 codes and each block accumulator is one ``tl.dot`` of K = 128 on the tensor cores
    from a cleared accumulator (module docstring); the rest is unchanged."""
    it = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(item_ptr + 3 * it).to(tl.int64)
    first = tl.load(item_ptr + 3 * it + 1).to(tl.int64)
    cnt = tl.load(item_ptr + 3 * it + 2)
    i = tl.arange(0, ROWS)
    rm = i < cnt
    r = first + i
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    final = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)  # FP32 values (_fma32 rounds to them): float32, fewer registers
    if SCALE_TERM:
        t1 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
        t2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    for kb in range(0, NB):
        if TC:
            acc = _tensor_core_block(a_ptr, codes_ptr, r, rm, n, nm, e, kb, kb, stride_a, stride_ce, stride_cn)
        else:
            acc = _emulated_block(a_ptr, codes_ptr, table_ptr, itab_ptr, r, rm, n, nm, e, kb, kb, stride_a,
                                  stride_ce, stride_cn, ROWS, BLOCK_N, ALIGN, NORM, STEPS, INST, INTEGER)
        if STORE_ACC:
            tl.store(acc_ptr + (r[:, None] * NB + kb) * N + n[None, :], acc.to(tl.float32),
                     mask=rm[:, None] & nm[None, :])
        sa = tl.load(sa_ptr + r * stride_sa + kb, mask=rm, other=0.0)
        sb = tl.load(sb_ptr + e * stride_sbe + (n // W_BN).to(tl.int64) * stride_sbn + kb, mask=nm, other=0.0)
        if PROMO == 0:
            final = _fma32(_f32(sa[:, None] * sb[None, :]), acc, final.to(tl.float64)).to(tl.float32)
        else:
            final = _fma32(_f32(acc * sa[:, None]), sb[None, :] + tl.zeros((ROWS, BLOCK_N), dtype=tl.float64),
                           final.to(tl.float64)).to(tl.float32)
        if SCALE_TERM:
            sbr = tl.load(sbr_ptr + e * stride_sbe + (n // W_BN).to(tl.int64) * stride_sbn + kb, mask=nm,
                          other=0.0)
            m = tl.abs(acc) * tl.abs(sbr)[None, :]
            d = tl.load(ds_ptr + r * stride_ds + kb, mask=rm, other=0.0)
            h = tl.load(shi_ptr + r * stride_ds + kb, mask=rm, other=0.0)
            t1 = t1 + m * d[:, None]
            t2 = t2 + m * h[:, None]
    mask = rm[:, None] & nm[None, :]
    offs = r[:, None] * stride_o + n[None, :]
    tl.store(out_ptr + offs, final.to(tl.float64), mask=mask)
    if SCALE_TERM:
        coef = tl.load(coef_ptr)
        tl.store(st_ptr + offs, t1 + coef * t2, mask=mask)


@triton.jit
def hopper_fp8_kernel(a_ptr, sa_ptr, codes_ptr, table_ptr, itab_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr,
                      shi_ptr, st_ptr, coef_ptr, acc_ptr, N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe,
                      stride_sbn, stride_o, stride_ds, NB, W_BN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N:
                      tl.constexpr, PROMO: tl.constexpr, SCALE_TERM: tl.constexpr, ALIGN: tl.constexpr, NORM:
                      tl.constexpr, STEPS: tl.constexpr, INST: tl.constexpr, STORE_ACC: tl.constexpr, INTEGER:
                      tl.constexpr, TC: tl.constexpr):
    """The compiled kernel: the number of K blocks ``NB`` is a runtime argument (one compilation for every K)."""
    _emulate(a_ptr, sa_ptr, codes_ptr, table_ptr, itab_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr, shi_ptr, st_ptr,
             coef_ptr, acc_ptr, N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o,
             stride_ds, NB, W_BN, ROWS, BLOCK_N, PROMO, SCALE_TERM, ALIGN, NORM, STEPS, INST, STORE_ACC, INTEGER,
             TC)


@triton.jit
def hopper_fp8_kernel_interpreted(a_ptr, sa_ptr, codes_ptr, table_ptr, itab_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr,
                                  ds_ptr, shi_ptr, st_ptr, coef_ptr, acc_ptr, N, stride_a, stride_sa, stride_ce,
                                  stride_cn, stride_sbe, stride_sbn, stride_o, stride_ds, NB: tl.constexpr, W_BN:
                                  tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PROMO: tl.constexpr,
                                  SCALE_TERM: tl.constexpr, ALIGN: tl.constexpr, NORM: tl.constexpr, STEPS:
                                  tl.constexpr, INST: tl.constexpr, STORE_ACC: tl.constexpr, INTEGER: tl.constexpr,
                                  TC: tl.constexpr):
    """The same under ``TRITON_INTERPRET=1``, whose loops need a constexpr bound."""
    _emulate(a_ptr, sa_ptr, codes_ptr, table_ptr, itab_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr, shi_ptr, st_ptr,
             coef_ptr, acc_ptr, N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o,
             stride_ds, NB, W_BN, ROWS, BLOCK_N, PROMO, SCALE_TERM, ALIGN, NORM, STEPS, INST, STORE_ACC, INTEGER,
             TC)


@triton.jit
def hopper_fp8_block_kernel(a_ptr, codes_ptr, table_ptr, itab_ptr, item_ptr, out_ptr, N, stride_a, stride_ce,
                            stride_cn, stride_o, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
                            NORM: tl.constexpr, STEPS: tl.constexpr, INST: tl.constexpr, INTEGER: tl.constexpr,
                            TC: tl.constexpr):
    """One 128-column K block per row: a work item (``item_ptr``: expert, first row, row count, the weights' K block
    ``kb``) = up to ROWS rows of ``a`` (128 columns: float64 E4M3 values, or with TC their uint8 codes) against
    BLOCK_N columns of that expert's K block ``kb``; ``out[r, n]`` = the block's accumulator (float64, FP32 values),
    the one :func:`_emulate` forms for that block (the same block functions), neither scaled nor promoted. Compiled
    and interpreted alike (no loop)."""
    it = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(item_ptr + 4 * it).to(tl.int64)
    first = tl.load(item_ptr + 4 * it + 1).to(tl.int64)
    cnt = tl.load(item_ptr + 4 * it + 2)
    kb = tl.load(item_ptr + 4 * it + 3).to(tl.int64)
    i = tl.arange(0, ROWS)
    rm = i < cnt
    r = first + i
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    if TC:
        acc = _tensor_core_block(a_ptr, codes_ptr, r, rm, n, nm, e, 0, kb, stride_a, stride_ce, stride_cn)
    else:
        acc = _emulated_block(a_ptr, codes_ptr, table_ptr, itab_ptr, r, rm, n, nm, e, 0, kb, stride_a, stride_ce,
                              stride_cn, ROWS, BLOCK_N, ALIGN, NORM, STEPS, INST, INTEGER)
    tl.store(out_ptr + r[:, None] * stride_o + n[None, :], acc, mask=rm[:, None] & nm[None, :])


@triton.jit
def _replay_block(final, t1, t2, kb, c, r64, rm, mask, n, e, nb_, acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr,
                  sa_ptr, sb_ptr, sbr_ptr, ds_ptr, shi_ptr, N, NB, stride_sbe, stride_sbn, PROMO: tl.constexpr):
    """One K block of :func:`_combos`' replay: block ``kb``'s accumulator (the center's ``acc[r, kb]``, or where
    ``vbase[r, kb] >= 0`` the variant row of combination ``c``) promoted into ``final`` and added to the scale sums
    ``t1``, ``t2``: the operations of :func:`_emulate`'s block step. Returns ``(final, t1, t2)``."""
    acc = tl.load(acc_ptr + (r64[:, None] * NB + kb) * N + n[None, :], mask=mask, other=0.0).to(tl.float64)
    vb = tl.load(vbase_ptr + r64 * NB + kb, mask=rm, other=-1)
    j0 = tl.load(j0_ptr + r64 * NB + kb, mask=rm, other=0)
    nbit = tl.load(nbit_ptr + r64 * NB + kb, mask=rm, other=0)
    vrow = (vb + ((c >> j0) & ((1 << nbit) - 1))).to(tl.int64)
    has = vb >= 0
    va = tl.load(var_ptr + vrow[:, None] * N + n[None, :], mask=mask & has[:, None], other=0.0)
    acc = tl.where(has[:, None], va, acc)
    sa = tl.load(sa_ptr + r64 * NB + kb, mask=rm, other=0.0)
    sb = tl.load(sb_ptr + e[:, None] * stride_sbe + nb_[None, :] * stride_sbn + kb, mask=mask, other=0.0)
    if PROMO == 0:
        final = _fma32(_f32(sa[:, None] * sb), acc, final)
    else:
        final = _fma32(_f32(acc * sa[:, None]), sb, final)
    sbr = tl.load(sbr_ptr + e[:, None] * stride_sbe + nb_[None, :] * stride_sbn + kb, mask=mask, other=0.0)
    m = tl.abs(acc) * tl.abs(sbr)
    d = tl.load(ds_ptr + r64 * NB + kb, mask=rm, other=0.0)
    h = tl.load(shi_ptr + r64 * NB + kb, mask=rm, other=0.0)
    return final, t1 + m * d[:, None], t2 + m * h[:, None]


@triton.jit
def _prefix(ptrs, rws, k_pre, N, NB, stride_sbe, stride_sbn, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
            PROMO: tl.constexpr):
    """:func:`_combos`' shared prefix: ``(final, t1, t2)`` after the blocks ``kb < first[r]`` (the loop runs to
    ``k_pre``, at least every row's ``first``; a row takes a block's step only below its own ``first``)."""
    acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr, sa_ptr, sb_ptr, sbr_ptr, ds_ptr, shi_ptr = ptrs
    r64, rm, mask, n, e, nb_, first, ncomb = rws
    final = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    t1 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    t2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    no_combo = ncomb * 0  # the prefix's blocks hold no varied code: any combination reads the center's
    for kb in range(0, k_pre):
        f_, a_, b_ = _replay_block(final, t1, t2, kb, no_combo, r64, rm, mask, n, e, nb_, acc_ptr, var_ptr, vbase_ptr,
                                   j0_ptr, nbit_ptr, sa_ptr, sb_ptr, sbr_ptr, ds_ptr, shi_ptr, N, NB, stride_sbe,
                                   stride_sbn, PROMO)
        take = (kb < first)[:, None]
        final = tl.where(take, f_, final)
        t1 = tl.where(take, a_, t1)
        t2 = tl.where(take, b_, t2)
    return final, t1, t2


@triton.jit
def _combinations(ptrs, rws, final, t1, t2, center, coef, k_lo, c_hi, N, NB, stride_sbe, stride_sbn,
                  PROMO: tl.constexpr):
    """:func:`_combos`' combinations ``c < c_hi`` (at least every row's ``ncomb``; ``c < ncomb[r]`` kept): each
    continues the prefix ``(final, t1, t2)`` over the blocks from ``k_lo`` (at most every row's ``first``; a row
    takes a block's step only from its own ``first``) to ``NB``. Returns ``worst`` (float64 ``[ROWS, BLOCK_N]``)."""
    acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr, sa_ptr, sb_ptr, sbr_ptr, ds_ptr, shi_ptr = ptrs
    r64, rm, mask, n, e, nb_, first, ncomb = rws
    worst = final * 0.0
    for c in range(0, c_hi):
        fc = final
        u1 = t1
        u2 = t2
        for kb in range(k_lo, NB):
            f_, a_, b_ = _replay_block(fc, u1, u2, kb, c, r64, rm, mask, n, e, nb_, acc_ptr, var_ptr, vbase_ptr,
                                       j0_ptr, nbit_ptr, sa_ptr, sb_ptr, sbr_ptr, ds_ptr, shi_ptr, N, NB, stride_sbe,
                                       stride_sbn, PROMO)
            take = (kb >= first)[:, None]
            fc = tl.where(take, f_, fc)
            u1 = tl.where(take, a_, u1)
            u2 = tl.where(take, b_, u2)
        cand = tl.abs(fc - center) + (u1 + coef * u2)
        worst = tl.where((c < ncomb)[:, None], tl.maximum(worst, cand), worst)
    return worst


@triton.jit
def _combos(acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr, ncomb_ptr, first_ptr, order_ptr, row_e_ptr, sa_ptr, sb_ptr,
            sbr_ptr, ds_ptr, shi_ptr, coef_ptr, center_ptr, worst_ptr, R, N, stride_sbe, stride_sbn, NB, CMAX,
            W_BN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PROMO: tl.constexpr,
            DYNAMIC: tl.constexpr):
    """The promotion of every combination of a row's uncertain codes from its block accumulators, without
    emulating a block twice: ``acc[r, kb, n]`` (float32) are the center's blocks; block ``kb`` of row ``r``
    with uncertain codes (``vbase[r, kb] >= 0``) takes, under combination ``c``, the variant accumulator row
    ``vbase + ((c >> j0[r, kb]) & (2^nbit[r, kb] - 1))`` of ``var`` (float64 ``[V, N]``): the block's own bits of
    ``c``. Per combination ``c < ncomb[r]``: ``y`` and the scale term ``st`` exactly as :func:`_emulate` forms
    them (the same operations, in block order from 0), ``worst[r, n] = max_c(|y - center| + st)`` from 0.

    The blocks before the row's first varied block ``first[r]`` (``NB``: none) are the same under every
    combination: they are promoted once (``final``, ``t1``, ``t2`` up to ``first[r]``), and each combination
    continues that chain from block ``first[r]`` (the chain is sequential in block order, so only this prefix is
    shared; a row takes a block's step only on its own side of ``first[r]``, the steps and their order are those
    of the whole chain). A program takes the ``ROWS`` rows ``order[pid * ROWS ..]`` (the caller sorts them by
    ``ncomb`` and ``first``). DYNAMIC (compiled): the loops run to the program's own bounds, read from its rows
    (combinations to its largest ``ncomb``, the prefix to its largest ``first``, the combinations' blocks from its
    smallest ``first``); else (the interpreter, whose loops need constexpr bounds) to ``CMAX`` and ``NB``, the
    steps past a row's bounds masked off either way: the same values."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = pid_m * ROWS + tl.arange(0, ROWS)
    rm = slot < R
    r64 = tl.load(order_ptr + slot, mask=rm, other=0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    mask = rm[:, None] & nm[None, :]
    e = tl.load(row_e_ptr + r64, mask=rm, other=0).to(tl.int64)
    ncomb = tl.load(ncomb_ptr + r64, mask=rm, other=0)
    first = tl.load(first_ptr + r64, mask=rm, other=NB)
    coef = tl.load(coef_ptr)
    center = tl.load(center_ptr + r64[:, None] * N + n[None, :], mask=mask, other=0.0)
    nb_ = (n // W_BN).to(tl.int64)
    ptrs = (acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr, sa_ptr, sb_ptr, sbr_ptr, ds_ptr, shi_ptr)
    rws = (r64, rm, mask, n, e, nb_, first, ncomb)
    # the loop bounds are passed straight to the loops' functions: the interpreter keeps a constexpr argument a
    # constexpr, not one assigned to a name
    if DYNAMIC:
        final, t1, t2 = _prefix(ptrs, rws, tl.max(tl.where(rm, first, 0), axis=0), N, NB, stride_sbe, stride_sbn,
                                ROWS, BLOCK_N, PROMO)
        worst = _combinations(ptrs, rws, final, t1, t2, center, coef, tl.min(first, axis=0), tl.max(ncomb, axis=0),
                              N, NB, stride_sbe, stride_sbn, PROMO)
    else:
        final, t1, t2 = _prefix(ptrs, rws, NB, N, NB, stride_sbe, stride_sbn, ROWS, BLOCK_N, PROMO)
        worst = _combinations(ptrs, rws, final, t1, t2, center, coef, 0, CMAX, N, NB, stride_sbe, stride_sbn, PROMO)
    tl.store(worst_ptr + r64[:, None] * N + n[None, :], worst, mask=mask)


@triton.jit
def combos_kernel(acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr, ncomb_ptr, first_ptr, order_ptr, row_e_ptr, sa_ptr,
                  sb_ptr, sbr_ptr, ds_ptr, shi_ptr, coef_ptr, center_ptr, worst_ptr, R, N, stride_sbe, stride_sbn, NB,
                  W_BN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PROMO: tl.constexpr):
    """The compiled :func:`_combos`: ``NB`` a runtime argument, each program's loop bounds read from its rows."""
    _combos(acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr, ncomb_ptr, first_ptr, order_ptr, row_e_ptr, sa_ptr, sb_ptr,
            sbr_ptr, ds_ptr, shi_ptr, coef_ptr, center_ptr, worst_ptr, R, N, stride_sbe, stride_sbn, NB, 0, W_BN,
            ROWS, BLOCK_N, PROMO, True)


@triton.jit
def combos_kernel_interpreted(acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr, ncomb_ptr, first_ptr, order_ptr,
                              row_e_ptr, sa_ptr, sb_ptr, sbr_ptr, ds_ptr, shi_ptr, coef_ptr, center_ptr, worst_ptr, R,
                              N, stride_sbe, stride_sbn, NB: tl.constexpr, CMAX: tl.constexpr, W_BN: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PROMO: tl.constexpr):
    """The same under ``TRITON_INTERPRET=1`` (constexpr loop bounds: ``CMAX``, the launch's largest ``ncomb``, and
    ``NB``)."""
    _combos(acc_ptr, var_ptr, vbase_ptr, j0_ptr, nbit_ptr, ncomb_ptr, first_ptr, order_ptr, row_e_ptr, sa_ptr, sb_ptr,
            sbr_ptr, ds_ptr, shi_ptr, coef_ptr, center_ptr, worst_ptr, R, N, stride_sbe, stride_sbn, NB, CMAX, W_BN,
            ROWS, BLOCK_N, PROMO, False)
