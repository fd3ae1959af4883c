"""Single-rounding regimes: exact sums that the declared store must round, so that the faults an exact regime
cannot see become visible by equality.

On the exact regimes of :mod:`moeref.regimes.layer` a bf16 accumulator is exact (small integer sums) and a
round-toward-zero store is exact (exact values), so neither shows. :func:`rounding_gemm` makes GEMM inputs
that stay exact in FP32 (in any order: :func:`moeref.regimes.in_exact_regime` accepts them under ``"fp32"``)
but whose sums need 12 to 13 significant bits:

* every sum lies in ``[2^11, 2^13)`` with quantum 1, so the bf16 store (8 bits) discards 4 or 5 bits: a
  round-toward-zero store differs from round-to-nearest-even wherever RNE rounds up (about half of the
  outputs), and a bf16 (8-bit) or fp16 (11-bit) accumulator loses the small terms once the running sum
  passes ``2^11`` (a one-store-vs-two difference shows the same way: storing a partial result in bf16 and
  adding to it is a second rounding);
* ``ties=True``: every sum is exactly a bf16 midpoint (``4096 + 16 + 32 i``), so RNE, round-half-away
  and round-toward-zero stores all differ somewhere, while every FP32 accumulation order gives the same
  exact value and every RNE store the same bits.

The construction: column 0 is ``64 x 64 = 4096`` for every output; ``ties=False`` adds small random integer
terms (``|a|, |w| <= 4`` over ``k - 1 <= 127`` columns, at most 2032 in magnitude); ``ties=True`` adds one
term ``1 x (16 + 32 i)``, ``i`` in 0..3.
"""
from __future__ import annotations

import numpy as np

from .._checks import check_positive_int

__all__ = ["rounding_gemm", "round_toward_zero_bf16", "round_half_away_bf16"]


def rounding_gemm(m: int, n: int, k: int, *, ties: bool = False, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """``(a [m, k], w [n, k])`` float32 (bf16-exact) whose products ``a @ w.T`` are exact in FP32 and need
    a rounding at a bf16 store (module docstring). ``k`` in 2..128.

    >>> a, w = rounding_gemm(2, 3, 2, ties=True)
    >>> (a.astype(np.float64) @ w.T.astype(np.float64)).tolist()[0][:1][0] in (4112.0, 4144.0, 4176.0, 4208.0)
    True
    """
    m = check_positive_int(m, "m")
    n = check_positive_int(n, "n")
    k = check_positive_int(k, "k")
    if not 2 <= k <= 128:
        raise ValueError(f"k must be in 2..128 (sums stay in [2^11, 2^13)); got {k}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    a = np.zeros((m, k))
    w = np.zeros((n, k))
    a[:, 0] = 64.0
    w[:, 0] = 64.0
    if ties:
        a[:, 1] = 1.0
        w[:, 1] = 16.0 + 32.0 * rng.integers(0, 4, size=n)
    else:
        a[:, 1:] = rng.integers(-4, 5, size=(m, k - 1))
        w[:, 1:] = rng.integers(-4, 5, size=(n, k - 1))
    return a.astype(np.float32), w.astype(np.float32)


def round_toward_zero_bf16(x) -> np.ndarray:
    """float64 values of ``x`` (float32-exact) rounded toward zero to bf16: the low 16 bits of the FP32
    pattern cut (a truncating store, the fault model)."""
    f = np.asarray(x, dtype=np.float32)
    return (f.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)


def round_half_away_bf16(x) -> np.ndarray:
    """float64 values of ``x`` (float32-exact) rounded to nearest bf16, ties away from zero."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x8000) & 0xFFFF0000).astype(np.uint32)
    return r.view(np.float32).astype(np.float64)
