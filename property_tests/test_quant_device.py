"""The device quantizer (:mod:`moeref.quant.device`) gives :func:`moeref.quant.quantize`'s codes, scales and
global scale bit for bit: every scheme it takes, every preset that scheme accepts, float16/bfloat16/float32/
float64 input, partial blocks, and the special values (zeros of both signs, NaN of both signs, +-Inf,
subnormals, overflow, all-zero blocks and tensors, ties of the element grid) enumerated.

On a CUDA machine the tensors live on the GPU (where the NaN signs and the float32 arithmetic are the
device's, and the test proves the module's handling of them); elsewhere on torch CPU tensors, which proves the
logic (these run in CI). The oracle is the NumPy quantizer on the same values.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from moeref._interop import to_torch  # noqa: E402
from moeref.quant import (PRESETS, Preset, fp8_block, fp8_group, fp8_per_tensor, fp8_per_token,  # noqa: E402
                          int4_group, int8_per_token, mxfp4, mxfp6, mxfp8, nvfp4, quantize)
from moeref.quant.nvfp4 import NVFP4_PRESETS
from moeref.quant.device import DeviceQuantized, device_quantize, device_quantize_unavailable  # noqa: E402
from moeref.quant.scheme import Scheme  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

_FP8_PRESETS = ("default", "deepgemm", "deepgemm_cuda", "vllm", "deepep", "te_fp8", "te_fp8_block", "ocp",
                "vllm_int8")
_MX_PRESETS = ("default", "ocp", "torchao_ceil", "torchao_even", "torchao_rceil", "te_mxfp8", "deepgemm",
               "microxcaling")
# a preset no anchor uses, for the generated-NaN path: 448 / amax overflows float32 for a subnormal
# amax, so a zero element times the Inf factor is a NaN the operation creates (E4M3 keeps its sign)
_PAIR_FP8 = Preset("test_pair_fp8", fp32_rule="encode_decode_pair", apply="mul_encode", nonfinite="propagate")


def _schemes():
    out = []
    for p in _FP8_PRESETS:
        out += [fp8_per_tensor(preset=p), fp8_per_token(preset=p), fp8_group(128, "fp32", p), fp8_group(32, "ue8m0", p),
                fp8_block((16, 16), "fp32", p), fp8_group(16, "fp32", p, element="e5m2")]
    for p in _MX_PRESETS:
        out += [mxfp8(preset=p), mxfp8("e5m2", preset=p), mxfp4(preset=p), mxfp6("e2m3", preset=p),
                mxfp6("e3m2", preset=p)]
    out += [fp8_per_tensor(0.125), fp8_per_tensor(2.0**-4, scale="ue8m0"), fp8_block(), fp8_group(128, "ue8m0"),
            fp8_group(64, element="e4m3fnuz"), fp8_group(64, element="e5m2fnuz", preset="deepgemm"),
            int8_per_token(), int8_per_token(preset="vllm_int8"), int4_group(32), int4_group(32, preset="gptq"),
            fp8_group(32).replace(preset=PRESETS["default"].with_(name="inf_nan", overflow="inf_nan")),
            Scheme("pair_fp8", "e4m3fn", (1, 32), "fp32", _PAIR_FP8)]
    for p in NVFP4_PRESETS:
        out += [nvfp4(preset=p), nvfp4("weight", preset=p)]
    return out


SCHEMES = _schemes()
DTYPES = ("float32", "bfloat16", "float16", "float64")


@pytest.fixture(autouse=True, scope="module", params=["torch", "kernel"])
def engine(request):
    """Every test twice: the torch path, and the one-pass Triton kernel (:mod:`moeref.quant._device_kernels`;
    on CPU under TRITON_INTERPRET=1) wherever it applies."""
    import moeref.quant.device as qd

    before = qd._KERNEL
    qd._KERNEL = request.param == "kernel"
    yield request.param
    qd._KERNEL = before


def _np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _check_equal(x: np.ndarray, scheme, **static):
    """device_quantize(x) on DEV against quantize(x), every stored field by its bits; or the same error."""
    try:
        ref = quantize(x, scheme, **static)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            device_quantize(to_torch(x, DEV), scheme, **static)
        return None
    got = device_quantize(to_torch(x, DEV), scheme, **static)
    assert isinstance(got, DeviceQuantized) and got.device.type == torch.device(DEV).type
    host = got.to_host()
    assert host.shape == ref.shape and host.codes.dtype == ref.codes.dtype
    bad = np.flatnonzero(host.codes.ravel() != ref.codes.ravel())
    assert bad.size == 0, (f"{scheme.name} ({scheme.preset.name}) {x.dtype}: {bad.size} codes differ, first at "
                           f"{np.unravel_index(bad[0], ref.codes.shape)}: {host.codes.ravel()[bad[0]]:#x} vs "
                           f"{ref.codes.ravel()[bad[0]]:#x}")
    assert np.array_equal(_bits(host.scales), _bits(ref.scales)), f"{scheme.name} ({scheme.preset.name}): scales"
    assert host.global_scale == ref.global_scale
    assert np.array_equal(got.scale_values.cpu().numpy(), ref.scale_values(), equal_nan=True)
    return got


def _values(rng, shape, dtype, nvfp4_scheme: bool):
    """Normal values over wide block-to-block ranges, with the special values planted (NVFP4 takes
    finite input only: its specials are the finite ones)."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape[:-1] + (1,)))
    specials = [0.0, -0.0, 2.0**-140, -(2.0**-133), 1e-30, 448.0, -464.0, 465.0, 6.0, -5.0, 0.25, 1e30, 65504.0]
    if not nvfp4_scheme:
        specials += [np.nan, -np.nan, np.inf, -np.inf, 3e38]
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, len(specials) * 2), replace=False)
    flat[idx] = np.resize(np.array(specials), idx.size)
    if shape[0] > 1:
        x[shape[0] // 2] = 0.0  # an all-zero row (all-zero blocks of row-wise schemes)
    with np.errstate(over="ignore"):
        return x.astype(_np_dtype(dtype))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-{s.preset.name}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_quantize_equals_quantize_on_special_values(scheme, dtype):
    rng = np.random.default_rng(len(scheme.name) * 31 + DTYPES.index(dtype))
    for shape in ((37, 200), (5, 33), (1, 16)):
        x = _values(rng, shape, dtype, scheme.family == "nvfp4")
        assert device_quantize_unavailable(scheme, to_torch(x, DEV)) is None
        _check_equal(x, scheme)


@settings(max_examples=40)
@given(st.sampled_from(SCHEMES), st.sampled_from(DTYPES), st.integers(1, 40), st.integers(1, 300),
       st.integers(-30, 30), st.integers(0, 2**32 - 1))
def test_device_quantize_equals_quantize_drawn(scheme, dtype, rows, cols, exp, seed):
    """Drawn shapes (partial blocks in both axes) and magnitudes ``2^exp`` times normal values, with zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 2.0**exp
    x[rng.random((rows, cols)) < 0.1] = 0.0
    with np.errstate(over="ignore"):
        x = x.astype(_np_dtype(dtype))
    _check_equal(x, scheme)


def test_static_scales_and_errors_are_the_references():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    _check_equal(x, fp8_per_tensor(), scale=0.01)
    _check_equal(x * 1e3, fp8_per_tensor(), scale=0.5)  # saturating elements
    for preset, g in (("nvfp4_te", 3.0), ("nvfp4_flashinfer", 900.0), ("nvfp4_torchao", 0.002)):
        _check_equal(x, nvfp4(preset=preset), global_scale=g)
    with pytest.raises(ValueError, match="positive finite"):
        device_quantize(to_torch(x, DEV), fp8_per_tensor(), scale=-1.0)
    xn = x.copy()
    xn[2, 3] = np.nan
    with pytest.raises(ValueError, match=r"x\[2, 3\] = nan: NVFP4 quantization needs finite input"):
        device_quantize(to_torch(xn, DEV), nvfp4())
    # E2M1 has no NaN: a NaN-propagating preset without a NaN code is the codec's error
    s = mxfp4(preset="default").replace(preset=PRESETS["default"].with_(name="prop", nonfinite="propagate",
                                                                          e8m0_nonfinite="clamp"))
    _check_equal(xn, s)


def test_zero_tensors_and_three_axes():
    """An all-zero tensor (every block a zero block; NVFP4's zero tensor amax) and [E, N, K] input."""
    for scheme in (fp8_group(), fp8_per_tensor(), mxfp4(), nvfp4(), nvfp4("weight"), int8_per_token()):
        _check_equal(np.zeros((4, 48), np.float32), scheme)
        _check_equal(-np.zeros((4, 48), np.float32), scheme)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 20, 40)).astype(np.float32)
    for scheme in (fp8_per_tensor(), fp8_block((16, 16)), mxfp8(), nvfp4("weight")):
        _check_equal(x, scheme)


