"""The EP reference on NCCL, one process per GPU (``gpu`` tests: skipped on CPU machines, and on a
machine with fewer GPUs than ranks). The code is the gloo code; only the backend and the device of the
collectives' tensors change. The per-rank validation of a kernel with a planted fault runs on gloo (CPU
processes) and on NCCL with the same task."""
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
    assert bench.main(["--local-world", str(ranks), "--tokens", "128", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["backend"] == "nccl" and doc["meta"]["world_size"] == ranks
    assert {r["mode"] for r in doc["rows"]} == {"normal", "normal_fp8", "low_latency"}
    assert all(r["engine"] == "device" and r["rounds"] >= 7 for r in doc["rows"])
    assert all(c["median_s"] > 0 for r in doc["rows"] for c in r["cases"].values())


def test_bench_ep_gloo_smoke(tmp_path):
    """bench/bench_ep_gpu.py end to end on gloo (2 CPU processes, 4 tokens a rank), and its docs table."""
    import importlib
    import json
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench_dir = os.path.join(root, "bench")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)  # the spawned ranks import bench_ep_gpu by name (they get sys.path)
    bench = importlib.import_module("bench_ep_gpu")
    out = tmp_path / "ep.json"
    assert bench.main(["--backend", "gloo", "--local-world", "2", "--tokens", "4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["backend"] == "gloo" and doc["meta"]["world_size"] == 2
    assert [(r["mode"], r["engine"]) for r in doc["rows"]] == [("normal", "device"), ("normal_fp8", "device"),
                                                              ("low_latency", "device")]
    assert [r["recv_buffer"] for r in doc["rows"]] == [False, False, True]  # low latency: one reused buffer
    for r in doc["rows"]:
        assert r["rounds"] >= 7 and set(r["cases"]) == {"dispatch", "combine", "plain_dispatch", "plain_combine"}
        assert all(len(c["seconds"]) == r["rounds"] and c["min_s"] <= c["median_s"] <= c["max_s"]
                   for c in r["cases"].values())
    report = importlib.import_module("bench.report_ep")
    lines = report.table([doc]).splitlines()
    assert len([ln for ln in lines if ln.startswith("| 20")]) == 3  # one row per mode


# ---- per-rank validation of a user's EP kernel, with a fault planted on one rank -----------------

VE, VH, VN, VT = 8, 16, 8, 5
_WORLDS: dict = {}


def _world(backend: str, ranks: int):
    """gloo: the process-wide shared 4-rank world (runs on its first ``ranks``); nccl: one world per size,
    kept for this module's tests (closed at exit)."""
    if backend == "gloo":
        return LocalWorld.shared(4, timeout_s=20.0)
    if _gpus() < ranks:
        pytest.skip(f"needs {ranks} GPUs for {ranks} NCCL ranks; this machine has {_gpus()}")
    world = _WORLDS.get(ranks)
    if world is None or world._closed:
        world = _WORLDS[ranks] = LocalWorld(ranks, backend="nccl", timeout_s=120.0)
    return world


@pytest.fixture(scope="module", autouse=True)
def _close_nccl_worlds():
    yield
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()


def _validation_inputs(rank: int, ranks: int):
    rng = np.random.default_rng(40 + rank)
    ids = np.stack([rng.permutation(VE)[:2] for _ in range(VT)]).astype(np.int64)
    if rank == 0:
        ids[0] = [VE - 1, 0]  # token 0 of rank 0 reaches the last rank (linear placement: it owns expert VE-1)
    w = rng.integers(1, 64, size=(VT, 2)).astype(np.float32) / 64
    return make_tokens(VT, VH, seed=50 + rank), ids, w


def fault_kernel(hidden, topk_weights, topk_ids, group, *, mode: str, faulty: int):
    """A user's EP kernel: its receive buffers from the device-engine dispatch (tensors on the group's device),
    its output from the EP layer; on rank ``faulty`` the first received row has one bit flipped."""
    import torch

    from moeref.distributed import EPKernelOutput

    pl = ep_placement(VE, group.world_size)
    layer = make_layer(VE, VH, VN, seed=3)
    d = ep_dispatch(hidden, topk_ids, topk_weights, pl, group, mode=mode, max_tokens_per_rank=VT, engine="device")
    out = ep_fused_moe(hidden, layer, topk_weights, topk_ids, pl, group, mode=mode, max_tokens_per_rank=VT)
    x = d.x.clone()
    if group.rank == faulty:
        first = x.reshape(-1, VH)[0] if mode == "normal" else x[int(torch.nonzero(d.recv_count)[0, 0]), 0]
        first.view(torch.int32)[0] ^= 1  # one bit of the first element
    if mode == "normal":
        return EPKernelOutput(out, x, d.src_rank, d.src_token, d.topk_idx, d.num_recv_tokens_per_expert)
    return EPKernelOutput(out, x, d.src_rank, d.src_info, None, d.recv_count)


def validate_fault_task(g, mode, faulty, engine):
    import functools

    import torch

    from moeref.compare import FP32_ACCUM
    from moeref.distributed import validate_ep_kernel

    x, ids, w = _validation_inputs(g.rank, g.world_size)
    kernel = functools.partial(fault_kernel, mode=mode, faulty=faulty)
    v = validate_ep_kernel(kernel, x, w, ids, ep_placement(VE, g.world_size), g, weights=make_layer(VE, VH, VN, seed=3),
                           profile=FP32_ACCUM, mode=mode, max_tokens_per_rank=VT, engine=engine)
    # where the planted row came from, read from the reference dispatch (the test's own record of the fault)
    d = ep_dispatch(x, ids, w, ep_placement(VE, g.world_size), g, mode=mode, max_tokens_per_rank=VT)
    if mode == "normal":
        key = (int(d.src_rank[0]), int(d.src_token[0])) if d.num_recv else None
    else:
        e = np.flatnonzero(d.recv_count)
        key = (int(d.src_rank[e[0], 0]), int(d.src_info[e[0], 0])) if e.size else None
    return v.summary(), v.faulty_ranks, key, str(torch.zeros(1, device=g.device).device)


@pytest.mark.parametrize("engine", ["host", "device"])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("backend, ranks", [("gloo", 2), ("gloo", 4), pytest.param("nccl", 2, marks=pytest.mark.gpu),
                                            pytest.param("nccl", 4, marks=pytest.mark.gpu)])
def test_validation_names_the_rank_of_a_planted_fault(backend, ranks, mode, engine):
    """validate_ep_kernel on real ranks (gloo CPU processes; NCCL, one GPU each): a kernel whose receive buffers
    live on the device, with one bit flipped in one received row of the last rank, fails on that rank only,
    and every rank's report names the rank, the row's source token and rank; the reference dispatch of the
    validation on the host or on the device (``engine``)."""
    faulty = ranks - 1
    res = _world(backend, ranks).run(validate_fault_task, mode, faulty, engine, world_size=ranks)
    summaries = {r[0] for r in res}
    assert len(summaries) == 1, summaries  # the same report on every rank
    text, faulty_ranks, _, device = res[0][0], res[0][1], res[0][2], res[0][3]
    assert device == ("cpu" if backend == "gloo" else "cuda:0")
    src_rank, src_token = res[faulty][2]
    assert faulty_ranks == [faulty], text
    assert text.startswith(f"EP kernel validation over {ranks} ranks: FAIL on ranks [{faulty}]"), text
    what = f"token {src_token} of rank {src_rank}"
    assert f"rank {faulty}: 1 received rows differ from the sent values: " in text, text
    assert what in text, text
