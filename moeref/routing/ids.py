"""Validation of routing ids (``topk_ids``), shared by routing, dispatch and the MoE pipeline.

Contract for ``topk_ids``: a 2-D ``int32`` or ``int64`` array ``[num_tokens, top_k]``; each entry is
a global expert id in ``[0, num_experts)`` or ``-1`` for a padding slot (CUDA-graph / DP padding
tokens carry ``-1`` in every slot: vLLM PR #46428, SGLang PR #25852). Within a row the non-negative
ids are distinct (a token never picks one expert twice; every routing method guarantees this).
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

    Raises ``TypeError`` for a dtype other than int32/int64 and ``ValueError`` for a wrong rank, an
    id outside ``[0, num_experts)`` (``-1`` allowed when ``allow_padding``) or an expert repeated
    within a row; the message names the index and the value.

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
    if ids.shape[1] > 1 and ids.size:
        s = np.sort(ids, axis=1)
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        where = first_bad_index(dup)
        if where is not None:
            row, value = where[0], int(s[where[0], where[1] + 1])
            cols = np.flatnonzero(ids[row] == value).tolist()
            raise ValueError(
                f"{name}[{row}] selects expert {value} more than once (columns {cols}); "
                "ids within a row must be distinct"
            )
    return ids
