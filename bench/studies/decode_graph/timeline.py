"""A graph's per-kernel cost: the node floor and the profiler's per-replay kernel timeline (decode sweep)."""
from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

from .timing import Run, err, stats


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
