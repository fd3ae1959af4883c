"""Benchmark: the 4-bit-weight (W4A16) Triton grouped GEMMs against the bf16 Triton grouped GEMM, gpt-oss-120b shapes.

gpt-oss-120b MoE (hidden 2880, intermediate 2880, 128 experts, top-4): GEMM1 ``N = 5760, K = 2880`` and GEMM2
``N = 2880, K = 2880`` on the contiguous layout (128-row expert segments) of a random top-4 routing, bf16
activations. Weights: random codes and scales made on the GPU (MXFP4 E8M0 / 32, NVFP4 UE4M3 / 16 + global, INT4
groups of 128 with FP32 scales) and random bf16 weights for the baseline. Times each kernel with CUDA events
in interleaved rounds (:func:`bench.interleaved.time_interleaved`: each sample the mean of 3 launches, one
warm-up call each; the median, min-max and spread flag per kernel, the ratio to the bf16 kernel per round and its
median); TFLOPS count the real rows only (``2 * rows * N * K``). A tile that does not fit (its warm-up call
fails) is printed and left out. JSON to ``--out`` under the keys ``w4_meta`` and ``w4`` (merged into
docs/moe-gpu.md by bench/report_moe_device.py).

    python bench/bench_w4_gemm.py [--tokens 64 1024 8192] [--rounds 7] [--out bench_out/moe_device_w4.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.interleaved import MIN_ROUNDS, CudaEventClock, machine_meta, time_interleaved  # noqa: E402
from fastpath import dispatch  # noqa: E402
from fastpath.grouped_gemm import grouped_gemm_contiguous  # noqa: E402
from fastpath.grouped_gemm_w4 import W4Experts, W4Tiles, grouped_gemm_w4_contiguous  # noqa: E402

E, K, TOP = 128, 2880, 4


def random_w4(kind: str, n: int, gen) -> W4Experts:
    codes = torch.randint(0, 256, (E, n, K // 2), dtype=torch.uint8, device="cuda", generator=gen)
    if kind == "mxfp4":
        return W4Experts("mxfp4", codes, torch.randint(118, 124, (E, n, K // 32), dtype=torch.uint8, device="cuda",
                                                       generator=gen), 32, 1, K)
    if kind == "nvfp4":
        return W4Experts("nvfp4", codes, torch.randint(0x20, 0x60, (E, n, K // 16), dtype=torch.uint8, device="cuda",
                                                       generator=gen), 16, 1, K,
                         torch.ones(E, device="cuda"), torch.full((E,), 2688.0, device="cuda"))
    return W4Experts("int4", codes, torch.rand((E, n, -(-K // 128)), device="cuda", generator=gen) * 0.01, 128, 1, K)


def _parse_tiles(text: str) -> W4Tiles:
    v = [int(x) for x in text.split(",")]
    if len(v) not in (5, 6):
        raise SystemExit(f"--tiles wants block_m,block_n,block_k,warps,stages[,swap_ab]; got {text!r}")
    return W4Tiles(*v[:5], swap_ab=bool(v[5]) if len(v) == 6 else True)


def _runnable(fns: dict) -> dict:
    """The cases whose warm-up call runs (compiling them); a tile that does not fit (shared memory) is printed
    and left out, not fatal."""
    ok = {}
    for label, fn in fns.items():
        try:
            fn()
            ok[label] = fn
        except Exception as e:
            print(label, "failed:", type(e).__name__, str(e)[:120])
    torch.cuda.synchronize()
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1024, 8192])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"interleaved rounds (>= {MIN_ROUNDS})")
    ap.add_argument("--out", default="bench_out/moe_device_w4.json")
    ap.add_argument("--tiles", nargs="*", default=["16,128,64,4,4,1", "32,128,64,4,4,1", "128,128,64,8,3,1", "128,128,64,8,3,0",
                                               "64,128,64,4,3,1"],
                    help="W4 tiles to try: block_m,block_n,block_k,warps,stages,swap_ab (1: W @ a^T, 0: a @ W^T)")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tiles = [_parse_tiles(t) for t in args.tiles]
    rows_out = []
    for gemm, n in (("gemm1", 5760), ("gemm2", 2880)):
        weights = {kind: random_w4(kind, n, gen) for kind in ("mxfp4", "nvfp4", "int4")}
        b16 = (torch.randn((E, n, K), device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        for m in args.tokens:
            ids = torch.rand((m, E), device="cuda", generator=gen).topk(TOP, dim=1).indices.to(torch.int32)
            lay = dispatch.to_contiguous(None, ids, E, 128)
            a = torch.randn((int(lay.m_indices.numel()), K), device="cuda", generator=gen).to(torch.bfloat16)
            real = m * TOP
            fns = {"bf16 triton": lambda: grouped_gemm_contiguous(a, b16, lay.m_indices, impl="triton")}
            for kind, w in weights.items():
                for t in tiles:
                    fns[f"{kind} {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}"
                        f"{' swap' if t.swap_ab else ''}"] = (
                        lambda w=w, t=t: grouped_gemm_w4_contiguous(a, w, lay.m_indices, tiles=t))
            res = time_interleaved(_runnable(fns), baselines=["bf16 triton"], rounds=args.rounds, calls_per_round=3,
                                   warmup=0, clock=CudaEventClock())
            flops = 2 * real * n * K
            for label, t in res.cases.items():
                ms = t.median_s * 1e3
                ratio = res.ratios[label]["bf16 triton"].median if label in res.ratios else 1.0
                rows_out.append(dict(gemm=gemm, tokens=m, rows=real, kernel=label, ms=ms, min_ms=t.min_s * 1e3,
                                     max_ms=t.max_s * 1e3, flagged=t.flagged, tflops=flops / t.median_s / 1e12,
                                     of_bf16=ratio))
                print(f"{gemm} tokens={m} {label:34s} {ms:8.3f} ms {flops / t.median_s / 1e12:7.1f} TFLOPS x{ratio:.2f}")
            _write(args, rows_out)  # after every case: a run cut short keeps what it measured
        del weights, b16
    return 0


def _write(args, rows) -> None:
    meta = dict(machine_meta(), rounds=args.rounds)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(w4_meta=meta, w4=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
