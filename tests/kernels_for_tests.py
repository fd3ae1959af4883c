"""Hand-written torch kernels with the signatures of real ones, for the CPU tests of moeref.testing and the
adapters (the GPU tests run the real DeepGEMM and torch kernels). Each is written from the kernel's
documented contract, not from moeref's reference."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

BF16 = torch.bfloat16


def eager_bf16_moe(hidden_states, w1, w2, topk_weights, topk_ids, *, w13_layout="gate_up", bug=None):
    """A bf16 MoE layer in eager torch: per slot and expert, bf16 matmuls, ``silu(gate) * up`` (rounded
    twice), the routed weight multiplied in fp32 and rounded to bf16, slots summed in bf16 in slot order.
    ``bug="tail_slot"``: tokens of the last partial tile of 8 lose their last slot (M % 8 != 0)."""
    x = hidden_states.to(BF16)
    m, _ = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros_like(x)
    for j in range(k):
        contrib = torch.zeros_like(x)
        for e in torch.unique(topk_ids[:, j]).tolist():
            if e < 0:
                continue
            rows = (topk_ids[:, j] == e).nonzero().flatten()
            if bug == "tail_slot" and j == k - 1 and m % 8:
                rows = rows[rows < m - m % 8]
            h = x[rows] @ w1[e].to(BF16).T
            if w13_layout == "gate_up":
                gate, up = h.chunk(2, dim=-1)
            else:
                up, gate = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
            y = a @ w2[e].to(BF16).T
            contrib[rows] = (y.float() * topk_weights[rows, j, None].float()).to(BF16)
        out = out + contrib
    return out


def fp32_sum_bf16_moe(hidden_states, w1, w2, topk_weights, topk_ids, *, bug=None):
    """A bf16 MoE layer in eager torch with BF16_OUTPUT's arithmetic: bf16 matmuls (FP32 accumulation, bf16
    stores), ``silu(gate) * up`` in float32 stored once in bf16, the weighted top-k sum in float32, one bf16
    store. ``bug="last_bit"``: the last bit of output element ``[0, 0]`` flipped; ``"rz_gemm2_store"``: GEMM2's
    output stored in bf16 rounding toward zero (its FP32 result's low 16 bits cut); ``"bf16_k_blocks"``: each
    GEMM's FP32 sums of 32-column K blocks added in a bf16 accumulator."""
    x = hidden_states.to(BF16)
    out = torch.zeros(x.shape, dtype=torch.float32)

    def mm(a, w):
        if bug != "bf16_k_blocks":
            return a @ w.T
        acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32)
        for s in range(0, a.shape[1], 32):
            acc = (acc + a[:, s:s + 32].float() @ w[:, s:s + 32].float().T).to(BF16).float()
        return acc.to(BF16)

    for j in range(topk_ids.shape[1]):
        for e in torch.unique(topk_ids[:, j]).tolist():
            if e < 0:
                continue
            rows = (topk_ids[:, j] == e).nonzero().flatten()
            gate, up = mm(x[rows], w1[e].to(BF16)).chunk(2, dim=-1)
            a = (F.silu(gate.float()) * up.float()).to(BF16)
            if bug == "rz_gemm2_store":
                y32 = a.float() @ w2[e].to(BF16).float().T
                y = (y32.contiguous().view(torch.int32) & -65536).view(torch.float32)
            else:
                y = mm(a, w2[e].to(BF16)).float()
            out[rows] += y * topk_weights[rows, j, None].float()
    out = out.to(BF16)
    if bug == "last_bit":
        out.view(torch.int16)[0, 0] ^= 1
    return out


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", quant_config=None,
                  apply_router_weight_on_input=False, global_num_experts=-1, expert_map=None):
    """Stand-in with vLLM ``fused_experts``' signature (unquantized bf16, expert_map supported)."""
    assert activation == "silu" and quant_config is None and not apply_router_weight_on_input
    ids = topk_ids.long()
    if expert_map is not None:
        ids = torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], ids)
    return eager_bf16_moe(hidden_states, w1, w2, topk_weights, ids)


