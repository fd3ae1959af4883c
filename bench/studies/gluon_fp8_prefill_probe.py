"""Study (Hopper GPU, issue 33): the Gluon FP8 grouped GEMM's bits and speed against the Triton TMA tiles and, with
``--deep-gemm``, DeepGEMM (a quick probe; bench/studies/triton_fp8_prefill_sweep.py is the full sweep of the Triton
tiles).

1. Bits: each ``--variants`` entry against ``DEFAULT_TILES["fp8_block"]`` on
   small contiguous layouts (16 experts, top-4 of 61 tokens; K 7168 / 2048; N 512, 384, 320, 200: partial column
   tiles; experts with no rows), with and without a bias: every routed row bit for bit.
2. Speed: DeepSeek-V3's two grouped GEMMs at 4096 tokens (uniform top-8 of 256 experts, 128-row layout; GEMM1
   N 4096 K 7168, GEMM2 N 7168 K 2048; E4M3 codes over the whole range) for ``DEFAULT_TILES
   ["fp8_block_contiguous_tma"]`` and each variant ``block_n,stages,group_m,k_unroll[,in_flight[,epilogue]]``
   (``k_unroll`` and ``in_flight`` set :data:`fastpath._grouped_gemm_gluon.K_UNROLL` and ``IN_FLIGHT`` for its calls,
   0 the default; ``epilogue``: :attr:`GemmTiles.epilogue`): ``--rounds`` interleaved rounds of 10 calls between
   CUDA events after a warm-up call; median ms, TFLOP/s over the routed rows, bits against the TMA tiles. With
   ``--deep-gemm``, ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` (psum layout, as the layer calls it) in the same
   rounds: each output compared with DeepGEMM's bit for bit, and per round DeepGEMM's time over each variant's
   (``x_deep_gemm``: the median of those).

    python bench/studies/gluon_fp8_prefill_probe.py --deep-gemm --variants 128,6,8,4,0,tma 128,6,8,2,0,tma \
        --out probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402


def _small(k: int, n: int, seed: int, live: int, e: int = 16, tokens: int = 61, top_k: int = 4):
    from fastpath import dispatch

    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.stack([torch.randperm(live, device="cuda", generator=g)[:top_k] for _ in range(tokens)])
    lay = dispatch.to_contiguous(None, ids.to(torch.int32), e, 128)

    def codes(*shape):
        c = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
        c[(c & 0x7F) == 0x7F] -= 1
        return c.view(torch.float8_e4m3fn)

    rows, kb = int(lay.m_indices.numel()), -(-k // 128)
    b, sb = codes(e, n, k), torch.rand((e, -(-n // 128), kb), device="cuda", generator=g) * 1e-3
    a, sa = codes(rows, k), torch.rand((rows, kb), device="cuda", generator=g) * 1e-3
    return lay, a, sa, b, sb, torch.randn((e, n), device="cuda", generator=g)


def main(argv=None) -> int:
    import fastpath._grouped_gemm_gluon as G
    from bench.studies.triton_fp8_prefill_sweep import _codes, routing
    from fastpath import dispatch
    from fastpath.grouped_gemm import DEFAULT_TILES, GemmTiles, grouped_gemm_contiguous

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["128,6,8,4"],
                    help="block_n,stages,group_m,k_unroll[,in_flight[,epilogue]] of each Gluon variant")
    ap.add_argument("--deep-gemm", action="store_true",
                    help="time deep_gemm.m_grouped_fp8_gemm_nt_contiguous in the same rounds (psum layout, as the "
                         "layer calls it) and compare every output with it bit for bit")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tree", default=None, help="the commit measured (default: git rev-parse HEAD here)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tree = args.tree or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()
    res = {"meta": {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "torch": torch.__version__, "tree": tree, "argv": sys.argv[1:]}, "bits": {}, "times": {}}
    cands = {"tma": (DEFAULT_TILES["fp8_block_contiguous_tma"], G.K_UNROLL, None)}
    for v in args.variants:
        f = v.split(",")
        bn, s, g, ku = (int(x) for x in f[:4])
        inf, epi = int(f[4]) if len(f) > 4 else 0, f[5] if len(f) > 5 else "store"
        cands[f"gluon {bn} s{s} g{g} ku{ku} if{inf} {epi}"] = (
            GemmTiles(128, bn, 128, 4, s, group_m=g, kernel="gluon", epilogue=epi), ku, inf or None)
    for k, n, seed, live in ((7168, 512, 0, 16), (2048, 384, 1, 16), (2048, 320, 2, 12), (7168, 200, 3, 11)):
        lay, a, sa, b, sb, bias = _small(k, n, seed, live)
        valid = lay.m_indices >= 0
        for bias_or_none in (None, bias):
            kw = dict(impl="triton", a_scales=sa, b_scales=sb, bias=bias_or_none)
            want = grouped_gemm_contiguous(a, b, lay.m_indices, tiles=DEFAULT_TILES["fp8_block"], **kw)
            for name, (t, ku, inf) in cands.items():
                if name != "tma":
                    G.K_UNROLL, G.IN_FLIGHT = ku, inf
                    got = grouped_gemm_contiguous(a, b, lay.m_indices, tiles=t, **kw)
                    res["bits"][f"{name}: k{k} n{n} live{live} bias{int(bias_or_none is not None)}"] = bool(
                        torch.equal(got[valid], want[valid]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, tokens = 256, 4096
    ids = routing("uniform", tokens, e, 8, gen, 0.3)
    x, sx = _codes((tokens, 7168), gen), torch.rand((tokens, 56), device="cuda", generator=gen) + 0.5
    lay_x, lay_s = dispatch.to_contiguous(x.view(torch.uint8), ids, e, 128), dispatch.to_contiguous(sx, ids, e, 128)
    m_idx = lay_x.m_indices
    rows, valid = int(m_idx.numel()), m_idx >= 0
    real = int(valid.sum())
    res["meta"].update(layout_rows=rows, routed_rows=real)
    ops = {"gemm1": (4096, 7168, lay_x.a.view(torch.float8_e4m3fn), lay_s.a),
           "gemm2": (7168, 2048, _codes((rows, 2048), gen), torch.rand((rows, 16), device="cuda", generator=gen) + .5)}
    for gname, (n, k, a, sa) in ops.items():
        b, sb = _codes((e, n, k), gen), 1e-4 * (1 + torch.rand((e, n // 128, k // 128), device="cuda", generator=gen))
        outs, times = {}, {}
        for name, (t, ku, inf) in cands.items():
            o = torch.empty((rows, n), dtype=torch.bfloat16, device="cuda")

            def fn(t=t, ku=ku, inf=inf, o=o, b=b, sb=sb, a=a, sa=sa):
                G.K_UNROLL, G.IN_FLIGHT = ku, inf
                grouped_gemm_contiguous(a, b, m_idx, impl="triton", a_scales=sa, b_scales=sb, tiles=t, out=o)
            fn()
            outs[name], times[name] = (o, fn), []
        if args.deep_gemm:
            o = torch.empty((rows, n), dtype=torch.bfloat16, device="cuda")

            def fn(o=o, b=b, sb=sb, a=a, sa=sa):
                grouped_gemm_contiguous(a, b, m_idx, impl="deep_gemm", a_scales=sa, b_scales=sb, psum=lay_x.psum,
                                        out=o)
            fn()
            outs["deep_gemm"], times["deep_gemm"] = (o, fn), []
        for _ in range(args.rounds):
            for name, (o, fn) in outs.items():
                fn()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 10)
        for name, (o, _) in outs.items():
            med = sorted(times[name])[len(times[name]) // 2]
            res["times"].setdefault(gname, {})[name] = {
                "median_ms": med, "ms": times[name], "tflops_routed_rows": 2.0 * real * n * k / (med * 1e-3) / 1e12,
                "bits_equal_tma": bool(torch.equal(o[valid], outs["tma"][0][valid]))}
            r = res["times"][gname][name]
            if "deep_gemm" in outs:  # per round: DeepGEMM's time over this one's (> 1: faster than DeepGEMM)
                r["bits_equal_deep_gemm"] = bool(torch.equal(o[valid], outs["deep_gemm"][0][valid]))
                r["x_deep_gemm_per_round"] = [d / t for d, t in zip(times["deep_gemm"], times[name])]
                r["x_deep_gemm"] = sorted(r["x_deep_gemm_per_round"])[len(times[name]) // 2]
            print(f"{gname} {name:32s} {med:7.3f} ms {r['tflops_routed_rows']:5.0f} TFLOP/s bits: tma "
                  f"{r['bits_equal_tma']}, deep_gemm {r.get('bits_equal_deep_gemm')}; x DeepGEMM "
                  f"{r.get('x_deep_gemm')}", flush=True)
    bad = [key for key, ok in res["bits"].items() if not ok]
    print(f"bits vs DEFAULT_TILES['fp8_block']: {len(res['bits']) - len(bad)}/{len(res['bits'])} equal; unequal: {bad}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(res["bits"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
