"""Decode-sized latency of every fast path on a GPU (issue 20): eager, CUDA-graph replay, host overhead, floor.

For each case of :mod:`bench.latency_cases` (every quantization kernel of ``fastpath.quant`` /
``fastpath.fused`` and every dispatch kernel of ``fastpath.dispatch``) and each M of ``--Ms`` (1, 8, 64,
512 tokens), these are timed in the same interleaved rounds (:mod:`bench.interleaved`: >= 7 rounds, CUDA
events around a calibrated number of back-to-back calls, median / min-max / spread, flagged over 10%):

* ``eager``: the fast path's call as a decode step issues it (``validate=False``; no host sync);
* ``eager, before``: the same call with the host path as it was before issue 20's changes, timed in
  the same rounds (launches through ``kernel[grid]``, dispatch's three-kernel sort head:
  :func:`bench.latency_cases.before_variant`); its outputs are checked equal to ``eager``'s;
* ``graph``: the same call captured once in a CUDA graph, replayed (the device work, plus one replay's
  launch). Before timing, the replay's outputs are compared with the eager call's bit for bit;
* ``floor``: for each Triton launch the call makes, an empty Triton kernel launched on the same grid
  with the same arguments (:func:`bench.latency_cases.empty_launcher`): the launch cost no host code can
  go below through ``kernel[grid](...)``;
* ``floor (cached launcher)``: the same empty kernels launched through their ``CompiledKernel.run``
  (:func:`bench.latency_cases.direct_launcher`): what a per-shape cached launcher would pay;
* ``torch eager`` and ``torch.compile`` (``mode="reduce-overhead"``: CUDA graphs) of the torch
  implementation, where one exists (compiled at ``--compile-Ms`` within ``--compile-budget-s``).

Host overhead = eager - graph, per round, median reported. Target (issue 20): <= 15 us, or <= 1.5 x
the floor where the floor is above 15 us. JSON (``bench_latency.json``) carries the GPU, driver, CUDA,
torch, triton and date; ``bench/report_latency.py`` writes docs/fastpaths-latency.md from it.

Run: ``python bench/bench_latency_gpu.py --out OUTDIR [--Ms 1,8,64,512] [--only SUBSTR,..]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.interleaved import FLAG_SPREAD, MIN_ROUNDS, CudaEventClock, machine_meta, time_interleaved  # noqa: E402
from bench.latency_cases import (all_cases, before_variant, bits_equal, capture, direct_launcher,  # noqa: E402
                                 empty_launcher, record_launches, tensors)

TARGET_US = 15.0
FLOOR_FACTOR = 1.5


def run_meta(args) -> dict:
    return {**machine_meta(), "rounds": args.rounds, "round_ms": args.round_ms, "flag_spread": FLAG_SPREAD,
            "target_us": TARGET_US, "floor_factor": FLOOR_FACTOR, "label": args.label}


def _calls(fn, clock, target_s):
    t = max(clock.measure(fn, 3), 1e-7)
    return int(min(500, max(3, round(target_s / t))))


def overhead_met(overhead_us: float, floor_us: float) -> bool:
    """The issue's target on medians: <= 15 us, or <= 1.5 x the floor where the floor is above 15 us."""
    return overhead_us <= TARGET_US or (floor_us > TARGET_US and overhead_us <= FLOOR_FACTOR * floor_us)


