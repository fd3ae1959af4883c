"""Scaling schemes as data: :class:`Preset` (the knobs the anchors disagree on) and :class:`Scheme`
(element format + block shape + scale format + preset), with a registry of named presets.

A *scheme* says WHAT is stored: element format, which blocks share a scale, how scales are stored.
A *preset* says HOW the numbers are computed, knob by knob: the anchors
(OCP MX v1.0, torchao, TransformerEngine, DeepGEMM, vLLM, microxcaling) agree on the storage and
disagree on the arithmetic, so every disagreement is a named field here, and each anchor is one
named preset (:data:`PRESETS`). docs/fp8-scaling.md and docs/mx-formats.md tabulate them.

Block shapes (``Scheme.block``) cover the LAST ``len(block)`` axes of the logical tensor; ``None``
means "the whole axis". On an activation ``[M, K]`` or a weight ``[N, K]``:

=====================  ===============  ============================================
scheme                 block            one scale per
=====================  ===============  ============================================
per-tensor             ``(None, None)`` tensor (leading axes of a 3-D input included:
                                        per-tensor means one scale per trailing
                                        2-D matrix, i.e. per expert for ``[E, N, K]``)
per-token/per-channel  ``(1, None)``    row (token of an activation, output channel
                                        of a weight ``[N, K]``)
1x128 group            ``(1, 128)``     128 consecutive elements of a row
128x128 block          ``(128, 128)``   128x128 tile (DeepSeek weights)
MX                     ``(1, 32)``      32 consecutive elements of a row
NVFP4                  ``(1, 16)``      16 consecutive elements (weights: ``(16, 16)``
                                        in TE's 2-D recipe)
=====================  ===============  ============================================
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .._checks import check_choice
from ..formats import get_format

__all__ = [
    "Preset",
    "Scheme",
    "PRESETS",
    "get_preset",
    "register_preset",
    "FP32_RULES",
    "E8M0_RULES",
    "E8M0_NONFINITE",
    "NONFINITE_POLICIES",
    "APPLY_MODES",
    "ELEMENT_ROUNDINGS",
    "SIGNED_ZERO",
    "ZERO_BLOCK",
    "SCALE_FORMATS",
]

FP32_RULES = ("amax_over_max", "amax_times_recip_max", "te", "encode_decode_pair", "signed_minmax", "deepep")
E8M0_RULES = ("floor", "ceil", "even", "rceil", "ceil_div")
E8M0_NONFINITE = ("nan", "satfinite", "clamp")
NONFINITE_POLICIES = ("nan_block", "ignore_nan", "propagate")
APPLY_MODES = ("mul_recip", "div", "mul_encode")
ELEMENT_ROUNDINGS = ("rne", "ties_toward_zero", "ties_away")
SIGNED_ZERO = ("keep", "drop")
ZERO_BLOCK = ("rule", "one", "zero", "unit_amax")
SCALE_FORMATS = ("fp32", "ue8m0", "ue4m3")


@dataclass(frozen=True)
class Preset:
    """Every arithmetic knob of a blockwise quantizer, named.

    Attributes:
        name: registry key.
        description: one line: which anchor this reproduces, with its source file.
        fp32_rule: how an FP32 scale comes from the block amax ``a`` (element max ``M``), in the
            working precision (float32 for float16/bfloat16/float32 input, as every anchor):

            ``"amax_over_max"``  decode scale ``s = fl(a / M)`` (DeepGEMM, vLLM); the data are
                                 then scaled by ``apply``.
            ``"amax_times_recip_max"``  ``s = fl(a * fl(1/M))``: what ``amax / 448.0`` computes in
                                 torch on CUDA, where ATen's true division by a CPU scalar
                                 multiplies by the scalar's reciprocal (``BinaryDivTrueKernel.cu``);
                                 so DeepGEMM's utils give different scales on GPU than on CPU.
            ``"te"``             TransformerEngine ``compute_scale_from_amax``: encode
                                 ``e = fl(M / a)``, ``e = FLT_MAX`` if that overflows, ``e = 1``
                                 if ``a == 0`` or ``a`` is Inf; ``fp32_pow2`` rounds ``e`` DOWN
                                 to a power of two (mantissa bits cleared); decode
                                 ``s = fl(1 / e)`` (``scale_inv``). Data ``x * e``.
            ``"encode_decode_pair"``  vLLM dynamic INT8: ``e = fl(M / a)``, ``s = fl(a / M)``
                                 computed separately (not reciprocals of each other).
            ``"deepep"``         DeepEP's FP8 cast (``internode_ll.cu``): encode ``e = fl(M / a)``,
                                 decode ``s = fl(a * fl(1/M))`` (``kFP8AmaxInv``), in float32.
            ``"signed_minmax"``  vLLM ``quantize_weights`` for signed integers:
                                 ``s = max(|max/qmax|, |min/qmin|)`` (INT4: ``max/7``, ``-min/8``).
        element_max: ``M`` to use instead of the element format's max finite value (GPTQ and
            compressed-tensors symmetric INT4 use 7.5, so ``+amax`` saturates to code 7).
        fp32_pow2: round FP32 scales to powers of two (TE ``force_pow_2_scales``).
        e8m0_rule: how a UE8M0 scale comes from the block amax (all from FP32 bits, never log2):

            ``"floor"``     OCP MX §6.3 / torchao FLOOR: ``2^(floor(log2 a) - emax_elem)``.
            ``"ceil"``      torchao CEIL: ``2^(ceil(log2 a) - emax_elem)``.
            ``"even"``      torchao EVEN: ``a`` rounded half-up at the element's mantissa width
                            (bit trick ``(bits + 2^(22-mbits)) & 0xFF800000``), then FLOOR.
            ``"rceil"``     cuBLAS/TE/torchao RCEIL: ``2^ceil(log2 fl(a * fl(1/M)))``.
            ``"ceil_div"``  DeepGEMM ``ceil_to_ue8m0(a / 448)``, vLLM UE8M0: ``2^ceil(log2 fl(a/M))``.
        e8m0_clamp: ``(lo, hi)`` bounds on the biased exponent byte of finite blocks
            (DeepGEMM ``clamp(1, 254)``; OCP/torchao ``(0, 254)``).
        e8m0_nonfinite: scale byte for a block whose amax is Inf/NaN (when ``nonfinite`` lets it
            reach the rule): ``"nan"`` 0xFF for both (torchao, cvt.rp without satfinite);
            ``"satfinite"`` Inf -> 0xFE, NaN -> 0xFF (TE ``float_to_e8m0``, cvt.rp.satfinite);
            ``"clamp"`` both -> ``hi`` (DeepGEMM: exponent 255(+1) clamped to 254).
        amax_floor: lower clamp on the block amax, ``max(a, floor)`` in the working precision
            (DeepGEMM 1e-4, vLLM eps 1e-10; TE 0). NaN stays NaN, as ``torch.clamp``.
        zero_block: scale of a block whose (floored) amax is 0: ``"rule"`` whatever the rule
            gives (E8M0 FLOOR: 0x00 = 2^-127), ``"one"`` 1.0 (TE), ``"zero"`` 0.0 with codes 0.
        nonfinite: ``"nan_block"`` (torchao ``to_mx``, OCP "a NaN scale makes the block NaN"):
            a block holding NaN or Inf gets a NaN scale (FP32 NaN / 0xFF / 0x7F) and NaN element
            codes (element formats without NaN write ``nan_code`` or 0; the NaN scale already
            makes every element NaN on decode); ``"ignore_nan"`` (TE ``fmaxf`` amax): NaN
            elements do not reach the amax, Inf does; ``"propagate"`` (DeepGEMM, vLLM): the amax
            is NaN if any element is, and the rule's arithmetic runs on it as the anchor's does.
        apply: how the data are scaled before the element cast: ``"mul_recip"`` ``x * fl(1/s)``
            (DeepGEMM, torchao), ``"div"`` ``x / s`` (vLLM), ``"mul_encode"`` ``x * e`` with the
            rule's encode factor (TE, vLLM INT8).
        overflow: element overflow, passed to :func:`moeref.formats.encode`: ``"saturate"``
            (PTX satfinite, torch >= 2.13, clamp-then-cast) or ``"inf_nan"`` (ml_dtypes,
            torch <= 2.12).
        rounding: element rounding: ``"rne"`` (every spec-following anchor), ``"ties_toward_zero"``
            (DeepGEMM FP4 ``bucketize``), ``"ties_away"`` (microxcaling ``"nearest"``).
        signed_zero: ``"keep"`` negative values that round to zero keep the sign code (torchao,
            ml_dtypes, PTX); ``"drop"`` every zero is +0 (DeepGEMM FP4: sign only if code != 0).
        fp4_rounding, fp4_signed_zero: overrides of ``rounding`` / ``signed_zero`` for E2M1
            elements only (DeepGEMM casts FP8 with torch, RNE and signed zeros, but FP4 with its
            own ``bucketize``: ties toward zero, no -0). None = same as for other formats.
        nan_code: element code for NaN inputs in element formats without NaN (E2M1, FP6, INT);
            None raises, as the codec does. Per-format overrides go in the ``"nan_codes"``
            option (:meth:`nan_code_for`).
        options: free-form extra knobs for families built on this engine (NVFP4 op order ...),
            as a tuple of ``(name, value)`` pairs; read with :meth:`option`. ``"nan_codes"``:
            ``((format name, code), ...)``, the code a NaN takes in that element format, before
            ``nan_code`` (the torchao presets: E2M1 0x3, E2M3 0xC, E3M2 0xE, what torchao's
            ``_f32_to_floatx_unpacked`` gives the quiet NaN ``0x7FC00001`` that ``x * NaN``
            yields on CPU, so NaN-scale blocks hold the codes torchao writes).
    """

    name: str
    description: str = ""
    fp32_rule: str = "amax_over_max"
    element_max: float | None = None
    fp32_pow2: bool = False
    e8m0_rule: str = "floor"
    e8m0_clamp: tuple[int, int] = (0, 254)
    e8m0_nonfinite: str = "nan"
    amax_floor: float = 0.0
    zero_block: str = "rule"
    nonfinite: str = "nan_block"
    apply: str = "div"
    overflow: str = "saturate"
    rounding: str = "rne"
    signed_zero: str = "keep"
    fp4_rounding: str | None = None
    fp4_signed_zero: str | None = None
    nan_code: int | None = None
    options: tuple = ()

    def __post_init__(self):
        check_choice(self.fp32_rule, FP32_RULES, "Preset.fp32_rule")
        check_choice(self.e8m0_rule, E8M0_RULES, "Preset.e8m0_rule")
        check_choice(self.e8m0_nonfinite, E8M0_NONFINITE, "Preset.e8m0_nonfinite")
        check_choice(self.zero_block, ZERO_BLOCK, "Preset.zero_block")
        check_choice(self.nonfinite, NONFINITE_POLICIES, "Preset.nonfinite")
        check_choice(self.apply, APPLY_MODES, "Preset.apply")
        check_choice(self.overflow, ("saturate", "inf_nan"), "Preset.overflow")
        check_choice(self.rounding, ELEMENT_ROUNDINGS, "Preset.rounding")
        check_choice(self.signed_zero, SIGNED_ZERO, "Preset.signed_zero")
        if self.fp4_rounding is not None:
            check_choice(self.fp4_rounding, ELEMENT_ROUNDINGS, "Preset.fp4_rounding")
        if self.fp4_signed_zero is not None:
            check_choice(self.fp4_signed_zero, SIGNED_ZERO, "Preset.fp4_signed_zero")
        lo, hi = self.e8m0_clamp
        if not (0 <= lo <= hi <= 254):
            raise ValueError(f"Preset.e8m0_clamp must satisfy 0 <= lo <= hi <= 254; got {self.e8m0_clamp}")
        if not (self.amax_floor >= 0.0):
            raise ValueError(f"Preset.amax_floor must be >= 0; got {self.amax_floor}")
        if self.element_max is not None and not (self.element_max > 0):
            raise ValueError(f"Preset.element_max must be > 0; got {self.element_max}")

    def option(self, key: str, default=None):
        """Value of an extra knob in :attr:`options` (``default`` when absent)."""
        for k, v in self.options:
            if k == key:
                return v
        return default

    def rounding_for(self, element) -> str:
        """Element rounding for ``element`` (format name or ElementFormat)."""
        if self.fp4_rounding is not None and get_format(element).name == "e2m1":
            return self.fp4_rounding
        return self.rounding

    def nan_code_for(self, element) -> int | None:
        """NaN code for ``element`` (format name or ElementFormat) when it has no NaN: the
        ``"nan_codes"`` option's entry for it, else :attr:`nan_code`."""
        name = get_format(element).name
        for fmt, code in self.option("nan_codes", ()):
            if fmt == name:
                return code
        return self.nan_code

    def signed_zero_for(self, element) -> str:
        if self.fp4_signed_zero is not None and get_format(element).name == "e2m1":
            return self.fp4_signed_zero
        return self.signed_zero

    def with_(self, **changes) -> "Preset":
        """A copy with some knobs changed (``name`` should change too)."""
        return replace(self, **changes)


PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    """Add ``preset`` to :data:`PRESETS` (refuses to replace a different preset of that name)."""
    old = PRESETS.get(preset.name)
    if old is not None and old != preset:
        raise ValueError(f"a different preset named {preset.name!r} is already registered")
    PRESETS[preset.name] = preset
    return preset


def get_preset(preset) -> Preset:
    """Look a preset up by name; pass a :class:`Preset` through."""
    if isinstance(preset, Preset):
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a name or Preset; got {type(preset).__name__}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; accepted: {', '.join(PRESETS)}")
    return PRESETS[preset]


# torchao's E2M1/FP6 cast (custom_fp_utils._f32_to_floatx_unpacked) of the quiet NaN that
# x * NaN gives on CPU: inside a NaN-scale block every element is that NaN.
_TORCHAO_NAN_CODES = (("e2m1", 0x3), ("e2m3", 0xC), ("e3m2", 0xE))

for _p in (
    Preset(
        "default",
        "moeref's choice (docs/fp8-scaling.md, docs/mx-formats.md): RNE, saturating elements, "
        "x / s for FP32 scales (one rounding before the element cast), an all-zero block gets "
        "scale 1 in every scale format, NaN/Inf make the block NaN; UE8M0 by RCEIL "
        "(never saturates the block max, cuBLAS/TE/torchao RCEIL).",
        e8m0_rule="rceil", zero_block="one", apply="div",
    ),
    Preset(
        "ocp",
        "OCP MX v1.0 §6.3 as torchao's main branch implements it (mx_tensor.py to_mx, FLOOR; "
        "not the 0.18.0 release, docs/mx-formats.md): 2^(floor(log2 amax) - emax), NaN/Inf "
        "block -> 0xFF + NaN data (E2M1 0x3, FP6 0xC/0xE as torchao), x * 2^-k, RNE, saturate.",
        e8m0_rule="floor", apply="mul_recip", nonfinite="nan_block", e8m0_nonfinite="nan",
        options=(("nan_codes", _TORCHAO_NAN_CODES),),
    ),
    Preset(
        "torchao_ceil", "torchao to_mx ScaleCalculationMode.CEIL (main branch, not 0.18.0).",
        e8m0_rule="ceil", apply="mul_recip", options=(("nan_codes", _TORCHAO_NAN_CODES),),
    ),
    Preset(
        "torchao_even", "torchao to_mx ScaleCalculationMode.EVEN (main branch, not 0.18.0).",
        e8m0_rule="even", apply="mul_recip", options=(("nan_codes", _TORCHAO_NAN_CODES),),
    ),
    Preset(
        "torchao_rceil",
        "torchao to_mx ScaleCalculationMode.RCEIL (main branch, not 0.18.0; _to_mx_rceil / "
        "_f32_to_e8m0_rceil, cuBLAS): ceil2(amax * fl(1/M)), non-satfinite (Inf/NaN -> 0xFF).",
        e8m0_rule="rceil", apply="mul_recip", e8m0_nonfinite="nan",
        options=(("nan_codes", _TORCHAO_NAN_CODES),),
    ),
    Preset(
        "te_mxfp8",
        "TransformerEngine MXFP8 (quantize_mxfp8.cuh, float_to_e8m0): amax by fmaxf (NaN "
        "ignored), ceil2(amax * fl(1/448)) satfinite (Inf -> 0xFE), x * 2^-k, cast satfinite.",
        e8m0_rule="rceil", apply="mul_recip", nonfinite="ignore_nan", e8m0_nonfinite="satfinite",
    ),
    Preset(
        "deepgemm",
        "DeepGEMM deep_gemm/utils/math.py: amax.clamp(1e-4), sf = amax / M (FP32 scales: sf "
        "itself; UE8M0 scales: ceil_to_ue8m0(sf) clamped to [1, 254], NaN/Inf -> 254), "
        "x * (1/sf), torch cast (2.13: saturating); FP4: bucketize ties toward zero, no -0, "
        "NaN -> 0.",
        e8m0_rule="ceil_div", e8m0_clamp=(1, 254), e8m0_nonfinite="clamp", amax_floor=1e-4,
        nonfinite="propagate", apply="mul_recip", fp4_rounding="ties_toward_zero",
        fp4_signed_zero="drop", nan_code=0,
    ),
    Preset(
        "deepgemm_cuda",
        "DeepGEMM deep_gemm/utils/math.py as it runs on a CUDA tensor: torch computes amax / 448.0 "
        "as amax * fl(1/448) there (ATen divides by a CPU scalar through its reciprocal), so "
        "sf = fl(amax * fl(1/M)) and ceil_to_ue8m0 of it is RCEIL; otherwise as 'deepgemm'.",
        fp32_rule="amax_times_recip_max", e8m0_rule="rceil", e8m0_clamp=(1, 254),
        e8m0_nonfinite="clamp", amax_floor=1e-4, nonfinite="propagate", apply="mul_recip",
        fp4_rounding="ties_toward_zero", fp4_signed_zero="drop", nan_code=0,
    ),
    Preset(
        "vllm",
        "vLLM per_token_group_quant_fp8 (fp8_utils.py, Triton path): amax = max(amax, 1e-10), "
        "s = amax / M, UE8M0 = 2^ceil(log2 s) (exact; GPU log2f may differ, sglang#29954), "
        "q = clamp(x / s, -M, M).",
        e8m0_rule="ceil_div", amax_floor=1e-10, nonfinite="propagate", apply="div",
    ),
    Preset(
        "deepep",
        "DeepEP low-latency dispatch FP8 1x128 cast (csrc/kernels/internode_ll.cu, 567632d): amax by "
        "fmaxf (NaN ignored) floored at 1e-4, scale = fl(448 / amax), stored scale_inv = "
        "fl(amax * fl(1/448)), data x * scale cast satfinite RNE.",
        fp32_rule="deepep", amax_floor=1e-4, apply="mul_encode", nonfinite="ignore_nan",
    ),
    Preset(
        "te_fp8",
        "TransformerEngine FP8 current scaling (recipe_common.cuh compute_scale_from_amax): "
        "e = 448/amax (FLT_MAX on overflow, 1 if amax is 0 or Inf), scale_inv = 1/e, x * e, "
        "satfinite.",
        fp32_rule="te", apply="mul_encode", nonfinite="propagate",
    ),
    Preset(
        "te_fp8_block",
        "TransformerEngine Float8BlockScaling (1x128 / 128x128): te_fp8 with "
        "force_pow_2_scales (encode scale rounded down to a power of two).",
        fp32_rule="te", fp32_pow2=True, apply="mul_encode", nonfinite="propagate",
    ),
    Preset(
        "microxcaling",
        "microsoft/microxcaling CUDA path (shared_exp.cuh): FLOOR from FP32 bits, elements "
        "rounded ties-AWAY (rd_away, the default 'nearest'), saturate normals.",
        e8m0_rule="floor", apply="mul_recip", rounding="ties_away",
    ),
    Preset(
        "vllm_int8",
        "vLLM dynamic_scaled_int8_quant: scale = amax/127, data x * (127/amax), "
        "cvt.rni.sat.s8.f32 (nearest even, saturate to [-128, 127], NaN -> 0; an FP32-subnormal "
        "amax makes 127/amax Inf, as in vLLM).",
        fp32_rule="encode_decode_pair", apply="mul_encode", zero_block="one",
        nonfinite="propagate", nan_code=0,
    ),
    Preset(
        "gptq",
        "GPTQ / compressed-tensors symmetric INT4: s = amax / 7.5 (2*amax/15), q = clamp("
        "round(x / s), -8, 7) (stored as uint4b8 = q + 8).",
        element_max=7.5, apply="div", zero_block="unit_amax", nonfinite="propagate",
    ),
    Preset(
        "vllm_int4",
        "vLLM quantize_weights (quant_utils.py) signed INT4 without zero points: "
        "s = max(|max/7|, |min/(-8)|), q = clamp(round(x / s), -8, 7).",
        fp32_rule="signed_minmax", apply="div", zero_block="one", nonfinite="propagate",
    ),
):
    register_preset(_p)
