"""DeepGEMM's masked layout (``m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, expected_m)``),
which is also DeepEP's low-latency dispatch output.

Layout (DeepGEMM ``csrc/apis/gemm.hpp``, ``tests/test_fp8_fp4.py``; DeepEP
``deep_ep/buffers/legacy.py::low_latency_dispatch``):

* ``a``: ``[E_local, max_m, K]``; expert ``e``'s rows are ``a[e, :masked_m[e]]``; rows past
  ``masked_m[e]`` are **zero** here (unspecified in kernels: compare ``d[e, :masked_m[e]]`` only).
* ``masked_m``: int32 ``[E_local]``, valid rows per expert (0 allowed: empty experts exist in real
  routings, although DeepGEMM's generator never makes one).
* ``expected_m``: a positive int scheduling hint (``DG_HOST_ASSERT(expected_m > 0)``); moeref sets
  ``max(1, ceil(present slots / E_local))``. Any positive value gives the same result.
* ``src``: int64 ``[E_local, max_m]``, the slot ``t*k + j`` of each row, -1 for unused rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_positive_int
from .grouping import RowSource, SlotGrouping, group_slots, token_row_source

__all__ = ["Masked", "masked_from_grouping", "pack_per_expert", "to_masked"]


@dataclass(frozen=True, eq=False)
class Masked:
    """``a [E_local, max_m, K]`` (zero past ``masked_m``), ``masked_m`` int32 ``[E_local]``,
    ``expected_m`` (int > 0), ``src`` int64 ``[E_local, max_m]`` (-1 fill), ``num_tokens``, ``top_k``."""

    a: np.ndarray | None
    masked_m: np.ndarray
    expected_m: int
    src: np.ndarray
    num_tokens: int
    top_k: int

    @property
    def num_local_experts(self) -> int:
        return int(self.masked_m.size)

    @property
    def max_m(self) -> int:
        return int(self.src.shape[1])


def pack_per_expert(grouping: SlotGrouping, row_source: RowSource | None, capacity: int):
    """Rows per expert in a ``[E_local, capacity, ...]`` buffer: returns ``(a or None, src)``.

    Shared by the masked and batched layouts. ``ValueError`` names the first expert whose count
    exceeds ``capacity``.
    """
    counts = grouping.counts
    over = np.flatnonzero(counts > capacity)
    if over.size:
        e = int(over[0])
        raise ValueError(f"local expert {e} has {int(counts[e])} rows, more than the capacity {capacity}")
    n_local = grouping.num_local_experts
    order = grouping.present_order
    experts = grouping.present_experts
    ranks = grouping.rank_in_expert
    src = np.full((n_local, capacity), -1, dtype=np.int64)
    src[experts, ranks] = order
    a = None if row_source is None else row_source.gather(src)
    return a, src


def masked_from_grouping(grouping: SlotGrouping, row_source, max_m=None) -> Masked:
    """Masked layout of a grouping (:class:`RowSource` or None)."""
    counts = grouping.counts
    need = int(counts.max()) if counts.size else 0
    if max_m is None:
        max_m = max(1, need)
    max_m = check_positive_int(max_m, "max_m")
    a, src = pack_per_expert(grouping, row_source, max_m)
    n_local = grouping.num_local_experts
    expected_m = max(1, -(-grouping.num_present // n_local)) if n_local else 1
    return Masked(a, counts.astype(np.int32), int(expected_m), src, grouping.num_tokens, grouping.top_k)


def to_masked(hidden, topk_ids, num_experts: int, max_m=None, expert_map=None) -> Masked:
    """Masked layout of ``hidden [M, K]`` (module docstring); ``max_m`` defaults to the largest
    expert count (at least 1). ``hidden=None`` builds the indices only.

    >>> m = to_masked(None, np.array([[0, 2], [2, -1], [0, 2]], dtype=np.int32), 3)
    >>> m.masked_m.tolist(), m.expected_m, m.src.tolist()
    ([2, 0, 3], 2, [[0, 4, -1], [-1, -1, -1], [1, 2, 5]])
    """
    g = group_slots(topk_ids, num_experts, expert_map)
    return masked_from_grouping(g, token_row_source(hidden, g), max_m)
