"""The operand radius of GEMM2 (the uncertain re-quantized intermediate) through the weights, on a grid that makes
its sums exact.

GEMM2's bound carries ``a_radius``: the kernel multiplies some ``A~`` with ``|A~ - A| <= r`` elementwise. Two
terms read ``r |W|^T``: the operand difference itself (:func:`radius_dot`) and, inside the aligned-adder
bound, the partial sums that ``A~`` can add to the exact ones (:func:`moeref.compare.gemm_bounds.
aligned_adder_gemm_bound`). Summed as they come, those are float64 sums whose bits depend on the order, so an
engine could only reproduce them one column at a time. Rounded *up* onto a grid first, every partial sum over
a :data:`RADIUS_CHUNK` of columns is exact, so any order gives the same bits: NumPy's BLAS, cuBLAS or the float64
tensor cores (:mod:`moeref.compare.device.bounds`). Rounding up keeps the bound sound (it is monotone in the
radius) and costs at most ``2^-L`` of the row's largest radius in that chunk, ``L >= MIN_GRID_BITS``.

The grid (:func:`rounded_radius`): per row and chunk of :data:`RADIUS_CHUNK` columns, with ``R`` the chunk's
largest radius and ``e = floor(log2 R)``, ``q = 2^max(e - L, -1074)`` and ``r^ = ceil(r / q) q`` (so ``r^ <= 2^(e +
1)`` is a multiple of ``q``). The weights' elements are multiples of ``q_w`` at most ``m_w``
(:func:`moeref.gemm.exact.quantum_and_max`), so every product ``r^ |w|`` is a multiple of ``q q_w`` and a
chunk's sum is below ``128 2^(L + 1) (m_w / q_w) q q_w``: exact in float64 when ``L = 45 -
ceil(log2(m_w / q_w))`` (:func:`radius_grid_bits`; 27 for E4M3 weights, 41 for E2M1). Weights with a wider
ratio (``L < MIN_GRID_BITS``: E5M2, bf16 values), non-finite ones, block scales that change inside a chunk or a
non-finite radius keep the ordered sums (:func:`moeref.compare.summation_order.ordered_dot`).
"""
from __future__ import annotations

import math

import numpy as np

from .summation_order import ordered_dot

__all__ = ["RADIUS_CHUNK", "MIN_GRID_BITS", "radius_grid_bits", "rounded_radius", "exact_radius", "radius_dot",
           "chunk_scales_constant"]

RADIUS_CHUNK = 128
"""Columns of one radius grid (and of one exact chunk sum of :func:`radius_dot`): DeepGEMM's promotion chunk."""
MIN_GRID_BITS = 16
"""Fewest bits of a chunk's largest radius the grid keeps (else the ordered sums)."""


def radius_grid_bits(quantum_max) -> int | None:
    """``L = 45 - ceil(log2(m_w / q_w))`` for weights of :func:`moeref.gemm.exact.quantum_and_max` ``(q_w, m_w)``
    (45 for all-zero weights), None when below :data:`MIN_GRID_BITS`.

    >>> radius_grid_bits((2.0**-9, 448.0)), radius_grid_bits((0.5, 6.0)), radius_grid_bits((2.0**-16, 57344.0))
    (27, 41, None)
    """
    q, m = quantum_max
    ratio = 0.0 if m == 0 else m / q
    if not math.isfinite(ratio):
        return None
    f, e = math.frexp(max(ratio, 1.0))
    bits = 45 - (e - 1 if f == 0.5 else e)
    return bits if bits >= MIN_GRID_BITS else None


def pow2_exact(e):
    """``2^e`` as float64 from integer exponents ``e`` in ``[-1074, 1023]`` (subnormals included), built from the
    bits (no library ``pow``): NumPy int64 arrays or torch int64 tensors."""
    if _is_torch(e):
        import torch

        normal = ((e.clamp(min=-1022) + 1023) << 52).view(torch.float64)
        sub = (torch.ones_like(e) << (e.clamp(-1074, -1023) + 1074)).view(torch.float64)
        return torch.where(e >= -1022, normal, sub)
    e = np.asarray(e, dtype=np.int64)
    normal = ((np.maximum(e, -1022) + 1023) << 52).view(np.float64)
    sub = (np.int64(1) << (np.clip(e, -1074, -1023) + 1074)).view(np.float64)
    return np.where(e >= -1022, normal, sub)


def _is_torch(x) -> bool:
    from ..elementary import is_torch

    return is_torch(x)


