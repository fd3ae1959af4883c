"""Hypothesis strategies users import to test their kernels (needs the ``test`` extra: hypothesis).

:mod:`.routing`: routings (:func:`routings` returns a :class:`RoutingCase`), EP shards, token counts
at tile boundaries, DeepGEMM alignments, router logits and correction biases.
"""
from __future__ import annotations

from .routing import (
    BLACKWELL_ALIGNMENTS,
    ID_KINDS,
    LOGIT_KINDS,
    OPT_IN_KINDS,
    ROUTING_KINDS,
    EPShard,
    RoutingCase,
    alignments,
    biases,
    block_boundary_counts,
    ep_shards,
    router_logits,
    routings,
    token_counts,
)

__all__ = [
    "BLACKWELL_ALIGNMENTS",
    "ID_KINDS",
    "LOGIT_KINDS",
    "OPT_IN_KINDS",
    "ROUTING_KINDS",
    "EPShard",
    "RoutingCase",
    "alignments",
    "biases",
    "block_boundary_counts",
    "ep_shards",
    "router_logits",
    "routings",
    "token_counts",
]
