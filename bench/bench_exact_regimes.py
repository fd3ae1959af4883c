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
  declares); and on EP shards (:func:`~bench.exact_regimes.fastpath_runs.fastpath_ep_runs`): the layer run once
  per rank of an :func:`moeref.distributed.ep_placement` with that rank's experts and expert map, each rank's FP32
  partial sum added in rank order, then one bf16 store;
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
first tokens (:func:`~bench.exact_regimes.models.token_case`). ``--draws N`` adds N cases per model drawn by
Hypothesis (:func:`~bench.exact_regimes.draws.draw_strategy`, through :func:`moeref.testing.draw_cases`: derandomized,
distinct): a token count up to the largest ``--tokens`` (:func:`moeref.strategies.token_counts`, the counts around 128
included), a routing kind of :data:`moeref.testing.cases.CASE_KINDS` with its seed, padding tokens or none, and the EP
shards (:func:`moeref.strategies.ep_shards`: 1 to 8 ranks, linear or round-robin);
:func:`~bench.exact_regimes.draws.drawn_case` makes the case from the model's layer (token rows drawn from it, the
routing's ids, power-of-two top-k weights) and every implementation runs on it. The JSON's ``draws`` lists each draw's
parameters and differing outputs.

    python bench/bench_exact_regimes.py [--models deepseek_v3 qwen3_30b_a3b] [--tokens 128 512] [--draws 4]
    python bench/bench_exact_regimes.py --tiny --device cpu     # the CPU-runnable parts at tiny shapes (CI)
    python bench/bench_exact_regimes.py --regime single_rounding --models deepseek_v3 qwen3_30b_a3b

``--regime single_rounding`` runs :func:`moeref.regimes.single_rounding_layer` instead (FP8 and bf16 models): every
declared store rounds, and GEMM2's output goes into the top-k sum in FP32, so the torch pipeline keeps it in FP32,
the implementations that store it in bf16 (``torch._grouped_mm``, ``torch._scaled_mm`` here; any kernel that does)
differ by design, and :data:`~bench.exact_regimes.torch_layer.SINGLE_ROUNDING_FAULTS` are planted too.

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

This script is the driver (the arguments, each model's run, ``--time-check``, the JSON); its parts are the package
``bench/exact_regimes/``: the models and their layers in ``models.py``, the drawn cases in ``draws.py``, the torch
eager layer and its planted faults in ``torch_layer.py``, the ``fastpath.moe`` runs in ``fastpath_runs.py``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import asdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.exact_regimes.draws import drawn_case, drawn_parameters  # noqa: E402
from bench.exact_regimes.fastpath_runs import (deep_gemm_available, deep_gemm_version, ep_name,  # noqa: E402
                                               fast_layer, fastpath_ep_runs, fastpath_runs)
from bench.exact_regimes.models import DEFAULT_MODELS, MODELS, first_tokens, make_case  # noqa: E402
from bench.exact_regimes.torch_layer import FAULTS, SINGLE_ROUNDING_FAULTS, TorchLayer  # noqa: E402


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


# ------------------------------------------------------------------ driver


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
