"""The fused-MoE layer on the GPU: ``prepare -> grouped GEMM1 -> activation (+ quantization) -> grouped
GEMM2 -> weight-and-reduce``, the semantics of :func:`moeref.moe.fused_moe`, contiguous layout.

Stages (each an existing fast path or :mod:`fastpath.grouped_gemm`):

1. input quantization (``quant.a1``: FP8 1x128 FP32 scales, :func:`fastpath.quant.quantize`) of the token
   rows, then the DeepGEMM contiguous layout (:func:`fastpath.dispatch.to_contiguous`: counting sort,
   ``alignment``-row expert segments, ``m_indices`` with -1 padding, ``src`` slot per row); the rows
   (codes and scales) are gathered by ``src``;
2. GEMM1 ``h = a @ W13[e].T`` (``impl``: ``"triton"`` or ``"deep_gemm"``), stored bf16;
3. activation in FP32 and, for FP8 layers, the 1x128 re-quantization in the same kernel
   (:func:`fastpath.fused.silu_and_mul_quant_fp8`, :func:`fastpath.fused.swigluoai_quant_fp8`); float
   layers keep the activation in bf16 (:func:`fastpath.fused.silu_and_mul` / ``swigluoai``);
4. GEMM2 ``y = xq @ W2[e].T``, stored bf16;
5. ``out[t] = sum_j w[t, j] y[slot t*k+j]`` (:func:`fastpath.dispatch.weight_and_reduce`, FP32 sum in
   slot order), stored in ``out_dtype``.

The arithmetic it declares, for :func:`moeref.compare.compare` against the reference
(:func:`reference_config` gives the matching ``run_moe`` arguments): FP8 layers, profile
``HOPPER_FP8_DEEPGEMM_DATA`` with ``gemm1_out_dtype="bfloat16"``, ``act_out_dtype="float32"`` (the fused
kernel quantizes its FP32 activation) and the same a1/a2 schemes; float layers ``BF16_OUTPUT`` with bf16
GEMM and activation stores in the weights' dtype. Scope today: the contiguous layout (prefill and decode alike), activations
``silu_and_mul`` and ``swigluoai``, no biases, no expert map or shared experts (each refused with the
reason: nothing is silently approximated).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeref.gemm import StackedExperts

from .grouped_gemm import PROFILE_OF, grouped_gemm_contiguous, grouped_gemm_supports

__all__ = ["FastMoEWeights", "fused_moe", "reference_config", "fast_weights"]

ACTIVATIONS = ("silu_and_mul", "swigluoai")


@dataclass(frozen=True, eq=False)
class FastMoEWeights:
    """Expert weights as the GPU kernels take them: ``w13 [E, 2N, K]`` and ``w2 [E, K, N]``, either bf16/fp16
    tensors or float8_e4m3fn with FP32 128x128 block scales ``w13_scales [E, 2N/128, K/128]``,
    ``w2_scales [E, K/128, N/128]`` (DeepGEMM's and vLLM's ``w1``/``w1_scale``)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_layout: str
    w13_scales: torch.Tensor | None = None
    w2_scales: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.w13.dtype == torch.float8_e4m3fn


def fast_weights(weights, device="cuda") -> FastMoEWeights:
    """:class:`FastMoEWeights` from a :class:`moeref.moe.MoEWeights` whose stacks are FP8 128x128
    :class:`moeref.gemm.StackedExperts` with float32-representable scales, or float ``[E, N, K]`` tensors."""
    def one(ws):
        if isinstance(ws, StackedExperts):
            if ws.element != "e4m3fn" or ws.block != (128, 128):
                raise ValueError(f"the GPU layer takes E4M3 128x128 experts; got {ws.element} blocks {ws.block}")
            d = ws.to(device)
            s32 = d.scales.to(torch.float32)
            if not torch.equal(s32.to(torch.float64), d.scales):
                raise ValueError("block scales are not FP32 values (global/channel factors have no kernel here)")
            return d.codes.view(torch.float8_e4m3fn), s32
        if torch.is_tensor(ws):
            return ws.to(device), None
        return torch.stack([torch.as_tensor(np.asarray(w)) for w in ws]).to(device), None

    w13, s13 = one(weights.w13 if not isinstance(weights.w13, list) or not hasattr(weights.w13[0], "codes")
                   else StackedExperts.from_quantized(weights.w13))
    w2, s2 = one(weights.w2 if not isinstance(weights.w2, list) or not hasattr(weights.w2[0], "codes")
                 else StackedExperts.from_quantized(weights.w2))
    if getattr(weights, "b13", None) is not None or getattr(weights, "b2", None) is not None:
        raise ValueError("biases have no GPU layer yet: use moeref.moe.run_moe(device='cuda')")
    return FastMoEWeights(w13, w2, weights.w13_layout, s13, s2)


