"""Write the "Cost on the CPU" table of docs/error-bounds.md from ``bench/studies/bench_layer_bound_cpu.py``'s JSON.

    python bench/report_layer_bound_cpu.py [docs/data/layer_bound_cpu_*.json] [--docs docs/error-bounds.md] [--check]

Per JSON file (oldest first) a caption (date, machine, CPUs, profile, rounds, whether the trees were interleaved)
and one row per case: the reference ``run_moe`` and ``layer_bound`` (medians over the rounds, wall and, in
parentheses, CPU seconds), the median of the per-round ratios and their range. A ``--trees`` run shows its last
tree (the script's convention: ``--trees BASE .``, the tree measured last), a one-process run its only one.
Replaces the text between ``<!-- layer-bound-cpu:begin -->`` and ``<!-- layer-bound-cpu:end -->``; ``--check``
exits 1 when the page differs from what the JSON gives.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import report_main, runs_oldest_first  # noqa: E402

BEGIN, END = "<!-- layer-bound-cpu:begin -->", "<!-- layer-bound-cpu:end -->"
PATTERN = "layer_bound_cpu_*.json"
SCRIPT = "bench/studies/bench_layer_bound_cpu.py"


def _case_label(spec: str) -> str:
    t, h, i = spec.split(":")
    return f"{t} tokens, hidden {h}, intermediate {i}, 32 experts, top-4"


def _section(d: dict) -> list[str]:
    meta = d["meta"]
    trees = isinstance(d["rounds"], dict)
    rounds = list(d["rounds"].values())[-1] if trees else d["rounds"]
    summary = list(d["summary"].values())[-1] if trees else d["summary"]
    how = (f"{len(d['rounds'])} trees interleaved (`--trees`), the last shown" if trees
           else "one process (no `--trees`)")
    lines = [f"`layer_bound(run, \"{meta['profile']}\")` against `run_moe`, {meta['date'][:16].replace('T', ' ')} "
             f"UTC, {meta['machine']}, {meta['cpus']} CPUs, {meta['rounds']} rounds, {how} (`python {SCRIPT}`):",
             "",
             "| layer | `run_moe` | `layer_bound` | ratio | ratio range |",
             "|---|---|---|---|---|"]
    for spec in meta["cases"]:
        s = summary[spec]
        per = [(r[spec]["bound_wall"] / r[spec]["ref_wall"], r[spec]["bound_cpu"] / r[spec]["ref_cpu"])
               for r in rounds if spec in r]
        walls, cpus = [p[0] for p in per], [p[1] for p in per]
        assert abs(statistics.median(walls) - s["ratio_wall"]) < 1e-9, "summary and rounds disagree"
        lines.append(f"| {_case_label(spec)} | {s['ref_wall']:.2f} s ({s['ref_cpu']:.2f} s) | "
                     f"{s['bound_wall']:.2f} s ({s['bound_cpu']:.2f} s) | {s['ratio_wall']:.1f}x "
                     f"({s['ratio_cpu']:.1f}x) | {min(walls):.1f}-{max(walls):.1f}x "
                     f"({min(cpus):.1f}-{max(cpus):.1f}x) |")
    return lines


def render(runs: list) -> str:
    return runs_oldest_first(runs, _section, date=lambda d: d["meta"]["date"])


def main(argv=None) -> int:
    return report_main(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0], script=SCRIPT,
                       pattern=PATTERN, pages=["error-bounds.md"], begin=BEGIN, end=END, render=render,
                       json_help="bench_layer_bound_cpu.py JSON")


if __name__ == "__main__":
    raise SystemExit(main())
