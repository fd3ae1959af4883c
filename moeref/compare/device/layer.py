""":func:`moeref.compare.layer_bound` of a device-engine run (:func:`moeref.moe.run_moe` with ``device=``) on
its device: the stages of :mod:`moeref.compare.bounds` on torch float64 tensors, the same bound bit for bit.

Stage by stage, what runs where:

* GEMM centers: the device engine's exact product (:mod:`moeref.gemm.device`, the NumPy engine's bits), read
  from the run where it holds it: GEMM1's from :attr:`ExpertsOutput.h_pre <moeref.moe.ExpertsOutput>` (the same
  product of the same operand, before the run's store), GEMM2's from the run's ``y`` when the bound's
  re-quantized intermediate is the run's GEMM2 operand bit for bit (:func:`_same_operand`; it is not when a
  store may flip, the midpoint center then differing from the run's value), else from the bound's own
  aligned-adder kernel, which forms the exact chunk sums anyway (``device_rows_error_bound(center=True)``:
  scaled and added in chunk order as the engine does, the same bits), else computed here; under
  an emulated profile (``accum_model="emulated"``) both GEMMs' centers and radii come from
  :mod:`moeref.compare.device.emulated` (the kernel predicted bit for bit);
* GEMM error bounds and the operand-radius term: :mod:`moeref.compare.device.bounds` (Triton kernels,
  the declared summation orders of :mod:`moeref.compare.gemm_bounds`);
* stores: :func:`moeref.moe.device.round_on_device` (the NumPy casts' roundings), the interval in one pass of
  :mod:`moeref.compare.device._store_kernels` (the operations of its torch definition, :func:`~moeref.compare.device._store_kernels.store_interval_torch`);
* activation and its Lipschitz bound: the portable elementary functions (:mod:`moeref.elementary`), for the
  SiLU-gated activations in one pass of :mod:`moeref.compare.device._activation_kernels` (the same operations);
* the flip-aware re-quantization of the intermediate (:func:`requant_uncertainty`), valid rows only: on the
  device (:mod:`moeref.compare.device.requant`: FP8 blockwise schemes; only the block amax grids go to the
  host, through the quantizer's own scale step), else on the host (its quantizer and format rounding; the
  operand goes back to the device);
* flip counts: 0-d device tensors, read once per layer bound; the routing's index arrays go to the device
  through page-locked copies queued on the stream (:func:`moeref._interop.to_device`), not host waits;
* finalize: the slot-order loop of :func:`moeref.dispatch.weight_and_reduce`, for the center, the radius and the
  magnitude in one pass (:mod:`moeref.compare.device._reduce_kernels`).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..bounds import LayerBound, Profile, assemble_layer_bound, gamma
from ..stage_bounds import activation_error, activation_magnitude, requant_uncertainty
from ._activation_kernels import gated_silu_stage_t
from ._reduce_kernels import weighted_slot_sums_t
from ._store_kernels import store_interval_t, store_interval_torch
from .bounds import _n_out, device_rows_error_bound
from .emulated import device_emulated_gemm
from .requant import device_requant, device_requant_unavailable

__all__ = ["device_layer_bound", "device_store_interval", "store_interval_torch"]


def _torch():
    import torch

    return torch


def device_store_interval(value, radius, dtype: str | None, unit: float = 0.0):
    """:func:`moeref.compare.bounds.store_interval` on float64 tensors (the same operations): ``(center, half,
    flipped)``, in one Triton pass (:func:`moeref.compare.device._store_kernels.store_interval_t`, which runs
    its torch definition :func:`~moeref.compare.device._store_kernels.store_interval_torch` where it does not apply)."""
    return store_interval_t(value, radius, dtype, unit)


def _chunk_interval(p, e, weights, profile: Profile, cfg):
    """:func:`moeref.compare.bounds._chunk_interval` of a device chunk (``p``/``e``: the device engine's
    :class:`~moeref.moe.Prepared` / :class:`~moeref.moe.ExpertsOutput` holding device tensors; ``weights`` on the device)."""
    torch = _torch()
    from ..._interop import to_device, to_numpy
    from ...gemm import StackedExperts
    from ...gemm.device import add_expert_bias, device_operand
    from ...moe.device import _weights_gemm
    from ...moe.pipeline import _activation, _run_quantizer

    valid = e.valid
    rows = p.row_expert
    dev = p.a.device
    k_out = _n_out(weights.w2)
    if not valid.any():
        z = torch.zeros((p.num_tokens, k_out), dtype=torch.float64, device=dev)
        return z, z.clone(), 0
    # the index arrays go to the device once, queued without a host wait (moeref._interop.to_device)
    vidx = np.flatnonzero(valid)
    vt, vi = to_device(valid, dev), to_device(vidx, dev)
    act, params, lay = cfg.activation, cfg.activation_params, weights.w13_layout
    # stage 1-2: GEMM1 and its store
    emulated = profile.accum_model == "emulated"  # a known kernel: moeref.compare.device.emulated
    if emulated:
        h_pre, dh = device_emulated_gemm(p.a, None, rows, weights.w13, weights.b13, profile)
    else:  # the run's own exact product (the device engine keeps it), else computed here
        h_pre = e.h_pre if e.h_pre is not None else _weights_gemm(p.a, rows, weights.w13, weights.b13)
        dh = device_rows_error_bound(p.a, None, rows, weights.w13, weights.b13, profile)
    h, dh, flip_h = device_store_interval(h_pre, dh, profile.gemm_out_dtype, profile.gemm_out_unit)
    # stage 3: activation, its FP32 evaluation and its store
    fused = gated_silu_stage_t(h, dh, act, lay, params, profile.act_unit)  # one pass; None: not a SiLU gate
    if fused is not None:
        x_pre, dx = fused
    else:
        x_pre = _activation(act, h, lay, params)
        dx = activation_error(act, h, dh, lay, params)
        dx = dx + profile.act_unit * (x_pre.abs() + activation_magnitude(act, h.abs() + dh, lay, params) + dx)
    x, dx, flip_x = device_store_interval(x_pre, dx, profile.act_out_dtype)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    x = torch.where(vt[:, None], x, zero)
    dx = torch.where(vt[:, None], dx, zero)
    flips = (flip_h & vt[:, None]).sum() + (flip_x & vt[:, None]).sum()  # 0-d tensors: no host sync
    # stage 4: re-quantization of the valid rows (module docstring)
    codes = det = None
    if e.a2 is None:
        xq, unc = device_operand(x, dev), dx
    else:
        pos = np.full(x.shape[0], -1, dtype=np.int64)
        pos[vidx] = np.arange(vidx.size)
        got = None
        if device_requant_unavailable(cfg.quant.a2) is None:
            got = device_requant(x.index_select(0, vi), dx.index_select(0, vi), cfg.quant.a2, detail=emulated)
        if got is not None:
            xq_valid, u_v, f, *det = got
        else:
            x_h = to_numpy(x.index_select(0, vi).cpu())
            dx_h = to_numpy(dx.index_select(0, vi).cpu())
            xq_h, qt = _run_quantizer(cfg.quant.a2, x_h)
            u_h, f, *det = requant_uncertainty(x_h, dx_h, cfg.quant.a2, qt, detail=emulated)
            det = [{k_: torch.as_tensor(v, device=dev) for k_, v in d.items()} for d in det]
            xq_valid, u_v = device_operand(qt if qt is not None else xq_h, dev), torch.as_tensor(u_h, device=dev)
        flips = flips + f
        unc = torch.zeros_like(dx).index_copy_(0, vi, u_v)
        if det:  # the emulated GEMM2 reads the codes a kernel can store (zero rows: padding)
            codes = {k_: torch.zeros_like(dx).index_copy_(0, vi, v) for k_, v in det[0].items()}
        xq = xq_valid.take_rows(to_device(pos, dev))
    # stage 5: GEMM2 and its store
    if emulated:
        y_pre, dy = device_emulated_gemm(xq, unc, rows, weights.w2, weights.b2, profile, codes)
    else:  # the run's exact product when its operand is this one (_same_operand), else the bound kernel's, else here
        same = _same_operand(xq, e.xq)
        want = not same and isinstance(weights.w2, StackedExperts)
        rad, bnd, *prod = device_rows_error_bound(xq, unc, rows, weights.w2, weights.b2, profile, radius_term=True,
                                                  center=want)
        prod = prod[0] if want else None
        if same:
            y_pre = e.y
        elif prod is not None:  # the bound kernel's exact chunk sums, scaled and added as the engine does
            y_pre = prod if weights.b2 is None else add_expert_bias(prod, rows, weights.b2, len(weights.w2))
        else:
            y_pre = _weights_gemm(xq, rows, weights.w2, weights.b2)
        dy = rad + bnd
    weigh = p.apply_weights
    if profile.gemm2_weighted_store and weigh:  # the epilogue weights (one FP32 multiply), then stores
        tw = p.topk_weights.to(torch.float64).reshape(-1)
        w_row = torch.where(vt, tw.index_select(0, to_device(np.maximum(p.src, 0), dev)), zero)
        y_pre, dy = w_row[:, None] * y_pre, w_row.abs()[:, None] * dy
        dy = dy + profile.reduce_unit * (y_pre.abs() + dy)
        weigh = False
    y, dy, _ = device_store_interval(y_pre, dy, profile.gemm_out_dtype, profile.gemm_out_unit)
    y = torch.where(vt[:, None], y, zero)
    dy = torch.where(vt[:, None], dy, zero)
    # stage 6: top-k weighted sums (the center, the radius and the magnitude in one pass)
    live = np.flatnonzero(p.src >= 0)
    slot_row = np.full(p.num_tokens * p.top_k, -1, dtype=np.int64)
    slot_row[p.src[live]] = live
    center, d_tok, mag = weighted_slot_sums_t(y, dy, to_device(slot_row, dev), p.topk_weights, weigh)
    return center, d_tok + gamma(p.top_k + 2, profile.reduce_unit) * mag, flips


def _same_operand(a, b) -> bool:
    """Whether the :class:`~moeref.gemm.device.DeviceOperand` ``a`` (the bound's GEMM2 input) is ``b`` (the
    run's): the same representation (codes of one format, or float64 values), block (clipped to the shape: a
    1x128 group of a 32-column operand is its 1x32 block), flags and scale grid, and
    bit-identical codes/values and scales. Then the run's exact GEMM2 output is this operand's product (the same
    function of the same inputs: :func:`moeref.moe.device._weights_gemm` with the run's routing and weights), so
    the bound reads it instead of recomputing. One host read (a 0-d boolean); False whenever any part differs,
    including NaN payloads (compared as bits)."""
    torch = _torch()

    def block(op):  # a block at least the operand's extent is the whole extent: scales[0] for every index
        return tuple(min(int(bl), d) for bl, d in zip(op.block, op.shape))

    if not (type(a) is type(b) and (a.values is None) == (b.values is None) and a.element == b.element
            and a.shape == b.shape and block(a) == block(b) and a.quantized == b.quantized
            and a.magnitude == b.magnitude):
        return False
    ta, tb = (a.codes, b.codes) if a.values is None else (a.values, b.values)
    if (ta.shape != tb.shape or ta.dtype != tb.dtype or ta.device != tb.device or a.scales.shape != b.scales.shape
            or a.scales.dtype != b.scales.dtype or a.scales.device != b.scales.device):
        return False

    def bits(t):
        return t.view(torch.int64) if t.dtype == torch.float64 else t

    same = (bits(ta) == bits(tb)).all() & (bits(a.scales) == bits(b.scales)).all()
    return bool(same.item())


def device_layer_bound(run, profile: Profile) -> LayerBound:
    """:func:`moeref.compare.layer_bound` of a device run: ``bound``, ``center`` and ``radius`` are float64
    tensors on the run's device."""
    torch = _torch()
    from ...moe.device import device_weights

    out = run.output
    lb = assemble_layer_bound(run, profile, _chunk_interval, out.to(torch.float64),
                              shared_weights=lambda w: device_weights(w, out.device), store=device_store_interval,
                              cat=lambda xs: torch.cat(xs, dim=0), zeros_like=torch.zeros_like)
    return replace(lb, flips=int(lb.flips))  # the one host read of the flip count
