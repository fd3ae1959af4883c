"""Hypothesis properties of the error bounds: honest arithmetic never fails (any routing, shape,
scheme, activation, FP32 chunking and order); the stage bounds hold for random perturbations."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeref.activations import apply_activation
from moeref.compare import FP32_ACCUM, activation_error, compare, requant_uncertainty
from moeref.compare.faults import LayerCase, candidate, fp32_gemm, reference
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
