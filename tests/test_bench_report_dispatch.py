"""bench/report_dispatch.py renders docs/fastpaths-dispatch.md's measured table from the benchmark JSON: run
on a small hand-written JSON, the rendered rows are checked cell by cell; and the rows the benchmark writes
(bench.interleaved.row_record, fed by fake-clock timings) are what the report reads."""
from __future__ import annotations

import json
import os

import pytest

from bench import interleaved  # noqa: E402 (the repository root is on sys.path: conftest.py)
from bench import report_dispatch as report  # noqa: E402
from report_pages import rendered  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _case(med, lo, hi, flagged=False):
    return {"median_us": med, "min_us": lo, "max_us": hi, "spread": (hi - lo) / med, "flagged": flagged,
            "calls_per_round": 1}


META = {"gpu": "FakeGPU 9000", "driver": "999.1", "cuda": "13.0", "torch": "2.13.0", "triton": "3.6.0",
        "python": "3.12.0", "date": "2026-11-24 19:00 UTC", "E": 256, "k": 8, "K": 7168, "block_size": 64,
        "alignment": 128, "rounds": 7, "round_ms": 5.0, "flag_spread": 0.1, "copy_TBps": 3.0, "fill_TBps": 3.25}


def _row(op, M, cases, ratios, TBps, **extra):
    return {"op": op, "M": M, "bytes": 1, "rounds": 7, "clock": "cuda_events", "cases": cases,
            "ratio_median": ratios, "ratio_per_round": {}, "TBps": TBps, "pct_copy": 100 * ratios["copy"],
            "flagged": sorted(n for n, c in cases.items() if c["flagged"]), **extra}


FAKE = {"meta": META, "sweep": [], "rows": [
    # target met (92% >= 90) in bold; every baseline present
    _row("moe_permute", 16384,
         {"fastpath": _case(800.0, 790.0, 810.0), "copy": _case(736.0, 730.0, 740.0),
          "torch eager": _case(4000.0, 3900.0, 4100.0), "torch.compile": _case(1600.0, 1590.0, 1610.0),
          "CUDA graph": _case(780.0, 779.0, 781.0), "dense 1:k": _case(760.0, 759.0, 761.0)},
         {"copy": 0.92, "torch eager": 5.0, "torch.compile": 2.0, "CUDA graph": 0.975, "dense 1:k": 0.95}, 2.5),
    # not met; flagged fast path, copy and eager; compile failed; no graph (to_masked syncs)
    _row("to_masked", 1,
         {"fastpath": _case(350.0, 330.0, 400.0, True), "copy": _case(12.0, 10.0, 14.0, True),
          "torch eager": _case(500.0, 400.0, 600.0, True)},
         {"copy": 0.0343, "torch eager": 1.43}, 0.001, compile_error="RuntimeError: boom"),
    # compile skipped by the budget; graph capture failed
    _row("moe_align_block_size", 512,
         {"fastpath": _case(70.0, 69.0, 71.0), "copy": _case(10.0, 10.0, 10.0),
          "torch eager": _case(700.0, 690.0, 710.0)},
         {"copy": 0.143, "torch eager": 10.0}, 0.0007,
         compile_error="skipped: compile budget (90 s) spent", graph_error="RuntimeError: capture"),
]}

def _rendered(tmp_path, data=FAKE):
    return rendered(report.main, tmp_path, data, "fastpath-dispatch")


