"""Throughput of the reference quantizers (NumPy, one core): quantize + dequantize of a
7168 x 2048 bfloat16 weight (a DeepSeek-V3 expert's w13 half) to FP8 128x128 (DeepGEMM preset,
FP32 and UE8M0 scales), MXFP8, MXFP4 and, when moeref.quant.nvfp4 is present, NVFP4.

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_quant_reference.py [--repeat 3]``.
Target: >= 50 M elements/s for quantize (vectorised: a handful of full-array passes).
"""
from __future__ import annotations

import argparse
import os
import time

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from moeref import quant  # noqa: E402


def _schemes():
    out = [
        ("fp8 128x128 fp32 (deepgemm)", quant.fp8_block((128, 128), "fp32", "deepgemm")),
        ("fp8 128x128 ue8m0 (deepgemm)", quant.fp8_block((128, 128), "ue8m0", "deepgemm")),
        ("fp8 1x128 fp32 (default)", quant.fp8_group(128)),
        ("mxfp8 (default)", quant.mxfp8()),
        ("mxfp4 (default)", quant.mxfp4()),
        ("mxfp4 (ocp)", quant.mxfp4(preset="ocp")),
    ]
    if "nvfp4" in quant.SCHEMES:
        out.append(("nvfp4 (te)", quant.SCHEMES["nvfp4"]()))
    return out


def _best(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        r = fn()
        best = min(best, time.perf_counter() - t)
    return best, r


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shape", type=int, nargs=2, default=(7168, 2048))
    a = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        except OSError:
            pass
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(a.shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    n = w.size
    print(f"weight {a.shape} bfloat16, {n / 1e6:.1f} M elements, one core, best of {a.repeat}")
    print(f"{'scheme':32s} {'quantize':>14s} {'dequantize':>14s}")
    for name, s in _schemes():
        tq, q = _best(lambda: quant.quantize(w, s), a.repeat)
        td, _ = _best(lambda: q.dequantize(np.float32), a.repeat)
        print(f"{name:32s} {n / tq / 1e6:9.1f} M/s {n / td / 1e6:9.1f} M/s")


if __name__ == "__main__":
    main()
