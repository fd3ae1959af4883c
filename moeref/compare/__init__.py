"""Error-bounded comparison: sound per-element bounds from a declared arithmetic (:mod:`.bounds`),
reports with per-token/per-expert violations and conventional metrics (:mod:`.report`), and the
honest variants / planted faults that prove the bounds sound and sensitive (:mod:`.faults`, :mod:`.subtle_faults`), and the
profiles of real kernels (:mod:`.kernel_profiles`). The same bounds on a device, bit for bit, are the device
engine's (:mod:`moeref.compare.device`, torch and Triton: imported for a device-engine run only).
See docs/error-bounds.md."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from .bounds import (
    BF16_OUTPUT,
    EXACT,
    FP32_ACCUM,
    HOPPER_FP8_DEEPGEMM,
    HOPPER_FP8_DEEPGEMM_DATA,
    DEEPGEMM_FP8_EXACT,
    PROFILES,
    Profile,
    activation_error,
    gamma,
    gemm_coefficient,
    gemm_error_bound,
    requant_uncertainty,
    store_interval,
)
from .kernel_profiles import (
    BF16_OUTPUT_BIAS_AFTER_STORE,
    BF16_OUTPUT_BIAS_INIT,
    DECISION_TABLE,
    Arithmetic,
    CUBLAS_FP8,
    CUBLAS_FP8_FAST_ACCUM,
    CUTLASS_BF16_GROUPED_MM,
    DEEPGEMM_FP8,
    TORCH_EAGER_BF16,
    VLLM_MOE_SUM_BF16,
    get_profile,
    profile_for,
    suggest_profile,
)
from .report import Report, compare, conventional_checks, layer_bound, metrics

__all__ = [
    "Arithmetic",
    "BF16_OUTPUT",
    "BF16_OUTPUT_BIAS_AFTER_STORE",
    "BF16_OUTPUT_BIAS_INIT",
    "DECISION_TABLE",
    "CUBLAS_FP8",
    "CUBLAS_FP8_FAST_ACCUM",
    "CUTLASS_BF16_GROUPED_MM",
    "DEEPGEMM_FP8",
    "EXACT",
    "FP32_ACCUM",
    "HOPPER_FP8_DEEPGEMM",
    "HOPPER_FP8_DEEPGEMM_DATA",
    "DEEPGEMM_FP8_EXACT",
    "PROFILES",
    "Profile",
    "Report",
    "TORCH_EAGER_BF16",
    "VLLM_MOE_SUM_BF16",
    "activation_error",
    "compare",
    "conventional_checks",
    "gamma",
    "gemm_coefficient",
    "gemm_error_bound",
    "get_profile",
    "layer_bound",
    "metrics",
    "profile_for",
    "requant_uncertainty",
    "suggest_profile",
    "store_interval",
]

_MOVED = {f"{__name__}.{old}": f"{__name__}.device.{new}" for old, new in (
    ("device_layer", "layer"), ("device_bounds", "bounds"), ("device_adder", "adder"), ("device_emulated", "emulated"),
    ("device_requant", "requant"))}
"""Old paths of the device engine's modules (moved to :mod:`moeref.compare.device`) -> their modules."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path of :data:`_MOVED` as the moved module itself, with a DeprecationWarning."""

    _own: dict = {}  # the moved modules' own spec and loader, put back once the alias is imported

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} is deprecated: the device engine moved to moeref.compare.device; import "
                      f"{_MOVED[spec.name]}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(_MOVED[spec.name])
        self._own[module.__name__] = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module):
        # the import system has just set the alias's spec on the moved module: give it back its own, so that
        # its relative imports keep a consistent __package__ / __spec__.parent
        module.__spec__, module.__loader__ = self._own[module.__name__]


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())

