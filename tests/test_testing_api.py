"""moeref.testing on the CPU: the kernel profiles, a hand-written torch bf16 MoE kernel
(tests/kernels_for_tests.py) checked end to end, the report's slot diagnosis, what the kernel sees
(``kernel_inputs``) and the grouped-GEMM assertion through arguments. The adapters are checked in
test_testing_adapters.py; reproducers, the CLI and the mutation score in test_testing_cli.py."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels_for_tests import eager_bf16_moe, scaled_mm_fast_accum
from moeref.compare import PROFILES, compare, get_profile, suggest_profile
from moeref.moe import make_layer, make_tokens, run_moe
from moeref.moe.mapping import from_torch_scaled_mm
from moeref.testing import (MoEMismatch, assert_grouped_gemm_close, assert_moe_close, draw_cases, grouped_gemm_report,
                            kernel_inputs)
from testing_api_cases import layer_inputs


@pytest.fixture(scope="module")
def cases():
    return draw_cases(6, max_tokens=48)  # the CPU reference and bound: small cases keep the suite fast


# ------------------------------------------------------------------ profiles


def test_compare_accepts_profile_names_and_rejects_unknown_ones():
    ki = layer_inputs()
    out = eager_bf16_moe(**ki.torch())
    ref = ki.reference()
    assert compare(out, ref, "TORCH_EAGER_BF16").passed
    assert compare(out, ref, "torch_eager_bf16").profile is PROFILES["TORCH_EAGER_BF16"]
    with pytest.raises(ValueError, match="unknown profile 'NOPE'.*FP32_ACCUM"):
        compare(out, ref, "NOPE")
    with pytest.raises(TypeError, match="Profile or a profile name"):
        get_profile(3)


def test_kernel_profiles_are_registered_and_derived_from_their_arithmetic():
    p = PROFILES
    for name in ("DEEPGEMM_FP8", "CUBLAS_FP8", "CUBLAS_FP8_FAST_ACCUM", "CUTLASS_BF16_GROUPED_MM", "TORCH_EAGER_BF16",
                 "VLLM_MOE_SUM_BF16"):
        assert p[name].name == name
    assert p["DEEPGEMM_FP8"].promote_every == 128 and p["DEEPGEMM_FP8"].accum_unit == 2.0**-13
    assert p["CUBLAS_FP8_FAST_ACCUM"].promote_every is None
    assert p["CUTLASS_BF16_GROUPED_MM"].accum_unit == 2.0**-22  # truncating FP32, 16-wide MMA (docstring)
    assert p["TORCH_EAGER_BF16"].act_unit == pytest.approx(2 * 2.0**-8 + 2.0**-16 + 16 * 2.0**-24, rel=1e-12)
    assert p["VLLM_MOE_SUM_BF16"].reduce_unit == 2.0**-8 and p["BF16_OUTPUT"].reduce_unit == 2.0**-24


@pytest.mark.parametrize("dtypes, kernel, want", [
    (("float8_e4m3fn", "bfloat16"), None, "DEEPGEMM_FP8"),
    (("torch.float8_e4m3fn", "torch.bfloat16"), "cublas", "DEEPGEMM_FP8"),  # the same arithmetic
    (("bfloat16", "bfloat16"), None, "BF16_OUTPUT"),
    (("bfloat16", "bfloat16"), "cutlass", "BF16_OUTPUT"),
    (("bfloat16", "bfloat16"), "vllm", "VLLM_MOE_SUM_BF16"),
    (("bfloat16", "bfloat16"), "torch", "TORCH_EAGER_BF16"),
    (("uint8", "bfloat16"), None, "BF16_OUTPUT"),
    (("float32", "float32"), None, "FP32_ACCUM"),
])
def test_suggest_profile_from_dtypes(dtypes, kernel, want):
    assert suggest_profile(*dtypes, kernel=kernel).name == want
    assert suggest_profile("float8_e4m3fn", fast_accum=True).name == "CUBLAS_FP8_FAST_ACCUM"
    with pytest.raises(ValueError, match="no profile suggestion for operand dtype 'int7'"):
        suggest_profile("int7")


def test_vllm_bf16_topk_sum_passes_its_profile(cases):
    """vLLM's moe_sum: the k weighted bf16 rows summed in bf16 (each add rounded) after bf16 caches."""
    prof = get_profile("VLLM_MOE_SUM_BF16")
    for ki in cases:
        ref = ki.reference()
        run = run_moe(ki.hidden, ki.weights, ki.topk_weights, ki.topk_ids, gemm1_out_dtype="bfloat16",
                      act_out_dtype="bfloat16")
        p, e = run.chunks[0]
        y = np.zeros((p.num_tokens * p.top_k, e.y.shape[1]))
        y[p.src[p.src >= 0]] = e.y[p.src >= 0]
        y = y.reshape(p.num_tokens, p.top_k, -1)
        w = np.asarray(ki.topk_weights, np.float32)[:, :, None]
        rows = (y.astype(ml_dtypes.bfloat16).astype(np.float32) * w).astype(ml_dtypes.bfloat16)
        acc = np.zeros(rows.shape[::2], dtype=ml_dtypes.bfloat16)
        for j in range(rows.shape[1]):  # bf16 accumulation, as moe_sum_kernel's scalar_t x
            acc = (acc.astype(np.float32) + rows[:, j].astype(np.float32)).astype(ml_dtypes.bfloat16)
        r = compare(acc, ref, prof)
        assert r.passed, r.summary()
        assert np.all(r.bound >= compare(acc, ref, "BF16_OUTPUT").bound)


