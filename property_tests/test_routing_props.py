"""Properties of the routing references: tie/NaN policy, shift invariance, token equivariance,
method equivalences, EP partition. Oracles here are independent sort-based statements."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from moeref.routing import (
    biased_topk,
    expert_map,
    grouped_topk,
    llama4_top1,
    route,
    sigmoid_topk,
    softmax_topk,
    stable_topk,
    topk_softmax,
)
from moeref.strategies import biases, ep_shards, router_logits

SPECIAL = st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0])
FLOATS = st.one_of(st.integers(-8, 8).map(float), st.floats(-1e30, 1e30, allow_nan=False), SPECIAL)


@st.composite
def shapes(draw, max_tokens=6, max_experts=10):
    m = draw(st.integers(1, max_tokens))
    e = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, e))
    return m, e, k


@st.composite
def float_matrix(draw, m, e):
    vals = draw(st.lists(FLOATS, min_size=m * e, max_size=m * e))
    return np.array(vals, dtype=np.float64).reshape(m, e)


def oracle_order(row):
    key = lambda i: (1, 0.0, i) if math.isnan(row[i]) else (0, -row[i], i)  # noqa: E731
    return sorted(range(len(row)), key=key)


@given(shapes().flatmap(lambda s: st.tuples(st.just(s), float_matrix(s[0], s[1]))))
def test_stable_topk_is_the_declared_sort(case):
    (m, e, k), x = case
    got = stable_topk(x, k)
    for t in range(m):
        assert got[t].tolist() == oracle_order([float(v) for v in x[t]])[:k]


@given(shapes().flatmap(lambda s: st.tuples(st.just(s), router_logits(s[0], s[1], "nonfinite"))))
def test_every_method_gives_distinct_in_range_ids(case):
    (m, e, k), x = case
    rs = [softmax_topk(x, k), softmax_topk(x, k, renormalize=True), sigmoid_topk(x, k), topk_softmax(x, k),
          biased_topk(x, k, np.linspace(-1, 1, e))]
    if e % 2 == 0 and e >= 4 and k <= e // 2:
        rs.append(grouped_topk(x, k, 2, 1, bias=np.zeros(e), scoring="sigmoid"))
    for r in rs:
        assert r.ids.shape == (m, k) and r.weights.shape == (m, k) and r.weights.dtype == np.float32
        assert ((r.ids >= 0) & (r.ids < e)).all()
        assert all(len(set(row)) == k for row in r.ids.tolist())


@given(shapes(), st.data())
def test_tie_policy_with_constructed_ties(shape, data):
    """The tied experts share the top value; the k winners are the k lowest tied ids."""
    m, e, k = shape
    tied = sorted(data.draw(st.lists(st.integers(0, e - 1), min_size=k, max_size=e, unique=True)))
    x = np.full((m, e), -1.0)
    x[:, tied] = 2.0
    for method in ("softmax_topk", "sigmoid_topk", "topk_softmax"):
        assert route(x, k, method).ids.tolist() == [tied[:k]] * m
    assert biased_topk(x, k, np.zeros(e)).ids.tolist() == [tied[:k]] * m


@given(shapes(), st.data(), st.integers(-64, 64))
def test_softmax_routing_is_shift_invariant(shape, data, shift):
    """Adding c to a token's logits changes nothing (all-negative logits: FlashInfer #2822). Logits
    on a 1/8 grid and integer c keep x + c exact, so results must be bit-identical."""
    m, e, k = shape
    x = data.draw(router_logits(m, e))
    c = data.draw(st.lists(st.integers(-64, 64), min_size=m, max_size=m))
    y = (x + np.array(c, dtype=np.float32)[:, None] + np.float32(shift)).astype(np.float32)
    assert (y.astype(np.float64) == x.astype(np.float64) + np.array(c)[:, None] + shift).all()  # exact
    for f in (lambda z: softmax_topk(z, k), lambda z: softmax_topk(z, k, renormalize=True),
              lambda z: topk_softmax(z, k)):
        a, b = f(x), f(y)
        assert a.ids.tolist() == b.ids.tolist()
        np.testing.assert_array_equal(a.weights, b.weights)


@given(shapes(), st.data())
def test_routing_is_equivariant_to_token_permutation(shape, data):
    m, e, k = shape
    x = data.draw(router_logits(m, e, data.draw(st.sampled_from(["grid", "tied_logits", "nonfinite"]))))
    perm = np.array(data.draw(st.permutations(range(m))))
    bias = data.draw(biases(e))
    calls = [lambda z: softmax_topk(z, k), lambda z: sigmoid_topk(z, k, renormalize=True),
             lambda z: topk_softmax(z, k), lambda z: biased_topk(z, k, bias, scoring="sigmoid")]
    if k == 1:
        calls.append(lambda z: llama4_top1(z))
    if e % 2 == 0 and e >= 4 and k <= e // 2:
        calls.append(lambda z: grouped_topk(z, k, 2, 1, scoring="sigmoid", bias=bias, renormalize=True))
    for f in calls:
        a, b = f(x), f(x[perm])
        assert b.ids.tolist() == a.ids[perm].tolist()
        np.testing.assert_array_equal(b.weights, a.weights[perm])


@given(shapes(), st.data())
def test_renormalized_softmax_equals_topk_softmax(shape, data):
    """vLLM Renormalize (softmax -> topk -> renorm) and FlashInfer Renormalize (topk -> softmax)
    agree in exact arithmetic; the weights sum to 1."""
    m, e, k = shape
    x = data.draw(router_logits(m, e, data.draw(st.sampled_from(["grid", "tied_logits", "negative_logits"]))))
    a, b = softmax_topk(x, k, renormalize=True), topk_softmax(x, k)
    assert a.ids.tolist() == b.ids.tolist()
    np.testing.assert_allclose(a.weights, b.weights, rtol=2e-7)
    np.testing.assert_allclose(a.weights.astype(np.float64).sum(1), 1.0, rtol=1e-6)
    full = softmax_topk(x, k)  # unnormalized weights: same ids, proportional weights
    assert full.ids.tolist() == a.ids.tolist()
    np.testing.assert_allclose(full.weights / full.weights.sum(1, keepdims=True), a.weights, rtol=1e-6)


@given(shapes(), st.data(), st.sampled_from(["softmax", "sigmoid"]))
def test_single_group_grouped_topk_is_biased_topk(shape, data, scoring):
    """grouped_topk with one group masks nothing: it must equal biased_topk (or the plain method)."""
    m, e, k = shape
    x = data.draw(router_logits(m, e, "tied_logits"))
    if e >= 2:
        bias = data.draw(biases(e))
        g = grouped_topk(x, k, 1, 1, scoring=scoring, bias=bias, renormalize=True, routed_scaling_factor=2.5)
        b = biased_topk(x, k, bias, scoring=scoring, renormalize=True, routed_scaling_factor=2.5)
        assert g.ids.tolist() == b.ids.tolist()
        np.testing.assert_array_equal(g.weights, b.weights)
    g = grouped_topk(x, k, 1, 1, scoring=scoring)
    plain = softmax_topk(x, k) if scoring == "softmax" else sigmoid_topk(x, k)
    assert g.ids.tolist() == plain.ids.tolist()
    np.testing.assert_allclose(g.weights, plain.weights, rtol=2e-7)


@given(st.integers(1, 6), st.sampled_from([2, 4]), st.data())
def test_grouped_topk_only_selects_from_kept_groups(m, n_group, data):
    group_size = data.draw(st.integers(2, 4))
    e = n_group * group_size
    topk_group = data.draw(st.integers(1, n_group))
    k = data.draw(st.integers(1, topk_group * group_size))
    x = data.draw(router_logits(m, e, "negative_logits"))
    bias = data.draw(biases(e))
    r = grouped_topk(x, k, n_group, topk_group, scoring="sigmoid", bias=bias)
    s = 1.0 / (1.0 + np.exp(-x.astype(np.float64))) + bias
    for t in range(m):
        gs = [sorted(s[t, g * group_size:(g + 1) * group_size])[-2:] for g in range(n_group)]
        gscore = [a + b for a, b in gs]
        kept = oracle_order(gscore)[:topk_group]
        assert {int(i) // group_size for i in r.ids[t]} <= set(kept)


@given(st.integers(1, 64), st.integers(1, 9), st.sampled_from(["linear", "round_robin"]), st.integers(0, 2))
def test_ep_maps_partition_the_experts(e, ep_size, strategy, shared):
    maps = [expert_map(e, ep_size, r, strategy, shared) for r in range(ep_size)]
    owner = np.stack([m[:e] >= 0 for m in maps])
    assert (owner.sum(0) == 1).all()  # every routed expert lives on exactly one rank
    sizes = owner.sum(1)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == e
    assert sizes.tolist() == sorted(sizes.tolist(), reverse=True)  # extras on the first ranks
    for r, m in enumerate(maps):
        local = m[m >= 0]
        assert sorted(local.tolist()) == list(range(local.size))
        assert m[e:].tolist() == list(range(int(sizes[r]), int(sizes[r]) + shared))
        if strategy == "linear":
            g = np.flatnonzero(m[:e] >= 0)
            assert (np.diff(g) == 1).all() and (m[g] == np.arange(g.size)).all()


@settings(max_examples=25)
@given(st.integers(2, 64).flatmap(lambda e: ep_shards(e, max_ep_size=8)))
def test_ep_shard_strategy_shrinks_to_valid_maps(shard):
    assert shard.expert_map.dtype == np.int32 and 0 <= shard.ep_rank < shard.ep_size


# ------------------------------------------------------------------------------------------------
# the strategies themselves


from hypothesis import find  # noqa: E402

from moeref.strategies import ROUTING_KINDS, alignments, routings, token_counts  # noqa: E402


@given(routings(allow_zero_tokens=True))
def test_routings_satisfy_the_topk_ids_contract(case):
    from moeref.routing import check_topk_ids

    ids = check_topk_ids(case.ids, case.num_experts)
    assert ids.dtype == np.int32 and ids.shape == (case.num_tokens, case.top_k)
    assert case.weights.dtype == np.float32 and case.weights.shape == ids.shape
    pad = (ids < 0).all(axis=1)
    assert ((ids < 0).any(axis=1) == pad).all()  # padding is whole tokens
    assert int(pad.sum()) == case.num_padding and (case.weights[pad] == 0).all()
    assert case.kind in ROUTING_KINDS
    if case.logits is not None:
        assert case.logits.shape == (case.num_tokens, case.num_experts)
    if case.kind == "negative_bias":
        assert case.bias.shape == (case.num_experts,)


@given(routings(kinds=("all_to_one",)))
def test_all_to_one_sends_every_token_to_the_same_experts(case):
    rows = {tuple(r) for r in case.ids.tolist() if r[0] >= 0}
    assert len(rows) <= 1


@given(routings(kinds=("hot1",)))
def test_hot1_has_an_expert_in_every_token(case):
    rows = [set(r) for r in case.ids.tolist() if r[0] >= 0]
    if rows:
        assert set.intersection(*rows)


# ``hypothesis.find`` shrinks from random starting points and is not guaranteed to reach the
# globally smallest case: under a randomised profile (``dev``) the third search below returned a
# larger case in two of four runs. Shrink quality is a property of the strategies' *order*, so it
# is tested derandomised, with the phases named (generate, then shrink): with the default phases
# the first search returned a 'skewed_logits' case whenever moeref.quant had been imported first
# (test-order dependent), with these it returns the smallest case in every order tried.
_FIND = settings(derandomize=True, database=None, max_examples=200,
                 phases=[Phase.generate, Phase.shrink])


def test_strategies_shrink_to_the_smallest_case():
    c = find(routings(), lambda c: True, settings=_FIND)
    assert (c.num_tokens, c.num_experts, c.top_k, c.kind, c.ids.tolist()) == (1, 1, 1, "uniform", [[0]])
    c = find(routings(), lambda c: c.num_padding > 0, settings=_FIND)
    assert (c.num_tokens, c.num_experts, c.top_k, c.ids.tolist()) == (1, 1, 1, [[-1]])
    c = find(routings(), lambda c: c.top_k >= 2 and len({int(i) for i in c.ids.reshape(-1) if i >= 0}) >= 3,
             settings=_FIND)
    assert (c.num_tokens, c.num_experts, c.top_k) in ((2, 3, 2), (1, 3, 3))
    assert find(token_counts(block=128, large=True), lambda n: True, settings=_FIND) == 1
    assert find(token_counts(allow_zero=True), lambda n: True, settings=_FIND) == 0
    assert find(alignments(), lambda a: True, settings=_FIND) == 32


@given(routings(kinds=("repeated_experts",), allow_padding=False, top_k=2,
                num_experts=st.integers(2, 4)))
def test_repeated_experts_kind_repeats_an_expert(case):
    assert case.ids[0, 0] == case.ids[0, 1]


def test_unknown_kinds_raise():
    from moeref.strategies import router_logits

    with pytest.raises(ValueError, match="unknown kind.*'typo'.*accepted: grid, tied_logits"):
        router_logits(2, 4, "typo")
    with pytest.raises(ValueError, match="unknown kind.*'bogus'.*accepted: uniform"):
        routings(kinds=("bogus",))
    with pytest.raises(ValueError, match="at least one kind"):
        routings(kinds=())
    # a single name is one kind, not a sequence of letters
    assert find(routings(kinds="hot1"), lambda c: True, settings=_FIND).kind == "hot1"


@given(token_counts(max_tokens=4, block=128, large=True))
def test_token_counts_cover_boundaries(n):
    assert 1 <= n <= 4 or 126 <= n <= 130 or n in (4095, 4096, 4097)
