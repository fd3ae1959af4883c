"""docs/convert.md's GPU table is what bench/report_convert.py makes of the committed JSON
(docs/data/convert_gpu_*.json, written by bench/bench_convert.py --gpu): never edited by hand."""
from __future__ import annotations

import glob
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_convert_docs_table_is_generated_from_the_benchmark_json():
    from bench import report_convert as report
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "data", "convert_gpu_*.json")))
    assert len(files) == 1, files
    assert report.main([files[0], "--docs", os.path.join(ROOT, "docs", "convert.md"), "--check"]) == 0, (
        "docs/convert.md differs from the benchmark JSON: run bench/report_convert.py " + files[0])
