"""The EP reference on NCCL, one process per GPU (``gpu`` tests: skipped on CPU machines, and on a
machine with fewer than 2 GPUs for the multi-rank test). The code is the gloo code; only the backend
and the device of the collectives' tensors change."""
from __future__ import annotations

import os

import numpy as np
import pytest

from moeref.distributed import LocalWorld, ep_dispatch, ep_fused_moe, ep_placement
from moeref.moe import MoEQuant, fused_moe, make_layer, make_tokens, quantize_weights
from moeref.quant import fp8_block, fp8_group

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device notes)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_task(g, x, ids, w, layer, quant, sizes):
    ends = np.cumsum(sizes)
    sl = slice(int(ends[g.rank] - sizes[g.rank]), int(ends[g.rank]))
    pl = ep_placement(layer.num_experts, g.world_size)
    d = ep_dispatch(x[sl], ids[sl], w[sl], pl, g, mode="low_latency", max_tokens_per_rank=max(sizes))
    out = ep_fused_moe(x[sl], layer, w[sl], ids[sl], pl, g, quant=quant, quantize_before_dispatch=True,
                       max_tokens_per_rank=max(sizes))
    return g.device, int(d.recv_count.sum()), out


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_nccl_ep_layer_is_bit_identical(ranks):
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} GPUs for {ranks} NCCL ranks; this machine has {_gpus()}")
    rng = np.random.default_rng(0)
    t, e, k = 6 * ranks, 8, 2
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    w = rng.random((t, k)).astype(np.float32)
    x = make_tokens(t, 256, seed=1)
    layer = quantize_weights(make_layer(e, 256, 128, seed=2), fp8_block())
    quant = MoEQuant(fp8_group(128), fp8_group(128), "fp8")
    with LocalWorld(ranks, backend="nccl", timeout_s=120.0) as world:
        res = world.run(nccl_task, x, ids, w, layer, quant, [6] * ranks)
    assert [r[0] for r in res] == [f"cuda:{i}" for i in range(ranks)]
    assert sum(r[1] for r in res) == t * k  # every slot received once
    np.testing.assert_array_equal(np.concatenate([r[2] for r in res]), fused_moe(x, layer, w, ids, quant=quant))


@pytest.mark.gpu
def test_bench_ep_gpu_smoke(tmp_path):
    """bench/bench_ep_gpu.py end to end on NCCL with the GPUs at hand (1 or 2), one small size."""
    import importlib
    import json
    import sys

    ranks = min(_gpus(), 2)
    if ranks < 1:
        pytest.skip("needs a CUDA GPU")
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)  # the spawned ranks import bench_ep_gpu by name (they get sys.path)
    bench = importlib.import_module("bench_ep_gpu")
    out = tmp_path / "ep.json"
    assert bench.main(["--local-world", str(ranks), "--tokens", "128", "--iters", "1", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert {r["mode"] for r in records} == {"normal", "normal_fp8", "low_latency"}
    assert all(r["backend"] == "nccl" and r["dispatch_s"] > 0 and r["plain_dispatch_s"] > 0 for r in records)
