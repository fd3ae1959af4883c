"""Drawn MoE layer calls for kernel tests: a Hypothesis strategy (:func:`moe_cases`, shrinking included)
and a deterministic spread of cases for plain pytest parametrization (:func:`draw_cases`, what the pytest
plugin's ``moe_case`` fixture and ``moeref mutate`` use).

Each case is a :class:`~moeref.testing.inputs.KernelInputs` (already rounded to the kernel's dtype) whose
``meta`` says how it was made (sizes, routing kind, seed). Data: :func:`moeref.moe.make_layer` /
:func:`~moeref.moe.make_tokens` (GEMM1 outputs in the activations' nonlinear range, a per-token signature
so routing faults show on their own row). The routing is made from the case's seed with NumPy (one draw,
whatever the token count, so a case of thousands of tokens costs no more to draw than one of three) in
one of the kinds of :mod:`moeref.strategies.routing` (:data:`CASE_KINDS`): uniform, one hot expert, all to
one, Zipf, empty experts (ids), tied, negative and skewed router logits (routed by
:func:`moeref.routing.softmax_topk`, renormalized); ``repeated_experts`` on request.

Token counts: a kernel that processes rows in tiles (16, 64, 128 rows of one expert) is only tested by
counts that give an expert several tiles and a partial last one. :func:`draw_cases` spreads its counts
on a log scale from 1 to ``max_tokens`` (distinct where there are enough, off multiples of 16), and pairs
them with every expert count, top-k, routing kind and size in turn; :func:`moe_cases` draws counts up to
``max_tokens``, with the counts next to multiples of 16 and 128 drawn often.
"""
from __future__ import annotations

import numpy as np

__all__ = ["moe_cases", "draw_cases", "exact_case", "single_rounding_case", "CASE_KINDS", "DEFAULT_MAX_TOKENS"]

CASE_KINDS = ("uniform", "hot1", "all_to_one", "zipf", "empty_experts", "tied_logits", "negative_logits",
              "skewed_logits")
"""Routing kinds drawn by default (no NaN router logits: the layer's inputs stay finite)."""

_OPT_IN_KINDS = ("repeated_experts",)  # a token may pick one expert twice (moeref.routing.ids)

DEFAULT_MAX_TOKENS = 256
"""Default largest token count: 256 tokens at top-2 over 8 experts give an expert 64 rows (four 16-row
tiles) on average and a hot expert 256. A fast kernel with a device-side reference can take thousands
(``max_tokens=4096``); the NumPy reference and bound cost about linearly in the rows."""

_TILE = 16


def _routing(kind: str, num_tokens: int, num_experts: int, top_k: int, rng, allow_padding: bool):
    """``(topk_weights float32 [M, k], topk_ids int32 [M, k])`` of ``kind`` (module docstring), from ``rng``.

    Id kinds: ``k`` distinct experts per token chosen as the ``k`` smallest of per-expert random keys
    (uniform; ``hot1``: one expert's key below all others; ``all_to_one``: one key row for every token;
    ``zipf``: Gumbel top-k sampling with probabilities ``1 / rank^1.2``; ``empty_experts``: keys only on a
    random subset of at least ``k`` experts), weights on the 1/64 grid in ``[1/64, 1]``. Logit kinds: logits
    on the grids of :func:`moeref.strategies.router_logits` (multiples of 1/8; ``tied_logits`` from
    ``{0, 1, 2}``), routed by :func:`moeref.routing.softmax_topk` with ``renormalize=True``."""
    from ..routing import softmax_topk

    m, e, k = num_tokens, num_experts, top_k
    if kind in ("tied_logits", "negative_logits", "skewed_logits"):
        if kind == "tied_logits":
            logits = rng.choice(np.array([0.0, 1.0, 2.0]), size=(m, e))
        elif kind == "negative_logits":
            logits = rng.integers(-160, 0, size=(m, e)) / 8.0
        else:
            logits = rng.integers(-64, 65, size=(m, e)) / 8.0 + np.linspace(8.0, -8.0, e)[None, :]
        r = softmax_topk(logits.astype(np.float32), k, renormalize=True)
        weights, ids = r.weights.astype(np.float32), r.ids.astype(np.int32)
    else:
        if kind == "repeated_experts":
            ids = rng.integers(0, e, size=(m, k))
            if m and k >= 2:
                ids[0, -1] = ids[0, 0]
        else:
            keys = rng.random((m, e))
            if kind == "hot1":
                keys[:, rng.integers(e)] = -1.0
            elif kind == "all_to_one":
                keys[:] = keys[:1]
            elif kind == "zipf":
                p = 1.0 / np.arange(1, e + 1) ** 1.2
                keys = -(np.log(p)[None, :] - np.log(-np.log(keys)))
            elif kind == "empty_experts":
                pool = rng.choice(e, size=int(rng.integers(k, e + 1)), replace=False)
                keys[:, np.setdiff1d(np.arange(e), pool)] = np.inf
            ids = np.argsort(keys, axis=1, kind="stable")[:, :k]
        ids = ids.astype(np.int32)
        weights = (rng.integers(1, 65, size=(m, k)) / 64.0).astype(np.float32)
    if allow_padding and m:
        pad = rng.random(m) < 0.25
        ids[pad], weights[pad] = -1, 0.0
    return weights, ids


