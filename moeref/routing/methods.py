"""Routing methods: router logits ``[M, E]`` -> top-k weights and expert ids.

Every method selects with :func:`moeref.routing.topk.stable_topk` (one tie/NaN policy: higher score
first, lower expert id wins ties, NaN below -inf, ids never repeat) and computes weights in float64
from the exact input values, rounding once to float32 at the end.

Which scores are ranked. ``softmax_topk``, ``sigmoid_topk``, ``topk_softmax`` and ``llama4_top1``
rank the **logits**: softmax and sigmoid are strictly increasing, so this is the exact-arithmetic
selection of the published definitions, and it is invariant to shifting a token's logits (the
all-negative-logits bug, FlashInfer #2822 / vLLM #37591). A kernel that ranks fp32-rounded
probabilities can differ only where rounding makes two probabilities equal (e.g. sigmoid saturating
to 1.0: the only difference between FlashInfer "Sigmoid" and "TopKSigmoid"). ``biased_topk`` and
``grouped_topk`` rank ``score + bias`` computed in float64.

Non-finite logits (declared policy). Softmax is the limit definition: a row with ``m`` entries of
``+inf`` gives ``1/m`` to each of them and 0 elsewhere; a row whose entries are all ``-inf`` gives NaN
(0/0); a row containing NaN gives NaN everywhere (IEEE propagation). Sigmoid is elementwise:
``sigmoid(+inf) = 1``, ``sigmoid(-inf) = 0``, ``sigmoid(NaN) = NaN``. Selection always follows the
tie/NaN policy, so ids stay distinct and NaN experts are picked last.

Sources: vLLM ``router/fused_topk_router.py`` (softmax/sigmoid ``fused_topk``), ``fused_topk_bias``,
``router/grouped_topk_router.py@055e47c`` (``grouped_topk``), ``tests/kernels/moe/test_routing.py``
(``baseline_custom_llama4``), vLLM ``oai_moe_forward`` / triton_kernels ``routing_torch(sm_first=False)``
/ FlashInfer ``routing_reference_renormalize`` (topk -> softmax).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_float_array, check_choice, check_ndim, check_positive_int
from .topk import EXCLUDED_KEY, order_keys, stable_topk, top_values_from_keys, topk_from_keys

__all__ = [
    "METHODS",
    "SCORING_FUNCS",
    "Routing",
    "biased_topk",
    "grouped_topk",
    "llama4_top1",
    "route",
    "sigmoid_topk",
    "softmax_topk",
    "topk_softmax",
    "with_padding",
]

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True, eq=False)
class Routing:
    """Result of a routing method.

    ``weights``: float32 ``[M, k]``, the router weight of each slot (0.0 in padding rows).
    ``ids``: int32 or int64 ``[M, k]``, global expert ids in rank order (best first), distinct within a
    row; ``-1`` marks a padding slot (see :func:`with_padding`). ``method``: the method's name.
    """

    weights: np.ndarray
    ids: np.ndarray
    method: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[1])


# ----------------------------------------------------------------------------------------------
# score functions (float64, declared non-finite semantics)


def softmax(x: np.ndarray) -> np.ndarray:
    """Row softmax in float64 with the limit semantics for ``+inf`` (module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] == 0:
        return x.copy()
    if np.isfinite(x).all():  # fast path; the general path below gives the same values here
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    nan_row = np.isnan(x).any(axis=-1, keepdims=True)
    posinf = x == np.inf
    n_posinf = posinf.sum(axis=-1, keepdims=True)
    safe = np.where(np.isnan(x), -np.inf, x)
    row_max = safe.max(axis=-1, keepdims=True)
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        e = np.exp(safe - shift)
        p = e / e.sum(axis=-1, keepdims=True)  # all -inf row: 0/0 = NaN
        p = np.where(n_posinf > 0, posinf / np.maximum(n_posinf, 1), p)
    return np.where(nan_row, np.nan, p)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Elementwise logistic sigmoid ``1 / (1 + exp(-x))`` in float64 (relative error of a few float64
    ulps; ``exp`` overflow for ``x < -709`` gives exactly 0, the float32 result anyway;
    ``sigmoid(NaN) = NaN``)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _score(x: np.ndarray, scoring: str) -> np.ndarray:
    check_choice(scoring, SCORING_FUNCS, "scoring")
    return softmax(x) if scoring == "softmax" else sigmoid(x)


# ----------------------------------------------------------------------------------------------
# argument handling


