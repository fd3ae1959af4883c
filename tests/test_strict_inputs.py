"""Inputs checked up front (issue 32): one row per token in hidden and the routing everywhere a row count is
implied (an extra routing row used to be ignored by run_moe's chunking), kernel_inputs' shape and id checks,
the candidate's dtype against the profile's declared output, and arguments given in the wrong order."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from moeref.dispatch import apply_router_weight_on_input, moe_permute, to_batched, to_contiguous, to_masked
from moeref.moe import fused_moe, make_layer, make_tokens, prepare, run_moe
from moeref.testing import kernel_inputs

E, K, N = 4, 64, 32
ROWS = r"hidden has 11 rows \(shape \(11, 64\)\) but topk_weights has 12 \(shape \(12, 2\)\)"


@pytest.fixture(scope="module")
def layer():
    return make_layer(E, K, N, seed=0)


def _routing(m, k=2):
    ids = (np.arange(m * k).reshape(m, k) % E).astype(np.int32)
    return np.full((m, k), 1.0 / k, np.float32), ids


@pytest.mark.parametrize("chunk_size", [None, 4, 11])
def test_the_layer_rejects_a_routing_row_without_a_token(layer, chunk_size):
    """11 tokens, 12 routing rows: before, run_moe sliced the routing to the tokens and ignored row 11."""
    x = make_tokens(11, K)
    w, ids = _routing(12)
    for run in (run_moe, fused_moe):
        with pytest.raises(ValueError, match=ROWS):
            run(x, layer, w, ids, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"hidden has 12 rows .* but topk_weights has 11"):
        fused_moe(make_tokens(12, K), layer, w[:11], ids[:11], chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"hidden has 12 rows .* but topk_ids has 11 \(shape \(11, 2\)\)"):
        fused_moe(make_tokens(12, K), layer, w, ids[:11], chunk_size=chunk_size)


def test_prepare_names_rows_and_top_k(layer):
    w, ids = _routing(12)
    with pytest.raises(ValueError, match=ROWS):
        prepare(make_tokens(11, K), w, ids, num_experts=E)
    with pytest.raises(ValueError, match=r"topk_weights has top_k=3 \(shape \(12, 3\)\) but topk_ids has top_k=2"):
        prepare(make_tokens(12, K), np.full((12, 3), 0.5, np.float32), ids, num_experts=E)


def test_dispatch_functions_taking_hidden_and_ids_reject_a_row_mismatch():
    _, ids = _routing(12)
    x = make_tokens(11, K)
    calls = [lambda: to_contiguous(x, ids, E, 16), lambda: to_masked(x, ids, E), lambda: to_batched(x, ids, E, 24),
             lambda: moe_permute(x, ids, E)]
    for call in calls:
        with pytest.raises(ValueError, match=r"hidden must have 12 rows \(one per token\); got shape \(11, 64\)"):
            call()
    with pytest.raises(ValueError, match=r"hidden has 11 rows .* but topk_weights has 12"):
        apply_router_weight_on_input(x, np.ones((12, 1), np.float32))


def test_the_device_engine_checks_rows_on_the_host_before_chunking(layer):
    """The device engine's entry (moeref.moe.device.run_moe_device) on the CPU interpreter: the host-side
    check raises before any kernel runs."""
    w, ids = _routing(12)
    with pytest.raises(ValueError, match=ROWS):
        run_moe(torch.from_numpy(make_tokens(11, K)), layer, w, ids, device="cpu", chunk_size=4)


# ------------------------------------------------------------------ kernel_inputs


def test_kernel_inputs_rejects_ids_out_of_range_naming_index_and_value(layer):
    w, ids = _routing(5)
    ids[3, 1] = E  # one past the last expert
    with pytest.raises(ValueError, match=r"topk_ids\[3, 1\] = 4 is out of range: ids must be in \[0, 4\) or -1"):
        kernel_inputs(make_tokens(5, K), layer, w, ids)
    ids[3, 1] = -2
    with pytest.raises(ValueError, match=r"topk_ids\[3, 1\] = -2 is out of range"):
        kernel_inputs(make_tokens(5, K), layer, w, ids)
    ids[3, 1] = 6  # an EP shard's global id: accepted when the global count is given
    assert kernel_inputs(make_tokens(5, K), layer, w, ids, num_experts=8).topk_ids[3, 1] == 6


def test_kernel_inputs_rejects_row_top_k_and_size_mismatches(layer):
    w, ids = _routing(12)
    with pytest.raises(ValueError, match=ROWS):
        kernel_inputs(make_tokens(11, K), layer, w, ids)
    with pytest.raises(ValueError, match=r"topk_weights has top_k=3 \(shape \(12, 3\)\) but topk_ids has top_k=2 "
                                         r"\(shape \(12, 2\)\)"):
        kernel_inputs(make_tokens(12, K), layer, np.full((12, 3), 0.25, np.float32), ids)
    with pytest.raises(ValueError, match=r"hidden has hidden size K=32 \(shape \(12, 32\)\) but w13 \(4, 64, 64\) "
                                         r"and w2 \(4, 64, 32\) need K"):
        kernel_inputs(make_tokens(12, 32), layer, w, ids)
    w13, w2 = np.stack(layer.w13), np.stack(layer.w2)
    with pytest.raises(ValueError, match=r"w13 has 4 experts \(shape \(4, 64, 64\)\) but w2 has 3"):
        kernel_inputs(make_tokens(12, K), (w13, w2[:3]), w, ids)
    with pytest.raises(ValueError, match=r"w13 has 48 rows per expert .* must have 2N=64 rows \(gated activation\) "
                                         r"or N=32"):
        kernel_inputs(make_tokens(12, K), (w13[:, :48], w2), w, ids)
    with pytest.raises(ValueError, match=r"topk_ids must be 2-D \[M, top_k\]; got shape \(12,\)"):
        kernel_inputs(make_tokens(12, K), layer, w, ids[:, 0])
    ki = kernel_inputs(make_tokens(12, K), (w13[:, :N], w2), w, ids)  # non-gated: w13 [E, N, K]
    assert ki.w13.shape == (E, N, K) and ki.hidden.dtype == np.dtype(ml_dtypes.bfloat16)
