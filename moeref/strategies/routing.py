"""Hypothesis strategies for routings, EP shards, token counts and alignments.

Everything shrinks toward the smallest case: one token, one expert, ``top_k = 1``, no padding, no
EP, the first listed distribution. A failing property then reports e.g. "1 token, expert 0, k=1".

Distributions (``ROUTING_KINDS``), each a known bug class (the issues and PRs cited per row):

==================  ===========================================================================
``uniform``         every token picks ``k`` distinct experts uniformly (vLLM's harness: randperm)
``hot1``            one hot expert is in every token's selection
``all_to_one``      every token picks the same ``k`` experts (maximal skew)
``zipf``            experts drawn with Zipf(1.2)-skewed probabilities, without replacement
``empty_experts``   ids drawn from a subset of the experts, so some experts get nothing
``tied_logits``     logits from a 3-value set: exact ties at the top-k boundary (tie policy)
``negative_logits`` every logit negative (FlashInfer #2822 / vLLM #37591)
``nonfinite``       logits with +-inf and NaN entries (declared NaN policy)
``skewed_logits``   logits + a linspace(8, -8) expert bias (FlashInfer fuzzer "imbalanced")
``negative_bias``   sigmoid scores + a per-expert correction bias that may be negative everywhere,
                    routed by ``biased_topk`` (FlashInfer #2168, SGLang PR #3705)
==================  ===========================================================================

Opt-in (``OPT_IN_KINDS``, not drawn unless named in ``kinds=``):

==================  ===========================================================================
``repeated_experts`` ids drawn with replacement: a token may pick one expert twice (vLLM's kernels
                    and tests accept it; each slot is its own row, :mod:`moeref.routing.ids`);
                    with ``k >= 2`` the first token always does. Opt-in because kernels built
                    on a per-rank or per-(token, expert) deduplication (DeepEP-style dispatch)
                    cannot take repeats; name it where the kernel under test accepts them.
==================  ===========================================================================

Logit-based kinds route with :func:`moeref.routing.softmax_topk` (renormalize=True), except
``negative_bias`` (:func:`moeref.routing.biased_topk`, sigmoid, renormalize=True; the bias is kept in
:attr:`RoutingCase.bias`), and keep the logits in :attr:`RoutingCase.logits`. Padding tokens (``ids == -1`` in every slot, weight 0) are
drawn on top of any kind when ``allow_padding``. Logits and weights are drawn on exact binary grids
(multiples of 1/8 and 1/64) so shifted or rescaled copies stay exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from ..routing.expert_map import EP_STRATEGIES, expert_map
from ..routing.methods import biased_topk, softmax_topk

__all__ = [
    "BLACKWELL_ALIGNMENTS",
    "ID_KINDS",
    "LOGIT_KINDS",
    "OPT_IN_KINDS",
    "ROUTING_KINDS",
    "EPShard",
    "RoutingCase",
    "alignments",
    "biases",
    "block_boundary_counts",
    "ep_shards",
    "router_logits",
    "routings",
    "token_counts",
]

ID_KINDS = ("uniform", "hot1", "all_to_one", "zipf", "empty_experts")
LOGIT_KINDS = ("tied_logits", "negative_logits", "nonfinite", "skewed_logits", "negative_bias")
ROUTING_KINDS = ID_KINDS + LOGIT_KINDS
#: kinds drawn only when named in ``routings(kinds=...)`` (module docstring)
OPT_IN_KINDS = ("repeated_experts",)
#: the kinds :func:`router_logits` draws ("grid": multiples of 1/8 in [-8, 8])
ROUTER_LOGIT_KINDS = ("grid", "tied_logits", "negative_logits", "nonfinite", "skewed_logits")


def _check_kinds(kinds, accepted, what):
    """``kinds`` as a tuple after checking each is in ``accepted`` (a typo must not silently draw
    another distribution)."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError(f"{what}: give at least one kind; accepted: {', '.join(accepted)}")
    bad = [k for k in kinds if k not in accepted]
    if bad:
        raise ValueError(f"{what}: unknown kind(s) {', '.join(map(repr, bad))}; accepted: "
                         f"{', '.join(accepted)}")
    return kinds