def reference_config(weights: FastMoEWeights) -> dict:
    """The :func:`moeref.moe.run_moe` keyword arguments whose declared stores match this layer, and the
    :mod:`moeref.compare` profile name under ``"profile"``."""
    from moeref.moe import MoEQuant
    from moeref.quant import fp8_group

    if weights.fp8:
        q = MoEQuant(fp8_group(), fp8_group(), "fp8 1x128")
        return dict(quant=q, gemm1_out_dtype="bfloat16", act_out_dtype="float32", out_dtype="bfloat16",
                    profile="HOPPER_FP8_DEEPGEMM_DATA")
    store = str(weights.w13.dtype).replace("torch.", "")  # float layers store h and x in the weights' dtype
    return dict(gemm1_out_dtype=store, act_out_dtype=store, out_dtype="bfloat16", profile="BF16_OUTPUT")


def fused_moe(hidden: torch.Tensor, weights: FastMoEWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              impl: str = "triton", activation: str = "silu_and_mul", activation_params: dict | None = None,
              alignment: int = 128, out_dtype=torch.bfloat16, expert_map=None, num_experts: int | None = None,
              apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """The MoE layer on the GPU (module docstring). ``hidden`` bf16 ``[M, K]``, ``topk_weights`` float
    ``[M, k]``, ``topk_ids`` int ``[M, k]`` (-1 padding); returns ``out_dtype [M, K]``."""
    from fastpath import dispatch
    from fastpath.fused import silu_and_mul_quant_fp8, swigluoai_quant_fp8
    from fastpath.quant import quantize
    from moeref.quant import fp8_group

    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} has no GPU layer; supported: {ACTIVATIONS}")
    if expert_map is not None or apply_router_weight_on_input:
        raise ValueError("expert_map / apply_router_weight_on_input have no GPU layer yet: use "
                         "moeref.moe.run_moe(device='cuda')")
    params = dict(activation_params or {})
    layout_needed = "interleaved" if activation == "swigluoai" else "gate_up"
    if weights.w13_layout != params.get("layout", layout_needed):
        raise ValueError(f"the fused {activation} kernel reads w13 in the {layout_needed!r} layout; the weights are "
                         f"{weights.w13_layout!r} (convert them with moeref.activations.convert_w13)")
    e = int(weights.w13.shape[0])
    num_experts = e if num_experts is None else num_experts
    m, k = (int(d) for d in hidden.shape)
    top_k = int(topk_ids.shape[1])
    ok, why = grouped_gemm_supports(impl, alignment=alignment)
    if not ok:
        raise ValueError(why)
    ids = topk_ids.to(hidden.device)
    lay = dispatch.to_contiguous(None, ids, num_experts, alignment)
    src = lay.src
    rows = torch.where(src >= 0, torch.div(src, top_k, rounding_mode="floor"), torch.zeros_like(src))
    scheme = fp8_group()
    if weights.fp8:
        qa = quantize(hidden, scheme)
        a = qa.codes.reshape(m, k).view(torch.float8_e4m3fn).index_select(0, rows)
        sa = qa.scales.reshape(m, -1).index_select(0, rows)
    else:
        a, sa = hidden.index_select(0, rows), None
    store = torch.bfloat16 if weights.fp8 else weights.w13.dtype
    h = grouped_gemm_contiguous(a, weights.w13, lay.m_indices, impl=impl, a_scales=sa, b_scales=weights.w13_scales,
                                alignment=alignment, out_dtype=store)
    act_kw = {key: v for key, v in params.items() if key in ("alpha", "limit")}
    if weights.fp8:
        fq = (silu_and_mul_quant_fp8(h, scheme) if activation == "silu_and_mul"
              else swigluoai_quant_fp8(h, scheme=scheme, **act_kw))
        n = int(h.shape[1]) // 2
        x = fq.codes.reshape(-1, n).view(torch.float8_e4m3fn)
        sx = fq.scales.reshape(x.shape[0], -1)
    else:
        from fastpath.fused import silu_and_mul, swigluoai

        x = (silu_and_mul(h) if activation == "silu_and_mul" else swigluoai(h, **act_kw)).to(store)
        sx = None
    y = grouped_gemm_contiguous(x, weights.w2, lay.m_indices, impl=impl, a_scales=sx, b_scales=weights.w2_scales,
                                alignment=alignment, out_dtype=store)
    return dispatch.weight_and_reduce(y, src, topk_weights.to(hidden.device), m, out_dtype=out_dtype)


def profile_of(impl: str, weights: FastMoEWeights) -> str:
    """The declared :mod:`moeref.compare` profile of ``impl`` on these weights."""
    return PROFILE_OF[(impl, "fp8_block" if weights.fp8 else "float")]
