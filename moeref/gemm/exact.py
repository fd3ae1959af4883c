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
  ``|C - C_exact| <= gamma_{K}(2^-53) * sum_k |a_k b_k|``. The sum's order is fixed (in ``k`` order,
  per output element), so the result is still a function of the row and the column alone.

How it is computed (two paths, the same float64 result bit for bit):

* **Per-segment loop** (any operand not quantized, where the partial dots are float64-accurate):
  ``P_s`` is the sequential float64 sum of the segment's products in ``k`` order from +0.0 (no BLAS,
  whose rounding depends on how many rows share a call), then ``p *= sa; p *= sb; out += p`` in
  segment order. Each output element's arithmetic is fixed by its own row and column, so a row gives
  the same bits alone, in any batch, in any chunk and on any expert-parallel rank.
* **Blocked** (both operands quantized: every ``P_s`` is exact, so how BLAS sums it cannot matter):
  the same ``p *= sa; p *= sb`` and the same in-order sum from +0.0 per output element, computed
  over blocks of ``B``'s rows and steps of a few segments so that the decoded float64 block of
  ``B`` (a table lookup of its 8-bit codes, :meth:`BlockOperand.read_block`) stays in the L2 cache,
  with one stacked ``matmul`` per step. ``B`` is never decoded whole (a DeepSeek-V3 expert's
  ``w13 + w2`` are 44 M codes, 350 MB as float64), and row blocks are independent, so they run on
  :func:`set_num_threads` threads without changing a bit. Measured on a 2-core Xeon VM (AVX-512,
  OpenBLAS at one thread), one DeepSeek-V3 expert (``w13 [4096, 7168]`` and ``w2 [7168, 2048]``,
  FP8 128x128) at M=4 rows, one thread: 0.18 s decoding the codes whole to float32 and running the
  per-segment loop, 0.055 s blocked from the codes (2/3 of it the table lookup, ~0.9 ns a code).
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import _interop
from .._checks import as_float_array, check_ndim

__all__ = ["BlockOperand", "as_operand", "block_gemm", "get_num_threads", "in_order_sum", "partial_dots_exact",
           "quantum_and_max", "set_num_threads"]


