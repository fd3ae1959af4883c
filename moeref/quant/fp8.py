"""FP8 (E4M3 / E5M2) scaling schemes: per-tensor, per-token, per-channel, 1xG groups, BxB blocks.

Every constructor returns a :class:`~moeref.quant.scheme.Scheme` for the blockwise engine; the
preset picks the anchor's arithmetic (docs/fp8-scaling.md has the table):

* ``"deepgemm"``: ``per_token_cast_to_fp8`` / ``per_block_cast_to_fp8``
  (deep_gemm/utils/math.py): ``amax.clamp(1e-4)``, ``sf = amax / 448``, optional
  ``ceil_to_ue8m0`` clamped to [1, 254], ``x * (1 / sf)``, torch cast (saturating in 2.13).
* ``"vllm"``: ``per_token_group_quant_fp8`` (fp8_utils.py): ``max(amax, 1e-10) / 448``,
  UE8M0 ``2^ceil(log2 s)``, ``clamp(x / s, -448, 448)``.
* ``"te_fp8"`` / ``"te_fp8_block"``: TransformerEngine current scaling: encode ``448 / amax``,
  ``scale_inv = 1 / encode``; blockwise recipe rounds the encode scale down to a power of two.
* ``"default"``: ``s = amax / 448`` in float32, ``x / s`` (one rounding), RNE, saturate, a zero
  block gets scale 1, NaN/Inf make the block NaN.

>>> import numpy as np
>>> from moeref.quant import quantize, fp8_group
>>> x = np.array([[0.5, -1.0, 3.0, 1000.0]], np.float32)
>>> q = quantize(x, fp8_group(2, scale="ue8m0", preset="deepgemm"))
>>> q.scales.tolist()          # ceil_to_ue8m0(1/448) = 2^-8, ceil_to_ue8m0(1000/448) = 2^2
[[119, 129]]
>>> q.dequantize().tolist()
[[0.5, -1.0, 3.0, 1024.0]]
"""
from __future__ import annotations

from .._checks import check_choice, check_positive_int
from .scheme import Scheme, get_preset

__all__ = ["fp8_per_tensor", "fp8_per_token", "fp8_per_channel", "fp8_group", "fp8_block"]

_FP8 = ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz")


def _elem(element: str) -> str:
    from ..formats import get_format

    name = get_format(element).name
    check_choice(name, _FP8, "FP8 element format")
    return name


def _scale(scale: str) -> str:
    return check_choice(scale, ("fp32", "ue8m0"), "FP8 scale format")


def fp8_per_tensor(static_scale=None, *, element: str = "e4m3fn", preset="default",
                   scale: str = "fp32") -> Scheme:
    """One scale per trailing 2-D matrix (block ``(None, None)``); ``static_scale`` fixes it.

    A 1-D input gets one scale; a 3-D ``[E, N, K]`` input one per leading index (per expert).
    """
    el = _elem(element)
    kind = "static" if static_scale is not None else "dynamic"
    return Scheme(name=f"fp8_{el}_per_tensor_{kind}", element=el, block=(None, None),
                  scale_format=_scale(scale), preset=get_preset(preset),
                  static_scale=None if static_scale is None else static_scale,
                  description=f"FP8 {el}, per-tensor {kind} {scale} scale")


def fp8_per_token(*, element: str = "e4m3fn", preset="default", scale: str = "fp32") -> Scheme:
    """One scale per row of an activation ``[..., M, K]`` (block ``(1, None)``)."""
    el = _elem(element)
    return Scheme(name=f"fp8_{el}_per_token", element=el, block=(1, None),
                  scale_format=_scale(scale), preset=get_preset(preset),
                  description=f"FP8 {el}, per-token {scale} scale")


def fp8_per_channel(*, element: str = "e4m3fn", preset="default", scale: str = "fp32") -> Scheme:
    """One scale per output channel of a weight ``[..., N, K]`` (block ``(1, None)``: rows)."""
    el = _elem(element)
    return Scheme(name=f"fp8_{el}_per_channel", element=el, block=(1, None),
                  scale_format=_scale(scale), preset=get_preset(preset),
                  description=f"FP8 {el}, per-output-channel {scale} scale")


def fp8_group(group_size: int = 128, scale: str = "fp32", preset="default", *,
              element: str = "e4m3fn") -> Scheme:
    """One scale per ``group_size`` consecutive elements of a row (block ``(1, group_size)``)."""
    g = check_positive_int(group_size, "group_size")
    el = _elem(element)
    return Scheme(name=f"fp8_{el}_1x{g}_{scale}", element=el, block=(1, g),
                  scale_format=_scale(scale), preset=get_preset(preset),
                  description=f"FP8 {el}, 1x{g} groups, {scale} scales")


def fp8_block(block=(128, 128), scale: str = "fp32", preset="default", *,
              element: str = "e4m3fn") -> Scheme:
    """One scale per ``block`` tile of the last two axes (DeepSeek-V3 weights: 128x128)."""
    if not isinstance(block, tuple) or len(block) != 2:
        raise ValueError(f"block must be a tuple of two ints; got {block!r}")
    b0 = check_positive_int(block[0], "block[0]")
    b1 = check_positive_int(block[1], "block[1]")
    el = _elem(element)
    return Scheme(name=f"fp8_{el}_{b0}x{b1}_{scale}", element=el, block=(b0, b1),
                  scale_format=_scale(scale), preset=get_preset(preset),
                  description=f"FP8 {el}, {b0}x{b1} blocks, {scale} scales")
