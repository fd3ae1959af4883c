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

from bench.interleaved import CudaEventClock  # noqa: E402
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
    ap.add_argument("--fast", action="store_true", help="also time fastpath.moe (Triton and DeepGEMM)")
    ap.add_argument("--sweep", action="store_true", help="sweep the Triton FP8 grouped GEMM's tiles")
    ap.add_argument("--bf16", action="store_true", help="bf16 grouped GEMM: Triton against torch._grouped_mm")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of one run per token count")
    ap.add_argument("--compare", action="store_true",
                    help="time compare() of fastpath.moe against the reference under HOPPER_FP8_DEEPGEMM_DATA (the bound "
                         "on the GPU) beside the reference's own time")
    ap.add_argument("--variants", action="store_true",
                    help="time the device engine's paths (int8 digits, float64 few-rows, decode + cuBLAS)")
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
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for m, (x, tw, ids) in cases.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_moe(x, weights, tw, ids, device="cuda", **kw)
                torch.cuda.synchronize()
            print(f"--- profile, {m} tokens")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))
    variant_rows = bench_variants(weights, cases, kw, args.rounds) if args.variants else []
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
    compare_rows = bench_compare(weights, cases, kw, args.rounds, args.profile) if args.compare else []
    fast_rows = bench_fast_layer(weights, cases, args.rounds) if args.fast else []
    sweep_rows = bench_tiles(weights, cases[max(cases)], args.rounds) if args.sweep else []
    bf16_rows = bench_bf16(cases[max(cases)], args.experts, args.rounds) if args.bf16 else []
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
        json.dump(dict(meta=meta, rows=rows, compare=compare_rows, fast=fast_rows, sweep=sweep_rows, bf16=bf16_rows,
                   variants=variant_rows), f, indent=1)
    print(f"{meta['gpu']}  {meta['date']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"weights {meta['weights_gib']:.1f} GiB of FP8 codes")
    print(f"{'tokens':>7} {'median s':>9} {'min-max s':>15} {'spread':>7} {'TFLOP':>6} {'f64 TFLOPS':>10} {'peak GiB':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['median_s']:>9.3f} {r['min_s']:>7.3f}-{r['max_s']:<7.3f} {r['spread']:>7.1%} "
              f"{r['expert_tflop']:>6.2f} {r['float64_tflops']:>10.1f} {r['peak_extra_gib']:>9.1f}")
    for r in variant_rows:
        print("  variant " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    for r in sweep_rows:
        print("  tiles " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    for r in bf16_rows:
        print("  bf16 " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    for r in compare_rows:
        print("  compare " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if fast_rows:
        print(f"\nfastpath.moe (same layer), median of {args.rounds} interleaved rounds, ms:")
        for r in fast_rows:
            print("  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return 0


def _copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of a 2 GiB buffer."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        y.copy_(x)
    ev[1].record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (ev[0].elapsed_time(ev[1]) / 1e3)


def bench_variants(weights, cases, kw, rounds: int) -> list[dict]:
    """The whole reference run under each device-engine path, interleaved: the int8-digit kernel (the
    default for E4M3), the float64 few-rows kernel for experts of at most 32 rows with cuBLAS for the rest,
    and every expert through decode + cuBLAS."""
    from moeref.gemm import device as dev

    variants = {"int8_digits": dict(DIGITS=True), "float64_few_rows": dict(DIGITS=False, FEW_ROWS_MAX=32),
                "float64_cublas": dict(DIGITS=False, FEW_ROWS_MAX=0)}
    saved = dict(DIGITS=dev.DIGITS, FEW_ROWS_MAX=dev.FEW_ROWS_MAX)
    times: dict = {}
    try:
        for name, attrs in variants.items():  # warm-up (compiles)
            for a, v in attrs.items():
                setattr(dev, a, v)
            x, tw, ids = cases[min(cases)]
            run_moe(x, weights, tw, ids, device="cuda", **kw)
            for a, v in saved.items():
                setattr(dev, a, v)
        for _ in range(rounds):
            for m, (x, tw, ids) in cases.items():
                for name, attrs in variants.items():
                    for a, v in attrs.items():
                        setattr(dev, a, v)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    run_moe(x, weights, tw, ids, device="cuda", **kw)
                    torch.cuda.synchronize()
                    times.setdefault((m, name), []).append(time.perf_counter() - t0)
                    for a, v in saved.items():
                        setattr(dev, a, v)
    finally:
        for a, v in saved.items():
            setattr(dev, a, v)
    return [dict(tokens=m, variant=name, median_s=statistics.median(v), min_s=min(v), max_s=max(v))
            for (m, name), v in times.items()]


def _event_ms(fn, reps: int = 3) -> float:
    """Milliseconds per call of ``reps`` back-to-back calls (:class:`bench.interleaved.CudaEventClock`), after
    one warm-up call."""
    fn()
    torch.cuda.synchronize()
    return CudaEventClock().measure(fn, reps) * 1e3


def bench_tiles(weights, case, rounds: int) -> list[dict]:
    """The Triton FP8 grouped GEMM (GEMM1 shape) under several tiles, against DeepGEMM, interleaved."""
    from fastpath import dispatch
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_contiguous, grouped_gemm_supports

    x, tw, ids = case
    lay = dispatch.to_contiguous(None, torch.as_tensor(ids, device="cuda"), 256, 128)
    ms = int(lay.m_indices.numel())
    a = torch.randn((ms, 7168), device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand((ms, 56), device="cuda") + 0.5
    b = weights.w13.codes.view(torch.float8_e4m3fn)
    sb = weights.w13.scales.float()
    configs = [GemmTiles(64, 128, 128, 4, 4), GemmTiles(64, 128, 128, 4, 5), GemmTiles(64, 256, 128, 8, 3),
               GemmTiles(64, 64, 128, 4, 5), GemmTiles(128, 128, 128, 8, 4), GemmTiles(64, 128, 128, 8, 4)]
    times: dict = {}
    for _ in range(rounds):
        for t in configs:
            try:
                times.setdefault(t, []).append(_event_ms(lambda: grouped_gemm_contiguous(
                    a, b, lay.m_indices, impl="triton", a_scales=sa, b_scales=sb, tiles=t)))
            except Exception as e:  # a tile that does not fit (shared memory): recorded, not fatal
                times[t] = [float("nan")]
                print("tile", t, "failed:", type(e).__name__, str(e)[:120])
        if grouped_gemm_supports("deep_gemm")[0]:
            times.setdefault("deep_gemm", []).append(_event_ms(lambda: grouped_gemm_contiguous(
                a, b, lay.m_indices, impl="deep_gemm", a_scales=sa, b_scales=sb)))
    flops = 2 * ms * 4096 * 7168
    dg = statistics.median(times["deep_gemm"]) if "deep_gemm" in times else float("nan")
    out = []
    for t, v in times.items():
        med = statistics.median(v)
        out.append(dict(tiles=str(t), ms=med, tflops=flops / med / 1e9, of_deep_gemm=dg / med))
    return out


def bench_bf16(case, experts: int, rounds: int) -> list[dict]:
    """bf16 grouped GEMM at the GEMM1 and GEMM2 shapes on the same routing: the Triton kernel (contiguous,
    128-row segments) against torch._grouped_mm (CUTLASS; tight segments), TFLOPS on the real rows."""
    from fastpath import dispatch
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_contiguous

    x, tw, ids = case
    ids_t = torch.as_tensor(ids, device="cuda")
    lay = dispatch.to_contiguous(None, ids_t, experts, 128)
    counts = torch.bincount(ids_t.reshape(-1).long(), minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    real = int(counts.sum())
    out = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, n, k in (("gemm1", 4096, 7168), ("gemm2", 7168, 2048)):
        b = (torch.randn((experts, n, k), device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        a_pad = torch.randn((int(lay.m_indices.numel()), k), device="cuda", generator=gen).to(torch.bfloat16)
        a_tight = torch.randn((real, k), device="cuda", generator=gen).to(torch.bfloat16)
        bt = b.transpose(1, 2)
        times: dict = {}
        tiles = {"triton": None, "triton 128x256x64 w8 s3": GemmTiles(128, 256, 64, 8, 3),
                 "triton 128x128x64 w4 s4": GemmTiles(128, 128, 64, 4, 4),
                 "triton 64x256x64 w4 s4": GemmTiles(64, 256, 64, 4, 4)}
        for _ in range(rounds):
            for label, t in tiles.items():
                try:
                    times.setdefault(label, []).append(_event_ms(lambda: grouped_gemm_contiguous(
                        a_pad, b, lay.m_indices, impl="triton", tiles=t)))
                except Exception as e:
                    times[label] = [float("nan")]
                    print("bf16 tile", label, "failed:", type(e).__name__, str(e)[:100])
            times.setdefault("torch_grouped_mm", []).append(_event_ms(lambda: torch._grouped_mm(a_tight, bt, offs=offs)))
        flops = 2 * real * n * k
        ref = statistics.median(times["torch_grouped_mm"])
        for label in tiles:
            tri = statistics.median(times[label])
            out.append(dict(gemm=name, tiles=label, rows=real, triton_ms=tri, grouped_mm_ms=ref,
                            triton_tflops=flops / tri / 1e9, grouped_mm_tflops=flops / ref / 1e9, ratio=ref / tri))
        del b, bt
    return out


def bench_compare(weights, cases, kw, rounds: int, profile: bool = False) -> list[dict]:
    """``compare(fused_moe(...), run, "HOPPER_FP8_DEEPGEMM_DATA")`` with the bound on the GPU, beside the
    reference's own time (``run_moe(device="cuda")``), interleaved rounds, medians; peak extra GPU memory of
    the comparison; the bound's time alone (``layer_bound``)."""
    from fastpath.grouped_gemm import grouped_gemm_supports
    from fastpath.moe import FastMoEWeights, fused_moe
    from moeref.compare import PROFILES, compare, layer_bound

    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    fw = FastMoEWeights(weights.w13.codes.view(torch.float8_e4m3fn), weights.w2.codes.view(torch.float8_e4m3fn),
                        "gate_up", weights.w13.scales.float(), weights.w2.scales.float())
    impl = "deep_gemm" if grouped_gemm_supports("deep_gemm")[0] else "triton"
    out = []
    for m, (x, tw, ids) in cases.items():
        got = fused_moe(x, fw, tw, torch.as_tensor(ids, device="cuda"), impl=impl)
        ref_t, cmp_t, bnd_t, peak, rep = [], [], [], 0.0, None
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run = run_moe(x, weights, tw, ids, device="cuda", **kw)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            rep = compare(got, run, prof)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
            layer_bound(run, prof)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            ref_t.append(t1 - t0)
            cmp_t.append(t2 - t1)
            bnd_t.append(t3 - t2)
            del run
        run = run_moe(x, weights, tw, ids, device="cuda", **kw)
        syncs = _count_syncs(lambda: layer_bound(run, prof))
        if profile:
            from torch.profiler import ProfilerActivity, profile as prof_ctx

            with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
                layer_bound(run, prof)
                torch.cuda.synchronize()
            print(f"--- layer_bound profile, {m} tokens")
            print(pr.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
            print(pr.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50))
        r, c = statistics.median(ref_t), statistics.median(cmp_t)
        out.append(dict(tokens=m, impl=impl, reference_s=r, compare_s=c, bound_s=statistics.median(bnd_t),
                        compare_over_reference=c / r, passed=rep.passed, violations=rep.num_violations,
                        flips=rep.flips, peak_compare_gib=peak, bound_host_syncs=syncs))
    return out


def _count_syncs(fn) -> int:
    """Host synchronizations of the CUDA stream during ``fn()`` (torch's sync debug mode warns once per sync)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def bench_fast_layer(weights, cases, rounds: int) -> list[dict]:
    """fastpath.moe.fused_moe through the Triton kernel and DeepGEMM, and DeepGEMM's two GEMMs alone, on the
    layer and tokens of the reference benchmark; CUDA-event times, interleaved rounds, medians."""
    from fastpath.grouped_gemm import grouped_gemm_contiguous, grouped_gemm_supports
    from fastpath.moe import FastMoEWeights, fused_moe
    from fastpath import dispatch

    fw = FastMoEWeights(weights.w13.codes.view(torch.float8_e4m3fn), weights.w2.codes.view(torch.float8_e4m3fn),
                        "gate_up", weights.w13.scales.float(), weights.w2.scales.float())
    impls = [i for i in ("triton", "deep_gemm") if grouped_gemm_supports(i)[0]]
    bw = _copy_bandwidth()
    times: dict = {}
    inputs = {}
    for m, (x, tw, ids) in cases.items():
        ids_t = torch.as_tensor(ids, device="cuda")
        lay = dispatch.to_contiguous(None, ids_t, 256, 128)
        ms = int(lay.m_indices.numel())
        a = torch.randn((ms, 7168), device="cuda").to(torch.float8_e4m3fn)
        sa = torch.rand((ms, 56), device="cuda") + 0.5
        xm = torch.randn((ms, 2048), device="cuda").to(torch.float8_e4m3fn)
        sx = torch.rand((ms, 16), device="cuda") + 0.5
        inputs[m] = (x, tw, ids_t, lay, a, sa, xm, sx)
        touched = len(np.unique(ids))
        inputs[m] += (touched * (4096 * 7168 + 7168 * 2048),)

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        fn()
        ev[1].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1])

    for _ in range(rounds):
        for m, (x, tw, ids_t, lay, a, sa, xm, sx, wbytes) in inputs.items():
            for impl in impls:
                times.setdefault((m, f"layer_{impl}"), []).append(
                    timed(lambda: fused_moe(x, fw, tw, ids_t, impl=impl)))
                times.setdefault((m, f"gemms_{impl}"), []).append(timed(lambda: (
                    grouped_gemm_contiguous(a, fw.w13, lay.m_indices, impl=impl, a_scales=sa, b_scales=fw.w13_scales),
                    grouped_gemm_contiguous(xm, fw.w2, lay.m_indices, impl=impl, a_scales=sx, b_scales=fw.w2_scales))))
    out = []
    for m, (x, tw, ids_t, lay, a, sa, xm, sx, wbytes) in inputs.items():
        # the HBM roofline of the issue: the touched experts' weight bytes read once, at the copy bandwidth
        # (bytes read + written per second)
        row = dict(tokens=m, rows=int(lay.m_indices.numel()), copy_tb_s=bw / 1e12, roofline_ms=wbytes / bw * 1e3)
        for impl in impls:
            lt = statistics.median(times[(m, f"layer_{impl}")])
            gt = statistics.median(times[(m, f"gemms_{impl}")])
            flops = 2 * int(lay.m_indices.numel()) * (4096 * 7168 + 7168 * 2048)
            row.update({f"layer_{impl}_ms": lt, f"gemms_{impl}_ms": gt, f"gemms_{impl}_tflops": flops / gt / 1e9,
                        f"layer_{impl}_of_roofline": row["roofline_ms"] / lt, f"gemms_over_layer_{impl}": gt / lt})
        out.append(row)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
