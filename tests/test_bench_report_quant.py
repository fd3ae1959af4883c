"""bench/report_quant.py renders docs/fastpaths.md's quantization tables from the benchmark JSON: run on a
small hand-written JSON, the rendered rows are checked cell by cell; and the rows the benchmark writes
(bench_quant_gpu.row_record, fed by fake-clock timings) are what the report reads."""
from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


from bench import report_quant as report  # noqa: E402 (the repository root is on sys.path: conftest.py)
from report_pages import page_with_markers, rendered  # noqa: E402


def _case(med, lo, hi, flagged=False):
    return {"median_us": med, "min_us": lo, "max_us": hi, "spread": (hi - lo) / med, "flagged": flagged,
            "calls_per_round": 1}


META = {"gpu": "FakeGPU 9000", "driver": "999.1", "cuda": "13.0", "torch": "2.13.0", "triton": "3.6.0",
        "date": "2026-11-24 19:00 UTC", "M": 4096, "K": 7168, "rounds": 7, "round_ms": 10.0,
        "flag_spread": 0.1, "copy_TBps": 4.0}

FAKE = {"meta": META, "traffic_ceiling_TBps": {}, "kernels": {
    "fp8_1x128": {"small_graph_us": 1.5, "rows": [
        {"M": 1, "bytes": 100, "cases": {"fastpath": _case(20.0, 19.0, 21.0), "copy": _case(10.0, 10.0, 10.0)},
         "ratio_median": {"copy": 0.5}, "ratio_per_round": {"copy": [0.5] * 7}, "TBps": 5e-6, "pct_copy": 50.0,
         "flagged": []},
        {"M": 4096, "bytes": 2 * 10**8, "cases": {
            "fastpath": _case(50.0, 49.0, 60.0, True), "copy": _case(46.0, 45.0, 47.0),
            "torch eager": _case(800.0, 790.0, 810.0), "torch.compile": _case(55.0, 54.0, 56.0)},
         "ratio_median": {"copy": 0.92, "torch eager": 16.0, "torch.compile": 1.1},
         "ratio_per_round": {}, "TBps": 4.0, "pct_copy": 92.0, "flagged": ["fastpath"]}]},
    "nvfp4": {"rows": [
        {"M": 4096, "bytes": 10**8, "cases": {
            "fastpath": _case(100.0, 99.0, 101.0), "copy": _case(50.0, 40.0, 60.0, True),
            "torch.compile": _case(90.0, 89.0, 91.0), "DeepGEMM": _case(300.0, 200.0, 400.0, True)},
         "ratio_median": {"copy": 0.5, "torch.compile": 0.9, "DeepGEMM": 3.0},
         "ratio_per_round": {}, "TBps": 1.0, "pct_copy": 50.0, "flagged": ["copy", "DeepGEMM"]}]}}}

def _rendered(tmp_path):
    return rendered(report.main, tmp_path, FAKE, "fastpath-quant")


def test_report_renders_the_tables_between_the_markers(tmp_path):
    text = _rendered(tmp_path)
    assert text.startswith("# title\n\nhand text\n\n<!-- fastpath-quant:begin -->\n")
    assert text.endswith("<!-- fastpath-quant:end -->\n\nafter\n") and "old table" not in text
    lines = text.splitlines()
    assert ("**FakeGPU 9000**, 2026-11-24 19:00 UTC (driver 999.1, CUDA 13.0, torch 2.13.0, triton 3.6.0); "
            "input 4096 x 7168 bfloat16; device copy 4.00 TB/s.") in lines[5]
    assert "7 interleaved rounds" in lines[5] and "exceeds 10%" in lines[5]
    assert "| kernel | TB/s | % of copy | time, us | spread | x torch eager | x torch.compile | x DeepGEMM |" in lines
    # targets met (92% >= 90, 1.1 >= 1.0) in bold; the flagged fast-path time carries the mark
    assert "| fp8_1x128 | 4.00 | **92.0%** | 50.0 (49.0-60.0) ⚠ | 22.0% | 16.00 | **1.10** | — |" in lines
    # not met: plain; a flagged copy and a flagged DeepGEMM are marked on their cells
    assert "| nvfp4 | 1.00 | 50.0% ⚠ | 100.0 (99.0-101.0) | 2.0% | — | 0.90 | 3.00 ⚠ |" in lines
    assert "| kernel | M=1 | M=4096 | M=1 graph replay |" in lines
    assert "| fp8_1x128 | 20.0 (19.0-21.0) | 50.0 (49.0-60.0) ⚠ | 1.5 |" in lines
    assert "| nvfp4 | — | 100.0 (99.0-101.0) | — |" in lines


def test_report_writes_the_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the `all` extra)")
    js, page, png = tmp_path / "b.json", tmp_path / "p.md", tmp_path / "bw.png"
    js.write_text(json.dumps(FAKE))
    page.write_text(page_with_markers("fastpath-quant"))
    assert report.main([str(js), "--docs", str(page), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_refuses_a_page_without_markers(tmp_path):
    js, page = tmp_path / "bench_quant.json", tmp_path / "page.md"
    js.write_text(json.dumps(FAKE))
    page.write_text("no markers here")
    with pytest.raises(ValueError, match="markers"):
        report.main([str(js), "--docs", str(page)])
    assert page.read_text() == "no markers here"  # nothing written


def test_docs_page_has_the_markers():
    with open(os.path.join(ROOT, "docs", "fastpaths.md")) as f:
        page = f.read()
    assert page.count(report.BEGIN) == 1 and page.count(report.END) == 1
    assert page.index(report.BEGIN) < page.index(report.END)


def test_benchmark_rows_are_what_the_report_reads():
    """bench_quant_gpu.row_record on fake-clock timings (fast path 2 s, copy 1 s per call, every round)
    gives rows the report renders: 50% of copy, ratio 0.5, 1e8 bytes / 2 s."""
    bq = pytest.importorskip("bench.bench_quant_gpu", reason="bench_quant_gpu needs torch + triton")
    from bench import interleaved
    clock_t = [0.0]

    def advance(dt):
        return lambda: clock_t.__setitem__(0, clock_t[0] + dt)
    res = interleaved.time_interleaved({"fastpath": advance(2.0), "copy": advance(1.0)}, baselines=["copy"],
                                       clock=interleaved.WallClock(lambda: clock_t[0]))
    row = bq.row_record(res, 4096, 10**8)
    assert row["pct_copy"] == 50.0 and row["ratio_median"] == {"copy": 0.5}
    assert row["TBps"] == 10**8 / 2.0 / 1e12 and row["cases"]["fastpath"]["median_us"] == 2e6
    data = {"meta": META, "kernels": {"k": {"rows": [row]}}}
    assert "| k | 0.00 | 50.0% | 2000000.0 (2000000.0-2000000.0) | 0.0% | — | — | — |" in report.tables(data)
