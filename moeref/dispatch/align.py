"""vLLM ``moe_align_block_size`` and ``batched_moe_align_block_size`` (the fused_moe Triton layout).

Contract (vLLM ``fused_moe/moe_align_block_size.py`` and ``csrc/moe/moe_align_sum_kernels.cu``, current
code; golden ``tests/kernels/moe/test_moe_align_block_size.py``):

* ``sorted_token_ids``: int32 ``[max_num_tokens_padded]`` of flat slot indices ``t*k + j``, grouped by
  expert in ascending expert order, each expert's run padded to a multiple of ``block_size`` with the
  sentinel ``M*k`` (``topk_ids.numel()``); everything after the last run is the sentinel too.
  Sizing: ``max = M*k + E*(block_size-1)``; rounded up to ``block_size`` if ``pad_sorted_ids``; and if
  ``M*k < E``, ``max = min(M*k*block_size, max)`` (``E`` = the ``num_experts`` argument).
* ``expert_ids``: int32 ``[cdiv(max, block_size)]``, the expert of each block; **-1 for every unused
  block** (old vLLM zero-filled them, so the tail looked like expert 0). Only the first
  ``num_tokens_post_padded / block_size`` blocks are meaningful.
* ``num_tokens_post_padded``: int32 ``[1] = sum_e ceil(cnt_e / block_size) * block_size``; experts with
  no slot get no block.
* ``expert_map`` with ``ignore_invalid_experts=False``: blocks are laid out for *global* experts and
  then labelled ``expert_map[expert]``, so blocks of non-local experts carry -1 (the GEMM writes zeros
  for them). With ``ignore_invalid_experts=True`` (vLLM PR #29642) non-local slots get no block at all
  and blocks are laid out by local id. Unused tail blocks are -1 in both cases. (vLLM indexes
  ``expert_map[expert_ids]`` in torch after the kernel has written -1 into the tail, and torch reads
  ``expert_map[-1]`` = the last entry there; that only touches blocks past ``num_tokens_post_padded``.)
* Padding slots (``-1``) are skipped: they are not counted and appear nowhere.
* Within an expert, moeref lists slots in ascending ``t*k+j``; kernels use atomics and their order is
  unspecified (the golden compares per-expert multisets).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_int_array, check_ndim, check_positive_int, first_bad_index
from ..routing.expert_map import check_expert_map
from .grouping import SlotGrouping, group_slots

__all__ = [
    "AlignResult",
    "batched_moe_align_block_size",
    "max_num_tokens_padded",
    "moe_align_block_size",
]


@dataclass(frozen=True, eq=False)
class AlignResult:
    """``sorted_token_ids`` int32 ``[max_padded]`` (sentinel ``M*k``), ``expert_ids`` int32
    ``[cdiv(max_padded, block_size)]`` (-1 for unused/non-local blocks), ``num_tokens_post_padded``
    int32 ``[1]``. ``sentinel`` and ``block_size`` are kept for convenience."""

    sorted_token_ids: np.ndarray
    expert_ids: np.ndarray
    num_tokens_post_padded: np.ndarray
    sentinel: int
    block_size: int

    def __iter__(self):  # allows ``sorted_ids, expert_ids, n = moe_align_block_size(...)``
        return iter((self.sorted_token_ids, self.expert_ids, self.num_tokens_post_padded))

    @property
    def num_valid_blocks(self) -> int:
        return int(self.num_tokens_post_padded[0]) // self.block_size


def max_num_tokens_padded(numel: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """vLLM's buffer size for ``sorted_token_ids`` (see the module docstring)."""
    size = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        size = -(-size // block_size) * block_size
    if numel < num_experts:
        size = min(numel * block_size, size)
    return size


def _blocks_from_counts(counts: np.ndarray, block_size: int):
    padded = -(-counts // block_size) * block_size
    starts = (np.cumsum(padded) - padded).astype(np.int64)  # exclusive prefix sum
    block_expert = np.repeat(np.arange(counts.size, dtype=np.int64), padded // block_size)
    return padded, starts, block_expert


def _align(grouping: SlotGrouping, block_size: int, size: int, labels: np.ndarray | None) -> AlignResult:
    sentinel = grouping.num_slots
    padded, starts, block_expert = _blocks_from_counts(grouping.counts, block_size)
    sorted_ids = np.full(size, sentinel, dtype=np.int32)
    pos = np.repeat(starts, grouping.counts) + grouping.rank_in_expert
    sorted_ids[pos] = grouping.present_order
    n_blocks = -(-size // block_size)
    expert_ids = np.full(n_blocks, -1, dtype=np.int32)
    expert_ids[: block_expert.size] = block_expert if labels is None else labels[block_expert]
    total = np.array([int(padded.sum())], dtype=np.int32)
    return AlignResult(sorted_ids, expert_ids, total, sentinel, block_size)


def moe_align_block_size(
    topk_ids,
    block_size: int,
    num_experts: int,
    expert_map=None,
    pad_sorted_ids: bool = False,
    ignore_invalid_experts: bool = False,
) -> AlignResult:
    """Sort slots by expert and pad each expert's run to ``block_size`` (contract: module docstring).

    vLLM's docstring example, with ``num_experts=5`` (its text says 4, but ids go up to 4):

    >>> ids = np.array([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=np.int32)
    >>> r = moe_align_block_size(ids, block_size=4, num_experts=5)
    >>> r.sorted_token_ids[:16].tolist()
    [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    >>> r.sorted_token_ids.size, set(r.sorted_token_ids[16:].tolist())  # 12 + 5*3 = 27, sentinel 12
    (27, {12})
    >>> r.expert_ids.tolist(), r.num_tokens_post_padded.tolist()
    ([1, 2, 3, 4, -1, -1, -1], [16])
    """
    block_size = check_positive_int(block_size, "block_size")
    num_experts = check_positive_int(num_experts, "num_experts")
    if ignore_invalid_experts and expert_map is None:
        raise ValueError("ignore_invalid_experts=True needs an expert_map")
    if ignore_invalid_experts:
        grouping = group_slots(topk_ids, num_experts, expert_map)
        labels = None
    else:
        grouping = group_slots(topk_ids, num_experts)
        labels = None
        if expert_map is not None:
            labels, _ = check_expert_map(expert_map, num_experts)
            labels = labels.astype(np.int64)
    size = max_num_tokens_padded(grouping.num_slots, num_experts, block_size, pad_sorted_ids)
    return _align(grouping, block_size, size, labels)


def batched_moe_align_block_size(max_tokens_per_batch: int, block_size: int, expert_num_tokens) -> AlignResult:
    """vLLM ``batched_moe_align_block_size`` for the batched layout ``[B, max_tokens_per_batch, K]``.

    ``sorted_token_ids`` point into the flattened ``B*max_tokens_per_batch`` rows (``b*max + j``), the
    sentinel is ``B*max_tokens_per_batch``, the buffer holds ``B*round_up(max_tokens_per_batch,
    block_size)`` entries, ``expert_ids`` (one per block) are the batch index or -1.

    The example of vLLM's docstring as corrected by vLLM PR #55896:

    >>> r = batched_moe_align_block_size(8, 4, np.array([2, 3, 0, 6, 8], dtype=np.int32))
    >>> r.sorted_token_ids.reshape(-1, 4)[:7].tolist()
    [[0, 1, 40, 40], [8, 9, 10, 40], [24, 25, 26, 27], [28, 29, 40, 40], [32, 33, 34, 35], [36, 37, 38, 39], [40, 40, 40, 40]]
    >>> r.expert_ids.tolist(), r.num_tokens_post_padded.tolist()
    ([0, 1, 3, 3, 4, 4, -1, -1, -1, -1], [24])
    """
    max_tokens_per_batch = check_positive_int(max_tokens_per_batch, "max_tokens_per_batch")
    block_size = check_positive_int(block_size, "block_size")
    counts = as_int_array(expert_num_tokens, "expert_num_tokens")
    check_ndim(counts, 1, "expert_num_tokens")
    where = first_bad_index((counts < 0) | (counts > max_tokens_per_batch))
    if where is not None:
        raise ValueError(
            f"expert_num_tokens[{where[0]}] = {int(counts[where])} is out of range [0, {max_tokens_per_batch}]"
        )
    counts = counts.astype(np.int64)
    b = counts.size
    sentinel = b * max_tokens_per_batch
    size = b * (-(-max_tokens_per_batch // block_size) * block_size)
    # Batch e's valid rows are e*max + [0, count_e): build the flat "slot" list directly.
    slots = np.repeat(np.arange(b, dtype=np.int64) * max_tokens_per_batch, counts)
    rank = np.arange(slots.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    grouping = SlotGrouping(
        num_tokens=sentinel, top_k=1, num_local_experts=b,
        local_ids=np.empty(0, dtype=np.int64), order=slots + rank, counts=counts,
    )
    return _align(grouping, block_size, size, None)
