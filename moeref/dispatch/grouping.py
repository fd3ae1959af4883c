"""The one sort every dispatch layout is built from: (token, slot) pairs grouped by local expert.

A *slot* is one (token ``t``, position ``j``) of ``topk_ids [M, k]``; its flat index is
``src = t*k + j`` (vLLM's "token_expert_indices", TRT-LLM's "expandedIdx"). :func:`group_slots`
validates the ids, maps them to local experts with the ``expert_map`` and sorts the slots by
``(local expert, src)`` with one stable sort. Every layout (align-block-size, permute, contiguous,
masked, batched, CUTLASS FP4) places rows from this order, so they agree by construction.

Order within an expert: ascending ``src`` (token order). Kernels often use atomics, so their order
within an expert is unspecified; compare per expert as a multiset of ``src``
(:func:`rows_by_expert` gives the reference's multisets).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_ndim
from ..routing.expert_map import check_expert_map, to_local_ids
from ..routing.ids import check_topk_ids

__all__ = ["RowSource", "SlotGrouping", "check_rows", "group_slots", "rows_by_expert", "token_row_source"]


@dataclass(frozen=True, eq=False)
class SlotGrouping:
    """Slots grouped by local expert.

    ``local_ids``: int64 ``[M*k]``, the local expert of each slot, ``-1`` for padding slots and
    non-local experts ("absent" slots). ``order``: int64 ``[M*k]``, all slots sorted: present slots by
    ``(local expert, src)`` first, then absent slots (non-local by global id, then padding, each in
    ``src`` order: the order of vLLM's ``torch_permute`` golden). ``counts``: int64 ``[E_local]``.
    """

    num_tokens: int
    top_k: int
    num_local_experts: int
    local_ids: np.ndarray
    order: np.ndarray
    counts: np.ndarray

    @property
    def num_slots(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def num_present(self) -> int:
        return int(self.counts.sum())

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[E_local+1]``: exclusive prefix sum of ``counts`` (no padding)."""
        return np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    @property
    def present_order(self) -> np.ndarray:
        """int64 ``[num_present]``: the present slots, grouped by expert."""
        return self.order[: self.num_present]

    @property
    def present_experts(self) -> np.ndarray:
        """int64 ``[num_present]``: the local expert of each entry of :attr:`present_order`."""
        return np.repeat(np.arange(self.num_local_experts, dtype=np.int64), self.counts)

    @property
    def rank_in_expert(self) -> np.ndarray:
        """int64 ``[num_present]``: position of each present slot within its expert's run."""
        return np.arange(self.num_present, dtype=np.int64) - np.repeat(self.offsets[:-1], self.counts)

    @classmethod
    def from_local_ids(cls, local_ids, num_tokens: int, top_k: int, num_local_experts: int,
                       absent_key=None) -> "SlotGrouping":
        """Group already-validated local ids (int ``[M*k]``, -1 = absent). ``absent_key``: optional
        int64 ``[M*k]`` ordering the absent slots (default: ``src`` order)."""
        local = np.asarray(local_ids, dtype=np.int64).reshape(-1)
        present = local >= 0
        key = np.where(present, local, num_local_experts)
        if absent_key is not None:
            key = np.where(present, key, num_local_experts + np.asarray(absent_key, dtype=np.int64))
        order = np.argsort(key, kind="stable").astype(np.int64)
        counts = np.bincount(local[present], minlength=num_local_experts).astype(np.int64)
        return cls(int(num_tokens), int(top_k), int(num_local_experts), local, order, counts)


def group_slots(topk_ids, num_experts: int, expert_map=None) -> SlotGrouping:
    """Validate ``topk_ids`` (int32/int64 ``[M, k]``, ids in ``[0, num_experts)`` or -1; an expert
    repeated within a row is two slots, two rows of its group, :mod:`moeref.routing.ids`) and
    ``expert_map`` (length ``num_experts``), and group the slots by local expert.

    >>> g = group_slots(np.array([[2, 0], [0, 1]], dtype=np.int32), 3)
    >>> g.order.tolist(), g.counts.tolist()
    ([1, 2, 3, 0], [2, 1, 1])
    """
    ids = check_topk_ids(topk_ids, num_experts)
    m, k = ids.shape
    if expert_map is None:
        n_local = int(num_experts)
        local = ids.astype(np.int64).reshape(-1)
        absent_key = None
    else:
        emap, n_local = check_expert_map(expert_map, num_experts)
        local = to_local_ids(ids, emap).reshape(-1)
        flat = ids.astype(np.int64).reshape(-1)
        absent_key = np.where(flat >= 0, flat, int(num_experts))  # non-local by global id, padding last
    return SlotGrouping.from_local_ids(local, m, k, n_local, absent_key)


def check_rows(x, num_rows: int, name: str = "hidden") -> np.ndarray:
    """Rows to move: a 2-D array ``[num_rows, K]`` of any real numeric dtype (bf16/fp16/fp32, fp8, or
    packed integer codes and scales: layouts move rows without looking at them)."""
    from .. import _interop

    x = np.asarray(_interop.to_numpy(x))
    check_ndim(x, 2, name)
    if x.dtype.kind in "OSUcMmb":
        raise TypeError(f"{name} must be a numeric array; got dtype {x.dtype}")
    if x.shape[0] != num_rows:
        raise ValueError(f"{name} must have {num_rows} rows (one per token); got shape {x.shape}")
    return x


def rows_by_expert(grouping: SlotGrouping) -> list[np.ndarray]:
    """Per local expert, the sorted ``src`` of its slots (the multiset a kernel must reproduce)."""
    if grouping.num_local_experts == 0:
        return []
    runs = np.split(grouping.present_order, np.cumsum(grouping.counts)[:-1])
    return [np.sort(r) for r in runs]


@dataclass(frozen=True, eq=False)
class RowSource:
    """Where the row of slot ``s`` lives: ``values[s // slots_per_row]``.

    Token rows (``hidden [M, K]``: every slot of a token carries the token's row) use
    ``slots_per_row = k``; per-slot rows (``[M*k, K]``, e.g. expert outputs) use 1.
    """

    values: np.ndarray
    slots_per_row: int

    def gather(self, src) -> np.ndarray:
        """Rows for an int array of slots (any shape; ``-1`` gives a zero row): shape
        ``src.shape + values.shape[1:]``, dtype of ``values``. One gather into one new buffer."""
        src = np.asarray(src, dtype=np.int64)
        if self.values.shape[0] == 0:
            return np.zeros(src.shape + self.values.shape[1:], dtype=self.values.dtype)
        out = self.values[np.where(src >= 0, src // self.slots_per_row, 0)]
        out[src < 0] = 0
        return out


def token_row_source(hidden, grouping: SlotGrouping):
    """:class:`RowSource` of token rows ``hidden [M, K]`` (checked), or None when ``hidden`` is None
    (indices-only layouts)."""
    if hidden is None:
        return None
    return RowSource(check_rows(hidden, grouping.num_tokens), max(grouping.top_k, 1))
