"""The token-dispatch fast paths (fastpath/dispatch.py) against the references (moeref.dispatch).

Indices, counts, offsets and layouts must be equal to the reference **bit for bit**, order within
an expert included (the kernels implement the reference's stable order). Rows are compared through
integer views, so NaN payloads, -0.0 and fp8 codes must survive. Float reductions
(unpermute / weight-and-reduce, float32 sums) must be within the sound bound of a k-term float32
dot product, ``|out - ref| <= gamma_k * sum_j |w_j x_j|`` plus the output rounding, where ``ref`` is
the reference's float64 sum.

Every buffer the kernels write is poisoned before each run (:func:`fastpath.testing.poisoned`, the
one allocation hook of the fast paths, fills it with 0xA5 bytes), so an element no kernel wrote is
caught.

On CPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1): small shapes,
few examples. On a GPU the same properties run with more examples and larger shapes, plus the
``gpu``-marked large cases.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import moeref.dispatch as ref  # noqa: E402
from moeref import _interop  # noqa: E402
from moeref.routing import expert_map as make_expert_map  # noqa: E402
from moeref.strategies import OPT_IN_KINDS, ROUTING_KINDS, ep_shards, routings  # noqa: E402

import fastpath.dispatch as fast  # noqa: E402
from fastpath.testing import poisoned  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.interp

# Sizes and example counts: interpreter (CPU) vs GPU.
MAX_TOKENS = 64 if HAS_CUDA else 16
MAX_EXPERTS = 64 if HAS_CUDA else 9
MAX_TOPK = 8 if HAS_CUDA else 4
N_EXAMPLES = 200 if HAS_CUDA else 40
N_EXAMPLES_ROWS = 100 if HAS_CUDA else 25
BIG_TOKENS = 3000 if HAS_CUDA else 400  # seed-drawn routings crossing many CHUNK boundaries

SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------------------------
# Poisoned allocation
# ----------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def poison():
    with poisoned():   # 0xA5A5A5A5 as an index, count or offset is negative: never valid
        yield


def _np(t):
    return _interop.to_numpy(t)


def _assert_same(name, ref_arr, fast_t):
    """Equal shape, dtype and bits."""
    got = _np(fast_t)
    want = np.asarray(ref_arr)
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != reference {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape}"
    if want.dtype.kind == "f" or want.dtype.itemsize in (1, 2) and want.dtype.kind not in "iub":
        got = got.view(f"u{want.dtype.itemsize}")
        want = want.view(f"u{want.dtype.itemsize}")
    bad = np.flatnonzero((got != want).reshape(-1))
    assert bad.size == 0, (
        f"{name}: {bad.size} elements differ; first at flat index {int(bad[0])}: "
        f"fast {got.reshape(-1)[bad[0]]!r} reference {want.reshape(-1)[bad[0]]!r}"
    )


def _t(a, dtype=None):
    t = _interop.to_torch(np.ascontiguousarray(a), DEVICE)
    return t if dtype is None else t.to(dtype)


# ----------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------
@st.composite
def cases(draw, max_tokens=MAX_TOKENS, allow_zero=True):
    """(RoutingCase, expert_map or None, ids dtype)."""
    r = draw(routings(max_tokens=max_tokens, max_experts=MAX_EXPERTS, max_top_k=MAX_TOPK,
                      allow_zero_tokens=allow_zero, kinds=ROUTING_KINDS + OPT_IN_KINDS))
    emap = None
    if draw(st.booleans()):
        emap = draw(ep_shards(r.num_experts, max_ep_size=4)).expert_map
    ids_dtype = draw(st.sampled_from([np.int32, np.int64]))
    return r, emap, ids_dtype


@st.composite
def big_ids(draw):
    """Seed-drawn routings with many slots (uniform, all-to-one, zipf-skewed, few experts), -1 rows."""
    m = draw(st.integers(1, BIG_TOKENS))
    e = draw(st.sampled_from([1, 3, 8, 33, 256]))
    k = draw(st.integers(1, min(8, e)))
    kind = draw(st.sampled_from(["uniform", "all_to_one", "zipf", "subset"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "all_to_one":
        ids = np.repeat(rng.permutation(e)[None, :k], m, axis=0)
    else:
        logp = np.zeros(e)
        if kind == "zipf":
            logp = -1.2 * np.log(np.arange(1, e + 1))
        elif kind == "subset":
            logp = np.where(np.arange(e) < max(k, e // 4), 0.0, -np.inf)
        g = logp[None, :] - np.log(-np.log(rng.random((m, e))))
        ids = np.argsort(-g, axis=1, kind="stable")[:, :k]
    ids = ids.astype(np.int32)
    ids[rng.random(m) < draw(st.sampled_from([0.0, 0.1, 1.0]))] = -1
    emap = None
    if draw(st.booleans()):
        emap = make_expert_map(e, draw(st.integers(1, 4)), 0, draw(st.sampled_from(["linear", "round_robin"])))
    return ids, e, emap


# ----------------------------------------------------------------------------------------------
# Index outputs: align, offsets, counts, permute indices
# ----------------------------------------------------------------------------------------------
def _check_align(ids, e, emap, block_size, pad_sorted, ignore_invalid):
    if ignore_invalid and emap is None:
        return
    want = ref.moe_align_block_size(ids, block_size, e, emap, pad_sorted, ignore_invalid)
    got = fast.moe_align_block_size(_t(ids), block_size, e, emap, pad_sorted, ignore_invalid)
    _assert_same("sorted_token_ids", want.sorted_token_ids, got.sorted_token_ids)
    _assert_same("expert_ids", want.expert_ids, got.expert_ids)
    _assert_same("num_tokens_post_padded", want.num_tokens_post_padded, got.num_tokens_post_padded)
    assert got.sentinel == want.sentinel and got.block_size == want.block_size


@settings(max_examples=N_EXAMPLES, **SLOW)
@given(cases(), st.sampled_from([1, 2, 3, 4, 16, 64, 128]), st.booleans(), st.booleans())
def test_align_block_size_equals_reference(case, block_size, pad_sorted, ignore_invalid):
    r, emap, dt = case
    _check_align(r.ids.astype(dt), r.num_experts, emap, block_size, pad_sorted, ignore_invalid)


@settings(max_examples=N_EXAMPLES, **SLOW)
@given(cases())
def test_offsets_counts_and_permute_indices_equal_reference(case):
    r, emap, dt = case
    ids = r.ids.astype(dt)
    e = r.num_experts
    g = ref.group_slots(ids, e, emap)
    _assert_same("expert_counts", g.counts.astype(np.int32), fast.expert_counts(_t(ids), e, emap))
    want_off = ref.expert_first_token_offset(ids, g.num_local_experts, emap)
    _assert_same("expert_first_token_offset", want_off,
                 fast.expert_first_token_offset(_t(ids), g.num_local_experts, emap))
    want = ref.moe_permute(None, ids, e, emap)
    got = fast.moe_permute(None, _t(ids), e, emap)
    assert got.hidden is None
    for name in ("expert_first_token_offset", "permuted_idx", "inv_permuted_idx"):
        _assert_same(name, getattr(want, name), getattr(got, name))


@settings(max_examples=max(4, N_EXAMPLES // 4), **SLOW)
@given(big_ids(), st.sampled_from([1, 16, 64, 128]))
def test_many_chunks_indices_equal_reference(big, block_size):
    """Thousands of slots: the chunk prefix sums (many CHUNK boundaries) must give the stable order."""
    ids, e, emap = big
    _check_align(ids, e, emap, block_size, False, False)
    _check_align(ids, e, emap, block_size, True, True)
    want = ref.moe_permute(None, ids, e, emap)
    got = fast.moe_permute(None, _t(ids), e, emap)
    for name in ("expert_first_token_offset", "permuted_idx", "inv_permuted_idx"):
        _assert_same(name, getattr(want, name), getattr(got, name))
    c_want = ref.to_contiguous(None, ids, e, 96, emap)
    c_got = fast.to_contiguous(None, _t(ids), e, 96, emap)
    for name in ("m_indices", "src", "psum"):
        _assert_same(name, getattr(c_want, name), getattr(c_got, name))


# ----------------------------------------------------------------------------------------------
# Rows: permute, contiguous, masked, batched (bit copies, any dtype, strided hidden)
# ----------------------------------------------------------------------------------------------
SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -3.5, 65504.0, 3.0e38], dtype=np.float32)


@st.composite
def hidden_for(draw, m):
    """Rows [m, K] with specials mixed in; a dtype; and a layout (contiguous or strided)."""
    k_dim = draw(st.sampled_from([1, 3, 8, 33] + ([256, 700] if HAS_CUDA else [])))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.uint8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((m, k_dim)).astype(np.float32) * 4
    if m * k_dim:
        idx = rng.integers(0, m * k_dim, size=max(1, m * k_dim // 5))
        x.reshape(-1)[idx] = rng.choice(SPECIALS, size=idx.size)
    if dtype == torch.uint8:
        t = torch.from_numpy(rng.integers(0, 256, size=(m, k_dim), dtype=np.uint8))
    elif dtype == torch.float8_e4m3fn:  # arbitrary codes, NaN codes included
        t = torch.from_numpy(rng.integers(0, 256, size=(m, k_dim), dtype=np.uint8)).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(x).to(dtype)
    t = t.to(DEVICE)
    stride = draw(st.sampled_from(["contiguous", "row_padded", "col_strided"]))
    if stride == "row_padded":  # row stride > K: a column slice of a wider buffer
        wide = torch.zeros((m, k_dim + 5), dtype=t.dtype, device=DEVICE)
        wide[:, 2:2 + k_dim] = t
        t = wide[:, 2:2 + k_dim]
    elif stride == "col_strided":  # element stride 2
        wide = torch.zeros((m, 2 * k_dim), dtype=t.dtype, device=DEVICE)
        wide[:, ::2] = t
        t = wide[:, ::2]
    return t


@settings(max_examples=N_EXAMPLES_ROWS, **SLOW)
@given(st.data())
def test_row_layouts_equal_reference(data):
    r, emap, dt = data.draw(cases())
    ids = r.ids.astype(dt)
    e = r.num_experts
    x = data.draw(hidden_for(r.num_tokens))
    xn = _np(x.contiguous())

    want = ref.moe_permute(xn, ids, e, emap)
    got = fast.moe_permute(x, _t(ids), e, emap)
    for name in ("hidden", "expert_first_token_offset", "permuted_idx", "inv_permuted_idx"):
        _assert_same(f"permute.{name}", getattr(want, name), getattr(got, name))

    alignment = data.draw(st.sampled_from([1, 2, 5, 32, 128, 224]))
    m_sum = data.draw(st.sampled_from([None, "worst_case", "extra"]))
    if m_sum == "extra":
        m_sum = ref.contiguous_m_sum(ref.group_slots(ids, e, emap).counts, alignment) + data.draw(st.integers(0, 7))
    want = ref.to_contiguous(xn, ids, e, alignment, emap, m_sum=m_sum)
    got = fast.to_contiguous(x, _t(ids), e, alignment, emap, m_sum=m_sum)
    for name in ("a", "m_indices", "src", "psum"):
        _assert_same(f"contiguous.{name}", getattr(want, name), getattr(got, name))
    assert (got.alignment, got.num_tokens, got.top_k) == (want.alignment, want.num_tokens, want.top_k)

    max_m = data.draw(st.sampled_from([None, "roomy"]))
    if max_m == "roomy":
        counts = ref.group_slots(ids, e, emap).counts
        max_m = int(counts.max(initial=0)) + data.draw(st.integers(1, 3))
    want = ref.to_masked(xn, ids, e, max_m, emap)
    got = fast.to_masked(x, _t(ids), e, max_m, emap)
    for name in ("a", "masked_m", "src"):
        _assert_same(f"masked.{name}", getattr(want, name), getattr(got, name))
    assert got.expected_m == want.expected_m

    # rows per expert: the tokens, or more when a token repeats an expert (each slot is a row)
    t = max(1, r.num_tokens, int(ref.group_slots(ids, e, emap).counts.max(initial=0))) + data.draw(st.integers(0, 3))
    want = ref.to_batched(xn, ids, e, t, 1, emap)
    got = fast.to_batched(x, _t(ids), e, t, 1, emap)
    for name in ("a", "expert_num_tokens", "src"):
        _assert_same(f"batched.{name}", getattr(want, name), getattr(got, name))


@settings(max_examples=N_EXAMPLES, **SLOW)
@given(cases(allow_zero=False), st.integers(0, 3), st.data())
def test_sync_free_capacity_layouts_equal_the_reference(case, extra, data):
    """``to_masked(..., expected_m=1)`` and ``to_batched(..., validate=False)`` without token rows (no host sync;
    up to ``DECODE_CAPACITY_SLOTS`` slots one launch, ``_decode_capacity_kernel``, else the sort, rank and fill):
    the reference's counts and ``src``, and the slot -> row map inverts ``src``; the capacity is at least the
    tokens and the largest expert's rows (no overflow), ``extra`` rows more."""
    r, emap, dt = case
    ids = r.ids.astype(dt)
    e = r.num_experts
    cap = max(1, r.num_tokens, int(ref.group_slots(ids, e, emap).counts.max(initial=0))) + extra
    want = ref.to_masked(None, ids, e, cap, emap)
    got, dst = fast.to_masked(None, _t(ids), e, cap, emap, expected_m=1, validate=False, slot_rows=True)
    for name in ("masked_m", "src"):
        _assert_same(f"masked.{name}", getattr(want, name), getattr(got, name))
    d, flat = _np(dst), want.src.reshape(-1)
    assert np.array_equal(flat[d[d >= 0]], np.flatnonzero(d >= 0)) and (d >= 0).sum() == want.masked_m.sum()
    want = ref.to_batched(None, ids, e, cap, 1, emap)
    got = fast.to_batched(None, _t(ids), e, cap, 1, emap, validate=False)
    for name in ("expert_num_tokens", "src"):
        _assert_same(f"batched.{name}", getattr(want, name), getattr(got, name))


