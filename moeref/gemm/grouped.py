"""Grouped GEMMs for every dispatch layout, all through one engine (:func:`expert_rows_gemm`).

Each layout of :mod:`moeref.dispatch` says, per row, which local expert the row belongs to (or that it
is padding). The grouped GEMM of any layout is therefore one function: for each local expert ``e``,
``out[rows of e] = block_gemm(a[rows of e], W[e])`` (+ ``bias[e]``), padding rows 0. The layout
wrappers only read the row -> expert map of their layout:

* :func:`grouped_gemm_standard`: token rows ``a [M, K]`` and ``topk_ids [M, k]``; expert ``e`` gets the
  slots ``t*k+j`` with ``topk_ids[t, j] -> e`` (vLLM ``fused_experts`` / ``torch_experts``).
* :func:`grouped_gemm_contiguous`: ``a [M_sum, K]`` and ``m_indices``; rows with ``m_indices == e``,
  -1 padding (DeepGEMM ``m_grouped_*_contiguous``).
* :func:`grouped_gemm_masked`: ``a [E, max_m, K]`` and ``masked_m``; rows ``a[e, :masked_m[e]]``
  (DeepGEMM ``*_masked``, DeepEP low-latency output).
* :func:`grouped_gemm_batched`: ``a [E, T, K]`` and ``expert_num_tokens``; rows
  ``a[e, :expert_num_tokens[e]]`` (vLLM BatchedExperts).

Padding rows of the output are **0** here; kernels leave them unspecified (DeepGEMM, vLLM), so
compare only valid rows. Weights: ``weights[e]`` is expert ``e``'s ``[N, K]`` operand (NT layout) --
a float array ``[E, N, K]``, or a sequence of per-expert quantized tensors / arrays (vLLM quantizes
weights per expert: ``moe_quantize_weights_2d``). Biases: float ``[E, N]``, added in float64 after the
GEMM (vLLM ``torch_experts`` adds ``b_bias1``/``b_bias2`` after the matmul).

Exactness: that of :func:`moeref.gemm.block_gemm` per row; adding the bias is one float64 rounding.
"""
from __future__ import annotations

import numpy as np

from .._checks import as_float_array, as_int_array, check_ndim
from ..dispatch.grouping import group_slots
from .exact import BlockOperand, as_operand, block_gemm
from .stacked import StackedExperts

__all__ = [
    "ExpertOperands",
    "expert_rows_gemm",
    "grouped_gemm_batched",
    "grouped_gemm_contiguous",
    "grouped_gemm_masked",
    "grouped_gemm_standard",
]


class ExpertOperands:
    """Per-expert :class:`BlockOperand` view of ``weights``, built on first use, once per distinct tensor.

    Quantized tensors of 8-bit codes stay codes (:func:`moeref.gemm.as_operand`): the blocked
    :func:`moeref.gemm.block_gemm` decodes them block by block, so a layer of 256 distinct DeepSeek-V3
    experts (11.3 GB of codes) never holds more than a few decoded blocks.

    ``weights``: float array ``[E, N, K]``, a sequence of ``E`` per-expert operands ``[N, K]``, or a
    :class:`moeref.gemm.StackedExperts` (host arrays).
    """

    def __init__(self, weights, name: str = "weights"):
        if isinstance(weights, ExpertOperands):
            self._items, self.name, self._cache = weights._items, weights.name, weights._cache
            return
        self.name = name
        if isinstance(weights, StackedExperts):  # indexing gives a BlockOperand of codes (cached by e)
            self._items = weights
        elif isinstance(weights, (list, tuple)):
            self._items = list(weights)
        else:
            w = as_float_array(weights, name)
            check_ndim(w, 3, name)
            self._items = [w[e] for e in range(w.shape[0])]
        self._cache: dict[int, BlockOperand] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, e: int) -> BlockOperand:
        if not 0 <= e < len(self._items):
            raise ValueError(f"{self.name} has {len(self._items)} experts; expert {e} requested")
        key = e if isinstance(self._items, StackedExperts) else id(self._items[e])
        if key not in self._cache:
            self._cache[key] = as_operand(self._items[e], f"{self.name}[{e}]")
        return self._cache[key]

    def raw(self, e: int):
        return self._items[e]


