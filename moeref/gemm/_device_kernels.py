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
