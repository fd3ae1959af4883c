"""DeepGEMM packed UE8M0 scales: four E8M0 exponent bytes per int32, MN-major, TMA-aligned.

SM100 DeepGEMM kernels (recipe ``(1, 1, 128)`` / ``(1, 128, 128)`` with ``use_ue8m0``) read scales as
``int32[..., mn, ceil(k_groups / 4)]``. Facts pinned here (deepseek-ai/DeepGEMM
``transpose_and_pack_fp32_into_ue8m0`` / ``pack_ue8m0_to_int``, vLLM
``per_token_group_quant_fp8_packed_for_deepgemm``):

* byte ``j`` of word ``i`` (little-endian: bits ``8j .. 8j+7``) is the E8M0 code of K-group
  ``4i + j``; the code of a float32 power of two is its biased exponent ``bits >> 23``;
* K-groups are padded to a multiple of 4 with code ``0x00`` (the value 2^-127);
* the tensor is MN-major: strides ``(1, align(mn, 4))`` in int32 elements; the padding words
  ``mn .. align(mn, 4)`` of every column are zero (the MN-major core of :mod:`.tma`).

DeepGEMM's packer takes ``bits >> 23`` of whatever float32 it is given: a scale that is not an exact
power of two (mantissa bits set) is silently TRUNCATED to the power of two below, ~25% off and
consistent with nothing (sgl-project/sglang#39193; DeepGEMM PR #112). :func:`pack_ue8m0` refuses such
scales instead: requantize the data with a UE8M0 scale first.
"""
from __future__ import annotations

import numpy as np
import ml_dtypes

from .._checks import check_positive_int, first_bad_index
from ..formats.codec import decode
from ._common import ceil_div, as_array, check_min_ndim
from .tma import _mn_major_padded

__all__ = [
    "UE8M0_PER_WORD",
    "pow2_to_ue8m0_codes",
    "ue8m0_codes_to_float32",
    "pack_ue8m0",
    "unpack_ue8m0",
]

UE8M0_PER_WORD = 4
"""K-groups per packed int32 word."""

_E8M0_CODE_DTYPES = (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e8m0fnu))


def pow2_to_ue8m0_codes(scales, name: str = "scales") -> np.ndarray:
    """E8M0 codes (uint8) of exact positive powers of two; anything else raises ``ValueError``.

    ``2^e`` with ``-127 <= e <= 127`` maps to code ``e + 127`` (OCP MX v1.0 E8M0, bias 127; 2^-127 is
    a float32 subnormal and maps to code 0). Refused, naming the first bad index and value: zero,
    negative numbers (sign bit), values with mantissa bits (not powers of two), powers of two
    outside ``[2^-127, 2^127]``, NaN and Inf. Never rounds or truncates (sglang#39193).

    Accepts any floating dtype (float16/32/64, bfloat16); the test is exact in float64.

    >>> import numpy as np
    >>> pow2_to_ue8m0_codes(np.array([1.0, 0.5, 2.0**-127, 2.0**127], np.float32))
    array([127, 126,   0, 254], dtype=uint8)
    >>> pow2_to_ue8m0_codes(np.array([1.0, 0.75]))
    Traceback (most recent call last):
    ...
    ValueError: scales[1] = 0.75 is not an exact positive power of two in [2^-127, 2^127] ...
    """
    x = as_array(scales, name)
    if x.dtype.kind != "f" and x.dtype != np.dtype(ml_dtypes.bfloat16):
        raise TypeError(f"{name} must be floating point (or uint8/float8_e8m0fnu E8M0 codes); got {x.dtype}")
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        mant, exp = np.frexp(x64)  # x = mant * 2**exp, mant in [0.5, 1)
        power = exp - 1
        ok = np.isfinite(x64) & (mant == 0.5) & (power >= -127) & (power <= 127)
    bad = first_bad_index(~ok)
    if bad is not None:
        raise ValueError(
            f"{name}{list(bad)} = {float(x64[bad])!r} is not an exact positive power of two in [2^-127, 2^127] "
            f"(UE8M0 holds only those); packing would truncate it like DeepGEMM's bits>>23 does "
            f"(sglang#39193). Quantize with a UE8M0 scale rule (e.g. ceil_to_ue8m0) and requantize the data."
        )
    return (power + 127).astype(np.uint8)


def ue8m0_codes_to_float32(codes) -> np.ndarray:
    """float32 values of E8M0 codes (:func:`moeref.formats.decode` with ``"e8m0"``): ``2^(code - 127)``; code 0 is 2^-127 (a subnormal, not 0,
    pytorch/ao PR #4725); code 255 is NaN (OCP MX v1.0; sglang PR #25519).

    >>> import numpy as np
    >>> ue8m0_codes_to_float32(np.array([0, 127, 134, 255], np.uint8))
    array([5.877472e-39, 1.000000e+00, 1.280000e+02,          nan], dtype=float32)
    """
    return decode(_as_codes(codes, "codes"), "e8m0", np.float32)


