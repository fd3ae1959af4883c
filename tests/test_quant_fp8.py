"""FP8 scaling schemes: bit-for-bit against the anchors' algorithms (tests/quant_oracles.py),
hand-derived values, bad input, requantization."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from moeref._interop import torch_e4m3_cast_saturates
import ml_dtypes

import quant_oracles as O
from moeref.quant import (
    PRESETS, Preset, Scheme, fp8_block, fp8_group, fp8_per_channel, fp8_per_tensor, fp8_per_token,
    quantize, dequantize, requantize,
)

TORCH_SATURATES = torch_e4m3_cast_saturates()
needs_sat = pytest.mark.skipif(not TORCH_SATURATES, reason="torch < 2.13 e4m3 cast is non-saturating")


def _special_matrix(m: int, n: int, seed: int, dtype) -> torch.Tensor:
    """Random rows with per-row magnitudes over 2^-12..2^12, plus rows of specials on purpose:
    zeros, signed zeros, FP32 subnormals, exact scale boundaries 448*2^k and their neighbours."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, n)) * np.exp2(rng.integers(-12, 13, (m, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, ::2] = -0.0
    x[1, 1::2] = np.float32(1e-40) * np.arange(1, len(x[1, 1::2]) + 1, dtype=np.float32)
    b = np.float32(448.0 * 2.0 ** -3)
    x[2, : min(n, 6)] = np.array([b, np.nextafter(b, np.float32(0)), np.nextafter(b, np.float32(1e9)),
                                  -b, 464 * 2.0 ** -3, 465 * 2.0 ** -3], np.float32)[: min(n, 6)]
    x[3, : min(n, 3)] = np.array([448 * 2.0 ** 20, 1e-4, 1e-5], np.float32)[: min(n, 3)]
    return torch.from_numpy(x).to(dtype)


DTYPES = [torch.float32, torch.bfloat16]