del _p
PRESETS["torchao_floor"] = PRESETS["ocp"]


@dataclass(frozen=True)
class Scheme:
    """What is stored: element format, block shape, scale format, and the preset that computes it.

    Attributes:
        name: short label (``"fp8_group128_ue8m0"``).
        element: element format name (:func:`moeref.formats.get_format`).
        block: block extents over the LAST ``len(block)`` axes; ``None`` = the whole axis.
        scale_format: ``"fp32"``, ``"ue8m0"`` or ``"ue4m3"``.
        preset: :class:`Preset` (or its name, resolved on construction).
        family: which quantizer runs it (:data:`moeref.quant.tensor.QUANTIZERS`):
            ``"blockwise"`` (FP8, MX, INT8, symmetric INT4), ``"int_asym"`` (zero points),
            ``"w4a8"``, ``"nvfp4"`` (registered by :mod:`moeref.quant.nvfp4`).
        static_scale: fixed FP32 decode scale (per-tensor static quantization); None = dynamic.
        zero_point: integer codes carry a zero point (asymmetric).
        channel_block: for two-level integer schemes (W4A8), the block of the FP32 second-level
            scale (``(1, None)``: one per output channel).
        global_scale: a per-tensor FP32 factor multiplies every block scale (NVFP4).
        description: one line for tables.
    """

    name: str
    element: str
    block: tuple
    scale_format: str
    preset: Preset = field(default_factory=lambda: PRESETS["default"])
    family: str = "blockwise"
    static_scale: float | None = None
    zero_point: bool = False
    channel_block: tuple | None = None
    global_scale: bool = False
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "preset", get_preset(self.preset))
        get_format(self.element)  # validates the name
        check_choice(self.scale_format, SCALE_FORMATS, "Scheme.scale_format")
        if not isinstance(self.block, tuple) or not self.block:
            raise TypeError(f"Scheme.block must be a non-empty tuple of int or None; got {self.block!r}")
        for i, b in enumerate(self.block):
            if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
                raise ValueError(f"Scheme.block[{i}] must be a positive int or None; got {b!r}")
        if self.static_scale is not None:
            _check_static_scale(self.static_scale, self.scale_format, "Scheme.static_scale")

    @property
    def element_format(self):
        return get_format(self.element)

    @property
    def packed(self) -> bool:
        """Whether codes are packed two per byte (4-bit element formats)."""
        return self.element_format.bits == 4

    def with_preset(self, preset) -> "Scheme":
        return replace(self, preset=get_preset(preset))

    def replace(self, **changes) -> "Scheme":
        return replace(self, **changes)

    def resolve_block(self, shape) -> tuple[int, ...]:
        """Block extents as ints for a tensor of ``shape`` (``None`` -> that axis's length)."""
        shape = tuple(int(s) for s in shape)
        block = self.block
        if len(shape) < len(block):
            extra = block[: len(block) - len(shape)]
            if any(b not in (None, 1) for b in extra) or not shape:
                raise ValueError(
                    f"scheme {self.name!r} blocks the last {len(block)} axes with {block}, but the "
                    f"tensor has shape {shape}"
                )
            block = block[len(block) - len(shape):]  # e.g. (1, 32) on a 1-D vector: (32,)
        tail = shape[len(shape) - len(block):]
        return tuple(max(t, 1) if b is None else b for b, t in zip(block, tail))


def _check_static_scale(value, scale_format: str, name: str) -> float:
    """Validate a static decode scale: positive finite; a power of two for UE8M0."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number; got {v!r}")
    if scale_format == "ue8m0":
        m, e = math.frexp(v)
        if m != 0.5 or not (-127 <= e - 1 <= 127):
            raise ValueError(
                f"{name} = {v!r} is not a power of two in [2^-127, 2^127]: a UE8M0 scale cannot "
                "hold it (truncating it silently is the bug of sglang#39193)"
            )
    return v
