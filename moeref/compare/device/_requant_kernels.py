"""Triton kernels of :func:`moeref.compare.device.requant.device_requant`: its torch lines, bit for bit, in two
passes over ``x, dx`` float64 ``[V, N]``.

* :func:`amax_grids_t` mirrors the three ``_amax_grid`` calls (``|x|``, ``|x| + dx``, ``clamp(|x| - dx, min=0)``;
  zero-padded partial blocks): NaN where the block holds a NaN (``torch.amax`` propagates it), else the exact
  maximum by ``where(v > m, v, m)``; one ``[3, ceil(V / br), ceil(N / bk)]`` tensor.
* :func:`requant_t` mirrors the lines after the host scale step, each block's ``fac`` / ``s_ref`` / ``s_up`` /
  ``s_dn`` read by grid index (no ``_expand``): ``scaled = x * fac`` (or ``x / fac``), ``round_float_rne``
  (:func:`_round`: the quantum ``2^k`` from the exponent field; ``|v| * 2^-k``, the exact quotient; half to even
  as ``(t + 1.5 * 2^52) - 1.5 * 2^52`` for ``t < 2^(man_bits + 1)`` or Inf; ``* 2^k``; ``min(., max_finite)``;
  ``v``'s sign bit, as the symmetric ``torch.round`` leaves it, zeros included; a NaN through the same operations
  on ``v`` itself), the codes (:func:`_encode`: the exact FP8 encoding of the rounded value, field ``e - emin + 1``
  and the top mantissa bits, subnormals ``|r| * 2^(man_bits - emin)``, the sign bit, NaN ``0x7F`` with its
  float32 cast's sign, ``-0`` to ``0`` where the preset drops it: the bits of ``.to(float32).to(float8)``),
  ``decode() * s_ref`` as ``r * s_ref`` (``+0`` for code 0), then ``requant_uncertainty``'s scale range, corners
  and ``unc`` in the torch order; ``maximum`` / ``minimum`` propagate NaN as torch's (:func:`_maxp`),
  ``isfinite`` is an exponent-field test, ``/`` is the IEEE float64 division (``div.rn.f64``). Flips: one count
  per program, summed by torch.

Compiled with ``enable_fp_fusion=False`` (no FMA contraction); every float64 constant (``1 +- 2^-21``, ``2^-20``,
``1e-300``, ``1.5 * 2^52``, ``max_finite``, ``2^(man_bits - emin)``, Inf, NaN) is read from a float64 tensor
(:func:`_consts`, :func:`moeref.compare.device._constants.float64_constants`): Triton types a Python float as float32. Runs on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (CI).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._interop import triton_interpreted
from ._constants import float64_constants

__all__ = ["usable", "amax_grids_t", "requant_t"]

_C_HI, _C_LO, _C_W20, _C_TINY, _C_MAGIC, _C_MAXF, _C_SUB, _C_INF, _C_NAN = (tl.constexpr(i) for i in range(9))
_TILE = 1024  # elements of one program's tile


def _consts(device: torch.device, max_finite: float, sub: float):
    return float64_constants(device, 1 + 2.0**-21, 1 - 2.0**-21, 2.0**-20, 1e-300, 1.5 * 2.0**52, max_finite, sub,
                             float("inf"), float("nan"))


def usable(x, dx) -> bool:
    """Whether the kernels run on ``x``, ``dx``: float64 ``[V, N]`` (``V, N > 0``) of one shape on a CUDA device,
    or on the CPU under ``TRITON_INTERPRET=1``."""
    if not (isinstance(x, torch.Tensor) and isinstance(dx, torch.Tensor)):
        return False
    if x.dtype != torch.float64 or dx.dtype != torch.float64 or x.ndim != 2 or x.shape != dx.shape:
        return False
    if x.device != dx.device or x.numel() == 0:
        return False
    return x.device.type == "cuda" or (x.device.type == "cpu" and triton_interpreted())


@triton.jit
def _maxp(a, b):
    """``torch.maximum(a, b)``: NaN if either is (``a``'s first)."""
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _minp(a, b):
    """``torch.minimum(a, b)``."""
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def _finite(v):
    return ((v.to(tl.int64, bitcast=True) >> 52) & 0x7FF) != 0x7FF


@triton.jit
def _round(v, c_ptr, EMIN: tl.constexpr, MB: tl.constexpr):
    """``device_requant.round_float_rne(v, el)`` (module docstring)."""
    bits = v.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1023  # frexp's exponent - 1 where it matters (clamped at emin below)
    k = tl.maximum(e, EMIN) - MB
    q = ((k + 1023) << 52).to(tl.float64, bitcast=True)
    q_inv = ((1023 - k) << 52).to(tl.float64, bitcast=True)
    magic = tl.load(c_ptr + _C_MAGIC)
    n = (tl.abs(v) * q_inv + magic) - magic
    r = n * q
    maxf = tl.load(c_ptr + _C_MAXF)
    r = tl.where(r > maxf, maxf, r)
    r = (r.to(tl.int64, bitcast=True) | ((bits >> 63) << 63)).to(tl.float64, bitcast=True)
    return tl.where(v != v, ((v * q_inv + magic) - magic) * q, r)  # a NaN through signed arithmetic, as torch's


@triton.jit
def _encode(r, c_ptr, EMIN: tl.constexpr, MB: tl.constexpr, DROP: tl.constexpr):
    """int32 FP8 code of ``r`` (a :func:`_round` value: exact in the format, or NaN)."""
    bits = r.to(tl.int64, bitcast=True)
    a = bits & 0x7FFFFFFFFFFFFFFF
    e = (a >> 52) - 1023
    normal = ((e - EMIN + 1) << MB) | ((a >> (52 - MB)) & ((1 << MB) - 1))
    nan = r != r
    mag = tl.where(nan, 0.0, tl.abs(r))
    sub = (mag * tl.load(c_ptr + _C_SUB)).to(tl.int64)  # 2^(man_bits - emin): the subnormal's integer
    code = tl.where(e >= EMIN, normal, sub)
    sign = tl.where(nan, (r.to(tl.float32).to(tl.int32, bitcast=True) >> 24) & 0x80, (bits >> 56) & 0x80)
    code = tl.where(nan, 0x7F, code) | sign  # a NaN's sign: its float32 cast's, as torch's float32 -> float8
    if DROP:
        code = tl.where(code == 0x80, 0, code)
    return code.to(tl.int32)


@triton.jit
def _amax_kernel(x_ptr, dx_ptr, out_ptr, c_ptr, R, N, GR, GC, BR: tl.constexpr, BK: tl.constexpr,
                 G: tl.constexpr, CH: tl.constexpr):
    """Block row ``program_id(0)``, block columns ``program_id(1) * G + [0, G)``: the three amax of each block,
    its ``BR`` rows and ``BK`` columns read ``[G, CH]`` at a time (padding read as 0; lanes past ``BK``: -Inf)."""
    gr = tl.program_id(0)
    gc = tl.program_id(1) * G + tl.arange(0, G)
    ch = tl.arange(0, CH)
    ninf = -tl.load(c_ptr + _C_INF)
    m0 = tl.full((G, CH), 0.0, tl.float64) + ninf
    m1 = m0
    m2 = m0
    n0 = tl.zeros((G, CH), dtype=tl.int32)
    n1 = n0
    n2 = n0
    for rr in range(0, BR):
        row = gr * BR + rr
        for c0 in range(0, BK, CH):
            cib = c0 + ch
            col = gc[:, None] * BK + cib[None, :]
            inb = (gc < GC)[:, None] & (cib < BK)[None, :]
            ld = inb & (col < N) & (row < R)
            off = row.to(tl.int64) * N + col
            x = tl.load(x_ptr + off, mask=ld, other=0.0)
            dx = tl.load(dx_ptr + off, mask=ld, other=0.0)
            a0 = tl.abs(x)
            a1 = a0 + dx
            a2 = a0 - dx
            a2 = tl.where(a2 < 0.0, 0.0, a2)  # clamp(min=0): NaN stays
            n0 = n0 | (a0 != a0).to(tl.int32)  # NaN lanes are never taken into m (v > m is false)
            n1 = n1 | (a1 != a1).to(tl.int32)
            n2 = n2 | (a2 != a2).to(tl.int32)
            m0 = tl.where(inb & (a0 > m0), a0, m0)
            m1 = tl.where(inb & (a1 > m1), a1, m1)
            m2 = tl.where(inb & (a2 > m2), a2, m2)
    nf = tl.load(c_ptr + _C_NAN)
    ok = gc < GC
    base = out_ptr + gr * GC + gc
    tl.store(base, tl.where(tl.max(n0, axis=1) != 0, nf, tl.max(m0, axis=1)), mask=ok)
    tl.store(base + GR * GC, tl.where(tl.max(n1, axis=1) != 0, nf, tl.max(m1, axis=1)), mask=ok)
    tl.store(base + 2 * GR * GC, tl.where(tl.max(n2, axis=1) != 0, nf, tl.max(m2, axis=1)), mask=ok)


@triton.jit
def _requant_kernel(x_ptr, dx_ptr, fac_ptr, sref_ptr, sup_ptr, sdn_ptr, c_ptr, code_ptr, unc_ptr, flip_ptr, R, N, GC,
                    BR: tl.constexpr, BK: tl.constexpr, MUL: tl.constexpr, EMIN: tl.constexpr, MB: tl.constexpr,
                    DROP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One ``[BM, BN]`` tile: codes, ``unc`` and the tile's flip count (``flip_ptr[program]``)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    msk = (rows < R)[:, None] & (cols < N)[None, :]
    off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    gi = (rows // BR)[:, None] * GC + (cols // BK)[None, :]
    x = tl.load(x_ptr + off, mask=msk, other=0.0)
    dx = tl.load(dx_ptr + off, mask=msk, other=0.0)
    f = tl.load(fac_ptr + gi, mask=msk, other=1.0)
    s_ref = tl.load(sref_ptr + gi, mask=msk, other=1.0)
    # the center's codes
    if MUL:
        scaled = x * f
    else:
        scaled = x / f
    vals = _round(scaled, c_ptr, EMIN, MB)
    code = _encode(vals, c_ptr, EMIN, MB, DROP)
    tl.store(code_ptr + off, code.to(tl.uint8), mask=msk)
    q_ref = tl.where(code == 0, 0.0, vals) * s_ref  # operand.decode() * s_ref
    # requant_uncertainty
    s_hi = _maxp(tl.load(sup_ptr + gi, mask=msk, other=1.0), s_ref) * tl.load(c_ptr + _C_HI)
    s_lo = _minp(tl.load(sdn_ptr + gi, mask=msk, other=1.0), s_ref) * tl.load(c_ptr + _C_LO)
    s_lo_safe = tl.where(s_lo > 0.0, s_lo, s_hi)
    a = x - dx
    b = x + dx
    e = a / s_lo_safe
    t_lo = tl.where(_finite(e), e, 0.0)
    t_hi = t_lo
    e = a / s_hi
    e = tl.where(_finite(e), e, 0.0)
    t_lo = _minp(t_lo, e)
    t_hi = _maxp(t_hi, e)
    e = b / s_lo_safe
    e = tl.where(_finite(e), e, 0.0)
    t_lo = _minp(t_lo, e)
    t_hi = _maxp(t_hi, e)
    e = b / s_hi
    e = tl.where(_finite(e), e, 0.0)
    t_lo = _minp(t_lo, e)
    t_hi = _maxp(t_hi, e)
    widen = tl.load(c_ptr + _C_W20) * _maxp(tl.abs(t_lo), tl.abs(t_hi)) + tl.load(c_ptr + _C_TINY)
    r_lo = _round(t_lo - widen, c_ptr, EMIN, MB)
    r_hi = _round(t_hi + widen, c_ptr, EMIN, MB)
    unc = tl.abs(s_lo * r_lo - q_ref)
    unc = _maxp(unc, tl.abs(s_lo * r_hi - q_ref))
    unc = _maxp(unc, tl.abs(s_hi * r_lo - q_ref))
    unc = _maxp(unc, tl.abs(s_hi * r_hi - q_ref))
    unc = tl.where(_finite(unc), unc, tl.load(c_ptr + _C_INF))
    tl.store(unc_ptr + off, unc, mask=msk)
    flips = tl.sum(tl.sum((msk & (r_lo != r_hi)).to(tl.int32), axis=1), axis=0)
    tl.store(flip_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), flips)


def amax_grids_t(x, dx, block):
    """``[_amax_grid(|x|), _amax_grid(|x| + dx), _amax_grid(clamp(|x| - dx, min=0))]`` of float64 ``x``, ``dx``
    ``[V, N]`` (:func:`usable`) over ``block`` ``(br, bk)``: three views of one float64 ``[3, GR, GC]`` tensor."""
    r, n = (int(d) for d in x.shape)
    br, bk = (int(b) for b in block)
    gr, gc = -(-r // br), -(-n // bk)
    out = torch.empty((3, gr, gc), dtype=torch.float64, device=x.device)
    ch = min(triton.next_power_of_2(bk), _TILE)
    g = min(max(1, _TILE // ch), triton.next_power_of_2(gc))
    c = _consts(x.device, 0.0, 0.0)
    _amax_kernel[(gr, triton.cdiv(gc, g))](x.contiguous(), dx.contiguous(), out, c, r, n, gr, gc, BR=br, BK=bk, G=g,
                                           CH=ch, enable_fp_fusion=False)
    return [out[0], out[1], out[2]]


def requant_t(x, dx, fac, s_ref, s_up, s_dn, block, op: str, el, drop: bool):
    """``(codes uint8 [V, N], unc float64 [V, N], flips 0-d int64)`` of ``device_requant``'s element lines for
    float64 grids ``[GR, GC]`` ``fac`` (``op``: ``"mul"`` multiplies, else divides), ``s_ref``, ``s_up``, ``s_dn``,
    element ``el`` (``e4m3fn``, ``e5m2``); ``drop``: the preset drops the sign of zero codes."""
    r, n = (int(d) for d in x.shape)
    br, bk = (int(b) for b in block)
    codes = torch.empty((r, n), dtype=torch.uint8, device=x.device)
    unc = torch.empty((r, n), dtype=torch.float64, device=x.device)
    bn = min(256, triton.next_power_of_2(n))
    bm = _TILE // bn
    grid = (triton.cdiv(r, bm), triton.cdiv(n, bn))
    flips = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    grids = [t.contiguous() for t in (fac, s_ref, s_up, s_dn)]
    if any(t.dtype != torch.float64 or t.shape != grids[0].shape for t in grids):
        raise ValueError("requant_t reads float64 grids of one shape")
    c = _consts(x.device, float(el.max_finite), 2.0 ** (el.man_bits - el.emin))
    _requant_kernel[grid](x.contiguous(), dx.contiguous(), *grids, c, codes, unc, flips, r, n, int(fac.shape[1]), BR=br,
                          BK=bk, MUL=op == "mul", EMIN=int(el.emin), MB=int(el.man_bits), DROP=bool(drop), BM=bm, BN=bn,
                          enable_fp_fusion=False)
    return codes, unc, flips.sum(dtype=torch.int64)
