"""Write the decode A/B table of docs/moe-gpu.md from ``bench/studies/decode_graph_sweep.py --only decode_ab``'s JSON.

    python bench/report_decode_ab.py [docs/data/decode_ab_*.json] [--docs docs/moe-gpu.md] [--check]

Per run (oldest first) a caption naming the GPU, date, torch and Triton versions and tree, then one table: per
token count and case of :data:`bench.studies.decode_graph.phases.DECODE_AB`, the layer's time a call (median and
min-max of the interleaved rounds, a CUDA graph of ``calls_per_graph`` calls), its fraction of the run's roofline
(a device copy of the weights the layer reads), the one-call graph's median and fraction, and whether every output
equals the first case's bit for bit. Replaces the text between ``<!-- decode-ab:begin -->`` and
``<!-- decode-ab:end -->``; ``--check`` exits 1 when the page differs from what the JSON gives.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import report_main, runs_oldest_first  # noqa: E402

BEGIN, END = "<!-- decode-ab:begin -->", "<!-- decode-ab:end -->"
PATTERN = "decode_ab_*.json"
SCRIPT = "bench/studies/decode_graph_sweep.py"
_NOT_CASES = {"layout_equal", "all_bits_equal", "saved_us", "tokens", "bytes", "calls_per_graph"}


def _section(d: dict) -> list[str]:
    meta, ab = d["meta"], d["decode_ab"]
    counts = sorted((k for k in ab if k.isdigit()), key=int)
    calls = ab[counts[0]].get("calls_per_graph", d["args"].get("calls")) if counts else d["args"].get("calls")
    lines = [f"Measured on an {meta['gpu']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"tree {meta.get('tree', '?')}: `python {SCRIPT} --only decode_ab` (DeepSeek-V3 layer, Triton masked "
             f"layout, {d['args']['rounds']} interleaved rounds). *Graph of {calls}*: median (min-max) us a call in a "
             f"CUDA graph of {calls} calls; *one-call graph*: a graph of one call; *roofline*: a device copy of the "
             "weights the layer reads, timed in the same rounds; *same bits*: every output equals the first case's. "
             "*defaults*: the decode dispatch and reduce with PDL off; *defaults + pdl*: the layer as shipped.",
             "",
             f"| tokens | case | graph of {calls}, us | of roofline | one-call graph, us | of roofline | same bits |",
             "|---|---|---|---|---|---|---|"]
    for m in counts:
        for name, c in ab[m].items():
            if name in _NOT_CASES or not isinstance(c, dict) or "median_us" not in c:
                continue
            one = c.get("one_call_graph", {})
            lines.append(f"| {m} | {name} | {c['median_us']:.1f} ({c['min_us']:.1f}-{c['max_us']:.1f}) | "
                         f"{c['of_roofline']:.0%} | {one.get('median_us', float('nan')):.1f} | "
                         f"{one.get('of_roofline', float('nan')):.0%} | {'yes' if c.get('bits_equal') else '**no**'} |")
    return lines


def render(runs: list) -> str:
    return runs_oldest_first(runs, _section, date=lambda d: d["meta"]["date"])


def main(argv=None) -> int:
    return report_main(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0], script=SCRIPT,
                       pattern=PATTERN, pages=["moe-gpu.md"], begin=BEGIN, end=END, render=render,
                       json_help="decode_graph_sweep.py --only decode_ab JSON")


if __name__ == "__main__":
    raise SystemExit(main())