def test_report_renders_the_table_between_the_markers(tmp_path):
    text = _rendered(tmp_path)
    assert text.startswith("# title\n\nhand text\n\n<!-- fastpath-dispatch:begin -->\n")
    assert text.endswith("<!-- fastpath-dispatch:end -->\n\nafter\n") and "old table" not in text
    lines = text.splitlines()
    head = lines[5]
    assert head.startswith("**FakeGPU 9000**, 2026-11-24 19:00 UTC (driver 999.1, CUDA 13.0, torch 2.13.0, "
                           "triton 3.6.0); E = 256, top-8, hidden 7168 bf16, `block_size` 64, `alignment` 128; "
                           "1 GiB device copy 3.00 TB/s (read + write), `fill_` 3.25 TB/s (write).")
    assert "7 interleaved rounds" in head and "exceeds 10%" in head and ">= 90% of copy" in head
    assert ("| operation | tokens | fast, µs | spread | GB/s | % of copy | % of dense 1:k | x torch eager "
            "| x torch.compile | CUDA graph, µs |") in lines
    assert ("| moe_permute | 16384 | 800.0 (790.0-810.0) | 2.5% | 2500 | **92.0%** | 95.0% | 5.00 | 2.00 "
            "| 780.0 (779.0-781.0) |") in lines
    assert ("| to_masked | 1 | 350.0 (330.0-400.0) ⚠ | 20.0% | 1 | 3.4% ⚠ | — | 1.43 ⚠ | failed | — |") in lines
    assert ("| moe_align_block_size | 512 | 70.0 (69.0-71.0) | 2.9% | 1 | 14.3% | — | 10.00 | skipped "
            "| capture failed |") in lines
    assert "x shipped" not in text  # no sweep table without a sweep


def test_report_renders_the_sweep(tmp_path):
    data = dict(FAKE, sweep=[
        {"kind": "scatter", "cfg": [1, 8192, 8], "shipped": True, "median_us": 800.0, "min_us": 799.0,
         "max_us": 801.0, "flagged": False, "x_shipped": 1.0},
        {"kind": "scatter", "cfg": [2, 4096, 4], "shipped": False, "median_us": 820.0, "min_us": 700.0,
         "max_us": 900.0, "flagged": True, "x_shipped": 0.9756}])
    lines = _rendered(tmp_path, data).splitlines()
    assert "| kernel | (BLOCK_T, row bytes, warps) | µs | x shipped |" in lines
    assert "| scatter | (1, 8192, 8) shipped | 800.0 (799.0-801.0) | 1.000 |" in lines
    assert "| scatter | (2, 4096, 4) | 820.0 (700.0-900.0) ⚠ | 0.976 |" in lines


def test_report_refuses_a_page_without_markers(tmp_path):
    js, page = tmp_path / "d.json", tmp_path / "page.md"
    js.write_text(json.dumps(FAKE))
    page.write_text("no markers here")
    with pytest.raises(ValueError, match="markers"):
        report.main([str(js), "--docs", str(page)])
    assert page.read_text() == "no markers here"  # nothing written


def test_benchmark_rows_are_what_the_report_reads():
    """row_record on fake-clock timings (fast path 2 s, copy 1 s, eager 8 s per call, every round), with the
    benchmark's ``op``: 50% of copy, x4 eager, 1e8 bytes / 2 s = 0.05 GB/s."""
    clock_t = [0.0]

    def advance(dt):
        return lambda: clock_t.__setitem__(0, clock_t[0] + dt)
    res = interleaved.time_interleaved({"fastpath": advance(2.0), "copy": advance(1.0), "torch eager": advance(8.0)},
                                       baselines=["copy", "torch eager"],
                                       clock=interleaved.WallClock(lambda: clock_t[0]))
    row = {"op": "op", **interleaved.row_record(res, 4096, 10**8)}
    assert row["pct_copy"] == 50.0 and row["ratio_median"] == {"copy": 0.5, "torch eager": 4.0}
    text = report.tables({"meta": META, "rows": [row]})
    assert "| op | 4096 | 2000000.0 (2000000.0-2000000.0) | 0.0% | 0 | 50.0% | — | 4.00 | — | — |" in text


def test_docs_page_has_the_markers():
    with open(os.path.join(ROOT, "docs", "fastpaths-dispatch.md")) as f:
        page = f.read()
    assert page.count(report.BEGIN) == 1 and page.count(report.END) == 1
    assert page.index(report.BEGIN) < page.index(report.END)
