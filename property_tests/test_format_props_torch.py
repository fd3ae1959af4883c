"""RNE encode (moeref.formats.encode) equals torch's FP8 casts bit for bit: torch >= 2.13's
saturating E4M3FN and the never-saturating E5M2, on float32, bfloat16, float16 and float64 input
drawn by test_format_props.targeted (grid points, midpoints and their neighbours, the overflow
threshold, subnormals, signed zeros, Inf, NaN). The torch part of the codec suite, kept apart so
that test_format_props.py runs without torch.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

from moeref.formats import encode, round_to_format

torch = pytest.importorskip("torch")
from moeref._interop import torch_e4m3_cast_saturates  # noqa: E402
from property_tests.test_format_props import DTYPES, f64, odd_to_f32, targeted_arrays  # noqa: E402

# torch >= 2.13 saturates E4M3FN casts (PR #178817); older torch (2.11 on the GPU machine) gives NaN
TORCH_E4M3_OVERFLOW = "saturate" if torch_e4m3_cast_saturates() else "inf_nan"


def torch_cast(x: np.ndarray, torch_name: str) -> np.ndarray:
    if x.dtype == np.dtype(ml_dtypes.bfloat16):
        t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(getattr(torch, torch_name)).view(torch.uint8).numpy()


@pytest.mark.parametrize("name, torch_name, overflow", [
    ("e4m3fn", "float8_e4m3fn", TORCH_E4M3_OVERFLOW),  # torch >= 2.13 saturates E4M3FN (PR #178817)
    ("e5m2", "float8_e5m2", "inf_nan"),       # never saturates
])
@given(data=st.data())
def test_rne_matches_torch(name, torch_name, overflow, data):
    dtype = DTYPES[data.draw(st.sampled_from(list(DTYPES)), label="dtype")]
    x = data.draw(targeted_arrays(name, dtype), label="x")
    nan = np.isnan(f64(x))
    got = encode(x, name, overflow=overflow)
    ref = torch_cast(odd_to_f32(x) if x.dtype == np.float64 else x, torch_name)
    assert got[~nan].tolist() == ref[~nan].tolist()
    assert np.isnan(round_to_format(x[nan], name, overflow=overflow)).all()
