"""NVFP4: E2M1 elements, 16 per UE4M3 block scale, times one FP32 per-tensor factor.

Two-level scaling (NVIDIA TransformerEngine ``docs/features/low_precision_training/nvfp4``). With ``a`` the block amax, ``A`` the tensor amax,
``M_e = 6`` (E2M1 max) and ``M_s = 448`` (E4M3 max)::

    global (per tensor, FP32)   S_enc = M_s * M_e / A = 2688 / A     (encode)  or  A / 2688 (decode)
    block (per 16, UE4M3)       s     = e4m3( a / M_e * S_enc )       ~ 448 for the tensor's top block
    element (E2M1)              q     = e2m1( x / (s / S_enc) )
    decode                      x'    = q * s / S_enc

Blocks are 1x16 along the last axis for activations; TransformerEngine's 2-D recipe for weights
uses 16x16 tiles of the last two axes (one amax per tile, the same scale for all 16 rows, so the
rowwise and columnwise quantizations agree). Partial blocks are zero-padded (zeros never change an
amax). E2M1 codes are packed two per byte, even element low.

The anchors agree on this storage and disagree on the float32 operation order, which is visible
at ties of the UE4M3 cast (radixark/miles PR #1054 "FlashInfer is not bitwise exact
with TE"). Each order is a preset; in float32 (``fl`` = one rounding; ``s`` = the decoded UE4M3 scale):

* ``te``: ``S_enc = min(fl(2688/A), FLT_MAX)`` (0 -> 1); ``s = e4m3(min(a * fl(S_enc * fl(1/6)),
  448))``, ONE rounding of the product with the folded constant; no lower clamp (zero and
  subnormal scales); data factor ``min(1/(s * fl(1/S_enc)), FLT_MAX)``; zero block -> ``0x00``.
* ``flashinfer`` (= ``vllm``): ``S_enc = fl(2688/A)``; ``s = e4m3(min(S_enc * fl(a * fl(1/6)),
  448))``; data factor ``rcp(s * rcp(S_enc))`` with ``rcp(0) := 0``; zero block -> ``0x00``.
* ``torchao``: decode scale ``pts = fl(A/2688)``; ``s = e4m3(clamp(fl(a/6)/pts, 2^-6, 448))``;
  data factor ``fl(fl(1/pts)/s)``; zero block -> ``0x08`` (the 2^-6 clamp).

Every order then clamps the scaled data to +-6 and rounds to nearest even (E2M1).

Preset names (:data:`NVFP4_PRESETS`): ``nvfp4_<order>`` computes in the order's native global
quantity, ``nvfp4_<order>_<convention>`` takes the other convention that order accepts (below):
``nvfp4_te``, ``nvfp4_te_encode_scale``, ``nvfp4_flashinfer``, ``nvfp4_flashinfer_amax``,
``nvfp4_vllm``, ``nvfp4_vllm_amax``, ``nvfp4_torchao``, ``nvfp4_torchao_amax``. ``"default"`` is
``nvfp4_te``: TransformerEngine's order with the global scale held as the amax (TE's NVFP4 recipe
is the one NVIDIA documents, and the one the other libraries are compared against here). The bare
order names ``"te"``, ``"flashinfer"``, ``"vllm"``, ``"torchao"`` are deprecated aliases of
``nvfp4_<order>``: they give the same preset and warn (``DeprecationWarning``).

Sources: TransformerEngine ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``
(``_quantize_blockwise_reference``; kernel ``common/cast/nvfp4/core_nvfp4.cuh``), FlashInfer
``tests/test_helpers/utils_fp4.py::ref_fp4_quant`` (kernel with ``DISABLE_FP4_QUANT_FAST_MATH``
follows TE; the default fast-math kernel uses ``rcp.approx`` and is not reproduced), vLLM
``tests/kernels/quantization/test_nvfp4_quant.py::ref_nvfp4_quant`` (clamps the scale to 448
before the cast; FlashInfer's reference relies on torch's cast, which saturates from torch 2.13,
so the two are one preset here), torchao ``torchao/prototype/mx_formats/nvfp4_tensor.py``
(``nvfp4_quantize``, ``per_tensor_amax_to_scale``; HEAD 36027d8 multiplies by ``(1/pts)/s``).

Global-scale conventions (what a checkpoint or a kernel argument holds; ``convention=``):

* ``"amax"``: the tensor amax ``A`` (TransformerEngine's stored metadata, ``global_amax``).
* ``"encode_scale"``: ``S_enc = 2688 / A`` (vLLM ``a1_gscale``/``w1_alpha`` inputs, FlashInfer's
  ``global_scale`` argument; ``dequant = e2m1 * sf / global_scale``).
* ``"decode_scale"``: ``A / 2688`` (torchao ``per_tensor_scale``; ModelOpt checkpoints'
  ``weight_scale_2`` / ``input_scale``).

A preset computes in its native quantity (TE and FlashInfer from ``S_enc``, torchao from the
decode scale); converting between encode and decode scales adds a float32 rounding no anchor does,
so ``te``/``flashinfer`` accept ``amax`` or ``encode_scale`` and ``torchao`` ``amax`` or
``decode_scale``. Whatever the convention, :attr:`QuantizedTensor.global_scale` holds the float64
DECODE factor (``A / 2688``, ``1 / S_enc`` or the decode scale), so ``dequantize`` is
``e2m1 * ue4m3 * global_scale``; :func:`global_scale_as` reads it back in any convention, exactly
as the float32 the anchor holds.

Policies (moeref's choices where the anchors are silent or differ, each pinned by a test):

* Non-finite input (NaN, +-Inf) raises ``ValueError`` naming the first element. The anchors
  disagree and none is useful: TE's reference turns one NaN into a NaN global scale and NaN block
  scales everywhere (its kernel's ``fmaxf`` ignores NaN), FlashInfer's and torchao's references
  produce NaN scales and undefined codes; E2M1 has no NaN.
* Tensor amax 0 (dynamic): every block scale is the preset's zero-block code, every element code
  0, and the stored decode factor is 0.0 (TE stores amax 0; its S_enc would be FLT_MAX in the
  reference, 1.0 in the kernel, with identical outputs; FlashInfer's ``2688/0`` and torchao's
  ``0/0`` would give NaN).
* A static global scale (``quantize(x, scheme, global_scale=...)``) must be positive and finite,
  and so must the float32 reciprocal the order takes of it (an encode scale below about 3e-39
  would make the data factor Inf): otherwise ``ValueError``; block scales above 448 saturate to 448 (E4M3 ``satfinite``, vLLM's clamp) and the elements of
  such blocks saturate at +-6.
* ``te`` writes code 0x0 for an exact zero product (``-0.0``), 0x8 for negative values that round
  to zero (TE ``cast_to_fp4x2``); ``flashinfer``/``torchao`` keep the sign of zero (PTX ``cvt``,
  torchao ``f32_to_f4_unpacked``).
* DeepGEMM's FP4 (ties toward zero) uses FP32/UE8M0 scales per 32 or 128 elements, not UE4M3:
  it is an MXFP4-like scheme (:func:`moeref.quant.mxfp4` with ``preset="deepgemm"``), not NVFP4.

>>> import numpy as np
>>> from moeref.quant.nvfp4 import nvfp4
>>> from moeref.quant import quantize
>>> x = np.array([[0.5, -1.0, 3.0, 6.0] * 4], np.float32)
>>> q = quantize(x, nvfp4())                       # preset "default" = "nvfp4_te"
>>> int(q.scales[0, 0]), q.global_scale          # 448 = 0x7E; A / 2688 = 6 / 2688
(126, 0.002232142857142857)
>>> q.dequantize()[0, :4].tolist()
[0.5, -1.0, 3.0, 6.0]
"""
from __future__ import annotations

