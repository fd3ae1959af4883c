"""Integer schemes: INT8 per-token/per-channel, INT4 groups (W4A16), and CUTLASS W4A8.

* ``int8_per_token`` / ``int8_per_channel``: ``s = amax / 127``, ``q = clamp(round(x / s))``
  (RNE, ``[-128, 127]``); preset ``"vllm_int8"`` reproduces vLLM's dynamic kernel
  (``x * (127 / amax)``).
* ``int4_group(symmetric=True)``: ``s = amax / 7``, codes -7..7 (default preset: symmetric, and
  idempotent: requantizing the dequantized tensor gives the same codes and scales). Preset
  ``"gptq"``: GPTQ / compressed-tensors symmetric INT4, ``s = amax / 7.5`` (``2 amax / 15``):
  ``-amax`` maps to code -8 exactly and ``+amax`` saturates to 7 (finer steps, but not
  idempotent: the requantized block's amax is ``7 s``); checkpoints store ``q + 8``
  (``uint4b8``). Preset ``"vllm_int4"``: vLLM ``quantize_weights`` ``s = max(max/7, -min/8)``.
* ``int4_group(symmetric=False)``: GPTQ asymmetric (``Quantizer.find_params``): the range is
  widened to include 0, ``s = (xmax - xmin) / 15``, ``zp = round(-xmin / s)``,
  ``q = clamp(round(x / s) + zp, 0, 15)``; value = ``(q - zp) * s``. All-zero block: GPTQ
  uses ``xmin, xmax = -1, 1``.
* ``w4a8_cutlass()``: vLLM's CUTLASS W4A8 layout (``cutlass_w4a8_mm``): signed INT4 weights in
  groups of 128 along K with FP8 E4M3 group scales and FP32 per-output-channel scales. Group
  scales start from vLLM ``quantize_weights`` (``max(max/7, -min/8)``); with
  ``channel_scales="max"`` (default) the channel scale is ``max_g(s_g) / 448`` so the group
  scales use the FP8 range, the group scale stored is ``e4m3(s_g / c)`` and the data are
  quantized with the stored product ``e4m3(s_g / c) * c`` (so codes and scales agree). vLLM's
  loader today casts ``s_g`` to FP8 directly with channel scales of one
  (``channel_scales="ones"``); its test reference quantizes the data with the UNROUNDED group
  scales and rounds the scales afterwards, which moeref refuses to do (the same pattern as
  huggingface/transformers#47030 and sgl-project/sglang PR #28307).

A K that is not a multiple of the group is zero-padded for the last group's scale, like every
blockwise scheme here; ``cutlass_w4a8_mm`` itself needs whole groups, so pad K before packing.

Codes are stored as two's complement (INT4 ``-1`` is ``0xF``) packed two per byte, even element
low; :func:`moeref.formats.pack_int4_to_int32` gives CUTLASS's eight-per-int32 order.

>>> import numpy as np
>>> from moeref.quant import quantize, int4_group
>>> x = np.array([[-3.75, 0.0, 1.0, 3.75]])
>>> quantize(x, int4_group(4)).element_values().tolist()           # s = 3.75 / 7
[[-7.0, 0.0, 2.0, 7.0]]
>>> q = quantize(x, int4_group(4, preset="gptq"))                  # s = 3.75 / 7.5 = 0.5
>>> q.scales.tolist(), q.element_values().tolist()                 # +7.5 saturates to 7
([[0.5]], [[-8.0, 0.0, 2.0, 7.0]])
"""
from __future__ import annotations

import numpy as np

from .._checks import check_choice, check_positive_int
from ..formats import decode_table, encode
from .blockwise import as_input, quantize_blockwise
from .scale_rules import ScaleResult, fp32_scales
from .scheme import Scheme, get_preset
from .tensor import register_quantizer

__all__ = ["int8_per_token", "int8_per_channel", "int4_group", "w4a8_cutlass"]


def int8_per_token(*, preset="default") -> Scheme:
    """INT8, one FP32 scale per row of an activation ``[..., M, K]``."""
    return Scheme(name="int8_per_token", element="int8", block=(1, None), scale_format="fp32",
                  preset=get_preset(preset), description="INT8 per-token, FP32 scale amax/127")


def int8_per_channel(*, preset="default") -> Scheme:
    """INT8, one FP32 scale per output channel (row) of a weight ``[..., N, K]``."""
    return Scheme(name="int8_per_channel", element="int8", block=(1, None), scale_format="fp32",
                  preset=get_preset(preset), description="INT8 per-channel, FP32 scale amax/127")


