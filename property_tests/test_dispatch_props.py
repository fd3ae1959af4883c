"""Properties of the dispatch layouts over drawn routings (uniform, hot, all-to-one, Zipf, empty
experts, tied/negative/non-finite logits, padding tokens), EP shards and alignments.

Values are on exact grids (hidden: multiples of 1/8, weights: multiples of 1/64, expert factors:
small integers) so every float64 sum below is exact and results are compared bit for bit."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moeref.dispatch import (
    LAYOUTS,
    SlotRows,
    cutlass_moe_mm_data,
    from_slot_rows,
    moe_align_block_size,
    moe_permute,
    moe_unpermute,
    rows_by_expert,
    group_slots,
    to_batched,
    to_contiguous,
    to_masked,
    to_slot_rows,
    weight_and_reduce,
)
from moeref.routing import to_local_ids
from moeref.strategies import OPT_IN_KINDS, ROUTING_KINDS, alignments, ep_shards, routings

# every distribution, the opt-in repeated-expert routings included (each slot is its own row)
ALL_KINDS = ROUTING_KINDS + OPT_IN_KINDS


def batched_capacity(ids, num_experts, emap=None) -> int:
    """Rows per expert of the batched layout: the tokens (vLLM's sizing), or more when a token
    repeats an expert (each slot is a row; moeref.dispatch.batched)."""
    return max(1, ids.shape[0], int(group_slots(ids, num_experts, emap).counts.max(initial=0)))

K = 3  # hidden size: rows are moved, never mixed, so a small K loses nothing


def hidden_for(case, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(-64, 64, size=(case.num_tokens, K)) / 8.0).astype(np.float32)


def grid_weights(case):
    """The case's weights snapped to the 1/64 grid (NaN from non-finite logits -> 0.5), so that the
    float64 sums below are exact; the dispatch properties do not depend on the weight values."""
    w = np.nan_to_num(case.weights.astype(np.float64), nan=0.5, posinf=1.0, neginf=0.0)
    return (np.round(w * 64) / 64).astype(np.float32)


def expert_fn(rows, src, case, emap=None):
    """A toy expert: row * (global expert id + 1). Exact on the grid; depends on the expert."""
    flat = case.ids.reshape(-1).astype(np.int64)
    out = np.zeros(rows.shape, dtype=np.float64)
    valid = src >= 0
    out[valid] = rows[valid].astype(np.float64) * (flat[src[valid]] + 1)[:, None]
    return out


def oracle_output(case, h, local_mask=None):
    """sum_j w[t, j] * h[t] * (id + 1) over present slots, by a Python loop."""
    W = grid_weights(case)
    out = np.zeros((case.num_tokens, K))
    for t in range(case.num_tokens):
        for j in range(case.top_k):
            g = int(case.ids[t, j])
            if g >= 0 and (local_mask is None or local_mask[g]):
                out[t] += float(W[t, j]) * h[t].astype(np.float64) * (g + 1)
    return out


def oracle_groups(case, emap=None):
    """Per local expert, the sorted slots routed to it (Python loop)."""
    n_local = case.num_experts if emap is None else int((emap >= 0).sum())
    groups = [[] for _ in range(n_local)]
    for s, g in enumerate(case.ids.reshape(-1).tolist()):
        if g >= 0:
            loc = g if emap is None else int(emap[g])
            if loc >= 0:
                groups[loc].append(s)
    return groups


routing_and_shard = routings(allow_zero_tokens=True, kinds=ALL_KINDS).flatmap(
    lambda c: st.tuples(st.just(c), st.one_of(st.none(), ep_shards(c.num_experts, max_ep_size=4)))
)


@given(routing_and_shard)
def test_grouping_preserves_each_experts_multiset_and_counts(case_shard):
    case, shard = case_shard
    emap = None if shard is None else shard.expert_map
    g = group_slots(case.ids, case.num_experts, emap)
    want = oracle_groups(case, emap)
    assert [r.tolist() for r in rows_by_expert(g)] == want
    assert g.counts.tolist() == [len(w) for w in want]
    assert g.offsets[-1] == sum(len(w) for w in want)
    assert sorted(g.order.tolist()) == list(range(case.num_tokens * case.top_k))  # a permutation


@given(routing_and_shard)
def test_unpermute_of_permute_is_the_weighted_identity(case_shard):
    case, shard = case_shard
    emap = None if shard is None else shard.expert_map
    h = hidden_for(case)
    p = moe_permute(h, case.ids, case.num_experts, emap)
    out = moe_unpermute(p.hidden, grid_weights(case), p.inv_permuted_idx, p.expert_first_token_offset, out_dtype=np.float64)
    local = None if emap is None else emap[: case.num_experts] >= 0
    present = (case.ids >= 0) & (True if local is None else local[np.maximum(case.ids, 0)])
    want = (grid_weights(case).astype(np.float64) * present).sum(1, keepdims=True) * h.astype(np.float64)
    np.testing.assert_array_equal(out, want)
    # sentinels are exact
    n = int(p.expert_first_token_offset[-1])
    assert (p.permuted_idx[n:] == case.num_tokens * case.top_k).all()
    assert (p.hidden[n:] == 0).all()
    assert np.sort(p.inv_permuted_idx[~present.reshape(-1)]).tolist() == list(range(n, case.num_tokens * case.top_k))


@given(routing_and_shard, st.sampled_from([1, 2, 3, 4, 16, 64]), st.booleans())
def test_align_blocks_hold_exactly_their_experts_slots(case_shard, block, ignore_invalid):
    case, shard = case_shard
    emap = None if shard is None else shard.expert_map
    ignore = ignore_invalid and emap is not None
    r = moe_align_block_size(case.ids, block, case.num_experts, emap, ignore_invalid_experts=ignore)
    numel = case.num_tokens * case.top_k
    n_post = int(r.num_tokens_post_padded[0])
    assert n_post % block == 0 and n_post <= r.sorted_token_ids.size
    blocks = r.sorted_token_ids[:n_post].reshape(-1, block)
    labels = r.expert_ids[: n_post // block]
    flat = case.ids.reshape(-1)
    seen = []
    for b, lab in zip(blocks.tolist(), labels.tolist()):
        real = [s for s in b if s != numel]
        assert real, "every block holds at least one slot"
        ex = {int(flat[s]) for s in real}
        assert len(ex) == 1  # one expert per block
        g = ex.pop()
        want_label = g if emap is None else int(emap[g])
        assert lab == want_label
        seen += real
    valid = flat >= 0
    if ignore:
        valid &= emap[np.maximum(flat, 0)] >= 0
    assert sorted(seen) == np.flatnonzero(valid).tolist()
    assert (r.sorted_token_ids[n_post:] == numel).all()  # sentinel everywhere else
    assert set(r.sorted_token_ids[:n_post].tolist()) <= set(range(numel + 1))
    assert (r.expert_ids[n_post // block:] == -1).all()


def _all_layouts(case, shard, alignment, rows=None):
    emap = None if shard is None else shard.expert_map
    g = group_slots(case.ids, case.num_experts, emap)
    if rows is None:  # distinct per-slot rows: row of slot s = [s, s, s] + 0.5
        rows = np.repeat(np.arange(case.num_tokens * case.top_k, dtype=np.float32)[:, None], K, axis=1) + 0.5
        rows[g.local_ids < 0] = 0.0
    s = SlotRows(rows, g.local_ids, case.num_tokens, case.top_k, g.num_local_experts)
    params = {"permuted": {}, "contiguous": {"alignment": alignment}, "masked": {},
              "batched": {"max_tokens_per_dispatcher": batched_capacity(case.ids, case.num_experts, emap)}}
    return s, {name: from_slot_rows(s, name, **params[name]) for name in LAYOUTS}, params


@given(routing_and_shard, alignments())
def test_every_layout_converts_to_every_other_without_loss(case_shard, alignment):
    case, shard = case_shard
    s, layouts, params = _all_layouts(case, shard, alignment)
    for name, layout in layouts.items():
        back = to_slot_rows(layout)
        np.testing.assert_array_equal(back.rows, s.rows)
        assert back.local_ids.tolist() == s.local_ids.tolist()
        for target in LAYOUTS:
            conv = to_slot_rows(from_slot_rows(to_slot_rows(layout), target, **params[target]))
            np.testing.assert_array_equal(conv.rows, s.rows)
            assert conv.local_ids.tolist() == s.local_ids.tolist()


@given(routing_and_shard, alignments())
def test_layout_structure_and_sentinels(case_shard, alignment):
    case, shard = case_shard
    emap = None if shard is None else shard.expert_map
    h = hidden_for(case)
    want = oracle_groups(case, emap)
    counts = [len(w) for w in want]
    c = to_contiguous(h, case.ids, case.num_experts, alignment, emap)
    assert c.m_indices.size == sum(-(-n // alignment) * alignment for n in counts)
    pad = c.m_indices < 0
    assert (c.src[pad] == -1).all() and (c.a[pad] == 0).all() and (c.src[~pad] >= 0).all()
    start = 0
    for e, n in enumerate(counts):  # psum: group e starts at align(psum[e-1]) and ends at psum[e]
        assert c.psum[e] == start + n
        assert (c.m_indices[start:start + n] == e).all()
        assert sorted(c.src[start:start + n].tolist()) == want[e]
        assert start % alignment == 0
        start += -(-n // alignment) * alignment
    np.testing.assert_array_equal(c.a[~pad], h[c.src[~pad] // case.top_k])
    m = to_masked(h, case.ids, case.num_experts, expert_map=emap)
    assert m.masked_m.tolist() == counts and m.expected_m > 0
    for e, n in enumerate(counts):
        assert sorted(m.src[e, :n].tolist()) == want[e]
        assert (m.src[e, n:] == -1).all() and (m.a[e, n:] == 0).all()
    b = to_batched(h, case.ids, case.num_experts, batched_capacity(case.ids, case.num_experts, emap),
                   expert_map=emap)
    np.testing.assert_array_equal(b.src[:, : m.max_m], m.src)
    assert (b.src[:, m.max_m:] == -1).all()


@given(routing_and_shard, alignments())
def test_finalize_from_every_layout_equals_the_oracle(case_shard, alignment):
    case, shard = case_shard
    emap = None if shard is None else shard.expert_map
    h = hidden_for(case, 1)
    local = None if emap is None else emap[: case.num_experts] >= 0
    want = oracle_output(case, h, local)
    layouts = {
        "contiguous": to_contiguous(h, case.ids, case.num_experts, alignment, emap),
        "masked": to_masked(h, case.ids, case.num_experts, expert_map=emap),
        "batched": to_batched(h, case.ids, case.num_experts,
                              batched_capacity(case.ids, case.num_experts, emap), expert_map=emap),
    }
    for name, lay in layouts.items():
        y = expert_fn(lay.a.reshape(-1, K), lay.src.reshape(-1), case)
        out = weight_and_reduce(y, lay.src.reshape(-1), grid_weights(case), case.num_tokens, out_dtype=np.float64)
        np.testing.assert_array_equal(out, want, err_msg=name)
    p = moe_permute(h, case.ids, case.num_experts, emap)
    y = expert_fn(p.hidden, p.src, case)
    out = moe_unpermute(y, grid_weights(case), p.inv_permuted_idx, p.expert_first_token_offset, out_dtype=np.float64)
    np.testing.assert_array_equal(out, want)
    d = cutlass_moe_mm_data(case.ids, case.num_experts, 4, K, expert_map=emap)
    from moeref.dispatch import shuffle_rows

    a = shuffle_rows(h, d.a_map)
    out = weight_and_reduce(expert_fn(a, d.src, case), d.src, grid_weights(case), case.num_tokens, out_dtype=np.float64)
    np.testing.assert_array_equal(out, want)


@settings(max_examples=50)
@given(routings(max_tokens=6, kinds=ALL_KINDS), st.integers(1, 4), st.sampled_from(["linear", "round_robin"]))
def test_union_of_ep_shards_equals_the_unsharded_output(case, ep_size, strategy):
    """Sum over ranks of each rank's output = the full output (FlashInfer #3547: offset > 0 shard
    gave zeros), and the ranks' slots partition the present slots."""
    from moeref.routing import expert_map

    h = hidden_for(case, 2)
    full = moe_permute(h, case.ids, case.num_experts)
    y = expert_fn(full.hidden, full.src, case)
    want = moe_unpermute(y, grid_weights(case), full.inv_permuted_idx, full.expert_first_token_offset, out_dtype=np.float64)
    total = np.zeros_like(want)
    seen = []
    for rank in range(ep_size):
        emap = expert_map(case.num_experts, ep_size, rank, strategy)
        p = moe_permute(h, case.ids, case.num_experts, emap)
        seen += p.src[p.src >= 0].tolist()
        yr = expert_fn(p.hidden, p.src, case)
        total += moe_unpermute(yr, grid_weights(case), p.inv_permuted_idx, p.expert_first_token_offset, out_dtype=np.float64)
    np.testing.assert_array_equal(total, want)
    assert sorted(seen) == np.flatnonzero(case.ids.reshape(-1) >= 0).tolist()


