"""Compile every FP8 prefill candidate tile for Hopper (sm_90a) on a machine without a GPU: does it compile, with
what registers, spills, shared memory and warps, does its IR have Triton's warp specialization and TMA loads, and
how many FP32 multiplies and fused multiply-adds its SASS has (the promotion ``fma(part, fl(sa * sb), acc)``: one
FFMA per output and K block, and one FMUL per row with a scalar weight scale, per output with a vector of them)?
The programs per SM that fit follow from the registers and shared memory. Where the MMAs wait:
the SASS's ``WARPGROUP.DEPBAR.LE gsb0, N`` per N (``wgmma.wait_group N``: wait until at most N MMA groups are in
flight), and the most FP32 multiplies and FMAs scheduled between an MMA and the wait after it (the promotion work
done while an MMA runs; about a thread's outputs when a whole promotion overlaps an MMA, a handful when each MMA is
waited for at once). A static check before spending device time (issue 33; bench/studies/triton_fp8_prefill_sweep.py
measures); it runs nothing.

    python bench/studies/triton_fp8_prefill_compile.py [--gemms gemm1 gemm2] [--configs NAME ...] [--out FILE]

The launches are recorded on CPU tensors (bench/sass_report.py's recorder: pointers and sizes specialised as a
launch on aligned tensors specialises them) and compiled with the ptxas bundled with Triton's wheel.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.sass_report import compile_kernel, count, record  # noqa: E402  (pops TRITON_INTERPRET first)

import torch  # noqa: E402

GEMMS = {"gemm1": (4096, 7168), "gemm2": (7168, 2048)}  # DeepSeek-V3: name -> (N, K)
SM_REGISTERS, SM_SHARED = 65536, 227 * 1024  # Hopper, per SM (shared: the most one SM gives its blocks)


def mma_waits(sass: str) -> tuple[dict, int]:
    """``({N: count of "WARPGROUP.DEPBAR.LE gsb0, N"}, the most FMUL/FFMA between an MMA (QGMMA/HGMMA) and the
    next such wait)`` of a SASS listing, in listing order."""
    waits: dict = {}
    most, run = 0, None
    for line in sass.splitlines():
        if re.search(r"\b[QH]GMMA\.", line):
            run = 0
        elif "WARPGROUP.DEPBAR" in line:
            m = re.search(r"gsb0, (0x[0-9a-f]+|\d+)", line)
            n = int(m.group(1), 0) if m else -1
            waits[n] = waits.get(n, 0) + 1
            most, run = max(most, run or 0), None
        elif run is not None and re.search(r"\b(FFMA|FMUL)\b", line):
            run += 1
    return waits, most


def _setmaxnreg(sass: str) -> list:
    """The register counts a warp-specialized kernel's partitions ask for (``USETMAXREG.TRY_ALLOC`` / ``DEALLOC``
    operands), in listing order, without repeats."""
    out = []
    for m in re.finditer(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass):
        v = int(m.group(1), 16)
        if v not in out:
            out.append(v)
    return out


def compile_tile(tiles, n: int, k: int, experts: int = 16, rows: int = 4096) -> dict:
    """Compile the Triton grouped GEMM's launch for ``tiles`` at ``(N, K)`` (FP8 operands, bf16 output) and
    describe the kernel."""
    from fastpath import _host
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    a = torch.empty(rows, k, dtype=torch.float8_e4m3fn)
    b = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn)
    sa, sb = torch.empty(rows, k // 128), torch.empty(experts, n // 128, k // 128)
    m_idx = torch.zeros(rows, dtype=torch.int32)
    cache_on = _host.LAUNCH_CACHE_ON
    _host.LAUNCH_CACHE_ON = False  # kernel[grid] directly: the recorder takes it (no CUDA device to key on)
    try:
        if tiles.kernel == "gluon":  # its launcher below the host checks (which want a Hopper GPU)
            from fastpath import _grouped_gemm_gluon

            d = torch.empty(rows, n, dtype=torch.bfloat16)
            log = record(lambda: _grouped_gemm_gluon._launch(a, b, d, m_idx, sa, sb, None, tiles, rows, n, k, experts,
                                                             132))
        else:
            log = record(lambda: grouped_gemm_contiguous(a, b, m_idx, impl="triton", a_scales=sa, b_scales=sb,
                                                         tiles=tiles))
    finally:
        _host.LAUNCH_CACHE_ON = cache_on
    fn, _, args, kw = log[-1]
    ck, sass, regs, stack = compile_kernel(fn, args, kw)
    ops = count(sass)
    warps = int(ck.metadata.num_warps)
    per_warp = -(-regs * 32 // 256) * 256  # registers are given to warps in units of 256
    fit = min(SM_REGISTERS // (per_warp * warps), SM_SHARED // max(int(ck.metadata.shared), 1))
    ttgir = ck.asm["ttgir"]
    waits, overlap = mma_waits(sass)
    return {"mma_waits": waits, "fp32_ops_before_wait": overlap,
            "kernel": fn.__name__, "registers": regs, "stack_bytes": stack, "shared_bytes": int(ck.metadata.shared),
            "warps": warps, "programs_per_sm_fit": fit, "warp_specialized": "ttg.warp_specialize" in ttgir,
            "math_registers": _setmaxnreg(sass),
            "tma_loads": "async_tma_copy_global_to_local" in ttgir,
            "tma_stores": "async_tma_copy_local_to_global" in ttgir, "wgmma": ops.get("QGMMA", 0),
            "fmul": ops.get("FMUL", 0), "ffma": ops.get("FFMA", 0), "fadd": ops.get("FADD", 0)}


def main(argv=None) -> int:
    from fastpath.grouped_gemm import FP8_PREFILL_CANDIDATES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemms", nargs="+", default=list(GEMMS), choices=list(GEMMS))
    ap.add_argument("--configs", nargs="+", default=list(FP8_PREFILL_CANDIDATES))
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    unknown = [c for c in args.configs if c not in FP8_PREFILL_CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {list(FP8_PREFILL_CANDIDATES)}")
    out: dict = {}
    print(f"{'tile':34s} gemm   regs stack shared warps fit ws tma wgmma fmul ffma  waits{{N: count}} "
          "fp32_ops_before_wait")
    for name in args.configs:
        t = FP8_PREFILL_CANDIDATES[name]
        for g in args.gemms:
            try:
                r = compile_tile(t, *GEMMS[g])
            except Exception as e:  # recorded, not fatal
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{name:34s} {g}  FAILED {r['error'][:120]}", flush=True)
            else:
                print(f"{name:34s} {g} {r['registers']:4d} {r['stack_bytes']:5d} {r['shared_bytes']:6d} "
                      f"{r['warps']:5d} {r['programs_per_sm_fit']:3d} {r['warp_specialized']:d}  {r['tma_loads']:d}  "
                      f"{r['wgmma']:5d} {r['fmul']:4d} {r['ffma']:4d}  {r['mma_waits']} {r['fp32_ops_before_wait']}",
                      flush=True)
            out.setdefault(name, {})[g] = r
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if any("error" in r for v in out.values() for r in v.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
