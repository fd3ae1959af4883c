"""Unit tests for moeref.activations. Expected values are per-element statements of each formula
written here with the math module (scalars), or hand-derived numbers."""
from __future__ import annotations

import itertools
import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from moeref.activations import (
    ACTIVATIONS,
    W13_LAYOUTS,
    apply_activation,
    convert_w13,
    convert_w13_bias,
    gelu_and_mul,
    gelu_no_mul,
    join_w13,
    join_w13_bias,
    mul_and_silu,
    relu2_no_mul,
    sigmoid,
    silu_and_mul,
    silu_no_mul,
    split_w13,
    split_w13_bias,
    swiglu_bias,
    swiglustep,
    swigluoai,
)

RNG = np.random.default_rng(7)


# ---------------------------------------------------------------- scalar oracles (math module)


def s_sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


def s_silu(v):
    return v * s_sigmoid(v)


def s_gelu(v, approximate):
    if approximate == "tanh":
        return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def halves(row, layout):
    """(gate, up) lists of a python list row, straight from the layout's definition."""
    n = len(row) // 2
    if layout in ("gate_up", "concatenated"):
        return row[:n], row[n:]
    if layout == "up_gate":
        return row[n:], row[:n]
    return row[0::2], row[1::2]


def oracle(fn, x, layout):
    """Apply a per-element function fn(gate, up) to each row of x [rows, 2N]."""
    out = []
    for row in x.tolist():
        g, u = halves(row, layout)
        out.append([fn(a, b) for a, b in zip(g, u)])
    return np.array(out)


def s_swigluoai(g, u, alpha=1.702, limit=7.0):
    g = min(g, limit)
    u = max(min(u, limit), -limit)
    return (u + 1.0) * g * s_sigmoid(alpha * g)


def s_swiglu_bias(g, u, alpha, beta, limit):
    if limit is not None:
        g = min(g, limit)
        u = max(min(u, limit), -limit)
    return g * s_sigmoid(alpha * g) * (u + beta)


def s_swiglustep(g, u, limit=7.0):
    return min(s_silu(g), limit) * max(min(u, limit), -limit)


def data(rows=6, n=5, scale=12.0):
    """Asymmetric gate/up data spanning both sides of the clamp limit 7."""
    return RNG.uniform(-scale, scale, size=(rows, 2 * n))


LAYOUTS = ["gate_up", "up_gate", "interleaved", "concatenated"]


# ---------------------------------------------------------------- activations vs scalar formulas


@pytest.mark.parametrize("layout", LAYOUTS)
def test_silu_and_mul_matches_formula(layout):
    x = data()
    np.testing.assert_allclose(silu_and_mul(x, layout=layout), oracle(lambda g, u: s_silu(g) * u, x, layout),
                               rtol=1e-14, atol=1e-300)


def test_mul_and_silu_is_silu_of_second_half():
    x = data()
    want = oracle(lambda a, b: a * s_silu(b), x, "gate_up")  # x[:d] * silu(x[d:])
    np.testing.assert_allclose(mul_and_silu(x), want, rtol=1e-14)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("layout", ["gate_up", "interleaved"])
def test_gelu_and_mul_matches_formula(approximate, layout):
    x = data(scale=9.0)
    want = oracle(lambda g, u: s_gelu(g, approximate) * u, x, layout)
    np.testing.assert_allclose(gelu_and_mul(x, approximate=approximate, layout=layout), want,
                               rtol=1e-13, atol=1e-13)


def test_gelu_erf_and_tanh_differ_and_erf_is_accurate():
    x = np.linspace(-7, 7, 1401)
    erf_form = gelu_no_mul(x)
    want = np.array([s_gelu(v, "none") for v in x.tolist()])
    # both sides evaluate 1 + erf(x / sqrt 2), which cancels for x << 0: absolute error ~ |x| eps
    np.testing.assert_allclose(erf_form, want, rtol=1e-13, atol=1e-14)
    assert np.max(np.abs(gelu_no_mul(x, approximate="tanh") - erf_form)) > 1e-4  # the two are distinct


