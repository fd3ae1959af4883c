"""Where every expert lives across an expert-parallel (EP) group: :class:`EPPlacement`.

A placement gives, for each of the ``P`` experts the dispatch sees, the rank that owns it and its
local id there. It is the set of all ranks' ``expert_map`` (:mod:`moeref.routing.expert_map`) at
once, so a rank can compute where any token goes (a single rank's map only says what is local).

* ``"linear"`` / ``"round_robin"``: vLLM ``determine_expert_map`` (through
  :func:`moeref.routing.expert_map`: the first ``E % ep_size`` ranks get one extra expert).
  DeepEP's kernels assume linear placement with ``E % ep_size == 0``; moeref does not need it.
* :meth:`EPPlacement.from_expert_maps`: any placement given as per-rank maps (vLLM's custom
  ``rank_to_experts``); every expert must be owned by exactly one rank.
* Redundant experts (vLLM EPLB, ``eplb_state.py``): ``num_redundant`` extra *physical* experts
  replicate logical ones. The initial ``physical_to_logical`` map is ``[0 .. N-1]`` followed by
  ``i % N`` for the redundant slots; :meth:`EPPlacement.to_physical` maps logical ``topk_ids`` to
  physical ones as vLLM's router does (``base_router.py``): replica ``pos % replica_count`` of the
  logical expert, ``pos = t*k + j`` the flat slot position. Replicas hold the same weights, so the
  layer output does not depend on the replica chosen (only per-expert counts do).

Fused shared experts (which live on every rank) are not dispatched and are not part of a placement:
compute them on the source rank (:func:`moeref.distributed.ep_fused_moe` does).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .._checks import as_int_array, check_choice, check_ndim, check_positive_int
from ..routing.expert_map import EP_STRATEGIES, check_expert_map, expert_map
from ..routing.ids import check_topk_ids

__all__ = ["EPPlacement", "ep_placement"]


@dataclass(frozen=True, eq=False)
class EPPlacement:
    """All ranks' experts.

    Attributes:
        owner: int64 ``[P]``, the rank owning physical expert ``p``.
        local_id: int64 ``[P]``, the local id of ``p`` on its owner (``0 .. num_local(owner)-1``).
        ep_size: number of ranks.
        physical_to_logical: int64 ``[P]``, the logical expert (weight set) of ``p``; the identity
            without redundant experts.
        strategy: how it was built (``"linear"``, ``"round_robin"`` or ``"custom"``).
    """

    owner: np.ndarray
    local_id: np.ndarray
    ep_size: int
    physical_to_logical: np.ndarray
    strategy: str = "custom"

    def __post_init__(self):
        ep_size = check_positive_int(self.ep_size, "ep_size")
        for name in ("owner", "local_id", "physical_to_logical"):
            a = np.array(as_int_array(getattr(self, name), name), dtype=np.int64)
            check_ndim(a, 1, name)
            if a.shape != np.shape(self.owner):
                raise ValueError(f"{name} must have the shape of owner {np.shape(self.owner)}; got {a.shape}")
            a.setflags(write=False)
            object.__setattr__(self, name, a)
        bad = np.flatnonzero((self.owner < 0) | (self.owner >= ep_size))
        if bad.size:
            raise ValueError(f"owner[{int(bad[0])}] = {int(self.owner[bad[0]])} is not a rank in [0, {ep_size})")
        for r in range(ep_size):  # each rank's local ids are 0 .. n-1, once each
            ids = np.sort(self.local_id[self.owner == r])
            if not np.array_equal(ids, np.arange(ids.size)):
                raise ValueError(f"the local ids of rank {r} are {ids.tolist()}; they must be 0..{ids.size - 1} once each")

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def num_physical(self) -> int:
        """Experts the dispatch sees (``P``: logical + redundant)."""
        return int(self.owner.size)

    @property
    def num_logical(self) -> int:
        return int(self.physical_to_logical.max(initial=-1)) + 1

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    def num_local(self, rank: int) -> int:
        """Number of experts on ``rank``."""
        return int((self.owner == self._rank(rank)).sum())

    # ---- per-rank views -------------------------------------------------------------------------
    def expert_map(self, rank: int) -> np.ndarray:
        """int32 ``[P]``: ``rank``'s global -> local map (-1 elsewhere), as :mod:`moeref.routing.expert_map`."""
        r = self._rank(rank)
        return np.where(self.owner == r, self.local_id, -1).astype(np.int32)

    def local_experts(self, rank: int) -> np.ndarray:
        """int64 ``[num_local(rank)]``: the physical ids on ``rank``, indexed by local id."""
        r = self._rank(rank)
        p = np.flatnonzero(self.owner == r)
        out = np.empty(p.size, dtype=np.int64)
        out[self.local_id[p]] = p
        return out

    def local_logical_experts(self, rank: int) -> np.ndarray:
        """int64 ``[num_local(rank)]``: the logical expert (weight set) of each local expert of ``rank``:
        ``weights.select(placement.local_logical_experts(rank))`` gives the rank's weights."""
        return self.physical_to_logical[self.local_experts(rank)]

    def check_world_size(self, world_size: int) -> None:
        """``ValueError`` unless the placement was made for ``world_size`` ranks."""
        if int(world_size) != self.ep_size:
            raise ValueError(f"the expert placement is for ep_size={self.ep_size} ranks but the process group "
                             f"has world_size={world_size}")

    @property
    def fingerprint(self) -> int:
        """A 56-bit digest of the placement (ranks compare it to detect disagreeing placements)."""
        h = hashlib.blake2b(digest_size=7)
        for a in (np.array([self.ep_size], np.int64), self.owner, self.local_id, self.physical_to_logical):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return int.from_bytes(h.digest(), "little")

    def to_physical(self, topk_ids) -> np.ndarray:
        """Logical ``topk_ids [T, k]`` (-1 padding) -> physical ids (int64), vLLM EPLB's rule: slot
        ``pos = t*k + j`` of logical expert ``l`` goes to ``replicas(l)[pos % len(replicas(l))]``
        (replicas in ascending physical id). Without redundant experts this is the identity.

        >>> pl = ep_placement(2, 2, num_redundant=1)   # physical 2 replicates logical 0
        >>> pl.to_physical(np.array([[0, 1], [-1, 0]])).tolist()   # slot 3: replica 3 % 2 = 1 of logical 0
        [[0, 1], [-1, 2]]
        """
        ids = check_topk_ids(topk_ids, self.num_logical).astype(np.int64)
        if self.num_redundant == 0:
            return ids.copy()
        n = self.num_logical
        counts = np.bincount(self.physical_to_logical, minlength=n)
        order = np.argsort(self.physical_to_logical, kind="stable")  # physical ids grouped by logical
        starts = np.cumsum(counts) - counts
        pos = np.arange(ids.size, dtype=np.int64).reshape(ids.shape)
        safe = np.maximum(ids, 0)
        replica = pos % counts[safe]
        return np.where(ids >= 0, order[starts[safe] + replica], -1)

    def _rank(self, rank) -> int:
        r = check_positive_int(rank, "rank", allow_zero=True)
        if r >= self.ep_size:
            raise ValueError(f"rank must be in [0, ep_size={self.ep_size}); got {r}")
        return r

    @classmethod
    def from_expert_maps(cls, maps, physical_to_logical=None, strategy: str = "custom") -> "EPPlacement":
        """A placement from every rank's ``expert_map`` (int ``[P]`` each, rank order).

        Each map is validated (:func:`moeref.routing.check_expert_map`); every expert must be local
        on exactly one rank (``ValueError`` naming the expert and the ranks otherwise).
        """
        maps = list(maps)
        if not maps:
            raise ValueError("from_expert_maps needs one expert_map per rank; got none")
        first = as_int_array(maps[0], "expert_maps[0]")
        check_ndim(first, 1, "expert_maps[0]")
        p = int(first.shape[0])
        stack = np.stack([check_expert_map(m, p, f"expert_maps[{r}]")[0].astype(np.int64)
                          for r, m in enumerate(maps)])
        owners = (stack >= 0).sum(axis=0)
        bad = np.flatnonzero(owners != 1)
        if bad.size:
            e = int(bad[0])
            ranks = np.flatnonzero(stack[:, e] >= 0).tolist()
            raise ValueError(f"expert {e} is local on ranks {ranks}; every expert must live on exactly one rank")
        owner = np.argmax(stack >= 0, axis=0)
        local = stack[owner, np.arange(p)]
        p2l = np.arange(p) if physical_to_logical is None else as_int_array(physical_to_logical, "physical_to_logical")
        if p2l.shape != (p,) or (p2l < 0).any():
            raise ValueError(f"physical_to_logical must be non-negative ints of shape ({p},); got {p2l.shape}")
        missing = np.setdiff1d(np.arange(int(p2l.max(initial=-1)) + 1), p2l)
        if missing.size:
            raise ValueError(f"physical_to_logical has no replica of logical experts {missing.tolist()}")
        return cls(owner, local, len(maps), p2l, strategy)


