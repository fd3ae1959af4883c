"""bench/bench_convert_v3.py: DeepSeek-V3's real tensor names and shapes, and a tiny run of the whole script
(the GPU run is the lead's: the command is in docs/convert.md)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from bench import bench_convert, bench_convert_v3 as B  # noqa: E402
from bench.convert_v3 import source as S  # noqa: E402


def test_layer_tensors_are_deepseek_v3s():
    """Names and shapes as in the DeepSeek-V3 Hugging Face checkpoint (shared notes, checkpoint-formats.md
    section 1: gate/up [2048, 7168], down [7168, 2048], kv_a_proj_with_mqa N = 512 + 64)."""
    t = {n: (k, s) for n, k, s in B.layer_tensors(5, B.V3)}
    p = "model.layers.5."
    assert t[p + "mlp.experts.255.gate_proj"] == ("fp8", (2048, 7168))
    assert t[p + "mlp.experts.0.down_proj"] == ("fp8", (7168, 2048))
    assert t[p + "mlp.shared_experts.up_proj"] == ("fp8", (2048, 7168))
    assert t[p + "self_attn.kv_a_proj_with_mqa"] == ("fp8", (576, 7168))
    assert t[p + "self_attn.q_b_proj"] == ("fp8", (128 * 192, 1536))
    assert t[p + "self_attn.o_proj"] == ("fp8", (7168, 128 * 128))
    assert t[p + "mlp.gate.weight"] == ("bf16", (256, 7168))
    assert t[p + "mlp.gate.e_score_correction_bias"] == ("f32", (256,))
    assert sum(k == "fp8" for k, _ in t.values()) == 5 + 257 * 3
    dense = {n: s for n, k, s in B.layer_tensors(0, B.V3)}
    assert dense["model.layers.0.mlp.gate_proj"] == (18432, 7168) and "model.layers.0.mlp.gate.weight" not in dense
    # the FP8 elements of all 61 layers: bench_convert's independent count from config_671B.json
    fp8 = sum(s[0] * s[1] for i in range(61) for _, k, s in B.layer_tensors(i, B.V3) if k == "fp8")
    assert fp8 == bench_convert.deepseek_v3_quantized_elements()


def test_tiny_run_writes_the_json_and_leaves_nothing(tmp_path):
    out = tmp_path / "run.json"
    work = tmp_path / "work"
    work.mkdir()
    assert B.main(["--tiny", "--layers", "2", "--bandwidth-gib", "0.01", "--dir", str(work),
                   "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert os.listdir(work) == []  # sources, outputs and the bandwidth file deleted
    assert [r["layer"] for r in d["layers"]] == [3, 4]
    tiny_layer = S.source_bytes(B.layer_tensors(3, B.TINY))
    for r in d["layers"]:
        assert r["modules"] == 5 + 3 * (B.TINY["experts"] + 1) and r["copied"] == 6
        assert tiny_layer < r["bytes_read"] < tiny_layer + 65536  # the tensors plus headers and padding
        assert 0 < r["bytes_written"] < r["bytes_read"] and r["seconds"] > 0
    assert d["projection"]["model_source_bytes"] == B.model_source_bytes(B.TINY)
    assert set(d["meta"]) >= {"gpu", "date", "torch", "cuda", "tree"}
    assert d["disk"]["write_GBps"] > 0 and d["disk"]["read_GBps"] > 0
    assert d["complete"] and d["stopped"] is None and d["current"] is None and d["projection"]["layers"] == 2
    for r in d["layers"]:  # where the time went: the source's stages, the conversion's own
        assert set(r["stages"]) == {"source", "convert", "delete"} and r["stages"]["convert"] == r["seconds"]
        assert set(r["source_stages"]["seconds"]) == {"generate", "write", "fsync", "drop_cache"}
        assert {"read", "quantize", "report", "write", "close", "hash", "plan", "finish"} <= \
            set(r["convert_stages"]["seconds"])
        assert r["convert_stages"]["counts"]["quantize"] == r["modules"]
        assert [s["modules_done"] for s in r["shards_done"]] == [r["modules"]]
    assert set(d["warm_up"]["stages"]) == {"source", "convert", "delete"}


def test_max_seconds_stops_before_a_layer_and_the_report_says_so(tmp_path):
    out = tmp_path / "run.json"
    assert B.main(["--tiny", "--layers", "2", "--bandwidth-gib", "0.01", "--dir", str(tmp_path),
                   "--max-seconds", "1e-9", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["layers"] == [] and not d["complete"] and d["projection"] is None
    assert d["stopped"].startswith("--max-seconds") and d["layers_asked"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
    from bench import report_convert_v3 as R

    assert "0 of the 2 layers asked for were converted" in R.section(d) and "No layer finished" in R.section(d)


def test_the_report_of_a_partial_run_projects_from_the_layers_done(tmp_path):
    """A run stopped after 1 of 3 layers: the table has that layer, the projection its rate, and the text says
    1 of 3; the stage table lists the conversion's stages."""
    from bench import report_convert_v3 as R

    out = tmp_path / "run.json"
    assert B.main(["--tiny", "--layers", "1", "--bandwidth-gib", "0.01", "--dir", str(tmp_path),
                   "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    d.update(layers_asked=3, complete=False, stopped="--max-seconds 60: ...")
    text = R.section(d)
    assert "1 of the 3 layers asked for were converted" in text and "| **all 1** |" in text
    assert "| quantize (the engine) |" in text and "| **conversion (timed)** |" in text
    r = d["layers"][0]
    assert d["projection"]["seconds"] == r["seconds"] * d["projection"]["model_source_bytes"] / r["bytes_read"]


def test_random_codes_are_finite_e4m3_and_reproducible():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        a = S._random_codes(3 * S.RANDOM_CHUNK + 5, (1, 2), pool)
        b = S._random_codes(3 * S.RANDOM_CHUNK + 5, (1, 2), pool)
        c = S._random_codes(1000, (1, 3), pool)
    assert a.dtype == np.uint8 and a.size == 3 * S.RANDOM_CHUNK + 5 and np.array_equal(a, b)
    assert not np.any((a & 0x7F) == 0x7F)  # no NaN code
    counts = np.bincount(a, minlength=256)
    assert np.count_nonzero(counts) == 254  # every finite code occurs
    assert counts[0x7E] > 1.5 * counts[0x10]  # the largest codes take the NaN codes' share
    assert not np.array_equal(c, a[:1000])


def test_rename_source_gives_the_next_layers_names_to_the_same_bytes(tmp_path):
    """--same-weights: layer 9's source renamed to layer 10 (a longer name: the header grows into the reserved
    space): every tensor of layer 10 is there with layer 9's bytes, the index too, and the data did not move."""
    from moeref.checkpoint import SafetensorsCheckpoint

    src = str(tmp_path / "src")
    n = B.write_source(src, B.layer_tensors(9, B.TINY), 1 << 18, seed=1)
    before = SafetensorsCheckpoint.open(src)
    old = {k: before.read_bytes(k) for k in before.names()}
    sizes = {f: os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors")}
    assert len(sizes) > 1  # several shards
    assert B.rename_source(src, 9, 10) == n
    after = SafetensorsCheckpoint.open(src)
    want = {k.replace("model.layers.9.", "model.layers.10.", 1): v for k, v in old.items()}
    assert sorted(after.names()) == sorted(want)
    assert all(after.read_bytes(k) == v for k, v in want.items())
    assert {f: os.path.getsize(os.path.join(src, f)) for f in sizes} == sizes


def test_same_weights_run_renames_instead_of_writing(tmp_path):
    out = tmp_path / "run.json"
    assert B.main(["--tiny", "--layers", "2", "--same-weights", "--bandwidth-gib", "0.01", "--dir", str(tmp_path),
                   "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    first, second = d["layers"]
    assert "generate" in first["source_stages"]["seconds"] and "rename" not in first["source_stages"]["seconds"]
    assert set(second["source_stages"]["seconds"]) == {"rename", "drop_cache"}
    assert first["bytes_read"] == second["bytes_read"] and first["modules"] == second["modules"]
    assert d["same_weights"] and [p.name for p in tmp_path.iterdir()] == ["run.json"]
