"""The aligned-adder bound's exact and steps forms on the float64 tensor cores: the NumPy bound
(:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound`) bit for bit.

In both forms every partial sum of a chunk of element products is exact in float64 (the forms' condition,
:func:`~moeref.compare.gemm_bounds.adder_form`), and so is every partial sum of ``r^ |w|`` on the radius's grid
(:mod:`moeref.compare.operand_radius`). Any exact computation of them gives NumPy's value, so each MMA step's sum
is one float64 ``tl.dot`` of a ``[BM, MP]`` row tile and the transpose of a ``[BN, MP]`` weight tile (Hopper:
``mma.sync`` f64; the products are exact and every partial sum representable, so the tensor core's roundings change
nothing), ``MP`` the step width padded with zero columns to a power of two of at least 16. Per step:

* **exact form**: the step sum; ``m_j`` (the largest ``floor(log2|a|) + floor(log2|w|)`` over the step's nonzero
  products) from a second float64 dot of exponent powers, ``s = sum 2^(L x_a) 2^(L x_w)`` over the nonzero pairs,
  ``x = e - o`` with per-expert offsets ``o`` (the largest exponent of the expert's rows, of its weights: ``x <=
  0``; the exact form keeps ``x_a + x_w >= -55``, so every power and product is a normal float64), ``L =
  max(8, floor(log2 MP) + 1)`` (8 up to 128-column steps, so the division below is a shift; ``L <= 9`` keeps the
  powers normal): at most ``MP < 2^L`` nonzero terms give ``2^(L M) <= s < 2^(L M + L)`` under any monotone
  rounding, so ``M = floor(floor(log2 s) / L)`` and ``s = 0`` exactly when the step has no nonzero product;
* **steps form**: the step sum and the radius's step sum ``sum r^ |w|``, two dots;
* the step's row summaries (largest and nonzero count of ``|a|`` in the exact form, of the scaled ``|a| + r^`` in
  the steps form) read from ``[steps, rows]`` arrays made once per launch with torch, the column ones from the
  weight tile the kernel has just decoded (a weight row's step lies in one thread's registers, so they reduce
  without shuffles; times the chunk's weight scale in the steps form: the scaled values' summaries, as NumPy takes
  them); then ``T_j``, ``n_j`` and the recurrence of :func:`~moeref.compare.gemm_bounds.adder_rows`, operation for
  operation.

Chunks run in an outer loop and their steps in an inner one: a flat loop over the steps that zeroed the accumulators
where a chunk starts gave wrong sums in rows 8-15 of each 16-row MMA tile on Hopper with Triton 3.6
(``bench/studies/repro_f64_dot_loop_reset.py``). The weights are read as their uint8 codes (two a byte when packed) from the
stack itself, through the decode table (and, in the exact form, their exponent powers through
:func:`power_tables`), or as float64 element values. Compiled with ``enable_fp_fusion=False``. Runs under
``TRITON_INTERPRET=1`` (CI), where ``tl.dot`` of float64 tiles is NumPy's float64 matrix product (exact on these
operands too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..summation_order import grouped_columns
from ._bound_kernels import _grid, _item

__all__ = ["adder_mma_bound_t", "MmaWeights", "MmaTile", "TILE", "EXACT_ROWS", "NORMAL_QUANTUM", "power_tables",
           "step_summaries"]


@dataclass(frozen=True)
class MmaTile:
    """The kernel's tile: ``rows`` rows of a work item (a multiple of 16, the float64 MMA's height), ``bn`` output
    columns, ``warps``; ``maxnreg`` caps the registers a thread (None: the compiler's choice, 255 here)."""

    rows: int
    bn: int
    warps: int
    maxnreg: int | None = None


TILE = MmaTile(rows=16, bn=64, warps=4)
"""16 rows x 64 columns, 4 warps: the fastest of the variants timed on the GPU for both forms at 128 and 4096
DeepSeek-V3 tokens (``bench/bench_compare_device.py --sweep``, docs/moe-gpu.md), though ptxas spills a few hundred
bytes at it (8 warps spill less and ran 1.2-1.9x slower: docs/data/adder_mma_sweep_h200_2026-11-28.json). Read
at each call (a benchmark may set it)."""

EXACT_ROWS = (16, 32)
"""Rows an item may hold in the exact form, chosen per launch by :func:`~moeref.compare.device._bound_kernels.items`'s cost
model (many rows an expert: 32, which ran 1.2x faster at 4096 tokens; few: 16). The steps form keeps
:data:`TILE`'s rows (32 spills more there and ran slower)."""


NORMAL_QUANTUM = 2.0**-960
"""The exact form's grid skips its subnormal branch (``normal`` of :func:`adder_mma_bound_t`) when every group's
``q_a q_w u2`` is at least this (``q`` the quanta of :func:`moeref.gemm.exact.quantum_and_max`, ``u2`` twice the
accumulator's unit). Then every nonzero number the grid takes is at least ``q_a q_w u2 / 2 >= 2^-961``: ``|S|`` is a
multiple of ``q_a q_w``; ``T_j >= q_a q_w`` (``2^(m_j + 1)`` and ``p2(max|a| max|w|)``, quanta being powers of two);
a nonzero ``E`` holds an addend ``cnt u2 max(T, g) >= u2 q_a q_w / 2`` or ``u2 g(.) >= u2 q_a q_w / 2`` and never
decreases within a chunk. Far inside the normal range, where the grid's value is its exponent bits (0 for 0)."""


@dataclass(frozen=True)
class MmaWeights:
    """Experts' weights as the kernel reads them: ``data`` uint8 codes of a :class:`moeref.gemm.StackedExperts`
    (``[E, N, K]``, or ``[E, N, ceil(K / 2)]`` two codes a byte when ``packed``) with the float64 decode ``table``,
    or float64 element values ``[G, N, K]`` (``table`` None); ``experts`` int32 ``[G]``: the index in ``data`` of
    each group's expert."""

    data: object
    table: object
    experts: object
    packed: bool = False


@triton.jit
def _biased(v):
    """The biased exponent field of float64 ``v`` as int32."""
    return (v.to(tl.int64, bitcast=True) >> 52).to(tl.int32) & 0x7FF


@triton.jit
def _exponent(v):
    """``floor(log2|v|)`` of nonzero float64 ``v`` as int32, subnormals included (from the bits; a subnormal times
    ``2^64``, exact, is normal)."""
    b = _biased(v)
    return tl.where(b == 0, _biased(v * 18446744073709551616.0) - 1087, b - 1023)


@triton.jit
def _power(v, o, LAM: tl.constexpr):
    """``2^(L x)``, ``x = max(floor(log2|v|) - o, -100)``, for nonzero ``v``; 0 for zeros. The clamp is never reached
    while the weights hold a nonzero (the exact form keeps ``x_a + x_w >= -55``) and keeps the power's exponent in
    the normal range for ``L <= 9``. Integer work in int32 (exponents and ``L x`` are far inside it)."""
    x = tl.maximum(_exponent(v) - o, -100)
    return tl.where(v != 0.0, ((x * LAM + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True), 0.0)


@triton.jit
def _opaque(code, GPU: tl.constexpr):
    """``code`` unchanged; on the GPU through an impure move, which ends Triton's search for the bitwidth the dot's
    operand was loaded with there: past it lie the uint8 code loads, which would give the float64 operand a
    ``kWidth`` of 4, and Triton 3.6 cannot lower float64 MMAs with ``kWidth > 1`` ("Currently fp64 don't support
    largeK MMA"). The interpreter has no inline assembly and needs none."""
    if GPU:
        code = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [code], dtype=tl.int32, is_pure=False, pack=1)
    return code


@triton.jit
def _grid_of(x, wide, min_normal, NORMAL: tl.constexpr):
    """:func:`~moeref.compare.device._bound_kernels._grid` of ``x >= 0``; with ``NORMAL`` (every nonzero ``x`` is at least
    ``2^-1001``: :func:`adder_mma_bound_t`) the exponent bits alone, which are its value there and 0 for 0."""
    if NORMAL:
        return ((x * wide).to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)
    else:
        return _grid(x, wide, min_normal)


@triton.jit
def _min(x, y):
    """``min(x, y)`` of finite ``x``, ``y``: one compare and select (no NaN handling needed)."""
    return tl.where(x < y, x, y)


@triton.jit
def _hi(bits):
    """The high 32 bits of int64 ``bits`` (a float64's sign, exponent and top of the fraction) as int32."""
    return (bits >> 32).to(tl.int32)


@triton.jit
def _from_hi(hi):
    """The float64 whose high word is int32 ``hi`` and whose low word is 0."""
    return (hi.to(tl.int64) << 32).to(tl.float64, bitcast=True)


@triton.jit
def _top_exponent(sb, oa, ow, LAM: tl.constexpr):
    """``m_j + 1`` from the power sum's biased exponent field ``sb`` (``s > 0``): ``floor(floor(log2 s) / L)`` plus
    the offsets, clamped to ``[-1020, 1024]`` (the exponent of ``2^(m_j + 1)``; 1024: infinity)."""
    if LAM == 8:  # an arithmetic shift floors negative numerators too
        m = ((sb - 1023) >> 3) + oa + ow
    else:  # a nonnegative numerator, then back
        m = (sb - 1023 + 100 * LAM) // LAM - 100 + oa + ow
    return tl.minimum(tl.maximum(m, -1021) + 1, 1024)


@triton.jit
def _top_exact_hi(s, oa, ow, amax, wmax, wide, LAM: tl.constexpr):
    """The high word of :func:`_top_exact`'s ``T_j`` where every number the grid takes is normal (``NORMAL``): both
    candidates are powers of two or 0 with zero low words, so their minimum is that of the high words. ``s > 0``
    is ``s``'s exponent field being nonzero (``s`` is 0 or at least ``2^(-55 L)``, normal)."""
    sb = _biased(s)
    p2m = tl.where(sb > 0, (_top_exponent(sb, oa, ow, LAM) + 1023) << 20, 0)
    r1 = _hi(((amax[:, None] * wmax[None, :]) * wide).to(tl.int64, bitcast=True)) & 0x7FF00000
    return tl.minimum(p2m, r1)


@triton.jit
def _top_exact(s, oa, ow, amax, wmax, wide, min_normal, LAM: tl.constexpr):
    """``T_j`` of the exact form: ``min(2^(m_j + 1), p2(max|a| max|w|))`` with ``m_j`` from the power sum ``s``."""
    e = _top_exponent(_biased(s), oa, ow, LAM)  # s >= 0
    p2m = tl.where(s > 0.0, ((e + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True), 0.0)
    r1 = _grid(amax[:, None] * wmax[None, :], wide, min_normal)
    return tl.where(p2m < r1, p2m, r1)


@triton.jit
def _adder_mma_kernel(a_ptr, r_ptr, smax_ptr, snz_ptr, w_ptr, tab_ptr, ptab_ptr, eix_ptr, sa_ptr, sw_ptr, off_ptr, b_ptr,
                      c_ptr, out_ptr, rt_ptr, ctr_ptr, it_ptr, R, N, K, W_G, W_N,
                      NCH: tl.constexpr, C: tl.constexpr, STEPS: tl.constexpr, MMA: tl.constexpr, MP: tl.constexpr,
                      LAM: tl.constexpr, STEPS_FORM: tl.constexpr, RTERM: tl.constexpr, CENTER: tl.constexpr,
                      CODES: tl.constexpr, PACKED: tl.constexpr, TABN: tl.constexpr, EVEN_K: tl.constexpr,
                      EVEN_W: tl.constexpr, NORMAL: tl.constexpr, GPU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Module docstring. ``a`` float64 ``[R, K]`` element values, ``r`` the rounded radius (steps form); ``smax`` /
    ``snz`` float64 ``[NS, R]`` row step summaries; ``w`` codes (``CODES``; ``ptab`` float64 ``[G, TABN]`` their
    powers, exact form) or float64 values, expert ``eix[g]`` at ``w + eix[g] W_G``, row ``n`` at ``+ n W_N``;
    ``sa`` ``[R, NCH]`` / ``sw`` ``[G, N, NCH]`` signed chunk scales (the bound takes their magnitudes); ``off``
    int32 ``[G, 2]`` exponent offsets (exact form); ``b`` ``[G, N]``; ``c`` float64 ``[u2, g_prom, 1 + 2^-40,
    2^-1022, 1 + 1e-9, 1, 0]``. Outputs: ``out`` the bound, ``rt`` the radius term (``RTERM``), ``ctr`` the product
    (``CENTER``: the sum over chunks in order of ``(S sa) sw``, :func:`moeref.gemm.device.device_expert_rows_gemm`'s
    numbers without the bias)."""
    g, rm, mm = _item(it_ptr, BM)
    g64 = g.to(tl.int64)
    w_ptr += tl.load(eix_ptr + g).to(tl.int64) * W_G
    sw_ptr += g64 * N * NCH
    b_ptr += g64 * N
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = rn < N
    kk = tl.arange(0, MP)
    u2 = tl.load(c_ptr + 0)
    g_prom = tl.load(c_ptr + 1)
    wide = tl.load(c_ptr + 2)
    min_normal = tl.load(c_ptr + 3)
    final = tl.load(c_ptr + 4)
    one = tl.load(c_ptr + 5)
    zero = tl.load(c_ptr + 6)
    if not STEPS_FORM:
        oa = tl.load(off_ptr + 2 * g)  # int32
        ow = tl.load(off_ptr + 2 * g + 1)
    arow = rm.to(tl.int64) * K
    wrow = rn.to(tl.int64) * W_N
    tot_e = tl.zeros((BM, BN), dtype=tl.float64)
    tot_p = tl.zeros((BM, BN), dtype=tl.float64)
    if RTERM:
        tot_r = tl.zeros((BM, BN), dtype=tl.float64)
    if CENTER:
        tot_c = tl.zeros((BM, BN), dtype=tl.float64)
    # Chunks in an outer loop, each starting its accumulators fresh, steps in an inner one (not one flat loop that
    # zeroes them where a chunk starts: wrong rows 8-15 on Hopper, bench/studies/repro_f64_dot_loop_reset.py).
    for ch in range(0, NCH):
        su = tl.zeros((BM, BN), dtype=tl.float64)    # the chunk's exact partial sum (element values)
        err = tl.zeros((BM, BN), dtype=tl.float64)   # E_j
        du = tl.zeros((BM, BN), dtype=tl.float64)    # the radius's exact partial sum (steps form)
        sa_s = tl.load(sa_ptr + rm * NCH + ch, mask=mm, other=0.0)
        swc_s = tl.load(sw_ptr + rn * NCH + ch, mask=nm, other=0.0)
        sa = tl.abs(sa_s)
        swc = tl.abs(swc_s)
        sc = sa[:, None] * swc[None, :]
        for j in range(0, STEPS):
            s = ch * STEPS + j
            # |S_{j-1}| + E_{j-1} as the previous step left it (recomputed: one tile fewer to carry)
            if STEPS_FORM:
                prev = (tl.abs(su * sc) + du * swc[None, :]) + err
            else:
                prev = tl.abs(su) + err
            pos = j * MMA + kk
            col = ch * C + pos
            if EVEN_K:  # every step full: no column mask beyond the tile's
                kv = kk < MP
            else:
                kv = (kk < MMA) & (pos < C) & (col < K)
            am = mm[:, None] & kv[None, :]
            wm = nm[:, None] & kv[None, :]  # the weight tile is [BN, MP]: a row's step in one thread's registers
            a = tl.load(a_ptr + arow[:, None] + col[None, :], mask=am, other=0.0)
            if CODES:
                if EVEN_W:  # every weight of the tile is in the stack: no mask
                    if PACKED:
                        byte = tl.load(w_ptr + wrow[:, None] + (col // 2)[None, :]).to(tl.int32)
                        code = (byte >> ((col % 2) * 4)[None, :]) & 15
                    else:
                        code = tl.load(w_ptr + wrow[:, None] + col[None, :]).to(tl.int32)
                    code = _opaque(code, GPU)
                    w = tl.load(tab_ptr + code)
                    if not STEPS_FORM:  # the weights' exponent powers from the group's power table
                        pw_w = tl.load(ptab_ptr + g64 * TABN + code)
                else:
                    if PACKED:
                        byte = tl.load(w_ptr + wrow[:, None] + (col // 2)[None, :], mask=wm, other=0).to(tl.int32)
                        code = (byte >> ((col % 2) * 4)[None, :]) & 15
                    else:
                        code = tl.load(w_ptr + wrow[:, None] + col[None, :], mask=wm, other=0).to(tl.int32)
                    code = _opaque(code, GPU)
                    w = tl.where(wm, tl.load(tab_ptr + code), zero)
                    if not STEPS_FORM:
                        pw_w = tl.where(wm, tl.load(ptab_ptr + g64 * TABN + code), zero)
            elif EVEN_W:
                w = tl.load(w_ptr + wrow[:, None] + col[None, :])
            else:
                w = tl.load(w_ptr + wrow[:, None] + col[None, :], mask=wm, other=0.0)
            su = tl.dot(a, tl.trans(w), acc=su, out_dtype=tl.float64)
            wa = tl.abs(w)
            amax = tl.load(smax_ptr + s * R + rm, mask=mm, other=0.0)
            anz = tl.load(snz_ptr + s * R + rm, mask=mm, other=0.0)
            jf = tl.where(j > 0, one, zero)
            if STEPS_FORM:
                r = tl.load(r_ptr + arow[:, None] + col[None, :], mask=am, other=0.0)
                du = tl.dot(r, tl.trans(wa), acc=du, out_dtype=tl.float64)
                ws = wa * swc[:, None]  # the scaled |w|: the summaries NumPy takes
                wmax = tl.max(ws, axis=1)
                wnz = tl.sum((ws != 0.0).to(tl.float64), axis=1)
                top = amax[:, None] * wmax[None, :]
                s_part = tl.abs(su * sc) + du * swc[None, :]
                cnt = _min(((anz + jf) * u2)[:, None], ((wnz + jf) * u2)[None, :])  # (min(anz, wnz) + jf) u2
                align = cnt * tl.where(top > prev, top, prev)
                err = (err + align) + u2 * ((s_part + err) + align)
            else:
                wmax = tl.max(wa, axis=1)
                wnz = tl.sum((wa != 0.0).to(tl.float64), axis=1)
                if not CODES:
                    pw_w = _power(w, ow, LAM)
                pw = tl.dot(_power(a, oa, LAM), tl.trans(pw_w))
                s_part = tl.abs(su)
                cnt = _min(((anz + jf) * u2)[:, None], ((wnz + jf) * u2)[None, :])  # (min(anz, wnz) + jf) u2
                if NORMAL:  # T_j and g(.) are powers of two or 0 (zero low words): max(T_j, g) on the high words
                    top = _top_exact_hi(pw, oa, ow, amax, wmax, wide, LAM)
                    g0 = _hi((prev * wide).to(tl.int64, bitcast=True)) & 0x7FF00000
                    align = cnt * _from_hi(tl.maximum(top, g0))
                else:
                    top = _top_exact(pw, oa, ow, amax, wmax, wide, min_normal, LAM)
                    g0 = _grid_of(prev, wide, min_normal, NORMAL)
                    align = cnt * tl.where(top > g0, top, g0)
                err = (err + align) + u2 * _grid_of((s_part + err) + align, wide, min_normal, NORMAL)
        # the chunk's end: its terms join the sums over chunks, in order (|S| as its last step computed it)
        if STEPS_FORM:
            tot_e = tot_e + err
            tot_p = tot_p + ((tl.abs(su * sc) + du * swc[None, :]) + err)
            if RTERM:
                tot_r = tot_r + du * swc[None, :]
        else:
            tot_e = tot_e + err * sc
            tot_p = tot_p + (tl.abs(su) + err) * sc
        if CENTER:  # the exact chunk sum, scaled and added as the device engine's ordered sum does
            tot_c = tot_c + (su * sa_s[:, None]) * swc_s[None, :]
    b = tl.load(b_ptr + rn, mask=nm, other=0.0)
    out = (tot_e + g_prom * (tot_p + b[None, :])) * final
    off = rm.to(tl.int64)[:, None] * N + rn[None, :]
    msk = mm[:, None] & nm[None, :]
    tl.store(out_ptr + off, out, mask=msk)
    if RTERM:
        tl.store(rt_ptr + off, tot_r, mask=msk)
    if CENTER:
        tl.store(ctr_ptr + off, tot_c, mask=msk)


def power_tables(table, w_offsets, lam: int):
    """The exact form's weight powers by code: float64 ``[G, T]``, entry ``[g, c]`` the kernel's ``_power`` of
    ``table[c]`` with group ``g``'s weight offset ``w_offsets[g]``: ``2^(L max(floor(log2|v|) - o, -100))``, 0 for
    ``v = 0`` and for codes whose value is not finite (the exact form holds only finite weights). Bit for bit the
    powers the kernel would compute from the decoded values (``tests/test_adder_mma.py``), read with one gather."""
    v = table.to(torch.float64)
    e = torch.frexp(v).exponent.to(torch.int64) - 1  # floor(log2|v|), subnormals included
    x = torch.clamp(e[None, :] - w_offsets.to(torch.int64)[:, None], min=-100)
    p = ((x * lam + 1023) << 52).view(torch.float64)
    return torch.where((v != 0) & torch.isfinite(v), p, torch.zeros_like(p)).contiguous()


def step_summaries(x_abs: torch.Tensor, k: int, chunk: int, mma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(largest, nonzero count)`` of each MMA step of ``x_abs`` (float64 ``[R, K]``, >= 0, finite) in
    :func:`~moeref.compare.summation_order.grouped_columns` order: float64 ``[NS, R]`` each
    (:func:`~moeref.compare.gemm_bounds.step_maxima`'s numbers)."""
    r = int(x_abs.shape[0])
    cols = grouped_columns(k, chunk, mma)
    ns = cols.shape[0] * cols.shape[1]
    if k % chunk == 0 and chunk % mma == 0:  # no padding: the steps are consecutive columns
        v = x_abs.reshape(r, ns, mma)
    else:
        pos = torch.as_tensor(cols.reshape(-1), device=x_abs.device)
        v = torch.where(pos >= 0, x_abs[:, pos.clamp(min=0)], 0.0).reshape(r, ns, mma)
    return v.amax(dim=2).t().contiguous(), (v != 0).sum(dim=2).to(torch.float64).t().contiguous()


def adder_mma_bound_t(av, r_hat, summaries, w: MmaWeights, sa, sw, b_abs, offsets, consts, it, *, n: int,
                      chunk: int, mma: int, rterm: bool = False, center: bool = False, tile: MmaTile | None = None,
                      normal: bool = False):
    """The aligned-adder bound ``[R, N]`` of the exact form (``r_hat`` None) or the steps form (``r_hat`` the rounded
    radius ``[R, K]``): ``av`` float64 ``[R, K]`` element values; ``summaries`` :func:`step_summaries` of ``|a|``
    (exact form) or of the scaled ``|a| + r^`` (steps form); ``sa`` ``[R, NCH]`` / ``sw`` ``[G, N, NCH]`` chunk
    scales (signed: the bound takes their magnitudes), ``b_abs`` ``[G, N]``; ``offsets`` int32 ``[G, 2]`` (the largest exponent of each group's rows and
    of its weights; exact form); ``consts`` and ``it`` (at most ``tile.rows`` rows an item; :data:`TILE` by default) as
    :func:`~moeref.compare.device._bound_kernels.adder_bound_t`'s. With ``rterm`` (steps form) also the radius term, the sum
    over chunks of ``(sum r^ |w|) |sw|`` (:func:`moeref.compare.operand_radius.radius_dot`'s numbers when ``chunk``
    is its chunk). With ``center`` also the product ``a W^T`` as :func:`moeref.gemm.device.device_expert_rows_gemm`
    computes it (without bias) when ``chunk`` is its segment: the exact chunk sums the bound forms anyway, times the
    signed scales, added in chunk order. ``normal`` (exact form): every group's ``q_a q_w u2`` is at least
    :data:`NORMAL_QUANTUM`, so the grid needs no subnormal branch (the caller checks it: a wrong flag gives wrong
    bits). Returns ``(bound, term or None, product or None)``."""
    tile = TILE if tile is None else tile
    r, k = (int(d) for d in av.shape)
    dev = av.device
    out = torch.zeros((r, n), dtype=torch.float64, device=dev)
    term = torch.zeros_like(out) if rterm else None
    ctr = torch.zeros_like(out) if center else None
    if it.shape[0] == 0 or n == 0 or r == 0:
        return out, term, ctr
    steps_form = r_hat is not None
    if rterm and not steps_form:
        raise ValueError("rterm needs the steps form (a rounded radius)")
    c = max(1, min(chunk, k))
    nch, steps = -(-k // c), -(-c // mma)
    mp = max(16, triton.next_power_of_2(mma))
    lam = max(8, int(math.floor(math.log2(mp))) + 1)
    codes = w.table is not None
    data = w.data
    w_g, w_n = int(data.stride(0)), int(data.stride(1))
    grid = (int(it.shape[0]), triton.cdiv(n, tile.bn))
    dummy = consts
    ptab = power_tables(w.table, offsets[:, 1], lam) if codes and not steps_form else dummy
    _adder_mma_kernel[grid](av, r_hat if steps_form else dummy, summaries[0], summaries[1], data,
                            w.table if codes else dummy, ptab, w.experts, sa, sw, offsets, b_abs, consts, out,
                            term if rterm else out, ctr if center else out, it, r, n, k, w_g, w_n, NCH=nch, C=c,
                            STEPS=steps, MMA=mma, MP=mp, LAM=lam, STEPS_FORM=steps_form, RTERM=rterm, CENTER=center,
                            CODES=codes, PACKED=bool(w.packed),
                            TABN=int(w.table.numel()) if codes else 1, EVEN_K=k % c == 0 and c % mma == 0 and mma == mp,
                            EVEN_W=k % c == 0 and c % mma == 0 and mma == mp and n % tile.bn == 0,
                            NORMAL=normal, GPU=dev.type == "cuda", BM=tile.rows,
                            BN=tile.bn, num_warps=tile.warps, num_stages=1, enable_fp_fusion=False,
                            **({} if tile.maxnreg is None else {"maxnreg": tile.maxnreg}))
    return out, term, ctr
