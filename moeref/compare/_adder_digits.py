"""The aligned-adder bound's exact domain on the tensor cores:
:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound` on element values (chunk scales after, no radius), bit for
bit, with its per-step summaries
(:func:`~moeref.compare.gemm_bounds.adder_summaries`) and the exact step sums as matrix products.

Per work item (up to ``BM`` rows of one expert) and ``BN`` output columns, each MMA step ``j`` of each chunk:

* the step sum ``S_j`` exactly, from integer digits (the mechanism of the reference's own engine,
  :mod:`moeref.gemm._device_kernels` ``_exact_digits_kernel``): every element is an integer times a power of two
  (``a = I_a 2^-qa``, ``w = I_w 2^-qw``, ``|I| < 2^21``), split into signed base-128 int8 digits; each diagonal
  ``d`` of digit pairs is an int8 x int8 -> int32 ``tl.dot`` over the step's (zero-padded) 32 columns, exact
  (``|sum| <= 3 * 32 * 127^2``), and ``S_j = 2^-(qa+qw) sum_d c_d 128^d`` is exact in float64 (an integer below
  ``2^53`` times a power of two). Any exact computation of ``S_j`` gives NumPy's value: in the exact domain every
  partial sum is exact (:func:`~moeref.compare.gemm_bounds.adder_exact`). Operands whose integers need more than
  three digits take the float64 fallback: the step's products summed in float64 (exact in any order, the same
  reason);
* ``m_j`` (the largest ``floor(log2|a|) + floor(log2|w|)`` over the step's nonzero products) from the exponent
  matmul of bench/study_adder_summaries.py: ``s = sum_k 2^(6 x_a) 2^(6 x_w)`` over the nonzero pairs, ``x = e - o``
  with per-launch offsets ``o_a, o_w`` (:func:`_exponent_offsets`) that put every ``x`` in ``[-21, 21]`` and every
  ``x_a + x_w`` in ``[-21, 20]``. Each power is a bf16 (normal), each product ``2^(6 (x_a + x_w))`` is exact and a
  normal float32 (``>= 2^-126``), at most 32 are nonzero, so ``2^(6 M) <= s <= 2^(6 M + 5) < 2^128`` (``M =
  m_j - o_a - o_w``) for any FP32 accumulation whose adds are monotone and never drop the largest addend: round to
  nearest in any order, or the tensor cores' aligned adder with truncation toward zero (every addend is >= 0). So
  ``floor(log2 s)`` (the float32 exponent field) lies in ``[6 M, 6 M + 5]`` and ``M = floor(floor(log2 s) / 6)``;
  ``s = 0`` exactly when the step has no nonzero product. When the exponents' spread does not fit (``span_a +
  span_w > 41``: E5M2 with E4M3, wide integers) or a step is wider than 32 columns, ``m_j`` is the direct maximum
  of ``e_a + e_w`` (int32, :data:`~moeref.compare.gemm_bounds.NO_EXPONENT` for zeros): the same integer;
* the step's row maxima and nonzero counts of the activations from one pass of torch operations per launch, the
  weights' from the weight tile the kernel has just read (``max |I_w| 2^-qw`` and ``sum (I_w != 0)``: the same
  values), then ``T_j`` and ``n_j`` as :func:`~moeref.compare.gemm_bounds.adder_summaries` forms them and the
  recurrence exactly as :func:`~moeref.compare.gemm_bounds.adder_rows` orders it.

The activations arrive as float64 element values: their digits (int8 ``[DA, M, KP]``), exponent powers (bf16
``[M, KP]``) and step summaries are made once per launch in the kernel's column layout (``KP``: every step padded
to ``MP >= 32`` columns with zeros, :func:`~moeref.compare.gemm_bounds.grouped_columns`). The weights are read as
their uint8 codes through an int32 integer table and a bf16 power table (no float64 copy), or as float64 values
(converted once per launch). The operands must be finite (the exact domain's condition). Triton's interpreter
gives wrong bf16 ``tl.dot`` results (Triton 3.6, 2026-11-25: sums near ``2^33`` for powers near ``2^0``), so under
it (CPU tensors) the exponent matmul runs on float32 copies with ``input_precision="ieee"`` (round to nearest:
the same ``M`` by the argument above).

Compiled with ``enable_fp_fusion=False``. Runs under ``TRITON_INTERPRET=1`` (CI).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..gemm._device_kernels import _split_digits
from ..gemm.exact import quantum_and_max
from ._bound_kernels import _grid, _item
from .gemm_bounds import NO_EXPONENT, grouped_columns

__all__ = ["adder_digits_bound_t", "TILES"]

EXP_POWER = 6
"""``lambda`` of the exponent matmul: a step's sum of ``2^(6 x)`` over at most 32 = 2^5 nonzero products stays
below the next multiple of 6 in the exponent."""
EXP_LIMIT = 21
"""Offset exponents lie in ``[-21, 21]`` (bf16 powers ``2^(6 x)`` normal) and their pair sums in ``[-21, 20]``
(float32 products in ``[2^-126, 2^120]``, sums of 32 below ``2^128``)."""
DIGIT_LIMIT = 1 << 21
"""Three signed base-128 digits hold integers below ``2^21`` in magnitude."""
TILES = {"bm": (16, 32), "bn": 64, "warps": {16: 8, 32: 8, 64: 8}, "stages": 1, "item_cost_rows": 16}
"""GPU tiles: the rows per work item are chosen among ``bm`` (``tl.dot`` needs >= 16) to minimise the padded rows
plus ``item_cost_rows`` per item (an item decodes its expert's weight tiles once: ~16 rows of epilogue work);
``bn`` output columns; warps per rows; ``stages``: Triton's ``num_stages`` (None: its default). Chosen from the
compiler's resource report for sm_90 (Triton 3.6, ptxas of its wheel, 2026-11-25): 16x64 and 32x64 tiles with 8
warps and one stage compile without spills (0 bytes of stack at 244 and 252 registers); every 64-row tile spills
(128 to 5568 bytes), so does 32x64 with 4 warps (504 to 744). Not yet timed on a GPU (bench/bench_adder_exact.py)."""


@triton.jit
def _adder_digits_kernel(a_ptr, ax_ptr, amax_ptr, anz_ptr, w_ptr, wtab_ptr, wx_ptr, sa_ptr, sw_ptr, b_ptr, c_ptr,
                         out_ptr, it_ptr, M, N, K, KP, PLANE, EOFF, NCH: tl.constexpr, C: tl.constexpr,
                         STEPS: tl.constexpr, MMA: tl.constexpr, MP: tl.constexpr, DA: tl.constexpr,
                         DW: tl.constexpr, DIGITS: tl.constexpr, CODES: tl.constexpr, EXPDOT: tl.constexpr,
                         IEEE: tl.constexpr, NOEXP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Module docstring. ``a``: int8 digits ``[DA, M, KP]`` (``DIGITS``) or float64 values ``[M, KP]``; ``ax``: bf16
    powers (``EXPDOT``) or int32 exponents ``[M, KP]``; ``amax`` float64 / ``anz`` int32 ``[NCH * STEPS, M]``;
    ``w``: uint8 codes ``[G, K, N]`` through ``wtab`` (int32 integers or float64 values ``[256]``) and ``wx``
    (powers or exponents ``[256]``) with ``CODES``, else int32 integers / float64 values and ``wx`` ``[G, K, N]``;
    ``c``: float64 ``[u2, g_prom, 1 + 2^-40, 2^-1022, 1 + 1e-9, 1, 0, 2^-(qa+qw), 2^-qw]``."""
    g, rm, mm = _item(it_ptr, BM)
    g64 = g.to(tl.int64)
    w_ptr += g64 * K * N
    if not CODES:
        wx_ptr += g64 * K * N
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
    unit = tl.load(c_ptr + 7)
    wunit = tl.load(c_ptr + 8)
    arow = rm.to(tl.int64) * KP
    amask = mm[:, None] & (kk < MP)[None, :]
    tot_e = tl.zeros((BM, BN), dtype=tl.float64)
    tot_p = tl.zeros((BM, BN), dtype=tl.float64)
    for ch in range(0, NCH):
        err = tl.zeros((BM, BN), dtype=tl.float64)
        prev = tl.zeros((BM, BN), dtype=tl.float64)
        s_sum = tl.zeros((BM, BN), dtype=tl.float64)
        for j in range(0, STEPS):
            sidx = ch * STEPS + j
            pos = j * MMA + kk
            col = ch * C + pos
            wmask = ((kk < MMA) & (pos < C) & (col < K))[:, None] & nm[None, :]
            woff = col[:, None] * N + rn[None, :]
            aoff = arow[:, None] + (sidx * MP + kk)[None, :]
            # the weight tile [MP, BN]: integers (or values) and exponent powers (or exponents)
            if CODES:
                code = tl.load(w_ptr + woff, mask=wmask, other=0).to(tl.int32)
                wv = tl.load(wtab_ptr + code, mask=wmask, other=0)
                if EXPDOT:
                    xw = tl.load(wx_ptr + code, mask=wmask, other=0.0)
                else:
                    xw = tl.load(wx_ptr + code, mask=wmask, other=NOEXP)
            else:
                wv = tl.load(w_ptr + woff, mask=wmask, other=0)
                if EXPDOT:
                    xw = tl.load(wx_ptr + woff, mask=wmask, other=0.0)
                else:
                    xw = tl.load(wx_ptr + woff, mask=wmask, other=NOEXP)
            wnz = tl.sum((wv != 0).to(tl.int32), axis=0)
            # the step sum S_j, exact
            if DIGITS:
                wmx = tl.max(tl.abs(wv), axis=0).to(tl.float64) * wunit
                w0, w1, w2 = _split_digits(wv)
                a0 = tl.load(a_ptr + aoff, mask=amask, other=0)
                c0 = tl.dot(a0, w0, out_dtype=tl.int32)
                c1 = tl.zeros((BM, BN), dtype=tl.int32)
                c2 = tl.zeros((BM, BN), dtype=tl.int32)
                c3 = tl.zeros((BM, BN), dtype=tl.int32)
                c4 = tl.zeros((BM, BN), dtype=tl.int32)
                if DW > 1:
                    c1 = tl.dot(a0, w1, c1, out_dtype=tl.int32)
                if DW > 2:
                    c2 = tl.dot(a0, w2, c2, out_dtype=tl.int32)
                if DA > 1:
                    a1 = tl.load(a_ptr + PLANE + aoff, mask=amask, other=0)
                    c1 = tl.dot(a1, w0, c1, out_dtype=tl.int32)
                    if DW > 1:
                        c2 = tl.dot(a1, w1, c2, out_dtype=tl.int32)
                    if DW > 2:
                        c3 = tl.dot(a1, w2, c3, out_dtype=tl.int32)
                if DA > 2:
                    a2 = tl.load(a_ptr + PLANE + PLANE + aoff, mask=amask, other=0)
                    c2 = tl.dot(a2, w0, c2, out_dtype=tl.int32)
                    if DW > 1:
                        c3 = tl.dot(a2, w1, c3, out_dtype=tl.int32)
                    if DW > 2:
                        c4 = tl.dot(a2, w2, c4, out_dtype=tl.int32)
                # |c0|, |c4| <= 32 * 127^2, |c1|, |c3| <= 2 * that, |c2| <= 3 * that: lo, hi below 2^28 in int32;
                # the float64 combination is of integers below 2^53 (the step sum's integer): exact
                lo = c0 + (c1 << 7)
                if DA + DW > 3:
                    hi = c2 + (c3 << 7)
                    p = (c4.to(tl.float64) * 16384.0 + hi.to(tl.float64)) * 16384.0 + lo.to(tl.float64)
                else:
                    p = lo.to(tl.float64)
                ts = p * unit
            else:
                wmx = tl.max(tl.abs(wv), axis=0)
                av = tl.load(a_ptr + aoff, mask=amask, other=0.0)
                ts = tl.sum(av[:, :, None] * wv[None, :, :], axis=1)  # exact in any order (exact domain)
            # m_j: the largest exponent sum of the step's nonzero products -> 2^(max(m_j, -1021) + 1), 0 without one
            if EXPDOT:
                xa = tl.load(ax_ptr + aoff, mask=amask, other=0.0)
                if IEEE:
                    es = tl.dot(xa.to(tl.float32), xw.to(tl.float32), input_precision="ieee")
                else:
                    es = tl.dot(xa, xw, out_dtype=tl.float32)
                # floor(E / 6) = (E + 126) // 6 - 21 with E + 126 = (biased exponent) - 1 >= 0 for s >= 2^-126
                mj = ((es.to(tl.int32, bitcast=True) >> 23) - 1) // 6 - 21 + EOFF  # 21: EXP_LIMIT
                has = es > 0.0
            else:
                xa = tl.load(ax_ptr + aoff, mask=amask, other=NOEXP)
                mj = tl.max(xa[:, :, None] + xw[None, :, :], axis=1)
                has = mj > NOEXP // 2
            big = ((tl.maximum(mj, -1021) + 1024).to(tl.int64) << 52).to(tl.float64, bitcast=True)
            p2m = tl.where(has, big, zero)
            # T_j and n_j (adder_summaries), then adder_rows' recurrence
            am = tl.load(amax_ptr + sidx * M + rm, mask=mm, other=0.0)
            anz = tl.load(anz_ptr + sidx * M + rm, mask=mm, other=0)
            top = _grid(am[:, None] * wmx[None, :], wide, min_normal)
            top = tl.where(p2m < top, p2m, top)
            cnt = tl.minimum(anz[:, None], wnz[None, :]).to(tl.float64)
            s_sum = s_sum + ts
            s_part = tl.abs(s_sum)
            g1 = _grid(prev, wide, min_normal)
            jf = tl.where(j > 0, one, zero)
            align = ((cnt + jf) * u2) * tl.where(top > g1, top, g1)
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


def _integer_scale(quantum: float, top: float):
    """``(q, digits)``: ``v 2^q`` is an integer for every value ``v`` of quantum ``quantum`` (a power of two;
    ``inf`` for none nonzero) and largest magnitude ``top``, in ``digits`` base-128 digits (None: more than 3, or
    ``2^-q`` not a normal float64)."""
    if not math.isfinite(quantum) or top == 0:
        return 0, 1
    q = -int(round(math.log2(quantum)))
    if 2.0**-q != quantum or abs(q) > 1022:
        return q, None
    i = top * 2.0**q
    return q, (1 if i < 128 else 2 if i < 16384 else 3 if i < DIGIT_LIMIT else None)


def _exponents(v):
    """``floor(log2|v|)`` int32 of a float64 tensor, :data:`NO_EXPONENT` for zeros (finite values)."""
    return torch.where(v != 0, torch.frexp(v)[1] - 1, torch.full((), NO_EXPONENT, dtype=torch.int32, device=v.device))


def _span(e) -> tuple[int, int] | None:
    """``(lo, hi)`` of the exponents of the nonzero elements (:func:`_exponents`), None for none (one host copy)."""
    nz = e != NO_EXPONENT
    big = torch.full((), 1 << 20, dtype=e.dtype, device=e.device)
    lo, hi = torch.stack([torch.where(nz, e, big).min(), torch.where(nz, e, -big).max()]).tolist()
    return None if lo > hi else (int(lo), int(hi))


def _exponent_offsets(sa, sw, mp: int):
    """``(o_a, o_w)``: offsets with ``x_a = e_a - o_a``, ``x_w = e_w - o_w`` in ``[-21, 21]`` and ``x_a + x_w`` in
    ``[-21, 20]`` for every nonzero pair (``sa``/``sw``: :func:`_span`), or None (the direct maximum) when the
    spans add to more than 41 or a step is wider than 32 columns. ``x_a``'s top is ``h = max(span_a - 21, -1)``,
    ``x_w``'s ``20 - h``: both within the limits when ``span_a + span_w <= 41``."""
    if mp > 32:
        return None
    if sa is None or sw is None:  # no nonzero product: powers <= 1 (no overflow), every sum 0
        return (0 if sa is None else sa[1]), (0 if sw is None else sw[1])
    span_a, span_w = sa[1] - sa[0], sw[1] - sw[0]
    if span_a + span_w > 2 * EXP_LIMIT - 1:
        return None
    h = max(span_a - EXP_LIMIT, -1)
    return sa[1] - h, sw[1] - (EXP_LIMIT - 1 - h)


def _powers(e, off: int, dtype=torch.bfloat16):
    """``2^(6 (e - off))`` of exponents ``e`` (0 where :data:`NO_EXPONENT`), exact in ``dtype``."""
    one = torch.ones((), dtype=torch.float64, device=e.device)
    p = torch.ldexp(one, (EXP_POWER * (e.to(torch.int64) - off)).to(torch.float64))
    return torch.where(e != NO_EXPONENT, p, torch.zeros_like(p)).to(dtype)


def _digit_planes(ints, digits: int):
    """int8 ``[digits, *ints.shape]``: the signed base-128 digits of int32 ``ints`` (``_split_digits``'s)."""
    mag, neg = ints.abs(), ints < 0
    planes = [(mag >> (7 * i)) & 127 for i in range(digits)]
    return torch.stack([torch.where(neg, -d, d) for d in planes]).to(torch.int8)


def _layout(k: int, chunk: int, mma: int):
    """``(cols [KP] int64 with -1 on padding, MP)``: the kernel's columns, every step padded to ``MP`` columns."""
    cols = grouped_columns(k, chunk, mma)
    mp = max(32, triton.next_power_of_2(mma))
    full = np.full(cols.shape[:2] + (mp,), -1, dtype=np.int64)
    full[..., :mma] = cols
    return full.reshape(-1), mp


def _work_items(counts, device, bms):
    """``(items [T, 3] int32 (expert, first row, rows), BM)``, ``BM`` among ``bms`` minimising the padded rows
    plus :data:`TILES` ``item_cost_rows`` per item (:func:`moeref.gemm.device._items` cuts the rows)."""
    from ..gemm.device import _items

    counts = np.asarray(counts, dtype=np.int64)
    cost = TILES["item_cost_rows"]
    bm = min(bms, key=lambda b: (int((-(-counts // b) * b).sum() + cost * (-(-counts // b)).sum()), -b))
    starts = np.cumsum(counts) - counts
    per, first, cnt = _items(starts, counts, bm)
    it = np.stack([np.repeat(np.arange(counts.size), per), first, cnt], axis=1).astype(np.int32)
    return torch.as_tensor(it, device=device).contiguous(), bm


def adder_digits_bound_t(av, w, table, sa, sw, b_abs, consts, counts, *, n: int, chunk: int, mma: int,
                         steps: int, present=None, tiles: dict | None = None) -> torch.Tensor:
    """The aligned-adder bound ``[M, N]`` in the exact domain without a radius (module docstring): ``av`` float64
    ``[M, K]`` element values, ``counts[g]`` consecutive rows against expert ``g`` of ``w`` ``[G, K, N]`` (uint8
    codes read through ``table``, the float64 decode table ``[256]``; or float64 element values with ``table``
    None), ``sa`` ``[M, NCH]`` / ``sw`` ``[G, N, NCH]`` chunk scales, ``b_abs`` ``[G, N]``, ``consts`` float64
    ``[u2, g_prom, 1 + 2^-40, 2^-1022, 1 + 1e-9, 1, 0]``. Every value must be finite and the launch in the exact
    domain (:func:`~moeref.compare.gemm_bounds.adder_exact`: the caller's check). ``present``: bool ``[table
    size]``, the codes ``w`` holds (at least; e.g. cached per expert), else counted here (one pass over the codes).
    ``tiles``: :data:`TILES` overrides (``bm``, ``bn``, ``warps``, ``stages``) for benchmarks."""
    from .device_bounds import device_quantum_and_max

    m, k = (int(d) for d in av.shape)
    dev = av.device
    out = torch.zeros((m, n), dtype=torch.float64, device=dev)
    if m == 0 or n == 0:
        return out
    codes = table is not None
    nch = -(-k // chunk)
    cols, mp = _layout(k, chunk, mma)
    kp = cols.size
    if np.array_equal(cols, np.arange(k)):
        ag = av.contiguous()
    else:
        ct = torch.as_tensor(cols, device=dev)
        ag = torch.where(ct >= 0, av.index_select(1, ct.clamp(min=0)), torch.zeros((), dtype=av.dtype, device=dev))
    ns = nch * steps
    steps_of = ag.view(m, ns, mp)
    amax = steps_of.abs().amax(dim=2).t().contiguous()
    anz = (steps_of != 0).sum(dim=2, dtype=torch.int32).t().contiguous()
    ea = _exponents(ag)
    # the weights' integers, exponents and the launch's integer scales
    if codes:
        size = int(table.numel())
        if present is None:
            present = torch.bincount(w.reshape(-1), minlength=size)[:size].cpu().numpy() > 0
        present = np.asarray(present, dtype=bool)[:size]
        tv = table.cpu().numpy()
        vals = np.where(present, tv, 0.0)
        qw, dw = _integer_scale(*quantum_and_max(vals))
        ew_t = np.where(vals != 0, np.frexp(vals)[1] - 1, NO_EXPONENT)
        sw_span = (int(ew_t[vals != 0].min()), int(ew_t[vals != 0].max())) if np.any(vals != 0) else None
    else:
        qw, dw = _integer_scale(*device_quantum_and_max(w))
        ew = _exponents(w)
        sw_span = _span(ew)
    qa, da = _integer_scale(*device_quantum_and_max(av))
    digits = da is not None and dw is not None and abs(qa + qw) <= 1022
    offs = _exponent_offsets(_span(ea), sw_span, mp)
    # the activations in the kernel's layout
    if digits:
        a_op = _digit_planes(torch.ldexp(ag, torch.tensor(float(qa), device=dev)).to(torch.int32), da).contiguous()
    else:
        a_op = ag.contiguous()
    ax = (_powers(ea, offs[0]) if offs is not None else ea).contiguous()
    # the weights: codes through tables, or values converted once
    if codes:
        wtab = (torch.as_tensor(np.ldexp(vals, qw).astype(np.int32), device=dev) if digits
                else torch.as_tensor(vals, dtype=torch.float64, device=dev))
        ew_tt = torch.as_tensor(ew_t.astype(np.int32), device=dev)
        wx = _powers(ew_tt, offs[1]) if offs is not None else ew_tt
        w_op = w
    else:
        wtab = consts
        wx = (_powers(ew, offs[1]) if offs is not None else ew).contiguous()
        w_op = torch.ldexp(w, torch.tensor(float(qw), device=dev)).to(torch.int32) if digits else w
    w_op = w_op.contiguous()
    cfg = dict(TILES, **(tiles or {}))
    on_gpu = dev.type == "cuda"
    fast = digits and offs is not None
    bms = cfg["bm"] if (on_gpu and fast) else (16,)
    it, bm = _work_items(counts, dev, bms)
    bn = cfg["bn"] if (on_gpu and fast) else 16
    c = torch.cat([consts, torch.tensor([2.0 ** -(qa + qw), 2.0**-qw], dtype=torch.float64, device=dev)])
    grid = (int(it.shape[0]), triton.cdiv(n, bn))
    _adder_digits_kernel[grid](a_op, ax, amax, anz, w_op, wtab, wx, sa, sw, b_abs, c, out, it, m, n, k, kp, m * kp,
                               0 if offs is None else offs[0] + offs[1], NCH=nch, C=chunk, STEPS=steps, MMA=mma,
                               MP=mp, DA=da or 1, DW=dw or 1, DIGITS=digits, CODES=codes, EXPDOT=offs is not None,
                               IEEE=not on_gpu, NOEXP=NO_EXPONENT, BM=bm, BN=bn,
                               num_warps=cfg["warps"][bm] if (on_gpu and fast) else 4, enable_fp_fusion=False,
                               **({"num_stages": cfg["stages"]} if cfg["stages"] and on_gpu and fast else {}))
    return out

