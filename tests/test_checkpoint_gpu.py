"""GPU part of checkpoint conversion (skipped without CUDA; the lead runs them on the GPU machine).

* ``moeref convert --engine triton`` writes the same bytes as ``--engine numpy`` (the fast path
  is bit-identical to the reference), and the report names the engine per module.
* One 7168 x 2048 FP8 weight to NVFP4 / MXFP4 through :mod:`fastpath.requant` (fused FP8-block
  decode + quantize): bit-identical to the CPU path (bench/bench_convert.py ``bench_gpu``).
"""
from __future__ import annotations


import numpy as np
import pytest

pytestmark = [pytest.mark.gpu]

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import checkpoint_fixtures as F  # noqa: E402

from moeref.checkpoint import ConvertOptions, convert_checkpoint  # noqa: E402


@pytest.mark.parametrize("source,target", [("deepseek-fp8", "ct-nvfp4"),
                                           ("deepseek-fp8", "modelopt-nvfp4"),
                                           ("bf16", "ct-mxfp4"), ("ct-fp8-block", "gptoss-mxfp4")])
def test_triton_engine_writes_the_numpy_bytes(tmp_path, source, target):
    src = str(tmp_path / "src")
    F.BUILDERS[source](src, np.random.default_rng(5))
    a = convert_checkpoint(src, str(tmp_path / "np"), ConvertOptions(target=target, engine="numpy"))
    b = convert_checkpoint(src, str(tmp_path / "tr"), ConvertOptions(target=target, engine=F.triton_engine(),
                                                                      verify=True))
    assert {m.engine for m in b.modules} == {"triton"}
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]


def _bench():
    from bench import bench_convert

    return bench_convert


def test_one_deepseek_weight_bit_identical_on_the_gpu():
    """Bit-identity of the GPU conversion of one DeepSeek-V3 weight (the fused fastpath.requant
    path the converter takes, and the unfused one it replaced) against the CPU reference. Its
    speed is a benchmark figure (bench/bench_convert.py --gpu, docs/data/convert_gpu_*.json,
    docs/convert.md), not a test."""
    result = _bench().bench_gpu(rounds=2, reps=2, n_src=2)
    assert {r["target"] for r in result["rows"]} == {"modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4"}
    for r in result["rows"]:
        assert r["bit_identical"], (r["target"], r["path"])


def test_triton_engine_fused_gate_up_shares_the_global_and_matches_numpy(tmp_path):
    names = ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj"]
    src = str(tmp_path / "src")
    F.deepseek_fp8(src, np.random.default_rng(6), shapes=((512, 1024), (512, 1024)), names=names)
    for target in ("modelopt-nvfp4", "ct-nvfp4"):
        a = convert_checkpoint(src, str(tmp_path / f"np-{target}"),
                               ConvertOptions(target=target, engine="numpy"))
        b = convert_checkpoint(src, str(tmp_path / f"tr-{target}"),
                               ConvertOptions(target=target, engine=F.triton_engine()))
        assert {m.engine for m in b.modules} == {"triton"}
        assert all("shared with" in m.note for m in b.modules)
        assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