def _logits(logits) -> np.ndarray:
    x = as_float_array(logits, "logits")
    check_ndim(x, 2, "logits")
    if x.shape[1] == 0:
        raise ValueError(f"logits must have at least one expert column; got shape {x.shape}")
    return x.astype(np.float64)  # exact for every float input dtype


def _top_k(top_k, num_experts: int) -> int:
    top_k = check_positive_int(top_k, "top_k")
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= num_experts ({num_experts}); got top_k={top_k}")
    return top_k


def _ids_dtype(ids_dtype) -> np.dtype:
    dt = np.dtype(ids_dtype)
    if dt not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"ids_dtype must be int32 or int64; got {dt}")
    return dt


def _bias(bias, num_experts: int) -> np.ndarray:
    b = as_float_array(bias, "bias").astype(np.float64)
    if b.shape != (num_experts,):
        raise ValueError(f"bias must have shape ({num_experts},) (one per expert); got {b.shape}")
    return b


def _finish(w64, ids, renormalize, scale, ids_dtype, method) -> Routing:
    if renormalize:
        with np.errstate(invalid="ignore", divide="ignore"):
            w64 = w64 / w64.sum(axis=1, keepdims=True)
    if scale != 1.0:
        w64 = w64 * float(scale)
    return Routing(weights=w64.astype(np.float32), ids=ids.astype(_ids_dtype(ids_dtype)), method=method)


def _scale(routed_scaling_factor) -> float:
    f = float(routed_scaling_factor)
    if not np.isfinite(f) or f <= 0:
        raise ValueError(f"routed_scaling_factor must be a positive finite number; got {routed_scaling_factor!r}")
    return f


# ----------------------------------------------------------------------------------------------
# methods


def softmax_topk(logits, top_k: int, *, renormalize: bool = False, ids_dtype=np.int32) -> Routing:
    """vLLM ``fused_topk`` (scoring softmax): ``p = softmax(logits)``; ``w, ids = topk(p, k)``;
    if ``renormalize``: ``w /= sum(w)``. vLLM "Renormalize" (renormalize=True) = FlashInfer
    "RenormalizeNaive"; vLLM "Default"/SGLang ``torch_naive_moe`` (renormalize=False).

    >>> r = softmax_topk(np.array([[0.0, 2.0, 1.0, 2.0]], dtype=np.float32), 2)
    >>> r.ids  # tie between experts 1 and 3: lower id first
    array([[1, 3]], dtype=int32)
    >>> r.weights
    array([[0.3994863, 0.3994863]], dtype=float32)
    """
    x = _logits(logits)
    k = _top_k(top_k, x.shape[1])
    ids = stable_topk(x, k)
    if renormalize:
        # softmax -> top-k -> renormalize equals softmax over the k selected logits in exact
        # arithmetic (the full denominator cancels; the non-finite rules agree too), so compute it
        # that way: one rounding fewer. This is why it equals topk_softmax up to rounding (names.py).
        w = softmax(np.take_along_axis(x, ids, axis=1))
        return _finish(w, ids, False, 1.0, ids_dtype, "softmax_topk")
    w = np.take_along_axis(softmax(x), ids, axis=1)
    return _finish(w, ids, False, 1.0, ids_dtype, "softmax_topk")


def sigmoid_topk(logits, top_k: int, *, renormalize: bool = False, ids_dtype=np.int32) -> Routing:
    """vLLM ``fused_topk`` with ``scoring_func="sigmoid"`` (``topk_sigmoid``): ``w, ids =
    topk(sigmoid(logits), k)``, optionally renormalized. FlashInfer "Sigmoid"/"SigmoidRenorm"."""
    x = _logits(logits)
    k = _top_k(top_k, x.shape[1])
    ids = stable_topk(x, k)
    w = sigmoid(np.take_along_axis(x, ids, axis=1))
    return _finish(w, ids, renormalize, 1.0, ids_dtype, "sigmoid_topk")


def topk_softmax(logits, top_k: int, *, ids_dtype=np.int32) -> Routing:
    """gpt-oss / TRT-LLM "Renormalize" / triton_kernels ``sm_first=False``: ``ids = topk(logits, k)``;
    ``w = softmax(logits[ids])`` over the k selected only (weights sum to 1).

    >>> topk_softmax(np.array([[0.0, 1.0, -1.0]]), 2).weights
    array([[0.7310586 , 0.26894143]], dtype=float32)
    """
    x = _logits(logits)
    k = _top_k(top_k, x.shape[1])
    ids = stable_topk(x, k)
    w = softmax(np.take_along_axis(x, ids, axis=1))
    return _finish(w, ids, False, 1.0, ids_dtype, "topk_softmax")


