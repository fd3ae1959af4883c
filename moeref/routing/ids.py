"""Validation of routing ids (``topk_ids``), shared by routing, dispatch and the MoE pipeline.

Contract for ``topk_ids``: a 2-D ``int32`` or ``int64`` array ``[num_tokens, top_k]``; each entry is
a global expert id in ``[0, num_experts)`` or ``-1`` for a padding slot (CUDA-graph / DP padding
tokens carry ``-1`` in every slot: vLLM PR #46428, SGLang PR #25852).

An expert may appear more than once within a row. The routing methods never produce that (their
ids are distinct by construction), but vLLM's fused-MoE kernels and their tests accept it
(``moe_align_block_size`` and the permute kernels sort slots, not (token, expert) pairs), so a
reference must say what such a kernel computes: **each slot is its own row**. Slot ``(t, j)``
sends token ``t`` to expert ``topk_ids[t, j]`` once; a token that picks expert ``e`` twice is two
rows of expert ``e``'s group, both computed, each weighted by its own ``topk_weights[t, j]`` and
summed in finalize: the same as one slot with the summed weight, up to the rounding of the sum.
Every layout in :mod:`moeref.dispatch` (standard, permuted, DeepGEMM contiguous and masked,
batched, CUTLASS) is built from slots, so each represents repeats; none refuses them.
"""
from __future__ import annotations

import numpy as np

from .._checks import as_int_array, check_ndim, check_positive_int, first_bad_index

__all__ = ["PADDING_ID", "check_topk_ids"]

PADDING_ID = -1
"""The id of a padding slot: it selects no expert and contributes nothing."""


def check_topk_ids(
    topk_ids,
    num_experts: int,
    *,
    name: str = "topk_ids",
    allow_padding: bool = True,
) -> np.ndarray:
    """Return ``topk_ids`` as a NumPy int array after checking the contract above.

    Raises ``TypeError`` for a dtype other than int32/int64 and ``ValueError`` for a wrong rank or
    an id outside ``[0, num_experts)`` (``-1`` allowed when ``allow_padding``); the message names
    the index and the value. An expert repeated within a row is accepted (module docstring: each
    slot is its own row).

    >>> check_topk_ids(np.array([[2, 2]], dtype=np.int32), 4).tolist()   # one token, expert 2 twice
    [[2, 2]]

    >>> check_topk_ids(np.array([[0, 3], [-1, -1]], dtype=np.int32), 4).shape
    (2, 2)
    >>> check_topk_ids(np.array([[0, 4]], dtype=np.int32), 4)
    Traceback (most recent call last):
    ...
    ValueError: topk_ids[0, 1] = 4 is out of range: ids must be in [0, 4) or -1 (padding)
    """
    num_experts = check_positive_int(num_experts, "num_experts")
    ids = as_int_array(topk_ids, name)
    check_ndim(ids, 2, name)
    low = PADDING_ID if allow_padding else 0
    bad = (ids < low) | (ids >= num_experts)
    where = first_bad_index(bad)
    if where is not None:
        accepted = f"[0, {num_experts})" + (" or -1 (padding)" if allow_padding else "")
        raise ValueError(
            f"{name}[{where[0]}, {where[1]}] = {int(ids[where])} is out of range: ids must be in {accepted}"
        )
    return ids
