"""bench/report_compare_sources.py renders docs/hopper-fp8-accumulation.md's cost table of an emulated profile's
`compare` from bench_compare_device.py ``--sources`` JSON: the committed H200 run is rendered and its cells checked
against values recomputed here from the JSON's per-round seconds. That the committed page is what the committed JSON
gives is tests/test_generated_docs.py's."""
from __future__ import annotations

import json
import os
import statistics

from bench import report_compare_sources as report  # noqa: E402 (the repository root is on sys.path: conftest.py)


RUN = os.path.join(os.path.dirname(__file__), "..", "docs", "data", "history", "compare_sources_h200_2026-11-28.json")
"""The run these tests check cell by cell (both sources timed; the figures below are its own)."""


def _run():
    assert report.default_json(), "no docs/data/compare_sources_*.json"
    with open(RUN) as f:
        return json.load(f)


def test_rows_are_the_per_round_medians_and_the_rest_is_what_the_parts_leave():
    d = _run()
    text = report.table([d])
    row = d["rows"][0]
    cases = row["timing"]["cases"]
    ref = cases["reference"]["seconds"]
    for source, name in (("tensor_cores", "tensor cores (each call proves 1/128 of its rows, at least 32"),
                         ("emulator", "emulator (CUDA cores)")):
        got = cases["compare " + source]["seconds"]
        x = statistics.median(c / r for c, r in zip(got, ref))  # compare / reference, per round
        line = next(line for line in text.splitlines() if name in line)
        assert f"| {statistics.median(got):.2f} ({min(got):.2f}-{max(got):.2f}) | **{x:.1f}x** | yes | False |" in line
    assert "| 4096 | tensor cores (" in text and f"| {statistics.median(ref):.3f} (" in text
    c = row["cost tensor_cores"]
    rest = statistics.median(cases["compare tensor_cores"]["seconds"]) - c["tensor_core_s"] - c["proof_s"]
    assert f"| 4096 | tensor cores | 121, 90,128, 0.205 | 121, 4,121, 0.209 (0.153) | {rest:.2f} |" in text
    assert "**18.2x**" in text and "**37.6x**" in text  # the figures the docs quote (H200, 2026-11-28)


def test_command_is_rebuilt_from_the_json():
    d = _run()
    assert report.command(d) == ("python -m bench compare --profile DEEPGEMM_FP8_EXACT --tokens 4096 --check-rows 0 "
                                 "--sources tensor_cores emulator --rounds 7")
    d["rows"][0]["check"] = {}
    assert "--check-rows" not in report.command(d)
