""":func:`moeref.quant.quantize` on a torch tensor (a CUDA GPU, or torch CPU): the same codes and scales, bit
for bit, without copying the elements to the host. The MoE reference's device engine quantizes its ``a1``
and ``a2`` activations with it (:mod:`moeref.moe.device`).

It shares no kernel with the fast paths (:mod:`fastpath`): every step is either the NumPy quantizer's own
code or elementwise operations whose result is fixed by IEEE 754 (torch's, or the same operations in this
module's own Triton kernel, below), so a fast quantizer checked against a device run is checked against an
independent computation. The steps are those of the blockwise engine
(:func:`moeref.quant.blockwise.quantize_blockwise`), in its order:

1. **block amax** on the device, from the input's bit patterns: the sign bit cleared, the integer maximum over
   each zero-padded block (what :func:`moeref.quant.blocks.block_amax` does; exact, in the input dtype; NaN
   patterns sort above Inf, so the grid also says which blocks hold a NaN or an Inf); for NaN-ignoring presets
   the NaN patterns are dropped and the maximum taken again, when a block holds a NaN;
2. **scales on the host**: the amax grid (one number per block, in the input dtype) is copied to the host
   and goes through the NumPy quantizer's scale step, :func:`moeref.quant.blockwise.scales_from_amax` with
   the scheme's rule (the generic FP32/UE8M0 rules, or NVFP4's two-level rule with its global scale): the
   same code gives the same stored scales, decode values and data factor for every preset knob (amax
   floors, zero blocks, NaN policies, static scales);
3. **scaling** on the device: the input widened to the working dtype (float32, float64 for float64 input;
   exact) times, or divided by, each block's factor: one correctly rounded IEEE operation per element, as
   NumPy's (torch's tensor-by-tensor product and quotient are correctly rounded on CUDA and the CPU, with
   subnormals; a division by a host *scalar* would not be, on CUDA, so the factor is always a tensor);
4. **element codes** from the codec's own table (:func:`moeref.formats.codec.code_table_f32`), looked up
   with the float32 bits of each scaled value. A float64 scaled value is first rounded to odd in float32,
   which changes no rounding to a format of at most 22 significant bits (Boldo and Melquiond, "When double
   rounding is odd", 2005: round-to-odd to ``p + 2`` or more bits, then rounding to ``p``, equals rounding to
   ``p`` directly); values beyond float32's range round to odd to ``+-FLT_MAX`` or the smallest subnormal,
   which every element format saturates or flushes as it would the float64 value;
5. NaN-scale blocks' codes, dropped zero signs (``signed_zero="drop"``), the TE NVFP4 order's code 0x0 for
   an exact zero product, cropping and nibble packing: as the NumPy engine.

**One pass on CUDA.** Steps 3-5 for the common case (float32 working dtype and factors, no NaN-scale block,
formats of more than 4 bits: one code per byte; FP8, FP6, INT8) run as one Triton kernel owned by this module,
:mod:`moeref.quant._device_kernels`: it reads each input element once, widens it to float32, applies the same one
IEEE operation with its block's factor (a product, or a correctly rounded ``div_rn``; no fused multiply-add), gives
a NaN the same sign, looks the code up in the same codec table and writes it. Elsewhere, and on the CPU, the torch
operations above run; ``property_tests/test_quant_device.py`` runs every case on both and checks the kernel
against them and :func:`moeref.quant.quantize` bit for bit (on CPU under ``TRITON_INTERPRET=1``) on drawn ties,
subnormals, saturating and special values.

**NaN-free shortcut** (torch path). The NaN-sign passes of step 4 are skipped when the host grids show that no
NaN can reach the cast: no block holds a NaN or an Inf (step 1's grid) and every factor is finite and nonzero.
Then every element of the padded blocks is finite (padding is zero) and each is multiplied or divided by a finite
nonzero number; an IEEE product or quotient is NaN only for a NaN operand, ``0 * Inf``, ``Inf * 0``, ``0 / 0`` or
``Inf / Inf``, none of which can occur, and rounding a non-NaN float64 value to odd in float32 gives no NaN. A
product may overflow to Inf, which the table encodes as it does on the host.

A NaN element that reaches the cast (NaN-ignoring or NaN-propagating presets whose block scale is finite)
has the sign NumPy's multiply gives it on the host: the input NaN's sign, or, for a NaN the operation
creates (``0 * Inf``), the host's default NaN (negative on x86-64), read once from NumPy at import. The
device's own NaN signs are never used (CUDA returns a canonical positive NaN).

Which schemes (:func:`device_quantize_unavailable` says why not): the ``"blockwise"`` family without zero
points or channel scales and without the signed min/max rule (FP8 per-tensor dynamic and static, per-token,
1xG groups with FP32 or UE8M0 scales, BxB blocks, MXFP8/MXFP6/MXFP4, INT8, symmetric INT4) and the
``"nvfp4"`` family (dynamic or static global scale), on float16/bfloat16/float32/float64 input. Errors
(non-finite NVFP4 input, a NaN the format cannot encode) are raised by the NumPy quantizer itself on a host
copy, so the message is the reference's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .._interop import to_device
from ..formats.codec import code_table_f32
from .blockwise import element_cast, nan_block_code, scales_from_amax, working_dtype
from .quantized import QuantizedTensor, scale_values
from .scheme import Scheme, _check_static_scale

__all__ = ["DeviceQuantized", "device_quantize", "device_quantize_unavailable", "round_to_odd_f32"]

_FLOAT_INPUT = ("float16", "bfloat16", "float32", "float64")


def _torch():
    import torch

    return torch


def _host_nan_negative(dtype) -> dict:
    """Whether NumPy's multiply and divide on this host give a negative NaN for an invalid operation
    (``0 * Inf``, ``Inf / Inf``), per working dtype (x86-64: the 'indefinite' NaN, negative)."""
    with np.errstate(invalid="ignore"):
        z = np.zeros(64, dtype)
        inf = np.full(64, np.inf, dtype)
        return {"mul": bool(np.signbit(z * inf)[0]), "div": bool(np.signbit(inf / inf)[0])}


_HOST_NAN_NEGATIVE = {np.dtype(np.float32): _host_nan_negative(np.float32),
                      np.dtype(np.float64): _host_nan_negative(np.float64)}


@dataclass(frozen=True, eq=False)
class DeviceQuantized:
    """A quantized tensor on a torch device: :class:`moeref.quant.QuantizedTensor`'s fields as tensors.

    Attributes:
        codes: uint8 tensor, the logical shape (4-bit formats packed two per byte along the last axis, even
            element low, as ``QuantizedTensor.codes``).
        scales: the stored block scales on the block grid (float32, or uint8 UE8M0/UE4M3 codes).
        scheme, shape, global_scale: as in :class:`~moeref.quant.QuantizedTensor`.
        scale_values: float64 decode multiplier per block (global factor included):
            :func:`moeref.quant.quantized.scale_values` of ``scales``, on the device; computed from the host
            copy of the scales on first use (a dispatch that only sends codes and scales never pays for it).
    """

    codes: object
    scales: object
    scheme: Scheme
    shape: tuple
    global_scale: float | None = None
    host_scales: np.ndarray = field(repr=False, default=None)  # the stored scales on the host (scale_values)

    @cached_property
    def scale_values(self):
        stored = self.scales.cpu().numpy() if self.host_scales is None else self.host_scales
        return to_device(scale_values(self.scheme, stored, self.global_scale), self.scales.device)

    @property
    def device(self):
        return self.codes.device

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.scheme.resolve_block(self.shape)

    def element_codes(self):
        """Unpacked element codes (uint8, logical shape) on the device."""
        if not self.scheme.packed:
            return self.codes
        torch = _torch()
        c = self.codes
        both = torch.stack([c & 0xF, c >> 4], dim=-1).reshape(*c.shape[:-1], 2 * c.shape[-1])
        return both[..., : self.shape[-1]]

    def to_host(self) -> QuantizedTensor:
        """The same tensor as a :class:`~moeref.quant.QuantizedTensor` (codes and scales copied to the host,
        bit for bit)."""
        from .._interop import to_numpy

        return QuantizedTensor(codes=to_numpy(self.codes), scales=to_numpy(self.scales), scheme=self.scheme,
                               shape=tuple(self.shape), global_scale=self.global_scale)

    def dequantize(self, dtype=np.float64):
        """:meth:`QuantizedTensor.dequantize` of :meth:`to_host` (a host array)."""
        return self.to_host().dequantize(dtype)


def _static_arg(scheme: Scheme, static: dict):
    """The validated static scale of a call (the NumPy quantizer's own checks), or None."""
    if scheme.family == "nvfp4":
        from .nvfp4 import _static_value

        g = static.get("global_scale")
        return None if g is None else _static_value(g)
    s = static.get("scale")
    return scheme.static_scale if s is None else _check_static_scale(s, scheme.scale_format, "scale")


def device_quantize_unavailable(scheme, x, static: dict | None = None) -> str | None:
    """None when :func:`device_quantize` runs ``scheme`` on the tensor ``x`` with the keyword arguments
    ``static``, else why not (the caller then quantizes a host copy with :func:`moeref.quant.quantize`)."""
    torch = _torch()
    static = dict(static or {})
    if not isinstance(scheme, Scheme):
        return f"not a moeref.quant.Scheme ({type(scheme).__name__})"
    if not torch.is_tensor(x):
        return f"x is not a torch tensor ({type(x).__name__})"
    if str(x.dtype).replace("torch.", "") not in _FLOAT_INPUT:
        return f"x dtype {x.dtype} (float16, bfloat16, float32 or float64)"
    if x.dim() == 0 or x.numel() == 0:
        return f"x of shape {tuple(x.shape)} (at least one axis and one element)"
    if scheme.family == "nvfp4":
        allowed = {"global_scale"}
    elif scheme.family == "blockwise":
        allowed = {"scale"}
    else:
        return f"scheme family {scheme.family!r} (zero points / channel scales: its own quantizer)"
    if not set(static) <= allowed:
        return f"static arguments {sorted(static)} (accepted for {scheme.family!r}: {sorted(allowed)})"
    if scheme.zero_point or scheme.channel_block:
        return "zero points / channel scales"
    if scheme.family == "blockwise":
        if scheme.scale_format not in ("fp32", "ue8m0"):
            return f"scale format {scheme.scale_format!r} in the blockwise family"
        if scheme.preset.fp32_rule == "signed_minmax" and scheme.scale_format == "fp32":
            return "the signed min/max scale rule"
    try:
        scheme.resolve_block(tuple(x.shape))
    except ValueError as e:
        return str(e)
    return None


def device_quantize(x, scheme: Scheme, **static) -> DeviceQuantized:
    """:func:`moeref.quant.quantize` ``(x, scheme, **static)`` of the torch tensor ``x`` on its device: a
    :class:`DeviceQuantized` whose codes, scales and global scale equal the NumPy quantizer's bit for bit
    (module docstring). ``static``: ``scale=`` (blockwise) or ``global_scale=`` (NVFP4), validated as
    :func:`moeref.quant.quantize` does. Raises ``ValueError`` when :func:`device_quantize_unavailable` names a
    reason."""
    torch = _torch()
    why = device_quantize_unavailable(scheme, x, static)
    if why is not None:
        raise ValueError(f"device_quantize cannot run {getattr(scheme, 'name', scheme)!r} here: {why}")
    x = x.detach()
    dev = x.device
    fixed = _static_arg(scheme, static)
    if scheme.family == "nvfp4":
        if not bool(torch.isfinite(x).all()):
            _raise_as_host(x, scheme, static)  # the reference's error for non-finite NVFP4 input
        from .nvfp4 import _nvfp4_rule as rule
    else:
        rule = None
    shape = tuple(int(d) for d in x.shape)
    block = tuple(int(b) for b in scheme.resolve_block(shape))
    k = len(block)
    p, el = scheme.preset, scheme.element_format
    in_np = _numpy_dtype(x.dtype)
    w = working_dtype(np.zeros(0, in_np))

    # 1. block amax from the bit patterns of the input dtype (sign cleared; NaN patterns sort above Inf)
    ibits = _bit_view(x)
    nbits = 8 * x.element_size()
    inf_bits = int(np.array(np.inf, in_np).view(_uint(nbits)))
    mag = _block_view(ibits, block) & ((1 << (nbits - 1)) - 1)
    raw = mag.amax(dim=_block_axes(mag.dim(), k)).cpu().numpy().view(_uint(nbits))
    nonfinite_blocks = raw >= inf_bits  # a NaN or an Inf in the block
    if p.nonfinite == "ignore_nan" and bool((raw > inf_bits).any()):  # NaN patterns dropped from the amax
        mag = torch.where(mag > inf_bits, torch.zeros((), dtype=mag.dtype, device=dev), mag)
        raw = mag.amax(dim=_block_axes(mag.dim(), k)).cpu().numpy().view(_uint(nbits))
    amax = raw.view(in_np)

    # 2. the NumPy quantizer's scale step on the grid
    res, _ = scales_from_amax(amax, scheme, w, rule=rule, static_scale=fixed)

    # 3.-4. the data scaled in the working dtype (the factor in float64 where the rule fell back to it), then
    # the element codes through the codec's table, NaN signs as on the host
    fac = np.asarray(res.factor if res.factor.dtype == np.float64 else res.factor.astype(w))
    nan_blocks = np.isnan(res.decode)
    cast = element_cast(el, p, nan_free=p.nonfinite == "nan_block")
    shift, table, marked = _table(el, cast, dev)
    host_neg = _HOST_NAN_NEGATIVE[np.dtype(np.float64 if fac.dtype == np.float64 else np.float32)][
        "mul" if res.op == "mul" else "div"]
    grid = shape[: len(shape) - k] + tuple(-(-d // b) for d, b in zip(shape[len(shape) - k:], block))
    fac_dev = to_device(fac, dev)
    if _use_kernel(x, fac, grid, k, nan_blocks, el):  # the one-pass Triton kernel (moeref.quant._device_kernels)
        from ._device_kernels import scaled_codes

        codes, flags = scaled_codes(x, fac_dev, block, res.op, table, shift, host_negative=host_neg,
                                    drop_negative_zero=p.signed_zero_for(el) == "drop" and el.has_negative_zero,
                                    sign_mask=int(el.sign_mask))
        if flags is not None and bool(flags.any()):
            _raise_as_host(x, scheme, static)  # a value the format cannot encode: the codec's error
    else:
        nb = None
        tw = torch.float64 if w == np.float64 else torch.float32
        xb = _block_view(x.to(tw), block)
        fb = _broadcast_to_blocks(fac_dev, k)
        scaled = xb * fb if res.op == "mul" else xb / fb
        if nan_blocks.any():  # a NaN-scale block decodes to NaN whatever its codes: cast zeros, fill NaN codes
            nb = _broadcast_to_blocks(to_device(nan_blocks, dev), k)
            scaled = torch.where(nb, torch.zeros((), dtype=scaled.dtype, device=dev), scaled)
        f32 = scaled if scaled.dtype == torch.float32 else round_to_odd_f32(scaled)
        u = f32.view(torch.int32)
        # NaN-free (module docstring): no block holds a NaN or an Inf, every factor is finite and nonzero
        if nonfinite_blocks.any() or not (np.isfinite(fac).all() and (fac != 0).all()):
            nan = torch.isnan(scaled)
            in_neg = _block_view(ibits, block) < 0  # the input's sign bit
            neg = torch.where(torch.isnan(xb), in_neg, torch.full((), host_neg, device=dev))
            canon = torch.where(neg, torch.full((), _NEG_NAN_BITS, dtype=torch.int32, device=dev),
                                torch.full((), 0x7FC00000, dtype=torch.int32, device=dev))
            u = torch.where(nan, canon, u)  # the quiet NaN of that sign
        codes = _lookup(u, shift, table, marked)
        if codes is None:
            _raise_as_host(x, scheme, static)  # a value the format cannot encode: the codec's error

        # 5. NaN blocks, dropped zero signs, TE's exact-zero code
        if nb is not None:
            codes = torch.where(nb, torch.full((), nan_block_code(el, p), dtype=torch.uint8, device=dev), codes)
        if p.signed_zero_for(el) == "drop" and el.has_negative_zero:
            codes = torch.where(codes == el.sign_mask, torch.zeros((), dtype=torch.uint8, device=dev), codes)
        if scheme.family == "nvfp4" and p.option("nvfp4_order") == "te":
            # TE cast_to_fp4x2 (moeref.quant.nvfp4.quantize_nvfp4): an exact zero product is code 0x0, not 0x8
            codes = torch.where((codes == 0x8) & (scaled == 0), torch.zeros((), dtype=torch.uint8, device=dev),
                                codes)
        codes = _crop(codes, shape, block, res.stored.shape)
    if el.bits == 4:
        if shape[-1] % 2:
            codes = torch.cat([codes, torch.zeros(codes.shape[:-1] + (1,), dtype=torch.uint8, device=dev)], dim=-1)
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    codes = codes.contiguous()
    stored = np.ascontiguousarray(res.stored)
    glob = None if res.global_scale is None else float(res.global_scale)
    if fac.dtype == stored.dtype and fac.shape == stored.shape and \
            np.array_equal(fac.view(_uint(8 * fac.itemsize)), stored.view(_uint(8 * stored.itemsize))):
        scales_dev = fac_dev  # the factor is the stored scale, bit for bit (x / s): one copy to the device
    else:
        scales_dev = to_device(stored, dev)
    return DeviceQuantized(codes, scales_dev, scheme, shape, glob, stored)


_NEG_NAN_BITS = int(np.array(0xFFC00000, np.uint32).view(np.int32))


def _raise_as_host(x, scheme, static):
    """Run the NumPy quantizer on a host copy of ``x``, which raises the reference's error."""
    from .._interop import to_numpy
    from .tensor import quantize

    quantize(to_numpy(x.cpu()), scheme, **static)
    raise AssertionError(f"the device quantizer found {scheme.name!r} input the host quantizer accepts")


def _numpy_dtype(tdtype):
    import ml_dtypes

    name = str(tdtype).replace("torch.", "")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _uint(nbits: int):
    return {16: np.uint16, 32: np.uint32, 64: np.uint64}[nbits]


def _bit_view(x):
    """The signed-integer tensor of ``x``'s bit patterns (same shape)."""
    torch = _torch()
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _block_axes(ndim: int, k: int) -> tuple[int, ...]:
    return tuple(ndim - 2 * k + 2 * i + 1 for i in range(k))


def _block_view(t, block):
    """``t`` zero-padded on its last ``len(block)`` axes and viewed as ``[..., n0, b0, n1, b1]``
    (:func:`moeref.quant.blocks.block_view`)."""
    k = len(block)
    lead = tuple(t.shape[: t.dim() - k])
    tail = tuple(t.shape[t.dim() - k:])
    padded = tuple(-(-d // b) * b for d, b in zip(tail, block))
    if padded != tail:
        tp = t.new_zeros(lead + padded)
        tp[(...,) + tuple(slice(0, d) for d in tail)] = t
        t = tp
    return t.reshape(lead + tuple(v for d, b in zip(padded, block) for v in (d // b, b)))


def _broadcast_to_blocks(grid, k: int):
    """A size-1 axis after each blocked grid axis (:func:`moeref.quant.blocks.broadcast_to_blocks`)."""
    nl = grid.dim() - k
    return grid.reshape(tuple(grid.shape[:nl]) + tuple(v for n in grid.shape[nl:] for v in (n, 1)))


_TABLES: dict = {}


def _table(el, cast: dict, dev):
    """The codec's code table of ``el`` under ``cast`` on ``dev``, copied there once: ``(shift, table, marked)``
    (uint8, or int16 with negative markers where a value has no code: ``marked``)."""
    torch = _torch()
    key = (el.name, cast["rounding"], cast["overflow"], cast["nan_code"], str(dev))
    if key not in _TABLES:
        shift, codes = code_table_f32(el, **cast)
        marked = bool((codes < 0).any())
        table = torch.as_tensor(np.array(codes if marked else codes.astype(np.uint8)), device=dev)
        _TABLES[key] = (shift, table, marked)
    return _TABLES[key]


def _lookup(u, shift: int, table, marked: bool):
    """uint8 codes of the float32 bit patterns ``u`` (int32 tensor) from a code table (:func:`_table`); None
    when a value has no code (the codec raises there)."""
    torch = _torch()
    hi = (u >> shift) & ((1 << (32 - shift)) - 1)  # a logical shift of the uint32 bits
    idx = (hi << 1) | ((u & ((1 << shift) - 1)) != 0).to(torch.int32)
    codes = table.index_select(0, idx.reshape(-1)).reshape(idx.shape)
    if marked:
        if bool((codes < 0).any()):
            return None
        codes = codes.to(torch.uint8)
    return codes


def _crop(codes, shape: tuple, block: tuple, grid: tuple):
    """Codes of the zero-padded block view, reshaped to the padded shape and cropped to ``shape``."""
    k = len(block)
    lead = shape[: len(shape) - k]
    padded = lead + tuple(n * b for n, b in zip(grid[len(grid) - k:], block))
    return codes.reshape(padded)[(...,) + tuple(slice(0, d) for d in shape[len(shape) - k:])]


# None: the kernel where it applies on CUDA; True / False: forced (tests run it under TRITON_INTERPRET=1 on CPU)
_KERNEL: bool | None = None


def _use_kernel(x, fac: np.ndarray, grid: tuple, k: int, nan_blocks: np.ndarray, el) -> bool:
    """Whether :func:`device_quantize` takes the one-pass kernel (:mod:`moeref.quant._device_kernels`): on CUDA
    with Triton, float32 factors on the whole block ``grid`` (so a float32 working dtype), no NaN-scale block, one
    code per byte, blocks over the last ``k`` = one or two axes."""
    if _KERNEL is False or fac.dtype != np.float32 or tuple(fac.shape) != tuple(grid) or nan_blocks.any():
        return False
    if el.bits <= 4 or x.dtype == _torch().float64 or k not in (1, 2):
        return False
    if _KERNEL is None:
        if not x.is_cuda:
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
    return True


def round_to_odd_f32(x):
    """float64 tensor -> float32 rounded to odd: truncated toward zero, the last bit set when inexact.
    Beyond float32's range the result is ``+-FLT_MAX`` (odd); below it, ``+-2^-149``; NaN stays NaN.
    The first of two roundings that together give a single rounding (to float16 in
    :func:`moeref.moe.device.round_on_device`, to an element format in :func:`device_quantize`)."""
    torch = _torch()
    f = x.to(torch.float32)
    back = f.to(torch.float64)
    inexact = (back != x) & ~x.isnan()
    bits = f.view(torch.int32)
    bits = torch.where(inexact & (back.abs() > x.abs()), bits - 1, bits)  # toward zero (sign-magnitude)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32)
