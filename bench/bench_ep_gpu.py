"""Benchmark of the EP dispatch + combine reference (moeref.distributed) against one plain all_to_all_single.

Shapes: DeepSeek-V3, hidden 7168, top-8 of 256 experts (uniform random distinct experts per token, seeded
per rank), ``--tokens`` per rank (default 128 4096), linear placement over the world. For each size and mode:

* ``normal``: :func:`moeref.distributed.ep_dispatch` of bf16 rows (DeepEP normal semantics), then
  :func:`ep_combine` of bf16 expert outputs ``[N_recv, 8, H]`` with a bf16 combine, order ``slot``;
* ``normal_fp8``: the same with FP8 1x128 quantization before dispatch (``fp8_group(128)``);
* ``low_latency``: DeepEP low-latency semantics (masked receive layout ``E_local x R*M x H``, ``M = tokens``;
  the received buffer is the experts' output), up to ``--ll-max-tokens``. The device engine receives into one
  reusable buffer (``recv_buffer=ep_low_latency_buffer(...)``, as a DeepEP ``Buffer`` is made once and reused):
  each dispatch zeroes the rows the previous one wrote instead of a fresh ``E_local x R*M x H`` buffer (15 GB at
  4096 tokens per rank on 2 ranks).

``--engines``: ``device`` (default; ``engine="device"``, tensors on each rank's GPU) and/or ``host`` (the NumPy
engine, the specification: 4 s a combine at 4096 tokens).

Timing: interleaved rounds (``bench/interleaved.py``: at least 7, the order of the cases rotating each round),
each case timed on every rank between a barrier and a device synchronization, the slowest rank's time
(``all_reduce`` MAX) recorded; per case the median, min, max and spread over the rounds. The baselines, in the
same rounds: one plain ``all_to_all_single`` of the same bytes with the reference's split sizes (the dispatch's
packed rows: payload and metadata; the combine's rows, bf16), so ``dispatch / plain`` (median of the per-round
ratios) is how many transports' time the reference takes (issue 34's target: within 10x at 4096 tokens).

Launch (NCCL, one GPU per rank; NVLink multicast/NVLS off, as the device notes require)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/bench_ep_gpu.py --out docs/data/ep_h200x2.json
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 bench/bench_ep_gpu.py --out docs/data/ep_h200x4.json

or on CPU, gloo, without torchrun (local processes)::

    python bench/bench_ep_gpu.py --backend gloo --local-world 2 --tokens 128 --out /tmp/ep_gloo.json

Output: one JSON document (``--out``; ``meta`` and ``rows``) written by rank 0, and a table.
``bench/report_ep.py`` turns the JSON files into the tables of docs/expert-parallel.md and docs/performance.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, NUM_EXPERTS, TOP_K = 7168, 256, 8
MODES = ("normal", "normal_fp8", "low_latency")


def _routing(tokens: int, rank: int, seed: int):
    rng = np.random.default_rng(seed * 1000 + rank)
    ids = np.argsort(rng.random((tokens, NUM_EXPERTS)), axis=1)[:, :TOP_K].astype(np.int64)
    w = rng.random((tokens, TOP_K)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


class SlowestRankClock:
    """:class:`bench.interleaved.Clock` for collectives: a barrier, the calls, a device synchronization; the
    slowest rank's seconds per call (``all_reduce`` MAX), the same number on every rank."""

    name = "slowest_rank_wall"

    def __init__(self, g):
        self.g = g

    def _sync(self):
        import torch

        if self.g.backend == "nccl":
            torch.cuda.synchronize()

    def measure(self, fn, calls):
        import torch
        import torch.distributed as dist

        dist.barrier(group=self.g.group)
        self._sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        self._sync()
        t = torch.tensor([(time.perf_counter() - t0) / calls], dtype=torch.float64, device=self.g.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.g.group)
        return float(t.item())


