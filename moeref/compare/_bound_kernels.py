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
ITEM_COST_ROWS = 6
"""A work item's weight read in rows of arithmetic: 8 bytes per float64 weight at ~3 TB/s against ~7 float64
operations per product at ~17 T/s (H100), ~6 rows (:func:`items`)."""


@triton.jit
def _ordered_dot_kernel(x_ptr, w_ptr, out_ptr, it_ptr, M, N, K, NCH: tl.constexpr, C: tl.constexpr,
                        STEPS: tl.constexpr, STEP: tl.constexpr, ABS_W: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr):
    g, rm, mm = _item(it_ptr, BM)
    w_ptr += g.to(tl.int64) * K * N
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
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
                if ABS_W:
                    wv = tl.abs(wv)
                t = t + xv[:, None] * wv[None, :]
            s = s + t
        tot = tot + s
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], tot, mask=mm[:, None] & nm[None, :])


@triton.jit
def _item(it_ptr, BM: tl.constexpr):
    """Work item ``program_id(0)``: ``(expert g, first row, rows)``; the item's row indices and mask."""
    i = tl.program_id(0)
    g = tl.load(it_ptr + 3 * i)
    r0 = tl.load(it_ptr + 3 * i + 1)
    cnt = tl.load(it_ptr + 3 * i + 2)
    r = tl.arange(0, BM)
    return g, r0 + r, r < cnt


@triton.jit
def _grid(x, wide, min_normal):
    y = x * wide
    p2 = (y.to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)
    return tl.where(y >= min_normal, p2, y)