@needs_sat
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("n", [128, 300, 77])
def test_deepgemm_per_token_cast_bitwise(dtype, ue8m0, n):
    x = _special_matrix(9, n, n, dtype)
    codes, sf = O.deepgemm_per_token_cast_to_fp8(x, ue8m0, 128)
    q = quantize(x, fp8_group(128, "ue8m0" if ue8m0 else "fp32", "deepgemm"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scale_values().astype(np.float32), sf[:, : q.scales.shape[1]])
    if ue8m0:  # stored bytes are the exponent bits of DeepGEMM's float scales
        assert np.array_equal(q.scales, (sf.view(np.uint32) >> 23).astype(np.uint8))


@needs_sat
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_deepgemm_cuda_preset_reproduces_gpu_division(dtype, ue8m0):
    """``deepgemm_cuda``: DeepGEMM's utils as they run on a CUDA tensor (amax * fl(1/448)); the
    FP32 scales differ from the CPU run's (``deepgemm``) in some groups, by one ulp."""
    x = _special_matrix(64, 1024, 5, dtype)
    codes, sf = O.deepgemm_per_token_cast_to_fp8(x, ue8m0, 128, cuda_division=True)
    q = quantize(x, fp8_group(128, "ue8m0" if ue8m0 else "fp32", "deepgemm_cuda"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scale_values().astype(np.float32), sf)
    if not ue8m0:
        cpu = quantize(x, fp8_group(128, "fp32", "deepgemm"))
        assert not np.array_equal(cpu.scales, q.scales)  # the two runs of DeepGEMM really differ


@needs_sat
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(256, 256), (130, 200), (64, 64)])
def test_deepgemm_per_block_cast_bitwise(dtype, ue8m0, shape):
    x = _special_matrix(*shape, seed=shape[1], dtype=dtype)
    codes, sf = O.deepgemm_per_block_cast_to_fp8(x, ue8m0, 64)
    q = quantize(x, fp8_block((64, 64), "ue8m0" if ue8m0 else "fp32", "deepgemm"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scale_values().astype(np.float32), sf)


@needs_sat
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_vllm_per_token_group_quant_bitwise(dtype, ue8m0):
    x = _special_matrix(8, 384, 5, dtype)
    codes, ys = O.vllm_per_token_group_quant_fp8(x, 128, ue8m0)
    q = quantize(x, fp8_group(128, "ue8m0" if ue8m0 else "fp32", "vllm"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scale_values().astype(np.float32), ys)


@needs_sat
@pytest.mark.parametrize("dtype", DTYPES)
def test_te_current_scaling_bitwise(dtype):
    x = _special_matrix(6, 100, 11, dtype)
    codes, scale_inv = O.te_fp8_per_tensor(x)
    q = quantize(x, fp8_per_tensor(preset="te_fp8"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scales, scale_inv)


@needs_sat
@pytest.mark.parametrize("dtype", DTYPES)
def test_te_block_scaling_bitwise(dtype):
    x = _special_matrix(6, 256, 12, dtype)
    codes, scale_inv = O.te_fp8_block_1d(x, 128)
    q = quantize(x, fp8_group(128, preset="te_fp8_block"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scales, scale_inv)


@needs_sat
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_deepgemm_per_channel_cast_bitwise(dtype, ue8m0):
    x = _special_matrix(256, 40, 13, dtype)
    codes, sf = O.deepgemm_per_channel_cast_to_fp8(x, ue8m0, 128)
    q = quantize(x, fp8_block((128, 1), "ue8m0" if ue8m0 else "fp32", "deepgemm"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scale_values().astype(np.float32), sf)


def test_te_block_pow2_scales_round_encode_down():
    # amax 3: encode 448/3 = 149.33 -> 128 (down), decode 1/128
    q = quantize(np.array([[3.0, 1.0]], np.float32), fp8_group(2, preset="te_fp8_block"))
    assert q.scales.tolist() == [[1 / 128]]
    assert q.dequantize().tolist() == [[3.0, 1.0]]


def test_hand_derived_default_per_token():
    x = np.array([[448.0, 1.0, -2.0], [7.0, 0.0, 0.0], [0.0, -0.0, 0.0]], np.float32)
    q = quantize(x, fp8_per_token())
    # row 0: s = 1; row 1: s = 7/448 = 1/64 exactly; row 2: zero block -> scale 1 (default)
    assert q.scales.ravel().tolist() == [1.0, 1 / 64, 1.0]
    assert q.codes[0].tolist() == [0x7E, 0x38, 0xC0]
    assert q.codes[1].tolist() == [0x7E, 0x00, 0x00]
    assert q.codes[2].tolist() == [0x00, 0x80, 0x00]  # -0 keeps its sign
    assert q.dequantize().tolist() == x.tolist()


def test_e5m2_element_and_overflow_modes():
    x = np.array([[57344.0, 1.0]], np.float32)
    s = fp8_per_tensor(element="e5m2", static_scale=0.5)  # x / 0.5 = 114688 overflows E5M2
    assert quantize(x, s).codes.tolist() == [[0x7B, 0x40]]  # saturate (default)
    ml = fp8_per_tensor(element="e5m2", static_scale=0.5,
                        preset=PRESETS["default"].with_(name="nonsat", overflow="inf_nan"))
    assert quantize(x, ml).codes.tolist() == [[0x7C, 0x40]]  # Inf, as ml_dtypes
    ref = (x / np.float32(0.5)).astype(ml_dtypes.float8_e5m2).view(np.uint8)
    assert quantize(x, ml).codes.tolist() == ref.tolist()


def test_static_scale_and_override():
    x = np.array([[1.0, 2.0, 1000.0]], np.float32)
    q = quantize(x, fp8_per_tensor(static_scale=0.25))
    assert q.scales.tolist() == [[0.25]]
    assert q.dequantize().tolist() == [[1.0, 2.0, 112.0]]  # 4000 saturates to 448
    q2 = quantize(x, fp8_per_tensor(), scale=2.0)
    assert q2.scales.tolist() == [[2.0]]


def test_nan_inf_policies():
    x = np.array([[1.0, np.nan, 4.0, 448.0], [1.0, np.inf, 4.0, 448.0]], np.float32)
    d = quantize(x, fp8_group(2)).dequantize()
    assert np.isnan(d[0, :2]).all() and d[0, 2:].tolist() == [4.0, 448.0]  # NaN block
    assert np.isnan(d[1, :2]).all() and d[1, 2:].tolist() == [4.0, 448.0]
    # DeepGEMM: NaN amax -> ceil_to_ue8m0 -> 254 (2^127); data x * 2^-127 -> 0 except the NaN
    q = quantize(x, fp8_group(2, "ue8m0", "deepgemm"))
    assert q.scales[:, 0].tolist() == [254, 254]
    assert q.codes[0, :2].tolist() == [0x00, 0x7F]
    assert q.codes[1, :2].tolist() == [0x00, 0x7E]  # Inf * 2^-127 = Inf -> saturates to 448


def test_partial_blocks_pad_with_zeros():
    x = np.arange(1, 6, dtype=np.float32).reshape(1, 5) * 10  # groups [10..40], [50]
    q = quantize(x, fp8_group(4))
    assert q.scales.tolist() == [[np.float32(40) / np.float32(448), np.float32(50) / np.float32(448)]]
    assert q.codes.shape == (1, 5)


@pytest.mark.parametrize("make", [fp8_per_tensor, fp8_per_token, fp8_per_channel,
                                  lambda: fp8_group(64), lambda: fp8_block((32, 32))])
def test_any_leading_shape_and_torch_input(make):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 40, 70)).astype(np.float32)
    s = make()
    q = quantize(x, s)
    qt = quantize(torch.from_numpy(x), s)
    q16 = quantize(x.astype(ml_dtypes.bfloat16), s)
    assert q.codes.shape == x.shape
    assert np.array_equal(q.codes, qt.codes) and np.array_equal(q.scales, qt.scales)
    assert q16.codes.shape == x.shape
    # leading axes are independent: quantizing one slice gives that slice
    q1 = quantize(x[1], s)
    assert np.array_equal(q1.codes, q.codes[1]) and np.array_equal(q1.scales, q.scales[1])


def test_bad_input_raises():
    with pytest.raises(TypeError, match="floating point"):
        quantize(np.arange(8, dtype=np.int32).reshape(2, 4), fp8_group(4))
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        quantize(np.ones((2, 4), ml_dtypes.float8_e4m3fn), fp8_group(4))
    for bad in (-1.0, 0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            fp8_per_tensor(static_scale=bad)
        with pytest.raises(ValueError, match="positive finite"):
            quantize(np.ones((2, 2), np.float32), fp8_per_tensor(), scale=bad)
    with pytest.raises(ValueError, match="power of two"):
        fp8_per_tensor(static_scale=0.3, scale="ue8m0")
    with pytest.raises(ValueError, match="group_size must be > 0"):
        fp8_group(0)
    with pytest.raises(ValueError, match="FP8 element format"):
        fp8_group(element="e2m1")
    with pytest.raises(ValueError, match="blocks the last 2 axes"):
        quantize(np.ones(8, np.float32), fp8_block((4, 4)))
    with pytest.raises(ValueError, match="unknown preset"):
        fp8_group(preset="nope")
    with pytest.raises(ValueError, match="Preset.apply"):
        Preset("x", apply="nope")
    with pytest.raises(TypeError, match="Scheme"):
        quantize(np.ones((2, 2), np.float32), "fp8")


def test_quantized_tensor_is_immutable_and_validated():
    q = quantize(np.ones((2, 4), np.float32), fp8_group(2))
    with pytest.raises(ValueError):
        q.codes[0, 0] = 1
    with pytest.raises(ValueError):
        q.scales[0, 0] = 1
    with pytest.raises(Exception):
        q.shape = (1,)
    from moeref.quant import QuantizedTensor
    with pytest.raises(ValueError, match="block grid"):
        QuantizedTensor(codes=q.codes, scales=np.ones((2, 3), np.float32), scheme=q.scheme, shape=q.shape)
    assert q.nbytes == 8 + 4 * 4
    assert dequantize(q).dtype == np.float32


def test_requantize_fp32_group_to_ue8m0_is_lossy_and_requantizes_data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    q = quantize(x, fp8_group(128, "fp32", "deepgemm"))
    t, rep = requantize(q, fp8_group(128, "ue8m0", "deepgemm"))
    assert not rep.lossless and rep.max_abs_error > 0
    src = q.dequantize(np.float64)
    assert np.array_equal(rep.error, t.dequantize(np.float64) - src)
    # the data were re-encoded for the new scale, not reused with a rounded scale (the
    # transformers#47030 / sglang PR #28307 bug): the codes differ, and the error is within half
    # an E4M3 step at the new scale
    assert not np.array_equal(t.codes, q.codes)
    s = np.repeat(t.scale_values(), 128, axis=1)
    y = np.abs(src) / s
    ulp = np.exp2(np.floor(np.log2(np.maximum(y, 2.0 ** -6))) - 3)  # E4M3 spacing at |y|
    assert np.all(np.abs(rep.error) <= s * ulp / 2)
    # the wrong conversion (round the scale up to a power of two, keep the codes) is far worse
    wrong = q.element_values() * np.repeat(np.exp2(np.ceil(np.log2(q.scale_values()))), 128, axis=1)
    assert np.mean(np.abs(wrong - src)) > 4 * np.mean(np.abs(rep.error))


def test_requantize_to_same_or_finer_is_lossless():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    q = quantize(x, fp8_group(128, "ue8m0", "deepgemm"))
    t, rep = requantize(q, fp8_group(128, "ue8m0", "deepgemm"))
    assert rep.lossless and np.array_equal(t.codes, q.codes)
    t2, rep2 = requantize(q, fp8_group(32, "fp32"))
    assert rep2.lossless and rep2.max_abs_error == 0.0


def test_fp32_scale_underflow_never_makes_nan():
    # amax = 71 * 2^-149 (FP32 subnormal): amax / 448 underflows to 0; moeref uses 2^-149 so the
    # block's zeros stay zeros (not 0/0) and 71 rounds to the E4M3 value 72
    x = np.array([[71 * 2.0 ** -149, 0.0]], np.float32)
    for preset in ("default", PRESETS["default"].with_(name="mul", apply="mul_recip")):
        q = quantize(x, fp8_per_token(preset=preset))
        assert q.scales.tolist() == [[2.0 ** -149]]
        assert q.dequantize(np.float64).tolist() == [[72 * 2.0 ** -149, 0.0]]


def test_zero_block_knob():
    z = np.zeros((1, 4), np.float32)
    zero = PRESETS["default"].with_(name="zb0", zero_block="zero")
    assert quantize(z, fp8_per_token(preset=zero)).scales.tolist() == [[0.0]]
    assert quantize(z, fp8_per_token()).scales.tolist() == [[1.0]]
    with pytest.raises(ValueError, match="UE8M0"):
        quantize(z, fp8_per_token(preset=zero, scale="ue8m0"))
