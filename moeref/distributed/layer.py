"""The fused-MoE layer expert-parallel: dispatch -> local experts (exact engine) -> combine.

:func:`ep_fused_moe` is :func:`moeref.moe.fused_moe` split over a process group. Each rank routes its
own tokens, :func:`~moeref.distributed.ep_dispatch` sends them to the ranks owning their experts,
every rank runs the **public** pipeline stages on what it received (:func:`moeref.moe.prepare` with
the received rows as tokens and their local ids, :func:`moeref.moe.experts` with its local weights
``weights.select(placement.local_logical_experts(rank))``), and
:func:`~moeref.distributed.ep_combine` returns each slot's output to its source rank, which weights
and sums in slot order with the function the single-process finalize uses.

**Bit-identity.** The output on every rank equals, bit for bit, its rows of the single-process
``fused_moe`` of all ranks' tokens (rank 0's first, then rank 1's, ...) with the full layer, for any
world size, placement and routing, because every step is per row and the final reduction is the
same function (:func:`moeref.dispatch.weight_and_reduce`) in the same order. What "per row" needs:

* **Exact GEMMs** (quantized weights and quantized ``a1``/``a2``: :func:`moeref.gemm.block_gemm`'s
  partial dots are exact and its segment sum has a fixed order): a row's result does not depend on
  the other rows of the call, so any placement qualifies, redundant replicas included.
* **Float operands** (unquantized weights or activations): the K-sum is float64-accurate and has a
  fixed order per output element (:func:`moeref.gemm.block_gemm`), so a row's result does not depend
  on the other rows of the call either: any placement qualifies, redundant replicas included, and the
  shared experts (run on each source rank's own tokens) give the single-process bits.
* Activation quantizers that are row-local (per token, 1xG groups, MX blocks) or static. A dynamic
  per-*tensor* scale is computed over the rows a rank holds, so, like vLLM's chunks, it depends on
  the split (the single-process reference differs the same way under ``chunk_size``).
* ``combine_dtype=None``: a bf16 combine rounds each slot's output first (a different, declared
  arithmetic).

``quantize_before_dispatch=True`` quantizes the input with ``quant.a1`` on the source rank and sends
codes and scales (DeepEP low-latency FP8 dispatch, vLLM's block-FP8 DeepEP path); the destination's
``a1`` stage passes them through. With a row-local ``a1`` this is bit-identical too.
``apply_router_weight_on_input`` (top-1) scales the input on the source before dispatch
(:func:`moeref.dispatch.apply_router_weight_on_input`) and the combine only sums. Shared experts
run on the source rank on its own tokens (they are replicated, never dispatched).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .._checks import as_float_array, check_ndim
from ..dispatch import apply_router_weight_on_input as _weight_input
from ..moe.pipeline import NO_QUANT, MoEQuant, _dtype, experts, finalize, prepare
from ..moe.weights import MoEWeights, SharedExperts
from .combine import ep_combine
from .dispatch import ep_dispatch
from .group import EPGroup
from .placement import EPPlacement

__all__ = ["ep_fused_moe", "local_weights"]


def local_weights(weights: MoEWeights, placement: EPPlacement, rank: int) -> MoEWeights:
    """The experts of ``rank`` from the full layer's ``weights`` (one per logical expert)."""
    if weights.num_experts != placement.num_logical:
        raise ValueError(f"weights has {weights.num_experts} experts but the placement has "
                         f"{placement.num_logical} logical experts")
    return weights.select(placement.local_logical_experts(rank))


def _pass_through(qt):
    """An ``a1`` quantizer that returns rows already quantized on the source rank."""

    def run(x):
        if tuple(np.shape(x)) != tuple(qt.shape):
            raise ValueError(f"received quantized rows have shape {qt.shape} but prepare got {np.shape(x)}")
        return qt

    return run


