"""The exact-regime proof's models (``bench/bench_exact_regimes.py``'s docstring lists them): their shapes and
schemes (:data:`MODELS`, :data:`TINY`), the exact or single-rounding layer of a model (:func:`make_case`) and a
case made of some of its token rows with another routing (:func:`token_case`, :func:`first_tokens`)."""
from __future__ import annotations

import numpy as np

MODELS = {
    "deepseek_v3": dict(hidden=7168, intermediate=2048, experts=256, top_k=8, scheme="fp8_1x128",
                        activation="silu_and_mul"),
    "deepseek_v3_ue8m0": dict(hidden=7168, intermediate=2048, experts=256, top_k=8, scheme="fp8_1x128_ue8m0",
                              activation="silu_and_mul"),
    "qwen3_30b_a3b": dict(hidden=2048, intermediate=768, experts=128, top_k=8, scheme="bf16",
                          activation="silu_and_mul"),
    "qwen3_30b_a3b_gelu": dict(hidden=2048, intermediate=768, experts=128, top_k=8, scheme="bf16",
                               activation="gelu_and_mul"),
    "gpt_oss_120b_mxfp4": dict(hidden=2880, intermediate=2880, experts=128, top_k=4, scheme="mxfp4_w4a16",
                               activation="swigluoai", bias=True),
    "qwen3_30b_a3b_fp8": dict(hidden=2048, intermediate=768, experts=128, top_k=8, scheme="fp8_1x128",
                              activation="silu_and_mul"),
    "mixtral_8x7b": dict(hidden=4096, intermediate=14336, experts=8, top_k=2, scheme="bf16",
                         activation="silu_and_mul", max_pool=4),
}
DEFAULT_MODELS = ("deepseek_v3", "qwen3_30b_a3b", "qwen3_30b_a3b_fp8", "qwen3_30b_a3b_gelu", "mixtral_8x7b",
                  "gpt_oss_120b_mxfp4")
TINY = dict(hidden=256, intermediate=256, experts=8, top_k=2)


def make_case(model: str, tokens: int, *, tiny: bool = False, seed: int = 0, expert_pool: int = 8, shape=None,
              regime: str = "exact"):
    """The exact layer of ``model`` (``tiny``: hidden 256, intermediate 256, 8 experts, top-2; ``shape``:
    ``(hidden, intermediate, experts, top_k)``) with a skewed (Zipf) routing and token 0's first two weights made
    different. ``expert_pool`` 0: every expert distinct (else at most the model's ``max_pool``).
    ``regime="single_rounding"``: :func:`moeref.regimes.single_rounding_layer` (no biases)."""
    from moeref.regimes import exact_layer, exact_topk_weights, single_rounding_layer

    spec = dict(MODELS[model])
    if tiny:
        spec.update(TINY)
    if shape is not None:
        spec.update(zip(("hidden", "intermediate", "experts", "top_k"), (int(v) for v in shape)))
    rng = np.random.default_rng(seed)
    e, k = spec["experts"], spec["top_k"]
    p = 1.0 / np.arange(1, e + 1) ** 1.2
    gumbel = np.log(p)[None, :] - np.log(-np.log(rng.random((tokens, e))))
    ids = np.argsort(-gumbel, axis=1, kind="stable")[:, :k].astype(np.int32)
    tw = exact_topk_weights((tokens, k), seed=rng)
    if tokens and k > 1:
        tw[0, :2] = [1.0, 0.25]
    pool = min(expert_pool, e, spec.get("max_pool", e)) if expert_pool else None
    if regime == "single_rounding":
        return single_rounding_layer(tokens, spec["hidden"], spec["intermediate"], e, k, scheme=spec["scheme"],
                                     activation=spec["activation"], seed=rng, topk_ids=ids, topk_weights=tw,
                                     expert_pool=pool)
    return exact_layer(tokens, spec["hidden"], spec["intermediate"], e, k, scheme=spec["scheme"],
                       activation=spec["activation"], seed=rng, topk_ids=ids, topk_weights=tw,
                       expert_pool=pool, bias=spec.get("bias", False))


def token_case(base, rows, topk_ids, topk_weights):
    """The layer ``base`` (:func:`make_case`) on its token rows ``rows`` (int ``[M]``, repeats allowed) routed by
    ``topk_ids`` (int ``[M, k]``, -1 padding) with ``topk_weights`` (powers of two, 0 on padding): the same
    weights, config and declared stores. Every token row of the construction is one of its tokens, and the
    construction takes any routing with power-of-two weights (:func:`moeref.regimes.exact_layer`,
    :func:`moeref.regimes.single_rounding_layer`), so the case is in the regime ``base`` is in; it has no
    certificate (:func:`moeref.regimes.layer_in_exact_regime` reads its values)."""
    from moeref.regimes import ExactLayer

    rows = np.asarray(rows, np.int64)
    kt = None if base.token_exponents is None else np.asarray(base.token_exponents)[rows]
    return ExactLayer(base.hidden[rows], base.weights, np.asarray(topk_weights, np.float32),
                      np.asarray(topk_ids, np.int32), base.config, base.scheme, kt, base.excluded_stores)


def first_tokens(base, tokens: int):
    """``base`` itself at its own token count, else its first ``tokens`` tokens (:func:`token_case`)."""
    if tokens == base.hidden.shape[0]:
        return base
    if tokens > base.hidden.shape[0]:
        raise ValueError(f"the layer has {base.hidden.shape[0]} tokens; asked for the first {tokens}")
    return token_case(base, np.arange(tokens), base.topk_ids[:tokens], base.topk_weights[:tokens])
