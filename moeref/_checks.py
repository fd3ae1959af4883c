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
    "check_token_rows",
    "first_bad_index",
    "shape_of",
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


def shape_of(x) -> tuple | None:
    """``x``'s shape as a tuple of ints (NumPy, torch on any device, nested lists), or None for None."""
    if x is None:
        return None
    shape = getattr(x, "shape", None)
    return tuple(int(d) for d in (np.shape(x) if shape is None else shape))


def check_token_rows(hidden, topk_weights, topk_ids, *, names=("hidden", "topk_weights", "topk_ids")) -> tuple:
    """Raise ``ValueError`` unless one layer call's per-token arrays agree; return ``(M, top_k)``.

    ``hidden [M, K]``, ``topk_weights [M, k]`` and ``topk_ids [M, k]`` (arrays, tensors on any device, or
    shapes as tuples; ``None`` for one not given): one row per token in each, so a routing row without a
    token (or a token without a routing row) is an error, never ignored; the same ``k`` in both routing
    arrays. ``names``: how the message calls the three.

    >>> check_token_rows((11, 64), (12, 2), (12, 2))
    Traceback (most recent call last):
    ...
    ValueError: hidden has 11 rows (shape (11, 64)) but topk_weights has 12 (shape (12, 2)): hidden, topk_weights and topk_ids need one row per token
    """
    shapes = [s if isinstance(s, tuple) or s is None else shape_of(s) for s in (hidden, topk_weights, topk_ids)]
    for s, name, want in zip(shapes, names, ("[M, K]", "[M, top_k]", "[M, top_k]")):
        if s is not None and len(s) != 2:
            raise ValueError(f"{name} must be 2-D {want}; got shape {s}")
    given = [(s, n) for s, n in zip(shapes, names) if s is not None]
    if not given:
        raise ValueError(f"give at least one of {', '.join(names)}")
    (s0, n0), rows = given[0], given[0][0][0]
    for s, n in given[1:]:
        if s[0] != rows:
            raise ValueError(f"{n0} has {rows} rows (shape {s0}) but {n} has {s[0]} (shape {s}): "
                             f"{', '.join(names[:-1])} and {names[-1]} need one row per token")
    w, ids = shapes[1], shapes[2]
    if w is not None and ids is not None and w[1] != ids[1]:
        raise ValueError(f"{names[1]} has top_k={w[1]} (shape {w}) but {names[2]} has top_k={ids[1]} "
                         f"(shape {ids}): both must be [M, top_k] with the same top_k")
    top_k = ids[1] if ids is not None else (w[1] if w is not None else None)
    return rows, top_k


def first_bad_index(mask: np.ndarray):
    """Index tuple of the first True in ``mask`` (C order), or None. For error messages."""
    flat = np.flatnonzero(mask.ravel())
    if flat.size == 0:
        return None
    return tuple(int(i) for i in np.unravel_index(flat[0], mask.shape))
