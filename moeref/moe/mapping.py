"""How real kernels' arguments map onto moeref's: the table (FlashInfer ``cutlass_fused_moe``, vLLM
modular kernel) and adapters that take a kernel's own call arguments and return moeref's.

Adapters (tested on the CPU with stand-ins of the same signatures, on the GPU with the real kernels):

* MoE layers -> keyword arguments of :func:`moeref.moe.run_moe` / :func:`~moeref.moe.fused_moe`:
  :func:`from_vllm_fused_experts` (also the modular kernel's ``FusedMoEModularKernel.forward``, whose
  arguments are the same, and :func:`from_vllm_modular_kernel` for the batched activation format),
  :func:`from_sglang_fused_moe`, :func:`from_flashinfer_cutlass`.
* Grouped GEMMs -> a :class:`GroupedGemmCall` (operands, row -> expert map, the kernel's output) for
  :func:`moeref.testing.assert_grouped_gemm_close`: :func:`from_deepgemm_contiguous`,
  :func:`from_deepgemm_masked`, :func:`from_torch_grouped_mm`, :func:`from_torch_scaled_grouped_mm`,
  :func:`from_torch_scaled_mm`.

Quantized operands are read in the kernel's own layouts by :func:`moeref.gemm.from_kernel.kernel_operand`.

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

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import _interop
from ..gemm.from_kernel import kernel_expert_operands, kernel_operand
from .weights import MoEWeights

__all__ = ["ArgumentMapping", "MAPPING", "GroupedGemmCall", "VLLM_ACTIVATIONS", "from_deepgemm_contiguous",
           "from_deepgemm_masked", "from_flashinfer_cutlass", "from_sglang_fused_moe", "from_torch_grouped_mm",
           "from_torch_scaled_grouped_mm", "from_torch_scaled_mm", "from_vllm_fused_experts",
           "from_vllm_modular_kernel", "mapping_table"]


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


VLLM_ACTIVATIONS = {"silu": "silu_and_mul", "gelu": "gelu_and_mul", "swigluoai": "swigluoai",
                    "swiglustep": "swiglustep", "relu2_no_mul": "relu2_no_mul", "silu_no_mul": "silu_no_mul",
                    "gelu_no_mul": "gelu_no_mul"}
"""vLLM / SGLang activation names (``MoEActivation`` values, ``activation="silu"``) -> moeref's."""


def _arr(x, name: str):
    """NumPy view of a tensor (exact: bf16/fp8 keep their values), None passes."""
    return None if x is None else np.asarray(_interop.to_numpy(x))


def _activation(name, table=VLLM_ACTIVATIONS) -> str:
    name = getattr(name, "value", name)  # an Enum member (vLLM MoEActivation)
    name = str(name).lower()
    if name in table:
        return table[name]
    if name in table.values():
        return name
    raise ValueError(f"activation {name!r} has no moeref equivalent; accepted: {', '.join(table)}")


def _quant_name(quant_dtype) -> str | None:
    if quant_dtype is None:
        return None
    return str(quant_dtype).replace("torch.", "").lower()


def _fp8_activation_scheme(block_shape, per_act_token_quant: bool, static_scale):
    """vLLM's activation quantizer (``moe_kernel_quantize_input``): per-token-group (``block_shape``),
    per-token or per-tensor, dynamic unless a static scale is given; the ``vllm`` preset."""
    from ..quant import fp8_group, fp8_per_tensor, fp8_per_token
    from .pipeline import quantizer

    if block_shape is not None:
        return fp8_group(int(block_shape[1]), preset="vllm")
    if per_act_token_quant:
        return fp8_per_token(preset="vllm")
    if static_scale is not None:
        return quantizer(fp8_per_tensor(preset="vllm"), scale=float(np.asarray(_arr(static_scale, "a_scale"),
                                                                                np.float64).reshape(-1)[0]))
    return fp8_per_tensor(preset="vllm")


