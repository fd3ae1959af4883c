"""Honest implementation variants and planted faults, for the sensitivity tests and the demo.

A :class:`LayerCase` bundles one layer call (tokens, weights, routing, options). :func:`reference`
runs the traced reference. :data:`HONEST` variants compute the same layer with other legal
arithmetic (FP32 accumulation in other orders and K-chunkings, an emulated Hopper FP8 accumulator
of 14 bits promoted every 128 columns, torch bf16 matmuls); :mod:`moeref.compare.subtle_faults`
holds the variants with declared bf16 stores and the subtle faults. :data:`FAULTS` are gross bugs: all-zero
output, a dropped top-k slot, gate/up swapped, one token routed to a wrong expert, router weights
applied twice, a scale from the neighbouring block, the intermediate not re-quantized, an output row
left unwritten (NaN-poisoned buffer).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..activations import convert_w13
from ..gemm.exact import BlockOperand, as_operand
from ..moe.pipeline import MoEQuant, run_moe
from ..moe.weights import MoEWeights

__all__ = ["LayerCase", "reference", "candidate", "fp32_gemm", "hopper_fp8_gemm", "torch_bf16_gemm", "HONEST", "FAULTS", "FAULTY_INPUTS", "FAULTY_OUTPUTS"]


@dataclass(frozen=True, eq=False)
class LayerCase:
    """One layer call: ``hidden [M, K]``, ``weights``, ``topk_weights``/``topk_ids`` ``[M, k]`` and the
    keyword arguments of :func:`moeref.moe.run_moe` (activation, quant, layout, out_dtype ...)."""

    hidden: np.ndarray
    weights: MoEWeights
    topk_weights: np.ndarray
    topk_ids: np.ndarray
    options: dict = field(default_factory=dict)

    def with_(self, **changes) -> "LayerCase":
        opts = dict(self.options)
        opts.update(changes.pop("options", {}))
        return replace(self, options=opts, **changes)


def reference(case: LayerCase, **overrides):
    """The traced reference run of ``case`` (options overridden by ``overrides``)."""
    opts = dict(case.options)
    opts.update(overrides)
    return run_moe(case.hidden, case.weights, case.topk_weights, case.topk_ids, **opts)


def candidate(case: LayerCase, **overrides) -> np.ndarray:
    """The output (``out_dtype`` of the case) of ``case`` run with ``overrides``."""
    return reference(case, **overrides).out


# ---------------------------------------------------------------------------------- GEMM engines


def _segments(a: BlockOperand, w: BlockOperand, chunk: int):
    import math

    k = a.values.shape[1]
    g = max(1, math.gcd(math.gcd(min(a.block[1], k), min(w.block[1], k)), chunk))
    return [(s, min(s + g, k)) for s in range(0, k, g)]


def fp32_gemm(chunk: int = 128, reverse: bool = False):
    """An FP32 GEMM: per K-chunk an FP32 BLAS product, times the FP32 block scales, summed in FP32
    (chunks in forward or ``reverse`` order). Honest for :data:`moeref.compare.FP32_ACCUM`."""

    def gemm(a, w):
        a, w = as_operand(a), as_operand(w)
        m, n = a.values.shape[0], w.values.shape[0]
        out = np.zeros((m, n), dtype=np.float32)
        ra, rw = np.arange(m) // a.block[0], np.arange(n) // w.block[0]
        segs = _segments(a, w, chunk)
        for s, e in (segs[::-1] if reverse else segs):
            p = a.values[:, s:e].astype(np.float32) @ w.values[:, s:e].T.astype(np.float32)
            p = p * a.scales[ra, s // a.block[1]].astype(np.float32)[:, None]
            p = p * w.scales[rw, s // w.block[1]].astype(np.float32)[None, :]
            out = out + p
        return out

    return gemm


def _truncate(x: np.ndarray, bits: int) -> np.ndarray:
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(m * 2.0**bits) / 2.0**bits, e)


def hopper_fp8_gemm(promote: int = 128, mma_k: int = 32, bits: int = 14):
    """Emulated Hopper FP8 WGMMA: each ``mma_k``-column product is exact, added to an accumulator
    truncated to ``bits`` significant bits; every ``promote`` columns the accumulator is scaled and
    added to an FP32 sum (DeepGEMM). Honest for :data:`moeref.compare.HOPPER_FP8_DEEPGEMM`."""

    def gemm(a, w):
        a, w = as_operand(a), as_operand(w)
        m, n = a.values.shape[0], w.values.shape[0]
        k = a.values.shape[1]
        out = np.zeros((m, n), dtype=np.float32)
        ra, rw = np.arange(m) // a.block[0], np.arange(n) // w.block[0]
        for s in range(0, k, promote):
            acc = np.zeros((m, n))
            for t in range(s, min(s + promote, k), mma_k):
                e = min(t + mma_k, s + promote, k)
                mma = a.values[:, t:e].astype(np.float64) @ w.values[:, t:e].T.astype(np.float64)  # exact
                acc = _truncate(acc + mma, bits)
            sc = (a.scales[ra, s // a.block[1]][:, None] * w.scales[rw, s // w.block[1]][None, :]).astype(np.float32)
            out = out + acc.astype(np.float32) * sc
        return out

    return gemm


def torch_bf16_gemm():
    """torch bf16 matmul (CPU): operands rounded to bf16, FP32 accumulation, bf16 output. Honest for
    :data:`moeref.compare.BF16_OUTPUT` on a bf16 layer (bf16 tokens and weights)."""
    import torch

    def gemm(a, w):
        a, w = as_operand(a), as_operand(w)
        ta = torch.from_numpy(a.dequantize()).to(torch.bfloat16)
        tw = torch.from_numpy(w.dequantize()).to(torch.bfloat16)
        return (ta @ tw.T).float().numpy()

    return gemm


HONEST = {
    "fp32 chunks of 32": lambda case: candidate(case, gemm=fp32_gemm(32), act_out_dtype=np.float32),
    "fp32 chunks of 128, reversed": lambda case: candidate(case, gemm=fp32_gemm(128, reverse=True),
                                                           gemm1_out_dtype=np.float32, act_out_dtype=np.float32),
    "fp32 one chunk": lambda case: candidate(case, gemm=fp32_gemm(1 << 30)),
}
"""Honest variants for :data:`moeref.compare.FP32_ACCUM`: FP32 GEMMs in other chunkings and orders,
FP32 stores of the GEMM1 and activation outputs, the intermediate quantized from FP32."""


# ---------------------------------------------------------------------------------- faults


def _busiest(case: LayerCase) -> int:
    ids = np.asarray(case.topk_ids)
    v = ids[ids >= 0]
    return int(np.bincount(v).argmax()) if v.size else 0


def _swap_gate_up(case: LayerCase) -> np.ndarray:
    return candidate(_swap_gate_up_case(case))


def _swap_gate_up_case(case: LayerCase) -> LayerCase:
    lw = case.weights
    other = "up_gate" if lw.w13_layout != "up_gate" else "gate_up"

    def swapped(w):
        op = as_operand(w)
        vals = convert_w13(op.dequantize(), lw.w13_layout, other)
        return BlockOperand(vals, np.ones((1, 1)), (vals.shape[0], vals.shape[1]), False)

    w13 = [swapped(w) for w in lw.w13]
    return case.with_(weights=replace(lw, w13=w13))


def _neighbour_scale(case: LayerCase) -> np.ndarray:
    return candidate(_neighbour_scale_case(case))


def _neighbour_scale_case(case: LayerCase) -> LayerCase:
    lw = case.weights
    e0 = _busiest(case)
    op = as_operand(lw.w13[e0])
    sc = op.scales.copy()
    if sc.shape[1] >= 2:
        sc[:, 0] = sc[:, 1]
    elif sc.shape[0] >= 2:
        sc[0] = sc[1]
    else:
        raise ValueError("the weights have one scale per expert: no neighbouring block")
    w13 = list(lw.w13)
    w13[e0] = BlockOperand(op.values, sc, op.block, op.quantized)
    return case.with_(weights=replace(lw, w13=w13))


def _wrong_expert(case: LayerCase) -> np.ndarray:
    return candidate(_wrong_expert_case(case))


def _wrong_expert_case(case: LayerCase) -> LayerCase:
    ids = np.array(case.topk_ids, copy=True)
    e = case.weights.num_experts
    row = ids[0]
    free = [x for x in range(e) if x not in row.tolist()]
    if not free:
        raise ValueError(f"token 0 already uses all {e} experts: no wrong expert to route it to")
    ids[0, 0] = free[0]
    return case.with_(topk_ids=ids)


def _drop_slot(case: LayerCase) -> np.ndarray:
    return candidate(_drop_slot_case(case))


def _drop_slot_case(case: LayerCase) -> LayerCase:
    w = np.array(case.topk_weights, dtype=np.float32, copy=True)
    w[:, -1] = 0.0
    return case.with_(topk_weights=w)


def _weights_twice(case: LayerCase) -> np.ndarray:
    return candidate(_weights_twice_case(case))


def _weights_twice_case(case: LayerCase) -> LayerCase:
    w = np.asarray(case.topk_weights, dtype=np.float32)
    return case.with_(topk_weights=(w.astype(np.float64) ** 2).astype(np.float32))


def _no_requant(case: LayerCase) -> np.ndarray:
    q = case.options.get("quant", MoEQuant())
    if q.a2 is None:
        raise ValueError("the layer does not re-quantize its intermediate")
    return candidate(case, quant=MoEQuant(q.a1, None, q.name + " (a2 skipped)"))


def _unwritten_row(case: LayerCase) -> np.ndarray:
    return _nan_row_0(candidate(case))


def _nan_row_0(out) -> np.ndarray:
    out = np.array(out, copy=True)
    out[0] = np.nan
    return out


def _zero(case: LayerCase) -> np.ndarray:
    return np.zeros_like(candidate(case))


FAULTS = {
    "all-zero output": _zero,
    "top-k slot dropped": _drop_slot,
    "gate and up swapped": _swap_gate_up,
    "token 0 routed to a wrong expert": _wrong_expert,
    "router weights applied twice": _weights_twice,
    "scale from the neighbouring block": _neighbour_scale,
    "intermediate not re-quantized": _no_requant,
    "output row 0 unwritten (NaN)": _unwritten_row,
}

FAULTY_INPUTS = {
    "top-k slot dropped": _drop_slot_case,
    "gate and up swapped": _swap_gate_up_case,
    "token 0 routed to a wrong expert": _wrong_expert_case,
    "router weights applied twice": _weights_twice_case,
    "scale from the neighbouring block": _neighbour_scale_case,
}
"""The faults of :data:`FAULTS` that are a change of the layer's inputs, as ``case -> faulty case``: run
any implementation (a user's kernel, :mod:`moeref.testing.mutation`) on the faulty case and check it
against the original one."""

FAULTY_OUTPUTS = {
    "all-zero output": np.zeros_like,
    "output row 0 unwritten (NaN)": _nan_row_0,
}
"""The faults of :data:`FAULTS` that corrupt the output, as ``output -> faulty output``."""
