"""Triton kernels of the device error bounds (:mod:`moeref.compare.device_bounds`): the per-element
arithmetic of :func:`moeref.compare.gemm_bounds.ordered_dot`, :func:`aligned_adder_gemm_bound` and the
range walks of :func:`contiguous_tree_gemm_bound`, operation for operation.

Compiled with ``enable_fp_fusion=False`` (no multiply-add contraction). Every float64 constant is read
from a float64 tensor (``consts``): Triton types a Python float argument or literal as float32, which
would round ``1 + 2^-40`` to 1. Operands are K-major (``[K, M]``, ``[K, N]``), so a column load is one
coalesced vector. Runs under ``TRITON_INTERPRET=1`` on CPU tensors (CI).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ordered_dot_t", "adder_bound_t", "tree_walks_t"]

_BM, _BN = 32, 32


@triton.jit
def _ordered_dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, NCH: tl.constexpr, C: tl.constexpr,
                        STEPS: tl.constexpr, STEP: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    tot = tl.zeros((BM, BN), dtype=tl.float64)
    for ch in range(0, NCH):
        s = tl.zeros((BM, BN), dtype=tl.float64)
        for j in range(0, STEPS):
            t = tl.zeros((BM, BN), dtype=tl.float64)
            for i in range(0, STEP):
                pos = j * STEP + i
                col = ch * C + pos
                ok = (pos < C) & (col < K)
                xv = tl.load(x_ptr + col * M + rm, mask=mm & ok, other=0.0)
                wv = tl.load(w_ptr + col * N + rn, mask=nm & ok, other=0.0)
                t = t + xv[:, None] * wv[None, :]
            s = s + t
        tot = tot + s
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], tot, mask=mm[:, None] & nm[None, :])


@triton.jit
def _grid(x, wide, min_normal):
    y = x * wide
    p2 = (y.to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)
    return tl.where(y >= min_normal, p2, y)


@triton.jit
def _adder_kernel(a_ptr, w_ptr, r_ptr, sa_ptr, sw_ptr, b_ptr, c_ptr, out_ptr, M, N, K,
                  NCH: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr,
                  MMA: tl.constexpr, EXACT: tl.constexpr, HAS_R: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    u2 = tl.load(c_ptr + 0)
    g_prom = tl.load(c_ptr + 1)
    wide = tl.load(c_ptr + 2)
    min_normal = tl.load(c_ptr + 3)
    final = tl.load(c_ptr + 4)
    one = tl.load(c_ptr + 5)
    zero = tl.load(c_ptr + 6)
    tot_e = tl.zeros((BM, BN), dtype=tl.float64)
    tot_p = tl.zeros((BM, BN), dtype=tl.float64)
    for ch in range(0, NCH):
        err = tl.zeros((BM, BN), dtype=tl.float64)
        prev = tl.zeros((BM, BN), dtype=tl.float64)
        s_sum = tl.zeros((BM, BN), dtype=tl.float64)
        d_sum = tl.zeros((BM, BN), dtype=tl.float64)
        for j in range(0, STEPS):
            pm = tl.zeros((BM, BN), dtype=tl.float64)
            cnt = tl.zeros((BM, BN), dtype=tl.float64)
            ts = tl.zeros((BM, BN), dtype=tl.float64)
            td = tl.zeros((BM, BN), dtype=tl.float64)
            for i in range(0, MMA):
                pos = j * MMA + i
                col = ch * C + pos
                ok = (pos < C) & (col < K)
                av = tl.load(a_ptr + col * M + rm, mask=mm & ok, other=0.0)
                wv = tl.load(w_ptr + col * N + rn, mask=nm & ok, other=0.0)
                wa = tl.abs(wv)
                if HAS_R:
                    rv = tl.load(r_ptr + col * M + rm, mask=mm & ok, other=0.0)
                    au = tl.abs(av) + rv
                else:
                    au = tl.abs(av)
                pa = au[:, None] * wa[None, :]
                pm = tl.where(pa > pm, pa, pm)
                cnt = cnt + tl.where(pa != 0.0, one, zero)
                ts = ts + av[:, None] * wv[None, :]
                if HAS_R:
                    td = td + rv[:, None] * wa[None, :]
            s_sum = s_sum + ts
            s_part = tl.abs(s_sum)
            if HAS_R:
                d_sum = d_sum + td
                s_part = s_part + d_sum
            jf = tl.where(j > 0, one, zero)
            if EXACT:
                g1 = _grid(tl.where(pm > prev, pm, prev), wide, min_normal)
            else:
                g1 = tl.where(pm > prev, pm, prev)
            align = ((cnt + jf) * u2) * g1
            if EXACT:
                g2 = _grid((s_part + err) + align, wide, min_normal)
            else:
                g2 = (s_part + err) + align
            err = (err + align) + u2 * g2
            prev = s_part + err
        if EXACT:
            sa = tl.load(sa_ptr + rm * NCH + ch, mask=mm, other=0.0)
            sw = tl.load(sw_ptr + rn * NCH + ch, mask=nm, other=0.0)
            scale = sa[:, None] * sw[None, :]
            err = err * scale
            prev = prev * scale
        tot_e = tot_e + err
        tot_p = tot_p + prev
    b = tl.load(b_ptr + rn, mask=nm, other=0.0)
    out = tot_e + g_prom * (tot_p + b[None, :])
    out = out * final
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], out, mask=mm[:, None] & nm[None, :])


@triton.jit
def _tree_kernel(a_ptr, w_ptr, rng_ptr, ws_ptr, cs_ptr, M, N, K, KP: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    best = tl.zeros((BM, BN), dtype=tl.float64)
    ws = tl.zeros((BM, BN), dtype=tl.float64)
    walk = tl.zeros((BM, BN), dtype=tl.float64)
    for li in tl.static_range(6):  # 32, 16, 8, 4, 2, 1 lanes
        lanes: tl.constexpr = 32 >> li
        for r in range(0, lanes):
            walk = tl.zeros((BM, BN), dtype=tl.float64)
            mx = tl.zeros((BM, BN), dtype=tl.float64)
            mn = tl.zeros((BM, BN), dtype=tl.float64)
            for t in range(0, KP // lanes):
                col = t * lanes + r
                ok = col < K
                av = tl.load(a_ptr + col * M + rm, mask=mm & ok, other=0.0)
                wv = tl.load(w_ptr + col * N + rn, mask=nm & ok, other=0.0)
                p = av[:, None] * wv[None, :]
                walk = walk + p
                mx = tl.where(walk > mx, walk, mx)
                mn = tl.where(walk < mn, walk, mn)
                if lanes == 1:
                    ws = ws + tl.abs(p)
            top = mx - mn
            best = tl.where(top > best, top, best)
    off = rm[:, None] * N + rn[None, :]
    msk = mm[:, None] & nm[None, :]
    tl.store(rng_ptr + off, best, mask=msk)
    tl.store(ws_ptr + off, ws, mask=msk)
    tl.store(cs_ptr + off, walk, mask=msk)


def _grid2(m: int, n: int):
    return (triton.cdiv(m, _BM), triton.cdiv(n, _BN))


def ordered_dot_t(xt: torch.Tensor, wt: torch.Tensor, chunk: int, step: int) -> torch.Tensor:
    """``x @ w.T`` in :func:`~moeref.compare.gemm_bounds.ordered_dot`'s order; ``xt`` ``[K, M]``, ``wt``
    ``[K, N]`` float64 contiguous. Returns ``[M, N]``."""
    k, m = (int(d) for d in xt.shape)
    n = int(wt.shape[1])
    out = torch.zeros((m, n), dtype=torch.float64, device=xt.device)
    if m == 0 or n == 0 or k == 0:
        return out
    c = max(1, min(chunk, k))
    _ordered_dot_kernel[_grid2(m, n)](xt, wt, out, m, n, k, NCH=-(-k // c), C=c, STEPS=-(-c // step), STEP=step, BM=_BM, BN=_BN,
                                      enable_fp_fusion=False)
    return out


def adder_bound_t(at, wt, rt, sa, sw, b_abs, consts, *, chunk: int, mma: int, steps: int, exact: bool) -> torch.Tensor:
    """The aligned-adder bound ``[M, N]`` (``at`` ``[K, M]``, ``wt`` ``[K, N]``, ``rt`` ``[K, M]`` or None,
    ``sa`` ``[M, NCH]`` / ``sw`` ``[N, NCH]`` chunk scales when ``exact``, ``b_abs`` ``[N]``, ``consts``
    float64 ``[u2, g_prom, 1 + 2^-40, 2^-1022, 1 + 1e-9, 1, 0]``)."""
    k, m = (int(d) for d in at.shape)
    n = int(wt.shape[1])
    out = torch.empty((m, n), dtype=torch.float64, device=at.device)
    nch = -(-k // chunk)
    dummy = consts
    _adder_kernel[_grid2(m, n)](at, wt, rt if rt is not None else dummy, sa if exact else dummy,
                                sw if exact else dummy, b_abs, consts, out, m, n, k, NCH=nch, C=chunk, STEPS=steps,
                                MMA=mma, EXACT=exact, HAS_R=rt is not None, BM=_BM, BN=_BN, enable_fp_fusion=False)
    return out


def tree_walks_t(at, wt, kp: int):
    """``(range, sum |p|, sum p)`` ``[M, N]`` of :func:`contiguous_tree_gemm_bound`'s lane walks over K
    (padded to ``kp`` columns of zeros)."""
    k, m = (int(d) for d in at.shape)
    n = int(wt.shape[1])
    rng = torch.empty((m, n), dtype=torch.float64, device=at.device)
    ws = torch.empty_like(rng)
    cs = torch.empty_like(rng)
    _tree_kernel[_grid2(m, n)](at, wt, rng, ws, cs, m, n, k, KP=kp, BM=_BM, BN=_BN, enable_fp_fusion=False)
    return rng, ws, cs