def _case(num_tokens, hidden, intermediate, num_experts, top_k, kind, seed, dtype, allow_padding):
    """One :class:`~moeref.testing.KernelInputs` from its sizes, routing kind and seed (deterministic)."""
    from ..moe import make_layer, make_tokens
    from .inputs import kernel_inputs

    w, ids = _routing(kind, num_tokens, num_experts, top_k, np.random.default_rng(seed), allow_padding)
    lw = make_layer(num_experts, hidden, intermediate, seed=seed)
    ki = kernel_inputs(make_tokens(num_tokens, hidden, seed=seed + 1), lw, w, ids, dtype=dtype)
    meta = dict(num_tokens=int(num_tokens), hidden=int(hidden), intermediate=int(intermediate),
                num_experts=int(num_experts), top_k=int(top_k), routing=kind, seed=int(seed), dtype=dtype)
    return ki.with_(meta=meta)


def exact_case(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, kind: str, seed: int,
               *, dtype: str = "bfloat16", allow_padding: bool = False):
    """A :class:`~moeref.testing.KernelInputs` in the exact regime: the layer of
    :func:`moeref.regimes.exact_layer` (bf16 tokens and weights, SiLU-and-mul; every product and partial sum
    exact in FP32, every stored value exact in bf16), routed by the ids of routing ``kind``
    (:data:`CASE_KINDS`) with top-k weights ``2^-e`` (:func:`moeref.regimes.exact_topk_weights`).
    ``meta`` records the sizes, kind, seed and ``regime="exact"``. Only ``dtype="bfloat16"`` is built.

    >>> ki = exact_case(5, 64, 32, 4, 2, "uniform", 0)
    >>> ki.meta["regime"], ki.hidden.dtype.name, ki.reference().out.shape
    ('exact', 'bfloat16', (5, 64))
    """
    from ..regimes import exact_layer, exact_topk_weights
    from .inputs import kernel_inputs

    if dtype != "bfloat16":
        raise ValueError(f"exact_case builds bf16 layers (moeref.regimes.exact_layer, scheme 'bf16'); got dtype "
                         f"{dtype!r}: use moeref.regimes.exact_layer for other schemes")
    rng = np.random.default_rng([seed, 7])
    _, ids = _routing(kind, num_tokens, num_experts, top_k, rng, allow_padding)
    lay = exact_layer(num_tokens, hidden, intermediate, num_experts, top_k, scheme="bf16", seed=rng, topk_ids=ids,
                      topk_weights=exact_topk_weights(ids.shape, seed=rng))
    ki = kernel_inputs(lay.hidden, lay.weights, lay.topk_weights, lay.topk_ids, dtype=dtype)
    meta = dict(num_tokens=int(num_tokens), hidden=int(hidden), intermediate=int(intermediate),
                num_experts=int(num_experts), top_k=int(top_k), routing=kind, seed=int(seed), dtype=dtype,
                regime="exact")
    return ki.with_(meta=meta)


