"""Hypothesis strategies of exact-regime grouped GEMMs and whole layers (needs the ``test`` extra).

* :func:`exact_grouped_gemms`: :class:`ExactGroupedGemm` cases ``(a, weights, row_expert)`` for every
  operand pairing of :data:`GEMM_PAIRS` (FP8 per-tensor / per-token x per-channel / 1x128 x 128x128 with
  FP32 and UE8M0 scales, MXFP8, MXFP4, NVFP4, INT8, W4A16 INT4 and MXFP4, W4A8, bf16/fp16/fp32), with the
  rows of a routing of :func:`moeref.strategies.routings` (every kind), inside the regime of the drawn
  :class:`~moeref.regimes.Arithmetic` (the strategy asserts it with :func:`~moeref.regimes.in_exact_regime`).
* :func:`exact_layers`: :class:`~moeref.regimes.ExactLayer` cases over every routing kind, scheme and
  activation of :func:`~moeref.regimes.exact_layer`, with biases, shared experts, chunking, dispatch
  layouts and EP expert maps drawn.
* :func:`single_rounding_layers`: :func:`~moeref.regimes.single_rounding_layer` cases (every declared store
  rounds an exact value once), drawn the same way.

The routings' ids are used as drawn; their weights are replaced by powers of two
(:func:`~moeref.regimes.exact_topk_weights`): softmax weights are not exact in FP32 products.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from ..moe import LayerConfig
from ..routing.expert_map import expert_map as make_expert_map
from ..strategies import OPT_IN_KINDS, ROUTING_KINDS, routings
from .arithmetic import get_arithmetic
from .checker import in_exact_regime
from .layer import LAYER_ACTIVATIONS, LAYER_SCHEMES, ExactLayer, exact_layer, exact_topk_weights
from .operands import exact_operand
from .rounding import ROUNDING_LAYER_ACTIVATIONS, ROUNDING_LAYER_SCHEMES, single_rounding_layer

__all__ = ["GEMM_PAIRS", "ExactGroupedGemm", "exact_grouped_gemms", "exact_layers", "single_rounding_layers"]

GEMM_PAIRS = {
    "fp8_per_tensor": ("fp8_per_tensor", "fp8_per_tensor"),
    "fp8_per_token_channel": ("fp8_per_token", "fp8_per_channel"),
    "fp8_1x128_128x128": ("fp8_1x128", "fp8_128x128"),
    "fp8_1x128_128x128_ue8m0": ("fp8_1x128_ue8m0", "fp8_128x128_ue8m0"),
    "mxfp8": ("mxfp8", "mxfp8"),
    "mxfp4": ("mxfp4", "mxfp4"),
    "nvfp4": ("nvfp4", "nvfp4_weight"),
    "int8": ("int8_per_token", "int8_per_channel"),
    "w4a16_int4": ("bfloat16", "int4_g128"),
    "w4a16_int4_asym": ("bfloat16", "int4_g128_asym"),
    "w4a16_mxfp4": ("bfloat16", "mxfp4"),
    "w4a8": ("fp8_per_token", "w4a8_cutlass"),
    "bf16": ("bfloat16", "bfloat16"),
    "fp16": ("float16", "float16"),
    "fp32": ("float32", "float32"),
}
"""Operand pairings ``name -> (activation scheme, weight scheme)`` (names of
:data:`moeref.regimes.EXACT_SCHEMES` or float dtypes)."""

_DRAWN_KINDS = tuple(k for k in ROUTING_KINDS if k != "nonfinite")  # NaN logits route nothing exact


@dataclass(frozen=True, eq=False)
class ExactGroupedGemm:
    """A grouped GEMM in an exact regime: ``a [R, K]`` (one row per routed slot), ``weights`` (per-expert
    ``[N, K]``), ``row_expert`` int64 ``[R]``, the ``pair`` and ``arithmetic`` names, the routing kind."""

    a: object
    weights: list
    row_expert: np.ndarray
    pair: str
    arithmetic: str
    routing: str

    @property
    def inputs(self) -> tuple:
        return (self.a, self.weights, self.row_expert)

    def __repr__(self) -> str:
        shape = getattr(self.a, "shape", None)
        return (f"ExactGroupedGemm(pair={self.pair!r}, arithmetic={self.arithmetic!r}, routing={self.routing!r}, "
                f"a={tuple(shape) if shape is not None else None}, experts={len(self.weights)})")


@st.composite
def exact_grouped_gemms(draw, *, pairs=tuple(GEMM_PAIRS), arithmetics=("fp32", "hopper_fp8", "fp8_unpromoted"),
                        max_tokens: int = 8, max_experts: int = 4, max_top_k: int = 3, ks=(128, 256),
                        ns=(32, 128), kinds=_DRAWN_KINDS):
    """A :class:`ExactGroupedGemm` (module docstring). Element magnitudes shrink with the arithmetic
    (``max_abs`` 8 for FP32; 2 and a sparser operand for the 14-bit FP8 accumulators) so the drawn case is
    inside its regime; the strategy asserts that."""
    pair = draw(st.sampled_from(tuple(pairs)))
    ar = draw(st.sampled_from(tuple(arithmetics)))
    r = draw(routings(max_tokens=max_tokens, max_experts=max_experts, max_top_k=max_top_k, kinds=tuple(kinds),
                      allow_padding=True))
    k = draw(st.sampled_from(tuple(ks)))
    n = draw(st.sampled_from(tuple(ns)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    a_scheme, w_scheme = GEMM_PAIRS[pair]
    fp32 = get_arithmetic(ar).accumulator == "fp32"
    max_abs = 8 if fp32 else 2
    density = 1.0 if fp32 else 0.25
    rows = r.ids.reshape(-1).astype(np.int64)
    a = exact_operand((rows.size, k), a_scheme, seed=rng, max_abs=max_abs, density=density)
    weights = [exact_operand((n, k), w_scheme, seed=rng, max_abs=max_abs) for _ in range(r.num_experts)]
    case = ExactGroupedGemm(a, weights, rows, pair, ar, r.kind)
    ok, why = in_exact_regime(case.inputs, ar)
    assert ok, f"exact_grouped_gemms drew a case outside its regime ({pair}, {ar}): {why}"
    return case


@st.composite
def exact_layers(draw, *, schemes=LAYER_SCHEMES, activations=LAYER_ACTIVATIONS, max_tokens: int = 12,
                 max_experts: int = 6, max_top_k: int = 3, hidden=(256,), intermediate=(128, 256),
                 kinds=_DRAWN_KINDS + OPT_IN_KINDS, bias=None, shared=None, chunking: bool = True,
                 layouts=("standard", "contiguous", "masked", "batched"), expert_maps: bool = True) -> ExactLayer:
    """An :class:`~moeref.regimes.ExactLayer` (module docstring): scheme, activation, a routing of any kind
    (its ids; exact power-of-two weights), biases and a shared expert (drawn unless ``bias`` / ``shared``
    fix them), a chunk size, a dispatch layout and, with ``expert_maps``, one EP rank's expert map (the
    layer then holds that rank's experts and its output is the rank's partial sum)."""
    with_bias = draw(st.booleans()) if bias is None else bool(bias)
    return draw(_drawn_layers(exact_layer, dict(bias=with_bias), schemes=schemes, activations=activations,
                              max_tokens=max_tokens, max_experts=max_experts, max_top_k=max_top_k, hidden=hidden,
                              intermediate=intermediate, kinds=kinds, shared=shared, chunking=chunking,
                              layouts=layouts, expert_maps=expert_maps))


@st.composite
def single_rounding_layers(draw, *, schemes=ROUNDING_LAYER_SCHEMES, activations=ROUNDING_LAYER_ACTIVATIONS,
                           max_tokens: int = 12, max_experts: int = 6, max_top_k: int = 3, hidden=(256,),
                           intermediate=(128, 256), kinds=_DRAWN_KINDS + OPT_IN_KINDS, shared=None,
                           chunking: bool = True, layouts=("standard", "contiguous", "masked", "batched"),
                           expert_maps: bool = True, gemm2_store: str | None = None) -> ExactLayer:
    """A :func:`~moeref.regimes.single_rounding_layer` (every declared store rounds an exact value once), drawn
    like :func:`exact_layers` (no biases: the construction has none); ``gemm2_store``: GEMM2's declared store
    (None: none; ``"bfloat16"``: one bf16 store before the top-k sum)."""
    return draw(_drawn_layers(single_rounding_layer, {"gemm2_store": gemm2_store}, schemes=schemes, activations=activations,
                              max_tokens=max_tokens, max_experts=max_experts, max_top_k=max_top_k, hidden=hidden,
                              intermediate=intermediate, kinds=kinds, shared=shared, chunking=chunking,
                              layouts=layouts, expert_maps=expert_maps))


@st.composite
def _drawn_layers(draw, build, fixed: dict, *, schemes, activations, max_tokens, max_experts, max_top_k, hidden,
                  intermediate, kinds, shared, chunking, layouts, expert_maps) -> ExactLayer:
    scheme = draw(st.sampled_from(tuple(schemes)))
    activation = draw(st.sampled_from(tuple(activations)))
    r = draw(routings(max_tokens=max_tokens, max_experts=max_experts, max_top_k=max_top_k, kinds=tuple(kinds),
                      allow_padding=True))
    k = draw(st.sampled_from(tuple(hidden)))
    n = draw(st.sampled_from(tuple(intermediate)))
    with_shared = draw(st.booleans()) if shared is None else bool(shared)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    options = {"layout": draw(st.sampled_from(tuple(layouts)))}
    if chunking and r.num_tokens > 1 and draw(st.booleans()):
        options["chunk_size"] = draw(st.integers(1, r.num_tokens - 1))
    tw = exact_topk_weights(r.ids.shape, seed=rng)
    lay = build(r.num_tokens, k, n, r.num_experts, r.top_k, scheme=scheme, activation=activation, seed=rng,
                topk_ids=r.ids, topk_weights=tw, shared_experts=with_shared, **fixed, **options)
    if expert_maps and r.num_experts > 1 and draw(st.booleans()):
        ep_size = draw(st.integers(2, min(4, r.num_experts)))
        ep_rank = draw(st.integers(0, ep_size - 1))
        strategy = draw(st.sampled_from(("linear", "round_robin")))
        emap = make_expert_map(r.num_experts, ep_size, ep_rank, strategy)
        local = np.flatnonzero(emap >= 0)[np.argsort(emap[emap >= 0])]
        cfg = LayerConfig.build(lay.config, expert_map=emap, num_experts=r.num_experts)
        lay = ExactLayer(lay.hidden, lay.weights.select(local), lay.topk_weights, lay.topk_ids, cfg, lay.scheme,
                         lay.token_exponents, lay.excluded_stores)
    return lay