class BlockOperand:
    """A block-scaled 2-D operand ``[R, K]``: ``value[r, k] = values[r, k] * scales[r // br, k // bk]``.

    Attributes:
        values: float64 (or float32 for 8-bit formats, which it holds exactly) ``[R, K]``, the element
            values (format values before scaling; exact). Arithmetic on them is float64. An operand
            built from element codes (``codes=``, ``table=``; what :func:`as_operand` does for unpacked
            8-bit codes) decodes ``values`` on first access only: :func:`block_gemm` reads the codes
            block by block instead, so the weights of a large layer are never decoded whole.
        scales: float64 ``[ceil(R / br), ceil(K / bk)]``, the decode multiplier of each block.
        block: ``(br, bk)`` with ``1 <= br <= max(R, 1)`` and ``1 <= bk <= max(K, 1)``.
        quantized: True when ``values`` are low-precision format values (partial dots exact, see
            the module docstring); False for bf16/fp16/fp32/float64 input (float64-accurate).

    Build it as ``BlockOperand(values, scales, block, quantized)`` or
    ``BlockOperand(None, scales, block, quantized, codes=codes, table=table)`` with ``codes`` uint8
    ``[R, K]`` and ``table`` the float64 value of every code (:func:`moeref.formats.decode_table`):
    ``values = table[codes]``. Immutable.
    """

    __slots__ = ("_values", "_codes", "_table", "scales", "block", "quantized")

    def __init__(self, values, scales, block, quantized, *, codes=None, table=None):
        if values is None:
            if codes is None or table is None:
                raise ValueError("BlockOperand needs values, or codes and table")
            codes = np.asarray(codes)
            if codes.dtype != np.uint8 or codes.ndim != 2:
                raise ValueError(f"codes must be uint8 [R, K]; got {codes.dtype} of shape {codes.shape}")
            table = np.asarray(table, dtype=np.float64)
            if table.ndim != 1 or not 1 <= table.size <= 256:
                raise ValueError(f"table must be 1-D with at most 256 entries; got shape {table.shape}")
            shape = codes.shape
        else:
            if codes is not None or table is not None:
                raise ValueError("give values, or codes and table, not both")
            shape = np.shape(values)
            if len(shape) != 2:
                raise ValueError(f"values must be 2-D [R, K]; got shape {shape}")
        br, bk = (int(b) for b in block)
        if br < 1 or bk < 1:
            raise ValueError(f"block must be positive; got {block}")
        grid = (-(-shape[0] // br), -(-shape[1] // bk))
        if np.shape(scales) != grid and not (0 in shape):
            raise ValueError(f"scales have shape {np.shape(scales)} but the block grid of {tuple(shape)} "
                             f"with blocks {block} is {grid}")
        for name, v in (("_values", values), ("_codes", codes), ("_table", table), ("scales", scales),
                        ("block", block), ("quantized", quantized)):
            object.__setattr__(self, name, v)

    def __setattr__(self, name, value):
        raise AttributeError(f"BlockOperand is immutable; cannot set {name!r}")

    def __reduce__(self):  # pickle / copy through the constructor (attributes cannot be set)
        if self._codes is not None:
            return (_coded_operand, (self._codes, self._table, self.scales, self.block, self.quantized))
        return (BlockOperand, (self._values, self.scales, self.block, self.quantized))

    def __repr__(self) -> str:
        kind = "codes" if self._codes is not None else "values"
        return (f"BlockOperand(shape={self.shape}, block={self.block}, quantized={self.quantized}, "
                f"from {kind})")

    @property
    def values(self) -> np.ndarray:
        if self._values is None:  # decoded once, on first access (exact: see _decode_dtype)
            object.__setattr__(self, "_values", self._table.astype(_decode_dtype(self._table))[self._codes])
        return self._values

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self._codes.shape if self._codes is not None else np.shape(self._values))

    def dequantize(self) -> np.ndarray:
        """float64 ``[R, K]``: every element times its block scale."""
        if self.scales.size == 1:  # one block: the same products, without the expanded scale array
            return self.values * np.float64(self.scales.reshape(-1)[0])
        r, k = self.shape
        br, bk = self.block
        s = np.repeat(np.repeat(self.scales, br, axis=0)[:r], bk, axis=1)[:, :k]
        return self.values * s

    def abs(self) -> "BlockOperand":
        """``|values|`` with ``|scales|``: the operand whose GEMM gives ``sum |a||b|`` (error bounds)."""
        if self._codes is not None and self._values is None:
            return BlockOperand(None, np.abs(self.scales), self.block, self.quantized, codes=self._codes,
                                table=np.abs(self._table))
        return BlockOperand(np.abs(self.values), np.abs(self.scales), self.block, self.quantized)

    def take_rows(self, rows) -> "BlockOperand":
        """Rows ``rows`` (int ``[R']``; -1 gives a zero row with scale 1) as an operand with one scale
        row per row (block ``(1, bk)``): gathering never changes a value."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        pad = rows < 0
        safe = np.where(pad, 0, rows)
        if self.shape[0] == 0:
            vals = np.zeros((rows.size, self.shape[1]))
            sc = np.ones((rows.size, self.scales.shape[1] if self.scales.ndim == 2 else 1))
            return BlockOperand(vals, sc, (1, self.block[1]), self.quantized)
        if self._values is None:  # decode the gathered rows only
            picked = self._table.astype(_decode_dtype(self._table))[self._codes[safe]]
        else:
            picked = self._values[safe]
        vals = np.where(pad[:, None], 0.0, picked)
        sc = np.where(pad[:, None], 1.0, self.scales[safe // self.block[0]])
        return BlockOperand(vals, sc, (1, self.block[1]), self.quantized)

    def read_block(self, rows: slice, cols: slice, out: np.ndarray) -> np.ndarray:
        """Write the element values ``values[rows, cols]`` into ``out`` (float64, that shape) and return it:
        a table lookup of the codes when built from codes (nothing else is decoded), else a copy."""
        if self._values is None:
            # every uint8 code indexes a 256-entry table, so "clip" never clips (and lets NumPy write
            # `out` directly); a shorter table keeps the bounds check
            np.take(self._table, self._codes[rows, cols], out=out, mode="clip" if self._table.size == 256
                    else "raise")
        else:
            np.copyto(out, self._values[rows, cols], casting="unsafe")
        return out


def _coded_operand(codes, table, scales, block, quantized) -> BlockOperand:
    return BlockOperand(None, scales, block, quantized, codes=codes, table=table)


def _decode_dtype(table: np.ndarray):
    """float32 when it holds every table value exactly (formats of <= 8 bits: at most 8 significant
    bits, exponents inside float32's range; half the memory of float64), else float64."""
    with np.errstate(over="ignore"):
        t32 = table.astype(np.float32)
    return np.float32 if np.array_equal(t32.astype(np.float64), table, equal_nan=True) else np.float64


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
        vals, table = _elements(x)  # element values, or codes with their decode table
        if vals.ndim < 1:
            raise ValueError(f"{name} must have at least 1 dimension; got a scalar")
        block = tuple(int(b) for b in getattr(x, "block_shape", ()))
        scales = np.asarray(x.scale_values(), dtype=np.float64)

        def make(v, sc, blk):
            if table is None:
                return BlockOperand(v, sc, blk, True)
            return BlockOperand(None, sc, blk, True, codes=v, table=table)

        if vals.ndim > 2:
            lead = vals.shape[:-1]
            rows_per_block = block[-2] if len(block) >= 2 else (1 if len(block) == 1 else None)
            if len(block) > 2 and any(b not in (1,) for b in block[:-2]):
                raise ValueError(f"{name} of shape {vals.shape} has blocks {block} spanning leading axes")
            if scales.size == 1:
                return make(vals.reshape(-1, vals.shape[-1]), scales.reshape(1, 1),
                            (max(int(np.prod(lead)), 1), max(vals.shape[-1], 1)))
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
        return make(vals, _grid_scales(scales, grid, name), (br, bk))
    a = as_float_array(_interop.to_numpy(x), name)
    check_ndim(a, 2, name)
    a = a.astype(np.float64)
    return BlockOperand(a, np.ones((1, 1)), (max(a.shape[0], 1), max(a.shape[1], 1)), False)


def _elements(x) -> tuple[np.ndarray, np.ndarray | None]:
    """``(codes, table)`` for a quantized tensor of unpacked 8-bit codes without zero points (the
    element values are ``table[codes]``, :func:`moeref.formats.decode_table`; decoded lazily, block by
    block in :func:`block_gemm`), else ``(x.element_values(), None)`` (float64)."""
    scheme = getattr(x, "scheme", None)
    codes = getattr(x, "codes", None)
    if (scheme is not None and codes is not None and getattr(x, "zero_points", None) is None
            and not getattr(scheme, "packed", True) and codes.dtype == np.uint8
            and codes.shape == tuple(x.shape)):
        from ..formats import decode_table

        return codes, decode_table(scheme.element)
    return np.asarray(x.element_values(), dtype=np.float64), None


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
    k = a.shape[1]
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


def in_order_sum(a: BlockOperand, b: BlockOperand) -> bool:
    """Whether :func:`block_gemm` computes this pair as one in-order sum: the per-segment loop over a single
    segment (an operand not quantized, ``K`` columns in one block of each) with every scale 1, so
    ``C[m, n] = +0.0 + P`` with ``P`` the products ``a[m, k] * b[n, k]`` added in ``k`` order from +0.0, every add
    rounded. A sequential float64 sum of the same products in ``k`` order that starts at the first product, with
    or without zero products after the last, differs from ``P`` at most in the sign of a zero: ``+ 0.0`` gives it
    ``C``'s bits."""
    k = a.shape[1]
    return (not (a.quantized and b.quantized) and k >= 1 and _segment(a, b) >= k
            and bool(np.all(a.scales == 1.0)) and bool(np.all(b.scales == 1.0)))


def block_gemm(a, b, *, name_a: str = "a", name_b: str = "b") -> np.ndarray:
    """``C = A @ B.T`` in float64 with exact per-segment partial dots (module docstring).

    Args:
        a: ``[M, K]`` operand (:func:`as_operand` input): activations.
        b: ``[N, K]`` operand: one expert's weights (NT layout, as DeepGEMM and vLLM store them).

    Returns:
        float64 ``[M, N]``: ``C[m, n] = sum_s (P_s[m, n] * sa[m, s]) * sb[n, s]``, the segments added in
        order to a zero start. Quantized x quantized operands take the blocked path (module
        docstring), any other pair the per-segment loop; both give that same float64 value.

    >>> a = np.array([[1.0, 2.0, 3.0]]); b = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 2.0]])
    >>> block_gemm(a, b).tolist()
    [[6.0, 6.0]]
    """
    a = as_operand(a, name_a)
    b = as_operand(b, name_b)
    m, k = a.shape
    n, kb = b.shape
    if k != kb:
        raise ValueError(f"{name_a} has K={k} columns but {name_b} has K={kb}")
    out = np.zeros((m, n), dtype=np.float64)
    if m == 0 or n == 0 or k == 0:
        return out
    g = _segment(a, b)
    if a.quantized and b.quantized:
        _gemm_blocked(a, b, g, out)
    else:
        _gemm_segments(a, b, g, out)
    return out


def _gemm_segments(a: BlockOperand, b: BlockOperand, g: int, out: np.ndarray) -> None:
    """The definition for a pair with a float operand, one segment at a time over all of ``A`` and
    ``B``: ``P_s`` is the sequential float64 sum, in ``k`` order from +0.0, of the products
    ``a[m, k] * b[n, k]`` (each product exact for operands of 26 significand bits or fewer: bf16,
    fp16, fp32 and every low-precision format). The order is fixed per output element, so a row's
    result does not depend on the other rows of the call (a BLAS call's rounding does: one row goes
    through a matrix-vector kernel, two rows through a matrix-matrix one); products and sums are
    separate roundings (no fused multiply-add)."""
    m, k = a.shape
    n = b.shape[0]
    bra, bka = a.block
    brb, bkb = b.block
    row_a = np.arange(m) // bra
    row_b = np.arange(n) // brb
    av = np.asarray(a.values, dtype=np.float64)
    bt = np.ascontiguousarray(np.asarray(b.values, dtype=np.float64).T)  # [K, N]: one row per k
    p = np.empty((m, n))
    prod = np.empty((m, n))
    for start in range(0, k, g):
        stop = min(start + g, k)
        p.fill(0.0)
        for kk in range(start, stop):  # the K-sum in k order (module docstring)
            np.multiply(av[:, kk, None], bt[kk][None, :], out=prod)
            p += prod
        sa = a.scales[row_a, start // bka]
        sb = b.scales[row_b, start // bkb]
        p *= sa[:, None]
        p *= sb[None, :]
        out += p


_STEP_COLS = 512  # K columns (whole segments) per step of the blocked path
_STEP_ELEMS = 1 << 16  # B elements decoded per step: 512 KiB of float64, which stays in L2 with P
_PARTIALS_MAX = 1 << 21  # partial dots held per step and thread (16 MiB of float64)
_PARALLEL_MIN = 1 << 20  # B elements from which one GEMM is spread over threads


def _gemm_blocked(a: BlockOperand, b: BlockOperand, g: int, out: np.ndarray) -> None:
    """The same sum for quantized operands (exact ``P_s``), blocked over rows of ``B`` and steps of
    whole segments: each step decodes ``B[rows, step]`` into a small float64 buffer (a table lookup
    of the codes), computes the step's ``P_s`` with one stacked ``matmul`` (``[c, M, g] @ [c, g, rows]``),
    scales them in float64 (``p *= sa; p *= sb``) and adds them in segment order onto the running sum,
    which starts at +0.0.
    Row blocks are independent (each output column is written by one block), so spreading them over
    threads (:func:`set_num_threads`) cannot change a bit."""
    m, k = a.shape
    n = b.shape[0]
    a64 = np.asarray(a.values, dtype=np.float64)
    starts = np.arange(0, k, g)
    sa = np.ascontiguousarray(a.scales[np.arange(m) // a.block[0]][:, starts // a.block[1]].T)[:, :, None]
    col_b = starts // b.block[1]
    threads = get_num_threads()
    threaded = threads > 1 and n * k >= _PARALLEL_MIN
    # threaded: 4x larger steps (out of L2, but 4x fewer hand-offs of the GIL between the threads'
    # short Python stretches; measured 14% faster on 2 cores, and 15% slower on one thread)
    step_cols, step_elems = (4 * _STEP_COLS, 4 * _STEP_ELEMS) if threaded else (_STEP_COLS, _STEP_ELEMS)
    rows = max(1, step_elems // min(k, max(g, step_cols // g * g)))  # rows of B per block
    # segments per step, fewer where many rows of A would make the partial dots (per x M x rows) large
    per = max(1, min(step_cols // g, _PARTIALS_MAX // (m * rows)))
    full = k // g
    steps = [(s0, min(s0 + per, full), g) for s0 in range(0, full, per)]
    if k % g:  # a last, shorter segment (K not a multiple of g)
        steps.append((full, full + 1, k % g))
    # A as [c, M, width] views per step: BLAS reads them in place (row stride K)
    a_steps = [a64[:, s0 * g:s0 * g + (s1 - s0) * w].reshape(m, s1 - s0, w).transpose(1, 0, 2)
               for s0, s1, w in steps]
    width = min(k, per * g)
    blocks = [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]

    def run(block):
        r0, r1 = block
        nr = r1 - r0
        sb = np.ascontiguousarray(b.scales[np.arange(r0, r1) // b.block[0]][:, col_b].T)  # [S, nr]
        buf = np.empty(nr * width)
        p = np.empty((per, m, nr))  # the step's partial dots
        acc = out[:, r0:r1]  # the running sum, from out's +0.0
        for (s0, s1, w), a_s in zip(steps, a_steps):
            c = s1 - s0
            bb = b.read_block(slice(r0, r1), slice(s0 * g, s0 * g + c * w), buf[:nr * c * w].reshape(nr, c * w))
            part = p[:c]
            np.matmul(a_s, bb.reshape(nr, c, w).transpose(1, 2, 0), out=part)  # exact P_s
            part *= sa[s0:s1]
            part *= sb[s0:s1, None, :]
            for j in range(c):  # segment order
                acc += part[j]

    if threaded and len(blocks) > 1:
        for _ in _pool(threads).map(run, blocks):
            pass
    else:
        for block in blocks:
            run(block)


_NUM_THREADS: int | None = None
_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (threads, pid, pool)
_POOL_LOCK = threading.Lock()


def set_num_threads(n: int | None) -> None:
    """Threads one large quantized :func:`block_gemm` may use (``None``: the ``MOEREF_NUM_THREADS``
    environment variable, else ``os.cpu_count()``). Results do not depend on it, bit for bit. BLAS's own
    threads are separate: with more than one here, run BLAS at one (``OPENBLAS_NUM_THREADS=1``); the
    blocked path's GEMMs are small, below OpenBLAS's threading threshold at few rows."""
    global _NUM_THREADS
    if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
        raise ValueError(f"num_threads must be a positive int or None; got {n!r}")
    _NUM_THREADS = None if n is None else int(n)


def get_num_threads() -> int:
    """The thread count :func:`block_gemm` uses (see :func:`set_num_threads`)."""
    if _NUM_THREADS is not None:
        return _NUM_THREADS
    env = os.environ.get("MOEREF_NUM_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"MOEREF_NUM_THREADS must be a positive integer; got {env!r}")
        return int(env)
    return os.cpu_count() or 1


def _pool(threads: int) -> ThreadPoolExecutor:
    """The shared worker pool, rebuilt for another thread count or in a forked child (whose copy of
    the parent's pool has no threads)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[:2] != (threads, os.getpid()):
            if _POOL is not None and _POOL[1] == os.getpid():
                _POOL[2].shutdown(wait=False)
            _POOL = (threads, os.getpid(), ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moeref-gemm"))
        return _POOL[2]
