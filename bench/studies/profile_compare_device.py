"""Profile ``compare`` of a device-engine reference run at the DeepSeek-V3 layer: where its time goes.

The layer of ``bench/bench_moe_device.py`` (hidden 7168, intermediate 2048, 256 experts, top-8, FP8 1x128 x
128x128, bf16 GEMM1 store, float32 activation, bf16 output; random FP8 weights made on the GPU) and its random
top-8 routing. Per token count:

* seconds (median of ``--rounds`` after one warm-up): the reference ``run_moe(device="cuda")``, ``layer_bound``
  and ``compare`` under ``--profile`` (default ``HOPPER_FP8_DEEPGEMM_DATA``), and compare minus the bound (the
  report's extras);
* host synchronizations of the CUDA stream in ``layer_bound`` and in ``compare`` (torch's sync debug mode), with
  the moeref source lines that asked for them (``--sync-sites``);
* per-stage wall seconds of ``layer_bound`` (each stage function of :mod:`moeref.compare.device.layer` timed
  between two ``torch.cuda.synchronize()``: a separate pass, since the waits change the overlap);
* the top CUDA kernels of ``layer_bound`` and of ``compare`` (torch.profiler, one call each), CUDA total and wall.

The candidate is the reference's own bf16 output (``run.out``): no fast path (and no DeepGEMM build) is needed,
and ``compare``'s work does not depend on the candidate's values unless an element violates. Runs against
whatever ``moeref`` is first on ``sys.path`` (this checkout's parent by default; ``--root`` another), so the
same script profiles two trees. JSON to ``--out``.

    python bench/studies/profile_compare_device.py [--tokens 128 4096] [--rounds 3] [--out bench_out/profile_compare.json]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
import traceback
import warnings


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."),
                    help="the checkout whose moeref is profiled (default: this script's)")
    ap.add_argument("--label", default="", help="a name for this tree in the JSON (e.g. baseline / changed)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    ap.add_argument("--profile", default="HOPPER_FP8_DEEPGEMM_DATA",
                    help="the compare profile; an emulated one (DEEPGEMM_FP8_EXACT, TRITON_FP8_BLOCK_EXACT) with the "
                    "run's float32 activation store")
    ap.add_argument("--sync-sites", type=int, default=15, help="source lines of host syncs listed")
    ap.add_argument("--out", default="bench_out/profile_compare.json")
    return ap.parse_args(argv)


STAGES = {  # module -> functions timed as stages of layer_bound (those that exist in the profiled tree)
    "moeref.compare.device.layer": ["device_rows_error_bound", "device_store_interval", "device_requant",
                                    "activation_error", "activation_magnitude", "_weight_and_reduce",
                                    "weighted_slot_sums_t", "gated_silu_stage_t", "_same_operand",
                                    "device_emulated_gemm"],
    "moeref.compare.device.emulated": [],
    "moeref.moe.device": ["_weights_gemm"],
    "moeref.moe.pipeline": ["_activation"],
}


@contextlib.contextmanager
def _stage_timers(torch, seconds: dict):
    """Wrap the stage functions: each outermost call is timed between two synchronizations into ``seconds``."""
    import importlib

    saved, depth = [], [0]

    def wrap(name, fn):
        def timed(*a, **k):
            if depth[0]:
                return fn(*a, **k)
            depth[0] += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.synchronize()
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
                depth[0] -= 1
        return timed

    for mod_name, names in STAGES.items():
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError:  # a tree from before the device engine moved to moeref.compare.device
            mod = importlib.import_module(mod_name.replace("moeref.compare.device.", "moeref.compare.device_"))
        for n in names:
            if hasattr(mod, n):
                saved.append((mod, n, getattr(mod, n)))
                setattr(mod, n, wrap(n, getattr(mod, n)))
    try:
        yield
    finally:
        for mod, n, fn in saved:
            setattr(mod, n, fn)


def _syncs(torch, fn, sites: int):
    """``(count, [(site, count)])``: host synchronizations during ``fn()`` (torch's sync debug mode warns once
    per sync, from C++ through Python's ``warnings``) and the innermost moeref/fastpath source line on the
    Python stack of each."""
    where: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-1] if "/moeref/" in f.filename or "/fastpath/" in f.filename]
        f = stack[-1] if stack else None
        where["?" if f is None else f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum(where.values()), where.most_common(sites)


def _profile(torch, fn, top: int):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows = []
    for ev in prof.key_averages():  # the device's own events (kernels, copies, memsets): no op counted twice
        if not str(getattr(ev, "device_type", "")).endswith("CUDA"):
            continue
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0.0)
        if dev_us > 0:
            rows.append(dict(name=ev.key[:90], calls=int(ev.count), cuda_s=dev_us / 1e6))
    rows.sort(key=lambda r: -r["cuda_s"])
    sync_cpu = [ev for ev in prof.key_averages() if ev.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                                "cudaMemcpyAsync", "cudaHostAlloc")]
    return dict(wall_profiled_s=wall, cuda_total_s=sum(r["cuda_s"] for r in rows), top=rows[:top],
                host_calls={ev.key: dict(calls=int(ev.count), cpu_s=ev.cpu_time_total / 1e6) for ev in sync_cpu})


def main(argv=None) -> int:
    args = _args(argv)
    sys.path.insert(0, os.path.abspath(args.root))
    import torch

    import moeref
    from bench.bench_moe_device import deepseek_v3_layer, routing
    from dataclasses import replace

    from moeref.compare import compare, get_profile, layer_bound
    from moeref.moe import MoEQuant, run_moe
    from moeref.quant import fp8_group

    prof = get_profile(args.profile)
    if prof.accum_model == "emulated":  # the run below stores the activation in float32
        prof = replace(prof, act_out_dtype="float32")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = deepseek_v3_layer(args.experts, gen)
    quant = MoEQuant(fp8_group(), fp8_group(), "fp8 1x128 (DeepGEMM)")
    kw = dict(quant=quant, gemm1_out_dtype="bfloat16", act_out_dtype="float32", out_dtype="bfloat16")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                moeref=os.path.dirname(moeref.__file__), label=args.label, experts=args.experts, rounds=args.rounds,
                profile=prof.name)
    print(f"{meta['gpu']} {meta['date']} torch {meta['torch']}; moeref from {meta['moeref']} ({args.label})")
    rows = []
    for m in args.tokens:
        x = torch.randn((m, 7168), device="cuda", generator=gen).to(torch.bfloat16)
        tw, ids = routing(m, args.experts, 8, gen)

        def sync_time(fn):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0, out

        _, run = sync_time(lambda: run_moe(x, weights, tw, ids, device="cuda", **kw))  # warm-up: compiles
        rep = compare(run.out, run, prof)
        ref_t, lb_t, cmp_t = [], [], []
        for _ in range(args.rounds):
            del run
            t, run = sync_time(lambda: run_moe(x, weights, tw, ids, device="cuda", **kw))
            ref_t.append(t)
            lb_t.append(sync_time(lambda: layer_bound(run, prof))[0])
            t, rep = sync_time(lambda: compare(run.out, run, prof))
            cmp_t.append(t)
        med = {k: statistics.median(v) for k, v in (("reference_s", ref_t), ("layer_bound_s", lb_t),
                                                    ("compare_s", cmp_t))}
        row = dict(tokens=m, **med, compare_minus_bound_s=med["compare_s"] - med["layer_bound_s"],
                   compare_over_reference=med["compare_s"] / med["reference_s"],
                   times=dict(reference=ref_t, layer_bound=lb_t, compare=cmp_t),
                   passed=rep.passed, flips=int(rep.flips), peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        row["layer_bound_syncs"], row["layer_bound_sync_sites"] = _syncs(torch, lambda: layer_bound(run, prof),
                                                                         args.sync_sites)
        row["compare_syncs"], row["compare_sync_sites"] = _syncs(torch, lambda: compare(run.out, run, prof),
                                                                 args.sync_sites)
        stages: dict = {}
        with _stage_timers(torch, stages):
            row["staged_layer_bound_s"] = sync_time(lambda: layer_bound(run, prof))[0]
        row["stages_s"] = dict(sorted(stages.items(), key=lambda kv: -kv[1]))
        row["profile_layer_bound"] = _profile(torch, lambda: layer_bound(run, prof), args.top)
        row["profile_compare"] = _profile(torch, lambda: compare(run.out, run, prof), args.top)
        rows.append(row)
        print(f"--- {m} tokens: reference {med['reference_s']:.3f} s, layer_bound {med['layer_bound_s']:.3f} s, "
              f"compare {med['compare_s']:.3f} s (x{row['compare_over_reference']:.2f} of the reference); "
              f"syncs: layer_bound {row['layer_bound_syncs']}, compare {row['compare_syncs']}; "
              f"passed {rep.passed}, flips {rep.flips}")
        print("  stages (synchronized pass, s): " + ", ".join(f"{k} {v:.3f}" for k, v in row["stages_s"].items())
              + f"; whole {row['staged_layer_bound_s']:.3f}")
        print("  sync sites (layer_bound): " + "; ".join(f"{s} x{c}" for s, c in row["layer_bound_sync_sites"]))
        for name in ("profile_layer_bound", "profile_compare"):
            p = row[name]
            print(f"  {name}: CUDA {p['cuda_total_s']:.3f} s of {p['wall_profiled_s']:.3f} s wall (profiled); "
                  + ", ".join(f"{k} x{v['calls']} {v['cpu_s']:.3f} s" for k, v in p["host_calls"].items()))
            for r in p["top"]:
                print(f"    {r['cuda_s']:8.4f} s  x{r['calls']:<5d} {r['name']}")
        del run, rep
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