def _nvfp4_quantizer(gscale, name: str):
    from ..quant import nvfp4
    from .pipeline import quantizer

    if gscale is None:
        raise ValueError(f"NVFP4 needs {name} (the activation's global ENCODE factor, 448 * 6 / amax)")
    g = np.asarray(_arr(gscale, name), dtype=np.float32).reshape(-1)
    return quantizer(nvfp4(preset="nvfp4_vllm"), global_scale=g[0])


def _vllm_layer(hidden_states, w1, w2, topk_weights, topk_ids, activation, qc: dict, apply_router_weight_on_input,
                global_num_experts, expert_map, w13_layout: str = "gate_up", weight_scale_layout: str = "linear"):
    from .pipeline import MoEQuant

    qd = _quant_name(qc.get("quant_dtype"))
    block = qc.get("block_shape")
    block = None if block is None else tuple(int(b) for b in block)
    e = int(w1.shape[0])
    if qd is None:
        w13 = [_arr(w1[i], "w1") for i in range(e)]
        w2l = [_arr(w2[i], "w2") for i in range(int(w2.shape[0]))]
        quant = MoEQuant()
    elif qd in ("float8_e4m3fn", "fp8"):
        per_out = bool(qc.get("per_out_ch_quant", False))
        wblock = block if block is not None else ((1, 0) if per_out else None)
        w13 = kernel_expert_operands(w1, qc.get("w1_scale"), block=_resolve(wblock), name="w1")
        w2l = kernel_expert_operands(w2, qc.get("w2_scale"), block=_resolve(wblock), name="w2")
        a1 = _fp8_activation_scheme(block, bool(qc.get("per_act_token_quant", False)), qc.get("a1_scale"))
        a2 = _fp8_activation_scheme(block, bool(qc.get("per_act_token_quant", False)), qc.get("a2_scale"))
        kind = f"block {block}" if block else "per-token" if qc.get("per_act_token_quant") else "per-tensor"
        quant = MoEQuant(a1, a2, f"fp8 {kind}")
    elif qd == "nvfp4":
        a1g, a2g = qc.get("a1_gscale"), qc.get("a2_gscale")
        g1 = np.asarray(_arr(qc.get("g1_alphas"), "g1_alphas"), np.float64).reshape(-1)
        g2 = np.asarray(_arr(qc.get("g2_alphas"), "g2_alphas"), np.float64).reshape(-1)
        a1f = float(np.asarray(_arr(a1g, "a1_gscale"), np.float64).reshape(-1)[0])
        a2f = float(np.asarray(_arr(a2g, "a2_gscale"), np.float64).reshape(-1)[0])
        # alpha = 1 / (a_gscale * w_gscale) -> weight decode factor = alpha * a_gscale (exact in float64)
        w13 = kernel_expert_operands(w1, qc.get("w1_scale"), element="e2m1", block=(1, 16),
                                     scale_layout=weight_scale_layout, global_decode=g1 * a1f, name="w1")
        w2l = kernel_expert_operands(w2, qc.get("w2_scale"), element="e2m1", block=(1, 16),
                                     scale_layout=weight_scale_layout, global_decode=g2 * a2f, name="w2")
        quant = MoEQuant(_nvfp4_quantizer(a1g, "a1_gscale"), _nvfp4_quantizer(a2g, "a2_gscale"), "nvfp4")
    else:
        raise ValueError(f"quant_dtype {qc.get('quant_dtype')!r} is not mapped; accepted: None, float8_e4m3fn, "
                         "'nvfp4'")
    b1, b2 = qc.get("w1_bias"), qc.get("w2_bias")
    weights = MoEWeights(w13, w2l, w13_layout, _arr(b1, "w1_bias"), _arr(b2, "w2_bias"))
    emap = _arr(expert_map, "expert_map")
    num = int(global_num_experts) if global_num_experts is not None and int(global_num_experts) > 0 else None
    if emap is not None and num is None:
        num = int(emap.size)
    return dict(hidden=_arr(hidden_states, "hidden_states"), weights=weights,
                topk_weights=_arr(topk_weights, "topk_weights"), topk_ids=_arr(topk_ids, "topk_ids"),
                activation=_activation(activation), quant=quant, expert_map=emap, num_experts=num,
                apply_router_weight_on_input=bool(apply_router_weight_on_input),
                out_dtype=_out_dtype(hidden_states))


