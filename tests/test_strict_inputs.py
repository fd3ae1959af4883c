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
from moeref.testing import MoEMismatch, kernel_inputs

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


# ------------------------------------------------------------------ the candidate's dtype and the argument order


def _bf16_case(layer):
    w, ids = _routing(13)
    ki = kernel_inputs(make_tokens(13, K), layer, w, ids)
    return ki, ki.reference().out  # the exact layer rounded once to bf16: inside every bf16 profile


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_candidate_not_stored_in_the_declared_bf16_passes_no_bf16_profile(layer, dtype):
    from moeref.testing import assert_moe_close

    ki, out = _bf16_case(layer)
    assert assert_moe_close(out, ki, "BF16_OUTPUT").passed
    assert assert_moe_close(torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16), ki, "BF16_OUTPUT").passed
    wide = out.astype(np.float32).astype(dtype)  # the same values, stored wider: no bf16 kernel returns this
    name = np.dtype(dtype).name
    for cand in (wide, torch.from_numpy(wide)):
        with pytest.raises(TypeError, match=rf"the candidate is {name} but profile BF16_OUTPUT declares a bfloat16 "
                                            r"output store \(Profile.out_dtype='bfloat16'\).*EXACT, FP32_ACCUM"):
            assert_moe_close(cand, ki, "BF16_OUTPUT")
    with pytest.raises(MoEMismatch):  # no store declared: any dtype is checked (and this one exceeds FP32 rounding)
        assert_moe_close(wide, ki, "FP32_ACCUM")


def test_a_grouped_gemm_candidate_must_have_the_declared_gemm_store(layer):
    from moeref.testing import assert_grouped_gemm_close

    w = np.stack([np.eye(2), 2 * np.eye(2)]).astype(np.float32)
    a = np.array([[1.0, 3.0], [2.0, 5.0]], np.float32)
    out = np.array([[1.0, 3.0], [4.0, 10.0]])
    kw = dict(layout="contiguous", m_indices=np.array([0, 1]))
    assert assert_grouped_gemm_close(out.astype(ml_dtypes.bfloat16), a, w, "BF16_OUTPUT", **kw).passed
    with pytest.raises(TypeError, match=r"the candidate is float32 but profile BF16_OUTPUT declares a bfloat16 output "
                                        r"store \(Profile.gemm_out_dtype='bfloat16'\)"):
        assert_grouped_gemm_close(out.astype(np.float32), a, w, "BF16_OUTPUT", **kw)
    assert assert_grouped_gemm_close(out.astype(np.float32), a, w, "FP32_ACCUM", **kw).passed


def test_arguments_in_the_wrong_order_say_what_was_expected(layer):
    from moeref.compare import compare
    from moeref.testing import assert_moe_close

    ki, out = _bf16_case(layer)
    t = torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"assert_moe_close\(candidate, reference_run, profile\): candidate must be the "
                                        r"kernel's output, a NumPy array or a torch tensor; got KernelInputs \(the "
                                        r"arguments swapped\? the kernel's output comes first\)"):
        assert_moe_close(ki, t, "BF16_OUTPUT")
    with pytest.raises(TypeError, match=r"the reference must be a KernelInputs .* got ndarray \(an output array"):
        assert_moe_close(t, out, "BF16_OUTPUT")
    with pytest.raises(TypeError,
                       match=r"compare\(candidate, reference, profile\): candidate must be .* got LayerCase"):
        compare(ki.layer_case(), t, "BF16_OUTPUT")
    with pytest.raises(TypeError,
                       match=r"grouped_gemm_report: candidate must be the kernel's output, .* got KernelInputs"):
        from moeref.testing import assert_grouped_gemm_close

        assert_grouped_gemm_close(ki, np.zeros((2, 2), np.float32), [np.eye(2)], "FP32_ACCUM", layout="contiguous",
                                  m_indices=np.zeros(2, np.int32))
