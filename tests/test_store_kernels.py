""":func:`moeref.compare.device._store_kernels.store_interval_t` (one Triton pass) is
:func:`moeref.compare.device.layer.store_interval_torch` bit for bit: ``center`` and ``half`` compared as
int64 bits (NaN payloads and signs included on the CPU; on a GPU NaN against NaN), ``flipped`` element for
element, for every dtype the torch function accepts (and its aliases), the same errors for the others. Data: seeded random values of every
magnitude, random bit patterns (hypothesis), and a grid of hand-picked values x radii: +-0, float64
subnormals, the float32/bf16/f16 rounding midpoints (ties: each one an endpoint, asserted), the largest finite
values and the overflow midpoints, +-inf, NaNs of several payloads, radius 0 / huge / inf / negative.
CPU: the kernel under the Triton interpreter against torch on the CPU; GPU: against torch on the GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from fastpath.testing import device  # noqa: E402
from moeref.compare.device._store_kernels import store_interval_t  # noqa: E402
from moeref.compare.device.layer import store_interval_torch  # noqa: E402

DEV = device()
# NumPy's overflow / invalid-operation warnings from the interpreter's arithmetic: expected here (inf, NaN data)
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
DTYPES = [None, "float64", "float32", "bfloat16", "float16"]
SHAPES = [(1, 1), (3, 7), (63, 97), (2, 1500)]  # none a multiple of the kernel's 1024-element block


def _t(a):
    return torch.as_tensor(np.ascontiguousarray(a, dtype=np.float64), device=DEV)


def _bits(*xs):
    """float64 values from uint64 bit patterns."""
    return np.array(xs, dtype=np.uint64).view(np.float64)


def _same(v, r, dtype, unit=0.0):
    """Assert kernel == torch, bit for bit; returns torch's ``(center, half, flipped)``. On a GPU a NaN compares
    as NaN, whatever its sign and payload: CUDA's float64 arithmetic chooses those its own way (an H100 gave
    -NaN where the kernel gives +NaN for ``|NaN| + 0``, 2026-11-28), and nothing downstream reads them."""
    got = store_interval_t(v, r, dtype, unit)
    want = store_interval_torch(v, r, dtype, unit)
    for name, g, w in zip(("center", "half", "flipped"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        gi, wi = (g.view(torch.int64), w.view(torch.int64)) if g.dtype == torch.float64 else (g, w)
        if g.dtype == torch.float64 and g.device.type == "cuda":
            both_nan = torch.isnan(g) & torch.isnan(w)
            gi, wi = torch.where(both_nan, 0, gi), torch.where(both_nan, 0, wi)
        bad = (gi != wi).nonzero()
        if bad.numel():
            i = tuple(bad[0].tolist())
            raise AssertionError(
                f"{name} differs at {len(bad)} places, dtype={dtype}, first {i}: value={v[i].item()!r} "
                f"({v[i].view(torch.int64).item() & (2**64 - 1):#018x}) radius={r[i].item()!r} "
                f"got {g[i].item()!r} ({gi[i].item() & (2**64 - 1):#x}) want {w[i].item()!r} "
                f"({wi[i].item() & (2**64 - 1):#x})")
    return want


def _grid(values, radii):
    """All pairs: ``value[i, j] = values[i]``, ``radius[i, j] = radii[j]``."""
    values, radii = np.asarray(values, np.float64), np.asarray(radii, np.float64)
    return _t(np.repeat(values[:, None], radii.size, 1)), _t(np.repeat(radii[None, :], values.size, 0))


# formats: (mantissa bits, largest finite, smallest normal exponent)
_FORMATS = {"float32": (23, float(np.finfo(np.float32).max), -126), "bfloat16": (7, float.fromhex("0x1.fep127"), -126),
            "float16": (10, 65504.0, -14)}


def _midpoints(fmt):
    """Midpoints between neighbours of ``fmt`` (ties): normal ones, subnormal ones, and the one above the largest
    finite value (which ties to inf)."""
    p, top, emin = _FORMATS[fmt]
    emax = int(np.floor(np.log2(top)))
    ms = np.array([0, 1, 2, 3, (1 << p) - 2, (1 << p) - 1], np.float64)
    normal = [(1.0 + (ms + 0.5) * 2.0**-p) * 2.0**e for e in (emin, emin + 1, -3, 0, 1, 7, 20, emax) if e <= emax]
    return np.concatenate(normal + [(ms + 0.5) * 2.0**(emin - p)])


def _near(x, k=3):
    """``x`` and its ``k`` float64 neighbours on each side, both signs."""
    x = np.asarray(x, np.float64)
    out = [x]
    lo = hi = x
    for _ in range(k):
        lo, hi = np.nextafter(lo, -np.inf), np.nextafter(hi, np.inf)
        out += [lo, hi]
    out = np.concatenate(out)
    return np.concatenate([out, -out])


NANS = _bits(0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0xFFF7FFFFFFFFFFFF, 0x7FF8DEADBEEF1234,
             0xFFFC000000000ABC)
SPECIAL = np.concatenate([
    [0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 1.5, 3.0, 1e-300, -1e300, 1e308, float.fromhex("0x1.fffffffffffffp1023")],
    _bits(1, 2, 3, 0x000FFFFFFFFFFFFF, 0x0010000000000000),  # float64 subnormals, smallest normal
    -_bits(1, 0x000FFFFFFFFFFFFF),
    NANS,
])
RADII = np.concatenate([[0.0, -0.0, 2.0**-1074, 1e-300, 2.0**-60, 2.0**-30, 1e-9, 2.0**-24, 1e-3, 0.5, 1.0, 3.0,
                         1e30, 1e300, float.fromhex("0x1.fffffffffffffp1023"), np.inf, -1e-9, -1.0, -np.inf],
                        NANS[[0, 1, 4]]])


def _edge_values(fmt):
    mids = _midpoints(fmt)
    p, top, _ = _FORMATS[fmt]
    return np.concatenate([SPECIAL, _near(mids), _near([top, float(np.float32(top)), 2.0**128, 65536.0])])


@pytest.mark.interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_values(dtype):
    rng = np.random.default_rng(7)
    for shape in SHAPES:
        v = rng.standard_normal(shape) * 10.0 ** rng.integers(-40, 40, shape)
        r = np.abs(v) * 10.0 ** rng.integers(-20, 0, shape) * rng.random(shape)
        r[rng.random(shape) < 0.2] = 0.0
        v, r = _t(v), _t(r)
        _, _, flip = _same(v, r, dtype, 1.0 / 3.0)  # a unit float32 would round
        if dtype not in (None, "float64"):
            assert 0 < int(flip.sum()) < flip.numel() or flip.numel() < 30  # both outcomes occur


@pytest.mark.interp
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_grid(dtype, fmt):
    """Every hand-picked value (those of ``fmt`` around its ties and its overflow) against every radius."""
    vals = _edge_values(fmt)
    v, r = _grid(vals, RADII)
    c, h, flip = _same(v, r, dtype, 2.0**-24)
    # the data is meaningful: some endpoints fall exactly on a tie of ``fmt``, and NaN / inf outputs occur
    vn, rn = v.cpu().numpy(), r.cpu().numpy()
    with np.errstate(all="ignore"):
        wide = rn * (1.0 + 2.0**-40) + np.abs(vn) * 2.0**-52
        ends = np.concatenate([(vn - wide).ravel(), (vn + wide).ravel()])
    assert set(_midpoints(fmt)) <= set(np.abs(ends))  # every tie is an endpoint somewhere
    assert torch.isnan(h).any() and torch.isinf(h).any()
    if dtype is not None:
        assert torch.isnan(c).any() and flip.any() and not flip.all()


@pytest.mark.interp
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_overflow_neighbours(dtype):
    """Values around the largest finite value of ``dtype`` and the midpoint above it (which ties to inf), radii
    from 0 to beyond an ulp of ``dtype``: finite and infinite endpoints, flips between them."""
    p, top, _ = _FORMATS[dtype]
    mid = top + 2.0**(int(np.floor(np.log2(top))) - p - 1)
    vals = np.concatenate([_near([top, mid], k=40), np.linspace(top * 0.999, mid * 1.001, 41)])
    v, r = _grid(vals, [0.0, 2.0**-60 * top, np.spacing(top), np.spacing(mid) * 3, top * 2.0**-24, top * 2.0**-9])
    c, h, flip = _same(v, r, dtype)
    assert torch.isinf(h).any() and torch.isfinite(h).any() and flip.any()


@pytest.mark.interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_payloads(dtype):
    """NaN in value, radius or both, of several signs and payloads (signaling included)."""
    vals = np.concatenate([NANS, [0.0, -2.5, np.inf, -np.inf, 1e-310, 7.0]])
    v, r = _grid(vals, np.concatenate([NANS, [0.0, 1.0, np.inf]]))
    c, h, _ = _same(v, r, dtype, 0.25)
    assert torch.isnan(h).any()
    _same(r.t().contiguous(), v.t().contiguous(), dtype, 0.25)


@pytest.mark.interp
@settings(max_examples=25, deadline=None)
@given(bits=hnp.arrays(np.uint64, hnp.array_shapes(min_dims=2, max_dims=2, max_side=40)),
       data=st.data(), dtype=st.sampled_from(DTYPES), unit=st.sampled_from([0.0, 2.0**-24, 1.0 / 3.0, 1e-300]))
def test_random_bits(bits, data, dtype, unit):
    """Any float64 bit patterns (every exponent, NaN payloads) as values; radii random floats or bits."""
    v = bits.view(np.float64)
    r = data.draw(hnp.arrays(np.float64, v.shape, elements=st.floats(width=64)), label="radius")
    _same(_t(v), _t(r), dtype, unit)
    _same(_t(v), _t(np.abs(v) * 2.0**-20), dtype, unit)


@pytest.mark.interp
@pytest.mark.parametrize("alias", ["bf16", "f4", "single", "<f4", np.float32, "half", "e", "double", "f8", "float"])
def test_aliases(alias):
    rng = np.random.default_rng(3)
    v = _t(rng.standard_normal((5, 33)) * 100)
    r = _t(np.abs(rng.standard_normal((5, 33))) * 1e-3)
    _, _, flip = _same(v, r, alias)
    assert flip.dtype == torch.bool


@pytest.mark.interp
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cast_nan_path_on_non_nan_data(dtype, monkeypatch):
    """With no probed NaN image (``NAN_IMG`` off: the roundings' own NaN path), the kernel still equals torch
    on data whose endpoints are never NaN (finite values and radii, overflow included)."""
    import moeref.compare.device._store_kernels as sk

    assert sk._nan_image(DEV, 1) is None  # float64 keeps every NaN: no single image
    monkeypatch.setattr(sk, "_nan_image", lambda device, mode: None)
    sk._consts.cache_clear()
    try:
        vals = _edge_values(dtype)
        vals = vals[np.isfinite(vals)]
        radii = RADII[np.isfinite(RADII)]
        v, r = _grid(vals, radii)
        assert not sk._consts(DEV, 0.0, sk._mode(dtype))[1]
        _, h, flip = _same(v, r, dtype)
        assert torch.isinf(h).any() and flip.any()
    finally:
        sk._consts.cache_clear()


@pytest.mark.parametrize("dtype, exc", [("int8", ValueError), (">f4", ValueError), ("float8_e4m3fn", ValueError),
                                        ("complex64", ValueError), ("no_such_dtype", TypeError)])
def test_unsupported_dtype_same_error(dtype, exc):
    v = _t(np.ones((2, 3)))
    with pytest.raises(exc) as want:
        store_interval_torch(v, v, dtype)
    with pytest.raises(exc) as got:
        store_interval_t(v, v, dtype)
    assert str(got.value) == str(want.value)


@pytest.mark.interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_strided(dtype):
    for shape in [(0, 7), (0, 0), (5, 0)]:
        c, h, f = _same(_t(np.zeros(shape)), _t(np.zeros(shape)), dtype)
        assert c.shape == h.shape == f.shape == shape and f.dtype == torch.bool
    rng = np.random.default_rng(5)
    v = _t(rng.standard_normal((41, 29)) * 1e3).t()  # non-contiguous views
    r = _t(np.abs(rng.standard_normal((41, 29))) * 1e-2).t()
    assert not v.is_contiguous() and not r.is_contiguous()
    c, h, f = _same(v, r, dtype, 2.0**-10)
    if dtype is None:
        got = store_interval_t(v, r, dtype)
        assert got[0] is v  # as the torch function: ``value`` itself
