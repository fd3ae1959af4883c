"""Which check a drawn case gets: equality on exact-regime and single-rounding cases, the declared profile's bound
on general ones.

A bound is sound for every kernel of the declared arithmetic on any data, but at large K it is hundreds of
times wider than an honest kernel's error, so it cannot see a subtle bug (a skipped K block, one halved scale
block, two swapped top-k weights). Equality on exact-regime inputs (:mod:`moeref.regimes`) sees them, for any
kernel, but only on data built so that every conforming kernel gives the reference's bits. The default of the
pytest plugin and of ``moeref check`` is the **mix** (:class:`CheckMix`, ``regime="mixed"``): one run draws
both kinds of cases, so it has the power of equality and the soundness of the bound on general data. Exact sums
hide two kinds of fault (a store that rounds toward zero, an accumulator narrower than FP32), so the mix also
draws **single-rounding** cases (:func:`moeref.regimes.single_rounding_layer`): every declared store of the
profile, GEMM2's included, rounds an exact value once; they are drawn only where the profile's declared arithmetic
admits one (:func:`moeref.regimes.single_rounding_stores`), else those slots are exact-regime cases that say so.

* :data:`REGIMES`: ``"mixed"`` (the default), ``"exact"`` (every case exact-regime, checked by equality) and
  ``"bounds"`` (every case general, checked under the profile).
* :func:`moeref.testing.cases.exact_case`: one drawn layer call in the exact regime (:func:`moeref.regimes.exact_layer`, bf16
  scheme) as a :class:`~moeref.testing.KernelInputs`, ``meta["regime"] == "exact"``;
  :func:`moeref.testing.cases.single_rounding_case`: the same in the single-rounding regime,
  ``meta["regime"] == "single_rounding"`` (``meta["stores"]``: the declared stores its reference replays).
* :func:`check_case`: equality for an exact-regime case (when the profile's arithmetic is one the regime
  covers: :func:`equality_applies`) and for a single-rounding case (when the profile admits its stores:
  :func:`single_rounding_applies`), else :func:`~moeref.testing.assert_moe_close` under the profile.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["REGIMES", "DEFAULT_REGIME", "CheckMix", "check_case", "equality_applies", "single_rounding_applies",
           "case_regime", "CASE_REGIMES"]

REGIMES = ("mixed", "exact", "bounds")
"""``mixed``: exact-regime and general cases in one run; ``exact``: exact-regime cases only, equality;
``bounds``: general cases only, the declared profile's bound."""

DEFAULT_REGIME = "mixed"

CASE_REGIMES = ("exact", "single_rounding", "bounds")
"""What :meth:`CheckMix.kinds` gives each case: built in the exact regime, in the single-rounding regime, or general."""


@dataclass(frozen=True)
class CheckMix:
    """How drawn cases are split between the checks.

    ``regime``: one of :data:`REGIMES`. In ``"mixed"``: ``exact_fraction``, the share of exact-regime cases
    (default one in four), and ``single_rounding_fraction``, the share of single-rounding cases (default one in
    four; 0 draws none); the rest are general. Equality cases (both kinds) are placed evenly along the cases'
    ascending token counts so every kind gets small and large counts, and alternate between the two kinds in
    proportion; with two or more cases the general and the exact-regime kinds each get at least one, a single
    case is general.

    >>> CheckMix().kinds(8)
    ['bounds', 'exact', 'bounds', 'single_rounding', 'bounds', 'exact', 'bounds', 'single_rounding']
    >>> CheckMix("mixed", 0.5, 0.0).kinds(4), CheckMix("exact").kinds(2), CheckMix("bounds").kinds(2)
    (['bounds', 'exact', 'bounds', 'exact'], ['exact', 'exact'], ['bounds', 'bounds'])
    """

    regime: str = DEFAULT_REGIME
    exact_fraction: float = 0.25
    single_rounding_fraction: float = 0.25

    def __post_init__(self):
        from .._checks import check_choice

        check_choice(self.regime, REGIMES, "regime")
        f, g = self.exact_fraction, self.single_rounding_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0:
            raise ValueError(f"exact_fraction must be a number strictly between 0 and 1; got {f!r}")
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g < 1.0:
            raise ValueError(f"single_rounding_fraction must be a number in [0, 1); got {g!r}")
        if not f + g < 1.0:
            raise ValueError(f"exact_fraction + single_rounding_fraction must be below 1 (general cases keep the "
                             f"bound's soundness); got {f!r} + {g!r}")

    @classmethod
    def of(cls, mix) -> "CheckMix":
        """``mix`` itself, or the :class:`CheckMix` of a regime name (``TypeError`` for anything else)."""
        if isinstance(mix, CheckMix):
            return mix
        if isinstance(mix, str):
            return cls(mix)
        raise TypeError(f"mix must be a CheckMix or a regime name ({', '.join(REGIMES)}); got {type(mix).__name__}")

    def kinds(self, n: int) -> list:
        """One of :data:`CASE_REGIMES` for each of ``n`` cases (in the order the cases are drawn)."""
        if self.regime != "mixed":
            return [self.regime] * n
        if n < 2:
            return ["bounds"] * n
        f = self.exact_fraction + self.single_rounding_fraction
        equal = [int(np.floor((i + 1) * f)) > int(np.floor(i * f)) for i in range(n)]
        if all(equal):
            equal[0] = False
        if not any(equal):
            equal[-1] = True
        out, j = [], 0
        share = self.single_rounding_fraction / f  # of the equality cases
        for e in equal:
            if not e:
                out.append("bounds")
                continue
            sr = int(np.floor((j + 1) * share)) > int(np.floor(j * share))
            out.append("single_rounding" if sr else "exact")
            j += 1
        if "exact" not in out:  # every drawn mix holds an exact-regime case
            out[out.index("single_rounding")] = "exact"
        return out


