"""Shared input validation: every public function checks its input here, so errors read alike.

Each helper raises ``TypeError`` for a wrong kind of object or dtype and ``ValueError`` for a wrong
value, naming the argument, what was given and what is accepted.
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "as_float_array",
    "as_int_array",
    "check_choice",
    "check_positive_int",
    "check_ndim",
    "first_bad_index",
]

_FLOAT_KINDS = "f"


def _dtype_name(a) -> str:
    return str(getattr(a, "dtype", type(a).__name__))


def as_float_array(x, name: str = "x") -> np.ndarray:
    """Return ``x`` as a NumPy floating array without copying where possible.

    Accepts NumPy arrays of float16/32/64 or ml_dtypes bfloat16 (and the low-precision ml_dtypes
    floats), torch CPU tensors (through :mod:`moeref._interop`), Python floats and lists of them.
    Integer, boolean and complex input raise ``TypeError``: quantizers never guess what an integer
    means.
    """
    from . import _interop

    x = _interop.to_numpy(x)
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
        if x.dtype.kind in "iub":
            raise TypeError(f"{name} must be floating point; got integer/bool values {x!r:.80}")
    if x.dtype.kind == "c":
        raise TypeError(f"{name} must be real floating point; got complex dtype {x.dtype}")
    if x.dtype.kind in "iub":
        raise TypeError(
            f"{name} must be floating point (float16/float32/float64/bfloat16); got {x.dtype}"
        )
    if x.dtype.kind != "f" and not _is_ml_float(x.dtype):
        raise TypeError(f"{name} must be floating point; got dtype {x.dtype}")
    return x


def _is_ml_float(dtype) -> bool:
    try:
        import ml_dtypes

        return dtype in (
            np.dtype(ml_dtypes.bfloat16),
            np.dtype(ml_dtypes.float8_e4m3fn),
            np.dtype(ml_dtypes.float8_e5m2),
        )
    except Exception:  # pragma: no cover - ml_dtypes is a core dependency
        return False


def as_int_array(x, name: str = "x", dtypes=(np.int32, np.int64)) -> np.ndarray:
    """Return ``x`` as an integer NumPy array whose dtype is one of ``dtypes``.

    torch tensors are converted. Floats raise ``TypeError`` (an id or code that arrives as a float
    is a bug upstream, not something to round).
    """
    from . import _interop

    x = _interop.to_numpy(x)
    x = np.asarray(x)
    allowed = tuple(np.dtype(d) for d in dtypes)
    if x.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}); got {x.dtype}")
    return x


def check_choice(value, choices, name: str):
    """Raise ``ValueError`` unless ``value`` is one of ``choices``; return it."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"unknown {name} {value!r}; accepted: {listed}")
    return value


def check_positive_int(value, name: str, *, allow_zero: bool = False) -> int:
    """Return ``value`` as int, raising unless it is a (non-negative if allow_zero) integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}; got {value}")
    return value


def check_ndim(x: np.ndarray, ndims, name: str) -> None:
    """Raise ``ValueError`` unless ``x.ndim`` is in ``ndims`` (an int or a tuple of ints)."""
    if isinstance(ndims, int):
        ndims = (ndims,)
    if x.ndim not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{name} must have {want} dimension(s); got shape {x.shape}")


def first_bad_index(mask: np.ndarray):
    """Index tuple of the first True in ``mask`` (C order), or None. For error messages."""
    flat = np.flatnonzero(mask.ravel())
    if flat.size == 0:
        return None
    return tuple(int(i) for i in np.unravel_index(flat[0], mask.shape))
