"""Stage 4 of the device bound (:mod:`moeref.compare.device.layer`) on the device: the ``a2`` re-quantization
of the bound's intermediate center and :func:`moeref.compare.stage_bounds.requant_uncertainty`, on float64
torch tensors, with the NumPy stage's bits.

Which schemes: the ``"blockwise"`` family (no zero points, no channel scales, no NaN-ignoring amax) with an
element that torch stores as an FP8 dtype (E4M3FN, E5M2: its codes are read back exactly from the rounded
values), round-to-nearest-even elements and saturating overflow (:func:`device_requant_unavailable` says
why not, and the layer bound then runs the stage on the host, as it always did).

Two implementations, the same bits (``tests/test_requant_kernels.py``): by default two Triton passes over
``[V, N]`` (:mod:`moeref.compare.device._requant_kernels`: one for the three amax grids, one after the host scale step
for the codes, ``unc`` and the flip count, each block's scales read from their grids, no expanded ``[V, N]``
scale tensor); and the torch lines of :func:`_device_requant` (about 40 elementwise passes), for
``detail=True`` and for input the kernels do not take (not float64 ``[V, N]`` on CUDA, or on the CPU without
``TRITON_INTERPRET=1``). Per operation, against the NumPy stage:

* block amax: ``torch.amax`` of ``|x|`` (and of ``|x| + dx``, ``max(|x| - dx, 0)``) over each block (zero-padded
  partial blocks), exact and NaN-propagating as :func:`moeref.quant.blockwise.block_amax` on float64 input
  (kernel: ``where(v > m, v, m)`` over the block's non-NaN values, NaN where the block has one);
* scales: the amax grid (one number per block) is copied to the host and goes through the quantizer's own
  scale step, :func:`moeref.quant.blockwise.scales_from_amax` in float64 (the working dtype of float64 input),
  and its decode values through :meth:`moeref.quant.QuantizedTensor.scale_values`: the same code, so the
  same scales; a grid with a NaN decode (a non-finite block) goes to the host path;
* element rounding: :func:`round_float_rne` (round to nearest even on the format's quantum, saturating):
  ``moeref.formats.round_to_format(..., overflow="saturate", rounding="rne")`` for finite input (the quantum
  built from its exponent bits: ``torch.ldexp`` goes through ``pow``, which CUDA does not promise exact; an
  H100 run of the first version, with ``ldexp``, gave uncertainties that differed from the host's; kernel: the
  same quantum, ``|v| * 2^-k`` (exact), half to even by ``+ 1.5 * 2^52 - 1.5 * 2^52``, ``v``'s sign bit);
* codes: torch's exact ``float32 -> float8`` cast of the rounded values (kernel: the FP8 encoding of the value
  by integer bit work; both drop ``-0`` where the preset does);
* everything else (the interval ends, the divisions, the corners): the same IEEE operations on tensors
  (tensor-by-tensor divisions are correctly rounded on CUDA; the kernel's float64 ``/`` is ``div.rn.f64``, it is
  compiled without FMA contraction and reads its float64 constants from a tensor).

Host traffic: the three amax grids go to the host (one copy, the stage's one host wait) and the scale grids
come back as queued page-locked copies (:func:`moeref._interop.to_device`; ``[R, N / 128]`` for 1x128
groups), no element-sized copy.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["device_requant_unavailable", "device_requant", "round_float_rne"]

_TORCH_FP8 = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def _torch():
    import torch

    return torch


def _scheme(quantizer):
    from ...moe.config import Quantizer

    q = Quantizer.of(quantizer)
    return q, (None if q is None else q.scheme)


def device_requant_unavailable(quantizer) -> str | None:
    """None when :func:`device_requant` runs ``quantizer`` (a :class:`moeref.moe.config.Quantizer` input),
    else why not (the layer bound then re-quantizes on the host)."""
    q, scheme = _scheme(quantizer)
    if q is None or scheme is None:
        return "a quantizer function of the user's (it takes host arrays)"
    if q.static:
        return f"static arguments {sorted(q.static)}"
    if scheme.family != "blockwise" or scheme.zero_point or scheme.channel_block:
        return f"scheme family {scheme.family!r} (zero points / channel scales / own rule)"
    el = scheme.element_format
    if el.name not in _TORCH_FP8 or not hasattr(_torch(), _TORCH_FP8[el.name]):
        return f"element {el.name!r} has no torch FP8 dtype"
    p = scheme.preset
    if p.rounding != "rne" or p.rounding_for(el) != "rne":
        return f"element rounding {p.rounding_for(el)!r} (round to nearest even only)"
    if el.has_nan and p.overflow != "saturate":
        return f"overflow {p.overflow!r} (saturating only)"
    if p.nonfinite == "ignore_nan" or p.fp32_rule == "signed_minmax":
        return "a NaN-ignoring or signed min/max amax"
    return None


def round_float_rne(v, el):
    """``round_to_format(v, el, overflow="saturate", rounding="rne")`` of a float64 tensor ``v`` for a float
    element ``el`` (finite ``v``; +-Inf saturates): the nearest multiple of the binade's quantum
    ``2^(max(floor(log2|v|), emin) - man_bits)``, ties to even (``torch.round``; ``v / quantum`` is exact),
    clamped to ``+-max_finite``. The sign of a zero result is ``v``'s, as the codec writes it."""
    torch = _torch()
    _, e = torch.frexp(v.abs())
    k = torch.clamp(e.to(torch.int64) - 1, min=el.emin) - el.man_bits
    # 2^k from its exponent field (exact; torch.ldexp goes through pow, whose CUDA result need not be exact)
    q = ((k + 1023) << 52).view(torch.float64)
    r = torch.round(v / q) * q
    m = float(el.max_finite)
    return torch.clamp(r, -m, m)


