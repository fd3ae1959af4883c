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

from bench.bench_quant_gpu import kernels  # noqa: E402
from fastpath import dispatch as D  # noqa: E402


def cases(M=16384, K=7168, E=256, top_k=8, device="cuda"):
    """name -> zero-argument callable (inputs made once): every quantization case of the
    benchmark (:func:`bench.bench_quant_gpu.kernels`, its own names) and the dispatch kernels
    (16384 tokens, top-8 of 256 experts, as bench/bench_dispatch_gpu.py times them)."""
    out = {}
    for name, (make, run, _, _) in kernels(device).items():
        out[name] = (lambda run, inputs: lambda: run(*inputs))(run, make(M, K))
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.rand(M, E, generator=g, device=device).argsort(dim=1)[:, :top_k].int().contiguous()
    w = torch.rand(M, top_k, generator=g, device=device)
    w = w / w.sum(1, keepdim=True)
    perm = D.moe_permute(x, ids, E, validate=False)
    out.update({
        "permute": lambda: D.moe_permute(x, ids, E, validate=False),
        "contiguous": lambda: D.to_contiguous(x, ids, E, 128, m_sum="worst_case", validate=False),
        "masked": lambda: D.to_masked(x, ids, E, None, validate=False),
        "unpermute": lambda: D.moe_unpermute(perm.hidden, w, perm.inv_permuted_idx,
                                             perm.expert_first_token_offset, out_dtype=torch.bfloat16),
    })
    return out


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
