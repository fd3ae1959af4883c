"""Hypothesis properties of moeref.formats.encode.

* RNE encode equals ml_dtypes' cast bit for bit on float32, bfloat16, float16 and float64 input
  (overflow "inf_nan" where ml_dtypes does not saturate, "saturate" for E2M1/FP6); torch's casts
  in test_format_props_torch.py (this suite needs no torch).
* Every deterministic mode returns the neighbour its definition names (grid neighbours and tie
  rules written here from the published definitions), within the mode's error bound, monotone in x.
* Stochastic rounding: one of the two neighbours, deterministic given rbits, unbiased over all 256
  rbits values, and equal to TransformerEngine's ``floor((|x| + u*step)/step)``.
* Packing functions are exact inverses.

The strategy :func:`targeted` draws on purpose what breaks codecs: grid points, exact midpoints and
their neighbours one or two input-ulps away on both sides, the overflow threshold and its
neighbours, input subnormals, +-0, +-Inf, NaN, and arbitrary bit patterns.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moeref.formats import (
    FORMATS,
    encode,
    pack_int4_to_int32,
    pack_nibbles,
    round_to_format,
    unpack_int4_from_int32,
    unpack_nibbles,
)

DTYPES = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16),
          "f16": np.dtype(np.float16), "f64": np.dtype(np.float64)}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
ML_FLOATS = ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "e2m1", "e2m3", "e3m2", "e8m0"]
ML_OVERFLOW = {n: ("saturate" if n in ("e2m1", "e2m3", "e3m2") else "inf_nan") for n in ML_FLOATS}
# slower tests run a fraction of the profile's examples (ci 100, dev 60, thorough 2000)
FEWER = settings(max_examples=max(10, settings.default.max_examples * 3 // 5))
FEWEST = settings(max_examples=max(10, settings.default.max_examples * 2 // 5))
DETERMINISTIC = ("rne", "rtz", "ties_toward_zero", "ties_away", "ceil", "floor")


# ---- the value grid of each format, from an independent decoder -----------------------------
def _grid_and_codes(name: str):
    """(sorted non-negative finite magnitudes, their codes), decoded by ml_dtypes or by hand."""
    f = FORMATS[name]
    if f.kind == "int":  # two's complement integers: the magnitudes 0..max, code = magnitude
        mags = np.arange(int(f.max_finite) + 1, dtype=np.float64)
        return mags, mags.astype(np.int64)
    if name == "ue4m3":  # UE4M3 is the non-negative half of E4M3FN
        ml_name, codes = "float8_e4m3fn", np.arange(0x80, dtype=np.uint8)
    else:
        ml_name, codes = f.ml_dtypes_name, np.arange(f.num_codes, dtype=np.uint8)
    vals = codes.view(getattr(ml_dtypes, ml_name)).astype(np.float64)
    keep = np.isfinite(vals) & ~np.signbit(vals)
    order = np.argsort(vals[keep], kind="stable")
    mags, cds = vals[keep][order], codes[keep][order].astype(np.int64)
    first = np.r_[True, np.diff(mags) > 0]  # +0 only once
    return mags[first], cds[first]


GRIDS = {n: _grid_and_codes(n) for n in FORMATS}


def _threshold(name: str) -> float:
    """The overflow threshold: max finite + half the top step (E4M3FN 464, E5M2 61440, E2M1 7)."""
    mags = GRIDS[name][0]
    return mags[-1] + (mags[-1] - mags[-2]) / 2


def _nudge(x: np.ndarray, k: int) -> np.ndarray:
    """Move the magnitude of each element by k ulps of its own dtype (bit arithmetic)."""
    u = UINT[x.dtype.itemsize]
    bits = x.view(u)
    sign = bits & u(1 << (8 * x.dtype.itemsize - 1))
    mag = (bits ^ sign).astype(np.int64) + k
    mag = np.clip(mag, 0, None).astype(u)
    return (mag | sign).view(x.dtype)


@st.composite
def targeted(draw, name: str, dtype: np.dtype):
    """One value of ``dtype`` (0-d array) drawn to hit the weak spots of ``name``'s codec."""
    mags = GRIDS[name][0]
    kind = draw(st.sampled_from(["grid", "mid", "mid", "threshold", "special", "bits", "uniform"]))
    if kind == "grid":
        v = draw(st.sampled_from(mags.tolist()))
    elif kind == "mid":
        i = draw(st.integers(0, len(mags) - 2))
        v = (mags[i] + mags[i + 1]) / 2
    elif kind == "threshold":
        v = draw(st.sampled_from([_threshold(name), mags[-1], 2 * mags[-1]]))
    elif kind == "special":
        fi = ml_dtypes.finfo(dtype)
        v = draw(st.sampled_from([0.0, np.inf, np.nan, float(fi.smallest_subnormal),
                                  float(fi.smallest_normal), float(fi.max)]))
    elif kind == "uniform":
        v = draw(st.floats(0, 2 * _threshold(name), allow_nan=False))
    if kind == "bits":
        raw = draw(st.integers(0, (1 << (8 * dtype.itemsize)) - 1))
        x = np.array(raw, dtype=UINT[dtype.itemsize]).view(dtype)
    else:
        with np.errstate(over="ignore"):
            x = np.array(v, dtype=np.float64).astype(dtype)
        x = _nudge(x.reshape(1), draw(st.sampled_from([0, 0, -1, 1, -2, 2])))[0]
        if draw(st.booleans()):
            x = -x
    return np.asarray(x, dtype=dtype)


