"""Small helpers shared by the layout modules (alignment arithmetic, byte views, argument checks)."""
from __future__ import annotations

import numpy as np

from .. import _interop

__all__ = ["ceil_div", "align", "as_array", "as_byte_codes", "check_min_ndim"]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)


def align(a: int, b: int) -> int:
    """Smallest multiple of ``b`` that is ``>= a`` (DeepGEMM ``align``, TE ``roundup``)."""
    return ceil_div(a, b) * b


def as_array(x, name: str) -> np.ndarray:
    """NumPy array from an array-like or a torch tensor (bit views for bf16/fp8)."""
    x = _interop.to_numpy(x)
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    return x


def check_min_ndim(x: np.ndarray, ndim: int, name: str, shape_doc: str) -> None:
    if x.ndim < ndim:
        raise ValueError(f"{name} must have shape {shape_doc} (at least {ndim} dims); got shape {x.shape}")


def as_byte_codes(x, name: str) -> np.ndarray:
    """View a 1-byte array (uint8, int8, float8_*, float8_e8m0fnu, float4 codes) as uint8.

    Returns the uint8 view (no copy). Anything wider than one byte raises ``TypeError``: scale
    layouts move bytes and never convert values.
    """
    x = as_array(x, name)
    if x.dtype.itemsize != 1 or x.dtype.kind == "b":
        raise TypeError(
            f"{name} must be a 1-byte dtype (uint8, int8, float8_e4m3fn, float8_e8m0fnu, ...); "
            f"got {x.dtype}"
        )
    return x.view(np.uint8)
