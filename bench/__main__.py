"""The benchmarks' one entry point: ``python -m bench`` lists them, ``python -m bench NAME [ARGS ...]`` runs one.

Run from the repository root (the scripts import ``moeref``, ``fastpath`` and ``bench.*`` from it)::

    python -m bench                       # the table below, with each script's path
    python -m bench quant --quick         # = python bench/bench_quant_gpu.py --quick
    python -m bench report-quant --check  # = python bench/report_quant.py --check

``ARGS`` go to the script unchanged (``python -m bench NAME --help`` prints its own options). A name is one
of :data:`BENCHMARKS` or a script's file name without ``.py``. One-off studies, probes, calibrations and
reproducers live in ``bench/studies/`` (index: ``bench/studies/README.md``); they are run by path.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (script under bench/, what it does, machine). Every maintained script of bench/ is here; the
# importable helpers in HELPERS are not run on their own. tests/test_bench_index.py checks both lists
# against the directory, and that every name resolves to an existing script.
BENCHMARKS: dict[str, tuple[str, str, str]] = {
    # drivers
    "gpu": ("run_gpu.sh", "the whole test suite on the GPU, then the quantization and dispatch benchmarks", "GPU"),
    "latency-gpu": ("run_latency_gpu.sh", "the decode-latency benchmark, then the CUDA-graph capture tests", "GPU"),
    "ep-gpu": ("run_ep_gpu.sh", "the EP suites on NCCL with N ranks, then the EP benchmark and its tables", "GPU"),
    # benchmarks
    "formats": ("bench_formats.py", "encode throughput of moeref.formats.encode next to ml_dtypes", "CPU"),
    "quant-cpu": ("bench_quant_reference.py", "reference quantizers (NumPy, one core), elements/s", "CPU"),
    "quant": ("bench_quant_gpu.py", "Triton quantization fast paths: bandwidth against a device copy", "GPU"),
    "dispatch-cpu": ("bench_routing_dispatch.py", "routing and dispatch references at DeepSeek-V3 scale", "CPU"),
    "dispatch": ("bench_dispatch_gpu.py", "token-dispatch fast paths against torch and copy", "GPU"),
    "layer-cpu": ("bench_moe_reference.py", "the exact MoE layer on the CPU, DeepSeek-V3 shape", "CPU"),
    "layer": ("bench_moe_device.py", "the exact MoE reference on the GPU (--fast: the fast layer), DeepSeek-V3", "GPU"),
    "w4-gemm": ("bench_w4_gemm.py", "4-bit-weight grouped GEMMs against bf16, gpt-oss-120b shapes", "GPU"),
    "compare": ("bench_compare_device.py", "compare of a device reference run against the run itself", "GPU"),
    "latency": ("bench_latency_gpu.py", "decode-sized latency of every fast path, eager and CUDA graph", "GPU"),
    "convert": ("bench_convert.py", "checkpoint conversion speed, one expert and the whole model", "CPU/GPU"),
    "convert-v3": ("bench_convert_v3.py", "moeref convert on DeepSeek-V3 layers (real names and shapes) vs the disk",
                   "GPU"),
    "ep": ("bench_ep_gpu.py", "expert-parallel dispatch + combine over NCCL", "GPU"),
    "exact-regimes": ("bench_exact_regimes.py", "kernels on exact-regime inputs: differing outputs, planted faults, "
                      "EP shards, Hypothesis-drawn cases (--time-check: the check's cost against the reference's)",
                      "GPU"),
    "oracle-power": ("bench_oracle_power.py", "planted faults each compare profile catches, and its tightness",
                     "CPU"),
    "fault-catch": ("bench_fault_catch.py", "31 planted faults, 7 honest variants: what the mixed default, the "
                    "exact regime, declared and emulated profiles catch", "CPU/GPU"),
    # report scripts: a benchmark's JSON -> the generated table of a docs page (--check compares)
    "report-quant": ("report_quant.py", "docs/fastpaths.md tables from quant JSON", "any"),
    "report-dispatch": ("report_dispatch.py", "docs/fastpaths-dispatch.md tables from dispatch JSON", "any"),
    "report-latency": ("report_latency.py", "docs/fastpaths-latency.md tables from latency JSON", "any"),
    "report-layer": ("report_moe_device.py", "docs/moe-gpu.md layer tables from layer JSON", "any"),
    "report-compare": ("report_compare_device.py", "docs/moe-gpu.md compare table from compare JSON", "any"),
    "report-convert": ("report_convert.py", "docs/convert.md GPU table from convert JSON", "any"),
    "report-convert-v3": ("report_convert_v3.py", "docs/convert.md DeepSeek-V3-sized table from convert-v3 JSON",
                          "any"),
    "report-ep": ("report_ep.py", "docs/expert-parallel.md and docs/performance.md EP tables from EP JSON", "any"),
    "report-exact-regimes": ("report_exact_regimes.py", "docs/exact-regimes.md tables from exact-regimes JSON",
                             "any"),
    "report-fault-catch": ("report_fault_catch.py", "docs/error-bounds.md planted-fault tables from fault-catch JSON",
                           "any"),
    "report-prefill-sweep": ("report_prefill_sweep.py", "docs/moe-gpu.md Triton FP8 prefill tile table from the "
                             "studies/triton_fp8_prefill_sweep.py JSON", "any"),
    "report-decode-ab": ("report_decode_ab.py", "docs/moe-gpu.md decode A/B table from the "
                         "studies/decode_graph_sweep.py --only decode_ab JSON", "any"),
    "report-gluon-probe": ("report_gluon_probe.py", "docs/moe-gpu.md Gluon FP8 prefill table from the "
                           "studies/gluon_fp8_prefill_probe.py JSON", "any"),
    "report-layer-bound-cpu": ("report_layer_bound_cpu.py", "docs/error-bounds.md CPU cost table from the "
                               "studies/bench_layer_bound_cpu.py JSON", "any"),
    "report-compare-sources": ("report_compare_sources.py", "docs/hopper-fp8-accumulation.md cost table from "
                               "compare --sources JSON", "any"),
    # tools
    "sass-identity": ("sass_identity.py", "SHA-256 of every quantization kernel's SASS (refactors: same code?)",
                      "CPU"),
    "sass-report": ("sass_report.py", "SASS instructions per element of the fast-path kernels", "CPU"),
    "profile-gpu": ("profile_gpu.py", "one launch of each quantization kernel for ncu", "GPU"),
}

# Modules the scripts import; not entry points.
HELPERS = {
    "interleaved.py": "interleaved timing rounds, medians, spreads and ratios (every GPU benchmark)",
    "docs_page.py": "rewrite or --check the generated part of a docs page (every report script)",
    "latency_cases.py": "every fast path as a decode-sized call (latency benchmark, graph-capture tests)",
}


def resolve(name: str) -> str:
    """The path of the script that ``name`` runs: a key of :data:`BENCHMARKS` or a script's stem."""
    if name in BENCHMARKS:
        return os.path.join(HERE, BENCHMARKS[name][0])
    for script, *_ in BENCHMARKS.values():
        if os.path.splitext(script)[0] == name:
            return os.path.join(HERE, script)
    raise ValueError(f"unknown benchmark {name!r}; accepted: {', '.join(BENCHMARKS)} "
                     "(or a script's name without .py); `python -m bench` lists them")


def listing() -> str:
    """The table that ``python -m bench`` prints."""
    width = max(map(len, BENCHMARKS))
    lines = ["usage: python -m bench NAME [ARGS ...]", ""]
    for name, (script, what, machine) in BENCHMARKS.items():
        lines.append(f"  {name:<{width}}  {machine:<7} bench/{script:<26} {what}")
    lines += ["", "one-off studies, probes and calibrations: bench/studies/README.md"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    try:
        path = resolve(argv[0])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if path.endswith(".sh"):
        return subprocess.call(["bash", path, *argv[1:]])
    root = os.path.dirname(HERE)
    if root not in sys.path:
        sys.path.insert(0, root)
    sys.argv = [path, *argv[1:]]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
