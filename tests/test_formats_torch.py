"""Element formats against torch's casts and decodes (the ``torch`` extra): every code decoded,
every 16-bit input encoded, the E8M0 cast, torch tensors in and out, and the two disagreements
pinned in ``tests/test_formats.py`` seen from torch. Skipped as a whole without torch; the core
codec suite (``tests/test_formats.py``) does not need it."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moeref.formats import FORMATS, decode, encode
from test_formats import all_16bit, f64, same_values

torch = pytest.importorskip("torch")
from moeref._interop import torch_e4m3_cast_saturates  # noqa: E402

# torch >= 2.13 saturates E4M3FN casts (PR #178817); older torch (2.11 on the GPU machine) gives NaN
TORCH_E4M3_OVERFLOW = "saturate" if torch_e4m3_cast_saturates() else "inf_nan"
TORCH_FLOATS = [n for n, f in FORMATS.items() if f.kind == "float" and f.torch_name]


def torch_cast(x: np.ndarray, torch_name: str) -> np.ndarray:
    """torch ``.to(dtype)`` of a float16/bfloat16/float32/float64 array, as code bytes."""
    if x.dtype == np.dtype(ml_dtypes.bfloat16):
        t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(x)
    return t.to(getattr(torch, torch_name)).view(torch.uint8).numpy()


@pytest.mark.parametrize("name", TORCH_FLOATS)
def test_decode_every_code_matches_torch(name):
    codes = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(codes).view(getattr(torch, FORMATS[name].torch_name)).to(torch.float64)
    assert same_values(decode(codes, name, np.float64), ref.numpy())


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32], ids=["bf16", "f16", "f32"])
def test_encode_e4m3_matches_torch_cast(dtype):
    """torch >= 2.13 saturates E4M3FN casts (pytorch/pytorch PR #178817): finite overflow and +-Inf
    -> +-448; torch <= 2.12 (the GPU machine's 2.11) gives NaN: moeref's "saturate" and "inf_nan"."""
    x = all_16bit(dtype) if dtype != np.float32 else (
        np.random.default_rng(1).integers(0, 2**32, 1 << 17, dtype=np.uint64).astype(np.uint32)
        .view(np.float32))
    nan = np.isnan(f64(x))
    ref = torch_cast(x, "float8_e4m3fn")
    got = encode(x, "e4m3fn", overflow=TORCH_E4M3_OVERFLOW)
    assert np.array_equal(got[~nan], ref[~nan])
    assert ((got[nan] & 0x7F) == 0x7F).all() and ((ref[nan] & 0x7F) == 0x7F).all()  # NaN either sign


@pytest.mark.parametrize("name", ["e5m2", "e4m3fnuz", "e5m2fnuz"])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])

def test_encode_non_saturating_matches_torch(name, dtype):
    x = all_16bit(dtype)
    nan = np.isnan(f64(x))
    ref = torch_cast(x, FORMATS[name].torch_name)
    got = encode(x, name, overflow="inf_nan")
    assert np.array_equal(got[~nan], ref[~nan])
    assert np.isnan(decode(got[nan], name)).all()


def test_encode_e8m0_matches_torch_on_positive_inputs():
    """torch's E8M0 cast: nearest power of two, ties up; underflow -> 0x00; overflow/Inf/NaN -> 0xFF."""
    x = all_16bit(ml_dtypes.bfloat16)
    x64 = f64(x)
    pos = (x64 >= 1.5 * 2.0**-127) & np.isfinite(x64)  # inf_nan: overflow -> 0xFF like torch
    assert np.array_equal(encode(x[pos], "e8m0", overflow="inf_nan"), torch_cast(x[pos], "float8_e8m0fnu"))
    tiny = (x64 >= 0) & (x64 <= 2.0**-128)  # saturate: 0 and underflow -> 0x00 like torch
    assert np.array_equal(encode(x[tiny], "e8m0", overflow="saturate"), torch_cast(x[tiny], "float8_e8m0fnu"))


def test_encode_torch_tensor_in_torch_out():
    t = torch.tensor([1.0, 465.0], dtype=torch.bfloat16)
    out = encode(t, "e4m3fn", overflow="saturate")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.tolist() == [0x38, 0x7E]


def test_pinned_disagreements_seen_from_torch():
    """torch 2.13 sides of ``test_e8m0_nearest_below_2_pow_minus_126_disagrees_with_ml_dtypes_and_torch``
    and ``test_float64_input_rounds_once_unlike_ml_dtypes_and_torch`` (tests/test_formats.py):
    torch returns 2^-126 (0x01) for x in (2^-127, 1.5 * 2^-127), and narrows float64 to float32
    first (2^-10 + 2^-62 becomes the tie 2^-10, which rounds to even: 0x00)."""
    x = np.array([1.015625, 1.25, 1.484375], np.float32) * np.float32(2.0**-127)
    assert torch_cast(x, "float8_e8m0fnu").tolist() == [1, 1, 1]
    assert encode(x, "e8m0", overflow="inf_nan").tolist() == [0, 0, 0]
    x = np.array([np.nextafter(2.0**-10, 1.0)])
    assert torch_cast(x, "float8_e4m3fn").tolist() == [0x00]
    assert encode(x, "e4m3fn", overflow="inf_nan").tolist() == [0x01]
