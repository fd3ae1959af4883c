"""Write the GPU conversion table of docs/convert.md from bench_convert.py's JSON (never edited by hand).

    python bench/report_convert.py [RUN.json ...] [--docs docs/convert.md] [--check]

(no JSON given: the committed run, ``docs/data/convert_gpu_*.json``). One table per JSON file, in the order
given. Replaces the text between ``<!-- convert-gpu:begin -->`` and ``<!-- convert-gpu:end -->``; ``--check``
exits 1 when the page differs from what the JSON gives (a test runs it on the committed JSON).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import report_main  # noqa: E402

BEGIN, END = "<!-- convert-gpu:begin -->", "<!-- convert-gpu:end -->"


def table(d: dict) -> str:
    """The markdown table of one run (a bench_convert.py --gpu --json document), under its method line."""
    rows = d["rows"]
    cp = rows[0]
    per_round = ("% of copy: copy time / conversion time in the same round, median (min-max) over "
                 "rounds. " if "fraction_of_copy_per_round" in cp else "")
    out = [f"Measured on an {d['gpu']}, {d['date']}, torch {d['torch']}: one {d['shape'][0]} x "
           f"{d['shape'][1]} weight ({d['source']}; {cp['bytes_source'] / 1e6:.1f} MB), device time "
           f"per weight, median (min-max) of {d['rounds']} interleaved rounds, each a CUDA graph of "
           f"{d['reps_per_graph']} conversions over {d['rotating_sources']} different source weights. "
           f"Copy: `copy_` of (source + target bytes) / 2, "
           f"{cp['copy_seconds_median'] * 1e6:.1f} us = {cp['copy_GBps']:.0f} GB/s read + written "
           f"at this size. {per_round}Host-issued: the same call from Python, launch overhead "
           f"included. "
           f"DeepSeek-V3: the device time scaled to its {d['v3_quantized_elements'] / 1e9:.0f} G "
           f"quantized elements.", "",
           "| target | path | device time | bytes moved / time | % of copy (min-max) | host-issued | "
           "DeepSeek-V3, device | bit-identical to the CPU |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["fraction_of_copy_range"]
        out.append(
            f"| {r['target']} | {r['path']} | {r['seconds_median'] * 1e6:.1f} us "
            f"({r['seconds_min'] * 1e6:.1f}-{r['seconds_max'] * 1e6:.1f}) | {r['GBps']:.0f} GB/s | "
            f"**{100 * r['fraction_of_copy']:.1f}%** ({100 * lo:.1f}-{100 * hi:.1f}) | "
            f"{r['host_seconds_median'] * 1e6:.0f} us | {r['v3_device_seconds']:.1f} s | "
            f"{'yes' if r['bit_identical'] else 'NO'} |")
    return "\n".join(out)


def render(runs: list[dict]) -> str:
    """The generated part of the page: the table of each run, in order."""
    return "\n\n".join(table(d) for d in runs)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_convert.py",
                       pattern="convert_gpu_*.json", pages=("convert.md",), begin=BEGIN, end=END, render=render,
                       json_help="bench_convert.py --gpu --json files, one table each")


if __name__ == "__main__":
    sys.exit(main())
