"""Benchmark: the exact MoE reference on the GPU (moeref.moe.device) at DeepSeek-V3 shapes.

DeepSeek-V3 layer: hidden 7168, intermediate 2048, 256 distinct experts, top-8, FP8 E4M3 weights with
128x128 FP32 block scales, activations FP8 1x128 FP32 (a1 and a2), GEMM1 output stored bf16, the activation
in float32 (a fused activation + quantization kernel's arithmetic), bf16 output. The weights are random
codes and scales made on the GPU (11.3 GB of codes; building them with the host quantizer would take
hours); the tokens are N(0, 1) bf16 and the routing a random top-8 of 256 per token.

Times the whole ``run_moe(device="cuda")`` (routing metadata, both quantizations, both exact GEMMs, the
activation, finalize) after one warm-up, as interleaved rounds over the token counts; reports the median
and min-max per row and the peak GPU memory. JSON to ``--out`` (default bench_out/moe_device.json).

    python bench/bench_moe_device.py [--tokens 128 4096] [--rounds 5] [--experts 256]
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
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from moeref.gemm import StackedExperts  # noqa: E402
from moeref.moe import MoEQuant, MoEWeights, run_moe  # noqa: E402
from moeref.quant import fp8_group  # noqa: E402


def random_fp8_experts(e: int, n: int, k: int, gen: torch.Generator, scale: float) -> StackedExperts:
    """Random E4M3 codes (NaN codes 0x7F/0xFF replaced by the largest finite 0x7E/0xFE) and random FP32
    128x128 block scales around ``scale``."""
    codes = torch.randint(0, 256, (e, n, k), dtype=torch.uint8, device="cuda", generator=gen)
    codes[(codes & 0x7F) == 0x7F] -= 1
    grid = (e, -(-n // 128), -(-k // 128))
    s = scale * (1.0 + torch.rand(grid, device="cuda", generator=gen, dtype=torch.float64))
    return StackedExperts(codes, s.to(torch.float32).to(torch.float64), "e4m3fn", (128, 128), (n, k))


def deepseek_v3_layer(experts: int, gen: torch.Generator) -> MoEWeights:
    hidden, inter = 7168, 2048
    # |w| ~ 448 * scale: scales chosen so the FP8 weights have magnitudes ~0.05
    w13 = random_fp8_experts(experts, 2 * inter, hidden, gen, 1e-4)
    w2 = random_fp8_experts(experts, hidden, inter, gen, 1e-4)
    return MoEWeights(w13, w2, "gate_up")


def routing(m: int, experts: int, top_k: int, gen: torch.Generator):
    ids = torch.rand((m, experts), device="cuda", generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    w = torch.rand((m, top_k), device="cuda", generator=gen)
    w = (w / w.sum(dim=1, keepdim=True)).to(torch.float32)
    return w, ids.cpu().numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--out", default="bench_out/moe_device.json")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = deepseek_v3_layer(args.experts, gen)
    quant = MoEQuant(fp8_group(), fp8_group(), "fp8 1x128 (DeepGEMM)")
    kw = dict(quant=quant, gemm1_out_dtype="bfloat16", act_out_dtype="float32", out_dtype="bfloat16")
    cases = {}
    for m in args.tokens:
        x = torch.randn((m, 7168), device="cuda", generator=gen).to(torch.bfloat16)
        tw, ids = routing(m, args.experts, 8, gen)
        cases[m] = (x, tw, ids)
    times: dict[int, list[float]] = {m: [] for m in args.tokens}
    peak: dict[int, float] = {}
    engines: dict[int, list] = {}
    for m, (x, tw, ids) in cases.items():  # warm-up (Triton compiles, cuBLAS handles)
        run_moe(x, weights, tw, ids, device="cuda", **kw)
    for _ in range(args.rounds):
        for m, (x, tw, ids) in cases.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            run = run_moe(x, weights, tw, ids, device="cuda", **kw)
            torch.cuda.synchronize()
            times[m].append(time.perf_counter() - t0)
            peak[m] = max(peak.get(m, 0.0), (torch.cuda.max_memory_allocated() - base) / 2**30)
            engines[m] = run.engines
            del run
    rows = []
    for m in args.tokens:
        t = times[m]
        flops = 2 * m * 8 * (2 * 2048 * 7168 + 7168 * 2048)
        rows.append(dict(tokens=m, median_s=statistics.median(t), min_s=min(t), max_s=max(t),
                         spread=(max(t) - min(t)) / statistics.median(t), expert_tflop=flops / 1e12,
                         float64_tflops=flops / statistics.median(t) / 1e12, peak_extra_gib=peak[m],
                         engines=engines[m]))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, date=datetime.date.today().isoformat(),
                host=platform.node(), experts=args.experts, rounds=args.rounds,
                weights_gib=(weights.w13.codes.numel() + weights.w2.codes.numel()) / 2**30)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"{meta['gpu']}  {meta['date']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"weights {meta['weights_gib']:.1f} GiB of FP8 codes")
    print(f"{'tokens':>7} {'median s':>9} {'min-max s':>15} {'spread':>7} {'TFLOP':>6} {'f64 TFLOPS':>10} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['median_s']:>9.3f} {r['min_s']:>7.3f}-{r['max_s']:<7.3f} {r['spread']:>7.1%} "
              f"{r['expert_tflop']:>6.2f} {r['float64_tflops']:>10.1f} {r['peak_extra_gib']:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
