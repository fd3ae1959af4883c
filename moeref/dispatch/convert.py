"""Exact conversions between dispatch layouts, through per-slot rows.

Every layout records the slot ``src = t*k + j`` of each row, and its grouping fixes the local expert
of each row. :func:`to_slot_rows` turns any layout into :class:`SlotRows` (one row per slot, zero for
absent slots, plus each slot's local expert); :func:`from_slot_rows` builds any layout from that.
Nothing is recomputed from values, so a conversion moves rows without changing a bit
(``property_tests/test_dispatch_props.py`` checks every pair).

Absent slots (padding, non-local) carry no row. Where a layout orders them (the tail of
``Permuted.inv_permuted_idx``), a converted layout uses slot order, which may differ from the order
:func:`moeref.dispatch.moe_permute` gives with an ``expert_map`` (both are ``>= offset[-1]``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_choice
from .batched import Batched, batched_from_grouping
from .contiguous import Contiguous, contiguous_from_grouping
from .grouping import RowSource, SlotGrouping
from .masked import Masked, masked_from_grouping
from .permute import Permuted, permute_from_grouping

__all__ = [
    "LAYOUTS",
    "SlotRows",
    "batched_to_masked",
    "contiguous_to_masked",
    "contiguous_to_permuted",
    "convert",
    "from_slot_rows",
    "masked_to_batched",
    "masked_to_contiguous",
    "permuted_to_contiguous",
    "to_slot_rows",
]

LAYOUTS = ("permuted", "contiguous", "masked", "batched")


@dataclass(frozen=True, eq=False)
class SlotRows:
    """``rows``: ``[M*k, K]`` (row of slot ``t*k + j``; zero for absent slots) or None for
    indices-only layouts; ``local_ids``: int64 ``[M*k]``, -1 for absent slots."""

    rows: np.ndarray | None
    local_ids: np.ndarray
    num_tokens: int
    top_k: int
    num_local_experts: int

    def grouping(self) -> SlotGrouping:
        return SlotGrouping.from_local_ids(self.local_ids, self.num_tokens, self.top_k, self.num_local_experts)


def _rows_and_experts(layout):
    """(data rows [R, K] or None, src [R], local expert [R]) of a layout's occupied rows."""
    if isinstance(layout, Permuted):
        off = layout.expert_first_token_offset.astype(np.int64)
        n = int(off[-1])
        expert = np.repeat(np.arange(off.size - 1, dtype=np.int64), np.diff(off))
        data = None if layout.hidden is None else layout.hidden[:n]
        return data, layout.permuted_idx[:n].astype(np.int64), expert, off.size - 1
    if isinstance(layout, Contiguous):
        valid = layout.m_indices >= 0
        data = None if layout.a is None else layout.a[valid]
        return data, layout.src[valid], layout.m_indices[valid].astype(np.int64), layout.num_local_experts
    if isinstance(layout, (Masked, Batched)):
        valid = layout.src >= 0
        expert = np.broadcast_to(np.arange(layout.src.shape[0])[:, None], layout.src.shape)[valid]
        data = None if layout.a is None else layout.a[valid]
        return data, layout.src[valid], expert.astype(np.int64), layout.num_local_experts
    raise TypeError(f"layout must be Permuted, Contiguous, Masked or Batched; got {type(layout).__name__}")


def to_slot_rows(layout) -> SlotRows:
    """Per-slot rows of any layout (module docstring)."""
    data, src, expert, n_local = _rows_and_experts(layout)
    n_slots = layout.num_tokens * layout.top_k
    local = np.full(n_slots, -1, dtype=np.int64)
    local[src] = expert
    rows = None
    if data is not None:
        rows = np.zeros((n_slots,) + data.shape[1:], dtype=data.dtype)
        rows[src] = data
    return SlotRows(rows, local, layout.num_tokens, layout.top_k, int(n_local))


def from_slot_rows(slot_rows: SlotRows, target: str, **params):
    """Build layout ``target`` (one of :data:`LAYOUTS`) from per-slot rows.

    Parameters by target: ``contiguous``: ``alignment`` (required), ``m_sum``; ``masked``:
    ``max_m``; ``batched``: ``max_tokens_per_dispatcher`` (required), ``num_dispatchers``.
    """
    check_choice(target, LAYOUTS, "target")
    g = slot_rows.grouping()
    rows = slot_rows.rows
    source = None if rows is None else RowSource(rows, 1)
    if target == "permuted":
        _no_params(target, params, ())
        return permute_from_grouping(g, source)
    if target == "contiguous":
        _no_params(target, params, ("alignment", "m_sum"))
        if "alignment" not in params:
            raise ValueError("target 'contiguous' needs alignment")
        return contiguous_from_grouping(g, source, params["alignment"], params.get("m_sum"))
    if target == "masked":
        _no_params(target, params, ("max_m",))
        return masked_from_grouping(g, source, params.get("max_m"))
    _no_params(target, params, ("max_tokens_per_dispatcher", "num_dispatchers"))
    if "max_tokens_per_dispatcher" not in params:
        raise ValueError("target 'batched' needs max_tokens_per_dispatcher")
    return batched_from_grouping(g, source, params["max_tokens_per_dispatcher"], params.get("num_dispatchers", 1))


def _no_params(target, params, allowed):
    extra = sorted(set(params) - set(allowed))
    if extra:
        raise ValueError(f"target {target!r} does not take {extra}; it takes {list(allowed)}")


def convert(layout, target: str, **params):
    """Convert any layout to ``target`` without changing a row (``from_slot_rows(to_slot_rows(layout))``)."""
    return from_slot_rows(to_slot_rows(layout), target, **params)


def contiguous_to_masked(c: Contiguous, max_m=None) -> Masked:
    return convert(c, "masked", max_m=max_m)


def masked_to_contiguous(m: Masked, alignment: int, m_sum=None) -> Contiguous:
    return convert(m, "contiguous", alignment=alignment, m_sum=m_sum)


def permuted_to_contiguous(p: Permuted, alignment: int, m_sum=None) -> Contiguous:
    return convert(p, "contiguous", alignment=alignment, m_sum=m_sum)


def contiguous_to_permuted(c: Contiguous) -> Permuted:
    return convert(c, "permuted")


def masked_to_batched(m: Masked, max_tokens_per_dispatcher: int, num_dispatchers: int = 1) -> Batched:
    return convert(m, "batched", max_tokens_per_dispatcher=max_tokens_per_dispatcher, num_dispatchers=num_dispatchers)


def batched_to_masked(b: Batched, max_m=None) -> Masked:
    return convert(b, "masked", max_m=max_m)
