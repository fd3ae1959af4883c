"""Write the Gluon FP8 prefill table of docs/moe-gpu.md from ``bench/studies/gluon_fp8_prefill_probe.py``'s JSON.

    python bench/report_gluon_probe.py [docs/data/gluon_fp8_prefill_probe_*.json] [--docs docs/moe-gpu.md] [--check]

The probe's JSON holds several runs; the table shows each run made by the probe's current form (those with a
``torch`` version and a command line), oldest first: per variant, GEMM1's and GEMM2's median (min-max) in ms over
the interleaved rounds, TFLOP/s over the routed rows, and x DeepGEMM: DeepGEMM's median in the latest
``docs/data/triton_fp8_prefill_sweep_*.json`` (uniform routing, the rounds of the TMA tiles ``64x128 w4 s4 tma``:
the probe does not run DeepGEMM) over the variant's median; *same bits*: every output of every small layout equals
``DEFAULT_TILES["fp8_block"]``'s and the 4096-token outputs equal the TMA tiles'. Replaces the text between
``<!-- gluon-probe:begin -->`` and ``<!-- gluon-probe:end -->``; ``--check`` exits 1 when the page differs.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main  # noqa: E402

BEGIN, END = "<!-- gluon-probe:begin -->", "<!-- gluon-probe:end -->"
PATTERN = "gluon_fp8_prefill_probe_*.json"
SCRIPT = "bench/studies/gluon_fp8_prefill_probe.py"
DEEPGEMM_ROUNDS_OF = "64x128 w4 s4 tma"
"""The sweep's tiles in whose rounds DeepGEMM's time is taken (the TMA tiles the probe also times)."""


def deep_gemm_ms() -> tuple:
    """``(gemm1 ms, gemm2 ms, sweep date)``: DeepGEMM's medians at uniform routing in the latest prefill sweep JSON."""
    path = data_files("triton_fp8_prefill_sweep_*.json")[-1]
    with open(path) as f:
        d = json.load(f)
    gemms = d["routings"]["uniform"]["gemms"]
    out = []
    for g in ("gemm1", "gemm2"):
        group = str(gemms[g][DEEPGEMM_ROUNDS_OF]["group"])
        out.append(gemms[g]["deep_gemm"]["by_group"][group]["median_ms"])
    return out[0], out[1], d["meta"]["date"]


def _variant_name(key: str) -> str:
    if key == "tma":
        return 'Triton TMA tiles (`"fp8_block_contiguous_tma"`)'
    return key


def _bits(run: dict, key: str) -> bool:
    small = [v for k, v in run.get("bits", {}).items() if k.split(":")[0] == key]
    big = [run["times"][g][key].get("bits_equal_tma", False) for g in ("gemm1", "gemm2")]
    return all(small) and all(big)


def _ms(t: dict) -> str:
    ms = t["ms"]
    return f"{t['median_ms']:.2f} ({min(ms):.2f}-{max(ms):.2f})"


def render(runs: list) -> str:
    dg1, dg2, dg_date = deep_gemm_ms()
    lines = []
    for doc in runs:
        for run in doc["runs"]:
            if "torch" not in run or "command" not in run:
                continue  # the probe's earlier forms: kept in the JSON, not shown
            lines += ([""] if lines else []) + [
                f"Measured on an {run['gpu']}, {run['date']}, torch {run['torch']}, tree {run['head']}: "
                f"`{run['command'].replace('cd .hx/gluon2 && ', '')}` (DeepSeek-V3 at 4096 tokens, uniform routing). "
                f"Variants `gluon {{block_n}} s{{stages}} g{{group_m}} ku{{K_UNROLL}} if{{IN_FLIGHT, 0: the default}} "
                f"[tma]` (`tma`: `epilogue=\"tma\"`). *x DeepGEMM*: DeepGEMM's {dg1:.2f} / {dg2:.2f} ms (GEMM1 / GEMM2) "
                f"of the prefill sweep of {dg_date} over the variant's median.",
                "",
                "| variant | GEMM1 ms | TFLOP/s | x DeepGEMM | GEMM2 ms | TFLOP/s | x DeepGEMM | same bits |",
                "|---|---|---|---|---|---|---|---|"]
            t1, t2 = run["times"]["gemm1"], run["times"]["gemm2"]
            for key in t1:
                if key not in t2 or "median_ms" not in t1[key] or "median_ms" not in t2[key]:
                    continue
                a, b = t1[key], t2[key]
                lines.append(f"| {_variant_name(key)} | {_ms(a)} | {a['tflops_routed_rows']:.0f} | "
                             f"{dg1 / a['median_ms']:.2f}x | {_ms(b)} | {b['tflops_routed_rows']:.0f} | "
                             f"{dg2 / b['median_ms']:.2f}x | {'yes' if _bits(run, key) else '**no**'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    return report_main(sys.argv[1:] if argv is None else argv, description=__doc__.splitlines()[0], script=SCRIPT,
                       pattern=PATTERN, pages=["moe-gpu.md"], begin=BEGIN, end=END, render=render,
                       json_help="gluon_fp8_prefill_probe.py JSON")


if __name__ == "__main__":
    raise SystemExit(main())
