"""Where the time of one ``fastpath.moe.fused_moe`` call goes, DeepSeek-V3 FP8 layer (bench_moe_device's
weights and routing), against its two grouped GEMMs alone.

Per token count:

* a kernel timeline (torch.profiler, CUDA kernels) of one call of each case after warm-up: the layer
  (``impl`` deep_gemm and triton, ``capturable`` False and True) and the GEMMs alone as
  ``bench_moe_device`` times them (random operands on the tight layout); per kernel name the total
  device time, the GPU span of the call and the idle time between kernels;
* interleaved CUDA-event timings (``bench.interleaved``) of the layer and of the two GEMMs alone on
  three operand sets, through ``m_indices`` (the full mode; ``--quick`` times the psum layout the layer
  uses): the benchmark's random operands, the operands the layer itself passes (recorded from a call), and
  those with their padding rows overwritten by random data; and with the activation scales handed over
  already in DeepGEMM's MN-major TMA-aligned layout (no transpose in the call);
* the SM clock and power read by ``nvidia-smi`` while each case runs in a loop.

JSON to ``--out``; the kernel tables are printed. ``--quick``: the layer and the GEMMs alone only, with
``--before MODULE`` an older ``fastpath.moe`` beside (timelines, timings, bit equality).

    python bench/studies/profile_moe_layer.py --tokens 4096 16384 --out bench_out/profile_moe_layer.json
    python bench/studies/profile_moe_layer.py --quick --before fastpath._moe_before
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.bench_moe_device import deepseek_v3_layer, routing  # noqa: E402
from bench.interleaved import CudaEventClock, time_interleaved  # noqa: E402


def kernel_timeline(fn, trace_path: str) -> dict:
    """The CUDA kernels (and memsets/copies) of one ``fn()`` call: per-name totals, GPU span, idle gaps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        t_host = time.perf_counter() - t0
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        ev = json.load(f)["traceEvents"]
    ks = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                key=lambda e: e["ts"])
    per = defaultdict(lambda: [0, 0.0])
    seq = []
    for e in ks:
        name = e["name"][:90]
        per[name][0] += 1
        per[name][1] += e["dur"]
        seq.append((name, round(e["ts"] - ks[0]["ts"], 1), e["dur"]))
    busy = sum(e["dur"] for e in ks)
    span = (ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]) if ks else 0.0
    gaps = [(seq[i][0], round(ks[i]["ts"] - (ks[i - 1]["ts"] + ks[i - 1]["dur"]), 1))
            for i in range(1, len(ks)) if ks[i]["ts"] - (ks[i - 1]["ts"] + ks[i - 1]["dur"]) > 20]
    return dict(span_us=span, busy_us=busy, host_call_ms=t_host * 1e3, gaps_over_20us=gaps,
                per_name={k: dict(count=c, us=round(t, 1)) for k, (c, t) in
                          sorted(per.items(), key=lambda kv: -kv[1][1])}, sequence=seq)


