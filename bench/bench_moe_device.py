"""Benchmark: the exact MoE reference on the GPU (moeref.moe.device) at DeepSeek-V3 shapes.

DeepSeek-V3 layer: hidden 7168, intermediate 2048, 256 distinct experts, top-8, FP8 E4M3 weights with
128x128 FP32 block scales, activations FP8 1x128 FP32 (a1 and a2), GEMM1 output stored bf16, the activation
in float32 (a fused activation + quantization kernel's arithmetic), bf16 output. The weights are random
codes and scales made on the GPU (11.3 GB of codes; building them with the host quantizer would take
hours); the tokens are N(0, 1) bf16 and the routing a random top-8 of 256 per token.

Times the whole ``run_moe(device="cuda")`` (routing metadata, both quantizations, both exact GEMMs, the
activation, finalize) after one warm-up, as interleaved rounds over the token counts; reports the median
and min-max per row and the peak GPU memory. JSON to ``--out`` (default bench_out/moe_device.json).

    python bench/bench_moe_device.py [--tokens 128 4096] [--rounds 7] [--experts 256]

``--fast`` / ``--fast-only`` (without the reference) also time ``fastpath.moe`` (:func:`bench_fast_layer`:
eager, capturable, masked and CUDA-graph cases, the GEMMs alone, ``torch.compile`` of the layer in torch ops,
an older module with ``--before``), JSON keys ``layer`` and ``layer_meta``.
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
from bench.latency_cases import capture  # noqa: E402
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


def routing(m: int, experts: int, top_k: int, gen: torch.Generator, device: str = "cuda"):
    ids = torch.rand((m, experts), device=device, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    w = torch.rand((m, top_k), device=device, generator=gen)
    w = (w / w.sum(dim=1, keepdim=True)).to(torch.float32)
    return w, ids.cpu().numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--out", default="bench_out/moe_device.json")
    ap.add_argument("--fast", action="store_true", help="also time fastpath.moe (Triton and DeepGEMM; bench_fast_layer)")
    ap.add_argument("--fast-only", action="store_true", help="time fastpath.moe only (not the exact reference)")
    ap.add_argument("--calls", type=int, default=3, help="back-to-back calls per case and round (fastpath.moe)")
    ap.add_argument("--before", default=None,
                    help="module of an older fastpath.moe (e.g. fastpath._moe_before) timed beside it (A/B)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baseline")
    ap.add_argument("--sweep", action="store_true", help="sweep the Triton FP8 grouped GEMM's tiles")
    ap.add_argument("--bf16", action="store_true", help="bf16 grouped GEMM: Triton against torch._grouped_mm")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of one run per token count")
    ap.add_argument("--compare", action="store_true",
                    help="time compare() of fastpath.moe against the reference under HOPPER_FP8_DEEPGEMM_DATA (the bound "
                         "on the GPU) beside the reference's own time")
    ap.add_argument("--variants", action="store_true",
                    help="time the device engine's paths (int8 digits, float64 few-rows, decode + cuBLAS)")
    args = ap.parse_args(argv)
    from bench.interleaved import MIN_ROUNDS

    if (args.fast or args.fast_only) and args.rounds < MIN_ROUNDS:  # before minutes of setup, not after
        ap.error(f"--rounds {args.rounds}: the layer's interleaved timings (--fast, --fast-only) take at least "
                 f"{MIN_ROUNDS} rounds (bench.interleaved.MIN_ROUNDS)")
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
    if args.fast_only:
        args.fast = True
    for m, (x, tw, ids) in cases.items() if not args.fast_only else ():  # warm-up (Triton compiles, cuBLAS)
        run_moe(x, weights, tw, ids, device="cuda", **kw)
    for _ in range(args.rounds if not args.fast_only else 0):
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
    def partial(rows_so_far):
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".partial", "w") as f:
            json.dump(dict(layer=rows_so_far), f, indent=1)

    fast_rows, fast_meta = bench_fast_layer(weights, cases, args.rounds, args.calls, args.before,
                                            not args.no_compile, partial) if args.fast else ([], {})
    sweep_rows = bench_tiles(weights, cases[max(cases)], args.rounds) if args.sweep else []
    bf16_rows = bench_bf16(cases[max(cases)], args.experts, args.rounds) if args.bf16 else []
    rows = []
    for m in args.tokens if not args.fast_only else ():
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
        json.dump(dict(meta={} if args.fast_only else meta, rows=rows, compare=compare_rows, layer=fast_rows,
                       layer_meta=fast_meta, sweep=sweep_rows, bf16=bf16_rows, variants=variant_rows), f, indent=1)
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
        print(f"\nfastpath.moe (same layer), {fast_meta['gpu']} {fast_meta['date']}, median of {args.rounds} interleaved "
              f"rounds x {args.calls} calls, ms (of roofline):")
        for r in fast_rows:
            if "error" in r:
                print(f"  {r['tokens']} tokens: failed: {r['error']}")
                continue
            print(f"  {r['tokens']} tokens, roofline {r['roofline_ms']:.3f} ms; notes {r['notes']}")
            for n, c in r["cases"].items():
                rat = "  ".join(f"{b}/{n}={v:.2f}" for b, v in r["ratios"].get(n, {}).items())
                print(f"    {n:28s} {c['median_ms']:8.3f} ({c['min_ms']:.3f}-{c['max_ms']:.3f}){' !' if c['flagged'] else ''}"
                      f"  {c['of_roofline']:.0%}  {rat}")
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


DECODE_MAX = 256
"""Token counts up to this are decode rows: also timed on the masked layout and as CUDA-graph replays."""


def _fake_quant_1x128(t: torch.Tensor) -> torch.Tensor:
    """bf16 values of the FP8 E4M3 1x128 quantization of ``t`` (FP32 scale amax/448 per 128 values)."""
    shape = t.shape
    g = t.float().reshape(-1, shape[-1] // 128, 128)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 448.0
    q = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(torch.bfloat16).reshape(shape)


def torch_moe_layer(x, topk_weights, topk_ids, w13t, w2t):
    """The DeepSeek-V3 layer in torch ops, for ``torch.compile``: the slots sorted by expert (stable
    ``argsort``, group ends by ``searchsorted``), FP8 1x128 activations (quantized and dequantized to bf16),
    ``torch._grouped_mm`` on bf16 weights dequantized from the FP8 128x128 blocks once at load (torch has no
    block-scaled grouped GEMM), SiLU-and-mul in FP32, the weighted sum in FP32. No -1 slots (the benchmark's
    routing has none)."""
    m, k = topk_ids.shape
    e = w13t.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.searchsorted(flat[order], torch.arange(e, device=x.device, dtype=flat.dtype), right=True)
    offs = ends.to(torch.int32)
    a = _fake_quant_1x128(x).index_select(0, order // k)
    h = torch._grouped_mm(a, w13t, offs=offs)
    gate, up = h.float().chunk(2, dim=-1)
    xq = _fake_quant_1x128(torch.nn.functional.silu(gate) * up)
    y = torch._grouped_mm(xq, w2t, offs=offs)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=x.device)
    ys = y.index_select(0, inv).float().reshape(m, k, -1)
    return (ys * topk_weights[..., None]).sum(dim=1).to(torch.bfloat16)


def _dequant_bf16(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 ``[E, N, K]`` from FP8 codes and 128x128 block scales, one expert at a time."""
    e, n, k = codes.shape
    out = torch.empty((e, n, k), dtype=torch.bfloat16, device=codes.device)
    for i in range(e):
        s = scales[i].float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        out[i] = (codes[i].view(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)
    return out


def bench_fast_layer(weights, cases, rounds: int, calls: int = 3, before: str | None = None,
                     compiled: bool = True, partial=None) -> tuple[list[dict], dict]:
    """fastpath.moe.fused_moe (Triton and DeepGEMM GEMMs) on the layer and tokens of the reference benchmark,
    through :func:`bench.interleaved.time_interleaved` (CUDA events, ``calls`` back-to-back calls per case and
    round, the order rotating each round). Cases per token count:

    * ``layer_{impl}``: the default call (ids checked on the host, tight contiguous layout: two host syncs);
    * ``layer_{impl}_capturable``: ``capturable=True`` (no host sync; worst-case contiguous buffer), eager;
    * decode (``<= DECODE_MAX`` tokens): ``layer_{impl}_masked`` (masked layout, capturable, eager) and
      ``graph_{impl}_{layout}``: the capturable call captured in a CUDA graph and replayed (the host's launch
      cost removed; this machine's host adds 50-400 us per launch);
    * up to ``fastpath.moe.GRAPH_CACHE_MAX_TOKENS``: ``layer_{impl}_cached`` and ``layer_{impl}_masked_cached``,
      the default and the masked capturable call served by the layer's graph cache (the other ``layer_*`` cases
      pass ``graph_cache=False``);
    * ``gemms_{impl}``: the two grouped GEMMs alone on the tight contiguous layout, called as the layer calls
      them (DeepGEMM through its psum layout, ``psum=``; the baseline of the prefill criterion; per-round
      ratios ``gemms / layer``);
    * ``before_{impl}``: the layer of module ``before`` (an older ``fastpath.moe``), for an A/B in one run;
    * ``torch_compile``: :func:`torch_moe_layer` under ``torch.compile`` (bf16 weights, twice the bytes).

    The HBM roofline: the touched experts' weight codes read once at the measured copy bandwidth (bytes
    read + written per second of a 2 GiB device copy). Returns (rows, meta)."""
    import importlib

    from bench.interleaved import CudaEventClock, machine_meta, time_interleaved
    from fastpath import dispatch
    from fastpath.grouped_gemm import grouped_gemm_contiguous, grouped_gemm_supports
    from fastpath.moe import FastMoEWeights, fused_moe

    fw = FastMoEWeights(weights.w13.codes.view(torch.float8_e4m3fn), weights.w2.codes.view(torch.float8_e4m3fn),
                        "gate_up", weights.w13.scales.float(), weights.w2.scales.float())
    experts = int(fw.w13.shape[0])
    impls = [i for i in ("triton", "deep_gemm") if grouped_gemm_supports(i)[0]]
    old = importlib.import_module(before).fused_moe if before else None
    bw = _copy_bandwidth()
    torch_fn, w13t, w2t, notes = None, None, None, {}
    if compiled:
        try:
            w13t = _dequant_bf16(fw.w13, fw.w13_scales).transpose(1, 2)
            w2t = _dequant_bf16(fw.w2, fw.w2_scales).transpose(1, 2)
            torch_fn = torch.compile(torch_moe_layer, dynamic=False)
        except Exception as e:  # reported in the JSON, not hidden
            notes["torch_compile"] = f"{type(e).__name__}: {str(e)[:300]}"
            torch_fn = None
    pool = torch.cuda.graph_pool_handle()
    rows = []
    for m, (x, tw, ids) in cases.items():
        try:
            rows.append(_layer_row(m, x, tw, ids, fw, impls, old, torch_fn, w13t, w2t, pool, bw, rounds, calls))
        except Exception as e:  # one token count failing (memory, a capture) is recorded; the others still run
            import traceback

            traceback.print_exc()
            rows.append(dict(tokens=m, error=f"{type(e).__name__}: {str(e)[:500]}"))
        torch.cuda.empty_cache()
        if partial is not None:
            partial(rows)
    meta = dict(machine_meta(), rounds=rounds, calls_per_round=calls, experts=int(fw.w13.shape[0]), before=before,
                notes=notes, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    return rows, meta


def _layer_row(m, x, tw, ids, fw, impls, old, torch_fn, w13t, w2t, pool, bw, rounds, calls) -> dict:
    from bench.interleaved import CudaEventClock, time_interleaved
    from fastpath import dispatch
    from fastpath.grouped_gemm import grouped_gemm_contiguous
    from fastpath.moe import GRAPH_CACHE_MAX_TOKENS, fused_moe

    experts = int(fw.w13.shape[0])
    ids_t = torch.as_tensor(ids, device="cuda")
    lay = dispatch.to_contiguous(None, ids_t, experts, 128)
    ms = int(lay.m_indices.numel())
    a = torch.randn((ms, 7168), device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand((ms, 56), device="cuda") + 0.5
    xm = torch.randn((ms, 2048), device="cuda").to(torch.float8_e4m3fn)
    sx = torch.rand((ms, 16), device="cuda") + 0.5
    touched = len(np.unique(ids))
    wbytes = touched * (4096 * 7168 + 7168 * 2048)
    fns: dict = {}
    row_notes: dict = {}
    for impl in impls:  # the eager cases without the graph cache (graph_cache=False): every launch of the call
        fns[f"layer_{impl}"] = lambda impl=impl: fused_moe(x, fw, tw, ids_t, impl=impl, graph_cache=False)
        fns[f"layer_{impl}_capturable"] = lambda impl=impl: fused_moe(x, fw, tw, ids_t, impl=impl, capturable=True,
                                                                      graph_cache=False)
        if m <= DECODE_MAX:
            fns[f"layer_{impl}_masked"] = lambda impl=impl: fused_moe(x, fw, tw, ids_t, impl=impl, layout="masked",
                                                                      capturable=True, graph_cache=False)
        if m <= GRAPH_CACHE_MAX_TOKENS:  # the same calls served by fastpath.moe's graph cache (its default)
            fns[f"layer_{impl}_cached"] = lambda impl=impl: fused_moe(x, fw, tw, ids_t, impl=impl)
            fns[f"layer_{impl}_masked_cached"] = lambda impl=impl: fused_moe(x, fw, tw, ids_t, impl=impl,
                                                                             layout="masked", capturable=True)
            for name in (f"layer_{impl}_cached", f"layer_{impl}_masked_cached"):
                for _ in range(2):  # a key is captured on its second call
                    fns[name]()
                row_notes[f"{name[6:]}_equals_default"] = bool(torch.equal(fns[name](), fused_moe(
                    x, fw, tw, ids_t, impl=impl, graph_cache=False)))
        fns[f"gemms_{impl}"] = lambda impl=impl: (  # called as the layer calls them (DeepGEMM: psum layout)
            grouped_gemm_contiguous(a, fw.w13, lay.m_indices, impl=impl, a_scales=sa, b_scales=fw.w13_scales,
                                    psum=lay.psum),
            grouped_gemm_contiguous(xm, fw.w2, lay.m_indices, impl=impl, a_scales=sx, b_scales=fw.w2_scales,
                                    psum=lay.psum))
        if old is not None:
            fns[f"before_{impl}"] = lambda impl=impl: old(x, fw, tw, ids_t, impl=impl)
    want = fused_moe(x, fw, tw, ids_t, impl=impls[-1], graph_cache=False)
    if m <= DECODE_MAX:
        for impl in impls:
            for layout in ("contiguous", "masked"):
                fn = (lambda impl=impl, layout=layout:
                      fused_moe(x, fw, tw, ids_t, impl=impl, layout=layout, capturable=True, graph_cache=False))
                try:
                    g, out = capture(fn, pool=pool)
                    g.replay()
                    torch.cuda.synchronize()
                    ref = fused_moe(x, fw, tw, ids_t, impl=impl, layout=layout, graph_cache=False)
                    row_notes[f"graph_{impl}_{layout}_equals_eager"] = bool(torch.equal(out, ref))
                    fns[f"graph_{impl}_{layout}"] = g.replay
                except Exception as e:
                    row_notes[f"graph_{impl}_{layout}"] = f"{type(e).__name__}: {str(e)[:300]}"
    for impl in impls:  # the layouts and the capturable path give the same bits as the default call
        ref = fused_moe(x, fw, tw, ids_t, impl=impl, graph_cache=False)
        row_notes[f"{impl}_capturable_equals_default"] = bool(torch.equal(
            fused_moe(x, fw, tw, ids_t, impl=impl, capturable=True, graph_cache=False), ref))
        if old is not None:
            row_notes[f"{impl}_equals_before"] = bool(torch.equal(old(x, fw, tw, ids_t, impl=impl), ref))
    if torch_fn is not None:
        try:
            got = torch_fn(x, tw, ids_t, w13t, w2t)
            row_notes["torch_compile_rel_err"] = float((got.float() - want.float()).norm() / want.float().norm())
            fns["torch_compile"] = lambda: torch_fn(x, tw, ids_t, w13t, w2t)
        except Exception as e:
            row_notes["torch_compile"] = f"{type(e).__name__}: {str(e)[:300]}"
    baselines = [f"gemms_{i}" for i in impls]
    res = time_interleaved(fns, baselines=baselines, rounds=rounds, calls_per_round=calls,
                           clock=CudaEventClock())
    row = dict(tokens=m, touched_experts=touched, rows_tight=ms, copy_tb_s=bw / 1e12,
               roofline_ms=wbytes / bw * 1e3, notes=row_notes, cases={}, ratios={})
    for name, c in res.cases.items():
        row["cases"][name] = dict(median_ms=c.median_s * 1e3, min_ms=c.min_s * 1e3, max_ms=c.max_s * 1e3,
                                  spread=c.spread, flagged=c.flagged,
                                  of_roofline=wbytes / bw / c.median_s)
    for name, per in res.ratios.items():
        row["ratios"][name] = {b: r.median for b, r in per.items()}
    print(f"  {m} tokens: " + "  ".join(f"{n}={c['median_ms']:.3f}" for n, c in row["cases"].items()), flush=True)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
