"""Where the decode time of ``fastpath.moe`` goes in a CUDA graph, and which Triton tiles serve each of its two
grouped GEMMs (issue 33). DeepSeek-V3 FP8 layer (hidden 7168, intermediate 2048, 256 experts, top-8, FP8 1x128
activations x 128x128 weights, random codes and routing: ``bench/bench_moe_device.py``), masked layout,
``capturable=True``, ``impl="triton"``.

Phases, in this order (each case guarded: an error is recorded and the others run; ``--budget-s`` stops
starting new cases). Every timing is interleaved rounds (``bench.interleaved``, medians and min-max) with a
device-to-device copy of the bytes the case reads (the touched experts' FP8 weight codes) in the same rounds:
the case's roofline is those bytes read once at the copy's bandwidth (read + written bytes per second, as
docs/moe-gpu.md defines it), half the copy's time; ``of_roofline`` is the median of the per-round ratios.

1. ``node_floor``: a graph of 16 dependent kernels doing nothing (``t.add_(1)``; a Triton kernel of 1 program
   and of one program per SM, plainly and with PDL): what each kernel node of the layer's graph costs at
   least, and what Programmatic Dependent Launch would take off each boundary.
2. ``breakdown``: the default layer at 1 token as a one-call graph, its replay time (CUDA events), and the
   kernel timeline of ``--profile-replays`` replays under ``torch.profiler`` (CUDA activity): per kernel its
   stage (a1 quant, dispatch, GEMM1, act+requant, GEMM2, finalize, by place), median duration, start and the
   idle gap before it; the span, busy and idle time of a replay.
3. ``ablation``: the layer against the same launches with stages left out (post-dispatch, GEMM1+act+GEMM2,
   GEMM1+GEMM2, each GEMM), on the operands recorded from one eager call; differences give what the a1 quant
   and the dispatch, the reduce and the activation cost the graph.
4. ``gemm_sweep``: each grouped GEMM alone with the layer's own operands over the tiles ``GemmTiles(16,
   BLOCK_N, 128, warps, stages, swap_ab=True)``, BLOCK_N 64/128/256, 4/8 warps, 3-6 stages (the kernel has
   no split-K), a graph of ``--gemm-calls`` calls per tile; each tile's output on the routed rows checked bit
   for bit against the default tile's (only equal tiles are ranked).
5. ``layer``: the whole layer (``fused_moe(..., tiles=(gemm1, gemm2))``) with the default tiles and the
   combinations of the ``--top`` fastest tiles of each GEMM, a graph of ``--calls`` calls each, outputs
   checked bit for bit against the default's; then the best combination's breakdown and ablation.
6. ``tokens``: at each of ``--tokens`` (1, 4, 8), the default and the best combination as a one-call graph
   replayed (the figure of docs/moe-gpu.md) and as a ``--calls`` graph.
7. ``dispatch_ab``: the masked layout's sort, rank and fill as one launch
   (``fastpath._dispatch_sort.SMALL_CAPACITY_FUSED``) against three: the layouts compared first (the layer
   runs only if they are equal), then the layer with each, outputs compared bit for bit, and the one-launch
   layer's timeline. Last, because a wrong layout could fault the GEMMs.
8. ``gemm_sweep_tokens``: the GEMM sweep at the largest token count, if time is left.
9. ``act_rows_ab`` ("act over routed rows"): at each of ``--tokens``, the layer with the fused act+quant launch
   over the layout's row tiles (``skip_rows``: a program per tile of 4096 rows at 1 token, padding tiles returning
   at once) and over the routed rows only (``rows``: a program per tile of the ``m * top_k`` slots;
   ``fastpath._moe_layer.ACT_ROUTED_ROWS_AT_DECODE``), each a graph of ``--calls`` calls and a one-call graph,
   interleaved with the copy, and the routed rows on smaller tiles (:data:`ACT_ROWS_AB`); outputs compared bit
   for bit; at 1 token the routed-rows layer's kernel timeline. ``--only act_rows_ab`` runs this phase alone (no
   tile sweep: a few minutes of device time less).
10. ``decode_ab``: at each of ``--tokens``, the layer with the switches of
   ``bench.studies.decode_graph.phases.DECODE_AB`` (the decode dispatch kernel,
   ``fastpath._dispatch_sort.DECODE_CAPACITY_SLOTS``; the decode reduce tile, ``REDUCE_DECODE_TOKENS``; the a1
   quantization branch, ``fastpath._moe_layer.A1_QUANT_BRANCH``; Programmatic Dependent Launch, ``DECODE_PDL``)
   against the layer without the first two, each a graph of ``--calls`` calls and a one-call graph, interleaved
   with the copy; the layouts compared before any layer runs, every output compared bit for bit; at 1 token the
   kernel timelines with the defaults and with PDL. ``--only decode_ab`` runs the graph node floor and this phase
   alone.

Kernels are compiled in parallel before the sweep (Triton's ``AsyncCompileMode``; ``--serial-compile`` turns it
off). ONE JSON to ``--out``, and a table of the best tile per GEMM, the layer combinations and the breakdown.
The timing, the layer and the phases are in ``bench/studies/decode_graph/`` (``timing``, ``layer``, ``timeline``,
``phases``); this script runs them in order and prints the report.

    python bench/studies/decode_graph_sweep.py --out bench_out/decode_graph_sweep.json
    python bench/studies/decode_graph_sweep.py --smoke   # CPU, TRITON_INTERPRET=1, tiny layer: the code paths
    python bench/studies/decode_graph_sweep.py --only act_rows_ab --out bench_out/act_rows_ab.json
    python bench/studies/decode_graph_sweep.py --only decode_ab --out bench_out/decode_ab.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.studies.decode_graph.layer import (  # noqa: E402,F401 - re-exported: the study's names stay here
    build,
    compile_in_parallel,
    gemm_fn,
    layer_fn,
    record_gemms,
    record_stages,
    routed_rows,
    short,
    stage_fn,
    sweep_tiles,
    weight_bytes,
)
from bench.studies.decode_graph.phases import (  # noqa: E402,F401
    ACT_ROWS_AB,
    DECODE_AB,
    ablation,
    act_routed_rows,
    act_rows_ab,
    decode_ab,
    dispatch_ab,
    gemm_sweep,
    layer_sweep,
    one_program_dispatch,
    ranked,
)
from bench.studies.decode_graph.timeline import breakdown, node_floor, timeline  # noqa: E402,F401
from bench.studies.decode_graph.timing import Run, copy_case, err, stats, time_with_roofline  # noqa: E402,F401

SHAPE = dict(hidden=7168, inter=2048, experts=256, top_k=8)
SMOKE_SHAPE = dict(hidden=256, inter=128, experts=16, top_k=4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=4, help="layer calls per graph in the layer sweep")
    ap.add_argument("--gemm-calls", type=int, default=8, help="GEMM calls per graph in the GEMM sweep")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per case and round")
    ap.add_argument("--profile-replays", type=int, default=20)
    ap.add_argument("--top", type=int, default=3, help="fastest bit-equal tiles per GEMM combined in the layer")
    ap.add_argument("--budget-s", type=float, default=170.0, help="no new case starts past this (s from start)")
    ap.add_argument("--serial-compile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny layer, no graphs")
    ap.add_argument("--out", default="bench_out/decode_graph_sweep.json")
    ap.add_argument("--only", choices=["act_rows_ab", "decode_ab"], default=None, help="run this phase alone")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.reps, args.gemm_calls, args.calls, args.tokens = 7, 1, 1, 1, [1, 2]
        args.profile_replays, args.budget_s = 1, 3600.0
    run = Run(args)
    res: dict = dict(meta={}, args=vars(args))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save():
        res["meta"]["wall_s"] = time.perf_counter() - run.t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    if not args.smoke:
        from bench.interleaved import machine_meta

        res["meta"].update(machine_meta())
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    res["meta"]["shape"] = shape
    tiles = sweep_tiles(args.smoke)
    default = run.default
    fw, cases = build(run, shape, sorted(set(args.tokens) | {1}))
    one = cases[1]
    res["meta"]["touched_experts"] = {m: weight_bytes(fw, c[2])["touched"] for m, c in cases.items()}
    if args.only == "act_rows_ab":
        res["act_rows_ab"] = act_rows_ab(run, fw, {m: cases[m] for m in sorted(set(args.tokens))},
                                         (default, default), args.calls, args.reps, args.profile_replays)
        save()
        report(res)
        return 0
    if args.only == "decode_ab":
        try:
            res["node_floor"] = node_floor(run)
        except Exception as e:  # noqa: BLE001
            res["node_floor"] = dict(error=err(e))
        res["decode_ab"] = decode_ab(run, fw, {m: cases[m] for m in sorted(set(args.tokens))},
                                     (default, default), args.calls, args.reps, args.profile_replays)
        save()
        report(res)
        return 0

    # compile every GEMM tile in parallel (the layer's other kernels compile on its first call)
    t = time.perf_counter()
    try:
        calls = record_gemms(fw, one)
        with compile_in_parallel(run):
            for call, tl_ in itertools.product(calls, tiles):
                try:
                    gemm_fn(call, tl_)()
                except Exception:  # noqa: BLE001 - a tile that cannot compile fails again, recorded, in the sweep
                    pass
        del calls
        res["meta"]["compile_s"] = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001
        res["meta"]["compile_error"] = err(e)
    run.sync()

    try:
        res["node_floor"] = node_floor(run)
    except Exception as e:  # noqa: BLE001
        res["node_floor"] = dict(error=err(e))
    try:
        res["breakdown"] = {"default": breakdown(run, layer_fn(fw, one), args.profile_replays)}
    except Exception as e:  # noqa: BLE001
        res["breakdown"] = {"default": dict(error=err(e))}
    save()

    try:
        res["ablation"] = {"default": ablation(run, fw, one, (default, default), args.calls, args.reps)}
    except Exception as e:  # noqa: BLE001
        res["ablation"] = {"default": dict(error=err(e))}
    save()

    try:
        res["gemm_sweep"] = gemm_sweep(run, fw, one, tiles, args.gemm_calls, args.reps)
    except Exception as e:  # noqa: BLE001
        res["gemm_sweep"] = {g: dict(error=err(e), rows=[], tokens=1, touched=0, bytes=0) for g in ("gemm1", "gemm2")}
    save()

    best = {g: ranked(res["gemm_sweep"][g]["rows"], args.top) for g in ("gemm1", "gemm2")}
    by_str = {str(t_): t_ for t_ in tiles}
    b1 = [by_str.get(r["tiles"]) for r in best["gemm1"] if r["tiles"] in by_str]
    b2 = [by_str.get(r["tiles"]) for r in best["gemm2"] if r["tiles"] in by_str]
    combos = {"default": (default, default)}
    for x, y in itertools.product(b1 or [default], b2 or [default]):
        if (x, y) != (default, default):
            combos.setdefault(f"{short(x)} | {short(y)}", (x, y))
    if b1 and b1[0] != default:
        combos.setdefault(f"{short(b1[0])} | {short(default)}", (b1[0], default))
    if b2 and b2[0] != default:
        combos.setdefault(f"{short(default)} | {short(b2[0])}", (default, b2[0]))
    res["layer"], ref1 = layer_sweep(run, fw, one, combos, args.calls, args.reps)
    save()

    lay = res["layer"]["cases"]
    ok = [(n, c) for n, c in lay.items() if n != "copy" and "median_us" in c and c.get("bits_equal_default")]
    best_name = min(ok, key=lambda nc: nc[1]["median_us"])[0] if ok else "default"
    best_pair = combos.get(best_name, (default, default))
    res["best"] = dict(name=best_name, gemm1=str(best_pair[0]), gemm2=str(best_pair[1]))
    g1 = next((r for r in res["gemm_sweep"]["gemm1"]["rows"] if r.get("default") and "median_us" in r), None)
    g2 = next((r for r in res["gemm_sweep"]["gemm2"]["rows"] if r.get("default") and "median_us" in r), None)
    if g1 and g2 and "median_us" in lay.get("default", {}):
        res["summary"] = dict(layer_us=lay["default"]["median_us"], gemm1_alone_us=g1["median_us"],
                              gemm2_alone_us=g2["median_us"],
                              outside_gemms_us=lay["default"]["median_us"] - g1["median_us"] - g2["median_us"],
                              layer_roofline_us=lay["default"].get("roofline_us"),
                              gemm1_roofline_us=g1.get("roofline_us"), gemm2_roofline_us=g2.get("roofline_us"))
    if best_name != "default" and run.left() > 20:
        try:
            res["breakdown"]["best"] = breakdown(run, layer_fn(fw, one, best_pair), args.profile_replays)
        except Exception as e:  # noqa: BLE001
            res["breakdown"]["best"] = dict(error=err(e))
        try:
            res["ablation"]["best"] = ablation(run, fw, one, best_pair, args.calls, args.reps)
        except Exception as e:  # noqa: BLE001
            res["ablation"]["best"] = dict(error=err(e))
    save()

    res["tokens"] = []
    for m in sorted(args.tokens):
        if run.left() < 10:
            res["tokens"].append(dict(tokens=m, skipped="time budget"))
            continue
        pairs = {"default": (default, default)}
        if best_name != "default":
            pairs["best"] = best_pair
        row, _ = layer_sweep(run, fw, cases[m], pairs, args.calls, args.reps)
        one_call = {}
        for n, p in pairs.items():
            try:
                replay, _ = run.capture(layer_fn(fw, cases[m], p), 1)
                one_call[n] = replay
            except Exception as e:  # noqa: BLE001
                row["cases"].setdefault(n, {})["one_call_error"] = err(e)
        if one_call:
            timed = time_with_roofline(run, one_call, row["bytes"]["layer"], 1, run.reps(20))
            del timed["copy"]
            for n, st in timed.items():
                row["cases"][n]["one_call_graph"] = st
        res["tokens"].append(row)
        save()
    # last: a wrong one-launch layout could fault the GEMMs (the layouts are compared before any layer runs)
    if run.left() > 15:
        try:
            res["dispatch_ab"] = dispatch_ab(run, fw, one, (default, default), args.calls, args.reps,
                                             args.profile_replays)
        except Exception as e:  # noqa: BLE001
            res["dispatch_ab"] = dict(error=err(e))
        save()
    if run.left() > 15:
        try:
            res["act_rows_ab"] = act_rows_ab(run, fw, {m: cases[m] for m in sorted(set(args.tokens))},
                                             (default, default), args.calls, args.reps, args.profile_replays)
        except Exception as e:  # noqa: BLE001
            res["act_rows_ab"] = dict(error=err(e))
        save()
    if run.left() > 20:
        try:
            ms = [1] if args.smoke else sorted(set(args.tokens))  # smoke: the code paths once
            res["decode_ab"] = decode_ab(run, fw, {m: cases[m] for m in ms}, (default, default), args.calls,
                                         args.reps, args.profile_replays)
        except Exception as e:  # noqa: BLE001
            res["decode_ab"] = dict(error=err(e))
        save()
    m = max(args.tokens)
    if m != 1 and run.left() > 45:  # the GEMM tiles at the largest token count (compiled already)
        try:
            res["gemm_sweep_tokens"] = gemm_sweep(run, fw, cases[m], tiles, args.gemm_calls, args.reps)
        except Exception as e:  # noqa: BLE001
            res["gemm_sweep_tokens"] = dict(error=err(e))
    save()
    report(res)
    return 0


def report(res: dict) -> None:
    m = res["meta"]
    print(f"{m.get('gpu', 'CPU smoke')} {m.get('date', '')} compile {m.get('compile_s', 0):.0f} s, "
          f"wall {m.get('wall_s', 0):.0f} s; graph node floor "
          f"{res.get('node_floor', {}).get('node_floor_us') or 0:.2f} us")
    sweeps = [(g, sw) for g, sw in res.get("gemm_sweep", {}).items()]
    sweeps += [(g, sw) for g, sw in res.get("gemm_sweep_tokens", {}).items() if isinstance(sw, dict)]
    for g, sw in sweeps:
        rows = [r for r in sw["rows"] if "median_us" in r]
        dflt = next((r for r in rows if r.get("default")), None)
        head = f"{g} at {sw['tokens']} token(s), {sw['touched']} experts, {sw['bytes'] / 1e6:.0f} MB"
        print(f"{head}: default {dflt['median_us']:.1f} us ({dflt.get('of_roofline', 0):.0%} of "
              f"{dflt.get('roofline_us', 0):.1f} us)" if dflt else f"{head}: no default timing")
        for r in ranked(sw["rows"], 3):
            print(f"    {r['median_us']:7.1f} us ({r['min_us']:.1f}-{r['max_us']:.1f}) "
                  f"{r.get('of_roofline', 0):4.0%}  {r['short']}")
        bad = [r["short"] for r in sw["rows"] if r.get("bits_equal_default") is False]
        errs = [r["short"] for r in sw["rows"] if "error" in r]
        if bad or errs:
            print(f"    other bits: {bad}  errors: {errs}")
    lay = res.get("layer", {}).get("cases", {})
    if lay:
        print(f"layer, 1 token, graph of {res.get('layer', {}).get('calls_per_graph')} calls (us per call):")
    timed = [(n, c) for n, c in lay.items() if n != "copy" and "median_us" in c]
    for n, c in sorted(timed, key=lambda nc: nc[1]["median_us"]):
        print(f"    {c['median_us']:7.1f} us ({c['min_us']:.1f}-{c['max_us']:.1f}) {c.get('of_roofline', 0):4.0%} "
              f"eq={c.get('bits_equal_default')}  {n}")
    for name, c in res.get("node_floor", {}).items():
        if isinstance(c, dict) and name != "error":
            print(f"    graph chain, {name}: {c.get('us_per_kernel', 0):.2f} us a kernel {c.get('error', '')}"
                  f"{'' if c.get('count_ok', True) else ' COUNT WRONG'}")
    for name, b in res.get("breakdown", {}).items():
        tl_ = b.get("timeline", {})
        rep = b.get("replay", {})
        print(f"breakdown {name}: replay {rep.get('median_us', 0):.1f} us; span {tl_.get('span_us', 0):.1f} us, busy "
              f"{tl_.get('busy_us', 0):.1f}, idle {tl_.get('idle_us', 0):.1f}; {tl_.get('error', b.get('error', ''))}")
        if tl_.get("stage_us"):
            print("    by stage: " + ", ".join(f"{k} {v:.1f}" for k, v in tl_["stage_us"].items()))
        for k in tl_.get("kernels", []):
            print(f"    {k['start_us']:7.1f} +{k['dur_us']:6.1f} us (gap {k['gap_before_us']:4.1f})  "
                  f"{k['stage']:12s} {k['kernel'][:50]}")
    for name, ab in res.get("ablation", {}).items():
        cs = ab.get("cases", {})
        print(f"ablation {name} (graph of {ab.get('calls_per_graph')}, us a call): " + ", ".join(
            f"{n} {c['median_us']:.1f}" for n, c in cs.items() if "median_us" in c) + f" {ab.get('error', '')}")
        if ab.get("derived_us"):
            print("    derived: " + ", ".join(f"{k} {v:.1f}" for k, v in ab["derived_us"].items()))
    ab = res.get("dispatch_ab", {})
    if ab:
        print("dispatch A/B (us a call): " + ", ".join(f"{n} {c['median_us']:.1f} ({c['min_us']:.1f}-{c['max_us']:.1f})"
                                                     for n, c in ab.items() if isinstance(c, dict) and "median_us" in c)
              + f"; bits equal {ab.get('bits_equal')} {ab.get('error', '')}")
        tl_ = ab.get("breakdown", {}).get("timeline", {})
        if tl_.get("kernels"):
            print(f"    one-launch dispatch: span {tl_['span_us']:.1f} us, idle {tl_['idle_us']:.1f}; " + ", ".join(
                f"{k['stage']} {k['dur_us']:.1f}" for k in tl_["kernels"]))
    for m_, row in res.get("act_rows_ab", {}).items():
        if not isinstance(row, dict) or m_ == "breakdown":
            continue
        if "tokens" not in row:
            print(f"act rows A/B: {row}")
            continue
        print(f"act rows A/B, {row['tokens']} token(s) (us a call, graph of {row['calls_per_graph']} | one-call graph): "
              + ", ".join(f"{n} {c['median_us']:.1f} ({c['min_us']:.1f}-{c['max_us']:.1f}, "
                          f"{c.get('of_roofline', 0):.0%}) | {c.get('one_call_graph', {}).get('median_us', 0):.1f} "
                          f"({c.get('one_call_graph', {}).get('of_roofline', 0):.0%})"
                          for n, c in row.items() if isinstance(c, dict) and "median_us" in c)
              + f"; saved {row.get('saved_us', float('nan')):.1f} us; bits equal {row.get('bits_equal')} "
              + " ".join(f"{n}: {c['error']}" for n, c in row.items() if isinstance(c, dict) and "error" in c))
    for m_, row in res.get("decode_ab", {}).items():
        if m_ == "breakdown" or not isinstance(row, dict):
            continue
        if "tokens" not in row or "layout_equal" not in row:
            print(f"decode A/B: {row}")
            continue
        print(f"decode A/B, {row['tokens']} token(s) (us a call, graph of {row['calls_per_graph']} | one-call graph; "
              f"bits equal to the first: all {row.get('all_bits_equal')}):")
        for n, c in row.items():
            if isinstance(c, dict) and "median_us" in c:
                oc = c.get("one_call_graph", {})
                print(f"    {c['median_us']:7.1f} ({c['min_us']:.1f}-{c['max_us']:.1f}, "
                      f"{c.get('of_roofline', 0):.0%}) | "
                      f"{oc.get('median_us', 0):7.1f} ({oc.get('of_roofline', 0):.0%}) eq={c.get('bits_equal')}  {n}")
            elif isinstance(c, dict) and "error" in c:
                print(f"    error {n}: {c['error']}")
    for name, b in res.get("decode_ab", {}).get("breakdown", {}).items():
        tl_ = b.get("timeline", {})
        if tl_.get("kernels"):
            print(f"    {name}, 1 token: replay {b.get('replay', {}).get('median_us', 0):.1f} us, span "
                  f"{tl_['span_us']:.1f}, idle {tl_['idle_us']:.1f}; " + ", ".join(
                      f"{k['stage']} {k['dur_us']:.1f} (gap {k['gap_before_us']:.1f})" for k in tl_["kernels"]))
        elif b:
            print(f"    {name}: replay {b.get('replay', {}).get('median_us', 0):.1f} us; no timeline "
                  f"{b.get('error', tl_.get('error', ''))}")
    tl_ = res.get("act_rows_ab", {}).get("breakdown", {}).get("timeline", {})
    if tl_.get("kernels"):
        print(f"    act over routed rows, 1 token: span {tl_['span_us']:.1f} us, idle {tl_['idle_us']:.1f}; "
              + ", ".join(f"{k['stage']} {k['dur_us']:.1f}" for k in tl_["kernels"]))
    if res.get("summary"):
        print("summary (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res["summary"].items() if v is not None))
    for row in res.get("tokens", []):
        for n, c in row.get("cases", {}).items():
            if n == "copy" or "median_us" not in c:
                continue
            oc = c.get("one_call_graph", {})
            print(f"tokens {row['tokens']} {n:8s}: {c['median_us']:7.1f} us/call ({c.get('of_roofline', 0):.0%}), "
                  f"one-call graph {oc.get('median_us', 0):.1f} us ({oc.get('of_roofline', 0):.0%}) "
                  f"eq={c.get('bits_equal_default')}")


if __name__ == "__main__":
    raise SystemExit(main())