@pytest.mark.parametrize("layout", ["interleaved", "concatenated", "up_gate"])
@pytest.mark.parametrize("alpha,limit", [(1.702, 7.0), (1.0, 3.0)])
def test_swigluoai_matches_formula(layout, alpha, limit):
    x = data()
    want = oracle(lambda g, u: s_swigluoai(g, u, alpha, limit), x, layout)
    np.testing.assert_allclose(swigluoai(x, alpha=alpha, limit=limit, layout=layout), want, rtol=1e-14)


@pytest.mark.parametrize("alpha,beta,limit", [(0.5, 0.0, 7.0), (1.702, 1.0, 7.0), (1.0, 0.0, None)])
@pytest.mark.parametrize("layout", ["up_gate", "interleaved", "gate_up"])
def test_swiglu_bias_matches_formula(alpha, beta, limit, layout):
    x = data()
    want = oracle(lambda g, u: s_swiglu_bias(g, u, alpha, beta, limit), x, layout)
    np.testing.assert_allclose(swiglu_bias(x, layout=layout, alpha=alpha, beta=beta, limit=limit), want,
                               rtol=1e-14)


def test_swiglu_bias_gptoss_parameters_equal_swigluoai_and_no_limit_is_swiglu():
    x = data()
    np.testing.assert_allclose(swiglu_bias(x, layout="interleaved", alpha=1.702, beta=1.0, limit=7.0),
                               swigluoai(x), rtol=1e-15)
    np.testing.assert_allclose(swiglu_bias(x, layout="gate_up"), silu_and_mul(x), rtol=1e-15)


@pytest.mark.parametrize("layout", ["gate_up", "interleaved"])
def test_swiglustep_matches_formula(layout):
    x = data()
    want = oracle(lambda g, u: s_swiglustep(g, u), x, layout)
    np.testing.assert_allclose(swiglustep(x, layout=layout), want, rtol=1e-14)


def test_swiglustep_per_expert_limit_broadcasts():
    x = RNG.uniform(-12, 12, size=(3, 4, 10))  # [E, T, 2N]
    limits = np.array([1.0, 5.0, 7.0]).reshape(3, 1, 1)
    got = swiglustep(x, limit=limits)
    for e, lim in enumerate([1.0, 5.0, 7.0]):
        want = oracle(lambda g, u: s_swiglustep(g, u, lim), x[e], "gate_up")
        np.testing.assert_allclose(got[e], want, rtol=1e-14)


def test_non_gated_match_formulas():
    x = np.linspace(-20, 20, 81)
    np.testing.assert_array_equal(relu2_no_mul(x), [max(v, 0.0) ** 2 for v in x.tolist()])
    np.testing.assert_allclose(silu_no_mul(x), [s_silu(v) for v in x.tolist()], rtol=1e-15)
    # 1 + tanh(.) cancels for x << 0; np.tanh and math.tanh may differ by an ulp there
    np.testing.assert_allclose(gelu_no_mul(x, approximate="tanh"), [s_gelu(v, "tanh") for v in x.tolist()],
                               rtol=1e-14, atol=1e-14)


def test_hand_derived_values():
    # silu(1) * 3 = 3 / (1 + e^-1)
    assert silu_and_mul(np.array([1.0, 3.0]))[0] == pytest.approx(3.0 / (1.0 + math.exp(-1.0)), rel=1e-15)
    # swigluoai gate 9 -> 7, up -9 -> -7: (1 - 7) * 7 * sigmoid(1.702 * 7)
    assert swigluoai(np.array([9.0, -9.0]))[0] == pytest.approx(-42.0 / (1.0 + math.exp(-11.914)), rel=1e-15)
    # swiglustep: silu(10) -> 7, up 3: 21
    assert swiglustep(np.array([10.0, 3.0]))[0] == 21.0


# ---------------------------------------------------------------- limits engage


