"""Error-bounded comparison: sound per-element bounds from a declared arithmetic (:mod:`.bounds`),
reports with per-token/per-expert violations and conventional metrics (:mod:`.report`), and the
honest variants / planted faults that prove the bounds sound and sensitive (:mod:`.faults`).
See docs/error-bounds.md."""
from __future__ import annotations

from .bounds import (
    BF16_OUTPUT,
    EXACT,
    FP32_ACCUM,
    HOPPER_FP8_DEEPGEMM,
    HOPPER_FP8_DEEPGEMM_DATA,
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
from .report import Report, compare, conventional_checks, metrics

__all__ = [
    "BF16_OUTPUT",
    "EXACT",
    "FP32_ACCUM",
    "HOPPER_FP8_DEEPGEMM",
    "HOPPER_FP8_DEEPGEMM_DATA",
    "PROFILES",
    "Profile",
    "Report",
    "activation_error",
    "compare",
    "conventional_checks",
    "gamma",
    "gemm_coefficient",
    "gemm_error_bound",
    "layer_bound",
    "metrics",
    "requant_uncertainty",
    "store_interval",
]
