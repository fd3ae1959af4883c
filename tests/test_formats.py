"""Element formats: exhaustive decode/encode against ml_dtypes, pinned disagreements from the field
(OFP8 / OCP MX v1.0 tables, the libraries' casts), packing conventions, and bad input.

Oracles: ml_dtypes 0.6 casts and decodes (RNE, non-saturating) and values derived by hand in this
file. Expected values never come from moeref itself. The torch oracles (torch 2.13 casts:
saturating E4M3FN, non-saturating E5M2/FNUZ) are in ``tests/test_formats_torch.py``, so this suite
runs without torch (the core install needs only numpy and ml_dtypes).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moeref.formats import (
    FORMATS,
    ROUNDING_MODES,
    decode,
    decode_table,
    encode,
    get_format,
    pack_int4_to_int32,
    pack_nibbles,
    representable_values,
    round_to_format,
    unpack_int4_from_int32,
    unpack_nibbles,
)

ML_FLOATS = [n for n, f in FORMATS.items() if f.kind == "float" and f.ml_dtypes_name]
NON_SATURATING = {"e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "e8m0"}  # ml_dtypes overflow -> Inf/NaN


# ---- oracles ----------------------------------------------------------------------------------
def ml_decode(name: str) -> np.ndarray:
    """float64 value of every code, decoded by ml_dtypes (codes held one per byte)."""
    f = FORMATS[name]
    codes = np.arange(f.num_codes, dtype=np.uint8)
    return codes.view(getattr(ml_dtypes, f.ml_dtypes_name)).astype(np.float64)


def ml_encode(x: np.ndarray, name: str) -> np.ndarray:
    """ml_dtypes cast, as the code byte (sub-byte formats: the low ``bits`` bits)."""
    f = FORMATS[name]
    with np.errstate(over="ignore", invalid="ignore"):
        out = x.astype(getattr(ml_dtypes, f.ml_dtypes_name)).view(np.uint8)
    return out & np.uint8(f.num_codes - 1)


def all_16bit(dtype) -> np.ndarray:
    """Every bit pattern of a 16-bit float dtype."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)


