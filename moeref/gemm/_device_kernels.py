"""Triton kernel of the device engine (:mod:`moeref.gemm.device`): the scaled, in-order segment sum.

Compiled with ``enable_fp_fusion=False``: ``acc + (p * sa) * sb`` must round three times, as NumPy
does, never as one fused multiply-add. Runs under ``TRITON_INTERPRET=1`` on CPU tensors (CI).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ordered_scaled_sum"]


@triton.jit
def _ordered_scaled_sum_kernel(p_ptr, sa_ptr, sb_ptr, out_ptr, rows_ptr, R, N, r0,
                               stride_ps, stride_pr, stride_sar, stride_sbn, stride_or,
                               S: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = r < R
    nm = n < N
    mask = rm[:, None] & nm[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float64)
    for s in range(0, S):
        p = tl.load(p_ptr + s * stride_ps + r[:, None] * stride_pr + n[None, :], mask=mask, other=0.0)
        a = tl.load(sa_ptr + r * stride_sar + s, mask=rm, other=1.0)
        b = tl.load(sb_ptr + n * stride_sbn + s, mask=nm, other=1.0)
        t = p * a[:, None]
        t = t * b[None, :]
        acc = acc + t
    if HAS_ROWS:
        dst = tl.load(rows_ptr + r, mask=rm, other=0)
    else:
        dst = r + r0
    tl.store(out_ptr + dst[:, None].to(tl.int64) * stride_or + n[None, :], acc, mask=mask)


def ordered_scaled_sum(p: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out: torch.Tensor, rows, r0: int) -> None:
    """``out[rows[i], n] = sum_s (p[s, i, n] * sa[i, s]) * sb[n, s]`` in ``s`` order from +0.0
    (``rows`` None: row ``r0 + i``). ``p`` float64 ``[S, R, N]`` (contiguous), ``sa`` ``[R, S]``,
    ``sb`` ``[N, S]``, ``out`` float64 ``[*, N]`` with unit column stride."""
    S, R, N = (int(d) for d in p.shape)
    if R == 0 or N == 0:
        return
    p = p.contiguous()
    sa = sa.contiguous()
    sb = sb.contiguous()
    if out.stride(1) != 1:
        raise ValueError("out must have unit column stride")
    rows_t = rows if rows is not None else sa  # a dummy pointer when HAS_ROWS is False
    block_r, block_n = 16, 64
    grid = (triton.cdiv(R, block_r), triton.cdiv(N, block_n))
    _ordered_scaled_sum_kernel[grid](p, sa, sb, out, rows_t, R, N, r0,
                                     p.stride(0), p.stride(1), sa.stride(0), sb.stride(0), out.stride(0),
                                     S=S, HAS_ROWS=rows is not None, BLOCK_R=block_r, BLOCK_N=block_n,
                                     enable_fp_fusion=False)


@triton.jit
def _exact_few_rows_kernel(a_ptr, sa_ptr, pos_ptr, codes_ptr, table_ptr, sb_ptr, out_ptr,
                           item_expert_ptr, item_start_ptr, item_count_ptr, N, K,
                           stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o,
                           S: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, W_BN: tl.constexpr, W_BK: tl.constexpr, PACKED: tl.constexpr,
                           E4M3_CAST: tl.constexpr):
    """One work item = up to ROWS rows of one expert x BLOCK_N output columns, reading the expert's codes
    directly: P_s = sum over the segment's products (float64, exact in any order), then
    acc = acc + (P_s * sa) * sb in segment order (compiled without FMA contraction)."""
    pid_n = tl.program_id(0)
    item = tl.program_id(1)
    e = tl.load(item_expert_ptr + item).to(tl.int64)
    start = tl.load(item_start_ptr + item)
    count = tl.load(item_count_ptr + item)
    r = tl.arange(0, ROWS)
    rm = r < count
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BK)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    for s in range(S):
        p = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
        for j in range(G // BK):
            k = s * G + j * BK + kk
            km = k < K
            a = tl.load(a_ptr + (start + r)[:, None].to(tl.int64) * stride_a + k[None, :],
                        mask=rm[:, None] & km[None, :], other=0.0)
            wmask = nm[:, None] & km[None, :]
            if PACKED:
                byte = tl.load(codes_ptr + e * stride_ce + n[:, None].to(tl.int64) * stride_cn + (k // 2)[None, :],
                               mask=wmask, other=0)
                c = (byte >> ((k % 2) * 4)[None, :].to(tl.uint8)) & 0xF
            else:
                c = tl.load(codes_ptr + e * stride_ce + n[:, None].to(tl.int64) * stride_cn + k[None, :],
                            mask=wmask, other=0)
            if E4M3_CAST:
                w = c.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.float64)
            else:
                w = tl.load(table_ptr + c.to(tl.int32))
            w = tl.where(wmask, w, 0.0)
            # float64 products and sums, exact in any order (Triton 3.6 cannot lower a float64 tl.dot on
            # sm_90: ConvertTritonGPUToLLVM fails, H100, 2026-11-24)
            p += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
        sa = tl.load(sa_ptr + (start + r).to(tl.int64) * stride_sa + s, mask=rm, other=1.0)
        sb = tl.load(sb_ptr + e * stride_sbe + (n // W_BN) * stride_sbn + (s * G) // W_BK, mask=nm, other=1.0)
        t = p * sa[:, None]
        t = t * sb[None, :]
        acc = acc + t
    dst = tl.load(pos_ptr + start + r, mask=rm, other=0)
    tl.store(out_ptr + dst[:, None].to(tl.int64) * stride_o + n[None, :], acc, mask=rm[:, None] & nm[None, :])


def exact_few_rows(av: torch.Tensor, sa: torch.Tensor, pos: torch.Tensor, codes: torch.Tensor, table: torch.Tensor,
                   scales: torch.Tensor, out: torch.Tensor, items: torch.Tensor, *, g: int, n: int, k: int,
                   w_block: tuple, packed: bool, e4m3: bool, rows: int) -> None:
    """The few-rows exact product of :mod:`moeref.gemm.device` (see the kernel's docstring).

    ``av`` float64 ``[R, K]`` rows sorted by expert; ``sa`` float64 ``[R, S]``; ``pos`` int64 ``[R]`` output
    row of each sorted row; ``codes`` uint8 ``[E, N, K or K/2]``; ``table`` float64 decode table;
    ``scales`` float64 ``[E, gN, gK]``; ``items`` int32 ``[3, I]``: expert, first sorted row, row count
    (<= ``rows``) of each work item."""
    s = -(-k // g)
    bk = 16 if g % 16 == 0 else (8 if g % 8 == 0 else 1)
    block_n = 32 if out.device.type == "cuda" else 16
    n_items = int(items.shape[1])
    if n_items == 0:
        return
    grid = (triton.cdiv(n, block_n), n_items)
    _exact_few_rows_kernel[grid](av, sa, pos, codes, table, scales, out, items[0], items[1], items[2], n, k,
                                 av.stride(0), sa.stride(0), codes.stride(0), codes.stride(1), scales.stride(0),
                                 scales.stride(1), out.stride(0), S=s, G=g, BK=bk, ROWS=rows, BLOCK_N=block_n,
                                 W_BN=int(w_block[0]), W_BK=int(w_block[1]), PACKED=packed, E4M3_CAST=e4m3,
                                 num_warps=4, enable_fp_fusion=False)


@triton.jit
def _digits(code, itab_ptr, mask):
    """The element's exact integer value ``I = value * 2^q`` (a signed int32 table lookup) as three signed
    base-128 digits, each an int8 (0 where ``mask`` is False): ``I = d0 + 128 d1 + 16384 d2``."""
    iv = tl.load(itab_ptr + code.to(tl.int32))
    return _split_digits(tl.where(mask, iv, 0))


@triton.jit
def _split_digits(iv):
    """int32 ``I`` (``|I| < 2^21``) as three signed base-128 int8 digits: ``I = d0 + 128 d1 + 16384 d2``."""
    mag = tl.abs(iv)
    neg = iv < 0
    d0 = mag & 127
    d1 = (mag >> 7) & 127
    d2 = mag >> 14
    return (tl.where(neg, -d0, d0).to(tl.int8), tl.where(neg, -d1, d1).to(tl.int8),
            tl.where(neg, -d2, d2).to(tl.int8))


@triton.jit
def _exact_digits_kernel(a_ptr, sa_ptr, pos_ptr, codes_ptr, itab_a_ptr, itab_w_ptr, sb_ptr, out_ptr,
                         item_expert_ptr, item_start_ptr, item_count_ptr, N, K,
                         stride_a, stride_sa, stride_ce, stride_cn, stride_sbe, stride_sbn, stride_o, unit,
                         S: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, W_BN: tl.constexpr, W_BK: tl.constexpr, PACKED: tl.constexpr,
                         DA: tl.constexpr, DW: tl.constexpr):
    """Exact partial dots of integer-valued elements on the int8 tensor cores.

    Both operands' elements are integers times a power of two (``I_a 2^-qa``, ``I_w 2^-qw``; E4M3: ``q = 9``,
    ``|I| <= 229376 < 2^21``), split into DA / DW signed base-128 digits. Per segment of G columns, the digit
    products of each diagonal ``d = i + j`` are int8 x int8 dots accumulated exactly in int32 (at most
    3 x G x 127^2 < 2^31 for G < 44000), and ``P_s = unit * sum_d acc_d 128^d`` is exact in float64 (integers
    below 2^52, times the power of two ``unit = 2^-(qa+qw)``). Then, as every engine:
    ``acc = acc + (P_s * sa) * sb`` in segment order (compiled without FMA contraction)."""
    pid_n = tl.program_id(0)
    item = tl.program_id(1)
    e = tl.load(item_expert_ptr + item).to(tl.int64)
    start = tl.load(item_start_ptr + item)
    count = tl.load(item_count_ptr + item)
    r = tl.arange(0, ROWS)
    rm = r < count
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BK)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float64)
    for s in range(S):
        c0 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
        c1 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
        c2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
        c3 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
        c4 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
        for j in range(G // BK):
            k = s * G + j * BK + kk
            km = k < K
            amask = rm[:, None] & km[None, :]
            ca = tl.load(a_ptr + (start + r)[:, None].to(tl.int64) * stride_a + k[None, :], mask=amask, other=0)
            wmask = nm[None, :] & km[:, None]
            if PACKED:
                byte = tl.load(codes_ptr + e * stride_ce + n[None, :].to(tl.int64) * stride_cn + (k // 2)[:, None],
                               mask=wmask, other=0)
                cw = (byte >> ((k % 2) * 4)[:, None].to(tl.uint8)) & 0xF
            else:
                cw = tl.load(codes_ptr + e * stride_ce + n[None, :].to(tl.int64) * stride_cn + k[:, None],
                             mask=wmask, other=0)
            a0, a1, a2 = _digits(ca, itab_a_ptr, amask)
            w0, w1, w2 = _digits(cw, itab_w_ptr, wmask)
            c0 += tl.dot(a0, w0, out_dtype=tl.int32)
            if DW > 1:
                c1 += tl.dot(a0, w1, out_dtype=tl.int32)
            if DA > 1:
                c1 += tl.dot(a1, w0, out_dtype=tl.int32)
            if DW > 2:
                c2 += tl.dot(a0, w2, out_dtype=tl.int32)
            if DA > 1 and DW > 1:
                c2 += tl.dot(a1, w1, out_dtype=tl.int32)
            if DA > 2:
                c2 += tl.dot(a2, w0, out_dtype=tl.int32)
            if DA > 1 and DW > 2:
                c3 += tl.dot(a1, w2, out_dtype=tl.int32)
            if DA > 2 and DW > 1:
                c3 += tl.dot(a2, w1, out_dtype=tl.int32)
            if DA > 2 and DW > 2:
                c4 += tl.dot(a2, w2, out_dtype=tl.int32)
        # integers below 2^52: every product and partial sum here is exact in float64
        p = c4.to(tl.float64) * 128.0 + c3.to(tl.float64)
        p = p * 128.0 + c2.to(tl.float64)
        p = p * 128.0 + c1.to(tl.float64)
        p = p * 128.0 + c0.to(tl.float64)
        p = p * unit
        sa = tl.load(sa_ptr + (start + r).to(tl.int64) * stride_sa + s, mask=rm, other=1.0)
        sb = tl.load(sb_ptr + e * stride_sbe + (n // W_BN) * stride_sbn + (s * G) // W_BK, mask=nm, other=1.0)
        t = p * sa[:, None]
        t = t * sb[None, :]
        acc = acc + t
    dst = tl.load(pos_ptr + start + r, mask=rm, other=0)
    tl.store(out_ptr + dst[:, None].to(tl.int64) * stride_o + n[None, :], acc, mask=rm[:, None] & nm[None, :])


def exact_digits(a_codes: torch.Tensor, sa: torch.Tensor, pos: torch.Tensor, codes: torch.Tensor,
                 itab_a: torch.Tensor, itab_w: torch.Tensor, unit: float, digits: tuple, scales: torch.Tensor,
                 out: torch.Tensor, items: torch.Tensor, *, g: int, n: int, k: int, w_block: tuple, packed: bool,
                 rows: int) -> None:
    """The int8-digit exact product of :mod:`moeref.gemm.device` (the kernel's docstring).

    ``a_codes`` uint8 ``[R, K]`` rows sorted by expert; ``itab_a``/``itab_w`` int32 ``I(code)`` tables;
    ``unit`` = ``2^-(qa+qw)``; ``digits`` = ``(DA, DW)``; ``g`` a multiple of 32; the rest as
    :func:`exact_few_rows`."""
    s = -(-k // g)
    bk = next(b for b in (128, 64, 32) if g % b == 0)
    block_n = 64 if out.device.type == "cuda" else 16
    n_items = int(items.shape[1])
    if n_items == 0:
        return
    grid = (triton.cdiv(n, block_n), n_items)
    _exact_digits_kernel[grid](a_codes, sa, pos, codes, itab_a, itab_w, scales, out, items[0], items[1], items[2],
                               n, k, a_codes.stride(0), sa.stride(0), codes.stride(0), codes.stride(1),
                               scales.stride(0), scales.stride(1), out.stride(0), unit, S=s, G=g, BK=bk, ROWS=rows,
                               BLOCK_N=block_n, W_BN=int(w_block[0]), W_BK=int(w_block[1]), PACKED=packed,
                               DA=int(digits[0]), DW=int(digits[1]), num_warps=4, enable_fp_fusion=False)
