"""Unit tests for moeref.layouts. Expected values come from hand derivations, explicit published
formulas written here, ml_dtypes, or bit-level oracles; never from the code under test."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moeref.layouts import (
    check_swizzle_padding,
    from_cublas_1x128_scales,
    from_gptoss_mxfp4,
    from_mn_major_tma_aligned,
    mn_major_storage,
    pack_ue8m0,
    pow2_to_ue8m0_codes,
    swizzle_128x4,
    swizzle_128x4_offsets,
    to_cublas_1x128_scales,
    to_gptoss_mxfp4,
    to_mn_major_tma_aligned,
    ue8m0_codes_to_float32,
    unpack_ue8m0,
    unswizzle_128x4,
)

RNG = np.random.default_rng(20261121)


# ---------------------------------------------------------------- independent oracles


def swizzle_offset_formula(r, c, cols):
    """notes 4.5 / torchao to_blocked docstring: the explicit byte offset."""
    n_col_tiles = -(-cols // 4)
    return (r // 128) * n_col_tiles * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_offset_vllm(m, k, cols):
    """vLLM nvfp4_utils.cuh statement: (mTile*numKTiles + kTile)<<9 | (m%32)<<4 | ((m>>5)&3)<<2 | k&3."""
    num_k_tiles = -(-cols // 4)
    return ((m // 128) * num_k_tiles + k // 4) << 9 | (m % 32) << 4 | ((m >> 5) & 3) << 2 | (k & 3)


def swizzle_torchao(s):
    """torchao utils.to_blocked written with numpy: pad with zeros to (128k, 4k), then
    view(n_row_blocks, 128, n_col_blocks, 4).permute(0, 2, 1, 3).reshape(-1, 4, 32, 4).transpose(1, 2)."""
    rows, cols = s.shape
    nrb, ncb = -(-rows // 128), -(-cols // 4)
    padded = np.zeros((nrb * 128, ncb * 4), s.dtype)
    padded[:rows, :cols] = s
    blocks = padded.reshape(nrb, 128, ncb, 4).transpose(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1)


def e8m0_code_bits(x_f32):
    """DeepGEMM's bit statement for a float32 power of two: bits >> 23 (exact for 2^-127 too)."""
    return (np.asarray(x_f32, np.float32).view(np.uint32) >> 23).astype(np.int64)


# ---------------------------------------------------------------- MN-major TMA-aligned


