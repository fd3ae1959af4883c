"""Interleaved timing: benchmark numbers that repeat (issue 20).

Two runs of the same code a few minutes apart on a lent GPU gave 35.6% then 89.3% of copy for
one kernel: timing each row alone, once, records whatever state the machine was in at that
moment (clocks, a neighbour's traffic). Here every case of a row (the kernel and its baselines:
copy, torch eager, torch.compile, DeepGEMM) is timed in the same *round*, rounds repeat at least
7 times, and what is reported is robust to a bad moment:

* per case: the median, min and max over rounds, and the spread ``(max - min) / median``;
  ``flagged`` when the spread exceeds ``flag_spread`` (10% by default): such rows are reported,
  marked, never hidden;
* per case and baseline: the ratio ``baseline time / case time`` (a speedup: above 1 the case is
  faster) computed *per round*, from two timings taken seconds apart, and its median. A slow
  moment hits both sides of a round's ratio, so the median ratio repeats better than the ratio
  of two medians taken at different times.

The order of the cases rotates by one each round (round r starts with case ``r mod n``) so that
no case always runs first, after the host's pause, or last.

Clocks are injected (:class:`WallClock` with any ``now()``, :class:`CudaEventClock`), so the
statistics are tested on the CPU with a deterministic fake clock (``tests/test_bench_interleaved.py``).
Results are dataclasses; :meth:`InterleavedResult.to_json` gives plain dicts for ``json.dump``.

    from bench.interleaved import time_interleaved
    res = time_interleaved({"kernel": run, "copy": copy, "eager": eager}, baselines=["copy", "eager"])
    res.cases["kernel"].median_s, res.ratios["kernel"]["copy"].median, res.cases["kernel"].flagged
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

MIN_ROUNDS = 7
FLAG_SPREAD = 0.10


class Clock(Protocol):
    """Measures ``calls`` back-to-back calls of ``fn``; returns seconds per call."""

    name: str

    def measure(self, fn: Callable[[], object], calls: int) -> float: ...


class WallClock:
    """Host wall clock (``time.perf_counter`` by default; inject ``now`` to test)."""

    name = "perf_counter"

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now

    def measure(self, fn, calls):
        t0 = self.now()
        for _ in range(calls):
            fn()
        return (self.now() - t0) / calls


class CudaEventClock:
    """CUDA events recorded on the current stream around the calls, then one synchronize: the
    device time of the calls (host launch gaps included where the GPU waits for the host)."""

    name = "cuda_events"

    def __init__(self):
        import torch

        self.torch = torch

    def measure(self, fn, calls):
        torch = self.torch
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e-3 / calls


def default_clock() -> Clock:
    """CUDA events when torch sees a GPU, the host wall clock otherwise."""
    try:
        import torch

        if torch.cuda.is_available():
            return CudaEventClock()
    except ImportError:
        pass
    return WallClock()


def machine_meta() -> dict:
    """What a GPU figure is named with: the GPU, its driver (or why it could not be read), CUDA, torch, triton,
    Python and the UTC date and time of the run."""
    import datetime
    import subprocess
    import sys

    import torch
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception as e:  # reported, not hidden
        driver = f"unknown ({type(e).__name__})"
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "cuda": torch.version.cuda,
            "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


@dataclass(frozen=True)
class CaseTiming:
    """One case's seconds per call in each round (in round order) and their statistics."""

    name: str
    seconds: tuple[float, ...]
    median_s: float
    min_s: float
    max_s: float
    spread: float  # (max - min) / median
    flagged: bool  # spread > the flag threshold


@dataclass(frozen=True)
class BaselineRatio:
    """``baseline seconds / case seconds`` in each round, and their median (above 1: case faster)."""

    baseline: str
    per_round: tuple[float, ...]
    median: float


@dataclass(frozen=True)
class InterleavedResult:
    rounds: int
    clock: str
    calls_per_round: dict[str, int]
    flag_spread: float
    cases: dict[str, CaseTiming]
    ratios: dict[str, dict[str, BaselineRatio]]  # case -> baseline -> ratio (baselines excluded as cases)

    @property
    def flagged(self) -> list[str]:
        return [n for n, c in self.cases.items() if c.flagged]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _timing(name: str, seconds: Sequence[float], flag_spread: float) -> CaseTiming:
    med = statistics.median(seconds)
    lo, hi = min(seconds), max(seconds)
    spread = (hi - lo) / med if med > 0 else float("inf")
    return CaseTiming(name, tuple(seconds), med, lo, hi, spread, spread > flag_spread)


def time_interleaved(cases: Mapping[str, Callable[[], object]], *, baselines: Sequence[str] = (),
                     rounds: int = MIN_ROUNDS, calls_per_round: int | Mapping[str, int] = 1, warmup: int = 1,
                     clock: Clock | None = None, flag_spread: float = FLAG_SPREAD) -> InterleavedResult:
    """Time every case of ``cases`` (name -> zero-argument callable) in each of ``rounds`` rounds.

    ``baselines``: names among ``cases``; every other case gets a per-round ratio to each.
    ``calls_per_round``: calls timed together per case and round (one int, or per case name; a
    GPU kernel of a few microseconds needs many to rise above the event resolution), reported
    as seconds per call. ``warmup``: untimed calls of each case before the first round
    (compilation, autotuning, caches). ``clock``: :func:`default_clock` when None.
    ``rounds`` below 7 or a missing baseline is a ``ValueError``.
    """
    if not cases:
        raise ValueError("cases is empty: give name -> callable")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < MIN_ROUNDS:
        raise ValueError(f"rounds must be an int >= {MIN_ROUNDS}; got {rounds!r}")
    missing = [b for b in baselines if b not in cases]
    if missing:
        raise ValueError(f"baselines {missing} are not among the cases {list(cases)}")
    names = list(cases)
    calls = {n: calls_per_round if isinstance(calls_per_round, int) else calls_per_round.get(n, 1) for n in names}
    bad = {n: c for n, c in calls.items() if isinstance(c, bool) or not isinstance(c, int) or c < 1}
    if bad:
        raise ValueError(f"calls_per_round must be positive ints; got {bad}")
    clock = clock if clock is not None else default_clock()
    for n in names:
        for _ in range(warmup):
            cases[n]()
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            seconds[n].append(clock.measure(cases[n], calls[n]))
    timings = {n: _timing(n, seconds[n], flag_spread) for n in names}
    ratios: dict[str, dict[str, BaselineRatio]] = {}
    for n in names:
        if n in baselines:
            continue
        ratios[n] = {}
        for b in baselines:
            per = tuple(tb / tc if tc > 0 else float("inf") for tb, tc in zip(seconds[b], seconds[n]))
            ratios[n][b] = BaselineRatio(b, per, statistics.median(per))
    return InterleavedResult(rounds, clock.name, calls, flag_spread, timings, ratios)
