"""Integer schemes: GPTQ (symmetric and asymmetric), vLLM quantize_weights and dynamic INT8
bit-for-bit against tests/quant_oracles.py; W4A8 (CUTLASS) invariants; bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quant_oracles as O
from moeref.formats import pack_int4_to_int32, unpack_int4_from_int32
from moeref.quant import (
    int4_group, int8_per_channel, int8_per_token, quantize, requantize, w4a8_cutlass,
)


def _weights(n, k, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-6, 6, (n, 1)))).astype(np.float32)
    w[0] = 0.0                       # all-zero groups
    w[1] = np.abs(w[1])              # all-positive groups (asymmetric: xmin widened to 0)
    w[2, :8] = [-1.5, 1.5, 0.75, -0.75, 0.1, 0.0, 1.5, -1.5]
    return w


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_bitwise(sym, group):
    w = _weights(16, 256, group)
    q_ref, s_ref, z_ref = O.gptq_quantize(torch.from_numpy(w), group, sym)
    q = quantize(w, int4_group(group, symmetric=sym, preset="gptq"))
    if sym:
        # GPTQ find_params quirk, NOT reproduced: under sym=True an all-non-negative group keeps
        # xmin = 0, so its scale is amax/15 and half the codes are unusable; moeref's preset
        # (and compressed-tensors) use 2*amax/15 for every group. Row 1 is such a row.
        assert np.array_equal(s_ref[1], np.abs(w[1]).reshape(-1, group).max(-1) / np.float32(15))
        keep = np.ones(16, bool)
        keep[1] = False
        assert np.array_equal(q.scales[keep], s_ref[keep])
        # GPTQ stores q + 8 (uint4b8); moeref stores the signed value
        assert np.array_equal(q.element_values().astype(np.int64)[keep], q_ref[keep] - 8)
        return
    assert np.array_equal(q.scales, s_ref)
    if sym:
        pass
    else:
        assert np.array_equal(q.element_codes().astype(np.int64), q_ref)
        assert np.array_equal(q.zero_points, z_ref.astype(np.int16))


def test_vllm_quantize_weights_int4_bitwise():
    w = _weights(16, 256, 7)
    w[0, :5] = 1.0  # no all-zero groups: vLLM would divide by 0
    w[0] += 0.01
    q_ref, s_ref = O.vllm_quantize_weights_int4(torch.from_numpy(w), 64)
    q = quantize(w, int4_group(64, preset="vllm_int4"))
    assert np.array_equal(q.scales, s_ref)
    assert np.array_equal(q.element_values().astype(np.int64), q_ref)


def test_vllm_dynamic_int8_bitwise():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 200)).astype(np.float32) * 3
    q_ref, s_ref = O.vllm_dynamic_int8(x)
    q = quantize(x, int8_per_token(preset="vllm_int8"))
    assert np.array_equal(q.scales, s_ref)
    assert np.array_equal(q.element_values().astype(np.int64), q_ref)


def test_vllm_int8_subnormal_amax_overflows_like_vllm():
    # 127 / 3e-39 overflows float32 to Inf; -3e-39 * Inf = -Inf saturates to -128
    q = quantize(np.array([[-3e-39, 0.0]], np.float32), int8_per_token(preset="vllm_int8"))
    assert q.element_values().tolist() == [[-128.0, 0.0]]  # 0 * Inf = NaN -> 0 (cvt.rni.sat)


def test_int8_hand_values():
    x = np.array([[127.0, -127.0, 63.5, 0.5], [0, 0, 0, 0]], np.float32)
    q = quantize(x, int8_per_channel())
    assert q.scales.ravel().tolist() == [1.0, 1.0]
    # 63.5 and 0.5 are ties: to even (64, 0)
    assert q.element_values().tolist() == [[127, -127, 64, 0], [0, 0, 0, 0]]
    assert q.codes.dtype == np.uint8 and q.codes[0, 1] == 0x81  # two's complement


def test_int4_default_symmetric_and_packing():
    x = np.array([[-7.0, -1.0, 0.0, 1.0, 2.0, 3.0, 7.0, 4.0]], np.float32)
    q = quantize(x, int4_group(8))
    assert q.scales.tolist() == [[1.0]]
    assert q.element_values().tolist() == x.tolist()
    assert q.codes.shape == (1, 4)
    assert q.codes[0].tolist() == [0xF9, 0x10, 0x32, 0x47]  # -7 -> 9, -1 -> F, even element low
    words = pack_int4_to_int32(q.element_codes())
    assert np.array_equal(unpack_int4_from_int32(words), q.element_codes())


def test_asymmetric_zero_point_semantics():
    x = np.array([[0.0, 1.0, 2.0, 15.0]], np.float32)  # xmin 0 -> zp 0, s = 1
    q = quantize(x, int4_group(4, symmetric=False))
    assert q.scales.tolist() == [[1.0]] and q.zero_points.tolist() == [[0]]
    assert q.dequantize().tolist() == x.tolist()
    y = np.array([[-3.0, 0.0, 6.0, 12.0]], np.float32)  # s = 1, zp = 3
    q = quantize(y, int4_group(4, symmetric=False))
    assert q.zero_points.tolist() == [[3]] and q.element_codes().tolist() == [[0, 3, 9, 15]]
    assert q.dequantize().tolist() == y.tolist()


def test_w4a8_scales_and_codes_agree():
    w = _weights(8, 256, 3)
    q = quantize(w, w4a8_cutlass())
    assert q.scales.shape == (8, 2) and q.channel_scales.shape == (8, 1)
    assert q.scales.dtype == np.uint8  # E4M3 group scales
    # the data were quantized with the STORED group scale x channel scale (not the unrounded one)
    eff = np.repeat(q.scale_values(), 128, axis=1)
    zero = eff == 0  # row 0 is all zeros: group scale code 0, codes 0
    assert np.array_equal(zero, np.repeat(w.reshape(8, 2, 128).any(-1) == 0, 128, axis=1))
    ref = np.clip(np.rint(w.astype(np.float64) / np.where(zero, 1.0, eff)), -8, 7)
    assert np.array_equal(q.element_values(), ref)
    # each row's largest group scale is 448 in E4M3 (the channel scale spreads the range)
    live = q.scales.max(axis=1)[1:]
    assert (live == 0x7E).all()
    # vLLM loader convention: channel scales of one, group scales cast to E4M3 directly
    q1 = quantize(w[1:], w4a8_cutlass(channel_scales="ones"))
    assert (q1.channel_scales == 1).all()


def test_requantize_int4_sym_to_asym():
    w = _weights(4, 64, 5)
    q = quantize(w, int4_group(32))
    t, rep = requantize(q, int4_group(32, symmetric=False))
    assert rep.error.shape == w.shape and rep.max_abs_error >= 0
    assert np.array_equal(rep.error, t.dequantize(np.float64) - q.dequantize(np.float64))


def test_bad_input():
    with pytest.raises(ValueError, match="group_size"):
        int4_group(0)
    with pytest.raises(ValueError, match="channel_scales"):
        w4a8_cutlass(channel_scales="x")
    with pytest.raises(ValueError, match="W4A8 weights"):
        quantize(np.ones(8, np.float32), w4a8_cutlass())
    with pytest.raises(TypeError):
        quantize(np.ones((2, 8), np.int8), int8_per_token())
