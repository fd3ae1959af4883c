"""The measured tables of the docs pages are what the bench/report_*.py scripts make of the committed
benchmark JSON (docs/data/): never edited by hand. One case per report."""
from __future__ import annotations

import glob
import importlib
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")

PAGES = [  # (report script in bench/, JSON under docs/data/, page under docs/, JSON files it takes: None any)
    ("report_quant", "quant_*.json", "fastpaths.md", None),  # bench/bench_quant_gpu.py
    ("report_dispatch", "dispatch_*.json", "fastpaths-dispatch.md", None),  # bench/bench_dispatch_gpu.py
    ("report_latency", "latency_*.json", "fastpaths-latency.md", None),  # bench/bench_latency_gpu.py
    ("report_moe_device", "moe_device_*.json", "moe-gpu.md", None),  # bench/bench_moe_device.py
    ("report_compare_device", "compare_device_*.json", "moe-gpu.md", None),  # bench/bench_compare_device.py
    ("report_convert", "convert_gpu_*.json", "convert.md", 1),  # bench/bench_convert.py --gpu
    ("report_convert_v3", "convert_v3_*.json", "convert.md", None),  # bench/bench_convert_v3.py
    ("report_ep", "ep_*.json", "expert-parallel.md", None),  # bench/bench_ep_gpu.py
    ("report_ep", "ep_*.json", "performance.md", None),  # bench/bench_ep_gpu.py
    ("report_exact_regimes", "exact_regimes_*.json", "exact-regimes.md", None),  # bench/bench_exact_regimes.py
    ("studies.eager_host_profile", "eager_host_profile_*.json", "moe-gpu.md", 1),  # the eager study
    ("report_fault_catch", "fault_catch_*.json", "error-bounds.md", None),  # bench/bench_fault_catch.py
    ("report_prefill_sweep", "triton_fp8_prefill_sweep_*.json", "moe-gpu.md", None),  # studies/triton_fp8_prefill_sweep.py
    ("report_decode_ab", "decode_ab_*.json", "moe-gpu.md", None),  # studies/decode_graph_sweep.py --only decode_ab
    ("report_gluon_probe", "gluon_fp8_prefill_probe_*.json", "moe-gpu.md", None),  # studies/gluon_fp8_prefill_probe.py
    ("report_layer_bound_cpu", "layer_bound_cpu_*.json", "error-bounds.md", None),  # studies/bench_layer_bound_cpu.py
    ("report_compare_sources", "compare_sources_*.json", "hopper-fp8-accumulation.md", None),  # compare --sources
]


@pytest.mark.parametrize("script,pattern,page,count", PAGES, ids=[f"{p[0]}-{p[2]}" for p in PAGES])
def test_page_tables_are_generated_from_the_benchmark_json(script, pattern, page, count):
    report = importlib.import_module(f"bench.{script}")
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "data", pattern)))
    assert files, f"no docs/data/{pattern}"
    if count is not None:
        assert len(files) == count, files
    if hasattr(report, "default_json"):  # what the script reads when given no JSON
        assert [os.path.realpath(f) for f in files] == [os.path.realpath(f) for f in report.default_json()]
    assert report.main([*files, "--docs", os.path.join(ROOT, "docs", page), "--check"]) == 0, (
        f"docs/{page} differs from the benchmark JSON: run bench/{script}.py " + " ".join(files))
