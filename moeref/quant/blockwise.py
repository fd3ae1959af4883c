"""The one generic blockwise engine: pad, view as blocks, amax, scale rule, scale the data, encode.

Every scheme with one scale per block of the last ``k`` axes runs through
:func:`quantize_blockwise` (FP8 per-tensor/token/channel/group/block, MX, INT8, symmetric INT4,
and NVFP4's module with its own rule). Steps, all vectorised:

1. ``x`` is read as a NumPy array (float16/bfloat16/float32/float64, torch CPU tensors through
   :mod:`moeref._interop`) and widened to the working dtype: float32, or float64 for float64
   input (see :mod:`moeref.quant.scale_rules`).
2. Each blocked axis is padded with ZEROS up to a multiple of its block (DeepGEMM
   ``per_token_cast_to_fp8``/``per_block_cast_to_fp8`` pad with zeros; zeros never raise an
   amax, so a partial block's scale is that of its real elements) and viewed as
   ``[..., n0, b0, n1, b1, ...]``.
3. The block amax (``max |x|``, exact, read from the IEEE bit patterns of the input dtype) is
   NaN-propagating (``torch.amax``) or, for ``Preset.nonfinite="ignore_nan"``, NaN-ignoring
   (TE's ``fmaxf``); ``Preset.amax_floor`` clamps it below.
4. The scale rule gives stored scales, decode multipliers and the data factor.
5. Data are multiplied or divided by the broadcast factor in the working dtype (one rounding,
   as the anchor's float32 op), then cast element by element with :func:`moeref.formats.encode`
   under the preset's rounding, overflow and NaN code.
6. Blocks with a NaN decode scale get NaN element codes; ``signed_zero='drop'`` clears the sign
   of zero codes; the padding is cropped and 4-bit codes are packed two per byte.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import ml_dtypes

from .._checks import as_float_array
from ..formats import encode, pack_nibbles
from ..formats.spec import ElementFormat
from .blocks import (block_amax, block_reduce, block_view, broadcast_to_blocks, expand_to_elements,
                     grid_shape)
from .quantized import QuantizedTensor
from .scale_rules import RuleContext, ScaleResult, compute_scales
from .scheme import Scheme

__all__ = [
    "working_dtype",
    "as_input",
    "block_view",
    "block_amax",
    "scales_from_amax",
    "block_reduce",
    "broadcast_to_blocks",
    "grid_shape",
    "quantize_blockwise",
    "encode_elements",
    "element_cast",
    "nan_block_code",
]


def working_dtype(x: np.ndarray) -> np.dtype:
    """float64 for float64 input, else float32 (every anchor computes in float32)."""
    return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)


def as_input(x, name: str = "x") -> np.ndarray:
    """Validate and read ``x`` (NumPy/ml_dtypes/torch CPU, float16/bfloat16/float32/float64)."""
    a = as_float_array(x, name)
    if a.dtype not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
                       np.dtype(ml_dtypes.bfloat16)):
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64 to be quantized; got {a.dtype} "
            "(dequantize low-precision input first)"
        )
    if a.ndim == 0:
        raise ValueError(f"{name} must have at least one axis; got a scalar")
    return a


def encode_elements(scaled: np.ndarray, element: ElementFormat, preset, *,
                    nan_free: bool = False) -> np.ndarray:
    """Element cast of already-scaled data under the preset's rounding/overflow/NaN code.

    ``nan_free``: the caller guarantees ``scaled`` holds no NaN (NaN blocks already masked), so
    formats without NaN can use the codec's fast table path (any nan_code is then never used).
    """
    return encode(scaled, element, **element_cast(element, preset, nan_free=nan_free))


def element_cast(element: ElementFormat, preset, *, nan_free: bool = False) -> dict:
    """The :func:`moeref.formats.encode` arguments (``overflow``, ``rounding``, ``nan_code``) of the
    element cast under ``preset`` (:func:`encode_elements`; the device quantizer reads the same)."""
    nan_code = preset.nan_code_for(element) if not element.has_nan else None
    if nan_code is None and nan_free and not element.has_nan:
        nan_code = 0
    overflow = preset.overflow if element.has_nan else "saturate"
    return dict(overflow=overflow, rounding=preset.rounding_for(element), nan_code=nan_code)


def nan_block_code(element: ElementFormat, preset) -> int:
    """The element code every element of a NaN-scale block gets: the format's NaN, else the preset's
    NaN code for the format, else 0 (the block decodes to NaN whatever its codes)."""
    nc = preset.nan_code_for(element)
    return element.nan_code if element.has_nan else (nc if nc is not None else 0)


def scales_from_amax(amax: np.ndarray, scheme: Scheme, work, *, rule: Callable | None = None, static_scale=None,
                     bmin=None, bmax=None) -> tuple[ScaleResult, RuleContext]:
    """The scale step of :func:`quantize_blockwise` from the block amax grid (the preset's amax floor and
    zero-block rule, then ``rule`` or :func:`~moeref.quant.scale_rules.compute_scales` in the working
    dtype ``work``): ``(ScaleResult, RuleContext)``. Used alone by engines that reduce the amax elsewhere
    (the device bound's re-quantization, :mod:`moeref.compare.device.requant`)."""
    p = scheme.preset
    w = np.dtype(work)
    with np.errstate(invalid="ignore"):
        amax = np.asarray(amax).astype(w)
        if p.amax_floor > 0:
            amax = np.maximum(amax, w.type(p.amax_floor))
        if p.zero_block == "unit_amax":
            amax = np.where(amax == 0, w.type(1), amax)
    ctx = RuleContext(scheme=scheme, preset=p, element=scheme.element_format, work=w, bmin=bmin, bmax=bmax,
                      static_scale=static_scale)
    return (rule or compute_scales)(amax, ctx), ctx


def quantize_blockwise(x, scheme: Scheme, *, rule: Callable | None = None, static_scale=None,
                       need_minmax: bool = False, finalize: Callable | None = None):
    """Quantize ``x`` with one scale per block of ``scheme.block`` (see the module docstring).

    Args:
        x: input array/tensor, any leading shape.
        scheme: the scheme; its preset supplies every knob.
        rule: ``rule(amax, ctx) -> ScaleResult`` replacing the generic
            :func:`~moeref.quant.scale_rules.compute_scales` (NVFP4 passes its own).
        static_scale: fixed decode scale (validated by the caller).
        need_minmax: also reduce the signed block min/max into the rule's context.
        finalize: optional ``finalize(codes_unpacked, result, ctx) -> dict`` of extra fields
            for the :class:`~moeref.quant.tensor.QuantizedTensor` (zero points ...).

    Returns:
        :class:`~moeref.quant.tensor.QuantizedTensor`.
    """
    xa = as_input(x)
    w = working_dtype(xa)
    shape = xa.shape
    block = scheme.resolve_block(shape)
    k = len(block)
    p = scheme.preset
    el = scheme.element_format
    xw = xa.astype(w, copy=False)
    xb = block_view(xw, block)

    with np.errstate(invalid="ignore"):
        amax = block_amax(block_view(xa, block), k, p.nonfinite == "ignore_nan")
        bmin = block_reduce(xb, k, "min") if need_minmax else None
        bmax = block_reduce(xb, k, "max") if need_minmax else None
    res, ctx = scales_from_amax(amax, scheme, w, rule=rule, static_scale=static_scale, bmin=bmin, bmax=bmax)

    # the factor is in the working dtype, except in the rare float64 fallback of finalize_scales
    fb = broadcast_to_blocks(res.factor if res.factor.dtype == np.float64 else res.factor.astype(w), k)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        scaled = xb * fb if res.op == "mul" else xb / fb
    nan_blocks = np.isnan(res.decode)
    if nan_blocks.any():
        # the block decodes to NaN whatever its codes: write NaN codes (no NaN: nan_code or 0)
        fill = nan_block_code(el, p)
        scaled = np.where(broadcast_to_blocks(nan_blocks, k), w.type(0), scaled)
    if res.zero_point is not None:
        # GPTQ order: round(x / s) as a signed integer, then + zero point, then clamp to the codes
        r = encode(scaled, "int8", overflow="saturate", rounding=p.rounding_for(el),
                   nan_code=p.nan_code).view(np.int8).astype(np.int16)
        r = r + broadcast_to_blocks(res.zero_point.astype(np.int16), k)
        codes = np.clip(r, el.min_value, el.max_finite).astype(np.uint8)
    else:
        codes = encode_elements(scaled, el, p, nan_free=p.nonfinite == "nan_block")
    if nan_blocks.any():
        codes = np.where(broadcast_to_blocks(nan_blocks, k), np.uint8(fill), codes).astype(np.uint8)
    if p.signed_zero_for(el) == "drop" and el.has_negative_zero:
        codes = np.where(codes == el.sign_mask, np.uint8(0), codes).astype(np.uint8)
    padded_shape = shape[: len(shape) - k] + tuple(n * b for n, b in zip(res.stored.shape[-k:], block))
    codes = codes.reshape(padded_shape)[(...,) + tuple(slice(0, d) for d in shape[len(shape) - k:])]
    extra = dict(res.extra)
    if res.zero_point is not None:
        extra["zero_points"] = res.zero_point
    if finalize is not None:
        extra.update(finalize(codes, res, ctx))
    if "codes" in extra:
        codes = extra.pop("codes")
    if el.bits == 4:
        if shape[-1] % 2:
            codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
        codes = pack_nibbles(codes)
    else:
        codes = np.ascontiguousarray(codes)
    return QuantizedTensor(codes=codes, scales=res.stored, scheme=scheme, shape=tuple(shape),
                           global_scale=res.global_scale, **extra)
