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
read through ``a_src`` (no scatter; TMA then loads B only; warp-specialized tiles refuse it), for the default,
the fastest GEMM1 tile and the fastest without warp specialization.

Each tile's first call compiles it (timed, reported); a tile that fails to compile or run (shared memory,
an unsupported combination) is recorded with its error, not fatal. Compilation of a new tile stops when
``--budget-s`` (150) seconds have passed since the start (the rest are recorded as skipped; the ``a_src``
phase's tiles may start up to 30 s later), so the whole run stays within about 240 s on an H200. Per compiled
kernel the JSON records whether its IR has Triton's warp specialization and TMA loads, its registers, spills
and shared memory. Tiles are compiled and timed in three groups (pointer loads, TMA, warp-specialized), each
with DeepGEMM in its rounds; a first call that hangs (``--hang-s``) or leaves a CUDA error stops the run with
the JSON written (exit status 3).

    python bench/studies/triton_fp8_prefill_sweep.py --out bench_out/triton_fp8_prefill_sweep.json \\
        [--tokens 4096] [--rounds 7] [--routings uniform skewed] [--configs NAME ...] [--budget-s 150]

Prints a table per routing and GEMM and the best tile per GEMM (median ratio to DeepGEMM, bit-equal tiles only).

Without a GPU, under ``TRITON_INTERPRET=1``, it runs at a tiny shape (hidden 128, intermediate 128, 4 experts,
top-2, 16 tokens) with each candidate's options on 16 x 32 tiles (the Gluon kernel's left out: it has no
interpreter), wall-clock rounds and no DeepGEMM: it checks the script's plumbing and the bits, not speed.
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

DEEPSEEK_V3 = {"hidden": 7168, "inter": 2048, "experts": 256, "top_k": 8}
TINY = {"hidden": 128, "inter": 128, "experts": 4, "top_k": 2}  # the interpreter's plumbing run
DEFAULT_NAME = "default"
GATHER_EXTRA_S = 30.0  # the a_src phase may compile its two tiles up to this long past --budget-s


def _gemms(shape: dict) -> dict:
    """name -> (N, K) of the two grouped GEMMs."""
    return {"gemm1": (2 * shape["inter"], shape["hidden"]), "gemm2": (shape["hidden"], shape["inter"])}


def _codes(shape, gen, chunk: int = 16) -> torch.Tensor:
    """Random E4M3 codes over the whole finite range (NaN codes 0x7F / 0xFF moved to 0x7E / 0xFE), made in
    chunks of the leading dimension on the generator's device."""
    out = torch.empty(shape, dtype=torch.uint8, device=gen.device)
    for i in range(0, shape[0], chunk):
        c = out[i:i + chunk]
        c.random_(0, 256, generator=gen)
        c[(c & 0x7F) == 0x7F] -= 1
    return out.view(torch.float8_e4m3fn)


def routing(kind: str, tokens: int, experts: int, top_k: int, gen, skew: float) -> torch.Tensor:
    """``topk_ids`` int32 ``[tokens, top_k]``: ``uniform`` a random top-k per token; ``skewed`` a Gumbel top-k
    over the log of Zipf popularities ``rank^-skew`` (ranks a random permutation of the experts)."""
    scores = torch.rand((tokens, experts), device=gen.device, generator=gen)
    if kind == "skewed":
        rank = torch.randperm(experts, device=gen.device, generator=gen).to(torch.float64) + 1.0
        logp = (-skew * torch.log(rank)).to(torch.float32)
        scores = logp[None, :] - torch.log(-torch.log(scores.clamp_min(1e-12)))
    elif kind != "uniform":
        raise ValueError(f"routing must be 'uniform' or 'skewed'; got {kind!r}")
    return scores.topk(top_k, dim=1).indices.to(torch.int32)


def _compiled_info(before: set) -> list[dict]:
    """What the kernels compiled since ``before`` (keys of fastpath's launch cache) have: warp specialization
    and TMA loads in their IR, registers, spills, shared memory."""
    from fastpath import _host

    out = []
    for key in set(_host._LAUNCH_CACHE) - before:
        compiled = _host._LAUNCH_CACHE[key][0]
        info = {"kernel": getattr(key[0], "__name__", None) or str(key[0])}
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


