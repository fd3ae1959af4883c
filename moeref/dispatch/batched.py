"""vLLM's batched-experts layout (``FusedMoEActivationFormat.BatchedExperts``,
``BatchedPrepareAndFinalize``).

* ``a``: ``[E_local, max_tokens_per_dispatcher * num_dispatchers, K]``: a fixed capacity per expert
  (the masked layout with ``max_m`` fixed by the dispatcher configuration); rows past the count are
  **zero** here (garbage in vLLM unless zeroed: PR #39645).
* ``expert_num_tokens``: int32 ``[E_local]`` (vLLM ``ExpertTokensMetadata.expert_num_tokens``).
* ``src``: int64 ``[E_local, capacity]``, the slot ``t*k + j`` of each row, -1 fill.

The reference models one process: ``hidden`` holds the tokens of all ``num_dispatchers``
dispatchers, concatenated in dispatcher order, so ``M <= max_tokens_per_dispatcher * num_dispatchers``.
Within an expert, rows follow the slot order (dispatcher, then token).

The capacity counts rows, one per slot. vLLM sizes it in tokens (``max_num_tokens`` per
dispatcher), which bounds every expert's rows only while a token never picks an expert twice; a
routing that repeats an expert within a token (accepted, :mod:`moeref.routing.ids`) needs a row
per slot, and an expert whose slots exceed the capacity is refused with a ``ValueError`` naming
it and its count (never truncated).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_positive_int
from .grouping import SlotGrouping, group_slots, token_row_source
from .masked import pack_per_expert

__all__ = ["Batched", "batched_from_grouping", "to_batched"]


@dataclass(frozen=True, eq=False)
class Batched:
    """``a [E_local, T, K]`` (zero past the count), ``expert_num_tokens`` int32 ``[E_local]``, ``src``
    int64 ``[E_local, T]`` (-1 fill), with ``T = max_tokens_per_dispatcher * num_dispatchers``."""

    a: np.ndarray | None
    expert_num_tokens: np.ndarray
    src: np.ndarray
    num_tokens: int
    top_k: int
    max_tokens_per_dispatcher: int
    num_dispatchers: int

    @property
    def num_local_experts(self) -> int:
        return int(self.expert_num_tokens.size)


def batched_from_grouping(grouping: SlotGrouping, row_source, max_tokens_per_dispatcher: int, num_dispatchers: int = 1) -> Batched:
    """Batched layout of a grouping (:class:`RowSource` of the rows, or None for indices only)."""
    t = check_positive_int(max_tokens_per_dispatcher, "max_tokens_per_dispatcher")
    d = check_positive_int(num_dispatchers, "num_dispatchers")
    if grouping.num_tokens > t * d:
        raise ValueError(
            f"{grouping.num_tokens} tokens exceed max_tokens_per_dispatcher * num_dispatchers = {t * d}"
        )
    a, src = pack_per_expert(grouping, row_source, t * d)
    return Batched(a, grouping.counts.astype(np.int32), src, grouping.num_tokens, grouping.top_k, t, d)


def to_batched(hidden, topk_ids, num_experts: int, max_tokens_per_dispatcher: int, num_dispatchers: int = 1,
               expert_map=None) -> Batched:
    """Batched layout of ``hidden [M, K]`` (module docstring); ``hidden=None`` for indices only.

    >>> b = to_batched(None, np.array([[1, 0], [1, -1]], dtype=np.int32), 2, max_tokens_per_dispatcher=2)
    >>> b.expert_num_tokens.tolist(), b.src.tolist()
    ([1, 2], [[1, -1], [0, 2]])
    """
    g = group_slots(topk_ids, num_experts, expert_map)
    return batched_from_grouping(g, token_row_source(hidden, g), max_tokens_per_dispatcher, num_dispatchers)
