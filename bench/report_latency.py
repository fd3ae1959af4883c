"""Write docs/fastpaths-latency.md's tables from bench_latency_gpu.py's JSON (never edited by hand).

    python bench/report_latency.py [RUN.json ...] [--docs docs/fastpaths-latency.md] [--check]

(no JSON given: the page's run, ``docs/data/latency_*.json``; superseded runs are in docs/data/history/).

One section per JSON file (one run each: a GPU, a code state), in the order given. Replaces the text
between ``<!-- fastpath-latency:begin -->`` and ``<!-- fastpath-latency:end -->``; ``--check`` exits 1
when the page differs from what the JSON gives. Schema: :func:`bench.bench_latency_gpu.measure_case`'s
rows under ``rows`` and :func:`bench.bench_latency_gpu.run_meta`'s ``meta``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import report_main  # noqa: E402

BEGIN, END = "<!-- fastpath-latency:begin -->", "<!-- fastpath-latency:end -->"
FLAG = "⚠"


def _us(rec: dict, case: str) -> str:
    c = rec.get("cases", {}).get(case)
    if c is None:
        return "—"
    return f"{c['median_us']:.1f}" + (f" {FLAG}" if c["flagged"] else "")


def _void_floor(rec: dict) -> bool:
    """A run that recorded no launch for the row (run c72001c: its launch cache bypassed the recorder)
    has no floor: its floor cells read "not recorded" and its target is not judged."""
    return rec.get("launches") == 0


def _overhead(rec: dict) -> str:
    o = rec.get("overhead_us")
    if o is None:
        return "—"
    s = f"{o['median']:.1f}"
    return f"**{s}**" if rec.get("met") and not _void_floor(rec) else s


def _floor(rec: dict, case: str) -> str:
    return "not recorded" if _void_floor(rec) else _us(rec, case)


def _graph(rec: dict) -> str:
    if "graph_error" in rec:
        return "capture failed"
    return "bit-equal" if rec.get("graph_equal") else "DIFFERS"


def tables(data: dict) -> str:
    m = data["meta"]
    rows = [r for r in data["rows"] if "error" not in r]
    Ms = sorted({r["M"] for r in rows})
    names = list(dict.fromkeys(r["case"] for r in rows))
    by = {(r["case"], r["M"]): r for r in rows}
    label = f" ({m['label']})" if m.get("label") else ""
    out = [f"**{m['gpu']}**, {m['date']}{label}: driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
           f"triton {m['triton']}, Python {m.get('python', '?')}. Every row's cases timed in {m['rounds']} interleaved "
           f"rounds (CUDA events around back-to-back calls, about {m['round_ms']:g} ms per case and round); "
           f"medians in us, {FLAG}: spread (max - min) / median over {m['flag_spread']:.0%}. Overhead = eager - "
           f"graph replay per round, median; bold where the target is met (<= {m['target_us']:g} us, or <= "
           f"{m['floor_factor']:g} x the floor where the floor is above {m['target_us']:g} us).", ""]
    M0 = Ms[0]
    out += [f"At M = {M0}:", "",
            "| fast path | launches | eager | eager, before | graph replay | overhead | floor | floor, cached launcher | "
            "torch eager | torch.compile (reduce-overhead) | replay vs eager |",
            "|---" * 11 + "|"]
    for n in names:
        r = by.get((n, M0))
        if r is None:
            continue
        comp = _us(r, "torch.compile") if "torch.compile" in r.get("cases", {}) else \
            ("—" if "compile_error" not in r else "not timed" if "skipped" in r["compile_error"] else "failed")
        out.append(f"| {n} | {r['launches']} | {_us(r, 'eager')} | {_us(r, 'eager, before')} | {_us(r, 'graph')} | "
                   f"{_overhead(r)} | "
                   f"{_floor(r, 'floor')} | {_floor(r, 'floor (cached launcher)')} | {_us(r, 'torch eager')} | {comp} | "
                   f"{_graph(r)} |")
    before = any("eager, before" in r.get("cases", {}) for r in rows)
    out += ["", "Overhead (eager - graph replay)" + (" / the same before" if before else "") + " / floor, us, by M:", "",
            "| fast path | " + " | ".join(f"M = {M}" for M in Ms) + " |", "|---" * (1 + len(Ms)) + "|"]
    for n in names:
        cells = []
        for M in Ms:
            r = by.get((n, M))
            ob = r.get("overhead_before_us") if r is not None else None
            mid = (f" / {ob['median']:.1f}" if ob else " / —") if before else ""
            cells.append("—" if r is None else f"{_overhead(r)}{mid} / {_floor(r, 'floor')}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    if before:
        sp = sorted(r["speedup_vs_before"] for r in rows if "speedup_vs_before" in r)
        if sp:
            out += ["", f"Eager time before / now, per round, median over rows: {sp[len(sp) // 2]:.2f}x "
                    f"(range {sp[0]:.2f}-{sp[-1]:.2f}x over {len(sp)} rows)."]
    met = [r for r in rows if "met" in r and not _void_floor(r)]
    n_met = sum(1 for r in met if r["met"])
    out += ["", f"Target met in {n_met} of {len(met)} (fast path, M) rows." if met else
            "Target not judged: this run recorded no floor."]
    errs: dict = {}  # (case, message) -> [M, ...]
    for r in data["rows"]:
        msg = r.get("error") or r.get("graph_error") or \
            ("the replay differs from the eager call" if r.get("graph_equal") is False else None)
        if msg:
            errs.setdefault((r["case"], msg.split(". ")[0]), []).append(str(r["M"]))
    if errs:
        out += ["", "Errors: " + "; ".join(f"{c} (M = {', '.join(ms)}): {msg}" for (c, msg), ms in errs.items())]
    if data.get("skipped"):
        out += ["", f"Not timed (time budget): {len(data['skipped'])} rows."]
    return "\n".join(out)


def render(runs: list[dict]) -> str:
    """The generated part of the page: the tables of each run, in order."""
    return "\n\n".join(tables(d) for d in runs)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_latency.py",
                       pattern="latency_*.json", pages=("fastpaths-latency.md",), begin=BEGIN, end=END,
                       render=render, json_help="bench_latency_gpu.py JSON files, one section each")


if __name__ == "__main__":
    sys.exit(main())
