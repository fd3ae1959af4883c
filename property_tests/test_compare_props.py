"""Hypothesis properties of the error bounds: honest arithmetic never fails (any routing, shape,
scheme, activation, FP32 chunking and order); the stage bounds hold for random perturbations."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeref.activations import apply_activation
from moeref.compare import FP32_ACCUM, activation_error, compare, requant_uncertainty
from moeref.compare.bounds import HOPPER_FP8_DEEPGEMM_DATA, gemm_error_bound
from moeref.compare.faults import LayerCase, candidate, fp32_gemm, reference
from moeref.gemm.exact import BlockOperand, block_gemm
from moeref.quant import fp8_group, fp8_per_token, mxfp8, quantize

try:  # pytest puts property_tests/ on sys.path (rootdir-relative "prepend" import mode)
    from test_moe_props import layers
except ImportError:  # pragma: no cover - package-style collection
    from property_tests.test_moe_props import layers

SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SLOW
@given(layers(), st.sampled_from([1, 4, 16, 32, 1 << 20]), st.booleans())
def test_honest_fp32_arithmetic_never_fails(case, chunk, reverse):
    r = case["routing"]
    if not np.all(np.isfinite(r.weights)):
        return  # NaN router weights make NaN outputs on both sides (checked as equal NaN elsewhere)
    lc = LayerCase(case["hidden"], case["weights"], r.weights, r.ids,
                   dict(activation=case["activation"], quant=case["quant"], num_experts=r.num_experts,
                        out_dtype=np.float32))
    ref = reference(lc)
    rep = compare(candidate(lc, gemm=fp32_gemm(chunk, reverse), gemm1_out_dtype=np.float32,
                            act_out_dtype=np.float32), ref, FP32_ACCUM)
    assert rep.passed, rep.summary()


finite = st.floats(-30, 30, allow_nan=False, width=32)


@settings(deadline=None)
@given(st.sampled_from(["silu_and_mul", "gelu_and_mul", "swigluoai", "swiglustep", "relu2_no_mul",
                        "silu_no_mul", "gelu_no_mul"]),
       st.lists(finite, min_size=4, max_size=4), st.lists(st.floats(0, 2, width=32), min_size=4, max_size=4),
       st.lists(st.floats(-1, 1), min_size=4, max_size=4))
def test_activation_bound_holds(name, h, dh, t):
    h, dh, t = np.array([h]), np.array([dh]), np.array([t])
    kw = {} if name in ("relu2_no_mul", "silu_no_mul", "gelu_no_mul") else {"layout": "gate_up"}
    diff = np.abs(apply_activation(name, h + t * dh, **kw) - apply_activation(name, h, **kw))
    assert np.all(diff <= activation_error(name, h, dh, "gate_up") * (1 + 1e-9) + 1e-9)


@settings(deadline=None)
@given(st.sampled_from([fp8_group(8), fp8_per_token(), mxfp8(block_size=8), fp8_group(8, "ue8m0")]),
       st.integers(0, 2**16), st.floats(1e-7, 1e-1), st.integers(1, 4))
def test_requant_bound_holds(scheme, seed, rel, rows):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 16)) * 4
    dx = np.abs(x) * rel + rel
    qt = quantize(x, scheme)
    unc, _ = requant_uncertainty(x, dx, scheme, qt)
    q0 = qt.dequantize(np.float64)
    for _ in range(8):
        xp = x + dx * rng.uniform(-1, 1, x.shape)
        assert np.all(np.abs(quantize(xp, scheme).dequantize(np.float64) - q0) <= unc)


# ---------------------------------------------------------------- Hopper aligned-adder model


def _aligned_adder_gemm():
    try:  # the oracle lives in tests/test_compare.py (one definition)
        from test_compare import aligned_adder_gemm
    except ImportError:
        import os
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
        from test_compare import aligned_adder_gemm
    return aligned_adder_gemm


def _e4m3(x):
    import ml_dtypes

    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


@st.composite
def hopper_operands(draw):
    """E4M3 operands ``a [m, K]``, ``w [n, K]`` with adversarial magnitudes: Gaussian at a drawn binade,
    one huge product among tiny ones (the accumulator dwarfs later products), partial sums that grow and
    then cancel, all-equal values (every truncation error has the same sign), sparse rows, geometric ramps
    (the last products dominate), all with the same or random signs; block scales of 128 columns
    (non-powers of two included) and an optional bias."""
    k = draw(st.sampled_from([1, 5, 31, 32, 33, 64, 100, 128, 129, 200, 256]))
    m, n = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    pattern = draw(st.sampled_from(["gauss", "one_huge", "cancel", "equal", "sparse", "ramp"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    same_sign = draw(st.booleans())
    mag_a = np.abs(rng.standard_normal((m, k))) * 2.0 ** draw(st.integers(-8, 6))
    mag_w = np.abs(rng.standard_normal((n, k))) * 2.0 ** draw(st.integers(-8, 6))
    if pattern == "one_huge":
        mag_a *= 2.0**-6
        mag_a[:, draw(st.integers(0, k - 1))] = 448.0
    elif pattern == "equal":
        mag_a[:] = draw(st.sampled_from([1.0, 1.125, 15.0, 448.0]))
        mag_w[:] = draw(st.sampled_from([1.0, 1.875, 3.5, 0.01171875]))
    elif pattern == "sparse":
        mag_a *= rng.random((m, k)) < 0.2
    elif pattern == "ramp":
        mag_a *= 2.0 ** (np.arange(k) / 8.0 - k / 8.0 + 6)
    sign_a = np.ones((m, k)) if same_sign else rng.choice([-1.0, 1.0], (m, k))
    sign_w = np.ones((n, k)) if same_sign else rng.choice([-1.0, 1.0], (n, k))
    if pattern == "cancel":  # + over the first half of K, - over the second: partial sums peak, then cancel
        sign_w = np.where(np.arange(k) < k // 2, 1.0, -1.0) * np.ones((n, 1))
        sign_a = np.ones((m, k))
    a, w = _e4m3(mag_a * sign_a), _e4m3(mag_w * sign_w)
    bk = min(128, k)
    scale = st.sampled_from([1.0, 2.0**-10, 0.0123, 3.7, 1 / 448])
    sa = np.array(draw(st.lists(scale, min_size=m * -(-k // bk), max_size=m * -(-k // bk)))).reshape(m, -1)
    sw = np.array(draw(st.lists(scale, min_size=-(-k // bk), max_size=-(-k // bk)))).reshape(1, -1)
    bias = (rng.standard_normal(n) * 10).astype(np.float32) if draw(st.booleans()) else None
    return BlockOperand(a, sa, (1, bk), True), BlockOperand(w, sw, (max(n, 1), bk), True), bias


def _emulate(gemm, a, w, bias):
    out = gemm(a, w)
    return out if bias is None else out + bias.astype(np.float32)


@settings(deadline=None)
@given(hopper_operands(), st.sampled_from([0, 1]), st.sampled_from(["trunc", "floor"]), st.booleans(),
       st.booleans())
def test_aligned_truncating_accumulator_never_exceeds_data_dependent_bound(ops, headroom, rounding, renorm,
                                                                           scaled_domain):
    """Both forms of the bound: the exact unscaled one (grid 2^floor(log2 max)) and, with a zero
    ``a_radius``, the scaled one (grid from the scaled max)."""
    a, w, bias = ops
    exact = block_gemm(a, w) + (0.0 if bias is None else bias.astype(np.float64))
    got = _emulate(_aligned_adder_gemm()(headroom=headroom, rounding=rounding, renormalize=renorm), a, w, bias)
    radius = np.zeros(a.values.shape) if scaled_domain else None
    bound = gemm_error_bound(a, w, HOPPER_FP8_DEEPGEMM_DATA, a_radius=radius, bias=bias)
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= bound), (err / bound).max()


@settings(deadline=None)
@given(hopper_operands(), st.floats(0.0, 0.3), st.integers(0, 2**16))
def test_bound_with_operand_radius_covers_every_operand_in_the_box(ops, rel, seed):
    """GEMM2 multiplies an intermediate known only within ``unc``: the bound of the box's centre with
    ``a_radius`` covers the arithmetic error of any FP8 operand inside the box."""
    a, w, bias = ops
    rng = np.random.default_rng(seed)
    moved = _e4m3(a.values * (1 + rel * rng.uniform(-1, 1, a.values.shape)))
    radius = np.abs(moved - a.values) * np.repeat(np.abs(a.scales), a.block[1], axis=1)[:, : a.values.shape[1]]
    a2 = BlockOperand(moved, a.scales, a.block, True)
    exact = block_gemm(a2, w) + (0.0 if bias is None else bias.astype(np.float64))
    got = _emulate(_aligned_adder_gemm()(headroom=1), a2, w, bias)
    bound = gemm_error_bound(a, w, HOPPER_FP8_DEEPGEMM_DATA, a_radius=radius * (1 + 1e-12), bias=bias)
    assert np.all(np.abs(got.astype(np.float64) - exact) <= bound)


def test_a_narrower_accumulator_violates_the_14_bit_bound():
    """Negative control: the same oracle keeping 10 bits exceeds the bound on all-equal data (every
    truncation error has the same sign), so the soundness property above can fail."""
    a = BlockOperand(_e4m3(np.full((1, 128), 1.125)), np.ones((1, 1)), (1, 128), True)
    w = BlockOperand(_e4m3(np.full((1, 128), 3.5)), np.ones((1, 1)), (1, 128), True)
    exact = block_gemm(a, w)
    bound = gemm_error_bound(a, w, HOPPER_FP8_DEEPGEMM_DATA)
    assert np.abs(_aligned_adder_gemm()(bits=10)(a, w) - exact)[0, 0] > bound[0, 0]
    assert np.abs(_aligned_adder_gemm()(bits=14)(a, w) - exact)[0, 0] <= bound[0, 0]


@settings(deadline=None)
@given(st.integers(1, 80), st.integers(0, 2**32 - 1), st.sampled_from(["normal", "same sign", "cancel", "outlier",
                                                                       "sparse"]))
def test_contiguous_tree_bound_holds_for_random_fp32_trees(k, seed, data):
    """Any binary tree of contiguous K ranges, summed in FP32 round-to-nearest (IEEE adds: adder_factor
    1), stays within the contiguous-tree bound; the tree's split points are drawn at random."""
    import ml_dtypes

    from moeref.compare import Profile

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((3, k))
    w = rng.standard_normal((4, k))
    if data == "same sign":
        a, w = np.abs(a), np.abs(w)
    elif data == "cancel":
        a, w = np.abs(a), np.abs(w) * np.where(np.arange(k) < k // 2, 1.0, -1.0)
    elif data == "outlier":
        a[:, rng.integers(0, k)] *= 1e4
    else:
        a[:, rng.random(k) < 0.5] = 0.0 if data == "sparse" else 1.0
    a = a.astype(ml_dtypes.bfloat16).astype(np.float64)
    w = w.astype(ml_dtypes.bfloat16).astype(np.float64)
    p = (a[:, None, :] * w[None, :, :]).reshape(-1, k).astype(np.float32)  # exact: bf16 x bf16

    def tree(lo, hi):
        if hi - lo == 1:
            return p[:, lo]
        mid = int(rng.integers(lo + 1, hi))
        return tree(lo, mid) + tree(mid, hi)  # float32 + float32: one IEEE rounding

    got = tree(0, k).astype(np.float64).reshape(3, 4)
    bound = gemm_error_bound(a, w, Profile("ieee", accum_model="contiguous_tree", adder_factor=1.0))
    assert np.all(np.abs(got - a @ w.T) <= bound)