BLACKWELL_ALIGNMENTS = tuple(range(32, 225, 32))  # DeepGEMM SM100: 224 stepping down by 32
BOUNDARY_TOKEN_COUNTS = (4095, 4096, 4097)  # FlashInfer fuzzer's autotune-cache boundary


@dataclass(frozen=True, eq=False)
class RoutingCase:
    """A drawn routing. ``ids``: int32 ``[M, k]`` (-1 = padding slot), ``weights``: float32 ``[M, k]``
    (0 for padding), ``logits``: float32 ``[M, E]`` for logit-based kinds else None, ``kind``: the
    distribution, ``num_padding``: padding tokens, ``bias``: float64 ``[E]`` correction bias of the
    ``negative_bias`` kind else None."""

    num_tokens: int
    num_experts: int
    top_k: int
    ids: np.ndarray
    weights: np.ndarray
    logits: np.ndarray | None
    kind: str
    num_padding: int = 0
    bias: np.ndarray | None = None

    def __repr__(self) -> str:  # Hypothesis prints this for a failing example
        return (
            f"RoutingCase(kind={self.kind!r}, num_tokens={self.num_tokens}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, num_padding={self.num_padding}, ids={self.ids.tolist()}, "
            f"weights={self.weights.tolist()}, logits={None if self.logits is None else self.logits.tolist()}, "
            f"bias={None if self.bias is None else self.bias.tolist()})"
        )


@dataclass(frozen=True, eq=False)
class EPShard:
    """One EP rank: ``expert_map`` int32 ``[E + num_shared]`` and how it was made."""

    ep_size: int
    ep_rank: int
    strategy: str
    expert_map: np.ndarray

    @property
    def num_local_experts(self) -> int:
        return int((self.expert_map >= 0).sum())


def token_counts(*, max_tokens: int = 8, block: int | None = None, allow_zero: bool = False,
                 large: bool = False) -> st.SearchStrategy[int]:
    """Token counts: small counts first (shrink to 1, or 0 with ``allow_zero``), then
    ``block-2 .. block+2`` when ``block`` is given, then 4095/4096/4097 when ``large`` (use large only
    for index-only tests: they are cheap there)."""
    low = 0 if allow_zero else 1
    options = [st.integers(low, max(low, max_tokens))]
    if block is not None:
        options.append(block_boundary_counts(block))
    if large:
        options.append(st.sampled_from(BOUNDARY_TOKEN_COUNTS))
    return st.one_of(*options)


def block_boundary_counts(block: int) -> st.SearchStrategy[int]:
    """``block-2 .. block+2`` (positive ones): counts that straddle a tile boundary."""
    return st.sampled_from([c for c in range(block - 2, block + 3) if c > 0])


def alignments(*, hopper: bool = True, blackwell: bool = True) -> st.SearchStrategy[int]:
    """DeepGEMM contiguous-layout alignments: 128 (SM90) and 32..224 step 32 (SM100, not powers of 2)."""
    values = []
    if blackwell:
        values += list(BLACKWELL_ALIGNMENTS)
    if hopper and 128 not in values:
        values.append(128)
    return st.sampled_from(values)


@st.composite
def ep_shards(draw, num_experts: int, *, max_ep_size: int = 8, num_shared_experts: int = 0) -> EPShard:
    """An EP rank for ``num_experts`` routed experts: ``ep_size`` 1..max (shrinks to 1), any rank
    (offset > 0 included), linear or round-robin; ``num_experts`` need not divide evenly."""
    ep_size = draw(st.integers(1, max(1, max_ep_size)))
    ep_rank = draw(st.integers(0, ep_size - 1))
    strategy = draw(st.sampled_from(EP_STRATEGIES))
    m = expert_map(num_experts, ep_size, ep_rank, strategy, num_shared_experts)
    return EPShard(ep_size, ep_rank, strategy, m)