def f64(x: np.ndarray) -> np.ndarray:
    """float64 copy; NaN bit patterns widen to NaN quietly."""
    with np.errstate(invalid="ignore"):
        return x.astype(np.float64)


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as values, NaN == NaN, and -0 distinct from +0."""
    return np.array_equal(a, b, equal_nan=True) and np.array_equal(
        np.signbit(a[~np.isnan(a)]), np.signbit(b[~np.isnan(b)])
    )


# ---- format constants (OFP8 and OCP MX v1.0 tables, hand-copied) ---------------------------------
@pytest.mark.parametrize(
    "name, bits, bias, max_finite, min_normal, min_sub",
    [
        ("e4m3fn", 8, 7, 448.0, 2.0**-6, 2.0**-9),
        ("e5m2", 8, 15, 57344.0, 2.0**-14, 2.0**-16),
        ("e2m1", 4, 1, 6.0, 1.0, 0.5),
        ("e2m3", 6, 1, 7.5, 1.0, 0.125),
        ("e3m2", 6, 3, 28.0, 0.25, 0.0625),
        ("e8m0", 8, 127, 2.0**127, 2.0**-127, None),
        ("ue4m3", 7, 7, 448.0, 2.0**-6, 2.0**-9),
        ("e4m3fnuz", 8, 8, 240.0, 2.0**-7, 2.0**-10),
        ("e5m2fnuz", 8, 16, 57344.0, 2.0**-15, 2.0**-17),
    ],
)
def test_format_constants(name, bits, bias, max_finite, min_normal, min_sub):
    f = get_format(name)
    assert (f.bits, f.bias, f.max_finite, f.min_normal, f.min_subnormal) == (
        bits, bias, max_finite, min_normal, min_sub)
    # the largest finite value is also the largest value the decoder produces
    vals = decode_table(name)
    assert vals[np.isfinite(vals)].max() == max_finite


# ---- exhaustive decode ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ML_FLOATS)
def test_decode_every_code_matches_ml_dtypes(name):
    ours = decode(np.arange(FORMATS[name].num_codes, dtype=np.uint8), name, np.float64)
    assert same_values(ours, ml_decode(name))
    ours32 = decode(np.arange(FORMATS[name].num_codes, dtype=np.uint8), name)
    assert ours32.dtype == np.float32 and same_values(ours32.astype(np.float64), ours)


def test_decode_ue4m3_is_the_nonnegative_half_of_e4m3fn():
    ref = ml_decode("e4m3fn")[:128]  # sign bit 0: what an NVFP4 block scale byte can be
    assert same_values(decode(np.arange(128, dtype=np.uint8), "ue4m3", np.float64), ref)


@pytest.mark.parametrize("name, signed", [("int8", True), ("uint8", False), ("int4", True), ("uint4", False)])
def test_decode_integers_two_complement(name, signed):
    f = FORMATS[name]
    c = np.arange(f.num_codes)
    ref = np.where(c >= f.num_codes // 2, c - f.num_codes, c) if signed else c
    assert np.array_equal(decode(c.astype(np.uint8), name, np.float64), ref.astype(np.float64))


def test_e2m1_code_table_by_hand():
    # OCP MX v1.0 E2M1: 0:0, 1:0.5, 2:1, 3:1.5, 4:2, 5:3, 6:4, 7:6; bit 3 is the sign (0x8 = -0)
    pos = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert same_values(decode(np.arange(16, dtype=np.uint8), "e2m1", np.float64),
                       np.array(pos + [-v for v in pos]))


# ---- exhaustive encode(decode(c)) == c --------------------------------------------------------
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rounding", [m for m in ROUNDING_MODES if m != "stochastic"])
def test_round_trip_every_code(name, rounding):
    """Every mode maps a representable value to itself (tt-metal#51971: 132/256 E4M3 codes failed)."""
    f = FORMATS[name]
    codes = np.arange(f.num_codes, dtype=np.uint8)
    vals = decode(codes, name, np.float64)
    finite = np.isfinite(vals)
    if f.specials == "fnuz":
        finite &= codes != 0x80  # the FNUZ NaN code; decode gives NaN already
    if name == "ue4m3":
        finite &= codes < 0x80  # sign bit unused
    for overflow in ("saturate", "error") + (("inf_nan",) if f.has_nan else ()):
        got = encode(vals[finite], name, overflow=overflow, rounding=rounding)
        assert np.array_equal(got, codes[finite]), (name, rounding, overflow)
        # float32 input takes the table path: same answer
        got32 = encode(vals[finite].astype(np.float32), name, overflow=overflow, rounding=rounding)
        assert np.array_equal(got32, codes[finite])


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.has_nan])
def test_nan_codes_map_to_canonical_nan(name):
    f = FORMATS[name]
    vals = decode_table(name)
    nan_codes = np.flatnonzero(np.isnan(vals)).astype(np.uint8)
    assert nan_codes.size >= 1
    canonical_pos = {"e4m3fn": 0x7F, "e5m2": 0x7E, "e4m3fnuz": 0x80, "e5m2fnuz": 0x80,
                     "e8m0": 0xFF, "ue4m3": 0x7F}[name]
    x = vals[nan_codes]
    got = encode(x, name, overflow="inf_nan")
    if f.specials in ("ieee", "fn") and f.signed:  # sign of the NaN is kept (ml_dtypes does too)
        expect = np.where(np.signbit(x), canonical_pos | 0x80, canonical_pos)
    else:
        expect = np.full(x.shape, canonical_pos)
    assert np.array_equal(got, expect.astype(np.uint8))
    assert np.isnan(decode(got, name)).all()


