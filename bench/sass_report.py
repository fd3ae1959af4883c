"""Compile the fast-path kernels for Hopper (sm_90) on a machine without a GPU and count SASS
instructions, so instruction budgets can be compared before spending device time.

The memory-bound kernels here are issue-bound once their per-element instruction count passes
what the SMs can retire while HBM streams the bytes: on an H200 (132 SMs x 4 schedulers x ~1.98
GHz = ~1.05e12 warp instructions/s) against ~1.4e12 elements/s at 4.25 TB/s for a 3-byte/element
quantizer, that is about 24 thread instructions per element. The report prints SASS instructions
per element (static count of the straight-line kernel / elements per thread). Registers matter
as much: below that budget these kernels are latency-bound, and the registers per thread set
how many warps (bytes in flight) an SM holds (an Nsight Compute profile on an H200, 2026-11-21,
bench/profile_gpu.py: 42-80% issue utilisation, global-load stalls first).

    python bench/sass_report.py                  # the benchmark's kernels at 16384 x 7168 bf16
    python bench/sass_report.py --dump NAME      # also write NAME's SASS to bench_out/NAME.sass
    python bench/sass_report.py --maxnreg 64     # with a register cap (spills show as STACK)
    python bench/sass_report.py --tuning e2m1_ptx=False --tuning word_run_mxfp4=4
                                                 # with QuantTuning knobs (fastpath.quant)

The kernels are launched on CPU tensors, so device-specific tiles (fastpath.quant._tiles'
_DEVICE_TILES) are not taken here.

Uses the ptxas/cuobjdump bundled with Triton's wheel; no CUDA driver is needed.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_TARGET = GPUTarget("cuda", 90, 32)
_TY = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8",
       torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8", torch.float64: "*fp64",
       torch.float8_e4m3fn: "*fp8e4nv"}


class _Recorder:
    """Stands in for a JITFunction: ``k[grid](*args, **kw)`` records the launch."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append((self.fn, grid, args, kw))
        return launch