def _amax_grid(a, block):
    """Block amax of the non-negative float64 ``a`` ``[R, N]`` over ``block`` (zero padding), ``[R/br, N/bk]``."""
    torch = _torch()
    r, n = (int(d) for d in a.shape)
    br, bk = block
    pr, pn = -(-r // br) * br, -(-n // bk) * bk
    if (pr, pn) != (r, n):
        a = torch.nn.functional.pad(a, (0, pn - n, 0, pr - r))
    return a.reshape(pr // br, br, pn // bk, bk).amax(dim=(1, 3))


def _expand(grid, block, shape):
    """Grid ``[R/br, N/bk]`` -> elements ``[R, N]`` (each block's value)."""
    r, n = shape
    br, bk = block
    return grid.repeat_interleave(br, dim=0)[:r].repeat_interleave(bk, dim=1)[:, :n]


def _host_scales(amaxes, scheme):
    """Per amax grid (device tensors): ``(decode scale grid float64, factor grid float64, op)`` on the
    device through the host scale step; None if a decode scale is NaN."""
    torch = _torch()
    from ..._interop import to_device
    from ...quant.blockwise import scales_from_amax
    from ...quant.tensor import QuantizedTensor

    dev = amaxes[0].device
    host = torch.stack(amaxes).cpu().numpy()  # one copy for the three grids

    def scale_step(a):
        res, _ = scales_from_amax(a, scheme, np.float64, static_scale=scheme.static_scale)
        if res.global_scale is not None or res.zero_point is not None or np.isnan(res.decode).any():
            return None
        return QuantizedTensor.scale_values(_ScalesOnly(scheme, res.stored)), np.asarray(res.factor, np.float64), res.op

    # the grids in parallel threads: NumPy's array loops release the GIL (3x less host time at 4096 tokens)
    with ThreadPoolExecutor(len(host)) as pool:
        out = list(pool.map(scale_step, host))
    if any(o is None for o in out):
        return None
    sv = to_device(np.stack([o[0] for o in out]), dev)  # queued copies: no second host wait
    fac = to_device(np.stack([o[1] for o in out]), dev)
    return [(sv[i], fac[i], out[i][2]) for i in range(len(out))]


class _ScalesOnly:
    """What :meth:`QuantizedTensor.scale_values` reads (a block-scale grid, no global or channel factor)."""

    def __init__(self, scheme, scales):
        self.scheme, self.scales, self.global_scale, self.channel_scales = scheme, scales, None, None


def device_requant(x, dx, quantizer, *, detail: bool = False):
    """The ``a2`` re-quantization of the valid rows' center ``x`` (float64 ``[V, N]`` on a device) and its
    uncertainty for ``|x~ - x| <= dx``: ``(operand, unc, flips)`` with ``operand`` a
    :class:`moeref.gemm.device.DeviceOperand` (the quantizer's codes and scales of ``x``), ``unc`` float64
    ``[V, N]`` (:func:`moeref.compare.stage_bounds.requant_uncertainty`), ``flips`` a 0-d int64 tensor; or
    None where the host must run the stage (a NaN block scale). ``detail=True`` appends the dict of
    ``requant_uncertainty(..., detail=True)`` (float64 ``[V, N]`` tensors: ``code_lo``, ``code_hi``,
    ``scale_lo``, ``scale_hi``, ``scale_ref``). Call only when :func:`device_requant_unavailable` is None."""
    return _device_requant(x, dx, quantizer, detail=detail)


def _kernels_usable(x, dx) -> bool:
    try:
        from ._requant_kernels import usable
    except ImportError:  # no triton
        return False
    return usable(x, dx)


def _device_requant(x, dx, quantizer, *, detail: bool = False, kernels: bool | None = None):
    """:func:`device_requant` by the Triton kernels (``kernels=True``; not with ``detail``) or the torch lines
    (``False``); ``None``: the kernels where they run (:func:`_kernels_usable`) and ``detail`` is off."""
    torch = _torch()
    from ...gemm.device import DeviceOperand

    if kernels is None:
        kernels = not detail and _kernels_usable(x, dx)
    if kernels and (detail or not _kernels_usable(x, dx)):
        raise ValueError("the requant kernels take float64 [V, N] on CUDA (CPU: TRITON_INTERPRET=1), no detail")
    _, scheme = _scheme(quantizer)
    el = scheme.element_format
    shape = tuple(int(d) for d in x.shape)
    block = tuple(int(b) for b in scheme.resolve_block(shape))
    drop = scheme.preset.signed_zero_for(el) == "drop" and el.has_negative_zero
    if kernels:
        from ._requant_kernels import amax_grids_t, requant_t

        grids = _host_scales(amax_grids_t(x, dx, block), scheme)
        if grids is None:
            return None
        (s_ref_g, fac, op), (s_up_g, _, _), (s_dn_g, _, _) = grids
        codes, unc, flips = requant_t(x, dx, fac, s_ref_g, s_up_g, s_dn_g, block, op, el, drop)
        return DeviceOperand(None, codes, el.name, s_ref_g, block, True), unc, flips
    mag = x.abs()
    lo_mag = torch.clamp(mag - dx, min=0.0)
    grids = _host_scales([_amax_grid(mag, block), _amax_grid(mag + dx, block), _amax_grid(lo_mag, block)], scheme)
    if grids is None:
        return None
    (s_ref_g, fac, op), (s_up_g, _, _), (s_dn_g, _, _) = grids
    # the center's codes: x scaled in float64 (the working dtype), rounded, read back as FP8 codes
    f = _expand(fac, block, shape)
    scaled = x * f if op == "mul" else x / f
    vals = round_float_rne(scaled, el)
    codes = vals.to(torch.float32).to(getattr(torch, _TORCH_FP8[el.name])).view(torch.uint8)
    if drop:
        codes = torch.where(codes == el.sign_mask, torch.zeros((), dtype=torch.uint8, device=x.device), codes)
    operand = DeviceOperand(None, codes, el.name, s_ref_g, block, True)
    # requant_uncertainty, operation for operation (q_ref: the codes decoded, times their scales)
    s_ref = _expand(s_ref_g, block, shape)
    q_ref = operand.decode() * s_ref
    s_hi = torch.maximum(_expand(s_up_g, block, shape), s_ref) * (1 + 2.0**-21)
    s_lo = torch.minimum(_expand(s_dn_g, block, shape), s_ref) * (1 - 2.0**-21)
    s_lo_safe = torch.where(s_lo > 0, s_lo, s_hi)
    a, b = x - dx, x + dx
    # the four corners' min and max, pairwise (no [4, V, N] stack): min/max select exactly, so the values are
    # the reductions' (a zero's sign may differ, and is lost in t -+ widen and in abs below)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    t_lo = t_hi = None
    for num, den in ((a, s_lo_safe), (a, s_hi), (b, s_lo_safe), (b, s_hi)):
        end = num / den
        end = torch.where(torch.isfinite(end), end, zero)
        t_lo = end if t_lo is None else torch.minimum(t_lo, end)
        t_hi = end if t_hi is None else torch.maximum(t_hi, end)
    widen = 2.0**-20 * torch.maximum(t_lo.abs(), t_hi.abs()) + 1e-300
    r_lo = round_float_rne(t_lo - widen, el)
    r_hi = round_float_rne(t_hi + widen, el)
    unc = None
    for s_, r_ in ((s_lo, r_lo), (s_lo, r_hi), (s_hi, r_lo), (s_hi, r_hi)):  # NaN propagates, as amax's
        d = (s_ * r_ - q_ref).abs()
        unc = d if unc is None else torch.maximum(unc, d)
    unc = torch.where(torch.isfinite(unc), unc, torch.full((), float("inf"), dtype=torch.float64, device=x.device))
    if detail:
        return operand, unc, torch.count_nonzero(r_lo != r_hi), dict(code_lo=r_lo, code_hi=r_hi, scale_lo=s_lo,
                                                                      scale_hi=s_hi, scale_ref=s_ref)
    return operand, unc, torch.count_nonzero(r_lo != r_hi)
