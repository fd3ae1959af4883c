"""The small layer case the moeref.testing tests share: a layer, a routing and tokens as a kernel sees them."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from moeref.moe import make_layer, make_tokens
from moeref.routing import softmax_topk
from moeref.testing import kernel_inputs


def layer_inputs(m=13, k=128, n=64, e=6, top_k=3, seed=0):
    """:func:`moeref.testing.kernel_inputs` of ``m`` tokens of width ``k`` routed ``top_k`` of ``e`` experts
    (softmax top-k, renormalized) through a layer of intermediate size ``n`` (:func:`moeref.moe.make_layer`)."""
    lw = make_layer(e, k, n, seed=seed)
    r = softmax_topk(np.random.default_rng(seed + 5).standard_normal((m, e)), top_k, renormalize=True)
    return kernel_inputs(make_tokens(m, k, seed=seed + 1), lw, r.weights, r.ids)


def replace_weights(lw, w13, w2):
    """``lw`` (a :class:`moeref.moe.MoEWeights`) with its expert weights replaced."""
    return replace(lw, w13=w13, w2=w2)