def ep_placement(num_experts: int, ep_size: int, strategy: str = "linear", *, num_redundant: int = 0) -> EPPlacement:
    """The placement of ``num_experts`` logical experts (+ ``num_redundant`` replicas) over ``ep_size`` ranks.

    Physical experts ``0 .. num_experts + num_redundant - 1`` are placed by ``strategy`` exactly as
    :func:`moeref.routing.expert_map` places them; the redundant ones replicate logical ``i % num_experts``.

    >>> pl = ep_placement(6, 4)                  # 6 = 4*1 + 2: ranks 0 and 1 own two experts
    >>> pl.owner.tolist(), pl.local_id.tolist()
    ([0, 0, 1, 1, 2, 3], [0, 1, 0, 1, 0, 0])
    >>> ep_placement(6, 4, "round_robin").local_experts(1).tolist()
    [1, 5]
    """
    num_experts = check_positive_int(num_experts, "num_experts")
    ep_size = check_positive_int(ep_size, "ep_size")
    num_redundant = check_positive_int(num_redundant, "num_redundant", allow_zero=True)
    check_choice(strategy, EP_STRATEGIES, "strategy")
    p = num_experts + num_redundant
    maps = [expert_map(p, ep_size, r, strategy) for r in range(ep_size)]
    p2l = np.concatenate([np.arange(num_experts), np.arange(num_redundant) % num_experts])
    return EPPlacement.from_expert_maps(maps, p2l, strategy)
