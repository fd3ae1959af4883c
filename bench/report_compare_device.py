"""Write the `compare` timing table of docs/moe-gpu.md from bench_compare_device.py's JSON (never edited by hand).

    python bench/report_compare_device.py [RUN.json ...] [--docs docs/moe-gpu.md] [--check]

(no JSON given: the committed runs, ``docs/data/compare_device_*.json``).

One table per run (its GPU and date above it), oldest run first, one row per token count: the reference's and
`compare`'s medians over the interleaved rounds (min-max), the median of the per-round ratios, peak extra GPU
memory, whether the reference's own output passed. Superseded runs are kept in docs/data/history/. Replaces the
text between ``<!-- compare-device:begin -->`` and ``<!-- compare-device:end -->``; ``--check`` exits 1 when the
page differs from what the JSON gives (a test runs it on the committed JSON).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import report_main, runs_oldest_first  # noqa: E402

BEGIN, END = "<!-- compare-device:begin -->", "<!-- compare-device:end -->"


def _case(row: dict, name: str) -> dict:
    return row["timing"]["cases"][name]


def section(d: dict) -> list:
    """The lines of one run: the line naming its GPU and date, then its table."""
    m = d["meta"]
    out = [f"Measured on an {m['gpu']}, {m['date']}:", "",
           "| tokens | reference, s | compare, s | compare / reference | peak extra GPU memory | passed |",
           "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        ref, cmp_ = _case(r, "reference"), _case(r, "compare")
        out.append(f"| {r['tokens']} | {ref['median_s']:.3f} | {cmp_['median_s']:.3f} ({cmp_['min_s']:.3f}-"
                   f"{cmp_['max_s']:.3f}) | **{r['compare_over_reference']:.2f}x** | {r['peak_extra_gib']:.1f} GiB | "
                   f"{r['passed']} |")
    return out


def table(runs: list) -> str:
    """The markdown tables of ``runs`` (the JSON documents, any order): one per run, oldest first, each under a
    line naming its GPU and date."""
    head = ["`compare` of a device-engine reference run under `HOPPER_FP8_DEEPGEMM_DATA`, beside the reference's own "
            "time (`python -m bench compare`: DeepSeek-V3 layer, 256 experts, top-8, FP8 1x128 x 128x128, random "
            "routing; the candidate is the reference's own bf16 output). Median of the interleaved rounds (min-max); "
            "the ratio is the median of the per-round ratios."]
    return runs_oldest_first(runs, section, date=lambda d: d["meta"]["date"], head=head)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_compare_device.py",
                       pattern="compare_device_*.json", pages=("moe-gpu.md",), begin=BEGIN, end=END, render=table,
                       json_help="bench_compare_device.py --out files, one table each")


if __name__ == "__main__":
    sys.exit(main())
