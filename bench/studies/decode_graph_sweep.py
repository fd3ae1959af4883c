"""Where the decode time of ``fastpath.moe`` goes in a CUDA graph, and which Triton tiles serve each of its two
grouped GEMMs (issue 33). DeepSeek-V3 FP8 layer (hidden 7168, intermediate 2048, 256 experts, top-8, FP8 1x128
activations x 128x128 weights, random codes and routing: ``bench/bench_moe_device.py``), masked layout,
``capturable=True``, ``impl="triton"``.

Phases, in this order (each case guarded: an error is recorded and the others run; ``--budget-s`` stops
starting new cases). Every timing is interleaved rounds (``bench.interleaved``, medians and min-max) with a
device-to-device copy of the bytes the case reads (the touched experts' FP8 weight codes) in the same rounds:
the case's roofline is those bytes read once at the copy's bandwidth (read + written bytes per second, as
docs/moe-gpu.md defines it), half the copy's time; ``of_roofline`` is the median of the per-round ratios.

1. ``node_floor``: a graph of 16 dependent kernels doing nothing (``t.add_(1)``; a Triton kernel of 1 program
   and of one program per SM, plainly and with PDL): what each kernel node of the layer's graph costs at
   least, and what Programmatic Dependent Launch would take off each boundary.
2. ``breakdown``: the default layer at 1 token as a one-call graph, its replay time (CUDA events), and the
   kernel timeline of ``--profile-replays`` replays under ``torch.profiler`` (CUDA activity): per kernel its
   stage (a1 quant, dispatch, GEMM1, act+requant, GEMM2, finalize, by place), median duration, start and the
   idle gap before it; the span, busy and idle time of a replay.
3. ``ablation``: the layer against the same launches with stages left out (post-dispatch, GEMM1+act+GEMM2,
   GEMM1+GEMM2, each GEMM), on the operands recorded from one eager call; differences give what the a1 quant
   and the dispatch, the reduce and the activation cost the graph.
4. ``gemm_sweep``: each grouped GEMM alone with the layer's own operands over the tiles ``GemmTiles(16,
   BLOCK_N, 128, warps, stages, swap_ab=True)``, BLOCK_N 64/128/256, 4/8 warps, 3-6 stages (the kernel has
   no split-K), a graph of ``--gemm-calls`` calls per tile; each tile's output on the routed rows checked bit
   for bit against the default tile's (only equal tiles are ranked).
5. ``layer``: the whole layer (``fused_moe(..., tiles=(gemm1, gemm2))``) with the default tiles and the
   combinations of the ``--top`` fastest tiles of each GEMM, a graph of ``--calls`` calls each, outputs
   checked bit for bit against the default's; then the best combination's breakdown and ablation.
6. ``tokens``: at each of ``--tokens`` (1, 4, 8), the default and the best combination as a one-call graph
   replayed (the figure of docs/moe-gpu.md) and as a ``--calls`` graph.
7. ``dispatch_ab``: the masked layout's sort, rank and fill as one launch
   (``fastpath._dispatch_sort.SMALL_CAPACITY_FUSED``) against three: the layouts compared first (the layer
   runs only if they are equal), then the layer with each, outputs compared bit for bit, and the one-launch
   layer's timeline. Last, because a wrong layout could fault the GEMMs.
8. ``gemm_sweep_tokens``: the GEMM sweep at the largest token count, if time is left.
9. ``act_rows_ab`` ("act over routed rows"): at each of ``--tokens``, the layer with the fused act+quant launch
   over the layout's row tiles (``skip_rows``: a program per tile of 4096 rows at 1 token, padding tiles returning
   at once) and over the routed rows only (``rows``: a program per tile of the ``m * top_k`` slots;
   ``fastpath._moe_layer.ACT_ROUTED_ROWS_AT_DECODE``), each a graph of ``--calls`` calls and a one-call graph,
   interleaved with the copy, and the routed rows on smaller tiles (:data:`ACT_ROWS_AB`); outputs compared bit
   for bit; at 1 token the routed-rows layer's kernel timeline. ``--only act_rows_ab`` runs this phase alone (no
   tile sweep: a few minutes of device time less).

Kernels are compiled in parallel before the sweep (Triton's ``AsyncCompileMode``; ``--serial-compile`` turns it
off). ONE JSON to ``--out``, and a table of the best tile per GEMM, the layer combinations and the breakdown.

    python bench/studies/decode_graph_sweep.py --out bench_out/decode_graph_sweep.json
    python bench/studies/decode_graph_sweep.py --smoke   # CPU, TRITON_INTERPRET=1, tiny layer: the code paths
    python bench/studies/decode_graph_sweep.py --only act_rows_ab --out bench_out/act_rows_ab.json
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.interleaved import CudaEventClock, WallClock, spin_clocks, time_interleaved  # noqa: E402
from fastpath.grouped_gemm import GemmTiles, default_tiles  # noqa: E402

SHAPE = dict(hidden=7168, inter=2048, experts=256, top_k=8)
SMOKE_SHAPE = dict(hidden=256, inter=128, experts=16, top_k=4)


def sweep_tiles(smoke: bool) -> list[GemmTiles]:
    if smoke:  # interpreter: small tiles, warps/stages are launch options it ignores
        return [GemmTiles(16, 32, 128, 4, 3, swap_ab=True), GemmTiles(16, 64, 128, 4, 4, swap_ab=True)]
    return [GemmTiles(16, bn, 128, w, s, swap_ab=True) for bn in (64, 128, 256) for w in (4, 8) for s in (3, 4, 5, 6)]


def short(t: GemmTiles | None) -> str:
    """``n128 w4 s3`` (BLOCK_N, warps, stages of a 16-row swapped tile), else the dataclass's repr."""
    if t is None:
        return "default"
    if t.block_m == 16 and t.block_k == 128 and t.swap_ab:
        return f"n{t.block_n} w{t.num_warps} s{t.num_stages}"
    return str(t)


