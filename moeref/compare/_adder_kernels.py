"""The aligned-adder bound's exact domain (:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound` on element
values, chunk scales after, no radius) with fewer and cheaper operations than ``_adder_kernel``
(:mod:`moeref.compare._bound_kernels`), the same numbers:

* every product and every partial sum of a chunk is exact in float64 (that is the domain's condition,
  :func:`~moeref.compare.gemm_bounds.adder_exact`), so a step's sum is one fused multiply-add per product:
  the exact product added exactly is what the multiply then the add give;
* when every product is also exact in float32 (FP8 and FP4 elements; the caller proves it from the operands'
  significand bits and ranges), the step's largest product is a float32 maximum of float32 products and its
  nonzero count an int32 sum: the same values, off the float64 units;
* the weights may be read as their uint8 element codes through the decode table (no float64 copy of them).

And with an operand radius (GEMM2 of a layer; :func:`adder_radius_bound_t`): ``_adder_kernel``'s operations,
from padded operands without masks, with the radius term ``radius @ |W|^T`` in
:func:`~moeref.compare.gemm_bounds.ordered_dot`'s order taken from the recurrence's own partial sums.

Compiled with ``enable_fp_fusion=False``; ``tl.fma`` is explicit. Runs under ``TRITON_INTERPRET=1`` (CI).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._bound_kernels import _grid, _item, _launch

__all__ = ["adder_exact_bound_t", "adder_radius_bound_t"]


@triton.jit
def _adder_exact_kernel(a_ptr, a32_ptr, w_ptr, tab_ptr, tab32_ptr, sa_ptr, sw_ptr, b_ptr, c_ptr, out_ptr, it_ptr, M, N,
                        K, NCH: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr, MMA: tl.constexpr,
                        CODES: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """``_adder_kernel`` with ``EXACT`` and no radius, from the same values (module docstring). ``a``: float64
    ``[K, M]``; ``a32``: ``|a|`` in float32 (with ``F32``; made once by the caller: a conversion here would be
    one per product, on a slow unit); ``w``: uint8 codes ``[G, K, N]`` read through ``tab`` (float64 ``[256]``)
    and ``tab32`` (``|tab|`` in float32) with ``CODES``, else float64 values."""
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
        for j in range(0, STEPS):
            if F32:
                pm32 = tl.zeros((BM, BN), dtype=tl.float32)
                cnt32 = tl.zeros((BM, BN), dtype=tl.int32)
            else:
                pm = tl.zeros((BM, BN), dtype=tl.float64)
                cnt = tl.zeros((BM, BN), dtype=tl.float64)
            ts = tl.zeros((BM, BN), dtype=tl.float64)
            for i in range(0, MMA):
                pos = j * MMA + i
                col = ch * C + pos
                ok = (pos < C) & (col < K)
                am = mm & ok
                wm = nm & ok
                av = tl.load(a_ptr + col * M + rm, mask=am, other=0.0)
                if CODES:
                    wc = tl.load(w_ptr + col * N + rn, mask=wm, other=0).to(tl.int32)
                    wv = tl.where(wm, tl.load(tab_ptr + wc), 0.0)
                else:
                    wv = tl.load(w_ptr + col * N + rn, mask=wm, other=0.0)
                if F32:
                    a3 = tl.load(a32_ptr + col * M + rm, mask=am, other=0.0)
                    if CODES:
                        w3 = tl.where(wm, tl.load(tab32_ptr + wc), 0.0)
                    else:
                        w3 = tl.abs(wv).to(tl.float32)
                    pa = a3[:, None] * w3[None, :]
                    pm32 = tl.maximum(pm32, pa)
                    cnt32 = cnt32 + (pa != 0.0).to(tl.int32)
                else:
                    pa = tl.abs(av)[:, None] * tl.abs(wv)[None, :]
                    pm = tl.where(pa > pm, pa, pm)
                    cnt = cnt + tl.where(pa != 0.0, one, zero)
                ts = tl.fma(av[:, None], wv[None, :], ts)
            if F32:
                pm = pm32.to(tl.float64)
                cnt = cnt32.to(tl.float64)
            s_sum = s_sum + ts
            s_part = tl.abs(s_sum)
            jf = tl.where(j > 0, one, zero)
            g1 = _grid(tl.where(pm > prev, pm, prev), wide, min_normal)
            align = ((cnt + jf) * u2) * g1
            g2 = _grid((s_part + err) + align, wide, min_normal)
            err = (err + align) + u2 * g2
            prev = s_part + err
        sa = tl.load(sa_ptr + rm * NCH + ch, mask=mm, other=0.0)
        sw = tl.load(sw_ptr + rn * NCH + ch, mask=nm, other=0.0)
        scale = sa[:, None] * sw[None, :]
        tot_e = tot_e + err * scale
        tot_p = tot_p + prev * scale
    b = tl.load(b_ptr + rn, mask=nm, other=0.0)
    out = tot_e + g_prom * (tot_p + b[None, :])
    out = out * final
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], out, mask=mm[:, None] & nm[None, :])


def adder_exact_bound_t(at, w, table, sa, sw, b_abs, consts, it, bm: int, *, n: int, chunk: int, mma: int,
                        steps: int, f32: bool) -> torch.Tensor:
    """The aligned-adder bound ``[M, N]`` in the exact domain without a radius: ``at`` float64 ``[K, M]`` element
    values, ``w`` ``[G, K, N]`` float64 element values or uint8 codes read through ``table`` (float64 ``[256]``;
    None for values), ``sa`` ``[M, NCH]`` / ``sw`` ``[G, N, NCH]`` chunk scales, ``b_abs`` ``[G, N]``,
    ``consts`` and ``it`` as :func:`~moeref.compare._bound_kernels.adder_bound_t`'s; ``f32``: every product of
    the launch is exact in float32 (the caller's proof)."""
    k, m = (int(d) for d in at.shape)
    out = torch.zeros((m, n), dtype=torch.float64, device=at.device)
    if it.shape[0] == 0 or n == 0:
        return out
    codes = table is not None
    a32 = at.abs().to(torch.float32) if f32 else consts
    t32 = table.abs().to(torch.float32) if (f32 and codes) else consts
    grid, bn = _launch(it, bm, n)
    _adder_exact_kernel[grid](at, a32, w, table if codes else consts, t32, sa, sw, b_abs, consts, out, it, m, n, k,
                              NCH=-(-k // chunk), C=chunk, STEPS=steps, MMA=mma, CODES=codes, F32=f32, BM=bm, BN=bn,
                              enable_fp_fusion=False)
    return out


@triton.jit
def _adder_radius_kernel(a_ptr, w_ptr, b_ptr, c_ptr, out_ptr, tp_ptr, rt_ptr, it_ptr, MP, N,
                         NCH: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr, MMA: tl.constexpr,
                         RTERM: tl.constexpr, FINITE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """``_adder_kernel`` with ``HAS_R`` and not ``EXACT`` (the scaled products), the same operations on the same
    values in the same order, from padded operands (:func:`adder_radius_bound_t`): ``a`` one 16-byte record per
    element ``[NCH * C, MP]``, the value then its radius (zeros past K and past the last item's rows, as the
    masked loads read them), so the column loads carry no masks and share one address. Also:

    * ``RTERM``: the radius term ``sum_k r[m, k] |w[n, k]|`` in ``ordered_dot``'s order, to ``rt``: the step
      sums ``td`` of ``r |w|`` in column order and their running sum ``d_sum`` over a chunk's steps are
      ``ordered_dot``'s ``t`` and ``s`` when the chunk and the step are its (the caller checks), so the term is
      the sum of the chunks' last ``d_sum`` in chunk order: the same additions;
    * the nonzero count in int32 (integers <= MMA: the same float64 value after), a product being nonzero when
      its bits are (``|a| + r >= +0`` and ``|w| >= +0``: the product is +0, positive or NaN, as ``!= 0``
      counts it); with ``FINITE`` (every ``|a| + r`` and ``|w|`` finite: no NaN product) the largest product
      compared as int64 bits (the order of nonnegative doubles);
    * the sums over chunks accumulated in ``out`` / ``tp`` / ``rt`` (zeros), not in registers."""
    g, rm, mm = _item(it_ptr, BM)
    w_ptr += g.to(tl.int64) * (NCH * C) * N
    b_ptr += g.to(tl.int64) * N
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = rn < N
    u2 = tl.load(c_ptr + 0)
    g_prom = tl.load(c_ptr + 1)
    final = tl.load(c_ptr + 4)
    one = tl.load(c_ptr + 5)
    zero = tl.load(c_ptr + 6)
    off = rm[:, None] * N + rn[None, :]
    msk = mm[:, None] & nm[None, :]
    for ch in range(0, NCH):
        err = tl.zeros((BM, BN), dtype=tl.float64)
        prev = tl.zeros((BM, BN), dtype=tl.float64)
        s_sum = tl.zeros((BM, BN), dtype=tl.float64)
        d_sum = tl.zeros((BM, BN), dtype=tl.float64)
        for j in range(0, STEPS):
            if FINITE:
                pmi = tl.zeros((BM, BN), dtype=tl.int64)
            else:
                pm = tl.zeros((BM, BN), dtype=tl.float64)
            cnt32 = tl.zeros((BM, BN), dtype=tl.int32)
            ts = tl.zeros((BM, BN), dtype=tl.float64)
            td = tl.zeros((BM, BN), dtype=tl.float64)
            for i in range(0, MMA):
                col = ch * C + j * MMA + i
                rec = 2 * (col * MP + rm)
                av = tl.load(a_ptr + rec)
                rv = tl.load(a_ptr + rec + 1)
                wv = tl.load(w_ptr + col * N + rn, mask=nm, other=0.0)
                wa = tl.abs(wv)
                pa = (tl.abs(av) + rv)[:, None] * wa[None, :]
                pb = pa.to(tl.int64, bitcast=True)
                if FINITE:
                    pmi = tl.where(pb > pmi, pb, pmi)
                else:
                    pm = tl.where(pa > pm, pa, pm)
                cnt32 = cnt32 + (pb != 0).to(tl.int32)
                ts = ts + av[:, None] * wv[None, :]
                td = td + rv[:, None] * wa[None, :]
            if FINITE:
                pm = pmi.to(tl.float64, bitcast=True)
            cnt = cnt32.to(tl.float64)
            s_sum = s_sum + ts
            d_sum = d_sum + td
            s_part = tl.abs(s_sum) + d_sum
            jf = tl.where(j > 0, one, zero)
            align = ((cnt + jf) * u2) * tl.where(pm > prev, pm, prev)
            err = (err + align) + u2 * ((s_part + err) + align)
            prev = s_part + err
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


def adder_radius_bound_t(av, wt, radius, b_abs, consts, it, bm: int, *, chunk: int, mma: int, steps: int,
                         rterm: bool):
    """The aligned-adder bound ``[M, N]`` of scaled values ``av`` ``[M, K]`` with their ``radius`` ``[M, K]``
    against ``wt`` ``[G, K, N]`` (float64 scaled values; ``b_abs`` ``[G, N]``, ``consts`` as
    :func:`~moeref.compare._bound_kernels.adder_bound_t`) and, with ``rterm``, the radius term
    ``radius @ |wt|`` in ``ordered_dot``'s order (``chunk`` and ``mma`` must then be its chunk and step: the
    caller's check). ``chunk`` a multiple of ``mma``. Returns ``(bound, term or None)``."""
    m, k = (int(d) for d in av.shape)
    n = int(wt.shape[2])
    out = torch.zeros((m, n), dtype=torch.float64, device=av.device)
    term = torch.zeros_like(out) if rterm else None
    if it.shape[0] == 0 or n == 0:
        return out, term
    if chunk % mma:
        raise ValueError(f"chunk {chunk} is not a multiple of the MMA width {mma}")
    nch = -(-k // chunk)
    kp, mp = nch * chunk, m + bm
    rec = torch.zeros((kp, mp, 2), dtype=torch.float64, device=av.device)
    rec[:k, :m, 0] = av.t()
    rec[:k, :m, 1] = radius.t()
    finite = bool(torch.isfinite(av.abs() + radius).all()) and bool(torch.isfinite(wt).all())
    wp = torch.nn.functional.pad(wt, (0, 0, 0, kp - k)) if kp > k else wt
    tp = torch.zeros_like(out)
    grid, bn = _launch(it, bm, n)
    _adder_radius_kernel[grid](rec, wp.contiguous(), b_abs, consts, out, tp, term if rterm else tp, it, mp, n,
                               NCH=nch, C=chunk, STEPS=steps, MMA=mma, RTERM=rterm, FINITE=finite,
                               BM=bm, BN=bn, enable_fp_fusion=False)
    return out, term
