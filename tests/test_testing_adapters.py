"""moeref.testing's adapters on the CPU: stand-ins with real kernels' signatures (tests/kernels_for_tests.py)
and the real CPU torch functions, read through moeref.moe.mapping and checked against the reference; operands
read from kernels' own scale layouts (moeref.gemm.from_kernel)."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels_for_tests import cutlass_fused_moe, deepgemm_contiguous, eager_bf16_moe, fused_experts, sglang_fused_moe
from moeref.gemm.from_kernel import kernel_expert_operands, kernel_operand
from moeref.layouts import pack_ue8m0, swizzle_128x4, to_mn_major_tma_aligned
from moeref.moe import make_layer, make_tokens, run_moe
from moeref.moe.mapping import (from_deepgemm_contiguous, from_deepgemm_masked, from_flashinfer_cutlass,
                                from_sglang_fused_moe, from_torch_grouped_mm, from_torch_scaled_mm,
                                from_vllm_fused_experts, from_vllm_modular_kernel)
from moeref.testing import MoEMismatch, assert_grouped_gemm_close, assert_moe_close, grouped_gemm_report
from testing_api_cases import layer_inputs, replace_weights

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # OCP MX table


# ------------------------------------------------------------------ adapters (stand-ins of the same signatures)


def test_vllm_fused_experts_adapter_with_expert_map():
    ki = layer_inputs(e=6)
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
    ki = layer_inputs()
    t = ki.torch()
    pf = SimpleNamespace(activation_format=SimpleNamespace(name="BatchedExperts"))
    fe = SimpleNamespace(quant_config=None)
    kw = from_vllm_modular_kernel(pf, fe, **t)
    assert kw["layout"] == "batched"
    assert_moe_close(eager_bf16_moe(**t), run_moe(**kw), "TORCH_EAGER_BF16")


def test_flashinfer_cutlass_adapter_up_gate_and_ep():
    ki = layer_inputs(e=6)
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
    ki = layer_inputs()
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


def test_nvfp4_adapters_read_packed_weights_swizzled_scales_and_alphas():
    """FlashInfer quant_scales and vLLM's NVFP4 quant_config give the layer whose weights are the
    QuantizedTensors the packed bytes came from (alphas given in float64: 1 / (a_gscale * w_gscale))."""
    from moeref.moe import MoEQuant, quantizer
    from moeref.quant import nvfp4, quantize

    lw = make_layer(3, 64, 32, seed=7)
    qw13 = [quantize(w, nvfp4(preset="nvfp4_vllm")) for w in lw.w13]  # 1x16 blocks per row (vLLM scaled_fp4_quant)
    qw2 = [quantize(w, nvfp4(preset="nvfp4_vllm")) for w in lw.w2]
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
                   quant=MoEQuant(quantizer(nvfp4(preset="nvfp4_vllm"), global_scale=a1g),
                                  quantizer(nvfp4(preset="nvfp4_vllm"), global_scale=a2g))).output
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
