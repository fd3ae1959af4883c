"""Hypothesis properties of moeref.layouts: every layout is a bijection on its valid domain
(inverse(layout(s)) == s), padding is as documented, and offsets match the published formula."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from moeref.layouts import (
    check_swizzle_padding,
    from_cublas_1x128_scales,
    from_gptoss_mxfp4,
    from_mn_major_tma_aligned,
    mn_major_storage,
    pack_ue8m0,
    swizzle_128x4,
    to_cublas_1x128_scales,
    to_gptoss_mxfp4,
    to_mn_major_tma_aligned,
    unpack_ue8m0,
    unswizzle_128x4,
)

# leading (expert) axes, MN extents around multiples of 4 and 128, small K extents
lead_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
mn_sizes = st.one_of(st.integers(0, 13), st.sampled_from([31, 32, 33, 127, 128, 129, 255]))
k_sizes = st.integers(0, 9)


def _align(a, b):
    return -(-a // b) * b


@st.composite
def float_scales(draw):
    shape = (*draw(lead_shapes), draw(mn_sizes), draw(k_sizes))
    elems = st.floats(width=32, allow_nan=True, allow_infinity=True)
    return draw(hnp.arrays(np.float32, shape, elements=elems))


@given(float_scales())
def test_tma_roundtrip_strides_and_zero_padding(s):
    v = to_mn_major_tma_aligned(s)
    *lead, mn, k = s.shape
    mn_al = _align(mn, 4)
    assert v.shape == s.shape
    if mn > 1 and k > 1:
        assert v.strides[-2:] == (4, 4 * mn_al)
    storage = mn_major_storage(v)
    assert storage.shape == (*lead, k, mn_al)
    assert not np.any(storage[..., mn:])
    np.testing.assert_array_equal(from_mn_major_tma_aligned(v), s)
    np.testing.assert_array_equal(from_mn_major_tma_aligned(storage, mn=mn), s)
    # bit-exact (NaN payloads and -0.0 included)
    assert np.array_equal(from_mn_major_tma_aligned(v).view(np.uint32), s.view(np.uint32))


@given(float_scales())
def test_cublas_1x128_roundtrip(s):
    buf = to_cublas_1x128_scales(s)
    *lead, m, kb = s.shape
    assert buf.shape == (*lead, kb, _align(m, 4)) and buf.flags.c_contiguous
    np.testing.assert_array_equal(np.swapaxes(buf[..., :m], -1, -2), s)
    assert np.array_equal(from_cublas_1x128_scales(buf, m).view(np.uint32), s.view(np.uint32))


@st.composite
def pow2_scales(draw):
    shape = (*draw(lead_shapes), draw(mn_sizes), draw(k_sizes))
    exps = draw(hnp.arrays(np.int64, shape, elements=st.integers(-127, 127)))
    return np.ldexp(np.float32(1), exps).astype(np.float32)


@given(pow2_scales())
def test_ue8m0_pack_roundtrip_and_bit_oracle(s):
    p = pack_ue8m0(s)
    *lead, mn, k = s.shape
    n_words = -(-k // 4)
    assert p.shape == (*lead, mn, n_words) and p.dtype == np.int32
    np.testing.assert_array_equal(unpack_ue8m0(p, k), s)
    # oracle: memory image of each int32 (little-endian) is the 4 group codes bits>>23, then 0x00
    raw = np.ascontiguousarray(p).astype("<i4").view(np.uint8).reshape(*lead, mn, 4 * n_words)
    np.testing.assert_array_equal(raw[..., :k], s.view(np.uint32) >> 23)
    assert not np.any(raw[..., k:])
    assert not np.any(mn_major_storage(p)[..., mn:])


@given(hnp.arrays(np.uint8, st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(0, 13))))
def test_ue8m0_pack_codes_roundtrip(codes):
    p = pack_ue8m0(codes)
    np.testing.assert_array_equal(unpack_ue8m0(p, codes.shape[-1], as_codes=True), codes)


@given(
    s=pow2_scales().filter(lambda a: a.size > 0),
    data=st.data(),
)
def test_ue8m0_pack_refuses_any_mantissa_bit(s, data):
    flat_i = data.draw(st.integers(0, s.size - 1))
    idx = np.unravel_index(flat_i, s.shape)
    bits = int(s.view(np.uint32)[idx])
    if bits >> 23 == 0:  # 2^-127 (subnormal): set a different subnormal bit
        new_bits = bits | data.draw(st.integers(1, (1 << 22) - 1))
    else:
        new_bits = bits | data.draw(st.integers(1, (1 << 23) - 1))
    bad = s.copy()
    bad.view(np.uint32)[idx] = new_bits
    with pytest.raises(ValueError, match=r"scales\[" + ", ".join(str(int(i)) for i in idx) + r"\]"):
        pack_ue8m0(bad)


@st.composite
def byte_scales(draw):
    shape = (
        *draw(st.lists(st.integers(1, 3), max_size=1)),
        draw(st.one_of(st.integers(1, 40), st.sampled_from([127, 128, 129, 256, 300]))),
        draw(st.integers(1, 13)),
    )
    return draw(hnp.arrays(np.uint8, shape, elements=st.integers(1, 255)))  # nonzero: padding shows


@given(byte_scales(), st.sampled_from(["flat", "2d"]))
def test_swizzle_roundtrip_formula_and_zero_padding(s, out):
    *lead, rows, cols = s.shape
    R, C = _align(rows, 128), _align(cols, 4)
    buf = swizzle_128x4(s, out=out)
    assert buf.shape == ((*lead, R * C) if out == "flat" else (*lead, R, C))
    np.testing.assert_array_equal(unswizzle_128x4(buf, rows, cols), s)
    flat = buf.reshape(*lead, R * C)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = (r // 128) * (C // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    np.testing.assert_array_equal(flat[..., off], s)
    assert np.count_nonzero(flat) == s.size  # every other byte (padding) is zero
    assert check_swizzle_padding(buf, rows, cols).ok


@given(byte_scales(), st.data())
def test_swizzle_padding_checker_sees_any_poisoned_padding_byte(s, data):
    *lead, rows, cols = s.shape
    buf = swizzle_128x4(s)
    pad_offsets = np.flatnonzero(buf.reshape(-1, buf.shape[-1])[0] == 0)
    if pad_offsets.size == 0:
        return  # shapes that are exact multiples have no padding
    o = int(data.draw(st.sampled_from(pad_offsets.tolist())))
    poisoned = buf.copy()
    poisoned[..., o] = 0x80
    rep = check_swizzle_padding(poisoned, rows, cols)
    n_lead = int(np.prod(lead)) if lead else 1
    assert rep.count == n_lead and set(rep.offsets.tolist()) == {o}


@given(
    st.lists(st.integers(1, 3), max_size=2).map(tuple),
    st.integers(0, 5),
    st.integers(0, 4),
    st.data(),
)
def test_gptoss_roundtrip(lead, rows, n_blocks, data):
    codes = data.draw(hnp.arrays(np.uint8, (*lead, rows, 16 * n_blocks)))
    scales = data.draw(hnp.arrays(np.uint8, (*lead, rows, n_blocks)))
    blocks, sc = to_gptoss_mxfp4(codes, scales)
    assert blocks.shape == (*lead, rows, n_blocks, 16)
    c2, s2 = from_gptoss_mxfp4(blocks, sc)
    np.testing.assert_array_equal(c2, codes)
    np.testing.assert_array_equal(s2, scales)
    # block b byte i holds flat byte 16 b + i
    if rows and n_blocks:
        np.testing.assert_array_equal(blocks[..., -1, -1, :], codes[..., -1, 16 * (n_blocks - 1):])
