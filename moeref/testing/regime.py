"""Which check a drawn case gets: equality on exact-regime cases, the declared profile's bound on general ones.

A bound is sound for every kernel of the declared arithmetic on any data, but at large K it is hundreds of
times wider than an honest kernel's error, so it cannot see a subtle bug (a skipped K block, one halved scale
block, two swapped top-k weights). Equality on exact-regime inputs (:mod:`moeref.regimes`) sees them, for any
kernel, but only on data built so that every conforming kernel gives the reference's bits. The default of the
pytest plugin and of ``moeref check`` is the **mix** (:class:`CheckMix`, ``regime="mixed"``): one run draws
both kinds of cases, so it has the power of equality and the soundness of the bound on general data.

* :data:`REGIMES`: ``"mixed"`` (the default), ``"exact"`` (every case exact-regime, checked by equality) and
  ``"bounds"`` (every case general, checked under the profile).
* :func:`moeref.testing.cases.exact_case`: one drawn layer call in the exact regime (:func:`moeref.regimes.exact_layer`, bf16
  scheme) as a :class:`~moeref.testing.KernelInputs`, ``meta["regime"] == "exact"``.
* :func:`check_case`: equality for an exact-regime case (when the profile's arithmetic is one the regime
  covers: :func:`equality_applies`), else :func:`~moeref.testing.assert_moe_close` under the profile.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["REGIMES", "DEFAULT_REGIME", "CheckMix", "check_case", "equality_applies", "case_regime"]

REGIMES = ("mixed", "exact", "bounds")
"""``mixed``: exact-regime and general cases in one run; ``exact``: exact-regime cases only, equality;
``bounds``: general cases only, the declared profile's bound."""

DEFAULT_REGIME = "mixed"


@dataclass(frozen=True)
class CheckMix:
    """How drawn cases are split between the two checks.

    ``regime``: one of :data:`REGIMES`. ``exact_fraction``: in ``"mixed"``, the share of exact-regime cases
    (default one in two), placed evenly along the cases' ascending token counts so both kinds get small and
    large counts; with two or more cases each kind gets at least one, a single case is general.

    >>> CheckMix().kinds(8)
    ['bounds', 'exact', 'bounds', 'exact', 'bounds', 'exact', 'bounds', 'exact']
    >>> CheckMix("exact").kinds(2), CheckMix("bounds").kinds(2)
    (['exact', 'exact'], ['bounds', 'bounds'])
    """

    regime: str = DEFAULT_REGIME
    exact_fraction: float = 0.5

    def __post_init__(self):
        from .._checks import check_choice

        check_choice(self.regime, REGIMES, "regime")
        f = self.exact_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0:
            raise ValueError(f"exact_fraction must be a number strictly between 0 and 1; got {f!r}")

    @classmethod
    def of(cls, mix) -> "CheckMix":
        """``mix`` itself, or the :class:`CheckMix` of a regime name (``TypeError`` for anything else)."""
        if isinstance(mix, CheckMix):
            return mix
        if isinstance(mix, str):
            return cls(mix)
        raise TypeError(f"mix must be a CheckMix or a regime name ({', '.join(REGIMES)}); got {type(mix).__name__}")

    def kinds(self, n: int) -> list:
        """``"exact"`` or ``"bounds"`` for each of ``n`` cases (in the order the cases are drawn)."""
        if self.regime != "mixed":
            return [self.regime] * n
        if n < 2:
            return ["bounds"] * n
        f = self.exact_fraction
        exact = [int(np.floor((i + 1) * f)) > int(np.floor(i * f)) for i in range(n)]
        if all(exact):
            exact[0] = False
        if not any(exact):
            exact[-1] = True
        return ["exact" if e else "bounds" for e in exact]


def case_regime(case) -> str:
    """``"exact"`` for a case drawn in the exact regime (``meta["regime"]``), else ``"bounds"``."""
    return "exact" if getattr(case, "meta", {}).get("regime") == "exact" else "bounds"


def equality_applies(profile) -> tuple[bool, str]:
    """Whether an exact-regime case is checked by equality under ``profile`` (a Profile or its name), and why
    not. The regime makes every GEMM sum, store and the top-k sum exact in FP32 (or one rounding of an exact
    value); a profile that declares a bf16 top-k sum (``reduce_unit`` above FP32's: ``TORCH_EAGER_BF16``,
    ``VLLM_MOE_SUM_BF16``) rounds partial sums of the top-k sum that the regime leaves exact only in FP32, so
    its exact-regime cases are checked under the profile's bound instead.

    >>> equality_applies("BF16_OUTPUT")[0], equality_applies("TORCH_EAGER_BF16")[0]
    (True, False)
    """
    from ..compare.bounds import U_FP32
    from ..compare.kernel_profiles import get_profile

    p = get_profile(profile)
    if p.reduce_unit > U_FP32:
        return False, (f"profile {p.name} declares a top-k sum rounded to a lower precision (reduce_unit "
                       f"{p.reduce_unit:g}); the exact regime is exact for an FP32 top-k sum only")
    return True, ""


def check_case(output, case, profile, *, label: str = ""):
    """Check ``output`` for the drawn ``case``: by equality when the case is exact-regime
    (:func:`case_regime`) and :func:`equality_applies` to ``profile``, else under ``profile``'s bound
    (:func:`moeref.testing.assert_moe_close`). Raises :class:`~moeref.testing.MoEMismatch` on a mismatch;
    returns the report (an equality report or a :class:`moeref.compare.Report`)."""
    from .asserts import assert_moe_close

    if case_regime(case) == "exact" and equality_applies(profile)[0]:
        return assert_moe_close(output, case, regime="exact", label=label)
    return assert_moe_close(output, case, profile, label=label)
