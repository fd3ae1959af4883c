"""The fast paths' device rounding functions equal the moeref codec and the published rules, bit for bit.

Runs everywhere: on a CUDA GPU for real, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set
by conftest.py). The quantizers built on these functions are checked in ``test_fastpath_quant.py``.

* the integer rounding helpers of :mod:`fastpath._triton_rounding` are checked exhaustively (every bf16 bit
  pattern, plus random float32 magnitudes and bit patterns) against :func:`moeref.formats.encode`, and the
  E8M0 rules against oracles written here from DeepGEMM's ``ceil_to_ue8m0`` and torchao's
  ``_f32_to_e8m0_rceil``; the decode helpers on every code against :func:`moeref.formats.decode_table`;
* the FMA-corrected division of the "div" presets (``fastpath.quant._jit_codes._div_exact``) against the
  correctly rounded quotient.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moeref.formats import decode_table, encode  # noqa: E402

from fastpath import _triton_rounding as R  # noqa: E402
from fastpath.quant import _jit_codes as QC  # noqa: E402
from fastpath.testing import device, on_gpu, to_device  # noqa: E402
from rounding_probes import probe_values  # noqa: E402

GPU = on_gpu()
DEV = device()
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # NaN/Inf arithmetic in inputs
if not GPU:
    pytestmark.append(pytest.mark.interp)


# ----------------------------------------------------------------------------- rounding helpers

@triton.jit
def _rounding_kernel(x_ptr, o_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if FMT == 0:
        c = R.encode_e4m3(x, True)
    elif FMT == 1:
        c = R.encode_e4m3(x, False)
    elif FMT == 2:
        c = R.encode_e5m2(x, True)
    elif FMT == 3:
        c = R.encode_e5m2(x, False)
    elif FMT == 4:
        c = R.encode_e2m1(x, 0, 0x8, False)
    elif FMT == 5:
        c = R.encode_e2m1(x, 1, 0x0, False)
    elif FMT == 6:
        c = R.encode_e2m1(x, 2, 0x0, False)
    elif FMT == 7:
        c = R.encode_ue4m3(tl.abs(x))
    elif FMT == 8:
        c = R.e8m0_from_f32(tl.abs(x), R.E8M0_CEIL)
    elif FMT == 9:
        c = R.e8m0_from_f32(tl.abs(x), R.E8M0_RCEIL)
    elif FMT == 10:
        c = R.e8m0_from_f32(tl.abs(x), R.E8M0_RCEIL_SATFINITE)
    else:
        c = R.e8m0_from_f32(tl.abs(x), R.E8M0_FLOOR)
    tl.store(o_ptr + offs, c.to(tl.uint8), mask=m)


def _encode_dev(x32: np.ndarray, fmt: int) -> np.ndarray:
    xt = to_device(x32)
    out = torch.empty(x32.shape, dtype=torch.uint8, device=DEV)
    n = x32.size
    block = 65536 if not GPU else 1024
    _rounding_kernel[(triton.cdiv(n, block),)](xt, out, n, FMT=fmt, BLOCK=block)
    return out.cpu().numpy()


def _ceil_to_ue8m0_oracle(v: np.ndarray) -> np.ndarray:
    """DeepGEMM deep_gemm/utils/math.py ceil_to_ue8m0, as a byte: exp + (mantissa != 0), clamp [1, 254]."""
    b = np.abs(v).astype(np.float32).view(np.uint32).astype(np.int64)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0)
    return np.clip(e, 1, 254).astype(np.uint8)


def _rceil_oracle(v: np.ndarray, satfinite: bool) -> np.ndarray:
    """torchao _f32_to_e8m0_rceil / TE float_to_e8m0 (``cvt.rp[.satfinite].ue8m0x2.f32``)."""
    b = np.abs(v).astype(np.float32).view(np.uint32).astype(np.int64)
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    up = np.where(e == 0, m > 0x400000, m != 0)
    if satfinite:
        up &= e != 0xFE
    c = e + up
    if satfinite:
        c = np.where(b == 0x7F800000, 0xFE, c)
        c = np.where(b > 0x7F800000, 0xFF, c)
    else:
        c = np.where(e == 0xFF, 0xFF, c)
    return c.astype(np.uint8)


def test_rounding_helpers_match_codec():
    x = probe_values()
    cases_ = [
        (0, "e4m3fn", "saturate", "rne", None), (1, "e4m3fn", "inf_nan", "rne", None),
        (2, "e5m2", "saturate", "rne", None), (3, "e5m2", "inf_nan", "rne", None),
        (4, "e2m1", "saturate", "rne", 0x8), (5, "e2m1", "saturate", "ties_toward_zero", 0x0),
        (6, "e2m1", "saturate", "ties_away", 0x0),
    ]
    for fmt, name, ov, rd, nc in cases_:
        got = _encode_dev(x, fmt)
        want = encode(x, name, overflow=ov, rounding=rd, nan_code=nc)
        bad = got != want
        assert not bad.any(), (name, ov, rd, x[bad][:5], got[bad][:5], want[bad][:5])
    got = _encode_dev(x, 7)
    assert np.array_equal(got, encode(np.abs(x), "ue4m3", overflow="saturate"))


def test_e8m0_helpers_match_oracles():
    x = probe_values()
    assert np.array_equal(_encode_dev(x, 8), _ceil_to_ue8m0_oracle(x))
    assert np.array_equal(_encode_dev(x, 9), _rceil_oracle(x, False))
    assert np.array_equal(_encode_dev(x, 10), _rceil_oracle(x, True))
    b = np.abs(x).view(np.uint32)
    assert np.array_equal(_encode_dev(x, 11), ((b >> 23) & 0xFF).astype(np.uint8))


def test_e8m0_known_values():
    # hand-derived: 1.0 -> 127 in every rule; 1.5 -> ceil 128, floor 127; 0 -> ceil clamps to 1
    v = np.array([1.0, 1.5, 0.0, 2.0 ** -127, 7.0e-39, np.inf], np.float32)  # 7e-39 > 2^-127
    assert _encode_dev(v, 8).tolist() == [127, 128, 1, 1, 1, 254]
    assert _encode_dev(v, 9).tolist() == [127, 128, 0, 0, 1, 255]
    assert _encode_dev(v, 10).tolist() == [127, 128, 0, 0, 1, 254]
    assert _encode_dev(v, 11).tolist() == [127, 127, 0, 0, 0, 255]


@triton.jit
def _decode_kernel(c_ptr, o_ptr, FMT: tl.constexpr):
    c = tl.load(c_ptr + tl.arange(0, 256)).to(tl.uint32)
    if FMT == 0:
        v = R.decode_minifloat(c, 4, 3, 7, True, 1)
    elif FMT == 1:
        v = R.decode_minifloat(c, 5, 2, 15, True, 2)
    elif FMT == 2:
        v = R.decode_minifloat(c & 0xF, 2, 1, 1, True, 0)
    else:
        v = R.e8m0_to_f32(c)
    tl.store(o_ptr + tl.arange(0, 256), v)


def test_decode_helper_every_code():
    codes = to_device(np.arange(256, dtype=np.uint8))
    for fmt, name in [(0, "e4m3fn"), (1, "e5m2"), (2, "e2m1"), (3, "e8m0")]:
        out = torch.empty(256, dtype=torch.float32, device=DEV)
        _decode_kernel[(1,)](codes, out, FMT=fmt)
        got = out.cpu().numpy()
        tab = decode_table(name)
        want = (tab[np.arange(256) & 0xF] if name == "e2m1" else tab).astype(np.float32)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (name, np.flatnonzero(~same)[:5])


# ----------------------------------------------------------------------------------------------
# The FMA-corrected division the "div" presets use (fastpath.quant._jit_codes._div_exact)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _div_exact_kernel(x_ptr, s_ptr, o_ptr, N: tl.constexpr, DIV: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, QC._div_exact(tl.load(x_ptr + i), tl.load(s_ptr + i), DIV, False))


def test_div_exact_is_the_correctly_rounded_quotient():
    """``_div_exact`` (reciprocal + two FMA corrections, Markstein) equals RN(x / s) wherever its
    window holds (|s| in [2^-32, 2^33), |x/s| in [2^-32, 2^32]), on random pairs and on near-ties
    x = q (1 + 2^-24) s. The float64 quotient rounded to float32 is the correctly rounded float32
    quotient (53 >= 2*24 + 2: double rounding is innocuous for division)."""
    import os

    n = 1 << 16 if on_gpu() else 1 << 12
    div = 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1
    rng = np.random.default_rng(5)
    mismatches = 0
    for _ in range(8 if on_gpu() else 2):
        s_exp = rng.integers(127 - 32, 127 + 32, n, dtype=np.uint32)
        s_man = rng.integers(0, 1 << 23, n, dtype=np.uint32)
        s_man[: n // 8] = 0x7FFFFF
        s = ((s_exp << 23) | s_man).view(np.float32)
        q_exp = rng.integers(127 - 31, 127 + 31, n, dtype=np.uint32)
        q = ((q_exp << 23) | rng.integers(0, 1 << 23, n, dtype=np.uint32)).view(np.float32)
        x = (q.astype(np.float64) * (1 + 2.0**-24) * s.astype(np.float64)).astype(np.float32)
        half = n // 2
        x[half:] = ((rng.integers(127 - 40, 127 + 40, n - half, dtype=np.uint32) << 23)
                    | rng.integers(0, 1 << 23, n - half, dtype=np.uint32)).view(np.float32)
        x = np.where(rng.random(n) < 0.5, -x, x).astype(np.float32)
        out = torch.empty(n, dtype=torch.float32, device=device())
        _div_exact_kernel[(1,)](to_device(x), to_device(s), out, N=n, DIV=div)
        want = (x.astype(np.float64) / s.astype(np.float64)).astype(np.float32)
        a = np.abs(want)
        window = (a >= 2.0**-31) & (a <= 2.0**31)
        got = out.cpu().numpy()
        mismatches += int((got[window].view(np.uint32) != want[window].view(np.uint32)).sum())
        assert window.mean() > 0.5
    assert mismatches == 0
