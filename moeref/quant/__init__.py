"""Scaling schemes: presets, QuantizedTensor, quantize / dequantize / requantize.

One generic blockwise engine (:mod:`.blockwise`) and one place for scale rules
(:mod:`.scale_rules`) serve every scheme; :mod:`.fp8`, :mod:`.mx`, :mod:`.intq` (and
:mod:`.nvfp4`) only build :class:`Scheme` objects. Teaching pages: docs/fp8-scaling.md,
docs/mx-formats.md, docs/int4-groups.md.

>>> import numpy as np
>>> from moeref.quant import quantize, SCHEMES
>>> q = quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), SCHEMES["mxfp8"]())
>>> q.codes.shape, q.scales.shape
((2, 32), (2, 1))
"""
from __future__ import annotations

from .scheme import (
    Preset, Scheme, PRESETS, get_preset, register_preset,
)
from .tensor import (
    QuantizedTensor, RequantReport, quantize, dequantize, requantize, QUANTIZERS,
    register_quantizer, quantize_and_report,
)
from .fp8 import fp8_per_tensor, fp8_per_token, fp8_per_channel, fp8_group, fp8_block
from .mx import mxfp8, mxfp6, mxfp4
from .intq import int8_per_token, int8_per_channel, int4_group, w4a8_cutlass
from .nvfp4 import (
    NVFP4_CONVENTIONS, NVFP4_ORDERS, NVFP4_PRESETS, global_factors, global_scale_as, nvfp4, nvfp4_preset,
    nvfp4_weight, quantize_nvfp4,
)

SCHEMES = {
    "fp8_per_tensor": fp8_per_tensor,
    "fp8_per_token": fp8_per_token,
    "fp8_per_channel": fp8_per_channel,
    "fp8_group": fp8_group,
    "fp8_block": fp8_block,
    "mxfp8": mxfp8,
    "mxfp6": mxfp6,
    "mxfp4": mxfp4,
    "int8_per_token": int8_per_token,
    "int8_per_channel": int8_per_channel,
    "int4_group": int4_group,
    "w4a8_cutlass": w4a8_cutlass,
    "nvfp4": nvfp4,
    "nvfp4_weight": nvfp4_weight,
}

__all__ = [
    "Preset", "Scheme", "PRESETS", "SCHEMES", "get_preset", "register_preset",
    "QuantizedTensor", "RequantReport", "quantize", "dequantize", "requantize", "QUANTIZERS",
    "register_quantizer", "quantize_and_report",
    "fp8_per_tensor", "fp8_per_token", "fp8_per_channel", "fp8_group", "fp8_block",
    "mxfp8", "mxfp6", "mxfp4", "int8_per_token", "int8_per_channel", "int4_group", "w4a8_cutlass",
    "nvfp4", "nvfp4_weight", "NVFP4_ORDERS", "NVFP4_CONVENTIONS", "NVFP4_PRESETS", "nvfp4_preset", "quantize_nvfp4",
    "global_scale_as", "global_factors",
]