def _case(c) -> dict:
    return {"median_s": c.median_s, "min_s": c.min_s, "max_s": c.max_s, "spread": c.spread, "flagged": c.flagged,
            "seconds": list(c.seconds)}


def bench_rank(g, tokens_list, modes, engines, rounds, ll_max_tokens, seed):
    import ml_dtypes
    import torch
    import torch.distributed as dist

    from bench.interleaved import time_interleaved
    from moeref import _interop
    from moeref.distributed import ep_combine, ep_dispatch, ep_low_latency_buffer, ep_placement
    from moeref.quant import fp8_group

    pl = ep_placement(NUM_EXPERTS, g.world_size)
    clock = SlowestRankClock(g)
    rows = []
    for tokens in tokens_list:
        ids, w = _routing(tokens, g.rank, seed)
        x = np.random.default_rng(seed + g.rank).standard_normal((tokens, HIDDEN)).astype(ml_dtypes.bfloat16)
        for engine in engines:
            dev = g.device if engine == "device" else None
            x_in = _interop.to_torch(x).to(dev) if dev else x
            ids_in = torch.from_numpy(ids).to(dev) if dev else ids
            w_in = torch.from_numpy(w).to(dev) if dev else w
            for mode in modes:
                if mode == "low_latency" and tokens > ll_max_tokens:
                    continue
                kw = dict(mode="low_latency" if mode == "low_latency" else "normal", max_tokens_per_rank=tokens,
                          quant=fp8_group(128) if mode == "normal_fp8" else None, engine=engine)
                if mode == "low_latency" and engine == "device":  # made once, reused by every dispatch
                    kw["recv_buffer"] = ep_low_latency_buffer(pl, g, max_tokens_per_rank=tokens, hidden_size=HIDDEN,
                                                              dtype="bfloat16")
                state = {"d": ep_dispatch(x_in, ids_in, w_in, pl, g, **kw)}
                d = state["d"]
                if kw["mode"] == "normal":  # the experts' outputs: bf16 [N_recv, k, H], drawn once where they live
                    where = dev or "cpu"
                    gen = torch.Generator(device=where).manual_seed(seed + 7 * g.rank)
                    y = torch.randn((d.num_recv, TOP_K, HIDDEN), generator=gen, device=where, dtype=torch.bfloat16)
                    y = y if dev else _interop.to_numpy(y)
                else:  # identity experts: the received masked buffer
                    y = d.x
                h = d.handle
                plan = h.plan
                row_bytes = HIDDEN * 2 if kw["quant"] is None else HIDDEN + 4 * HIDDEN // 128
                meta = 8 + 8 * TOP_K + 4 * TOP_K if kw["mode"] == "normal" else 16
                sent = plan.rows_to if kw["mode"] == "normal" else plan.slots_to
                got = h.rows_from if kw["mode"] == "normal" else h.return_counts
                d_send, d_recv = np.asarray(sent) * (row_bytes + meta), np.asarray(got) * (row_bytes + meta)
                c_send, c_recv = np.asarray(h.return_counts) * HIDDEN * 2, np.asarray(plan.slots_to) * HIDDEN * 2
                bufs = {}

                def plain(send, recv, key):
                    if key not in bufs:
                        bufs[key] = (torch.zeros(int(send.sum()), dtype=torch.uint8, device=g.device),
                                     torch.empty(int(recv.sum()), dtype=torch.uint8, device=g.device))
                    inp, out = bufs[key]
                    dist.all_to_all_single(out, inp, [int(c) for c in recv], [int(c) for c in send], group=g.group)

                def dispatch():
                    state["d"] = ep_dispatch(x_in, ids_in, w_in, pl, g, **kw)

                cases = {"dispatch": dispatch,
                         "combine": lambda: ep_combine(y, d, g, combine_dtype="bfloat16"),
                         "plain_dispatch": lambda: plain(d_send, d_recv, "d"),
                         "plain_combine": lambda: plain(c_send, c_recv, "c")}
                res = time_interleaved(cases, baselines=["plain_dispatch", "plain_combine"], rounds=rounds,
                                       clock=clock)
                moved = [float(max(d_send.sum() + d_recv.sum(), 1)), float(max(c_send.sum() + c_recv.sum(), 1))]
                moved_max = []
                for m in moved:
                    t = torch.tensor([m], dtype=torch.float64, device=g.device)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.group)
                    moved_max.append(float(t.item()))
                rows.append(dict(
                    mode=mode, engine=engine, tokens_per_rank=tokens, rounds=res.rounds,
                    recv_buffer="recv_buffer" in kw,  # the low-latency dispatch reuses one receive buffer
                    cases={n: _case(c) for n, c in res.cases.items()},
                    # reference / plain all_to_all in each round, median (the baselines' speedups inverted)
                    dispatch_over_plain=1.0 / res.ratios["dispatch"]["plain_dispatch"].median,
                    combine_over_plain=1.0 / res.ratios["combine"]["plain_combine"].median,
                    dispatch_bytes_max_rank=moved_max[0], combine_bytes_max_rank=moved_max[1],
                    flagged=res.flagged))
                del state, d, y, bufs, kw
                if g.backend == "nccl":
                    torch.cuda.empty_cache()
    return rows if g.rank == 0 else None


