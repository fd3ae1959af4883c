"""The aligned-adder bound's exact domain (:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound` on element
values, chunk scales after, no radius; GEMM1 of FP8/FP4 layers), the NumPy bound's numbers:

* every product and every partial sum of a chunk is exact in float64 (that is the domain's condition,
  :func:`~moeref.compare.gemm_bounds.adder_exact`), so a step's sum is one fused multiply-add per product:
  the exact product added exactly is what the multiply then the add give;
* the step summaries (:func:`~moeref.compare.gemm_bounds.adder_summaries`): the row maxima and nonzero counts
  are taken as the activation columns load, the column ones as the weight columns load (once per tile, not per
  product); the largest exponent sum ``m_j`` is the only other per-product work, an int32 add and maximum of
  the elements' exponents (``floor(log2|x|)`` from ``frexp`` on the host, ``NO_EXPONENT`` for zeros);
* the weights may be read as their uint8 element codes through the decode table and an exponent table (no
  float64 copy of them).

Compiled with ``enable_fp_fusion=False``; ``tl.fma`` is explicit. Runs under ``TRITON_INTERPRET=1`` (CI).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .gemm_bounds import NO_EXPONENT
from ._bound_kernels import _grid, _item, _launch

__all__ = ["adder_exact_bound_t"]


@triton.jit
def _pow2(m):
    """``2^(max(m, -1021) + 1)`` as float64 from int32 ``m`` (``inf`` from ``2^1024``), 0 where ``m`` is a no-product
    sentinel (``<= NO_EXPONENT // 2``): the NumPy ``ldexp`` of :func:`~moeref.compare.gemm_bounds.adder_summaries`."""
    e = tl.minimum(tl.maximum(m, -1021) + 1, 1024)
    bits = (e + 1023).to(tl.int64) << 52
    return tl.where(m > -(1 << 19), bits.to(tl.float64, bitcast=True), 0.0)


@triton.jit
def _adder_exact_kernel(a_ptr, ae_ptr, w_ptr, tab_ptr, etab_ptr, we_ptr, sa_ptr, sw_ptr, b_ptr, c_ptr, out_ptr, it_ptr,
                        M, N, K, NCH: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr, MMA: tl.constexpr,
                        CODES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The exact domain (module docstring). ``a``: float64 ``[K, M]`` element values, ``ae`` their int32 exponents;
    ``w``: uint8 codes ``[G, K, N]`` read through ``tab`` (float64 ``[256]``) and ``etab`` (int32 exponents) with
    ``CODES``, else float64 values with int32 exponents ``we``."""
    g, rm, mm = _item(it_ptr, BM)
    w_ptr += g.to(tl.int64) * K * N
    we_ptr += g.to(tl.int64) * K * N
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
            amax = tl.zeros((BM,), dtype=tl.float64)
            wmax = tl.zeros((BN,), dtype=tl.float64)
            anz = tl.zeros((BM,), dtype=tl.int32)
            wnz = tl.zeros((BN,), dtype=tl.int32)
            mx = tl.full((BM, BN), -(1 << 20), dtype=tl.int32)
            ts = tl.zeros((BM, BN), dtype=tl.float64)
            for i in range(0, MMA):
                pos = j * MMA + i
                col = ch * C + pos
                ok = (pos < C) & (col < K)
                am = mm & ok
                wm = nm & ok
                av = tl.load(a_ptr + col * M + rm, mask=am, other=0.0)
                ea = tl.load(ae_ptr + col * M + rm, mask=am, other=-(1 << 20))
                if CODES:
                    wc = tl.load(w_ptr + col * N + rn, mask=wm, other=0).to(tl.int32)
                    wv = tl.where(wm, tl.load(tab_ptr + wc), 0.0)
                    ew = tl.where(wm, tl.load(etab_ptr + wc), -(1 << 20))
                else:
                    wv = tl.load(w_ptr + col * N + rn, mask=wm, other=0.0)
                    ew = tl.load(we_ptr + col * N + rn, mask=wm, other=-(1 << 20))
                aa = tl.abs(av)
                wa = tl.abs(wv)
                amax = tl.where(aa > amax, aa, amax)
                wmax = tl.where(wa > wmax, wa, wmax)
                anz = anz + (aa != 0.0).to(tl.int32)
                wnz = wnz + (wa != 0.0).to(tl.int32)
                mx = tl.maximum(mx, ea[:, None] + ew[None, :])
                ts = tl.fma(av[:, None], wv[None, :], ts)
            r1 = tl.where((amax[:, None] == 0.0) | (wmax[None, :] == 0.0), zero, amax[:, None] * wmax[None, :])
            r1 = _grid(r1, wide, min_normal)
            p2m = _pow2(mx)
            top = tl.where(p2m < r1, p2m, r1)
            cnt = tl.minimum(anz[:, None], wnz[None, :]).to(tl.float64)
            s_sum = s_sum + ts
            s_part = tl.abs(s_sum)
            jf = tl.where(j > 0, one, zero)
            g0 = _grid(prev, wide, min_normal)
            align = ((cnt + jf) * u2) * tl.where(top > g0, top, g0)
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


def _exponents(x: torch.Tensor) -> torch.Tensor:
    """int32 ``floor(log2|x|)`` of finite ``x`` (``frexp``: subnormals included), ``NO_EXPONENT`` for zeros."""
    _, e = torch.frexp(x)
    return torch.where(x != 0, e.to(torch.int32) - 1, torch.full((), NO_EXPONENT, dtype=torch.int32, device=x.device))


def adder_exact_bound_t(at, w, table, sa, sw, b_abs, consts, it, bm: int, *, n: int, chunk: int, mma: int,
                        steps: int) -> torch.Tensor:
    """The aligned-adder bound ``[M, N]`` in the exact domain without a radius: ``at`` float64 ``[K, M]`` element
    values, ``w`` ``[G, K, N]`` float64 element values or uint8 codes read through ``table`` (float64 ``[256]``;
    None for values), ``sa`` ``[M, NCH]`` / ``sw`` ``[G, N, NCH]`` chunk scales, ``b_abs`` ``[G, N]``,
    ``consts`` and ``it`` as :func:`~moeref.compare._bound_kernels.adder_bound_t`'s (every element finite: the
    domain's condition)."""
    k, m = (int(d) for d in at.shape)
    out = torch.zeros((m, n), dtype=torch.float64, device=at.device)
    if it.shape[0] == 0 or n == 0:
        return out
    codes = table is not None
    ae = _exponents(at)
    if codes:
        etab = _exponents(torch.where(torch.isfinite(table), table, torch.zeros((), dtype=table.dtype,
                                                                                 device=table.device)))
        we, tab = ae, table
    else:
        etab, we, tab = ae, _exponents(w), consts
    grid, bn = _launch(it, bm, n)
    _adder_exact_kernel[grid](at, ae, w, tab, etab, we, sa, sw, b_abs, consts, out, it, m, n, k,
                              NCH=-(-k // chunk), C=chunk, STEPS=steps, MMA=mma, CODES=codes, BM=bm, BN=bn,
                              enable_fp_fusion=False)
    return out
