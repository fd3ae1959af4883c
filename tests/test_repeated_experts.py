"""Routing ids that repeat an expert within a token (vLLM's fused-MoE kernels and tests accept
them): each slot is its own row in every dispatch layout, every grouped GEMM and the whole layer
(moeref.routing.ids). Expected values come from a per-slot loop written here."""
from __future__ import annotations

import numpy as np
import pytest

from moeref.dispatch import (
    cutlass_moe_mm_data,
    moe_align_block_size,
    moe_permute,
    to_batched,
    to_contiguous,
    to_masked,
)
from moeref.moe import LAYOUTS, fused_moe, make_layer, make_tokens
from moeref.routing import check_topk_ids

# token 0 picks expert 2 twice, token 1 picks expert 0 three times, token 2 is padding,
# token 3 picks 1 and 3 and 1 again
IDS = np.array([[2, 2, 1], [0, 0, 0], [-1, -1, -1], [1, 3, 1]], dtype=np.int32)
WEIGHTS = np.array([[0.5, 0.25, 0.25], [0.125, 0.375, 0.5], [0.0, 0.0, 0.0], [0.5, 0.25, 0.25]],
                   dtype=np.float32)
E = 4
SLOTS = [s for s, e in enumerate(IDS.reshape(-1)) if e >= 0]   # flat slots t*k + j that route


def _slots_held(src) -> list[int]:
    src = np.asarray(src).reshape(-1)
    return sorted(int(s) for s in src if s >= 0)


def test_the_contract_accepts_repeats():
    assert check_topk_ids(IDS, E).tolist() == IDS.tolist()


@pytest.mark.parametrize("build", [
    lambda: moe_permute(None, IDS, E),
    lambda: to_contiguous(None, IDS, E, 4),
    lambda: to_masked(None, IDS, E),
    lambda: to_batched(None, IDS, E, 4),
    lambda: cutlass_moe_mm_data(IDS, E, 8, 8),
], ids=["permute", "contiguous", "masked", "batched", "cutlass"])
def test_every_layout_holds_each_slot_once(build):
    layout = build()
    assert _slots_held(layout.src) == SLOTS          # each routed slot exactly once, repeats included


def test_expert_counts_count_slots():
    # expert 0: 3 slots (token 1), expert 1: 3 (tokens 0, 3, 3), expert 2: 2, expert 3: 1
    masked = to_masked(None, IDS, E)
    assert masked.masked_m.tolist() == [3, 3, 2, 1]
    align = moe_align_block_size(IDS, 4, E)
    assert align.num_tokens_post_padded == 4 * 4        # each expert's count rounded up to 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_with_repeats_is_the_per_slot_sum(layout):
    lw = make_layer(E, 16, 8, seed=3)
    x = make_tokens(4, 16, seed=4)
    got = fused_moe(x, lw, WEIGHTS, IDS, layout=layout, alignment=4)
    w13 = [np.asarray(w, np.float64) for w in lw.w13]
    w2 = [np.asarray(w, np.float64) for w in lw.w2]
    want = np.zeros((4, w2[0].shape[0]))
    for t in range(4):
        for j in range(3):
            e = int(IDS[t, j])
            if e < 0:
                continue
            h = w13[e] @ x[t].astype(np.float64)
            g, u = h[: h.size // 2], h[h.size // 2:]
            want[t] += float(WEIGHTS[t, j]) * (w2[e] @ (g / (1.0 + np.exp(-g)) * u))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # a token picking one expert twice is that expert once with the summed weight
    merged = fused_moe(x[:1], lw, np.array([[0.75, 0.25]], np.float32), np.array([[2, 1]], np.int32),
                       layout=layout, alignment=4)
    np.testing.assert_allclose(got[0], merged[0], rtol=1e-12, atol=1e-12)


def test_batched_capacity_counts_rows_not_tokens():
    # one token, expert 0 twice: two rows; a capacity of one token per dispatcher cannot hold them
    with pytest.raises(ValueError, match="local expert 0 has 2 rows, more than the capacity 1"):
        to_batched(None, np.array([[0, 0]], np.int32), 2, 1)
    assert to_batched(None, np.array([[0, 0]], np.int32), 2, 2).expert_num_tokens.tolist() == [2, 0]
