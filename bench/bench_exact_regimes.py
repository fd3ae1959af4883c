"""GPU proof of the exact regimes: at production shapes, on exact-regime layers (:func:`moeref.regimes.exact_layer`),
every implementation must give the reference's bf16 bits, and planted faults must change them.

Models (``--models``):

* ``deepseek_v3``: FP8 1x128 activations x 128x128 weights, FP32 scales, hidden 7168, intermediate 2048, 256 experts,
  top-8, SiLU; ``deepseek_v3_ue8m0``: the same with UE8M0 scales;
* ``qwen3_30b_a3b``: bf16, hidden 2048, intermediate 768, 128 experts, top-8, SiLU; ``qwen3_30b_a3b_fp8``: the same
  layer in FP8 1x128 / 128x128 with FP32 scales (Qwen3-30B-A3B-FP8's block FP8, DeepSeek's recipe);
* ``qwen3_30b_a3b_gelu``: the bf16 layer with GELU (erf vs tanh GELU probes);
* ``mixtral_8x7b``: bf16, hidden 4096, intermediate 14336, 8 experts, top-2, SiLU (weights from 4 distinct experts:
  each expert's 117M-element w13 takes seconds to build on the host; ``--expert-pool 0`` builds all 8);
* ``gpt_oss_120b_mxfp4``: MXFP4 W4A16 (bf16 activations), hidden 2880, intermediate 2880, 128 experts, top-4,
  SwiGLU-OAI with biases.

Implementations, each in its own try/except (the error is recorded, the run goes on):

* ``fastpath.moe`` (Triton; DeepGEMM when ``deep_gemm`` imports, else the entry's ``skipped`` says so), contiguous
  and masked, and capturable, with the layer's activation and its parameters (GELU: erf, as the GELU model
  declares); and on EP shards (:func:`fastpath_ep_runs`): the layer run once per rank of an
  :func:`moeref.distributed.ep_placement` with that rank's experts and expert map, each rank's FP32 partial sum
  added in rank order, then one bf16 store;
* ``torch eager bf16``: the layer written here in torch (cuBLAS bf16 GEMMs, FP32 accumulation, bf16 stores,
  FP8 re-quantization in float32 with torch's float8 cast), and honest variants of it (split-K GEMM1 in two
  halves summed in FP32, the top-k sum in reverse slot order, tokens in chunks of 32, EP shards summed in rank
  order);
* ``torch._grouped_mm`` (CUTLASS) bf16 GEMMs in the same pipeline;
* ``torch._scaled_mm`` per expert (cuBLAS rowwise FP8, fast accumulation off and on; FP8 models only).

The reference is ``moeref.moe.run_moe(device="cuda")`` (the device engine, bit-identical to the host reference;
its weights are stacked on the device once per model). Each result: the number of bf16 outputs that differ from
the reference (0 expected). Planted faults on the torch eager pipeline (skipped last K block, halved w2 scale
block, swapped top-k weights of one token, gate/up swapped in one expert, renormalised router weights, one token
routed to a neighbouring expert, last-bit noise on 0.5% of the outputs, tanh GELU for the GELU model), and on the
GPU one in ``fastpath.moe`` (the GELU model's layer run with tanh GELU where erf is declared,
``fastpath_tanh_gelu``): the number of differing outputs and whether equality caught it; faults run at the first
``--tokens`` count only.

Each model's layer is built once, at the largest ``--tokens`` count (skewed Zipf routing); a smaller count runs its
first tokens (:func:`token_case`). ``--draws N`` adds N cases per model drawn by Hypothesis (:func:`draw_strategy`,
through :func:`moeref.testing.draw_cases`: derandomized, distinct): a token count up to the largest ``--tokens``
(:func:`moeref.strategies.token_counts`, the counts around 128 included), a routing kind of
:data:`moeref.testing.cases.CASE_KINDS` with its seed, padding tokens or none, and the EP shards
(:func:`moeref.strategies.ep_shards`: 1 to 8 ranks, linear or round-robin); :func:`drawn_case` makes the case
from the model's layer (token rows drawn from it, the routing's ids, power-of-two top-k weights) and every
implementation runs on it. The JSON's ``draws`` lists each draw's parameters and differing outputs.

    python bench/bench_exact_regimes.py [--models deepseek_v3 qwen3_30b_a3b] [--tokens 128 512] [--draws 4]
    python bench/bench_exact_regimes.py --tiny --device cpu     # the CPU-runnable parts at tiny shapes (CI)
    python bench/bench_exact_regimes.py --regime single_rounding --models deepseek_v3 qwen3_30b_a3b

``--regime single_rounding`` runs :func:`moeref.regimes.single_rounding_layer` instead (FP8 and bf16 models): every
declared store rounds, and GEMM2's output goes into the top-k sum in FP32, so the torch pipeline keeps it in FP32,
the implementations that store it in bf16 (``torch._grouped_mm``, ``torch._scaled_mm`` here; any kernel that does)
differ by design, and :data:`SINGLE_ROUNDING_FAULTS` are planted too.

``--time-check`` times the exact-regime check itself instead (:func:`time_check`: reference alone against
reference + in-regime + equality, interleaved rounds; ``--time-values`` adds the in-regime check from the values):

    python bench/bench_exact_regimes.py --time-check --models deepseek_v3 --tokens 128 --expert-pool 0   # GPU
    python bench/bench_exact_regimes.py --time-check --device cpu --models deepseek_v3 --shape 2048 768 32 8 --tokens 64

Writes JSON to ``--out`` (meta: date, argv, torch, CUDA (``torch.version.cuda``), DeepGEMM's version or
``"absent"``, GPU; ``model_seconds``: each model's wall time, layer construction and weight uploads included)
(default ``$OUT/exact_regimes.json``, else ``bench/results/exact_regimes.json``).
Budget: each model's wall time is printed and kept in ``model_seconds``; at one count of 128 tokens (NVIDIA H200,
2026-11-28) layer construction, reference and calls took 3 to 22 s per model (weights from a pool of 8 distinct
experts), weight uploads not counted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

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
FAULTS = ("skipped_last_k_block", "halved_w2_scale_block", "swapped_topk_weights", "gate_up_swapped",
          "renormalized_weights", "neighbour_expert", "last_bit_noise", "tanh_gelu")
FASTPATH_FAULTS = ("fastpath_tanh_gelu",)
"""Faults planted in fastpath.moe itself (GPU only): the GELU layer run with tanh GELU where erf is declared."""
SINGLE_ROUNDING_FAULTS = ("rz_gemm1_store", "rz_intermediate", "rz_output_store", "second_gemm2_store")
"""Faults only ``--regime single_rounding`` sees: a store rounding toward zero (GEMM1's, the FP8 codes or bf16
activation store, the output's) and GEMM2's output stored in bf16 before the top-k sum."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[128],
                   help="token counts (the layer is built at the largest; smaller counts run its first tokens)")
    p.add_argument("--draws", type=int, default=0,
                   help="cases per model drawn by Hypothesis (token count, routing kind and seed, padding, EP shards)")
    p.add_argument("--ep-size", type=int, default=4, help="EP ranks of the fixed cases' EP-shard variants")
    p.add_argument("--expert-pool", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (hidden 256, 8 experts): CPU-runnable")
    p.add_argument("--out", default=None)
    p.add_argument("--regime", default="exact", choices=("exact", "single_rounding"),
                   help="single_rounding: moeref.regimes.single_rounding_layer (every declared store rounds, no GEMM2 "
                        "store), with its faults (round-toward-zero stores, a second store)")
    p.add_argument("--time-check", action="store_true",
                   help="time the exact-regime check (reference + in-regime + equality) against the reference alone "
                        "instead of running the implementations")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of --time-check")
    p.add_argument("--shape", nargs=4, type=int, default=None, metavar=("HIDDEN", "INTERMEDIATE", "EXPERTS", "TOP_K"),
                   help="override the model's shape (e.g. a mid shape on the CPU)")
    p.add_argument("--time-values", action="store_true",
                   help="with --time-check, also time the in-regime check from the values (once; slow at large shapes)")
    args = p.parse_args(argv)
    if min(args.tokens) < 1 or args.draws < 0 or args.ep_size < 1:
        p.error(f"--tokens must be positive, --draws >= 0, --ep-size >= 1; got {args.tokens}, {args.draws}, "
                f"{args.ep_size}")
    return args


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


@dataclass(frozen=True)
class Draw:
    """One drawn case's parameters (:func:`draw_strategy`; :func:`drawn_case` makes the case from them)."""

    tokens: int
    routing: str
    seed: int
    padding: bool
    ep_size: int
    ep_strategy: str


def draw_strategy(max_tokens: int, num_experts: int):
    """Hypothesis strategy of :class:`Draw`: a token count of :func:`moeref.strategies.token_counts` (1 to
    ``max_tokens``, and 126..130 when ``max_tokens`` reaches 130), a routing kind of
    :data:`moeref.testing.cases.CASE_KINDS` and its seed, padding tokens (about a quarter) or none, and the EP
    shards of :func:`moeref.strategies.ep_shards` (``ep_size`` 1 to ``min(8, num_experts)``, linear or
    round-robin; every rank runs, so the drawn rank is not used). Shrinks toward one token, uniform routing,
    seed 0, no padding, one shard."""
    from hypothesis import strategies as st

    from moeref.strategies import ep_shards, token_counts
    from moeref.testing.cases import CASE_KINDS

    return st.builds(lambda m, kind, seed, pad, shard: Draw(int(m), kind, int(seed), bool(pad), shard.ep_size,
                                                            shard.strategy),
                     token_counts(max_tokens=max_tokens, block=128 if max_tokens >= 130 else None),
                     st.sampled_from(CASE_KINDS), st.integers(0, 2**16), st.booleans(),
                     ep_shards(num_experts, max_ep_size=min(8, num_experts)))


def drawn_case(base, draw: Draw):
    """The case of ``draw`` on the layer ``base`` (:func:`token_case`): ``draw.tokens`` token rows of ``base``
    chosen from the draw's seed (distinct while ``base`` has enough), the ids of routing ``draw.routing``
    (:func:`moeref.testing.cases._routing`, the drawn cases' NumPy routings; padding tokens with
    ``draw.padding``), power-of-two top-k weights (:func:`moeref.regimes.exact_topk_weights`, 0 on padding)."""
    from moeref.regimes import exact_topk_weights
    from moeref.testing.cases import _routing

    rng = np.random.default_rng([draw.seed, 30])
    m_base = base.hidden.shape[0]
    rows = rng.choice(m_base, size=draw.tokens, replace=draw.tokens > m_base)
    _, ids = _routing(draw.routing, draw.tokens, len(base.weights.w13), base.topk_ids.shape[1], rng, draw.padding)
    tw = np.where(ids >= 0, exact_topk_weights(ids.shape, seed=rng), np.float32(0.0))
    return token_case(base, rows, ids, tw)


def drawn_parameters(n: int, max_tokens: int, num_experts: int, seed: int = 0) -> list:
    """``n`` :class:`Draw` s of :func:`draw_strategy`, the same list for the same arguments: ``4 n`` distinct
    examples drawn by :func:`moeref.testing.draw_cases` (derandomized; ``seed`` skips the first ``seed``), of
    which the first of each routing kind come first, then the others, in the order drawn (a derandomized run
    starts from the simplest example and its neighbours, so a few draws taken in order would share a kind)."""
    from moeref.testing import draw_cases

    pool = draw_cases(4 * n, draw_strategy(max_tokens, num_experts), seed=seed)
    first, kinds = [], set()
    for d in pool:
        if d.routing not in kinds:
            kinds.add(d.routing)
            first.append(d)
    return (first + [d for d in pool if d not in first])[:n]


# ------------------------------------------------------------------ the torch pipeline


def _stack_weights(ws, torch, dev):
    """bf16 [E, R, C] on ``dev`` from per-expert bf16 arrays or FP8 QuantizedTensors (exact: small integers times
    powers of two)."""
    if isinstance(ws[0], np.ndarray):
        return torch.stack([torch.from_numpy(np.ascontiguousarray(w).view(np.int16))
                            .view(torch.bfloat16) for w in ws]).to(dev)
    out = []
    cache = {}
    for w in ws:
        key = id(w)
        if key not in cache and w.scheme.element != "e4m3fn":  # MXFP4: E2M1 x 2^e, exact in bf16
            cache[key] = torch.from_numpy(w.dequantize(np.float32)).to(dev).to(torch.bfloat16)
        if key not in cache:
            r, c = w.shape
            codes = torch.from_numpy(np.array(w.codes, copy=True)).view(torch.float8_e4m3fn).to(dev).float()
            s = torch.from_numpy(np.asarray(w.scale_values(), np.float32).copy()).to(dev)
            br = 1 if s.shape[0] == r else 128
            bc = c if s.shape[1] == 1 else 128
            cache[key] = (codes * s.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]).to(torch.bfloat16)
        out.append(cache[key])
    return torch.stack(out)


