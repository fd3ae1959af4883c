"""DeepGEMM's M-grouped contiguous layout (``m_grouped_fp8_fp4_gemm_{nt,nn}_contiguous``).

Layout (DeepGEMM ``tests/generators.py::generate_m_grouped_contiguous``, ``csrc/apis/gemm.hpp``;
vLLM ``deep_gemm_utils.compute_aligned_M``):

* ``a``: ``[M_sum, K]``, the concatenation of per-expert segments, each padded to a multiple of
  ``alignment``; padding rows are **zero** (DeepGEMM's ``ensure_zero_padding`` / zero-filled BF16
  padding in the current generator).
* ``m_indices`` (DeepGEMM's ``grouped_layout``): int32 ``[M_sum]``, the local expert of each row,
  **-1 for padding rows** (vLLM PR #30494 initializes to -1 so unwritten rows are skipped).
* ``psum`` (the alternative psum layout): int32 ``[E_local]``, cumulative *actual* end offsets: group
  ``g`` starts at ``align(psum[g-1], alignment)`` and ends at ``psum[g]``.
* ``src``: int64 ``[M_sum]``, the slot ``t*k + j`` of each row, -1 for padding (moeref's addition,
  used by :func:`moeref.dispatch.weight_and_reduce` and the conversions).

``alignment`` is any positive integer here. DeepGEMM uses 128 on SM90 (the legacy constant) and, on
SM100, ``get_theoretical_mk_alignment_for_contiguous_layout(expected_m)``: 224 by default, stepping
down by 32 to >= 32, so **not a power of two**; it is a process-global mutable setting there
(``set_mk_alignment_for_contiguous_layout``). Experts with no slot get no rows.

Output rows of padding are unspecified in DeepGEMM; compare only rows with ``m_indices >= 0``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_positive_int
from .grouping import RowSource, SlotGrouping, group_slots, token_row_source

__all__ = ["Contiguous", "contiguous_from_grouping", "contiguous_m_sum", "to_contiguous"]


@dataclass(frozen=True, eq=False)
class Contiguous:
    """``a [M_sum, K]`` (zero padding rows), ``m_indices`` int32 ``[M_sum]`` (-1 padding), ``src``
    int64 ``[M_sum]`` (-1 padding), ``psum`` int32 ``[E_local]``, plus ``alignment``,
    ``num_tokens`` and ``top_k``. ``a`` is None for an indices-only layout."""

    a: np.ndarray | None
    m_indices: np.ndarray
    src: np.ndarray
    psum: np.ndarray
    alignment: int
    num_tokens: int
    top_k: int

    @property
    def num_local_experts(self) -> int:
        return int(self.psum.size)


def contiguous_m_sum(counts, alignment: int, rule: str = "tight", *, num_slots: int | None = None) -> int:
    """Rows of the contiguous buffer.

    ``"tight"``: ``sum_e round_up(cnt_e, alignment)``. ``"worst_case"``: vLLM ``compute_aligned_M``
    without CPU counts, ``round_up(M*k + E_local*(alignment-1), alignment)`` (``num_slots = M*k``).
    """
    counts = np.asarray(counts, dtype=np.int64)
    if rule == "tight":
        return int((-(-counts // alignment) * alignment).sum())
    if rule == "worst_case":
        if num_slots is None:
            raise ValueError("rule='worst_case' needs num_slots (M*k)")
        size = num_slots + counts.size * (alignment - 1)
        return int(-(-size // alignment) * alignment)
    raise ValueError(f"unknown m_sum rule {rule!r}; accepted: 'tight', 'worst_case' or an int")


def contiguous_from_grouping(grouping: SlotGrouping, row_source: RowSource | None, alignment: int,
                             m_sum=None) -> Contiguous:
    """Place a grouping's present slots in the contiguous layout (:class:`RowSource` or None)."""
    alignment = check_positive_int(alignment, "alignment")
    counts = grouping.counts
    tight = contiguous_m_sum(counts, alignment)
    if m_sum is None or m_sum == "tight":
        size = tight
    elif m_sum == "worst_case":
        size = contiguous_m_sum(counts, alignment, "worst_case", num_slots=grouping.num_slots)
    else:
        size = check_positive_int(m_sum, "m_sum", allow_zero=True)
        if size < tight:
            raise ValueError(f"m_sum={size} is smaller than the rows the routing needs ({tight})")
    padded = -(-counts // alignment) * alignment
    starts = (np.cumsum(padded) - padded).astype(np.int64)  # exclusive prefix sum
    rows = np.repeat(starts, counts) + grouping.rank_in_expert
    order = grouping.present_order
    m_indices = np.full(size, -1, dtype=np.int32)
    m_indices[rows] = grouping.present_experts
    src = np.full(size, -1, dtype=np.int64)
    src[rows] = order
    a = None if row_source is None else row_source.gather(src)
    psum = (starts + counts).astype(np.int32)
    return Contiguous(a, m_indices, src, psum, alignment, grouping.num_tokens, grouping.top_k)


def to_contiguous(hidden, topk_ids, num_experts: int, alignment: int, expert_map=None, *, m_sum=None) -> Contiguous:
    """DeepGEMM contiguous layout of ``hidden [M, K]`` for a routing (module docstring).

    ``m_sum``: None/"tight" (default), "worst_case" (vLLM's buffer) or an explicit row count; rows
    past the tight size are padding. ``hidden=None`` builds the indices only.

    >>> ids = np.array([[0, 2], [2, -1], [0, 2]], dtype=np.int32)
    >>> c = to_contiguous(None, ids, 3, alignment=4)
    >>> c.m_indices.tolist()
    [0, 0, -1, -1, 2, 2, 2, -1]
    >>> c.src.tolist(), c.psum.tolist()
    ([0, 4, -1, -1, 1, 2, 5, -1], [2, 4, 7])
    """
    g = group_slots(topk_ids, num_experts, expert_map)
    return contiguous_from_grouping(g, token_row_source(hidden, g), alignment, m_sum)
