"""The layer bound's GEMM intervals with the walk of ``L = 1`` bracketed too (``ends.exact_center`` False,
:func:`moeref.compare.gemm_intervals._rows_gemm_interval`): the store of the interval has the bits of the store of the
exact interval, whatever the brackets leave open; and the pieces that argument rests on hold on their own.

* :func:`moeref.compare.tree_brackets._walk_brackets`: its brackets hold the walk's in-order sum and the range of
  every lane (oracle: the walk's definition, ``np.cumsum`` of the products along K), on cancelling sums, one-signed
  drifts, huge and tiny magnitudes (products that underflow), zeros.
* :func:`moeref.compare.stores._store_ends_box` and the weighted store's box (``_StoreEnds`` with ``w_row``): every
  center and radius drawn inside the box (its corners included) stores ends between the box's least and greatest,
  and a box of one center gives the ends of the store itself, bit for bit.
* The whole interval, drawn as in tests/test_tree_bound_bits.py plus adversarial GEMMs (sums that cancel to zero or
  to a bf16 rounding tie, a center just off a tie, huge and tiny scales, zero rows and columns of either sign, inf and
  NaN, FP8 operands), with the number of lane counts bracketed, the place of ``L = 1`` in the walk order, the batches
  and the whole-GEMM fallback varied: its store (center, half-width, flips) equals the store of the interval computed
  apart (every lane walked for every output) and the store of the exact-center path (``exact_center`` True, which
  walks ``L = 1`` for every output), and where the center was walked it is the exact center's bits.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeref.compare import bounds as bounds_mod
from moeref.compare import contiguous_tree as ct
from moeref.compare import gemm_intervals as gint
from moeref.compare import stores
from moeref.compare import tree_brackets as tb
from moeref.compare.bounds import BF16_OUTPUT
from test_tree_bound_bits import (_gemm_case, _routing_radius_bias, _rows_gemm_interval_apart, _same_bits, _stored,
                                  _values)

TIE = 1.0 + 2.0**-8  # halfway between the bf16 values 1 and 1 + 2^-7


def _adversarial(rng, m, k, kind):
    """``(a, w)`` float64 ``[m, k]`` and ``[n, k]`` of one adversarial kind (``n = 2 m``)."""
    n = 2 * m
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16).astype(np.float64)
    w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16).astype(np.float64)
    if kind == "cancel":  # each product followed by its negation: every even prefix sum is zero
        h = k // 2
        a[:, 1:2 * h:2] = a[:, 0:2 * h:2]
        w[:, 1:2 * h:2] = -w[:, 0:2 * h:2]
    elif kind in ("tie", "near_tie"):  # one product: the sum is a bf16 tie (or a float64 ulp or a few off it)
        a[:] = 0.0
        w[:] = 0.0
        a[:, 0] = 1.0
        off = 0.0 if kind == "tie" else np.float64(2.0**-52) * rng.integers(-3, 4, n)
        w[:, 0] = (TIE + off) * np.exp2(rng.integers(-20, 20, n)) * rng.choice([-1.0, 1.0], n)
    elif kind == "tiny":  # products that underflow
        a *= 2.0**-540
        w *= 2.0**-520
    elif kind == "huge":
        a *= 2.0**300
        w *= 2.0**200
    elif kind == "drift":
        a = np.abs(a) + 0.2
    elif kind == "zeros":
        a[rng.integers(0, m)] = 0.0
        w[rng.integers(0, n)] = -0.0
        w[:, rng.integers(0, k)] = 0.0
    return a, w


@given(m=st.integers(1, 6), n=st.integers(1, 40), k=st.integers(1, 300),
       kind=st.sampled_from(["bf16", "f64", "positive", "drift", "int"]),
       adv=st.sampled_from([None, "cancel", "tiny", "huge", "drift", "zeros"]),
       lane=st.sampled_from(sorted(tb._BRACKET_BLOCKS)), seed=st.integers(0, 2**31 - 1))
def test_walk_brackets_hold_the_walk(m, n, k, kind, adv, lane, seed):
    rng = np.random.default_rng(seed)
    if adv is None:
        a, w = _values(rng, (m, k), kind), _values(rng, (n, k), kind)
    else:
        a, w = _adversarial(rng, m, k, adv)
        n = w.shape[0]
    kp = -(-k // 32) * 32
    at, wt = ct._k_major(a, kp), ct._k_major(w, kp)
    w_hi = np.abs(a) @ np.abs(w).T * tb._grow(kp) + tb._tiny(kp)  # at least sum |p|
    with np.errstate(over="ignore", invalid="ignore"):
        (r_lo, r_hi), c, total = tb._walk_brackets(at, wt, np.abs(wt), w_hi, lane, tb._BRACKET_BLOCKS[lane])
    q = at[:, :, None] * wt[:, None, :]  # [kp, m, n]
    walk = np.cumsum(q.reshape(kp // lane, lane, m, n), axis=0)  # each lane's prefix sums in K order
    top = (np.maximum(walk.max(axis=0), 0.0) - np.minimum(walk.min(axis=0), 0.0)).max(axis=0)
    assert np.all(top <= r_hi)
    if lane == 1:
        last = walk[-1, 0]
        assert np.all(r_lo <= top)
        assert np.all(c[0] <= last) and np.all(last <= c[1])
        assert np.all(c[0] <= total) and np.all(total <= c[1])
    else:
        assert r_lo is None and c is None and total is None


def _box_draws(rng, x, lo, hi):
    """``x`` values drawn in ``[lo, hi]`` (elementwise): the two ends, a uniform draw, and zero where inside."""
    t = rng.random(lo.shape)
    mid = np.clip(lo + (hi - lo) * t, lo, hi)
    zero = np.where((lo <= 0) & (0 <= hi), 0.0, mid)
    return [lo, hi, mid, zero][x]


@given(n=st.integers(1, 50), width=st.sampled_from([0.0, 2.0**-60, 2.0**-30, 2.0**-9, 1.0]),
       rwidth=st.sampled_from([0.0, 2.0**-20, 1.0]), weighted=st.booleans(), at_tie=st.booleans(),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]), seed=st.integers(0, 2**31 - 1))
def test_store_ends_box_holds_every_point(n, width, rwidth, weighted, at_tie, dtype, seed):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))
    if at_tie:
        c = TIE * np.exp2(rng.integers(-20, 20, n)) * rng.choice([-1.0, 1.0], n)
    c[rng.random(n) < 0.1] = 0.0
    c_lo, c_hi = c - width * np.abs(c) - width * 1e-30, c + width * np.abs(c) + width * 1e-30
    r = np.abs(rng.standard_normal(n)) * np.exp2(rng.integers(-40, 0, n)) * np.maximum(np.abs(c), 1e-30)
    r_lo, r_hi = r, r * (1.0 + rwidth)
    w_row = rng.standard_normal(n) if weighted else None
    if weighted:
        w_row[rng.random(n) < 0.2] = 0.0
    ends = gint._StoreEnds(dtype, w_row, BF16_OUTPUT.reduce_unit)
    rows = np.arange(n)
    with np.errstate(over="ignore", invalid="ignore"):
        lo_min, lo_max, hi_min, hi_max = ends(rows, c_lo, c_hi, r_lo, r_hi)
        d_lo = r_lo if w_row is None else gint._weighted_box(w_row, c_lo, c_hi, r_lo, r_hi, BF16_OUTPUT.reduce_unit)[2]
        for xc in range(4):
            for xr in range(3):
                cc, rr = _box_draws(rng, xc, c_lo, c_hi), _box_draws(rng, xr, r_lo, r_hi)
                v, d = (cc, rr) if w_row is None else gint._weighted(w_row, cc, rr, BF16_OUTPUT.reduce_unit)
                e_lo, e_hi = stores._store_ends(v, d, dtype)
                ok = d_lo > 0  # the box's ends are NaN (never known) where the stored radius may be zero
                for e, a, b in ((e_lo, lo_min, lo_max), (e_hi, hi_min, hi_max)):
                    known = ok & (a == b) & (np.signbit(a) == np.signbit(b))
                    assert np.all(e[known] == a[known]) and np.all(np.signbit(e[known]) == np.signbit(a[known]))
                    assert np.all(((a <= e) & (e <= b))[ok])
        # one center: the store's own ends at both radius brackets, bit for bit
        v0, d0 = (c, r_hi) if w_row is None else gint._weighted(w_row, c, r_hi, BF16_OUTPUT.reduce_unit)
        v1, d1 = (c, r_lo) if w_row is None else gint._weighted(w_row, c, r_lo, BF16_OUTPUT.reduce_unit)
        deg = ends(rows, c, c, r_lo, r_hi)
        (want_lo_min, want_hi_max), (want_lo_max, want_hi_min) = stores._store_ends(v0, d0, dtype), stores._store_ends(v1, d1, dtype)
    _same_bits(deg[0], want_lo_min)
    _same_bits(deg[3], want_hi_max)
    pos = d_lo > 0
    _same_bits(deg[1][pos], want_lo_max[pos])
    _same_bits(deg[2][pos], want_hi_min[pos])


def _adversarial_case(rng, rows, k, n, experts, adv, with_radius, with_bias):
    """A grouped GEMM as :func:`_gemm_case` draws it, each expert's weights and the rows of one adversarial kind."""
    a, w0 = _adversarial(rng, rows, k, adv)
    weights = [w0[:n] if w0.shape[0] >= n else np.resize(w0, (n, k))]
    for _ in range(experts - 1):
        weights.append(_adversarial(rng, rows, k, adv)[1][:n] if 2 * rows >= n else np.resize(w0, (n, k)))
    if adv in ("tie", "near_tie"):
        weights = [np.ascontiguousarray(wi) for wi in weights]
    row_expert, radius, bias = _routing_radius_bias(rng, rows, k, n, experts, with_radius, with_bias, 2.0**-12)
    if adv in ("tie", "near_tie") and bias is not None:
        bias[:] = 0.0
    return a, weights, row_expert, radius, bias