def test_limits_engage_beyond_the_limit():
    big = np.array([50.0, 60.0])  # gate 50, up 60 (gate_up / interleaved agree for N = 1)
    # clamped: gate 7, up 7 -> (7+1)*7*sigmoid(1.702*7)
    assert swigluoai(big)[0] == pytest.approx(56.0 * s_sigmoid(1.702 * 7.0), rel=1e-15)
    assert swigluoai(big)[0] < 57.0  # unclamped would be ~3050
    assert swigluoai(np.array([50.0, -60.0]))[0] == pytest.approx(-6 * 7 * s_sigmoid(11.914), rel=1e-15)
    # gate is clamped only from above
    assert swigluoai(np.array([-50.0, 0.0]))[0] == pytest.approx(-50 * s_sigmoid(-85.1), rel=1e-14)
    assert swiglu_bias(big, layout="gate_up", limit=7.0)[0] == pytest.approx(49 * s_sigmoid(7.0), rel=1e-15)
    assert swiglu_bias(big, layout="gate_up", limit=None)[0] == pytest.approx(60 * s_silu(50.0), rel=1e-15)
    assert swiglustep(big)[0] == 49.0


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit"):
        swigluoai(np.zeros(4), limit=0.0)
    with pytest.raises(ValueError, match="limit"):
        swiglustep(np.zeros(4), limit=-1.0)


# ---------------------------------------------------------------- layout detectability


@pytest.mark.parametrize("name,params", [
    ("silu_and_mul", {}),
    ("gelu_and_mul", {}),
    ("swigluoai", {}),
    ("swiglu_bias", {"alpha": 1.702, "beta": 1.0, "limit": 7.0}),
    ("swiglustep", {}),
])
def test_every_wrong_layout_is_detected_on_asymmetric_data(name, params):
    # gate ~ U(1, 2), up ~ U(-3, -2): any mix-up of halves changes the output
    n = 8
    gate = RNG.uniform(1, 2, size=(4, n))
    up = RNG.uniform(-3, -2, size=(4, n))
    ref_x = join_w13(gate, up, "gate_up", axis=-1)
    fn = ACTIVATIONS[name].function
    want = fn(ref_x, layout="gate_up", **params)
    for true_layout, read_as in itertools.permutations(W13_LAYOUTS, 2):
        x = convert_w13(ref_x, "gate_up", true_layout, axis=-1)
        np.testing.assert_allclose(fn(x, layout=true_layout, **params), want, rtol=1e-15)
        assert np.max(np.abs(fn(x, layout=read_as, **params) - want)) > 0.1, (true_layout, read_as)


# ---------------------------------------------------------------- numerics, dtypes, purity


