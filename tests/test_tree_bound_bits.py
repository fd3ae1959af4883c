"""The host contiguous-tree bound (:func:`moeref.compare.gemm_bounds.contiguous_tree_gemm_bound`) gives the bits of
its definition as first written: ``np.cumsum`` of every lane count's products over ``[K, rows, cols]`` tiles, every
lane count evaluated for every output. So do the helpers its layer bound calls on the way, which were made faster
the same way: :func:`moeref.compare.summation_order.ordered_dot`, the early ``None`` of
:func:`moeref.compare.operand_radius.exact_radius` and the bf16 test of the products.

Oracles: those implementations, kept here verbatim as the slow definitions (:func:`_tree_oracle`,
:func:`_ordered_dot_oracle`, ...). The tree bound under test walks ``L = 1, 2, 4`` chunk by chunk (in-order row adds),
sums ``|p|`` with one in-order ``np.add.reduce`` along K per chunk, and walks ``L = 8, 16, 32`` only for the lanes
whose ``(sum |p| + |sum p|) / 2`` (BLAS lane sums, with a float64 margin) cannot be ruled out; the draws below cover
both branches (random signs, where the wide lane counts are skipped, and one-signed or structured products, where
none is), several tiles (``_WALK_OUTPUTS`` made small, down to one output: NumPy sums a single column pairwise), K
walked in chunks of 4 to 96 rows (the last one partial), lane sums split into many small BLAS products
(``_CAP_MACS``), the lanes walked one by one in batches down to one lane (``_LANE_ELEMS``), the wide lane counts
walked for every output from a smaller K (``_WALK_ALL_FROM``: none, some or all of them), K not a multiple of the 32
lanes, a radius, a bias, zero rows and columns, inf and NaN elements (non-finite outputs take every lane),
products that underflow (operands scaled by ``2^-520`` or ``2^-1000``), block-scaled FP8 operands and float operands
whose products are or are not exact in FP32. The layer bound's GEMM interval, which takes the GEMM's center from the
walk of ``L = 1`` (``in_order_sum``) and the radius term from the bound's ``ordered_dot``, is checked against the
three computed apart (:func:`_rows_gemm_interval_apart`). Equal means the same float64 bits (NaN compared as NaN)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeref.compare import bounds as bounds_mod
from moeref.compare import contiguous_tree as ct
from moeref.compare import gemm_bounds as gb
from moeref.compare import gemm_intervals as gint
from moeref.compare import operand_radius as orad
from moeref.compare import summation_order as so
from moeref.compare import tree_brackets as tb
from moeref.compare.bounds import BF16_OUTPUT, FP32_ACCUM, Profile
from moeref.gemm.exact import as_operand, quantum_and_max
from moeref.quant import fp8_block, fp8_group, quantize

IEEE = Profile("IEEE_TREE", accum_model="contiguous_tree", adder_factor=1.0)


def _tree_oracle(a, w, profile, radius, b_abs) -> np.ndarray:
    """The contiguous-tree bound as defined before the in-order row-add walks (the definition's bits)."""
    m, k = a.values.shape
    n = w.values.shape[0]
    if m == 0 or n == 0:
        return np.zeros((m, n))
    u = float(profile.accum_unit)
    rho = float(profile.adder_factor)
    u_prom = float(profile.promote_unit)
    ad, wd = a.dequantize(), w.dequantize()
    lanes = max(gb.TREE_LANES)
    kp = -(-max(k, 1) // lanes) * lanes
    if kp != k:
        ad = np.pad(ad, ((0, 0), (0, kp - k)))
        wd = np.pad(wd, ((0, 0), (0, kp - k)))
    d = (np.zeros((m, n)) if radius is None
         else gb.ordered_dot(radius, np.abs(w.dequantize())) * (1.0 + gb.gamma(k + 2, gb.U_F64)))
    rng = np.zeros((m, n))
    wsum = np.zeros((m, n))
    csum = np.zeros((m, n))
    at, wt = np.ascontiguousarray(ad.T), np.ascontiguousarray(wd.T)
    nb = max(1, min(n, (1 << 15) // kp))
    rb = max(1, (1 << 15) // (kp * nb))
    for r0 in range(0, m, rb):
        r1 = min(r0 + rb, m)
        for n0 in range(0, n, nb):
            n1 = min(n0 + nb, n)
            p = at[:, r0:r1, None] * wt[:, None, n0:n1]
            walk = np.empty_like(p)
            np.cumsum(np.abs(p), axis=0, out=walk)
            wsum[r0:r1, n0:n1] = walk[-1]
            best = np.zeros((r1 - r0, n1 - n0))
            for lane in gb.TREE_LANES[::-1]:
                wl = walk.reshape(kp // lane, lane, r1 - r0, n1 - n0)
                np.cumsum(p.reshape(wl.shape), axis=0, out=wl)
                top = np.maximum(wl.max(axis=0), 0.0)
                top -= np.minimum(wl.min(axis=0), 0.0)
                best = np.maximum(best, top.max(axis=0))
            csum[r0:r1, n0:n1] = walk[-1]
            rng[r0:r1, n0:n1] = best
    slack = 2.0 * gb.gamma(kp + 2, gb.U_F64) * wsum
    r_hi = rng + slack + d
    w_hi = wsum * (1.0 + gb.gamma(kp + 2, gb.U_F64)) + d
    c_hi = np.abs(csum) + slack + d
    sigma = gb.gamma(2, u_prom)
    u_prod = 0.0 if ct._products_exact_in_fp32(a, w) else 2.0 * u
    t = rho * max(k - 1, 0) * u
    denom = 1.0 - t - sigma
    if denom <= 0:
        return np.full((m, n), np.inf)
    acc = (t * r_hi + (sigma + u_prod) * w_hi) / np.float64(denom)
    out = acc + u_prom * (c_hi + acc + b_abs[None, :]) + (k + 2) * 2.0**-149
    return out * (1.0 + 1e-9)


def _same_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype == np.float64
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.int64), want[~nan].view(np.int64))


def _values(rng, shape, kind):
    """Elements of one of several kinds: bf16 normals (exact FP32 products), float64 normals (inexact), one-signed
    (no lane count skipped), a slow drift with small noise (long one-signed runs), small integers with zeros."""
    if kind == "bf16":
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float64)
    if kind == "f64":
        return rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
    if kind == "positive":
        return np.abs(rng.standard_normal(shape)) + 0.1
    if kind == "drift":
        return 0.3 + rng.standard_normal(shape)
    return rng.integers(-3, 4, shape).astype(np.float64)

def _gemm_case(rng, rows, k, n, experts, kind, fp8, with_radius, with_bias, weight_scale=1.0, special=None):
    """``(a, weights, row_expert, radius, bias)`` of a grouped GEMM drawn from ``rng``: values of ``kind``
    (weights times ``weight_scale``; ``special`` written into one element of ``a`` unless FP8), FP8 1x128 / 128x128
    when ``fp8``, row experts in ``-1 .. experts - 1`` (-1: padding), half the radius entries zero when
    ``with_radius``, a normal bias when ``with_bias``."""
    a = _values(rng, (rows, k), kind)
    weights = [_values(rng, (n, k), kind) for _ in range(experts)]
    if weight_scale != 1.0:
        weights = [weight_scale * wi for wi in weights]
    if special is not None and not fp8:
        a[rng.integers(0, rows), rng.integers(0, k)] = special
    if fp8:
        a = quantize(a.astype(np.float32), fp8_group(min(128, k)))
        weights = [quantize(wi.astype(np.float32), fp8_block()) for wi in weights]
    return (a, weights, *_routing_radius_bias(rng, rows, k, n, experts, with_radius, with_bias))


def _routing_radius_bias(rng, rows, k, n, experts, with_radius, with_bias, radius_scale=2.0**-9):
    """``(row_expert, radius, bias)`` drawn from ``rng`` in that order: row experts in ``-1 .. experts - 1``, a
    ``[rows, k]`` radius of ``|normal| * radius_scale`` with half its entries zero (None unless ``with_radius``), a
    normal ``[experts, n]`` bias (None unless ``with_bias``)."""
    row_expert = rng.integers(-1, experts, rows)
    radius = None
    if with_radius:
        radius = np.abs(rng.standard_normal((rows, k))) * radius_scale
        radius[rng.random((rows, k)) < 0.5] = 0.0
    bias = rng.standard_normal((experts, n)) if with_bias else None
    return row_expert, radius, bias


@given(m=st.integers(1, 9), n=st.integers(1, 40), k=st.integers(1, 140),
       kind_a=st.sampled_from(["bf16", "f64", "positive", "drift", "int"]),
       kind_w=st.sampled_from(["bf16", "f64", "positive", "drift", "int"]),
       tile=st.sampled_from([1, 5, 16, 2048]), rows=st.sampled_from([4, 8, 12, 32, 64, 96]),
       cap_macs=st.sampled_from([1, 100, 1 << 18]), lane_elems=st.sampled_from([1, 50, 1 << 21]),
       walk_all_from=st.sampled_from([0, 1, 16, 64]),
       with_radius=st.booleans(), with_bias=st.booleans(),
       zeros=st.booleans(), special=st.sampled_from([None, np.inf, -np.inf, np.nan]),
       scale=st.sampled_from([0, 0, -520, -1000]),
       profile=st.sampled_from([BF16_OUTPUT, FP32_ACCUM, IEEE]), seed=st.integers(0, 2**31 - 1))
def test_float_operands_same_bits_as_the_definition(m, n, k, kind_a, kind_w, tile, rows, cap_macs, lane_elems,
                                                    walk_all_from, with_radius, with_bias, zeros, special, scale,
                                                    profile, seed):
    rng = np.random.default_rng(seed)
    a = _values(rng, (m, k), kind_a) * 2.0**scale
    w = _values(rng, (n, k), kind_w) * 2.0**(scale // 2)
    if zeros:
        a[rng.integers(0, m)] = 0.0
        w[:, rng.integers(0, k)] = 0.0
        w[rng.integers(0, n)] = -0.0
    if special is not None:
        a[rng.integers(0, m), rng.integers(0, k)] = special
    radius = np.abs(rng.standard_normal((m, k))) * 1e-3 if with_radius else None
    b_abs = np.abs(rng.standard_normal(n)) if with_bias else np.zeros(n)
    A, W = as_operand(a), as_operand(w)
    with np.errstate(invalid="ignore", over="ignore"):
        want = _tree_oracle(A, W, profile, radius, b_abs)
    with pytest.MonkeyPatch.context() as mp, np.errstate(invalid="ignore", over="ignore"):
        mp.setattr(ct, "_WALK_OUTPUTS", tile)
        mp.setattr(ct, "_WALK_ROWS", rows)
        mp.setattr(ct, "_CAP_MACS", cap_macs)
        mp.setattr(ct, "_LANE_ELEMS", lane_elems)
        mp.setattr(ct, "_WALK_ALL_FROM", walk_all_from)
        got = gb.contiguous_tree_gemm_bound(A, W, profile, radius, b_abs)
    _same_bits(got, want)


@given(m=st.integers(1, 4), n=st.integers(1, 24), k=st.sampled_from([256, 384, 512, 1000]),
       seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["bf16", "positive", "drift"]))
def test_wide_lanes_walked_lane_by_lane_same_bits(m, n, k, seed, kind):
    """Long K with few outputs: every lane count 8-32 has lanes that pass and lanes that fail their cap (one-signed
    and drifting products raise the wide lanes' ranges; random signs do not)."""
    rng = np.random.default_rng(seed)
    a = _values(rng, (m, k), kind)
    w = _values(rng, (n, k), "bf16")
    w[:, rng.integers(0, k, size=k // 3)] = np.abs(w[:, rng.integers(0, k, size=k // 3)])
    A, W = as_operand(a), as_operand(w)
    b_abs = np.zeros(n)
    _same_bits(gb.contiguous_tree_gemm_bound(A, W, IEEE, None, b_abs), _tree_oracle(A, W, IEEE, None, b_abs))


@pytest.mark.parametrize("scheme", ["group", "block"])
@given(m=st.integers(1, 6), n=st.integers(1, 24), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       with_radius=st.booleans())
def test_fp8_operands_same_bits_as_the_definition(scheme, m, n, k, seed, with_radius):
    rng = np.random.default_rng(seed)
    a = quantize(rng.standard_normal((m, k)).astype(np.float32), fp8_group(min(128, k)) if scheme == "group"
                 else fp8_group())
    w = quantize((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), fp8_block())
    A, W = as_operand(a), as_operand(w)
    radius = np.abs(rng.standard_normal((m, k))) * 1e-2 if with_radius else None
    b_abs = np.abs(rng.standard_normal(n))
    _same_bits(gb.contiguous_tree_gemm_bound(A, W, BF16_OUTPUT, radius, b_abs),
               _tree_oracle(A, W, BF16_OUTPUT, radius, b_abs))


@pytest.mark.parametrize("m,n,k", [(8, 600, 512), (40, 96, 1000)])
def test_layer_sized_random_signs_same_bits(m, n, k):
    """Expert-sized shapes with random signs, where most outputs skip the wide lane counts (several tiles)."""
    rng = np.random.default_rng(m + n + k)
    a = _values(rng, (m, k), "bf16")
    w = (0.02 * _values(rng, (n, k), "bf16")).astype(ml_dtypes.bfloat16).astype(np.float64)
    A, W = as_operand(a), as_operand(w)
    b_abs = np.abs(rng.standard_normal(n))
    _same_bits(gb.contiguous_tree_gemm_bound(A, W, BF16_OUTPUT, None, b_abs),
               _tree_oracle(A, W, BF16_OUTPUT, None, b_abs))


def test_empty_shapes():
    for m, n, k in [(0, 3, 5), (3, 0, 5), (2, 3, 0)]:
        A, W = as_operand(np.ones((m, k))), as_operand(np.ones((n, k)))
        _same_bits(gb.contiguous_tree_gemm_bound(A, W, BF16_OUTPUT, None, np.zeros(n)),
                   _tree_oracle(A, W, BF16_OUTPUT, None, np.zeros(n)))


def test_layer_bound_same_bits_with_the_definition():
    """``layer_bound`` under ``BF16_OUTPUT`` (both GEMMs, GEMM2 with its re-quantization radius) is unchanged bit for
    bit when the definition's implementation computes every contiguous-tree bound."""
    from moeref.compare import layer_bound
    from moeref.moe import make_layer, make_tokens, run_moe
    from moeref.routing import softmax_topk

    layer = make_layer(8, 64, 96, seed=0)
    x = make_tokens(24, 64, seed=1)
    r = softmax_topk(np.random.default_rng(2).standard_normal((24, 8)).astype(np.float32), 2)
    run = run_moe(x, layer, r.weights, r.ids)
    got = layer_bound(run, "BF16_OUTPUT")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gb, "contiguous_tree_gemm_bound", _tree_oracle)
        mp.setattr(bounds_mod, "_rows_gemm_interval", _rows_gemm_interval_apart)
        want = layer_bound(run, "BF16_OUTPUT")
    _same_bits(got.bound, want.bound)
    _same_bits(got.radius, want.radius)
    _same_bits(got.center, want.center)
    assert got.flips == want.flips


def _rows_gemm_interval_apart(a, a_radius, row_expert, weights, bias, profile, ends=None):
    """The GEMM interval of the layer bound as first written: the center from its own GEMM
    (``expert_rows_gemm``), the bound per expert through ``gemm_error_bound``, the radius term from ``radius_dot``
    (the exact radius everywhere, whatever the store's ``ends``)."""
    from moeref.gemm import expert_rows_gemm

    center = expert_rows_gemm(a, row_expert, weights, bias)
    bound = bounds_mod._rows_error_bound(a, a_radius, row_expert, weights, bias, profile)
    return center, bound if a_radius is None else bounds_mod._rows_radius_term(a_radius, row_expert, weights) + bound


@given(rows=st.integers(0, 12), experts=st.integers(1, 4), n=st.integers(1, 16), k=st.integers(1, 200),
       kind=st.sampled_from(["bf16", "f64", "int"]), with_radius=st.booleans(), with_bias=st.booleans(),
       fp8=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_rows_gemm_interval_same_bits_as_apart(rows, experts, n, k, kind, with_radius, with_bias, fp8, seed):
    """The layer bound's GEMM interval (center from the walk where ``in_order_sum`` holds, radius term from the
    bound's ``ordered_dot``) against the center, bound and radius term computed apart: the same bits, padding rows
    (-1) and experts without rows included; FP8 operands take ``block_gemm`` for the center."""
    rng = np.random.default_rng(seed)
    a, weights, row_expert, radius, bias = _gemm_case(rng, rows, k, n, experts, kind, fp8, with_radius, with_bias)
    got = bounds_mod._rows_gemm_interval(a, radius, row_expert, weights, bias, BF16_OUTPUT)
    want = _rows_gemm_interval_apart(a, radius, row_expert, weights, bias, BF16_OUTPUT)
    _same_bits(got[0], want[0])
    _same_bits(got[1], want[1])


@given(m=st.integers(1, 6), n=st.integers(1, 20), k=st.integers(1, 300),
       kind_a=st.sampled_from(["bf16", "f64", "drift", "int"]), kind_w=st.sampled_from(["bf16", "f64", "int"]),
       zeros=st.booleans(), special=st.sampled_from([None, np.inf, np.nan]), with_radius=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_tree_parts_give_the_gemm_and_the_radius_dot(m, n, k, kind_a, kind_w, zeros, special, with_radius, seed):
    """``contiguous_tree_parts``: its bound is ``gemm_error_bound``'s, its in-order sum plus +0.0 is ``block_gemm``'s
    result for a float pair (``in_order_sum``; oracle: the products' ``np.cumsum`` along K from +0.0), its radius dot
    ``ordered_dot``'s; zero products of either sign (a zero row, a -0.0 row of w) and inf / NaN elements included."""
    from moeref.gemm.exact import block_gemm, in_order_sum

    rng = np.random.default_rng(seed)
    a, w = _values(rng, (m, k), kind_a), _values(rng, (n, k), kind_w)
    if zeros:
        a[rng.integers(0, m)] = 0.0
        w[rng.integers(0, n)] = -0.0
    if special is not None:
        a[rng.integers(0, m), rng.integers(0, k)] = special
    radius = np.abs(rng.standard_normal((m, k))) * 1e-3 if with_radius else None
    A, W = as_operand(a), as_operand(w)
    assert in_order_sum(A, W)
    with np.errstate(invalid="ignore", over="ignore"):
        bound, total, rdot = gb.contiguous_tree_parts(A, W, BF16_OUTPUT, a_radius=radius)
        _same_bits(bound, gb.gemm_error_bound(A, W, BF16_OUTPUT, a_radius=radius))
        prods = np.concatenate([np.zeros((m, n, 1)), a[:, None, :] * w[None, :, :]], axis=2)
        _same_bits(total + 0.0, np.cumsum(prods, axis=2)[..., -1] + 0.0)
        _same_bits(total + 0.0, block_gemm(A, W))
    if radius is None:
        assert rdot is None
    else:
        _same_bits(rdot, _ordered_dot_oracle(radius, np.abs(w)))


@pytest.mark.parametrize("k,order", [(256, (so.ORDER_CHUNK, so.ORDER_STEP)), (1024, (so.ORDER_CHUNK, so.ORDER_STEP)),
                                     (192, (64, 16))])
def test_ordered_dot_reads_a_k_major_w_in_place_same_bits(k, order):
    """Whole chunks (``K`` a multiple of the chunk): ``w_t`` is read as a view; the bits are the definition's."""
    rng = np.random.default_rng(k)
    x = np.abs(rng.standard_normal((5, k))) * np.exp2(rng.integers(-30, 30, (5, k)))
    w = rng.standard_normal((33, k)) * np.exp2(rng.integers(-30, 30, (33, k)))
    w_t = np.ascontiguousarray(np.pad(w, ((0, 0), (0, 32)), constant_values=np.nan).T)
    _same_bits(so.ordered_dot(x, None, *order, w_t=w_t), _ordered_dot_oracle(x, w, *order))


def test_in_order_sum_only_for_one_segment_with_unit_scales():
    from moeref.gemm.exact import BlockOperand, in_order_sum

    f = as_operand(np.ones((2, 256), dtype=np.float32))
    q = as_operand(quantize(np.ones((2, 256), dtype=np.float32), fp8_group(128)))
    assert in_order_sum(f, f)
    assert not in_order_sum(q, f)  # two segments of 128 (the FP8 group)
    assert not in_order_sum(q, q)  # the blocked path (BLAS on exact partial dots)
    assert not in_order_sum(f, BlockOperand(np.ones((2, 256)), np.full((1, 1), 2.0), (2, 256), False))
    assert not in_order_sum(as_operand(np.ones((2, 0))), as_operand(np.ones((3, 0))))


def _ordered_dot_oracle(x, w, chunk=so.ORDER_CHUNK, step=so.ORDER_STEP):
    """:func:`moeref.compare.summation_order.ordered_dot` as first written (gathered columns, a new array per add)."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    m, k = x.shape
    n = w.shape[0]
    out = np.zeros((m, n))
    if m == 0 or n == 0 or k == 0:
        return out
    cols = so.grouped_columns(k, chunk, step)
    xg, wg = so._gather_cols(x, cols), so._gather_cols(w, cols)
    rb = max(1, so._BLOCK_ELEMS // max(1, n * cols.size))
    for r0 in range(0, m, rb):
        r1 = min(r0 + rb, m)
        t = np.zeros((r1 - r0, n) + cols.shape[:2])
        for i in range(cols.shape[2]):  # column order within a step
            t = t + xg[r0:r1, None, :, :, i] * wg[None, :, :, :, i]
        s = np.zeros(t.shape[:3])
        for j in range(cols.shape[1]):
            s = s + t[..., j]
        tot = np.zeros((r1 - r0, n))
        for c in range(cols.shape[0]):
            tot = tot + s[..., c]
        out[r0:r1] = tot
    return out


@given(m=st.integers(0, 7), n=st.integers(0, 30), k=st.integers(0, 300),
       order=st.sampled_from([(so.ORDER_CHUNK, so.ORDER_STEP), (64, 16), (100, 32), (7, 3)]),
       block=st.sampled_from([None, 1, 3]), special=st.sampled_from([None, np.inf, -np.inf, np.nan, -0.0]),
       scale=st.sampled_from([0, -540, -1060]), seed=st.integers(0, 2**31 - 1))
def test_ordered_dot_same_bits_as_the_definition(m, n, k, order, block, special, scale, seed):
    rng = np.random.default_rng(seed)
    x = np.abs(rng.standard_normal((m, k))) * np.exp2(rng.integers(-30, 30, (m, k)) + scale)
    w = rng.standard_normal((n, k)) * np.exp2(rng.integers(-30, 30, (n, k)))
    if special is not None and m and k:
        x[rng.integers(0, m), rng.integers(0, k)] = special
    with pytest.MonkeyPatch.context() as mp, np.errstate(invalid="ignore", over="ignore"):
        if block is not None:  # row blocks of the [rows, N, K] tensor down to one row
            mp.setattr(so, "_ORDER_BLOCK_ELEMS", block)
        got = so.ordered_dot(x, w, *order)
        want = _ordered_dot_oracle(x, w, *order)
        # w given K-major (w_t=), with rows beyond K that are not read (read in place for whole chunks)
        w_t = np.ascontiguousarray(np.pad(w, ((0, 0), (0, int(rng.integers(0, 40)))), constant_values=7.0).T)
        got_t = so.ordered_dot(x, None, *order, w_t=w_t)
    _same_bits(got, want)
    _same_bits(got_t, want)


def _exact_radius_oracle(radius, w):
    """:func:`moeref.compare.operand_radius.exact_radius` without its early ``None`` (the grid bits from
    :func:`moeref.gemm.exact.quantum_and_max` always)."""
    radius = np.asarray(radius, dtype=np.float64)
    k = radius.shape[1]
    if not (np.all(np.isfinite(radius)) and np.all(np.isfinite(w.scales)) and np.all(np.isfinite(w.values))):
        return None
    if not orad.chunk_scales_constant(k, w.block[1], orad.RADIUS_CHUNK):
        return None
    bits = orad.radius_grid_bits(quantum_and_max(w.values))
    return None if bits is None else orad.rounded_radius(radius, bits)


@given(n=st.integers(1, 6), k=st.integers(1, 300), spread=st.integers(0, 40), seed=st.integers(0, 2**31 - 1),
       zeros=st.booleans(), kind=st.sampled_from(["grid", "float32"]))
def test_exact_radius_early_none_same_as_the_definition(n, k, spread, seed, zeros, kind):
    """Weights whose largest and smallest nonzero magnitudes are ``2^spread`` apart (around the 2^29 at which the
    grid keeps fewer than MIN_GRID_BITS bits), on a power-of-two grid or arbitrary float32 values."""
    rng = np.random.default_rng(seed)
    if kind == "grid":
        wv = rng.integers(1, 8, (n, k)) * np.exp2(-rng.integers(0, spread + 1, (n, k))) * rng.choice([-1, 1], (n, k))
    else:
        wv = (rng.standard_normal((n, k)) * np.exp2(-rng.integers(0, spread + 1, (n, k)))).astype(np.float32)
    if zeros:
        wv[rng.integers(0, n)] = 0.0
    w = as_operand(np.asarray(wv, dtype=np.float64))
    radius = np.abs(rng.standard_normal((2, k)))
    got, want = orad.exact_radius(radius, w), _exact_radius_oracle(radius, w)
    assert (got is None) == (want is None)
    if want is not None:
        _same_bits(got, want)


def _bf16_products_oracle(a, w) -> bool:
    def bf16_exact(v):
        v = np.asarray(v, dtype=np.float64)
        return bool(np.all(np.isfinite(v)) and np.array_equal(v.astype(ml_dtypes.bfloat16).astype(np.float64), v))

    return bf16_exact(a.values) and bf16_exact(w.values)


@given(shape=st.sampled_from([(1, 1), (3, 5), (4, 100), (2, 300)]), kind=st.sampled_from(["bf16", "f64", "int"]),
       late=st.sampled_from([None, 0.1, 1.0 + 2.0**-20, 2.0**-140, np.inf, np.nan, -0.0]),
       seed=st.integers(0, 2**31 - 1))
def test_products_exact_in_fp32_same_as_the_definition(shape, kind, late, seed):
    """bf16, float and integer elements, one element that is not bf16 (or non-finite, or -0) placed last, after the
    elements the fast test reads first."""
    rng = np.random.default_rng(seed)
    a = _values(rng, shape, kind)
    w = _values(rng, shape, "bf16")
    if late is not None:
        a[-1, -1] = late
    A, W = as_operand(a), as_operand(w)
    assert ct._products_exact_in_fp32(A, W) == _bf16_products_oracle(A, W)
    assert ct._products_exact_in_fp32(W, A) == _bf16_products_oracle(W, A)


def _stored(center, radius, dtype, w_row):
    """The store of a GEMM interval as ``_chunk_interval`` makes it (after the epilogue weights where given)."""
    if w_row is not None:
        center, radius = bounds_mod._weighted(w_row[:, None], center, radius, BF16_OUTPUT.reduce_unit)
    return bounds_mod.store_interval(center, radius, dtype)


@given(rows=st.integers(1, 24), experts=st.integers(1, 3), n=st.integers(1, 40), k=st.integers(1, 300),
       kind=st.sampled_from(["bf16", "f64", "drift", "int"]), with_radius=st.booleans(), with_bias=st.booleans(),
       fp8=st.booleans(), special=st.sampled_from([None, None, np.inf, np.nan]),
       dtype=st.sampled_from(["bfloat16", "bfloat16", "float16", "float32"]), weighted=st.booleans(),
       exact_all_from=st.sampled_from([0.0, 0.5, 1.0]), lane_elems=st.sampled_from([1, 600, 1 << 21]),
       init=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_rows_gemm_interval_with_ends_stores_the_same_bits(rows, experts, n, k, kind, with_radius, with_bias, fp8,
                                                           special, dtype, weighted, exact_all_from, lane_elems, init,
                                                           seed):
    """With the store's ``ends`` the GEMM interval brackets the radius and walks the lane counts only where the
    store's ends stay open: its store (center, half-width, flips), after the epilogue weights or not, has the bits of
    the store of the exact interval (oracle: the interval computed apart, every lane walked for every output),
    whether the open outputs are refined one lane count at a time (in batches down to two outputs) or the whole GEMM
    is walked (``_EXACT_ALL_FROM``); the center is the same either way."""
    from moeref.compare.kernel_profiles import BF16_OUTPUT_BIAS_INIT

    profile = BF16_OUTPUT_BIAS_INIT if init else BF16_OUTPUT
    rng = np.random.default_rng(seed)
    a, weights, row_expert, radius, bias = _gemm_case(rng, rows, k, n, experts, kind, fp8, with_radius, with_bias,
                                                      weight_scale=0.05, special=special)
    w_row = rng.random(rows) if weighted else None
    with pytest.MonkeyPatch.context() as mp:  # every store dtype bracketed (FP16 and FP32 leave most ends open)
        mp.setattr(gint, "_BRACKETED_STORES", (dtype,))
        ends = bounds_mod._ends_of(dtype, w_row, BF16_OUTPUT.reduce_unit)
    assert ends is not None
    with pytest.MonkeyPatch.context() as mp, np.errstate(invalid="ignore", over="ignore"):
        mp.setattr(gint, "_EXACT_ALL_FROM", exact_all_from)
        mp.setattr(tb, "_REFINE_ELEMS", lane_elems)
        got = bounds_mod._rows_gemm_interval(a, radius, row_expert, weights, bias, profile, ends=ends)
        want = _rows_gemm_interval_apart(a, radius, row_expert, weights, bias, profile)
        _same_bits(got[0], want[0])
        for x, y in zip(_stored(*got, dtype, w_row), _stored(*want, dtype, w_row)):
            if x.dtype == bool:
                assert np.array_equal(x, y)
            else:
                _same_bits(x, y)


@given(m=st.integers(1, 8), n=st.integers(1, 30), k=st.integers(1, 400),
       kind_a=st.sampled_from(["bf16", "f64", "positive", "drift", "int"]),
       kind_w=st.sampled_from(["bf16", "f64", "positive", "drift", "int"]),
       with_radius=st.booleans(), with_bias=st.booleans(), scale=st.sampled_from([0, 0, -520, -1000]),
       seed=st.integers(0, 2**31 - 1))
def test_tree_brackets_hold_the_bound(m, n, k, kind_a, kind_w, with_radius, with_bias, scale, seed):
    """``_TreeBrackets``: ``lo <= bound <= hi`` (the bound of the definition) before any walk of ``L >= 2`` and after
    each lane count walked (``refine``), including products that underflow; after every lane count, refine's bounds
    are the definition's bits. Its in-order sum is the definition's walk's (``block_gemm``'s for a float pair)."""
    rng = np.random.default_rng(seed)
    a = _values(rng, (m, k), kind_a) * 2.0**scale
    w = _values(rng, (n, k), kind_w) * 2.0**(scale // 2)
    radius = np.abs(rng.standard_normal((m, k))) * 1e-3 if with_radius else None
    b_abs = np.abs(rng.standard_normal(n)) if with_bias else np.zeros(n)
    A, W = as_operand(a), as_operand(w)
    want = _tree_oracle(A, W, BF16_OUTPUT, radius, b_abs)
    tree = tb._TreeBrackets(A, W, radius, b_abs, BF16_OUTPUT)
    lo, hi = tree.bounds(1)
    assert np.all(lo <= want) and np.all(want <= hi)
    from moeref.gemm.exact import block_gemm

    _same_bits(tree.total + 0.0, block_gemm(A, W))
    levels = []

    def settle(mi, ni, lo, hi):
        levels.append(len(levels))
        assert np.all(lo <= want[mi, ni]) and np.all(want[mi, ni] <= hi)
        return rng.random(mi.size) < 0.3  # some settle at each lane count, the others go on

    mi, ni = np.nonzero(np.ones((m, n), dtype=bool))
    gi, gj, bound, rdot = tree.refine(mi, ni, settle)
    assert len(levels) >= 1
    _same_bits(bound, want[gi, gj])
    if with_radius:
        _same_bits(rdot, _ordered_dot_oracle(radius, np.abs(w))[gi, gj])


@given(x=st.integers(1, 30), k=st.integers(1, 700), seed=st.integers(0, 2**31 - 1))
def test_ordered_dot_pairs_is_ordered_dot_per_output(x, k, seed):
    rng = np.random.default_rng(seed)
    a = np.abs(rng.standard_normal((x, k))) * np.exp2(rng.integers(-30, 30, (x, k)))
    b = rng.standard_normal((x, k)) * np.exp2(rng.integers(-30, 30, (x, k)))
    want = np.array([_ordered_dot_oracle(a[i:i + 1], b[i:i + 1])[0, 0] for i in range(x)])
    _same_bits(so.ordered_dot_pairs(a, b), want)