@given(rows=st.integers(1, 24), experts=st.integers(1, 3), n=st.integers(1, 40), k=st.integers(1, 300),
       kind=st.sampled_from(["bf16", "f64", "drift", "int"]),
       adv=st.sampled_from([None, None, "cancel", "tie", "near_tie", "tiny", "huge", "drift", "zeros"]),
       with_radius=st.booleans(), with_bias=st.booleans(), fp8=st.booleans(),
       special=st.sampled_from([None, None, np.inf, np.nan]), weighted=st.booleans(), init=st.booleans(),
       more=st.sampled_from([0.0, 0.06, 1.0]), first_after=st.sampled_from([0, 2, 4, 32]),
       exact_all_from=st.sampled_from([0.0, 0.5, 1.0]), refine_elems=st.sampled_from([1, 600, 1 << 19]),
       seed=st.integers(0, 2**31 - 1))
def test_bracketed_center_stores_the_same_bits(rows, experts, n, k, kind, adv, with_radius, with_bias, fp8, special,
                                               weighted, init, more, first_after, exact_all_from, refine_elems, seed):
    from moeref.compare.kernel_profiles import BF16_OUTPUT_BIAS_INIT

    profile = BF16_OUTPUT_BIAS_INIT if init else BF16_OUTPUT
    rng = np.random.default_rng(seed)
    if adv is None:
        a, weights, row_expert, radius, bias = _gemm_case(rng, rows, k, n, experts, kind, fp8, with_radius,
                                                          with_bias, weight_scale=0.05, special=special)
    else:
        a, weights, row_expert, radius, bias = _adversarial_case(rng, rows, k, n, experts, adv, with_radius,
                                                                 with_bias)
    w_row = None
    if weighted:
        w_row = rng.random(rows) * rng.choice([-1.0, 1.0], rows)
        w_row[rng.random(rows) < 0.1] = 0.0
    fast = bounds_mod._ends_of("bfloat16", w_row, BF16_OUTPUT.reduce_unit, exact_center=False)
    exact = bounds_mod._ends_of("bfloat16", w_row, BF16_OUTPUT.reduce_unit)
    assert not fast.exact_center and exact.exact_center
    with pytest.MonkeyPatch.context() as mp, np.errstate(invalid="ignore", over="ignore"):
        mp.setattr(gint, "_BRACKET_MORE", more)
        mp.setattr(tb, "_FIRST_AFTER", first_after)
        mp.setattr(gint, "_EXACT_ALL_FROM", exact_all_from)
        mp.setattr(tb, "_REFINE_ELEMS", refine_elems)
        got = bounds_mod._rows_gemm_interval(a, radius, row_expert, weights, bias, profile, ends=fast)
        walked = bounds_mod._rows_gemm_interval(a, radius, row_expert, weights, bias, profile, ends=exact)
        want = _rows_gemm_interval_apart(a, radius, row_expert, weights, bias, profile)
        _same_bits(walked[0], want[0])
        stored = [_stored(*x, "bfloat16", w_row) for x in (got, walked, want)]
    for parts in zip(*stored):
        for x in parts[:2]:
            if parts[2].dtype == bool:
                assert np.array_equal(x, parts[2])
            else:
                _same_bits(x, parts[2])