def targeted_arrays(name: str, dtype: np.dtype, max_size: int = 24):
    return st.lists(targeted(name, dtype), min_size=1, max_size=max_size).map(
        lambda xs: np.stack(xs).astype(dtype))


def f64(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return x.astype(np.float64)


def ml_cast(x: np.ndarray, name: str) -> np.ndarray:
    f = FORMATS[name]
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(getattr(ml_dtypes, f.ml_dtypes_name)).view(np.uint8) & np.uint8(f.num_codes - 1)


def odd_to_f32(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 with round-to-odd. ml_dtypes and torch narrow float64 to float32 first and
    so round twice (tests/test_formats.py pins a case); narrowing with round-to-odd instead makes
    their RNE cast of the result a correct single rounding of x, because float32 keeps at least two
    more significand bits than any target here (Boldo & Melquiond, "Emulation of FMA and correctly
    rounded sums: proved algorithms using rounding to odd", 2008)."""
    with np.errstate(over="ignore", invalid="ignore"):
        t = x.astype(np.float32)
        t64 = t.astype(np.float64)
    inexact = (t64 != x) & np.isfinite(x)
    bits = t.view(np.uint32)
    bits = np.where(inexact & (np.abs(t64) > np.abs(x)), bits - np.uint32(1), bits)  # toward zero
    return np.where(inexact, bits | np.uint32(1), bits).astype(np.uint32).view(np.float32)


# ---- RNE against ml_dtypes ------------------------------------------------------------------
@pytest.mark.parametrize("name", ML_FLOATS)
@given(data=st.data())
def test_rne_matches_ml_dtypes(name, data):
    dtype = DTYPES[data.draw(st.sampled_from(list(DTYPES)), label="dtype")]
    x = data.draw(targeted_arrays(name, dtype), label="x")
    x64 = f64(x)
    if not FORMATS[name].has_nan:  # ml_dtypes writes -0 for NaN; moeref asks for nan_code
        x = x[~np.isnan(x64)]
    if name == "e8m0":  # positive inputs, above ml_dtypes' subnormal quirk (tests/test_formats.py)
        x = np.abs(x)
        x = x[(f64(x) >= 1.5 * 2.0**-127) | np.isnan(f64(x))]
    got = encode(x, name, overflow=ML_OVERFLOW[name])
    ref = ml_cast(odd_to_f32(x) if x.dtype == np.float64 else x, name)
    assert got.tolist() == ref.tolist()


# ---- deterministic modes: the neighbour the definition names --------------------------------------
def _expected(x: np.ndarray, name: str, rounding: str) -> np.ndarray:
    """Oracle straight from the definitions, on the independent grid (float64, finite, in range)."""
    mags, codes = GRIDS[name]
    a = np.abs(x)
    j = np.searchsorted(mags, a, side="left")  # mags[j] >= a (a <= max finite)
    hi = mags[j]
    lo = np.where(hi == a, a, mags[np.maximum(j - 1, 0)])
    neg = np.signbit(x)
    mid = (lo + hi) / 2  # exact: both on a small grid
    # magnitude rule of each mode (True = take hi)
    if rounding == "rtz":
        up = np.zeros(a.shape, bool)
    elif rounding == "ceil":
        up = ~neg
    elif rounding == "floor":
        up = neg
    else:
        tie = a == mid
        if rounding == "ties_toward_zero":
            on_tie = np.zeros(a.shape, bool)
        elif rounding == "ties_away":
            on_tie = np.ones(a.shape, bool)
        elif FORMATS[name].kind == "float" and FORMATS[name].man_bits == 0:
            on_tie = np.ones(a.shape, bool)  # E8M0: significand always 1 (odd): ties go up
        else:  # rne: the neighbour whose code (last significand bit) is even
            hi_code = codes[j]
            on_tie = hi_code % 2 == 0
        up = np.where(tie, on_tie, a > mid)
    m = np.where(a == lo, a, np.where(up, hi, lo))
    return np.where(neg, -m, m), lo, hi


@pytest.mark.parametrize("name", list(FORMATS))
@given(data=st.data())
def test_deterministic_modes_pick_the_defined_neighbour(name, data):
    f = FORMATS[name]
    dtype = DTYPES[data.draw(st.sampled_from(["f32", "bf16", "f64"]), label="dtype")]
    x = data.draw(targeted_arrays(name, dtype, max_size=32), label="x")
    x64 = f64(x)
    keep = np.isfinite(x64) & (np.abs(x64) <= f.max_finite)
    if not f.signed or f.min_value >= 0:
        keep &= x64 >= 0
    if f.specials == "e8m0":
        keep &= x64 >= f.min_normal
    x, x64 = x[keep], x64[keep]
    order = np.argsort(x64, kind="stable")
    for rounding in DETERMINISTIC:
        got = round_to_format(x, name, overflow="saturate", rounding=rounding)
        expect, lo, hi = _expected(x64, name, rounding)
        assert np.array_equal(got, expect), (rounding, x64, got, expect)
        assert ((np.abs(got) == lo) | (np.abs(got) == hi)).all()
        bound = (hi - lo) / (1 if rounding in ("rtz", "ceil", "floor") else 2)
        assert (np.abs(got - x64) <= bound).all()
        assert (np.diff(got[order]) >= 0).all(), "rounding must be monotone in x"
        if rounding in ("rtz", "ceil", "floor"):
            direction = {"rtz": -np.sign(x64), "ceil": 1.0, "floor": -1.0}[rounding]
            assert ((got - x64) * direction >= 0).all()


# ---- stochastic rounding ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["e2m1", "e4m3fn", "e5m2", "e3m2", "e8m0", "int4", "int8"])
@given(data=st.data())
@FEWER
def test_stochastic_rounding_neighbours_unbiased_and_te_formula(name, data):
    f = FORMATS[name]
    dtype = DTYPES[data.draw(st.sampled_from(["f32", "bf16"]), label="dtype")]
    x = data.draw(targeted_arrays(name, dtype, max_size=8), label="x")
    x64 = f64(x)
    keep = np.isfinite(x64) & (np.abs(x64) <= f.max_finite)
    if not f.signed or f.min_value >= 0:
        keep &= x64 >= 0
    if f.specials == "e8m0":
        keep &= x64 >= f.min_normal
    x, x64 = x[keep], x64[keep]
    rbits = np.broadcast_to(np.arange(256, dtype=np.uint8), (x.size, 256))
    xb = np.broadcast_to(x[:, None], (x.size, 256))
    got = round_to_format(xb, name, overflow="saturate", rounding="stochastic", rbits=rbits)
    again = round_to_format(xb, name, overflow="saturate", rounding="stochastic", rbits=rbits)
    assert np.array_equal(got, again)  # deterministic given rbits
    _, lo, hi = _expected(x64, name, "rtz")
    a = np.abs(x64)[:, None]
    step = (hi - lo)[:, None]
    assert ((np.abs(got) == lo[:, None]) | (np.abs(got) == hi[:, None])).all()
    # unbiased: the mean over all 256 rbits values is x up to 2^-8 of the step
    assert (np.abs(got.mean(axis=1) - x64) <= step[:, 0] * 2.0**-8).all()
    # TransformerEngine (reference_nvfp4.py): q = floor((|x| + u*step)/step) * step, u = rbits/256.
    # Exact in float64 for float32/bfloat16 inputs; for x on the grid, step = 0 and q = |x|.
    u = rbits / 256.0
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(step > 0, np.floor((a + u * step) / np.where(step > 0, step, 1)) * step, a)
    assert np.array_equal(np.abs(got), q)
    assert np.array_equal(np.signbit(got) & (got != 0), np.signbit(xb) & (got != 0))


# ---- the float32/16-bit lookup tables agree with the generic float64 path -------------------------
@pytest.mark.parametrize("name", list(FORMATS))
@given(data=st.data())
@FEWEST
def test_table_paths_equal_generic_path(name, data):
    f = FORMATS[name]
    dtype = DTYPES[data.draw(st.sampled_from(["f32", "bf16", "f16"]), label="dtype")]
    x = data.draw(targeted_arrays(name, dtype, max_size=32), label="x")
    x64 = f64(x)
    if not f.signed or f.min_value >= 0:
        x, x64 = np.abs(x), np.abs(x64)
    nan_code = None if f.has_nan else 0
    for rounding in DETERMINISTIC:
        for overflow in ("saturate",) + (("inf_nan",) if f.has_nan else ()):
            ok = np.isfinite(x64) | (overflow == "saturate") | np.isnan(x64)
            if f.specials == "e8m0" and overflow == "inf_nan":
                ok &= (x64 >= 2.0**-126) | ~np.isfinite(x64)  # no underflow error
            a = encode(x[ok], name, overflow=overflow, rounding=rounding, nan_code=nan_code)
            b = encode(x64[ok], name, overflow=overflow, rounding=rounding, nan_code=nan_code)
            assert a.tolist() == b.tolist(), (rounding, overflow)


# ---- packing ---------------------------------------------------------------------------------------
shapes = st.tuples(st.integers(1, 3), st.integers(1, 4)).map(lambda s: (s[0], 8 * s[1]))


@given(shape=shapes, axis=st.sampled_from([0, 1, -1]), seed=st.integers(0, 2**32 - 1))
def test_packing_inverses(shape, axis, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    if codes.shape[axis] % 2 == 0:
        packed = pack_nibbles(codes, axis=axis)
        assert np.array_equal(unpack_nibbles(packed, axis=axis), codes)
        assert np.array_equal(pack_nibbles(unpack_nibbles(packed, axis=axis), axis=axis), packed)
        c = np.moveaxis(codes, axis, -1)
        assert np.array_equal(np.moveaxis(packed, axis, -1), c[..., 0::2] | (c[..., 1::2] << 4))
    if codes.shape[axis] % 8 == 0:
        words = pack_int4_to_int32(codes, axis=axis)
        assert np.array_equal(unpack_int4_from_int32(words, axis=axis), codes)
        c = np.moveaxis(codes, axis, -1).astype(np.uint64)
        w = sum(c[..., j::8] << np.uint64(4 * j) for j in range(8))
        assert np.array_equal(np.moveaxis(words, axis, -1).view(np.uint32), w.astype(np.uint32))
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    assert np.array_equal(pack_nibbles(unpack_nibbles(raw, axis=axis), axis=axis), raw)