def test_nan_signs_are_the_hosts():
    """NaN elements that reach the element cast: an input NaN keeps its sign (E4M3 0x7F / 0xFF, derived by
    hand from the OFP8 encoding); a NaN the scaling creates (0 * Inf) takes the host NumPy's sign."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [np.nan, -np.nan, 1.0, -2.0]
    got = _check_equal(x, mxfp8(preset="te_mxfp8"))  # NaN-ignoring amax: the block scale is finite
    assert got.to_host().codes[0, :2].tolist() == [0x7F, 0xFF]
    y = np.zeros((1, 32), np.float32)
    y[0, 1] = 1e-40  # a subnormal amax: 448 / amax = Inf, 0 * Inf = NaN
    with np.errstate(all="ignore"):
        host_neg = bool(np.signbit(np.zeros(64, np.float32) * np.full(64, np.inf, np.float32))[0])
    got = _check_equal(y, Scheme("pair_fp8", "e4m3fn", (1, 32), "fp32", _PAIR_FP8))
    assert got.to_host().codes[0, 0] == (0xFF if host_neg else 0x7F)


def test_what_runs_on_the_host_says_why():
    x = to_torch(np.ones((4, 32), np.float32), DEV)
    assert "zero points" in device_quantize_unavailable(int4_group(32, symmetric=False), x)
    assert "signed min/max" in device_quantize_unavailable(int4_group(32, preset="vllm_int4"), x)
    assert "static arguments" in device_quantize_unavailable(fp8_group(), x, {"global_scale": 1.0})
    assert "dtype" in device_quantize_unavailable(fp8_group(), x.to(torch.int32))
    assert "blocks the last" in device_quantize_unavailable(nvfp4("weight"), x[0])
    with pytest.raises(ValueError, match="cannot run"):
        device_quantize(x, int4_group(32, symmetric=False))


def test_the_device_operand_decodes_to_the_dequantized_values():
    """The operand the MoE device engine builds from a device-quantized tensor holds its exact values."""
    from moeref.gemm.device import device_operand

    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 96)).astype(np.float32)
    for scheme in (fp8_group(32), mxfp4(), nvfp4(), fp8_per_tensor(), int8_per_token()):
        got = device_quantize(to_torch(x, DEV), scheme)
        op = device_operand(got, DEV)
        r, c = op.shape
        rows = torch.arange(r, device=op.device) // op.block[0]
        cols = torch.arange(c, device=op.device) // op.block[1]
        vals = op.decode() * op.scales[rows][:, cols]
        assert np.array_equal(vals.cpu().numpy(), quantize(x, scheme).dequantize(np.float64))


# the schemes the one-pass kernel claims (moeref.quant._device_kernels): one code per byte (FP8, FP6, INT8)
KERNEL_SCHEMES = [s for s in SCHEMES if s.family == "blockwise" and s.element_format.bits > 4] + [
    fp8_per_tensor(2.0**-3), fp8_per_tensor(2.0**-9, preset="deepgemm"), fp8_per_tensor(0.75, preset="vllm")]
_SUBNORMAL = {"float32": 2.0**-149, "bfloat16": 2.0**-133, "float16": 2.0**-24}
_MAX = {"float32": float(np.finfo(np.float32).max), "bfloat16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
        "float16": 65504.0}


def _kernel_values(rng, rows: int, cols: int, dtype: str, exp: int, specials: bool) -> np.ndarray:
    """Values that hit the cast's edges: few-bit dyadic values ``m * 2^e`` (exact ties of the element grids
    under power-of-two scales), subnormals of the input dtype, its largest values (saturation), zeros of
    both signs, and (``specials``) NaN and +-Inf."""
    x = rng.integers(-64, 65, (rows, cols)) * np.exp2(exp + rng.integers(-3, 4, (rows, 1)))
    pick = rng.random((rows, cols))
    x = np.where(pick < 0.1, rng.integers(-7, 8, (rows, cols)) * _SUBNORMAL[dtype], x)
    x = np.where((pick >= 0.1) & (pick < 0.14), np.where(pick < 0.12, 1.0, -1.0) * _MAX[dtype], x)
    x = np.where((pick >= 0.14) & (pick < 0.2), np.where(pick < 0.17, 0.0, -0.0), x)
    if specials:
        x = np.where((pick >= 0.2) & (pick < 0.203), np.nan, x)
        x = np.where((pick >= 0.203) & (pick < 0.206), -np.nan, x)
        x = np.where((pick >= 0.206) & (pick < 0.21), np.where(pick < 0.208, np.inf, -np.inf), x)
    with np.errstate(over="ignore"):
        return x.astype(_np_dtype(dtype))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(KERNEL_SCHEMES), st.sampled_from(["float32", "bfloat16", "float16"]), st.integers(1, 24),
       st.integers(1, 1100), st.integers(-30, 12), st.booleans(), st.integers(0, 2**32 - 1))
def test_kernel_equals_torch_path_and_quantize(engine, scheme, dtype, rows, cols, exp, specials, seed):
    """The one-pass kernel's codes equal the torch path's and :func:`moeref.quant.quantize`'s, bit for bit, on
    drawn ties, subnormals, saturating and special values (rows wider than one program's 1024 columns too); it
    runs wherever no block's scale is NaN."""
    if engine != "kernel":
        pytest.skip("runs both paths itself: once, under the module's 'kernel' parameter")
    import moeref.quant._device_kernels as kernels
    import moeref.quant.device as qd

    x = _kernel_values(np.random.default_rng(seed), rows, cols, dtype, exp, specials)
    try:
        ref = quantize(x, scheme)
    except ValueError:  # the input the reference refuses: the error is checked by _check_equal above
        return
    calls = []
    orig, before = kernels.scaled_codes, qd._KERNEL
    kernels.scaled_codes = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        qd._KERNEL = True
        by_kernel = device_quantize(to_torch(x, DEV), scheme).to_host()
        qd._KERNEL = False
        by_torch = device_quantize(to_torch(x, DEV), scheme).to_host()
    finally:
        kernels.scaled_codes, qd._KERNEL = orig, before
    nan_scale = bool(np.isnan(ref.scale_values()).any())
    # scale_rules.finalize_scales: an FP32 scale that underflows is stored as 2^-149 and, for x * (1/s), those
    # blocks are scaled by 2^149 in float64 (the torch path's float64 working dtype)
    factor64 = (scheme.scale_format == "fp32" and scheme.preset.apply == "mul_recip" and scheme.static_scale is None
                and bool((ref.scales == np.float32(2.0**-149)).any()))
    event(f"kernel ran: {bool(calls)}")
    assert bool(calls) == (not nan_scale and not factor64), \
        f"kernel ran {len(calls)} times; NaN-scale blocks: {nan_scale}, float64 factors: {factor64}"
    for got, name in ((by_kernel, "kernel"), (by_torch, "torch path")):
        bad = np.flatnonzero(got.codes.ravel() != ref.codes.ravel())
        assert bad.size == 0, (f"{name}: {scheme.name} ({scheme.preset.name}) {dtype}: {bad.size} codes differ, "
                               f"first x = {x.ravel()[bad[0]]!r}: {got.codes.ravel()[bad[0]]:#x} vs "
                               f"{ref.codes.ravel()[bad[0]]:#x}")
        assert np.array_equal(_bits(got.scales), _bits(ref.scales)), name