def _resolve(block):
    """A vLLM ``block_shape [bn, bk]`` as an operand block; ``(1, 0)``: per output channel (all of K)."""
    if block is None:
        return None
    return block if block[1] else (1, 1 << 40)


def _out_dtype(x):
    """The output dtype a kernel writes: that of the tensor ``x`` (or ``x`` itself, a dtype), in moeref's
    spelling (``"bfloat16"``, float16, float32); None (float64) for anything else."""
    dt = x if not hasattr(x, "shape") else x.dtype
    name = str(getattr(dt, "name", dt)).replace("torch.", "")
    return {"bfloat16": "bfloat16", "float16": np.float16, "float32": np.float32}.get(name)


_QC_FIELDS = ("quant_dtype", "per_act_token_quant", "per_out_ch_quant", "block_shape", "w1_scale", "w2_scale",
              "a1_scale", "a2_scale", "a1_gscale", "a2_gscale", "g1_alphas", "g2_alphas", "w1_bias", "w2_bias")


def _quant_config_fields(quant_config) -> dict:
    if quant_config is None:
        return {}
    return {f: getattr(quant_config, f) for f in _QC_FIELDS if getattr(quant_config, f, None) is not None}


def from_vllm_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu", quant_config=None,
                            apply_router_weight_on_input: bool = False, global_num_experts: int = -1,
                            expert_map=None, *, weight_scale_layout: str = "linear") -> dict:
    """Keyword arguments of :func:`moeref.moe.run_moe` for a vLLM ``fused_experts`` call (the same
    arguments as ``FusedMoEModularKernel.forward``).

    vLLM ``vllm/model_executor/layers/fused_moe/fused_moe.py::fused_experts(hidden_states, w1, w2,
    topk_weights, topk_ids, activation, quant_config, apply_router_weight_on_input, global_num_experts,
    expert_map)``: ``w1 [E, 2N, K]`` is ``[w1 (gate); w3 (up)]`` (``w13_layout="gate_up"``), ``w2 [E, K, N]``.
    ``quant_config`` (``FusedMoEQuantConfig``) is read by attribute: ``quant_dtype`` (None,
    ``torch.float8_e4m3fn`` or ``"nvfp4"``), ``block_shape``, ``per_act_token_quant``,
    ``per_out_ch_quant``, ``w1_scale``/``w2_scale`` (FP8: per tensor ``[E]``, per channel ``[E, 2N, 1]``,
    blocks ``[E, 2N/bn, K/bk]``; NVFP4: E4M3 block scales, linear or ``weight_scale_layout=
    "swizzled_128x4"``), ``a1_scale``/``a2_scale`` (static FP8), ``a1_gscale``/``a2_gscale`` and
    ``g1_alphas``/``g2_alphas`` (NVFP4), ``w1_bias``/``w2_bias``. The activation quantizers follow vLLM's
    ``moe_kernel_quantize_input`` (the ``vllm`` preset). ``out_dtype`` is ``hidden_states``' dtype.
    """
    return _vllm_layer(hidden_states, w1, w2, topk_weights, topk_ids, activation, _quant_config_fields(quant_config),
                       apply_router_weight_on_input, global_num_experts, expert_map,
                       weight_scale_layout=weight_scale_layout)


def from_vllm_modular_kernel(prepare_finalize, fused_experts, hidden_states, w1, w2, topk_weights, topk_ids,
                             activation="silu", global_num_experts: int = -1, expert_map=None,
                             apply_router_weight_on_input: bool = False, **kw) -> dict:
    """:func:`from_vllm_fused_experts` for a ``FusedMoEModularKernel(prepare_finalize, fused_experts)``:
    the quantization comes from ``fused_experts.quant_config`` (``FusedMoEPermuteExpertsUnpermute``) and
    the layout from ``prepare_finalize.activation_format`` (``Standard`` -> ``"standard"``,
    ``BatchedExperts`` -> ``"batched"``); the output does not depend on the layout, the reference's
    trace then holds the rows as that format lays them out."""
    fmt = str(getattr(getattr(prepare_finalize, "activation_format", None), "name",
                      getattr(prepare_finalize, "activation_format", "Standard")))
    layout = "batched" if "batched" in fmt.lower() else "standard"
    out = from_vllm_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                  getattr(fused_experts, "quant_config", None), apply_router_weight_on_input,
                                  global_num_experts, expert_map, **kw)
    out["layout"] = layout
    return out