@pytest.mark.parametrize("mn,k", [(1, 1), (3, 2), (4, 5), (5, 3), (8, 1), (13, 7)])
def test_tma_view_strides_values_and_zero_padding(mn, k):
    s = RNG.standard_normal((mn, k)).astype(np.float32)
    v = to_mn_major_tma_aligned(s)
    mn_al = ((mn + 3) // 4) * 4  # hand: align(mn, 4)
    assert v.shape == (mn, k)
    assert v.strides == (4, 4 * mn_al)
    assert v.dtype == np.float32
    storage = mn_major_storage(v)
    assert v.base is storage
    assert storage.shape == (k, mn_al) and storage.flags.c_contiguous
    for m in range(mn):
        for g in range(k):
            assert storage[g, m] == s[m, g]
    assert np.all(storage[:, mn:] == 0)
    np.testing.assert_array_equal(from_mn_major_tma_aligned(v), s)
    np.testing.assert_array_equal(from_mn_major_tma_aligned(storage, mn=mn), s)


def test_tma_batched_strides_and_half_precision_alignment():
    s = RNG.standard_normal((2, 3, 5, 3)).astype(np.float32)
    v = to_mn_major_tma_aligned(s)
    assert v.strides == (3 * 3 * 8 * 4, 3 * 8 * 4, 4, 32)
    np.testing.assert_array_equal(v, s)
    h = to_mn_major_tma_aligned(np.ones((5, 2), np.float16))  # 16 bytes = 8 half elements
    assert h.strides == (2, 16)
    assert mn_major_storage(h).shape == (2, 8)


def test_tma_refuses_bad_input_and_nonzero_padding():
    with pytest.raises(TypeError, match="scales"):
        to_mn_major_tma_aligned(np.ones((4, 2), np.int32))
    with pytest.raises(ValueError, match="mn, k_groups"):
        to_mn_major_tma_aligned(np.ones(4, np.float32))
    storage = mn_major_storage(to_mn_major_tma_aligned(np.ones((5, 2), np.float32)))
    bad = storage.copy()
    bad[1, 6] = 3.0
    with pytest.raises(ValueError, match=r"x\[1, 6\] = 3\.0 is MN padding"):
        from_mn_major_tma_aligned(bad, mn=5)
    np.testing.assert_array_equal(from_mn_major_tma_aligned(bad, mn=5, check_padding=False), np.ones((5, 2)))
    with pytest.raises(ValueError, match="align"):
        from_mn_major_tma_aligned(storage, mn=9)
    with pytest.raises(ValueError, match="not an MN-major"):
        mn_major_storage(np.ones((5, 2), np.float32))


def test_cublas_1x128_layout_shape_and_values():
    m, k = 5, 300
    kb = -(-k // 128)  # 3
    s = RNG.random((m, kb)).astype(np.float32) + 0.5
    buf = to_cublas_1x128_scales(s)
    assert buf.shape == (kb, 8) and buf.flags.c_contiguous  # (ceil(K/128), roundup(M, 4))
    np.testing.assert_array_equal(buf[:, :m], s.T)
    assert np.all(buf[:, m:] == 0)
    np.testing.assert_array_equal(from_cublas_1x128_scales(buf, m), s)


# ---------------------------------------------------------------- packed UE8M0


def test_pack_ue8m0_bit_level_oracle():
    mn, k = 6, 9
    exps = RNG.integers(-127, 128, size=(mn, k))
    s = np.ldexp(np.float32(1), exps).astype(np.float32)
    p = pack_ue8m0(s)
    n_words = 3  # ceil(9 / 4)
    assert p.dtype == np.int32 and p.shape == (mn, n_words)
    assert p.strides == (4, 4 * 8)  # MN-major, stride(-1) = align(6, 4) = 8
    codes = e8m0_code_bits(s)
    for m in range(mn):
        for i in range(n_words):
            want = 0
            for j in range(4):
                g = 4 * i + j
                want |= (int(codes[m, g]) if g < k else 0) << (8 * j)
            assert int(p[m, i]) & 0xFFFFFFFF == want
    # memory image: little-endian int32, byte j of word i = group 4i + j
    raw = np.frombuffer(np.ascontiguousarray(p).astype("<i4").tobytes(), np.uint8).reshape(mn, 4 * n_words)
    np.testing.assert_array_equal(raw[:, :k], codes)
    assert np.all(raw[:, k:] == 0)
    storage = mn_major_storage(p)
    assert storage.shape == (n_words, 8) and np.all(storage[:, mn:] == 0)


def test_pack_ue8m0_deepgemm_hand_example():
    # groups 1, 2, 0.5, 4 -> codes 0x7F, 0x80, 0x7E, 0x81; group 8 -> 0x82 padded with 0x00
    p = pack_ue8m0(np.array([[1.0, 2.0, 0.5, 4.0, 8.0]], np.float32))
    assert int(p[0, 0]) & 0xFFFFFFFF == 0x817E807F
    assert int(p[0, 1]) == 0x82
    np.testing.assert_array_equal(unpack_ue8m0(p, 5), [[1.0, 2.0, 0.5, 4.0, 8.0]])


def test_pack_ue8m0_extremes_and_negative_words():
    s = np.array([[2.0**-127, 2.0**127, 1.0, 2.0**127]], np.float32)  # codes 0, 254, 127, 254
    p = pack_ue8m0(s)
    assert int(p[0, 0]) & 0xFFFFFFFF == 0xFE7FFE00
    assert int(p[0, 0]) < 0  # int32 two's complement
    np.testing.assert_array_equal(unpack_ue8m0(p, 4), s)


@pytest.mark.parametrize(
    "bad,value_text",
    [
        (0.75, "0.75"),
        (3.0, "3.0"),
        (1.0 + 2.0**-23, "1.0000001"),
        (0.0, "0.0"),
        (-0.0, "-0.0"),
        (-1.0, "-1.0"),
        (np.nan, "nan"),
        (np.inf, "inf"),
        (-np.inf, "-inf"),
        (2.0**-128, "2.93"),  # power of two below E8M0's 2^-127 (float32 subnormal)
        (2.0**-149, "1.4"),
    ],
)
def test_pack_ue8m0_refuses_non_powers_of_two(bad, value_text):
    s = np.ones((2, 5), np.float32)
    s[1, 3] = bad
    with pytest.raises(ValueError, match=r"scales\[1, 3\] = " + value_text.replace(".", r"\.")) as e:
        pack_ue8m0(s)
    assert "sglang#39193" in str(e.value)


def test_pack_ue8m0_refuses_non_power_of_two_float64_above_range():
    with pytest.raises(ValueError, match=r"scales\[0, 0\]"):
        pack_ue8m0(np.array([[2.0**128]]))


def test_pack_ue8m0_accepts_codes_uint8_and_e8m0_dtype():
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    p = pack_ue8m0(codes)
    np.testing.assert_array_equal(unpack_ue8m0(p, 32, as_codes=True), codes)
    p2 = pack_ue8m0(codes.view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(np.asarray(p2), np.asarray(p))
    with pytest.raises(TypeError, match="scales"):
        pack_ue8m0(codes.astype(np.int32))


def test_ue8m0_decode_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = ue8m0_codes_to_float32(codes)
    np.testing.assert_array_equal(got, want)  # equal_nan by default: code 255 -> NaN
    assert got[0] == np.float32(2.0**-127) and got[0x86] == 128.0 and np.isnan(got[255])


def test_pow2_codes_match_bit_oracle_for_every_exponent():
    s = np.ldexp(np.float32(1), np.arange(-127, 128)).astype(np.float32)
    np.testing.assert_array_equal(pow2_to_ue8m0_codes(s), e8m0_code_bits(s))
    np.testing.assert_array_equal(pow2_to_ue8m0_codes(s.astype(ml_dtypes.bfloat16)), e8m0_code_bits(s))


def test_unpack_ue8m0_refuses_nonzero_k_padding_and_bad_shapes():
    p = np.ascontiguousarray(pack_ue8m0(np.ones((3, 5), np.float32)))
    p[2, 1] |= 0x7F << 16  # group 6 = word 1, byte 2: padding
    with pytest.raises(ValueError, match=r"packed\[2\] byte for padding group 6 \(word 1, byte 2\) is 0x7f"):
        unpack_ue8m0(p, 5)
    assert unpack_ue8m0(p, 5, check_padding=False).shape == (3, 5)
    with pytest.raises(ValueError, match="ceil"):
        unpack_ue8m0(p, 9)
    with pytest.raises(TypeError, match="int32"):
        unpack_ue8m0(p.astype(np.int64), 5)


def test_pack_ue8m0_batched_groups():
    s = np.ldexp(np.float32(1), RNG.integers(-20, 20, size=(3, 5, 6))).astype(np.float32)
    p = pack_ue8m0(s)
    assert p.shape == (3, 5, 2) and p.strides == (2 * 8 * 4, 4, 32)
    for g in range(3):
        np.testing.assert_array_equal(np.asarray(p[g]), np.asarray(pack_ue8m0(s[g])))
    np.testing.assert_array_equal(unpack_ue8m0(p, 6), s)


# ---------------------------------------------------------------- 128x4 swizzle


def test_swizzle_exhaustive_against_formula_200x6():
    rows, cols = 200, 6
    s = RNG.integers(1, 256, size=(rows, cols), dtype=np.uint8)  # nonzero: padding is visible
    flat = swizzle_128x4(s)
    assert flat.shape == (256 * 8,) and flat.dtype == np.uint8
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = swizzle_offset_formula(r, c, cols)
    np.testing.assert_array_equal(off, swizzle_offset_vllm(r, c, cols))
    np.testing.assert_array_equal(flat[off], s)
    is_data = np.zeros(flat.size, bool)
    is_data[off.ravel()] = True
    assert np.all(flat[~is_data] == 0)
    np.testing.assert_array_equal(swizzle_128x4_offsets(rows, cols)[:rows, :cols], off)


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (129, 5), (300, 3), (32, 17)])
def test_swizzle_against_torchao_form(shape):
    s = RNG.integers(0, 256, size=shape, dtype=np.uint8)
    np.testing.assert_array_equal(swizzle_128x4(s), swizzle_torchao(s))


def test_swizzle_hand_example_first_tile():
    s = np.zeros((128, 4), np.uint8)
    s[0, 0], s[1, 0], s[32, 0], s[127, 3] = 1, 2, 3, 4
    flat = swizzle_128x4(s)
    assert flat[0] == 1 and flat[16] == 2 and flat[4] == 3 and flat[511] == 4  # hand-derived


def test_swizzle_2d_form_dtype_preserved_and_batched():
    s = RNG.integers(0, 256, size=(3, 130, 6), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    b2 = swizzle_128x4(s, out="2d")
    assert b2.shape == (3, 256, 8) and b2.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    for e in range(3):
        np.testing.assert_array_equal(b2[e].view(np.uint8).ravel(), swizzle_torchao(s[e].view(np.uint8)))
    back = unswizzle_128x4(b2, 130, 6)
    assert back.dtype == s.dtype
    np.testing.assert_array_equal(back.view(np.uint8), s.view(np.uint8))
    np.testing.assert_array_equal(unswizzle_128x4(b2.reshape(3, -1), 130, 6).view(np.uint8), s.view(np.uint8))


def test_swizzle_bad_arguments():
    with pytest.raises(TypeError, match="1-byte"):
        swizzle_128x4(np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match="accepted: 'flat', '2d'"):
        swizzle_128x4(np.ones((4, 4), np.uint8), out="3d")
    with pytest.raises(ValueError, match=r"\[\.\.\., 512\]"):
        unswizzle_128x4(np.zeros(500, np.uint8), 4, 4)


def test_check_swizzle_padding_finds_each_poisoned_byte():
    rows, cols = 130, 5
    s = RNG.integers(1, 256, size=(rows, cols), dtype=np.uint8)
    buf = swizzle_128x4(s)
    assert check_swizzle_padding(buf, rows, cols).ok
    # poison every padding byte: the report must count exactly the padding
    off = swizzle_offset_formula(*np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij"), cols)
    pad = np.ones(buf.size, bool)
    pad[off.ravel()] = False
    poisoned = buf.copy()
    poisoned[pad] = 0xFF
    rep = check_swizzle_padding(poisoned, rows, cols)
    assert rep.count == 256 * 8 - rows * cols and not rep.ok
    assert sorted(rep.offsets.tolist()) == np.flatnonzero(pad).tolist()
    # one poisoned byte at logical (131, 2): offset by the formula
    one = buf.copy()
    o = swizzle_offset_formula(131, 2, cols)
    one[o] = 0x42
    rep = check_swizzle_padding(one, rows, cols)
    assert rep.count == 1 and rep.positions.tolist() == [[131, 2]] and rep.offsets.tolist() == [o]
    assert rep.values.tolist() == [0x42] and "0x42" in str(rep)


def test_check_swizzle_padding_batched_positions():
    buf = swizzle_128x4(np.ones((2, 3, 2), np.uint8), out="2d")
    assert buf.shape == (2, 128, 4)
    buf[1, 50, 0] = 9  # byte offset 200 = 12*16 + 2*4 + 0 -> logical (r=2*32+12=76, c=0): row padding
    rep = check_swizzle_padding(buf, 3, 2)
    assert rep.count == 1 and rep.positions.tolist() == [[1, 76, 0]] and rep.values.tolist() == [9]
    assert rep.offsets.tolist() == [200]


# ---------------------------------------------------------------- gpt-oss MXFP4


def test_gptoss_element_mapping_and_shapes():
    rows, k = 3, 96
    codes = RNG.integers(0, 16, size=(2, rows, k), dtype=np.uint8)  # [E, rows, K] E2M1 codes
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # low nibble = even element
    scale_codes = RNG.integers(100, 140, size=(2, rows, k // 32), dtype=np.uint8)
    blocks, scales = to_gptoss_mxfp4(packed, scale_codes)
    assert blocks.shape == (2, rows, 3, 16) and scales.shape == (2, rows, 3)
    assert blocks.dtype == np.uint8 and scales.dtype == np.uint8
    for e, r, kk in [(0, 0, 0), (0, 2, 33), (1, 1, 95), (1, 0, 64), (0, 1, 31)]:
        byte = blocks[e, r, kk // 32, (kk % 32) // 2]
        assert (byte >> (4 * (kk % 2))) & 0xF == codes[e, r, kk]
        assert scales[e, r, kk // 32] == scale_codes[e, r, kk // 32]
    # transformers convert_moe_packed_tensors: lut[low] -> even, lut[high] -> odd, ldexp(scale - 127)
    lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    deq = np.empty((2, rows, 3, 32))
    deq[..., 0::2] = lut[blocks & 0xF]
    deq[..., 1::2] = lut[blocks >> 4]
    deq = np.ldexp(deq, scales[..., None].astype(int) - 127).reshape(2, rows, k)
    want = lut[codes] * np.ldexp(1.0, np.repeat(scale_codes.astype(int) - 127, 32, axis=-1))
    np.testing.assert_array_equal(deq, want)
    back_codes, back_scales = from_gptoss_mxfp4(blocks, scales)
    np.testing.assert_array_equal(back_codes, packed)
    np.testing.assert_array_equal(back_scales, scale_codes)


def test_gptoss_outputs_do_not_alias_inputs():
    packed = np.zeros((1, 16), np.uint8)
    blocks, scales = to_gptoss_mxfp4(packed, np.zeros((1, 1), np.uint8))
    blocks[0, 0, 0] = 1
    assert packed[0, 0] == 0


def test_gptoss_shape_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        to_gptoss_mxfp4(np.zeros((2, 24), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match=r"scale_codes must have shape \(2, 2\)"):
        to_gptoss_mxfp4(np.zeros((2, 32), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match="last dimension 16"):
        from_gptoss_mxfp4(np.zeros((2, 2, 8), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="blocks.shape"):
        from_gptoss_mxfp4(np.zeros((2, 2, 16), np.uint8), np.zeros((2, 3), np.uint8))
    with pytest.raises(TypeError, match="1-byte"):
        to_gptoss_mxfp4(np.zeros((2, 16), np.int32), np.zeros((2, 1), np.uint8))


def test_torch_inputs_are_accepted():
    torch = pytest.importorskip("torch")
    s = torch.ones((5, 3), dtype=torch.float32)
    np.testing.assert_array_equal(to_cublas_1x128_scales(s)[:, :5], np.ones((3, 5)))
    b = swizzle_128x4(torch.ones((3, 2), dtype=torch.uint8))
    assert b.sum() == 6
