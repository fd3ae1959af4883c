"""Interleaved timing of graph replays against a device copy's roofline (``bench/studies/decode_graph_sweep.py``)."""
from __future__ import annotations

import statistics
import time

import torch

from bench.interleaved import CudaEventClock, WallClock, spin_clocks, time_interleaved
from fastpath.grouped_gemm import default_tiles


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
