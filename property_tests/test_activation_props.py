"""Hypothesis properties of moeref.activations: W13 converters are exact bijections for all layout
pairs, activations agree across layouts once the weights are converted, limits bound the output,
and inputs are never modified."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from moeref.activations import (
    ACTIVATIONS,
    W13_LAYOUTS,
    convert_w13,
    convert_w13_bias,
    join_w13,
    silu_and_mul,
    split_w13,
    swiglustep,
    swigluoai,
)

layouts = st.sampled_from(W13_LAYOUTS)
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def w13_arrays(draw, min_dims=2):
    lead = draw(st.lists(st.integers(1, 3), min_size=min_dims - 2, max_size=2))
    n = draw(st.integers(0, 6))
    k = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([np.float32, np.float64, np.uint8, np.int32]))
    return draw(hnp.arrays(dtype, (*lead, 2 * n, k)))


@given(w13_arrays(), layouts, layouts)
def test_convert_w13_roundtrip_exact_all_pairs(w, src, dst):
    out = convert_w13(w, src, dst)
    assert out.dtype == w.dtype and out.shape == w.shape
    back = convert_w13(out, dst, src)
    assert np.array_equal(back.view(np.uint8), w.view(np.uint8))  # bit-exact, NaN payloads too
    g0, u0 = split_w13(w, src)
    g1, u1 = split_w13(out, dst)
    assert np.array_equal(g0.view(np.uint8), g1.view(np.uint8))
    assert np.array_equal(u0.view(np.uint8), u1.view(np.uint8))


@given(w13_arrays(), layouts, layouts, layouts)
def test_convert_w13_composes(w, a, b, c):
    direct = convert_w13(w, a, c)
    via = convert_w13(convert_w13(w, a, b), b, c)
    assert np.array_equal(direct.view(np.uint8), via.view(np.uint8))


@given(st.integers(1, 3), st.integers(0, 6), layouts, layouts, st.data())
def test_bias_converters_roundtrip(e, n, src, dst, data):
    b = data.draw(hnp.arrays(np.float32, (e, 2 * n), elements=finite.map(np.float32)))
    back = convert_w13_bias(convert_w13_bias(b, src, dst), dst, src)
    np.testing.assert_array_equal(back, b)


@given(st.integers(1, 4), st.integers(1, 6), layouts, st.data())
def test_activation_is_layout_invariant_after_conversion(t, n, layout, data):
    gate = data.draw(hnp.arrays(np.float64, (t, n), elements=st.floats(-30, 30)))
    up = data.draw(hnp.arrays(np.float64, (t, n), elements=st.floats(-30, 30)))
    x_ref = join_w13(gate, up, "gate_up", axis=-1)
    x = convert_w13(x_ref, "gate_up", layout, axis=-1)
    for name, (fn, gated) in ACTIVATIONS.items():
        if not gated or name == "mul_and_silu":
            continue
        extra = {"alpha": 1.702, "beta": 1.0, "limit": 7.0} if name == "swiglu_bias" else {}
        np.testing.assert_array_equal(fn(x, layout=layout, **extra), fn(x_ref, layout="gate_up", **extra))


@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 6).map(lambda n: 2 * n)), elements=finite),
       st.floats(0.1, 20))
def test_limits_bound_outputs(x, limit):
    # swigluoai: |g*sigmoid(alpha g)| <= max(limit, ~0.28/alpha) and |u + 1| <= limit + 1
    out = swigluoai(x, limit=limit)
    assert np.all(np.abs(out) <= (limit + 1) * max(limit, 0.3) * (1 + 1e-12))
    out = swiglustep(x, limit=limit, layout="interleaved")
    assert np.all(np.abs(out) <= limit * max(limit, 0.28) * (1 + 1e-12))


@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 5).map(lambda n: 2 * n)), elements=finite))
def test_silu_and_mul_matches_scalar_formula(x):
    got = silu_and_mul(x)
    n = x.shape[-1] // 2
    for i, row in enumerate(x.tolist()):
        for j in range(n):
            g, u = row[j], row[n + j]
            sg = 1.0 / (1.0 + math.exp(-g)) if g >= 0 else math.exp(g) / (1.0 + math.exp(g))
            assert math.isclose(got[i, j], g * sg * u, rel_tol=1e-14, abs_tol=1e-300)


@given(st.sampled_from(sorted(ACTIVATIONS)),
       hnp.arrays(st.sampled_from([np.float32, np.float64, np.float16]),
                  st.tuples(st.integers(1, 3), st.integers(1, 4).map(lambda n: 2 * n))))
def test_inputs_never_modified(name, x):
    before = x.copy()
    extra = {"layout": "up_gate"} if name == "swiglu_bias" else {}
    with np.errstate(all="ignore"):  # unbounded inputs may overflow honestly to inf
        ACTIVATIONS[name].function(x, **extra)
    assert np.array_equal(x.view(np.uint8), before.view(np.uint8))
