"""docs/fastpaths-dispatch.md's measured table is what bench/report_dispatch.py makes of the committed JSON
(docs/data/dispatch_*.json, written by bench/bench_dispatch_gpu.py): never edited by hand."""
from __future__ import annotations

import glob
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_dispatch_table_is_generated_from_the_benchmark_json():
    from bench import report_dispatch as report
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "data", "dispatch_*.json")))
    assert files, "no docs/data/dispatch_*.json"
    assert [os.path.realpath(f) for f in files] == [os.path.realpath(f) for f in report.default_json()]
    assert report.main([*files, "--docs", os.path.join(ROOT, "docs", "fastpaths-dispatch.md"), "--check"]) == 0, (
        "docs/fastpaths-dispatch.md differs from the benchmark JSON: run bench/report_dispatch.py " + " ".join(files))