def single_rounding_case(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, kind: str,
                         seed: int, *, dtype: str = "bfloat16", allow_padding: bool = False,
                         profile="BF16_OUTPUT"):
    """A :class:`~moeref.testing.KernelInputs` in the single-rounding regime: the layer of
    :func:`moeref.regimes.single_rounding_layer` (bf16 tokens and weights, SiLU-and-mul; every partial sum exact
    in FP32, and every store ``profile`` declares, GEMM2's bf16 store included, rounding an exact value once),
    routed like :func:`exact_case`. ``meta`` records the sizes, kind, seed, ``regime="single_rounding"`` and
    ``stores``: the declared stores (``gemm1_out_dtype``, ``act_out_dtype``, ``gemm2_out_dtype``) that the
    reference replays (:func:`moeref.testing.regime.check_case`). ``ValueError`` when ``profile`` admits no
    single-rounding layer (:func:`moeref.regimes.single_rounding_stores` says why); only ``dtype="bfloat16"``.

    >>> ki = single_rounding_case(5, 64, 32, 4, 2, "uniform", 0)
    >>> ki.meta["regime"], ki.meta["stores"]["gemm2_out_dtype"], ki.hidden.dtype.name
    ('single_rounding', 'bfloat16', 'bfloat16')
    """
    from ..regimes import exact_topk_weights, single_rounding_layer, single_rounding_stores
    from .inputs import kernel_inputs

    if dtype != "bfloat16":
        raise ValueError(f"single_rounding_case builds bf16 layers (moeref.regimes.single_rounding_layer, scheme "
                         f"'bf16'); got dtype {dtype!r}: use moeref.regimes.single_rounding_layer for other schemes")
    opts, why = single_rounding_stores(profile, "bf16")
    if opts is None:
        raise ValueError(why)
    rng = np.random.default_rng([seed, 11])
    _, ids = _routing(kind, num_tokens, num_experts, top_k, rng, allow_padding)
    lay = single_rounding_layer(num_tokens, hidden, intermediate, num_experts, top_k, scheme="bf16", seed=rng,
                                topk_ids=ids, topk_weights=exact_topk_weights(ids.shape, seed=rng), **opts)
    ki = kernel_inputs(lay.hidden, lay.weights, lay.topk_weights, lay.topk_ids, dtype=dtype)
    cfg = lay.config
    stores = {k: getattr(cfg, k) for k in ("gemm1_out_dtype", "act_out_dtype", "gemm2_out_dtype")}
    meta = dict(num_tokens=int(num_tokens), hidden=int(hidden), intermediate=int(intermediate),
                num_experts=int(num_experts), top_k=int(top_k), routing=kind, seed=int(seed), dtype=dtype,
                regime="single_rounding", stores=stores)
    return ki.with_(meta=meta)


def _check_kinds(kinds) -> tuple:
    from .._checks import check_choice

    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    if not kinds:
        raise ValueError(f"give at least one routing kind; accepted: {', '.join(CASE_KINDS + _OPT_IN_KINDS)}")
    for k in kinds:
        check_choice(k, CASE_KINDS + _OPT_IN_KINDS, "routing kind")
    return kinds


def _check_sizes(max_tokens, max_experts, max_top_k):
    from .._checks import check_positive_int

    return (check_positive_int(max_tokens, "max_tokens"), check_positive_int(max_experts, "max_experts"),
            check_positive_int(max_top_k, "max_top_k"))


