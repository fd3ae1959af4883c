"""Decode profile of ``fastpath.moe.fused_moe`` (DeepSeek-V3 FP8 layer) as a CUDA graph, and a tile sweep of
its two grouped GEMMs at decode sizes.

* ``--profile``: the capturable layer (Triton and DeepGEMM GEMMs, contiguous and masked layouts) captured in
  a CUDA graph; torch.profiler over ``--replays`` replays gives each kernel of the graph and its mean time;
  the replay's median time (CUDA events) against the HBM roofline (the touched experts' FP8 weights read
  once at the measured copy bandwidth). ``--before MODULE`` times an older ``fused_moe`` beside it and checks
  that both give the same bits.
* ``--sweep``: GEMM1 (N 4096, K 7168) and GEMM2 (N 7168, K 2048) alone on the tight contiguous layout of the
  same routing, each tile of ``SWEEP`` (Triton) and DeepGEMM (contiguous, and masked with several
  ``expected_m``), timed as a graph of ``--calls`` back-to-back calls; every Triton tile's output is checked
  bit for bit against the default tile's on the routed rows.

JSON to ``--out``. ``python bench/studies/profile_moe_decode.py --profile --sweep --tokens 1 8 --out prof.json``
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.bench_moe_device import _copy_bandwidth, deepseek_v3_layer, routing  # noqa: E402
from bench.latency_cases import capture  # noqa: E402
from fastpath.grouped_gemm import GemmTiles  # noqa: E402

SWEEP = [GemmTiles(64, 128, 128, 4, 4), GemmTiles(64, 128, 128, 4, 4, swap_ab=True),
         GemmTiles(16, 128, 128, 4, 3, swap_ab=True), GemmTiles(16, 128, 128, 4, 4, swap_ab=True),
         GemmTiles(16, 128, 128, 4, 6, swap_ab=True), GemmTiles(16, 64, 128, 4, 4, swap_ab=True),
         GemmTiles(16, 64, 128, 4, 6, swap_ab=True), GemmTiles(16, 64, 128, 4, 8, swap_ab=True),
         GemmTiles(16, 256, 128, 8, 3, swap_ab=True), GemmTiles(16, 256, 128, 8, 4, swap_ab=True),
         GemmTiles(16, 128, 128, 8, 4, swap_ab=True), GemmTiles(32, 128, 128, 4, 4, swap_ab=True)]


def _replay_ms(g, calls: int, reps: int = 15) -> list[float]:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    g.replay()
    out = []
    for _ in range(reps):
        ev[0].record()
        g.replay()
        ev[1].record()
        torch.cuda.synchronize()
        out.append(ev[0].elapsed_time(ev[1]) / calls)
    return out


def _kernels(g, replays: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        r = rows.setdefault(ev.name, [0, 0.0])
        r[0] += 1
        r[1] += ev.device_time
    return sorted(({"kernel": k[:90], "per_replay": c / replays, "us_per_replay": t / replays}
                   for k, (c, t) in rows.items()), key=lambda r: -r["us_per_replay"])


def profile_layer(fw, cases, bw, replays, before, impls):
    from fastpath.moe import fused_moe

    old = importlib.import_module(before).fused_moe if before else None
    out = []
    for m, (x, tw, ids) in cases.items():
        ids_t = torch.as_tensor(ids, device="cuda")
        touched = len(np.unique(ids))
        roof_ms = touched * (4096 * 7168 + 7168 * 2048) / bw * 1e3
        for impl in impls:
            for layout in ("contiguous", "masked"):
                for tag, f in (("new", fused_moe), ("before", old)):
                    if f is None:
                        continue
                    fn = (lambda f=f, impl=impl, layout=layout:
                          f(x, fw, tw, ids_t, impl=impl, layout=layout, capturable=True))
                    try:
                        g, res = capture(fn)
                        g.replay()
                        torch.cuda.synchronize()
                        eager = fused_moe(x, fw, tw, ids_t, impl=impl)
                        t = _replay_ms(g, 1)
                        row = dict(tokens=m, impl=impl, layout=layout, version=tag, roofline_ms=roof_ms,
                                   median_ms=statistics.median(t), min_ms=min(t), max_ms=max(t),
                                   of_roofline=roof_ms / statistics.median(t),
                                   equals_new_default=bool(torch.equal(res, eager)))
                        if m == min(cases):
                            row["kernels"] = _kernels(g, replays)
                    except Exception as e:  # recorded, the others still run
                        row = dict(tokens=m, impl=impl, layout=layout, version=tag, error=f"{type(e).__name__}: {e}"[:400])
                    out.append(row)
                    print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
    return out


def sweep(fw, cases, bw, calls, impls):
    from fastpath import dispatch
    from fastpath.grouped_gemm import grouped_gemm_contiguous, grouped_gemm_masked

    out = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    for m, (x, tw, ids) in cases.items():
        ids_t = torch.as_tensor(ids, device="cuda")
        lay = dispatch.to_contiguous(None, ids_t, 256, 128)
        ms = int(lay.m_indices.numel())
        valid = lay.m_indices >= 0
        touched = len(np.unique(ids))
        shapes = {"gemm1": (fw.w13, fw.w13_scales, 7168), "gemm2": (fw.w2, fw.w2_scales, 2048)}
        for gname, (w, ws, k) in shapes.items():
            a = torch.randn((ms, k), device="cuda", generator=gen).to(torch.float8_e4m3fn)
            sa = torch.rand((ms, k // 128), device="cuda", generator=gen) + 0.5
            roof_ms = touched * int(w.shape[1]) * k / bw * 1e3
            ref = None
            fns = {}
            for t in SWEEP:
                fns[str(t)] = (lambda t=t: grouped_gemm_contiguous(a, w, lay.m_indices, impl="triton", a_scales=sa,
                                                                   b_scales=ws, tiles=t))
            if "deep_gemm" in impls:
                fns["deep_gemm_contiguous"] = lambda: grouped_gemm_contiguous(a, w, lay.m_indices, impl="deep_gemm",
                                                                              a_scales=sa, b_scales=ws)
                mk = dispatch.to_masked(None, ids_t, 256, 128, expected_m=1, validate=False)
                am = torch.randn((256, 128, k), device="cuda", generator=gen).to(torch.float8_e4m3fn)
                sam = torch.rand((256, 128, k // 128), device="cuda", generator=gen) + 0.5
                for em in sorted({1, max(1, -(-m * 8 // 256)), 4, 16}):
                    fns[f"deep_gemm_masked_em{em}"] = (lambda em=em: grouped_gemm_masked(
                        am, w, mk.masked_m, impl="deep_gemm", a_scales=sam, b_scales=ws, expected_m=em))
                for t in (GemmTiles(16, 128, 128, 4, 4, swap_ab=True), GemmTiles(16, 64, 128, 4, 6, swap_ab=True)):
                    fns[f"triton_masked {t}"] = (lambda t=t: grouped_gemm_masked(
                        am, w, mk.masked_m, impl="triton", a_scales=sam, b_scales=ws, tiles=t,
                        max_groups=min(256, m * 8)))
            for name, fn in fns.items():
                try:
                    g, res = capture(fn, calls=calls)
                    t_ms = _replay_ms(g, calls, reps=9)
                    same = None
                    if name.startswith("GemmTiles"):
                        if ref is None:
                            ref = res.clone()
                        same = bool(torch.equal(res[valid], ref[valid]))
                    row = dict(tokens=m, gemm=gname, case=name, median_ms=statistics.median(t_ms), min_ms=min(t_ms),
                               max_ms=max(t_ms), roofline_ms=roof_ms, of_roofline=roof_ms / statistics.median(t_ms),
                               bits_equal_default=same)
                    del g
                except Exception as e:
                    row = dict(tokens=m, gemm=gname, case=name, error=f"{type(e).__name__}: {e}"[:300])
                out.append(row)
                print(row, flush=True)
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=None)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--before", default=None)
    ap.add_argument("--out", default="bench_out/moe_decode_profile.json")
    args = ap.parse_args(argv)
    from bench.interleaved import machine_meta
    from fastpath.grouped_gemm import grouped_gemm_supports
    from fastpath.moe import FastMoEWeights

    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = deepseek_v3_layer(256, gen)
    fw = FastMoEWeights(weights.w13.codes.view(torch.float8_e4m3fn), weights.w2.codes.view(torch.float8_e4m3fn),
                        "gate_up", weights.w13.scales.float(), weights.w2.scales.float())
    del weights
    impls = [i for i in ("triton", "deep_gemm") if grouped_gemm_supports(i)[0]]
    cases = {}
    for m in sorted(set(args.tokens) | set(args.sweep_tokens or [])):
        x = torch.randn((m, 7168), device="cuda", generator=gen).to(torch.bfloat16)
        tw, ids = routing(m, 256, 8, gen)
        cases[m] = (x, tw, ids)
    bw = _copy_bandwidth()
    res = dict(meta=dict(machine_meta(), copy_tb_s=bw / 1e12, impls=impls), profile=[], sweep=[])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    if args.profile:
        res["profile"] = profile_layer(fw, {m: cases[m] for m in args.tokens}, bw, args.replays, args.before, impls)
        save()
    if args.sweep:
        st = args.sweep_tokens or args.tokens
        res["sweep"] = sweep(fw, {m: cases[m] for m in st}, bw, args.calls, impls)
        save()
    print(f"{res['meta'].get('gpu')} copy {bw / 1e12:.2f} TB/s")
    for r in res["profile"]:
        if "error" in r:
            print(f"  {r['tokens']:4d} {r['impl']:9s} {r['layout']:10s} {r['version']:6s} ERROR {r['error'][:100]}")
            continue
        print(f"  {r['tokens']:4d} {r['impl']:9s} {r['layout']:10s} {r['version']:6s} {r['median_ms']:.4f} ms "
              f"({r['min_ms']:.4f}-{r['max_ms']:.4f}) {r['of_roofline']:.0%} eq={r['equals_new_default']}")
        for kr in r.get("kernels", []):
            print(f"        {kr['us_per_replay']:8.2f} us x{kr['per_replay']:.0f}  {kr['kernel'][:70]}")
    for r in res["sweep"]:
        if "error" in r:
            print(f"  sweep {r['tokens']} {r['gemm']} {r['case']} ERROR {r['error'][:100]}")
        else:
            print(f"  sweep {r['tokens']:4d} {r['gemm']} {r['median_ms']:.4f} {r['of_roofline']:.0%} "
                  f"eq={r['bits_equal_default']} {r['case']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
