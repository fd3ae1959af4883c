"""CPU cost of the routing and dispatch references at DeepSeek-V3 scale, on ONE core.

16384 tokens, 256 experts, top-8, hidden 7168 (bf16). Stages, best of ``--repeat`` runs each:

* routing: vLLM "Renormalize" (``softmax_topk(renormalize=True)``) from float32 logits; the other
  methods are timed too;
* ``moe_align_block_size`` (block 64);
* ``moe_permute`` indices (offsets, dst->src, src->dst);
* the DeepGEMM contiguous / masked index layouts;
* ``moe_permute`` with the hidden rows: a gather of M*k*K bf16 values (1.9 GB written), which is
  memory-bound and reported apart from the target.

The target is "routing + align + permute indices < 0.5 s". Usage::

    PYTHONPATH=$PWD python3 bench/bench_routing_dispatch.py [--repeat 3] [--tokens 16384] [--no-rows]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import ml_dtypes
import numpy as np

from moeref.dispatch import moe_align_block_size, moe_permute, to_contiguous, to_masked
from moeref.routing import route


def best_of(fn, repeat: int):
    """(best wall time, best process CPU time, result). NumPy runs these single-threaded, so on an
    idle machine the two agree; on a shared machine the CPU time is the steadier figure."""
    best, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return (best, best_cpu), out


def main(argv=None) -> list[tuple[str, tuple[float, float]]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--no-rows", action="store_true", help="skip the 1.9 GB hidden-row gather")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    m, e, k, h = args.tokens, args.experts, args.top_k, args.hidden
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((m, e)).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32)

    rows: list[tuple[str, tuple[float, float]]] = []
    t_route, r = best_of(lambda: route(logits, k, "softmax_topk", renormalize=True), args.repeat)
    rows.append(("routing softmax_topk(renormalize) [vLLM Renormalize]", t_route))
    for name, kw in [
        ("routing softmax_topk (no renorm) [vLLM Default]", dict(method="softmax_topk")),
        ("routing topk_softmax [FlashInfer Renormalize]", dict(method="topk_softmax")),
        ("routing sigmoid_topk", dict(method="sigmoid_topk")),
        ("routing biased_topk (sigmoid)", dict(method="biased_topk", bias=bias, scoring="sigmoid")),
        ("routing grouped_topk [DeepSeek-V3: 8 groups, keep 4]", dict(
            method="grouped_topk", n_group=8, topk_group=4, scoring="sigmoid", bias=bias,
            renormalize=True, routed_scaling_factor=2.5)),
    ]:
        method = kw.pop("method")
        t, _ = best_of(lambda: route(logits, k, method, **kw), args.repeat)
        rows.append((name, t))
    ids = r.ids
    t_align, _ = best_of(lambda: moe_align_block_size(ids, 64, e), args.repeat)
    rows.append(("moe_align_block_size (block 64)", t_align))
    t_perm, _ = best_of(lambda: moe_permute(None, ids, e), args.repeat)
    rows.append(("moe_permute indices", t_perm))
    t, _ = best_of(lambda: to_contiguous(None, ids, e, 128), args.repeat)
    rows.append(("to_contiguous indices (alignment 128)", t))
    t, _ = best_of(lambda: to_masked(None, ids, e), args.repeat)
    rows.append(("to_masked indices", t))
    target = tuple(a + b + c for a, b, c in zip(t_route, t_align, t_perm))
    rows.append(("TARGET routing + align + permute indices (< 0.5 s)", target))
    if not args.no_rows:
        hidden = rng.standard_normal((m, h)).astype(ml_dtypes.bfloat16)
        t, _ = best_of(lambda: moe_permute(hidden, ids, e), 1)
        rows.append((f"moe_permute with rows (bf16 {m}*{k} x {h}: memory-bound, not in target)", t))

    stamp = (f"{datetime.date.today()} {platform.machine()} {platform.processor() or ''} "
             f"numpy {np.__version__}; 1 core; M={m} E={e} k={k} K={h}")
    width = max(len(n) for n, _ in rows)
    print(stamp)
    print(f"{'stage'.ljust(width)}  {'wall ms':>9}  {'cpu ms':>9}")
    for name, (wall, cpu) in rows:
        print(f"{name.ljust(width)}  {wall * 1e3:9.1f}  {cpu * 1e3:9.1f}")
    print()
    print(f"<!-- {stamp} -->")
    print("| stage | wall (ms) | CPU (ms) |")
    print("|---|---|---|")
    for name, (wall, cpu) in rows:
        print(f"| {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} |")
    return rows


if __name__ == "__main__":
    main()
