"""moeref.testing on the CPU: a hand-written torch bf16 MoE kernel and stand-ins with real kernels'
signatures (tests/kernels_for_tests.py) checked through the adapters, the kernel profiles, operands read
from kernels' own layouts, the report's slot diagnosis, reproducers, the CLI and the mutation score."""
from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels_for_tests import (cutlass_fused_moe, deepgemm_contiguous, eager_bf16_moe, fused_experts,
                               scaled_mm_fast_accum, sglang_fused_moe)
from moeref.compare import PROFILES, compare, get_profile, suggest_profile
from moeref.compare.faults import LayerCase
from moeref.gemm.from_kernel import kernel_expert_operands, kernel_operand
from moeref.layouts import pack_ue8m0, swizzle_128x4, to_mn_major_tma_aligned
from moeref.moe import make_layer, make_tokens, run_moe
from moeref.moe.mapping import (from_deepgemm_contiguous, from_deepgemm_masked, from_flashinfer_cutlass,
                                from_sglang_fused_moe, from_torch_grouped_mm, from_torch_scaled_mm,
                                from_vllm_fused_experts, from_vllm_modular_kernel)
from moeref.routing import softmax_topk
from moeref.testing import (MoEMismatch, assert_grouped_gemm_close, assert_moe_close, draw_cases,
                            grouped_gemm_report, kernel_inputs, load_reproducer, mutation_score, replay,
                            save_reproducer)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # OCP MX table


def _layer(m=13, k=128, n=64, e=6, top_k=3, seed=0):
    lw = make_layer(e, k, n, seed=seed)
    r = softmax_topk(np.random.default_rng(seed + 5).standard_normal((m, e)), top_k, renormalize=True)
    return kernel_inputs(make_tokens(m, k, seed=seed + 1), lw, r.weights, r.ids)


@pytest.fixture(scope="module")
def cases():
    return draw_cases(6, max_tokens=48)  # the CPU reference and bound: small cases keep the suite fast


# ------------------------------------------------------------------ profiles


def test_compare_accepts_profile_names_and_rejects_unknown_ones():
    ki = _layer()
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
    (("torch.float8_e4m3fn", "torch.bfloat16"), "cublas", "CUBLAS_FP8"),
    (("bfloat16", "bfloat16"), None, "CUTLASS_BF16_GROUPED_MM"),
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
    ki = _layer(m=13, top_k=3)
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
    ki = _layer()
    rep = compare(np.zeros((13, 128), np.float32), ki.reference(), "BF16_OUTPUT")
    assert rep.metrics["cosine"] == 0.0 and not rep.passed
    assert "nan" not in rep.summary().lower()