# ----------------------------------------------------------------------------------------------
# Reductions: unpermute and weight-and-reduce within the sound float32 bound
# ----------------------------------------------------------------------------------------------
def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _check_bound(name, got, exact, abs_sum, k, out_dtype):
    """|got - exact| <= gamma_k(u32) * sum|w x| + u_out * (|exact| + gamma_k * sum|w x|)."""
    u32 = 2.0 ** -24
    u_out = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[out_dtype]
    g = _gamma(max(k, 1), u32)
    tiny = {torch.float32: 2.0 ** -149, torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24}[out_dtype]
    bound = g * abs_sum + u_out * (np.abs(exact) + g * abs_sum) + tiny
    got64 = _np(got.float()).astype(np.float64)
    assert np.isfinite(got64).all(), f"{name}: non-finite output {got64[~np.isfinite(got64)][:4]}"
    err = np.abs(got64 - exact)
    bad = np.argwhere(err > bound)
    assert bad.size == 0, (f"{name}: {len(bad)} elements exceed the bound; first {tuple(bad[0])}: "
                           f"got {got64[tuple(bad[0])]!r} exact {exact[tuple(bad[0])]!r} bound {bound[tuple(bad[0])]!r}")


@settings(max_examples=N_EXAMPLES_ROWS, **SLOW)
@given(cases(allow_zero=False), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**32 - 1), st.sampled_from([1, 7, 64, 300]))
def test_unpermute_within_bound(case, in_dtype, out_dtype, seed, k_dim):
    r, emap, dt = case
    ids = r.ids.astype(dt)
    rng = np.random.default_rng(seed)
    p = ref.moe_permute(None, ids, r.num_experts, emap)
    n_rows = ids.size
    y = (rng.standard_normal((n_rows, k_dim)) * np.exp2(rng.integers(-8, 8, size=(n_rows, 1)))).astype(np.float32)
    y = _np(torch.from_numpy(y).to(in_dtype))  # representable in in_dtype
    n_valid = int(p.expert_first_token_offset[-1])
    y[n_valid:] = np.nan  # rows of absent slots: must not leak
    w = (rng.standard_normal(r.weights.shape)).astype(np.float32)
    exact = ref.moe_unpermute(y.astype(np.float64), w, p.inv_permuted_idx, p.expert_first_token_offset,
                              out_dtype=np.float64)
    abs_sum = ref.moe_unpermute(np.nan_to_num(np.abs(y.astype(np.float64)), nan=0.0), np.abs(w),
                                p.inv_permuted_idx, p.expert_first_token_offset, out_dtype=np.float64)
    got = fast.moe_unpermute(_t(y), _t(w), _t(p.inv_permuted_idx), _t(p.expert_first_token_offset),
                             out_dtype=out_dtype)
    assert got.dtype == out_dtype and tuple(got.shape) == (r.num_tokens, k_dim)
    _check_bound("moe_unpermute", got, exact, abs_sum, r.top_k, out_dtype)