def test_e5m2_infinities_round_trip_only_without_saturation():
    assert encode(np.array([np.inf, -np.inf]), "e5m2", overflow="inf_nan").tolist() == [0x7C, 0xFC]
    assert encode(np.array([np.inf, -np.inf]), "e5m2", overflow="saturate").tolist() == [0x7B, 0xFB]


# ---- exhaustive encode of 16-bit inputs -------------------------------------------------------
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", ML_FLOATS)
def test_encode_every_16bit_input_matches_ml_dtypes(dtype, name):
    """All 65536 bit patterns, RNE; overflow as ml_dtypes does it (Inf/NaN, or saturate for FP4/FP6)."""
    f = FORMATS[name]
    x = all_16bit(dtype)
    x64 = f64(x)
    keep = np.ones(x.shape, bool)
    if not f.has_nan:
        keep &= ~np.isnan(x64)  # ml_dtypes writes -0 for NaN; moeref refuses (tested below)
    if name == "e8m0":  # E8M0: positive inputs above ml_dtypes' subnormal quirk (pinned below)
        keep &= (x64 >= 1.5 * 2.0**-127) | np.isnan(x64)
    overflow = "inf_nan" if name in NON_SATURATING else "saturate"
    got = encode(x[keep], name, overflow=overflow)
    assert np.array_equal(got, ml_encode(x[keep], name))


# ---- pinned disagreements (FP8 overflow, E2M1 midpoints, reported bugs) --------------------------
E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E2M1_EXPECTED = {  # derived by hand from the grid 0, .5, 1, 1.5, 2, 3, 4, 6
    "rne": [0, 2, 2, 4, 4, 6, 6],               # ties to the even code
    "ties_toward_zero": [0, 1, 2, 3, 4, 5, 6],  # DeepGEMM _quantize_to_fp4_e2m1 (|x| > boundary)
    "ties_away": [1, 2, 3, 4, 5, 6, 7],         # microxcaling "nearest"
}


@pytest.mark.parametrize("rounding", list(E2M1_EXPECTED))
@pytest.mark.parametrize("dtype", [np.float64, np.float32, ml_dtypes.bfloat16, np.float16])
def test_e2m1_midpoints_under_three_tie_rules(rounding, dtype):
    x = np.array(E2M1_MIDPOINTS, dtype=dtype)
    expect = np.array(E2M1_EXPECTED[rounding])
    assert encode(x, "e2m1", overflow="saturate", rounding=rounding).tolist() == expect.tolist()
    assert encode(-x, "e2m1", overflow="saturate", rounding=rounding).tolist() == (expect | 8).tolist()


def test_e2m1_rne_agrees_with_ml_dtypes_on_midpoints():
    x = np.array(E2M1_MIDPOINTS, np.float32)
    assert encode(x, "e2m1", overflow="saturate").tolist() == ml_encode(x, "e2m1").tolist()


def test_e2m1_signs_and_saturation():
    x = np.array([-0.1, -0.0, 0.0, 7.0, -7.0, np.inf, -np.inf, 1e30])
    assert encode(x, "e2m1", overflow="saturate").tolist() == [8, 8, 0, 7, 15, 7, 15, 7]


def test_e2m1_sticky_bit_tt_metal_51971():
    """0.25000006 is above the 0 | 0.5 midpoint and must round to 0.5 (tt-metal lost the sticky bit)."""
    for dtype in (np.float32, np.float64):
        x = np.array([0.25000006, np.nextafter(dtype(0.25), dtype(1))], dtype)
        assert encode(x, "e2m1", overflow="saturate").tolist() == [1, 1]
    x = np.array([0.25], ml_dtypes.bfloat16).view(np.uint16) + np.uint16(1)
    assert encode(x.view(ml_dtypes.bfloat16), "e2m1", overflow="saturate").tolist() == [1]


