"""bench/report_latency.py renders docs/fastpaths-latency.md's tables from bench_latency_gpu.py's JSON:
a small hand-written JSON is rendered and checked cell by cell (the target's bold, flags, errors). That the
committed page is what the committed JSON gives is tests/test_generated_docs.py's."""
from __future__ import annotations

from bench import report_latency as report  # noqa: E402 (the repository root is on sys.path: conftest.py)


def _c(med, flagged=False):
    return {"median_us": med, "min_us": med, "max_us": med, "spread": 0.0, "flagged": flagged, "calls_per_round": 9}


META = {"gpu": "FakeGPU 9000", "driver": "999.1", "cuda": "13.0", "torch": "2.11.0", "triton": "3.6.0",
        "python": "3.12.3", "date": "2026-11-24 21:00 UTC", "rounds": 7, "round_ms": 3.0, "flag_spread": 0.1,
        "target_us": 15.0, "floor_factor": 1.5, "label": "abc123"}
FAKE = {"meta": META, "rows": [
    # overhead 12 <= 15: met (bold)
    {"case": "k1", "group": "quant", "M": 1, "launches": 1, "graph_equal": True, "met": True,
     "cases": {"eager": _c(15.0), "graph": _c(3.0), "floor": _c(9.0), "floor (cached launcher)": _c(4.0),
               "torch eager": _c(40.0, True), "torch.compile": _c(20.0)},
     "overhead_us": {"median": 12.0, "min": 11.0, "max": 13.0, "per_round": [12.0] * 7}},
    # overhead 50 > 15 and > 1.5 x floor 30: not met
    {"case": "k2", "group": "dispatch", "M": 1, "launches": 3, "graph_equal": True, "met": False,
     "cases": {"eager": _c(60.0), "graph": _c(10.0), "floor": _c(30.0), "floor (cached launcher)": _c(12.0)},
     "overhead_us": {"median": 50.0, "min": 49.0, "max": 51.0, "per_round": [50.0] * 7},
     "compile_error": "skipped: --compile-budget-s spent"},
    {"case": "k2", "group": "dispatch", "M": 64, "launches": 3, "graph_error": "RuntimeError: sync. More text",
     "cases": {"eager": _c(70.0), "floor": _c(31.0)}},
]}


def test_rendered_cells():
    text = report.tables(FAKE)
    assert "**FakeGPU 9000**, 2026-11-24 21:00 UTC (abc123): driver 999.1" in text
    assert "| k1 | 1 | 15.0 | — | 3.0 | **12.0** | 9.0 | 4.0 | 40.0 ⚠ | 20.0 | bit-equal |" in text
    assert "| k2 | 3 | 60.0 | — | 10.0 | 50.0 | 30.0 | 12.0 | — | not timed | bit-equal |" in text
    assert "| k1 | **12.0** / 9.0 | — |" in text
    assert "| k2 | 50.0 / 30.0 | — / 31.0 |" in text
    assert "Target met in 1 of 2 (fast path, M) rows." in text
    assert "Errors: k2 (M = 64): RuntimeError: sync" in text


def test_before_column_and_speedup():
    import copy

    data = copy.deepcopy(FAKE)
    r = data["rows"][0]
    r["cases"]["eager, before"] = _c(45.0)
    r["overhead_before_us"] = {"median": 42.0, "min": 41.0, "max": 43.0}
    r["speedup_vs_before"] = 3.0
    text = report.tables(data)
    assert "| k1 | 1 | 15.0 | 45.0 | 3.0 | **12.0** |" in text
    assert "| k1 | **12.0** / 42.0 / 9.0 | — |" in text
    assert "Eager time before / now, per round, median over rows: 3.00x (range 3.00-3.00x over 1 rows)." in text


def test_a_run_without_recorded_launches_has_no_floor_and_no_verdict():
    import copy

    data = copy.deepcopy(FAKE)
    for r in data["rows"]:
        r["launches"] = 0
    text = report.tables(data)
    assert "| k1 | 0 | 15.0 | — | 3.0 | 12.0 | not recorded | not recorded |" in text  # 12 not bold
    assert "Target not judged: this run recorded no floor." in text
