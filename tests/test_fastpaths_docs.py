"""docs/fastpaths.md's quantization tables are what bench/report_quant.py makes of the committed JSON
(docs/data/quant_*.json, written by bench/bench_quant_gpu.py): never edited by hand."""
from __future__ import annotations

import glob
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_fastpaths_tables_are_generated_from_the_benchmark_json():
    from bench import report_quant as report
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "data", "quant_*.json")))
    assert files, "no docs/data/quant_*.json"
    assert report.main([*files, "--docs", os.path.join(ROOT, "docs", "fastpaths.md"), "--check"]) == 0, (
        "docs/fastpaths.md differs from the benchmark JSON: run bench/report_quant.py " + " ".join(files))
