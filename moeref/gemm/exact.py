"""Exact block-scaled dot products: one engine for every scaling scheme.

Every quantized operand moeref handles (FP8/FP6/FP4 elements, INT8/INT4 codes, with per-tensor,
per-token, per-channel, 1x128, 128x128, MX 1x32 or NVFP4 1x16 scales) is, per element,

    value = element * scale(block of the element)

where ``element`` is a format value (an integer times a power of two) and ``scale`` is a float64
decode multiplier of the element's block (UE8M0, E4M3 or FP32 block scale times any global or
per-channel factor). :class:`BlockOperand` holds exactly that: ``values`` (float64 elements),
``scales`` (float64 block grid) and ``block`` (rows, cols of one block). It is built from a
:class:`moeref.quant.QuantizedTensor` (``element_values()``, ``scale_values()``, ``block_shape``) or
from a plain float array (one block: scale 1).

:func:`block_gemm` computes ``C = A @ B.T`` for ``A [M, K]`` and ``B [N, K]`` as

    C[m, n] = sum_s  ( P_s[m, n] * sa[m, s] ) * sb[n, s],   P_s = sum_{k in segment s} a[m,k] b[n,k]

over the segments ``s`` of the **common refinement** of the two K-blockings: segments of
``g = gcd(bk_A, bk_B)`` columns, so each segment lies inside one block of A and one block of B
(DeepGEMM FP4 experts: activation blocks of 128, weight blocks of 32 -> segments of 32).

Where the result is exact and where it is float64-accurate:

* **Exact**: each partial dot ``P_s``. Elements of one format are integer multiples of a quantum
  ``q`` (E4M3: ``2^-9``, the smallest subnormal) with ``|x| <= max`` (E4M3: 448), so every product is
  a multiple of ``q_a q_b`` below ``max_a max_b`` and every partial sum of ``g`` products is an integer
  times ``q_a q_b`` of at most ``log2(g * max_a max_b / (q_a q_b))`` bits. For E4M3 x E4M3 that is
  ``36 + log2(g)`` bits (``448^2 / 2^-18 < 2^36``), below float64's 53 for ``g <= 2^17``: every
  partial sum, in any summation order (BLAS blocking, FMA), is representable, so ``P_s`` is exact.
  The same holds with more room for E2M1 (``q = 0.5``, max 6: 7 bits + log2 g), INT8 (14 bits),
  INT4 and mixed pairs (FP4 x FP8, INT4 x FP8). :func:`partial_dots_exact` checks the condition
  for given operands from their actual values.
* **float64-accurate**: applying the scales and summing the ``S`` segments. Each term is rounded
  at most twice (two scale multiplications) and the sum adds ``S - 1`` roundings, so
  ``|C - C_exact| <= gamma_{S+2}(2^-53) * sum_s |sa sb P_s|``, i.e. a relative error of a few
  ``1e-16`` of the absolute-value sum (far below any low-precision kernel's error).
* **float64-accurate** also for bf16/fp16/fp32 operands (one block, scale 1): products of two bf16
  are exact in float64 (16-bit significands) and of fp32 too (48 bits), but the sum over K is not:
  ``|C - C_exact| <= gamma_{K}(2^-53) * sum_k |a_k b_k|``.

The K-segment loop is a Python loop over at most ``K / g`` segments, each one BLAS call over all
rows and columns: NumPy's stacked ``matmul`` does not use BLAS efficiently for ``[S, M, g] @ [S, g, N]``
(measured 20x slower at M=4, N=4096, K=7168), and one call over the whole K cannot keep the
per-block partial sums exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _interop
from .._checks import as_float_array, check_ndim

__all__ = ["BlockOperand", "as_operand", "block_gemm", "partial_dots_exact", "quantum_and_max"]


@dataclass(frozen=True, eq=False)
class BlockOperand:
    """A block-scaled 2-D operand ``[R, K]``: ``value[r, k] = values[r, k] * scales[r // br, k // bk]``.

    Attributes:
        values: float64 (or float32 for 8-bit formats, which it holds exactly) ``[R, K]``, the element
            values (format values before scaling; exact). Arithmetic on them is float64.
        scales: float64 ``[ceil(R / br), ceil(K / bk)]``, the decode multiplier of each block.
        block: ``(br, bk)`` with ``1 <= br <= max(R, 1)`` and ``1 <= bk <= max(K, 1)``.
        quantized: True when ``values`` are low-precision format values (partial dots exact, see
            the module docstring); False for bf16/fp16/fp32/float64 input (float64-accurate).
    """

    values: np.ndarray
    scales: np.ndarray
    block: tuple[int, int]
    quantized: bool

    def __post_init__(self):
        v = np.asarray(self.values)
        if v.ndim != 2:
            raise ValueError(f"values must be 2-D [R, K]; got shape {v.shape}")
        br, bk = (int(b) for b in self.block)
        if br < 1 or bk < 1:
            raise ValueError(f"block must be positive; got {self.block}")
        grid = (-(-v.shape[0] // br), -(-v.shape[1] // bk))
        if np.shape(self.scales) != grid and not (0 in v.shape):
            raise ValueError(f"scales have shape {np.shape(self.scales)} but the block grid of {v.shape} "
                             f"with blocks {self.block} is {grid}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> np.ndarray:
        """float64 ``[R, K]``: every element times its block scale."""
        r, k = self.values.shape
        br, bk = self.block
        s = np.repeat(np.repeat(self.scales, br, axis=0)[:r], bk, axis=1)[:, :k]
        return self.values * s

    def abs(self) -> "BlockOperand":
        """``|values|`` with ``|scales|``: the operand whose GEMM gives ``sum |a||b|`` (error bounds)."""
        return BlockOperand(np.abs(self.values), np.abs(self.scales), self.block, self.quantized)

    def take_rows(self, rows) -> "BlockOperand":
        """Rows ``rows`` (int ``[R']``; -1 gives a zero row with scale 1) as an operand with one scale
        row per row (block ``(1, bk)``): gathering never changes a value."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        pad = rows < 0
        safe = np.where(pad, 0, rows)
        if self.values.shape[0] == 0:
            vals = np.zeros((rows.size, self.values.shape[1]))
            sc = np.ones((rows.size, self.scales.shape[1] if self.scales.ndim == 2 else 1))
            return BlockOperand(vals, sc, (1, self.block[1]), self.quantized)
        vals = np.where(pad[:, None], 0.0, self.values[safe])
        sc = np.where(pad[:, None], 1.0, self.scales[safe // self.block[0]])
        return BlockOperand(vals, sc, (1, self.block[1]), self.quantized)


def _resolve_block(block, shape) -> tuple[int, int]:
    block = tuple(int(b) for b in block)
    if len(block) > 2:
        raise ValueError(f"block_shape {block} has more than 2 axes; a GEMM operand is 2-D")
    block = (1,) * (2 - len(block)) + block if len(block) else (shape[0], shape[1])
    r, k = shape
    br = max(1, min(block[0], r)) if block[0] > 0 else max(r, 1)
    bk = max(1, min(block[1], k)) if block[1] > 0 else max(k, 1)
    return br, bk


def _grid_scales(scales, grid: tuple[int, int], name: str) -> np.ndarray:
    s = np.asarray(scales, dtype=np.float64)
    if s.size == 1:
        return np.full(grid, float(s.reshape(-1)[0]))
    if s.size != grid[0] * grid[1]:
        raise ValueError(f"{name} scales have shape {s.shape}, which does not fit the block grid {grid}")
    return s.reshape(grid)


def as_operand(x, name: str = "operand") -> BlockOperand:
    """A :class:`BlockOperand` of ``x``.

    ``x`` may be a :class:`BlockOperand`, a quantized tensor (any object with ``element_values()``,
    ``scale_values()`` and ``block_shape``, i.e. :class:`moeref.quant.QuantizedTensor`) of logical shape
    ``[R, K]`` (or ``[..., R, K]`` when its blocks have one row, flattened to rows), or a floating array
    (NumPy incl. bfloat16, or torch) ``[R, K]``: one block, scale 1, ``quantized=False``.

    >>> op = as_operand(np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32))
    >>> op.block, op.scales.tolist(), op.quantized
    ((2, 2), [[1.0]], False)
    """
    if isinstance(x, BlockOperand):
        return x
    if hasattr(x, "element_values") and hasattr(x, "scale_values"):
        vals = _element_values(x)
        if vals.ndim < 1:
            raise ValueError(f"{name} must have at least 1 dimension; got a scalar")
        block = tuple(int(b) for b in getattr(x, "block_shape", ()))
        scales = np.asarray(x.scale_values(), dtype=np.float64)
        if vals.ndim > 2:
            lead = vals.shape[:-1]
            rows_per_block = block[-2] if len(block) >= 2 else (1 if len(block) == 1 else None)
            if len(block) > 2 and any(b not in (1,) for b in block[:-2]):
                raise ValueError(f"{name} of shape {vals.shape} has blocks {block} spanning leading axes")
            if scales.size == 1:
                return BlockOperand(vals.reshape(-1, vals.shape[-1]), scales.reshape(1, 1),
                                    (max(int(np.prod(lead)), 1), max(vals.shape[-1], 1)), True)
            if rows_per_block != 1:
                raise ValueError(
                    f"{name} of shape {vals.shape} with block {block}: only blocks of one row can be "
                    "flattened to a 2-D operand"
                )
            vals = vals.reshape(-1, vals.shape[-1])
            block = (1, block[-1])
            scales = scales.reshape(vals.shape[0], -1)
        if vals.ndim == 1:
            vals = vals[None, :]
            block = (1,) + block[-1:] if block else ()
        br, bk = _resolve_block(block, vals.shape)
        grid = (-(-vals.shape[0] // br) if vals.shape[0] else 0, -(-vals.shape[1] // bk) if vals.shape[1] else 0)
        return BlockOperand(vals, _grid_scales(scales, grid, name), (br, bk), True)
    a = as_float_array(_interop.to_numpy(x), name)
    check_ndim(a, 2, name)
    a = a.astype(np.float64)
    return BlockOperand(a, np.ones((1, 1)), (max(a.shape[0], 1), max(a.shape[1], 1)), False)


def _element_values(x) -> np.ndarray:
    """Exact element values of a quantized tensor: ``x.element_values()`` (float64), or for unpacked
    8-bit codes without zero points the same :func:`moeref.formats.decode_table` lookup done in one pass
    into float32 (exact: at most 8 significant bits and exponents within float32's range). The weights of
    a large layer are decoded per call; this avoids two full-size float64 temporaries."""
    scheme = getattr(x, "scheme", None)
    codes = getattr(x, "codes", None)
    if (scheme is not None and codes is not None and getattr(x, "zero_points", None) is None
            and not getattr(scheme, "packed", True) and codes.dtype == np.uint8
            and codes.shape == tuple(x.shape)):
        from ..formats import decode_table

        # every value of a format of <= 8 bits is exact in float32: half the memory of float64
        return decode_table(scheme.element).astype(np.float32)[codes]
    return np.asarray(x.element_values(), dtype=np.float64)


def quantum_and_max(values) -> tuple[float, float]:
    """``(q, m)``: the largest power of two dividing every nonzero value, and ``max |value|``.

    Every value is an integer multiple of ``q``; ``(inf, 0.0)`` for an all-zero array.

    >>> quantum_and_max(np.array([448.0, -0.001953125, 0.0]))   # E4M3 max and min subnormal 2^-9
    (0.001953125, 448.0)
    """
    v = np.abs(np.asarray(values, dtype=np.float64)).reshape(-1)
    v = v[v != 0]
    if v.size == 0:
        return math.inf, 0.0
    if not np.all(np.isfinite(v)):
        raise ValueError("values must be finite to have a quantum")
    m, e = np.frexp(v)
    mi = (m * 2.0**53).astype(np.int64)
    low = mi & -mi
    q = np.ldexp(low.astype(np.float64), e - 53)
    return float(q.min()), float(v.max())


def _segment(a: BlockOperand, b: BlockOperand) -> int:
    k = a.values.shape[1]
    return max(1, math.gcd(min(a.block[1], max(k, 1)), min(b.block[1], max(k, 1))))


def partial_dots_exact(a: BlockOperand, b: BlockOperand) -> bool:
    """Whether every partial dot ``P_s`` of :func:`block_gemm` is exact in float64, from the values.

    Condition: ``g * max_a * max_b <= 2^53 * q_a * q_b`` with ``g`` the segment length and ``q``, ``max``
    from :func:`quantum_and_max`: every partial sum is then an integer multiple of ``q_a q_b`` with at
    most 53 bits. Sufficient, not necessary.
    """
    qa, ma = quantum_and_max(a.values)
    qb, mb = quantum_and_max(b.values)
    if ma == 0 or mb == 0:
        return True
    g = _segment(a, b)
    return g * ma * mb <= 2.0**53 * qa * qb


def block_gemm(a, b, *, name_a: str = "a", name_b: str = "b") -> np.ndarray:
    """``C = A @ B.T`` in float64 with exact per-segment partial dots (module docstring).

    Args:
        a: ``[M, K]`` operand (:func:`as_operand` input): activations.
        b: ``[N, K]`` operand: one expert's weights (NT layout, as DeepGEMM and vLLM store them).

    Returns:
        float64 ``[M, N]``.

    >>> a = np.array([[1.0, 2.0, 3.0]]); b = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 2.0]])
    >>> block_gemm(a, b).tolist()
    [[6.0, 6.0]]
    """
    a = as_operand(a, name_a)
    b = as_operand(b, name_b)
    m, k = a.values.shape
    n, kb = b.values.shape
    if k != kb:
        raise ValueError(f"{name_a} has K={k} columns but {name_b} has K={kb}")
    out = np.zeros((m, n), dtype=np.float64)
    if m == 0 or n == 0 or k == 0:
        return out
    g = _segment(a, b)
    bra, bka = a.block
    brb, bkb = b.block
    row_a = np.arange(m) // bra
    row_b = np.arange(n) // brb
    bt = b.values.T  # [K, N] view: BLAS reads it transposed
    for start in range(0, k, g):
        stop = min(start + g, k)
        # float64 products and sums (values may be stored as exact float32)
        p = a.values[:, start:stop].astype(np.float64, copy=False) @ bt[start:stop].astype(np.float64, copy=False)
        sa = a.scales[row_a, start // bka]
        sb = b.scales[row_b, start // bkb]
        p *= sa[:, None]
        p *= sb[None, :]
        out += p
    return out