def check_row_expert(row_expert, num_rows: int, num_experts: int) -> np.ndarray:
    """``row_expert`` (any integer array) as flat int64 after checking it names one expert in
    ``[0, num_experts)`` or ``-1`` (a padding row) for each of the ``num_rows`` rows; ``ValueError``
    naming the first bad entry otherwise. Shared by the host and the device engines."""
    rows = np.asarray(row_expert).reshape(-1).astype(np.int64)
    if rows.size != num_rows:
        raise ValueError(f"row_expert has {rows.size} entries but a has {num_rows} rows")
    bad = np.flatnonzero((rows < -1) | (rows >= num_experts))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"row_expert[{i}] = {int(rows[i])} is out of range [-1, {num_experts})")
    return rows


def _bias(bias, num_experts: int, n: int, name: str):
    if bias is None:
        return None
    b = as_float_array(bias, name).astype(np.float64)
    if b.shape != (num_experts, n):
        raise ValueError(f"{name} must have shape ({num_experts}, {n}); got {b.shape}")
    return b


def expert_rows_gemm(a, row_expert, weights, bias=None, *, abs_values: bool = False, gemm=None) -> np.ndarray:
    """The engine of every layout: ``out[r] = a[r] @ W[row_expert[r]].T (+ bias)``, 0 where -1.

    Args:
        a: operand ``[R, K]`` (quantized tensor, float array or :class:`BlockOperand`).
        row_expert: int ``[R]``, the local expert of each row, -1 for padding rows.
        weights: per-expert ``[N, K]`` operands (:class:`ExpertOperands` input).
        bias: optional float ``[E, N]``.
        abs_values: compute ``|a| @ |W|.T + |bias|`` instead (the magnitude sums of error bounds).
        gemm: the per-expert GEMM ``(a_rows, w) -> [R_e, N]``; :func:`block_gemm` by default (honest
            variants and planted faults of :mod:`moeref.compare.faults` plug in here).

    Returns: float64 ``[R, N]``.
    """
    gemm = block_gemm if gemm is None else gemm
    a = as_operand(a, "a")
    w = ExpertOperands(weights)
    rows = check_row_expert(as_int_array(row_expert, "row_expert"), a.shape[0], len(w))
    if abs_values:
        a = a.abs()
    n = None
    out = None
    for e in np.unique(rows[rows >= 0]).tolist():
        we = w[e].abs() if abs_values else w[e]
        if n is None:
            n = we.shape[0]
            out = np.zeros((rows.size, n))
        idx = np.flatnonzero(rows == e)
        rows_e = a.take_rows(idx)
        if gemm is block_gemm:
            r = block_gemm(rows_e, we, name_a="a", name_b=f"{w.name}[{e}]")
        else:
            r = gemm(rows_e, we)
        out[idx] = r
    if out is None:  # no valid row: the width comes from expert 0
        n = w[0].shape[0] if len(w) else 0
        out = np.zeros((rows.size, n))
    b = _bias(bias, len(w), n, "bias")
    if b is not None:
        valid = rows >= 0
        add = np.abs(b) if abs_values else b
        out[valid] += add[rows[valid]]
    return out