def from_sglang_fused_moe(hidden_states, w1, w2, topk_output, moe_runner_config=None, b1=None, b2=None,
                          use_fp8_w8a8: bool = False, use_int8_w8a8: bool = False, use_int8_w8a16: bool = False,
                          use_int4_w4a16: bool = False, per_channel_quant: bool = False, w1_scale=None,
                          w2_scale=None, w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None,
                          block_shape=None) -> dict:
    """Keyword arguments of :func:`moeref.moe.run_moe` for SGLang's ``fused_moe`` / ``fused_experts``
    (``python/sglang/srt/layers/moe/fused_moe_triton/fused_moe.py``): ``topk_output`` is
    ``(topk_weights, topk_ids, router_logits)``; ``moe_runner_config`` supplies ``activation``
    (``"silu"``/``"gelu"``), ``apply_router_weight_on_input``, ``routed_scaling_factor`` (must be None or
    1: moeref applies none) and ``num_experts``. Weights as vLLM (``w1 = [gate; up]``). FP8 w8a8 only
    (block, per-channel or per-tensor); the INT8/INT4 paths raise."""
    if use_int8_w8a8 or use_int8_w8a16 or use_int4_w4a16 or w1_zp is not None or w2_zp is not None:
        raise ValueError("from_sglang_fused_moe maps unquantized and FP8 w8a8 calls; INT8/INT4 paths are not mapped")
    topk_weights, topk_ids = topk_output[0], topk_output[1]
    cfg = moe_runner_config
    scaling = getattr(cfg, "routed_scaling_factor", None)
    if scaling not in (None, 1, 1.0):
        raise ValueError(f"routed_scaling_factor={scaling}: scale topk_weights by it before the reference")
    qc = dict(w1_bias=b1, w2_bias=b2)
    if use_fp8_w8a8:
        qc.update(quant_dtype="float8_e4m3fn", block_shape=block_shape, per_act_token_quant=per_channel_quant,
                  per_out_ch_quant=per_channel_quant, w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale,
                  a2_scale=a2_scale)
    return _vllm_layer(hidden_states, w1, w2, topk_weights, topk_ids, getattr(cfg, "activation", "silu"),
                       {k: v for k, v in qc.items() if v is not None}, getattr(cfg, "apply_router_weight_on_input",
                                                                              False),
                       getattr(cfg, "num_experts", None), None)


