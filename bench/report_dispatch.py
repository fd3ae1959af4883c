"""Write docs/fastpaths-dispatch.md's measured table from bench_dispatch_gpu.py's JSON (never edited by hand).

    python bench/report_dispatch.py [RUN.json ...] [--docs docs/fastpaths-dispatch.md] [--check]

(no JSON given: the committed runs, ``docs/data/dispatch_*.json``, in name order).

One section per JSON file (one GPU run each), in the order given. Replaces the text between
``<!-- fastpath-dispatch:begin -->`` and ``<!-- fastpath-dispatch:end -->``; ``--check`` exits 1 when
the page differs from what the JSON gives. Schema: :func:`bench.interleaved.row_record`'s rows (plus
``op`` and any ``compile_error`` / ``graph_error``) under ``rows``, the settings and
:func:`bench.interleaved.machine_meta` under ``meta``, the ``--sweep`` candidates under ``sweep``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main  # noqa: E402

BEGIN, END = "<!-- fastpath-dispatch:begin -->", "<!-- fastpath-dispatch:end -->"
PATTERN = "dispatch_*.json"
FLAG = "⚠"
# The page's target, stated on the medians (issue 20): bold where met.
TARGET_PCT_COPY = 90.0


def default_json() -> list[str]:
    return data_files(PATTERN)


def _flag(case: dict | None) -> str:
    return f" {FLAG}" if case is not None and case["flagged"] else ""


def _span(case: dict | None) -> str:
    """``median (min-max)`` in us, with the flag when the spread is over the threshold; "—" when absent."""
    if case is None:
        return "—"
    return f"{case['median_us']:.1f} ({case['min_us']:.1f}-{case['max_us']:.1f})" + _flag(case)


def _ratio(row: dict, base: str, error_key: str = "-") -> str:
    """The median of the per-round ratios ``baseline time / fast time`` (flag of the baseline's case)."""
    if base not in row["ratio_median"]:
        if error_key in row:  # not timed: compilation skipped (budget) or failed, said so
            return "skipped" if row[error_key].startswith("skipped") else "failed"
        return "—"
    return f"{row['ratio_median'][base]:.2f}" + _flag(row["cases"][base])


def _cells(row: dict) -> list[str]:
    fp, cases = row["cases"]["fastpath"], row["cases"]
    pct = row["pct_copy"]
    dense = (f"{100 * row['ratio_median']['dense 1:k']:.1f}%" + _flag(cases["dense 1:k"])
             if "dense 1:k" in row["ratio_median"] else "—")
    graph = "capture failed" if "graph_error" in row else _span(cases.get("CUDA graph"))
    return [row["op"], str(row["M"]), _span(fp), f"{fp['spread']:.1%}", f"{row['TBps'] * 1e3:.0f}",
            (f"**{pct:.1f}%**" if pct >= TARGET_PCT_COPY else f"{pct:.1f}%") + _flag(cases["copy"]),
            dense, _ratio(row, "torch eager"), _ratio(row, "torch.compile", "compile_error"), graph]


def tables(data: dict) -> str:
    """Markdown for one run: the method line (GPU, driver, versions, date, shape, device ceilings,
    rounds, flag, target) and one table row per (operation, tokens); the sweep when there is one."""
    m = data["meta"]
    out = [f"**{m['gpu']}**, {m['date']} (driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
           f"triton {m['triton']}); E = {m['E']}, top-{m['k']}, hidden {m['K']} bf16, `block_size` {m['block_size']}, "
           f"`alignment` {m['alignment']}; 1 GiB device copy {m['copy_TBps']:.2f} TB/s (read + write), "
           f"`fill_` {m['fill_TBps']:.2f} TB/s (write). Every row is timed in {m['rounds']} interleaved rounds with "
           f"its baselines (the same bytes copied, torch eager, torch.compile, the CUDA-graph replay of the fast "
           f"call, and for permute the row kernel with identity destinations, \"dense 1:k\"): times are medians "
           f"(min-max) in µs, ratios the median of the per-round ratios (baseline time / fast time; % of copy and "
           f"% of dense 1:k the same ratio in percent), GB/s the logical bytes over the median time; {FLAG} marks a "
           f"case whose spread (max - min) / median exceeds {m['flag_spread']:.0%}. Target, on the medians: >= "
           f"{TARGET_PCT_COPY:.0f}% of copy (bold where met).", "",
           "| operation | tokens | fast, µs | spread | GB/s | % of copy | % of dense 1:k | x torch eager "
           "| x torch.compile | CUDA graph, µs |",
           "|---" * 10 + "|"]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in data["rows"]]
    if data.get("sweep"):
        out += ["", "Row-kernel configurations (`--sweep`, 16384 tokens, each kind's candidates in the same "
                "interleaved rounds; x shipped: the shipped configuration's time / the candidate's, median of the "
                "per-round ratios):", "",
                "| kernel | (BLOCK_T, row bytes, warps) | µs | x shipped |", "|---|---|---|---|"]
        for s in data["sweep"]:
            cfg = "(" + ", ".join(str(c) for c in s["cfg"]) + ")" + (" shipped" if s["shipped"] else "")
            span = f"{s['median_us']:.1f} ({s['min_us']:.1f}-{s['max_us']:.1f})" + (f" {FLAG}" if s["flagged"] else "")
            out.append(f"| {s['kind']} | {cfg} | {span} | {s['x_shipped']:.3f} |")
    return "\n".join(out)


def render(runs: list[dict]) -> str:
    """The generated part of the page: the tables of each run, in order."""
    return "\n\n".join(tables(d) for d in runs)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_dispatch.py", pattern=PATTERN,
                       pages=("fastpaths-dispatch.md",), begin=BEGIN, end=END, render=render,
                       json_help="bench_dispatch_gpu.py JSON files, one section each")


if __name__ == "__main__":
    sys.exit(main())
