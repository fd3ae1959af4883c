"""Expert-parallel demo: a small FP8 MoE layer split over ranks, checked bit for bit.

Launch with torchrun (one process per rank; CPU gloo or one GPU per rank with NCCL)::

    torchrun --nproc-per-node 2 -m moeref.distributed.demo --backend gloo
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 -m moeref.distributed.demo --backend nccl

or without torchrun (local worker processes, :class:`~moeref.distributed.LocalWorld`)::

    python -m moeref.distributed.demo --world-size 2

Every rank builds the same seeded layer (8 experts, top-2, hidden 256, FP8 1x128 activations x
FP8 128x128 weights) and routing, takes its slice of the tokens, runs
:func:`~moeref.distributed.ep_fused_moe` (FP8 dispatch, exact local experts, slot-order combine)
and compares its rows with the single-process :func:`moeref.moe.fused_moe` of all tokens. Exit
status 0 when every rank is bit-identical.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np

__all__ = ["demo_rank", "main"]


def demo_rank(group, *, seed: int = 0, tokens_per_rank: int = 8, num_experts: int = 8, top_k: int = 2,
              hidden: int = 256, strategy: str = "linear", mode: str = "normal") -> dict:
    """One rank's part of the demo; returns a small dict of findings."""
    from ..moe import MoEQuant, fused_moe, make_layer, make_tokens, quantize_weights
    from ..quant import fp8_block, fp8_group
    from ..routing import softmax_topk
    from .layer import ep_fused_moe
    from .placement import ep_placement
    from .plan import dispatch_layout

    r, me = group.world_size, group.rank
    layer = quantize_weights(make_layer(num_experts, hidden, 128, seed=seed), fp8_block())
    quant = MoEQuant(fp8_group(128), fp8_group(128), "FP8 1x128")
    total = tokens_per_rank * r
    x = make_tokens(total, hidden, seed=seed + 1)
    routing = softmax_topk(np.random.default_rng(seed + 2).standard_normal((total, num_experts)), top_k,
                           renormalize=True)
    placement = ep_placement(num_experts, r, strategy)
    mine = slice(me * tokens_per_rank, (me + 1) * tokens_per_rank)
    t0 = time.perf_counter()
    out = ep_fused_moe(x[mine], layer, routing.weights[mine], routing.ids[mine], placement, group, quant=quant,
                       mode=mode, quantize_before_dispatch=True, max_tokens_per_rank=tokens_per_rank)
    seconds = time.perf_counter() - t0
    ref = fused_moe(x, layer, routing.weights, routing.ids, quant=quant)[mine]
    sent = dispatch_layout(routing.ids[mine], placement).num_tokens_per_rank
    return dict(rank=me, backend=group.backend, local_experts=placement.local_experts(me).tolist(),
                tokens_sent_per_rank=sent.tolist(), identical=bool(np.array_equal(out, ref)),
                max_abs_diff=float(np.abs(out - ref).max(initial=0.0)), seconds=seconds)


def _print(results: list[dict]) -> int:
    ok = all(res["identical"] for res in results)
    for res in results:
        print(f"rank {res['rank']} ({res['backend']}): local experts {res['local_experts']}, tokens sent per rank "
              f"{res['tokens_sent_per_rank']}, bit-identical to the single-process layer: {res['identical']} "
              f"(max |diff| {res['max_abs_diff']:.3g}), {res['seconds'] * 1e3:.1f} ms")
    print("EP demo:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moeref.distributed.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    ap.add_argument("--tokens-per-rank", type=int, default=8)
    ap.add_argument("--strategy", choices=("linear", "round_robin"), default="linear")
    ap.add_argument("--mode", choices=("normal", "low_latency"), default="normal")
    ap.add_argument("--timeout", type=float, default=120.0, help="process group timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    kw = dict(seed=a.seed, tokens_per_rank=a.tokens_per_rank, strategy=a.strategy, mode=a.mode)
    from moeref.distributed.demo import demo_rank as task  # picklable under its module name

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        import torch
        import torch.distributed as dist

        from .group import ep_group

        if a.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=a.timeout))
        try:
            g = ep_group(None, timeout_s=a.timeout)
            results: list = [None] * g.world_size
            dist.all_gather_object(results, task(g, **kw))
            code = _print(results) if g.rank == 0 else (0 if all(r["identical"] for r in results) else 1)
        finally:
            dist.destroy_process_group()
        return code
    from .world import LocalWorld

    with LocalWorld(a.world_size, backend=a.backend, timeout_s=a.timeout) as world:
        return _print(world.run(task, **kw))


if __name__ == "__main__":
    sys.exit(main())