def _toward_zero(torch, x, fmt: str):
    """float32 ``x`` rounded toward zero to bf16 (the low 16 bits cut) or to E4M3 (3 fraction bits, exponents
    >= -6), as float32: a truncating store, the fault model."""
    x = x.float().contiguous()
    if fmt == "bfloat16":
        return (x.view(torch.int32) & -65536).view(torch.float32)
    _, ex = torch.frexp(x)
    step = torch.exp2((torch.clamp(ex - 1, min=-6) - 3).float())
    return torch.trunc(x / step) * step


def _fp8_groups(torch, x, group: int, ue8m0: bool, toward_zero: bool = False):
    """Dynamic FP8 per ``group`` columns in float32: (dequantized values, E4M3 codes, scales [M, C/group]);
    ``toward_zero``: the codes rounded toward zero (a fault)."""
    m, k = x.shape
    xg = x.reshape(m, k // group, group)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    codes = (_toward_zero(torch, xg / s, "e4m3") if toward_zero else xg / s).to(torch.float8_e4m3fn)
    return (codes.float() * s).reshape(m, k), codes.reshape(m, k), s.reshape(m, -1)


class TorchLayer:
    """The layer in torch on one device; ``run(gemm=..., fault=..., variant=..., ep=...)``. The weights are
    stacked once; :meth:`on` gives the same weights with another case's tokens and routing."""

    def __init__(self, lay, dev):
        import torch

        self.torch, self.dev = torch, dev
        cfg = lay.config
        self.fp8 = lay.scheme.startswith("fp8")
        self.ue8m0 = lay.scheme.endswith("ue8m0")
        self.w13 = _stack_weights(list(lay.weights.w13), torch, dev)
        self.w2 = _stack_weights(list(lay.weights.w2), torch, dev)
        self.shared = None
        if cfg.shared_experts is not None:
            self.shared = (_stack_weights([cfg.shared_experts.w13], torch, dev),
                           _stack_weights([cfg.shared_experts.w2], torch, dev))
        self._tokens(lay)

    def _tokens(self, lay):
        torch, dev = self.torch, self.dev
        self.lay = lay
        self.x = torch.from_numpy(lay.hidden).to(dev)
        self.ids = torch.from_numpy(lay.topk_ids.astype(np.int64)).to(dev)
        self.w = torch.from_numpy(lay.topk_weights.astype(np.float32)).to(dev)
        counts = np.bincount(lay.topk_ids[lay.topk_ids >= 0], minlength=len(lay.weights.w13))
        self.busiest = int(counts.argmax())
        self.gemm2_store = "gemm2" not in lay.excluded_stores  # single_rounding_layer: GEMM2 into the sum in FP32

    def on(self, lay) -> "TorchLayer":
        """This layer's stacked weights with ``lay``'s tokens and routing (``lay``: a :func:`token_case` of the
        layer this one was built from)."""
        import copy

        other = copy.copy(self)
        other._tokens(lay)
        return other

    def _gemm(self, a, w, rows_expert, kind, faulty_rows=None, k_cut=None, out_dtype=None):
        """``a [R, C]`` float32 (exact bf16 or FP8 values) times ``w[e] [N, C]`` per row's expert, bf16 output
        (``out_dtype=torch.float32``: FP32 output, ``bf16`` and ``split_k`` kinds only)."""
        torch = self.torch
        out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
        if out_dtype != torch.bfloat16 and kind not in ("bf16", "split_k"):
            raise ValueError(f"{kind} stores its output in bf16, and single_rounding_layer declares GEMM2's output "
                             "unstored (FP32 into the top-k sum)")
        out = torch.empty(a.shape[0], w.shape[1], dtype=out_dtype, device=a.device)
        experts = torch.unique(rows_expert).tolist()
        if kind == "grouped_mm":
            order = torch.argsort(rows_expert, stable=True)
            counts = torch.bincount(rows_expert, minlength=w.shape[0])
            offs = torch.cumsum(counts, 0).to(torch.int32)
            res = torch._grouped_mm(a[order].to(torch.bfloat16), w.transpose(-2, -1), offs=offs)
            out[order] = res.to(torch.bfloat16)
            return out
        for e in experts:
            sel = torch.nonzero(rows_expert == e).flatten()
            ae, we = a[sel], w[e]
            if k_cut is not None and e == faulty_rows:
                ae, we = ae[:, :k_cut], we[:, :k_cut]
            if kind == "bf16" and out_dtype == torch.float32:  # FP32 GEMM of bf16-exact values (TF32 off)
                out[sel] = ae.to(torch.bfloat16).float() @ we.float().T
            elif kind == "bf16":
                out[sel] = ae.to(torch.bfloat16) @ we.T
            elif kind == "split_k":
                half = ae.shape[1] // 2
                p1 = ae[:, :half].to(torch.bfloat16).float() @ we[:, :half].float().T
                p2 = ae[:, half:].to(torch.bfloat16).float() @ we[:, half:].float().T
                out[sel] = (p2 + p1).to(out_dtype)
            elif kind.startswith("scaled_mm"):
                # rowwise FP8: per-row scale 2^ceil(log2(amax / 448)) (exact: every row's amax is 448 * 2^j)
                amax = ae.abs().amax(1, keepdim=True).clamp(min=1e-30)
                sa = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
                a8 = (ae / sa).to(torch.float8_e4m3fn)
                w8 = we.float().to(torch.float8_e4m3fn)
                m = a8.shape[0]
                pad = (-m) % 16
                if pad:
                    a8 = torch.cat([a8, torch.zeros(pad, a8.shape[1], dtype=a8.dtype, device=a8.device)])
                    sa = torch.cat([sa, torch.ones(pad, 1, device=sa.device)])
                r = torch._scaled_mm(a8, w8.T, scale_a=sa.float(), scale_b=torch.ones(1, w8.shape[0], device=a8.device),
                                     out_dtype=torch.bfloat16, use_fast_accum=kind.endswith("fast"))
                out[sel] = r[:m]
            else:
                raise ValueError(kind)
        return out

    def run(self, gemm: str = "bf16", fault: str | None = None, variant: str | None = None, ep=None):
        """The layer's bf16 output. ``ep``: an :class:`moeref.distributed.EPPlacement`; each rank sums the slots
        of its experts into its own FP32 partial output, and the partials are added in rank order."""
        torch = self.torch
        lay, cfg = self.lay, self.lay.config
        m, k = self.x.shape
        ids, w = self.ids.clone(), self.w.clone()
        if fault == "renormalized_weights":
            w = w / w.sum(1, keepdim=True).clamp(min=1e-30)
        if fault == "swapped_topk_weights":
            w[0, [0, 1]] = w[0, [1, 0]].clone()
        if fault == "neighbour_expert":
            ids[0, 0] = (ids[0, 0] + 1) % self.w13.shape[0]
        g1 = 128 if lay.scheme.startswith("fp8_1x128") else k
        a = _fp8_groups(torch, self.x, g1, self.ue8m0)[0] if self.fp8 else self.x.to(torch.bfloat16).float()
        chunks = [(0, m)] if variant != "chunks_of_32" else [(s, min(s + 32, m)) for s in range(0, m, 32)]
        out = torch.zeros(m, k, device=self.dev)
        for s0, s1 in chunks:
            tok, slot = torch.nonzero(ids[s0:s1] >= 0, as_tuple=True)
            tok = tok + s0
            ex = ids[tok, slot]
            y = self._mlp(a[tok], ex, self.w13, self.w2, gemm, fault, variant, lay.weights)
            contrib = w[tok, slot][:, None] * y.float()
            if variant == "reverse_topk":
                for j in range(ids.shape[1] - 1, -1, -1):
                    sel = slot == j
                    out.index_add_(0, tok[sel], contrib[sel])
            elif ep is not None:
                owner = torch.from_numpy(np.array(ep.owner, np.int64)).to(self.dev)[ex]
                for r in range(ep.ep_size):
                    sel = owner == r
                    part = torch.zeros(m, k, device=self.dev)
                    part.index_add_(0, tok[sel], contrib[sel])
                    out += part
            else:
                out.index_add_(0, tok, contrib)
        if self.shared is not None:
            zero = torch.zeros(m, dtype=torch.int64, device=self.dev)
            out = out + self._mlp(a, zero, self.shared[0], self.shared[1], gemm, None, variant,
                                  cfg.shared_experts.as_weights()).float()
        res = out.to(torch.bfloat16)
        if fault == "rz_output_store":
            res = _toward_zero(torch, out, "bfloat16").to(torch.bfloat16)
        if fault == "last_bit_noise":
            flat = res.view(torch.int16).reshape(-1)
            gen = torch.Generator(device="cpu").manual_seed(1)
            idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 200)].to(self.dev)
            flat[idx] ^= 1
        return res

    def _mlp(self, a, ex, w13, w2, gemm, fault, variant, weights):
        torch = self.torch
        lay, cfg = self.lay, self.lay.config
        n = w2.shape[2]
        kind1 = "split_k" if variant == "split_k" else gemm
        k_cut = a.shape[1] - 128 if fault == "skipped_last_k_block" else None
        if fault == "rz_gemm1_store":  # FP32 GEMM1, then a truncating bf16 store
            h = _toward_zero(torch, self._gemm(a, w13, ex, kind1, out_dtype=torch.float32), "bfloat16")
        else:
            h = self._gemm(a, w13, ex, kind1, self.busiest, k_cut).float()
        if weights.b13 is not None:
            h = h + torch.from_numpy(np.asarray(weights.b13, np.float32)).to(self.dev)[ex]
        h = h.to(torch.bfloat16).float()
        layout = weights.w13_layout
        if layout == "interleaved":
            gate, up = h[:, 0::2], h[:, 1::2]
        elif layout == "up_gate":
            up, gate = h[:, :n], h[:, n:]
        else:
            gate, up = h[:, :n], h[:, n:]
        if fault == "gate_up_swapped":
            sel = (ex == self.busiest)[:, None]
            gate, up = torch.where(sel, up, gate), torch.where(sel, gate, up)
        if cfg.activation == "silu_and_mul":
            x = torch.nn.functional.silu(gate) * up
        elif cfg.activation == "gelu_and_mul":
            x = torch.nn.functional.gelu(gate, approximate="tanh" if fault == "tanh_gelu" else "none") * up
        else:
            gc = gate.clamp(max=7.0)
            x = (up.clamp(-7.0, 7.0) + 1) * gc * torch.sigmoid(1.702 * gc)
        if cfg.act_out_dtype is not None or not self.fp8:
            x = _toward_zero(torch, x, "bfloat16") if fault == "rz_intermediate" and not self.fp8 else \
                x.to(torch.bfloat16).float()
        if self.fp8:
            x = _fp8_groups(torch, x, 128 if lay.scheme.startswith("fp8_1x128") else n, self.ue8m0,
                            toward_zero=fault == "rz_intermediate")[0]
        w2u = w2
        if fault == "halved_w2_scale_block":
            w2u = w2.clone()  # the 128x128 block holding the busiest expert's first nonzero weight (exact-regime
            nz = torch.nonzero(w2[self.busiest])  # w2 is sparse: a block of zeros halved would change nothing)
            r0, c0 = (int(v) // 128 * 128 for v in nz[0]) if nz.shape[0] else (0, 0)
            w2u[self.busiest, r0:r0 + 128, c0:c0 + 128] *= 0.5
        stored = self.gemm2_store or fault == "second_gemm2_store"
        y = self._gemm(x, w2u, ex, gemm, out_dtype=None if stored else torch.float32).float()
        if weights.b2 is not None:
            y = y + torch.from_numpy(np.asarray(weights.b2, np.float32)).to(self.dev)[ex]
        return y.to(torch.bfloat16) if stored else y


# ------------------------------------------------------------------ fastpath.moe


def fast_layer(lay, dev, dev_weights=None):
    """``(weights, shared experts or None)`` of ``lay`` as :func:`fastpath.moe.fused_moe` takes them, on ``dev``
    (stacked once per model; every case of the model's layer reuses them). ``dev_weights``: the layer's weights
    already stacked on ``dev`` (:func:`moeref.moe.device.device_weights`, the reference's): FP8 and bf16 layers
    use those tensors (no second host stack and upload); MXFP4 layers are packed from ``lay.weights``."""
    import torch

    from fastpath.moe import fast_weights

    weights = lay.weights
    if dev_weights is not None and not lay.scheme.startswith("mxfp4"):
        weights = dev_weights
    elif lay.scheme == "bf16":  # fastpath takes float experts as stacked tensors (MXFP4 and FP8: quantized tensors)
        from dataclasses import replace

        weights = replace(weights, w13=_stack_weights(list(weights.w13), torch, dev),
                          w2=_stack_weights(list(weights.w2), torch, dev))
    shared = None
    if lay.config.shared_experts is not None:
        shared = fast_weights(lay.config.shared_experts, dev)
    return fast_weights(weights, dev), shared


def deep_gemm_available() -> bool:
    """Whether ``deep_gemm`` imports (its rows run on FP8 layers only)."""
    return deep_gemm_version() != "absent"


def _fast_inputs(lay, dev):
    import torch

    return (torch.from_numpy(lay.hidden).to(dev).to(torch.bfloat16), torch.from_numpy(lay.topk_weights).to(dev),
            torch.from_numpy(lay.topk_ids).to(dev))


def _impls(lay) -> list:
    return ["triton"] + (["deep_gemm"] if lay.scheme.startswith("fp8") and deep_gemm_available() else [])


def fastpath_runs(lay, dev, activation_params=None, *, fast=None):
    """``{name: callable -> bf16 tensor}`` for fastpath.moe's implementations that can run here, with the layer's
    activation and ``activation_params`` (default: the layer's own, ``lay.config.activation_params``); ``fast``:
    :func:`fast_layer` of the layer's weights (default: made here)."""
    from fastpath.moe import fused_moe

    fw, shared = fast_layer(lay, dev) if fast is None else fast
    hidden, tw, ids = _fast_inputs(lay, dev)
    params = dict(lay.config.activation_params if activation_params is None else activation_params)
    runs = {}
    for impl in _impls(lay):
        for layout in ("contiguous", "masked"):
            for capturable in (False, True):
                name = f"fastpath.moe {impl} {layout}" + (" capturable" if capturable else "")
                runs[name] = (lambda impl=impl, layout=layout, capturable=capturable: fused_moe(
                    hidden, fw, tw, ids, impl=impl, activation=lay.config.activation, activation_params=params,
                    layout=layout, shared_experts=shared, capturable=capturable))
    return runs


def shard_weights(fw, experts):
    """The experts ``experts`` (int64 tensor of expert ids, on ``fw``'s device) of :class:`fastpath.moe.FastMoEWeights`
    ``fw``: every per-expert tensor (4-bit :class:`fastpath.grouped_gemm_w4.W4Experts` fields included) selected
    along its first dimension, on the device (an EP rank's weights without a second upload)."""
    from dataclasses import replace

    from fastpath.grouped_gemm_w4 import W4Experts

    def sel(t):
        if t is None:
            return None
        if isinstance(t, W4Experts):
            return replace(t, codes=sel(t.codes), scales=sel(t.scales), global_mul=sel(t.global_mul),
                           global_div=sel(t.global_div), zero_points=sel(t.zero_points))
        return t.index_select(0, experts)

    return replace(fw, w13=sel(fw.w13), w2=sel(fw.w2), w13_scales=sel(fw.w13_scales), w2_scales=sel(fw.w2_scales),
                   b13=sel(fw.b13), b2=sel(fw.b2))


def ep_name(placement) -> str:
    """``"4 EP shards (linear)"``: how the implementations' names say which shards ran."""
    n = placement.ep_size
    return f"{n} EP shard{'s' if n != 1 else ''} ({placement.strategy})"


def fastpath_ep_runs(lay, dev, placement, *, fast=None):
    """``{name: callable -> bf16 tensor}``: :func:`fastpath.moe.fused_moe` (contiguous; Triton, and DeepGEMM on FP8
    layers when it imports) on the EP shards of ``placement`` (an :class:`moeref.distributed.EPPlacement` of the
    layer's experts): rank ``r`` runs its experts (:func:`shard_weights`) with its ``expert_map`` (global ids in,
    non-local slots contribute 0) and an FP32 output; the ranks' partial outputs are added in rank order in FP32
    and stored once in bf16 (shared experts, if any, on rank 0). In an exact regime the top-k sum is exact in FP32
    in any order, so the shards' sum gives the reference's bits."""
    import torch

    from fastpath.moe import fused_moe

    fw, shared = fast_layer(lay, dev) if fast is None else fast
    hidden, tw, ids = _fast_inputs(lay, dev)
    params = dict(lay.config.activation_params)

    def run(impl):
        total = None
        for r in range(placement.ep_size):
            local = torch.as_tensor(placement.local_logical_experts(r), device=hidden.device)
            part = fused_moe(hidden, shard_weights(fw, local), tw, ids, impl=impl, activation=lay.config.activation,
                             activation_params=params, expert_map=placement.expert_map(r),
                             num_experts=placement.num_physical, out_dtype=torch.float32,
                             shared_experts=shared if r == 0 else None)
            total = part if total is None else total + part
        return total.to(torch.bfloat16)

    return {f"fastpath.moe {impl} contiguous, {ep_name(placement)}": (lambda impl=impl: run(impl))
            for impl in _impls(lay)}


# ------------------------------------------------------------------ driver


def deep_gemm_version() -> str:
    """``deep_gemm.__version__`` (``"unknown"`` when it has none), or ``"absent"`` when it does not import."""
    try:
        import deep_gemm
    except Exception:  # noqa: BLE001 - DeepGEMM is optional
        return "absent"
    return str(getattr(deep_gemm, "__version__", "unknown"))


def _count(ref: np.ndarray, got) -> int:
    g = np.asarray(got.float().cpu().numpy() if hasattr(got, "cpu") else got, dtype=np.float32)
    return int(np.count_nonzero(~((ref == g) | (np.isnan(ref) & np.isnan(g)))))


def _shape(lay) -> dict:
    return dict(hidden=int(lay.hidden.shape[1]), intermediate=int(np.asarray(lay.weights.w2[0].shape)[1]),
                experts=len(lay.weights.w13), distinct_experts=len({id(w) for w in lay.weights.w13}),
                top_k=int(lay.topk_ids.shape[1]), scheme=lay.scheme, activation=lay.config.activation)


def run_model(model: str, args, log) -> dict:
    """One model: ``{"entries": [...], "draws": [...], "seconds": s}``. An entry per ``--tokens`` count (the
    implementations' differing outputs, the planted faults at the first count), a draw per ``--draws`` case
    (its parameters and the implementations' differing outputs); ``seconds``: the model's wall time, the
    layer's construction and the weights' uploads included. The layer is built once (at the largest count) and
    its weights are stacked on the device once (torch, fastpath and the reference's each)."""
    import torch

    from moeref.distributed import ep_placement
    from moeref.regimes import ROUNDING_LAYER_ACTIVATIONS, ROUNDING_LAYER_SCHEMES

    t_model = time.time()
    single = args.regime == "single_rounding"
    spec = MODELS[model]
    if single and (spec["scheme"] not in ROUNDING_LAYER_SCHEMES or spec["activation"] not in ROUNDING_LAYER_ACTIVATIONS
                   or spec.get("bias")):
        return {"entries": [{"model": model, "regime": args.regime, "supported": False,
                             "why": f"single_rounding_layer has no {spec['scheme']} / {spec['activation']} / bias "
                                    "construction"}], "draws": [], "seconds": 0.0}
    t0 = time.time()
    base = make_case(model, max(args.tokens), tiny=args.tiny, seed=args.seed, expert_pool=args.expert_pool,
                     regime=args.regime)
    reduced = bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    common = {"model": model, "regime": args.regime, "supported": True, "bf16_reduced_precision_reduction": reduced,
              "case_seconds": round(time.time() - t0, 2), "shape": _shape(base)}
    dev = torch.device(args.device)
    t0 = time.time()
    try:
        tl = TorchLayer(base, dev)
    except Exception:  # noqa: BLE001
        return {"entries": [dict(common, tokens=max(args.tokens), implementations={}, faults={},
                                 torch_layer_error=traceback.format_exc()[-800:])], "draws": [],
                "seconds": round(time.time() - t_model, 2)}
    dev_weights = fast = None
    fast_error = None
    if args.device != "cpu":
        from moeref.moe.device import device_weights

        dev_weights = device_weights(base.weights, args.device)  # the reference's, stacked once
        try:
            fast = fast_layer(base, dev, dev_weights)
        except Exception as exc:  # noqa: BLE001 - recorded in every entry's fastpath row
            fast_error = f"{type(exc).__name__}: {exc}"[:400]
    common["weights_seconds"] = round(time.time() - t0, 2)
    log(f"{model}: layer {common['case_seconds']} s, weights on the device {common['weights_seconds']} s")
    ctx = dict(args=args, log=log, dev=dev, single=single, dev_weights=dev_weights, fast=fast, fast_error=fast_error)
    e = common["shape"]["experts"]
    n_ep = min(args.ep_size, e)
    entries = []
    for i, tokens in enumerate(args.tokens):
        lay = first_tokens(base, tokens)
        log(f" {model}, {tokens} tokens")
        entries.append(dict(common, tokens=tokens, **_run_case(
            lay, tl.on(lay), ctx, faults=i == 0, ep_torch=ep_placement(e, n_ep, "round_robin"),
            ep_fast=ep_placement(e, n_ep, "linear"))))
    draws = []
    try:
        params = drawn_parameters(args.draws, max(args.tokens), e, seed=args.seed) if args.draws else []
    except Exception as exc:  # noqa: BLE001 - e.g. no Hypothesis here: the fixed cases stand
        params = []
        draws.append({"model": model, "regime": args.regime, "error": f"{type(exc).__name__}: {exc}"[:400]})
    for j, d in enumerate(params):
        lay = drawn_case(base, d)
        log(f" {model}, draw {j}: {d}")
        pl = ep_placement(e, d.ep_size, d.ep_strategy)
        draws.append(dict({"model": model, "regime": args.regime, "draw": j, "params": asdict(d), "tokens": d.tokens},
                          **_run_case(lay, tl.on(lay), ctx, faults=False, ep_torch=pl, ep_fast=pl)))
    seconds = round(time.time() - t_model, 2)
    log(f"{model}: {seconds} s")
    return {"entries": entries, "draws": draws, "seconds": seconds}


def _run_case(lay, tl, ctx: dict, *, faults: bool, ep_torch, ep_fast) -> dict:
    """The implementations (and with ``faults`` the planted faults) on one case ``lay`` of a model's layer:
    ``{"implementations", "faults", "reference_seconds"}``, with ``in_regime`` at tiny shapes (from the values
    where the case has no certificate) and ``skipped`` (the DeepGEMM rows where it does not import)."""
    from moeref.regimes import layer_in_exact_regime

    args, log, dev, single = ctx["args"], ctx["log"], ctx["dev"], ctx["single"]
    res = {"implementations": {}, "faults": {}}
    t0 = time.time()
    if args.device == "cpu":
        host_run = lay.reference()
        out = host_run.out
    else:
        from moeref.moe import run_moe

        host_run = None
        out = run_moe(lay.hidden, ctx["dev_weights"], lay.topk_weights, lay.topk_ids, lay.config,
                      device=args.device).out
    ref = np.asarray(out.float().cpu().numpy() if hasattr(out, "cpu") else np.asarray(out, np.float32), np.float32)
    res["reference_seconds"] = round(time.time() - t0, 2)
    if args.tiny:
        ok, why = layer_in_exact_regime(lay, "fp32" if single and lay.scheme == "bf16" else "hopper_fp8",
                                        run=host_run)
        res["in_regime"] = {"ok": bool(ok), "reasons": why[:3]}

    def record(table, name, fn):
        t = time.time()
        try:
            got = fn()
            table[name] = {"differing": _count(ref, got), "of": int(ref.size), "seconds": round(time.time() - t, 3)}
        except Exception as exc:  # noqa: BLE001 - every implementation is optional here
            table[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        log(f"  {name}: {table[name]}")

    impl = res["implementations"]
    record(impl, "torch eager bf16", lambda: tl.run("bf16"))
    record(impl, "torch eager bf16, split-K GEMM1", lambda: tl.run("bf16", variant="split_k"))
    record(impl, "torch eager bf16, top-k sum reversed", lambda: tl.run("bf16", variant="reverse_topk"))
    record(impl, "torch eager bf16, chunks of 32 tokens", lambda: tl.run("bf16", variant="chunks_of_32"))
    record(impl, f"torch eager bf16, {ep_name(ep_torch)}", lambda: tl.run("bf16", ep=ep_torch))
    record(impl, "torch._grouped_mm (CUTLASS)", lambda: tl.run("grouped_mm"))
    if lay.scheme.startswith("fp8"):
        record(impl, "torch._scaled_mm rowwise (cuBLAS)", lambda: tl.run("scaled_mm"))
        record(impl, "torch._scaled_mm rowwise, fast accumulation", lambda: tl.run("scaled_mm_fast"))
    if args.device != "cpu":
        if lay.scheme.startswith("fp8") and not deep_gemm_available():
            res["skipped"] = {"fastpath.moe deep_gemm": "deep_gemm does not import (DeepGEMM absent)"}
        if ctx["fast"] is None:
            impl["fastpath.moe"] = {"error": ctx["fast_error"]}
        else:
            try:
                runs = fastpath_runs(lay, dev, fast=ctx["fast"])
                runs.update(fastpath_ep_runs(lay, dev, ep_fast, fast=ctx["fast"]))
                for name, fn in runs.items():
                    record(impl, name, fn)
            except Exception as exc:  # noqa: BLE001
                impl["fastpath.moe"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    if not faults:
        return res
    for fault in FAULTS + (SINGLE_ROUNDING_FAULTS if single else ()):
        if fault == "tanh_gelu" and (lay.config.activation != "gelu_and_mul" or single):
            continue  # single_rounding_layer has no GELU probes: every gate is saturated
        record(res["faults"], fault, lambda fault=fault: tl.run("bf16", fault=fault))
    if args.device != "cpu" and ctx["fast"] is not None and lay.config.activation == "gelu_and_mul" \
            and lay.config.activation_params.get("approximate", "none") == "none":
        record(res["faults"], "fastpath_tanh_gelu", lambda: fastpath_runs(
            lay, dev, {"approximate": "tanh"}, fast=ctx["fast"])["fastpath.moe triton contiguous"]())
    for f in res["faults"].values():
        if "differing" in f:
            f["caught"] = f["differing"] > 0
    return res


def time_check(model: str, args, log, tokens: int) -> dict:
    """Interleaved rounds (bench.interleaved, wall clock) of the reference alone against the exact-regime check:
    the reference, then :func:`moeref.regimes.layer_in_exact_regime` (``hopper_fp8``; the layer's certificate)
    and :func:`moeref.regimes.moe_equality_report` of a candidate output (a copy of the reference's, where a
    kernel's output would go). On a GPU the reference is ``run_moe(device=...)`` on weights stacked on the
    device once (``weights_to_device_s``) and the candidate a device tensor; on the CPU the NumPy reference.
    ``check_over_reference``: the median per-round ratio; ``added_over_reference``: the regime check and the
    comparison, timed alone, over the reference's median. The arithmetic: ``hopper_fp8`` for FP8 layers, ``fp32``
    for bf16 ones; ``--regime single_rounding`` times :func:`moeref.regimes.single_rounding_layer`."""
    from bench.interleaved import WallClock, time_interleaved
    from moeref.moe import run_moe
    from moeref.regimes import layer_in_exact_regime, moe_equality_report

    t0 = time.perf_counter()
    lay = make_case(model, tokens, tiny=args.tiny, seed=args.seed, expert_pool=args.expert_pool,
                    shape=args.shape, regime=args.regime)
    arithmetic = "hopper_fp8" if lay.scheme.startswith("fp8") else "fp32"
    res = {"model": model, "regime": args.regime, "arithmetic": arithmetic, "tokens": tokens,
           "expert_pool": args.expert_pool or "distinct",
           "case_seconds": round(time.perf_counter() - t0, 2), "device": args.device,
           "shape": dict(hidden=int(lay.hidden.shape[1]), intermediate=int(np.asarray(lay.weights.w2[0].shape)[1]),
                         experts=len(lay.weights.w13), top_k=int(lay.topk_ids.shape[1]), scheme=lay.scheme),
           "certificate": lay.certificate is not None}
    if args.device == "cpu":
        def reference():
            return lay.reference()

        def sync():
            pass
    else:
        import torch

        from moeref.moe.device import device_weights

        t = time.perf_counter()
        on_device = device_weights(lay.weights, args.device)  # stacked once, as a kernel's weights would be
        res["weights_to_device_s"] = time.perf_counter() - t

        def reference():
            return run_moe(lay.hidden, on_device, lay.topk_weights, lay.topk_ids, lay.config, device=args.device)

        def sync():
            torch.cuda.synchronize()
    first = reference()
    sync()
    out = first.out
    candidate = out.clone() if hasattr(out, "clone") else np.array(out, copy=True)

    def ref_case():
        reference()
        sync()

    verdicts = []

    def check_case():
        run = reference()
        ok = layer_in_exact_regime(lay, arithmetic, run=run if args.device == "cpu" else None)
        rep = moe_equality_report(candidate, run)
        sync()
        verdicts.append(bool(ok.ok) and rep.passed)

    r = time_interleaved({"reference": ref_case, "check": check_case}, baselines=["reference"], rounds=args.rounds,
                         clock=WallClock())
    ratio = r.ratios["check"]["reference"].median
    res.update(reference_s=r.cases["reference"].median_s, check_s=r.cases["check"].median_s,
               check_over_reference=round(1.0 / ratio, 4) if ratio > 0 else None,
               check_passed=all(verdicts), flagged=r.flagged, rounds=args.rounds)
    for name, fn in (("in_regime_certificate_s", lambda: layer_in_exact_regime(lay, arithmetic)),
                     ("equality_s", lambda: moe_equality_report(candidate, first))):
        t = time.perf_counter()
        fn()
        res[name] = time.perf_counter() - t
    # what the check adds to the reference, from its parts (robust where rounds are noisy)
    res["added_over_reference"] = (res["in_regime_certificate_s"] + res["equality_s"]) / res["reference_s"]
    if args.time_values:
        t = time.perf_counter()
        host_run = lay.reference()
        res["host_reference_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ok = layer_in_exact_regime(lay, arithmetic, run=host_run, from_values=True)
        res["in_regime_from_values_s"] = time.perf_counter() - t
        res["in_regime_from_values_ok"] = bool(ok.ok)
    log(f"{model}: {res}")
    return res


def _free_device_memory() -> None:
    """Return the finished model's device memory to CUDA (the next model's weights need it): fastpath.moe's graph
    cache (whose keys hold the weights) is cleared first."""
    import gc

    try:
        import torch

        from fastpath.moe import clear_graph_cache

        clear_graph_cache()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - no torch or no fastpath: nothing to free
        gc.collect()


def main(argv=None) -> dict:
    args = parse_args(argv)
    out_path = args.out or os.path.join(os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")),
                                        "regime_check_time.json" if args.time_check else "exact_regimes.json")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:] if argv is None else list(argv), "models": []}
    try:
        import torch

        result["torch"] = torch.__version__
        result["cuda"] = torch.version.cuda or "absent"  # None on a CPU-only build
        if torch.cuda.is_available():
            result["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    result["deep_gemm"] = deep_gemm_version()

    def log(msg):
        print(msg, flush=True)

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    if not args.time_check:
        result.update(draws=[], model_seconds={})
    for model in args.models:
        try:
            if args.time_check:
                for tokens in args.tokens:
                    result["models"].append(time_check(model, args, log, tokens))
            else:
                r = run_model(model, args, log)
                result["models"] += r["entries"]
                result["draws"] += r["draws"]
                result["model_seconds"][model] = r["seconds"]
        except Exception:  # noqa: BLE001
            result["models"].append({"model": model, "error": traceback.format_exc()[-1500:]})
        _free_device_memory()
        save()
    if not args.time_check:
        log(f"seconds per model: {result['model_seconds']}, total {round(sum(result['model_seconds'].values()), 1)}")
    log(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