def grouped_gemm_standard(a, weights, topk_ids, num_experts: int, expert_map=None, bias=None,
                          *, abs_values: bool = False) -> np.ndarray:
    """Standard layout: token rows ``a [M, K]`` and ``topk_ids [M, k]`` -> float64 ``[M, k, N]``.

    Slot ``(t, j)`` gets ``a[t] @ W[local(topk_ids[t, j])].T``; slots with id -1 or a non-local expert
    (``expert_map``) are 0 (vLLM ``torch_experts``: "-1 matches no expert").

    >>> w = np.stack([np.eye(2), 2 * np.eye(2)])
    >>> grouped_gemm_standard(np.array([[1.0, 3.0]]), w, np.array([[1, 0]], dtype=np.int32), 2).tolist()
    [[[2.0, 6.0], [1.0, 3.0]]]
    """
    g = group_slots(topk_ids, num_experts, expert_map)
    k = max(g.top_k, 1)
    slots = np.arange(g.num_slots)
    op = as_operand(a, "a")
    if op.shape[0] != g.num_tokens:
        raise ValueError(f"a must have {g.num_tokens} rows (one per token); got {op.shape[0]}")
    rows = op.take_rows(slots // k)
    out = expert_rows_gemm(rows, g.local_ids, weights, bias, abs_values=abs_values)
    return out.reshape(g.num_tokens, g.top_k, -1)


def grouped_gemm_contiguous(a, weights, m_indices, bias=None, *, abs_values: bool = False) -> np.ndarray:
    """DeepGEMM contiguous layout: ``a [M_sum, K]``, ``m_indices`` int ``[M_sum]`` (-1 padding)
    -> float64 ``[M_sum, N]`` (padding rows 0)."""
    return expert_rows_gemm(a, m_indices, weights, bias, abs_values=abs_values)


def _per_expert_rows(counts, max_m: int, name: str) -> np.ndarray:
    c = as_int_array(counts, name).reshape(-1).astype(np.int64)
    bad = np.flatnonzero((c < 0) | (c > max_m))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {int(c[i])} is out of range [0, {max_m}]")
    pos = np.arange(max_m)[None, :]
    return np.where(pos < c[:, None], np.arange(c.size)[:, None], -1).reshape(-1)


def grouped_gemm_masked(a, weights, masked_m, bias=None, *, abs_values: bool = False) -> np.ndarray:
    """DeepGEMM masked layout: ``a [E, max_m, K]``, ``masked_m`` int ``[E]`` -> float64
    ``[E, max_m, N]``; rows ``>= masked_m[e]`` are 0 (unspecified in DeepGEMM). ``a`` may also be given
    as its ``[E * max_m, K]`` rows (a float array, quantized tensor or :class:`BlockOperand`).

    >>> a = np.ones((2, 3, 4)); w = np.stack([np.eye(4), 2 * np.eye(4)])
    >>> grouped_gemm_masked(a, w, np.array([1, 2], dtype=np.int32))[:, :, 0].tolist()
    [[1.0, 0.0, 0.0], [2.0, 2.0, 0.0]]
    """
    if not isinstance(a, BlockOperand) and not hasattr(a, "element_values"):
        arr = as_float_array(a, "a")
        a = arr.reshape(-1, arr.shape[-1]) if arr.ndim == 3 else arr
    op = as_operand(a, "a")
    e = np.asarray(masked_m).size
    if e == 0 or op.shape[0] % e:
        raise ValueError(f"a has {op.shape[0]} rows, not a multiple of the {e} experts of masked_m")
    max_m = op.shape[0] // e
    out = expert_rows_gemm(op, _per_expert_rows(masked_m, max_m, "masked_m"), weights, bias,
                           abs_values=abs_values)
    return out.reshape(e, max_m, -1)


def grouped_gemm_batched(a, weights, expert_num_tokens, bias=None, *, abs_values: bool = False) -> np.ndarray:
    """vLLM BatchedExperts layout: ``a [E, T, K]``, ``expert_num_tokens`` int ``[E]`` -> float64
    ``[E, T, N]``. The same arithmetic as :func:`grouped_gemm_masked` (DeepEP low-latency output)."""
    return grouped_gemm_masked(a, weights, expert_num_tokens, bias, abs_values=abs_values)