def test_kernel_inputs_are_what_the_kernel_sees():
    ki = _layer()
    t = ki.torch()
    assert t["hidden_states"].dtype == torch.bfloat16 and t["topk_ids"].dtype == torch.int32
    x = make_tokens(13, 128, seed=1)
    assert np.array_equal(t["hidden_states"].float().numpy(), torch.from_numpy(x).bfloat16().float().numpy())
    w13 = np.stack(make_layer(6, 128, 64, seed=0).w13)
    assert np.array_equal(ki.w13.astype(np.float32), w13.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert ki.reference().weights.w13[0].dtype == ml_dtypes.bfloat16
    with pytest.raises(TypeError, match="topk_ids must be integer"):
        kernel_inputs(x, make_layer(6, 128, 64), ki.topk_weights, ki.topk_ids.astype(np.float32))


# ------------------------------------------------------------------ adapters (stand-ins of the same signatures)


def test_vllm_fused_experts_adapter_with_expert_map():
    ki = _layer(e=6)
    t = ki.torch()
    assert list(inspect.signature(from_vllm_fused_experts).parameters)[:10] == \
        list(inspect.signature(fused_experts).parameters)
    emap = torch.tensor([-1, 0, 1, 2, -1, -1], dtype=torch.int32)  # rank holds experts 1..3
    local = dict(t, w1=t["w1"][1:4], w2=t["w2"][1:4])
    out = fused_experts(**local, global_num_experts=6, expert_map=emap)
    kw = from_vllm_fused_experts(**local, global_num_experts=6, expert_map=emap)
    assert kw["num_experts"] == 6 and kw["out_dtype"] == "bfloat16"
    assert_moe_close(out, run_moe(**kw), "TORCH_EAGER_BF16")
    with pytest.raises(MoEMismatch):  # the full layer is not this rank's share
        assert_moe_close(out, ki.reference(), "TORCH_EAGER_BF16")


def test_vllm_modular_kernel_adapter_reads_format_and_quant_config():
    ki = _layer()
    t = ki.torch()
    pf = SimpleNamespace(activation_format=SimpleNamespace(name="BatchedExperts"))
    fe = SimpleNamespace(quant_config=None)
    kw = from_vllm_modular_kernel(pf, fe, **t)
    assert kw["layout"] == "batched"
    assert_moe_close(eager_bf16_moe(**t), run_moe(**kw), "TORCH_EAGER_BF16")


def test_flashinfer_cutlass_adapter_up_gate_and_ep():
    ki = _layer(e=6)
    t = ki.torch()
    w31 = torch.cat([t["w1"][:, 64:], t["w1"][:, :64]], dim=1)  # [w3 (up); w1 (gate)]
    gids = t["topk_ids"]
    args = dict(input=t["hidden_states"], token_selected_experts=gids, token_final_scales=t["topk_weights"],
                fc1_expert_weights=w31[3:], fc2_expert_weights=t["w2"][3:], output_dtype=torch.bfloat16,
                ep_size=2, ep_rank=1)
    out = cutlass_fused_moe(**args)
    kw = from_flashinfer_cutlass(**args)
    assert kw["weights"].w13_layout == "up_gate" and kw["expert_map"].tolist() == [-1, -1, -1, 0, 1, 2]
    assert_moe_close(out, run_moe(**kw), "TORCH_EAGER_BF16")


def test_sglang_adapter():
    ki = _layer()
    t = ki.torch()
    topk = (t["topk_weights"], t["topk_ids"], None)
    cfg = SimpleNamespace(activation="silu", apply_router_weight_on_input=False, routed_scaling_factor=None)
    out = sglang_fused_moe(t["hidden_states"], t["w1"], t["w2"], topk, cfg)
    kw = from_sglang_fused_moe(t["hidden_states"], t["w1"], t["w2"], topk, cfg)
    assert_moe_close(out, run_moe(**kw), "TORCH_EAGER_BF16")
    with pytest.raises(ValueError, match="routed_scaling_factor=2.5"):
        from_sglang_fused_moe(t["hidden_states"], t["w1"], t["w2"], topk, SimpleNamespace(routed_scaling_factor=2.5))


def _dg_inputs(rows_per_expert=(5, 0, 7), k=320, n=256, seed=0):
    """DeepGEMM-style FP8 operands: activations 1x128 (MN-major TMA-aligned scales), weights 128x128,
    contiguous layout with 128-row alignment; scales chosen (powers of two times odd numbers) by hand."""
    rng = np.random.default_rng(seed)
    e = len(rows_per_expert)
    kb, nb = -(-k // 128), -(-n // 128)
    m_idx = np.concatenate([np.r_[np.full(c, i), np.full(-(-max(c, 1) // 128) * 128 - c, -1)]
                            for i, c in enumerate(rows_per_expert)]).astype(np.int32)
    a = torch.from_numpy(rng.standard_normal((m_idx.size, k)).astype(np.float32)).to(torch.float8_e4m3fn)
    sa = to_mn_major_tma_aligned((rng.integers(1, 8, (m_idx.size, kb)) / 64.0).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal((e, n, k)).astype(np.float32)).to(torch.float8_e4m3fn)
    sb = (rng.integers(1, 8, (e, nb, kb)) / 32.0).astype(np.float32)
    return (a, torch.from_numpy(sa)), (b, torch.from_numpy(sb)), torch.from_numpy(m_idx)


def test_deepgemm_contiguous_adapter_and_wrong_last_block_scale():
    a, b, m_idx = _dg_inputs()
    d = deepgemm_contiguous(a, b, torch.empty(m_idx.numel(), 256, dtype=torch.bfloat16), m_idx)
    call = from_deepgemm_contiguous(a, b, d, m_idx)
    rep = assert_grouped_gemm_close(call, profile="DEEPGEMM_FP8")
    assert rep.row_name == "row" and int((call.row_expert >= 0).sum()) == 12
    bad = deepgemm_contiguous(a, b, torch.empty_like(d), m_idx, bug="last_k_scale")
    with pytest.raises(MoEMismatch) as exc:
        assert_grouped_gemm_close(from_deepgemm_contiguous(a, b, bad, m_idx), profile="DEEPGEMM_FP8")
    assert "expert" in exc.value.report.summary()
    # the same check through the layout arguments instead of the adapter
    assert grouped_gemm_report(d, a, b, "DEEPGEMM_FP8", layout="contiguous", m_indices=m_idx).passed


def test_deepgemm_masked_adapter_ignores_rows_past_masked_m():
    a, b, _ = _dg_inputs(rows_per_expert=(4, 4, 4), k=256)
    ax = a[0][:12].reshape(3, 4, 256)
    sa = torch.from_numpy(np.ascontiguousarray(a[1].numpy()[:12])).reshape(3, 4, 2)
    masked_m = torch.tensor([2, 0, 4], dtype=torch.int32)
    rows = torch.tensor([0, 0, -1, -1, -1, -1, -1, -1, 2, 2, 2, 2], dtype=torch.int32)
    d = deepgemm_contiguous((ax.reshape(12, 256), sa.reshape(12, 2)), b, torch.empty(12, 256, dtype=torch.bfloat16),
                            rows)
    d[2:8] = 1e4  # rows past masked_m: unspecified
    call = from_deepgemm_masked((ax, sa), b, d.reshape(3, 4, 256), masked_m, expected_m=4)
    assert call.row_expert.tolist() == rows.tolist()
    assert_grouped_gemm_close(call, profile="DEEPGEMM_FP8")
    with pytest.raises(ValueError, match="expected_m must be > 0"):
        from_deepgemm_masked((ax, sa), b, d, masked_m, expected_m=0)


def test_torch_grouped_mm_adapter_on_the_real_cpu_function():
    rng = np.random.default_rng(1)
    a = torch.from_numpy(rng.standard_normal((20, 64)).astype(np.float32)).bfloat16()
    b = torch.from_numpy(rng.standard_normal((3, 64, 48)).astype(np.float32)).bfloat16()
    offs = torch.tensor([5, 5, 17], dtype=torch.int32)  # an empty expert, 3 padding rows
    out = torch._grouped_mm(a, b, offs=offs)
    call = from_torch_grouped_mm(a, b, offs, out=out)
    assert call.row_expert.tolist() == [0] * 5 + [2] * 12 + [-1] * 3
    assert_grouped_gemm_close(call, profile="CUTLASS_BF16_GROUPED_MM")
    wrong = out.clone()
    wrong[5:17] = torch._grouped_mm(a[5:17], b[1:2], offs=torch.tensor([12], dtype=torch.int32))  # expert off by one
    with pytest.raises(MoEMismatch):
        assert_grouped_gemm_close(from_torch_grouped_mm(a, b, offs, out=wrong), profile="CUTLASS_BF16_GROUPED_MM")


def test_torch_scaled_mm_adapter_on_the_real_cpu_function():
    rng = np.random.default_rng(2)
    a = torch.from_numpy(rng.standard_normal((8, 256)).astype(np.float32)).to(torch.float8_e4m3fn)
    b = torch.from_numpy(rng.standard_normal((16, 256)).astype(np.float32)).to(torch.float8_e4m3fn)
    sa = torch.from_numpy((rng.integers(1, 4, (8, 1)) / 8).astype(np.float32))
    sb = torch.from_numpy((rng.integers(1, 4, (1, 16)) / 4).astype(np.float32))
    try:
        out = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16)
    except RuntimeError as e:  # torch 2.11's CPU backend (the GPU machine's) has per-tensor scales only
        if "only supports per-tensor" not in str(e):
            raise
        pytest.skip(f"this torch's CPU _scaled_mm has no rowwise scales ({torch.__version__}); the GPU test "
                    "tests/test_kernel_profiles_gpu.py runs the real kernel")
    assert_grouped_gemm_close(from_torch_scaled_mm(a, b.t(), sa, sb, out), profile="CUBLAS_FP8")


# ------------------------------------------------------------------ operands from kernels' own layouts


def test_kernel_operand_fp8_scales_in_deepgemm_layouts():
    rng = np.random.default_rng(4)
    codes = rng.standard_normal((5, 256)).astype(ml_dtypes.float8_e4m3fn)
    s = np.array([[0.5, 2.0]] * 5, np.float32) * np.arange(1, 6, dtype=np.float32)[:, None]
    want = codes.astype(np.float64) * np.repeat(s.astype(np.float64), 128, axis=1)
    for sc, kw in ((s, {}), (to_mn_major_tma_aligned(s), {}), (torch.from_numpy(to_mn_major_tma_aligned(s)), {})):
        assert np.array_equal(kernel_operand(codes, sc, **kw).dequantize(), want)
    p2 = np.array([[0.5, 4.0]] * 5, np.float32)  # powers of two: packed UE8M0 words (DeepGEMM SM100)
    want2 = codes.astype(np.float64) * np.repeat(p2.astype(np.float64), 128, axis=1)
    assert np.array_equal(kernel_operand(codes, pack_ue8m0(p2)).dequantize(), want2)
    with pytest.raises(ValueError, match="do not fit an operand"):
        kernel_operand(codes, np.ones((5, 3), np.float32))


def test_kernel_operand_nvfp4_swizzled_with_global_encode_factor():
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 16, (3, 32)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # element 2i in the low nibble
    sc = np.array([[1.0, 0.5], [2.0, 0.75], [3.0, 448.0]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    want = np.array(E2M1)[codes] * np.repeat(sc.astype(np.float64), 16, axis=1) * (1.0 / 896.0)
    op = kernel_operand(packed, swizzle_128x4(sc), element="e2m1", scale_layout="swizzled_128x4", global_encode=896.0)
    assert np.array_equal(op.dequantize(), want)
    t = torch.from_numpy(packed).view(torch.float4_e2m1fn_x2)
    assert np.array_equal(kernel_operand(t, sc, global_decode=1 / 896.0).dequantize(), want)
    with pytest.raises(ValueError, match="element='e2m1'"):
        kernel_operand(packed, sc)
    ops = kernel_expert_operands(np.stack([packed, packed]), np.stack([sc, sc]), element="e2m1",
                                 global_decode=np.array([1.0, 2.0]))
    assert np.array_equal(ops[1].dequantize(), 2 * np.array(E2M1)[codes] * np.repeat(sc.astype(np.float64), 16, 1))


def test_vllm_fp8_block_adapter_reads_w1_scale():
    lw = make_layer(3, 256, 128, seed=2)
    rng = np.random.default_rng(6)
    w1 = np.stack(lw.w13).astype(ml_dtypes.float8_e4m3fn)
    w2 = np.stack(lw.w2).astype(ml_dtypes.float8_e4m3fn)
    s1 = (rng.integers(1, 4, (3, 2, 2)) / 64).astype(np.float32)
    s2 = (rng.integers(1, 4, (3, 2, 1)) / 64).astype(np.float32)
    qc = SimpleNamespace(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128], w1_scale=s1, w2_scale=s2,
                         per_act_token_quant=False)
    x = torch.from_numpy(make_tokens(4, 256)).bfloat16()
    kw = from_vllm_fused_experts(x, w1, w2, np.full((4, 2), 0.5, np.float32), np.array([[0, 2]] * 4), "silu", qc)
    w = kw["weights"].w13[1]
    assert np.array_equal(w.dequantize(), w1[1].astype(np.float64) * np.repeat(np.repeat(s1[1], 128, 0), 128, 1))
    assert kw["quant"].a1.scheme.block == (1, 128) and kw["quant"].a1.scheme.preset.name == "vllm"
    assert run_moe(**kw).out.shape == (4, 256)


# ------------------------------------------------------------------ reproducers, CLI, mutation score


def test_reproducer_round_trip_and_replay(tmp_path):
    ki = _layer()
    out = eager_bf16_moe(**ki.torch(), bug="tail_slot")
    st, js = save_reproducer(tmp_path / "case", ki.layer_case(), out, "TORCH_EAGER_BF16", label="x", extra={"a": 1})
    case, cand, prof, cfg = load_reproducer(js)
    assert prof == "TORCH_EAGER_BF16" and cfg["extra"] == {"a": 1} and isinstance(case, LayerCase)
    assert np.array_equal(cand, out.float().numpy())
    r1 = replay(st)
    r0 = compare(out, ki.reference(), "TORCH_EAGER_BF16")
    assert np.array_equal(r1.violations, r0.violations) and np.array_equal(r1.bound, r0.bound)
    with pytest.raises(ValueError, match="missing"):
        load_reproducer(tmp_path / "nothing.json")


def test_reproducer_keeps_fp8_quantizers(tmp_path):
    from moeref.moe import MoEQuant, quantize_weights, quantizer
    from moeref.quant import fp8_block, fp8_group, fp8_per_tensor

    lw = quantize_weights(make_layer(2, 256, 128, seed=0), fp8_block())
    q = MoEQuant(fp8_group(128), quantizer(fp8_per_tensor(), scale=0.25), "mixed")
    case = LayerCase(make_tokens(3, 256), lw, np.full((3, 1), 1.0, np.float32), np.array([[0], [1], [0]]),
                     dict(quant=q, out_dtype="bfloat16"))
    ref = run_moe(case.hidden, lw, case.topk_weights, case.topk_ids, quant=q, out_dtype="bfloat16")
    save_reproducer(tmp_path / "q", case, ref.out, "BF16_OUTPUT")
    r = replay(tmp_path / "q.json")
    assert r.passed and np.array_equal(r.error, np.abs(ref.out.astype(np.float64) - ref.output))


def test_cli_check_and_replay(tmp_path, capsys):
    from safetensors.torch import save_file

    from moeref.cli import main

    ki = _layer()
    t = ki.torch()
    save_file({k: v.contiguous() for k, v in t.items()}, str(tmp_path / "in.safetensors"))
    save_file({"out": eager_bf16_moe(**t)}, str(tmp_path / "good.safetensors"))
    save_file({"out": eager_bf16_moe(**t, bug="tail_slot")}, str(tmp_path / "bad.safetensors"))
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "good.safetensors"),
                 "--kernel", "torch"]) == 0
    assert "profile TORCH_EAGER_BF16: suggested" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "bad.safetensors"),
                 "--profile", "TORCH_EAGER_BF16"]) == 1
    assert "FAIL" in capsys.readouterr().out
    save_reproducer(tmp_path / "r", ki.layer_case(), eager_bf16_moe(**t, bug="tail_slot"), "TORCH_EAGER_BF16")
    assert main(["replay", str(tmp_path / "r.json")]) == 1
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "none.npy")]) == 2