def test_fast_accumulation_needs_its_profile():
    """A 14-bit accumulator never promoted: inside CUBLAS_FP8_FAST_ACCUM, outside FP32_ACCUM where partial
    sums grow large and cancel (the second half of K mirrors the first with the sign of b flipped)."""
    rng = np.random.default_rng(3)
    a = np.abs(rng.standard_normal((16, 1024))) + 0.1
    b = np.abs(rng.standard_normal((32, 1024))) + 0.1
    a = torch.from_numpy(np.concatenate([a, a], 1).astype(np.float32)).to(torch.float8_e4m3fn)
    b = torch.from_numpy(np.concatenate([b, -b], 1).astype(np.float32)).to(torch.float8_e4m3fn)
    sa, sb = torch.full((16, 1), 0.5), torch.full((1, 32), 0.25)
    out = scaled_mm_fast_accum(a, b.t(), sa, sb)
    call = from_torch_scaled_mm(a, b.t(), sa, sb, out)
    ok = grouped_gemm_report(call, profile="CUBLAS_FP8_FAST_ACCUM")
    assert ok.passed
    assert not grouped_gemm_report(call, profile="FP32_ACCUM").passed


# ------------------------------------------------------------------ the bf16 MoE kernel, end to end


def test_eager_bf16_kernel_passes_its_profile_on_drawn_cases(cases):
    for ki in cases:
        assert_moe_close(eager_bf16_moe(**ki.torch()), ki, "TORCH_EAGER_BF16")


def test_dropped_tail_slot_is_caught_and_the_slot_named():
    ki = layer_inputs(m=13, top_k=3)
    out = eager_bf16_moe(**ki.torch(), bug="tail_slot")
    with pytest.raises(MoEMismatch) as exc:
        assert_moe_close(out, ki, "TORCH_EAGER_BF16", label="tail slot")
    rep = exc.value.report
    assert sorted(np.flatnonzero(rep.token_violations).tolist()) == list(range(8, 13))  # M % 8 tail only
    for t in range(8, 13):
        j, e, corr = rep.suspects[t]
        assert (j, e) == (2, int(ki.topk_ids[t, 2])) and corr < -0.99  # the dropped slot, anti-correlated
    assert "slot j=2 -> expert" in rep.summary()
    assert exc.value.case is not None and exc.value.candidate.shape == (13, 128)


def test_all_zero_candidate_prints_no_nan_metric():
    ki = layer_inputs()
    rep = compare(np.zeros((13, 128), np.float32), ki.reference(), "BF16_OUTPUT")
    assert rep.metrics["cosine"] == 0.0 and not rep.passed
    assert "nan" not in rep.summary().lower()


def test_kernel_inputs_are_what_the_kernel_sees():
    ki = layer_inputs()
    t = ki.torch()
    assert t["hidden_states"].dtype == torch.bfloat16 and t["topk_ids"].dtype == torch.int32
    x = make_tokens(13, 128, seed=1)
    assert np.array_equal(t["hidden_states"].float().numpy(), torch.from_numpy(x).bfloat16().float().numpy())
    w13 = np.stack(make_layer(6, 128, 64, seed=0).w13)
    assert np.array_equal(ki.w13.astype(np.float32), w13.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert ki.reference().weights.w13[0].dtype == ml_dtypes.bfloat16
    with pytest.raises(TypeError, match="topk_ids must be integer"):
        kernel_inputs(x, make_layer(6, 128, 64), ki.topk_weights, ki.topk_ids.astype(np.float32))


# ------------------------------------------------------------------ grouped GEMM outputs through arguments


def test_grouped_gemm_standard_and_batched_layouts_through_arguments():
    rng = np.random.default_rng(11)
    x = torch.from_numpy(rng.standard_normal((5, 64)).astype(np.float32)).bfloat16()
    w = torch.from_numpy(rng.standard_normal((3, 32, 64)).astype(np.float32)).bfloat16()
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]], dtype=torch.int32)
    cache = torch.stack([torch.stack([x[t] @ w[int(ids[t, j])].T for j in range(2)]) for t in range(5)])  # [M, k, N]
    rep = assert_grouped_gemm_close(cache, x, w, "BF16_OUTPUT", layout="standard", topk_ids=ids)
    assert rep.error.shape == (10, 32)
    bad = cache.clone()
    bad[3, 1] = x[3] @ w[2].T                                      # slot (3, 1) read expert 2, not 1
    with pytest.raises(MoEMismatch, match="row 7: .*expert 1"):    # row t*k+j = 7
        assert_grouped_gemm_close(bad, x, w, "BF16_OUTPUT", layout="standard", topk_ids=ids)
    with pytest.raises(ValueError, match="topk_ids has 4 tokens but a has 5 rows"):
        grouped_gemm_report(cache[:4], x, w, layout="standard", topk_ids=ids[:4])
    a3 = torch.zeros(3, 4, 64, dtype=torch.bfloat16)               # batched: [E, T, K], rows past the count
    a3[0, :2], a3[2, :3] = x[:2], x[2:]
    counts = torch.tensor([2, 0, 3], dtype=torch.int32)
    out = torch.einsum("etk,enk->etn", a3.float(), w.float()).bfloat16()
    out[0, 3] = float("nan")                                       # unspecified padding row
    assert_grouped_gemm_close(out, a3, w, "BF16_OUTPUT", layout="batched", masked_m=counts)
    with pytest.raises(ValueError, match="layout must be one of"):
        grouped_gemm_report(out, a3, w, layout="ragged", masked_m=counts)
