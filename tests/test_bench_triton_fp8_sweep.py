"""The CPU-runnable part of bench/studies/triton_fp8_prefill_sweep.py (issue 33's GPU sweep): a tiny run under
Triton's interpreter writes the JSON the lead reads, with every tile's first call, its bits against the default
tiles, timings and the token-row (``a_src``) phase; unknown tile names are refused."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import on_gpu  # noqa: E402

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "studies", "triton_fp8_prefill_sweep.py")


def _sweep():
    spec = importlib.util.spec_from_file_location("triton_fp8_prefill_sweep", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_interpreter_run_writes_the_json(tmp_path):
    if on_gpu():
        pytest.skip("the tiny run is the interpreter's; on a GPU the script measures the real shapes (minutes)")
    out = tmp_path / "s.json"
    assert _sweep().main(["--out", str(out), "--configs", "64x128 w4 s4 g4", "--routings", "skewed"]) == 0
    res = json.loads(out.read_text())
    rec = res["routings"]["skewed"]
    assert rec["real_rows"] == 16 * res["shape"]["top_k"] and rec["layout_rows"] % 128 == 0
    for g in ("gemm1", "gemm2"):
        for name in ("default", "64x128 w4 s4 g4"):
            row = rec["gemms"][g][name]
            assert row["status"] == "ok" and row["bits_equal_default"], (g, name, row)
            assert row["median_ms"] > 0 and len(row["seconds_per_round"]) == 7
    assert rec["together"]["best_pair"]["median_ms"] > 0
    assert rec["gemm1_a_src"]["default"]["bits_equal_scattered_rows"]
    assert res["best"]["skewed"]["gemm1"]["config"] in ("default", "64x128 w4 s4 g4")


def test_unknown_tile_name_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown configs"):
        _sweep().main(["--out", str(tmp_path / "s.json"), "--configs", "no such tile"])
