"""Expert parallelism (EP): which experts live on which rank, as a global -> local ``expert_map``.

An ``expert_map`` is ``int32[num_experts]`` (global expert count, fused shared experts included):
``expert_map[g]`` is the local index of global expert ``g`` on this rank, or ``-1`` when ``g`` lives
on another rank. The local indices of a rank are exactly ``0 .. L-1``, each once. Padding slots
(``topk_id == -1``) and non-local experts are both "not here" for this rank's dispatch.

Placement follows vLLM ``determine_expert_map`` (``fused_moe/layer.py``):

* ``"linear"``: rank ``r`` owns a contiguous block. With ``base = E // ep_size`` and
  ``rem = E % ep_size``, rank ``r`` owns ``base + (r < rem)`` experts starting at
  ``r*base + min(r, rem)``: **the first ``rem`` ranks get one extra expert**. (This is what the
  current code does; the docstring above it in vLLM still says "remaining are assigned to the last
  rank".)
* ``"round_robin"``: rank ``r`` owns ``r, r + ep_size, r + 2*ep_size, ...``.
* ``num_shared_experts`` fused shared experts get global ids ``E .. E+S-1`` and live on **every**
  rank, with local ids ``L .. L+S-1`` after the rank's routed experts (vLLM appends them the same
  way when it builds the AITER expert mask).

Other conventions, for comparison: FlashInfer passes ``local_expert_offset`` + ``local_num_experts``
with global ids (a linear map; bug #3547 was a shard with offset > 0); triton_kernels
``make_expt_assignment`` gives a per-shard bitmask and an ``expt_map[shard, E]`` with -1.
"""
from __future__ import annotations

import numpy as np

from .._checks import as_int_array, check_choice, check_ndim, check_positive_int, first_bad_index

__all__ = [
    "EP_STRATEGIES",
    "check_expert_map",
    "expert_map",
    "local_expert_ids",
    "to_local_ids",
]

EP_STRATEGIES = ("linear", "round_robin")


def expert_map(
    num_experts: int,
    ep_size: int,
    ep_rank: int,
    strategy: str = "linear",
    num_shared_experts: int = 0,
) -> np.ndarray:
    """The ``expert_map`` of rank ``ep_rank`` out of ``ep_size``: int32 ``[num_experts + num_shared_experts]``.

    ``num_experts`` counts routed experts only. A rank may own zero routed experts when
    ``num_experts < ep_size`` (its map is all -1 apart from shared experts).

    >>> expert_map(10, 4, 0)  # 10 = 4*2 + 2: ranks 0 and 1 own 3 experts, ranks 2 and 3 own 2
    array([ 0,  1,  2, -1, -1, -1, -1, -1, -1, -1], dtype=int32)
    >>> expert_map(10, 4, 2)
    array([-1, -1, -1, -1, -1, -1,  0,  1, -1, -1], dtype=int32)
    >>> expert_map(8, 2, 1, "round_robin", num_shared_experts=1)
    array([-1,  0, -1,  1, -1,  2, -1,  3,  4], dtype=int32)
    """
    num_experts = check_positive_int(num_experts, "num_experts")
    ep_size = check_positive_int(ep_size, "ep_size")
    ep_rank = check_positive_int(ep_rank, "ep_rank", allow_zero=True)
    num_shared_experts = check_positive_int(num_shared_experts, "num_shared_experts", allow_zero=True)
    check_choice(strategy, EP_STRATEGIES, "strategy")
    if ep_rank >= ep_size:
        raise ValueError(f"ep_rank must be in [0, ep_size={ep_size}); got {ep_rank}")
    base, rem = divmod(num_experts, ep_size)
    n_local = base + (1 if ep_rank < rem else 0)
    out = np.full(num_experts + num_shared_experts, -1, dtype=np.int32)
    if strategy == "linear":
        start = ep_rank * base + min(ep_rank, rem)
        owned = np.arange(start, start + n_local)
    else:
        owned = np.arange(ep_rank, num_experts, ep_size)
    out[owned] = np.arange(n_local, dtype=np.int32)
    out[num_experts:] = n_local + np.arange(num_shared_experts, dtype=np.int32)
    return out


def check_expert_map(expert_map, num_experts: int, name: str = "expert_map") -> tuple[np.ndarray, int]:
    """Validate an ``expert_map`` for ``num_experts`` global experts; return ``(map, num_local)``.

    The map must be 1-D int32/int64 of length ``num_experts``, with entries ``-1`` or local ids, and
    its non-negative entries must be exactly ``0 .. num_local-1`` once each (``ValueError`` naming
    the index and value otherwise: a duplicated local id would send two experts' tokens to one
    weight slot, as the random ``e_ids`` of vLLM ``test_moe.py`` can).
    """
    num_experts = check_positive_int(num_experts, "num_experts")
    m = as_int_array(expert_map, name)
    check_ndim(m, 1, name)
    if m.shape[0] != num_experts:
        raise ValueError(f"{name} must have length num_experts={num_experts}; got length {m.shape[0]}")
    where = first_bad_index(m < -1)
    if where is not None:
        raise ValueError(f"{name}[{where[0]}] = {int(m[where])}: entries must be -1 (not local) or a local id >= 0")
    local = m[m >= 0]
    n_local = int(local.size)
    where = first_bad_index(m >= n_local)
    if where is not None:
        raise ValueError(
            f"{name}[{where[0]}] = {int(m[where])}: local ids must be 0..{n_local - 1} ({n_local} local experts)"
        )
    counts = np.bincount(local, minlength=n_local)
    if n_local and (counts != 1).any():
        dup = int(np.flatnonzero(counts > 1)[0])
        at = np.flatnonzero(m == dup).tolist()
        raise ValueError(f"{name} maps global experts {at} to the same local id {dup}; local ids must be unique")
    return m, n_local


def local_expert_ids(expert_map) -> np.ndarray:
    """Global ids of the local experts, indexed by local id: int64 ``[num_local]``.

    >>> local_expert_ids(np.array([-1, 1, -1, 0], dtype=np.int32))
    array([3, 1])
    """
    m, n_local = check_expert_map(expert_map, int(np.asarray(expert_map).shape[0]))
    out = np.empty(n_local, dtype=np.int64)
    g = np.flatnonzero(m >= 0)
    out[m[g]] = g
    return out


def to_local_ids(topk_ids: np.ndarray, expert_map: np.ndarray | None) -> np.ndarray:
    """Map validated global ids (``-1`` = padding) to local ids; non-local and padding become -1.

    ``expert_map=None`` means every expert is local (ids are returned as int64 unchanged).
    Inputs are assumed validated (:func:`moeref.routing.check_topk_ids`, :func:`check_expert_map`).
    """
    ids = np.asarray(topk_ids, dtype=np.int64)
    if expert_map is None:
        return ids.copy()
    m = np.asarray(expert_map, dtype=np.int64)
    return np.where(ids >= 0, m[np.maximum(ids, 0)], -1)
