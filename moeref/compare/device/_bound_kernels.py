"""Triton kernels of the device error bounds (:mod:`moeref.compare.device.bounds`): the per-element
arithmetic of :func:`moeref.compare.summation_order.ordered_dot`, :func:`aligned_adder_gemm_bound` and the
range walks of :func:`contiguous_tree_gemm_bound`, operation for operation.

Compiled with ``enable_fp_fusion=False`` (no multiply-add contraction). Every float64 constant is read
from a float64 tensor (``consts``): Triton types a Python float argument or literal as float32, which
would round ``1 + 2^-40`` to 1. Operands are K-major (``[K, M]``, ``[K, N]``), so a column load is one
coalesced vector. Runs under ``TRITON_INTERPRET=1`` on CPU tensors (CI).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..summation_order import grouped_columns

__all__ = ["ordered_dot_t", "adder_bound_t", "tree_walks_t", "CodedWeights"]

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
def _partial(s_sum, d_sum, HAS_R: tl.constexpr):
    """``|S_j|`` of the recurrence: ``|s_sum|``, plus the radius term's partial sum ``d_sum`` with a radius."""
    if HAS_R:
        return tl.abs(s_sum) + d_sum
    else:
        return tl.abs(s_sum)


@triton.jit
def _adder_kernel(a_ptr, rs_ptr, w_ptr, tab_ptr, sc_ptr, b_ptr, c_ptr, out_ptr, tp_ptr, rt_ptr, it_ptr, MP, N, K,
                  NCH: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr, MMA: tl.constexpr, BK: tl.constexpr,
                  MASKED: tl.constexpr, HAS_R: tl.constexpr, RTERM: tl.constexpr, CODES: tl.constexpr,
                  UNROLL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound` in the scaled form (:func:`adder_bound_t`), one
    ``[BM, BN]`` tile of one work item. Per product only the step sums ``ts = ts + a w`` and ``td = td + r |w|``
    (two multiplies and two adds, no contraction); the step's column summaries (largest ``|w|`` ignoring NaN,
    from +0, and nonzero count) are taken from the weights as they are loaded, the row summaries read from
    ``rs``; the recurrence runs once per step. ``a``: records ``(value, radius)`` ``[P, MP, 2]`` in grouped
    column order; ``w``: float64 ``[G, K, N]``, or with ``CODES`` uint8 codes ``[G, K, N]`` read through the
    decode table ``tab`` and multiplied by the block scale ``sc`` ``[G, ceil(K / BK), N]`` (the decoded value:
    one multiply, as :func:`moeref.compare.device.operands._decode_kt`). The sums over chunks accumulate in
    ``out`` / ``tp`` / ``rt`` (zeros), not in registers."""
    g, rm, mm = _item(it_ptr, BM)
    w_ptr += g.to(tl.int64) * K * N
    sc_ptr += g.to(tl.int64) * tl.cdiv(K, BK) * N
    b_ptr += g.to(tl.int64) * N
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = rn < N
    u2 = tl.load(c_ptr + 0)
    g_prom = tl.load(c_ptr + 1)
    final = tl.load(c_ptr + 4)
    one = tl.load(c_ptr + 5)
    zero = tl.load(c_ptr + 6)
    rec = rm[:, None] * 2 + tl.arange(0, 2)[None, :]
    off = rm.to(tl.int64)[:, None] * N + rn[None, :]
    msk = mm[:, None] & nm[None, :]
    for ch in range(0, NCH):
        err = tl.zeros((BM, BN), dtype=tl.float64)
        s_sum = tl.zeros((BM, BN), dtype=tl.float64)
        d_sum = tl.zeros((BM, BN), dtype=tl.float64)
        for j in range(0, STEPS):
            prev = _partial(s_sum, d_sum, HAS_R) + err  # |S_{j-1}| + E_{j-1}, as the previous step left it
            ts = tl.zeros((BM, BN), dtype=tl.float64)
            td = tl.zeros((BM, BN), dtype=tl.float64)
            w_max = tl.zeros((1, BN), dtype=tl.float64)  # 2-D: the accumulators' layout, no conversion
            w_nz = tl.zeros((1, BN), dtype=tl.int32)
            for i in tl.range(0, MMA, loop_unroll_factor=UNROLL):
                col = ch * C + j * MMA + i
                av, rv = tl.split(tl.load(a_ptr + rec))
                a_ptr += 2 * MP  # the next grouped column's records
                if MASKED:
                    wm = nm & ((j * MMA + i < C) & (col < K))
                else:
                    wm = nm
                if CODES:
                    code = tl.load(w_ptr + col * N + rn, mask=wm, other=0).to(tl.int32)
                    wv = tl.load(tab_ptr + code) * tl.load(sc_ptr + (col // BK) * N + rn, mask=wm, other=0.0)
                    if MASKED:
                        wv = tl.where(wm, wv, zero)
                else:
                    wv = tl.load(w_ptr + col * N + rn, mask=wm, other=0.0)
                wv = wv[None, :]
                wa = tl.abs(wv)
                w_max = tl.where(wa > w_max, wa, w_max)
                w_nz += (wa.to(tl.int64, bitcast=True) != 0).to(tl.int32)
                ts = ts + av[:, None] * wv
                if HAS_R:
                    td = td + rv[:, None] * wa
            s_sum = s_sum + ts
            s_part = tl.abs(s_sum)
            if HAS_R:
                d_sum = d_sum + td
                s_part = s_part + d_sum
            a_max, a_nz = tl.split(tl.load(rs_ptr + rec))
            rs_ptr += 2 * MP
            top = tl.where((a_max[:, None] == 0.0) | (w_max == 0.0), zero, a_max[:, None] * w_max)
            cnt = tl.minimum(a_nz[:, None], w_nz.to(tl.float64))
            jf = tl.where(j > 0, one, zero)
            align = ((cnt + jf) * u2) * tl.where(top > prev, top, prev)
            err = (err + align) + u2 * ((s_part + err) + align)
        prev = _partial(s_sum, d_sum, HAS_R) + err
        tl.store(out_ptr + off, tl.load(out_ptr + off, mask=msk, other=0.0) + err, mask=msk)
        tl.store(tp_ptr + off, tl.load(tp_ptr + off, mask=msk, other=0.0) + prev, mask=msk)
        if RTERM:
            tl.store(rt_ptr + off, tl.load(rt_ptr + off, mask=msk, other=0.0) + d_sum, mask=msk)
    tot_e = tl.load(out_ptr + off, mask=msk, other=0.0)
    tot_p = tl.load(tp_ptr + off, mask=msk, other=0.0)
    b = tl.load(b_ptr + rn, mask=nm, other=0.0)
    out = tot_e + g_prom * (tot_p + b[None, :])
    out = out * final
    tl.store(out_ptr + off, out, mask=msk)

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


def items(row_counts, device, sizes=None) -> tuple[torch.Tensor, int]:
    """Work items ``[T, 3]`` int32 ``(expert g, first row, rows)`` over groups of ``row_counts[g]`` consecutive
    rows (expert ``g``'s rows follow expert ``g - 1``'s), rows per item ``BM``; returns ``(items, BM)``.

    ``BM`` (one of ``sizes``; default the powers of two up to 32 and the largest group's size) minimizes the
    padded rows computed (``sum ceil(c / BM) * BM``) plus :data:`ITEM_COST_ROWS` per item (each item reads its expert's
    weights once): with few rows per expert (decode-sized batches) a tile of the largest group's size would
    mostly compute padding. The bound of each element does not depend on the tile (its columns are summed in
    the same order in any tile)."""
    import numpy as np

    counts = np.asarray(row_counts, dtype=np.int64)
    if sizes is None:
        top = min(_BM, triton.next_power_of_2(int(max(counts.max(initial=1), 1))))
        sizes = [1 << i for i in range(top.bit_length()) if (1 << i) <= top]
    bm = min(sizes, key=lambda b: (int((-(-counts // b) * b).sum() + ITEM_COST_ROWS * (-(-counts // b)).sum()), -b))
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
    """``x @ w[g].T`` per item in :func:`~moeref.compare.summation_order.ordered_dot`'s order; ``xt`` ``[K, M]``,
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


@dataclass(frozen=True)
class CodedWeights:
    """Experts' weights ``[G, K, N]`` as :func:`adder_bound_t` reads them without a float64 copy: uint8 ``codes``
    (K-major), the float64 decode ``table`` ``[256]``, and ``scales`` float64 ``[G, ceil(K / bk), N]``: each scale
    block's multiplier repeated over its ``N`` columns. The weight is ``table[code] * scale``: one multiply, the
    value :func:`moeref.compare.device.operands._decode_kt` gives."""

    codes: object
    table: object
    scales: object
    bk: int


ADDER_UNROLL = 2
"""Columns of a step per iteration of the aligned-adder kernel's column loop (``loop_unroll_factor``)."""
ADDER_WARPS = 4
ADDER_TILE = 1024
"""Outputs of one program of the aligned-adder kernel (``BM * BN``, ``BN`` at most 256). With ``ADDER_WARPS``
and ``ADDER_UNROLL`` the fastest of five settings timed on an H100 (bench/studies/bench_adder_radius.py, 2026-11-25
04:33 UTC, 7 interleaved rounds: 0.966 s at 4096 tokens against 1.03-1.32 s for (2, 8, 2048), (1, 8, 2048),
(4, 8, 2048) and (2, 8, 1024); at 128 tokens all but (4, 8, 2048) within the rounds' spread), every setting the
same bits."""


def _adder_launch(it, bm: int, n: int):
    """Grid and ``BN`` of :func:`adder_bound_t`. Triton lays the ``[BM, BN]`` tile out one column a thread per 32
    columns, warps along ``N`` first (``BN / 32`` of them, at most all), so with 4 warps and ``BM * BN = 1024`` a
    thread holds 8 rows of one column at ``BM = 32`` (8 16-byte row-record loads and one weight load a column,
    for 8 products) and 4 rows of 2 columns at ``BM = 4``; more outputs a thread spill its registers (five
    float64 accumulators an output)."""
    bn = min(256, max(32, ADDER_TILE // bm))
    return (int(it.shape[0]), triton.cdiv(n, bn)), bn


def adder_bound_t(av, radius, w, b_abs, consts, it, bm: int, *, chunk: int, mma: int, rterm: bool = False):
    """:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound` in the scaled form (grid = identity; its
    :func:`~moeref.compare.gemm_bounds.adder_summaries` from the steps' maxima and nonzero counts), ``[M, N]``:
    rows ``av`` float64 ``[M, K]`` (scaled values) with their ``radius`` ``[M, K]`` (or None) against experts
    ``w``: float64 ``[G, K, N]`` scaled values, or :class:`CodedWeights`; ``b_abs`` ``[G, N]``, ``consts`` float64
    ``[u2, g_prom, 1 + 2^-40, 2^-1022, 1 + 1e-9, 1, 0]``, ``it`` :func:`items`. With ``rterm`` (and a radius)
    also the radius term ``radius @ |w|`` in ``ordered_dot``'s order, from the recurrence's own partial sums
    (``chunk`` and ``mma`` must then be its chunk and step: the caller's check). Returns ``(bound, term or
    None)``.

    The rows go to the kernel in :func:`~moeref.compare.summation_order.grouped_columns` order as 16-byte records
    ``(value, radius)`` ``[P, M + BM, 2]`` (zeros at padding and past the last item's rows, so their loads need no
    mask) with their step summaries ``(largest |a| + r ignoring NaN, nonzero count)`` ``[P / mma, M + BM, 2]``
    (:func:`~moeref.compare.gemm_bounds.step_maxima`'s numbers); the weights' step summaries are taken in the
    kernel from the values it loads."""
    m, k = (int(d) for d in av.shape)
    coded = isinstance(w, CodedWeights)
    wt = w.codes if coded else w
    n = int(wt.shape[2])
    dev = av.device
    out = torch.zeros((m, n), dtype=torch.float64, device=dev)
    term = torch.zeros_like(out) if rterm else None
    if it.shape[0] == 0 or n == 0 or m == 0:
        return out, term
    if rterm and radius is None:
        raise ValueError("rterm needs a radius")
    cols = grouped_columns(k, chunk, mma)
    nch, steps, _ = cols.shape
    c = min(chunk, k)
    pos = torch.as_tensor(cols.reshape(-1), device=dev)
    valid = (pos >= 0)[:, None]
    idx = pos.clamp(min=0)
    mp = m + bm
    a_g = torch.where(valid, av.t().index_select(0, idx), 0.0)                  # [P, M] grouped columns
    rec = torch.zeros((pos.numel(), mp, 2), dtype=torch.float64, device=dev)
    rec[:, :m, 0] = a_g
    au = a_g.abs()
    if radius is not None:
        r_g = torch.where(valid, radius.t().index_select(0, idx), 0.0)
        rec[:, :m, 1] = r_g
        au = au + r_g
    au = au.view(nch * steps, mma, m)
    summ = torch.zeros((nch * steps, mp, 2), dtype=torch.float64, device=dev)
    summ[:, :m, 0] = torch.where(au.isnan(), 0.0, au).amax(dim=1)              # NaN ignored, from +0
    summ[:, :m, 1] = (au != 0).sum(dim=1)                                       # NaN counts
    del a_g, au
    tp = torch.zeros_like(out)
    grid, bn = _adder_launch(it, bm, n)
    _adder_kernel[grid](rec, summ, wt, w.table if coded else consts, w.scales if coded else consts, b_abs, consts,
                        out, tp, term if rterm else tp, it, mp, n, k, NCH=nch, C=c, STEPS=steps, MMA=mma,
                        BK=w.bk if coded else 1, MASKED=bool(k % c or c % mma), HAS_R=radius is not None,
                        RTERM=rterm, CODES=coded, UNROLL=ADDER_UNROLL, BM=bm, BN=bn, num_warps=ADDER_WARPS,
                        enable_fp_fusion=False)
    return out, term

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
