"""The device engine of the MoE reference (:mod:`moeref.moe.device`) gives the NumPy engine's result bit for
bit: over the layer strategy of test_moe_props (every scheme, activation, w13 layout, routing kind,
biases, layouts, chunking, shared experts, EP maps), its GEMM engine alone, and its elementary
functions and stores.

On a CUDA machine these run on the GPU (cuBLAS float64, the device quantizers of :mod:`moeref.quant.device`); elsewhere on torch CPU tensors with Triton under ``TRITON_INTERPRET=1`` (few examples: the
interpreter is slow), which proves the logic. The oracle is the NumPy engine, run on the same data.
Float (bf16/fp32) layers are float64-accurate, not bit-identical (their partial dots depend on the
BLAS): those cases check ``1e-12`` of the output's magnitude, as test_moe_props does across layouts.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device, on_gpu  # noqa: E402
from moeref import elementary  # noqa: E402
from moeref.gemm import StackedExperts, expert_rows_gemm  # noqa: E402
from moeref.gemm.device import device_expert_rows_gemm  # noqa: E402
from moeref.moe import LAYOUTS, SharedExperts, run_moe  # noqa: E402
from moeref.moe.device import round_on_device  # noqa: E402
from moeref.moe.pipeline import round_to_dtype  # noqa: E402
from moeref.quant import fp8_block, fp8_group, quantize  # noqa: E402
from moeref.quant.device import device_quantize_unavailable  # noqa: E402
from moeref.routing import expert_map  # noqa: E402
from test_moe_props import layers  # noqa: E402

DEV = device()
def _settings():
    if on_gpu():
        return settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    return settings(deadline=None, max_examples=6,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _check(ref, got, exact: bool):
    got = got.cpu().numpy() if torch.is_tensor(got) else got
    if exact:
        assert np.array_equal(ref, got, equal_nan=True), (
            f"device engine differs from the NumPy engine in {np.count_nonzero(ref != got)} of {ref.size} "
            f"elements (max |diff| {np.nanmax(np.abs(ref - got), initial=0):.3g})")
    else:
        tol = 1e-12 * (1 + np.nanmax(np.abs(ref), initial=0))
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol)


@_settings()
@given(layers(), st.sampled_from(LAYOUTS), st.integers(1, 5), st.sampled_from([None, "bfloat16", "float32"]),
       st.sampled_from([None, "bfloat16", "float16", "float32"]), st.booleans(), st.data())
def test_device_layer_equals_numpy_layer(case, layout, alignment, store, out_dtype, shared, data):
    r = case["routing"]
    exact = case["a_scheme"] is not None  # every GEMM then has quantized operands on both sides
    kw = dict(activation=case["activation"], quant=case["quant"], num_experts=r.num_experts, layout=layout,
              alignment=alignment, gemm1_out_dtype=store, act_out_dtype=store, out_dtype=out_dtype,
              chunk_size=data.draw(st.sampled_from([None, 1, 3]), label="chunk_size"))
    if shared:
        lw = case["float_weights"]
        kw["shared_experts"] = SharedExperts(lw.w13[0], lw.w2[0], lw.w13_layout)
        exact = False  # the shared expert's weights are float
    ref = run_moe(case["hidden"], case["weights"], r.weights, r.ids, **kw)
    got = run_moe(case["hidden"], case["weights"], r.weights, r.ids, device=DEV, **kw)
    _check(ref.output, got.output, exact)
    want = np.asarray(ref.out).astype(np.float64)
    _check(want, got.out.to(torch.float64), exact)
    assert all(e.split(":")[0] in ("a1", "a2") for e in got.engines)
    if case["a_scheme"] is not None and device_quantize_unavailable(case["a_scheme"], torch.ones(4, 64)) is None:
        # a scheme the device quantizer takes never falls back to the host (moeref.quant.device ran it)
        assert got.engines and all("moeref.quant.device" in e for e in got.engines), got.engines


@_settings()
@given(layers(rowwise_only=True), st.integers(1, 3), st.data())
def test_device_layer_on_an_ep_shard_equals_numpy(case, ep_size, data):
    """Expert-parallel: a rank's local experts through an expert map (non-local slots contribute 0)."""
    r = case["routing"]
    rank = data.draw(st.integers(0, ep_size - 1), label="rank")
    emap = expert_map(r.num_experts, ep_size, rank, data.draw(st.sampled_from(["linear", "round_robin"])))
    local = np.argsort(np.where(emap >= 0, emap, len(emap)))[: int((emap >= 0).sum())]  # global id per local
    w = case["weights"]
    shard = type(w)([w.w13[e] for e in local], [w.w2[e] for e in local], w.w13_layout,
                    None if w.b13 is None else np.asarray(w.b13)[local], None if w.b2 is None else np.asarray(w.b2)[local])
    kw = dict(activation=case["activation"], quant=case["quant"], num_experts=r.num_experts, expert_map=emap)
    ref = run_moe(case["hidden"], shard, r.weights, r.ids, **kw)
    got = run_moe(case["hidden"], shard, r.weights, r.ids, device=DEV, **kw)
    _check(ref.output, got.output, case["a_scheme"] is not None)


