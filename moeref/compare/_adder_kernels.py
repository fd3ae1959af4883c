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

Compiled with ``enable_fp_fusion=False``; ``tl.fma`` is explicit. Runs under ``TRITON_INTERPRET=1`` (CI).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._bound_kernels import _grid, _item, _launch

__all__ = ["adder_exact_bound_t"]


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