def _interpreter_tiles(t):
    """A candidate's options on interpreter-sized tiles: 16 x 32 for every candidate, since the interpreter's
    dot of FP8 codes (NumPy's float32 matmul) may round differently at another tile width (the tile-loop
    kernel's 256-wide path is checked bit for bit by tests/test_grouped_gemm_tile_loop.py on exact dots)."""
    from dataclasses import replace

    return replace(t, block_m=16, block_n=32, num_warps=1, num_stages=1)


def _time(cases: dict, args, on_gpu: bool):
    """Interleaved rounds: :func:`bench.interleaved.time_row` on the GPU (DeepGEMM the baseline when present),
    one wall-clock call per case and round under the interpreter."""
    from bench.interleaved import MIN_ROUNDS, WallClock, time_interleaved, time_row

    base = ["deep_gemm"] if "deep_gemm" in cases else []
    if on_gpu:
        return time_row(cases, base, args.rounds, args.round_ms * 1e-3)
    return time_interleaved(cases, baselines=base, rounds=max(args.rounds, MIN_ROUNDS), clock=WallClock(), warmup=0)


def _group(t) -> int:
    """Timing group of a tile: 0 the pointer-load kernels, 1 TMA, 2 warp-specialized, 3 the Gluon kernel (compiled,
    checked and timed after the groups before it, so a failure there cannot cost their measurements)."""
    return 3 if t.kernel == "gluon" else 2 if t.warp_specialize else 1 if t.tma else 0


class Fatal(RuntimeError):
    """A first call that hung or left a sticky CUDA error: nothing after it can run in this process."""


def _first_call(key, fn, status, compiled, budget_s: float, t_start: float, hang_s: float) -> dict:
    """Run ``fn`` once (compiling its kernel): ``{"status": "ok", "first_call_s", "compiled"}``, or the
    failure / budget skip (kept in ``status`` so a later routing does not retry it). A kernel still running
    ``hang_s`` seconds after its launch, or a CUDA error (sticky: the context is lost), raises :class:`Fatal`."""
    from fastpath import _host

    if key not in status and time.perf_counter() - t_start > budget_s:
        status[key] = f"skipped: the compile budget ({budget_s:.0f} s) was spent"
    if key in status and status[key] != "ok":
        return {"status": status[key]}
    before = set(_host._LAUNCH_CACHE)
    t0 = time.perf_counter()
    try:
        fn()
        if torch.cuda.is_available():
            done = torch.cuda.Event()
            done.record()
            t1 = time.perf_counter()
            while not done.query():
                if time.perf_counter() - t1 > hang_s:
                    status[key] = f"hung: still running {hang_s:.0f} s after its launch"
                    raise Fatal(f"{key}: {status[key]}")
                time.sleep(0.002)
            torch.cuda.synchronize()
    except Fatal:
        raise
    except Exception as e:  # a tile that does not compile or run: recorded, not fatal
        status[key] = f"failed: {type(e).__name__}: {str(e)[:400]}"
        print(f"  {key[1]} {key[0]}: {status[key][:160]}", flush=True)
        if "CUDA error" in str(e) or "illegal" in str(e).lower():
            raise Fatal(f"{key}: {status[key]}") from e
        return {"status": status[key], "traceback": traceback.format_exc()[-1500:]}
    first = time.perf_counter() - t0
    print(f"  first call {key[1]} {key[0]}: {first:.1f} s (at {time.perf_counter() - t_start:.0f} s)", flush=True)
    status[key] = "ok"
    if key not in compiled:
        compiled[key] = _compiled_info(before)
    return {"status": "ok", "first_call_s": first, "compiled": compiled[key]}