def test_stable_sigmoid_no_overflow_warnings():
    x = np.array([-1e4, -800.0, -1.0, 0.0, 1.0, 800.0, 1e4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = sigmoid(x)
        y = silu_no_mul(x)
        z = silu_and_mul(np.concatenate([x, np.ones_like(x)]))
        w = swigluoai(np.stack([x, x], axis=-1).ravel(), limit=1e5)
    assert s.tolist()[:1] == [0.0] and s[-1] == 1.0 and s[3] == 0.5
    assert y[0] == 0.0 and y[-1] == 1e4
    np.testing.assert_array_equal(z, y)
    assert np.all(np.isfinite(w))


@pytest.mark.parametrize("dtype,out", [
    (np.float64, np.float64), (np.float32, np.float32), (np.float16, np.float32), (ml_dtypes.bfloat16, np.float32),
])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_output_dtype_and_inputs_not_modified(name, dtype, out):
    x = RNG.uniform(-10, 10, size=(3, 8)).astype(dtype)
    before = x.copy()
    params = {"layout": "interleaved"} if name == "swiglu_bias" else {}
    y = apply_activation(name, x, **params)
    assert y.dtype == np.dtype(out)
    assert y.shape == ((3, 4) if ACTIVATIONS[name].gated else (3, 8))
    np.testing.assert_array_equal(x.view(np.uint8), before.view(np.uint8))
    # the float32 result is the rounded float64 result
    y64 = apply_activation(name, x.astype(np.float64), **params)
    np.testing.assert_array_equal(y, y64.astype(out))


def test_relu2_does_not_mutate_input_unlike_vllm():
    x = np.array([-1.0, 2.0])
    relu2_no_mul(x)
    assert x.tolist() == [-1.0, 2.0]


def test_torch_input_accepted_and_not_modified():
    torch = pytest.importorskip("torch")
    t = torch.tensor([[-3.0, 1.0, 2.0, 4.0]])
    y = swigluoai(t)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    assert t.tolist() == [[-3.0, 1.0, 2.0, 4.0]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="accepted: 'gate_up', 'up_gate', 'interleaved', 'concatenated'"):
        silu_and_mul(np.zeros(4), layout="gate-up")
    with pytest.raises(ValueError, match="accepted: 'gate_up', 'up_gate', 'interleaved'$"):
        convert_w13(np.zeros((4, 2)), "gate_up", "concatenated")
    with pytest.raises(ValueError, match="accepted: 'none', 'tanh'"):
        gelu_and_mul(np.zeros(4), approximate="erf")
    with pytest.raises(ValueError, match="even length"):
        silu_and_mul(np.zeros(5))
    with pytest.raises(TypeError, match="floating"):
        silu_and_mul(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        apply_activation("swish", np.zeros(4))
    with pytest.raises(TypeError, match="layout"):
        swiglu_bias(np.zeros(4))  # layout is required
    with pytest.raises(TypeError):
        convert_w13(np.zeros((4, 2)), "gate_up")  # dst_layout is required
    with pytest.raises(ValueError, match="same shape"):
        join_w13(np.zeros((2, 1)), np.zeros((3, 1)), "gate_up")
    with pytest.raises(ValueError, match="out of range"):
        split_w13(np.zeros((4, 2)), "gate_up", axis=2)


# ---------------------------------------------------------------- W13 converters


def test_convert_w13_hand_example_all_pairs():
    E, N, K = 2, 3, 2
    gate = np.arange(E * N * K).reshape(E, N, K)
    up = 100 + gate
    explicit = {  # written out by definition
        "gate_up": np.concatenate([gate, up], axis=1),
        "up_gate": np.concatenate([up, gate], axis=1),
        "interleaved": np.stack([gate, up], axis=2).reshape(E, 2 * N, K),
    }
    assert explicit["interleaved"][0, :, 0].tolist() == [0, 100, 2, 102, 4, 104]
    for src, dst in itertools.product(W13_LAYOUTS, repeat=2):
        got = convert_w13(explicit[src], src, dst)
        np.testing.assert_array_equal(got, explicit[dst])
        assert got.dtype == gate.dtype
        g, u = split_w13(explicit[src], src)
        np.testing.assert_array_equal(g, gate)
        np.testing.assert_array_equal(u, up)


def test_bias_converters():
    gate = np.array([[1.0, 2.0], [3.0, 4.0]])
    up = -gate
    b = join_w13_bias(gate, up, "interleaved")
    assert b.tolist() == [[1.0, -1.0, 2.0, -2.0], [3.0, -3.0, 4.0, -4.0]]
    assert convert_w13_bias(b, "interleaved", "up_gate").tolist() == [[-1.0, -2.0, 1.0, 2.0], [-3.0, -4.0, 3.0, 4.0]]
    g, u = split_w13_bias(b, "interleaved")
    np.testing.assert_array_equal(g, gate)
    np.testing.assert_array_equal(u, up)


def test_w13_weight_layout_and_activation_layout_agree():
    """Converting W13 and running the GEMM gives the same activation output as the reference layout
    (the bug class of SGLang PR #32430, a [gate; up] vs [up; gate] W13
    order, and vLLM PR #44893, interleaved vs concatenated SwiGLU weights)."""
    E, N, K, T = 2, 4, 6, 3
    w = RNG.standard_normal((E, 2 * N, K))  # "gate_up"
    x = RNG.standard_normal((T, K))
    ref = swigluoai(np.einsum("tk,enk->etn", x, w), layout="gate_up")
    for layout in W13_LAYOUTS:
        w2 = convert_w13(w, "gate_up", layout)
        np.testing.assert_allclose(swigluoai(np.einsum("tk,enk->etn", x, w2), layout=layout), ref, rtol=1e-14)


def test_w13_on_gptoss_blocks_axis():
    blocks = RNG.integers(0, 256, size=(2, 6, 3, 16), dtype=np.uint8)  # [E, 2N, K/32, 16]
    inter = convert_w13(blocks, "gate_up", "interleaved", axis=-3)
    assert inter.dtype == np.uint8
    np.testing.assert_array_equal(inter[:, 0::2], blocks[:, :3])
    np.testing.assert_array_equal(inter[:, 1::2], blocks[:, 3:])
