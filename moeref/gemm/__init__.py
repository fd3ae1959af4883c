"""Exact grouped GEMMs: one block-scaled dot-product engine (:mod:`.exact`) and one grouped GEMM per
dispatch layout (:mod:`.grouped`). See docs/moe-pipeline.md."""
from __future__ import annotations

from .exact import (BlockOperand, as_operand, block_gemm, get_num_threads, partial_dots_exact,
                    quantum_and_max, set_num_threads)
from .stacked import StackedExperts
from .grouped import (
    ExpertOperands,
    expert_rows_gemm,
    grouped_gemm_batched,
    grouped_gemm_contiguous,
    grouped_gemm_masked,
    grouped_gemm_standard,
)

__all__ = [
    "BlockOperand",
    "ExpertOperands",
    "StackedExperts",
    "as_operand",
    "block_gemm",
    "expert_rows_gemm",
    "grouped_gemm_batched",
    "grouped_gemm_contiguous",
    "grouped_gemm_masked",
    "grouped_gemm_standard",
    "get_num_threads",
    "partial_dots_exact",
    "quantum_and_max",
    "set_num_threads",
]
