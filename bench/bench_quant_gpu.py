"""Benchmark the Triton quantization fast paths on a GPU: achieved bandwidth vs the device copy.

For each kernel and each size M of the sweep (large: default 16384 x 7168 bf16 input), the fast
path is timed in the same interleaved rounds as its baselines (:mod:`bench.interleaved`: >= 7
rounds, ``--rounds``, CUDA events, calls per round calibrated to ``--round-ms``, inputs rotated
across enough buffers that the L2 cache (50-60 MB) cannot hold them, clocks spun up first):

* ``copy``: a device-to-device copy moving the same bytes (read + write) as the operation must
  (bytes it must read + bytes it must write); % of copy is the median of the per-round ratios;
* at the large size with ``--baselines``: a torch-eager implementation of the same operation,
  ``torch.compile`` of it, and DeepGEMM's own quantizer where installed, each as the median of
  its per-round ratios (baseline time / fast-path time).

Every case reports median, min, max and spread; a case whose spread exceeds 10% is flagged in
the JSON, the console and the tables. The JSON carries the GPU, driver, CUDA, torch and triton
versions and the date; ``bench/report_quant.py`` turns it into docs/fastpaths.md's tables.
Writes ``bench_quant.json``, ``bench_quant.md`` (the same tables) and ``fastpath_bandwidth.png``
(bandwidth vs bytes moved, one line per kernel) to ``--out``.

Run: ``python bench/bench_quant_gpu.py --out OUTDIR [--baselines] [--quick]`` (bench/run_gpu.sh).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moeref.quant import fp8_group, fp8_per_tensor, fp8_per_token, mxfp4, mxfp8  # noqa: E402
from moeref.quant.nvfp4 import nvfp4  # noqa: E402

from bench.interleaved import (  # noqa: E402  (row_record and the rest: shared with the dispatch benchmark)
    FLAG_SPREAD, L2_BYTES, MIN_ROUNDS, rotating, copy_case, machine_meta, row_ratios_text, row_record, spin_clocks,
    time_row)
from bench.report_quant import plot, tables as report_tables  # noqa: E402
from fastpath import fused as F  # noqa: E402
from fastpath import quant as Q  # noqa: E402

# ----------------------------------------------------------------------------- torch baselines
# Same operation, written the way one writes it in PyTorch (DeepGEMM's per_token_cast_to_fp8 style).

def _ceil_ue8m0(sf):
    bits = sf.view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return (e.clamp(1, 254) << 23).view(torch.float32)


def torch_group_fp8(x, g=128, ue8m0=False):
    """DeepGEMM's recipe (deep_gemm/utils/math.py per_token_cast_to_fp8): x * (1 / sf)."""
    m, k = x.shape
    xv = x.view(m, k // g, g).float()
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    sf = amax / 448.0
    if ue8m0:
        sf = _ceil_ue8m0(sf)
    q = (xv * (1.0 / sf.unsqueeze(2))).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    return q, sf


def torch_group_fp8_div(x, g=128):
    """moeref's default preset: sf = amax / 448 (1 for a zero block), x / sf."""
    m, k = x.shape
    xv = x.view(m, k // g, g).float()
    sf = xv.abs().amax(dim=2) / 448.0
    sf = torch.where(sf == 0, torch.ones_like(sf), sf)
    q = (xv / sf.unsqueeze(2)).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    return q, sf


def torch_per_token_fp8(x):
    xf = x.float()
    sf = xf.abs().amax(dim=1, keepdim=True) / 448.0
    sf = torch.where(sf == 0, torch.ones_like(sf), sf)
    return (xf / sf).clamp(-448, 448).to(torch.float8_e4m3fn), sf


def torch_per_tensor_fp8(x):
    xf = x.float()
    sf = xf.abs().amax() / 448.0
    return (xf / sf).clamp(-448, 448).to(torch.float8_e4m3fn), sf


def _mx_blocks(x, elem_max):
    """32-element blocks of x (float32 [m, k/32, 32]), their power-of-two scales (ceil of
    amax * (1/elem_max), DeepGEMM style) and the E8M0 bytes."""
    m, k = x.shape
    xv = x.view(m, k // 32, 32).float()
    amax = xv.abs().amax(dim=2)
    bits = (amax * (1.0 / elem_max)).view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    scale = (e.clamp(1, 254) << 23).view(torch.float32)
    return xv, scale, e.to(torch.uint8)


def torch_mxfp8(x):
    xv, scale, e = _mx_blocks(x, 448.0)
    return (xv / scale.unsqueeze(2)).clamp(-448, 448).to(torch.float8_e4m3fn).view(x.shape), e


_FP4_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _fp4_codes(y):
    a = y.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for b in _FP4_BOUNDS:
        code = code + (a > b).to(torch.uint8)
    code = code | ((y < 0).to(torch.uint8) << 3)
    return code


def torch_mxfp4(x):
    m, k = x.shape
    xv, scale, e = _mx_blocks(x, 6.0)
    c = _fp4_codes(xv / scale.unsqueeze(2)).view(m, k // 2, 2)
    return c[..., 0] | (c[..., 1] << 4), e


def torch_nvfp4(x, s_enc=None):
    """NVFP4 in eager torch; ``s_enc``: a static encode scale (vLLM's input_global_scale), else
    the dynamic 2688 / amax (one more read of x)."""
    m, k = x.shape
    xf = x.float()
    if s_enc is None:
        s_enc = 2688.0 / xf.abs().amax()
    xv = xf.view(m, k // 16, 16)
    sf = (xv.abs().amax(dim=2) * (s_enc / 6.0)).clamp(max=448).to(torch.float8_e4m3fn)
    fac = 1.0 / (sf.float() / s_enc)
    c = _fp4_codes((xv * fac.unsqueeze(2)).clamp(-6, 6)).view(m, k // 2, 2)
    return c[..., 0] | (c[..., 1] << 4), sf


def torch_silu_and_mul(x):
    n = x.shape[1] // 2
    return torch.nn.functional.silu(x[:, :n].float()) * x[:, n:].float()


def torch_silu_group_fp8(x):
    n = x.shape[1] // 2
    a = torch.nn.functional.silu(x[:, :n].float()) * x[:, n:].float()
    return torch_group_fp8_div(a)


def torch_swigluoai_group_fp8(x, alpha=1.702, limit=7.0):
    g = x[:, 0::2].float().clamp(max=limit)
    u = x[:, 1::2].float().clamp(-limit, limit)
    a = (u + 1) * g * torch.sigmoid(alpha * g)
    return torch_group_fp8_div(a)


def torch_dequant_group(codes, sf):
    m, k = codes.shape
    return (codes.view(torch.float8_e4m3fn).float().view(m, k // 128, 128) * sf.unsqueeze(2)).view(m, k).bfloat16()


# ----------------------------------------------------------------------------- kernels under test

def kernels(device="cuda"):
    """name -> (make_inputs(M, K) -> tuple, run(*inputs, **tile), bytes(M, K), torch_fn or None).

    ``run`` passes tile overrides (``block_m``, ``groups_per_program``, ``num_warps``) through to
    the fast path: the benchmark, the tile sweep (``--tune``) and ``bench/profile_gpu.py`` all
    take their cases from here."""
    bf = torch.bfloat16

    def x_in(M, K):
        return (torch.randn(M, K, device=device, dtype=bf),)

    def x2_in(M, K):
        return (torch.randn(M, 2 * K, device=device, dtype=bf),)

    def bytes_q(elem_bytes, scale_bytes_per_group, g):
        return lambda M, K: M * K * 2 + M * K * elem_bytes + M * (-(-K // g)) * scale_bytes_per_group

    def dq_in(M, K):
        x = torch.randn(M, K, device=device, dtype=bf)
        q = Q.quantize(x, fp8_group(128))
        return (q,)

    s_g = fp8_group(128)
    s_dg = fp8_group(128, "ue8m0", "deepgemm")
    s_dg32 = fp8_group(128, "fp32", "deepgemm")
    s_tok = fp8_per_token()
    s_ten = fp8_per_tensor()
    s_mx8 = mxfp8()
    s_mx4 = mxfp4()
    s_nv = nvfp4()
    s_nv_vllm = nvfp4(preset="nvfp4_vllm")  # encode_scale convention: vLLM's input_global_scale

    def x_gscale_in(M, K):
        """x and its static encode scale 2688 / amax, computed once outside the timing: a float
        for the Triton path, the same value as a 0-d device tensor for the torch baseline (a
        float would make torch.compile specialize on each value of the rotation)."""
        x = torch.randn(M, K, device=device, dtype=bf)
        g = 2688.0 / float(x.float().abs().amax())
        return (x, g, torch.tensor(g, dtype=torch.float32, device=device))

    def seq_bytes(elem_bytes):
        return lambda M, K: M * 2 * K * 2 + 2 * M * K * 4 + int(M * K * elem_bytes)

    def handoff(scheme, **kw):
        """activation with its amax, then the quantizer's one read of it"""
        def run(x, **c):
            a, amax = F.silu_and_mul(x, amax_for=scheme)
            return Q.quantize(a, scheme, amax=amax, **kw)
        return run

    def quant(scheme, **fixed):
        return lambda x, **c: Q.quantize(x, scheme, **fixed, **c)

    return {
        "fp8_1x128_fp32 (default: x / s)": (x_in, quant(s_g), bytes_q(1, 4, 128),
                                            lambda x: torch_group_fp8_div(x)),
        "fp8_1x128_fp32 (deepgemm: x * (1/s))": (x_in, quant(s_dg32), bytes_q(1, 4, 128),
                                                 lambda x: torch_group_fp8(x)),
        "fp8_1x128_ue8m0_packed (deepgemm)": (x_in, quant(s_dg, scale_layout="packed_ue8m0"),
                                              bytes_q(1, 1, 128), lambda x: torch_group_fp8(x, ue8m0=True)),
        "fp8_1x128_fp32_mn_major (deepgemm)": (x_in, quant(s_dg32, scale_layout="mn_major"),
                                               bytes_q(1, 4, 128), lambda x: torch_group_fp8(x)),
        "fp8_per_token": (x_in, quant(s_tok), lambda M, K: M * K * 3 + 4 * M, torch_per_token_fp8),
        "fp8_per_tensor": (x_in, quant(s_ten), lambda M, K: M * K * 3 + 4, torch_per_tensor_fp8),
        "mxfp8_swizzled": (x_in, quant(s_mx8, scale_layout="swizzled_128x4"), bytes_q(1, 1, 32),
                           torch_mxfp8),
        "mxfp4_swizzled": (x_in, quant(s_mx4, scale_layout="swizzled_128x4"), bytes_q(0.5, 1, 32),
                           torch_mxfp4),
        "nvfp4_swizzled": (x_in, quant(s_nv, scale_layout="swizzled_128x4"), bytes_q(0.5, 1, 16),
                           torch_nvfp4),
        "nvfp4_swizzled (static global scale)": (
            x_gscale_in,
            lambda x, g, gt, **c: Q.quantize(x, s_nv_vllm, scale_layout="swizzled_128x4",
                                             global_scale=g, **c),
            bytes_q(0.5, 1, 16), lambda x, g, gt: torch_nvfp4(x, gt)),
        "silu_and_mul+fp8_1x128": (x2_in, lambda x, **c: F.silu_and_mul_quant_fp8(x, s_g, **c),
                                   lambda M, K: M * 2 * K * 2 + M * K + M * (K // 128) * 4,
                                   torch_silu_group_fp8),
        "swigluoai+fp8_1x128": (x2_in, lambda x, **c: F.swigluoai_quant_fp8(x, 1.702, 7.0, s_g, **c),
                                lambda M, K: M * 2 * K * 2 + M * K + M * (K // 128) * 4,
                                torch_swigluoai_group_fp8),
        "dequant_fp8_1x128_to_bf16": (dq_in, lambda q, **c: Q.dequantize(q, torch.bfloat16, **c),
                                      lambda M, K: M * K * 1 + M * (K // 128) * 4 + M * K * 2,
                                      None),
        # issue 20's two-pass kernels, as the two-kernel sequence activation -> quantize: the amax
        # pass over the float32 activation (today), or the amax from the activation kernel (one read).
        # Bytes: the sequence's least traffic (bf16 input read, float32 activation written and read
        # once, codes written), the same for both rows so their % of copy compare.
        "silu_and_mul -> fp8_per_tensor (amax pass)": (
            x2_in, lambda x, **c: Q.quantize(F.silu_and_mul(x), s_ten), seq_bytes(1),
            lambda x: torch_per_tensor_fp8(torch_silu_and_mul(x))),
        "silu_and_mul -> fp8_per_tensor (amax from the activation)": (
            x2_in, handoff(s_ten), seq_bytes(1),
            lambda x: torch_per_tensor_fp8(torch_silu_and_mul(x))),
        "silu_and_mul+fp8_per_tensor (fused: amax pass, then data pass)": (
            x2_in, lambda x, **c: F.silu_and_mul_quant_fp8(x, s_ten, **c),
            lambda M, K: M * 2 * K * 2 + M * K + 4,
            lambda x: torch_per_tensor_fp8(torch_silu_and_mul(x))),
        "silu_and_mul -> nvfp4 (amax pass)": (
            x2_in, lambda x, **c: Q.quantize(F.silu_and_mul(x), s_nv, scale_layout="swizzled_128x4"),
            seq_bytes(0.5), None),
        "silu_and_mul -> nvfp4 (amax from the activation)": (
            x2_in, handoff(s_nv, scale_layout="swizzled_128x4"), seq_bytes(0.5), None),
    }


def bench_fn(fn, inputs_list, warmup_ms=25, rep_ms=200):
    """Median ms of fn over rotating inputs (each call uses the next input set), clocks spun
    up first (:func:`spin_clocks`)."""
    state = {"i": 0}

    def call():
        args = inputs_list[state["i"] % len(inputs_list)]
        state["i"] += 1
        fn(*args)

    spin_clocks()
    return triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def make_rotation(make, M, K, bytes_per_call):
    n = max(1, min(32, int(np.ceil(4 * L2_BYTES / max(bytes_per_call, 1)))))
    return [make(M, K) for _ in range(n)]


def copy_bandwidth():
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    spin_clocks(1000)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e12


@triton.jit
def _traffic_kernel(src_ptr, dst_ptr, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """The memory traffic of a kernel and nothing else, per source item: MODE 1 reads 2 bytes
    (int16) and writes 1 (quantize bf16 -> FP8); 2 reads 4 (an int32 pair of bf16) and writes 1
    (bf16 -> FP4); 0 reads 1 and writes 2 (dequantize)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(src_ptr + offs, mask=m, other=0)
    if MODE == 1:
        tl.store(dst_ptr + offs, (v >> 8).to(tl.uint8), mask=m)
    elif MODE == 2:
        tl.store(dst_ptr + offs, (v >> 24).to(tl.uint8), mask=m)
    elif MODE == 3:  # an amax pass: read, one word per program
        tl.store(dst_ptr + tl.program_id(0), tl.max(v & 0x7FFFFFFF, axis=0))
    else:
        tl.store(dst_ptr + offs, v.to(tl.int16) << 8, mask=m)


def traffic_ceiling(M, K):
    """Bandwidth of the bare traffic patterns (same bytes, no arithmetic): what a memory-bound
    quantize (read 2, write 1 byte per element), FP4 quantize (read 2, write 0.5) or dequantize
    (read 1, write 2) can reach here."""
    n = M * K
    out = {}
    for name, mode in (("read2_write1 (quantize)", 1), ("read2_write0.5 (FP4 quantize)", 2),
                       ("read1_write2 (dequantize)", 0)):
        items = n // 2 if mode == 2 else n
        if mode == 1:
            src = torch.randint(-30000, 30000, (items,), dtype=torch.int16, device="cuda")
        elif mode == 2:
            src = torch.randint(-2**31, 2**31 - 1, (items,), dtype=torch.int32, device="cuda")
        else:
            src = torch.randint(0, 255, (items,), dtype=torch.uint8, device="cuda")
        dst = torch.empty(items, dtype=torch.int16 if mode == 0 else torch.uint8, device="cuda")
        nbytes = items * (5 if mode == 2 else 3)
        best = 0.0
        for warps in (4, 8):
            fn = lambda: _traffic_kernel[(triton.cdiv(items, 4096),)](src, dst, items, MODE=mode,  # noqa: E731
                                                                      BLOCK=4096, num_warps=warps)
            fn()
            spin_clocks()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            best = max(best, nbytes / (ms * 1e-3) / 1e12)
        out[name] = best
        if mode == 2:  # the same bytes counted, after an amax pass that reads the input once more
            part = torch.empty(triton.cdiv(items, 4096), dtype=torch.int32, device="cuda")
            best2 = 0.0
            for warps in (4, 8):
                def two_pass(warps=warps):
                    _traffic_kernel[(triton.cdiv(items, 4096),)](src, part, items, MODE=3, BLOCK=4096, num_warps=warps)
                    _traffic_kernel[(triton.cdiv(items, 4096),)](src, dst, items, MODE=2, BLOCK=4096, num_warps=warps)
                two_pass()
                spin_clocks()
                ms = triton.testing.do_bench(two_pass, warmup=25, rep=200, return_mode="median")
                best2 = max(best2, nbytes / (ms * 1e-3) / 1e12)
            out["read2 + read2_write0.5 (two-pass FP4 quantize: amax pass, then data; one read counted)"] = best2
            del part
        del src, dst
        torch.cuda.empty_cache()
    return out


def run_meta(args) -> dict:
    """GPU, driver, CUDA, torch, triton, Python, date and the timing settings of this run."""
    return {**machine_meta(), "M": args.M, "K": args.K, "rounds": args.rounds, "round_ms": args.round_ms,
            "flag_spread": FLAG_SPREAD}


def deep_gemm_baselines() -> dict:
    """Row name -> DeepGEMM's own quantizer of the same operation (``deep_gemm.utils.per_token_cast_to_fp8``,
    1x128 FP32 or UE8M0-rounded scales), when deep_gemm is importable; else {}."""
    try:
        import deep_gemm
    except Exception:
        return {}
    f = deep_gemm.utils.per_token_cast_to_fp8
    return {"fp8_1x128_fp32 (deepgemm: x * (1/s))": lambda x: f(x, use_ue8m0=False),
            "fp8_1x128_fp32_mn_major (deepgemm)": lambda x: f(x, use_ue8m0=False),
            "fp8_1x128_ue8m0_packed (deepgemm)": lambda x: f(x, use_ue8m0=True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--baselines", action="store_true", help="also time torch eager / torch.compile / deep_gemm")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--only", default="", help="comma-separated substrings of kernel names")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs at the large size")
    ap.add_argument("--ceiling", action="store_true",
                    help="also time the bare read2/write1 and read1/write2 traffic (no arithmetic)")
    ap.add_argument("--maxnreg", default="",
                    help="with --tune: comma-separated register caps to sweep (0: none) on each tile")
    ap.add_argument("--tiles", default="", help="with --tune: ';'-separated dicts of tile overrides "
                    "and QuantTuning fields to sweep instead of the default list, e.g. "
                    "\"{};{'num_warps': 8};{'word_run_mxfp4': 4};{'e2m1_ptx': False}\"")
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--K", type=int, default=7168)
    ap.add_argument("--rounds", type=int, default=9, help=f"interleaved rounds per row (>= {MIN_ROUNDS})")
    ap.add_argument("--round-ms", type=float, default=10.0, help="time per case and round (calls calibrated)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    meta = run_meta(args)
    copy_tbs = copy_bandwidth()
    meta["copy_TBps"] = copy_tbs
    print(f"device {meta['gpu']}  driver {meta['driver']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"date {meta['date']}  copy bandwidth {copy_tbs:.3f} TB/s", flush=True)
    ceiling = traffic_ceiling(args.M, args.K) if args.ceiling else {}
    for k_, v_ in ceiling.items():
        print(f"traffic ceiling {k_:28s} {v_:6.3f} TB/s ({100 * v_ / copy_tbs:5.1f}% of copy)", flush=True)
    ks = kernels()
    if args.only:
        keys = [k for k in ks if any(s in k for s in args.only.split(","))]
        ks = {k: ks[k] for k in keys}
    if args.tune:
        tune(args, ks)
        return
    Ms = [1, 16, 128, 1024, 4096, args.M] if not args.quick else [16, 1024, args.M]
    results = {"meta": meta, "traffic_ceiling_TBps": ceiling, "kernels": {}}
    dg = deep_gemm_baselines() if args.baselines else {}
    for name, (make, run, nbytes, tfn) in ks.items():
        rec = {"rows": []}
        for M in Ms:
            b = nbytes(M, args.K)
            inputs = make_rotation(make, M, args.K, b)
            cases = {"fastpath": rotating(run, inputs), "copy": copy_case(b)}
            if M == args.M and args.baselines and tfn is not None:
                try:
                    tfn(*inputs[0])
                    cases["torch eager"] = rotating(tfn, inputs)
                except Exception as e:  # reported, not hidden
                    rec["eager_error"] = f"{type(e).__name__}: {e}"[:200]
                try:
                    cfn = torch.compile(tfn, dynamic=False)
                    t0 = time.time()
                    cfn(*inputs[0])
                    torch.cuda.synchronize()
                    rec["compile_s"] = time.time() - t0
                    cases["torch.compile"] = rotating(cfn, inputs)
                except Exception as e:  # reported, not hidden
                    rec["compile_error"] = f"{type(e).__name__}: {e}"[:200]
                if name in dg:
                    cases["DeepGEMM"] = rotating(lambda x, *_, f=dg[name]: f(x), inputs)
            res = time_row(cases, [c for c in cases if c != "fastpath"], args.rounds, args.round_ms * 1e-3)
            rec["rows"].append(row_record(res, M, b))
            del inputs, cases
            torch.cuda.empty_cache()
        # kernel-only latency at the smallest size: one call captured in a CUDA graph, replayed
        try:
            small = make(Ms[0], args.K)
            run(*small)
            torch.cuda.synchronize()
            rec["small_graph_us"] = triton.testing.do_bench_cudagraph(lambda: run(*small), rep=50,
                                                                      return_mode="median") * 1e3
        except Exception as e:
            rec["small_graph_error"] = f"{type(e).__name__}: {e}"[:200]
        results["kernels"][name] = rec
        with open(os.path.join(args.out, "bench_quant.json"), "w") as fh:  # partial results too
            json.dump(results, fh, indent=1)
        big, small_row = rec["rows"][-1], rec["rows"][0]
        fp = big["cases"]["fastpath"]
        msg = (f"{name:38s} {big['TBps']:6.3f} TB/s ({big['pct_copy']:5.1f}% of copy) {fp['median_us']:9.1f} us "
               f"[{fp['min_us']:.1f}-{fp['max_us']:.1f}] @M={args.M}  M={Ms[0]}: "
               f"{small_row['cases']['fastpath']['median_us']:7.1f} us")
        print(msg + row_ratios_text(big), flush=True)

    with open(os.path.join(args.out, "bench_quant.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    with open(os.path.join(args.out, "bench_quant.md"), "w") as fh:
        fh.write(report_tables(results) + "\n")
    plot(results, os.path.join(args.out, "fastpath_bandwidth.png"))


def _with_tuning(cfg: dict) -> dict:
    """A sweep entry as the kernels' keyword arguments: the tile overrides (``block_m``,
    ``groups_per_program``, ``num_warps``) as they are, the fields of
    :class:`fastpath.quant.QuantTuning` (``maxnreg``, ``e2m1_ptx``, ``word_run_mxfp4``,
    ``word_run_nvfp4``, ``row_loop_min_k``, ``row_loop_tile``) folded into one ``tuning=``."""
    names = {f.name for f in dataclasses.fields(Q.QuantTuning)}
    knobs = {k: v for k, v in cfg.items() if k in names}
    out = {k: v for k, v in cfg.items() if k not in names}
    if knobs:
        out["tuning"] = Q.QuantTuning(**knobs)
    return out


def tune(args, ks):
    """Tile sweep at the large size: time every candidate (block_m, groups_per_program,
    num_warps, and QuantTuning knobs) of each kernel of ``ks`` (:func:`kernels`, as ``--only``
    filtered it), print each and the best (the defaults in fastpath.quant._tiles come from this
    sweep; docs/performance.md keeps the history)."""
    M, K = args.M, args.K
    tiles = [dict(), dict(num_warps=2), dict(num_warps=4), dict(num_warps=8),
             dict(block_m=16, num_warps=4), dict(block_m=16, num_warps=8),
             dict(block_m=32, num_warps=8), dict(block_m=4, groups_per_program=8, num_warps=4),
             dict(block_m=8, groups_per_program=8, num_warps=4), dict(block_m=8, groups_per_program=8, num_warps=8),
             dict(block_m=32, num_warps=16), dict(block_m=1, groups_per_program=32, num_warps=4),
             dict(block_m=2, groups_per_program=16, num_warps=4),
             dict(block_m=1, groups_per_program=64, num_warps=8),
             dict(block_m=2, groups_per_program=32, num_warps=8)]
    # per-token rows over QuantTuning.row_loop_min_k columns take the looped kernel
    # (fastpath.quant._kernels._row_loop_kernel): its tile (rows, columns per chunk, warps), and
    # one [1, next_pow2(K)] tile per row instead
    rows = [dict()] + [dict(row_loop_tile=t) for t in [
        (1, 2048, 4), (1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 2048, 4), (2, 2048, 8),
        (1, 2048, 2)]] + [dict(row_loop_min_k=1 << 40)]
    if args.tiles:
        import ast
        tiles = [ast.literal_eval(t) for t in args.tiles.split(";")]
    caps = [int(c) or None for c in args.maxnreg.split(",")] if args.maxnreg else [None]
    out = {}
    for name, (make, fn, nbytes_of, _) in ks.items():
        inputs = [make(M, K) for _ in range(4)]
        nbytes = nbytes_of(M, K)
        configs = rows if name == "fp8_per_token" and not args.tiles else tiles
        configs = [dict(c, maxnreg=r) if r else dict(c) for c in configs for r in caps]
        best = None
        for cfg in configs:
            cfg_name = str(cfg)
            try:
                kw = _with_tuning(cfg)
                fn(*inputs[0], **kw)
                torch.cuda.synchronize()
                ms = bench_fn(lambda *t: fn(*t, **kw), inputs, rep_ms=100)
            except Exception as e:
                print(f"  {name} {cfg_name}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            tb = nbytes / (ms * 1e-3) / 1e12
            print(f"  {name:34s} {cfg_name:52s} {ms * 1e3:8.1f} us {tb:6.3f} TB/s", flush=True)
            out.setdefault(name, []).append({"cfg": cfg_name, "us": ms * 1e3, "TBps": tb})
            if best is None or tb > best[1]:
                best = (cfg_name, tb)
        print(f"BEST {name}: {best}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "tune.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
