"""Dispatch layouts against hand-derived values and loop oracles written here from the published
goldens (vLLM ``torch_moe_align_block_size``, ``torch_permute``/``torch_unpermute``,
``batched_moe_align_block_size`` ``ref_outputs``, CUTLASS ``compute_arg_sorts``)."""
from __future__ import annotations

import numpy as np
import pytest

from moeref.dispatch import (
    apply_router_weight_on_input,
    batched_moe_align_block_size,
    contiguous_m_sum,
    convert,
    cutlass_moe_mm_data,
    expert_first_token_offset,
    finalize_noop,
    moe_align_block_size,
    moe_permute,
    moe_unpermute,
    shuffle_rows,
    to_batched,
    to_contiguous,
    to_masked,
    to_slot_rows,
    weight_and_reduce,
)
from moeref.routing import expert_map

# ------------------------------------------------------------------------------------------------
# oracles


def golden_align(topk_ids, block, num_experts, emap=None, pad_sorted_ids=False, ignore_invalid=False):
    """vLLM's golden, loop form; -1 ids skipped; unused blocks -1; current sizing rule."""
    flat = topk_ids.reshape(-1).tolist()
    numel = len(flat)
    size = numel + num_experts * (block - 1)
    if pad_sorted_ids:
        size = -(-size // block) * block
    if numel < num_experts:
        size = min(numel * block, size)
    sorted_ids = [numel] * size
    expert_ids = [-1] * (-(-size // block))
    if ignore_invalid:
        label = {g: int(emap[g]) for g in range(num_experts) if emap[g] >= 0}
        groups = sorted(label.values())
        members = {l: [i for i, g in enumerate(flat) if g >= 0 and label.get(g) == l] for l in groups}
    else:
        groups = list(range(num_experts))
        members = {g: [i for i, x in enumerate(flat) if x == g] for g in groups}
    pos = blk = 0
    for g in groups:
        toks = members[g]
        if not toks:
            continue
        sorted_ids[pos:pos + len(toks)] = toks
        nb = -(-len(toks) // block)
        lab = g if (emap is None or ignore_invalid) else int(emap[g])
        expert_ids[blk:blk + nb] = [lab] * nb
        pos += nb * block
        blk += nb
    return sorted_ids, expert_ids, pos


def golden_permute(hidden, topk_ids, n_expert, emap=None):
    """vLLM torch_permute (loop form), generalized to any map; -1 ids sort after non-local ones."""
    m, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    n_local = n_expert if emap is None else int((emap >= 0).sum())

    def key(i):
        g = int(flat[i])
        if g < 0:
            return (2, 0, i)
        loc = g if emap is None else int(emap[g])
        return (0, loc, i) if loc >= 0 else (1, g, i)

    order = sorted(range(m * k), key=key)
    counts = [sum(1 for i in order if key(i)[0] == 0 and key(i)[1] == e) for e in range(n_local)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    inv = [0] * (m * k)
    for dst, src in enumerate(order):
        inv[src] = dst
    permuted_idx = [s if d < offsets[-1] else m * k for d, s in enumerate(order)]
    rows = [hidden[s // k] if d < offsets[-1] else np.zeros_like(hidden[0]) for d, s in enumerate(order)]
    return np.array(rows), offsets, permuted_idx, inv


# ------------------------------------------------------------------------------------------------
# moe_align_block_size


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("pad_sorted_ids", [False, True])
def test_align_matches_golden(seed, block, pad_sorted_ids):
    rng = np.random.default_rng(seed)
    m, k, e = int(rng.integers(1, 20)), int(rng.integers(1, 4)), int(rng.integers(4, 12))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    ids[rng.random(m) < 0.2] = -1
    r = moe_align_block_size(ids, block, e, pad_sorted_ids=pad_sorted_ids)
    s, x, n = golden_align(ids, block, e, pad_sorted_ids=pad_sorted_ids)
    assert r.sorted_token_ids.tolist() == s
    assert r.expert_ids.tolist() == x
    assert r.num_tokens_post_padded.tolist() == [n]
    assert r.sorted_token_ids.dtype == r.expert_ids.dtype == r.num_tokens_post_padded.dtype == np.int32


def test_align_sizing_rule_small_numel():
    ids = np.array([[3]], dtype=np.int32)  # numel 1 < E 8: size = min(1*16, 1 + 8*15) = 16
    r = moe_align_block_size(ids, 16, 8)
    assert r.sorted_token_ids.size == 16 and r.expert_ids.tolist() == [3]
    assert r.sorted_token_ids.tolist() == [0] + [1] * 15


@pytest.mark.parametrize("ignore_invalid", [False, True])
def test_align_with_expert_map(ignore_invalid):
    rng = np.random.default_rng(7)
    e = 8
    emap = np.full(e, -1, dtype=np.int32)
    emap[0::2] = np.arange(4)  # vLLM's test: even experts local
    ids = np.stack([rng.permutation(e)[:3] for _ in range(9)]).astype(np.int32)
    r = moe_align_block_size(ids, 4, e, emap, ignore_invalid_experts=ignore_invalid)
    s, x, n = golden_align(ids, 4, e, emap, ignore_invalid=ignore_invalid)
    assert (r.sorted_token_ids.tolist(), r.expert_ids.tolist(), int(r.num_tokens_post_padded[0])) == (s, x, n)


def test_align_ignore_invalid_needs_map():
    with pytest.raises(ValueError, match="expert_map"):
        moe_align_block_size(np.zeros((1, 1), dtype=np.int32), 4, 2, ignore_invalid_experts=True)


def test_batched_align_matches_vllm_ref_outputs():
    rng = np.random.default_rng(3)
    for max_tokens, block in [(16, 8), (8, 4), (10, 4), (5, 8)]:
        counts = rng.integers(0, max_tokens + 1, size=6).astype(np.int32)
        r = batched_moe_align_block_size(max_tokens, block, counts)
        b = counts.size
        size = b * (-(-max_tokens // block) * block)
        sentinel = b * max_tokens
        ref_sorted = [sentinel] * size
        ref_experts = [-1] * (size // block)
        i = 0
        for e, c in enumerate(counts.tolist()):
            start = i
            for j in range(c):
                ref_sorted[i] = e * max_tokens + j
                i += 1
            i = start + -(-c // block) * block
            ref_experts[start // block:i // block] = [e] * ((i - start) // block)
        assert r.sorted_token_ids.tolist() == ref_sorted
        assert r.expert_ids.tolist() == ref_experts
        assert int(r.num_tokens_post_padded[0]) == i
    with pytest.raises(ValueError, match=r"expert_num_tokens\[1\] = 9"):
        batched_moe_align_block_size(8, 4, np.array([1, 9], dtype=np.int32))


# ------------------------------------------------------------------------------------------------
# permute / unpermute


@pytest.mark.parametrize("ep", [None, ("linear", 4, 1), ("round_robin", 3, 2), ("linear", 3, 0)])
def test_permute_matches_golden(ep):
    rng = np.random.default_rng(11)
    m, k, e = 13, 3, 10
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    ids[[2, 7]] = -1
    hidden = rng.standard_normal((m, 5)).astype(np.float32)
    emap = None if ep is None else expert_map(e, ep[1], ep[2], ep[0])
    p = moe_permute(hidden, ids, e, emap)
    rows, offsets, permuted_idx, inv = golden_permute(hidden, ids, e, emap)
    assert p.expert_first_token_offset.tolist() == offsets and p.expert_first_token_offset.dtype == np.int64
    assert p.permuted_idx.tolist() == permuted_idx and p.permuted_idx.dtype == np.int32
    assert p.inv_permuted_idx.tolist() == inv
    np.testing.assert_array_equal(p.hidden, rows)
    n_local = len(offsets) - 1
    assert expert_first_token_offset(ids, n_local, emap).tolist() == offsets


def test_permute_vllm_invalid_ids_case():
    # vLLM test_moe_permute_ignores_invalid_expert_ids_with_scratch, with in-range ids.
    hidden = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)
    ids = np.array([[0], [-1], [1], [3], [2]], dtype=np.int32)
    emap = np.array([0, 1, -1, -1], dtype=np.int32)
    p = moe_permute(hidden, ids, 4, emap)
    assert p.expert_first_token_offset.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(p.hidden[:2], hidden[[0, 2]])
    assert (p.inv_permuted_idx[[1, 3, 4]] >= 2).all()
    poisoned = p.hidden.copy()
    poisoned[2:] = np.nan  # rows past offset[-1] are unspecified in kernels
    out = moe_unpermute(poisoned, np.ones((5, 1)), p.inv_permuted_idx, p.expert_first_token_offset)
    expected = np.zeros_like(hidden)
    expected[[0, 2]] = hidden[[0, 2]]
    np.testing.assert_array_equal(out, expected)


def test_unpermute_matches_golden_loop():
    rng = np.random.default_rng(5)
    m, k, e = 9, 2, 6
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    w = rng.random((m, k)).astype(np.float32)
    p = moe_permute(None, ids, e)
    y = rng.standard_normal((m * k, 3)).astype(np.float32)
    out = moe_unpermute(y, w, p.inv_permuted_idx, p.expert_first_token_offset)
    for t in range(m):
        want = sum(float(w[t, j]) * y[p.inv_permuted_idx[t * k + j]].astype(np.float64) for j in range(k))
        np.testing.assert_allclose(out[t], want, rtol=1e-6)
    assert out.dtype == np.float32


# ------------------------------------------------------------------------------------------------
# contiguous / masked / batched / cutlass


def test_contiguous_hand_example_non_power_of_two_alignment():
    ids = np.array([[1, 0], [1, -1], [0, 1]], dtype=np.int32)
    h = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], dtype=np.float32)
    c = to_contiguous(h, ids, 3, alignment=3)
    # expert 0: slots 1, 4 -> rows 0,1 (+1 padding); expert 1: slots 0, 2, 5 -> rows 3..5; expert 2: none
    assert c.m_indices.tolist() == [0, 0, -1, 1, 1, 1]
    assert c.src.tolist() == [1, 4, -1, 0, 2, 5]
    assert c.psum.tolist() == [2, 6, 6] and c.psum.dtype == np.int32
    assert c.a[:, 0].tolist() == [1.0, 3.0, 0.0, 1.0, 2.0, 3.0]
    w = to_contiguous(None, ids, 3, alignment=96, m_sum="worst_case")
    assert w.m_indices.size == contiguous_m_sum([2, 3, 0], 96, "worst_case", num_slots=6) == 384  # round_up(6 + 3*95, 96)
    assert (w.m_indices[192:] == -1).all()
    with pytest.raises(ValueError, match="smaller than the rows"):
        to_contiguous(None, ids, 3, alignment=4, m_sum=7)


def test_masked_and_batched_hand_example():
    ids = np.array([[1, 0], [1, -1], [0, 1]], dtype=np.int32)
    h = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    mk = to_masked(h, ids, 3)
    assert mk.masked_m.tolist() == [2, 3, 0] and mk.masked_m.dtype == np.int32
    assert mk.src.tolist() == [[1, 4, -1], [0, 2, 5], [-1, -1, -1]]
    assert mk.a[..., 0].tolist() == [[1.0, 3.0, 0.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]
    assert mk.expected_m == 2  # ceil(5 / 3)
    with pytest.raises(ValueError, match="local expert 1 has 3 rows, more than the capacity 2"):
        to_masked(h, ids, 3, max_m=2)
    b = to_batched(h, ids, 3, max_tokens_per_dispatcher=2, num_dispatchers=2)
    assert b.a.shape == (3, 4, 1) and b.expert_num_tokens.tolist() == [2, 3, 0]
    with pytest.raises(ValueError, match="exceed"):
        to_batched(h, ids, 3, max_tokens_per_dispatcher=2)


def test_cutlass_maps_against_compute_arg_sorts_loop():
    rng = np.random.default_rng(2)
    m, k, e = 11, 3, 7
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    ids[4] = -1
    d = cutlass_moe_mm_data(ids, e, n=32, k=64)
    flat = ids.reshape(-1)
    counts = [int((flat == x).sum()) for x in range(e)]
    off = np.concatenate([[0], np.cumsum(counts)])
    assert d.expert_offsets.tolist() == off.tolist()
    assert d.blockscale_offsets.tolist() == np.concatenate([[0], np.cumsum([-(-c // 128) * 128 for c in counts])]).tolist()
    assert d.problem_sizes1.tolist() == [[c, 64, 64] for c in counts]
    assert d.problem_sizes2.tolist() == [[c, 64, 32] for c in counts]
    assert cutlass_moe_mm_data(ids, e, n=32, k=64, is_gated=False).problem_sizes1[0].tolist() == [counts[0], 32, 64]
    total = int(off[-1])
    for i, x in enumerate(flat.tolist()):  # compute_arg_sorts contract
        if x < 0:
            assert d.c_map[i] == total
        else:
            r = d.c_map[i]
            assert off[x] <= r < off[x + 1] and d.a_map[r] == i // k
    assert (d.a_map[total:] == m).all()
    h = rng.standard_normal((m, 4)).astype(np.float32)
    shuffled = shuffle_rows(h, d.a_map)
    np.testing.assert_array_equal(shuffled[total:], 0.0)
    w = rng.random((m, k)).astype(np.float32)
    back = weight_and_reduce(shuffled, d.src, w, m)
    want = np.where(ids >= 0, w, 0.0).astype(np.float64).sum(1, keepdims=True) * h
    np.testing.assert_allclose(back, want, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# finalize and conversions


def test_weight_and_reduce_from_masked_matches_loop():
    rng = np.random.default_rng(9)
    m, k, e = 7, 2, 4
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    w = rng.random((m, k)).astype(np.float32)
    mk = to_masked(rng.standard_normal((m, 3)).astype(np.float32), ids, e)
    y = mk.a * 2.0 + 1.0  # some "expert" on each row
    out = weight_and_reduce(y, mk.src, w, m)
    for t in range(m):
        want = np.zeros(3)
        for j in range(k):
            ex, row = np.argwhere(mk.src == t * k + j)[0]
            want += float(w[t, j]) * y[ex, row]
        np.testing.assert_allclose(out[t], want, rtol=1e-6)


def test_finalize_variants_and_errors():
    w = np.array([[0.5, 0.5]])
    with pytest.raises(ValueError, match="top_k == 1"):
        apply_router_weight_on_input(np.ones((1, 2)), w)
    x = apply_router_weight_on_input(np.ones((1, 2)), np.array([[0.25]]))
    assert x.tolist() == [[0.25, 0.25]]
    assert weight_and_reduce(np.array([[4.0]]), np.array([0]), np.array([[0.25]]), 1, apply_weights=False).tolist() == [[4.0]]
    assert finalize_noop(np.ones((2, 3)), 2).shape == (2, 3)
    with pytest.raises(ValueError, match="num_tokens=3"):
        finalize_noop(np.ones((2, 3)), 3)
    with pytest.raises(ValueError, match=r"slot 1 appears in rows \[0, 2\]"):
        weight_and_reduce(np.ones((3, 1)), np.array([1, 0, 1]), w, 1)
    with pytest.raises(ValueError, match=r"src\[1\] = 2 is out of range"):
        weight_and_reduce(np.ones((2, 1)), np.array([0, 2]), w, 1)
    with pytest.raises(ValueError, match="leading shape"):
        weight_and_reduce(np.ones((2, 1)), np.array([0, 1, -1]), w, 1)


def test_convert_round_trip_simple():
    ids = np.array([[1, 0], [1, -1], [0, 1]], dtype=np.int32)
    h = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    c = to_contiguous(h, ids, 3, alignment=4)
    m = convert(c, "masked")
    np.testing.assert_array_equal(m.a, to_masked(h, ids, 3).a)
    back = convert(m, "contiguous", alignment=4)
    np.testing.assert_array_equal(back.a, c.a)
    assert back.m_indices.tolist() == c.m_indices.tolist()
    s = to_slot_rows(convert(c, "permuted"))
    assert s.local_ids.tolist() == [1, 0, 1, -1, 0, 1]
    with pytest.raises(ValueError, match="needs alignment"):
        convert(m, "contiguous")
    with pytest.raises(ValueError, match="does not take"):
        convert(m, "masked", alignment=4)


# ------------------------------------------------------------------------------------------------
# bad input (every builder goes through the same validation)

BUILDERS = {
    "align": lambda ids, e, emap=None: moe_align_block_size(ids, 4, e, emap),
    "permute": lambda ids, e, emap=None: moe_permute(None, ids, e, emap),
    "contiguous": lambda ids, e, emap=None: to_contiguous(None, ids, e, 32, emap),
    "masked": lambda ids, e, emap=None: to_masked(None, ids, e, expert_map=emap),
    "batched": lambda ids, e, emap=None: to_batched(None, ids, e, 8, expert_map=emap),
    "cutlass": lambda ids, e, emap=None: cutlass_moe_mm_data(ids, e, 8, 8, expert_map=emap),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_bad_ids_and_maps(name):
    build = BUILDERS[name]
    with pytest.raises(ValueError, match=r"topk_ids\[1, 0\] = 4 is out of range"):
        build(np.array([[0, 1], [4, 2]], dtype=np.int32), 4)
    with pytest.raises(TypeError, match="dtype"):
        build(np.array([[1.0, 0.0]]), 4)
    with pytest.raises(ValueError, match="dimension"):
        build(np.array([1, 0], dtype=np.int32), 4)
    with pytest.raises(ValueError, match="length num_experts=4; got length 3"):
        build(np.array([[1, 0]], dtype=np.int32), 4, np.array([0, 1, -1], dtype=np.int32))
    # int64 ids are accepted
    build(np.array([[1, 0]], dtype=np.int64), 4)


def test_hidden_rows_checked():
    with pytest.raises(ValueError, match="must have 2 rows"):
        moe_permute(np.zeros((3, 4)), np.zeros((2, 1), dtype=np.int32), 2)
    with pytest.raises(ValueError, match="dimension"):
        to_masked(np.zeros(2), np.zeros((2, 1), dtype=np.int32), 2)


def test_empty_rank_and_zero_tokens():
    emap = expert_map(2, 4, 3)  # this rank owns no expert
    ids = np.array([[0], [1]], dtype=np.int32)
    p = moe_permute(np.ones((2, 3)), ids, 2, emap)
    assert p.expert_first_token_offset.tolist() == [0] and (p.hidden == 0).all()
    mk = to_masked(np.ones((2, 3)), ids, 2, expert_map=emap)
    assert mk.a.shape == (0, 1, 3) and mk.expected_m == 1
    z = np.zeros((0, 2), dtype=np.int32)
    r = moe_align_block_size(z, 4, 8)
    assert r.sorted_token_ids.size == 0 and int(r.num_tokens_post_padded[0]) == 0
    assert to_contiguous(np.zeros((0, 3)), z, 8, 128).a.shape == (0, 3)