def biased_topk(
    logits,
    top_k: int,
    bias,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
    ids_dtype=np.int32,
) -> Routing:
    """vLLM ``fused_topk_bias``: ``s = score(logits)``; select ``ids = topk(s + bias, k)``; the
    weights are the **unbiased** ``s[ids]``; renormalize; then ``* routed_scaling_factor``.

    Selection ranks ``s + bias`` even when every value is negative (no masking with 0: FlashInfer
    #2168, SGLang PR #3705). ``bias``: float ``[E]``.

    >>> r = biased_topk(np.zeros((1, 3)), 1, np.array([-0.5, -0.1, -0.3]), scoring="sigmoid")
    >>> r.ids, r.weights
    (array([[1]], dtype=int32), array([[0.5]], dtype=float32))
    """
    x = _logits(logits)
    k = _top_k(top_k, x.shape[1])
    b = _bias(bias, x.shape[1])
    s = _score(x, scoring)
    ids = stable_topk(s + b, k)
    w = np.take_along_axis(s, ids, axis=1)
    return _finish(w, ids, renormalize, _scale(routed_scaling_factor), ids_dtype, "biased_topk")


def grouped_topk(
    logits,
    top_k: int,
    n_group: int,
    topk_group: int,
    *,
    scoring: str = "softmax",
    bias=None,
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
    ids_dtype=np.int32,
) -> Routing:
    """DeepSeek-V2/V3 grouped top-k (vLLM ``grouped_topk``, FlashInfer ``noaux_tc_ref``).

    1. ``s = score(logits)`` (``scoring`` softmax or sigmoid); ``c = s + bias`` if ``bias`` else ``s``.
    2. Experts form ``n_group`` contiguous groups of ``E / n_group``. Group score: with ``bias``, the
       sum of the group's top-2 ``c``; without, the group's max ``c``.
    3. Keep the ``topk_group`` best groups (lower group id wins ties). Experts of other groups are
       **excluded** (vLLM masks them to ``-inf``; older code and HF DeepSeek masked to 0.0, which lets
       a masked expert win when every kept score is negative: SGLang PR #3705). Here an excluded
       expert ranks below everything, so it is never selected.
    4. ``ids = topk(c, k)`` over kept experts; weights are the unbiased ``s[ids]``; renormalize; then
       ``* routed_scaling_factor`` (applied after renormalization).

    DeepSeek-V3: ``scoring="sigmoid"``, ``bias=e_score_correction_bias``, ``n_group=8``,
    ``topk_group=4``, ``top_k=8``, ``renormalize=True``, ``routed_scaling_factor=2.5``.
    """
    x = _logits(logits)
    m, e = x.shape
    k = _top_k(top_k, e)
    n_group = check_positive_int(n_group, "n_group")
    topk_group = check_positive_int(topk_group, "topk_group")
    if e % n_group:
        raise ValueError(f"num_experts ({e}) must be divisible by n_group; got n_group={n_group}")
    if topk_group > n_group:
        raise ValueError(f"topk_group must be <= n_group ({n_group}); got topk_group={topk_group}")
    group_size = e // n_group
    if k > topk_group * group_size:
        raise ValueError(
            f"top_k={k} exceeds the experts in the kept groups (topk_group*E/n_group = {topk_group * group_size})"
        )
    s = _score(x, scoring)
    c = s if bias is None else s + _bias(bias, e)
    keys = order_keys(c)  # one ranking pass, shared by the group scores and the final selection
    per_group = keys.reshape(m * n_group, group_size)
    if bias is not None:
        if group_size < 2:
            raise ValueError(f"a biased group score sums the top-2 of each group; group size is {group_size}")
        group_score = top_values_from_keys(per_group, 2).sum(axis=1)  # top-2 in the declared order
    else:
        group_score = top_values_from_keys(per_group, 1)[:, 0]
    kept_groups = stable_topk(group_score.reshape(m, n_group), topk_group)
    kept = np.zeros((m, n_group), dtype=bool)
    np.put_along_axis(kept, kept_groups, True, axis=1)
    keys[~np.repeat(kept, group_size, axis=1)] = EXCLUDED_KEY  # dropped groups rank below everything
    ids = topk_from_keys(keys, k)
    w = np.take_along_axis(s, ids, axis=1)
    return _finish(w, ids, renormalize, _scale(routed_scaling_factor), ids_dtype, "grouped_topk")