def _signature(fn, args, kw):
    names = fn.arg_names
    vals = {p.name: p.default for p in fn.params if p.default is not inspect.Parameter.empty}  # defaults
    vals.update(zip(names, args))
    vals.update(kw)
    num_warps = vals.pop("num_warps", 4)
    num_stages = vals.pop("num_stages", 3)
    maxnreg = vals.pop("maxnreg", None)
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(names):
        v = vals[n]
        if fn.params[i].is_constexpr:
            sig[n] = "constexpr"
            consts[n] = v
        elif isinstance(v, torch.Tensor):
            sig[n] = _TY[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[n] = "i1"
        elif isinstance(v, int):
            if v == 1 and not fn.params[i].do_not_specialize:
                sig[n] = "constexpr"
                consts[n] = 1
                continue
            sig[n] = "i64" if abs(v) >= 2 ** 31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[n] = "fp32"
        else:
            raise TypeError(f"{n}: {type(v)}")
    return sig, consts, attrs, num_warps, num_stages, maxnreg


def compile_kernel(fn, args, kw, maxnreg=None):
    """Compile one recorded launch for sm_90a: ``(compiled kernel, SASS text, registers, stack bytes)``;
    ``maxnreg`` overrides the launch's register cap (ptxas ``.maxnreg``)."""
    sig, consts, attrs, nw, ns, cap = _signature(fn, args, kw)
    opts = {"num_warps": nw, "num_stages": ns}
    if maxnreg or cap:
        opts["maxnreg"] = maxnreg or cap
    src_type = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel: its IR is built by Gluon's source type
        from triton.experimental.gluon._runtime import GluonASTSource as src_type
    src = src_type(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    ck = triton.compile(src, target=_TARGET, options=opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(re.search(r"STACK:(\d+)", res).group(1))
    return ck, sass, regs, stack


def compile_sass(fn, args, kw, maxnreg=None):
    """SASS text, registers, stack bytes, warps and shared memory of one recorded launch
    (:func:`compile_kernel`)."""
    ck, sass, regs, stack = compile_kernel(fn, args, kw, maxnreg)
    return sass, regs, stack, int(ck.metadata.num_warps), ck.metadata.shared


def count(sass: str):
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    ops.pop("NOP", None)
    return ops


def record(call):
    """Run ``call()`` (which calls fastpath functions on CPU tensors) with launches recorded:
    every Triton kernel bound to a name in a ``fastpath`` module is swapped for a recorder."""
    import fastpath.dispatch  # noqa: F401 (the kernels' modules, loaded before the swap)
    import fastpath.fused  # noqa: F401
    import fastpath.quant  # noqa: F401
    from fastpath.quant import _preset_map as P
    mods = [m for n, m in sorted(sys.modules.items()) if n == "fastpath" or n.startswith("fastpath.")]
    log = []
    saved = {}
    for mod in mods:
        if hasattr(mod, "_INTERPRETED"):
            saved[(mod, "_INTERPRETED")] = mod._INTERPRETED
            mod._INTERPRETED = False
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, triton.runtime.jit.JITFunction):
                saved[(mod, name)] = obj
                setattr(mod, name, _Recorder(obj, log))
    P.constexprs_cached.cache_clear()
    os.environ["TRITON_INTERPRET"] = "1"  # lets fastpath accept CPU tensors; nothing launches
    try:
        call()
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        for (mod, name), obj in saved.items():
            setattr(mod, name, obj)
        P.constexprs_cached.cache_clear()
    return log


def cases(M=16384, K=7168, tuning=None):
    """The benchmark's kernels (bench/bench_quant_gpu.py), launched on CPU tensors; ``tuning``:
    a :class:`fastpath.quant.QuantTuning` for every quantize and fused launch (None: the
    defaults)."""
    import fastpath.fused as F
    import fastpath.quant as Q
    from moeref.quant import fp8_group, fp8_per_tensor, fp8_per_token, mxfp4, mxfp8, nvfp4
    x = torch.empty(M, K, dtype=torch.bfloat16)
    gu = torch.empty(M, 2 * K, dtype=torch.bfloat16)
    s_g = fp8_group(128)
    s_dg32 = fp8_group(128, "fp32", "deepgemm")
    t = {} if tuning is None else {"tuning": tuning}
    return {
        "fp8_1x128_default": lambda: Q.quantize(x, s_g, hw_fp8=True, **t),
        "fp8_1x128_deepgemm": lambda: Q.quantize(x, s_dg32, hw_fp8=True, **t),
        "fp8_per_token": lambda: Q.quantize(x, fp8_per_token(), hw_fp8=True, **t),
        "fp8_per_tensor": lambda: Q.quantize(x, fp8_per_tensor(), hw_fp8=True, **t),
        "mxfp8": lambda: Q.quantize(x, mxfp8(), scale_layout="swizzled_128x4", hw_fp8=True, **t),
        "mxfp4": lambda: Q.quantize(x, mxfp4(), scale_layout="swizzled_128x4", hw_fp8=True, **t),
        "nvfp4": lambda: Q.quantize(x, nvfp4(), scale_layout="swizzled_128x4", hw_fp8=True, **t),
        "nvfp4_static": lambda: Q.quantize(x, nvfp4(preset="nvfp4_vllm"), scale_layout="swizzled_128x4",
                                           global_scale=1.0, hw_fp8=True, **t),
        # the FP4 paths the bf16 benchmark does not take: 16-bit words without the packed
        # encode (float16), and the generic split tile (float32)
        "mxfp4_fp16": lambda: Q.quantize(x.half(), mxfp4(), scale_layout="swizzled_128x4", hw_fp8=True, **t),
        "mxfp4_fp32": lambda: Q.quantize(x.float(), mxfp4(), scale_layout="swizzled_128x4", hw_fp8=True, **t),
        "silu_fp8": lambda: F.silu_and_mul_quant_fp8(gu, s_g, **t),
        "swigluoai_fp8": lambda: F.swigluoai_quant_fp8(gu, 1.702, 7.0, s_g, **t),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--dump", action="store_true", help="write each kernel's SASS to bench_out/")
    ap.add_argument("--maxnreg", type=int, default=None, help="cap registers per thread (ptxas .maxnreg)")
    ap.add_argument("--tuning", action="append", default=[], metavar="FIELD=VALUE",
                    help="a fastpath.quant.QuantTuning field for the quantize launches (repeatable)")
    a = ap.parse_args(argv)
    tuning = None
    if a.tuning:
        import ast

        from fastpath.quant import QuantTuning
        tuning = QuantTuning(**{k: ast.literal_eval(v) for k, v in (f.split("=", 1) for f in a.tuning)})
    cs = cases(tuning=tuning)
    names = a.names or list(cs)
    print(f"{'case':24s} {'kernel':24s} {'regs':>4s} {'stack':>5s} {'warps':>5s} {'instr':>6s} "
          f"{'elem/thr':>8s} {'instr/elem':>10s}  top ops")
    for name in names:
        for fn, grid, args, kw in record(cs[name]):
            sass, regs, spills, nw, _ = compile_sass(fn, args, kw, a.maxnreg)
            ops = count(sass)
            total = sum(ops.values())
            vals = dict(zip(fn.arg_names, args)); vals.update(kw)
            per = None
            if "BLOCK_M" in vals and "GPP" in vals and "GB" in vals:
                per = vals["BLOCK_M"] * vals["GPP"] * vals["GB"] / (32 * nw)
            top = ", ".join(f"{k}:{v}" for k, v in ops.most_common(8))
            print(f"{name:24s} {fn.__name__:24s} {regs:4d} {spills:5d} {nw:5d} {total:6d} "
                  f"{per or 0:8.0f} {total / per if per else float('nan'):10.2f}  {top}")
            if a.dump:
                os.makedirs("bench_out", exist_ok=True)
                with open(f"bench_out/{name}.{fn.__name__}.sass", "w") as f:
                    f.write(sass)


if __name__ == "__main__":
    sys.exit(main())