def test_device_gemm_engine_equals_block_gemm_fp8_deepgemm_blocks():
    """FP8 1x128 activations x 128x128 weights with wide-ranging scales (the DeepSeek-V3 recipe), K = 896
    (7 scale blocks) and N not a multiple of the block: the grouped GEMM bit for bit, and its magnitude
    sums (abs_values), with biases and padding rows."""
    rng = np.random.default_rng(7)
    m, n, k, e = 45, 200, 896, 5
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-8, 8, (m, 1)))).astype(np.float32)
    qa = quantize(x, fp8_group())
    qw = [quantize((rng.standard_normal((n, k)) * np.exp2(rng.integers(-6, 6))).astype(np.float32), fp8_block())
          for _ in range(e)]
    rows = rng.integers(-1, e, m)
    bias = rng.standard_normal((e, n))
    stacked = StackedExperts.from_quantized(qw)
    for absolute in (False, True):
        ref = expert_rows_gemm(qa, rows, qw, bias, abs_values=absolute)
        got = device_expert_rows_gemm(qa, rows, stacked.to(DEV), bias, abs_values=absolute)
        _check(ref, got, exact=True)


@pytest.mark.parametrize("w_scheme", ["fp8_block16", "mxfp4"])
def test_few_rows_kernel_equals_the_decode_path(monkeypatch, w_scheme):
    """Both device paths (the few-rows kernel reading codes, and decode + batched product) give
    block_gemm's bits: experts with 1..9 rows (one or two work items), K with a short last segment."""
    from moeref.gemm import device as dev_mod
    from moeref.quant import mxfp4

    rng = np.random.default_rng(2)
    m, n, k, e = 23, 20, 80, 3
    a_s, w_s = (fp8_group(16), fp8_block((16, 16))) if w_scheme == "fp8_block16" else (fp8_group(32), mxfp4())
    k = 80 if w_scheme == "fp8_block16" else 96
    qa = quantize(rng.standard_normal((m, k)).astype(np.float32), a_s)
    qw = [quantize(rng.standard_normal((n, k)).astype(np.float32), w_s) for _ in range(e)]
    rows = np.repeat(np.arange(-1, e), [2, 1, 9, 11])
    rng.shuffle(rows)
    ref = expert_rows_gemm(qa, rows, qw)
    stacked = StackedExperts.from_quantized(qw).to(DEV)
    monkeypatch.setattr(dev_mod, "FEW_ROWS_ON_CPU", True)
    for limit in (0, 32):  # 0: every expert through decode + product; 32: every expert through the kernel
        monkeypatch.setattr(dev_mod, "FEW_ROWS_MAX", limit)
        _check(ref, device_expert_rows_gemm(qa, rows, stacked), exact=True)


@pytest.mark.parametrize("schemes", ["fp8_32", "mxfp4", "nvfp4", "int8"])
def test_int8_digit_kernel_equals_block_gemm(monkeypatch, schemes):
    """The int8-digit kernel (exact products of integer-valued elements on the int8 tensor cores) gives
    block_gemm's bits: E4M3 x E4M3 (3 x 3 digits), E4M3 x E2M1 packed (3 x 1), NVFP4 x NVFP4 (global
    factors in the scales, 16-column segments: the float64 paths, as int8 dots need K >= 32), INT8 x INT8
    (2 x 2); 16-row and 64-row work items; magnitudes (abs)."""
    from moeref.gemm import device as dev_mod
    from moeref.quant import int8_per_channel, int8_per_token, mxfp4, nvfp4

    pairs = {"fp8_32": (fp8_group(32), fp8_block((32, 32))), "mxfp4": (fp8_group(32), mxfp4()),
             "nvfp4": (nvfp4(), nvfp4()), "int8": (int8_per_token(), int8_per_channel())}
    a_s, w_s = pairs[schemes]
    rng = np.random.default_rng(4)
    m, n, k, e = 90, 24, 64, 3
    qa = quantize((rng.standard_normal((m, k)) * np.exp2(rng.integers(-4, 4, (m, 1)))).astype(np.float32), a_s)
    qw = [quantize(rng.standard_normal((n, k)).astype(np.float32), w_s) for _ in range(e)]
    rows = np.repeat(np.arange(-1, e), [3, 5, 12, 70])  # 5 and 12 rows: 16-row items; 70: 64-row items
    rng.shuffle(rows)
    stacked = StackedExperts.from_quantized(qw).to(DEV)
    monkeypatch.setattr(dev_mod, "DIGITS_ON_CPU", True)
    monkeypatch.setattr(dev_mod, "DIGITS_MAX_ROWS", 100)
    calls = []
    real = dev_mod._digit_rows
    monkeypatch.setattr(dev_mod, "_digit_rows", lambda *a, **k: (calls.append(1), real(*a, **k)))
    for absolute in (False, True):
        ref = expert_rows_gemm(qa, rows, qw, abs_values=absolute)
        _check(ref, device_expert_rows_gemm(qa, rows, stacked, abs_values=absolute), exact=True)
    assert len(calls) == (0 if schemes == "nvfp4" else 2)  # the digit kernel ran where it applies


