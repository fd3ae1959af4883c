"""Declared stores as intervals (stage 2 of :mod:`moeref.compare.bounds`): :func:`store_interval`, its ends."""
from __future__ import annotations

import numpy as np

STORE_DTYPES = ("bfloat16", "float16", "float32")
"""Dtypes a :class:`~moeref.compare.bounds.Profile` can declare for a replayed store (round to nearest-even)."""


def store_interval(value, radius, dtype: str | None, unit: float = 0.0):
    """One declared store, as an interval: ``(center, radius, may_flip)``.

    ``value``: float64 array, the center of what the kernel holds before the store; ``radius``: float64
    (same shape, >= 0), the bound on the kernel's deviation from it; ``dtype``: one of
    :data:`STORE_DTYPES` (the kernel rounds to nearest-even in it) or None (the store is bounded by
    ``unit (|value| + radius)`` instead and the center stays ``value``).

    Round to nearest is monotone, so the stored ``rnd(v~)`` for ``|v~ - value| <= radius`` lies in
    ``[rnd(value - radius), rnd(value + radius)]``; the result is that interval as its midpoint and
    half-width. Where both ends round alike the radius is exactly 0 (the stored value is known); where
    they straddle a rounding boundary the interval is one ulp of ``dtype`` wide (more for a wide
    input) and ``may_flip`` is set. The rounding is the float64 -> ``dtype`` cast of
    :func:`moeref.moe.round_to_dtype` (ml_dtypes rounds through float32 first: on an FP32 value, as a
    kernel holds it, that is the kernel's rounding; on a float64 value it is still monotone, which is all
    the interval needs). The ends are widened by ``2^-40`` relative for the float64 ``value -+ radius``.

    >>> v = np.array([1.0 + 2**-8 + 2**-12, 1.0 + 2**-9])    # bf16 ulp at 1: 2^-7, tie at 1 + 2^-8
    >>> c, r, f = store_interval(v, np.array([2**-11, 2**-30]), "bfloat16")
    >>> ((c - 1) * 2**8).tolist(), (r * 2**8).tolist(), f.tolist()  # the first straddles, the second is known
    ([1.0, 0.0], [1.0, 0.0], [True, False])
    """
    value = np.asarray(value, dtype=np.float64)
    radius = np.asarray(radius, dtype=np.float64)
    if dtype is None:
        return value, radius + unit * (np.abs(value) + radius), np.zeros(value.shape, dtype=bool)
    if dtype not in STORE_DTYPES:
        raise ValueError(f"dtype must be None or one of {', '.join(STORE_DTYPES)}; got {dtype!r}")
    lo, hi = _store_ends(value, radius, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        center = 0.5 * lo + 0.5 * hi        # exact: both are representable, halving is exact
        half = 0.5 * hi - 0.5 * lo
    bad = ~np.isfinite(half) & np.isfinite(value)
    center = np.where(bad, value, center)
    half = np.where(bad, np.inf, half)
    return center, half, lo != hi


def _store_ends(value, radius, dtype: str):
    """The two ends :func:`store_interval` rounds for a store to ``dtype`` (one of :data:`STORE_DTYPES`):
    ``(rnd(value - wide), rnd(value + wide))``, float64, ``wide`` the radius widened for the float64 evaluation; the
    first nonincreasing and the second nondecreasing in ``radius``."""
    from ..moe.pipeline import round_to_dtype

    with np.errstate(over="ignore", invalid="ignore"):
        wide = radius * (1.0 + 2.0**-40) + np.abs(value) * 2.0**-52
        return round_to_dtype(value - wide, dtype), round_to_dtype(value + wide, dtype)