def test_cli_check_and_replay_json(tmp_path, capsys):
    """``--json``: one strict-JSON object with the verdict, the profile and the worst rows; the
    exit status as without it."""
    import json

    from safetensors.torch import save_file

    from moeref.cli import main

    ki = _layer()
    t = ki.torch()
    save_file({k: v.contiguous() for k, v in t.items()}, str(tmp_path / "in.safetensors"))
    save_file({"out": eager_bf16_moe(**t)}, str(tmp_path / "good.safetensors"))
    bad = eager_bf16_moe(**t, bug="tail_slot")
    save_file({"out": bad}, str(tmp_path / "bad.safetensors"))
    capsys.readouterr()
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "good.safetensors"),
                 "--kernel", "torch", "--json"]) == 0
    good = json.loads(capsys.readouterr().out)
    assert good["passed"] is True and good["violations"] == 0 and good["worst"] == []
    assert good["profile"] == "TORCH_EAGER_BF16" and good["profile_choice"].startswith("suggested")
    assert good["shape"] == list(ki.hidden.shape) and set(good["metrics"]) >= {"rel_l2", "cosine"}
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "bad.safetensors"),
                 "--profile", "TORCH_EAGER_BF16", "--json"]) == 1
    out = capsys.readouterr().out
    failed = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert failed["passed"] is False and failed["violations"] > 0
    assert failed["profile_choice"] == "given" and failed["rows_with_violations"] >= len(failed["worst"]) > 0
    worst = failed["worst"][0]
    assert worst["ratio"] == "inf" or worst["ratio"] > 1  # beyond its bound
    assert worst["token"] in range(ki.hidden.shape[0]) and worst["slot"] is not None
    save_reproducer(tmp_path / "r", ki.layer_case(), bad, "TORCH_EAGER_BF16")
    assert main(["replay", str(tmp_path / "r.json"), "--json"]) == 1
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["passed"] is False and replayed["violations"] == failed["violations"]


