"""The MoE reference on a torch device (float64 on a CUDA GPU): :func:`moeref.moe.run_moe`'s result, bit for
bit, at production shapes.

One semantics, two engines. :func:`moeref.moe.run_moe` with ``device="cuda"`` (or CUDA tensors as input)
runs the same stages as the NumPy engine, each with the same float64 arithmetic:

* routing metadata (slots, layout rows, ``src``): the NumPy engine's own index code
  (:func:`moeref.moe.stages.dispatch_rows`) on the host, copied to the device;
* router weight on input: the float64 product rounded once to float32;
* quantizers (``a1``, ``a2``): :func:`moeref.quant.device.device_quantize` where it runs the scheme and
  input dtype (the NumPy quantizer's own scale step on the block amax grid, torch elementwise scaling and
  the codec's code table: :func:`moeref.quant.quantize`'s codes and scales bit for bit, and no kernel
  shared with :mod:`fastpath`, so a fast path checked against this engine is checked against an
  independent computation), else the NumPy quantizer on a host copy; which one ran is recorded in
  :attr:`DeviceRun.engines`, never chosen silently;
* GEMMs: :func:`moeref.gemm.device.device_expert_rows_gemm` (exact partial dots, the same in-order
  scaled sum);
* activations: :func:`moeref.activations.activation_values` on torch float64, whose ``exp``/``erf``
  are :mod:`moeref.elementary`'s portable ones (the same bits as on the CPU);
* stores (``gemm1_out_dtype``, ``act_out_dtype``, ``gemm2_out_dtype``, ``out_dtype``): the NumPy engine's roundings
  (float64 -> float32 -> bfloat16 for bfloat16, as ml_dtypes; one rounding for float16 and float32);
* finalize: ``sum_j w[t, j] * row(t*k + j)`` in float64, slot order, from +0.0.

Weights: :class:`moeref.moe.MoEWeights` whose ``w13``/``w2`` are per-expert quantized tensors (stacked and
uploaded on first use: call :meth:`MoEWeights.to` once to keep them there), :class:`moeref.gemm.StackedExperts`
(host or device), or float ``[E, N, K]`` arrays/tensors (kept in their dtype, decoded per expert).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .._checks import check_token_rows
from .._interop import to_device, triton_interpreted
from ..dispatch.grouping import group_slots
from ..gemm.device import DeviceOperand, device_expert_rows_gemm, device_operand
from ..gemm.stacked import StackedExperts
from ..quant.device import device_quantize, device_quantize_unavailable, round_to_odd_f32
from .config import LayerConfig
from .stages import ExpertsOutput, MoERun, Prepared, _activation, _dtype, _run_quantizer, dispatch_rows
from .weights import MoEWeights, SharedExperts

__all__ = ["device_weights", "run_moe_device", "round_on_device"]


def _torch():
    import torch

    return torch


# ------------------------------------------------------------------------------------------- weights


def _stack(ws, device):
    """A device form of one weight stack: StackedExperts (quantized) or a float tensor [E, N, K]."""
    torch = _torch()
    if isinstance(ws, StackedExperts):
        return ws.to(device) if ws.device != str(device) else ws
    if torch.is_tensor(ws):
        return ws.to(device)
    items = list(ws)
    if not items:  # an EP rank without local experts: nothing to stack (no row reaches a GEMM)
        return items
    if all(hasattr(t, "scale_values") and hasattr(t, "codes") for t in items):
        return StackedExperts.from_quantized(items).to(device)
    from .._interop import to_numpy, to_torch

    arrs = [to_numpy(t) if not torch.is_tensor(t) else t for t in items]
    if all(torch.is_tensor(t) for t in arrs):
        return torch.stack([t.to(device) for t in arrs])
    return to_torch(np.stack([np.asarray(a) for a in arrs]), device=device)


def device_weights(weights: MoEWeights, device) -> MoEWeights:
    """``weights`` with ``w13``/``w2`` stacked on ``device`` (quantized: :class:`StackedExperts`; float:
    ``[E, N, K]`` tensors in their dtype) and biases as float64 tensors there. Idempotent."""
    torch = _torch()
    dev = torch.device(device)

    def bias(b):
        if b is None:
            return None
        t = b if torch.is_tensor(b) else torch.as_tensor(np.asarray(b, dtype=np.float64))
        return t.to(device=dev, dtype=torch.float64)

    return replace(weights, w13=_stack(weights.w13, dev), w2=_stack(weights.w2, dev), b13=bias(weights.b13),
                   b2=bias(weights.b2))


def _weights_gemm(a: DeviceOperand, row_expert, w, bias):
    """``device_expert_rows_gemm`` for quantized stacks; float stacks as one-block float experts."""
    torch = _torch()
    if isinstance(w, StackedExperts):
        return device_expert_rows_gemm(a, row_expert, w, bias)
    # float [E, N, K]: each expert one block of scale 1 (not quantized: float64-accurate partial dots)
    from ..gemm.device import _product, add_expert_bias

    rows = np.asarray(row_expert, dtype=np.int64)
    n = int(w.shape[1])
    out = torch.zeros((rows.size, n), dtype=torch.float64, device=w.device)
    for e in np.unique(rows[rows >= 0]).tolist():
        idx = torch.as_tensor(np.flatnonzero(rows == e), device=w.device)
        ae = a.take_rows(idx)
        we = w[e].to(torch.float64)
        _product(ae.decode(), ae.scales, ae.block, we, torch.ones((1, 1), dtype=torch.float64, device=w.device),
                 (n, int(w.shape[2])), out, idx)
    if bias is not None:
        add_expert_bias(out, rows, bias, int(w.shape[0]))
    return out


# ------------------------------------------------------------------------------------------- stores


def round_on_device(x, dtype):
    """:func:`moeref.moe.round_to_dtype` on a float64 tensor: the same roundings. float32: one RNE;
    bfloat16: float64 -> float32 -> bfloat16 (two RNE, as ml_dtypes' cast); float16: one RNE (through a
    round-to-odd float32, which makes the second rounding exact: 24 bits against 11)."""
    torch = _torch()
    if dtype is None:
        return x
    dt = _dtype(dtype)
    if dt == np.float64:
        return x
    if dt == np.float32:
        return x.to(torch.float32).to(torch.float64)
    if dt.name == "bfloat16":
        return x.to(torch.float32).to(torch.bfloat16).to(torch.float64)
    if dt == np.float16:
        return round_to_odd_f32(x).to(torch.float16).to(torch.float64)
    raise ValueError(f"the device engine stores float64, float32, bfloat16 or float16; got {dt}")


_round_to_odd_f32 = round_to_odd_f32  # its former name here (moeref.compare._store_kernels cites it)


def _work_dtype(dtype):
    """The torch dtype a kernel hands its quantizer after an ``act_out_dtype`` store."""
    torch = _torch()
    dt = _dtype(dtype)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float64": torch.float64}[dt.name]


# ------------------------------------------------------------------------------------------- quantizers


def _quantize(q, x, engines: list, label: str) -> tuple[DeviceOperand, object]:
    """Run quantizer ``q`` on the device tensor ``x``: ``(operand, quantized tensor or None)``."""
    torch = _torch()
    if q is None:
        return device_operand(x.to(torch.float64) if x.dim() == 2 else x.reshape(x.shape[0], -1), x.device), None
    from .config import Quantizer

    q = Quantizer.of(q)
    scheme, static = q.scheme, q.static
    why = "a quantizer function of the user's (it takes host arrays)"
    if scheme is not None:
        why = device_quantize_unavailable(scheme, x, static)
        if why is None:
            qt = device_quantize(x, scheme, **static)
            engines.append(f"{label}: moeref.quant.device ({scheme.name})")
            return device_operand(qt, x.device), qt
    from .._interop import to_numpy

    _, qt = _run_quantizer(q, to_numpy(x.cpu()))
    engines.append(f"{label}: moeref.quant on the host ({why})")
    return device_operand(qt, x.device), qt


# ------------------------------------------------------------------------------------------- stages


def _prepare(x, w, ids, *, num_experts, layout, quant, expert_map, apply_router_weight_on_input, alignment,
             max_m, engines) -> Prepared:
    torch = _torch()
    check_token_rows(x, w, ids)
    g = group_slots(ids, num_experts, expert_map)
    if apply_router_weight_on_input:
        if ids.shape[1] != 1:
            raise ValueError("apply_router_weight_on_input needs top_k == 1 (weight-on-input is exact only then); "
                             f"got top_k={ids.shape[1]}")
        x = (x.to(torch.float64) * w.to(torch.float64)).to(torch.float32)
    a_tok, a1 = _quantize(quant.a1, x, engines, "a1")
    src, row_expert, disp = dispatch_rows(ids, g, num_experts=num_experts, layout=layout, expert_map=expert_map,
                                          alignment=alignment, max_m=max_m)
    rows = np.where(src >= 0, src // max(g.top_k, 1), -1)
    return Prepared(layout, a_tok.take_rows(to_device(rows, a_tok.device)), row_expert, src, disp,
                    w.to(torch.float64), ids, g.num_tokens, not apply_router_weight_on_input, a1)


def _experts(p: Prepared, weights: MoEWeights, *, activation, activation_params, quant, gemm1_out_dtype,
             act_out_dtype, engines, gemm2_out_dtype=None) -> ExpertsOutput:
    torch = _torch()
    valid = p.row_expert >= 0
    n_w = len(weights.w13)
    if n_w < int(p.row_expert.max(initial=-1)) + 1:
        raise ValueError(f"the routing uses local expert {int(p.row_expert.max())} but weights has {n_w}")
    dev = p.a.device
    r, k = p.a.shape
    if not valid.any():
        empty = torch.zeros((r, 0), dtype=torch.float64, device=dev)
        return ExpertsOutput(torch.zeros((r, k), dtype=torch.float64, device=dev), empty, empty,
                                   device_operand(empty, dev), None, valid)
    h_pre = _weights_gemm(p.a, p.row_expert, weights.w13, weights.b13)  # kept: the layer bound reads it
    h = round_on_device(h_pre, gemm1_out_dtype)
    x = _activation(activation, h, weights.w13_layout, activation_params)
    vt = to_device(valid, dev)
    x = torch.where(vt[:, None], x, torch.zeros((), dtype=torch.float64, device=dev))
    x = round_on_device(x, act_out_dtype)
    vidx = np.flatnonzero(valid)
    xv = x.index_select(0, to_device(vidx, dev))
    x_in = xv if act_out_dtype is None else xv.to(_work_dtype(act_out_dtype))
    xq_valid, a2 = _quantize(quant.a2, x_in, engines, "a2")
    pos = np.full(r, -1, dtype=np.int64)
    pos[vidx] = np.arange(vidx.size)
    xq = xq_valid.take_rows(to_device(pos, dev))
    y = round_on_device(_weights_gemm(xq, p.row_expert, weights.w2, weights.b2), gemm2_out_dtype)
    return ExpertsOutput(y, h, x, xq, a2, valid, h_pre)


def _finalize(p: Prepared, e: ExpertsOutput):
    """``out[t] = sum_j w[t, j] * row(t*k + j)`` in float64, slot order from +0.0 (float64 tensor)."""
    torch = _torch()
    dev = e.y.device
    m, k = p.num_tokens, p.top_k
    kdim = int(e.y.shape[1])
    slot_rows = torch.zeros((m * k, kdim), dtype=torch.float64, device=dev)
    valid = np.flatnonzero(p.src >= 0)
    if valid.size:
        slot_rows[to_device(p.src[valid], dev)] = e.y.index_select(0, to_device(valid, dev))
    rows = slot_rows.reshape(m, k, kdim)
    w = p.topk_weights if p.apply_weights else torch.ones_like(p.topk_weights)
    out = torch.zeros((m, kdim), dtype=torch.float64, device=dev)
    for j in range(k):
        out += w[:, j:j + 1] * rows[:, j, :]
    return out


@dataclass(frozen=True, eq=False)
class DeviceRun(MoERun):
    """:class:`moeref.moe.MoERun` of the device engine: ``output``/``out`` are tensors on the device;
    ``engines`` lists which quantizer ran where (``"a1: moeref.quant.device (...)"``)."""

    engines: list = field(default_factory=list)


def run_moe_device(hidden, weights: MoEWeights, topk_weights, topk_ids, config: LayerConfig, *,
                   device=None) -> DeviceRun:
    """:func:`moeref.moe.run_moe` on ``device`` (default: ``hidden``'s device) for the :class:`LayerConfig`
    ``config``; ``hidden`` and ``topk_weights`` may be NumPy arrays or tensors on any device (moved),
    ``topk_ids`` is read on the host. Returns a :class:`DeviceRun` whose ``output`` (float64) and ``out``
    (``out_dtype``) are tensors on ``device``, equal bit for bit to the NumPy engine's for quantized weights
    and activations (float operands: float64-accurate, see :mod:`moeref.gemm.device`)."""
    torch = _torch()
    from .._interop import to_torch

    cfg = config
    dev = torch.device(device) if device is not None else (hidden.device if torch.is_tensor(hidden)
                                                             else torch.device("cuda"))
    check_token_rows(hidden, topk_weights, topk_ids)  # inputs first; before chunking: a row past M would be ignored
    if dev.type == "cpu" and not triton_interpreted():
        raise ValueError("the device engine on the CPU runs its Triton kernels under TRITON_INTERPRET=1 only (set it "
                         "before importing triton); for the host engine leave device unset")
    x = hidden if torch.is_tensor(hidden) else to_torch(np.asarray(hidden))
    x = x.to(dev)
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"hidden must be a float [M, K] array; got {x.dtype} of shape {tuple(x.shape)}")
    w = topk_weights if torch.is_tensor(topk_weights) else to_torch(np.asarray(topk_weights))
    w = w.to(dev)
    ids = np.asarray(topk_ids.cpu() if torch.is_tensor(topk_ids) else topk_ids)
    num_experts = weights.num_experts if cfg.num_experts is None else cfg.num_experts
    dw = device_weights(weights, dev)
    m = int(x.shape[0])
    chunk = m if cfg.chunk_size is None else cfg.chunk_size
    engines: list = []
    kw = dict(activation=cfg.activation, activation_params=cfg.activation_params, quant=cfg.quant,
              gemm1_out_dtype=cfg.gemm1_out_dtype, act_out_dtype=cfg.act_out_dtype, engines=engines,
              gemm2_out_dtype=cfg.gemm2_out_dtype)
    outs, chunks, shared_chunks, shared_parts = [], [], [], []
    sw = None if cfg.shared_experts is None else device_weights(cfg.shared_experts.as_weights(), dev)
    for start in range(0, max(m, 1), max(chunk, 1)):
        sl = slice(start, min(start + chunk, m))
        p = _prepare(x[sl], w[sl], ids[sl], num_experts=num_experts, layout=cfg.layout, quant=cfg.quant,
                     expert_map=cfg.expert_map, apply_router_weight_on_input=cfg.apply_router_weight_on_input,
                     alignment=cfg.alignment, max_m=cfg.max_m, engines=engines)
        e = _experts(p, dw, **kw)
        outs.append(_finalize(p, e))
        chunks.append((p, e))
        if sw is not None:
            n = sl.stop - sl.start
            sp = _prepare(x[sl], torch.ones((n, 1), dtype=torch.float32, device=dev), np.zeros((n, 1), np.int32),
                          num_experts=1, layout="standard", quant=cfg.quant, expert_map=None,
                          apply_router_weight_on_input=False, alignment=cfg.alignment, max_m=None, engines=engines)
            se = _experts(sp, sw, **kw)
            shared_parts.append(_finalize(sp, se))
            shared_chunks.append((sp, se))
    routed = torch.cat(outs, dim=0) if outs else torch.zeros((0, 0), dtype=torch.float64, device=dev)
    shared = torch.cat(shared_parts, dim=0) if shared_parts else None
    output = routed + shared if shared is not None else routed
    out = output if cfg.out_dtype is None else _to_dtype(output, cfg.out_dtype)
    return DeviceRun(output, out, chunks, shared, shared_chunks, cfg, dw, engines)


def _to_dtype(x, dtype):
    """The output store: the float64 tensor rounded to ``dtype`` as the NumPy engine's ``astype``."""
    torch = _torch()
    return round_on_device(x, dtype).to(_work_dtype(dtype))