def biases(num_experts: int, *, negative: bool = True) -> st.SearchStrategy[np.ndarray]:
    """Correction biases ``float64 [E]`` on a 1/16 grid; with ``negative`` they may all be negative
    (FlashInfer #2168), and they vary per expert (vLLM's test uses a constant 0.9, which cannot
    change a selection)."""
    def of(lo, hi):
        elems = st.integers(lo, hi).map(lambda v: v / 16.0)
        return st.lists(elems, min_size=num_experts, max_size=num_experts).map(lambda v: np.array(v, dtype=np.float64))

    if not negative:
        return of(0, 64)
    return st.one_of(of(-64, 64), of(-64, -1))  # mixed signs, or negative for every expert


def router_logits(num_tokens: int, num_experts: int, kind: str = "grid") -> st.SearchStrategy[np.ndarray]:
    """float32 ``[M, E]`` logits of one kind: ``grid`` (multiples of 1/8 in [-8, 8]), ``tied_logits``,
    ``negative_logits``, ``nonfinite``, ``skewed_logits``. An unknown ``kind`` raises ``ValueError``
    here, when the strategy is built."""
    (kind,) = _check_kinds(kind, ROUTER_LOGIT_KINDS, "router_logits")
    return _router_logits(num_tokens, num_experts, kind)


@st.composite
def _router_logits(draw, num_tokens: int, num_experts: int, kind: str) -> np.ndarray:
    n = num_tokens * num_experts
    if kind == "tied_logits":
        vals = draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=n, max_size=n))
    elif kind == "negative_logits":
        vals = draw(st.lists(st.integers(-160, -1).map(lambda v: v / 8.0), min_size=n, max_size=n))
    elif kind == "nonfinite":
        special = st.sampled_from([np.inf, -np.inf, np.nan])
        vals = draw(st.lists(st.one_of(st.integers(-64, 64).map(lambda v: v / 8.0), special), min_size=n, max_size=n))
    else:
        vals = draw(st.lists(st.integers(-64, 64).map(lambda v: v / 8.0), min_size=n, max_size=n))
    x = np.array(vals, dtype=np.float32).reshape(num_tokens, num_experts)
    if kind == "skewed_logits":
        x = x + np.linspace(8.0, -8.0, num_experts, dtype=np.float32)[None, :]
    return x


def _distinct_rows(draw, num_tokens, top_k, pool):
    """Rows of ``top_k`` distinct experts from ``pool`` (list of ids), drawn by Hypothesis."""
    rows = []
    for _ in range(num_tokens):  # Hypothesis draws each row; sizes here are small by design
        picks = draw(st.lists(st.sampled_from(pool), min_size=top_k, max_size=top_k, unique=True))
        rows.append(picks)
    return np.array(rows, dtype=np.int64).reshape(num_tokens, top_k)


def routings(*, kinds=ROUTING_KINDS, **kwargs) -> st.SearchStrategy["RoutingCase"]:
    """A :class:`RoutingCase` (module docstring). Sizes may be fixed by passing ints or strategies
    for ``num_tokens`` / ``num_experts`` / ``top_k``; other keywords: ``max_tokens``,
    ``max_experts``, ``max_top_k``, ``allow_padding``, ``allow_zero_tokens``. ``kinds`` must name
    distributions of :data:`ROUTING_KINDS` or :data:`OPT_IN_KINDS`; an unknown one raises
    ``ValueError`` here."""
    return _routings(kinds=_check_kinds(kinds, ROUTING_KINDS + OPT_IN_KINDS, "routings"), **kwargs)


