"""The MoE layer: ``prepare -> experts -> finalize`` and ``fused_moe`` (:mod:`.pipeline`), weight
containers and test-layer builders (:mod:`.weights`), the FlashInfer/vLLM argument mapping
(:mod:`.mapping`) and the demo (:mod:`.demo`). See docs/moe-pipeline.md."""
from __future__ import annotations

from .config import LayerConfig, Quantizer
from .pipeline import (
    LAYOUTS,
    NO_QUANT,
    ExpertsOutput,
    MoEQuant,
    MoERun,
    Prepared,
    experts,
    finalize,
    fused_moe,
    prepare,
    quantizer,
    round_to_dtype,
    run_moe,
)
from .weights import MoEWeights, SharedExperts, make_layer, make_tokens, quantize_weights

__all__ = [
    "LAYOUTS",
    "NO_QUANT",
    "ExpertsOutput",
    "LayerConfig",
    "Quantizer",
    "MoEQuant",
    "MoERun",
    "MoEWeights",
    "Prepared",
    "SharedExperts",
    "experts",
    "finalize",
    "fused_moe",
    "make_layer",
    "make_tokens",
    "prepare",
    "quantize_weights",
    "quantizer",
    "round_to_dtype",
    "run_moe",
]