def from_flashinfer_cutlass(input, token_selected_experts, token_final_scales, fc1_expert_weights,
                            fc2_expert_weights, output_dtype=None, quant_scales=None, *, fc1_expert_biases=None,
                            fc2_expert_biases=None, input_sf=None, swiglu_alpha=None, swiglu_beta=None,
                            swiglu_limit=None, ep_size: int = 1, ep_rank: int = 0, activation: str = "silu_and_mul",
                            activation_params=None, weight_scale_layout: str = "swizzled_128x4") -> dict:
    """Keyword arguments of :func:`moeref.moe.run_moe` for a FlashInfer ``cutlass_fused_moe`` call
    (``flashinfer/fused_moe/core.py``).

    ``fc1_expert_weights [E_local, 2N, K]`` is ``[w3 (up); w1 (gate)]``, so ``w13_layout="up_gate"``;
    ``token_selected_experts`` are global ids; ``ep_size``/``ep_rank`` place the local experts linearly
    (:func:`moeref.routing.expert_map`). ``swiglu_alpha/beta/limit`` select ``swiglu_bias``.
    ``output_dtype`` (torch or NumPy dtype) is the output's; None keeps the float64 output.

    ``quant_scales`` None: unquantized. NVFP4 (``fc1_expert_weights`` packed ``uint8 [E, 2N, K/2]``):
    the six entries ``[a1_gscale, fc1 weight block scales, g1_alphas, a2_gscale, fc2 weight block scales,
    g2_alphas]`` (E4M3 scales, 128x4-swizzled by default); ``input`` is the unquantized activation and
    ``input_sf`` (if given) must equal ``a1_gscale``.
    """
    from .pipeline import MoEQuant

    e_local = int(fc1_expert_weights.shape[0])
    if quant_scales is None:
        w31 = _arr(fc1_expert_weights, "fc1_expert_weights")
        w2 = _arr(fc2_expert_weights, "fc2_expert_weights")
        w13 = [w31[e] for e in range(w31.shape[0])]
        w2l = [w2[e] for e in range(w2.shape[0])]
        quant = MoEQuant()
    else:
        if len(quant_scales) != 6:
            raise ValueError(f"NVFP4 quant_scales must have 6 entries [a1_gscale, fc1 scales, g1_alphas, a2_gscale, "
                             f"fc2 scales, g2_alphas]; got {len(quant_scales)}")
        a1g, w1s, g1, a2g, w2s, g2 = quant_scales
        a1f = float(np.asarray(_arr(a1g, "a1_gscale"), np.float64).reshape(-1)[0])
        a2f = float(np.asarray(_arr(a2g, "a2_gscale"), np.float64).reshape(-1)[0])
        if input_sf is not None and float(np.asarray(_arr(input_sf, "input_sf"), np.float64).reshape(-1)[0]) != a1f:
            raise ValueError("input_sf differs from quant_scales[0] (a1_gscale): pass the unquantized input")
        g1 = np.asarray(_arr(g1, "g1_alphas"), np.float64).reshape(-1)
        g2 = np.asarray(_arr(g2, "g2_alphas"), np.float64).reshape(-1)
        w13 = kernel_expert_operands(fc1_expert_weights, w1s, element="e2m1", block=(1, 16),
                                     scale_layout=weight_scale_layout, global_decode=g1 * a1f, name="fc1")
        w2l = kernel_expert_operands(fc2_expert_weights, w2s, element="e2m1", block=(1, 16),
                                     scale_layout=weight_scale_layout, global_decode=g2 * a2f, name="fc2")
        quant = MoEQuant(_nvfp4_quantizer(a1g, "a1_gscale"), _nvfp4_quantizer(a2g, "a2_gscale"), "nvfp4")
    params = dict(activation_params or {})
    if swiglu_alpha is not None or swiglu_beta is not None or swiglu_limit is not None:
        activation = "swiglu_bias"
        for key, v in (("alpha", swiglu_alpha), ("beta", swiglu_beta), ("limit", swiglu_limit)):
            if v is not None:
                params[key] = float(np.asarray(_arr(v, key), np.float64).reshape(-1)[0])
    weights = MoEWeights(w13, w2l, "up_gate", _arr(fc1_expert_biases, "fc1_expert_biases"),
                         _arr(fc2_expert_biases, "fc2_expert_biases"))
    out = dict(hidden=_arr(input, "input"), weights=weights,
               topk_weights=_arr(token_final_scales, "token_final_scales"),
               topk_ids=_arr(token_selected_experts, "token_selected_experts"), activation=activation,
               activation_params=params or None, quant=quant,
               out_dtype=None if output_dtype is None else _out_dtype(output_dtype))
    if int(ep_size) > 1:
        from ..routing import expert_map

        out["expert_map"] = expert_map(e_local * int(ep_size), int(ep_size), int(ep_rank), "linear")
        out["num_experts"] = e_local * int(ep_size)
    return out


# ---------------------------------------------------------------------------------- grouped GEMMs


@dataclass(frozen=True, eq=False)
class GroupedGemmCall:
    """One grouped-GEMM call in moeref's terms: ``out[r] = a[r] @ weights[row_expert[r]].T`` for rows with
    ``row_expert[r] >= 0``; other rows are padding (unspecified in every kernel, never compared).

    ``a``: :class:`~moeref.gemm.exact.BlockOperand` ``[R, K]``; ``weights``: per-expert operands ``[N, K]``;
    ``row_expert``: int64 ``[R]``; ``out``: the kernel's output as ``[R, N]`` (NumPy, its dtype kept) or
    None; ``layout``: the kernel's name for its layout (labels only)."""

    a: object
    weights: list
    row_expert: np.ndarray
    out: object = None
    layout: str = "contiguous"


