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
``bench/report_fault_catch.py`` makes the table of docs/error-bounds.md from it. This script is the driver (the
emulated kernel, the checks, the run and its JSON); the cases and input faults are in ``bench/fault_catch/cases.py``,
the torch layer, its internal faults and the fault lists in ``bench/fault_catch/layer.py``.
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
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.fault_catch.cases import (LAYERS, SHAPES, Case, exact_case, general_case, reference,  # noqa: E402
                                    single_rounding_case)
from bench.fault_catch.layer import Hooks, TorchLayer, Variant, faults, honest  # noqa: E402


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