def _torch_kernel(ki):
    return eager_bf16_moe(**ki.torch(), w13_layout=ki.w13_layout)


def test_mutation_score_of_bound_check_and_of_a_loose_tolerance():
    cases = [_layer(seed=s) for s in range(3)]
    strong = mutation_score(_torch_kernel, cases, profile="TORCH_EAGER_BF16")
    assert not strong.baseline_failures and not strong.errors
    assert strong.score == 1.0 and strong.tried["top-k slot dropped"] == 3
    assert strong.tried["scale from the neighbouring block"] == 0  # float weights: one scale, not applicable

    # vLLM's test scale (hidden randn/10, weights /15: outputs below 1e-2) under its atol=2e-2, rtol=0 check
    from dataclasses import replace

    lw = make_layer(6, 128, 64, seed=0)
    r = softmax_topk(np.random.default_rng(5).standard_normal((13, 6)), 3, renormalize=True)
    small = kernel_inputs(make_tokens(13, 128, seed=1) / 10, replace(lw, w2=[w / 15 for w in lw.w2]), r.weights, r.ids)

    def vllm_check(ki, out):  # out: the kernel's bf16 tensor, as mutation_score hands it over
        ref = torch.from_numpy(ki.reference().out.astype(np.float32))
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)

    weak = mutation_score(_torch_kernel, [small], vllm_check)
    assert weak.caught["output row 0 unwritten (NaN)"] == 1 and weak.caught["all-zero output"] == 0
    assert weak.score < 0.5
    assert mutation_score(_torch_kernel, [small], profile="TORCH_EAGER_BF16").score == 1.0
    assert "mutation score" in weak.summary()


