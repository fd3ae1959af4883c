"""What one source rank sends where: the NumPy half of EP dispatch (no process group needed).

Two message granularities, DeepEP's two modes (``deep_ep/buffer.py``: ``dispatch``, the normal
mode, and ``low_latency_dispatch``):

* **token rows** (DeepEP normal / high-throughput): a token goes to rank ``r`` **once** if any of its
  ``k`` experts lives on ``r``; the row carries the token's top-k ids as *local* ids on ``r`` and
  ``-1`` for slots elsewhere (and padding slots), weights ``0.0`` there (DeepEP ``intranode.cu``).
  Rows are ordered by destination rank, then ascending token index.
* **slots** (DeepEP low-latency): one message per valid ``(token t, slot j)``, ordered by destination
  rank, then ascending flat slot ``t*k + j``. The same order is the combine order of both modes:
  a destination returns the expert output of each slot in the order it received them, so the source
  places row ``i`` of rank ``r``'s block at slot ``slot_src[...]`` without any search.

:func:`dispatch_layout` is DeepEP ``Buffer.get_dispatch_layout`` (``num_tokens_per_rank``,
``num_tokens_per_expert``, ``is_token_in_rank``), for any placement rather than only linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_float_array, check_ndim
from ..routing.ids import check_topk_ids
from .placement import EPPlacement, ep_placement  # noqa: F401 (doctests)

__all__ = ["DispatchLayout", "SendPlan", "dispatch_layout", "send_plan"]


@dataclass(frozen=True, eq=False)
class DispatchLayout:
    """DeepEP ``get_dispatch_layout`` of one source rank (int32 counts, as DeepEP returns them).

    ``num_tokens_per_rank [R]``: distinct tokens with at least one expert on rank ``r``;
    ``num_tokens_per_expert [P]``: (token, slot) pairs choosing expert ``p``;
    ``is_token_in_rank`` bool ``[T, R]``.
    """

    num_tokens_per_rank: np.ndarray
    num_tokens_per_expert: np.ndarray
    is_token_in_rank: np.ndarray


@dataclass(frozen=True, eq=False)
class SendPlan:
    """Everything a source rank sends (module docstring); ``T`` tokens, ``k`` slots, ``R`` ranks.

    Token rows (normal mode), ``S`` of them: ``row_token`` int64 ``[S]``, ``row_dest`` int64 ``[S]``,
    ``rows_to`` int64 ``[R]``, ``row_local_ids`` int64 ``[S, k]`` (-1 = not on that rank),
    ``row_weights`` float32 ``[S, k]`` (0 where -1).

    Slots (low-latency mode and every combine), ``Q`` of them: ``slot_src`` int64 ``[Q]`` (flat
    ``t*k + j``), ``slot_dest`` int64 ``[Q]``, ``slot_local`` int64 ``[Q]`` (local expert on the
    destination), ``slots_to`` int64 ``[R]``.

    ``dest``: int64 ``[T, k]``, the rank of each slot (-1 for padding).
    """

    num_tokens: int
    top_k: int
    dest: np.ndarray
    row_token: np.ndarray
    row_dest: np.ndarray
    rows_to: np.ndarray
    row_local_ids: np.ndarray
    row_weights: np.ndarray
    slot_src: np.ndarray
    slot_dest: np.ndarray
    slot_local: np.ndarray
    slots_to: np.ndarray


def _dest_and_local(topk_ids, placement: EPPlacement):
    ids = check_topk_ids(topk_ids, placement.num_physical).astype(np.int64)
    safe = np.maximum(ids, 0)
    dest = np.where(ids >= 0, placement.owner[safe], -1)
    local = np.where(ids >= 0, placement.local_id[safe], -1)
    return ids, dest, local


def _token_in_rank(dest: np.ndarray, ep_size: int) -> np.ndarray:
    t = dest.shape[0]
    hit = np.zeros((t, ep_size + 1), dtype=bool)  # column ep_size collects padding slots
    hit[np.arange(t)[:, None], np.where(dest >= 0, dest, ep_size)] = True
    return hit[:, :ep_size]


def dispatch_layout(topk_ids, placement: EPPlacement) -> DispatchLayout:
    """DeepEP ``get_dispatch_layout`` for ``topk_ids`` (int ``[T, k]`` physical ids, -1 padding).

    >>> pl = ep_placement(4, 2)                   # rank 0: experts 0, 1; rank 1: experts 2, 3
    >>> lay = dispatch_layout(np.array([[0, 1], [1, 2], [-1, 3]]), pl)
    >>> lay.num_tokens_per_rank.tolist(), lay.num_tokens_per_expert.tolist()
    ([2, 2], [1, 2, 1, 1])
    """
    ids, dest, _ = _dest_and_local(topk_ids, placement)
    in_rank = _token_in_rank(dest, placement.ep_size)
    per_expert = np.bincount(ids[ids >= 0], minlength=placement.num_physical)
    return DispatchLayout(in_rank.sum(axis=0).astype(np.int32), per_expert.astype(np.int32), in_rank)


def send_plan(topk_ids, topk_weights, placement: EPPlacement) -> SendPlan:
    """The :class:`SendPlan` of one source rank: ``topk_ids`` int ``[T, k]`` (physical ids, -1
    padding, distinct per row), ``topk_weights`` float ``[T, k]``.

    >>> pl = ep_placement(4, 2)
    >>> sp = send_plan(np.array([[0, 3], [2, 3]]), np.array([[0.5, 0.5], [0.25, 0.75]]), pl)
    >>> sp.row_token.tolist(), sp.rows_to.tolist(), sp.row_local_ids.tolist()
    ([0, 0, 1], [1, 2], [[0, -1], [-1, 1], [0, 1]])
    >>> sp.slot_src.tolist(), sp.slot_local.tolist(), sp.slots_to.tolist()
    ([0, 1, 2, 3], [0, 1, 0, 1], [1, 3])
    """
    ids, dest, local = _dest_and_local(topk_ids, placement)
    w = as_float_array(topk_weights, "topk_weights")
    check_ndim(w, 2, "topk_weights")
    if w.shape != ids.shape:
        raise ValueError(f"topk_weights has shape {w.shape} but topk_ids has {ids.shape}")
    t, k = ids.shape
    r = placement.ep_size
    in_rank = _token_in_rank(dest, r)
    row_dest, row_token = np.nonzero(in_rank.T)  # row-major over [R, T]: by rank, then token
    row_dest = row_dest.astype(np.int64)
    row_token = row_token.astype(np.int64)
    here = dest[row_token] == row_dest[:, None]
    row_local = np.where(here, local[row_token], -1)
    row_w = np.where(here, w[row_token].astype(np.float32), np.float32(0.0)).astype(np.float32)
    flat_dest = dest.reshape(-1)
    valid = np.flatnonzero(flat_dest >= 0)
    slot_src = valid[np.argsort(flat_dest[valid], kind="stable")].astype(np.int64)
    return SendPlan(
        num_tokens=t, top_k=k, dest=dest,
        row_token=row_token, row_dest=row_dest, rows_to=np.bincount(row_dest, minlength=r).astype(np.int64),
        row_local_ids=row_local, row_weights=row_w,
        slot_src=slot_src, slot_dest=flat_dest[slot_src], slot_local=local.reshape(-1)[slot_src],
        slots_to=np.bincount(flat_dest[valid], minlength=r).astype(np.int64),
    )
