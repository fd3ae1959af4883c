"""The weights of :func:`fastpath.moe.fused_moe` and what a layer of them declares: the container
:class:`FastMoEWeights` and its constructor :func:`fast_weights`, the reference's matching arguments
(:func:`reference_config`, :func:`stored_as`) and the declared profiles (:func:`profile_of`,
:func:`exact_profile`). The module docstring of :mod:`fastpath.moe` states the arithmetic they declare;
everything here is re-exported there."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeref.gemm import StackedExperts

from .grouped_gemm import EXACT_PROFILE_OF, PROFILE_OF
from .grouped_gemm_w4 import PROFILE_OF as W4_PROFILE_OF
from .grouped_gemm_w4 import W4Experts


@dataclass(frozen=True, eq=False)
class FastMoEWeights:
    """Expert weights as the GPU kernels take them: ``w13 [E, 2N, K]`` and ``w2 [E, K, N]``, either bf16/fp16/fp32
    tensors or float8_e4m3fn with FP32 128x128 block scales ``w13_scales [E, 2N/128, K/128]``,
    ``w2_scales [E, K/128, N/128]`` (DeepGEMM's and vLLM's ``w1``/``w1_scale``), or both
    :class:`fastpath.grouped_gemm_w4.W4Experts` (MXFP4, NVFP4, INT4 groups: the W4A16 layer); optional
    float32 biases ``b13 [E, 2N]``, ``b2 [E, K]``."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_layout: str
    w13_scales: torch.Tensor | None = None
    w2_scales: torch.Tensor | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    w4_activations: str = "bfloat16"
    """4-bit layers: ``"bfloat16"`` (W4A16) or ``"float8_e4m3fn"`` (W4A8: a1 and a2 quantized FP8 1x128 with FP32
    scales, as the FP8 layer does; the activation is quantized from FP32 in the fused kernel)."""

    def __post_init__(self):
        if isinstance(self.w13, W4Experts) != isinstance(self.w2, W4Experts):
            raise ValueError("w13 and w2 must both be 4-bit W4Experts or both tensors (mixed layers have no kernel)")
        if self.w4_activations not in ("bfloat16", "float8_e4m3fn"):
            raise ValueError(f"w4_activations must be 'bfloat16' or 'float8_e4m3fn'; got {self.w4_activations!r}")

    @property
    def fp8_activations(self) -> bool:
        """Activations quantized FP8 1x128 (FP8 layers, and 4-bit layers with ``w4_activations`` FP8)."""
        return self.fp8 or (self.w4 and self.w4_activations == "float8_e4m3fn")

    @property
    def w4(self) -> bool:
        """4-bit weights (:class:`fastpath.grouped_gemm_w4.W4Experts`), run with bf16 activations (W4A16)."""
        return isinstance(self.w13, W4Experts)

    @property
    def fp8(self) -> bool:
        return not self.w4 and self.w13.dtype == torch.float8_e4m3fn

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])


def fast_weights(weights, device="cuda", *, w4_activations: str = "bfloat16") -> FastMoEWeights:
    """:class:`FastMoEWeights` from a :class:`moeref.moe.MoEWeights` (or :class:`moeref.moe.SharedExperts`)
    whose stacks are FP8 128x128 quantized experts with float32-representable scales, 4-bit experts (MXFP4,
    NVFP4, INT4 groups: :meth:`fastpath.grouped_gemm_w4.W4Experts.from_quantized`; ``w4_activations`` picks
    W4A16 or W4A8), or float arrays."""
    if hasattr(weights, "as_weights"):
        weights = weights.as_weights()

    def one(ws):
        if isinstance(ws, W4Experts):
            return ws.to(device), None
        if isinstance(ws, (list, tuple)) and ws and hasattr(ws[0], "scheme") and ws[0].scheme.element in _W4_ELEMENTS:
            return W4Experts.from_quantized(ws, device), None
        if isinstance(ws, list) and ws and hasattr(ws[0], "codes"):
            ws = StackedExperts.from_quantized(ws)
        if isinstance(ws, StackedExperts):
            if ws.element != "e4m3fn" or ws.block != (128, 128):
                raise ValueError(f"the GPU layer takes E4M3 128x128 experts; got {ws.element} blocks {ws.block}")
            d = ws.to(device)
            s32 = d.scales.to(torch.float32)
            if not torch.equal(s32.to(torch.float64), d.scales):
                raise ValueError("block scales are not FP32 values (global/channel factors have no kernel here)")
            return d.codes.view(torch.float8_e4m3fn), s32
        if torch.is_tensor(ws):
            return ws.to(device), None
        return torch.stack([torch.as_tensor(np.asarray(w)) for w in ws]).to(device), None

    def bias(b):
        return None if b is None else torch.as_tensor(np.asarray(b, dtype=np.float32)).to(device)

    w13, s13 = one(weights.w13)
    w2, s2 = one(weights.w2)
    return FastMoEWeights(w13, w2, weights.w13_layout, s13, s2, bias(weights.b13), bias(weights.b2),
                          w4_activations=w4_activations)


