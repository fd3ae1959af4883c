"""Planted-fault study: which check catches which subtle fault, and that no check alarms on an honest variant.

An honest kernel, the layer written here in torch eager (FP8 1x128 x 128x128 block GEMMs as per-128-K-block FP32
products scaled and summed in FP32, or bf16 matmuls with FP32 accumulation; bf16 GEMM stores; the activation in
float32; the intermediate re-quantized per 128 columns in float32 with torch's E4M3 cast; the weighted top-k sum
in FP32; one bf16 output store), is run with planted faults and with honest variants. Faults are wrappers around
it: *input* faults change what the kernel is given (a weight K block zeroed, a scale block halved, two top-k
weights swapped, ids off by one...) or what it returns (last-bit noise), so they wrap any honest kernel, the
emulated ones included; *internal* faults replace one step of the torch layer (a bf16 accumulation, a
round-toward-zero store, tanh GELU, the intermediate's scale per token, a swizzled partial tile...).

Layers (``--shape``: ``small``, hidden 256, intermediate 256, 8 experts, top-4, 40 tokens, for the CPU and the
test; ``deepseek-v3``: hidden 7168, intermediate 2048, 256 experts, top-8, 128 tokens), each as one exact-regime
case (:func:`moeref.regimes.exact_layer`, Zipf-skewed routing, expert weights from a pool of 8), one
single-rounding case where the declared profile admits one (:func:`moeref.regimes.single_rounding_layer` with the
profile's stores, a bf16 GEMM2 store included: :func:`moeref.regimes.single_rounding_stores`) and one general
case (random FP8 codes or bf16 weights from a pool of 8, N(0, 1) bf16 tokens, softmax top-k weights that do not
sum to 1):

* ``fp8``: DeepSeek-V3 FP8 (FP32 scales, SiLU); declared profile ``DEEPGEMM_FP8`` (= ``HOPPER_FP8_DEEPGEMM_DATA``);
  emulated profile ``DEEPGEMM_FP8_EXACT`` around moeref's DeepGEMM emulation on the CPU, or
  ``fastpath.moe.exact_profile("triton")`` around the Triton layer on a GPU;
* ``fp8_ue8m0``: the same with UE8M0 scales (no emulated profile);
* ``bf16_gelu``: bf16 weights, erf GELU; declared profile ``BF16_OUTPUT`` (no emulated profile).

Per fault and honest variant, ``changed``: the outputs it changes against the honest layer on each case (a
fault changes some). Checks: ``exact`` (equality on the exact-regime case,
:func:`moeref.regimes.moe_equality_report`), ``single_rounding`` (equality on the single-rounding case),
``declared`` (the declared profile's bound on the general case, :func:`moeref.compare.bounds.layer_bound`,
computed once per case), ``emulated`` (input faults and honest variants around the emulated kernel, under its
profile, where the layer has one) and ``mixed`` = exact or single-rounding or declared (what the pytest plugin's
default runs). Recorded: per fault which checks caught it, false alarms per honest variant, each
check's time (the bound's or the equality's own, per call) and the reference's own time per case.

    python bench/bench_fault_catch.py                                   # CPU, small shapes (minutes)
    python bench/bench_fault_catch.py --device cuda --shape deepseek-v3 # GPU, production shapes
    python bench/bench_fault_catch.py --layers fp8 --faults skip_last_k_block   # a subset

Writes JSON to ``--out`` (default ``$OUT/fault_catch.json``, else ``bench/results/fault_catch.json``);
``bench/report_fault_catch.py`` makes the table of docs/error-bounds.md from it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

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


# ------------------------------------------------------------------------------------------------ input edits


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


# ------------------------------------------------------------------------------------------------ the torch layer


@dataclass(frozen=True)
class Hooks:
    """Steps of :class:`TorchLayer` an internal fault or an honest variant replaces (None: the honest step)."""

    gemm_sum: str = "fp32"  # how K-block partials (FP8) or K chunks (bf16) are summed: fp32, reverse, split, bf16
    quant: str = "honest"  # a1/a2: honest, amax_skips_last, group_offset, ue8m0_floor
    a2: str = "fp8"  # fp8, none (kept bf16), per_token, neighbour_scale, e5m2
    act: str = "honest"  # honest, tanh_gelu, bf16_store, rz_store, weight_first
    gemm2_store: str = "rne"  # rne, rz
    out_store: str = "rne"  # rne, rz
    reduce: str = "fp32"  # fp32, reverse, bf16, by_rank
    rows: str = "honest"  # honest, swizzle_partial_tile, padding_leak
    chunk: int | None = None  # tokens per chunk


def _rz_bf16(torch, x):
    """float32 -> bf16 rounding toward zero (truncate the low 16 bits)."""
    b = x.float().contiguous().view(torch.int32) & torch.tensor(-65536, dtype=torch.int32, device=x.device)
    return b.view(torch.float32).to(torch.bfloat16)


class TorchLayer:
    """The honest layer in torch on ``device`` (module docstring); ``run(case, hooks)`` -> bf16 ``[M, K]``."""

    def __init__(self, device: str, ranks: int):
        import torch

        self.torch, self.dev, self.ranks = torch, torch.device(device), ranks
        self._cache: dict = {}

    def _weight(self, w, fp8: bool):
        key = id(w)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is w:
            return hit[1]
        torch = self.torch
        if fp8:
            codes = torch.from_numpy(np.array(w.codes)).view(torch.float8_e4m3fn).to(self.dev).float()
            scales = torch.from_numpy(np.asarray(w.scale_values(), np.float32).copy()).to(self.dev)
            val = (codes, scales)
        else:
            val = torch.from_numpy(np.ascontiguousarray(w).view(np.int16)).view(torch.bfloat16).to(self.dev).float()
        self._cache[key] = (w, val)
        return val

    # -- FP8 quantization (DeepGEMM's rule: amax.clamp(1e-4), sf = amax / 448, x * (1 / sf), torch's E4M3 cast)
    def _quant(self, x, ue8m0: bool, hooks: Hooks, group: int = 128, fmt: str = "e4m3"):
        torch = self.torch
        m, k = x.shape
        xg = x.reshape(m, k // group, group)
        if hooks.quant == "group_offset":  # the amax of group j read over columns 128j+1 .. 128j+128
            shifted = torch.cat([x[:, 1:], torch.zeros(m, 1, device=x.device)], 1).reshape(m, k // group, group)
            amax = shifted.abs().amax(-1, keepdim=True)
        elif hooks.quant == "amax_skips_last":
            amax = xg[..., :-1].abs().amax(-1, keepdim=True)
        else:
            amax = xg.abs().amax(-1, keepdim=True)
        fmax = 448.0 if fmt == "e4m3" else 57344.0
        sf = amax.clamp(min=1e-4) / torch.tensor(fmax, device=x.device)
        if ue8m0:
            mant, ex = torch.frexp(sf)
            up = (mant != 0.5).to(ex.dtype)
            if hooks.quant == "ue8m0_floor":
                up = torch.zeros_like(ex)
            sf = torch.ldexp(torch.ones_like(sf), ex - 1 + up)
        dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        codes = (xg * (1.0 / sf)).to(dt).float()
        return codes.reshape(m, k), sf.reshape(m, k // group)

    def _gemm(self, a, a_s, w, fp8: bool, hooks: Hooks):
        """``a [R, K]`` (codes, or bf16 values) times ``w`` ``[N, K]`` -> float32 ``[R, N]``."""
        torch = self.torch
        if fp8:
            codes, ws = w
            r, k = a.shape
            nb = k // 128
            parts = torch.bmm(a.reshape(r, nb, 128).transpose(0, 1),
                              codes.reshape(-1, nb, 128).permute(1, 2, 0))  # [nb, R, N], FP32 block sums
            sw = ws.repeat_interleave(128, 0)[: codes.shape[0]].T  # [nb, N]
            parts = parts * a_s.T[:, :, None] * sw[:, None, :]
            order = range(nb)
            if hooks.gemm_sum == "reverse":
                order = range(nb - 1, -1, -1)
            if hooks.gemm_sum == "split":  # two halves of K, each summed, then added
                h = nb // 2
                lo = torch.zeros_like(parts[0])
                hi = torch.zeros_like(parts[0])
                for i in range(h):
                    lo = lo + parts[i]
                for i in range(h, nb):
                    hi = hi + parts[i]
                return hi + lo
            acc = torch.zeros_like(parts[0])
            for i in order:
                acc = (acc + parts[i]).to(torch.bfloat16).float() if hooks.gemm_sum == "bf16" else acc + parts[i]
            return acc
        k = a.shape[1]
        if hooks.gemm_sum in ("split", "reverse"):
            h = k // 2
            lo, hi = a[:, :h] @ w[:, :h].T, a[:, h:] @ w[:, h:].T
            return lo + hi if hooks.gemm_sum == "split" else hi + lo
        if hooks.gemm_sum == "bf16":  # a bf16 accumulator: 32-column chunks added in bf16
            acc = torch.zeros(a.shape[0], w.shape[0], device=a.device)
            for s in range(0, k, 32):
                acc = (acc + a[:, s:s + 32] @ w[:, s:s + 32].T).to(torch.bfloat16).float()
            return acc
        return a @ w.T

    def _act(self, h, activation: str, hooks: Hooks):
        torch = self.torch
        n = h.shape[1] // 2
        gate, up = h[:, :n], h[:, n:]
        if activation == "gelu_and_mul":
            x = torch.nn.functional.gelu(gate, approximate="tanh" if hooks.act == "tanh_gelu" else "none") * up
        else:
            x = torch.nn.functional.silu(gate) * up
        return x

    def run(self, case: Case, hooks: Hooks = Hooks()):
        torch = self.torch
        m, k = case.hidden.shape
        x = torch.from_numpy(case.hidden).to(self.dev)
        ids = torch.from_numpy(case.topk_ids.astype(np.int64)).to(self.dev)
        tw = torch.from_numpy(case.topk_weights.astype(np.float32)).to(self.dev)
        out = torch.zeros(m, k, device=self.dev)
        step = hooks.chunk or max(m, 1)
        for s0 in range(0, m, step):
            s1 = min(s0 + step, m)
            out[s0:s1] = self._chunk(case, x[s0:s1], ids[s0:s1], tw[s0:s1], hooks)
        if hooks.out_store == "rz":
            return _rz_bf16(torch, out)
        return out.to(torch.bfloat16)

    def _chunk(self, case: Case, x, ids, tw, hooks: Hooks):
        torch = self.torch
        m, k = x.shape
        top = ids.shape[1]
        if case.fp8:
            a, a_s = self._quant(x, case.ue8m0, hooks)
        else:
            a, a_s = x, None
        tok, slot = torch.nonzero(ids >= 0, as_tuple=True)
        ex = ids[tok, slot]
        y = torch.zeros(tok.numel(), k, device=self.dev)
        experts = sorted(set(ex.tolist()))
        rows_of = {e: torch.nonzero(ex == e).flatten() for e in experts}
        extra = []  # (token, slot weight, y row) of leaking padding rows
        for e in experts:
            sel = rows_of[e]
            toks = tok[sel]
            ae = a[toks]
            if hooks.act == "weight_first":  # the router weight applied to the input rows before GEMM1
                ae = x[toks] * tw[toks, slot[sel]][:, None]
                if case.fp8:
                    ae, ase = self._quant(ae, case.ue8m0, hooks)
                else:
                    ae, ase = ae.to(torch.bfloat16).float(), None
            else:
                ase = a_s[toks] if a_s is not None else None
            w13 = self._weight(case.weights.w13[e], case.fp8)
            w2 = self._weight(case.weights.w2[e], case.fp8)
            h = self._gemm(ae, ase, w13, case.fp8, hooks).to(torch.bfloat16).float()
            if hooks.rows == "swizzle_partial_tile" and e == self._tile_expert(case, 64):
                full = (h.shape[0] // 64) * 64
                h = torch.cat([h[:full], h[full:].flip(0)])
            xa = self._act(h, case.activation, hooks)
            declared_act = case.options.get("act_out_dtype") is not None or not case.fp8
            if hooks.act == "rz_store":
                xa = _rz_bf16(torch, xa).float()
            elif declared_act or hooks.act == "bf16_store":
                xa = xa.to(torch.bfloat16).float()
            if case.fp8:
                if hooks.a2 == "none":
                    xq, xs = xa.to(torch.bfloat16).float(), None
                elif hooks.a2 == "per_token":
                    xq, xs = self._quant(xa, case.ue8m0, hooks, group=xa.shape[1])
                    xs = xs.repeat_interleave(xa.shape[1] // 128, 1)
                elif hooks.a2 == "neighbour_scale":  # codes with each group's scale, GEMM2 with the next one's
                    xq, xs = self._quant(xa, case.ue8m0, hooks)
                    xs = torch.cat([xs[:, 1:], xs[:, -1:]], 1)
                elif hooks.a2 == "e5m2":
                    xq, xs = self._quant(xa, case.ue8m0, hooks, fmt="e5m2")
                else:
                    xq, xs = self._quant(xa, case.ue8m0, hooks)
                if xs is None:  # no re-quantization: a bf16 GEMM2 against the dequantized weights
                    codes, ws = w2
                    wd = codes * ws.repeat_interleave(128, 0)[: codes.shape[0]].repeat_interleave(128, 1)[:, : codes.shape[1]]
                    ye = xq @ wd.T
                else:
                    ye = self._gemm(xq, xs, w2, True, hooks)
            else:
                ye = self._gemm(xa, None, w2, False, hooks)
            ye = _rz_bf16(torch, ye).float() if hooks.gemm2_store == "rz" else ye.to(torch.bfloat16).float()
            y[sel] = ye
            if hooks.rows == "padding_leak" and e == self._tile_expert(case, 16):
                pad = (-sel.numel()) % 16  # padding rows hold the last real row; scattered to its token again
                last = sel[-1]
                extra += [(tok[last], tw[tok[last], slot[last]], ye[-1])] * pad
        w = tw[tok, slot][:, None]
        if hooks.act == "weight_first":
            w = torch.ones_like(w)
        contrib = w * y
        out = torch.zeros(m, k, device=self.dev)
        if hooks.reduce == "bf16":
            out = out.to(torch.bfloat16)
            for j in range(top):
                sel = slot == j
                out.index_add_(0, tok[sel], contrib[sel].to(torch.bfloat16))
            out = out.float()
        elif hooks.reduce in ("reverse", "by_rank"):
            if hooks.reduce == "reverse":
                groups = [slot == j for j in range(top - 1, -1, -1)]
            else:
                e_all = len(case.weights.w13)
                per = -(-e_all // self.ranks)
                groups = [(ex // per) == r for r in range(self.ranks)]
            for sel in groups:
                out.index_add_(0, tok[sel], contrib[sel])
        else:
            out.index_add_(0, tok, contrib)
        for t, wt, row in extra:
            out[t] += wt * row
        return out

    @staticmethod
    def _tile_expert(case: Case, tile: int) -> int:
        """The busiest expert whose row count is not a multiple of ``tile`` (it has a partial last tile)."""
        rows = case.expert_rows()
        for e in np.argsort(-rows, kind="stable"):
            if rows[e] % tile:
                return int(e)
        return int(np.argmax(rows))


# ------------------------------------------------------------------------------------------------ faults, variants


def last_bit_noise(out):
    """Flip the last bit of 0.5% of the bf16 outputs (seeded)."""
    import torch

    flat = out.contiguous().view(torch.int16).reshape(-1).clone()
    gen = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 200)].to(flat.device)
    flat[idx] ^= 1
    return flat.view(torch.bfloat16).reshape(out.shape)


@dataclass(frozen=True)
class Variant:
    """A planted fault or an honest variant: ``edit`` changes the kernel's inputs (``Case -> Case``), ``post`` its
    output, ``hooks`` a step of the torch layer. Input/output variants (no hooks) wrap any honest kernel."""

    name: str
    layers: tuple
    what: str
    edit: object = None
    post: object = None
    hooks: Hooks | None = None

    @property
    def level(self) -> str:
        return "internal" if self.hooks is not None else "inputs"


FP8 = ("fp8",)
FP8_ALL = ("fp8", "fp8_ue8m0")
ALL = tuple(LAYERS)


def faults(shape: dict) -> list:
    ranks = shape["ranks"]
    H = Hooks
    return [
        Variant("skip_last_k_block", FP8, "GEMM1 skips the last 128-column K block (busiest expert)", skip_last_k_block),
        Variant("halved_w2_scale_block", FP8, "one 128x128 w2 scale block halved (busiest expert)", halved_w2_scale_block),
        Variant("swapped_topk_weights", FP8, "top-k weights of slots 0 and 1 swapped (token 0)", swapped_topk_weights),
        Variant("last_bit_noise", FP8, "last bit flipped in 0.5% of the bf16 outputs", post=last_bit_noise),
        Variant("gate_up_swapped", FP8, "gate and up halves swapped (busiest expert)", gate_up_swapped),
        Variant("k_scale_off_by_one", FP8, "GEMM1 reads the next K block's weight scale (busiest expert)",
                k_scale_off_by_one),
        Variant("w2_scale_row_off_by_one", FP8, "GEMM2 reads the next 128-row block's weight scale (busiest expert)",
                w2_scale_row_off_by_one),
        Variant("scale_grid_transposed", FP8, "w13 scale grid read transposed (busiest expert)", scale_grid_transposed),
        Variant("renormalized_weights", FP8, "router weights renormalised when they should not be", renormalized_weights),
        Variant("neighbour_expert", FP8, "token 0, slot 0 routed to the neighbouring expert", neighbour_expert),
        Variant("expert_map_last_rank", FP8, f"expert map off by one on the last of {ranks} EP ranks",
                lambda c: expert_map_last_rank(c, ranks)),
        Variant("dropped_last_slot", FP8, "the last token loses its last top-k slot", dropped_last_slot),
        Variant("ids_stride_off_by_one", FP8, "slot 1 reads the previous token's expert id (last 8 tokens)",
                ids_stride_off_by_one),
        Variant("weight_before_activation", FP8, "router weight applied to GEMM1's input, not the output",
                hooks=H(act="weight_first")),
        Variant("swizzle_partial_tile", FP8, "rows of a partial 64-row tile swizzled (reversed) after GEMM1",
                hooks=H(rows="swizzle_partial_tile")),
        Variant("padding_rows_leak", FP8, "padding rows of a partial 16-row tile leak into the top-k sum",
                hooks=H(rows="padding_leak")),
        Variant("bf16_topk_sum", FP8, "top-k sum accumulated in bf16", hooks=H(reduce="bf16")),
        Variant("rz_output_store", FP8, "output stored round-toward-zero instead of to nearest even",
                hooks=H(out_store="rz")),
        Variant("rz_gemm2_store", FP8, "GEMM2 output stored round-toward-zero", hooks=H(gemm2_store="rz")),
        Variant("a2_not_requantized", FP8, "intermediate kept in bf16 (no FP8 re-quantization)", hooks=H(a2="none")),
        Variant("a2_per_token_scale", FP8, "intermediate quantized with one scale per token, not per 128",
                hooks=H(a2="per_token")),
        Variant("a2_neighbour_group_scale", FP8, "GEMM2 reads the intermediate's next 128-group scale",
                hooks=H(a2="neighbour_scale")),
        Variant("a2_e5m2", FP8, "intermediate quantized to E5M2 instead of E4M3", hooks=H(a2="e5m2")),
        Variant("amax_skips_last_column", FP8, "activation scales: the amax misses each group's last column",
                hooks=H(quant="amax_skips_last")),
        Variant("quant_group_offset", FP8, "activation scales: groups read one column late", hooks=H(quant="group_offset")),
        Variant("bf16_k_block_sum", FP8, "GEMM K-block partial sums accumulated in bf16", hooks=H(gemm_sum="bf16")),
        Variant("ue8m0_rounded_down", ("fp8_ue8m0",), "UE8M0 activation scales rounded down instead of up",
                hooks=H(quant="ue8m0_floor")),
        Variant("ue8m0_bias_off_by_one", ("fp8_ue8m0",), "w13 UE8M0 scales decoded with bias 128 (busiest expert)",
                ue8m0_exponent_bias_off_by_one),
        Variant("tanh_gelu", ("bf16_gelu",), "erf GELU computed as tanh GELU", hooks=H(act="tanh_gelu")),
        Variant("bf16_accumulation", ("bf16_gelu",), "GEMMs accumulate in bf16 (32-column chunks)",
                hooks=H(gemm_sum="bf16")),
        Variant("rz_activation_store", ("bf16_gelu",), "activation stored round-toward-zero", hooks=H(act="rz_store")),
    ]


def honest(shape: dict) -> list:
    H = Hooks
    return [
        Variant("torch eager", ALL, "the honest layer", hooks=H()),
        Variant("split-K GEMMs", ALL, "every GEMM's K in two halves, summed", hooks=H(gemm_sum="split")),
        Variant("K blocks reversed", ALL, "GEMM K blocks summed in reverse order", hooks=H(gemm_sum="reverse")),
        Variant("top-k sum reversed", ALL, "top-k sum in reverse slot order", hooks=H(reduce="reverse")),
        Variant("EP shards", ALL, f"experts on {shape['ranks']} ranks, combined rank by rank", hooks=H(reduce="by_rank")),
        Variant("chunked tokens", ALL, f"tokens in chunks of {shape['chunk']}", hooks=H(chunk=shape["chunk"])),
        Variant("activation stored in bf16", FP8_ALL, "the activation stored in bf16 before the re-quantization",
                hooks=H(act="bf16_store")),
    ]


# ------------------------------------------------------------------------------------------------ emulated kernel


class Emulated:
    """The emulated honest kernel of a layer, its profile and the reference run that profile is declared against:
    on the CPU moeref's DeepGEMM emulation (:func:`moeref.compare.subtle_faults._deepgemm_candidate`,
    ``DEEPGEMM_FP8_EXACT``, the general case's own reference); on a GPU the Triton layer (``fastpath.moe.fused_moe``,
    ``fastpath.moe.exact_profile("triton")``, the reference run with ``fastpath.moe.reference_config``'s options).
    On a GPU each distinct expert tensor is uploaded once; a call stacks the experts on the device."""

    def __init__(self, device: str):
        self.device = device
        self.fastpath = device != "cpu"  # the Triton layer (a GPU; on the CPU only under TRITON_INTERPRET=1)
        self._dev: dict = {}

    def setup(self, case: Case):
        """``(profile, reference run)`` for the general ``case``."""
        if not self.fastpath:
            return "DEEPGEMM_FP8_EXACT", None  # the general case's own run
        from fastpath.moe import exact_profile, reference_config
        from moeref.moe import run_moe

        fw = self._fast(case.weights)
        opts = {k: v for k, v in reference_config(fw).items() if k != "profile"}
        run = run_moe(case.hidden, case.weights, case.topk_weights, case.topk_ids, device=self.device,
                      activation=case.activation, **opts)
        return exact_profile("triton", fw), run

    def _fast(self, weights):
        import torch

        from fastpath.moe import FastMoEWeights

        def dev(q):
            hit = self._dev.get(id(q))
            if hit is None or hit[0] is not q:
                codes = torch.from_numpy(np.array(q.codes)).to(self.device).view(torch.float8_e4m3fn)
                scales = torch.from_numpy(np.asarray(q.scale_values(), np.float32).copy()).to(self.device)
                hit = self._dev[id(q)] = (q, codes, scales)
            return hit[1], hit[2]

        w13 = [dev(q) for q in weights.w13]
        w2 = [dev(q) for q in weights.w2]
        return FastMoEWeights(torch.stack([c for c, _ in w13]), torch.stack([c for c, _ in w2]), weights.w13_layout,
                              torch.stack([s for _, s in w13]), torch.stack([s for _, s in w2]))

    def run(self, case: Case):
        import torch

        if not self.fastpath:
            from moeref.compare.faults import LayerCase
            from moeref.compare.subtle_faults import _deepgemm_candidate

            lc = LayerCase(case.hidden, case.weights, case.topk_weights, case.topk_ids, dict(case.options))
            return torch.from_numpy(np.asarray(_deepgemm_candidate(lc), np.float32)).to(torch.bfloat16)
        from fastpath.moe import fused_moe

        dev = torch.device(self.device)
        return fused_moe(torch.from_numpy(case.hidden).to(dev).to(torch.bfloat16), self._fast(case.weights),
                         torch.from_numpy(case.topk_weights).to(dev), torch.from_numpy(case.topk_ids).to(dev),
                         impl="triton", activation=case.activation)


# ------------------------------------------------------------------------------------------------ checks


def _sync(device: str):
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


class Checker:
    """The reference runs, bounds and equality of one layer (both cases), each timed once."""

    def __init__(self, layer: str, shape: dict, args, log):
        from moeref.compare import layer_bound

        self.layer, self.device, self.log = layer, args.device, log
        self.info = {"layer": layer, **{k: LAYERS[layer][k] for k in ("scheme", "activation", "declared")}}
        t0 = time.perf_counter()
        self.cases = {"exact": exact_case(layer, shape, args.seed), "general": general_case(layer, shape, args.seed)}
        sr, self.info["single_rounding"] = single_rounding_case(layer, shape, args.seed)
        if sr is not None:
            self.cases["single_rounding"] = sr
        self.info["case_seconds"] = round(time.perf_counter() - t0, 2)
        self.runs, self.info["reference_seconds"] = {}, {}
        for kind, case in self.cases.items():
            reference(case, self.device)  # warm-up (device engine compilation)
            _sync(self.device)
            t0 = time.perf_counter()
            self.runs[kind] = reference(case, self.device)
            _sync(self.device)
            self.info["reference_seconds"][kind] = time.perf_counter() - t0
        self.bounds, self.info["bound_seconds"] = {}, {}
        self._bound("declared", LAYERS[layer]["declared"], self.runs["general"], layer_bound)
        self.info["emulated"] = None

    def _bound(self, name: str, profile, run, layer_bound):
        layer_bound(run, profile)  # warm-up (device kernels' compilation)
        _sync(self.device)
        t0 = time.perf_counter()
        b = layer_bound(run, profile).bound
        _sync(self.device)
        self.info["bound_seconds"][name] = time.perf_counter() - t0
        self.bounds[name] = (_host(run.output), _host(b))

    def add_emulated(self, profile, run=None):
        """The emulated profile's bound around ``run`` (default: the general case's reference run)."""
        from moeref.compare import layer_bound

        self._bound("emulated", profile, self.runs["general"] if run is None else run, layer_bound)
        self.info["emulated"] = getattr(profile, "name", str(profile))

    def equality(self, cand, kind: str = "exact") -> dict:
        from moeref.regimes import moe_equality_report

        t0 = time.perf_counter()
        r = moe_equality_report(cand, self.runs[kind])
        return {"caught": not r.passed, "differing": int(r.num_differences), "seconds": time.perf_counter() - t0}

    def bound(self, cand, which: str) -> dict:
        t0 = time.perf_counter()
        output, bound = self.bounds[which]
        err = np.abs(_host(cand) - output)
        with np.errstate(invalid="ignore"):
            bad = ~(err <= bound)
        n = int(np.count_nonzero(bad))
        return {"caught": n > 0, "violations": n,
                "seconds": time.perf_counter() - t0 + self.info["bound_seconds"][which]}


def _host(x) -> np.ndarray:
    from moeref import _interop

    if hasattr(x, "dtype") and "bfloat16" in str(x.dtype) and hasattr(x, "float"):
        x = x.float()
    return np.asarray(_interop.to_numpy(x), dtype=np.float64)


def _apply(variant: Variant, case: Case, kernel):
    c = variant.edit(case) if variant.edit is not None else case
    out = kernel(c)
    return variant.post(out) if variant.post is not None else out


def run_layer(layer: str, shape: dict, args, log, chosen_faults, chosen_honest) -> tuple[dict, list, list]:
    ck = Checker(layer, shape, args, log)
    log(f"{layer}: cases {ck.info['case_seconds']} s, reference {ck.info['reference_seconds']}, "
        f"declared bound {ck.info['bound_seconds']['declared']:.2f} s")
    tl = TorchLayer(args.device, shape["ranks"])
    emu = None
    if LAYERS[layer]["emulated"] and not args.no_emulated:
        try:
            emu = Emulated(args.device)
            ck.add_emulated(*emu.setup(ck.cases["general"]))
            emu.run(ck.cases["general"])  # warm-up (compilation, autotuning)
        except Exception as exc:  # noqa: BLE001 - recorded, the study goes on without it
            ck.info["emulated_error"] = f"{type(exc).__name__}: {exc}"[:400]
            emu = None
    honest_out = {kind: _host(tl.run(case)) for kind, case in ck.cases.items()}
    fault_rows, honest_rows = [], []
    for group, variants, rows in (("fault", chosen_faults, fault_rows), ("honest", chosen_honest, honest_rows)):
        for v in variants:
            if layer not in v.layers:
                continue
            row = {"name": v.name, "layer": layer, "what": v.what, "level": v.level, "checks": {}}
            hooks = v.hooks or Hooks()
            t0 = time.perf_counter()
            try:
                outs = {kind: _apply(v, case, lambda c: tl.run(c, hooks)) for kind, case in ck.cases.items()}
                # how many outputs the variant changes against the honest layer (a fault must change some)
                row["changed"] = {kind: int(np.count_nonzero(_host(o) != honest_out[kind])) for kind, o in outs.items()}
                row["checks"]["exact"] = ck.equality(outs["exact"])
                if "single_rounding" in outs:
                    row["checks"]["single_rounding"] = ck.equality(outs["single_rounding"], "single_rounding")
                row["checks"]["declared"] = ck.bound(outs["general"], "declared")
                if emu is not None and (v.level == "inputs" or v.hooks in (Hooks(), Hooks(chunk=shape["chunk"]))):
                    if v.hooks is not None and v.hooks.chunk:
                        def kernel(c, ch=v.hooks.chunk):
                            import torch

                            parts = [emu.run(c.with_(hidden=c.hidden[s:s + ch], topk_ids=c.topk_ids[s:s + ch],
                                                     topk_weights=c.topk_weights[s:s + ch]))
                                     for s in range(0, c.hidden.shape[0], ch)]
                            return torch.cat(parts)
                    else:
                        kernel = emu.run
                    row["checks"]["emulated"] = ck.bound(_apply(v, ck.cases["general"], kernel), "emulated")
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                log(traceback.format_exc()[-1200:])
            ch = row["checks"]
            if "exact" in ch and "declared" in ch:  # the plugin's default: exact, single-rounding and general cases
                parts = [ch[k] for k in MIXED if k in ch]
                ch["mixed"] = {"caught": any(c["caught"] for c in parts), "seconds": sum(c["seconds"] for c in parts)}
            row["seconds"] = round(time.perf_counter() - t0, 3)
            caught = [k for k in ("exact", "single_rounding", "declared", "emulated") if ch.get(k, {}).get("caught")]
            log(f"  {group} {v.name}: caught by {caught or 'none'} ({row['seconds']} s)")
            rows.append(row)
    info = dict(ck.info)
    for k in ("reference_seconds", "bound_seconds"):
        info[k] = {kk: round(vv, 4) for kk, vv in info[k].items()}
    return info, fault_rows, honest_rows


REGIMES = ("mixed", "exact", "single_rounding", "declared", "emulated")
MIXED = ("exact", "single_rounding", "declared")
"""The checks of the mixed default (the pytest plugin's): equality on the exact-regime case, equality on the
single-rounding case (where the declared profile admits one), the declared profile's bound on the general case."""


def summarise(fault_rows: list, honest_rows: list, layers: list) -> dict:
    out = {}
    for reg in REGIMES:
        f = [r["checks"][reg] for r in fault_rows if reg in r["checks"]]
        h = [r["checks"][reg] for r in honest_rows if reg in r["checks"]]
        secs = [c["seconds"] for c in f + h]
        out[reg] = {"caught": sum(c["caught"] for c in f), "faults": len(f),
                    "false_alarms": sum(c["caught"] for c in h), "honest": len(h),
                    "median_seconds": statistics.median(secs) if secs else None}
    refs = [v for info in layers for v in info["reference_seconds"].values()]
    out["reference_median_seconds"] = statistics.median(refs) if refs else None
    return out


def meta(args) -> dict:
    m = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "argv": sys.argv[1:] if args.argv is None else list(args.argv), "device": args.device, "shape": args.shape,
         "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
         "numpy": np.__version__}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            m["cpu"] = names[0]
    except OSError:
        pass
    try:
        import torch

        m["torch"] = torch.__version__
        m["cuda"] = torch.version.cuda
        if args.device != "cpu" and torch.cuda.is_available():
            m["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        tree = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        m["tree"] = tree + ("+dirty" if dirty else "") if tree else "unknown"
    except (OSError, subprocess.SubprocessError):
        m["tree"] = "unknown"
    return m


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--faults", nargs="+", default=None, help="fault names (default: all)")
    p.add_argument("--honest", nargs="+", default=None, help="honest variant names (default: all)")
    p.add_argument("--no-emulated", action="store_true", help="skip the emulated profile")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    all_faults, all_honest = faults(shape), honest(shape)
    known = {v.name for v in all_faults}
    if args.faults:
        bad = sorted(set(args.faults) - known)
        if bad:
            raise SystemExit(f"unknown faults {bad}; known: {', '.join(sorted(known))}")
    chosen_f = [v for v in all_faults if args.faults is None or v.name in args.faults]
    chosen_h = [v for v in all_honest if args.honest is None or v.name in args.honest]
    out_path = args.out or os.path.join(os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")),
                                        "fault_catch.json")
    result = {"meta": meta(args), "shape": shape, "layers": [], "faults": [], "honest": []}

    def log(msg):
        print(msg, flush=True)

    t0 = time.perf_counter()
    for layer in args.layers:
        try:
            info, f, h = run_layer(layer, shape, args, log, chosen_f, chosen_h)
        except Exception:  # noqa: BLE001 - recorded, the next layer runs
            info, f, h = {"layer": layer, "error": traceback.format_exc()[-1500:]}, [], []
            log(info["error"])
        result["layers"].append(info)
        result["faults"] += f
        result["honest"] += h
    result["summary"] = summarise(result["faults"], result["honest"],
                                  [i for i in result["layers"] if "reference_seconds" in i])
    result["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    log(json.dumps(result["summary"], indent=1))
    log(f"wrote {out_path} ({result['meta']['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