def ep_fused_moe(hidden, weights: MoEWeights, topk_weights, topk_ids, placement: EPPlacement, group: EPGroup, *,
                 activation: str = "silu_and_mul", activation_params: dict | None = None,
                 quant: MoEQuant = NO_QUANT, mode: str = "normal", layout: str = "standard",
                 quantize_before_dispatch: bool = False, apply_router_weight_on_input: bool = False,
                 shared_experts: SharedExperts | None = None, out_dtype=None, combine_dtype=None,
                 gemm1_out_dtype=None, act_out_dtype=None, gemm: Callable | None = None, alignment: int = 128,
                 max_tokens_per_rank: int | None = None, max_recv_tokens: int | None = None,
                 weights_are_local: bool = False) -> np.ndarray:
    """This rank's rows of the fused-MoE layer, computed expert-parallel (module docstring).

    Args:
        hidden: float ``[T, H]`` this rank's tokens. topk_weights: float ``[T, k]``. topk_ids: int
            ``[T, k]`` **logical** expert ids (-1 padding); mapped to physical ids with
            :meth:`EPPlacement.to_physical` when the placement has redundant experts.
        weights: the full layer (one entry per logical expert), or this rank's local experts with
            ``weights_are_local=True`` (in local-id order).
        placement, group: as for :func:`~moeref.distributed.ep_dispatch`.
        mode: ``"normal"`` or ``"low_latency"`` dispatch (same output). layout: the layout the local
            experts run in (``"standard"``, ``"contiguous"``, ``"masked"``, ``"batched"``; same output).
        quant, activation, activation_params, gemm1_out_dtype, act_out_dtype, gemm, alignment,
        shared_experts, apply_router_weight_on_input, out_dtype: as :func:`moeref.moe.fused_moe`.
        combine_dtype: dtype the expert outputs travel back in (None: float64, exact).
        max_tokens_per_rank, max_recv_tokens: dispatch bounds (:func:`~moeref.distributed.ep_dispatch`).

    Returns float64 ``[T, H]`` (or ``out_dtype``, rounded once).
    """
    x = as_float_array(hidden, "hidden")
    check_ndim(x, 2, "hidden")
    w = np.asarray(as_float_array(topk_weights, "topk_weights"))
    me = group.rank
    if isinstance(placement, EPPlacement) and placement.ep_size == group.world_size:
        mine = weights if weights_are_local else local_weights(weights, placement, me)
        if weights_are_local and mine.num_experts != placement.num_local(me):
            raise ValueError(f"rank {me}: weights_are_local=True but weights has {mine.num_experts} experts and "
                             f"the placement puts {placement.num_local(me)} on this rank")
        ids = placement.to_physical(topk_ids)
    else:  # let ep_dispatch raise the same error on every rank
        mine, ids = None, topk_ids
    if quantize_before_dispatch and (quant.a1 is None or quant.a1.scheme is None or quant.a1.static):
        raise ValueError("quantize_before_dispatch=True needs quant.a1 to be a moeref.quant.Scheme (no static "
                         "arguments: the dispatch quantizes each row on its own)")
    # a row mismatch is left to ep_dispatch, which raises it on every rank (weighting would raise on this one only)
    weigh = apply_router_weight_on_input and w.ndim == 2 and w.shape[0] == x.shape[0]
    x_send = _weight_input(x, w) if weigh else x
    d = ep_dispatch(x_send, ids, w, placement, group, mode=mode,
                    quant=quant.a1.scheme if quantize_before_dispatch else None,
                    max_tokens_per_rank=max_tokens_per_rank, max_recv_tokens=max_recv_tokens)
    n_local = placement.num_local(me)
    h = x.shape[1]
    if mode == "normal":
        rows_x, rows_ids, rows_w = d.x, d.topk_idx, d.topk_weights
        out_shape = (d.num_recv, d.topk_idx.shape[1], h)
    else:
        e_loc, cap = d.src_info.shape
        rows_x = None if d.x is None else d.x.reshape(e_loc * cap, h)
        slot_expert = np.where(d.src_info >= 0, np.arange(e_loc)[:, None], -1).reshape(-1, 1)
        rows_ids, rows_w = slot_expert, np.ones(slot_expert.shape, np.float32)
        out_shape = (e_loc, cap, h)
    y_slots = np.zeros((int(np.prod(out_shape[:-1])), h), dtype=np.float64)
    if n_local and (rows_ids >= 0).any():
        q = quant
        if quantize_before_dispatch:
            xq = d.xq if mode == "normal" else _flatten_rows(d.xq, rows_ids.shape[0], h)
            q = MoEQuant(a1=_pass_through(xq), a2=quant.a2, name=quant.name)
            rows_x = np.zeros((rows_ids.shape[0], h), dtype=np.float32)  # shapes only: a1 passes xq through
        p = prepare(rows_x, rows_w, rows_ids, num_experts=n_local, layout=layout, quant=q, alignment=alignment)
        e = experts(p, mine, activation=activation, activation_params=activation_params, quant=quant,
                    gemm1_out_dtype=gemm1_out_dtype, act_out_dtype=act_out_dtype, gemm=gemm)
        valid = p.src >= 0
        y_slots[p.src[valid]] = e.y[valid]
    routed = ep_combine(y_slots.reshape(out_shape), d, group, combine_dtype=combine_dtype,
                        apply_weights=not apply_router_weight_on_input)
    output = routed
    if shared_experts is not None:
        n = x.shape[0]
        kw = dict(activation=activation, activation_params=activation_params, quant=quant,
                  gemm1_out_dtype=gemm1_out_dtype, act_out_dtype=act_out_dtype, gemm=gemm)
        sp = prepare(x, np.ones((n, 1), np.float32), np.zeros((n, 1), np.int32), num_experts=1, quant=quant)
        output = routed + finalize(sp, experts(sp, shared_experts.as_weights(), **kw))
    return output if out_dtype is None else output.astype(_dtype(out_dtype))


def _flatten_rows(qt, rows: int, h: int):
    from ..quant import QuantizedTensor

    return QuantizedTensor(qt.codes.reshape(rows, -1), qt.scales.reshape(rows, -1), qt.scheme, (rows, h))
