"""Routing references: router logits -> (weights, expert ids), with one declared tie/NaN policy.

* :mod:`.topk`: the stable top-k every method uses (higher score first, lower expert id wins ties,
  NaN below -inf, ids never repeat).
* :mod:`.methods`: ``softmax_topk``, ``sigmoid_topk``, ``topk_softmax``, ``biased_topk``,
  ``grouped_topk``, ``llama4_top1`` and the by-name :func:`route`.
* :mod:`.names`: what vLLM/FlashInfer/triton_kernels/SGLang method names mean in these terms.
* :mod:`.expert_map`: EP placement (linear / round-robin, fused shared experts) as ``expert_map``.
* :mod:`.ids`: the ``topk_ids`` contract (``-1`` = padding slot; an expert repeated within a token
  is accepted, each slot its own row) and its validation.
"""
from __future__ import annotations

from .expert_map import EP_STRATEGIES, check_expert_map, expert_map, local_expert_ids, to_local_ids
from .ids import PADDING_ID, check_topk_ids
from .methods import (
    METHODS,
    SCORING_FUNCS,
    Routing,
    biased_topk,
    grouped_topk,
    llama4_top1,
    route,
    sigmoid,
    sigmoid_topk,
    softmax,
    softmax_topk,
    topk_softmax,
    with_padding,
)
from .names import LIBRARY_METHOD_NAMES, LibraryMethod, route_as
from .topk import order_keys, stable_topk, top_values

__all__ = [
    "EP_STRATEGIES",
    "LIBRARY_METHOD_NAMES",
    "METHODS",
    "PADDING_ID",
    "SCORING_FUNCS",
    "LibraryMethod",
    "Routing",
    "biased_topk",
    "check_expert_map",
    "check_topk_ids",
    "expert_map",
    "grouped_topk",
    "llama4_top1",
    "local_expert_ids",
    "order_keys",
    "route",
    "route_as",
    "sigmoid",
    "sigmoid_topk",
    "softmax",
    "softmax_topk",
    "stable_topk",
    "to_local_ids",
    "top_values",
    "topk_softmax",
    "with_padding",
]
