"""GELU-gated activation in the fast path (``fastpath.fused.gelu_and_mul[_quant_fp8]``, ``fastpath.moe`` with
``activation="gelu_and_mul"``): erf GELU and PyTorch's tanh approximation against the float64 reference
(:mod:`moeref.activations`), the layer under its declared profile, and the layer in an exact regime
(:func:`moeref.regimes.exact_layer`) by equality, where tanh GELU computed for a declared erf GELU must fail.

CPU: Triton's interpreter (float32 and FP8 layers: its dot of bf16 operands is not the hardware's,
:mod:`fastpath.grouped_gemm`); the whole bf16 layer in the exact regime runs on a GPU.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device, on_gpu  # noqa: E402
from moeref.compare import PROFILES, compare  # noqa: E402
from moeref.moe import make_layer, make_tokens, quantize_weights, run_moe  # noqa: E402
from moeref.quant import fp8_block, fp8_group, quantize  # noqa: E402

DEV = device()
APPROX = ("none", "tanh")
U32 = 2.0**-24


def _gelu_oracle(g: np.ndarray, approximate: str) -> np.ndarray:
    """GELU written here from its two published formulas (PyTorch ``F.gelu``), scalar ``math`` in float64."""
    if approximate == "tanh":
        f = np.vectorize(lambda v: 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3))))
    else:
        f = np.vectorize(lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))))
    return f(g.astype(np.float64))


def _gate_up(rows: int, n: int, seed: int) -> np.ndarray:
    """float32 ``[rows, 2N]``: gates over GELU's transition zone and beyond, with specials in row 0."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 2 * n)) * 3).astype(np.float32)
    x[0, :8] = [0.875, -10.0, -30.0, 0.0, -0.0, 1e30, np.inf, -np.inf]
    x[0, n:n + 8] = [119.0, 3.0, -2.0, 5.0, 7.0, 1.0, 2.0, 2.0]
    x[1, :n] = np.linspace(-6.0, 6.0, n, dtype=np.float32)
    return x


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_activation_within_a_few_ulps_of_the_formula(approximate, dtype):
    """The kernel's float32 ``gelu(gate) * up`` lies within 4 float32 ulps of ``|gate| |up|`` of the formula
    it declares (the profiles allow 16), NaN where the formula gives NaN, and is not the other form: in
    GELU's transition zone the erf and tanh forms differ by far more than that."""
    from fastpath.fused import gelu_and_mul

    n = 256
    x = torch.as_tensor(_gate_up(6, n, 1), device=DEV).to(dtype)
    xf = x.float().cpu().numpy().astype(np.float64)
    g, u = xf[:, :n], xf[:, n:]
    got = gelu_and_mul(x, approximate).cpu().numpy().astype(np.float64)
    assert got.shape == (6, n)
    with np.errstate(invalid="ignore", over="ignore"):  # the specials: inf * 0
        want = _gelu_oracle(g, approximate) * u
        other = _gelu_oracle(g, "tanh" if approximate == "none" else "none") * u
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)])  # +-inf
    gu = np.abs(g * u)[fin]
    err = np.abs(got[fin] - want[fin])
    assert np.all(err <= 4 * U32 * (gu + np.abs(want[fin]))), np.max(err / gu)
    zone = fin & (np.abs(g) > 0.5) & (np.abs(g) < 3) & (np.abs(u) > 0.5)
    assert np.max(np.abs(got - other)[zone] / np.abs(g * u)[zone]) > 2.0**8 * 4 * U32


@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_quant_fp8_is_the_quantizer_of_its_activation(approximate):
    """The fused kernel's codes and scales equal, bit for bit, the reference quantizer applied to the
    kernel's own float32 activation; against the exact activation (the registry's reference) the codes
    move by at most one step."""
    from fastpath.fused import gelu_and_mul, gelu_and_mul_quant_fp8
    from fastpath.registry import get_implementation

    x = torch.as_tensor(_gate_up(5, 256, 2), device=DEV)
    x[0, :8] = torch.as_tensor([0.875, -10.0, -30.0, 0.0, -0.0, 3.0, 2.0, -2.0])  # finite: FP8 takes finite rows
    fast = get_implementation("gelu_and_mul_quant_fp8", "triton", scheme=fp8_group(128), x=x)
    assert fast is gelu_and_mul_quant_fp8
    got = fast(x, approximate, fp8_group(128), hw_fp8=False)
    want = quantize(gelu_and_mul(x, approximate).cpu().numpy(), fp8_group(128))
    np.testing.assert_array_equal(got.codes.cpu().numpy(), np.asarray(want.codes).view(np.uint8))
    np.testing.assert_array_equal(got.scales.cpu().numpy(), np.asarray(want.scales, np.float32))
    ref = get_implementation("gelu_and_mul_quant_fp8", "reference")(x.cpu().numpy(), approximate, fp8_group(128))
    np.testing.assert_allclose(got.scales.cpu().numpy(), np.asarray(ref.scales), rtol=2.0**-21)
    cg, cr = (np.asarray(c).view(np.uint8).astype(np.int64) for c in (got.codes.cpu().numpy(), ref.codes))
    mg, mr = cg & 0x7F, cr & 0x7F  # E4M3 magnitudes order like their 7 bits
    assert np.all(np.abs(mg - mr) <= 1)
    assert np.all(((cg >> 7) == (cr >> 7)) | ((mg == 0) & (mr == 0)))
    assert np.count_nonzero(cg != cr) <= 0.02 * cg.size


