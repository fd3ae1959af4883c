"""Preset -> the kernels' compile-time constants, derived from the scheme definitions.

Every knob of a :class:`~moeref.quant.scheme.Preset` becomes a ``tl.constexpr`` of
:func:`fastpath.quant._kernels._quant_kernel`. A knob whose value is one of a fixed set of names
is passed as that name's POSITION in the tuple :mod:`moeref.quant.scheme` validates it against
(``FP32_RULES``, ``E8M0_RULES``, ``E8M0_NONFINITE``, ``NONFINITE_POLICIES``, ``APPLY_MODES``,
``ELEMENT_ROUNDINGS``, ``ZERO_BLOCK``, ``SCALE_FORMATS``); the kernels compare with those
positions (their comments name each). Element constants (largest finite value, emax, mantissa
bits, NaN code) are read from the element format (:func:`moeref.formats.get_format`). Nothing
here restates an enumeration; what is written down is what the kernels can run
(:data:`ELEMENTS`, :data:`FP32_RULES_RUN`, :data:`ZERO_BLOCKS_RUN`, :data:`NVFP4_OPS`), which
:func:`fastpath.quant.supports` checks first.
"""
from __future__ import annotations

import functools

import numpy as np

from moeref._interop import triton_interpreted
from moeref.formats import get_format
from moeref.quant import scheme as S
from moeref.quant.nvfp4 import NVFP4_ORDERS
from moeref.quant.scheme import Scheme

# the element formats the kernels encode; ELEM is the position here (0, 1: one byte per code;
# 2: E2M1, two codes per byte)
ELEMENTS = ("e4m3fn", "e5m2", "e2m1")
# the FP32 scale rules the kernels compute (the others are refused by supports())
FP32_RULES_RUN = S.FP32_RULES[:3]  # amax_over_max, amax_times_recip_max, te
# the zero-block policies the kernels apply ("unit_amax" is the integer schemes')
ZERO_BLOCKS_RUN = tuple(z for z in S.ZERO_BLOCK if z != "unit_amax")
# NVFP4 operation orders -> the kernels' NV_ORDER: vLLM's reference is FlashInfer's order with
# the block scale clamped to 448 before the UE4M3 cast, and the kernels clamp for every order
# (the cast saturates at 448 anyway), so both are one code path
NVFP4_OPS = ("te", "flashinfer", "torchao")
NVFP4_OP = {o: NVFP4_OPS.index("flashinfer" if o == "vllm" else o) for o in NVFP4_ORDERS}

# Triton decides at decoration (import) time whether the kernels run in its interpreter
_INTERPRETED = triton_interpreted()


def position(choice: str, choices: tuple) -> int:
    """The constexpr of ``choice``: its position in ``choices`` (a tuple of moeref.quant.scheme)."""
    return choices.index(choice)


def _f32(v: float) -> float:
    """Python float holding exactly the float32 nearest to ``v`` (constants are passed this way so
    the kernel and the NumPy reference use the same float32 constant)."""
    return float(np.float32(v))


def constexprs(scheme: Scheme, hw_fp8: bool) -> dict:
    """The kernel's compile-time knobs for ``scheme`` (cached per scheme, cast path and
    interpreter mode). ``DIV``: how ``x / s`` is computed (see ``_jit_codes._scale_data``): 1 with
    the hardware FMA, 2 under Triton's interpreter (float64-emulated FMA)."""
    return constexprs_cached(scheme, bool(hw_fp8), _INTERPRETED)


@functools.lru_cache(maxsize=256)
def constexprs_cached(scheme: Scheme, hw_fp8: bool, interp: bool) -> dict:
    p = scheme.preset
    el = scheme.element
    fmt = get_format(el)
    M = fmt.max_finite
    rounding = p.rounding_for(el)
    signed_zero = p.signed_zero_for(el)
    nan_code = p.nan_code_for(el) if p.nan_code_for(el) is not None else 0
    fill = fmt.nan_code if fmt.has_nan else nan_code  # the code of a NaN block's elements
    fp32_rule = p.fp32_rule if p.fp32_rule in FP32_RULES_RUN else FP32_RULES_RUN[0]
    return dict(
        ELEM=position(el, ELEMENTS), ELEM_MAX=M, INV_M=_f32(1.0 / M), EMAX=fmt.emax,
        MBITS=fmt.man_bits, SCALE_KIND=position(scheme.scale_format, S.SCALE_FORMATS),
        FP32_RULE=position(fp32_rule, S.FP32_RULES), FP32_POW2=bool(p.fp32_pow2),
        E8_RULE=position(p.e8m0_rule, S.E8M0_RULES), E8_LO=int(p.e8m0_clamp[0]),
        E8_HI=int(p.e8m0_clamp[1]), E8_NF=position(p.e8m0_nonfinite, S.E8M0_NONFINITE),
        AMAX_FLOOR=_f32(p.amax_floor), ZERO_BLOCK=position(p.zero_block, S.ZERO_BLOCK),
        NONFINITE=position(p.nonfinite, S.NONFINITE_POLICIES),
        APPLY=position(p.apply, S.APPLY_MODES), SATURATE=(p.overflow == "saturate") or el == "e2m1",
        ROUND=position(rounding, S.ELEMENT_ROUNDINGS), DROP_NEG_ZERO=(signed_zero == "drop"),
        NAN_CODE=nan_code, FILL_CODE=fill,
        HW_FP8=bool(hw_fp8 and el != "e2m1" and p.overflow == "saturate" and rounding == "rne"),
        DIV=2 if interp else 1,
        # packed bf16x2 PTX encode for MXFP4 (fastpath._packed_fp4): GPU only (the interpreter
        # runs no inline asm), E2M1 + E8M0 + RNE + signed zero kept, single-level; the kernel
        # also requires bfloat16 words (PAIR 1, IN16 1) and no activation. hw_fp8=False keeps the
        # integer path (the GPU tests compare the two).
        PACKED_BF16=bool(hw_fp8 and not interp and el == "e2m1" and scheme.scale_format == "ue8m0"
                         and rounding == "rne" and signed_zero != "drop"
                         and scheme.family != "nvfp4"),
        # the other E2M1 RNE paths (NVFP4, 16-bit float16 / float32 input) encode through
        # fastpath._packed_fp4.e2m1_lane_f32 (GPU only, signed zeros kept or TE's +0 rule)
        E2M1_PTX=bool(hw_fp8 and not interp and el == "e2m1" and rounding == "rne"
                      and signed_zero != "drop"),
        # NVFP4's UE4M3 block scale by the hardware cast (cvt.rn.satfinite.e4m3x2.f32, exact
        # RNE of a value in [0, 448]); the interpreter's FP8 cast is wrong, so not there
        HW_SCALE=bool(hw_fp8 and not interp and scheme.scale_format == "ue4m3"),
    )
