"""The fused-MoE layer as three public stages: ``prepare -> experts -> finalize`` (vLLM modular kernel).

::

    hidden [M, K] --(router weight on input, top-1 only)--> quantize a1 --> dispatch (layout)
        |                                                                         |
        |   prepare: Prepared(a rows [R, K], row_expert [R], src [R], layout)  <--+
        v
    experts:  h = a @ W13[e].T (+b13)        GEMM1, exact per block (moeref.gemm)
              x = act(h; w13_layout)         activation, float64 (moeref.activations)
              xq = quantize a2 (x)           re-quantization: dynamic per token/group, static, NVFP4 global
              y = xq @ W2[e].T (+b2)         GEMM2, exact per block
        v
    finalize: out[t] = sum_j w[t,j] * y[slot t*k+j]   (float64, slot order), + shared experts,
              rounded once to out_dtype

Semantics (each with its source):

* Router weight on input (``apply_router_weight_on_input``): top-1 only; the input is scaled in
  float64 and rounded to float32 before quantization, and finalize only sums (vLLM
  ``torch_experts``, Llama 4; :func:`moeref.dispatch.apply_router_weight_on_input`).
* Input quantization happens in ``prepare`` over the token rows, before dispatch (vLLM
  ``MoEPrepareAndFinalizeNoEP.prepare`` -> ``moe_kernel_quantize_input``); row-wise schemes therefore
  give the same codes in every layout. A per-tensor *dynamic* scale is computed over the rows of the
  call, so it is not chunk-invariant (as in vLLM, where each chunk is quantized on its own).
* Intermediate re-quantization uses the ``a2`` quantizer on the activation output of the valid rows
  (padding rows never reach an amax). Dynamic per-token/group, static (``Scheme.static_scale``) and
  NVFP4 with a global scale are all just quantizers here.
* Padding rows (contiguous ``m_indices == -1``, masked/batched rows past the count) produce 0 and are
  never read by finalize (their ``src`` is -1).
* Everything is float64 from the exact GEMMs to the final sum (vLLM ``torch_experts`` reduces in
  fp32); the only roundings are the declared quantizers, the optional ``gemm1_out_dtype`` /
  ``act_out_dtype`` / ``gemm2_out_dtype`` stores (kernels keep these in bf16) and the final ``out_dtype``.

``gemm``: the GEMM engine, ``(a_operand, w_operand) -> float array``; :func:`moeref.gemm.block_gemm`
by default. Honest variants and planted faults (:mod:`moeref.compare.faults`) plug in here.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .._checks import as_float_array, check_choice, check_ndim, check_token_rows
from ..dispatch import apply_router_weight_on_input as _weight_input
from ..dispatch import weight_and_reduce
from ..dispatch.grouping import group_slots
from ..gemm.exact import as_operand
from ..gemm.grouped import ExpertOperands, expert_rows_gemm
from .config import LAYOUTS, NO_QUANT, LayerConfig, MoEQuant, Quantizer, quantizer
from .device import run_moe_device
from .stages import (ExpertsOutput, MoERun, Prepared, _activation, _dtype, _run_quantizer, dispatch_rows,
                     round_to_dtype)
from .weights import MoEWeights, SharedExperts

__all__ = [
    "LAYOUTS",
    "LayerConfig",
    "MoEQuant",
    "NO_QUANT",
    "Quantizer",
    "quantizer",
    "Prepared",
    "ExpertsOutput",
    "MoERun",
    "prepare",
    "experts",
    "finalize",
    "fused_moe",
    "run_moe",
    "round_to_dtype",
]

def _is_device_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and getattr(x, "device", None) is not None \
        and x.device.type != "cpu"


def prepare(hidden, topk_weights, topk_ids, *, num_experts: int, layout: str = "standard",
            quant: MoEQuant = NO_QUANT, expert_map=None, apply_router_weight_on_input: bool = False,
            alignment: int = 128, max_m: int | None = None) -> Prepared:
    """Router weight on input (top-1), input quantization, dispatch into ``layout``.

    Args:
        hidden: float ``[M, K]`` tokens. topk_weights: float ``[M, k]``. topk_ids: int ``[M, k]``
            global expert ids, -1 padding (one row per token in all three: ``ValueError`` otherwise,
            :func:`moeref._checks.check_token_rows`). num_experts: global E.
        layout: ``"standard"`` (slot rows in ``t*k+j`` order), ``"contiguous"`` (DeepGEMM,
            ``alignment`` rows per group), ``"masked"`` (``max_m`` rows per expert; default: the largest
            count), ``"batched"`` (vLLM, ``max_m`` rows per expert; default M, or the largest count
            when a token repeats an expert: each slot is a row).
    """
    check_choice(layout, LAYOUTS, "layout")
    x = as_float_array(hidden, "hidden")
    check_ndim(x, 2, "hidden")
    w = as_float_array(topk_weights, "topk_weights")
    check_ndim(w, 2, "topk_weights")
    check_token_rows(x, w, topk_ids)
    g = group_slots(topk_ids, num_experts, expert_map)
    ids = np.asarray(topk_ids)
    if apply_router_weight_on_input:
        x = _weight_input(x, w)
    a_tok, a1 = _run_quantizer(quant.a1, np.asarray(x))
    src, row_expert, disp = dispatch_rows(ids, g, num_experts=num_experts, layout=layout, expert_map=expert_map,
                                          alignment=alignment, max_m=max_m)
    rows = np.where(src >= 0, src // max(g.top_k, 1), -1)
    return Prepared(layout, a_tok.take_rows(rows), row_expert, src, disp,
                    np.asarray(w), ids, g.num_tokens, not apply_router_weight_on_input, a1)


def experts(prepared: Prepared, weights: MoEWeights, *, activation: str = "silu_and_mul",
            activation_params: dict | None = None, quant: MoEQuant = NO_QUANT,
            gemm1_out_dtype=None, act_out_dtype=None, gemm: Callable | None = None,
            gemm2_out_dtype=None) -> ExpertsOutput:
    """GEMM1 (+b13) -> activation (``weights.w13_layout``) -> re-quantize (``quant.a2``) -> GEMM2 (+b2).

    ``gemm1_out_dtype`` / ``act_out_dtype``: optional stores (e.g. ``"bfloat16"``) of the GEMM1 output
    and of the activation output, as kernels keep them (None: float64, no rounding); the ``a2``
    quantizer then receives the activation in ``act_out_dtype`` and works in its precision.
    ``gemm2_out_dtype``: an optional store of GEMM2's output (``y``, bias included) before the top-k sum.
    """
    w13 = ExpertOperands(weights.w13, "w13")
    w2 = ExpertOperands(weights.w2, "w2")
    if len(w13) < int(prepared.row_expert.max(initial=-1)) + 1:
        raise ValueError(f"the routing uses local expert {int(prepared.row_expert.max())} but weights has {len(w13)}")
    valid = prepared.row_expert >= 0
    if not valid.any():  # no row for this rank (EP shard without local experts, empty routing)
        r, k = prepared.a.values.shape
        empty = np.zeros((r, 0))
        return ExpertsOutput(np.zeros((r, k)), empty, empty, as_operand(empty), None, valid)
    h = round_to_dtype(expert_rows_gemm(prepared.a, prepared.row_expert, w13, weights.b13, gemm=gemm),
                       gemm1_out_dtype)
    x = _activation(activation, h, weights.w13_layout, activation_params)
    x[~valid] = 0.0
    x = round_to_dtype(x, act_out_dtype)
    vidx = np.flatnonzero(valid)
    # a kernel quantizes its stored activation in that dtype's working precision (fp32 for bf16/fp32)
    x_in = x[vidx] if act_out_dtype is None else x[vidx].astype(_dtype(act_out_dtype))
    xq_valid, a2 = _run_quantizer(quant.a2, x_in)
    # padding rows are zero rows of the operand (they never reach a quantizer's amax)
    pos = np.full(x.shape[0], -1, dtype=np.int64)
    pos[vidx] = np.arange(vidx.size)
    xq = xq_valid.take_rows(pos)
    y = round_to_dtype(expert_rows_gemm(xq, prepared.row_expert, w2, weights.b2, gemm=gemm), gemm2_out_dtype)
    return ExpertsOutput(y, h, x, xq, a2, valid)


def finalize(prepared: Prepared, out: ExpertsOutput, *, out_dtype=None) -> np.ndarray:
    """``out[t] = sum_j w[t, j] * y[slot t*k+j]`` in float64 (slot order, via
    :func:`moeref.dispatch.weight_and_reduce`), rounded to ``out_dtype`` (None: float64)."""
    y = weight_and_reduce(out.y, prepared.src, prepared.topk_weights, prepared.num_tokens,
                          apply_weights=prepared.apply_weights, out_dtype=np.float64)
    return round_to_dtype(y, out_dtype).astype(_dtype(out_dtype) if out_dtype is not None else np.float64)


def run_moe(hidden, weights: MoEWeights, topk_weights, topk_ids, config: LayerConfig | None = None, *,
            gemm: Callable | None = None, device=None, **options) -> MoERun:
    """:func:`fused_moe` keeping the trace of every stage (for :mod:`moeref.compare`).

    ``config``: a :class:`LayerConfig`; ``options``: its fields by name (``activation=``, ``quant=``,
    ``layout=`` ...), replacing the config's. ``device``: run on a torch device (``"cuda"``) with the device
    engine (:mod:`moeref.moe.device`: the same result bit for bit, float64 on the GPU, for production
    shapes); the default runs on the device of ``hidden`` when it is a CUDA tensor, else with NumPy.
    ``gemm``: the host GEMM engine, ``(a_operand, w_operand) -> float array`` (honest variants and planted
    faults of :mod:`moeref.compare.faults` plug in here).
    """
    cfg = LayerConfig.build(config, **options)
    if cfg.num_experts is None:
        cfg = LayerConfig.build(cfg, num_experts=weights.num_experts)
    if device is not None or _is_device_tensor(hidden):
        if gemm is not None:
            raise ValueError("gemm= (a host GEMM engine) cannot run on a device; leave device unset")
        return run_moe_device(hidden, weights, topk_weights, topk_ids, cfg, device=device)
    x = as_float_array(hidden, "hidden")
    check_ndim(x, 2, "hidden")
    check_token_rows(x, topk_weights, topk_ids)  # before chunking: a row past M would be ignored
    m = x.shape[0]
    chunk = m if cfg.chunk_size is None else cfg.chunk_size
    w = np.asarray(topk_weights)
    ids = np.asarray(topk_ids)
    kw = dict(activation=cfg.activation, activation_params=cfg.activation_params, quant=cfg.quant,
              gemm1_out_dtype=cfg.gemm1_out_dtype, act_out_dtype=cfg.act_out_dtype, gemm=gemm,
              gemm2_out_dtype=cfg.gemm2_out_dtype)
    outs, chunks, shared_chunks, shared_parts = [], [], [], []
    for start in range(0, max(m, 1), max(chunk, 1)):
        sl = slice(start, min(start + chunk, m))
        p = prepare(x[sl], w[sl], ids[sl], num_experts=cfg.num_experts, layout=cfg.layout, quant=cfg.quant,
                    expert_map=cfg.expert_map, apply_router_weight_on_input=cfg.apply_router_weight_on_input,
                    alignment=cfg.alignment, max_m=cfg.max_m)
        e = experts(p, weights, **kw)
        outs.append(finalize(p, e))
        chunks.append((p, e))
        if cfg.shared_experts is not None:
            n = sl.stop - sl.start
            sp = prepare(x[sl], np.ones((n, 1), np.float32), np.zeros((n, 1), np.int32), num_experts=1,
                         quant=cfg.quant)
            se = experts(sp, cfg.shared_experts.as_weights(), **kw)
            shared_parts.append(finalize(sp, se))
            shared_chunks.append((sp, se))
    routed = np.concatenate(outs, axis=0) if outs else np.zeros((0, 0))
    shared = np.concatenate(shared_parts, axis=0) if shared_parts else None
    output = routed + shared if shared is not None else routed
    out = output if cfg.out_dtype is None else output.astype(_dtype(cfg.out_dtype))
    return MoERun(output, out, chunks, shared, shared_chunks, cfg, weights)


def fused_moe(hidden, weights: MoEWeights, topk_weights, topk_ids, config: LayerConfig | None = None, *,
              gemm: Callable | None = None, device=None, **options):
    """The whole layer: ``prepare -> experts -> finalize`` per chunk of ``config.chunk_size`` tokens, plus
    shared experts, rounded once to ``config.out_dtype`` (None: float64). ``config`` / ``options``: a
    :class:`LayerConfig` and field overrides, as :func:`run_moe`.

    Any routing (``topk_ids`` with -1 padding), any ``layout`` (the output does not depend on it),
    ``expert_map`` (EP: ``weights`` holds this rank's local experts; non-local slots contribute 0,
    so the sum over ranks is the full layer), biases (in ``weights``), shared experts (a plain MLP,
    weight 1). The output does not depend on ``chunk_size`` unless an activation scheme has a dynamic
    per-tensor scale (computed per chunk, as in vLLM). ``device="cuda"`` (or CUDA tensors) runs the
    device engine (:mod:`moeref.moe.device`; the result is then a tensor there). Argument mapping to
    FlashInfer ``cutlass_fused_moe`` and vLLM: :mod:`moeref.moe.mapping`.

    >>> from moeref.moe.weights import make_layer
    >>> lw = make_layer(2, 4, 2, seed=0)
    >>> x = np.eye(4, dtype=np.float32)[:2]
    >>> y = fused_moe(x, lw, np.array([[1.0], [1.0]], np.float32), np.array([[0], [1]], np.int32))
    >>> y.shape, y.dtype
    ((2, 4), dtype('float64'))
    """
    return run_moe(hidden, weights, topk_weights, topk_ids, config, gemm=gemm, device=device, **options).out