import numpy as np

from .._checks import check_choice, first_bad_index
from ..formats import decode_table, encode
from .blockwise import as_input, expand_to_elements, quantize_blockwise, working_dtype
from .scale_rules import FLT_MAX, RuleContext, ScaleResult
from .scheme import PRESETS, Preset, Scheme, get_preset, register_preset
from .tensor import QuantizedTensor, register_quantizer

__all__ = [
    "nvfp4",
    "nvfp4_weight",
    "NVFP4_ORDERS",
    "NVFP4_CONVENTIONS",
    "NVFP4_PRESETS",
    "nvfp4_preset",
    "quantize_nvfp4",
    "global_scale_as",
    "global_factors",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
_PRODUCT = E4M3_MAX * E2M1_MAX  # 2688
_E4M3_TINY = 2.0 ** -6         # torch.finfo(float8_e4m3fn).tiny, torchao's E4M3_EPS

NVFP4_ORDERS = ("te", "flashinfer", "vllm", "torchao")
NVFP4_CONVENTIONS = ("amax", "encode_scale", "decode_scale")
_NATIVE = {"te": "amax", "flashinfer": "encode_scale", "vllm": "encode_scale", "torchao": "decode_scale"}
_ALLOWED = {"te": ("amax", "encode_scale"), "flashinfer": ("encode_scale", "amax"),
            "vllm": ("encode_scale", "amax"), "torchao": ("decode_scale", "amax")}
_DESCRIPTION = {
    "te": "TransformerEngine NVFP4 (reference_nvfp4.py, core_nvfp4.cuh): S_enc = min(2688/A, "
          "FLT_MAX), s = e4m3(min(a * fl(S_enc * fl(1/6)), 448)) (one rounding), no lower clamp, "
          "data x * min(1/(s * fl(1/S_enc)), FLT_MAX), RNE, -0.0 -> 0x0",
    "flashinfer": "FlashInfer ref_fp4_quant (tests/test_helpers/utils_fp4.py): s = e4m3(S_enc * "
                  "fl(a * fl(1/6))), data x * rcp(s * rcp(S_enc)) with rcp(0) = 0, RNE",
    "vllm": "vLLM ref_nvfp4_quant (tests/kernels/quantization/test_nvfp4_quant.py): FlashInfer's "
            "op order with the scale clamped to 448 before the cast",
    "torchao": "torchao nvfp4_quantize (prototype/mx_formats/nvfp4_tensor.py): pts = A/2688, "
               "s = e4m3(clamp(fl(a/6)/pts, 2^-6, 448)), data x * fl(fl(1/pts)/s), RNE",
}


def _preset_name(order: str, convention: str) -> str:
    return f"nvfp4_{order}" if convention == _NATIVE[order] else f"nvfp4_{order}_{convention}"


for _order in NVFP4_ORDERS:
    for _conv in _ALLOWED[_order]:
        register_preset(Preset(
            _preset_name(_order, _conv),
            _DESCRIPTION[_order] + f"; global scale stored as {_conv}",
            nonfinite="propagate", apply="mul_encode", overflow="saturate", rounding="rne",
            signed_zero="keep",
            options=(("nvfp4_order", _order), ("global_convention", _conv)),
        ))
del _order, _conv

#: The NVFP4 preset names (module docstring): ``"default"`` (= ``nvfp4_te``), then one per
#: operation order and global-scale convention.
NVFP4_PRESETS = ("default",) + tuple(_preset_name(o, c) for o in NVFP4_ORDERS for c in _ALLOWED[o])


def nvfp4_preset(preset="default", convention: str | None = None) -> Preset:
    """The registered NVFP4 preset for an operation order and a global-scale convention.

    ``preset``: ``"default"`` (``nvfp4_te``: TransformerEngine), a name of
    :data:`NVFP4_PRESETS` (``"nvfp4_vllm"``...) or a :class:`Preset` carrying the ``nvfp4_order``
    option; the bare orders ``"te"``, ``"flashinfer"``, ``"vllm"``, ``"torchao"`` are deprecated
    aliases of ``"nvfp4_<order>"`` (same preset, with a ``DeprecationWarning``).
    ``convention``: None (the preset's), ``"amax"``, ``"encode_scale"`` or ``"decode_scale"``.

    >>> nvfp4_preset().name, nvfp4_preset("nvfp4_vllm", "amax").name
    ('nvfp4_te', 'nvfp4_vllm_amax')
    """
    if isinstance(preset, str) and preset in NVFP4_ORDERS:
        import warnings

        warnings.warn(f"the NVFP4 preset name {preset!r} is deprecated; use 'nvfp4_{preset}' "
                      "(the same preset)", DeprecationWarning, stacklevel=3)
        order = preset
    elif isinstance(preset, str) and preset == "default":
        order = "te"
    else:
        p = get_preset(preset)
        order = p.option("nvfp4_order")
        if order is None:
            raise ValueError(f"preset {p.name!r} is not an NVFP4 preset; accepted: "
                             f"{', '.join(NVFP4_PRESETS)}")
        if convention is None:
            convention = p.option("global_convention")
    if convention is None:
        convention = _NATIVE[order]
    check_choice(convention, NVFP4_CONVENTIONS, "NVFP4 global-scale convention")
    if convention not in _ALLOWED[order]:
        raise ValueError(
            f"the {order!r} order computes from the {_NATIVE[order]!r}; convention={convention!r} "
            f"would add a float32 rounding no anchor does; accepted for {order!r}: "
            f"{', '.join(_ALLOWED[order])}")
    return PRESETS[_preset_name(order, convention)]


def nvfp4(kind: str = "activation", convention: str | None = None, preset="default") -> Scheme:
    """NVFP4 scheme: E2M1 elements, UE4M3 scales, FP32 global scale.

    Args:
        kind: ``"activation"`` (1x16 blocks along the last axis) or ``"weight"`` (TE's 16x16
            tiles of the last two axes, one scale per tile).
        convention: global-scale convention (module docstring); None = the preset's native one.
        preset: ``"default"`` (``"nvfp4_te"``, TransformerEngine) or a name of
            :data:`NVFP4_PRESETS` (``"nvfp4_flashinfer"``, ``"nvfp4_vllm"``, ``"nvfp4_torchao"``,
            ...); the bare orders ``"te"``... are deprecated aliases (:func:`nvfp4_preset`).

    >>> s = nvfp4("weight", preset="nvfp4_vllm")
    >>> s.block, s.scale_format, s.preset.name
    ((16, 16), 'ue4m3', 'nvfp4_vllm')
    """
    check_choice(kind, ("activation", "weight"), "NVFP4 kind")
    p = nvfp4_preset(preset, convention)
    block = (1, 16) if kind == "activation" else (16, 16)
    name = "nvfp4" if kind == "activation" else "nvfp4_weight"
    desc = (f"NVFP4 {kind}: E2M1 x UE4M3 per {block[0]}x{block[1]} block x FP32 global "
            f"({p.option('global_convention')}), {p.option('nvfp4_order')} op order")
    return Scheme(name=name, element="e2m1", block=block, scale_format="ue4m3", preset=p,
                  family="nvfp4", global_scale=True, description=desc)


def nvfp4_weight(convention: str | None = None, preset="default") -> Scheme:
    """``nvfp4("weight", ...)``: TransformerEngine's 2-D recipe, one UE4M3 scale per 16x16 tile."""
    return nvfp4("weight", convention, preset)


def _static_value(value) -> float:
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"global_scale must be a real number; got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"global_scale must be a positive finite number; got {v!r}")
    return v


def _rcp0(v, T):
    """FlashInfer/vLLM ``get_reciprocal``: ``1/v`` with ``1/0 := 0``."""
    with np.errstate(divide="ignore"):
        return np.where(v == 0, T(0), T(1) / v).astype(T)


def _ue4m3(v: np.ndarray) -> np.ndarray:
    """RNE UE4M3 codes of non-negative values already clamped to [0, 448] (the shared codec)."""
    return encode(v, "ue4m3", overflow="saturate", rounding="rne")


def global_factors(preset: Preset, tensor_amax=None, static=None, work=np.float32):
    """The per-tensor step of the NVFP4 rule: ``(s_enc, pts, glob, zero_tensor)``.

    ``s_enc`` is the ``work``-precision encode scale the TE / FlashInfer / vLLM orders use and
    ``pts`` torchao's decode scale (each order reads only its own; the other is its reciprocal),
    ``glob`` the float64 decode factor :attr:`QuantizedTensor.global_scale` stores and
    ``zero_tensor`` whether the tensor is treated as all zeros (amax 0: every data factor 0).
    From the tensor amax (dynamic) or a validated ``static`` value in the preset's convention.
    Raises ``ValueError`` with the reason when the scale the order needs is not a positive
    finite number with a finite reciprocal. The fast path (:mod:`fastpath.quant`) calls this for
    static scales, so both compute the same float32 factors.
    """
    T = np.dtype(work).type
    order = preset.option("nvfp4_order")
    conv = preset.option("global_convention")
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        glob = None
        s_enc = pts = None
        if static is None or conv == "amax":
            A = T(tensor_amax) if static is None else T(static)
            zero_tensor = bool(A == 0)
            if conv == "amax":
                glob = float(A) / _PRODUCT
            if order == "torchao":
                pts = A / T(_PRODUCT)
            else:
                s_enc = T(_PRODUCT) / A
                if order == "te":
                    s_enc = min(s_enc, T(FLT_MAX))
                    s_enc = T(1) if s_enc == 0 else s_enc
            what = f"the tensor amax {float(A)!r}"
        else:
            zero_tensor = False
            if order == "torchao":
                pts = T(static)
            else:
                s_enc = T(static)
            what = f"global_scale={static!r}"
        name = np.dtype(work).name
        if zero_tensor:
            glob = 0.0
            pts, s_enc = T(1), T(1)  # any positive value: every block is zero
        elif order == "torchao":
            if not (pts > 0 and np.isfinite(pts)):
                raise ValueError(f"{what} gives the decode scale {float(pts)!r} in {name}; "
                                 "torchao's order needs a positive finite one")
            if not np.isfinite(T(1) / pts):
                raise ValueError(f"{what} gives the decode scale {float(pts)!r}, whose reciprocal "
                                 f"overflows {name} (the data factor would be Inf)")
            glob = float(pts) if glob is None else glob
            s_enc = T(1) / pts
        else:
            if not (s_enc > 0 and np.isfinite(s_enc)):
                raise ValueError(f"{what} gives the encode scale {float(s_enc)!r} in {name} "
                                 f"(2688 / amax overflows float32?); the {order!r} order has no "
                                 "clamp for it (TE clamps to FLT_MAX)")
            if not np.isfinite(T(1) / s_enc):
                raise ValueError(f"{what} gives the encode scale {float(s_enc)!r}, whose reciprocal "
                                 f"(the decode scale) overflows {name}: the data factor would "
                                 "be Inf or NaN")
            glob = 1.0 / float(s_enc) if glob is None else glob
            pts = T(1) / s_enc
    return s_enc, pts, glob, zero_tensor


def _nvfp4_rule(amax: np.ndarray, ctx: RuleContext) -> ScaleResult:
    """Block amax grid -> UE4M3 codes, data factor and the global decode factor (module docstring)."""
    p, w = ctx.preset, ctx.work
    T = w.type
    order = p.option("nvfp4_order")
    a = amax.astype(w, copy=False)
    tensor_amax = T(a.max()) if a.size else T(0)
    dec_table = decode_table("ue4m3")
    s_enc, pts, glob, zero_tensor = global_factors(p, tensor_amax, ctx.static_scale, w)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if order == "te":
            multiplier = s_enc * (T(1) / T(E2M1_MAX))
            sf = np.minimum(a * multiplier, T(FLT_MAX))
            code = _ue4m3(np.minimum(sf, T(E4M3_MAX)))
            s = dec_table[code].astype(w)
            gd = T(1) / s_enc
            factor = np.minimum(T(1) / (s * gd), T(FLT_MAX))
        elif order in ("flashinfer", "vllm"):
            sf = s_enc * (a * _rcp0(T(E2M1_MAX), T))
            code = _ue4m3(np.minimum(sf, T(E4M3_MAX)))
            s = dec_table[code].astype(w)
            factor = _rcp0(s * _rcp0(s_enc, T), T)
        else:  # torchao
            block_scale = a / T(E2M1_MAX)
            code = _ue4m3(np.clip(block_scale / pts, T(_E4M3_TINY), T(E4M3_MAX)))
            s = dec_table[code].astype(w)
            factor = (T(1) / pts) / s
            if not np.isfinite(factor).all():
                # fl(1/pts) / s overflows when the tensor amax is tiny (pts near FLT_MIN): torchao
                # then multiplies zeros by Inf (NaN codes); refuse instead of encoding NaN
                raise ValueError(f"torchao's NVFP4 order: the data factor fl(fl(1/pts) / s) "
                                 f"overflows float32 (pts = {float(pts)!r}, the tensor amax "
                                 f"{float(pts) * _PRODUCT!r} is too small for this order)")
    if zero_tensor:
        factor = np.zeros_like(factor)
    return ScaleResult(stored=code.astype(np.uint8), decode=dec_table[code],
                       factor=np.asarray(factor, w), op="mul", global_scale=glob)


def quantize_nvfp4(x, scheme: Scheme, global_scale=None) -> QuantizedTensor:
    """Quantize ``x`` to NVFP4 (the ``"nvfp4"`` family's quantizer; :func:`moeref.quant.quantize`
    dispatches here).

    Args:
        x: float16/bfloat16/float32/float64 array or torch CPU tensor; activations any shape with
            ``>= 1`` axis, weights (16x16) ``>= 2`` axes. Arithmetic is float32 (float64 only for
            float64 input, which no anchor takes). Must be finite.
        scheme: an :func:`nvfp4` scheme.
        global_scale: static per-tensor quantity in the scheme's convention (``amax``,
            ``encode_scale`` such as vLLM's ``a1_gscale``, or ``decode_scale``); None = dynamic
            (the tensor amax of ``x``).

    Returns:
        :class:`~moeref.quant.tensor.QuantizedTensor` with packed E2M1 ``codes``, UE4M3 ``scales``
        (uint8, one per block: ``[..., ceil(n/16)]`` or ``[..., ceil(m/16), ceil(n/16)]``) and
        ``global_scale`` = the float64 decode factor.
    """
    if not isinstance(scheme, Scheme) or scheme.family != "nvfp4":
        raise TypeError(f"scheme must be an NVFP4 Scheme (moeref.quant.nvfp4.nvfp4()); got {scheme!r}")
    static = None if global_scale is None else _static_value(global_scale)
    xa = as_input(x)
    bad = ~np.isfinite(xa)
    if bad.any():
        idx = first_bad_index(bad)
        raise ValueError(f"x{list(idx)} = {float(xa[idx])!r}: NVFP4 quantization needs finite input "
                         "(E2M1 has no NaN/Inf; the anchors disagree on what a non-finite value "
                         "does to the global and block scales)")
    finalize = None
    if scheme.preset.option("nvfp4_order") == "te":
        block = scheme.resolve_block(xa.shape)
        xw = xa.astype(working_dtype(xa), copy=False)

        def finalize(codes, res, ctx):
            # TE cast_to_fp4x2: an exact zero product (-0.0, or a negative product that
            # underflows) is code 0x0, while (-0.25, 0) is 0x8. Only 0x8 codes can change.
            idx = np.nonzero(codes == 0x8)
            if idx[0].size == 0:
                return {}
            nl = codes.ndim - len(block)
            gidx = idx[:nl] + tuple(i // b for i, b in zip(idx[nl:], block))
            with np.errstate(under="ignore"):
                zero = (xw[idx] * res.factor[gidx]) == 0
            out = codes.copy()
            out[tuple(i[zero] for i in idx)] = 0
            return {"codes": out}

    return quantize_blockwise(xa, scheme, rule=_nvfp4_rule, static_scale=static, finalize=finalize)


register_quantizer("nvfp4", quantize_nvfp4)


def global_scale_as(q: QuantizedTensor, convention: str) -> np.float32:
    """The global scale of an NVFP4 tensor in ``convention``, as the float32 the anchors hold.

    ``"decode_scale"``: ``fl32(g)``; ``"encode_scale"``: ``fl32(1/g)`` (Inf when ``g == 0``);
    ``"amax"``: ``fl32(g * 2688)``, where ``g = q.global_scale``. For a tensor produced in that
    convention this returns the float32 the preset used, exactly (float64 carries 29 more bits
    than the float32 it came from, so the round trip cannot move by a float32 ulp).

    >>> from moeref.quant import quantize
    >>> q = quantize(np.full((1, 16), 3.0, np.float32), nvfp4(preset="nvfp4_vllm"))
    >>> float(global_scale_as(q, "encode_scale")), float(global_scale_as(q, "amax"))
    (896.0, 3.0)
    """
    if not isinstance(q, QuantizedTensor) or q.scheme.family != "nvfp4":
        raise TypeError(f"q must be an NVFP4 QuantizedTensor; got {type(q).__name__}")
    check_choice(convention, NVFP4_CONVENTIONS, "NVFP4 global-scale convention")
    g = float(q.global_scale)
    if convention == "decode_scale":
        return np.float32(g)
    if convention == "amax":
        return np.float32(g * _PRODUCT)
    return np.float32(np.inf) if g == 0 else np.float32(1.0 / g)

