"""Exact regimes: inputs on which every conforming kernel must give the reference's bits.

A check by equality is sound for *any* implementation (any accumulation order, tensor core, split-K,
tile shape) on inputs where the declared arithmetic leaves no freedom: every product and every
partial sum any allowed order can form is exactly representable in every accumulator the arithmetic
allows, and every declared store rounds an exact value. Guide: docs/exact-regimes.md.

* :mod:`.arithmetic`: :class:`Arithmetic`, the declared arithmetic (accumulator, promotion, stores).
* :mod:`.checker`: :func:`in_exact_regime` ``(inputs, arithmetic) -> (ok, reasons)`` for GEMMs.
* :mod:`.operands`: :func:`exact_operand`, exact-regime operands for every scaling scheme.
* :mod:`.layer`: :func:`exact_layer`, whole fused-MoE layers and inputs checked by equality, and
  :func:`layer_in_exact_regime` (:mod:`.layer_check`: from a generated layer's :class:`RegimeCertificate` in
  O(tokens x top-k), else from the values).
* :mod:`.equality`: :func:`moe_equality_report` / :func:`gemm_equality_report`, the differing elements
  with token, expert and slot (``regime="exact"`` of :mod:`moeref.testing`).
* :mod:`.rounding`: :func:`rounding_gemm` and :func:`single_rounding_layer`, single-rounding regimes (exact
  FP32 sums that each declared store must round) that separate RNE from RZ stores, FP32 from bf16
  accumulation, one store from two, for a GEMM and for a whole layer (GEMM2's output unstored or stored once
  in bf16: :func:`single_rounding_stores` picks the variant a declared profile admits).

Hypothesis strategies: :mod:`moeref.regimes.strategies` (needs the ``test`` extra).
"""
from __future__ import annotations

from .arithmetic import ACCUMULATORS, ARITHMETICS, Arithmetic, get_arithmetic
from .checker import RegimeCheck, in_exact_regime, lsb_exponents, significant_bits
from .operands import EXACT_SCHEMES, FLOAT_DTYPES, element_choices, exact_operand

__all__ = [
    "ACCUMULATORS", "ARITHMETICS", "Arithmetic", "get_arithmetic",
    "RegimeCheck", "in_exact_regime", "lsb_exponents", "significant_bits",
    "EXACT_SCHEMES", "FLOAT_DTYPES", "element_choices", "exact_operand",
]
from .layer import (LAYER_ACTIVATIONS, LAYER_SCHEMES, ExactLayer, RegimeCertificate, exact_layer,  # noqa: E402
                    exact_topk_weights, layer_in_exact_regime)

__all__ += ["LAYER_ACTIVATIONS", "LAYER_SCHEMES", "ExactLayer", "RegimeCertificate", "exact_layer",
            "exact_topk_weights", "layer_in_exact_regime"]
from .equality import EqualityReport, ExactMismatch, gemm_equality_report, moe_equality_report  # noqa: E402

__all__ += ["EqualityReport", "ExactMismatch", "gemm_equality_report", "moe_equality_report"]
from .rounding import (GEMM2_STORES, ROUNDING_LAYER_ACTIVATIONS, ROUNDING_LAYER_SCHEMES,  # noqa: E402
                       round_half_away_bf16, round_toward_zero_bf16, rounding_gemm, single_rounding_layer,
                       single_rounding_stores)

__all__ += ["round_half_away_bf16", "round_toward_zero_bf16", "rounding_gemm", "single_rounding_layer",
            "single_rounding_stores", "ROUNDING_LAYER_SCHEMES", "ROUNDING_LAYER_ACTIVATIONS", "GEMM2_STORES"]
