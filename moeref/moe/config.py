"""The layer's configuration, typed: :class:`LayerConfig` (everything but the data), :class:`MoEQuant`
(how activations are quantized) and :class:`Quantizer` (one activation quantizer).

Both engines of the reference (:func:`moeref.moe.run_moe` on the host and on a device), the error bounds
(:mod:`moeref.compare`) and the adapters read the same :class:`LayerConfig`; a traced run keeps it as
:attr:`moeref.moe.MoERun.config`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Mapping

from .._checks import check_choice, check_positive_int

__all__ = ["LAYOUTS", "LayerConfig", "MoEQuant", "NO_QUANT", "Quantizer", "quantizer"]

LAYOUTS = ("standard", "contiguous", "masked", "batched")


@dataclass(frozen=True, eq=False)
class Quantizer:
    """One activation quantizer, ``x -> QuantizedTensor``.

    Either a :class:`moeref.quant.Scheme` with static arguments of :func:`moeref.quant.quantize`
    (``scale=``: a static FP8 scale, vLLM ``a1_scale``/``a2_scale``; ``global_scale=``: an NVFP4 global scale
    in the preset's convention), or a ``function`` of the user's (it receives host arrays). The device
    engine runs the first kind through :func:`moeref.quant.device.device_quantize` where that runs it.
    """

    scheme: object = None
    static: Mapping = field(default_factory=dict)
    function: Callable | None = None

    def __post_init__(self):
        from ..quant import Scheme

        if (self.scheme is None) == (self.function is None):
            raise ValueError("a Quantizer needs a scheme or a function (exactly one)")
        if self.scheme is not None and not isinstance(self.scheme, Scheme):
            raise TypeError(f"scheme must be a moeref.quant.Scheme; got {type(self.scheme).__name__}")
        object.__setattr__(self, "static", dict(self.static))

    @property
    def name(self) -> str:
        return self.scheme.name if self.scheme is not None else getattr(self.function, "__name__", "function")

    def __call__(self, x):
        if self.function is not None:
            return self.function(x)
        from ..quant import quantize

        return quantize(x, self.scheme, **self.static)

    @classmethod
    def of(cls, q) -> "Quantizer | None":
        """``q`` as a Quantizer: None, a Quantizer, a Scheme, or a function ``x -> QuantizedTensor``."""
        from ..quant import Scheme

        if q is None or isinstance(q, Quantizer):
            return q
        if isinstance(q, Scheme):
            return cls(q)
        if callable(q):
            return cls(function=q)
        raise TypeError(f"a quantizer is None, a Scheme, a Quantizer or a function; got {type(q).__name__}")


def quantizer(scheme, **static) -> Quantizer:
    """:class:`Quantizer` of ``scheme`` with static arguments bound: ``quantizer(fp8_per_tensor(), scale=s)``
    (static FP8 a1/a2 scale, vLLM ``a1_scale``/``a2_scale``), ``quantizer(nvfp4(preset="nvfp4_vllm"),
    global_scale=a1_gscale)`` (NVFP4 input/intermediate global scale in the preset's convention;
    vLLM/FlashInfer pass the encode factor ``448 * 6 / amax``)."""
    return Quantizer(scheme, static)


@dataclass(frozen=True, eq=False)
class MoEQuant:
    """How activations are quantized: ``a1`` (GEMM1 input) and ``a2`` (intermediate, GEMM2 input), each None
    (no quantization: float64 values) or a :class:`Quantizer` (a Scheme or a function is turned into one).
    ``name`` labels reports."""

    a1: Quantizer | None = None
    a2: Quantizer | None = None
    name: str = "none"

    def __post_init__(self):
        object.__setattr__(self, "a1", Quantizer.of(self.a1))
        object.__setattr__(self, "a2", Quantizer.of(self.a2))


NO_QUANT = MoEQuant()


@dataclass(frozen=True, eq=False)
class LayerConfig:
    """Everything about the layer but its data (weights, tokens, routing).

    Attributes:
        activation, activation_params: :data:`moeref.activations.ACTIVATIONS` name and its parameters.
        quant: :class:`MoEQuant`.
        layout: dispatch layout, one of :data:`LAYOUTS` (the output does not depend on it).
        expert_map: EP map (global expert -> local id or -1), with ``num_experts`` the global count.
        num_experts: global E (default: the weights' count; required with an ``expert_map``).
        apply_router_weight_on_input: top-1 only (Llama 4).
        chunk_size: tokens per chunk (None: one chunk).
        shared_experts: :class:`moeref.moe.SharedExperts` added with weight 1.
        out_dtype, gemm1_out_dtype, act_out_dtype: declared stores (None: float64, no rounding).
        gemm2_out_dtype: a declared store of GEMM2's output (bias included) before the top-k sum (DeepGEMM
            pipelines, CUTLASS / torch bf16 layers: ``Profile.gemm_out_dtype``); None: float64 into the sum.
        alignment: contiguous layout's rows per expert segment; max_m: masked/batched capacity.
    """

    activation: str = "silu_and_mul"
    activation_params: Mapping = field(default_factory=dict)
    quant: MoEQuant = NO_QUANT
    layout: str = "standard"
    expert_map: object = None
    num_experts: int | None = None
    apply_router_weight_on_input: bool = False
    chunk_size: int | None = None
    shared_experts: object = None
    out_dtype: object = None
    alignment: int = 128
    max_m: int | None = None
    gemm1_out_dtype: object = None
    act_out_dtype: object = None
    gemm2_out_dtype: object = None

    def __post_init__(self):
        from ..activations import ACTIVATIONS

        check_choice(self.layout, LAYOUTS, "layout")
        check_choice(self.activation, tuple(ACTIVATIONS), "activation")
        if not isinstance(self.quant, MoEQuant):
            raise TypeError(f"quant must be a MoEQuant; got {type(self.quant).__name__}")
        object.__setattr__(self, "activation_params", dict(self.activation_params or {}))
        if self.chunk_size is not None:
            check_positive_int(self.chunk_size, "chunk_size")
        check_positive_int(self.alignment, "alignment")
        if self.expert_map is not None and self.num_experts is None:
            raise ValueError("num_experts (global) is required with an expert_map")

    @classmethod
    def build(cls, config: "LayerConfig | None" = None, **options) -> "LayerConfig":
        """``config`` (default: all defaults) with ``options`` replacing fields; an unknown option is a
        TypeError naming the accepted ones."""
        names = {f.name for f in fields(cls)}
        bad = sorted(set(options) - names)
        if bad:
            raise TypeError(f"unknown layer option(s) {bad}; accepted: {sorted(names)}")
        return replace(config or cls(), **options)