def test_equivalent_mutants_are_not_counted():
    ki = _layer(top_k=1)
    ki = ki.with_(topk_weights=np.ones_like(ki.topk_weights))   # weight 1: applying it twice changes nothing
    res = mutation_score(_torch_kernel, [ki], profile="TORCH_EAGER_BF16")
    assert res.equivalent == 1 and res.tried["router weights applied twice"] == 0 and res.score == 1.0


def test_cli_mutate(tmp_path, monkeypatch, capsys):
    from moeref.cli import main

    (tmp_path / "mykernel.py").write_text(
        "from kernels_for_tests import eager_bf16_moe\n"
        "def run(ki):\n    return eager_bf16_moe(**ki.torch())\n")
    monkeypatch.chdir(tmp_path)
    assert main(["mutate", "mykernel:run", "--cases", "2", "--profile", "TORCH_EAGER_BF16", "--min-score", "1.0"]) == 0
    assert "mutation score" in capsys.readouterr().out
    assert main(["mutate", "mykernel:run", "--cases", "2", "--profile", "TORCH_EAGER_BF16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["score"] == 1.0 and res["caught"] == res["tried"] == sum(f["tried"] for f in res["faults"]) > 0
    assert res["baseline_failures"] == [] and res["errors"] == []


def test_nvfp4_adapters_read_packed_weights_swizzled_scales_and_alphas():
    """FlashInfer quant_scales and vLLM's NVFP4 quant_config give the layer whose weights are the
    QuantizedTensors the packed bytes came from (alphas given in float64: 1 / (a_gscale * w_gscale))."""
    from moeref.moe import MoEQuant, quantizer
    from moeref.quant import nvfp4, quantize

    lw = make_layer(3, 64, 32, seed=7)
    qw13 = [quantize(w, nvfp4(preset="vllm")) for w in lw.w13]  # 1x16 blocks per row (vLLM scaled_fp4_quant)
    qw2 = [quantize(w, nvfp4(preset="vllm")) for w in lw.w2]
    x = make_tokens(5, 64, seed=8)
    tw, ids = np.full((5, 2), 0.5, np.float32), np.array([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]])
    a1g, a2g = np.float32(448 * 6 / np.abs(x).max()), np.float32(64.0)

    def stack(qs):
        return (np.stack([q.codes for q in qs]),
                np.stack([swizzle_128x4(q.scales.view(ml_dtypes.float8_e4m3fn), out="2d") for q in qs]),
                np.array([q.global_scale for q in qs]))

    c13, s13, g13 = stack(qw13)
    c2, s2, g2 = stack(qw2)
    alphas1, alphas2 = g13 / float(a1g), g2 / float(a2g)     # decode_w / a_gscale = 1 / (a_gscale * w_gscale)
    want = run_moe(x, replace_weights(lw, qw13, qw2), tw, ids,
                   quant=MoEQuant(quantizer(nvfp4(preset="vllm"), global_scale=a1g),
                                  quantizer(nvfp4(preset="vllm"), global_scale=a2g))).output
    w31 = [np.concatenate([c[32:], c[:32]]) for c in c13]    # FlashInfer fc1 = [w3 (up); w1 (gate)] rows
    s31 = np.stack([swizzle_128x4(np.concatenate([q.scales[32:], q.scales[:32]]).view(ml_dtypes.float8_e4m3fn),
                                  out="2d") for q in qw13])
    kw = from_flashinfer_cutlass(x, ids, tw, np.stack(w31), c2, None, [a1g, s31, alphas1, a2g, s2, alphas2])
    np.testing.assert_allclose(run_moe(**kw).output, want, rtol=1e-12, atol=1e-12)
    qc = SimpleNamespace(quant_dtype="nvfp4", w1_scale=s13, w2_scale=s2, a1_gscale=a1g, a2_gscale=a2g,
                         g1_alphas=alphas1, g2_alphas=alphas2)
    kw = from_vllm_fused_experts(x, c13, c2, tw, ids, "silu", qc, weight_scale_layout="swizzled_128x4")
    np.testing.assert_allclose(run_moe(**kw).output, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="6 entries"):
        from_flashinfer_cutlass(x, ids, tw, np.stack(w31), c2, None, [a1g])


def replace_weights(lw, w13, w2):
    from dataclasses import replace

    return replace(lw, w13=w13, w2=w2)


@pytest.mark.parametrize("mode", ["per_channel", "per_tensor"])
def test_vllm_fp8_per_channel_and_per_tensor_scales(mode):
    lw = make_layer(2, 128, 64, seed=3)
    w1 = np.stack(lw.w13).astype(ml_dtypes.float8_e4m3fn)
    w2 = np.stack(lw.w2).astype(ml_dtypes.float8_e4m3fn)
    if mode == "per_channel":
        s1, s2 = np.full((2, 128, 1), 0.5, np.float32), np.full((2, 128, 1), 0.25, np.float32)
        s1[1, 7, 0] = 2.0
        qc = SimpleNamespace(quant_dtype="float8_e4m3fn", w1_scale=s1, w2_scale=s2, per_act_token_quant=True,
                             per_out_ch_quant=True)
    else:
        s1, s2 = np.array([0.5, 2.0], np.float32), np.array([0.25, 0.125], np.float32)
        qc = SimpleNamespace(quant_dtype=torch.float8_e4m3fn, w1_scale=s1, w2_scale=s2, a1_scale=np.float32(0.03125),
                             a2_scale=np.float32(0.0625))
    kw = from_vllm_fused_experts(make_tokens(3, 128), w1, w2, np.ones((3, 1), np.float32), np.array([[1]] * 3),
                                 "silu", qc)
    w = kw["weights"].w13[1].dequantize()
    if mode == "per_channel":
        assert w[7, 5] == float(w1[1, 7, 5]) * 2.0 and w[8, 5] == float(w1[1, 8, 5]) * 0.5
        assert kw["quant"].a1.scheme.block == (1, None)
    else:
        assert np.array_equal(w, w1[1].astype(np.float64) * 2.0)
        assert kw["quant"].a1.scheme.block == (None, None)
    assert np.isfinite(run_moe(**kw).output).all()


def test_torch_scaled_grouped_mm_adapter_rowwise_scales():
    """torch._scaled_grouped_mm has no CPU kernel: a stand-in computes its contract (FP8 rows of expert e
    times mat_b[e], rowwise scale_a [R] and scale_b [E, N], FP32 accumulation, bf16 out)."""
    from moeref.moe.mapping import from_torch_scaled_grouped_mm

    rng = np.random.default_rng(9)
    a = torch.from_numpy(rng.standard_normal((10, 128)).astype(np.float32)).to(torch.float8_e4m3fn)
    b = torch.from_numpy(rng.standard_normal((2, 32, 128)).astype(np.float32)).to(torch.float8_e4m3fn)
    sa = torch.from_numpy((rng.integers(1, 4, 10) / 8).astype(np.float32))
    sb = torch.from_numpy((rng.integers(1, 4, (2, 32)) / 4).astype(np.float32))
    offs = torch.tensor([4, 9], dtype=torch.int32)
    out = torch.zeros(10, 32)
    for e, (s, t) in enumerate(((0, 4), (4, 9))):
        out[s:t] = (a[s:t].float() @ b[e].float().T) * sa[s:t, None] * sb[e][None, :]
    out = out.bfloat16()
    call = from_torch_scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs, out=out)
    assert call.row_expert.tolist() == [0] * 4 + [1] * 5 + [-1]
    assert_grouped_gemm_close(call, profile="CUBLAS_FP8")
    out[6, 3] = -out[6, 3] + 1
    with pytest.raises(MoEMismatch, match="row 6"):
        assert_grouped_gemm_close(from_torch_scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs, out=out),
                                  profile="CUBLAS_FP8")


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