def int4_group(group_size: int = 128, symmetric: bool = True, *, preset=None) -> Scheme:
    """INT4 weights, one FP32 scale per ``group_size`` elements along K (W4A16)."""
    g = check_positive_int(group_size, "group_size")
    if symmetric:
        return Scheme(name=f"int4_g{g}_sym", element="int4", block=(1, g), scale_format="fp32",
                      preset=get_preset(preset or "default"),
                      description=f"INT4 symmetric groups of {g} (amax/7)")
    return Scheme(name=f"int4_g{g}_asym", element="uint4", block=(1, g), scale_format="fp32",
                  preset=get_preset(preset or "gptq"), family="int_asym", zero_point=True,
                  description=f"UINT4 + zero point, groups of {g} (GPTQ asymmetric)")


def w4a8_cutlass(group_size: int = 128, *, channel_scales: str = "max") -> Scheme:
    """INT4 weights ``[N, K]``: FP8 E4M3 group scales (1 x 128) and FP32 per-channel scales."""
    g = check_positive_int(group_size, "group_size")
    check_choice(channel_scales, ("max", "ones"), "channel_scales")
    preset = get_preset("vllm_int4").with_(name=f"w4a8_{channel_scales}",
                                            options=(("channel_scales", channel_scales),))
    return Scheme(name=f"w4a8_cutlass_g{g}", element="int4", block=(1, g), scale_format="ue4m3",
                  preset=preset, family="w4a8", channel_block=(1, None),
                  description="INT4 groups with E4M3 group scales and FP32 channel scales (CUTLASS W4A8)")


# ---- quantizers ------------------------------------------------------------------------------

def _asym_rule(amax, ctx) -> ScaleResult:
    w = ctx.work
    qmax = w.type(ctx.element.max_finite)
    xmin = np.minimum(ctx.bmin.astype(w), w.type(0))
    xmax = np.maximum(ctx.bmax.astype(w), w.type(0))
    both0 = (xmin == 0) & (xmax == 0)
    xmin = np.where(both0, w.type(-1), xmin)
    xmax = np.where(both0, w.type(1), xmax)
    with np.errstate(invalid="ignore"):
        s = ((xmax - xmin) / qmax).astype(np.float32)
        zp = encode((-xmin / s.astype(w)).astype(w), "uint8", overflow="saturate")
    zp = np.minimum(zp, int(qmax)).astype(np.int16)
    return ScaleResult(stored=s, decode=s.astype(np.float64), factor=s.astype(w), op="div",
                       zero_point=zp)


def _quantize_int_asym(x, scheme: Scheme):
    return quantize_blockwise(x, scheme, rule=_asym_rule, need_minmax=True)


def _w4a8_rule(amax, ctx) -> ScaleResult:
    sg = fp32_scales(amax, ctx).stored.astype(np.float64)  # signed_minmax group scales
    zero = ~(sg > 0)  # all-zero group: scale code 0, codes 0
    if ctx.preset.option("channel_scales") == "ones":
        ch = np.ones(sg.shape[:-1] + (1,), np.float32)
    else:
        top = np.max(np.where(zero, 0.0, sg), axis=-1, keepdims=True)
        ch = np.where(top > 0, top / 448.0, 1.0).astype(np.float32)
        ch = np.maximum(ch, np.float32(2.0 ** -149))  # top / 448 may underflow float32
    codes = encode(np.where(zero, 0.0, sg / ch.astype(np.float64)), "ue4m3", overflow="saturate")
    # a group 2^-18 below its row's largest rounds to scale 0: use the smallest E4M3 scale
    # instead (coarser, never saturating), so its values are not silently zeroed
    codes = np.where(zero, 0, np.maximum(codes, 1)).astype(np.uint8)
    dec = decode_table("ue4m3")[codes]
    eff = dec * ch.astype(np.float64)
    factor = np.where(zero, 1.0, eff).astype(ctx.work)
    return ScaleResult(stored=codes, decode=dec, factor=factor, op="div",
                       extra={"channel_scales": ch})


def _quantize_w4a8(x, scheme: Scheme):
    xa = as_input(x)
    if xa.ndim < 2:
        raise ValueError(f"W4A8 weights must be [..., N, K]; got shape {xa.shape}")
    return quantize_blockwise(xa.astype(np.float64), scheme, rule=_w4a8_rule, need_minmax=True)


register_quantizer("int_asym", _quantize_int_asym)
register_quantizer("w4a8", _quantize_w4a8)