def _meta(g_backend: str, world_size: int, rounds: int) -> dict:
    import torch

    if torch.cuda.is_available() and g_backend == "nccl":
        gpu = torch.cuda.get_device_name()
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    else:
        gpu, nccl = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", None
    try:
        tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # reported as unknown, not hidden
        tree = ""
    return dict(hidden=HIDDEN, num_experts=NUM_EXPERTS, top_k=TOP_K, backend=g_backend, world_size=world_size,
                gpu=gpu, nccl=nccl, torch=torch.__version__, host=platform.node(), tree=tree or "unknown",
                rounds=rounds, nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                load_average=os.getloadavg()[0],  # the 1-minute load at the end (a shared CPU machine's noise)
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def table(doc: dict) -> str:
    lines = [f"{'mode':12s} {'engine':6s} {'tokens':>6s} {'dispatch ms':>12s} {'plain ms':>9s} {'x':>7s} "
             f"{'combine ms':>11s} {'plain ms':>9s} {'x':>7s}"]
    for r in doc["rows"]:
        c = r["cases"]
        lines.append(f"{r['mode']:12s} {r['engine']:6s} {r['tokens_per_rank']:6d} "
                     f"{c['dispatch']['median_s'] * 1e3:12.3f} {c['plain_dispatch']['median_s'] * 1e3:9.3f} "
                     f"{r['dispatch_over_plain']:7.1f} {c['combine']['median_s'] * 1e3:11.3f} "
                     f"{c['plain_combine']['median_s'] * 1e3:9.3f} {r['combine_over_plain']:7.1f}"
                     + (f"  FLAGGED: {', '.join(r['flagged'])}" if r["flagged"] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--local-world", type=int, default=0, help="spawn this many local ranks instead of torchrun")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--engines", nargs="+", default=["device"], choices=("device", "host"))
    ap.add_argument("--ll-max-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    a = ap.parse_args(argv)
    args = (a.tokens, a.modes, a.engines, a.rounds, a.ll_max_tokens, a.seed)
    if a.local_world:
        from moeref.distributed import LocalWorld

        with LocalWorld(a.local_world, backend=a.backend, timeout_s=a.timeout) as world:
            rows = world.run(bench_rank, *args, timeout_s=10 * a.timeout)[0]
        world_size = a.local_world
    else:
        import torch
        import torch.distributed as dist

        from moeref.distributed import ep_group

        if a.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=a.timeout))
        g = ep_group(None, timeout_s=a.timeout)
        rows = bench_rank(g, *args)
        world_size = g.world_size
        dist.destroy_process_group()
        if g.rank != 0:
            return 0
    doc = dict(meta=_meta(a.backend, world_size, a.rounds), rows=rows)
    print(table(doc))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
