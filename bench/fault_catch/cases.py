"""The planted-fault study's cases (``bench/bench_fault_catch.py`` describes the study): the layers and shapes,
one exact-regime and one general case per layer, the reference run, and the input and output faults (each
changes what the kernel is given or what it returns, so it wraps any honest kernel)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

SHAPES = {
    "small": dict(hidden=256, intermediate=256, experts=8, top_k=4, tokens=40, chunk=16, ranks=2),
    "deepseek-v3": dict(hidden=7168, intermediate=2048, experts=256, top_k=8, tokens=128, chunk=32, ranks=8),
}
LAYERS = {
    "fp8": dict(scheme="fp8_1x128", activation="silu_and_mul", declared="DEEPGEMM_FP8", emulated=True),
    "fp8_ue8m0": dict(scheme="fp8_1x128_ue8m0", activation="silu_and_mul", declared="DEEPGEMM_FP8", emulated=False),
    "bf16_gelu": dict(scheme="bf16", activation="gelu_and_mul", declared="BF16_OUTPUT", emulated=False),
}
POOL = 8
STAGGER = 9
"""Binades between the maxima of neighbouring intermediate groups in the exact FP8 cases (:func:`boundary_groups`):
more than E4M3's normal range below 448 spans down to its subnormals (2^-6 .. 2^-9), so a scale taken over the
whole token instead of the group rounds the small group's values to other (subnormal) codes."""


# ------------------------------------------------------------------------------------------------ the cases


@dataclass(frozen=True, eq=False)
class Case:
    """One layer call as every implementation here is given it: ``hidden`` float32 ``[M, K]`` (bf16 values),
    ``weights`` a :class:`moeref.moe.MoEWeights` (FP8 :class:`moeref.quant.QuantizedTensor` or bf16 arrays per
    expert; experts share the objects of a pool), routing, and the reference's options."""

    layer: str
    kind: str  # "exact" or "general"
    hidden: np.ndarray
    weights: object
    topk_weights: np.ndarray
    topk_ids: np.ndarray
    options: dict
    fp8: bool
    ue8m0: bool
    activation: str
    meta: dict = field(default_factory=dict)

    def with_(self, **changes) -> "Case":
        return replace(self, **changes)

    def expert_rows(self) -> np.ndarray:
        ids = self.topk_ids[self.topk_ids >= 0]
        return np.bincount(ids, minlength=len(self.weights.w13))


def _zipf_ids(rng, tokens: int, experts: int, k: int) -> np.ndarray:
    p = 1.0 / np.arange(1, experts + 1) ** 1.2
    gumbel = np.log(p)[None, :] - np.log(-np.log(rng.random((tokens, experts))))
    return np.argsort(-gumbel, axis=1, kind="stable")[:, :k].astype(np.int32)


def exact_case(layer: str, shape: dict, seed: int) -> Case:
    from moeref.regimes import exact_layer, exact_topk_weights

    spec = LAYERS[layer]
    rng = np.random.default_rng([seed, 1])
    ids = _zipf_ids(rng, shape["tokens"], shape["experts"], shape["top_k"])
    tw = exact_topk_weights(ids.shape, seed=rng)
    tw[0, :2] = [1.0, 0.25]  # token 0's first two weights differ (the swapped-weights fault shows)
    lay = exact_layer(shape["tokens"], shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"],
                      scheme=spec["scheme"], activation=spec["activation"], seed=rng, topk_ids=ids,
                      topk_weights=tw, expert_pool=min(POOL, shape["experts"]))
    case = Case(layer, "exact", lay.hidden, lay.weights, lay.topk_weights, lay.topk_ids, lay.options,
                spec["scheme"].startswith("fp8"), spec["scheme"].endswith("ue8m0"), spec["activation"],
                meta={"exact_layer": lay})
    return boundary_groups(case) if case.fp8 else case


