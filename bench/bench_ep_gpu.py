"""Benchmark of the EP dispatch + combine reference (moeref.distributed) for DeepSeek-V3 shapes (issue 19).

Shapes: hidden 7168, top-8 of 256 experts (uniform random distinct experts per token, seeded per
rank), ``--tokens`` per rank (default 128 256 512 1024 2048 4096). For each size and mode:

* ``normal``: :func:`moeref.distributed.ep_dispatch` of bf16 rows (DeepEP normal semantics), then
  :func:`ep_combine` with a bf16 combine, order ``slot`` (the identity expert: each slot returns its row);
* ``normal_fp8``: the same with FP8 1x128 quantization before dispatch (``fp8_group(128)``);
* ``low_latency``: DeepEP low-latency semantics (masked receive layout, ``M = tokens``), only up to
  ``--ll-max-tokens`` (the masked buffer is ``E_local x R*M x H``: 15 GB per rank at 8 ranks x 4096).

Timing: ``--iters`` timed iterations after ``--warmup``, a barrier before each, the slowest rank's
wall time per iteration (``all_reduce`` MAX), median over iterations; CUDA synchronized. Next to it,
the same bytes moved by one plain ``all_to_all_single`` per direction (the dispatch payload rows
and the combine rows, as uint8, with the reference's split sizes) timed the same way: the ratio says
how much of the reference's time is the transport and how much the host-side NumPy (the reference
is a specification, not a fast path). Bandwidth = bytes this rank sends + receives / time (max over
ranks of the bytes).

Launch (NCCL, one GPU per rank; NVLink multicast/NVLS off, as the device notes require)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 8 bench/bench_ep_gpu.py --out bench_out/ep.json

or on CPU, gloo, without torchrun (small sizes)::

    python bench/bench_ep_gpu.py --backend gloo --local-world 2 --tokens 128 256 --iters 3

Output: a JSON list of records (``--out``), one per (mode, tokens), written by rank 0, and a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, NUM_EXPERTS, TOP_K = 7168, 256, 8


def _routing(tokens: int, rank: int, seed: int):
    rng = np.random.default_rng(seed * 1000 + rank)
    ids = np.argsort(rng.random((tokens, NUM_EXPERTS)), axis=1)[:, :TOP_K].astype(np.int64)
    w = rng.random((tokens, TOP_K)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def _sync(g):
    import torch

    if g.backend == "nccl":
        torch.cuda.synchronize()


def _slowest(g, seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=g.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.group)
    return float(t.item())


def _timed(g, fn, warmup: int, iters: int) -> float:
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier(group=g.group)
        _sync(g)
        t0 = time.perf_counter()
        fn()
        _sync(g)
        times.append(_slowest(g, time.perf_counter() - t0))
    return statistics.median(times)


def bench_rank(g, tokens_list, modes, warmup, iters, ll_max_tokens, seed):
    import ml_dtypes
    import torch
    import torch.distributed as dist

    from moeref.distributed import ep_combine, ep_dispatch, ep_placement
    from moeref.quant import fp8_group

    pl = ep_placement(NUM_EXPERTS, g.world_size)
    records = []
    for tokens in tokens_list:
        ids, w = _routing(tokens, g.rank, seed)
        x = np.random.default_rng(seed + g.rank).standard_normal((tokens, HIDDEN)).astype(ml_dtypes.bfloat16)
        for mode in modes:
            if mode == "low_latency" and tokens > ll_max_tokens:
                continue
            kw = dict(mode="low_latency" if mode == "low_latency" else "normal", max_tokens_per_rank=tokens,
                      quant=fp8_group(128) if mode == "normal_fp8" else None)
            state = {}

            def dispatch():
                state["d"] = ep_dispatch(x, ids, w, pl, g, **kw)

            def combine():
                d = state["d"]
                if kw["mode"] == "normal":
                    rows = d.x if d.xq is None else d.xq.dequantize(np.float32)
                    y = np.broadcast_to(rows[:, None, :], (rows.shape[0], TOP_K, HIDDEN))
                else:
                    y = d.x if d.xq is None else d.xq.dequantize(np.float32)
                ep_combine(y, d, g, combine_dtype="bfloat16")

            t_dispatch = _timed(g, dispatch, warmup, iters)
            t_combine = _timed(g, combine, warmup, iters)
            h = state["d"].handle
            plan = h.plan
            row_bytes = (HIDDEN * 2 if kw["quant"] is None else HIDDEN + 4 * HIDDEN // 128)
            meta = 8 + 8 * TOP_K + 4 * TOP_K if kw["mode"] == "normal" else 16
            sent_rows = plan.rows_to if kw["mode"] == "normal" else plan.slots_to
            recv_rows = h.rows_from if kw["mode"] == "normal" else h.return_counts
            d_send, d_recv = sent_rows * (row_bytes + meta), recv_rows * (row_bytes + meta)
            c_send, c_recv = h.return_counts * HIDDEN * 2, plan.slots_to * HIDDEN * 2
            bufs = {}

            def plain(send, recv, key):
                if key not in bufs:
                    bufs[key] = (torch.zeros(int(send.sum()), dtype=torch.uint8, device=g.device),
                                 torch.empty(int(recv.sum()), dtype=torch.uint8, device=g.device))
                inp, out = bufs[key]
                dist.all_to_all_single(out, inp, [int(c) for c in recv], [int(c) for c in send], group=g.group)

            t_plain_d = _timed(g, lambda: plain(d_send, d_recv, "d"), warmup, iters)
            t_plain_c = _timed(g, lambda: plain(c_send, c_recv, "c"), warmup, iters)
            moved = float(max(d_send.sum() + d_recv.sum(), 1)), float(max(c_send.sum() + c_recv.sum(), 1))
            moved_max = [_slowest(g, m) for m in moved]
            rec = dict(mode=mode, tokens_per_rank=tokens, world_size=g.world_size, backend=g.backend,
                       dispatch_s=t_dispatch, combine_s=t_combine,
                       dispatch_bytes_max_rank=moved_max[0], combine_bytes_max_rank=moved_max[1],
                       dispatch_GBps=moved_max[0] / t_dispatch / 1e9, combine_GBps=moved_max[1] / t_combine / 1e9,
                       plain_dispatch_s=t_plain_d, plain_combine_s=t_plain_c,
                       plain_dispatch_GBps=moved_max[0] / t_plain_d / 1e9,
                       plain_combine_GBps=moved_max[1] / t_plain_c / 1e9)
            records.append(rec)
    return records if g.rank == 0 else None


def _table(records) -> str:
    head = (f"{'mode':12s} {'tokens':>6s} {'dispatch ms':>11s} {'GB/s':>7s} {'plain ms':>9s} {'GB/s':>7s} "
            f"{'combine ms':>10s} {'GB/s':>7s} {'plain ms':>9s} {'GB/s':>7s}")
    lines = [head]
    for r in records:
        lines.append(f"{r['mode']:12s} {r['tokens_per_rank']:6d} {r['dispatch_s'] * 1e3:11.2f} "
                     f"{r['dispatch_GBps']:7.2f} "
                     f"{r['plain_dispatch_s'] * 1e3:9.2f} {r['plain_dispatch_GBps']:7.2f} {r['combine_s'] * 1e3:10.2f} "
                     f"{r['combine_GBps']:7.2f} {r['plain_combine_s'] * 1e3:9.2f} {r['plain_combine_GBps']:7.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--local-world", type=int, default=0, help="spawn this many local ranks instead of torchrun")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--modes", nargs="+", default=["normal", "normal_fp8", "low_latency"],
                    choices=["normal", "normal_fp8", "low_latency"])
    ap.add_argument("--ll-max-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="JSON file for the records")
    a = ap.parse_args(argv)
    args = (a.tokens, a.modes, a.warmup, a.iters, a.ll_max_tokens, a.seed)
    if a.local_world:
        from moeref.distributed import LocalWorld

        with LocalWorld(a.local_world, backend=a.backend, timeout_s=a.timeout) as world:
            records = world.run(bench_rank, *args, timeout_s=10 * a.timeout)[0]
    else:
        import torch
        import torch.distributed as dist

        from moeref.distributed import ep_group

        if a.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=a.timeout))
        g = ep_group(None, timeout_s=a.timeout)
        records = bench_rank(g, *args)
        dist.destroy_process_group()
        if g.rank != 0:
            return 0
    meta = dict(hidden=HIDDEN, num_experts=NUM_EXPERTS, top_k=TOP_K, host=platform.node(),
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    for r in records:
        r.update(meta)
    print(_table(records))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