@st.composite
def _routings(
    draw,
    *,
    max_tokens: int = 8,
    max_experts: int = 8,
    max_top_k: int = 4,
    kinds=ROUTING_KINDS,
    allow_padding: bool = True,
    allow_zero_tokens: bool = False,
    num_tokens=None,
    num_experts=None,
    top_k=None,
) -> RoutingCase:
    def pick(value, default):
        if value is None:
            return draw(default)
        if isinstance(value, st.SearchStrategy):
            return draw(value)
        return int(value)

    e = pick(num_experts, st.integers(1, max(1, max_experts)))
    k = pick(top_k, st.integers(1, max(1, min(max_top_k, e))))
    if k > e:
        raise ValueError(f"top_k={k} > num_experts={e}")
    m = pick(num_tokens, st.integers(0 if allow_zero_tokens else 1, max(1, max_tokens)))
    kind = draw(st.sampled_from(kinds))
    logits = bias = None
    if kind == "negative_bias":
        logits = draw(router_logits(m, e, "grid"))
        bias = draw(biases(e, negative=True))
        r = biased_topk(logits, k, bias, scoring="sigmoid", renormalize=True) if m else None
        ids = r.ids.astype(np.int64) if m else np.zeros((0, k), dtype=np.int64)
        weights = r.weights if m else np.zeros((0, k), dtype=np.float32)
    elif kind in LOGIT_KINDS:
        logits = draw(router_logits(m, e, kind))
        r = softmax_topk(logits, k, renormalize=True) if m else None
        ids = r.ids.astype(np.int64) if m else np.zeros((0, k), dtype=np.int64)
        weights = r.weights if m else np.zeros((0, k), dtype=np.float32)
    else:
        if kind == "uniform":
            ids = _distinct_rows(draw, m, k, list(range(e)))
        elif kind == "hot1":
            hot = draw(st.integers(0, e - 1))
            others = [x for x in range(e) if x != hot]
            rest = _distinct_rows(draw, m, k - 1, others) if k > 1 else np.zeros((m, 0), dtype=np.int64)
            ids = np.concatenate([np.full((m, 1), hot, dtype=np.int64), rest], axis=1)
        elif kind == "all_to_one":
            row = _distinct_rows(draw, 1, k, list(range(e)))
            ids = np.repeat(row, m, axis=0)
        elif kind == "zipf":
            seed = draw(st.integers(0, 2**32 - 1))
            rng = np.random.default_rng(seed)
            p = 1.0 / np.arange(1, e + 1) ** 1.2
            gumbel = np.log(p)[None, :] - np.log(-np.log(rng.random((m, e))))  # Gumbel top-k sampling
            ids = np.argsort(-gumbel, axis=1, kind="stable")[:, :k]
        elif kind == "repeated_experts":
            grid_ids = draw(st.lists(st.integers(0, e - 1), min_size=m * k, max_size=m * k))
            ids = np.array(grid_ids, dtype=np.int64).reshape(m, k)
            if m and k >= 2:
                ids[0, -1] = ids[0, 0]
        else:  # empty_experts
            size = draw(st.integers(k, e))
            pool = sorted(draw(st.lists(st.integers(0, e - 1), min_size=size, max_size=size, unique=True)))
            ids = _distinct_rows(draw, m, k, pool)
        grid = draw(st.lists(st.integers(1, 64), min_size=m * k, max_size=m * k))
        weights = (np.array(grid, dtype=np.float32) / 64.0).reshape(m, k)
    ids = ids.astype(np.int32)
    n_pad = 0
    if allow_padding and m:
        pad = np.array(draw(st.lists(st.booleans(), min_size=m, max_size=m)), dtype=bool)
        ids[pad] = -1
        weights = np.where(pad[:, None], np.float32(0.0), weights).astype(np.float32)
        n_pad = int(pad.sum())
    return RoutingCase(m, e, k, ids, weights.astype(np.float32), logits, kind, n_pad, bias)
