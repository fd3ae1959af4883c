"""What each library's routing-method name means, in moeref's methods.

The same name means different things across libraries (vLLM PR
#43223): vLLM "Renormalize" is softmax -> top-k -> renormalize, which FlashInfer calls
"RenormalizeNaive"; FlashInfer/TRT-LLM "Renormalize" is top-k -> softmax (moeref ``topk_softmax``).
In exact arithmetic these two give the same weights (the full softmax denominator cancels when the
k weights are renormalized) and the same ids (both rank the logits); kernels differ in rounding, and
in selection where fp32 probabilities round to equal values. The names do not collide harmlessly
elsewhere: vLLM "Default" (no renormalization) is FlashInfer "Default", not "Renormalize".

:data:`LIBRARY_METHOD_NAMES` maps ``(library, name)`` to a :class:`LibraryMethod`: the moeref method
and the fixed options it implies. Model parameters (``bias``, ``n_group``, ``topk_group``,
``routed_scaling_factor``) still come from the caller. Not listed: FlashInfer "TopK" (raw logits as
weights, no score function), which has no moeref method.

>>> LIBRARY_METHOD_NAMES[("vllm", "Renormalize")] == LIBRARY_METHOD_NAMES[("flashinfer", "RenormalizeNaive")]
True
>>> LIBRARY_METHOD_NAMES[("flashinfer", "Renormalize")].method
'topk_softmax'
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .methods import Routing, route

__all__ = ["LIBRARY_METHOD_NAMES", "LibraryMethod", "route_as"]


@dataclass(frozen=True)
class LibraryMethod:
    """A library's routing method expressed as a moeref method plus fixed options.

    ``note`` records where the meaning comes from; it does not take part in equality.
    """

    method: str
    options: tuple = ()  # sorted (name, value) pairs, hashable
    note: str = field(default="", compare=False)

    def kwargs(self) -> dict:
        return dict(self.options)


def _m(method: str, note: str, **options) -> LibraryMethod:
    return LibraryMethod(method, tuple(sorted(options.items())), note)


_SOFTMAX_RENORM = "softmax over all experts, top-k, divide by the sum of the k weights"

LIBRARY_METHOD_NAMES: dict[tuple[str, str], LibraryMethod] = {
    # vLLM (router/fused_topk_router.py, grouped_topk_router.py; RoutingMethodType)
    ("vllm", "Default"): _m("softmax_topk", "fused_topk(renormalize=False)", renormalize=False),
    ("vllm", "Renormalize"): _m("softmax_topk", "fused_topk(renormalize=True): " + _SOFTMAX_RENORM, renormalize=True),
    ("vllm", "RenormalizeNaive"): _m("softmax_topk", "same as vLLM Renormalize (PR #43223)", renormalize=True),
    ("vllm", "DeepSeekV3"): _m(
        "grouped_topk", "grouped_topk(scoring_func='sigmoid', e_score_correction_bias, renormalize=True)",
        scoring="sigmoid", renormalize=True,
    ),
    ("vllm", "Llama4"): _m("llama4_top1", "top-1 on logits, sigmoid weight, applied on the input"),
    ("vllm", "fused_topk_bias"): _m("biased_topk", "select on score + bias, unbiased weights"),
    ("vllm", "grouped_topk"): _m("grouped_topk", "scoring_func='softmax' by default"),
    ("vllm", "topk_sigmoid"): _m("sigmoid_topk", "fused_topk(scoring_func='sigmoid')"),
    # FlashInfer / TRT-LLM-gen (tests/moe/trtllm_gen_fused_moe_utils.py, fb28d72)
    ("flashinfer", "Default"): _m("softmax_topk", "softmax -> top-k, no renormalization", renormalize=False),
    ("flashinfer", "Renormalize"): _m("topk_softmax", "top-k on logits -> softmax over the k"),
    ("flashinfer", "RenormalizeNaive"): _m("softmax_topk", _SOFTMAX_RENORM, renormalize=True),
    ("flashinfer", "DeepSeekV3"): _m("grouped_topk", "noaux_tc_ref", scoring="sigmoid", renormalize=True),
    ("flashinfer", "Llama4"): _m("llama4_top1", "top-1, sigmoid"),
    ("flashinfer", "Sigmoid"): _m("sigmoid_topk", "sigmoid -> top-k", renormalize=False),
    ("flashinfer", "SigmoidRenorm"): _m("sigmoid_topk", "sigmoid -> top-k -> renormalize", renormalize=True),
    ("flashinfer", "TopKSigmoid"): _m(
        "sigmoid_topk", "top-k on logits -> sigmoid: equal to Sigmoid in exact arithmetic; in fp32 they "
        "differ only where sigmoid saturates to 1.0", renormalize=False,
    ),
    ("flashinfer", "MiniMax2"): _m(
        "biased_topk", "sigmoid + bias selection, unbiased weights, sum-normalized, scaled",
        scoring="sigmoid", renormalize=True,
    ),
    # triton_kernels routing_torch / gpt-oss
    ("triton_kernels", "sm_first=False"): _m("topk_softmax", "routing(sm_first=False), gpt-oss"),
    ("triton_kernels", "sm_first=True"): _m("softmax_topk", "routing(sm_first=True)", renormalize=False),
    ("gpt-oss", "router"): _m("topk_softmax", "vLLM oai_moe_forward"),
    # SGLang
    ("sglang", "torch_naive_moe"): _m("softmax_topk", "test/srt/test_fused_moe.py", renormalize=False),
    ("sglang", "biased_grouped_topk"): _m("grouped_topk", "moe_fused_gate reference", scoring="sigmoid"),
}


def route_as(library: str, name: str, logits, top_k: int, **model_params) -> Routing:
    """Route with a library's method name: ``route(logits, top_k, method, **options, **model_params)``.

    ``model_params`` may not override a fixed option of the name (``ValueError``).
    """
    key = (library, name)
    if key not in LIBRARY_METHOD_NAMES:
        known = ", ".join(f"{lib}:{n}" for lib, n in LIBRARY_METHOD_NAMES)
        raise ValueError(f"unknown library routing method {library}:{name}; known: {known}")
    spec = LIBRARY_METHOD_NAMES[key]
    fixed = spec.kwargs()
    clash = sorted(set(fixed) & set(model_params))
    if clash:
        raise ValueError(f"{library}:{name} fixes {clash}; do not pass them")
    return route(logits, top_k, spec.method, **fixed, **model_params)