def moe_cases(*, max_tokens: int = DEFAULT_MAX_TOKENS, hidden=(64, 128, 256), intermediate=(32, 64, 128),
              max_experts: int = 8, max_top_k: int = 4, dtype: str = "bfloat16", kinds=CASE_KINDS,
              allow_padding: bool = False):
    """Strategy of :class:`~moeref.testing.inputs.KernelInputs`: K from ``hidden``, N from ``intermediate``,
    E in ``1..max_experts``, top-k in ``1..min(max_top_k, E)``, 1 to ``max_tokens`` tokens (often one next to
    a multiple of 16 or 128: a partial last tile), a routing kind of ``kinds`` (:data:`CASE_KINDS`, or
    ``"repeated_experts"``) and a seed for the weights, tokens and routing; ``allow_padding`` makes about a
    quarter of the tokens padding (every slot -1). Shrinks toward one token, one expert, top-1, the first
    kind, seed 0."""
    from hypothesis import strategies as st

    max_tokens, max_experts, max_top_k = _check_sizes(max_tokens, max_experts, max_top_k)
    kinds = _check_kinds(kinds)
    near_tiles = sorted({c for t in range(_TILE, max_tokens + 2, _TILE) for c in (t - 1, t + 1)
                         if 1 <= c <= max_tokens and (t % 128 == 0 or t <= 4 * _TILE)})
    tokens = st.integers(1, max_tokens) if not near_tiles else st.one_of(st.integers(1, max_tokens),
                                                                          st.sampled_from(near_tiles))

    @st.composite
    def build(draw):
        k_hidden = draw(st.sampled_from(tuple(hidden)))
        n = draw(st.sampled_from(tuple(intermediate)))
        e = draw(st.integers(1, max_experts))
        top_k = draw(st.integers(1, min(max_top_k, e)))
        m = draw(tokens)
        kind = draw(st.sampled_from(kinds))
        seed = draw(st.integers(0, 2**16))
        return _case(m, k_hidden, n, e, top_k, kind, seed, dtype, allow_padding)

    return build()


def _token_counts(n: int, max_tokens: int, rng) -> np.ndarray:
    """``n`` counts in ``[1, max_tokens]``, one per stratum ``q`` of ``[0, 1)``, ``(max_tokens + 1) ** sqrt(q)``
    (a log scale leaning to the large end: small, middling and large counts all appear, half of them above
    ``max_tokens ** 0.7``), moved off multiples of 16 above 16, then made distinct where ``max_tokens``
    allows, in ascending order."""
    q = (np.arange(n) + rng.random(n)) / n
    counts = np.floor((max_tokens + 1.0) ** np.sqrt(q)).astype(np.int64)
    counts = np.where((counts > _TILE) & (counts % _TILE == 0), counts - 1, counts)
    counts = np.clip(np.sort(counts), 1, max_tokens)
    for i in range(1, n):  # distinct where possible: push duplicates up, then down from the top
        counts[i] = max(counts[i], counts[i - 1] + 1)
    for i in range(n - 1, -1, -1):
        counts[i] = min(counts[i], max_tokens if i == n - 1 else counts[i + 1] - 1)
    return np.clip(counts, 1, max_tokens)