def test_e4m3_overflow_threshold():
    x = np.array([448.0, 449.0, 464.0, 465.0, np.inf, -465.0, -np.inf], np.float32)
    assert [hex(c) for c in encode(x, "e4m3fn", overflow="inf_nan")] == [
        "0x7e", "0x7e", "0x7e", "0x7f", "0x7f", "0xff", "0xff"]
    assert [hex(c) for c in encode(x, "e4m3fn", overflow="saturate")] == [
        "0x7e", "0x7e", "0x7e", "0x7e", "0x7e", "0xfe", "0xfe"]
    # just below 464 and just above: the rounding decides, then the overflow rule
    below, above = np.nextafter(np.float32(464), np.float32(0)), np.nextafter(np.float32(464), np.float32(1e9))
    assert encode(np.array([below, above]), "e4m3fn", overflow="inf_nan").tolist() == [0x7E, 0x7F]
    with pytest.raises(ValueError, match=r"element \(3,\) = 465.0 is outside the range of e4m3fn"):
        encode(x, "e4m3fn", overflow="error")


def test_e5m2_overflow_threshold():
    x = np.array([57344.0, 61439.0, 61440.0, -61440.0, np.inf], np.float32)
    assert encode(x, "e5m2", overflow="inf_nan").tolist() == [0x7B, 0x7B, 0x7C, 0xFC, 0x7C]
    assert encode(x, "e5m2", overflow="saturate").tolist() == [0x7B, 0x7B, 0x7B, 0xFB, 0x7B]


def test_fnuz_has_no_negative_zero():
    assert encode(np.array([-0.0, -1e-30, 0.0]), "e4m3fnuz", overflow="inf_nan").tolist() == [0, 0, 0]
    assert encode(np.array([-0.0]), "e4m3fn", overflow="inf_nan").tolist() == [0x80]
    # overflow in FNUZ is the unsigned NaN 0x80 whatever the sign (ml_dtypes, torch)
    assert encode(np.array([1e6, -1e6]), "e4m3fnuz", overflow="inf_nan").tolist() == [0x80, 0x80]


def test_e8m0_decode_pins():
    """sglang PR #25519 (0x86 read as NaN, 0xFF as Inf) and torchao PR #4725 (0x00 decoded as 0)."""
    out = decode(np.array([0x86, 0xFF, 0x00, 0x7F, 0xFE], np.uint8), "e8m0")
    assert out[0] == 128.0 and np.isnan(out[1]) and out[3] == 1.0 and out[4] == 2.0**127
    assert out[2] == 2.0**-127 and out[2:3].view(np.uint32)[0] == 0x00400000  # an fp32 subnormal


@pytest.mark.parametrize("k", [-127, -20, -1, 0, 1, 6, 100, 126])
def test_e8m0_floor_ceil_around_powers_of_two(k):
    p = np.float32(2.0**k)
    above = np.nextafter(p, np.float32(np.inf))
    below = np.nextafter(p, np.float32(0))
    x = np.array([p, above])
    assert encode(x, "e8m0", overflow="saturate", rounding="ceil").tolist() == [127 + k, 128 + k]
    assert encode(x, "e8m0", overflow="saturate", rounding="floor").tolist() == [127 + k, 127 + k]
    if k > -127:
        assert encode(np.array([below]), "e8m0", overflow="saturate", rounding="ceil").tolist() == [127 + k]
        assert encode(np.array([below]), "e8m0", overflow="saturate", rounding="floor").tolist() == [126 + k]


def test_e8m0_worked_example_100():
    x = np.array([100.0], np.float32)
    assert encode(x, "e8m0", overflow="saturate", rounding="floor").tolist() == [133]  # 2^6 = 64
    assert encode(x, "e8m0", overflow="saturate", rounding="ceil").tolist() == [134]   # 2^7 = 128
    assert encode(x, "e8m0", overflow="saturate").tolist() == [134]  # 100 > 96 = midpoint of 64, 128


