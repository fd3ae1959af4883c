"""Where the host time of an eager ``fastpath.moe.fused_moe`` call goes at decode sizes, and what the graph
cache leaves of it (issue 33). DeepSeek-V3 FP8 layer of ``bench/bench_moe_device.py`` (hidden 7168,
intermediate 2048, 256 experts, top-8, FP8 1x128 x 128x128), random codes and routing.

* ``timing``: host wall time per call (``--calls`` back-to-back calls, one ``torch.cuda.synchronize`` after
  them, divided by the calls; the median and min-max of ``--rounds`` rounds, the cases rotating each round)
  at each of ``--tokens``, per implementation, of the three eager forms (the default call, ``capturable=True``
  contiguous, ``capturable=True`` masked) with the graph cache off (``graph_cache=False``) and on, beside the
  caller's own CUDA graph of the capturable call replayed (contiguous and masked). Every cached and replayed
  result is checked bit for bit against the uncached call (``equal`` in the JSON).
* ``profile``: ``cProfile`` of ``--profile-calls`` calls of each eager form at ``--profile-tokens`` (cache off
  and on): per stage of the call (the host check of the ids, the a1 quantization, the dispatch, the two
  grouped GEMMs, the fused activation + a2 quantization, the reduce; with the cache: the key, the replay)
  the cumulative host time per call under the profiler, the rest (``other``: the glue, views, small torch
  ops), the calls per call of Triton's launcher, of the fast paths' cached launch and of ``torch.empty``, and
  the functions with the most own time.

JSON to ``--out`` (``meta``: the machine, :func:`bench.interleaved.machine_meta`); ``--table FILE`` prints the
markdown tables of a JSON file without a GPU.

    python bench/studies/eager_host_profile.py --out docs/data/eager_host_profile_h200.json
    python bench/studies/eager_host_profile.py --table docs/data/eager_host_profile_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

STAGES = [
    ("ids checked on the host (device -> host copy, sync)", [("moeref/routing/ids.py", "check_topk_ids"),
                                                            ("moeref/_interop.py", "to_numpy")]),
    ("a1 quantization", [("fastpath/quant/__init__.py", "quantize")]),
    ("dispatch (sort, rank, fill; tight sizes: counts to the host)", [("fastpath/dispatch.py", "to_contiguous"),
                                                                      ("fastpath/dispatch.py", "to_masked")]),
    ("token rows scattered (DeepGEMM)", [("fastpath/_dispatch_sort.py", "_scatter_rows")]),
    ("grouped GEMMs (2)", [("fastpath/grouped_gemm.py", "grouped_gemm_contiguous"),
                           ("fastpath/grouped_gemm.py", "grouped_gemm_masked")]),
    ("activation + a2 quantization", [("fastpath/fused.py", "_fused")]),
    ("weight-and-reduce", [("fastpath/_dispatch_finalize.py", "_reduce")]),
    ("graph cache: key", [("fastpath/moe.py", "_graph_key")]),
    ("graph cache: replay (graph launch)", [("torch/cuda/graphs.py", "replay")]),
]
COUNTED = [("Triton launcher (JITFunction.run)", ("triton/runtime/jit.py", "run")),
           ("cached launch (fastpath._host.launch)", ("fastpath/_host.py", "launch")),
           ("planned launch (PlannedLaunch.__call__)", ("fastpath/_host.py", "__call__")),
           ("torch.empty", ("~", "<built-in method torch.empty>")),
           ("graph replays", ("torch/cuda/graphs.py", "replay"))]
FORMS = {"default": dict(), "capturable": dict(capturable=True), "masked": dict(capturable=True, layout="masked")}


def _layer():
    import torch

    from bench.bench_moe_device import deepseek_v3_layer
    from fastpath.moe import FastMoEWeights

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = deepseek_v3_layer(256, gen)
    fw = FastMoEWeights(w.w13.codes.view(torch.float8_e4m3fn), w.w2.codes.view(torch.float8_e4m3fn), "gate_up",
                        w.w13.scales.float(), w.w2.scales.float())
    return fw, gen


def _inputs(m, gen):
    import torch

    from bench.bench_moe_device import routing

    x = torch.randn((m, 7168), device="cuda", generator=gen).to(torch.bfloat16)
    tw, ids = routing(m, 256, 8, gen)
    return x, tw, torch.as_tensor(ids, device="cuda")


def _wall_ms(fn, calls: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def timing(fw, gen, tokens, impls, calls: int, rounds: int) -> list[dict]:
    import torch

    from bench.latency_cases import capture
    from fastpath.moe import fused_moe

    rows = []
    pool = torch.cuda.graph_pool_handle()
    for m in tokens:
        x, tw, ids = _inputs(m, gen)
        fns, equal = {}, {}
        for impl in impls:
            want = fused_moe(x, fw, tw, ids, impl=impl, graph_cache=False)
            for form, kw in FORMS.items():
                for cache in (False, True):
                    fn = (lambda impl=impl, kw=kw, cache=cache:
                          fused_moe(x, fw, tw, ids, impl=impl, graph_cache=cache, **kw))
                    for _ in range(3):  # compiles; the cache captures on a key's second call
                        got = fn()
                    equal[f"{impl} {form} cache={'on' if cache else 'off'}"] = bool(torch.equal(got, want))
                    fns[(impl, form, "on" if cache else "off")] = fn
            for layout in ("contiguous", "masked"):
                g, out = capture(lambda impl=impl, layout=layout: fused_moe(
                    x, fw, tw, ids, impl=impl, layout=layout, capturable=True, graph_cache=False), pool=pool)
                g.replay()
                torch.cuda.synchronize()
                equal[f"{impl} graph {layout}"] = bool(torch.equal(out, want))
                fns[(impl, f"graph_{layout}", "graph")] = g.replay
        names = list(fns)
        per = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                per[n].append(_wall_ms(fns[n], calls))
        for (impl, form, cache), t in per.items():
            rows.append(dict(tokens=m, impl=impl, form=form, cache=cache, median_ms=statistics.median(t),
                             min_ms=min(t), max_ms=max(t)))
        rows.append(dict(tokens=m, equal=equal))
        print(f"{m} tokens: " + "  ".join(f"{i}/{f}/{c}={statistics.median(t):.3f}" for (i, f, c), t in per.items()),
              flush=True)
        print(f"  equal: {equal}", flush=True)
    return rows


def _match(key, file_suffix: str, name: str) -> bool:
    f, _, fn = key
    if file_suffix == "~":
        return f == "~" and fn.startswith(name)
    return fn == name and f.replace(os.sep, "/").endswith(file_suffix)


def stages_of(stats: dict, calls: int) -> dict:
    """Per-call host time by stage (ms, cumulative under the profiler), the total, counts per call, and the
    functions with the most own time, from ``pstats.Stats(...).stats``."""
    total = max(ct for (_, _, _, ct, _) in stats.values())  # the outermost call's cumulative time
    out, used = {}, 0.0
    for stage, fns in STAGES:
        t = sum(v[3] for k, v in stats.items() for fs, n in fns if _match(k, fs, n))
        if t:
            out[stage] = t / calls * 1e3
            used += t
    out["other (glue, views, small torch ops)"] = max(0.0, total - used) / calls * 1e3
    counts = {label: sum(v[1] for k, v in stats.items() if _match(k, *pat)) / calls for label, pat in COUNTED}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:20]
    return dict(total_ms=total / calls * 1e3, stages_ms=out, calls_per_call=counts,
                top_own_time=[dict(function=f"{os.path.basename(k[0])}:{k[1]} {k[2]}"[:120],
                                   calls_per_call=v[1] / calls, own_us_per_call=v[2] / calls * 1e6)
                              for k, v in top])


def profile(fw, gen, tokens, impls, calls: int) -> list[dict]:
    from fastpath.moe import fused_moe

    rows = []
    for m in tokens:
        x, tw, ids = _inputs(m, gen)
        for impl in impls:
            for form, kw in FORMS.items():
                for cache in (False, True):
                    def fn(impl=impl, kw=kw, cache=cache):
                        return fused_moe(x, fw, tw, ids, impl=impl, graph_cache=cache, **kw)

                    for _ in range(3):
                        fn()
                    prof = cProfile.Profile()

                    def run(fn=fn):
                        for _ in range(calls):
                            fn()
                    prof.runcall(run)
                    st = pstats.Stats(prof).stats
                    row = dict(tokens=m, impl=impl, form=form, cache="on" if cache else "off", calls=calls,
                               **stages_of(st, calls))
                    rows.append(row)
                    print(f"profile {m} tokens {impl} {form} cache={row['cache']}: {row['total_ms']:.3f} ms/call; "
                          + ", ".join(f"{k} {v:.3f}" for k, v in row["stages_ms"].items()), flush=True)
    return rows


def table(data: dict) -> str:
    """Markdown tables of a JSON file of this script."""
    meta = data.get("meta", {})
    out = [f"Measured on an {meta.get('gpu')}, {meta.get('date')}, torch {meta.get('torch')}, triton "
           f"{meta.get('triton')}: host wall time per call, median (min-max) of {data.get('rounds')} rounds of "
           f"{data.get('calls')} back-to-back calls.", "",
           "| tokens | implementation | call | graph cache off, ms | graph cache on, ms | on / graph replay |",
           "|---|---|---|---|---|---|"]
    rows = [r for r in data.get("timing", []) if "form" in r]
    graph = {(r["tokens"], r["impl"], r["form"]): r for r in rows if r["cache"] == "graph"}
    for r in rows:
        if r["cache"] != "off":
            continue
        on = next(o for o in rows if (o["tokens"], o["impl"], o["form"], o["cache"]) ==
                  (r["tokens"], r["impl"], r["form"], "on"))
        g = graph.get((r["tokens"], r["impl"], "graph_masked" if r["form"] == "masked" else "graph_contiguous"))
        rel = f"{on['median_ms'] / g['median_ms']:.2f}" if g else ""
        out.append(f"| {r['tokens']} | {r['impl']} | {r['form']} | {r['median_ms']:.3f} ({r['min_ms']:.3f}-"
                   f"{r['max_ms']:.3f}) | {on['median_ms']:.3f} ({on['min_ms']:.3f}-{on['max_ms']:.3f}) | {rel} |")
    for (m, impl, form), g in graph.items():
        out.append(f"| {m} | {impl} | caller's CUDA graph, {form[6:]} | | {g['median_ms']:.3f} ({g['min_ms']:.3f}-"
                   f"{g['max_ms']:.3f}) | 1.00 |")
    prof = data.get("profile", [])
    if prof:
        stages = list(dict.fromkeys(s for r in prof for s in r["stages_ms"]))
        out += ["", "Host time per call by stage under `cProfile` (ms; the profiler's own cost inflates the total):", "",
                "| stage | " + " | ".join(f"{r['tokens']} tok, {r['impl']}, {r['form']}, cache {r['cache']}"
                                           for r in prof) + " |",
                "|---|" + "---|" * len(prof)]
        for s in stages + ["total"]:
            vals = [r["total_ms"] if s == "total" else r["stages_ms"].get(s) for r in prof]
            out.append(f"| {s} | " + " | ".join("" if v is None else f"{v:.3f}" for v in vals) + " |")
        for label, _ in COUNTED:
            out.append(f"| calls per call: {label} | " + " | ".join(f"{r['calls_per_call'][label]:.0f}"
                                                                 for r in prof) + " |")
    return "\n".join(out)


BEGIN, END = "<!-- eager-host-profile:begin -->", "<!-- eager-host-profile:end -->"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--profile-tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--impls", nargs="+", default=["triton", "deep_gemm"])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile-calls", type=int, default=50)
    ap.add_argument("--out", default="bench_out/eager_host_profile.json")
    ap.add_argument("--table", default=None, help="print the tables of this JSON file and exit (no GPU needed)")
    ap.add_argument("json", nargs="*", help="with --docs: the JSON file whose tables the page shows")
    ap.add_argument("--docs", default=None, help="write the tables of the JSON given into this page (between "
                    f"{BEGIN} and {END}) and exit (no GPU needed)")
    ap.add_argument("--check", action="store_true", help="with --docs: write nothing, exit 1 if the page differs")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    if args.docs:
        from bench.docs_page import update_page

        if len(args.json) != 1:
            ap.error("--docs takes one JSON file")
        with open(args.json[0]) as f:
            body = table(json.load(f))
        return update_page(args.docs, BEGIN, END, body, check=args.check,
                           remedy=f"run python bench/studies/eager_host_profile.py {args.json[0]} --docs {args.docs}")
    from bench.interleaved import machine_meta
    from fastpath.grouped_gemm import grouped_gemm_supports

    impls = [i for i in args.impls if grouped_gemm_supports(i)[0]]
    fw, gen = _layer()
    data = dict(meta=machine_meta(), calls=args.calls, rounds=args.rounds, impls=impls,
                skipped={i: grouped_gemm_supports(i)[1] for i in args.impls if i not in impls})
    data["profile"] = profile(fw, gen, args.profile_tokens, impls, args.profile_calls)
    data["timing"] = timing(fw, gen, args.tokens, impls, args.calls, args.rounds)
    from fastpath.moe import graph_cache_info

    data["graph_cache"] = graph_cache_info()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