def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
                      output_dtype, quant_scales=None, fc1_expert_biases=None, fc2_expert_biases=None,
                      input_sf=None, swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None, tp_size=1, tp_rank=0,
                      ep_size=1, ep_rank=0):
    """Stand-in with FlashInfer ``cutlass_fused_moe``'s leading arguments: fc1 = [w3 (up); w1 (gate)],
    global ids with linear EP placement."""
    e_local = fc1_expert_weights.shape[0]
    ids = token_selected_experts.long() - ep_rank * e_local
    ids = torch.where((ids >= 0) & (ids < e_local), ids, torch.full_like(ids, -1))
    return eager_bf16_moe(input, fc1_expert_weights, fc2_expert_weights, token_final_scales, ids,
                          w13_layout="up_gate").to(output_dtype)


def sglang_fused_moe(hidden_states, w1, w2, topk_output, moe_runner_config=None, b1=None, b2=None,
                     use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                     per_channel_quant=False, w1_scale=None, w2_scale=None, w1_zp=None, w2_zp=None, a1_scale=None,
                     a2_scale=None, block_shape=None):
    """Stand-in with SGLang ``fused_moe``'s signature (unquantized)."""
    topk_weights, topk_ids, _ = topk_output
    return eager_bf16_moe(hidden_states, w1, w2, topk_weights, topk_ids.long())


def _truncate(x: np.ndarray, bits: int) -> np.ndarray:
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(m * 2.0**bits) / 2.0**bits, e)


def deepgemm_contiguous(a, b, d, m_indices, *, bug=None, promote=128, mma_k=32, bits=14):
    """Stand-in of DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, m_indices)`` on the CPU:
    per row's expert, per 32-column MMA an exact product added to an accumulator truncated to ``bits``
    bits, promoted every ``promote`` columns times the 1x128 / 128x128 scales into an FP32 sum; bf16 ``d``.
    ``promote=None``: never promoted (cuBLAS fast accumulation). ``bug="last_k_scale"``: the last, partial
    K block uses the previous block's weight scale."""
    (ax, sa), (bx, sb) = a, b
    av = ax.float().double().numpy()
    bv = bx.float().double().numpy()
    sa, sb = sa.double().numpy(), sb.double().numpy()
    mi = m_indices.numpy()
    k = av.shape[1]
    promote = k if promote is None else promote
    out = np.zeros((av.shape[0], bv.shape[1]), dtype=np.float32)
    for e in np.unique(mi[mi >= 0]).tolist():
        rows = np.flatnonzero(mi == e)
        acc32 = np.zeros((rows.size, bv.shape[1]), dtype=np.float32)
        for s in range(0, k, promote):
            acc = np.zeros_like(acc32, dtype=np.float64)
            for t in range(s, min(s + promote, k), mma_k):
                t1 = min(t + mma_k, s + promote, k)
                acc = _truncate(acc + av[rows, t:t1] @ bv[e][:, t:t1].T, bits)
            blk = s // 128
            wblk = blk - 1 if (bug == "last_k_scale" and blk == (k - 1) // 128 and k % 128 and blk) else blk
            scale = sa[rows, blk][:, None] * np.repeat(sb[e][:, wblk], 128)[: bv.shape[1]][None, :]
            acc32 = acc32 + (acc * scale).astype(np.float32)
        out[rows] = acc32
    d.copy_(torch.from_numpy(out).to(d.dtype))
    return d


def scaled_mm_fast_accum(a, b, scale_a, scale_b, out_dtype=BF16, *, bits=14, mma_k=32):
    """Stand-in of ``torch._scaled_mm(a, b, scale_a, scale_b, use_fast_accum=True)`` (rowwise): a ~14-bit
    truncating accumulator over all of K, never promoted, scales applied in the epilogue."""
    av = a.float().double().numpy()
    bv = b.float().double().numpy()  # [K, N]
    k = av.shape[1]
    acc = np.zeros((av.shape[0], bv.shape[1]))
    for t in range(0, k, mma_k):
        acc = _truncate(acc + av[:, t:t + mma_k] @ bv[t:t + mma_k], bits)
    res = acc.astype(np.float32) * scale_a.numpy().astype(np.float32) * scale_b.numpy().astype(np.float32)
    return torch.from_numpy(res).to(out_dtype)