def test_e8m0_top_of_range():
    """2^128 does not exist in E8M0: 0xFF is NaN, not 2^128 (fixed: it once encoded to 0xFF)."""
    x = np.array([2.0**127, 1.5 * 2.0**127, 2.0**128, np.inf])
    assert encode(x, "e8m0", overflow="saturate").tolist() == [0xFE] * 4
    assert encode(x, "e8m0", overflow="inf_nan").tolist() == [0xFE, 0xFF, 0xFF, 0xFF]
    assert encode(x, "e8m0", overflow="saturate", rounding="ceil").tolist() == [0xFE] * 4
    with pytest.raises(ValueError, match=r"element \(1,\) .* outside the range of e8m0"):
        encode(x, "e8m0", overflow="error")


def test_e8m0_nearest_below_2_pow_minus_126_disagrees_with_ml_dtypes_and_torch():
    """Pinned disagreement. For x in (2^-127, 1.5 * 2^-127) the nearest power of two is 2^-127
    (0x00): |x - 2^-127| < 0.5 * 2^-127 < |x - 2^-126|. ml_dtypes 0.6 and torch 2.13 return 2^-126
    (0x01) for these float32 subnormal inputs; moeref returns the nearest value."""
    x = np.array([1.015625, 1.25, 1.484375], np.float32) * np.float32(2.0**-127)
    assert encode(x, "e8m0", overflow="inf_nan").tolist() == [0, 0, 0]
    assert ml_encode(x, "e8m0").tolist() == [1, 1, 1]       # torch: tests/test_formats_torch.py
    # from 1.5 * 2^-127 (the tie, which goes up) on, all three agree
    x = np.array([1.5, 1.75], np.float32) * np.float32(2.0**-127)
    assert encode(x, "e8m0", overflow="inf_nan").tolist() == ml_encode(x, "e8m0").tolist() == [1, 1]


def test_float64_input_rounds_once_unlike_ml_dtypes_and_torch():
    """Pinned disagreement. x = 2^-10 + 2^-62 lies above the E4M3FN midpoint between 0 and 2^-9, so
    it rounds to 2^-9 (code 0x01). ml_dtypes 0.6 and torch 2.13 narrow float64 to float32 first,
    which rounds x to the midpoint 2^-10 exactly, and then round that tie to even: 0x00."""
    x = np.array([np.nextafter(2.0**-10, 1.0), np.nextafter(0.25, 1.0)])
    assert encode(x[:1], "e4m3fn", overflow="inf_nan").tolist() == [0x01]
    assert encode(x[1:], "e2m1", overflow="saturate").tolist() == [0x1]
    assert ml_encode(x[:1], "e4m3fn").tolist() == [0x00]
    assert ml_encode(x[1:], "e2m1").tolist() == [0x0]       # torch: tests/test_formats_torch.py


def test_e8m0_zero_and_underflow():
    x = np.array([0.0, -0.0, 2.0**-140])
    assert encode(x, "e8m0", overflow="saturate").tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="outside the range of e8m0"):
        encode(x[:1], "e8m0", overflow="inf_nan")


def test_integers_round_and_clamp():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 7.4, 8.0, -8.0, -9.0])
    assert encode(x, "int4", overflow="saturate").tolist() == [0, 2, 2, 0, 0xE, 7, 7, 8, 8]
    assert encode(x[:4], "int4", overflow="saturate", rounding="ties_away").tolist() == [1, 2, 3, 0xF]
    with pytest.raises(ValueError, match=r"element \(6,\) = 8.0 is outside the range of int4 \(-8..7\)"):
        encode(x, "int4", overflow="error")
    # UINT: negatives are out of range like any integer (zero-point quantizers clamp q to [0, 255])
    u = np.array([-3.0, -0.4, 255.4, 300.0])
    assert encode(u, "uint8", overflow="saturate").tolist() == [0, 0, 255, 255]
    with pytest.raises(ValueError, match=r"element \(0,\) = -3.0 is outside the range of uint8 \(0..255\)"):
        encode(u, "uint8", overflow="error")