class Run:
    """The device, clock, capture and time budget of the run (CUDA, or the CPU smoke run without graphs)."""

    def __init__(self, args):
        self.smoke, self.args, self.t0 = args.smoke, args, time.perf_counter()
        self.dev = "cpu" if self.smoke else "cuda"
        self.clock = WallClock() if self.smoke else CudaEventClock()
        self.rounds = args.rounds
        self.default = default_tiles("fp8_block", 1, self.dev)  # the decode tiles (interpreter: its own)

    def reps(self, n: int) -> int:
        return 1 if self.smoke else n

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def sync(self):
        if not self.smoke:
            torch.cuda.synchronize()

    def capture(self, fn, calls: int):
        """(replay, result): ``calls`` back-to-back calls of ``fn`` in one CUDA graph (smoke: plain calls)."""
        if self.smoke:
            out = fn()
            return (lambda: [fn() for _ in range(calls)]), out
        from bench.latency_cases import capture

        g, out = capture(fn, calls=calls)
        g.replay()
        torch.cuda.synchronize()
        return g.replay, out

    def time(self, cases: dict, per_call: dict, reps: int) -> dict:
        """Interleaved rounds of ``cases`` (``reps`` calls each a round); seconds per unit of work
        (``per_call[name]`` units a call): name -> list of per-round seconds."""
        if not self.smoke:
            spin_clocks(150)
        res = time_interleaved(cases, rounds=self.rounds, calls_per_round=reps, warmup=1, clock=self.clock)
        return {n: [s / per_call.get(n, 1) for s in c.seconds] for n, c in res.cases.items()}


def stats(seconds: list, roof_s: list | None = None) -> dict:
    """us: median/min/max/spread; with the copy's roofline per round, of_roofline (median of per-round ratios)."""
    med = statistics.median(seconds)
    out = dict(median_us=med * 1e6, min_us=min(seconds) * 1e6, max_us=max(seconds) * 1e6,
               spread=(max(seconds) - min(seconds)) / med if med > 0 else None)
    if roof_s:
        out["of_roofline"] = statistics.median(r / s for r, s in zip(roof_s, seconds))
        out["roofline_us"] = statistics.median(roof_s) * 1e6
    return out