def _as_codes(x, name: str) -> np.ndarray:
    a = as_array(x, name)
    if a.dtype not in _E8M0_CODE_DTYPES:
        raise TypeError(f"{name} must be uint8 or float8_e8m0fnu E8M0 codes; got {a.dtype}")
    return a.view(np.uint8)


def pack_ue8m0(scales) -> np.ndarray:
    """Pack scales ``[..., mn, k_groups]`` into DeepGEMM's ``int32[..., mn, ceil(k_groups/4)]``.

    Args:
        scales: float powers of two (refused otherwise, see :func:`pow2_to_ue8m0_codes`), or E8M0
            codes as uint8 / ``ml_dtypes.float8_e8m0fnu`` (every byte 0..255 accepted as is).
            Leading axes (groups / experts) are kept.

    Returns:
        int32 view ``[..., mn, ceil(k_groups / 4)]`` with element strides ``(1, align(mn, 4))``
        (MN-major); ``word[..., m, i]`` holds the code of group ``4i + j`` in bits ``8j..8j+7``
        (int32 two's complement: a code >= 128 in byte 3 makes the word negative). K padding bytes
        are 0x00, MN padding words are 0. Its ``base`` is the storage
        ``[..., ceil(k_groups/4), align(mn, 4)]`` (:func:`moeref.layouts.mn_major_storage`).

    >>> import numpy as np
    >>> p = pack_ue8m0(np.array([[1.0, 2.0, 0.5, 4.0, 8.0]], np.float32))
    >>> p.shape, [hex(int(w) & 0xFFFFFFFF) for w in p[0]]
    ((1, 2), ['0x817e807f', '0x82'])
    """
    a = as_array(scales, "scales")
    check_min_ndim(a, 2, "scales", "[..., mn, k_groups]")
    codes = _as_codes(a, "scales") if a.dtype in _E8M0_CODE_DTYPES else pow2_to_ue8m0_codes(a)
    *lead, mn, k = codes.shape
    n_words = ceil_div(k, UE8M0_PER_WORD)
    padded = np.zeros((*lead, mn, n_words * UE8M0_PER_WORD), dtype=np.uint32)
    padded[..., :k] = codes
    b = padded.reshape(*lead, mn, n_words, UE8M0_PER_WORD)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return _mn_major_padded(words.view(np.int32))


def unpack_ue8m0(packed, k_groups: int, *, as_codes: bool = False, check_padding: bool = True) -> np.ndarray:
    """Inverse of :func:`pack_ue8m0`: ``int32[..., mn, ceil(k_groups/4)]`` (any strides) -> scales.

    Args:
        packed: int32 or uint32 words ``[..., mn, ceil(k_groups / 4)]``.
        k_groups: logical number of K-groups (the padding is not recoverable from the words).
        as_codes: return the uint8 E8M0 codes instead of float32 values.
        check_padding: raise ``ValueError`` if a K padding byte (groups ``k_groups .. 4*ceil``) is not
            0x00, the documented contract.

    Returns:
        float32 ``[..., mn, k_groups]`` powers of two (code 255 decodes to NaN), or uint8 codes.

    >>> import numpy as np
    >>> s = np.array([[1.0, 2.0, 0.5, 4.0, 8.0]], np.float32)
    >>> unpack_ue8m0(pack_ue8m0(s), 5)
    array([[1. , 2. , 0.5, 4. , 8. ]], dtype=float32)
    """
    a = as_array(packed, "packed")
    if a.dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
        raise TypeError(f"packed must be int32 (or uint32) words; got {a.dtype}")
    check_min_ndim(a, 2, "packed", "[..., mn, ceil(k_groups/4)]")
    k = check_positive_int(k_groups, "k_groups", allow_zero=True)
    n_words = ceil_div(k, UE8M0_PER_WORD)
    if a.shape[-1] != n_words:
        raise ValueError(
            f"packed must have last dimension ceil(k_groups/4) = {n_words} for k_groups={k}; got shape {a.shape}"
        )
    w = a.view(np.uint32)
    shifts = np.arange(UE8M0_PER_WORD, dtype=np.uint32) * 8
    codes = ((w[..., None] >> shifts) & 0xFF).astype(np.uint8)
    codes = codes.reshape(*a.shape[:-1], n_words * UE8M0_PER_WORD)
    if check_padding:
        bad = first_bad_index(codes[..., k:] != 0)
        if bad is not None:
            g = bad[-1] + k
            raise ValueError(
                f"packed{list(bad[:-1])} byte for padding group {g} (word {g // 4}, byte {g % 4}) is "
                f"{int(codes[(*bad[:-1], g)]):#04x}; K padding must be 0x00"
            )
    codes = np.ascontiguousarray(codes[..., :k])
    return codes if as_codes else ue8m0_codes_to_float32(codes)
