"""Benchmark: GEMM2's error bound alone on a DeepSeek-V3 layer (the aligned-adder bound in the scaled form, with
the operand radius, and the radius term from the same kernel: ``device_rows_error_bound(..., radius_term=True)``
under ``HOPPER_FP8_DEEPGEMM_DATA``), this tree against an older tree's ``moeref/compare`` (``--old``).

GEMM2 of the layer: 256 experts of w2 ``[7168, 2048]`` (random E4M3 codes, 128x128 FP32 scales:
``bench_moe_device.random_fp8_experts``), rows = tokens x 8 slots of a random top-8 routing; the operand is FP8
1x128 with FP32 scales (``N(0, 1) * 0.05`` quantized on the GPU) and its radius ``2^-9 |value|`` (the size of a
re-quantization's uncertainty). Times both trees' bound as interleaved rounds (>= 7, CUDA events), reports the
median and min-max, the peak GPU memory of one call of each, the ratio of the two bounds (the new definition
of 2026-11-25 is looser: per-step summaries) and a spot check: the new bound of two experts' rows on 256
output columns equals the NumPy bound (:func:`moeref.compare.gemm_intervals._rows_error_bound`) bit for bit.

    python bench/studies/bench_adder_radius.py --old ../moeref/compare --out $OUT/adder_radius.json

``--old DIR``: a ``moeref/compare`` directory whose ``device_bounds.py``, ``_bound_kernels.py`` and
``_adder_kernels.py`` are loaded as a separate package (its other imports resolved against this tree).
``--variant U,W,T`` (repeatable): also time the new kernel with ``ADDER_UNROLL=U``, ``ADDER_WARPS=W``,
``ADDER_TILE=T``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.bench_moe_device import random_fp8_experts, routing  # noqa: E402
from bench.interleaved import CudaEventClock, machine_meta, time_interleaved  # noqa: E402
from moeref.compare import PROFILES  # noqa: E402
from moeref.compare.device import _bound_kernels as BK  # noqa: E402
from moeref.compare.device.bounds import device_rows_error_bound  # noqa: E402
from moeref.gemm.device import DeviceOperand  # noqa: E402

DEVICE = "cuda"
SHAPE = (256, 7168, 2048)
"""Experts, N (hidden) and K (intermediate) of GEMM2."""
_OLD_FILES = ("device_bounds.py", "_bound_kernels.py", "_adder_kernels.py")


def load_old(directory: str):
    """``device_rows_error_bound`` of the ``moeref/compare`` modules in ``directory``, as package ``_old_compare``
    in a temporary directory: relative imports of the three files stay inside it, the others go to this tree's
    ``moeref``."""
    root = tempfile.mkdtemp(prefix="old_compare_")
    pkg = os.path.join(root, "_old_compare")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    local = {f[:-3] for f in _OLD_FILES}
    for f in _OLD_FILES:
        src = open(os.path.join(directory, f)).read()
        src = re.sub(r"from \.\.(\w)", r"from moeref.\1", src)
        src = re.sub(r"from \.(\w+) import", lambda m: m.group(0) if m.group(1) in local
                     else f"from moeref.compare.{m.group(1)} import", src)
        with open(os.path.join(pkg, f), "w") as out:
            out.write(src)
    sys.path.insert(0, root)
    return importlib.import_module("_old_compare.device_bounds").device_rows_error_bound


def gemm2_operand(rows: int, gen: torch.Generator):
    """FP8 1x128 operand ``[rows, K]`` (FP32 scales, amax / 448) of ``N(0, 1) * 0.05`` and its radius
    ``2^-9 |value|``."""
    k = SHAPE[2]
    x = torch.randn((rows, k), device=DEVICE, generator=gen) * 0.05
    amax = x.abs().view(rows, k // 128, 128).amax(dim=2).clamp_min(1e-12)
    scale = (amax / 448.0).to(torch.float32)
    codes = (x.view(rows, k // 128, 128) / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(rows, k)
    op = DeviceOperand(None, codes, "e4m3fn", scale.to(torch.float64), (1, 128), True)
    value = codes.view(torch.float8_e4m3fn).to(torch.float64) * op.scales.repeat_interleave(128, dim=1)
    return op, value.abs() * 2.0**-9


def spot_check(op, rad, row_expert, w2, prof, got, cols: int = 256) -> dict:
    """The new bound of the rows of two experts on the first ``cols`` output columns against the NumPy bound."""
    from moeref.compare.bounds import _rows_error_bound
    from moeref.formats import decode_table
    from moeref.gemm import StackedExperts
    from moeref.gemm.exact import BlockOperand

    experts = [int(e) for e in np.unique(row_expert[row_expert >= 0])[:2]]
    idx = np.flatnonzero(np.isin(row_expert, experts))
    sub = np.searchsorted(experts, row_expert[idx])
    it = torch.as_tensor(idx, device=DEVICE)
    a = BlockOperand(None, op.scales.index_select(0, it).cpu().numpy(), (1, 128), True,
                     codes=op.codes.index_select(0, it).cpu().numpy(), table=decode_table("e4m3fn"))
    sel = torch.as_tensor(experts, device=DEVICE)
    ws = StackedExperts(w2.codes.index_select(0, sel)[:, :cols].cpu().numpy(),
                        w2.scales.index_select(0, sel)[:, : -(-cols // 128)].cpu().numpy(), "e4m3fn", (128, 128),
                        (cols, int(w2.shape[1])))
    ref = _rows_error_bound(a, rad.index_select(0, it).cpu().numpy(), sub, ws, None, prof)
    dev = got.index_select(0, it)[:, :cols].cpu().numpy()
    return {"rows": int(idx.size), "cols": cols, "equal": bool(np.array_equal(ref, dev)),
            "differing": int(np.count_nonzero(ref != dev))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--old", default=None, help="an older moeref/compare directory, timed beside this tree's")
    ap.add_argument("--variant", action="append", default=[], help="U,W,T: the new kernel with these tunables")
    ap.add_argument("--no-check", action="store_true", help="skip the NumPy spot check")
    ap.add_argument("--out", default="bench_out/adder_radius.json")
    args = ap.parse_args(argv)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w2 = random_fp8_experts(*SHAPE, gen, 1e-4)
    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    old = load_old(args.old) if args.old else None
    meta = machine_meta()
    rows_out = []
    default = (BK.ADDER_UNROLL, BK.ADDER_WARPS, BK.ADDER_TILE)

    def new_with(u, w, t):
        def call(op, rad, re_):
            BK.ADDER_UNROLL, BK.ADDER_WARPS, BK.ADDER_TILE = u, w, t
            try:
                return device_rows_error_bound(op, rad, re_, w2, None, prof, radius_term=True)
            finally:
                BK.ADDER_UNROLL, BK.ADDER_WARPS, BK.ADDER_TILE = default
        return call

    for m in args.tokens:
        _, ids = routing(m, SHAPE[0], 8, gen)
        row_expert = ids.reshape(-1).astype(np.int64)
        op, rad = gemm2_operand(row_expert.size, gen)
        fns = {"new": new_with(*default)}
        for v in args.variant:
            u, w, t = (int(x) for x in v.split(","))
            fns[f"new U{u} W{w} T{t}"] = new_with(u, w, t)
        if old is not None:
            fns["old"] = lambda op_, rad_, re_: old(op_, rad_, re_, w2, None, prof, radius_term=True)
        peak, results = {}, {}
        for name, fn in fns.items():  # one call each: compilation, peak memory, the bound itself
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            results[name] = fn(op, rad, row_expert)
            torch.cuda.synchronize()
            peak[name] = torch.cuda.max_memory_allocated() / 2**30
        rec = {"tokens": m, "rows": int(row_expert.size), "peak_gib": peak}
        rad_new, bnd_new = results["new"]
        for name, (r_, b_) in results.items():
            if name.startswith("new "):
                rec.setdefault("variants_equal", {})[name] = bool(torch.equal(r_, rad_new) and torch.equal(b_, bnd_new))
        if old is not None:
            rad_old, bnd_old = results["old"]
            rec["radius_term_equal_old"] = bool(torch.equal(rad_old, rad_new))
            ratio = (bnd_new / bnd_old).reshape(-1)
            rec["bound_new_over_old"] = {"median": float(ratio.median()), "min": float(ratio.min()),
                                         "max": float(ratio.max())}
        if not args.no_check:
            rec["spot_check"] = spot_check(op, rad, row_expert, w2, prof, bnd_new)
        del results
        res = time_interleaved({n: (lambda f=f: f(op, rad, row_expert)) for n, f in fns.items()},
                               baselines=["old"] if old is not None else [], rounds=args.rounds,
                               clock=CudaEventClock())
        rec["timing"] = res.to_json()
        rec["median_s"] = {n: res.cases[n].median_s for n in fns}
        if old is not None:
            rec["speedup_vs_old"] = {n: res.ratios[n]["old"].median for n in fns if n != "old"}
        rows_out.append(rec)
        print(f"{m} tokens ({row_expert.size} rows): " + ", ".join(f"{n} {s:.4f} s" for n, s in rec["median_s"].items())
              + f"; peak GiB {', '.join(f'{n} {p:.1f}' for n, p in peak.items())}; check {rec.get('spot_check')}; "
              f"new/old bound {rec.get('bound_new_over_old')}; variants equal {rec.get('variants_equal')}", flush=True)
        del op, rad
        torch.cuda.empty_cache()
    out = {"meta": meta, "what": "GEMM2 bound alone (device_rows_error_bound, radius_term=True), DeepSeek-V3 w2, "
           "HOPPER_FP8_DEEPGEMM_DATA", "rounds": args.rounds, "old": args.old, "rows": rows_out}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{meta['gpu']} {meta['date']}: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