@given(routings(allow_padding=False, kinds=ALL_KINDS), st.data())
def test_padding_tokens_contribute_nothing(case, data):
    """Inserting padding tokens (ids -1, any weights, any hidden) changes no real token's output and
    their own output is exactly 0 (vLLM PR #46428, SGLang PR #25852)."""
    m = case.num_tokens
    n_pad = data.draw(st.integers(1, 3))
    where = sorted(data.draw(st.lists(st.integers(0, m + n_pad - 1), min_size=n_pad, max_size=n_pad, unique=True)))
    real = [i for i in range(m + n_pad) if i not in where]
    ids = np.full((m + n_pad, case.top_k), -1, dtype=np.int32)
    ids[real] = case.ids
    w = np.full((m + n_pad, case.top_k), 7.0, dtype=np.float32)
    w[real] = grid_weights(case)
    h = np.full((m + n_pad, K), np.nan, dtype=np.float32)  # padding rows hold garbage
    h[real] = hidden_for(case, 3)
    p = moe_permute(h, ids, case.num_experts)
    out = moe_unpermute(p.hidden, w, p.inv_permuted_idx, p.expert_first_token_offset, out_dtype=np.float64)
    q = moe_permute(hidden_for(case, 3), case.ids, case.num_experts)
    ref = moe_unpermute(q.hidden, grid_weights(case), q.inv_permuted_idx, q.expert_first_token_offset, out_dtype=np.float64)
    np.testing.assert_array_equal(out[real], ref)
    assert (out[where] == 0).all()
    r = moe_align_block_size(ids, 4, case.num_experts)
    r0 = moe_align_block_size(case.ids, 4, case.num_experts)
    assert r.num_tokens_post_padded.tolist() == r0.num_tokens_post_padded.tolist()
    assert r.expert_ids.tolist()[: r.num_valid_blocks] == r0.expert_ids.tolist()[: r0.num_valid_blocks]


@settings(max_examples=20)
@given(st.sampled_from([4095, 4096, 4097]), st.integers(1, 8), st.sampled_from([64, 128, 224]))
def test_large_token_counts_index_only(m, k, alignment):
    e = 256
    rng = np.random.default_rng(m * k)
    ids = np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)
    c = to_contiguous(None, ids, e, alignment)
    counts = np.bincount(ids.reshape(-1), minlength=e)
    assert c.m_indices.size == int((-(-counts // alignment) * alignment).sum())
    assert np.bincount(c.m_indices[c.m_indices >= 0], minlength=e).tolist() == counts.tolist()
    r = moe_align_block_size(ids, 128, e)
    assert int(r.num_tokens_post_padded[0]) == int((-(-counts // 128) * 128).sum())
    assert to_local_ids(ids, None).shape == (m, k)
