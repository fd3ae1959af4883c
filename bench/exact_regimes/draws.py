"""The exact-regime proof's Hypothesis-drawn cases: a draw's parameters (:class:`Draw`), their strategy
(:func:`draw_strategy`), a derandomized list of them (:func:`drawn_parameters`) and the case of a draw on a
model's layer (:func:`drawn_case`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.exact_regimes.models import token_case

@dataclass(frozen=True)
class Draw:
    """One drawn case's parameters (:func:`draw_strategy`; :func:`drawn_case` makes the case from them)."""

    tokens: int
    routing: str
    seed: int
    padding: bool
    ep_size: int
    ep_strategy: str


def draw_strategy(max_tokens: int, num_experts: int):
    """Hypothesis strategy of :class:`Draw`: a token count of :func:`moeref.strategies.token_counts` (1 to
    ``max_tokens``, and 126..130 when ``max_tokens`` reaches 130), a routing kind of
    :data:`moeref.testing.cases.CASE_KINDS` and its seed, padding tokens (about a quarter) or none, and the EP
    shards of :func:`moeref.strategies.ep_shards` (``ep_size`` 1 to ``min(8, num_experts)``, linear or
    round-robin; every rank runs, so the drawn rank is not used). Shrinks toward one token, uniform routing,
    seed 0, no padding, one shard."""
    from hypothesis import strategies as st

    from moeref.strategies import ep_shards, token_counts
    from moeref.testing.cases import CASE_KINDS

    return st.builds(lambda m, kind, seed, pad, shard: Draw(int(m), kind, int(seed), bool(pad), shard.ep_size,
                                                            shard.strategy),
                     token_counts(max_tokens=max_tokens, block=128 if max_tokens >= 130 else None),
                     st.sampled_from(CASE_KINDS), st.integers(0, 2**16), st.booleans(),
                     ep_shards(num_experts, max_ep_size=min(8, num_experts)))


def drawn_case(base, draw: Draw):
    """The case of ``draw`` on the layer ``base`` (:func:`token_case`): ``draw.tokens`` token rows of ``base``
    chosen from the draw's seed (distinct while ``base`` has enough), the ids of routing ``draw.routing``
    (:func:`moeref.testing.cases._routing`, the drawn cases' NumPy routings; padding tokens with
    ``draw.padding``), power-of-two top-k weights (:func:`moeref.regimes.exact_topk_weights`, 0 on padding)."""
    from moeref.regimes import exact_topk_weights
    from moeref.testing.cases import _routing

    rng = np.random.default_rng([draw.seed, 30])
    m_base = base.hidden.shape[0]
    rows = rng.choice(m_base, size=draw.tokens, replace=draw.tokens > m_base)
    _, ids = _routing(draw.routing, draw.tokens, len(base.weights.w13), base.topk_ids.shape[1], rng, draw.padding)
    tw = np.where(ids >= 0, exact_topk_weights(ids.shape, seed=rng), np.float32(0.0))
    return token_case(base, rows, ids, tw)


def drawn_parameters(n: int, max_tokens: int, num_experts: int, seed: int = 0) -> list:
    """``n`` :class:`Draw` s of :func:`draw_strategy`, the same list for the same arguments: ``4 n`` distinct
    examples drawn by :func:`moeref.testing.draw_cases` (derandomized; ``seed`` skips the first ``seed``), of
    which the first of each routing kind come first, then the others, in the order drawn (a derandomized run
    starts from the simplest example and its neighbours, so a few draws taken in order would share a kind)."""
    from moeref.testing import draw_cases

    pool = draw_cases(4 * n, draw_strategy(max_tokens, num_experts), seed=seed)
    first, kinds = [], set()
    for d in pool:
        if d.routing not in kinds:
            kinds.add(d.routing)
            first.append(d)
    return (first + [d for d in pool if d not in first])[:n]