@settings(max_examples=N_EXAMPLES_ROWS, **SLOW)
@given(cases(allow_zero=False), st.sampled_from(["contiguous", "masked", "batched"]), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_weight_and_reduce_within_bound(case, layout, apply_weights, seed):
    r, emap, dt = case
    ids = r.ids.astype(dt)
    e = r.num_experts
    rng = np.random.default_rng(seed)
    if layout == "contiguous":
        lay = ref.to_contiguous(None, ids, e, 4, emap)
    elif layout == "masked":
        lay = ref.to_masked(None, ids, e, None, emap)
    else:
        lay = ref.to_batched(None, ids, e, max(r.num_tokens, int(ref.group_slots(ids, e, emap).counts.max(initial=0))) + 1, 1, emap)
    src = lay.src
    rows = rng.standard_normal(src.shape + (17,)).astype(np.float32)
    rows[src < 0] = np.nan  # padding rows hold garbage: must be ignored
    w = rng.standard_normal(r.weights.shape).astype(np.float32)
    exact = ref.weight_and_reduce(rows.astype(np.float64), src, w, r.num_tokens, apply_weights=apply_weights,
                                  out_dtype=np.float64)
    abs_sum = ref.weight_and_reduce(np.nan_to_num(np.abs(rows.astype(np.float64))), src, np.abs(w), r.num_tokens,
                                    apply_weights=apply_weights, out_dtype=np.float64)
    got = fast.weight_and_reduce(_t(rows), _t(src), _t(w), r.num_tokens, apply_weights=apply_weights)
    _check_bound(f"weight_and_reduce[{layout}]", got, exact, abs_sum, r.top_k, torch.float32)


def test_reduction_is_exact_on_a_grid():
    """Weights on a 1/64 grid and small-integer rows: every float32 partial sum is exact, so the
    fast path must equal the float64 reference exactly (a hand-checkable case)."""
    ids = np.array([[0, 2], [2, -1], [1, 0]], dtype=np.int32)
    w = np.array([[0.5, 0.25], [1.0, 0.0], [0.75, 0.125]], dtype=np.float32)
    p = ref.moe_permute(np.arange(3, dtype=np.float32)[:, None] + 1, ids, 3)
    y = p.hidden.astype(np.float32)  # row of slot t*k+j holds t+1
    got = fast.moe_unpermute(_t(y), _t(w), _t(p.inv_permuted_idx), _t(p.expert_first_token_offset))
    # by hand: token0 = 0.5*1 + 0.25*1; token1 = 1.0*2; token2 = 0.75*3 + 0.125*3
    assert _np(got)[:, 0].tolist() == [0.75, 2.0, 2.625]


# ----------------------------------------------------------------------------------------------
# Enumerated special cases
# ----------------------------------------------------------------------------------------------
SPECIAL_ROUTINGS = {
    "zero_tokens": (np.zeros((0, 2), dtype=np.int32), 4, None),
    "all_padding": (np.full((5, 3), -1, dtype=np.int32), 4, None),
    "all_to_one": (np.tile(np.array([[2, 0]], dtype=np.int32), (300, 1)), 4, None),
    "one_expert": (np.zeros((129, 1), dtype=np.int32), 1, None),
    "empty_experts": (np.array([[5, 1], [1, 5], [5, -1]], dtype=np.int32), 8, None),
    "rank_without_experts": (np.array([[0, 1], [1, -1]], dtype=np.int32), 2, make_expert_map(2, 4, 3)),
    "all_non_local": (np.array([[0, 1], [1, 0]], dtype=np.int32), 4, make_expert_map(4, 2, 1)),
    "ep_offset_rank": (np.array([[3, 0], [2, 3], [-1, -1]], dtype=np.int32), 4, make_expert_map(4, 2, 1)),
    "shared_expert": (np.array([[0, 4], [3, 4]], dtype=np.int32), 5, make_expert_map(4, 2, 1, num_shared_experts=1)),
}


@pytest.mark.parametrize("name", sorted(SPECIAL_ROUTINGS))
def test_special_routings(name):
    ids, e, emap = SPECIAL_ROUTINGS[name]
    for bs in (1, 16):
        _check_align(ids, e, emap, bs, False, False)
        _check_align(ids, e, emap, bs, True, True)
    x = torch.arange(ids.shape[0] * 6, dtype=torch.float32, device=DEVICE).reshape(-1, 6).to(torch.bfloat16)
    xn = _np(x)
    want, got = ref.moe_permute(xn, ids, e, emap), fast.moe_permute(x, _t(ids), e, emap)
    for f in ("hidden", "expert_first_token_offset", "permuted_idx", "inv_permuted_idx"):
        _assert_same(f, getattr(want, f), getattr(got, f))
    want, got = ref.to_contiguous(xn, ids, e, 128, emap), fast.to_contiguous(x, _t(ids), e, 128, emap)
    for f in ("a", "m_indices", "src", "psum"):
        _assert_same(f, getattr(want, f), getattr(got, f))
    want, got = ref.to_masked(xn, ids, e, None, emap), fast.to_masked(x, _t(ids), e, None, emap)
    for f in ("a", "masked_m", "src"):
        _assert_same(f, getattr(want, f), getattr(got, f))


def test_errors_name_the_argument():
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="topk_ids"):
        fast.moe_permute(None, ids.float(), 2)
    with pytest.raises(ValueError, match="topk_ids"):
        fast.moe_permute(None, ids.reshape(-1), 2)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\] = 1 is out of range"):
        fast.moe_align_block_size(ids, 4, 1)
    with pytest.raises(ValueError, match="ignore_invalid_experts"):
        fast.moe_align_block_size(ids, 4, 2, ignore_invalid_experts=True)
    with pytest.raises(ValueError, match="block_size"):
        fast.moe_align_block_size(ids, 0, 2)
    with pytest.raises(ValueError, match="hidden must have 1 rows"):
        fast.moe_permute(torch.zeros((2, 4), device=DEVICE), ids, 2)
    with pytest.raises(ValueError, match="capacity"):
        fast.to_masked(None, torch.tensor([[0], [0]], dtype=torch.int32, device=DEVICE), 2, max_m=1)
    with pytest.raises(ValueError, match="m_sum"):
        fast.to_contiguous(None, ids, 2, 4, m_sum=3)
    with pytest.raises(ValueError, match="appears in rows"):
        fast.weight_and_reduce(torch.zeros((2, 3), device=DEVICE), torch.tensor([0, 0], device=DEVICE),
                               torch.ones((1, 2), device=DEVICE), 1)


