"""vLLM ``moe_permute`` / ``moe_unpermute`` (the unpadded permuted layout, CUTLASS/TRT-LLM style).

Contract (golden ``torch_permute``/``torch_unpermute`` of vLLM
``tests/kernels/moe/test_moe_permute_unpermute.py@00606a9``):

* ``expert_first_token_offset``: int64 ``[E_local+1]``, exclusive prefix sum of per-local-expert slot
  counts, **no padding**. Rows ``[offset[e], offset[e+1])`` of the permuted tensor belong to local
  expert ``e``.
* ``permuted_idx`` (dst -> src): int32 ``[M*k]``; row ``r < offset[-1]`` came from slot
  ``src = t*k + j``; rows ``>= offset[-1]`` hold the sentinel ``M*k``.
* ``inv_permuted_idx`` (src -> dst): int32 ``[M*k]``, the inverse permutation of the full stable sort;
  padding (-1) and non-local slots map to a row ``>= offset[-1]`` (exact value: non-local slots by
  global id, then padding slots, each in ``src`` order, the golden's order; vLLM's own test pins only
  ``>= offset[-1]``).
* ``hidden``: ``[M*k, K]``, row ``r`` = ``hidden[permuted_idx[r] // k]``; rows ``>= offset[-1]`` are
  **zero** here (unspecified in kernels).
* unpermute: ``out[t] = sum_j w[t, j] * permuted[inv[t*k + j]]`` over present slots only; absent slots
  contribute 0. Accumulates in float64 in slot order ``j = 0..k-1``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_float_array, as_int_array, check_ndim
from .finalize import reduce_slot_rows
from .grouping import RowSource, SlotGrouping, group_slots, token_row_source

__all__ = ["Permuted", "expert_first_token_offset", "moe_permute", "moe_unpermute"]


@dataclass(frozen=True, eq=False)
class Permuted:
    """Result of :func:`moe_permute` (fields: module docstring). ``hidden`` is None when
    :func:`moe_permute` was called with ``hidden=None`` (indices only)."""

    hidden: np.ndarray | None
    expert_first_token_offset: np.ndarray
    permuted_idx: np.ndarray
    inv_permuted_idx: np.ndarray
    num_tokens: int
    top_k: int

    @property
    def num_local_experts(self) -> int:
        return int(self.expert_first_token_offset.size - 1)

    @property
    def src(self) -> np.ndarray:
        """int64 ``[M*k]``: source slot of each row, -1 for rows ``>= offset[-1]``."""
        s = self.permuted_idx.astype(np.int64)
        return np.where(s < self.num_tokens * self.top_k, s, -1)


def expert_first_token_offset(topk_ids, num_local_experts: int, expert_map=None, *, num_experts=None) -> np.ndarray:
    """int64 ``[E_local+1]`` offsets of the permuted layout (no padding).

    Without ``expert_map`` every expert is local and ``num_local_experts`` is the number of experts.
    With one, pass ``num_experts`` (global) if it differs from ``len(expert_map)`` (it never does for
    a valid map) and ``num_local_experts`` must match the map.

    >>> expert_first_token_offset(np.array([[1, 0], [1, -1]], dtype=np.int32), 3).tolist()
    [0, 1, 3, 3]
    """
    if expert_map is None:
        g = group_slots(topk_ids, num_local_experts)
    else:
        n_global = int(np.asarray(expert_map).shape[0]) if num_experts is None else num_experts
        g = group_slots(topk_ids, n_global, expert_map)
        if g.num_local_experts != num_local_experts:
            raise ValueError(
                f"num_local_experts={num_local_experts} but expert_map has {g.num_local_experts} local experts"
            )
    return g.offsets


def permute_from_grouping(grouping: SlotGrouping, row_source: RowSource | None) -> Permuted:
    """Build :class:`Permuted` from a grouping and a :class:`RowSource` (None: indices only)."""
    n_slots = grouping.num_slots
    order = grouping.order
    n_present = grouping.num_present
    permuted_idx = order.astype(np.int32)
    permuted_idx[n_present:] = n_slots
    inv = np.empty(n_slots, dtype=np.int32)
    inv[order] = np.arange(n_slots, dtype=np.int32)
    hidden = None
    if row_source is not None:
        src = order.copy()
        src[n_present:] = -1
        hidden = row_source.gather(src)
    return Permuted(hidden, grouping.offsets, permuted_idx, inv, grouping.num_tokens, grouping.top_k)


def moe_permute(hidden, topk_ids, num_experts: int, expert_map=None) -> Permuted:
    """Group each token's rows by local expert, unpadded (vLLM ``moe_permute``; contract: module
    docstring). ``hidden``: ``[M, K]`` rows of any numeric dtype (activations, fp8 codes, or their
    scales: call again with the scales to permute them the same way), or None for indices only.

    >>> ids = np.array([[1, 0], [0, -1]], dtype=np.int32)
    >>> p = moe_permute(np.array([[10.0], [20.0]]), ids, 2)
    >>> p.expert_first_token_offset.tolist(), p.permuted_idx.tolist(), p.inv_permuted_idx.tolist()
    ([0, 2, 3], [1, 2, 0, 4], [2, 0, 1, 3])
    >>> p.hidden[:, 0].tolist()
    [10.0, 20.0, 10.0, 0.0]
    """
    g = group_slots(topk_ids, num_experts, expert_map)
    return permute_from_grouping(g, token_row_source(hidden, g))


def moe_unpermute(permuted_out, topk_weights, inv_permuted_idx, expert_first_token_offset, *, out_dtype=np.float32) -> np.ndarray:
    """Weight and reduce permuted expert outputs back to tokens: ``[M, K]`` (module docstring).

    ``permuted_out``: float ``[R, K]`` with ``R >= offset[-1]``; ``topk_weights``: float ``[M, k]``;
    ``inv_permuted_idx``: int ``[M*k]`` (src -> dst); ``expert_first_token_offset``: int ``[E_local+1]``.
    Slots whose destination is ``>= offset[-1]`` (padding, non-local) contribute exactly 0, whatever
    the rows there hold (NaN included). Accumulation is float64, then cast to ``out_dtype``.
    """
    y = as_float_array(permuted_out, "permuted_out")
    check_ndim(y, 2, "permuted_out")
    w = as_float_array(topk_weights, "topk_weights")
    check_ndim(w, 2, "topk_weights")
    m, k = w.shape
    inv = as_int_array(inv_permuted_idx, "inv_permuted_idx").reshape(-1)
    off = as_int_array(expert_first_token_offset, "expert_first_token_offset")
    check_ndim(off, 1, "expert_first_token_offset")
    if inv.size != m * k:
        raise ValueError(f"inv_permuted_idx must have M*k = {m * k} entries; got {inv.size}")
    n_valid = int(off[-1])
    if n_valid > y.shape[0]:
        raise ValueError(f"permuted_out has {y.shape[0]} rows but expert_first_token_offset[-1] = {n_valid}")
    present = (inv >= 0) & (inv < n_valid)
    rows = np.zeros((m * k, y.shape[1]), dtype=np.float64)
    rows[present] = y[inv[present]].astype(np.float64)
    return reduce_slot_rows(rows, w, out_dtype=out_dtype)
