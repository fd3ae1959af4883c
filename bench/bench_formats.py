"""Encode throughput of moeref.formats.encode next to ml_dtypes ``astype`` on the same data.

16M float32 and 16M bfloat16 values (normal, scaled so that a few percent overflow E2M1 and none
overflow E4M3FN) are encoded to E4M3FN and E2M1 on ONE core (the process is pinned to one CPU),
best of ``--repeat`` runs. Both sides produce the same bytes (checked): moeref with
``overflow="inf_nan"`` for E4M3FN and ``"saturate"`` for E2M1 is ml_dtypes' cast.

Usage: ``python bench/bench_formats.py [--n 16777216] [--repeat 3]``. Prints a plain table and then
the same table as markdown.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import ml_dtypes
import numpy as np

from moeref.formats import encode

CASES = [("e4m3fn", "inf_nan", ml_dtypes.float8_e4m3fn), ("e2m1", "saturate", ml_dtypes.float4_e2m1fn)]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_time(fn, repeat: int) -> float:
    fn()  # warm-up: builds moeref's cached code table once
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 24)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    rng = np.random.default_rng(0)
    x32 = (rng.standard_normal(args.n, dtype=np.float32) * np.float32(2.0))
    inputs = {"float32": x32, "bfloat16": x32.astype(ml_dtypes.bfloat16)}
    rows = []
    for in_name, x in inputs.items():
        for fmt, overflow, ml_t in CASES:
            ours = encode(x, fmt, overflow=overflow)
            ref = x.astype(ml_t).view(np.uint8)
            if not np.array_equal(ours, ref & np.uint8(0xFF if fmt == "e4m3fn" else 0xF)):
                raise AssertionError(f"moeref and ml_dtypes disagree on {in_name} -> {fmt}")
            t_ours = best_time(lambda: encode(x, fmt, overflow=overflow), args.repeat)
            t_ml = best_time(lambda: x.astype(ml_t), args.repeat)
            rows.append(dict(input=in_name, format=fmt, overflow=overflow, n=args.n,
                             moeref=args.n / t_ours, ml_dtypes=args.n / t_ml, ratio=t_ml / t_ours))
    header = ["input", "format", "overflow", "moeref Melem/s", "ml_dtypes Melem/s", "moeref / ml_dtypes"]
    cells = [[r["input"], r["format"], r["overflow"], f"{r['moeref'] / 1e6:.1f}",
              f"{r['ml_dtypes'] / 1e6:.1f}", f"{r['ratio']:.2f}x"] for r in rows]
    stamp = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{cpu_name()} ({os.cpu_count()} CPUs), pinned to 1 core, n={args.n}, best of {args.repeat}, "
             f"numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}")
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print(stamp)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))
    print()
    print(f"<!-- {stamp} -->")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for c in cells:
        print("| " + " | ".join(c) + " |")
    return rows


if __name__ == "__main__":
    main()
