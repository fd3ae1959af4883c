"""Routing references against hand-derived values and per-token oracles written here from the
published definitions (vLLM fused_topk / grouped_topk, gpt-oss topk->softmax, Llama 4)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from moeref.routing import (
    LIBRARY_METHOD_NAMES,
    Routing,
    biased_topk,
    check_expert_map,
    check_topk_ids,
    expert_map,
    grouped_topk,
    llama4_top1,
    local_expert_ids,
    route,
    route_as,
    sigmoid_topk,
    softmax_topk,
    stable_topk,
    to_local_ids,
    topk_softmax,
    with_padding,
)

# ------------------------------------------------------------------------------------------------
# oracles (Python floats, one token at a time)


def rank_key(value: float, idx: int):
    """The declared order as a Python sort key: NaN last, then by value descending, then id."""
    return (1, 0.0, idx) if math.isnan(value) else (0, -value, idx)


def oracle_topk(row, k):
    return sorted(range(len(row)), key=lambda i: rank_key(float(row[i]), i))[:k]


def oracle_softmax(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    s = sum(e)
    return [v / s for v in e]


def oracle_sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def oracle_grouped(row, k, n_group, topk_group, scoring, bias, renorm, scale):
    """DeepSeek-V3 grouped top-k for one token, straight from vLLM grouped_topk (masked = -inf)."""
    s = oracle_softmax(row) if scoring == "softmax" else [oracle_sigmoid(v) for v in row]
    c = [s[i] + (bias[i] if bias is not None else 0.0) for i in range(len(row))]
    size = len(row) // n_group
    gscore = []
    for g in range(n_group):
        vals = sorted(c[g * size:(g + 1) * size], reverse=True)
        gscore.append(vals[0] + vals[1] if bias is not None else vals[0])
    kept = oracle_topk(gscore, topk_group)
    masked = [c[i] if (i // size) in kept else -math.inf for i in range(len(row))]
    ids = oracle_topk(masked, k)
    w = [s[i] for i in ids]
    if renorm:
        tot = sum(w)
        w = [v / tot for v in w]
    return ids, [v * scale for v in w]


def check(r: Routing, ids, weights, rtol=2e-7):
    assert r.ids.tolist() == ids
    np.testing.assert_allclose(r.weights, np.array(weights, dtype=np.float64), rtol=rtol, atol=0)
    assert r.weights.dtype == np.float32


# ------------------------------------------------------------------------------------------------
# stable top-k and the tie / NaN policy


def test_stable_topk_matches_sort_oracle_with_ties_and_specials():
    rng = np.random.default_rng(1)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 1.0, -1.0])
    x = rng.choice(specials, size=(64, 8))
    for k in (1, 3, 8):
        got = stable_topk(x, k)
        want = [oracle_topk(list(row), k) for row in x]
        assert got.tolist() == want


def test_tie_lower_id_wins_and_zero_signs_tie():
    assert stable_topk(np.array([[5.0, 7.0, 7.0, 7.0]]), 2).tolist() == [[1, 2]]
    assert stable_topk(np.array([[-0.0, 0.0]]), 1).tolist() == [[0]]
    assert stable_topk(np.array([[0.0, -0.0]]), 1).tolist() == [[0]]


def test_nan_ranks_below_minus_inf_and_ids_never_repeat():
    x = np.array([[np.nan, 1.0, np.nan, -np.inf]])
    assert stable_topk(x, 4).tolist() == [[1, 3, 0, 2]]
    allnan = np.full((2, 5), np.nan)
    assert stable_topk(allnan, 3).tolist() == [[0, 1, 2], [0, 1, 2]]
    allneg = np.full((1, 4), -np.inf)  # vllm-omni PR #7175: must not return duplicates
    assert stable_topk(allneg, 4).tolist() == [[0, 1, 2, 3]]


def test_exclude_ranks_below_nan():
    x = np.array([[3.0, np.nan, 2.0, 1.0]])
    ex = np.array([[True, False, True, False]])
    assert stable_topk(x, 3, exclude=ex).tolist() == [[3, 1, 0]]


# ------------------------------------------------------------------------------------------------
# methods vs oracles


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_matches_oracle_on_tied_logits(renormalize):
    rng = np.random.default_rng(2)
    x = rng.integers(-3, 3, size=(40, 12)).astype(np.float32)  # many exact ties
    r = softmax_topk(x, 4, renormalize=renormalize)
    for t in range(x.shape[0]):
        row = [float(v) for v in x[t]]
        ids = oracle_topk(row, 4)
        p = oracle_softmax(row)
        w = [p[i] for i in ids]
        if renormalize:
            w = [v / sum(w) for v in w]
        check(Routing(r.weights[t:t + 1], r.ids[t:t + 1]), [ids], [w])


def test_hand_values():
    # softmax([0, 2, 1, 2]) = [1, e^2, e, e^2] / (1 + 2e^2 + e); tie 1 vs 3 -> [1, 3]
    d = 1 + 2 * math.e**2 + math.e
    check(softmax_topk(np.array([[0.0, 2.0, 1.0, 2.0]]), 2), [[1, 3]], [[math.e**2 / d] * 2])
    check(softmax_topk(np.array([[0.0, 2.0, 1.0, 2.0]]), 2, renormalize=True), [[1, 3]], [[0.5, 0.5]])
    check(topk_softmax(np.array([[0.0, math.log(3.0), -5.0]]), 2), [[1, 0]], [[0.75, 0.25]])
    check(sigmoid_topk(np.array([[0.0, -1.0, 2.0]]), 2), [[2, 0]], [[oracle_sigmoid(2.0), 0.5]])
    check(llama4_top1(np.array([[-1.0, 3.0, 3.0]])), [[1]], [[oracle_sigmoid(3.0)]])


def test_softmax_nonfinite_policy():
    # +inf: limit softmax, uniform over the +inf entries
    check(softmax_topk(np.array([[np.inf, 0.0, np.inf]]), 2), [[0, 2]], [[0.5, 0.5]])
    check(softmax_topk(np.array([[np.inf, 0.0, np.inf]]), 3), [[0, 2, 1]], [[0.5, 0.5, 0.0]])
    r = softmax_topk(np.array([[-np.inf, -np.inf]]), 1)  # all -inf: 0/0
    assert r.ids.tolist() == [[0]] and np.isnan(r.weights).all()
    r = softmax_topk(np.array([[np.nan, 1.0, 0.0]]), 2)  # NaN row: NaN weights, numbers first
    assert r.ids.tolist() == [[1, 2]] and np.isnan(r.weights).all()
    r = sigmoid_topk(np.array([[np.nan, np.inf, -np.inf]]), 3)
    assert r.ids.tolist() == [[1, 2, 0]]
    assert r.weights[0, :2].tolist() == [1.0, 0.0] and np.isnan(r.weights[0, 2])


def test_biased_topk_all_negative_scores_and_unbiased_weights():
    x = np.array([[0.0, 1.0, 2.0, -1.0]])
    bias = np.array([-3.0, -2.5, -4.0, -0.5])  # s + bias < 0 everywhere
    s = [oracle_sigmoid(v) for v in x[0]]
    c = [s[i] + bias[i] for i in range(4)]
    ids = oracle_topk(c, 2)
    assert ids == [3, 1]
    check(biased_topk(x, 2, bias, scoring="sigmoid"), [ids], [[s[3], s[1]]])
    tot = s[3] + s[1]
    check(biased_topk(x, 2, bias, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5),
          [ids], [[2.5 * s[3] / tot, 2.5 * s[1] / tot]])


@pytest.mark.parametrize("scoring,use_bias", [("softmax", False), ("sigmoid", True), ("softmax", True)])
def test_grouped_topk_matches_oracle(scoring, use_bias):
    rng = np.random.default_rng(3)
    x = (rng.integers(-16, 16, size=(30, 16)) / 4.0).astype(np.float32)
    bias = rng.integers(-8, 8, size=16) / 8.0 if use_bias else None
    r = grouped_topk(x, 4, 4, 2, scoring=scoring, bias=bias, renormalize=True, routed_scaling_factor=2.5)
    for t in range(x.shape[0]):
        ids, w = oracle_grouped([float(v) for v in x[t]], 4, 4, 2, scoring,
                                None if bias is None else list(bias), True, 2.5)
        assert r.ids[t].tolist() == ids, t
        np.testing.assert_allclose(r.weights[t], w, rtol=3e-7)


def test_grouped_topk_masked_group_never_wins_with_negative_scores():
    # Group 0 = experts 0,1 ; group 1 = experts 2,3. Biased scores are all negative. Group 1 has
    # the better top-2 sum, so group 0 is dropped. Masking with 0.0 (old HF/SGLang) would pick
    # expert 0 or 1 (0 > negative); -inf masking picks from {2, 3} only.
    x = np.zeros((1, 4))
    bias = np.array([-3.0, -3.0, -1.0, -2.0])
    r = grouped_topk(x, 2, 2, 1, scoring="sigmoid", bias=bias)
    assert r.ids.tolist() == [[2, 3]]


def test_grouped_topk_group_tie_lower_group_wins():
    x = np.array([[1.0, 0.0, 0.0, 1.0, 0.5, 0.5]])  # group max: 1, 1, 0.5 -> groups 0 and 1 tie
    r = grouped_topk(x, 1, 3, 1)
    assert r.ids.tolist() == [[0]]


def test_route_dispatch_and_unused_options():
    x = np.array([[1.0, 3.0, 2.0, 0.0]])
    assert route(x, 2, "softmax_topk", renormalize=True).ids.tolist() == [[1, 2]]
    assert route(x, 2, "grouped_topk", n_group=2, topk_group=1).ids.tolist() == [[1, 0]]
    with pytest.raises(ValueError, match="bias"):
        route(x, 2, "softmax_topk", bias=np.zeros(4))
    with pytest.raises(ValueError, match="renormalize"):
        route(x, 2, "topk_softmax", renormalize=True)
    with pytest.raises(ValueError, match="n_group"):
        route(x, 2, "grouped_topk")
    with pytest.raises(ValueError, match="unknown method"):
        route(x, 2, "Renormalize")
    assert route(x, 2, "topk_softmax", ids_dtype=np.int64).ids.dtype == np.int64


def test_library_names():
    assert LIBRARY_METHOD_NAMES[("vllm", "Renormalize")] == LIBRARY_METHOD_NAMES[("flashinfer", "RenormalizeNaive")]
    assert LIBRARY_METHOD_NAMES[("flashinfer", "Renormalize")].method == "topk_softmax"
    assert LIBRARY_METHOD_NAMES[("vllm", "Renormalize")] != LIBRARY_METHOD_NAMES[("flashinfer", "Renormalize")]
    assert LIBRARY_METHOD_NAMES[("vllm", "Default")] == LIBRARY_METHOD_NAMES[("flashinfer", "Default")]
    x = np.array([[0.0, 2.0, 1.0]])
    assert route_as("flashinfer", "Renormalize", x, 2).weights.sum() == pytest.approx(1.0)
    r = route_as("vllm", "DeepSeekV3", np.zeros((1, 4)), 2, n_group=2, topk_group=1, bias=np.array([0, 1, 0, 0.5]))
    assert r.ids.tolist() == [[1, 0]]
    with pytest.raises(ValueError, match="fixes"):
        route_as("vllm", "Renormalize", x, 2, renormalize=False)
    with pytest.raises(ValueError, match="unknown library"):
        route_as("vllm", "Nope", x, 2)


def test_with_padding():
    r = with_padding(softmax_topk(np.array([[1.0, 0.0], [0.0, 1.0]]), 1), np.array([True, False]))
    assert r.ids.tolist() == [[0], [-1]] and r.weights[1, 0] == 0.0
    with pytest.raises(ValueError, match="valid_rows"):
        with_padding(r, np.array([1, 0]))


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: softmax_topk(np.zeros((2, 4)), 5), ValueError, "top_k must be <= num_experts"),
        (lambda: softmax_topk(np.zeros((2, 4)), 0), ValueError, "top_k"),
        (lambda: softmax_topk(np.zeros(4), 1), ValueError, "dimension"),
        (lambda: softmax_topk(np.zeros((2, 4), dtype=np.int32), 1), TypeError, "floating"),
        (lambda: biased_topk(np.zeros((2, 4)), 1, np.zeros(3)), ValueError, "bias must have shape"),
        (lambda: softmax_topk(np.zeros((2, 4)), 1, ids_dtype=np.int16), TypeError, "ids_dtype"),
        (lambda: grouped_topk(np.zeros((2, 6)), 1, 4, 1), ValueError, "divisible"),
        (lambda: grouped_topk(np.zeros((2, 8)), 1, 4, 5), ValueError, "topk_group"),
        (lambda: grouped_topk(np.zeros((2, 8)), 5, 4, 2), ValueError, "exceeds"),
        (lambda: grouped_topk(np.zeros((2, 4)), 1, 4, 1, bias=np.zeros(4)), ValueError, "top-2"),
        (lambda: llama4_top1(np.zeros((2, 4)), 2), ValueError, "top_k"),
        (lambda: biased_topk(np.zeros((1, 2)), 1, np.zeros(2), routed_scaling_factor=0.0), ValueError, "routed"),
        (lambda: biased_topk(np.zeros((1, 2)), 1, np.zeros(2), scoring="tanh"), ValueError, "scoring"),
    ],
)
def test_bad_routing_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_zero_tokens():
    x = np.zeros((0, 8), dtype=np.float32)
    for r in (softmax_topk(x, 2), softmax_topk(x, 2, renormalize=True), sigmoid_topk(x, 2), topk_softmax(x, 2),
              biased_topk(x, 2, np.zeros(8)), grouped_topk(x, 2, 4, 2, bias=np.zeros(8)), grouped_topk(x, 2, 4, 2)):
        assert r.ids.shape == (0, 2) and r.weights.shape == (0, 2) and r.ids.dtype == np.int32
    assert llama4_top1(x).ids.shape == (0, 1)


def test_bf16_logits_are_exact():
    import ml_dtypes

    x = np.array([[1.0, 1.0078125, 1.0]], dtype=ml_dtypes.bfloat16)  # distinct bf16 values
    assert softmax_topk(x, 1).ids.tolist() == [[1]]


# ------------------------------------------------------------------------------------------------
# topk_ids validation


def test_check_topk_ids_messages():
    with pytest.raises(ValueError, match=r"topk_ids\[1, 0\] = 7 is out of range"):
        check_topk_ids(np.array([[0, 1], [7, 2]], dtype=np.int32), 4)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\] = -2"):
        check_topk_ids(np.array([[0, -2]], dtype=np.int64), 4)
    # an expert repeated within a row is accepted (each slot its own row)
    assert check_topk_ids(np.array([[0, 1, 2], [3, 1, 3]], dtype=np.int32), 4).tolist()[1] == [3, 1, 3]
    with pytest.raises(TypeError, match="dtype"):
        check_topk_ids(np.array([[0.0]]), 4)
    with pytest.raises(ValueError, match="dimension"):
        check_topk_ids(np.array([0, 1], dtype=np.int32), 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)$"):
        check_topk_ids(np.array([[-1]], dtype=np.int32), 4, allow_padding=False)
    # repeated -1 (padding) is fine
    assert check_topk_ids(np.array([[-1, -1]], dtype=np.int32), 4).shape == (1, 2)


# ------------------------------------------------------------------------------------------------
# expert maps (vLLM determine_expert_map)


def test_expert_map_linear_remainder_goes_to_first_ranks():
    maps = [expert_map(10, 4, r) for r in range(4)]
    owned = [np.flatnonzero(m >= 0).tolist() for m in maps]
    assert owned == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    for m in maps:
        assert m.dtype == np.int32
        assert sorted(m[m >= 0].tolist()) == list(range((m >= 0).sum()))


def test_expert_map_round_robin_and_shared():
    m = expert_map(10, 4, 1, "round_robin")
    assert np.flatnonzero(m >= 0).tolist() == [1, 5, 9] and m[[1, 5, 9]].tolist() == [0, 1, 2]
    m = expert_map(4, 2, 1, "linear", num_shared_experts=2)
    assert m.tolist() == [-1, -1, 0, 1, 2, 3]
    assert local_expert_ids(m).tolist() == [2, 3, 4, 5]
    assert expert_map(3, 1, 0).tolist() == [0, 1, 2]
    assert expert_map(2, 4, 3).tolist() == [-1, -1]  # more ranks than experts: empty rank


def test_expert_map_bad_input():
    with pytest.raises(ValueError, match="ep_rank"):
        expert_map(8, 2, 2)
    with pytest.raises(ValueError, match="strategy"):
        expert_map(8, 2, 0, "random")
    with pytest.raises(ValueError, match="length num_experts=8; got length 7"):
        check_expert_map(np.zeros(7, dtype=np.int32), 8)
    with pytest.raises(ValueError, match=r"global experts \[0, 2\] to the same local id 0"):
        check_expert_map(np.array([0, 1, 0, -1], dtype=np.int32), 4)
    with pytest.raises(ValueError, match=r"expert_map\[1\] = -3"):
        check_expert_map(np.array([0, -3], dtype=np.int32), 2)
    with pytest.raises(ValueError, match=r"expert_map\[1\] = 3: local ids must be 0..2"):
        check_expert_map(np.array([0, 3, -1, 1], dtype=np.int32), 4)


def test_to_local_ids():
    m = np.array([-1, 0, -1, 1], dtype=np.int32)
    ids = np.array([[3, 0], [-1, 1]], dtype=np.int32)
    assert to_local_ids(ids, m).tolist() == [[1, -1], [-1, 0]]