def copy_case(nbytes: int, dev: str):
    src = torch.empty(max(1, nbytes), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def time_with_roofline(run, cases: dict, nbytes: int, calls: int, reps: int) -> dict:
    """``cases`` (name -> a graph replay of ``calls`` calls) timed in interleaved rounds with a device copy of
    ``nbytes`` (the bytes the cases must read): ``{name: stats per call with the roofline of each round (the
    copy's time / 2: one read of the bytes)}`` plus ``"copy"``: the copy's own stats."""
    secs = run.time(dict(cases, copy=copy_case(nbytes, run.dev)), {n: calls for n in cases}, reps)
    copy = secs.pop("copy")
    roof = [c / 2 for c in copy]
    out = {n: stats(sec, roof) for n, sec in secs.items()}
    out["copy"] = stats(copy)
    return out


def err(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:400]


# --------------------------------------------------------------------------------------------- the layer

def build(run: Run, shape: dict, tokens: list[int]):
    """(FastMoEWeights, {tokens: (x, topk_weights, topk_ids)}) of the FP8 layer."""
    from fastpath.moe import FastMoEWeights

    gen = torch.Generator(device=run.dev).manual_seed(0)
    h, n, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]

    def experts(rows, cols):
        codes = torch.randint(0, 256, (e, rows, cols), dtype=torch.uint8, device=run.dev, generator=gen)
        codes[(codes & 0x7F) == 0x7F] -= 1  # no NaN codes
        s = 1e-4 * (1.0 + torch.rand((e, -(-rows // 128), -(-cols // 128)), device=run.dev, generator=gen))
        return codes.view(torch.float8_e4m3fn), s.to(torch.float32)

    w13, s13 = experts(2 * n, h)
    w2, s2 = experts(h, n)
    fw = FastMoEWeights(w13, w2, "gate_up", s13, s2)
    cases = {}
    for m in tokens:
        x = torch.randn((m, h), device=run.dev, generator=gen).to(torch.bfloat16)
        ids = torch.rand((m, e), device=run.dev, generator=gen).topk(k, dim=1).indices.to(torch.int32)
        tw = torch.rand((m, k), device=run.dev, generator=gen)
        cases[m] = (x, (tw / tw.sum(dim=1, keepdim=True)).float(), ids)
    return fw, cases


def layer_fn(fw, case, tiles=None):
    from fastpath.moe import fused_moe

    x, tw, ids = case
    return lambda: fused_moe(x, fw, tw, ids, impl="triton", layout="masked", capturable=True, graph_cache=False,
                             tiles=tiles)


def weight_bytes(fw, ids) -> dict:
    touched = int(torch.unique(ids[ids >= 0]).numel())
    b1 = touched * int(fw.w13.shape[1]) * int(fw.w13.shape[2])
    b2 = touched * int(fw.w2.shape[1]) * int(fw.w2.shape[2])
    return dict(touched=touched, gemm1=b1, gemm2=b2, layer=b1 + b2)


def record_stages(fw, case) -> dict:
    """The calls after the dispatch of one eager layer call, recorded as ``(args, kwargs, output)`` with the
    layer's own operands: ``gemm1``, ``gemm2`` (``fastpath.grouped_gemm.grouped_gemm_masked``), ``act`` (the
    fused SiLU + a2 quantization, ``fastpath.fused.silu_and_mul_quant_fp8``), ``reduce``
    (``fastpath.dispatch._reduce``). Each is called again as :func:`stage_fn` gives it."""
    import fastpath.dispatch as dp
    import fastpath.fused as fu
    import fastpath.grouped_gemm as gg

    rec: dict = {"gemms": []}
    origs = {(gg, "grouped_gemm_masked"): "gemms", (fu, "silu_and_mul_quant_fp8"): "act", (dp, "_reduce"): "reduce"}
    saved = {k: getattr(*k) for k in origs}

    def recorder(key):
        orig = saved[key]

        def call(*a, **kw):
            out = orig(*a, **kw)
            if origs[key] == "gemms":
                rec["gemms"].append((a, kw, out))
            else:
                rec[origs[key]] = (a, kw, out)
            return out
        return call

    for (mod, name) in origs:
        setattr(mod, name, recorder((mod, name)))
    try:
        layer_fn(fw, case)()
    finally:
        for (mod, name), f in saved.items():
            setattr(mod, name, f)
    if len(rec["gemms"]) != 2 or "act" not in rec or "reduce" not in rec:
        raise RuntimeError(f"expected 2 masked GEMMs, the fused activation and the reduce; recorded "
                           f"{len(rec['gemms'])} GEMMs and {sorted(k for k in rec if k != 'gemms')}")
    return dict(gemm1=rec["gemms"][0], gemm2=rec["gemms"][1], act=rec["act"], reduce=rec["reduce"])


def stage_fn(name: str, call, tiles=None):
    """A zero-argument call of a recorded stage (:func:`record_stages`), the GEMMs with ``tiles`` if given."""
    import fastpath.dispatch as dp
    import fastpath.fused as fu
    import fastpath.grouped_gemm as gg

    a, kw, _ = call
    if name in ("gemm1", "gemm2"):
        return lambda: gg.grouped_gemm_masked(*a, **(kw if tiles is None else dict(kw, tiles=tiles)))
    f = {"act": fu.silu_and_mul_quant_fp8, "reduce": dp._reduce}[name]
    return lambda: f(*a, **kw)


def record_gemms(fw, case):
    """The layer's two ``grouped_gemm_masked`` calls (args, kwargs, output) from one eager call."""
    st = record_stages(fw, case)
    return [st["gemm1"], st["gemm2"]]


def gemm_fn(call, tiles):
    import fastpath.grouped_gemm as gg

    a, kw, _ = call
    return lambda: gg.grouped_gemm_masked(*a, **dict(kw, tiles=tiles))


def routed_rows(call):
    a, kw, out = call
    masked_m = a[2]
    cap = int(out.shape[1])
    return torch.arange(cap, device=masked_m.device)[None, :] < masked_m.to(torch.int64)[:, None]


@contextlib.contextmanager
def compile_in_parallel(run: Run):
    """Launches of the grouped GEMM inside become ``warmup`` compiles on a thread pool (Triton's AsyncCompileMode;
    nothing runs); the kernels are in Triton's cache after the block."""
    if run.smoke or run.args.serial_compile:
        yield False
        return
    from concurrent.futures import ThreadPoolExecutor

    import fastpath.grouped_gemm as gg
    from triton.runtime import _async_compile

    orig = gg.launch

    def warm(kernel, grid, *a, **kw):
        kernel.warmup(*a, grid=grid, **kw)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        mode = _async_compile.AsyncCompileMode(ex, ignore_errors=True)
        gg.launch = warm
        try:
            with mode:
                yield True
        finally:
            gg.launch = orig


# ---------------------------------------------------------------------------------------------- phases

@triton.jit
def _chain_kernel(p, PDL: tl.constexpr):
    """One link of a chain: each program adds 1 to its own word. ``PDL``: launched with Programmatic
    Dependent Launch, it lets its dependent launch at once and waits for the kernel before it
    (``griddepcontrol.wait``) before it reads."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    w = p + tl.program_id(0)
    tl.store(w, tl.load(w) + 1)


def node_floor(run: Run) -> dict:
    """Time per kernel of a graph of 16 dependent kernels doing nothing (each program adds 1 to a word): one
    ``t.add_(1)`` (torch), and a Triton kernel of 1 program and of one program per SM, launched plainly or with
    PDL (``launch_pdl``, trigger at once, wait before the read). What each kernel node of the layer's graph costs
    at least, and what PDL would take off each boundary; ``count_ok``: every word counted every link (PDL kept
    the order)."""
    if run.smoke:
        return {}
    out = {}
    t = torch.zeros(1, device="cuda")
    cases, words = {"torch add_": (lambda: t.add_(1))}, {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for progs in (1, sms):
        for pdl in (False, True):
            w = torch.zeros(progs, dtype=torch.int32, device="cuda")
            name = f"triton {progs} program(s){' pdl' if pdl else ''}"
            words[name] = w
            cases[name] = (lambda w=w, progs=progs, pdl=pdl: _chain_kernel[(progs,)](w, PDL=pdl, launch_pdl=pdl))
    replays = {}
    for name, fn in cases.items():
        try:
            replays[name], _ = run.capture(fn, 16)
            if name in words:
                words[name].zero_()  # counted from here: 16 a replay
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=err(e))
    secs = run.time(replays, {n: 16 for n in replays}, run.reps(50))
    torch.cuda.synchronize()
    for name, s in secs.items():
        out[name] = dict(us_per_kernel=statistics.median(s) * 1e6, min_us=min(s) * 1e6, max_us=max(s) * 1e6)
        if name in words:  # every call of the graph adds 16 to each word: all equal, a multiple of 16
            w = words[name]
            out[name]["count_ok"] = bool((w == w[0]).all()) and int(w[0]) % 16 == 0 and int(w[0]) > 0
    out["node_floor_us"] = out.get("torch add_", {}).get("us_per_kernel")
    return out


def _labels(names: list[str]) -> list[str]:
    """Stage of each kernel of one replay (in start order), by its place around the two grouped GEMMs: before
    GEMM1 the a1 quantization (a quantization kernel) or the dispatch (anything else), between them the
    activation + a2 re-quantization, after GEMM2 the finalize (weight-and-reduce)."""
    gemms = [i for i, n in enumerate(names) if "grouped_gemm" in n]
    if len(gemms) != 2:
        return ["other"] * len(names)
    out = []
    for i, n in enumerate(names):
        if i == gemms[0] or i == gemms[1]:
            out.append("GEMM1" if i == gemms[0] else "GEMM2")
        elif i < gemms[0]:
            out.append("a1 quant" if ("quant" in n or "row_loop" in n) else "dispatch")
        else:
            out.append("act+requant" if i < gemms[1] else "finalize")
    return out


def timeline(kernels: list[tuple[str, float, float]], split_us: float = 100.0) -> dict:
    """Per-replay kernel timeline from ``(name, start_us, end_us)`` records of replays separated by idle time:
    the kernels sorted by start, cut into replays where no kernel runs for more than ``split_us``; the replays
    with the most common number of kernels are kept (``dropped``: the others; ``consistent``: all kept replays
    ran the same kernels). Per kernel (its name and occurrence in the replay, so a branch that starts in
    another order from replay to replay is still one row), in the order of the median start: stage
    (:func:`_labels`), median duration, start from the replay's first kernel, idle gap before it (no kernel of
    the replay running). Also the medians of the span (first start to last end), the busy time (span less the
    gaps) and the idle time, and the summed durations per stage (kernels on the a1 branch overlap the
    dispatch: stages may sum past busy)."""
    ks = sorted(kernels, key=lambda r: r[1])
    if not ks:
        return dict(error="no kernel records")
    segs, end = [[ks[0]]], ks[0][2]
    for r in ks[1:]:
        if r[1] - end > split_us:
            segs.append([])
        segs[-1].append(r)
        end = max(end, r[2])
    per = statistics.mode(len(g) for g in segs)
    groups = [g for g in segs if len(g) == per]
    names0 = sorted(n for n, _, _ in groups[0])
    consistent = all(sorted(n for n, _, _ in g) == names0 for g in groups)
    spans, idles = [], []
    by_key: dict = {}
    for g in groups:
        t0, busy_end, idle, seen = g[0][1], g[0][1], 0.0, {}
        for (n, s, e), lab in zip(g, _labels([r[0] for r in g])):
            gap = max(0.0, s - busy_end)
            idle += gap
            busy_end = max(busy_end, e)
            seen[n] = seen.get(n, -1) + 1
            by_key.setdefault((n, seen[n]), []).append((lab, e - s, s - t0, gap))
        spans.append(busy_end - t0)
        idles.append(idle)
    rows = sorted((dict(kernel=n[:80], stage=recs[0][0], dur_us=statistics.median(r[1] for r in recs),
                        start_us=statistics.median(r[2] for r in recs),
                        gap_before_us=statistics.median(r[3] for r in recs)) for (n, _), recs in by_key.items()),
                  key=lambda r: r["start_us"])
    stage_us: dict = {}
    for r in rows:
        stage_us[r["stage"]] = stage_us.get(r["stage"], 0.0) + r["dur_us"]
    return dict(kernels_per_replay=per, replays=len(groups), dropped=len(segs) - len(groups), consistent=consistent,
                span_us=statistics.median(spans),
                idle_us=statistics.median(idles), busy_us=statistics.median(s - i for s, i in zip(spans, idles)),
                stage_us=stage_us, kernels=rows)


def breakdown(run: Run, fn, replays: int) -> dict:
    """One-call graph of ``fn``: replay time (events) and the profiler's kernel timeline."""
    replay, _ = run.capture(fn, 1)
    out = dict(replay=stats(run.time({"replay": replay}, {}, run.reps(20))["replay"]))
    if run.smoke:
        return out
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):  # replays apart (the timeline cuts them at the idle time)
            replay()
            torch.cuda.synchronize()
            time.sleep(0.001)
    ks = [(ev.name, float(ev.time_range.start), float(ev.time_range.end)) for ev in prof.events()
          if ev.device_type == torch.autograd.DeviceType.CUDA]
    out["timeline"] = timeline(ks)
    return out


def gemm_sweep(run: Run, fw, case, tiles: list, gemm_calls: int, reps: int) -> dict:
    calls = record_gemms(fw, case)
    wb = weight_bytes(fw, case[2])
    out = {}
    for gi, gname in enumerate(("gemm1", "gemm2")):
        call = calls[gi]
        rows = routed_rows(call)
        cases, meta, ref = {}, {}, None
        default_t = run.default
        order = [default_t] + [t for t in tiles if t != default_t]
        for t in order:
            if run.left() < 40:
                meta[str(t)] = dict(tiles=str(t), short=short(t), skipped="time budget")
                continue
            try:
                replay, res = run.capture(gemm_fn(call, t), gemm_calls)
                got = res[rows]
                if ref is None:
                    ref = got.clone()
                cases[str(t)] = replay
                meta[str(t)] = dict(tiles=str(t), short=short(t), bits_equal_default=bool(torch.equal(got, ref)),
                                    default=t == default_t)
            except Exception as e:  # noqa: BLE001 - recorded, the others run
                meta[str(t)] = dict(tiles=str(t), short=short(t), error=err(e))
        try:
            timed = time_with_roofline(run, cases, wb[gname], gemm_calls, reps)
            meta["copy"] = timed.pop("copy")
            for n, st in timed.items():
                meta[n].update(st)
        except Exception as e:  # noqa: BLE001
            meta["timing_error"] = err(e)
        out[gname] = dict(tokens=int(case[0].shape[0]), touched=wb["touched"], bytes=wb[gname],
                          rows=[v for k, v in meta.items() if k not in ("copy", "timing_error")],
                          copy=meta.get("copy"), timing_error=meta.get("timing_error"))
    return out


def ablation(run: Run, fw, case, tiles: tuple, calls: int, reps: int) -> dict:
    """The layer and the same launches with stages left out, each a graph of ``calls`` repetitions, in the same
    interleaved rounds (with the copy of the touched experts' bytes): ``layer`` (a1 quant + dispatch + the four
    below), ``post-dispatch`` (GEMM1, act+requant, GEMM2, reduce on the recorded operands), ``gemm1+act+gemm2``,
    ``gemm1+gemm2``, ``gemm1``, ``gemm2``. Differences of medians (``derived``): what the a1 quant and the
    dispatch cost the graph (layer - post-dispatch), the reduce (post-dispatch - gemm1+act+gemm2), the
    act+requant (gemm1+act+gemm2 - gemm1+gemm2), and the GEMMs' sum against their pair."""
    st = record_stages(fw, case)
    t1, t2 = tiles
    f = dict(gemm1=stage_fn("gemm1", st["gemm1"], t1), gemm2=stage_fn("gemm2", st["gemm2"], t2),
             act=stage_fn("act", st["act"]), reduce=stage_fn("reduce", st["reduce"]))

    def seq(*names):
        fs = [f[n] for n in names]
        return lambda: [g() for g in fs][-1]

    variants = {"layer": layer_fn(fw, case, tiles), "post-dispatch": seq("gemm1", "act", "gemm2", "reduce"),
                "gemm1+act+gemm2": seq("gemm1", "act", "gemm2"), "gemm1+gemm2": seq("gemm1", "gemm2"),
                "gemm1": f["gemm1"], "gemm2": f["gemm2"]}
    wb = weight_bytes(fw, case[2])
    cases, out = {}, {}
    for name, fn in variants.items():
        try:
            cases[name], _ = run.capture(fn, calls)
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=err(e))
    out.update(time_with_roofline(run, cases, wb["layer"], calls, reps))
    med = {n: out[n]["median_us"] for n in variants if "median_us" in out.get(n, {})}
    pairs = {"a1 quant + dispatch": ("layer", "post-dispatch"), "reduce": ("post-dispatch", "gemm1+act+gemm2"),
             "act+requant": ("gemm1+act+gemm2", "gemm1+gemm2")}
    derived = {k: med[a] - med[b] for k, (a, b) in pairs.items() if a in med and b in med}
    if all(n in med for n in ("gemm1", "gemm2", "gemm1+gemm2")):
        derived["gemm1+gemm2 - (gemm1 + gemm2)"] = med["gemm1+gemm2"] - med["gemm1"] - med["gemm2"]
    return dict(tokens=int(case[0].shape[0]), gemm1=str(t1), gemm2=str(t2), calls_per_graph=calls, cases=out,
                derived_us=derived)


@contextlib.contextmanager
def one_program_dispatch(on: bool):
    """``fastpath._dispatch_sort.SMALL_CAPACITY_FUSED`` set to ``on`` inside (the masked layout's sort, rank and
    fill as one launch)."""
    import fastpath._dispatch_sort as ds

    old = ds.SMALL_CAPACITY_FUSED
    ds.SMALL_CAPACITY_FUSED = on
    try:
        yield
    finally:
        ds.SMALL_CAPACITY_FUSED = old


def dispatch_ab(run: Run, fw, case, tiles: tuple, calls: int, reps: int, profile_replays: int) -> dict:
    """The layer with the masked layout's dispatch as three launches and as one (``SMALL_CAPACITY_FUSED``), each
    a graph of ``calls`` calls, interleaved with the copy of the touched experts' bytes; the outputs compared
    bit for bit; the one-launch layer's kernel timeline."""
    from fastpath import dispatch

    x, tw, ids = case
    e = int(fw.w13.shape[0])
    cap = -(-int(x.shape[0]) // 16) * 16  # the layer's masked capacity (Triton: the tokens rounded to 16)
    lays = []
    for on in (False, True):
        with one_program_dispatch(on):
            lay, dst = dispatch.to_masked(None, ids, e, cap, expected_m=1, validate=False, slot_rows=True)
        lays.append((lay.masked_m.clone(), lay.src.clone(), dst.clone()))
    same = all(torch.equal(a, b) for a, b in zip(*lays))
    if not same:
        return dict(layout_equal=False, error="the one-launch masked layout differs from the three launches': not run")
    cases, outs, out = {}, {}, dict(layout_equal=True)
    for on in (False, True):
        name = "one-launch dispatch" if on else "three-launch dispatch"
        try:
            with one_program_dispatch(on):
                cases[name], res = run.capture(layer_fn(fw, case, tiles), calls)
            outs[name] = res.clone()
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=err(e))
    wb = weight_bytes(fw, case[2])
    timed = time_with_roofline(run, cases, wb["layer"], calls, reps)
    del timed["copy"]
    out.update(timed)
    if len(outs) == 2:
        a, b = outs.values()
        out["bits_equal"] = bool(torch.equal(a, b))
    if "one-launch dispatch" in outs and run.left() > 30:
        try:
            with one_program_dispatch(True):
                out["breakdown"] = breakdown(run, layer_fn(fw, case, tiles), profile_replays)
        except Exception as e:  # noqa: BLE001
            out["breakdown"] = dict(error=err(e))
    return out


@contextlib.contextmanager
def act_routed_rows(on: bool, tile=None):
    """``fastpath._moe_layer.ACT_ROUTED_ROWS_AT_DECODE`` set to ``on`` and ``ACT_ROUTED_ROWS_TILE`` to ``tile``
    inside."""
    import fastpath._moe_layer as ml

    old = ml.ACT_ROUTED_ROWS_AT_DECODE, ml.ACT_ROUTED_ROWS_TILE
    ml.ACT_ROUTED_ROWS_AT_DECODE, ml.ACT_ROUTED_ROWS_TILE = on, tile
    try:
        yield
    finally:
        ml.ACT_ROUTED_ROWS_AT_DECODE, ml.ACT_ROUTED_ROWS_TILE = old


ACT_ROWS_AB = {"act over layout tiles": (False, None), "act over routed rows": (True, None),
               "act over routed rows, 2-group tiles": (True, dict(block_m=1, groups_per_program=2, num_warps=1))}
"""The act-rows A/B's cases: name -> (``ACT_ROUTED_ROWS_AT_DECODE``, ``ACT_ROUTED_ROWS_TILE``): the last one
splits each row's 16 groups over 8 programs of one warp (64 programs at 1 token instead of 16 with the H200's
fused tile of 8 groups)."""


def act_rows_ab(run: Run, fw, cases: dict, tiles: tuple, calls: int, reps: int, profile_replays: int) -> dict:
    """At each token count of ``cases``: the layer with the fused act+quant launch over the layout's row tiles
    and over the routed rows only (:data:`ACT_ROWS_AB`), each a graph of ``calls`` calls and a one-call graph,
    interleaved with the copy of the touched experts' bytes; the outputs compared bit for bit (``bits_equal``: all
    equal), ``saved_us`` the tiles' median less the routed rows'; at 1 token the routed-rows layer's kernel
    timeline (``breakdown``)."""
    out: dict = {}
    for m, case in sorted(cases.items()):
        if run.left() < 15:
            out[m] = dict(skipped="time budget")
            continue
        row, outs, graphs, ones = {}, {}, {}, {}
        for name, (on, tile) in ACT_ROWS_AB.items():
            try:  # captured with the case's setting (a graph keeps it)
                with act_routed_rows(on, tile):
                    graphs[name], res = run.capture(layer_fn(fw, case, tiles), calls)
                    outs[name] = res.clone()
                    ones[name], _ = run.capture(layer_fn(fw, case, tiles), 1)
            except Exception as e:  # noqa: BLE001
                row[name] = dict(error=err(e))
        wb = weight_bytes(fw, case[2])
        try:
            timed = time_with_roofline(run, graphs, wb["layer"], calls, reps)
            del timed["copy"]
            row.update(timed)
            one = time_with_roofline(run, ones, wb["layer"], 1, run.reps(20))
            del one["copy"]
            for n, st in one.items():
                row[n]["one_call_graph"] = st
        except Exception as e:  # noqa: BLE001
            row["timing_error"] = err(e)
        base = outs.get("act over layout tiles")
        if base is not None and len(outs) > 1:
            row["bits_equal"] = all(bool(torch.equal(base, o)) for o in outs.values())
        med = {n: row[n]["median_us"] for n in ACT_ROWS_AB if "median_us" in row.get(n, {})}
        if "act over layout tiles" in med and "act over routed rows" in med:
            row["saved_us"] = med["act over layout tiles"] - med["act over routed rows"]
        out[m] = dict(row, tokens=m, bytes=wb, calls_per_graph=calls)
    if 1 in cases and run.left() > 30:
        try:
            with act_routed_rows(True):
                out["breakdown"] = breakdown(run, layer_fn(fw, cases[1], tiles), profile_replays)
        except Exception as e:  # noqa: BLE001
            out["breakdown"] = dict(error=err(e))
    return out


def ranked(rows: list, top: int) -> list:
    ok = [r for r in rows if "median_us" in r and r.get("bits_equal_default")]
    return sorted(ok, key=lambda r: r["median_us"])[:top]


def layer_sweep(run: Run, fw, case, combos: dict, calls: int, reps: int, ref_out=None) -> dict:
    """``combos``: name -> (gemm1 tiles, gemm2 tiles); a graph of ``calls`` layer calls each, interleaved with
    the copy of the touched experts' bytes."""
    wb = weight_bytes(fw, case[2])
    cases, meta, ref = {}, {}, ref_out
    for name, (t1, t2) in combos.items():
        if run.left() < 15:
            meta[name] = dict(skipped="time budget")
            continue
        try:
            replay, res = run.capture(layer_fn(fw, case, (t1, t2)), calls)
            if ref is None:
                ref = res.clone()
            cases[name] = replay
            meta[name] = dict(gemm1=str(t1), gemm2=str(t2), bits_equal_default=bool(torch.equal(res, ref)))
        except Exception as e:  # noqa: BLE001
            meta[name] = dict(gemm1=str(t1), gemm2=str(t2), error=err(e))
    try:
        timed = time_with_roofline(run, cases, wb["layer"], calls, reps)
        meta["copy"] = timed.pop("copy")
        for n, st in timed.items():
            meta[n].update(st)
    except Exception as e:  # noqa: BLE001
        meta["timing_error"] = err(e)
    return dict(tokens=int(case[0].shape[0]), bytes=wb, calls_per_graph=calls, cases=meta), ref


# ------------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=4, help="layer calls per graph in the layer sweep")
    ap.add_argument("--gemm-calls", type=int, default=8, help="GEMM calls per graph in the GEMM sweep")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per case and round")
    ap.add_argument("--profile-replays", type=int, default=20)
    ap.add_argument("--top", type=int, default=3, help="fastest bit-equal tiles per GEMM combined in the layer")
    ap.add_argument("--budget-s", type=float, default=170.0, help="no new case starts past this (s from start)")
    ap.add_argument("--serial-compile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny layer, no graphs")
    ap.add_argument("--out", default="bench_out/decode_graph_sweep.json")
    ap.add_argument("--only", choices=["act_rows_ab"], default=None, help="run this phase alone")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.reps, args.gemm_calls, args.calls, args.tokens = 7, 1, 1, 1, [1, 2]
        args.profile_replays, args.budget_s = 1, 3600.0
    run = Run(args)
    res: dict = dict(meta={}, args=vars(args))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save():
        res["meta"]["wall_s"] = time.perf_counter() - run.t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    if not args.smoke:
        from bench.interleaved import machine_meta

        res["meta"].update(machine_meta())
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    res["meta"]["shape"] = shape
    tiles = sweep_tiles(args.smoke)
    default = run.default
    fw, cases = build(run, shape, sorted(set(args.tokens) | {1}))
    one = cases[1]
    res["meta"]["touched_experts"] = {m: weight_bytes(fw, c[2])["touched"] for m, c in cases.items()}
    if args.only == "act_rows_ab":
        res["act_rows_ab"] = act_rows_ab(run, fw, {m: cases[m] for m in sorted(set(args.tokens))},
                                         (default, default), args.calls, args.reps, args.profile_replays)
        save()
        report(res)
        return 0

    # compile every GEMM tile in parallel (the layer's other kernels compile on its first call)
    t = time.perf_counter()
    try:
        calls = record_gemms(fw, one)
        with compile_in_parallel(run):
            for call, tl_ in itertools.product(calls, tiles):
                try:
                    gemm_fn(call, tl_)()
                except Exception:  # noqa: BLE001 - a tile that cannot compile fails again, recorded, in the sweep
                    pass
        del calls
        res["meta"]["compile_s"] = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001
        res["meta"]["compile_error"] = err(e)
    run.sync()

    try:
        res["node_floor"] = node_floor(run)
    except Exception as e:  # noqa: BLE001
        res["node_floor"] = dict(error=err(e))
    try:
        res["breakdown"] = {"default": breakdown(run, layer_fn(fw, one), args.profile_replays)}
    except Exception as e:  # noqa: BLE001
        res["breakdown"] = {"default": dict(error=err(e))}
    save()

    try:
        res["ablation"] = {"default": ablation(run, fw, one, (default, default), args.calls, args.reps)}
    except Exception as e:  # noqa: BLE001
        res["ablation"] = {"default": dict(error=err(e))}
    save()

    try:
        res["gemm_sweep"] = gemm_sweep(run, fw, one, tiles, args.gemm_calls, args.reps)
    except Exception as e:  # noqa: BLE001
        res["gemm_sweep"] = {g: dict(error=err(e), rows=[], tokens=1, touched=0, bytes=0) for g in ("gemm1", "gemm2")}
    save()

    best = {g: ranked(res["gemm_sweep"][g]["rows"], args.top) for g in ("gemm1", "gemm2")}
    by_str = {str(t_): t_ for t_ in tiles}
    b1 = [by_str.get(r["tiles"]) for r in best["gemm1"] if r["tiles"] in by_str]
    b2 = [by_str.get(r["tiles"]) for r in best["gemm2"] if r["tiles"] in by_str]
    combos = {"default": (default, default)}
    for x, y in itertools.product(b1 or [default], b2 or [default]):
        if (x, y) != (default, default):
            combos.setdefault(f"{short(x)} | {short(y)}", (x, y))
    if b1 and b1[0] != default:
        combos.setdefault(f"{short(b1[0])} | {short(default)}", (b1[0], default))
    if b2 and b2[0] != default:
        combos.setdefault(f"{short(default)} | {short(b2[0])}", (default, b2[0]))
    res["layer"], ref1 = layer_sweep(run, fw, one, combos, args.calls, args.reps)
    save()

    lay = res["layer"]["cases"]
    ok = [(n, c) for n, c in lay.items() if n != "copy" and "median_us" in c and c.get("bits_equal_default")]
    best_name = min(ok, key=lambda nc: nc[1]["median_us"])[0] if ok else "default"
    best_pair = combos.get(best_name, (default, default))
    res["best"] = dict(name=best_name, gemm1=str(best_pair[0]), gemm2=str(best_pair[1]))
    g1 = next((r for r in res["gemm_sweep"]["gemm1"]["rows"] if r.get("default") and "median_us" in r), None)
    g2 = next((r for r in res["gemm_sweep"]["gemm2"]["rows"] if r.get("default") and "median_us" in r), None)
    if g1 and g2 and "median_us" in lay.get("default", {}):
        res["summary"] = dict(layer_us=lay["default"]["median_us"], gemm1_alone_us=g1["median_us"],
                              gemm2_alone_us=g2["median_us"],
                              outside_gemms_us=lay["default"]["median_us"] - g1["median_us"] - g2["median_us"],
                              layer_roofline_us=lay["default"].get("roofline_us"),
                              gemm1_roofline_us=g1.get("roofline_us"), gemm2_roofline_us=g2.get("roofline_us"))
    if best_name != "default" and run.left() > 20:
        try:
            res["breakdown"]["best"] = breakdown(run, layer_fn(fw, one, best_pair), args.profile_replays)
        except Exception as e:  # noqa: BLE001
            res["breakdown"]["best"] = dict(error=err(e))
        try:
            res["ablation"]["best"] = ablation(run, fw, one, best_pair, args.calls, args.reps)
        except Exception as e:  # noqa: BLE001
            res["ablation"]["best"] = dict(error=err(e))
    save()

    res["tokens"] = []
    for m in sorted(args.tokens):
        if run.left() < 10:
            res["tokens"].append(dict(tokens=m, skipped="time budget"))
            continue
        pairs = {"default": (default, default)}
        if best_name != "default":
            pairs["best"] = best_pair
        row, _ = layer_sweep(run, fw, cases[m], pairs, args.calls, args.reps)
        one_call = {}
        for n, p in pairs.items():
            try:
                replay, _ = run.capture(layer_fn(fw, cases[m], p), 1)
                one_call[n] = replay
            except Exception as e:  # noqa: BLE001
                row["cases"].setdefault(n, {})["one_call_error"] = err(e)
        if one_call:
            timed = time_with_roofline(run, one_call, row["bytes"]["layer"], 1, run.reps(20))
            del timed["copy"]
            for n, st in timed.items():
                row["cases"][n]["one_call_graph"] = st
        res["tokens"].append(row)
        save()
    # last: a wrong one-launch layout could fault the GEMMs (the layouts are compared before any layer runs)
    if run.left() > 15:
        try:
            res["dispatch_ab"] = dispatch_ab(run, fw, one, (default, default), args.calls, args.reps,
                                             args.profile_replays)
        except Exception as e:  # noqa: BLE001
            res["dispatch_ab"] = dict(error=err(e))
        save()
    if run.left() > 15:
        try:
            res["act_rows_ab"] = act_rows_ab(run, fw, {m: cases[m] for m in sorted(set(args.tokens))},
                                             (default, default), args.calls, args.reps, args.profile_replays)
        except Exception as e:  # noqa: BLE001
            res["act_rows_ab"] = dict(error=err(e))
        save()
    m = max(args.tokens)
    if m != 1 and run.left() > 45:  # the GEMM tiles at the largest token count (compiled already)
        try:
            res["gemm_sweep_tokens"] = gemm_sweep(run, fw, cases[m], tiles, args.gemm_calls, args.reps)
        except Exception as e:  # noqa: BLE001
            res["gemm_sweep_tokens"] = dict(error=err(e))
    save()
    report(res)
    return 0


def report(res: dict) -> None:
    m = res["meta"]
    print(f"{m.get('gpu', 'CPU smoke')} {m.get('date', '')} compile {m.get('compile_s', 0):.0f} s, "
          f"wall {m.get('wall_s', 0):.0f} s; graph node floor "
          f"{res.get('node_floor', {}).get('node_floor_us') or 0:.2f} us")
    sweeps = [(g, sw) for g, sw in res.get("gemm_sweep", {}).items()]
    sweeps += [(g, sw) for g, sw in res.get("gemm_sweep_tokens", {}).items() if isinstance(sw, dict)]
    for g, sw in sweeps:
        rows = [r for r in sw["rows"] if "median_us" in r]
        dflt = next((r for r in rows if r.get("default")), None)
        head = f"{g} at {sw['tokens']} token(s), {sw['touched']} experts, {sw['bytes'] / 1e6:.0f} MB"
        print(f"{head}: default {dflt['median_us']:.1f} us ({dflt.get('of_roofline', 0):.0%} of "
              f"{dflt.get('roofline_us', 0):.1f} us)" if dflt else f"{head}: no default timing")
        for r in ranked(sw["rows"], 3):
            print(f"    {r['median_us']:7.1f} us ({r['min_us']:.1f}-{r['max_us']:.1f}) "
                  f"{r.get('of_roofline', 0):4.0%}  {r['short']}")
        bad = [r["short"] for r in sw["rows"] if r.get("bits_equal_default") is False]
        errs = [r["short"] for r in sw["rows"] if "error" in r]
        if bad or errs:
            print(f"    other bits: {bad}  errors: {errs}")
    lay = res.get("layer", {}).get("cases", {})
    if lay:
        print(f"layer, 1 token, graph of {res.get('layer', {}).get('calls_per_graph')} calls (us per call):")
    timed = [(n, c) for n, c in lay.items() if n != "copy" and "median_us" in c]
    for n, c in sorted(timed, key=lambda nc: nc[1]["median_us"]):
        print(f"    {c['median_us']:7.1f} us ({c['min_us']:.1f}-{c['max_us']:.1f}) {c.get('of_roofline', 0):4.0%} "
              f"eq={c.get('bits_equal_default')}  {n}")
    for name, c in res.get("node_floor", {}).items():
        if isinstance(c, dict) and name != "error":
            print(f"    graph chain, {name}: {c.get('us_per_kernel', 0):.2f} us a kernel {c.get('error', '')}"
                  f"{'' if c.get('count_ok', True) else ' COUNT WRONG'}")
    for name, b in res.get("breakdown", {}).items():
        tl_ = b.get("timeline", {})
        rep = b.get("replay", {})
        print(f"breakdown {name}: replay {rep.get('median_us', 0):.1f} us; span {tl_.get('span_us', 0):.1f} us, busy "
              f"{tl_.get('busy_us', 0):.1f}, idle {tl_.get('idle_us', 0):.1f}; {tl_.get('error', b.get('error', ''))}")
        if tl_.get("stage_us"):
            print("    by stage: " + ", ".join(f"{k} {v:.1f}" for k, v in tl_["stage_us"].items()))
        for k in tl_.get("kernels", []):
            print(f"    {k['start_us']:7.1f} +{k['dur_us']:6.1f} us (gap {k['gap_before_us']:4.1f})  "
                  f"{k['stage']:12s} {k['kernel'][:50]}")
    for name, ab in res.get("ablation", {}).items():
        cs = ab.get("cases", {})
        print(f"ablation {name} (graph of {ab.get('calls_per_graph')}, us a call): " + ", ".join(
            f"{n} {c['median_us']:.1f}" for n, c in cs.items() if "median_us" in c) + f" {ab.get('error', '')}")
        if ab.get("derived_us"):
            print("    derived: " + ", ".join(f"{k} {v:.1f}" for k, v in ab["derived_us"].items()))
    ab = res.get("dispatch_ab", {})
    if ab:
        print("dispatch A/B (us a call): " + ", ".join(f"{n} {c['median_us']:.1f} ({c['min_us']:.1f}-{c['max_us']:.1f})"
                                                     for n, c in ab.items() if isinstance(c, dict) and "median_us" in c)
              + f"; bits equal {ab.get('bits_equal')} {ab.get('error', '')}")
        tl_ = ab.get("breakdown", {}).get("timeline", {})
        if tl_.get("kernels"):
            print(f"    one-launch dispatch: span {tl_['span_us']:.1f} us, idle {tl_['idle_us']:.1f}; " + ", ".join(
                f"{k['stage']} {k['dur_us']:.1f}" for k in tl_["kernels"]))
    for m_, row in res.get("act_rows_ab", {}).items():
        if not isinstance(row, dict) or m_ == "breakdown":
            continue
        if "tokens" not in row:
            print(f"act rows A/B: {row}")
            continue
        print(f"act rows A/B, {row['tokens']} token(s) (us a call, graph of {row['calls_per_graph']} | one-call graph): "
              + ", ".join(f"{n} {c['median_us']:.1f} ({c['min_us']:.1f}-{c['max_us']:.1f}, "
                          f"{c.get('of_roofline', 0):.0%}) | {c.get('one_call_graph', {}).get('median_us', 0):.1f} "
                          f"({c.get('one_call_graph', {}).get('of_roofline', 0):.0%})"
                          for n, c in row.items() if isinstance(c, dict) and "median_us" in c)
              + f"; saved {row.get('saved_us', float('nan')):.1f} us; bits equal {row.get('bits_equal')} "
              + " ".join(f"{n}: {c['error']}" for n, c in row.items() if isinstance(c, dict) and "error" in c))
    tl_ = res.get("act_rows_ab", {}).get("breakdown", {}).get("timeline", {})
    if tl_.get("kernels"):
        print(f"    act over routed rows, 1 token: span {tl_['span_us']:.1f} us, idle {tl_['idle_us']:.1f}; "
              + ", ".join(f"{k['stage']} {k['dur_us']:.1f}" for k in tl_["kernels"]))
    if res.get("summary"):
        print("summary (us): " + ", ".join(f"{k} {v:.1f}" for k, v in res["summary"].items() if v is not None))
    for row in res.get("tokens", []):
        for n, c in row.get("cases", {}).items():
            if n == "copy" or "median_us" not in c:
                continue
            oc = c.get("one_call_graph", {})
            print(f"tokens {row['tokens']} {n:8s}: {c['median_us']:7.1f} us/call ({c.get('of_roofline', 0):.0%}), "
                  f"one-call graph {oc.get('median_us', 0):.1f} us ({oc.get('of_roofline', 0):.0%}) "
                  f"eq={c.get('bits_equal_default')}")


if __name__ == "__main__":
    raise SystemExit(main())