def test_nan_code_for_formats_without_nan():
    x = np.array([np.nan, 1.0])
    assert encode(x, "e2m1", overflow="saturate", nan_code=0x7).tolist() == [7, 2]
    assert encode(x, "int8", overflow="saturate", nan_code=0).tolist() == [0, 1]


def test_round_to_format_and_representable_values():
    assert round_to_format(np.array([0.3, 2.6, 100.0]), "e2m1", overflow="saturate").tolist() == [0.5, 3.0, 6.0]
    assert representable_values("e2m1").tolist() == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert representable_values("e4m3fn").size == 253  # 254 non-NaN codes, +0 and -0 merge


@pytest.mark.parametrize("dtype", [np.float64, np.float32, ml_dtypes.bfloat16, np.float16])
def test_encode_keeps_shape(dtype):
    """0-d in, 0-d out (the float32 path once returned shape (1,)); strided input is fine."""
    out = encode(np.array(0.3, dtype), "e4m3fn", overflow="saturate")
    assert out.shape == () and int(out) == 0x2A
    x = np.arange(12, dtype=dtype).reshape(3, 4)[:, ::2]
    assert encode(x.T, "e2m1", overflow="saturate").tolist() == [[0, 6, 7], [4, 7, 7]]


# ---- packing (element 2i in the low nibble, as every anchor) -------------------------------------
def test_pack_nibbles_low_nibble_is_even_element():
    codes = np.array([0x1, 0x2, 0xF, 0x0, 0x7, 0x8], np.uint8)
    assert pack_nibbles(codes).tolist() == [0x21, 0x0F, 0x87]
    assert unpack_nibbles(np.array([0x21, 0x0F, 0x87], np.uint8)).tolist() == codes.tolist()


def test_pack_nibbles_axis():
    codes = np.arange(8, dtype=np.uint8).reshape(4, 2)
    assert pack_nibbles(codes, axis=0).tolist() == [[0x20, 0x31], [0x64, 0x75]]
    assert unpack_nibbles(pack_nibbles(codes, axis=0), axis=0).tolist() == codes.tolist()


def test_pack_int4_to_int32_order():
    codes = np.array([0, 1, 2, 3, 4, 5, 6, 7, 0xF, 0, 0, 0, 0, 0, 0, 0x8], np.uint8)
    words = pack_int4_to_int32(codes)
    assert words.dtype == np.int32
    assert words.view(np.uint32).tolist() == [0x76543210, 0x8000000F]
    assert words[1] < 0  # top nibble 8 sets the int32 sign bit
    assert unpack_int4_from_int32(words).tolist() == codes.tolist()


def test_ptx_and_ggml_orders_are_not_produced():
    """PTX cvt e2m1x2 puts its first operand high; GGML splits j / j+16. moeref's bytes differ."""
    codes = np.arange(32, dtype=np.uint8) % 16
    packed = pack_nibbles(codes)
    ptx_style = (codes[0::2] << 4) | codes[1::2]
    ggml_style = codes[:16] | (codes[16:] << 4)
    assert packed.tolist() == (codes[0::2] | (codes[1::2] << 4)).tolist()
    assert packed.tolist() != ptx_style.tolist() and packed.tolist() != ggml_style.tolist()


# ---- bad input ---------------------------------------------------------------------------------
def test_unknown_format():
    with pytest.raises(ValueError, match=r"unknown element format 'e9m9'; accepted: e4m3fn, e5m2"):
        get_format("e9m9")
    with pytest.raises(TypeError, match="format must be a name or ElementFormat; got int"):
        encode(np.ones(2), 8, overflow="saturate")


def test_unknown_rounding_and_overflow_modes():
    with pytest.raises(ValueError, match=r"unknown rounding mode 'nearest'; accepted: 'rne', 'rtz'"):
        encode(np.ones(2), "e4m3fn", overflow="saturate", rounding="nearest")
    with pytest.raises(ValueError, match=r"unknown overflow mode 'clamp'; accepted: 'saturate', 'inf_nan', 'error'"):
        encode(np.ones(2), "e4m3fn", overflow="clamp")
    with pytest.raises(TypeError, match="overflow"):
        encode(np.ones(2), "e4m3fn")  # no default: the field disagrees