def test_cli_check_fp8_block_weights_and_flashinfer_names(tmp_path, capsys):
    from safetensors.torch import save_file

    from moeref.cli import main
    from moeref.moe import MoEQuant
    from moeref.quant import fp8_group

    lw = make_layer(3, 256, 128, seed=2)
    w1 = torch.from_numpy(np.stack(lw.w13)).to(torch.float8_e4m3fn)
    w2 = torch.from_numpy(np.stack(lw.w2)).to(torch.float8_e4m3fn)
    s1, s2 = torch.full((3, 2, 2), 1 / 64), torch.full((3, 2, 1), 1 / 32)
    x = torch.from_numpy(make_tokens(4, 256)).bfloat16()
    tw, ids = torch.full((4, 2), 0.5), torch.tensor([[0, 2]] * 4, dtype=torch.int32)
    weights = replace_weights(lw, kernel_expert_operands(w1, s1, block=(128, 128)),
                              kernel_expert_operands(w2, s2, block=(128, 128)))
    q = fp8_group(128, preset="vllm")
    out = run_moe(x, weights, tw.numpy(), ids.numpy(), quant=MoEQuant(q, q), out_dtype="bfloat16").out
    save_file(dict(hidden_states=x, w1=w1, w2=w2, topk_weights=tw, topk_ids=ids, w1_scale=s1, w2_scale=s2),
              str(tmp_path / "fp8.safetensors"))
    save_file({"out": torch.from_numpy(out.astype(np.float32)).bfloat16()}, str(tmp_path / "out.safetensors"))
    assert main(["check", str(tmp_path / "fp8.safetensors"), str(tmp_path / "out.safetensors"),
                 "--block-shape", "128,128"]) == 0
    assert "profile DEEPGEMM_FP8: suggested from the dtypes (weights float8_e4m3fn" in capsys.readouterr().out
    ki = _layer()
    t = ki.torch()
    w31 = torch.cat([t["w1"][:, 64:], t["w1"][:, :64]], dim=1)
    save_file(dict(input=t["hidden_states"], fc1_expert_weights=w31, fc2_expert_weights=t["w2"],
                   token_final_scales=t["topk_weights"], token_selected_experts=t["topk_ids"]),
              str(tmp_path / "fi.safetensors"))
    save_file({"out": eager_bf16_moe(**t)}, str(tmp_path / "fi_out.safetensors"))
    assert main(["check", str(tmp_path / "fi.safetensors"), str(tmp_path / "fi_out.safetensors"),
                 "--profile", "TORCH_EAGER_BF16"]) == 0
    save_file(dict(x=t["hidden_states"]), str(tmp_path / "bad.safetensors"))
    assert main(["check", str(tmp_path / "bad.safetensors"), str(tmp_path / "fi_out.safetensors")]) == 2
    assert "has no hidden tensor (looked for hidden_states" in capsys.readouterr().err
