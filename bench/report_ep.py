"""Write the EP reference's timing table (docs/expert-parallel.md, docs/performance.md) from bench_ep_gpu.py's JSON.

    python bench/report_ep.py docs/data/ep_*.json [--docs docs/expert-parallel.md] [--check]

One row per run, engine, mode and token count, runs ordered by world size then date: the reference's dispatch and
combine against one plain ``all_to_all_single`` of the same bytes, medians over the interleaved rounds (min-max),
the ratio the median of the per-round ratios (issue 34's target: within 10x at 4096 tokens per rank), flagged
cases (spread over 10%) named. Replaces the text between ``<!-- ep-reference:begin -->`` and
``<!-- ep-reference:end -->`` (the same table on both pages); ``--check`` exits 1 when the page differs from what
the JSON gives (a test runs it on the committed JSON).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main  # noqa: E402

BEGIN, END = "<!-- ep-reference:begin -->", "<!-- ep-reference:end -->"
PATTERN = "ep_*.json"
MODE_NAMES = {"normal": "normal (bf16)", "normal_fp8": "normal, FP8 1x128 before dispatch",
              "low_latency": "low latency (bf16)"}


def _num(ms: float) -> str:
    return f"{ms:,.0f}" if ms >= 100 else (f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}")


def _ms(case: dict) -> str:
    return f"{_num(case['median_s'] * 1e3)} ({_num(case['min_s'] * 1e3)}-{_num(case['max_s'] * 1e3)})"


def _machine(m: dict) -> str:
    load = m.get("load_average")
    return m["gpu"] + (f", load {load:.1f}" if load is not None and m["backend"] == "gloo" else "")


def _mode(row: dict) -> str:
    return MODE_NAMES.get(row["mode"], row["mode"]) + (", reused receive buffer" if row.get("recv_buffer") else "")


def table(runs: list) -> str:
    """The markdown table of ``runs`` (bench_ep_gpu.py JSON documents, any order)."""
    runs = sorted(runs, key=lambda d: (d["meta"]["world_size"], d["meta"]["date"]))
    out = ["`bench/bench_ep_gpu.py`: DeepSeek-V3 shapes (hidden 7168, top-8 of 256 experts, uniform random routing, "
           "linear placement), one process per rank; per case the slowest rank's time, median over the interleaved "
           "rounds (min-max) in ms; *plain*: one `all_to_all_single` of the same bytes with the same split sizes in "
           "the same rounds; *x*: reference / plain, the median of the per-round ratios (target: within 10x at 4096 "
           "tokens per rank); *reused receive buffer*: the low-latency dispatch receives into one "
           "`ep_low_latency_buffer` made before the rounds (DeepEP's `Buffer`), zeroing only the rows the previous "
           "dispatch wrote (rows without it zero a fresh `E_local x R*M x H` buffer per dispatch).", "",
           "| measured | machine | backend, ranks | tree | engine | mode | tokens per rank | dispatch, ms | plain, ms "
           "| x | combine (bf16), ms | plain, ms | x | spread > 10% |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in runs:
        m = d["meta"]
        for r in d["rows"]:
            c = r["cases"]
            flagged = ", ".join(r["flagged"]) if r["flagged"] else "-"
            out.append(f"| {m['date']} | {_machine(m)} | {m['backend']}, {m['world_size']} | {m['tree']} | {r['engine']} "
                       f"| {_mode(r)} | {r['tokens_per_rank']} | {_ms(c['dispatch'])} | "
                       f"{_ms(c['plain_dispatch'])} | **{r['dispatch_over_plain']:.1f}x** | {_ms(c['combine'])} | "
                       f"{_ms(c['plain_combine'])} | **{r['combine_over_plain']:.1f}x** | {flagged} |")
    return "\n".join(out)


def default_json() -> list:
    """The committed benchmark JSON (what the docs tests check)."""
    return data_files(PATTERN)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_ep.py", pattern=PATTERN,
                       pages=("expert-parallel.md", "performance.md"), begin=BEGIN, end=END, render=table,
                       json_help="bench_ep_gpu.py --out files")


if __name__ == "__main__":
    sys.exit(main())
