"""One launch of each benchmark kernel at the large size, for a hardware-counter profiler.

Each case is run twice outside the profiled range (compilation, autotuning of nothing, warm
caches), then once between ``cudaProfilerStart``/``cudaProfilerStop``, so that

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section SchedulerStats \\
        python3 bench/profile_gpu.py [NAME ...]

reads the counters of exactly the kernels of one call per case (the Triton data kernel and its
small helpers: per-tensor amax passes, dispatch histograms). Names: see ``--list``. Without a
profiler the script just runs (a smoke test of the cases).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastpath import dispatch as D  # noqa: E402
from fastpath import fused as F  # noqa: E402
from fastpath import quant as Q  # noqa: E402
from moeref.quant import fp8_group, fp8_per_token, mxfp4, mxfp8  # noqa: E402
from moeref.quant.nvfp4 import nvfp4  # noqa: E402


def cases(M=16384, K=7168, E=256, top_k=8):
    """name -> zero-argument callable (inputs made once, on the GPU)."""
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(M, 2 * K, device=dev, dtype=torch.bfloat16)
    g_enc = 2688.0 / float(x.float().abs().amax())
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(M, E, generator=g, device=dev).argsort(dim=1)[:, :top_k].int().contiguous()
    w = torch.rand(M, top_k, generator=g, device=dev)
    w = w / w.sum(1, keepdim=True)
    perm = D.moe_permute(x, ids, E, validate=False)
    return {
        "fp8_1x128_default": lambda: Q.quantize(x, fp8_group(128)),
        "fp8_1x128_deepgemm": lambda: Q.quantize(x, fp8_group(128, "fp32", "deepgemm")),
        "fp8_per_token": lambda: Q.quantize(x, fp8_per_token()),
        "mxfp8": lambda: Q.quantize(x, mxfp8(), scale_layout="swizzled_128x4"),
        "mxfp4": lambda: Q.quantize(x, mxfp4(), scale_layout="swizzled_128x4"),
        "nvfp4_static": lambda: Q.quantize(x, nvfp4(preset="vllm"), scale_layout="swizzled_128x4",
                                           global_scale=g_enc),
        "silu_fp8": lambda: F.silu_and_mul_quant_fp8(gu, fp8_group(128)),
        "swigluoai_fp8": lambda: F.swigluoai_quant_fp8(gu, 1.702, 7.0, fp8_group(128)),
        "dequant": (lambda q: lambda: Q.dequantize(q, torch.bfloat16))(Q.quantize(x, fp8_group(128))),
        "permute": lambda: D.moe_permute(x, ids, E, validate=False),
        "contiguous": lambda: D.to_contiguous(x, ids, E, 128, m_sum="worst_case", validate=False),
        "masked": lambda: D.to_masked(x, ids, E, None, validate=False),
        "unpermute": lambda: D.moe_unpermute(perm.hidden, w, perm.inv_permuted_idx,
                                             perm.expert_first_token_offset, out_dtype=torch.bfloat16),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    cs = cases()
    if a.list:
        print("\n".join(cs))
        return 0
    for name in a.names or list(cs):
        fn = cs[name]
        fn()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("profiled", name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
