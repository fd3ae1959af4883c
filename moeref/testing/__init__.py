"""Validate your own kernel: assertions against the exact reference under a declared arithmetic, the
reference's inputs exactly as the kernel sees them, drawn cases, reproducers, and mutation scores.

* :func:`assert_moe_close`, :func:`assert_grouped_gemm_close` (:mod:`.asserts`): raise
  :class:`MoEMismatch` with the report; profiles by object or name (``"BF16_OUTPUT"``,
  ``"DEEPGEMM_FP8"``...; the table in docs/test-your-kernel.md).
* :func:`kernel_inputs`, :func:`as_kernel_sees` (:mod:`.inputs`): round once to the kernel's dtypes,
  give the reference and the kernel the same values.
* :func:`moe_cases`, :func:`draw_cases` (:mod:`.cases`): Hypothesis strategy and deterministic draws.
* :func:`save_reproducer`, :func:`load_reproducer`, :func:`replay` (:mod:`.reproducer`).
* :func:`mutation_score` (:mod:`.mutation`): how many of the library's planted faults a user's check
  catches.
* :class:`CheckMix`, :func:`check_case`, :func:`exact_case`, :func:`single_rounding_case` (:mod:`.regime`,
  :mod:`.cases`): the default mix of exact-regime and single-rounding cases checked by equality and general cases
  checked under the profile's bound.
* The pytest plugin (:mod:`.plugin`, entry point ``pytest11``): ``moe_case``, ``moe_profile``,
  ``moe_check``, ``moe_regime`` fixtures, ``--moeref-regime``, ``--moeref-profile``, ``--moeref-thorough``,
  reproducers on failure.

Kernel-signature adapters live in :mod:`moeref.moe.mapping`; operands from a kernel's own tensors in
:mod:`moeref.gemm.from_kernel`. Guide: docs/test-your-kernel.md.
"""
from __future__ import annotations

from .asserts import GEMM_LAYOUTS, MoEMismatch, assert_grouped_gemm_close, assert_moe_close, grouped_gemm_report
from .inputs import KernelInputs, as_kernel_sees, kernel_inputs
from .regime import REGIMES, CheckMix, check_case
from .reproducer import load_reproducer, replay, save_reproducer

__all__ = [
    "CheckMix",
    "GEMM_LAYOUTS",
    "KernelInputs",
    "MoEMismatch",
    "as_kernel_sees",
    "assert_grouped_gemm_close",
    "assert_moe_close",
    "check_case",
    "draw_cases",
    "exact_case",
    "grouped_gemm_report",
    "kernel_inputs",
    "load_reproducer",
    "moe_cases",
    "mutation_score",
    "REGIMES",
    "replay",
    "save_reproducer",
    "single_rounding_case",
]


def __dir__():  # dir() lists the lazy exports too (PEP 562)
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):  # the Hypothesis-backed helpers load on first use (hypothesis is the test extra)
    if name in ("moe_cases", "draw_cases", "exact_case", "single_rounding_case"):
        from . import cases

        return getattr(cases, name)
    if name == "mutation_score":
        from .mutation import mutation_score

        return mutation_score
    raise AttributeError(f"module 'moeref.testing' has no attribute {name!r}")