def _spread(values, n: int, rng) -> list:
    """``n`` items cycling through ``values`` in a shuffled order (each value as often as ``n`` allows)."""
    values = list(values)
    reps = -(-n // len(values))
    return [values[j] for r in range(reps) for j in rng.permutation(len(values))][:n]


def draw_cases(n: int, strategy=None, *, seed: int = 0, max_tokens: int = DEFAULT_MAX_TOKENS,
               max_experts: int = 8, max_top_k: int = 4, hidden=(64, 128, 256), intermediate=(32, 64, 128),
               dtype: str = "bfloat16", kinds=CASE_KINDS, allow_padding: bool = False, mix=None,
               profile=None) -> list:
    """``n`` layer calls, deterministic for a given ``seed``, spread over the sizes a kernel must get right.

    By default (no ``strategy``): token counts spread over ``[1, max_tokens]`` on a log scale leaning to the
    large end (:func:`_token_counts`: distinct, off multiples of 16), each paired with an expert count of
    ``2, 3, 4, 6, 8, 12, 16...`` up to ``max_experts`` (1 only when ``max_experts`` is 1), a top-k of
    ``1..min(max_top_k, E)``, a routing kind of ``kinds``, a K of ``hidden`` and an N of ``intermediate``,
    each cycled in a shuffled order so every value appears as often as ``n`` allows; the cases come in
    ascending token count. Raise ``max_tokens`` (e.g. 4096) where the kernel and the reference are fast:
    the tiles a bug lives in need rows.

    ``mix``: a :class:`moeref.testing.regime.CheckMix` or a regime name (``"mixed"``, ``"exact"``,
    ``"bounds"``; None, the default here, is ``"bounds"``: every case general). The cases :meth:`CheckMix.kinds`
    marks ``"exact"`` are built in the exact regime instead, with the same sizes, routing kind and seed
    (:func:`exact_case`; ``meta["regime"] == "exact"``), those it marks ``"single_rounding"`` in the
    single-rounding regime with the stores ``profile`` declares (:func:`single_rounding_case`; ``profile``: the
    profile the cases will be checked under, a Profile or its name, default the package's for ``dtype``,
    :func:`moeref.compare.suggest_profile`). Where the profile admits no single-rounding layer those cases are
    exact-regime cases with ``meta["single_rounding"]`` saying why. The pytest plugin draws ``"mixed"`` by
    default. Not with a ``strategy``.

    With a Hypothesis ``strategy`` (e.g. :func:`moe_cases` with other choices): ``n`` distinct examples drawn
    with ``derandomize`` (``seed`` skips the first ``seed``); Hypothesis (>= 6.131) mixes constants found in
    the imported modules into some draws, so another set of imported modules can draw other cases. A failing
    case is kept by its reproducer (:mod:`moeref.testing.reproducer`), not by redrawing it.
    """
    from .._checks import check_positive_int

    n = check_positive_int(n, "n")
    seed = check_positive_int(seed, "seed", allow_zero=True)
    kinds_of = None
    if mix is not None:
        from .regime import CheckMix

        kinds_of = CheckMix.of(mix).kinds(n)
    if strategy is not None:
        if kinds_of is not None and "exact" in kinds_of:
            raise ValueError("draw_cases: a Hypothesis strategy draws its own cases; give mix only without a "
                             "strategy (exact-regime strategies: moeref.regimes.strategies)")
        return _hypothesis_draws(n, strategy, seed)
    max_tokens, max_experts, max_top_k = _check_sizes(max_tokens, max_experts, max_top_k)
    kinds = _check_kinds(kinds)
    rng = np.random.default_rng([seed, 32])
    counts = _token_counts(n, max_tokens, rng)
    ladder = [e for e in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if e < max_experts]
    experts = _spread(ladder + [max_experts], n, rng)
    ks = _spread(range(1, max_top_k + 1), n, rng)
    refused = ""
    if kinds_of is not None and "single_rounding" in kinds_of:
        from ..compare.kernel_profiles import get_profile, suggest_profile
        from ..regimes import single_rounding_stores

        profile = suggest_profile(dtype) if profile is None else get_profile(profile)
        refused = single_rounding_stores(profile, "bf16")[1]
    out = []
    for i, (m, e, k, kind, kh, nn, s) in enumerate(zip(counts, experts, ks, _spread(kinds, n, rng),
                                                       _spread(hidden, n, rng), _spread(intermediate, n, rng),
                                                       rng.integers(0, 2**16, size=n))):
        if kinds_of is not None and kinds_of[i] == "single_rounding" and not refused:
            out.append(single_rounding_case(int(m), kh, nn, e, min(k, e), kind, int(s), dtype=dtype,
                                            allow_padding=allow_padding, profile=profile))
        elif kinds_of is not None and kinds_of[i] in ("exact", "single_rounding"):
            c = exact_case(int(m), kh, nn, e, min(k, e), kind, int(s), dtype=dtype, allow_padding=allow_padding)
            out.append(c.with_(meta={**c.meta, "single_rounding": refused}) if kinds_of[i] != "exact" else c)
        else:
            out.append(_case(int(m), kh, nn, e, min(k, e), kind, int(s), dtype, allow_padding))
    return out


def _hypothesis_draws(n: int, strategy, seed: int) -> list:
    """``n`` distinct (by ``repr``, which names the sizes and how the case was made) examples of ``strategy``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    out: list = []
    seen: set = set()

    @settings(max_examples=4 * (n + seed) + 16, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(strategy, st.just(None))
    def collect(case, _):
        key = repr(case)
        if key not in seen:
            seen.add(key)
            out.append(case)

    collect()
    return out[seed:seed + n] if len(out) >= seed + n else out[-n:]
