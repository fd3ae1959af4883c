"""Token dispatch references: every layout MoE kernels read, built from one stable sort.

* :mod:`.grouping`: slots ``t*k + j`` grouped by local expert (validation, EP map, the one sort).
* :mod:`.align`: vLLM ``moe_align_block_size`` / ``batched_moe_align_block_size`` (fused_moe Triton).
* :mod:`.permute`: vLLM ``moe_permute`` / ``moe_unpermute`` (unpadded, offsets).
* :mod:`.contiguous`: DeepGEMM contiguous layout (``m_indices`` -1 padding, psum, any alignment).
* :mod:`.masked`: DeepGEMM masked layout / DeepEP low-latency output (``masked_m``, ``expected_m``).
* :mod:`.batched`: vLLM BatchedExperts layout (``expert_num_tokens``).
* :mod:`.cutlass_fp4`: vLLM CUTLASS ``get_cutlass_moe_mm_data`` (``a_map``, ``c_map``, problem sizes).
* :mod:`.finalize`: weight-and-reduce from any layout's rows; no-op; weight on input (top_k == 1).
* :mod:`.convert`: lossless conversions between layouts through per-slot rows.

Every layout's ``src`` gives, per row, the slot ``t*k + j`` it holds (-1 for padding rows).
Diagrams: ``docs/dispatch.md``.
"""
from __future__ import annotations

from .align import AlignResult, batched_moe_align_block_size, max_num_tokens_padded, moe_align_block_size
from .batched import Batched, batched_from_grouping, to_batched
from .contiguous import Contiguous, contiguous_from_grouping, contiguous_m_sum, to_contiguous
from .convert import (
    LAYOUTS,
    SlotRows,
    batched_to_masked,
    contiguous_to_masked,
    contiguous_to_permuted,
    convert,
    from_slot_rows,
    masked_to_batched,
    masked_to_contiguous,
    permuted_to_contiguous,
    to_slot_rows,
)
from .cutlass_fp4 import CutlassMoeData, cutlass_moe_mm_data, shuffle_rows
from .finalize import apply_router_weight_on_input, finalize_noop, reduce_slot_rows, weight_and_reduce
from .grouping import RowSource, SlotGrouping, check_rows, group_slots, rows_by_expert, token_row_source
from .masked import Masked, masked_from_grouping, pack_per_expert, to_masked
from .permute import Permuted, expert_first_token_offset, moe_permute, moe_unpermute, permute_from_grouping

__all__ = [
    "LAYOUTS",
    "AlignResult",
    "Batched",
    "Contiguous",
    "CutlassMoeData",
    "Masked",
    "Permuted",
    "RowSource",
    "SlotGrouping",
    "SlotRows",
    "apply_router_weight_on_input",
    "batched_from_grouping",
    "batched_moe_align_block_size",
    "batched_to_masked",
    "check_rows",
    "contiguous_from_grouping",
    "contiguous_m_sum",
    "contiguous_to_masked",
    "contiguous_to_permuted",
    "convert",
    "cutlass_moe_mm_data",
    "expert_first_token_offset",
    "finalize_noop",
    "from_slot_rows",
    "group_slots",
    "masked_from_grouping",
    "masked_to_batched",
    "masked_to_contiguous",
    "max_num_tokens_padded",
    "moe_align_block_size",
    "moe_permute",
    "moe_unpermute",
    "pack_per_expert",
    "permute_from_grouping",
    "permuted_to_contiguous",
    "reduce_slot_rows",
    "rows_by_expert",
    "shuffle_rows",
    "to_batched",
    "to_contiguous",
    "to_masked",
    "to_slot_rows",
    "token_row_source",
    "weight_and_reduce",
]