def test_poison_is_detected():
    """Meta-test: the poisoned allocator makes an unwritten element fail the comparison."""
    buf = fast._alloc(4, torch.int32, DEVICE)         # the kernels' allocator, poisoned here
    assert _np(buf).view(np.uint32).tolist() == [0xA5A5A5A5] * 4
    with pytest.raises(AssertionError, match="differ"):
        _assert_same("probe", np.zeros(4, dtype=np.int32), buf)
    fbuf = fast._alloc(4, torch.bfloat16, DEVICE)
    assert _np(fbuf).view(np.uint16).tolist() == [0xA5A5] * 4


# ----------------------------------------------------------------------------------------------
# GPU only: production shapes
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m,e,k,ep", [(16384, 256, 8, None), (4097, 256, 8, (8, 3)), (1, 256, 8, None),
                                      (2048, 128, 6, (4, 1))])
def test_production_shapes_equal_reference(m, e, k, ep):
    rng = np.random.default_rng(m)
    ids = np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)
    ids[rng.random(m) < 0.05] = -1
    emap = None if ep is None else make_expert_map(e, ep[0], ep[1])
    _check_align(ids, e, emap, 64, False, False)
    _check_align(ids, e, emap, 64, True, True)
    x = torch.randn(m, 7168, device=DEVICE).to(torch.bfloat16)
    xn = _np(x)
    want, got = ref.moe_permute(xn, ids, e, emap), fast.moe_permute(x, _t(ids), e, emap)
    for f in ("hidden", "expert_first_token_offset", "permuted_idx", "inv_permuted_idx"):
        _assert_same(f, getattr(want, f), getattr(got, f))
    w = rng.random((m, k)).astype(np.float32)
    exact = ref.moe_unpermute(want.hidden.astype(np.float64), w, want.inv_permuted_idx,
                              want.expert_first_token_offset, out_dtype=np.float64)
    abs_sum = ref.moe_unpermute(np.abs(want.hidden.astype(np.float64)), w, want.inv_permuted_idx,
                                want.expert_first_token_offset, out_dtype=np.float64)
    out = fast.moe_unpermute(got.hidden, _t(w), got.inv_permuted_idx, got.expert_first_token_offset)
    _check_bound("moe_unpermute", out, exact, abs_sum, k, torch.float32)
    want, got = ref.to_contiguous(xn, ids, e, 128, emap), fast.to_contiguous(x, _t(ids), e, 128, emap)
    for f in ("a", "m_indices", "src", "psum"):
        _assert_same(f, getattr(want, f), getattr(got, f))
    for max_m in (None, 700):
        want, got = ref.to_masked(xn, ids, e, max_m, emap), fast.to_masked(x, _t(ids), e, max_m, emap)
        for f in ("a", "masked_m", "src"):
            _assert_same(f, getattr(want, f), getattr(got, f))
        assert got.expected_m == want.expected_m


# ----------------------------------------------------------------------------------------------
# Registry hooks
# ----------------------------------------------------------------------------------------------
def test_registry_lists_dispatch_and_supports():
    from fastpath import registry
    for op in fast.OPERATIONS:
        assert set(registry.implementations(op)) >= {"reference", "triton"}
        for name in ("reference", "triton"):
            assert callable(registry.get_implementation(op, name)), (op, name)
    ok, reason = fast.supports(topk_ids=torch.zeros((2, 2), dtype=torch.int32, device=DEVICE))
    assert ok, reason
    ok, reason = fast.supports(topk_ids=torch.zeros((2, 2), dtype=torch.float32, device=DEVICE))
    assert not ok and "int32/int64" in reason
    meta = torch.zeros((2, 2), dtype=torch.int32, device="meta")
    with pytest.raises(Exception, match="host data"):
        registry.get_implementation("moe_permute", "reference", topk_ids=meta)
