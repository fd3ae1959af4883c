"""What both engines of the MoE layer share: the stage results (:class:`Prepared`, :class:`ExpertsOutput`,
:class:`MoERun`), the routing's row bookkeeping (:func:`dispatch_rows`), the quantizer call, the stores'
roundings and the activation. The NumPy engine (:mod:`.pipeline`) and the device engine (:mod:`.device`)
import these; this module imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..activations import activation_values
from ..dispatch import to_batched, to_contiguous, to_masked
from ..gemm.exact import BlockOperand, as_operand
from .config import LayerConfig, Quantizer
from .weights import MoEWeights

__all__ = ["Prepared", "ExpertsOutput", "MoERun", "dispatch_rows", "round_to_dtype"]


def _run_quantizer(q, x: np.ndarray):
    """``(operand, quantized tensor or None)`` of ``x`` through ``q`` (None, or a :class:`Quantizer` input)."""
    q = Quantizer.of(q)
    if q is None:
        return as_operand(x, "x"), None
    qt = q(x)
    return as_operand(qt, "quantized"), qt


def round_to_dtype(x, dtype) -> np.ndarray:
    """Round float64 ``x`` to ``dtype`` (numpy/ml_dtypes name or dtype, RNE) and back to float64;
    ``None`` or float64 returns ``x``."""
    if dtype is None:
        return np.asarray(x, dtype=np.float64)
    dt = _dtype(dtype)
    if dt == np.float64:
        return np.asarray(x, dtype=np.float64)
    return np.asarray(x, dtype=np.float64).astype(dt).astype(np.float64)


def _dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


@dataclass(frozen=True, eq=False)
class Prepared:
    """Output of :func:`prepare`.

    ``a``: :class:`BlockOperand` ``[R, K]``, the layout's rows (quantized codes + scales, or float);
    ``row_expert``: int64 ``[R]`` local expert per row, -1 padding; ``src``: int64 ``[R]`` slot
    ``t*k+j`` per row, -1 padding; ``dispatch``: the layout object of :mod:`moeref.dispatch` (None for
    ``"standard"``); ``topk_weights`` float ``[M, k]``; ``apply_weights``: False when the weight was
    applied on the input; ``a1``: the quantized token tensor (or None).

    The device engine (``run_moe(device=...)``, :mod:`moeref.moe.device`) fills the same fields on its
    device: ``a`` a :class:`moeref.gemm.device.DeviceOperand`, ``topk_weights`` a float64 tensor; the
    index arrays stay on the host (NumPy).
    """

    layout: str
    a: BlockOperand
    row_expert: np.ndarray
    src: np.ndarray
    dispatch: object
    topk_weights: np.ndarray
    topk_ids: np.ndarray
    num_tokens: int
    apply_weights: bool
    a1: object = None

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])


def dispatch_rows(topk_ids, groups, *, num_experts: int, layout: str, expert_map=None, alignment: int = 128,
                  max_m: int | None = None):
    """The rows of ``layout`` for a routing: ``(src, row_expert, dispatch)``, int64 ``[R]`` slot ``t*k+j``
    and local expert per row (-1 padding) and the layout object (None for ``"standard"``). Index work
    only (no data moves); shared by both engines of :func:`prepare` (NumPy and :mod:`moeref.moe.device`).
    ``groups``: :func:`moeref.dispatch.grouping.group_slots` of ``topk_ids``."""
    g = groups
    ids = np.asarray(topk_ids)
    if layout == "standard":
        src = np.where(g.local_ids >= 0, np.arange(g.num_slots), -1)
        row_expert = g.local_ids.copy()
        disp = None
    elif layout == "contiguous":
        disp = to_contiguous(None, ids, num_experts, alignment, expert_map)
        src, row_expert = disp.src.astype(np.int64), disp.m_indices.astype(np.int64)
    else:
        largest = int(g.counts.max(initial=0))  # above M only when a token repeats an expert
        cap = int(max_m) if max_m is not None else (max(largest, 1) if layout == "masked"
                                                    else max(g.num_tokens, largest, 1))
        if layout == "masked":
            disp = to_masked(None, ids, num_experts, cap, expert_map)
        else:
            disp = to_batched(None, ids, num_experts, cap, 1, expert_map)
        src = disp.src.reshape(-1).astype(np.int64)
        row_expert = np.where(src >= 0, np.repeat(np.arange(disp.src.shape[0]), disp.src.shape[1]), -1)
    return src.astype(np.int64), np.asarray(row_expert).astype(np.int64), disp


@dataclass(frozen=True, eq=False)
class ExpertsOutput:
    """Output of :func:`experts`: ``y`` float64 ``[R, K]`` (padding rows 0) and the trace the error
    bounds read: ``h`` (GEMM1 output ``[R, 2N]``), ``x`` (activation output before re-quantization,
    ``[R, N]``), ``xq`` (the GEMM2 input operand) and ``a2`` (the quantized intermediate or None).
    On the device engine: float64 tensors and a ``DeviceOperand``; ``valid`` stays a NumPy bool array.

    ``h_pre``: the exact GEMM1 output before the ``gemm1_out_dtype`` store (float64 ``[R, 2N]``), kept by the
    device engine for its layer bound (:mod:`moeref.compare.device.layer` reads it instead of recomputing the
    product; ``h`` itself when there is no store, so no extra memory then); None from the NumPy engine (its
    bound recomputes the GEMM)."""

    y: np.ndarray
    h: np.ndarray
    x: np.ndarray
    xq: BlockOperand
    a2: object
    valid: np.ndarray
    h_pre: object = None


def _activation(name: str, h, w13_layout: str, params: dict):
    """float64 activation of ``h`` (NumPy or torch): :func:`moeref.activations.activation_values`."""
    return activation_values(name, h, w13_layout, params)


@dataclass(frozen=True, eq=False)
class MoERun:
    """A traced reference run (:func:`run_moe`): ``output`` float64 ``[M, K]`` before output rounding,
    ``out`` rounded to ``config.out_dtype``, per chunk the :class:`Prepared` and :class:`ExpertsOutput`,
    ``shared`` (float64 ``[M, K]`` or None), and what the bounds read: the :class:`LayerConfig` (with
    ``num_experts`` filled in) and the weights."""

    output: np.ndarray
    out: np.ndarray
    chunks: list
    shared: object
    shared_chunks: list
    config: LayerConfig
    weights: MoEWeights
