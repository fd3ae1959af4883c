"""docs/moe-gpu.md's performance tables are what bench/report_moe_device.py makes of the committed JSON
(docs/data/moe_device_*.json, written by bench/bench_moe_device.py on the GPU): never edited by hand."""
from __future__ import annotations

import glob
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_docs_tables_are_generated_from_the_benchmark_json():
    from bench import report_moe_device as report
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "data", "moe_device_*.json")))
    assert files, "no benchmark JSON committed"
    assert report.main(files + ["--docs", os.path.join(ROOT, "docs", "moe-gpu.md"), "--check"]) == 0, (
        "docs/moe-gpu.md differs from the benchmark JSON: run bench/report_moe_device.py " + " ".join(files))
