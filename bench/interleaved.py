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

The GPU benchmarks' rows (bench_quant_gpu, bench_dispatch_gpu) share one way of timing a row: inputs
rotated (:func:`rotating`), the same bytes copied as the ``copy`` baseline (:func:`copy_case`), calls
per round calibrated and clocks spun up (:func:`time_row`), one JSON row (:func:`row_record`).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

MIN_ROUNDS = 7
FLAG_SPREAD = 0.10
L2_BYTES = 64 << 20  # above the L2 of an H100 (50 MB) or H200 (60 MB): rotations cover 4x this


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


# ----------------------------------------------------------------------------- GPU rows (torch imported lazily)

_SPIN: dict = {}


def spin_clocks(ms: float = 300.0):
    """Keep the GPU busy for ``ms`` (a 256 MiB copy in a loop) so that its clocks are up before a
    timing: after a pause (a compilation, host work), an H100 was seen measuring 40% low for
    over a second (2026-11-21: MXFP4 1.65 TB/s right after an idle spell, 2.7 once warm)."""
    import torch

    if "buf" not in _SPIN:
        _SPIN["buf"] = (torch.empty(1 << 28, dtype=torch.uint8, device="cuda"),
                        torch.empty(1 << 28, dtype=torch.uint8, device="cuda"))
    a, b = _SPIN["buf"]
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(8):
            b.copy_(a)
        torch.cuda.synchronize()


def rotating(fn, inputs_list):
    """A zero-argument call of ``fn`` on the next input set of the rotation (L2 never holds it)."""
    state = {"i": 0}

    def call():
        args = inputs_list[state["i"] % len(inputs_list)]
        state["i"] += 1
        return fn(*args)
    return call


def copy_case(nbytes: int):
    """A device copy moving ``nbytes`` (read + write: ``nbytes / 2`` each way), rotated like the
    kernel inputs: the same traffic as the row, timed in the same rounds."""
    import torch

    half = max(1, int(nbytes) // 2)  # FP4 rows count half bytes per element: nbytes may be a float
    n_pairs = max(1, min(32, -(-4 * L2_BYTES // max(int(nbytes), 1))))
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda"), torch.empty(half, dtype=torch.uint8, device="cuda"))
             for _ in range(n_pairs)]
    return rotating(lambda src, dst: dst.copy_(src), pairs)


def _calibrated_calls(cases, clock, target_s):
    """Calls per round so that each case's round lasts about ``target_s`` (1 to 1000)."""
    out = {}
    for n, fn in cases.items():
        t = max(clock.measure(fn, 3), 1e-7)
        out[n] = int(min(1000, max(1, round(target_s / t))))
    return out


def time_row(cases: dict, baselines: list, rounds: int, target_round_s: float) -> InterleavedResult:
    """The row's cases (``fastpath`` and its baselines) timed in interleaved rounds
    (:func:`time_interleaved`, CUDA events), after one warm-up call each and the clocks spun up."""
    import torch

    clock = CudaEventClock()
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    calls = _calibrated_calls(cases, clock, target_round_s)
    spin_clocks()
    return time_interleaved(cases, baselines=baselines, rounds=rounds, calls_per_round=calls, clock=clock, warmup=0)


def row_record(res: InterleavedResult, M: int, nbytes: int) -> dict:
    """JSON row of one (kernel, M): every case's median/min/max/spread/flag in us, the median of the
    per-round ratios to each baseline (``baseline time / fastpath time``) and their per-round values;
    TB/s from the median time; % of copy from the per-round copy ratio (equal bytes)."""
    cases = {n: {"median_us": c.median_s * 1e6, "min_us": c.min_s * 1e6, "max_us": c.max_s * 1e6,
                 "spread": c.spread, "flagged": c.flagged, "calls_per_round": res.calls_per_round[n]}
             for n, c in res.cases.items()}
    ratios = res.ratios["fastpath"]
    med = res.cases["fastpath"].median_s
    return {"M": M, "bytes": nbytes, "rounds": res.rounds, "clock": res.clock, "cases": cases,
            "ratio_median": {b: r.median for b, r in ratios.items()},
            "ratio_per_round": {b: list(r.per_round) for b, r in ratios.items()},
            "TBps": nbytes / med / 1e12, "pct_copy": 100 * ratios["copy"].median,
            "flagged": sorted(n for n, c in res.cases.items() if c.flagged)}


def row_ratios_text(rec: dict) -> str:
    """The printed tail of a :func:`row_record` row: the median ratio to each baseline but the copy, and
    the flagged cases (spread over :data:`FLAG_SPREAD`)."""
    text = "".join(f"  x{r:.2f} {b}" for b, r in rec["ratio_median"].items() if b != "copy")
    if rec["flagged"]:
        text += f"  FLAGGED (spread > {FLAG_SPREAD:.0%}): {', '.join(rec['flagged'])}"
    return text
