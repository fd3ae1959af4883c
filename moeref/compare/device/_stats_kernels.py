"""Per-row statistics of a float64 operand in one pass (Triton): what the device bounds ask of an operand's rows
before choosing a form (:func:`moeref.compare.device.operands._row_stats`).

Per row of ``values`` ``[R, K]``, all from the bits, so exact on every engine (the interpreter in CI, the GPU):

* **finite**: no NaN or infinity;
* **bf16**: finite and every element exactly representable in bfloat16 (what ``x.to(float32).to(bfloat16)`` gives
  back unchanged): zero, or a normal float64 with exponent ``E <= 127`` whose lowest set bit weighs at least
  ``2^max(E - 7, -133)`` (8 significant bits; bfloat16's subnormals are the multiples of ``2^-133``);
* **quantum**: :func:`moeref.gemm.exact.quantum_and_max`'s ``q`` over the finite elements: the smallest weight of a
  lowest set bit, ``2^(e - 52 + tz)`` with ``tz`` the trailing zeros of the significand (read as the exponent of
  ``sig & -sig`` converted to float64, a power of two), float64 subnormals included (exact there too, as NumPy's
  ``ldexp``); ``inf`` for a row without a nonzero finite element;
* **max**: the largest finite ``|x|`` (0 for none).

One program reads a block of rows once, in column tiles; the reductions (all, min, max) are exact in any order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["row_stats_t"]


@triton.jit
def _row_stats_kernel(v_ptr, out_ptr, R, K, NK: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = rows < R
    base = rows.to(tl.int64) * K
    fin = tl.full((BR,), 1, tl.int32)
    bf = tl.full((BR,), 1, tl.int32)
    inf = tl.full((BR, BK), 0x7FF0000000000000, tl.int64).to(tl.float64, bitcast=True)
    qmin = tl.full((BR,), 0x7FF0000000000000, tl.int64).to(tl.float64, bitcast=True)
    vmax = tl.zeros((BR,), dtype=tl.float64)
    for t in range(0, NK):  # a constexpr count: the interpreter cannot loop to a runtime bound
        cols = t * BK + tl.arange(0, BK)
        m = rm[:, None] & (cols < K)[None, :]
        v = tl.load(v_ptr + base[:, None] + cols[None, :], mask=m, other=0.0)
        bits = v.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF   # |v|
        biased = (bits >> 52).to(tl.int32)
        finite = biased != 0x7FF
        frac = bits & 0xFFFFFFFFFFFFF
        sig = tl.where(biased == 0, frac, frac | (1 << 52))
        low = sig & -sig                                              # the lowest set bit (0 for 0)
        tz = (low.to(tl.float64).to(tl.int64, bitcast=True) >> 52).to(tl.int32) - 1023
        qe = tl.where(biased == 0, -1074, biased - 1075) + tz          # log2 of that bit's weight
        q_normal = ((tl.maximum(qe, -1022) + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
        shift = tl.minimum(tl.maximum(qe + 1074, 0), 52).to(tl.int64)  # a subnormal weight's bit (0..51 used)
        q_sub = (tl.full((BR, BK), 1, tl.int64) << shift).to(tl.float64, bitcast=True)
        q = tl.where(qe >= -1022, q_normal, q_sub)
        nonzero = finite & (bits != 0)
        q = tl.where(nonzero, q, inf)
        mag = tl.where(finite, bits, 0).to(tl.float64, bitcast=True)
        e = biased - 1023
        rep = (bits == 0) | (finite & (biased != 0) & (e <= 127) & (qe >= tl.maximum(e - 7, -133)))
        fin = fin & tl.min(tl.where(m, finite, True).to(tl.int32), axis=1)
        bf = bf & tl.min(tl.where(m, rep, True).to(tl.int32), axis=1)
        qmin = tl.minimum(qmin, tl.min(tl.where(m, q, inf), axis=1))
        vmax = tl.maximum(vmax, tl.max(tl.where(m, mag, 0.0), axis=1))
    bf = bf & fin
    tl.store(out_ptr + rows, fin.to(tl.float64), mask=rm)
    tl.store(out_ptr + R + rows, bf.to(tl.float64), mask=rm)
    tl.store(out_ptr + 2 * R + rows, qmin, mask=rm)
    tl.store(out_ptr + 3 * R + rows, vmax, mask=rm)


def row_stats_t(values: torch.Tensor) -> torch.Tensor:
    """Float64 ``[4, R]`` on ``values``' device: per row of float64 ``values`` ``[R, K]`` the finite flag, the bf16
    flag (1.0 / 0.0), the quantum and the largest magnitude (module docstring)."""
    r, k = (int(d) for d in values.shape)
    out = torch.empty((4, r), dtype=torch.float64, device=values.device)
    if r == 0:
        return out
    v = values.contiguous()
    br, bk = 4, 512
    _row_stats_kernel[(triton.cdiv(r, br),)](v, out, r, k, NK=triton.cdiv(k, bk), BR=br, BK=bk, num_warps=4)
    return out
