"""Study (Hopper GPU): could the tensor cores produce the emulator's block accumulators? Equality and time.

The emulated profiles (``DEEPGEMM_FP8_EXACT``, ``TRITON_FP8_BLOCK_EXACT``) predict every 128-column block
accumulator of an FP8 GEMM with the device emulator (:func:`moeref.gemm.device_hopper_fp8.device_deepgemm_rows`,
a few integer operations per product on the CUDA cores). On sm_90 a Triton ``tl.dot`` of two E4M3 tiles with
K = 128 into a cleared FP32 accumulator is four chained ``wgmma ... k32`` instructions, the instruction the
emulator's model was calibrated on (docs/hopper-fp8-accumulation.md). This script computes the block accumulators
both ways on random E4M3 codes over the whole range (``--rows`` x ``--cols``, K = ``--k``), counts the
accumulators that differ (expected: 0) and times both. On their agreement rests
:data:`moeref.gemm.device_hopper_fp8.ACCUMULATOR_SOURCE`: on Hopper ``device_deepgemm_rows`` takes the
accumulators from the tensor cores and proves them per call on a sample of rows with the emulator; this study
asks it for the emulator (``source="emulator"``) on every row.

    python bench/studies/wgmma_block_accumulators.py [--rows 4096] [--cols 4096] [--k 7168] [--out FILE]

Under ``TRITON_INTERPRET=1`` (CPU) it runs at a tiny shape to check its plumbing only: the interpreter's
``tl.dot`` is not the tensor core, so differences are expected there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _block_acc(a_ptr, b_ptr, out_ptr, M, N, K, NB, BM: tl.constexpr, BN: tl.constexpr):
    """``out[kb, m, n]`` = the FP32 tensor-core accumulator of ``a[m, kb*128:(kb+1)*128] . b[n, same]`` from a
    cleared accumulator (one ``tl.dot`` of K = 128); ``a``/``b`` uint8 E4M3 codes."""
    pid_m, pid_n, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    k = kb * 128 + tl.arange(0, 128)
    a = tl.load(a_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=(m < M)[:, None], other=0)
    b = tl.load(b_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=(n < N)[:, None], other=0)
    acc = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(b.to(tl.float8e4nv, bitcast=True)),
                 out_dtype=tl.float32)
    tl.store(out_ptr + (kb * M + m[:, None].to(tl.int64)) * N + n[None, :], acc,
             mask=(m < M)[:, None] & (n < N)[None, :])


def _codes(shape, gen, dev):
    c = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)
    c[(c & 0x7F) == 0x7F] -= 1  # no NaN codes
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import numpy as np

    from moeref.gemm import StackedExperts
    from moeref.gemm.device import DeviceOperand
    from moeref.gemm.device_hopper_fp8 import device_deepgemm_rows

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m, n, k = (args.rows, args.cols, args.k) if dev == "cuda" else (16, 32, 256)
    nb = k // 128
    gen = torch.Generator(device=dev).manual_seed(0)
    a, b = _codes((m, k), gen, dev), _codes((n, k), gen, dev)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def tensor_cores():
        out = torch.empty((nb, m, n), dtype=torch.float32, device=dev)
        _block_acc[(triton.cdiv(m, 128), triton.cdiv(n, 128), nb)](a, b, out, m, n, k, nb, BM=128, BN=128,
                                                                   num_warps=8)
        return out

    op = DeviceOperand(None, a, "e4m3fn", torch.ones((m, nb), dtype=torch.float64, device=dev), (1, 128), True)
    w = StackedExperts(b[None], torch.ones((1, -(-n // 128), nb), dtype=torch.float64, device=dev), "e4m3fn",
                       (128, 128), (n, k))
    rows = np.zeros(m, dtype=np.int64)

    def emulator():
        return device_deepgemm_rows(op, rows, w, block_acc=True, source="emulator")[2]  # [m, nb, n]

    res = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter: plumbing only)",
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=m, cols=n, k=k, torch=torch.__version__,
               triton=triton.__version__)
    for name, fn in (("tensor_cores", tensor_cores), ("emulator", emulator)):
        fn()
        sync()
        t0 = time.perf_counter()
        got = fn()
        sync()
        res[f"{name}_s"] = time.perf_counter() - t0
        if name == "tensor_cores":
            tc = got
        else:
            em = got.permute(1, 0, 2)
    diff = tc != em
    res["accumulators"] = int(diff.numel())
    res["differing"] = int(diff.sum())
    if res["differing"]:
        i = torch.nonzero(diff)[0].tolist()
        res["first_difference"] = dict(block_row_col=i, tensor_cores=float(tc[tuple(i)]), emulator=float(em[tuple(i)]))
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
