"""Triton kernel of :mod:`moeref.gemm.device_hopper_fp8`: Hopper's FP8 WGMMA accumulation and DeepGEMM's FP32
promotion per output element, the arithmetic of :mod:`moeref.gemm.hopper_fp8` (its NumPy code is the
specification; this kernel performs the same exact steps).

Every step is exact or one declared rounding, so the order of evaluation cannot change a bit:

* products of E4M3 values are exact in float64; a step's operand exponents come from the float64 bits
  (``floor(log2 |x|)``, clamped to E4M3's ``emin = -6``; zeros never set the alignment);
* each aligned addend ``x * 2^-q`` (a power-of-two scaling) is cut toward zero by the float64 -> int64
  conversion (C semantics), and the addends are summed as integers (below 2^22 in magnitude);
* the normalisation to 14 significant bits is one more power-of-two scaling and int64 conversion;
* the FP32 promotion is :func:`moeref.gemm.hopper_fp8.fp32_fma`'s: an exact float64 product, an error-free
  sum (compiled without FMA contraction: ``enable_fp_fusion=False``), round-to-odd on the float64 bits,
  one float64 -> float32 conversion (round to nearest even, on the GPU and in the interpreter alike).

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
def _emulate(a_ptr, sa_ptr, codes_ptr, table_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr, shi_ptr, st_ptr, coef_ptr,
             N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o, stride_ds, NB,
             W_BN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PROMO: tl.constexpr,
             SCALE_TERM: tl.constexpr, ALIGN: tl.constexpr, NORM: tl.constexpr, STEPS: tl.constexpr,
             INST: tl.constexpr):
    """One work item (``item_ptr``: expert, first row, row count) = up to ROWS rows of the gathered operand
    ``a`` (float64 E4M3 values) against BLOCK_N columns of that expert's codes (read through the float64
    decode table ``table_ptr``). Per 128-column K block: STEPS chained MMAs of INST columns from a cleared
    accumulator, then the promotion (PROMO 0: ``fma(fl(sa*sb), acc, final)``, 1: ``fma(fl(acc*sa), sb,
    final)``; ``sb``: the weight scales rounded to FP32, as the kernel reads them). ``out[r, n]`` = the FP32
    result. SCALE_TERM: also ``st[r, n] = sum_b m_b ds[r, b] + coef * sum_b m_b shi[r, b]`` with
    ``m_b = |acc_b| * |sbr_b|`` (``sbr``: the weight scales as given), sums in block order from 0."""
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
    kk = tl.arange(0, INST)
    final = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    if SCALE_TERM:
        t1 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
        t2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    for kb in range(0, NB):
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
        for s in tl.static_range(STEPS):
            k0 = kb * (STEPS * INST) + s * INST
            a = tl.load(a_ptr + r[:, None] * stride_a + (k0 + kk)[None, :], mask=rm[:, None], other=0.0)
            c = tl.load(codes_ptr + e * stride_ce + n[:, None].to(tl.int64) * stride_cn + (k0 + kk)[None, :],
                        mask=nm[:, None], other=0)
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
        sa = tl.load(sa_ptr + r * stride_sa + kb, mask=rm, other=0.0)
        sb = tl.load(sb_ptr + e * stride_sbe + (n // W_BN).to(tl.int64) * stride_sbn + kb, mask=nm, other=0.0)
        if PROMO == 0:
            final = _fma32(_f32(sa[:, None] * sb[None, :]), acc, final)
        else:
            final = _fma32(_f32(acc * sa[:, None]), sb[None, :] + tl.zeros((ROWS, BLOCK_N), dtype=tl.float64),
                           final)
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
    tl.store(out_ptr + offs, final, mask=mask)
    if SCALE_TERM:
        coef = tl.load(coef_ptr)
        tl.store(st_ptr + offs, t1 + coef * t2, mask=mask)


@triton.jit
def hopper_fp8_kernel(a_ptr, sa_ptr, codes_ptr, table_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr, shi_ptr,
                      st_ptr, coef_ptr, N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o,
                      stride_ds, NB, W_BN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      PROMO: tl.constexpr, SCALE_TERM: tl.constexpr, ALIGN: tl.constexpr, NORM: tl.constexpr,
                      STEPS: tl.constexpr, INST: tl.constexpr):
    """The compiled kernel: the number of K blocks ``NB`` is a runtime argument (one compilation for every K)."""
    _emulate(a_ptr, sa_ptr, codes_ptr, table_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr, shi_ptr, st_ptr,
             coef_ptr, N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o, stride_ds, NB,
             W_BN, ROWS, BLOCK_N, PROMO, SCALE_TERM, ALIGN, NORM, STEPS, INST)


@triton.jit
def hopper_fp8_kernel_interpreted(a_ptr, sa_ptr, codes_ptr, table_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr,
                                  shi_ptr, st_ptr, coef_ptr, N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe,
                                  stride_sbn, stride_o, stride_ds, NB: tl.constexpr, W_BN: tl.constexpr,
                                  ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PROMO: tl.constexpr,
                                  SCALE_TERM: tl.constexpr, ALIGN: tl.constexpr, NORM: tl.constexpr,
                                  STEPS: tl.constexpr, INST: tl.constexpr):
    """The same under ``TRITON_INTERPRET=1``, whose loops need a constexpr bound."""
    _emulate(a_ptr, sa_ptr, codes_ptr, table_ptr, sb_ptr, sbr_ptr, item_ptr, out_ptr, ds_ptr, shi_ptr, st_ptr,
             coef_ptr, N, stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o, stride_ds, NB,
             W_BN, ROWS, BLOCK_N, PROMO, SCALE_TERM, ALIGN, NORM, STEPS, INST)