def boundary_groups(case: Case) -> Case:
    """The exact layer with its quantization groups' maxima moved to the groups' edges and their scales staggered,
    still in the regime (``layer_in_exact_regime`` says so; the test checks it): in every odd 128-column group of the tokens and of the intermediate the
    columns are reversed (the group's maximum, :func:`moeref.regimes.exact_layer`'s anchor, moves from its first to
    its last column: tokens with w13's columns, intermediate columns with w13's gate and up rows and w2's columns,
    inside their 128-blocks, so no block scale changes and every sum has the same terms); and the up rows of every
    odd intermediate group get half their block scale (the group's values, its maximum and its FP8 scale halve;
    its codes stay: E4M3 is floating point; the GEMM2 outputs it feeds halve, exactly). Group-boundary bugs (a
    maximum that misses a group's last column) and group-scale bugs (a neighbouring group's scale) then change the
    output, which :func:`moeref.regimes.exact_layer`'s equal groups hide."""
    from moeref.regimes import ExactLayer

    k = case.hidden.shape[1]
    n = case.weights.w2[0].shape[1]

    def perm(size):
        p = np.arange(size)
        for g in range(1, size // 128, 2):
            p[128 * g:128 * (g + 1)] = p[128 * g:128 * (g + 1)][::-1]
        return p

    pk, pn = perm(k), perm(n)
    rows13 = np.concatenate([pn, n + pn])
    odd_up = np.arange(n // 128, 2 * n // 128)[1::2]  # scale rows of the up half's odd 128-row blocks
    memo: dict = {}

    def w13(q):
        if id(q) not in memo:
            scales = np.array(q.scales)
            if scales.dtype == np.uint8:
                scales[odd_up] -= STAGGER
            else:
                scales[odd_up] *= np.float32(2.0**-STAGGER)
            memo[id(q)] = _edit_fp8(q, codes=np.asarray(q.codes)[rows13][:, pk], scales=scales)
        return memo[id(q)]

    def w2(q):
        if id(q) not in memo:
            memo[id(q)] = _edit_fp8(q, codes=np.asarray(q.codes)[:, pn])
        return memo[id(q)]

    weights = replace(case.weights, w13=[w13(q) for q in case.weights.w13], w2=[w2(q) for q in case.weights.w2])
    hidden = np.ascontiguousarray(case.hidden[:, pk])
    lay = case.meta["exact_layer"]
    lay = ExactLayer(hidden, weights, lay.topk_weights, lay.topk_ids, lay.config, lay.scheme, lay.token_exponents)
    return case.with_(hidden=hidden, weights=weights, meta={"exact_layer": lay})


def single_rounding_case(layer: str, shape: dict, seed: int) -> tuple:
    """``(case, note)``: the layer as :func:`moeref.regimes.single_rounding_layer` with the stores its declared
    profile admits (:func:`moeref.regimes.single_rounding_stores`: a bf16 GEMM2 store for ``DEEPGEMM_FP8`` and
    ``BF16_OUTPUT``), routed and weighted as :func:`exact_case`; ``(None, why not)`` where the profile admits none."""
    from moeref.regimes import exact_topk_weights, single_rounding_layer, single_rounding_stores

    spec = LAYERS[layer]
    opts, why = single_rounding_stores(spec["declared"], spec["scheme"])
    if opts is None:
        return None, why
    rng = np.random.default_rng([seed, 3])
    ids = _zipf_ids(rng, shape["tokens"], shape["experts"], shape["top_k"])
    tw = exact_topk_weights(ids.shape, seed=rng)
    tw[0, :2] = [1.0, 0.25]
    lay = single_rounding_layer(shape["tokens"], shape["hidden"], shape["intermediate"], shape["experts"],
                                shape["top_k"], scheme=spec["scheme"], activation=spec["activation"], seed=rng,
                                topk_ids=ids, topk_weights=tw, expert_pool=min(POOL, shape["experts"]), **opts)
    case = Case(layer, "single_rounding", lay.hidden, lay.weights, lay.topk_weights, lay.topk_ids, lay.options,
                spec["scheme"].startswith("fp8"), spec["scheme"].endswith("ue8m0"), spec["activation"],
                meta={"exact_layer": lay})
    return case, f"single_rounding_layer({', '.join(f'{k}={v!r}' for k, v in opts.items())})"


def general_case(layer: str, shape: dict, seed: int) -> Case:
    """Random weights (a pool of 8 experts), N(0, 1) bf16 tokens, softmax top-k weights (not renormalised)."""
    import ml_dtypes

    from moeref.moe import MoEQuant, MoEWeights
    from moeref.quant import QuantizedTensor, fp8_block, fp8_group
    from moeref.routing import softmax_topk

    spec = LAYERS[layer]
    rng = np.random.default_rng([seed, 2])
    m, k, n, e, top = shape["tokens"], shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
    bf16 = ml_dtypes.bfloat16
    hidden = rng.standard_normal((m, k), dtype=np.float32).astype(bf16).astype(np.float32)
    fp8 = spec["scheme"].startswith("fp8")
    ue8m0 = spec["scheme"].endswith("ue8m0")
    sf = "ue8m0" if ue8m0 else "fp32"

    def fp8_weight(rows, cols, target_std):
        # E4M3 codes of values in [2^-3, 2^3) with random signs, block scales near target_std / 2
        exp = rng.integers(4, 10, size=(rows, cols), dtype=np.uint8)
        codes = (rng.integers(0, 2, size=(rows, cols), dtype=np.uint8) << 7) | (exp << 3) | rng.integers(
            0, 8, size=(rows, cols), dtype=np.uint8)
        grid = (-(-rows // 128), -(-cols // 128))
        base = target_std / 2.0 * (1.0 + rng.random(grid))
        if ue8m0:
            scales = (np.round(np.log2(base)).astype(np.int64) + 127).astype(np.uint8)
        else:
            scales = base.astype(np.float32)
        return QuantizedTensor(codes, scales, fp8_block((128, 128), sf), (rows, cols))

    def bf16_weight(rows, cols, std):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(bf16)

    pool13, pool2 = [], []
    for _ in range(min(POOL, e)):
        if fp8:
            pool13.append(fp8_weight(2 * n, k, 2.5 / np.sqrt(k)))
            pool2.append(fp8_weight(k, n, 1.0 / np.sqrt(n)))
        else:
            pool13.append(bf16_weight(2 * n, k, 2.5 / np.sqrt(k)))
            pool2.append(bf16_weight(k, n, 1.0 / np.sqrt(n)))
    p = len(pool13)
    weights = MoEWeights([pool13[i % p] for i in range(e)], [pool2[i % p] for i in range(e)], "gate_up")
    logits = rng.standard_normal((m, e)) + np.log(1.0 / np.arange(1, e + 1) ** 1.2)[None, :]
    r = softmax_topk(logits.astype(np.float32), top, renormalize=False)
    opts = dict(activation=spec["activation"], out_dtype="bfloat16")
    if fp8:
        scheme = fp8_group(128, sf, preset="deepgemm")
        opts["quant"] = MoEQuant(scheme, scheme, name=f"fp8 1x128 x 128x128 ({sf})")
    return Case(layer, "general", hidden, weights, r.weights.astype(np.float32), r.ids.astype(np.int32), opts,
                fp8, ue8m0, spec["activation"])


def reference(case: Case, device: str):
    from moeref.moe import run_moe

    dev = None if device == "cpu" else device
    return run_moe(case.hidden, case.weights, case.topk_weights, case.topk_ids, device=dev, **case.options)


# ---------------------------------------------------------------------------------------- input and output edits


def _busiest(case: Case) -> int:
    return int(np.argmax(case.expert_rows()))


def _replace_expert(case: Case, which: str, e: int, new) -> Case:
    ws = list(getattr(case.weights, which))
    ws[e] = new
    return case.with_(weights=replace(case.weights, **{which: ws}))


def _edit_fp8(q, codes=None, scales=None):
    from moeref.quant import QuantizedTensor

    return QuantizedTensor(np.array(q.codes if codes is None else codes), np.array(q.scales if scales is None else scales),
                           q.scheme, q.shape)


def _halve_scales(scales: np.ndarray, sl) -> np.ndarray:
    s = np.array(scales, copy=True)
    if s.dtype == np.uint8:  # UE8M0 exponent byte
        s[sl] = s[sl] - 1
    else:
        s[sl] = s[sl] * np.float32(0.5)
    return s


def skip_last_k_block(case: Case) -> Case:
    e = _busiest(case)
    w = case.weights.w13[e]
    if case.fp8:
        codes = np.array(w.codes)
        codes[:, -128:] = 0
        return _replace_expert(case, "w13", e, _edit_fp8(w, codes=codes))
    w = np.array(w)
    w[:, -128:] = 0
    return _replace_expert(case, "w13", e, w)


def halved_w2_scale_block(case: Case) -> Case:
    e = _busiest(case)
    w = case.weights.w2[e]
    if case.fp8:
        return _replace_expert(case, "w2", e, _edit_fp8(w, scales=_halve_scales(w.scales, (0, 0))))
    w = np.array(w)
    w[:128, :128] = (w[:128, :128].astype(np.float32) * 0.5).astype(w.dtype)
    return _replace_expert(case, "w2", e, w)


def ue8m0_exponent_bias_off_by_one(case: Case) -> Case:
    """w13's UE8M0 scale bytes of one expert decoded with bias 128 instead of 127: every block scale halved."""
    e = _busiest(case)
    w = case.weights.w13[e]
    return _replace_expert(case, "w13", e, _edit_fp8(w, scales=_halve_scales(w.scales, (slice(None), slice(None)))))


def gate_up_swapped(case: Case) -> Case:
    e = _busiest(case)
    w = case.weights.w13[e]
    if case.fp8:
        c, s = np.array(w.codes), np.array(w.scales)
        n, ns = c.shape[0] // 2, s.shape[0] // 2
        return _replace_expert(case, "w13", e, _edit_fp8(w, np.concatenate([c[n:], c[:n]]),
                                                          np.concatenate([s[ns:], s[:ns]])))
    n = w.shape[0] // 2
    return _replace_expert(case, "w13", e, np.concatenate([w[n:], w[:n]]))


def k_scale_off_by_one(case: Case) -> Case:
    """GEMM1 reads the weight scale of the next K block (the last block keeps its own), one expert."""
    e = _busiest(case)
    w = case.weights.w13[e]
    s = np.array(w.scales)
    s[:, :-1] = s[:, 1:]
    return _replace_expert(case, "w13", e, _edit_fp8(w, scales=s))


def w2_scale_row_off_by_one(case: Case) -> Case:
    """GEMM2 reads the weight scale of the next 128-row block (the last block keeps its own), one expert."""
    e = _busiest(case)
    w = case.weights.w2[e]
    s = np.array(w.scales)
    s[:-1] = s[1:]
    return _replace_expert(case, "w2", e, _edit_fp8(w, scales=s))


def scale_grid_transposed(case: Case) -> Case:
    """w13's scale grid indexed [k block, n block] instead of [n block, k block] where both fit, one expert."""
    e = _busiest(case)
    w = case.weights.w13[e]
    s = np.array(w.scales)
    d = min(s.shape)
    s[:d, :d] = s[:d, :d].T.copy()
    return _replace_expert(case, "w13", e, _edit_fp8(w, scales=s))


def swapped_topk_weights(case: Case) -> Case:
    tw = np.array(case.topk_weights)
    tw[0, [0, 1]] = tw[0, [1, 0]]
    return case.with_(topk_weights=tw)


def renormalized_weights(case: Case) -> Case:
    tw = case.topk_weights.astype(np.float32)
    return case.with_(topk_weights=(tw / np.maximum(tw.sum(1, keepdims=True), np.float32(1e-30))).astype(np.float32))


def neighbour_expert(case: Case) -> Case:
    ids = np.array(case.topk_ids)
    e = len(case.weights.w13)
    ids[0, 0] = (ids[0, 0] + 1) % e
    if ids[0, 0] in ids[0, 1:]:
        ids[0, 0] = (ids[0, 0] + 1) % e
    return case.with_(topk_ids=ids)


def expert_map_last_rank(case: Case, ranks: int) -> Case:
    """Expert parallel over ``ranks`` ranks; the last rank's global -> local map is off by one: its tokens reach the
    next expert, and its last expert's tokens are dropped."""
    e = len(case.weights.w13)
    start = e - e // ranks
    ids = np.array(case.topk_ids)
    on = ids >= start
    ids[on] = np.where(ids[on] + 1 < e, ids[on] + 1, -1)
    tw = np.where(ids >= 0, case.topk_weights, np.float32(0.0)).astype(np.float32)
    return case.with_(topk_ids=ids, topk_weights=tw)


def dropped_last_slot(case: Case) -> Case:
    """The last token (a partial tile) loses its last top-k slot."""
    ids = np.array(case.topk_ids)
    tw = np.array(case.topk_weights)
    ids[-1, -1], tw[-1, -1] = -1, 0.0
    return case.with_(topk_ids=ids, topk_weights=tw)


def ids_stride_off_by_one(case: Case) -> Case:
    """Slot 1 of token t reads token t-1's id (a row stride off by one in the top-k table), last 8 tokens."""
    ids = np.array(case.topk_ids)
    for t in range(ids.shape[0] - 1, max(ids.shape[0] - 9, 0), -1):
        if ids[t - 1, 1] not in ids[t]:
            ids[t, 1] = ids[t - 1, 1]
    return case.with_(topk_ids=ids)


def last_bit_noise(out):
    """Flip the last bit of 0.5% of the bf16 outputs (seeded)."""
    import torch

    flat = out.contiguous().view(torch.int16).reshape(-1).clone()
    gen = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 200)].to(flat.device)
    flat[idx] ^= 1
    return flat.view(torch.bfloat16).reshape(out.shape)
