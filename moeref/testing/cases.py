"""Drawn MoE layer calls for kernel tests: a Hypothesis strategy (:func:`moe_cases`, shrinking included)
and deterministic draws from it for plain pytest parametrization (:func:`draw_cases`, what the pytest
plugin's ``moe_case`` fixture uses).

Each case is a :class:`~moeref.testing.inputs.KernelInputs` (already rounded to the kernel's dtype) whose
``meta`` says how it was drawn. Data: :func:`moeref.moe.make_layer` / :func:`~moeref.moe.make_tokens`
(GEMM1 outputs in the activations' nonlinear range, a per-token signature so routing faults show on
their own row), routing from :func:`moeref.strategies.routings` (uniform, hot expert, all to one,
Zipf, empty experts, tied/negative/skewed logits), token counts that straddle multiples of 8 and 16.
"""
from __future__ import annotations

__all__ = ["moe_cases", "draw_cases", "CASE_KINDS"]

CASE_KINDS = ("uniform", "hot1", "all_to_one", "zipf", "empty_experts", "tied_logits", "negative_logits",
              "skewed_logits")
"""Routing kinds drawn by default (no NaN router logits: the layer's inputs stay finite)."""


def moe_cases(*, max_tokens: int = 24, hidden=(64, 128, 256), intermediate=(32, 64, 128), max_experts: int = 8,
              max_top_k: int = 4, dtype: str = "bfloat16", kinds=CASE_KINDS, allow_padding: bool = False):
    """Strategy of :class:`~moeref.testing.inputs.KernelInputs`: sizes drawn from the given choices (K from
    ``hidden``, N from ``intermediate``, E up to ``max_experts``, top-k up to ``max_top_k``, 1 to
    ``max_tokens`` tokens), a seed for the weights/tokens, and a routing of the given ``kinds``;
    ``allow_padding`` adds tokens whose every slot is -1."""
    from hypothesis import strategies as st

    from ..moe import make_layer, make_tokens
    from ..strategies import routings
    from .inputs import kernel_inputs

    @st.composite
    def build(draw):
        k = draw(st.sampled_from(tuple(hidden)))
        n = draw(st.sampled_from(tuple(intermediate)))
        r = draw(routings(max_tokens=max_tokens, max_experts=max_experts, max_top_k=max_top_k, kinds=tuple(kinds),
                          allow_padding=allow_padding))
        seed = draw(st.integers(0, 2**16))
        lw = make_layer(r.num_experts, k, n, seed=seed)
        x = make_tokens(r.num_tokens, k, seed=seed + 1)
        ki = kernel_inputs(x, lw, r.weights, r.ids, dtype=dtype)
        meta = dict(num_tokens=r.num_tokens, hidden=k, intermediate=n, num_experts=r.num_experts, top_k=r.top_k,
                    routing=r.kind, seed=seed, dtype=dtype)
        return ki.with_(meta=meta)

    return build()


def draw_cases(n: int, strategy=None, *, seed: int = 0) -> list:
    """``n`` cases drawn deterministically (Hypothesis ``derandomize``; ``seed`` varies the draw) from
    ``strategy`` (default :func:`moe_cases`), for parametrizing tests without ``@given``.

    Deterministic for a given set of imported modules: Hypothesis (>= 6.131) mixes constants found in the
    project's imported modules into about 5% of its draws, so a process that imported other modules can
    draw other cases (every pytest-xdist worker collects alike, so they agree). A failing case is kept by
    its reproducer (:mod:`moeref.testing.reproducer`), not by redrawing it."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    strategy = moe_cases() if strategy is None else strategy
    out: list = []

    @settings(max_examples=max(int(n), 1) + int(seed), derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(strategy, st.just(None))
    def collect(case, _):
        out.append(case)

    collect()
    return out[int(seed):int(seed) + int(n)] if len(out) > seed else out[:n]