def _special_values():
    rng = np.random.default_rng(3)
    grid = np.concatenate([
        rng.uniform(-750.0, 712.0, 20000), rng.standard_normal(20000) * 6.0, rng.uniform(-0.5, 0.5, 5000),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-310, -1e-310, 709.78, 709.79, -745.13, -745.14,
                  -708.4, 6.0, -6.0, 5.9999999]),
    ])
    return grid


@pytest.mark.parametrize("fn", ["exp", "tanh", "erf", "sigmoid"])
def test_elementary_functions_give_the_same_bits_on_the_device(fn):
    x = _special_values()
    f = getattr(elementary, fn)
    with np.errstate(all="ignore"):
        want = f(x)
    got = f(torch.as_tensor(x, device=DEV)).cpu().numpy()
    assert np.array_equal(want, got, equal_nan=True)


def test_elementary_exp_is_faithful():
    """Independent oracle: math.exp (correctly rounded or within 1 ulp on every libm we run on) at 2000
    points: ours within 1 ulp of it, and of the true value by the derivation in the module docstring."""
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.uniform(-700, 700, 1000), rng.uniform(-1, 1, 1000)])
    ours = elementary.exp(x)
    libm = np.array([math.exp(v) for v in x])
    assert np.all(np.abs(ours - libm) <= np.spacing(libm))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_device_stores_round_like_the_numpy_engine(dtype):
    """Stores of float64 values into narrow dtypes, including double-rounding traps (a float32 value on a
    bfloat16 midpoint), overflow and subnormals: the NumPy engine's ml_dtypes/NumPy casts bit for bit."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal(50000) * np.exp2(rng.integers(-30, 30, 50000))
    # values just off a bfloat16 / float16 midpoint by less than a float32 ulp
    mids = (1.0 + 2.0**-8) * np.exp2(rng.integers(-20, 20, 2000)) * (1 + rng.choice([-1, 1], 2000) * 2.0**-30)
    mids16 = (1.0 + 2.0**-11) * np.exp2(rng.integers(-14, 15, 2000)) * (1 + rng.choice([-1, 1], 2000) * 2.0**-40)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 65519.99, 3.4e38, 3.403e38, 1e-8,
                      6e-8, -6e-8, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-45, 1e-39])
    x = np.concatenate([base, mids, mids16, edges])
    with np.errstate(all="ignore"):
        want = round_to_dtype(x, dtype)
    got = round_on_device(torch.as_tensor(x, device=DEV), dtype).cpu().numpy()
    assert np.array_equal(want, got, equal_nan=True)
    if dtype == "bfloat16":  # the documented convention (two roundings) is what the NumPy engine does
        trap = np.array([1.0 + 2.0**-8 + 2.0**-30])
        assert trap.astype(ml_dtypes.bfloat16).astype(np.float64)[0] == 1.0


@pytest.mark.gpu
@pytest.mark.slow
def test_deepseek_v3_shaped_layer_on_the_gpu_equals_numpy():
    """A DeepSeek-V3-shaped layer (hidden 7168, intermediate 2048, FP8 1x128 x 128x128, top-8) on a few
    experts and 48 tokens: the GPU reference equals the NumPy reference bit for bit at K = 7168."""
    from moeref.moe import MoEQuant, MoEWeights

    rng = np.random.default_rng(0)
    e, k, n, m, top = 12, 7168, 2048, 48, 8
    w13 = [quantize((rng.standard_normal((2 * n, k)) * 0.02).astype(np.float32), fp8_block()) for _ in range(e)]
    w2 = [quantize((rng.standard_normal((k, n)) * 0.02).astype(np.float32), fp8_block()) for _ in range(e)]
    weights = MoEWeights(w13, w2, "gate_up")
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = np.stack([rng.choice(e, top, replace=False) for _ in range(m)]).astype(np.int32)
    tw = rng.random((m, top)).astype(np.float32)
    q = MoEQuant(fp8_group(), fp8_group(), "fp8 1x128")
    kw = dict(quant=q, gemm1_out_dtype="bfloat16", act_out_dtype="float32", out_dtype="bfloat16")
    ref = run_moe(x, weights, tw, ids, **kw)
    got = run_moe(x, weights, tw, ids, device="cuda", **kw)
    _check(ref.output, got.output, exact=True)
    assert got.engines and all("moeref.quant.device" in s for s in got.engines)