def llama4_top1(logits, top_k: int = 1, *, ids_dtype=np.int32) -> Routing:
    """Llama 4: ``w, ids = topk(logits, 1)``; ``w = sigmoid(w)``. The weight is meant to be applied
    to the input (``apply_router_weight_on_input``), so ``top_k`` must be 1 (HF
    ``modeling_llama4.py``; vLLM ``baseline_custom_llama4``).

    >>> llama4_top1(np.array([[0.0, 3.0, 3.0]])).ids
    array([[1]], dtype=int32)
    """
    x = _logits(logits)
    if top_k != 1:
        raise ValueError(f"llama4_top1 routes each token to one expert; got top_k={top_k!r}")
    ids = stable_topk(x, 1)
    w = sigmoid(np.take_along_axis(x, ids, axis=1))
    return _finish(w, ids, False, 1.0, ids_dtype, "llama4_top1")


METHODS = {
    "softmax_topk": softmax_topk,
    "sigmoid_topk": sigmoid_topk,
    "topk_softmax": topk_softmax,
    "biased_topk": biased_topk,
    "grouped_topk": grouped_topk,
    "llama4_top1": llama4_top1,
}


def route(
    logits,
    top_k: int,
    method: str,
    *,
    renormalize: bool = False,
    bias=None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    scoring: str = "softmax",
    ids_dtype=np.int32,
) -> Routing:
    """Dispatch to one method by name (the keys of :data:`METHODS`).

    Options a method does not use raise ``ValueError`` instead of being ignored (``bias`` with
    ``softmax_topk``, ``renormalize`` with ``topk_softmax``, ...). ``scoring`` applies to
    ``biased_topk`` and ``grouped_topk``. Library names (vLLM "Renormalize", FlashInfer
    "RenormalizeNaive", ...) map to these through :data:`moeref.routing.LIBRARY_METHOD_NAMES`.

    >>> route(np.array([[1.0, 2.0, 3.0]]), 2, "softmax_topk", renormalize=True).ids
    array([[2, 1]], dtype=int32)
    """
    check_choice(method, tuple(METHODS), "method")
    given = {
        "renormalize": bool(renormalize),
        "bias": bias is not None,
        "n_group": n_group is not None,
        "topk_group": topk_group is not None,
        "routed_scaling_factor": float(routed_scaling_factor) != 1.0,
        "scoring": scoring != "softmax",
    }
    uses = {
        "softmax_topk": {"renormalize"},
        "sigmoid_topk": {"renormalize"},
        "topk_softmax": set(),
        "biased_topk": {"renormalize", "bias", "routed_scaling_factor", "scoring"},
        "grouped_topk": {"renormalize", "bias", "n_group", "topk_group", "routed_scaling_factor", "scoring"},
        "llama4_top1": set(),
    }[method]
    unused = [name for name, on in given.items() if on and name not in uses]
    if unused:
        raise ValueError(f"method {method!r} does not use option(s) {unused}")
    if method in ("softmax_topk", "sigmoid_topk"):
        return METHODS[method](logits, top_k, renormalize=renormalize, ids_dtype=ids_dtype)
    if method in ("topk_softmax", "llama4_top1"):
        return METHODS[method](logits, top_k, ids_dtype=ids_dtype)
    if method == "biased_topk":
        if bias is None:
            raise ValueError("method 'biased_topk' needs bias")
        return biased_topk(
            logits, top_k, bias, scoring=scoring, renormalize=renormalize,
            routed_scaling_factor=routed_scaling_factor, ids_dtype=ids_dtype,
        )
    if n_group is None or topk_group is None:
        raise ValueError("method 'grouped_topk' needs n_group and topk_group")
    return grouped_topk(
        logits, top_k, n_group, topk_group, scoring=scoring, bias=bias, renormalize=renormalize,
        routed_scaling_factor=routed_scaling_factor, ids_dtype=ids_dtype,
    )


def with_padding(routing: Routing, valid_rows) -> Routing:
    """Mark padding tokens: rows where ``valid_rows`` is False get ids ``-1`` and weight 0.0.

    Padding tokens (CUDA-graph / DP padding) must select no expert and contribute nothing
    (vLLM PR #46428, SGLang PR #25852). ``valid_rows``: bool ``[M]``.
    """
    valid = np.asarray(valid_rows)
    if valid.dtype != np.bool_ or valid.shape != (routing.num_tokens,):
        raise ValueError(
            f"valid_rows must be a bool array of shape ({routing.num_tokens},); got {valid.dtype} {valid.shape}"
        )
    ids = np.where(valid[:, None], routing.ids, -1).astype(routing.ids.dtype)
    w = np.where(valid[:, None], routing.weights, 0.0).astype(np.float32)
    return Routing(weights=w, ids=ids, method=routing.method)
