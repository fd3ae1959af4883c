"""Exact-regime operands for every scaling scheme: small element values, power-of-two scales.

:func:`exact_operand` builds a :class:`moeref.quant.QuantizedTensor` (or a bf16/fp16/fp32 array) directly
from element values and scales, so nothing is rounded on the way: element values are drawn from the
format's values of magnitude at most ``max_abs`` that are integers (halves too for the 4-bit and 6-bit
floats: E2M1's 0.5 and 1.5), block scales are powers of two ``2^e`` with ``e`` in ``scale_exponents``
(FP32 scales hold them exactly, UE8M0 is exactly the powers of two, UE4M3 holds ``2^-9 .. 2^8``), the
NVFP4 global factor and the W4A8 channel factor are powers of two as well. Every product of two such
operands is then a short integer times a power of two, and :func:`moeref.regimes.in_exact_regime`
says for which arithmetic their GEMM is exact (small K, or small ``max_abs``, for the 14-bit FP8
accumulator; nearly anything for FP32).

:data:`EXACT_SCHEMES` names the schemes covered (activations and weights of FP8 per-tensor / per-token /
per-channel / 1x128 / 128x128 with FP32 or UE8M0 scales, MXFP8, MXFP4, NVFP4 with its global scale,
INT8 per-token/channel, INT4 groups (symmetric and with zero points), W4A8's INT4 + E4M3 group + FP32
channel scales) and :data:`FLOAT_DTYPES` the unquantized operands.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .._checks import check_choice, check_positive_int
from ..formats import encode, pack_nibbles, representable_values
from ..quant import (QuantizedTensor, Scheme, fp8_block, fp8_group, fp8_per_channel, fp8_per_tensor,
                     fp8_per_token, int4_group, int8_per_channel, int8_per_token, mxfp4, mxfp8, nvfp4,
                     nvfp4_weight, w4a8_cutlass)
from ..quant.blockwise import grid_shape

__all__ = ["EXACT_SCHEMES", "FLOAT_DTYPES", "exact_operand", "element_choices", "scheme_of"]

EXACT_SCHEMES = {
    "fp8_per_tensor": lambda: fp8_per_tensor(),
    "fp8_per_tensor_ue8m0": lambda: fp8_per_tensor(scale="ue8m0"),
    "fp8_per_token": lambda: fp8_per_token(),
    "fp8_per_channel": lambda: fp8_per_channel(),
    "fp8_1x128": lambda: fp8_group(128),
    "fp8_1x128_ue8m0": lambda: fp8_group(128, "ue8m0"),
    "fp8_128x128": lambda: fp8_block((128, 128)),
    "fp8_128x128_ue8m0": lambda: fp8_block((128, 128), "ue8m0"),
    "fp8_e5m2_per_token": lambda: fp8_per_token(element="e5m2"),
    "mxfp8": lambda: mxfp8(),
    "mxfp4": lambda: mxfp4(),
    "nvfp4": lambda: nvfp4(),
    "nvfp4_weight": lambda: nvfp4_weight(),
    "int8_per_token": lambda: int8_per_token(),
    "int8_per_channel": lambda: int8_per_channel(),
    "int4_g128": lambda: int4_group(128),
    "int4_g128_asym": lambda: int4_group(128, symmetric=False),
    "w4a8_cutlass": lambda: w4a8_cutlass(),
}
"""Scheme name -> constructor of the :class:`moeref.quant.Scheme` (see the module docstring)."""

FLOAT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
                "float32": np.dtype(np.float32)}

_UE4M3_EXPONENTS = (-9, 8)  # powers of two UE4M3 holds exactly (subnormal 2^-9 .. 2^8)


def scheme_of(scheme) -> Scheme:
    """``scheme`` as a :class:`moeref.quant.Scheme` (a Scheme, or a name of :data:`EXACT_SCHEMES`)."""
    if isinstance(scheme, Scheme):
        return scheme
    if isinstance(scheme, str):
        check_choice(scheme, tuple(EXACT_SCHEMES), "exact-regime scheme")
        return EXACT_SCHEMES[scheme]()
    raise TypeError(f"scheme must be a moeref.quant.Scheme or one of {', '.join(EXACT_SCHEMES)}; "
                    f"got {type(scheme).__name__}")


def element_choices(element: str, max_abs: float) -> np.ndarray:
    """The element values drawn: values of ``element`` with ``|v| <= max_abs`` that are integers, or
    halves for formats of at most 6 bits (float64, sorted, zero included).

    >>> element_choices("e2m1", 2).tolist()
    [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0]
    >>> element_choices("int4", 3).tolist()
    [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0]
    """
    from ..formats import get_format

    f = get_format(element)
    v = representable_values(f)
    step = 0.5 if f.bits <= 6 and not f.name.startswith(("int", "uint")) else 1.0
    keep = (np.abs(v) <= max_abs) & (np.round(v / step) * step == v)
    out = v[keep]
    if out.size == 0:
        raise ValueError(f"no value of {element} has |v| <= {max_abs}")
    return out


def _pow2_exponents(rng, shape, exps) -> np.ndarray:
    lo, hi = int(exps[0]), int(exps[1])
    if lo > hi:
        raise ValueError(f"scale_exponents must be (low, high) with low <= high; got {exps}")
    return rng.integers(lo, hi + 1, size=shape)


def exact_operand(shape, scheme, *, seed=0, max_abs: float = 8, scale_exponents=(-2, 0), density: float = 1.0,
                  global_exponent: int = 0, channel_exponents=(0, 0)):
    """An exact-regime operand of logical ``shape`` (``[..., R, K]``).

    Args:
        scheme: a :class:`moeref.quant.Scheme`, a name of :data:`EXACT_SCHEMES`, or a dtype name of
            :data:`FLOAT_DTYPES` (``"bfloat16"``, ``"float16"``, ``"float32"``: a float array of small
            integers times ``2^e`` per row, ``e`` in ``scale_exponents``).
        seed: an int or a ``numpy.random.Generator``.
        max_abs: largest element magnitude (see :func:`element_choices`).
        scale_exponents: ``(low, high)``: every block scale is ``2^e``, ``e`` uniform in that range.
        density: fraction of nonzero elements (the rest are zeros), in ``(0, 1]``.
        global_exponent: NVFP4's per-tensor decode factor ``2^global_exponent``.
        channel_exponents: W4A8's per-output-channel FP32 factors ``2^e``.

    Returns:
        a :class:`moeref.quant.QuantizedTensor` (float dtypes: a NumPy array of that dtype).

    >>> q = exact_operand((2, 64), "mxfp4", seed=1, max_abs=2)
    >>> q.scheme.name, q.scales.dtype.name, bool(np.all(np.abs(q.element_values()) <= 2))
    ('mxfp4_e2m1', 'uint8', True)
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    shape = tuple(check_positive_int(d, "shape entry", allow_zero=True) for d in shape)
    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density must be in (0, 1]; got {density}")
    if isinstance(scheme, str) and scheme in FLOAT_DTYPES:
        vals = rng.integers(-int(max_abs), int(max_abs) + 1, size=shape).astype(np.float64)
        vals *= rng.random(shape) < density
        rows = np.ldexp(1.0, _pow2_exponents(rng, shape[:-1] + (1,), scale_exponents))
        out = (vals * rows).astype(FLOAT_DTYPES[scheme])
        if not np.array_equal(out.astype(np.float64), vals * rows):
            raise ValueError(f"max_abs={max_abs} with scale_exponents={scale_exponents} is not exact in {scheme}")
        return out
    s = scheme_of(scheme)
    element = s.element
    zero_points = None
    if s.zero_point:  # asymmetric INT4: codes 0..15 with zero point 8 -> values -8..7
        choices = np.arange(-min(8, int(max_abs)), min(7, int(max_abs)) + 1).astype(np.float64)
    else:
        choices = element_choices(element, max_abs)
    vals = choices[rng.integers(0, choices.size, size=shape)]
    vals = vals * (rng.random(shape) < density)
    block = s.resolve_block(shape)
    grid = grid_shape(shape, block)
    exps = _pow2_exponents(rng, grid, scale_exponents)
    if s.scale_format == "fp32":
        scales = np.ldexp(np.float32(1.0), exps).astype(np.float32)
    elif s.scale_format == "ue8m0":
        if np.any(exps < -127) or np.any(exps > 127):
            raise ValueError(f"UE8M0 holds 2^-127 .. 2^127; got scale_exponents={scale_exponents}")
        scales = (exps + 127).astype(np.uint8)
    else:  # ue4m3
        if np.any(exps < _UE4M3_EXPONENTS[0]) or np.any(exps > _UE4M3_EXPONENTS[1]):
            raise ValueError(f"UE4M3 holds the powers of two 2^-9 .. 2^8; got scale_exponents={scale_exponents}")
        scales = np.asarray(encode(np.ldexp(1.0, exps), "ue4m3", overflow="error"), dtype=np.uint8)
    if s.zero_point:
        zero_points = np.full(grid, 8, dtype=np.int16)
        codes = np.asarray(encode(vals + 8.0, element, overflow="error"), dtype=np.uint8)
    else:
        codes = np.asarray(encode(vals, element, overflow="error"), dtype=np.uint8)
    if s.packed:
        if shape[-1] % 2:
            codes = np.concatenate([codes, np.zeros(shape[:-1] + (1,), np.uint8)], axis=-1)
        codes = pack_nibbles(codes)
    global_scale = float(np.ldexp(1.0, int(global_exponent))) if s.global_scale else None
    channel = None
    if s.channel_block is not None:
        cshape = grid[:-1] + (1,)
        channel = np.ldexp(np.float32(1.0), _pow2_exponents(rng, cshape, channel_exponents)).astype(np.float32)
    return QuantizedTensor(codes, scales, s, shape, global_scale=global_scale, channel_scales=channel,
                           zero_points=zero_points)
