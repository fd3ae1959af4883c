"""The device bound's re-quantization stage (:mod:`moeref.compare.device.requant`) against the NumPy stage:
the quantizer's codes and scales (:func:`moeref.quant.quantize` of the float64 center) and
:func:`moeref.compare.stage_bounds.requant_uncertainty`, bit for bit; and :func:`round_float_rne` against
the codec's ``round_to_format``. The oracle is the host code path (the specification); CPU tensors here, CUDA
tensors on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fastpath.testing import device  # noqa: E402
from moeref.compare.device.requant import device_requant, device_requant_unavailable, round_float_rne  # noqa: E402
from moeref.compare.stage_bounds import requant_uncertainty  # noqa: E402
from moeref.formats import FORMATS, round_to_format  # noqa: E402
from moeref.quant import fp8_block, fp8_group, fp8_per_token, mxfp4, nvfp4, quantize  # noqa: E402

DEV = device()
SCHEMES = {
    "fp8 1x128": lambda: fp8_group(),
    "fp8 1x32 e5m2": lambda: fp8_group(32, element="e5m2"),
    "fp8 1x64 ue8m0": lambda: fp8_group(64, "ue8m0", "deepgemm"),
    "fp8 per token vllm": lambda: fp8_per_token(preset="vllm"),
    "fp8 2x64 block te": lambda: fp8_block((2, 64), preset="te_fp8_block"),
}


def _x(seed: int, r: int, n: int, zeros: bool):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((r, n)) * np.exp2(rng.integers(-30, 12, (r, 1)))
    x = x.astype(np.float32).astype(np.float64)
    if zeros:
        x[:, ::7] = 0.0
        x[0] = 0.0                      # an all-zero block
        x[-1, :3] = [-1e-30, 1e-30, -0.0]
    dx = np.abs(x) * np.exp2(rng.integers(-12, -2, (r, n))) + np.exp2(rng.integers(-40, -10, (r, n)))
    return x, dx


@settings(deadline=None, max_examples=40)
@given(st.sampled_from(sorted(SCHEMES)), st.integers(1, 5), st.sampled_from([64, 200, 256]), st.booleans(),
       st.integers(0, 2**16))
def test_device_requant_equals_the_host_stage(name, r, n, zeros, seed):
    scheme = SCHEMES[name]()
    assert device_requant_unavailable(scheme) is None
    x, dx = _x(seed, r, n, zeros)
    qt = quantize(x, scheme)
    unc, flips = requant_uncertainty(x, dx, scheme, qt)
    got = device_requant(torch.as_tensor(x, device=DEV), torch.as_tensor(dx, device=DEV), scheme)
    assert got is not None
    op, d_unc, d_flips = got
    codes = qt.codes.reshape(r, n)
    assert np.array_equal(op.codes.cpu().numpy(), codes), f"{name}: codes differ"
    assert np.array_equal(op.scales.cpu().numpy(), qt.scale_values()), f"{name}: scales differ"
    assert tuple(op.block) == tuple(qt.block_shape)
    assert np.array_equal(d_unc.cpu().numpy(), unc), (
        f"{name}: uncertainty differs in {np.count_nonzero(d_unc.cpu().numpy() != unc)} elements")
    assert int(d_flips) == flips


@pytest.mark.parametrize("el", ["e4m3fn", "e5m2", "e2m1", "e3m2"])
def test_round_float_rne_equals_round_to_format(el):
    """Every binade of the format, ties (midpoints), subnormals, overflow past max and +-0."""
    fmt = FORMATS[el]
    m = fmt.max_finite
    rng = np.random.default_rng(1)
    v = np.concatenate([rng.standard_normal(4000) * np.exp2(rng.integers(-20, 12, 4000)),
                        np.arange(-4 * m, 4 * m, m / 512.0), [0.0, -0.0, 2 * m, -3 * m, np.inf, -np.inf]])
    ref = round_to_format(v, fmt, overflow="saturate", rounding="rne")
    got = round_float_rne(torch.as_tensor(v, device=DEV), fmt).cpu().numpy()
    assert np.array_equal(ref, got)
    assert np.array_equal(np.signbit(ref), np.signbit(got))


@pytest.mark.parametrize("scheme, why", [(mxfp4(), "torch FP8"), (nvfp4(), "family"),
                                         (fp8_group(preset="te_mxfp8"), "NaN-ignoring"),
                                         (fp8_group(preset="microxcaling"), "rounding")])
def test_device_requant_names_what_it_does_not_run(scheme, why):
    assert why in (device_requant_unavailable(scheme) or "")
