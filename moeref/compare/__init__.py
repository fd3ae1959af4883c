"""Error-bounded comparison: sound per-element bounds from a declared arithmetic (:mod:`.bounds`),
reports with per-token/per-expert violations and conventional metrics (:mod:`.report`), and the
honest variants / planted faults that prove the bounds sound and sensitive (:mod:`.faults`, :mod:`.subtle_faults`), and the
profiles of real kernels (:mod:`.kernel_profiles`).
See docs/error-bounds.md."""
from __future__ import annotations

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
    layer_bound,
    requant_uncertainty,
    store_interval,
)
from .kernel_profiles import (
    CUBLAS_FP8,
    CUBLAS_FP8_FAST_ACCUM,
    CUTLASS_BF16_GROUPED_MM,
    DEEPGEMM_FP8,
    TORCH_EAGER_BF16,
    VLLM_MOE_SUM_BF16,
    get_profile,
    suggest_profile,
)
from .report import Report, compare, conventional_checks, metrics

__all__ = [
    "BF16_OUTPUT",
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
    "requant_uncertainty",
    "suggest_profile",
    "store_interval",
]
