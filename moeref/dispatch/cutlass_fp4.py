"""Row shuffles of vLLM's CUTLASS grouped-GEMM MoE path (``cutlass_moe_fp4`` / ``cutlass_moe_fp8``):
``ops.get_cutlass_moe_mm_data`` and ``ops.shuffle_rows``.

Facts (vLLM ``csrc/quantization/cutlass_w8a8/moe/moe_data.cu``, ``fused_moe/cutlass_moe.py::
run_cutlass_moe_fp4``), with ``E`` experts of the weights, ``n`` = intermediate size, ``k`` = hidden size:

* ``problem_sizes1``: int32 ``[E, 3]`` = ``(M_e, w1_n, k)`` with ``w1_n = 2n`` for gated activations
  (``[gate; up]``) and ``n`` otherwise; ``problem_sizes2``: int32 ``[E, 3]`` = ``(M_e, k, n)``.
  ``M_e`` = slots routed to expert ``e``. (The FP8 path may swap A/B for tiny batches,
  ``M*k <= 64``, and then stores ``(w1_n, M_e, k)``; the FP4 path never swaps. moeref gives the
  unswapped form.)
* ``expert_offsets``: int32 ``[E+1]``, exclusive prefix sum of ``M_e`` (unpadded rows).
* ``blockscale_offsets``: int32 ``[E+1]``, prefix sum of ``round_up(M_e, 128)``: each expert's rows of
  the swizzled NVFP4 scale-factor tensor are padded to 128 (the 128x4 scale layout).
* ``a_map`` (``input_permutation``): int32 ``[M*k]``; ``a_map[r]`` = the *token* whose row goes to
  grouped row ``r`` (``a = shuffle_rows(a, a_map)``). Rows ``r >= expert_offsets[E]`` (slots of
  padding/-1 ids) are **never written by vLLM** (``torch.empty``; reading them caused SGLang's EP
  out-of-bounds gather). moeref writes the sentinel ``M`` (one past the last token) there.
* ``c_map`` (``output_permutation``): int32 ``[M*k]``; ``c_map[t*k + j]`` = the grouped row holding
  slot ``(t, j)``; for ``-1`` ids it is ``expert_offsets[E]`` (vLLM: "c2 is initialized to zeros", so
  that row reads zeros). Finalize: ``out[t] = sum_j w[t, j] * c2[c_map[t*k + j]]``.
* Order within an expert: vLLM uses ``atomicAdd`` (unspecified); moeref uses slot order.

``expert_map`` (moeref's addition for EP): non-local slots are treated like ``-1`` ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_int_array, check_ndim, check_positive_int
from .grouping import group_slots

__all__ = ["CutlassMoeData", "cutlass_moe_mm_data", "shuffle_rows"]


@dataclass(frozen=True, eq=False)
class CutlassMoeData:
    """Outputs of :func:`cutlass_moe_mm_data` (module docstring)."""

    expert_offsets: np.ndarray
    blockscale_offsets: np.ndarray
    problem_sizes1: np.ndarray
    problem_sizes2: np.ndarray
    a_map: np.ndarray
    c_map: np.ndarray
    num_tokens: int
    top_k: int

    @property
    def src(self) -> np.ndarray:
        """int64 ``[M*k]``: slot of each grouped row, -1 for rows ``>= expert_offsets[E]``."""
        src = np.full(self.c_map.size, -1, dtype=np.int64)
        valid = self.c_map < int(self.expert_offsets[-1])
        src[self.c_map[valid]] = np.flatnonzero(valid)
        return src


def cutlass_moe_mm_data(topk_ids, num_experts: int, n: int, k: int, *, is_gated: bool = True,
                        expert_map=None, blockscale_alignment: int = 128) -> CutlassMoeData:
    """``get_cutlass_moe_mm_data`` (module docstring). ``num_experts``: experts of ``topk_ids``'
    id space (global when ``expert_map`` is given, whose local experts then size the outputs).

    >>> d = cutlass_moe_mm_data(np.array([[1, 0], [1, -1]], dtype=np.int32), 2, n=8, k=16)
    >>> d.expert_offsets.tolist(), d.blockscale_offsets.tolist()
    ([0, 1, 3], [0, 128, 256])
    >>> d.problem_sizes1.tolist(), d.problem_sizes2.tolist()
    ([[1, 16, 16], [2, 16, 16]], [[1, 16, 8], [2, 16, 8]])
    >>> d.a_map.tolist(), d.c_map.tolist()  # a_map[3] = 2 (sentinel M); c_map of the -1 slot = 3
    ([0, 0, 1, 2], [1, 0, 2, 3])
    """
    n = check_positive_int(n, "n")
    k = check_positive_int(k, "k")
    blockscale_alignment = check_positive_int(blockscale_alignment, "blockscale_alignment")
    g = group_slots(topk_ids, num_experts, expert_map)
    counts = g.counts
    total = g.num_present
    offsets = g.offsets.astype(np.int32)
    rounded = -(-counts // blockscale_alignment) * blockscale_alignment
    blockscale_offsets = np.concatenate([[0], np.cumsum(rounded)]).astype(np.int32)
    w1_n = 2 * n if is_gated else n
    e = g.num_local_experts
    ps1 = np.stack([counts, np.full(e, w1_n), np.full(e, k)], axis=1).astype(np.int32).reshape(e, 3)
    ps2 = np.stack([counts, np.full(e, k), np.full(e, n)], axis=1).astype(np.int32).reshape(e, 3)
    a_map = np.full(g.num_slots, g.num_tokens, dtype=np.int32)
    a_map[:total] = g.present_order // max(g.top_k, 1)
    c_map = np.full(g.num_slots, total, dtype=np.int32)
    c_map[g.present_order] = np.arange(total, dtype=np.int32)
    return CutlassMoeData(offsets, blockscale_offsets, ps1, ps2, a_map, c_map, g.num_tokens, g.top_k)


def shuffle_rows(x, row_map) -> np.ndarray:
    """``out[r] = x[row_map[r]]`` (vLLM ``ops.shuffle_rows``); an index outside ``[0, len(x))`` (the
    sentinels above) gives a zero row instead of reading out of bounds.

    >>> shuffle_rows(np.array([[1.0], [2.0]]), np.array([1, 2, 0], dtype=np.int32))[:, 0].tolist()
    [2.0, 0.0, 1.0]
    """
    x = np.asarray(x)
    m = as_int_array(row_map, "row_map")
    check_ndim(m, 1, "row_map")
    inside = (m >= 0) & (m < x.shape[0])
    out = np.zeros((m.size,) + x.shape[1:], dtype=x.dtype)
    out[inside] = x[m[inside]]
    return out
