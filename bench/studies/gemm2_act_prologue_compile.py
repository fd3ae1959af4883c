"""Compile the decode GEMM2 of the DeepSeek-V3 FP8 layer for Hopper (sm_90a) on a machine without a GPU, plain (FP8
codes and scales read from memory) and with the act prologue (``act_prologue``: SiLU / erf GELU / tanh GELU /
SwiGLU-OAI and the FP8 1x128 quantization computed from GEMM1's bf16 output in the operand loads): registers,
spills, shared memory, and the SASS counts that show the extra work (QGMMA, MUFU for the exponentials, FFMA, loads).
A static check before device time (issue 33); it runs nothing.

    python bench/studies/gemm2_act_prologue_compile.py [--tiles decode|plain] [--out FILE]

The launches are recorded on CPU tensors (bench/sass_report.py's recorder, which compiles the GPU form: no
interpreter branches, the hardware FMA and E4M3 cast) and compiled with the ptxas bundled with Triton's wheel.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.sass_report import compile_kernel, count, record  # noqa: E402  (pops TRITON_INTERPRET first)

import torch  # noqa: E402

SHAPE = dict(experts=256, cap=16, hidden=7168, inter=2048)  # DeepSeek-V3 GEMM2 at 1 token (masked, capacity 16)
ACTS = {"plain": None, "silu": ("silu_and_mul", {}), "gelu": ("gelu_and_mul", {}),
        "gelu_tanh": ("gelu_and_mul", {"approximate": "tanh"}), "swigluoai": ("swigluoai", {})}


def compile_gemm2(act, tiles, maxnreg=None) -> dict:
    """Compile the masked GEMM2 launch (``act`` None: FP8 operand from memory) and describe the kernel; ``maxnreg``
    overrides the launch's register cap (0: none)."""
    from fastpath import _host
    from fastpath.fused import GatedQuant
    from fastpath.grouped_gemm import grouped_gemm_masked

    e, cap, n, k = SHAPE["experts"], SHAPE["cap"], SHAPE["hidden"], SHAPE["inter"]
    b = torch.empty(e, n, k, dtype=torch.float8_e4m3fn)
    sb = torch.empty(e, n // 128, k // 128)
    mm = torch.ones(e, dtype=torch.int32)
    if act is None:
        a, sa, kw = torch.empty(e, cap, k, dtype=torch.float8_e4m3fn), torch.empty(e, cap, k // 128), {}
    else:
        a, sa = torch.empty(e, cap, 2 * k, dtype=torch.bfloat16), None
        kw = dict(act_prologue=GatedQuant(act[0], hw_fp8=True, **act[1]))
    cache_on = _host.LAUNCH_CACHE_ON
    _host.LAUNCH_CACHE_ON = False  # kernel[grid] directly: the recorder takes it (no CUDA device to key on)
    try:
        log = record(lambda: grouped_gemm_masked(a, b, mm, impl="triton", a_scales=sa, b_scales=sb, tiles=tiles,
                                                 max_groups=8, **kw))
    finally:
        _host.LAUNCH_CACHE_ON = cache_on
    fn, _, args, kwargs = log[-1]
    if maxnreg == 0:
        kwargs = {k_: v for k_, v in kwargs.items() if k_ != "maxnreg"}
    ck, sass, regs, stack = compile_kernel(fn, args, kwargs, maxnreg or None)
    ops = count(sass)
    return {"registers": regs, "stack_bytes": stack, "shared_bytes": int(ck.metadata.shared),
            "warps": int(ck.metadata.num_warps), "instructions": sum(ops.values()),
            **{op.lower(): ops.get(op, 0) for op in ("QGMMA", "MUFU", "FFMA", "FMUL", "LDG", "LDGSTS", "LDS",
                                                      "STS", "BAR")}}


def main(argv=None) -> int:
    from fastpath.grouped_gemm import DEFAULT_TILES, GemmTiles

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", choices=["decode", "plain"], default="decode",
                    help="decode: the default decode tiles (16-row swapped); plain: GemmTiles(16, 128, 128, 4, 3)")
    ap.add_argument("--maxnreg", type=int, default=None,
                    help="cap registers per thread (ptxas .maxnreg; default: the launch's own, "
                         "fastpath.grouped_gemm.ACT_PROLOGUE_MAXNREG for the prologue; 0: no cap)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    tiles = DEFAULT_TILES["fp8_block_decode"] if args.tiles == "decode" else GemmTiles(16, 128, 128, 4, 3)
    out: dict = {"tiles": str(tiles), "shape": SHAPE, "maxnreg": args.maxnreg, "cases": {}}
    print(f"GEMM2 {SHAPE}, tiles {tiles}")
    print(f"{'case':10s} regs stack shared warps  instr qgmma mufu  ffma  fmul  ldg ldgsts  lds  sts  bar")
    for name, act in ACTS.items():
        try:
            r = compile_gemm2(act, tiles, args.maxnreg)
        except Exception as e:  # recorded, not fatal
            r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:10s} FAILED {r['error'][:200]}", flush=True)
        else:
            print(f"{name:10s} {r['registers']:4d} {r['stack_bytes']:5d} {r['shared_bytes']:6d} {r['warps']:5d} "
                  f"{r['instructions']:6d} {r['qgmma']:5d} {r['mufu']:4d} {r['ffma']:5d} {r['fmul']:5d} "
                  f"{r['ldg']:4d} {r['ldgsts']:6d} {r['lds']:4d} {r['sts']:4d} {r['bar']:4d}", flush=True)
        out["cases"][name] = r
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if any("error" in r for r in out["cases"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
