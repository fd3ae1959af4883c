"""The host contiguous-tree bound (:func:`moeref.compare.gemm_bounds.contiguous_tree_gemm_bound`) gives the bits of
its definition as first written: ``np.cumsum`` of every lane count's products over ``[K, rows, cols]`` tiles, every
lane count evaluated for every output.

Oracle: that implementation, kept here verbatim as the slow definition (:func:`_tree_oracle`). The implementation
under test walks the lanes with in-order row adds and skips, per output, the lane counts whose every lane's
``(sum |p| + |sum p|) / 2`` cannot raise the range already reached; the draws below cover both branches (random signs,
where the wide lane counts are skipped, and one-signed or structured products, where none is), several tiles
(``_WALK_OUTPUTS`` made small; K walked in chunks of 32, 64 or 96 rows, the last one partial), K not a multiple of
the 32 lanes, a radius, a bias, zero rows and columns, inf and NaN elements (non-finite tiles take every lane
count), block-scaled FP8 operands and float operands whose products are or are not exact in FP32. Equal means the same float64 bits (NaN compared as NaN)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeref.compare import gemm_bounds as gb
from moeref.compare.bounds import BF16_OUTPUT, FP32_ACCUM, Profile
from moeref.gemm.exact import as_operand
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
    u_prod = 0.0 if gb._products_exact_in_fp32(a, w) else 2.0 * u
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


@given(m=st.integers(1, 9), n=st.integers(1, 40), k=st.integers(1, 140),
       kind_a=st.sampled_from(["bf16", "f64", "positive", "drift", "int"]),
       kind_w=st.sampled_from(["bf16", "f64", "positive", "drift", "int"]),
       tile=st.sampled_from([1, 5, 16, 2048]), rows=st.sampled_from([32, 64, 96]), with_radius=st.booleans(),
       with_bias=st.booleans(),
       zeros=st.booleans(), special=st.sampled_from([None, np.inf, -np.inf, np.nan]),
       profile=st.sampled_from([BF16_OUTPUT, FP32_ACCUM, IEEE]), seed=st.integers(0, 2**31 - 1))
def test_float_operands_same_bits_as_the_definition(m, n, k, kind_a, kind_w, tile, rows, with_radius,
                                                    with_bias, zeros, special, profile, seed):
    rng = np.random.default_rng(seed)
    a = _values(rng, (m, k), kind_a)
    w = _values(rng, (n, k), kind_w)
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
        mp.setattr(gb, "_WALK_OUTPUTS", tile)
        mp.setattr(gb, "_WALK_ROWS", rows)
        got = gb.contiguous_tree_gemm_bound(A, W, profile, radius, b_abs)
    _same_bits(got, want)


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
        want = layer_bound(run, "BF16_OUTPUT")
    _same_bits(got.bound, want.bound)
    _same_bits(got.radius, want.radius)
    assert got.flips == want.flips
