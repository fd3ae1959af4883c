"""Drawn cases (issue 32): draw_cases(24) used to give seven identical 3-token cases and three with one token,
one expert, top-1, never more than 24 tokens (a kernel's tile bug dropped everything and was caught trivially).
The spread now covers token counts that give an expert several tiles, several expert counts, every top-k and
every routing kind, distinct and deterministic."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from moeref.testing import draw_cases, moe_cases
from moeref.testing.cases import CASE_KINDS


def _rows_per_expert(ki) -> np.ndarray:
    ids = ki.topk_ids[ki.topk_ids >= 0]
    return np.bincount(ids, minlength=ki.w13.shape[0])


def _sizes(ki):  # read off the arrays, not the meta the code under test writes
    return ki.hidden.shape[0], ki.w13.shape[0], ki.topk_ids.shape[1]


def test_draw_cases_are_distinct_and_spread_over_sizes_kinds_and_tiles():
    cases = draw_cases(24)
    sizes = [_sizes(c) + (c.meta["routing"],) for c in cases]
    assert len(set(sizes)) == 24  # no two alike
    tokens = sorted(s[0] for s in sizes)
    assert len(set(tokens)) == 24 and tokens[0] <= 4 and tokens[-1] >= 200 and tokens[-1] <= 256
    assert sum(t > 64 for t in tokens) >= 8  # a third of the cases beyond four 16-row tiles of tokens
    assert len({s[1] for s in sizes}) >= 5 and {s[2] for s in sizes} == {1, 2, 3, 4}
    assert {s[3] for s in sizes} == set(CASE_KINDS)
    busiest = [int(_rows_per_expert(c).max()) for c in cases]
    assert sum(b >= 3 * 16 for b in busiest) >= 8  # an expert with three or more full 16-row tiles
    assert sum(b % 16 not in (0,) for b in busiest) >= 20  # a partial last tile
    for c in cases:  # the layer's shapes agree and every id is an expert of the layer
        m, e, k = _sizes(c)
        assert c.topk_weights.shape == (m, k) and c.w2.shape[0] == e and c.w13.shape[2] == c.hidden.shape[1]
        assert np.all((c.topk_ids >= 0) & (c.topk_ids < e))
        assert all(len(set(row)) == k for row in c.topk_ids.tolist())  # distinct experts per token


def test_draw_cases_is_deterministic_and_seeded():
    a, b, c = draw_cases(6), draw_cases(6), draw_cases(6, seed=1)
    for x, y in zip(a, b):
        assert x.meta == y.meta and np.array_equal(x.topk_ids, y.topk_ids)
        assert np.array_equal(x.hidden.view(np.uint16), y.hidden.view(np.uint16))
    assert [x.meta for x in a] != [x.meta for x in c]


def test_max_tokens_reaches_thousands_of_rows():
    cases = draw_cases(8, max_tokens=4096)
    tokens = [c.hidden.shape[0] for c in cases]
    assert max(tokens) <= 4096 and sum(t >= 1000 for t in tokens) >= 3
    assert max(int(_rows_per_expert(c).max()) for c in cases) >= 8 * 128  # eight 128-row tiles of one expert
    small = draw_cases(5, max_tokens=3, max_experts=1, max_top_k=1)
    assert [_sizes(c) for c in small] == [(1, 1, 1), (1, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]


def test_draw_cases_from_a_strategy_are_distinct():
    cases = draw_cases(10, moe_cases(max_tokens=24))
    assert len({repr(c) for c in cases}) == 10


def test_bad_choices_name_what_is_accepted():
    with pytest.raises(ValueError, match="unknown routing kind 'zipfian'; accepted: 'uniform', 'hot1'"):
        draw_cases(2, kinds=("uniform", "zipfian"))
    with pytest.raises(ValueError, match="max_tokens must be > 0; got 0"):
        draw_cases(2, max_tokens=0)


@settings(max_examples=15, deadline=None)
@given(moe_cases(max_tokens=300, allow_padding=True))
def test_moe_cases_draws_consistent_layer_calls(ki):
    m, e, k = _sizes(ki)
    assert 1 <= m <= 300 and 1 <= k <= min(4, e) and e <= 8
    assert ki.topk_ids.shape == ki.topk_weights.shape == (m, k)
    assert np.all((ki.topk_ids >= -1) & (ki.topk_ids < e))
    pad = np.all(ki.topk_ids == -1, axis=1)
    assert np.all(ki.topk_weights[pad] == 0) and not np.any(ki.topk_ids[~pad] == -1)


def test_repeated_experts_are_drawn_only_when_named():
    cases = draw_cases(4, kinds=("repeated_experts",), max_experts=3, max_top_k=2)
    two = [c for c in cases if c.topk_ids.shape[1] == 2]
    assert two and all(c.topk_ids[0, 0] == c.topk_ids[0, 1] for c in two)  # token 0 picks one expert twice
    assert all(len(set(row)) == len(row) for c in draw_cases(24) for row in c.topk_ids.tolist())
