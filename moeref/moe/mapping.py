"""How FlashInfer ``cutlass_fused_moe`` and vLLM modular-kernel arguments map onto moeref's.

Sources: FlashInfer ``flashinfer/fused_moe/core.py::cutlass_fused_moe`` and
``tests/moe/test_trtllm_cutlass_fused_moe.py`` (``fb28d72``); vLLM
``vllm/model_executor/layers/fused_moe/modular_kernel.py`` (``FusedMoEPrepareAndFinalize.prepare``,
``FusedMoEPermuteExpertsUnpermute.apply``, ``finalize``) and ``config.py::FusedMoEQuantConfig``.
Read :data:`MAPPING` as a table
(``docs/moe-pipeline.md`` prints it); :func:`from_flashinfer_cutlass` applies the unquantized part.

Scale conventions. moeref's quantized tensors carry DECODE scales (value = element * scale). vLLM and
FlashInfer pass NVFP4 global scales as ENCODE factors: ``a1_gscale = 448 * 6 / amax`` and
``g1_alphas = 1 / (a1_gscale * w1_gscale)``; moeref's exact GEMM applies every block scale and both
global decode factors inside the dot product, which equals the CUTLASS ``alpha * acc`` epilogue
exactly in real arithmetic (``tests/test_gemm.py::test_nvfp4_matches_cutlass_alpha_formulation``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .weights import MoEWeights

__all__ = ["ArgumentMapping", "MAPPING", "from_flashinfer_cutlass", "mapping_table"]


class ArgumentMapping(NamedTuple):
    """One row: the moeref argument, the FlashInfer ``cutlass_fused_moe`` argument, the vLLM
    modular-kernel argument, and what converting between them takes."""

    moeref: str
    flashinfer: str
    vllm: str
    note: str


MAPPING: tuple[ArgumentMapping, ...] = (
    ArgumentMapping("hidden [M, K]", "input", "hidden_states / a1", "same"),
    ArgumentMapping("topk_ids [M, k] (int, -1 padding)", "token_selected_experts (int32)", "topk_ids",
                    "FlashInfer ids are global; EP by ep_size/ep_rank"),
    ArgumentMapping("topk_weights [M, k]", "token_final_scales (fp32)", "topk_weights", "same"),
    ArgumentMapping("weights.w13[e] [2N, K], w13_layout", "fc1_expert_weights [E, 2N, K] = [w3 (up); w1 (gate)]",
                    "w1 [E, 2N, K] = [w1 (gate); w3 (up)]",
                    "FlashInfer: w13_layout='up_gate'; vLLM: 'gate_up'; gpt-oss checkpoints: 'interleaved'"),
    ArgumentMapping("weights.w2[e] [K, N]", "fc2_expert_weights [E, K, N]", "w2 [E, K, N]", "same"),
    ArgumentMapping("weights.b13 / weights.b2", "fc1_expert_biases / fc2_expert_biases", "w1_bias / w2_bias",
                    "b13 in the w13_layout order"),
    ArgumentMapping("activation, activation_params", "activation_type, swiglu_alpha/beta/limit",
                    "activation (MoEActivation)", "swiglu_bias(alpha, beta, limit); swigluoai = (1.702, 1, 7)"),
    ArgumentMapping("quant.a1 (Scheme or quantizer)", "quant_scales[0] a1_gscale (NVFP4) / input_sf",
                    "quant_config.a1_scale / a1_gscale, per_act_token_quant, block_shape",
                    "static scales: Scheme.static_scale or quantize(..., scale=/global_scale=)"),
    ArgumentMapping("quant.a2", "quant_scales[3] a2_gscale (NVFP4) / fc2 input quant", "a2_scale / a2_gscale",
                    "dynamic when None in vLLM"),
    ArgumentMapping("weights quantized per expert (QuantizedTensor)",
                    "quant_scales: fc1/fc2 weight block scales, g1_alphas, g2_alphas",
                    "w1_scale, w2_scale, g1_alphas, g2_alphas",
                    "alphas = 1/(a_gscale * w_gscale): decode factors multiplied in exactly"),
    ArgumentMapping("expert_map [E] (-1 non-local), weights of the local experts", "ep_size, ep_rank (linear)",
                    "expert_map, global_num_experts", "moeref.routing.expert_map(..., 'linear')"),
    ArgumentMapping("apply_router_weight_on_input (top-1)", "-", "apply_router_weight_on_input",
                    "weight applied once, on the input (vLLM PR #43694: not twice)"),
    ArgumentMapping("layout", "- (permutes internally)", "activation format Standard / BatchedExperts",
                    "'standard' | 'contiguous' (DeepGEMM) | 'masked' (DeepEP LL) | 'batched'"),
    ArgumentMapping("chunk_size", "tune_max_num_tokens (tuning only)", "VLLM_FUSED_MOE_CHUNK_SIZE",
                    "output invariant to chunk size"),
    ArgumentMapping("shared_experts", "- (separate)", "SharedFusedMoE shared_experts", "plain MLP added, weight 1"),
    ArgumentMapping("out_dtype", "output_dtype", "hidden_states dtype", "one rounding at the end"),
    ArgumentMapping("prepare()", "-", "FusedMoEPrepareAndFinalize.prepare", "quantize a1, dispatch"),
    ArgumentMapping("experts()", "-", "FusedMoEPermuteExpertsUnpermute.apply", "GEMM1, activation, a2, GEMM2"),
    ArgumentMapping("finalize()", "-", "FusedMoEPrepareAndFinalize.finalize (TopKWeightAndReduce)",
                    "weight and reduce in slot order"),
)


def mapping_table() -> str:
    """:data:`MAPPING` as a Markdown table."""
    rows = ["| moeref | FlashInfer cutlass_fused_moe | vLLM modular kernel | note |", "|---|---|---|---|"]
    rows += [f"| {r.moeref} | {r.flashinfer} | {r.vllm} | {r.note} |" for r in MAPPING]
    return "\n".join(rows)


def from_flashinfer_cutlass(input, token_selected_experts, token_final_scales, fc1_expert_weights,
                            fc2_expert_weights, *, fc1_expert_biases=None, fc2_expert_biases=None,
                            activation: str = "silu_and_mul", activation_params=None, output_dtype=None) -> dict:
    """Keyword arguments of :func:`moeref.moe.fused_moe` for an unquantized FlashInfer call.

    ``fc1_expert_weights [E, 2N, K]`` is ``[w3 (up); w1 (gate)]``, so ``w13_layout="up_gate"``.
    """
    w31 = np.asarray(fc1_expert_weights)
    w2 = np.asarray(fc2_expert_weights)
    weights = MoEWeights([w31[e] for e in range(w31.shape[0])], [w2[e] for e in range(w2.shape[0])], "up_gate",
                         fc1_expert_biases, fc2_expert_biases)
    return dict(hidden=input, weights=weights, topk_weights=token_final_scales, topk_ids=token_selected_experts,
                activation=activation, activation_params=activation_params, out_dtype=output_dtype)
