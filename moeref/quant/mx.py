"""OCP MX v1.0 schemes: MXFP8, MXFP6, MXFP4 (32 elements share one UE8M0 scale).

The scale is a power of two read from the block amax's exponent bits. Presets (docs/mx-formats.md
tabulates them with their sources):

* ``"ocp"`` = ``"torchao_floor"``: ``2^(floor(log2 amax) - emax_elem)`` (OCP §6.3, torchao
  FLOOR). Can saturate the block max (E4M3 amax in (448, 512) x 2^k; microxcaling#4).
* ``"torchao_ceil"``, ``"torchao_even"``: torchao's CEIL and EVEN.
* ``"torchao_rceil"``: ``2^ceil(log2(amax * fl(1/M)))``, non-satfinite (cuBLAS).
* ``"te_mxfp8"``: RCEIL satfinite with a NaN-ignoring amax (TransformerEngine).
* ``"deepgemm"``: ``ceil_to_ue8m0(max(amax, 1e-4) / M)`` clamped [1, 254], FP4 ties toward zero.
* ``"microxcaling"``: FLOOR with ties-away element rounding.
* ``"default"``: RCEIL (the block max never saturates), RNE, saturate, NaN/Inf -> NaN block.

>>> import numpy as np
>>> from moeref.quant import quantize, mxfp4
>>> x = np.array([0.0, 0.25, 0.75, 1.0, 5.0, 6.0, -7.0, 12.0] * 4, np.float32)
>>> q = quantize(x, mxfp4(preset="ocp"))
>>> int(q.scales[0])                  # floor(log2 12) - 2 = 1 -> 2^1
128
>>> q.dequantize()[:8].tolist()       # x / 2 rounded RNE to E2M1, times 2
[0.0, 0.0, 1.0, 1.0, 4.0, 6.0, -8.0, 12.0]
"""
from __future__ import annotations

from .._checks import check_choice, check_positive_int
from .scheme import Scheme, get_preset

__all__ = ["mxfp8", "mxfp6", "mxfp4"]


def _mx(kind: str, element: str, preset, block_size: int) -> Scheme:
    b = check_positive_int(block_size, "block_size")
    return Scheme(name=f"{kind}_{element}" + ("" if b == 32 else f"_b{b}"), element=element,
                  block=(1, b), scale_format="ue8m0", preset=get_preset(preset),
                  description=f"OCP {kind.upper()} ({element}, {b} elements per UE8M0 scale)")


def mxfp8(element: str = "e4m3fn", *, preset="default", block_size: int = 32) -> Scheme:
    """MXFP8: E4M3 (or E5M2) elements, 32 per UE8M0 scale along the last axis."""
    check_choice(element, ("e4m3fn", "e5m2"), "MXFP8 element")
    return _mx("mxfp8", element, preset, block_size)


def mxfp6(element: str = "e2m3", *, preset="default", block_size: int = 32) -> Scheme:
    """MXFP6: E2M3 or E3M2 elements (one code per byte, unpacked)."""
    check_choice(element, ("e2m3", "e3m2"), "MXFP6 element")
    return _mx("mxfp6", element, preset, block_size)


def mxfp4(*, preset="default", block_size: int = 32) -> Scheme:
    """MXFP4: E2M1 elements packed two per byte (even element low), 32 per UE8M0 scale."""
    return _mx("mxfp4", "e2m1", preset, block_size)