def test_encode_refuses_integer_and_complex_input():
    with pytest.raises(TypeError, match=r"x must be floating point \(float16/float32/float64/bfloat16\); got int32"):
        encode(np.ones(2, np.int32), "e4m3fn", overflow="saturate")
    with pytest.raises(TypeError, match="x must be floating point; got integer/bool values"):
        encode([1, 2], "e4m3fn", overflow="saturate")
    with pytest.raises(TypeError, match="x must be real floating point; got complex dtype complex128"):
        encode(np.ones(2, complex), "e4m3fn", overflow="saturate")


def test_decode_refuses_bad_codes():
    with pytest.raises(ValueError, match=r"code 16 at index \(1,\) is out of range for e2m1 \(4-bit codes are 0..15\)"):
        decode(np.array([3, 16]), "e2m1")
    with pytest.raises(ValueError, match=r"code -1 at index \(0,\) is out of range for e4m3fn"):
        decode(np.array([-1]), "e4m3fn")
    with pytest.raises(TypeError, match="codes must be an integer array; got float64"):
        decode(np.array([1.0]), "e4m3fn")
    with pytest.raises(ValueError, match="dtype must be float32 or float64; got float16"):
        decode(np.array([1]), "e4m3fn", np.float16)


def test_nan_policies_refused_where_impossible():
    with pytest.raises(ValueError, match="nan_code is only for formats without NaN; e4m3fn has its own NaN"):
        encode(np.ones(2), "e4m3fn", overflow="saturate", nan_code=0)
    with pytest.raises(ValueError, match=r"nan_code must be a e2m1 code in \[0, 16\); got 16"):
        encode(np.ones(2), "e2m1", overflow="saturate", nan_code=16)
    with pytest.raises(ValueError, match="overflow='inf_nan' is impossible for e2m1: it has no Inf or NaN"):
        encode(np.ones(2), "e2m1", overflow="inf_nan")
    with pytest.raises(ValueError, match=r"element \(1,\) = nan: e2m1 has no NaN encoding; pass nan_code"):
        encode(np.array([1.0, np.nan]), "e2m1", overflow="saturate")
    with pytest.raises(ValueError, match=r"element \(0,\) = -2.0 is negative, but e8m0 is unsigned"):
        encode(np.array([-2.0]), "e8m0", overflow="saturate")


def test_stochastic_argument_errors():
    with pytest.raises(ValueError, match="rounding='stochastic' needs rbits"):
        encode(np.ones(2), "e2m1", overflow="saturate", rounding="stochastic")
    with pytest.raises(TypeError, match="rbits must be an unsigned integer array; got int8"):
        encode(np.ones(2), "e2m1", overflow="saturate", rounding="stochastic", rbits=np.zeros(2, np.int8))
    with pytest.raises(ValueError, match=r"rbits shape \(3,\) does not match x shape \(2,\)"):
        encode(np.ones(2), "e2m1", overflow="saturate", rounding="stochastic", rbits=np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="rbits is only used with rounding='stochastic'; got rounding='rne'"):
        encode(np.ones(2), "e2m1", overflow="saturate", rbits=np.zeros(2, np.uint8))


def test_packing_refuses_bad_input():
    with pytest.raises(ValueError, match=r"cannot pack an odd number \(3\) of 4-bit codes along axis -1"):
        pack_nibbles(np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match=r"codes\[\(1,\)\] = 16 is not a 4-bit code \(0..15\)"):
        pack_nibbles(np.array([1, 16], np.uint8))
    with pytest.raises(TypeError, match="codes must be an integer array of 4-bit codes; got float32"):
        pack_nibbles(np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=r"packed must be uint8 \(or int8\) bytes; got int32"):
        unpack_nibbles(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="cannot pack 12 4-bit codes eight per int32 along axis -1"):
        pack_int4_to_int32(np.zeros(12, np.uint8))
    with pytest.raises(TypeError, match="words must be int32 or uint32; got int64"):
        unpack_int4_from_int32(np.zeros(2, np.int64))