def measure_case(case, M: int, args, compile_state: dict) -> dict:
    rec: dict = {"case": case.name, "group": case.group, "M": M}
    state = case.make(M)
    fn = lambda: case.fast(state)  # noqa: E731
    want = tensors(fn())
    fn()
    torch.cuda.synchronize()
    _, launches = record_launches(fn)
    rec["launches"] = len(launches)
    rec["kernels"] = [l_.kernel for l_ in launches]
    rec["args_per_launch"] = [len(l_.values) for l_ in launches]
    cases = {"eager": fn, "eager, before": before_variant(case, state)}
    got_before = tensors(cases["eager, before"]())
    rec["before_equal"] = len(got_before) == len(want) and all(bits_equal(a, b) for a, b in zip(want, got_before))
    try:
        g, out = capture(fn)
        g.replay()
        torch.cuda.synchronize()
        got = tensors(out)
        rec["graph_equal"] = len(got) == len(want) and all(bits_equal(a, b) for a, b in zip(want, got))
        cases["graph"] = g.replay
    except Exception as e:  # reported, not hidden
        rec["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.synchronize()
    cases["floor"] = empty_launcher(launches)
    try:
        cases["floor (cached launcher)"] = direct_launcher(launches)
    except Exception as e:
        rec["direct_error"] = f"{type(e).__name__}: {e}"[:300]
    if case.torch is not None:
        tfn = lambda: case.torch(state)  # noqa: E731
        try:
            tfn()
            cases["torch eager"] = tfn
        except Exception as e:
            rec["torch_error"] = f"{type(e).__name__}: {e}"[:300]
        if M in args.compile_Ms and time.time() - compile_state["t0"] < args.compile_budget_s:
            try:
                torch._dynamo.reset()
                cfn_ = torch.compile(case.torch, mode="reduce-overhead", dynamic=False)
                t0 = time.time()
                for _ in range(3):
                    cfn_(state)
                torch.cuda.synchronize()
                rec["compile_s"] = time.time() - t0
                cases["torch.compile"] = lambda: cfn_(state)
            except Exception as e:
                rec["compile_error"] = f"{type(e).__name__}: {e}"[:300]
        elif M in args.compile_Ms:
            rec["compile_error"] = "skipped: --compile-budget-s spent"
    for f in cases.values():  # warm-up (compiles the empty kernels)
        f()
    torch.cuda.synchronize()
    clock = CudaEventClock()
    calls = {n: _calls(f, clock, args.round_ms * 1e-3) for n, f in cases.items()}
    res = time_interleaved(cases, rounds=args.rounds, calls_per_round=calls, clock=clock, warmup=0)
    rec["cases"] = {n: {"median_us": c.median_s * 1e6, "min_us": c.min_s * 1e6, "max_us": c.max_s * 1e6,
                        "spread": c.spread, "flagged": c.flagged, "calls_per_round": calls[n]}
                    for n, c in res.cases.items()}
    rec["flagged"] = res.flagged
    if "graph" in cases:
        per = [(e - g_) * 1e6 for e, g_ in zip(res.cases["eager"].seconds, res.cases["graph"].seconds)]
        rec["overhead_us"] = {"median": statistics.median(per), "min": min(per), "max": max(per), "per_round": per}
        fl = rec["cases"]["floor"]["median_us"]
        rec["met"] = overhead_met(rec["overhead_us"]["median"], fl)
        per_b = [(e - g_) * 1e6 for e, g_ in zip(res.cases["eager, before"].seconds, res.cases["graph"].seconds)]
        rec["overhead_before_us"] = {"median": statistics.median(per_b), "min": min(per_b), "max": max(per_b)}
        sp = [b / e for b, e in zip(res.cases["eager, before"].seconds, res.cases["eager"].seconds)]
        rec["speedup_vs_before"] = statistics.median(sp)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--Ms", default="1,8,64,512")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--round-ms", type=float, default=3.0, help="time per case and round (calls calibrated)")
    ap.add_argument("--compile-Ms", default="1", help="sizes at which torch.compile is timed ('' for none)")
    ap.add_argument("--compile-budget-s", type=float, default=150.0)
    ap.add_argument("--time-budget-s", type=float, default=1e9, help="stop starting new rows after this")
    ap.add_argument("--label", default="", help="a label for this run (e.g. the commit)")
    args = ap.parse_args(argv)
    args.compile_Ms = {int(m) for m in args.compile_Ms.split(",") if m}
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    meta = run_meta(args)
    print(f"device {meta['gpu']} driver {meta['driver']} torch {meta['torch']} triton {meta['triton']} "
          f"date {meta['date']}", flush=True)
    cases = all_cases("cuda")
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only.split(","))]
    results = {"meta": meta, "rows": []}
    t_start = time.time()
    compile_state = {"t0": time.time()}
    path = os.path.join(args.out, "bench_latency.json")
    for M in [int(m) for m in args.Ms.split(",")]:
        for case in cases:
            if time.time() - t_start > args.time_budget_s:
                results.setdefault("skipped", []).append([case.name, M])
                continue
            try:
                rec = measure_case(case, M, args, compile_state)
            except Exception as e:  # reported, not hidden
                rec = {"case": case.name, "group": case.group, "M": M, "error": f"{type(e).__name__}: {e}"[:300]}
            results["rows"].append(rec)
            with open(path, "w") as fh:
                json.dump(results, fh, indent=1)
            c = rec.get("cases", {})

            def us(n):
                return f"{c[n]['median_us']:8.1f}" if n in c else "       -"
            oh = rec.get("overhead_us", {}).get("median")
            print(f"M={M:4d} {case.name[:40]:40s} L={rec.get('launches', '-')!s:>2} eager {us('eager')} "
                  f"before {us('eager, before')} graph "
                  f"{us('graph')} overhead {oh if oh is None else round(oh, 1)!s:>6} floor {us('floor')} "
                  f"cached {us('floor (cached launcher)')} torch {us('torch eager')} compile {us('torch.compile')}"
                  f"{'' if rec.get('graph_equal', True) else '  GRAPH != EAGER'}"
                  f"{'  ' + rec['error'] if 'error' in rec else ''}{'  ' + rec['graph_error'] if 'graph_error' in rec else ''}",
                  flush=True)
    results["wall_s"] = time.time() - t_start
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
