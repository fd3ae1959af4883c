"""bench/report_prefill_sweep.py renders docs/moe-gpu.md's Triton FP8 prefill tile table from
bench/studies/triton_fp8_prefill_sweep.py's JSON: the committed H200 run is rendered and its cells checked against
values recomputed here from the JSON's per-round seconds. That the committed page is what the committed JSON gives
is tests/test_generated_docs.py's."""
from __future__ import annotations

import json
import os
import statistics

import pytest

from bench import report_prefill_sweep as report  # noqa: E402 (the repository root is on sys.path: conftest.py)

pytest.importorskip("torch")
pytest.importorskip("triton")


RUN = os.path.join(os.path.dirname(__file__), "..", "docs", "data", "triton_fp8_prefill_sweep_h200_2026-11-28.json")
"""The run these tests check cell by cell (the full tile sweep; the figures below are its own)."""


def _run():
    assert RUN in report.default_json() or os.path.basename(RUN) in map(os.path.basename, report.default_json())
    with open(RUN) as f:
        return json.load(f)


def _row(text: str, start: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(start)]
    assert len(rows) == 1, (start, rows)
    return rows[0]


def test_short_names_are_the_candidates_names():
    """The table names tiles by their fields as FP8_PREFILL_CANDIDATES' hand-written keys do."""
    from fastpath.grouped_gemm import FP8_PREFILL_CANDIDATES

    for name, tiles in FP8_PREFILL_CANDIDATES.items():
        assert report.short_name(repr(tiles)) == name, name


def test_the_default_tiles_are_named_and_their_ratios_are_the_per_round_medians():
    d = _run()
    from fastpath.grouped_gemm import GemmTiles

    assert report.default_names(d["configs"]) == {"64x128 w4 s4 tma": "fp8_block_contiguous_tma",
                                                  "default": "fp8_block"}
    recorded = report._fields(d["configs"]["64x128 w4 s4 tma"])  # the JSON predates GemmTiles.promotion
    assert recorded == {k: repr(v) for k, v in vars(GemmTiles(64, 128, 128, 4, 4, tma=True)).items() if k in recorded}
    assert "promotion" not in recorded and GemmTiles.promotion == "inline"
    lagged = {**d["configs"], "64x128 w4 s4 tma": repr(GemmTiles(64, 128, 128, 4, 4, tma=True, promotion="lagged_pair"))}
    assert report.default_names(lagged) == {"default": "fp8_block"}  # another promotion is not the default
    text = report.table([d])
    uni = d["routings"]["uniform"]
    cells = []
    for g in ("gemm1", "gemm2"):
        r = uni["gemms"][g]["64x128 w4 s4 tma"]
        dg = uni["gemms"][g]["deep_gemm"]["by_group"][str(r["group"])]["seconds_per_round"]
        x = statistics.median(a / b for a, b in zip(dg, r["seconds_per_round"]))
        cells.append(f"{statistics.median(r['seconds_per_round']) * 1e3:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f}) | "
                     f"{x:.2f}x")
    row = _row("\n".join(_by_routing(text)["uniform"]),
               '| | `64x128 w4 s4 tma` (`DEFAULT_TILES["fp8_block_contiguous_tma"]`) | yes | ')
    assert " | ".join(cells) in row, (cells, row)
    assert "| 3.59 (3.28-3.72) | 0.70x |" in row  # the H200 figure the prose quotes


def _by_routing(text: str) -> dict:
    """The first table's rows by routing (a row with an empty first cell continues the routing above)."""
    out, cur = {}, None
    for line in text.split("\n\n")[1].splitlines()[2:]:
        first = line.split("|")[1].strip()
        if first:
            cur = first.split(" (")[0]
        out.setdefault(cur, []).append(line)
    return out


def test_the_fastest_bit_equal_tiles_are_shown_and_other_bits_are_flagged():
    d = _run()
    rows = _by_routing(report.table([d]))
    assert set(rows) == set(d["routings"])
    for rname, rec in d["routings"].items():
        block = "\n".join(rows[rname])
        both = rec["together"]
        equal = [n for n in both if n != "best_pair" and rec["gemms"]["gemm1"][n]["bits_equal_default"]
                 and rec["gemms"]["gemm2"][n]["bits_equal_default"]]
        fastest = sorted(equal, key=lambda n: both[n]["x_deep_gemm"], reverse=True)[:report.N_BEST]
        for n in fastest:
            assert f"| | `{n}`" in block, (rname, n)
        slow = min(equal, key=lambda n: both[n]["x_deep_gemm"])
        assert f"`{slow}`" not in block  # the slowest bit-equal tile is not among them
        assert "| | `128x128 w4 s4 pers1 tma ws g2` | **no** |" in block  # faster, other bits
    assert "| skewed | DeepGEMM (scattered rows) | | 2.51 (2.39-2.56) | |" in report.table([d])
