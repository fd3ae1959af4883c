"""Write the Gluon FP8 prefill table of docs/moe-gpu.md from ``bench/studies/gluon_fp8_prefill_probe.py``'s JSON.

    python bench/report_gluon_probe.py [docs/data/gluon_fp8_prefill_probe_*.json] [--docs docs/moe-gpu.md] [--check]

The newest file (name order; earlier ones are in ``docs/data/history/``) holds one or more runs of the probe with
DeepGEMM in its rounds (``--deep-gemm``); the table shows each, oldest first: per variant, GEMM1's and GEMM2's median
(min-max) in ms over the interleaved rounds, TFLOP/s over the routed rows, and *x DeepGEMM*: the median over rounds
of DeepGEMM's time in that round over the variant's (above 1: faster than DeepGEMM), for each GEMM and for the two
together (the sums of a round's two times). *Bits*: ``= TMA`` when every small layout's outputs equal the reference
of the probe's bit check and the 4096-token outputs equal the Triton TMA tiles'; ``= DeepGEMM`` when the 4096-token
outputs equal DeepGEMM's. Replaces the text between ``<!-- gluon-probe:begin -->`` and ``<!-- gluon-probe:end -->``;
``--check`` exits 1 when the page differs.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import report_main, runs_oldest_first  # noqa: E402

BEGIN, END = "<!-- gluon-probe:begin -->", "<!-- gluon-probe:end -->"
PATTERN = "gluon_fp8_prefill_probe_*.json"
SCRIPT = "bench/studies/gluon_fp8_prefill_probe.py"
DEEP_GEMM = "deep_gemm"


def _variant_name(key: str) -> str:
    return {"tma": 'Triton TMA tiles (`"fp8_block_contiguous_tma"`)', DEEP_GEMM: "DeepGEMM"}.get(key, key)


def _bits(run: dict, key: str) -> str:
    small = [v for k, v in run.get("bits", {}).items() if k.split(":")[0] == key]
    t = [run["times"][g][key] for g in ("gemm1", "gemm2")]
    marks = [m for m, ok in (("= TMA", all(small) and all(x.get("bits_equal_tma", False) for x in t)),
                             ("= DeepGEMM", all(x.get("bits_equal_deep_gemm", False) for x in t))) if ok]
    return ", ".join(marks) or "**neither**"


def _ms(t: dict) -> str:
    ms = t["ms"]
    return f"{t['median_ms']:.2f} ({min(ms):.2f}-{max(ms):.2f})"


def _both(run: dict, key: str) -> float:
    """The median over rounds of DeepGEMM's GEMM1 + GEMM2 time over the variant's."""
    t1, t2 = run["times"]["gemm1"], run["times"]["gemm2"]
    dg = [a + b for a, b in zip(t1[DEEP_GEMM]["ms"], t2[DEEP_GEMM]["ms"])]
    return statistics.median(d / (a + b) for d, a, b in zip(dg, t1[key]["ms"], t2[key]["ms"]))


def _section(run: dict) -> list:
    t1, t2 = run["times"]["gemm1"], run["times"]["gemm2"]
    rounds = len(t1[DEEP_GEMM]["ms"])
    lines = [f"Measured on an {run['gpu']}, {run['date']}, torch {run['torch']}, tree {run['head']}: "
             f"`{run['command']}` (DeepSeek-V3 at 4096 tokens, uniform routing, {rounds} interleaved rounds of 10 "
             f"calls). {run['note']}. Variants `gluon {{block_n}} s{{stages}} g{{group_m}} ku{{K_UNROLL}} "
             "if{IN_FLIGHT, 0: the default} {tma: the TMA-store epilogue | store}`.", "",
             "| variant | GEMM1 ms | TFLOP/s | x DeepGEMM | GEMM2 ms | TFLOP/s | x DeepGEMM | both, x DeepGEMM "
             "| bits |", "|---|---|---|---|---|---|---|---|---|"]
    for key in t1:
        a, b = t1[key], t2[key]
        x1, x2, xb = (("1.00x",) * 3 if key == DEEP_GEMM else
                      (f"{a['x_deep_gemm']:.2f}x", f"{b['x_deep_gemm']:.2f}x", f"{_both(run, key):.2f}x"))
        bits = "" if key == DEEP_GEMM else _bits(run, key)
        lines.append(f"| {_variant_name(key)} | {_ms(a)} | {a['tflops_routed_rows']:.0f} | {x1} | {_ms(b)} | "
                     f"{b['tflops_routed_rows']:.0f} | {x2} | {xb} | {bits} |")
    return lines


def render(docs: list) -> str:
    """The table of each run of the newest document (``docs`` in name order), oldest run first."""
    return runs_oldest_first(docs[-1]["runs"], _section, date=lambda run: run["date"])


def main(argv=None) -> int:
    return report_main(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0], script=SCRIPT,
                       pattern=PATTERN, pages=["moe-gpu.md"], begin=BEGIN, end=END, render=render,
                       json_help="gluon_fp8_prefill_probe.py JSON")


if __name__ == "__main__":
    raise SystemExit(main())