def test_gelu_refuses_unknown_approximations_and_parameters():
    """An approximation other than ``"none"``/``"tanh"`` is a ValueError naming both (kernel and layer); an
    unknown activation parameter (a misspelt ``approximate``) a TypeError, never a silent erf GELU."""
    from fastpath.fused import gelu_and_mul, gelu_and_mul_quant_fp8
    from fastpath.moe import fast_weights, fused_moe

    x = torch.zeros((4, 256), device=DEV)
    for fn in (gelu_and_mul, gelu_and_mul_quant_fp8):
        with pytest.raises(ValueError, match=r"'erf'.*'none', 'tanh'"):
            fn(x, "erf")
    lw = make_layer(2, 32, 16, seed=0)
    args = (torch.zeros((3, 32), device=DEV), fast_weights(lw, DEV), torch.ones((3, 1), device=DEV),
            torch.zeros((3, 1), dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match=r"'erf'.*'none', 'tanh'"):
        fused_moe(*args, activation="gelu_and_mul", activation_params={"approximate": "erf"}, alignment=16)
    with pytest.raises(TypeError, match="approximation"):
        fused_moe(*args, activation="gelu_and_mul", activation_params={"approximation": "tanh"}, alignment=16)
    with pytest.raises(TypeError, match="approximate"):
        fused_moe(*args, activation="silu_and_mul", activation_params={"approximate": "tanh"}, alignment=16)


def _routing(rng, tokens: int, experts: int, top_k: int):
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[0, -1] = -1  # a padding slot
    return ids, rng.random((tokens, top_k)).astype(np.float32)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_fastpath_moe_gelu_float32_layer_within_fp32_bound(approximate, layout):
    """The float32 GELU layer against the reference under FP32_ACCUM with float32 stores (the float
    layer's declaration on the CPU); the layer run with the other GELU form fails it."""
    from fastpath.moe import fast_weights, fused_moe

    rng = np.random.default_rng(3)
    lw = make_layer(4, 64, 32, seed=3, bias=True)
    x = make_tokens(9, 64, seed=4)
    ids, tw = _routing(rng, 9, 4, 2)
    args = (torch.as_tensor(x, device=DEV), fast_weights(lw, DEV), torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    kw = dict(activation="gelu_and_mul", layout=layout, alignment=16, out_dtype=torch.float32)
    got = fused_moe(*args, activation_params={"approximate": approximate}, **kw)
    run = run_moe(x, lw, tw, ids, activation="gelu_and_mul", activation_params={"approximate": approximate},
                  gemm1_out_dtype="float32", act_out_dtype="float32", out_dtype="float32")
    prof = PROFILES["FP32_ACCUM"]
    if on_gpu():  # fp32 tl.dot is TF32 on the GPU
        from dataclasses import replace

        prof = replace(prof, accum_unit=2.0**-10)
    assert compare(got.cpu(), run, prof).passed
    if on_gpu():  # TF32's bound (2^-10 a product) is wider than erf - tanh GELU here; the exact-regime
        return    # check sees that fault on the GPU (bench/bench_exact_regimes.py, fastpath_tanh_gelu)
    other = fused_moe(*args, activation_params={"approximate": "tanh" if approximate == "none" else "none"}, **kw)
    assert not compare(other.cpu(), run, prof).passed


@pytest.mark.parametrize("approximate", APPROX)
def test_fastpath_moe_gelu_fp8_layer_within_declared_profile(approximate):
    """The FP8 layer (1x128 activations, 128x128 weights) with GELU against ``run_moe`` with the arguments
    :func:`fastpath.moe.reference_config` declares, under its declared profile (HOPPER_FP8_DEEPGEMM_DATA);
    on a GPU also under the emulated ``exact_profile`` of the Triton GEMM, whose ``act_unit`` (16 float32
    ulps) the fused GELU's float32 evaluation must fit (the interpreter's FP8 dot is not Hopper's, which that
    profile predicts). The layer with one expert's GEMM2 dropped (its w2 scales zeroed) fails the declared
    profile."""
    from fastpath.moe import FastMoEWeights, exact_profile, fast_weights, fused_moe, reference_config

    rng = np.random.default_rng(5)
    lw = quantize_weights(make_layer(3, 256, 128, seed=5), fp8_block((128, 128)))
    x = make_tokens(6, 256, seed=6).astype(ml_dtypes.bfloat16).astype(np.float32)
    ids, tw = _routing(rng, 6, 3, 2)
    fw = fast_weights(lw, DEV)
    cfg = reference_config(fw)
    profile = cfg.pop("profile")
    assert profile == "HOPPER_FP8_DEEPGEMM_DATA"
    params = {"approximate": approximate}
    tail = (torch.as_tensor(tw, device=DEV), torch.as_tensor(ids, device=DEV))
    hidden = torch.as_tensor(x, device=DEV).to(torch.bfloat16)
    got = fused_moe(hidden, fw, *tail, activation="gelu_and_mul", activation_params=params, alignment=16).cpu()
    run = run_moe(x, lw, tw, ids, activation="gelu_and_mul", activation_params=params, **cfg)
    assert compare(got, run, profile).passed
    if on_gpu():
        assert compare(got, run, exact_profile("triton", fw)).passed
    bad_scales = fw.w2_scales.clone()
    bad_scales[int(ids[1, 0])] = 0.0
    bad = FastMoEWeights(fw.w13, fw.w2, fw.w13_layout, fw.w13_scales, bad_scales)
    got_bad = fused_moe(hidden, bad, *tail, activation="gelu_and_mul", activation_params=params,
                        alignment=16).cpu()
    assert not compare(got_bad, run, profile).passed


def _fast_layer_args(lay):
    """fastpath.moe's arguments for an :class:`moeref.regimes.ExactLayer` (bf16 experts stacked as tensors,
    FP8 experts as their codes and scales), bf16 hidden states."""
    from dataclasses import replace

    from fastpath.moe import fast_weights

    weights = lay.weights
    if lay.scheme == "bf16":
        def stack(ws):
            return torch.stack([torch.from_numpy(np.ascontiguousarray(w).view(np.int16)).view(torch.bfloat16)
                                for w in ws]).to(DEV)

        weights = replace(weights, w13=stack(weights.w13), w2=stack(weights.w2))
    return (torch.as_tensor(lay.hidden, device=DEV).to(torch.bfloat16), fast_weights(weights, DEV),
            torch.as_tensor(lay.topk_weights, device=DEV), torch.as_tensor(lay.topk_ids, device=DEV))


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_fastpath_moe_gelu_fp8_exact_layer_equals_the_reference(layout):
    """An FP8 (DeepSeek-V3 recipe) GELU layer in the exact regime through fastpath.moe gives the reference's
    bf16 bits in every output. (Its GELU probes are quantized from the fused kernel's float32 activation, where
    erf and tanh GELU land on the same E4M3 code: in this layer the tanh-for-erf fault is seen by the
    stage check below and by the bf16 layer, not by the output.)"""
    from fastpath.moe import fused_moe
    from moeref.regimes import exact_layer, layer_in_exact_regime
    from moeref.testing import assert_moe_close

    lay = exact_layer(12, 256, 256, 4, 2, scheme="fp8_1x128", activation="gelu_and_mul", seed=3)
    assert layer_in_exact_regime(lay, "hopper_fp8").ok
    assert lay.config.activation == "gelu_and_mul" and lay.config.activation_params in (None, {})
    out = fused_moe(*_fast_layer_args(lay), activation="gelu_and_mul", layout=layout, alignment=16)
    assert assert_moe_close(out.cpu(), lay, regime="exact").passed


@pytest.mark.parametrize("approximate", APPROX)
def test_fast_gelu_stage_in_the_exact_regime_and_the_tanh_fault(approximate):
    """The bf16 GELU layer's activation stage as fastpath.moe runs it (``fastpath.fused.gelu_and_mul`` on the
    stored GEMM1 output, stored bf16) on the reference's own GEMM1 outputs of an exact-regime layer: equal
    to the reference's stored activation, probe rows included, for the declared form; the other form (tanh
    computed where erf is declared, and the reverse) differs on the probe rows."""
    from fastpath.fused import gelu_and_mul
    from moeref.regimes import exact_layer

    lay = exact_layer(16, 256, 256, 4, 2, scheme="bf16", activation="gelu_and_mul", seed=1,
                      activation_params={"approximate": approximate})
    run = lay.reference()
    assert lay.config.act_out_dtype == "bfloat16" and lay.config.gemm1_out_dtype == "bfloat16"
    other = "tanh" if approximate == "none" else "none"
    probes = 0
    for _, eo in run.chunks:
        h = torch.as_tensor(eo.h[eo.valid].astype(np.float32), device=DEV)
        want = eo.x[eo.valid]
        got = gelu_and_mul(h, approximate).to(torch.bfloat16).float().cpu().numpy()
        np.testing.assert_array_equal(got, want)
        wrong = gelu_and_mul(h, other).to(torch.bfloat16).float().cpu().numpy()
        probes += int(np.count_nonzero(wrong != want))
    assert probes > 0, "the tanh/erf mix-up is invisible at the activation store"


@pytest.mark.skipif(not on_gpu(), reason="the bf16 layer needs a GPU: the interpreter's dot of bf16 operands is "
                                         "not the hardware's (fastpath.grouped_gemm)")
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_fastpath_moe_gelu_bf16_exact_layer_equals_the_reference_and_catches_tanh(layout):
    """The bf16 GELU layer (Qwen3-style) in the exact regime through fastpath.moe: the reference's bf16 bits in
    every output with the declared erf GELU; the same layer computing tanh GELU fails the equality check."""
    from fastpath.moe import fused_moe
    from moeref.regimes import exact_layer
    from moeref.testing import assert_moe_close

    lay = exact_layer(64, 512, 256, 8, 4, scheme="bf16", activation="gelu_and_mul", seed=2)
    args = _fast_layer_args(lay)
    out = fused_moe(*args, activation="gelu_and_mul", layout=layout)
    assert assert_moe_close(out.cpu(), lay, regime="exact").passed
    bad = fused_moe(*args, activation="gelu_and_mul", activation_params={"approximate": "tanh"}, layout=layout)
    with pytest.raises(AssertionError, match="differ from the reference"):
        assert_moe_close(bad.cpu(), lay, regime="exact")


@pytest.mark.parametrize("w4_activations", ["bfloat16", "float8_e4m3fn"])
def test_fastpath_moe_gelu_w4_layer_within_fp32_bound(w4_activations):
    """MXFP4 weights with GELU and float32 hidden states (the CPU path of the 4-bit layer: float32 stores):
    W4A16 (the plain GELU kernel) and W4A8 (a1 and a2 FP8 1x128, the fused GELU + FP8 kernel), against
    ``run_moe`` with :func:`fastpath.moe.reference_config`'s quantizers under FP32_ACCUM (W4A8: with the
    ``act_unit`` of its declared BF16_OUTPUT_FP32_ACT); a layer whose w2 nibbles are swapped fails it."""
    from dataclasses import replace

    from fastpath.moe import FastMoEWeights, fast_weights, fused_moe, reference_config
    from moeref.quant import mxfp4

    rng = np.random.default_rng(11)
    lw = quantize_weights(make_layer(3, 256, 128, seed=11), mxfp4())
    x = make_tokens(7, 256, seed=12)
    ids, tw = _routing(rng, 7, 3, 2)
    fw = fast_weights(lw, DEV, w4_activations=w4_activations)
    cfg = reference_config(fw)
    prof = PROFILES["FP32_ACCUM"]
    if cfg.pop("profile") == "BF16_OUTPUT_FP32_ACT":
        prof = replace(prof, act_unit=PROFILES["BF16_OUTPUT_FP32_ACT"].act_unit)
    args = (torch.as_tensor(x, device=DEV), fw, torch.as_tensor(tw, device=DEV), torch.as_tensor(ids, device=DEV))
    kw = dict(activation="gelu_and_mul", alignment=16, out_dtype=torch.float32)
    got = fused_moe(*args, **kw)
    quant = {"quant": cfg["quant"]} if "quant" in cfg else {}
    run = run_moe(x, lw, tw, ids, activation="gelu_and_mul", gemm1_out_dtype="float32", act_out_dtype="float32",
                  out_dtype="float32", **quant)
    assert compare(got.cpu(), run, prof).passed
    bad = FastMoEWeights(fw.w13, replace(fw.w2, codes=((fw.w2.codes >> 4) | (fw.w2.codes << 4)).to(torch.uint8)),
                         fw.w13_layout, w4_activations=w4_activations)
    assert not compare(fused_moe(args[0], bad, *args[2:], **kw).cpu(), run, prof).passed