# ---- moeref formats / demo tables -------------------------------------------------------------
def test_parameter_rows_cover_every_format():
    from moeref.format_tables import parameter_rows

    rows = {r["name"]: r for r in parameter_rows()}
    assert set(rows) == set(FORMATS)
    assert (rows["e4m3fn"]["layout"], rows["e4m3fn"]["bias"], rows["e4m3fn"]["max"],
            rows["e4m3fn"]["min normal"], rows["e4m3fn"]["min subnormal"]) == ("1/4/3", "7", "448", "2^-6", "2^-9")
    assert rows["e8m0"]["max"] == "2^127" and rows["e8m0"]["min subnormal"] == "-"
    assert "0xFF = NaN" in rows["e8m0"]["specials"]


def test_value_rows_list_small_formats_only():
    from moeref.format_tables import value_rows

    rows = value_rows("e2m1")
    assert [r["value"] for r in rows] == ["0", "0.5", "1", "1.5", "2", "3", "4", "6",
                                          "-0", "-0.5", "-1", "-1.5", "-2", "-3", "-4", "-6"]
    assert [r["class"] for r in rows[:3]] == ["zero", "subnormal", "normal"]
    assert rows[0xB]["bits"] == "1.01.1" and rows[0xB]["code"] == "0xB"
    assert len(value_rows("e3m2")) == 64 and value_rows("e2m3")[63]["value"] == "-7.5"
    with pytest.raises(ValueError, match="value_rows lists formats of at most 6 bits; e4m3fn has 8"):
        value_rows("e4m3fn")


@pytest.mark.parametrize("x, name, rounding", [
    (0.3, "e4m3fn", "rne"), (1.75, "e2m1", "rne"), (1.75, "e2m1", "ties_toward_zero"),
    (1e-3, "e4m3fn", "rne"), (500.0, "e4m3fn", "rne"), (100.0, "e8m0", "ceil"), (-3.0, "int4", "rne"),
    (float("nan"), "e5m2", "rne"), (-2.5, "e2m1", "ties_away"),
])
def test_walk_value_steps_end_in_the_right_code(x, name, rounding):
    from moeref.format_tables import walk_value_steps

    steps = dict(walk_value_steps(x, name, rounding=rounding))
    expect = {  # hand-derived codes
        (0.3, "e4m3fn", "rne"): 0x2A, (1.75, "e2m1", "rne"): 0x4, (1.75, "e2m1", "ties_toward_zero"): 0x3,
        (1e-3, "e4m3fn", "rne"): 0x01, (500.0, "e4m3fn", "rne"): 0x7E, (100.0, "e8m0", "ceil"): 0x86,
        (-3.0, "int4", "rne"): 0xD, (-2.5, "e2m1", "ties_away"): 0xD,
    }.get((x, name, rounding), 0x7E)  # NaN -> E5M2 canonical NaN 0x7E
    assert steps["code"].startswith(f"0x{expect:0{(FORMATS[name].bits + 3) // 4}x} ")
    if (x, rounding) == (1.75, "rne"):
        assert "a tie: the even code" in steps["rounding"]


def test_rich_tables_render():
    pytest.importorskip("rich")
    from rich.console import Console

    from moeref.format_tables import format_detail, formats_overview, walk_value

    console = Console(record=True, width=200)
    console.print(formats_overview())
    console.print(format_detail("e2m1"))
    console.print(format_detail("e8m0"))
    console.print(walk_value(0.3, "e4m3fn"))
    text = console.export_text()
    assert "57344" in text and "0.11.1" in text and "256 codes" in text and "0x2a = 0.0101.010" in text