def smi_sample(fn, seconds: float = 1.5) -> dict:
    """``nvidia-smi`` SM clock, power and throttle reasons while ``fn`` runs in a queued loop."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    n = max(3, int(seconds / max(one, 1e-4)))
    for _ in range(n):
        fn()
    time.sleep(min(0.5, seconds / 3))
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,"
                            "clocks_throttle_reasons.active", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # recorded, not fatal
        q = f"{type(e).__name__}: {e}"
    torch.cuda.synchronize()
    return dict(smi=q, calls=n, first_call_ms=one * 1e3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench_out/profile_moe_layer.json")
    ap.add_argument("--no-smi", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="the layer and the GEMMs alone only (no recorded operands, no nvidia-smi)")
    ap.add_argument("--before", default=None,
                    help="module of an older fastpath.moe (e.g. fastpath._moe_before): its DeepGEMM layer beside")
    args = ap.parse_args(argv)
    if args.quick:
        args.no_smi = True
    import deep_gemm

    import fastpath._moe_layer as fm  # where _routed looks up grouped_gemm_contiguous
    from fastpath import dispatch
    from fastpath.grouped_gemm import grouped_gemm_contiguous
    from fastpath.moe import FastMoEWeights, fused_moe

    outdir = os.path.dirname(args.out) or "."
    os.makedirs(outdir, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = deepseek_v3_layer(256, gen)
    fw = FastMoEWeights(weights.w13.codes.view(torch.float8_e4m3fn), weights.w2.codes.view(torch.float8_e4m3fn),
                        "gate_up", weights.w13.scales.float(), weights.w2.scales.float())
    result = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  rows=[])
    for m in args.tokens:
        x = torch.randn((m, 7168), device="cuda", generator=gen).to(torch.bfloat16)
        tw, ids = routing(m, 256, 8, gen)
        ids_t = torch.as_tensor(ids, device="cuda")
        lay = dispatch.to_contiguous(None, ids_t, 256, 128)
        ms = int(lay.m_indices.numel())
        pad = lay.m_indices < 0
        # the benchmark's operands
        a = torch.randn((ms, 7168), device="cuda").to(torch.float8_e4m3fn)
        sa = torch.rand((ms, 56), device="cuda") + 0.5
        xm = torch.randn((ms, 2048), device="cuda").to(torch.float8_e4m3fn)
        sx = torch.rand((ms, 16), device="cuda") + 0.5
        if args.quick:
            _quick_row(args, result, m, x, tw, ids_t, fw, a, sa, xm, sx, lay, outdir)
            continue
        # the layer's own operands, recorded from one call
        rec = []
        orig = fm.grouped_gemm_contiguous

        def recorder(a_, b_, m_idx, **kw):
            rec.append((a_, kw.get("a_scales"), m_idx))
            return orig(a_, b_, m_idx, **kw)

        fm.grouped_gemm_contiguous = recorder
        try:
            fused_moe(x, fw, tw, ids_t, impl="deep_gemm")
        finally:
            fm.grouped_gemm_contiguous = orig
        (la, lsa, lmi), (lx, lsx, _) = rec
        same_layout = bool(torch.equal(lmi, lay.m_indices))
        la_f, lsa_f, lx_f, lsx_f = la.clone(), lsa.clone(), lx.clone(), lsx.clone()
        u8 = lambda t: t.view(torch.uint8)  # noqa: E731  (boolean indexing of FP8 tensors through bytes)
        f8 = lambda t, rows: u8(t)[rows].view(torch.float8_e4m3fn).float()  # noqa: E731
        u8(la_f)[pad], u8(lx_f)[pad] = u8(a)[pad], u8(xm)[pad]
        lsa_f[pad], lsx_f[pad] = sa[pad], sx[pad]
        stats = dict(
            layer_a_abs_mean=float(f8(la, ~pad).abs().mean()), bench_a_abs_mean=float(a.float().abs().mean()),
            layer_x_abs_mean=float(f8(lx, ~pad).abs().mean()), bench_x_abs_mean=float(xm.float().abs().mean()),
            layer_a_pad_nonfinite=int((~torch.isfinite(f8(la, pad))).sum()),
            layer_sa_pad_nonfinite=int((~torch.isfinite(lsa[pad])).sum()),
            layer_x_pad_nonfinite=int((~torch.isfinite(f8(lx, pad))).sum()),
            layer_sx_pad_nonfinite=int((~torch.isfinite(lsx[pad])).sum()),
            layer_sa_shape_strides=[list(lsa.shape), list(lsa.stride())],
            layer_sx_shape_strides=[list(lsx.shape), list(lsx.stride())],
            pad_rows=int(pad.sum()), rows=ms, same_layout=same_layout)
        mn = deep_gemm.get_mn_major_tma_aligned_tensor

        def gemms(impl, a1, s1, a2, s2):
            return lambda: (grouped_gemm_contiguous(a1, fw.w13, lay.m_indices, impl=impl, a_scales=s1,
                                                    b_scales=fw.w13_scales),
                            grouped_gemm_contiguous(a2, fw.w2, lay.m_indices, impl=impl, a_scales=s2,
                                                    b_scales=fw.w2_scales))

        cases = {
            "layer_deep_gemm": lambda: fused_moe(x, fw, tw, ids_t, impl="deep_gemm"),
            "layer_deep_gemm_capturable": lambda: fused_moe(x, fw, tw, ids_t, impl="deep_gemm", capturable=True),
            "layer_triton_capturable": lambda: fused_moe(x, fw, tw, ids_t, impl="triton", capturable=True),
            "gemms_deep_gemm": gemms("deep_gemm", a, sa, xm, sx),
            "gemms_deep_gemm_layer_operands": gemms("deep_gemm", la, lsa, lx, lsx),
            "gemms_deep_gemm_layer_operands_pad_random": gemms("deep_gemm", la_f, lsa_f, lx_f, lsx_f),
            "gemms_deep_gemm_mn_major_scales": gemms("deep_gemm", a, mn(sa), xm, mn(sx)),
            "gemms_triton": gemms("triton", a, sa, xm, sx),
            "gemms_triton_layer_operands": gemms("triton", la, lsa, lx, lsx),
        }
        row = dict(tokens=m, stats=stats, timeline={}, smi={})
        for name in ("layer_deep_gemm_capturable", "layer_deep_gemm", "layer_triton_capturable", "gemms_deep_gemm",
                     "gemms_deep_gemm_layer_operands", "gemms_triton"):
            cases[name]()
            cases[name]()
            row["timeline"][name] = tl = kernel_timeline(cases[name], os.path.join(outdir, f"trace_{m}_{name}.json"))
            print(f"--- {m} tokens, {name}: span {tl['span_us'] / 1e3:.3f} ms, kernels {tl['busy_us'] / 1e3:.3f} ms, "
                  f"host {tl['host_call_ms']:.2f} ms, gaps>20us {tl['gaps_over_20us'][:6]}")
            for k, v in list(tl["per_name"].items())[:12]:
                print(f"    {v['us'] / 1e3:8.3f} ms  x{v['count']:<3d} {k}")
        res = time_interleaved(cases, baselines=["gemms_deep_gemm"], rounds=args.rounds, calls_per_round=3,
                               clock=CudaEventClock())
        row["cases"] = {n: dict(median_ms=c.median_s * 1e3, min_ms=c.min_s * 1e3, max_ms=c.max_s * 1e3)
                        for n, c in res.cases.items()}
        row["ratios"] = {n: {b: r.median for b, r in per.items()} for n, per in res.ratios.items()}
        print(f"=== {m} tokens ({ms} rows, stats {stats})")
        for n, c in row["cases"].items():
            r = row["ratios"].get(n, {}).get("gemms_deep_gemm")
            print(f"  {n:44s} {c['median_ms']:8.3f} ({c['min_ms']:.3f}-{c['max_ms']:.3f})"
                  + (f"  gemms_deep_gemm/this {r:.3f}" if r else ""))
        if not args.no_smi:
            for n in ("layer_deep_gemm_capturable", "gemms_deep_gemm", "gemms_deep_gemm_layer_operands",
                      "layer_triton_capturable", "gemms_triton"):
                row["smi"][n] = s = smi_sample(cases[n])
                print(f"  smi {n:40s} {s['smi']}")
        result["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        del rec, la, lsa, lx, lsx, la_f, lsa_f, lx_f, lsx_f, cases
        torch.cuda.empty_cache()
    return 0


def _quick_row(args, result, m, x, tw, ids_t, fw, a, sa, xm, sx, lay, outdir):
    """The layer (DeepGEMM default and capturable, Triton capturable, an older module's DeepGEMM layer) and
    the GEMMs alone: kernel timelines of the DeepGEMM layers and interleaved timings."""
    import importlib

    from fastpath.grouped_gemm import grouped_gemm_contiguous
    from fastpath.moe import fused_moe

    def gemms(impl, psum=None):
        return lambda: (grouped_gemm_contiguous(a, fw.w13, lay.m_indices, impl=impl, a_scales=sa, b_scales=fw.w13_scales,
                                                psum=psum),
                        grouped_gemm_contiguous(xm, fw.w2, lay.m_indices, impl=impl, a_scales=sx, b_scales=fw.w2_scales,
                                                psum=psum))

    cases = {"layer_deep_gemm": lambda: fused_moe(x, fw, tw, ids_t, impl="deep_gemm"),
             "layer_deep_gemm_capturable": lambda: fused_moe(x, fw, tw, ids_t, impl="deep_gemm", capturable=True),
             "layer_triton_capturable": lambda: fused_moe(x, fw, tw, ids_t, impl="triton", capturable=True),
             "gemms_deep_gemm": gemms("deep_gemm", lay.psum), "gemms_deep_gemm_m_indices": gemms("deep_gemm"),
             "gemms_triton": gemms("triton")}
    row = dict(tokens=m, timeline={}, notes={})
    if args.before:
        old = importlib.import_module(args.before).fused_moe
        cases["before_deep_gemm"] = lambda: old(x, fw, tw, ids_t, impl="deep_gemm")
        cases["before_deep_gemm_capturable"] = lambda: old(x, fw, tw, ids_t, impl="deep_gemm", capturable=True)
        for c in (False, True):
            row["notes"][f"deep_gemm_capturable_{c}_equals_before"] = bool(torch.equal(
                fused_moe(x, fw, tw, ids_t, impl="deep_gemm", capturable=c),
                old(x, fw, tw, ids_t, impl="deep_gemm", capturable=c)))
    for name in [n for n in ("layer_deep_gemm_capturable", "before_deep_gemm_capturable", "layer_triton_capturable")
                 if n in cases]:
        cases[name]()
        cases[name]()
        row["timeline"][name] = tl = kernel_timeline(cases[name], os.path.join(outdir, f"trace_{m}_{name}.json"))
        print(f"--- {m} tokens, {name}: span {tl['span_us'] / 1e3:.3f} ms, kernels {tl['busy_us'] / 1e3:.3f} ms")
        for k, v in list(tl["per_name"].items())[:10]:
            print(f"    {v['us'] / 1e3:8.3f} ms  x{v['count']:<3d} {k}")
    res = time_interleaved(cases, baselines=["gemms_deep_gemm", "gemms_triton"], rounds=args.rounds,
                           calls_per_round=3, clock=CudaEventClock())
    row["cases"] = {n: dict(median_ms=c.median_s * 1e3, min_ms=c.min_s * 1e3, max_ms=c.max_s * 1e3)
                    for n, c in res.cases.items()}
    row["ratios"] = {n: {b: r.median for b, r in per.items()} for n, per in res.ratios.items()}
    print(f"=== {m} tokens, notes {row['notes']}")
    for n, c in row["cases"].items():
        r = row["ratios"].get(n, {})
        print(f"  {n:34s} {c['median_ms']:8.3f} ({c['min_ms']:.3f}-{c['max_ms']:.3f})  "
              + "  ".join(f"{b}/this {v:.3f}" for b, v in r.items()))
    result["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