def main(argv=None) -> int:
    from fastpath.grouped_gemm import DEFAULT_TILES, FP8_PREFILL_CANDIDATES, grouped_gemm_supports

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default 4096; 16 under the interpreter)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (at least 7)")
    ap.add_argument("--round-ms", type=float, default=15.0, help="target length of one case's round (GPU)")
    ap.add_argument("--routings", nargs="+", default=["uniform", "skewed"], choices=["uniform", "skewed"])
    ap.add_argument("--skew", type=float, default=0.3, help="Zipf exponent of the skewed routing")
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"names from FP8_PREFILL_CANDIDATES (default all): {list(FP8_PREFILL_CANDIDATES)}")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="no new tile is compiled after this many seconds from the start (the a_src phase: "
                         f"{GATHER_EXTRA_S:.0f} s more)")
    ap.add_argument("--hang-s", type=float, default=20.0,
                    help="a first call still running this long after its launch stops the run (JSON kept)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("needs a CUDA GPU (Hopper), or TRITON_INTERPRET=1 for the tiny plumbing run")
    names = list(FP8_PREFILL_CANDIDATES) if args.configs is None else args.configs
    unknown = [n for n in names if n not in FP8_PREFILL_CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {list(FP8_PREFILL_CANDIDATES)}")
    configs = {DEFAULT_NAME: DEFAULT_TILES["fp8_block"]}
    configs.update((n, FP8_PREFILL_CANDIDATES[n]) for n in names if FP8_PREFILL_CANDIDATES[n] != configs[DEFAULT_NAME])
    if not on_gpu:  # (the Gluon kernel has no interpreter: its tiles are left out there)
        configs = {n: _interpreter_tiles(t) for n, t in configs.items() if t.kernel != "gluon"}
    shape = DEEPSEEK_V3 if on_gpu else TINY
    tokens = args.tokens if args.tokens is not None else (4096 if on_gpu else 16)
    gemms = _gemms(shape)
    dev = "cuda" if on_gpu else "cpu"
    have_dg, why_dg = grouped_gemm_supports("deep_gemm")
    have_dg = have_dg and on_gpu
    if on_gpu:
        from bench.interleaved import machine_meta

        meta = machine_meta()
        meta["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        meta = {"gpu": "none: TRITON_INTERPRET=1, a plumbing run (not a measurement)"}
    result = {"meta": meta, "args": vars(args), "tokens": tokens, "shape": shape,
              "deep_gemm": True if have_dg else why_dg if on_gpu else "not under the interpreter",
              "configs": {n: repr(t) for n, t in configs.items()}, "routings": {}}
    print(f"{meta['gpu']}; {len(configs)} Triton tiles; deep_gemm: {result['deep_gemm']}", flush=True)

    try:
        _sweep(result, args, configs, shape, tokens, gemms, dev, have_dg, on_gpu, t_start)
    except Fatal as e:  # what was measured before it stays in the JSON; the process cannot go on
        result["fatal"] = str(e)
        result["best"] = {r: {g: _best(rec["gemms"].get(g, {})) for g in gemms}
                          for r, rec in result["routings"].items()}
        _write(result, args.out, t_start)
        for r, rec in result["routings"].items():
            for g, grec in rec["gemms"].items():
                _print_table(r, g, grec)
        print(f"FATAL {e}; wrote {args.out}", flush=True)
        os._exit(3)
    except BaseException as e:  # the JSON keeps what was measured (a single GPU run is precious)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
        _write(result, args.out, t_start)
        raise
    result["best"] = {r: {g: _best(rec["gemms"].get(g, {})) for g in gemms} for r, rec in result["routings"].items()}
    _write(result, args.out, t_start)
    print("\nbest tile per GEMM (median x DeepGEMM, among tiles with the default tiles' bits):")
    for r, by_g in result["best"].items():
        for g, best in by_g.items():
            print(f"  {r:8s} {g}: {best}")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


def _write(result: dict, path: str, t_start: float) -> None:
    result["wall_s"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def _sweep(result, args, configs, shape, tokens, gemms, dev, have_dg, on_gpu, t_start) -> None:
    """The routings' layouts, first calls, bit checks and timings into ``result["routings"]`` (written to
    ``args.out`` after each step)."""
    from fastpath import dispatch
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    experts, top_k = shape["experts"], shape["top_k"]
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    weights = {}
    for g, (n, k) in gemms.items():
        weights[g] = (_codes((experts, n, k), gen),
                      1e-4 * (1 + torch.rand((experts, n // 128, k // 128), device=dev, generator=gen)))
    x = _codes((tokens, shape["hidden"]), gen)
    sx = torch.rand((tokens, shape["hidden"] // 128), device=dev, generator=gen) + 0.5
    status: dict = {}  # (config, gemm) -> "ok" | "failed: ..." | "skipped: ..."
    compiled: dict = {}  # (config, gemm) -> what its compiled kernels have
    for rname in args.routings:
        ids = routing(rname, tokens, experts, top_k, gen, args.skew)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=experts)
        lay_x = dispatch.to_contiguous(x.view(torch.uint8), ids, experts, 128)
        lay_s = dispatch.to_contiguous(sx, ids, experts, 128)
        m_idx, valid = lay_x.m_indices, lay_x.m_indices >= 0
        rows, real = int(m_idx.numel()), int(counts.sum())
        operands = {"gemm1": (lay_x.a.view(torch.float8_e4m3fn), lay_s.a),
                    "gemm2": (_codes((rows, shape["inter"]), gen),
                              torch.rand((rows, shape["inter"] // 128), device=dev, generator=gen) + 0.5)}
        rrec = {"layout_rows": rows, "real_rows": real,
                "rows_per_expert": {"max": int(counts.max()), "mean": float(counts.float().mean()),
                                    "min": int(counts.min()), "zero_experts": int((counts == 0).sum())},
                "row_tiles": {bm: int(((counts + bm - 1) // bm).sum()) for bm in (64, 128)}, "gemms": {}}
        result["routings"][rname] = rrec
        print(f"\n== routing {rname}: {real} routed rows in {rows} layout rows; rows per expert max "
              f"{int(counts.max())}, min {int(counts.min())}", flush=True)
        per_round = {g: {} for g in gemms}  # gemm -> tile -> (seconds per round, DeepGEMM's in its group)
        grecs = {g: {} for g in gemms}
        for g in gemms:
            rrec["gemms"][g] = grecs[g]
        dg_fns = {}
        if have_dg:
            for g, (n, k) in gemms.items():
                (a, sa), (b, sb) = operands[g], weights[g]
                dg_out = torch.empty((rows, n), dtype=torch.bfloat16, device=dev)
                errors = []
                for psum in (lay_x.psum, None):  # the layer's psum layout; m_indices if this build has none
                    fn = (lambda a=a, sa=sa, b=b, sb=sb, o=dg_out, p=psum: grouped_gemm_contiguous(
                        a, b, m_idx, impl="deep_gemm", a_scales=sa, b_scales=sb, psum=p, out=o))
                    t0 = time.perf_counter()
                    try:
                        fn()
                        torch.cuda.synchronize()
                    except Exception as e:  # recorded; the Triton tiles are still measured
                        errors.append(f"{'psum' if psum is not None else 'm_indices'}: {type(e).__name__}: {e}"[:400])
                        continue
                    dg_fns[g] = fn
                    grecs[g]["deep_gemm"] = {"status": "ok", "first_call_s": time.perf_counter() - t0,
                                             "layout": "psum" if psum is not None else "m_indices",
                                             "errors": errors, "by_group": {}}
                    break
                else:
                    grecs[g]["deep_gemm"] = {"status": "failed", "errors": errors}
                    print(f"  deep_gemm {g} failed: {errors}", flush=True)
        want = {}
        for grp in sorted({_group(t) for t in configs.values()}):
            members = {c: t for c, t in configs.items() if _group(t) == grp}
            cases = {g: {} for g in gemms}
            outs = {g: {} for g in gemms}
            for cname, t in members.items():  # tile-major: a tile cut by the budget misses both GEMMs
                for g, (n, k) in gemms.items():
                    (a, sa), (b, sb) = operands[g], weights[g]
                    out = torch.empty((rows, n), dtype=torch.bfloat16, device=dev)
                    fn = (lambda t=t, out=out, a=a, sa=sa, b=b, sb=sb: grouped_gemm_contiguous(
                        a, b, m_idx, impl="triton", a_scales=sa, b_scales=sb, tiles=t, out=out))
                    grecs[g][cname] = _first_call((cname, g), fn, status, compiled, args.budget_s, t_start,
                                                  args.hang_s)
                    grecs[g][cname]["group"] = grp
                    if grecs[g][cname]["status"] == "ok":
                        outs[g][cname], cases[g][cname] = out, fn
                _write(result, args.out, t_start)
            for g, (n, k) in gemms.items():
                grec = grecs[g]
                if DEFAULT_NAME in outs[g]:
                    want[g] = outs[g][DEFAULT_NAME][valid]
                for cname, out in outs[g].items():
                    if g in want:
                        grec[cname]["bits_equal_default"] = bool(torch.equal(out[valid], want[g]))
                if not cases[g]:
                    continue
                if g in dg_fns:
                    cases[g]["deep_gemm"] = dg_fns[g]
                res = _time(cases[g], args, on_gpu)
                flops = 2.0 * real * n * k
                dg_s = res.cases["deep_gemm"].seconds if g in dg_fns else None
                for cname in cases[g]:
                    st = _stats(res, cname)
                    st["tflops_real_rows"] = flops / res.cases[cname].median_s / 1e12
                    if cname == "deep_gemm":
                        grec["deep_gemm"]["by_group"][grp] = st
                        continue
                    grec[cname].update(st)
                    grec[cname]["x_deep_gemm"] = _ratio(res, cname)
                    per_round[g][cname] = (res.cases[cname].seconds, dg_s)
            _write(result, args.out, t_start)
        for g in gemms:
            _print_table(rname, g, grecs[g])
        rrec["together"] = _together(per_round, rrec["gemms"])
        if rrec["together"]:
            _print_together(rname, rrec["together"])
        _write(result, args.out, t_start)
        rrec["gemm1_a_src"] = _gather_phase(rrec, x, sx, operands["gemm1"], lay_x, weights["gemm1"], configs, top_k,
                                            args, t_start, status, compiled, dg_fns.get("gemm1"), on_gpu)
        _write(result, args.out, t_start)


def _best(grec: dict):
    """The bit-equal tile with the highest median ratio to DeepGEMM (the lowest median time without it)."""
    ok = [((v["x_deep_gemm"] if v.get("x_deep_gemm") is not None else -v["median_ms"]), n)
          for n, v in grec.items() if n != "deep_gemm" and "median_ms" in v and v.get("bits_equal_default")]
    if not ok:
        return None
    _, n = max(ok)
    return {"config": n, "x_deep_gemm": grec[n].get("x_deep_gemm"), "median_ms": grec[n]["median_ms"]}


def _together(per_round: dict, gemms: dict) -> dict:
    """Per tile timed in both GEMMs: the per-round sums of its two times, against the per-round sums of
    DeepGEMM's times in the same timing groups; and the best GEMM1 tile with the best GEMM2 tile."""
    p1, p2 = per_round.get("gemm1", {}), per_round.get("gemm2", {})

    def rec(c1, c2):
        (s1, d1), (s2, d2) = p1[c1], p2[c2]
        both = [a + b for a, b in zip(s1, s2)]
        r = {"median_ms": statistics.median(both) * 1e3, "min_ms": min(both) * 1e3, "max_ms": max(both) * 1e3}
        if d1 is not None and d2 is not None:
            dg = [a + b for a, b in zip(d1, d2)]
            r["deep_gemm_median_ms"] = statistics.median(dg) * 1e3
            r["x_deep_gemm"] = statistics.median([d / t for d, t in zip(dg, both)])
        return r

    out = {n: rec(n, n) for n in p1 if n in p2}
    b1, b2 = _best(gemms.get("gemm1", {})), _best(gemms.get("gemm2", {}))
    if b1 and b2 and b1["config"] in p1 and b2["config"] in p2:
        out["best_pair"] = {"gemm1": b1["config"], "gemm2": b2["config"], **rec(b1["config"], b2["config"])}
    return out


def _gather_phase(rrec, x, sx, layout_rows, lay_x, weight, configs, top_k, args, t_start, status, compiled,
                  dg_fn, on_gpu) -> dict:
    """GEMM1 as the Triton layer runs it (token rows ``x`` read through ``a_src``) for the default tile, the
    fastest GEMM1 tile and the fastest without warp specialization (which refuses ``a_src``: recorded): bits
    against the same tile on ``layout_rows`` (the token rows and scales scattered into the layout), timed with
    DeepGEMM on ``layout_rows``."""
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    g1 = rrec["gemms"].get("gemm1", {})
    best = _best(g1)  # the fastest tile, and the fastest taking a_src (warp-specialized and Gluon tiles refuse it)
    best_plain = _best({c: v for c, v in g1.items() if c in configs and not configs[c].warp_specialize
                        and configs[c].kernel != "gluon"})  # (the Gluon kernel refuses a_src too)
    picks = [DEFAULT_NAME] + [b["config"] for b in (best, best_plain) if b and b["config"] != DEFAULT_NAME]
    picks = list(dict.fromkeys(picks))
    b, sb = weight
    m_idx, valid = lay_x.m_indices, lay_x.m_indices >= 0
    rows, n, dev = int(m_idx.numel()), int(b.shape[1]), x.device
    out_rec, cases = {}, {}
    for cname in picks:
        t = configs[cname]
        out = torch.empty((rows, n), dtype=torch.bfloat16, device=dev)
        fn = (lambda t=t, out=out: grouped_gemm_contiguous(x, b, m_idx, impl="triton", a_scales=sx, b_scales=sb,
                                                           tiles=t, out=out, a_src=lay_x.src, top_k=top_k))
        out_rec[cname] = _first_call((cname, "gemm1_a_src"), fn, status, compiled, args.budget_s + GATHER_EXTRA_S,
                                     t_start, args.hang_s)
        if out_rec[cname]["status"] != "ok":
            continue
        scat = grouped_gemm_contiguous(layout_rows[0], b, m_idx, impl="triton", a_scales=layout_rows[1],
                                       b_scales=sb, tiles=t)
        out_rec[cname]["bits_equal_scattered_rows"] = bool(torch.equal(out[valid], scat[valid]))
        cases[cname] = fn
    if not cases:
        return out_rec
    if dg_fn is not None:  # DeepGEMM's GEMM1 as timed above (the layout's rows)
        cases["deep_gemm"] = dg_fn
        out_rec["deep_gemm"] = {"status": "ok"}
    res = _time(cases, args, on_gpu)
    for cname in cases:
        out_rec[cname].update(_stats(res, cname))
        if cname != "deep_gemm":
            out_rec[cname]["x_deep_gemm"] = _ratio(res, cname)
        x_dg = out_rec[cname].get("x_deep_gemm")
        print(f"  gemm1 a_src {cname:34s} {out_rec[cname]['median_ms']:7.3f} ms"
              f"{'' if x_dg is None else f'  x{x_dg:.2f} DeepGEMM'}", flush=True)
    return out_rec


def _print_table(rname: str, g: str, grec: dict) -> None:
    print(f"-- {rname} {g}: median ms (min-max), x DeepGEMM (median of per-round ratios), bits = default?")
    rows = sorted(grec.items(), key=lambda kv: kv[1].get("median_ms", float("inf")))
    for cname, v in rows:
        if cname == "deep_gemm":
            meds = ", ".join(f"{st['median_ms']:.3f}" for st in v.get("by_group", {}).values())
            print(f"  {'deep_gemm':34s} {meds} (one timing per group: pointer loads, TMA, warp-specialized)")
            continue
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
    dg = [v["deep_gemm_median_ms"] for v in tog.values() if "deep_gemm_median_ms" in v]
    dg_text = f": DeepGEMM {statistics.median(dg):.3f} ms (median over the timing groups)" if dg else ""
    print(f"-- {rname} both GEMMs (per-round sums){dg_text}")
    rows = sorted(tog.items(), key=lambda kv: kv[1]["median_ms"])
    for cname, v in rows[:6]:
        extra = f" ({v['gemm1']} + {v['gemm2']})" if cname == "best_pair" else ""
        x = f"  x{v['x_deep_gemm']:.2f}" if "x_deep_gemm" in v else ""
        print(f"  {cname:34s} {v['median_ms']:7.3f} ms{x}{extra}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