@triton.jit
def _adder_kernel(a_ptr, w_ptr, r_ptr, sa_ptr, sw_ptr, b_ptr, c_ptr, out_ptr, it_ptr, M, N, K,
                  NCH: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr,
                  MMA: tl.constexpr, EXACT: tl.constexpr, HAS_R: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr):
    g, rm, mm = _item(it_ptr, BM)
    w_ptr += g.to(tl.int64) * K * N
    sw_ptr += g.to(tl.int64) * N * NCH
    b_ptr += g.to(tl.int64) * N
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
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
def _tree_kernel(a_ptr, w_ptr, rng_ptr, ws_ptr, cs_ptr, it_ptr, M, N, K, KP: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr):
    g, rm, mm = _item(it_ptr, BM)
    w_ptr += g.to(tl.int64) * K * N
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = rn < N
    best = tl.zeros((BM, BN), dtype=tl.float64)
    ws = tl.zeros((BM, BN), dtype=tl.float64)
    walk = tl.zeros((BM, BN), dtype=tl.float64)
    for li in tl.static_range(6):  # 32, 16, 8, 4, 2, 1 lanes
        for r in range(0, 32 >> li):
            walk = tl.zeros((BM, BN), dtype=tl.float64)
            mx = tl.zeros((BM, BN), dtype=tl.float64)
            mn = tl.zeros((BM, BN), dtype=tl.float64)
            for t in range(0, KP // (32 >> li)):
                col = t * (32 >> li) + r
                ok = col < K
                av = tl.load(a_ptr + col * M + rm, mask=mm & ok, other=0.0)
                wv = tl.load(w_ptr + col * N + rn, mask=nm & ok, other=0.0)
                p = av[:, None] * wv[None, :]
                walk = walk + p
                mx = tl.where(walk > mx, walk, mx)
                mn = tl.where(walk < mn, walk, mn)
                if li == 5:  # one lane: the plain walk, and sum |p| in K order
                    ws = ws + tl.abs(p)
            top = mx - mn
            best = tl.where(top > best, top, best)
    off = rm[:, None] * N + rn[None, :]
    msk = mm[:, None] & nm[None, :]
    tl.store(rng_ptr + off, best, mask=msk)
    tl.store(ws_ptr + off, ws, mask=msk)
    tl.store(cs_ptr + off, walk, mask=msk)


def items(row_counts, device) -> tuple[torch.Tensor, int]:
    """Work items ``[T, 3]`` int32 ``(expert g, first row, rows)`` over groups of ``row_counts[g]`` consecutive
    rows (expert ``g``'s rows follow expert ``g - 1``'s), rows per item ``BM``; returns ``(items, BM)``.

    ``BM`` (a power of two, at most 32) minimizes the padded rows computed (``sum ceil(c / BM) * BM``) plus
    :data:`ITEM_COST_ROWS` per item (each item reads its expert's float64 weights once): with few rows per
    expert (decode-sized batches) a tile of the largest group's size would mostly compute padding. The bound
    of each element does not depend on the tile (its columns are summed in the same order in any tile)."""
    import numpy as np

    counts = np.asarray(row_counts, dtype=np.int64)
    top = min(_BM, triton.next_power_of_2(int(max(counts.max(initial=1), 1))))
    cands = [1 << i for i in range(top.bit_length()) if (1 << i) <= top]
    bm = min(cands, key=lambda b: (int((-(-counts // b) * b).sum() + ITEM_COST_ROWS * (-(-counts // b)).sum()), -b))
    starts = np.cumsum(counts) - counts
    per = -(-counts // bm)
    g = np.repeat(np.arange(counts.size), per)
    first = np.repeat(starts, per) + bm * (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per))
    cnt = np.minimum(np.repeat(starts + counts, per) - first, bm)
    it = np.stack([g, first, cnt], axis=1).astype(np.int32)
    return torch.as_tensor(it, device=device).contiguous(), bm


def _launch(it, bm: int, n: int):
    bn = min(256, max(_BN, 1024 // bm))
    return (int(it.shape[0]), triton.cdiv(n, bn)), bn


def ordered_dot_t(xt, wt, it, bm: int, chunk: int, step: int, *, abs_w: bool = False) -> torch.Tensor:
    """``x @ w[g].T`` per item in :func:`~moeref.compare.gemm_bounds.ordered_dot`'s order; ``xt`` ``[K, M]``,
    ``wt`` ``[G, K, N]`` float64 contiguous (``|wt|`` read if ``abs_w``), ``it`` :func:`items`. Returns
    ``[M, N]``."""
    k, m = (int(d) for d in xt.shape)
    n = int(wt.shape[2])
    out = torch.zeros((m, n), dtype=torch.float64, device=xt.device)
    if m == 0 or n == 0 or k == 0 or it.shape[0] == 0:
        return out
    c = max(1, min(chunk, k))
    grid, bn = _launch(it, bm, n)
    _ordered_dot_kernel[grid](xt, wt, out, it, m, n, k, NCH=-(-k // c), C=c, STEPS=-(-c // step), STEP=step, ABS_W=abs_w, BM=bm,
                              BN=bn, enable_fp_fusion=False)
    return out


def adder_bound_t(at, wt, rt, sa, sw, b_abs, consts, it, bm: int, *, chunk: int, mma: int, steps: int,
                  exact: bool) -> torch.Tensor:
    """The aligned-adder bound ``[M, N]`` (``at`` ``[K, M]``, ``wt`` ``[G, K, N]``, ``rt`` ``[K, M]`` or None,
    ``sa`` ``[M, NCH]`` / ``sw`` ``[G, N, NCH]`` chunk scales when ``exact``, ``b_abs`` ``[G, N]``, ``consts``
    float64 ``[u2, g_prom, 1 + 2^-40, 2^-1022, 1 + 1e-9, 1, 0]``, ``it`` :func:`items`)."""
    k, m = (int(d) for d in at.shape)
    n = int(wt.shape[2])
    out = torch.zeros((m, n), dtype=torch.float64, device=at.device)
    if it.shape[0] == 0 or n == 0:
        return out
    nch = -(-k // chunk)
    dummy = consts
    grid, bn = _launch(it, bm, n)
    _adder_kernel[grid](at, wt, rt if rt is not None else dummy, sa if exact else dummy, sw if exact else dummy,
                        b_abs, consts, out, it, m, n, k, NCH=nch, C=chunk, STEPS=steps, MMA=mma, EXACT=exact,
                        HAS_R=rt is not None, BM=bm, BN=bn, enable_fp_fusion=False)
    return out


def tree_walks_t(at, wt, it, bm: int, kp: int):
    """``(range, sum |p|, sum p)`` ``[M, N]`` of :func:`contiguous_tree_gemm_bound`'s lane walks over K
    (padded to ``kp`` columns of zeros); ``wt`` ``[G, K, N]``."""
    k, m = (int(d) for d in at.shape)
    n = int(wt.shape[2])
    rng = torch.zeros((m, n), dtype=torch.float64, device=at.device)
    ws = torch.zeros_like(rng)
    cs = torch.zeros_like(rng)
    if it.shape[0] == 0 or n == 0:
        return rng, ws, cs
    grid, bn = _launch(it, bm, n)
    _tree_kernel[grid](at, wt, rng, ws, cs, it, m, n, k, KP=kp, BM=bm, BN=bn, enable_fp_fusion=False)
    return rng, ws, cs
