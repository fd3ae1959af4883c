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
        wide = _wide(radius, np.abs(value))
        return round_to_dtype(value - wide, dtype), round_to_dtype(value + wide, dtype)


def _wide(radius, mag):
    """The half-width :func:`_store_ends` rounds about a value of magnitude ``mag``: ``radius (1 + 2^-40) + mag
    2^-52`` (every operation rounded to nearest, so nondecreasing in ``radius`` and in ``mag``)."""
    return radius * (1.0 + 2.0**-40) + mag * 2.0**-52


def _abs_range(lo, hi):
    """``(min |v|, max |v|)`` over ``lo <= v <= hi`` (float64, elementwise, NaN where an end is NaN; a zero of either
    sign for the first where the interval holds 0): ``max(0, lo, -hi)`` and ``max(|lo|, |hi|)``."""
    return np.maximum(np.maximum(lo, -hi), 0.0), np.maximum(np.abs(lo), np.abs(hi))


def _store_ends_box(v_lo, v_hi, r_lo, r_hi, dtype: str):
    """``(lo_min, lo_max, hi_min, hi_max)``: the least and greatest of each end of :func:`_store_ends` over every
    ``value`` in ``[v_lo, v_hi]`` and ``radius`` in ``[r_lo, r_hi]`` (float64, elementwise; ``v_lo == v_hi`` gives
    :func:`_store_ends` at ``r_hi`` and ``r_lo`` with their bits; NaN for ``lo_max`` and ``hi_min`` where ``r_lo``
    is not positive, so that no caller takes those ends as known). Every float64 operation of
    :func:`_store_ends` is monotone in each of its operands (rounding to nearest is), and so is the rounding to
    ``dtype``: ``wide`` lies between :func:`_wide` of the least radius and magnitude and of the greatest, and
    ``value - wide`` (``value + wide``) between its values at the corners of ``value`` and ``wide``. A zero end keeps
    its sign over the box: with ``wide > 0`` the computed ``value -+ wide`` is never -0.0, so an end that is the same
    zero at both corners has arguments of one sign between them."""
    from ..moe.pipeline import round_to_dtype

    with np.errstate(over="ignore", invalid="ignore"):
        m_lo, m_hi = _abs_range(v_lo, v_hi)
        r_lo = np.where(r_lo > 0, r_lo, np.nan)
        w_lo, w_hi = _wide(r_lo, m_lo), _wide(r_hi, m_hi)
        return (round_to_dtype(v_lo - w_hi, dtype), round_to_dtype(v_hi - w_lo, dtype),
                round_to_dtype(v_lo + w_lo, dtype), round_to_dtype(v_hi + w_hi, dtype))