def case_regime(case) -> str:
    """``"exact"`` or ``"single_rounding"`` for a case drawn in that regime (``meta["regime"]``), else
    ``"bounds"``."""
    r = getattr(case, "meta", {}).get("regime")
    return r if r in ("exact", "single_rounding") else "bounds"


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


def single_rounding_applies(profile, case) -> tuple[bool, str]:
    """Whether the single-rounding ``case`` (``meta["stores"]``, the stores its layer declares) is checked by
    equality under ``profile`` (a Profile or its name), and why not: the profile must admit a single-rounding
    layer (:func:`moeref.regimes.single_rounding_stores`: bf16 GEMM, activation and output stores, an FP32 top-k
    sum, at least 14 accumulator bits) and declare the case's GEMM2 store. A kernel whose arithmetic rounds at
    other points differs from the case's reference by design; its single-rounding cases get its profile's bound.

    >>> from moeref.testing.cases import single_rounding_case
    >>> c = single_rounding_case(4, 64, 32, 4, 2, "uniform", 0)
    >>> single_rounding_applies("BF16_OUTPUT", c)[0], single_rounding_applies("TORCH_EAGER_BF16", c)[0]
    (True, False)
    """
    from ..regimes import single_rounding_stores

    opts, why = single_rounding_stores(profile, "bf16")
    if opts is None:
        return False, why
    stores = dict(getattr(case, "meta", {}).get("stores") or {})
    if stores.get("gemm2_out_dtype") != opts["gemm2_store"]:
        return False, (f"the case declares GEMM2 store {stores.get('gemm2_out_dtype')!r}, the profile "
                       f"{opts['gemm2_store']!r}")
    return True, ""


def check_case(output, case, profile, *, label: str = ""):
    """Check ``output`` for the drawn ``case``: by equality when the case is exact-regime (:func:`case_regime`)
    and :func:`equality_applies` to ``profile``, or single-rounding and :func:`single_rounding_applies` (against
    the reference with the case's declared stores, ``meta["stores"]``), else under ``profile``'s bound
    (:func:`moeref.testing.assert_moe_close`; a single-rounding case whose profile admits none says so in the
    report's label). Raises :class:`~moeref.testing.MoEMismatch` on a mismatch; returns the report (an equality
    report or a :class:`moeref.compare.Report`)."""
    from .asserts import assert_moe_close

    regime = case_regime(case)
    if regime == "exact" and equality_applies(profile)[0]:
        return assert_moe_close(output, case, regime="exact", label=label)
    if regime == "single_rounding":
        ok, why = single_rounding_applies(profile, case)
        if ok:
            return assert_moe_close(output, case.layer_case(**case.meta["stores"]), regime="exact",
                                    label=label or "MoE layer (single-rounding regime)")
        label = f"{label or 'MoE layer'} (single-rounding case under the bound: {why})"
    return assert_moe_close(output, case, profile, label=label)