def _pair(x, name: str, **kw):
    """``(elements, scales)`` pair or a dense tensor -> operand."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{name} must be a tensor or an (elements, scales) pair; got {len(x)} items")
        return x[0], x[1]
    return x, None


def _rows_of(x):
    return None if x is None else np.asarray(_interop.to_numpy(x))


def from_deepgemm_contiguous(a, b, d=None, m_indices=None, **kw) -> GroupedGemmCall:
    """DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, m_indices)``: ``a`` e4m3 ``[M, K]``
    with ``sa`` float32 ``[M, K/128]`` (1x128, any strides) or packed UE8M0 int32; ``b`` e4m3 ``[E, N, K]``
    with ``sb`` float32 ``[E, N/128, K/128]`` (128x128) or packed; ``d`` bf16 ``[M, N]``; ``m_indices``
    int32 ``[M]`` (-1: padding rows). ``kw`` go to :func:`~moeref.gemm.from_kernel.kernel_operand`."""
    if m_indices is None:
        raise ValueError("m_indices is required (int32 [M], -1 for padding rows)")
    ax, asc = _pair(a, "a")
    bx, bsc = _pair(b, "b")
    rows = _rows_of(m_indices).astype(np.int64).reshape(-1)
    op = kernel_operand(ax, asc, name="a", **kw)
    if rows.size != op.shape[0]:
        raise ValueError(f"m_indices has {rows.size} entries but a has {op.shape[0]} rows")
    return GroupedGemmCall(op, kernel_expert_operands(bx, bsc, name="b", **kw), rows, _rows_of(d), "contiguous")


def from_deepgemm_masked(a, b, d=None, masked_m=None, expected_m=None, **kw) -> GroupedGemmCall:
    """DeepGEMM ``m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, masked_m, expected_m)``: ``a`` e4m3
    ``[E, max_m, K]`` with ``sa [E, max_m, K/128]``; ``masked_m`` int32 ``[E]`` valid rows per expert
    (rows past it are padding); ``d`` bf16 ``[E, max_m, N]`` (read as ``[E * max_m, N]``). ``expected_m``
    is a scheduling hint (must be > 0 for DeepGEMM; not used by the reference)."""
    if masked_m is None:
        raise ValueError("masked_m is required (int32 [E], valid rows per expert)")
    if expected_m is not None and int(expected_m) <= 0:
        raise ValueError(f"expected_m must be > 0 (DeepGEMM asserts it); got {expected_m}")
    ax, asc = _pair(a, "a")
    bx, bsc = _pair(b, "b")
    e, max_m, k = (int(v) for v in ax.shape)
    counts = _rows_of(masked_m).astype(np.int64).reshape(-1)
    if counts.size != e or np.any((counts < 0) | (counts > max_m)):
        raise ValueError(f"masked_m must hold {e} counts in [0, {max_m}]; got {counts.tolist()}")
    rows = np.where(np.arange(max_m)[None, :] < counts[:, None], np.arange(e)[:, None], -1).reshape(-1)
    a2 = ax.reshape(e * max_m, k)
    s2 = None if asc is None else (asc.reshape(e * max_m, -1) if len(asc.shape) == 3 else asc)
    out = _rows_of(d)
    return GroupedGemmCall(kernel_operand(a2, s2, name="a", **kw), kernel_expert_operands(bx, bsc, name="b", **kw),
                           rows, None if out is None else out.reshape(e * max_m, -1), "masked")


def _offs_rows(offs, r: int) -> np.ndarray:
    ends = _rows_of(offs).astype(np.int64).reshape(-1)
    if np.any(np.diff(ends) < 0) or (ends.size and (ends[0] < 0 or ends[-1] > r)):
        raise ValueError(f"offs must be non-decreasing cumulative row ends within [0, {r}]; got {ends.tolist()}")
    rows = np.full(r, -1, dtype=np.int64)
    start = 0
    for e, end in enumerate(ends.tolist()):  # a loop over experts
        rows[start:end] = e
        start = end
    return rows


def _weights_kn(mat_b, name: str) -> np.ndarray:
    """``[E, K, N]`` (torch's ``mat_b``, usually a transposed view) -> ``[E, N, K]`` values."""
    b = np.asarray(_interop.to_numpy(mat_b))
    if b.ndim != 3:
        raise ValueError(f"{name} must be [E, K, N]; got shape {b.shape}")
    return np.swapaxes(b, 1, 2)


def from_torch_grouped_mm(mat_a, mat_b, offs=None, bias=None, out=None) -> GroupedGemmCall:
    """``torch._grouped_mm(mat_a [R, K], mat_b [E, K, N], offs)`` (bf16, CUTLASS on Hopper): ``offs`` int32
    ``[E]`` cumulative row ends, rows ``offs[e-1]:offs[e]`` belong to expert ``e``, rows past ``offs[-1]``
    are padding. ``out``: the result ``[R, N]``."""
    if bias is not None:
        raise ValueError("torch._grouped_mm takes no bias in this mapping (add it to the reference instead)")
    if offs is None:
        raise ValueError("offs is required (2-D x 3-D grouped_mm)")
    a = kernel_operand(mat_a, name="mat_a")
    w = _weights_kn(mat_b, "mat_b")
    weights = [kernel_operand(np.ascontiguousarray(w[e]), name=f"mat_b[{e}]") for e in range(w.shape[0])]
    return GroupedGemmCall(a, weights, _offs_rows(offs, a.shape[0]), _rows_of(out), "offsets")


def from_torch_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, out=None, **kw) -> GroupedGemmCall:
    """``torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=bf16)``: rowwise FP8,
    ``mat_a`` e4m3 ``[R, K]`` with ``scale_a`` float32 ``[R]``, ``mat_b`` e4m3 ``[E, K, N]`` with
    ``scale_b`` float32 ``[E, N]``; ``offs`` as :func:`from_torch_grouped_mm`."""
    if offs is None:
        raise ValueError("offs is required (2-D x 3-D scaled_grouped_mm)")
    sa = np.asarray(_interop.to_numpy(scale_a), np.float32).reshape(-1, 1)
    a = kernel_operand(mat_a, sa, block=(1, 1 << 40), name="mat_a")
    w = _weights_kn(mat_b, "mat_b")
    sb = np.asarray(_interop.to_numpy(scale_b), np.float32)
    if sb.shape != (w.shape[0], w.shape[1]):
        raise ValueError(f"scale_b must be [E, N] = {(w.shape[0], w.shape[1])}; got {sb.shape}")
    weights = [kernel_operand(np.ascontiguousarray(w[e]), sb[e].reshape(-1, 1), block=(1, 1 << 40),
                              name=f"mat_b[{e}]") for e in range(w.shape[0])]
    return GroupedGemmCall(a, weights, _offs_rows(offs, a.shape[0]), _rows_of(out), "offsets")


def from_torch_scaled_mm(a, b, scale_a, scale_b, out=None) -> GroupedGemmCall:
    """``torch._scaled_mm(a [M, K], b [K, N], scale_a, scale_b, out_dtype=...)``: FP8 with tensorwise
    (scalar) or rowwise (``[M, 1]`` and ``[1, N]``) float32 scales, as one group."""
    sa = np.asarray(_interop.to_numpy(scale_a), np.float32)
    sb = np.asarray(_interop.to_numpy(scale_b), np.float32)
    op = kernel_operand(a, sa if sa.size == 1 else sa.reshape(-1, 1), block=None if sa.size == 1 else (1, 1 << 40),
                        name="a")
    bt = np.ascontiguousarray(np.asarray(_interop.to_numpy(b)).T)
    w = kernel_operand(bt, sb if sb.size == 1 else sb.reshape(-1, 1), block=None if sb.size == 1 else (1, 1 << 40),
                       name="b")
    return GroupedGemmCall(op, [w], np.zeros(op.shape[0], dtype=np.int64), _rows_of(out), "standard")