_W4_ELEMENTS = ("e2m1", "int4", "uint4")


def reference_config(weights: FastMoEWeights, *, apply_router_weight_on_input: bool = False) -> dict:
    """The :func:`moeref.moe.run_moe` keyword arguments whose declared stores match this layer, and the
    :mod:`moeref.compare` profile name under ``"profile"`` (4-bit layers: for bf16 hidden states; float32
    hidden states store in float32 under ``FP32_ACCUM``), for every activation of :data:`ACTIVATIONS` (their
    float32 evaluation is inside the profiles' ``act_unit``: module docstring).
    ``apply_router_weight_on_input``: the layer run with it; for bf16/fp16 GEMM operands the weighted float32
    rows are declared stored in that dtype (an a1 quantizer that rounds them, :func:`stored_as`; module
    docstring)."""
    from moeref.moe import MoEQuant
    from moeref.quant import fp8_group

    on_input = dict(apply_router_weight_on_input=True) if apply_router_weight_on_input else {}
    if weights.fp8_activations:
        q = MoEQuant(fp8_group(), fp8_group(), "fp8 1x128")
        return dict(quant=q, gemm1_out_dtype="bfloat16", act_out_dtype="float32", out_dtype="bfloat16",
                    profile="HOPPER_FP8_DEEPGEMM_DATA" if weights.fp8 else "BF16_OUTPUT_FP32_ACT", **on_input)
    # W4A16: bf16 activations, GEMM outputs and activation stored bf16 (W4A8: above); float layers store the
    # GEMM operand, h and x in the weights' dtype
    store = "bfloat16" if weights.w4 else str(weights.w13.dtype).replace("torch.", "")
    if on_input and store != "float32":
        on_input["quant"] = MoEQuant(stored_as(store), None, f"weighted input stored {store}")
    profile = W4_PROFILE_OF[("triton", weights.w13.kind)] if weights.w4 else "BF16_OUTPUT"
    return dict(gemm1_out_dtype=store, act_out_dtype=store, out_dtype="bfloat16", profile=profile, **on_input)


def stored_as(dtype: str):
    """An a1 quantizer function of the reference (:class:`moeref.moe.Quantizer`) that rounds its float rows
    to ``dtype`` (RNE, :func:`moeref.moe.round_to_dtype`): the store of the router-weighted input in a bf16/fp16
    GEMM operand."""
    from moeref.moe import round_to_dtype

    def store(x):
        return round_to_dtype(x, dtype)

    store.__name__ = f"stored_{dtype}"
    return store


def profile_of(impl: str, weights: FastMoEWeights) -> str:
    """The declared :mod:`moeref.compare` profile of ``impl`` on these weights."""
    if weights.w4:
        return "BF16_OUTPUT_FP32_ACT" if weights.fp8_activations else W4_PROFILE_OF[(impl, weights.w13.kind)]
    return PROFILE_OF[(impl, "fp8_block" if weights.fp8 else "float")]


def exact_profile(impl: str, weights: FastMoEWeights, *, apply_router_weight_on_input: bool = False):
    """The equality-level :class:`moeref.compare.Profile` of the FP8 layer through ``impl``
    (:data:`fastpath.grouped_gemm.EXACT_PROFILE_OF`: both GEMMs predicted bit for bit on Hopper) with the stores
    :func:`reference_config` declares (GEMM outputs, activation, output), for every activation of
    :data:`ACTIVATIONS` (``act_unit`` 16 float32 ulps, the activation's evaluation: module docstring).
    ``ValueError`` for layers without one (bf16 and 4-bit weights: their GEMMs are not emulated)."""
    from dataclasses import replace

    from moeref.compare.kernel_profiles import get_profile

    if not weights.fp8 or weights.w4 or (impl, "fp8_block") not in EXACT_PROFILE_OF:
        raise ValueError(f"no emulated profile for impl {impl!r} on these weights (FP8 block weights through "
                         f"{sorted(i for i, _ in EXACT_PROFILE_OF)} only)")
    cfg = reference_config(weights, apply_router_weight_on_input=apply_router_weight_on_input)
    return replace(get_profile(EXACT_PROFILE_OF[(impl, "fp8_block")]), gemm_out_dtype=cfg["gemm1_out_dtype"],
                   act_out_dtype=cfg["act_out_dtype"], out_dtype=cfg["out_dtype"])
