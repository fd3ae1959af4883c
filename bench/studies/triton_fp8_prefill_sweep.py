"""Study (Hopper GPU, issue 33): which Triton FP8 grouped GEMM tiles come closest to DeepGEMM at DeepSeek-V3 prefill?

DeepSeek-V3's two grouped GEMMs at ``--tokens`` (4096) tokens, top-8 of 256 experts, 128-row contiguous layout
(:func:`fastpath.dispatch.to_contiguous`, as :mod:`fastpath.moe` builds it): GEMM1 ``N = 4096, K = 7168``, GEMM2
``N = 7168, K = 2048``; FP8 E4M3 codes over the whole finite range, 1x128 activation and 128x128 weight scales
(FP32), bf16 output. Two routings: ``uniform`` (a random top-8 per token, as bench/bench_moe_device.py) and
``skewed`` (Gumbel top-8 over Zipf expert popularities ``p_e ~ rank^-s``, ``--skew`` s = 0.3: the hottest expert
about 3.8x the mean load, the coldest 0.7x; ranks shuffled over the experts).

Times ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` (called as :mod:`fastpath.moe` calls it: the psum layout)
against the Triton kernel under every tile of :data:`fastpath.grouped_gemm.FP8_PREFILL_CANDIDATES` (or
``--configs``), GEMM1 and GEMM2 separately, in interleaved rounds (:func:`bench.interleaved.time_row`: CUDA
events, calls per round calibrated to ``--round-ms``, clocks spun up; medians and spreads); "together" is the
per-round sum of the two GEMMs' times (round ``i`` of GEMM1 with round ``i`` of GEMM2) against DeepGEMM's.
Each Triton output is checked bit for bit against the default tiles (:data:`fastpath.grouped_gemm.DEFAULT_TILES`)
on every routed row of the same data. GEMM1 is also timed the way the Triton layer runs it, the token rows
read through ``a_src`` (no scatter; TMA then loads B only), for the default and the fastest GEMM1 tile.

Each tile's first call compiles it (timed, reported); a tile that fails to compile or run (shared memory,
an unsupported combination) is recorded with its error, not fatal. Compilation of a new tile stops when
``--budget-s`` seconds have passed since the start (the rest are recorded as skipped), so the whole run
stays within about 240 s on an H200. Per compiled kernel the JSON records whether its IR has Triton's warp
specialization and TMA loads, its registers, spills and shared memory.

    python bench/studies/triton_fp8_prefill_sweep.py --out bench_out/triton_fp8_prefill_sweep.json \\
        [--tokens 4096] [--rounds 7] [--routings uniform skewed] [--configs NAME ...] [--budget-s 170]

Prints a table per routing and GEMM and the best tile per GEMM (median ratio to DeepGEMM, bit-equal tiles only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 7168, 2048, 256, 8
GEMMS = {"gemm1": (2 * INTER, HIDDEN), "gemm2": (HIDDEN, INTER)}  # name -> (N, K)
DEFAULT_NAME = "default"


def _codes(shape, gen, chunk: int = 16) -> torch.Tensor:
    """Random E4M3 codes over the whole finite range (NaN codes 0x7F / 0xFF moved to 0x7E / 0xFE), made in
    chunks of the leading dimension."""
    out = torch.empty(shape, dtype=torch.uint8, device="cuda")
    for i in range(0, shape[0], chunk):
        c = out[i:i + chunk]
        c.random_(0, 256, generator=gen)
        c[(c & 0x7F) == 0x7F] -= 1
    return out.view(torch.float8_e4m3fn)


def routing(kind: str, tokens: int, gen, skew: float) -> torch.Tensor:
    """``topk_ids`` int32 ``[tokens, 8]``: ``uniform`` a random top-8 of 256 per token; ``skewed`` a Gumbel top-8
    over the log of Zipf popularities ``rank^-skew`` (ranks a random permutation of the experts)."""
    scores = torch.rand((tokens, EXPERTS), device="cuda", generator=gen)
    if kind == "skewed":
        rank = torch.randperm(EXPERTS, device="cuda", generator=gen).to(torch.float64) + 1.0
        logp = (-skew * torch.log(rank)).to(torch.float32)
        scores = logp[None, :] - torch.log(-torch.log(scores.clamp_min(1e-12)))
    elif kind != "uniform":
        raise ValueError(f"routing must be 'uniform' or 'skewed'; got {kind!r}")
    return scores.topk(TOP_K, dim=1).indices.to(torch.int32)


def _compiled_info(before: set) -> list[dict]:
    """What the kernels compiled since ``before`` (keys of fastpath's launch cache) have: warp specialization
    and TMA loads in their IR, registers, spills, shared memory."""
    from fastpath import _host

    out = []
    for key in set(_host._LAUNCH_CACHE) - before:
        compiled = _host._LAUNCH_CACHE[key][0]
        info = {"kernel": getattr(key[0], "__name__", str(key[0]))}
        try:
            ttgir = compiled.asm.get("ttgir", "")
            info["warp_specialized"] = "ttg.warp_specialize" in ttgir
            info["tma_loads"] = "async_tma_copy_global_to_local" in ttgir
        except Exception as e:  # reported, not hidden
            info["ir"] = f"{type(e).__name__}: {e}"
        for name in ("n_regs", "n_spills"):
            info[name] = getattr(compiled, name, None)
        info["shared_bytes"] = getattr(getattr(compiled, "metadata", None), "shared", None)
        out.append(info)
    return out


def _stats(res, name: str) -> dict:
    c = res.cases[name]
    return {"median_ms": c.median_s * 1e3, "min_ms": c.min_s * 1e3, "max_ms": c.max_s * 1e3, "spread": c.spread,
            "flagged": c.flagged, "calls_per_round": res.calls_per_round[name],
            "seconds_per_round": list(c.seconds)}


def _ratio(res, name: str) -> float | None:
    r = res.ratios.get(name, {}).get("deep_gemm")
    return None if r is None else r.median


def main(argv=None) -> int:
    from bench.interleaved import machine_meta, time_row
    from fastpath import _host, dispatch
    from fastpath.grouped_gemm import (DEFAULT_TILES, FP8_PREFILL_CANDIDATES, grouped_gemm_contiguous,
                                       grouped_gemm_supports)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (at least 7)")
    ap.add_argument("--round-ms", type=float, default=15.0, help="target length of one case's round")
    ap.add_argument("--routings", nargs="+", default=["uniform", "skewed"], choices=["uniform", "skewed"])
    ap.add_argument("--skew", type=float, default=0.3, help="Zipf exponent of the skewed routing")
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"names from FP8_PREFILL_CANDIDATES (default all): {list(FP8_PREFILL_CANDIDATES)}")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="no new tile is compiled after this many seconds from the start")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (Hopper): the sweep times DeepGEMM and the compiled Triton kernels")
    names = list(FP8_PREFILL_CANDIDATES) if args.configs is None else args.configs
    unknown = [n for n in names if n not in FP8_PREFILL_CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {list(FP8_PREFILL_CANDIDATES)}")
    configs = {DEFAULT_NAME: DEFAULT_TILES["fp8_block"]}
    configs.update((n, FP8_PREFILL_CANDIDATES[n]) for n in names if FP8_PREFILL_CANDIDATES[n] != configs[DEFAULT_NAME])
    have_dg, why_dg = grouped_gemm_supports("deep_gemm")
    result = {"meta": machine_meta(), "args": vars(args),
              "sms": torch.cuda.get_device_properties(0).multi_processor_count,
              "deep_gemm": have_dg if have_dg else why_dg,
              "configs": {n: repr(t) for n, t in configs.items()}, "routings": {}}
    print(f"{result['meta']['gpu']}, triton {result['meta']['triton']}, torch {result['meta']['torch']}; "
          f"{len(configs)} Triton tiles; deep_gemm: {result['deep_gemm']}", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    weights = {}
    for g, (n, k) in GEMMS.items():
        weights[g] = (_codes((EXPERTS, n, k), gen),
                      (1e-4 * (1 + torch.rand((EXPERTS, n // 128, k // 128), device="cuda", generator=gen))))
    x = _codes((args.tokens, HIDDEN), gen)
    sx = torch.rand((args.tokens, HIDDEN // 128), device="cuda", generator=gen) + 0.5
    status: dict = {}  # (config, gemm) -> "ok" | error text | "skipped ..."
    compiled: dict = {}  # (config, gemm or "gemm1_a_src") -> kernel info

    for rname in args.routings:
        ids = routing(rname, args.tokens, gen, args.skew)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=EXPERTS)
        lay_x = dispatch.to_contiguous(x.view(torch.uint8), ids, EXPERTS, 128)
        lay_s = dispatch.to_contiguous(sx, ids, EXPERTS, 128)
        m_idx, valid = lay_x.m_indices, lay_x.m_indices >= 0
        rows, real = int(m_idx.numel()), int(counts.sum())
        h_codes = _codes((rows, INTER), gen)
        h_scales = torch.rand((rows, INTER // 128), device="cuda", generator=gen) + 0.5
        operands = {"gemm1": (lay_x.a.view(torch.float8_e4m3fn), lay_s.a), "gemm2": (h_codes, h_scales)}
        c = counts.float()
        rrec = {"layout_rows": rows, "real_rows": real,
                "rows_per_expert": {"max": int(counts.max()), "mean": float(c.mean()), "min": int(counts.min()),
                                    "zero_experts": int((counts == 0).sum())},
                "row_tiles": {bm: int(((counts + bm - 1) // bm).sum()) for bm in (64, 128)}, "gemms": {}}
        result["routings"][rname] = rrec
        print(f"\n== routing {rname}: {real} routed rows in {rows} layout rows; rows per expert max "
              f"{int(counts.max())}, min {int(counts.min())}", flush=True)
        per_round: dict = {}
        for g, (n, k) in GEMMS.items():
            a, sa = operands[g]
            b, sb = weights[g]
            outs = {}

            def call(t, out, a=a, sa=sa, b=b, sb=sb):
                return grouped_gemm_contiguous(a, b, m_idx, impl="triton", a_scales=sa, b_scales=sb, tiles=t, out=out)

            cases, grec = {}, {}
            if have_dg:
                dg_out = torch.empty((rows, n), dtype=torch.bfloat16, device="cuda")
                cases["deep_gemm"] = (lambda a=a, sa=sa, b=b, sb=sb, o=dg_out: grouped_gemm_contiguous(
                    a, b, m_idx, impl="deep_gemm", a_scales=sa, b_scales=sb, psum=lay_x.psum, out=o))
                t0 = time.perf_counter()
                cases["deep_gemm"]()
                torch.cuda.synchronize()
                grec["deep_gemm"] = {"first_call_s": time.perf_counter() - t0}
            for cname, t in configs.items():
                key = (cname, g)
                if key in status and status[key] != "ok":
                    grec[cname] = {"status": status[key]}
                    continue
                if key not in status and time.perf_counter() - t_start > args.budget_s:
                    status[key] = f"skipped: the compile budget ({args.budget_s:.0f} s) was spent"
                    grec[cname] = {"status": status[key]}
                    continue
                out = torch.empty((rows, n), dtype=torch.bfloat16, device="cuda")
                before = set(_host._LAUNCH_CACHE)
                t0 = time.perf_counter()
                try:
                    call(t, out)
                    torch.cuda.synchronize()
                except Exception as e:  # a tile that does not compile or run: recorded, not fatal
                    status[key] = f"failed: {type(e).__name__}: {str(e)[:400]}"
                    grec[cname] = {"status": status[key], "traceback": traceback.format_exc()[-1500:]}
                    print(f"  {g} {cname}: {status[key][:160]}", flush=True)
                    continue
                first = time.perf_counter() - t0
                if key not in compiled:
                    compiled[key] = _compiled_info(before)
                status[key] = "ok"
                outs[cname] = out
                grec[cname] = {"status": "ok", "first_call_s": first, "compiled": compiled[key]}
                cases[cname] = lambda t=t, out=out: call(t, out)
            if DEFAULT_NAME in outs:
                want = outs[DEFAULT_NAME][valid]
                for cname, out in outs.items():
                    grec[cname]["bits_equal_default"] = bool(torch.equal(out[valid], want))
            if len(cases) > 1:
                res = time_row(cases, ["deep_gemm"] if have_dg else [], args.rounds, args.round_ms * 1e-3)
                flops = 2.0 * real * n * k
                for cname in cases:
                    grec[cname].update(_stats(res, cname))
                    grec[cname]["tflops_real_rows"] = flops / res.cases[cname].median_s / 1e12
                    if cname != "deep_gemm":
                        grec[cname]["x_deep_gemm"] = _ratio(res, cname)
                per_round[g] = {cname: res.cases[cname].seconds for cname in cases}
            rrec["gemms"][g] = grec
            _print_table(rname, g, grec)
        rrec["together"] = _together(per_round, rrec["gemms"])
        if rrec["together"]:
            _print_together(rname, rrec["together"])
        rrec["gemm1_a_src"] = _gather_phase(rrec, x, sx, operands["gemm1"], lay_x, weights, configs, args, t_start,
                                            status, compiled, have_dg)
    result["best"] = {r: {g: _best(rec["gemms"].get(g, {})) for g in GEMMS} for r, rec in result["routings"].items()}
    result["wall_s"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print("\nbest tile per GEMM (median x DeepGEMM, bit-equal to the default tiles):")
    for r, by_g in result["best"].items():
        for g, best in by_g.items():
            print(f"  {r:8s} {g}: {best}")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


def _best(grec: dict):
    ok = [(v["x_deep_gemm"], n) for n, v in grec.items()
          if n != "deep_gemm" and v.get("x_deep_gemm") is not None and v.get("bits_equal_default")]
    if not ok:
        return None
    r, n = max(ok)
    return {"config": n, "x_deep_gemm": r, "median_ms": grec[n]["median_ms"]}


def _together(per_round: dict, gemms: dict) -> dict:
    """Per config timed in both GEMMs: the per-round sums against DeepGEMM's; plus the best GEMM1 tile with the
    best GEMM2 tile."""
    if set(per_round) != set(GEMMS) or any("deep_gemm" not in v for v in per_round.values()):
        return {}
    dg = [a + b for a, b in zip(per_round["gemm1"]["deep_gemm"], per_round["gemm2"]["deep_gemm"])]

    def rec(s1, s2):
        both = [a + b for a, b in zip(s1, s2)]
        return {"median_ms": statistics.median(both) * 1e3, "min_ms": min(both) * 1e3, "max_ms": max(both) * 1e3,
                "x_deep_gemm": statistics.median([d / t for d, t in zip(dg, both)])}

    out = {"deep_gemm": {"median_ms": statistics.median(dg) * 1e3, "min_ms": min(dg) * 1e3, "max_ms": max(dg) * 1e3}}
    for cname in per_round["gemm1"]:
        if cname != "deep_gemm" and cname in per_round["gemm2"]:
            out[cname] = rec(per_round["gemm1"][cname], per_round["gemm2"][cname])
    b1, b2 = _best(gemms["gemm1"]), _best(gemms["gemm2"])
    if b1 and b2:
        out["best_pair"] = {"gemm1": b1["config"], "gemm2": b2["config"],
                            **rec(per_round["gemm1"][b1["config"]], per_round["gemm2"][b2["config"]])}
    return out


def _gather_phase(rrec, x, sx, layout_rows, lay_x, weights, configs, args, t_start, status, compiled,
                  have_dg) -> dict:
    """GEMM1 as the Triton layer runs it (token rows ``x`` read through ``a_src``) for the default tile and the
    fastest GEMM1 tile: bits against the same tile on ``layout_rows`` (the token rows and scales scattered into
    the layout), timed with DeepGEMM on ``layout_rows``."""
    from bench.interleaved import time_row
    from fastpath import _host
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    best = _best(rrec["gemms"].get("gemm1", {}))
    picks = [DEFAULT_NAME] + ([best["config"]] if best and best["config"] != DEFAULT_NAME else [])
    b, sb = weights["gemm1"]
    m_idx, valid = lay_x.m_indices, lay_x.m_indices >= 0
    rows, n = int(m_idx.numel()), GEMMS["gemm1"][0]
    out_rec, cases = {}, {}
    for cname in picks:
        key = (cname, "gemm1_a_src")
        if key not in status and time.perf_counter() - t_start > args.budget_s:
            status[key] = f"skipped: the compile budget ({args.budget_s:.0f} s) was spent"
        if key in status and status[key] != "ok":
            out_rec[cname] = {"status": status[key]}
            continue
        t = configs[cname]
        out = torch.empty((rows, n), dtype=torch.bfloat16, device="cuda")
        fn = (lambda t=t, out=out: grouped_gemm_contiguous(x, b, m_idx, impl="triton", a_scales=sx, b_scales=sb,
                                                           tiles=t, out=out, a_src=lay_x.src, top_k=TOP_K))
        before = set(_host._LAUNCH_CACHE)
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:
            status[key] = f"failed: {type(e).__name__}: {str(e)[:400]}"
            out_rec[cname] = {"status": status[key]}
            continue
        status[key] = "ok"
        compiled.setdefault(key, _compiled_info(before))
        scat = grouped_gemm_contiguous(layout_rows[0], b, m_idx, impl="triton", a_scales=layout_rows[1],
                                       b_scales=sb, tiles=t)
        out_rec[cname] = {"status": "ok", "compiled": compiled[key],
                          "bits_equal_scattered_rows": bool(torch.equal(out[valid], scat[valid]))}
        cases[cname + " a_src"] = fn
    if cases:
        if have_dg:
            a1, sa1 = layout_rows
            dg_out = torch.empty((rows, n), dtype=torch.bfloat16, device="cuda")
            cases["deep_gemm"] = lambda: grouped_gemm_contiguous(a1, b, m_idx, impl="deep_gemm", a_scales=sa1,
                                                                 b_scales=sb, psum=lay_x.psum, out=dg_out)
        res = time_row(cases, ["deep_gemm"] if have_dg else [], args.rounds, args.round_ms * 1e-3)
        for cname in picks:
            if cname + " a_src" in res.cases:
                out_rec[cname].update(_stats(res, cname + " a_src"))
                out_rec[cname]["x_deep_gemm"] = _ratio(res, cname + " a_src")
        if have_dg:
            out_rec["deep_gemm"] = _stats(res, "deep_gemm")
        for cname, v in out_rec.items():
            if "median_ms" in v:
                print(f"  gemm1 a_src {cname:34s} {v['median_ms']:7.3f} ms  x{v.get('x_deep_gemm') or 0:.2f} DeepGEMM",
                      flush=True)
    return out_rec


def _print_table(rname: str, g: str, grec: dict) -> None:
    print(f"-- {rname} {g}: median ms (min-max), x DeepGEMM (median of per-round ratios), bits = default?")
    rows = sorted(grec.items(), key=lambda kv: kv[1].get("median_ms", float("inf")))
    for cname, v in rows:
        if "median_ms" not in v:
            print(f"  {cname:34s} {v.get('status', '')[:100]}")
            continue
        info = v.get("compiled") or [{}]
        ws = any(i.get("warp_specialized") for i in info)
        regs = "/".join(f"{i.get('n_regs')}r{i.get('n_spills')}s" for i in info) if info != [{}] else ""
        x = v.get("x_deep_gemm")
        bits = v.get("bits_equal_default", "")
        print(f"  {cname:34s} {v['median_ms']:7.3f} ({v['min_ms']:.3f}-{v['max_ms']:.3f})"
              f"{'' if x is None else f'  x{x:.2f}'}  bits={bits}{'  ws' if ws else ''}  {regs}", flush=True)


def _print_together(rname: str, tog: dict) -> None:
    print(f"-- {rname} both GEMMs (per-round sums): DeepGEMM {tog['deep_gemm']['median_ms']:.3f} ms")
    rows = sorted(((n, v) for n, v in tog.items() if n != "deep_gemm"), key=lambda kv: kv[1]["median_ms"])
    for cname, v in rows[:6]:
        extra = f" ({v['gemm1']} + {v['gemm2']})" if cname == "best_pair" else ""
        print(f"  {cname:34s} {v['median_ms']:7.3f} ms  x{v['x_deep_gemm']:.2f}{extra}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