def rounded_radius(radius, bits):
    """``r^``: ``radius`` (float64 ``[M, K]``, finite, >= 0) rounded up onto the grid of the module docstring, per
    row and :data:`RADIUS_CHUNK` columns; ``bits``: ``L``, an int or one per row (int64 ``[M]``). NumPy arrays or
    torch tensors (the same operations: a maximum, exponent bits, one exact division, ``ceil``, one exact multiply).

    >>> rounded_radius(np.array([[1.0, 1.0 + 2.0**-30, 0.0, 2.0**-40]]), 20).tolist()
    [[1.0, 1.0000009536743164, 0.0, 9.5367431640625e-07]]
    """
    torch_in = _is_torch(radius)
    m, k = radius.shape
    if m == 0 or k == 0:
        return radius.clone() if torch_in else np.array(radius, dtype=np.float64)
    pad = -k % RADIUS_CHUNK
    if torch_in:
        import torch

        rp = torch.nn.functional.pad(radius, (0, pad)) if pad else radius
        big = rp.reshape(m, -1, RADIUS_CHUNK).amax(dim=2)                           # [M, G]
        e = torch.frexp(big)[1].to(torch.int64) - 1
        lb = bits if isinstance(bits, int) else bits.reshape(m, 1)
        q = pow2_exact((e - lb).clamp(min=-1074))
        q = q.repeat_interleave(RADIUS_CHUNK, dim=1)[:, :k]
        return torch.ceil(radius / q) * q
    rp = np.pad(radius, ((0, 0), (0, pad))) if pad else radius
    big = rp.reshape(m, -1, RADIUS_CHUNK).max(axis=2, initial=0.0)
    e = np.frexp(big)[1].astype(np.int64) - 1
    lb = bits if isinstance(bits, int) else np.asarray(bits, dtype=np.int64).reshape(m, 1)
    q = pow2_exact(np.maximum(e - lb, -1074))
    q = np.repeat(q, RADIUS_CHUNK, axis=1)[:, :k]
    return np.ceil(radius / q) * q


def chunk_scales_constant(k: int, block_k: int, chunk: int) -> bool:
    """Every chunk of ``chunk`` columns of a ``K = k`` operand lies in one scale block of ``block_k`` columns."""
    blk = np.arange(-(-max(k, 1) // chunk)) * chunk
    last = np.minimum(blk + chunk, k) - 1
    return bool(np.array_equal(blk // block_k, last // block_k))


def exact_radius(radius, w):
    """``r^`` (:func:`rounded_radius`) for ``radius`` ``[M, K]`` against ``w`` (a
    :class:`moeref.gemm.exact.BlockOperand` ``[N, K]``), or None where the grid does not apply (module
    docstring): non-finite radius, elements or block scales, block scales not constant over each
    :data:`RADIUS_CHUNK`, or :func:`radius_grid_bits` None."""
    from ..gemm.exact import quantum_and_max

    radius = np.asarray(radius, dtype=np.float64)
    k = radius.shape[1]
    if not (np.all(np.isfinite(radius)) and np.all(np.isfinite(w.scales)) and np.all(np.isfinite(w.values))):
        return None
    if not chunk_scales_constant(k, w.block[1], RADIUS_CHUNK):
        return None
    values = np.asarray(w.values, dtype=np.float64)
    q_few, _ = quantum_and_max(values.reshape(-1)[:256])  # q_w divides these too, so q_w <= q_few
    if values.size and float(np.abs(values).max()) > q_few * 2.0**(45 - MIN_GRID_BITS):
        return None  # m_w / q_w > 2^(45 - MIN_GRID_BITS): fewer than MIN_GRID_BITS bits, without every quantum
    bits = radius_grid_bits(quantum_and_max(values))
    return None if bits is None else rounded_radius(radius, bits)


def chunk_weight_scales(w, k: int) -> np.ndarray:
    """``|scale|`` of each output row's block at each :data:`RADIUS_CHUNK`'s first column, float64 ``[N, G]``."""
    n = w.values.shape[0]
    blk = np.arange(-(-max(k, 1) // RADIUS_CHUNK)) * RADIUS_CHUNK
    return np.abs(w.scales[(np.arange(n) // w.block[0])[:, None], (blk // w.block[1])[None, :]])


def radius_dot(radius, w) -> np.ndarray:
    """``radius @ |W|^T`` (the operand's own uncertainty through the GEMM), float64 ``[M, N]``: with the grid
    (:func:`exact_radius`), per chunk of :data:`RADIUS_CHUNK` columns the exact sum ``sum r^ |w|`` over the
    element values, times the chunk's ``|scale_w|`` (one rounding), chunks added in order; otherwise
    :func:`moeref.compare.summation_order.ordered_dot` of the radius and ``|W|`` (the dequantized weights)."""
    radius = np.asarray(radius, dtype=np.float64)
    m, k = radius.shape
    n = w.values.shape[0]
    r_hat = exact_radius(radius, w) if m and n and k else None
    if r_hat is None:
        return ordered_dot(radius, np.abs(w.dequantize()))
    wv = np.abs(np.asarray(w.values, dtype=np.float64))
    sw = chunk_weight_scales(w, k)
    out = np.zeros((m, n))
    for c in range(sw.shape[1]):  # chunks in order
        cols = slice(c * RADIUS_CHUNK, min((c + 1) * RADIUS_CHUNK, k))
        out = out + (r_hat[:, cols] @ wv[:, cols].T) * sw[None, :, c]   # each chunk's sum exact in any order
    return out
