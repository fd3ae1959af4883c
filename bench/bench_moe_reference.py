"""Time the exact reference MoE layer at DeepSeek-V3 shape on the CPU.

Shape: 128 tokens, 256 experts, top-8, hidden 7168, intermediate 2048 (w13 [4096, 7168], w2
[7168, 2048] per expert), FP8 E4M3 weights with 128x128 FP32 block scales, FP8 1x128 activations
(dynamic, DeepGEMM), SiLU-and-mul, intermediate re-quantized 1x128. FLOPs counted as
``2 * M * k * (2N * K + K * N)`` (the expert GEMMs; routing, quantization and the activation are not
counted).

Weights: the full layer holds 11.3 GB of FP8 codes (90 GB as float64 element values), so the 256
experts share ``--pool`` distinct expert tensors (random valid E4M3 codes and random positive block
scales, built directly as QuantizedTensors). The reference decodes each distinct tensor once per call
(:class:`moeref.gemm.ExpertOperands`); the script also times one decode, so the cost of 256 distinct
experts can be read off: ``time + (256 - pool) * decode``.

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_moe_reference.py [--tokens 128] [--pool 8]``
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # BLAS threads must be set before NumPy loads (see --threads)
    _t = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
    for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_v, _t)

import numpy as np


def random_fp8_block_weight(rng, rows: int, cols: int, scheme):
    from moeref.quant import QuantizedTensor

    codes = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes (E4M3FN: S.1111.111)
    grid = (-(-rows // 128), -(-cols // 128))
    scales = (rng.uniform(0.5, 1.0, size=grid) / 448.0 / np.sqrt(cols) * 4).astype(np.float32)
    return QuantizedTensor(codes=codes, scales=scales, scheme=scheme, shape=(rows, cols))


def main(argv=None) -> None:
    from moeref.gemm import as_operand
    from moeref.moe import MoEQuant, MoEWeights, fused_moe
    from moeref.quant import fp8_block, fp8_group
    from moeref.routing import grouped_topk

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--pool", type=int, default=8, help="distinct expert weight tensors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="BLAS threads (default 1: each GEMM has ~4 rows, and a busy 2-core box makes "
                        "OpenBLAS threads spin; measured 3-10x slower with 2 threads under load)")
    a = p.parse_args(argv)

    rng = np.random.default_rng(a.seed)
    m, e, k, hid, inter = a.tokens, a.experts, a.top_k, a.hidden, a.intermediate
    t0 = time.perf_counter()
    wscheme = fp8_block()
    pool13 = [random_fp8_block_weight(rng, 2 * inter, hid, wscheme) for _ in range(a.pool)]
    pool2 = [random_fp8_block_weight(rng, hid, inter, wscheme) for _ in range(a.pool)]
    weights = MoEWeights([pool13[i % a.pool] for i in range(e)], [pool2[i % a.pool] for i in range(e)], "gate_up")
    x = rng.standard_normal((m, hid)).astype(np.float32)
    logits = rng.standard_normal((m, e)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(e)).astype(np.float32)
    n_group = 8 if e % 8 == 0 and e >= 16 else 1  # DeepSeek-V3: 8 groups, 4 kept
    routing = grouped_topk(logits, k, n_group, min(4, n_group), scoring="sigmoid", bias=bias, renormalize=True,
                           routed_scaling_factor=2.5)
    quant = MoEQuant(fp8_group(128), fp8_group(128), "FP8 1x128 x 128x128")
    t_build = time.perf_counter() - t0

    t0 = time.perf_counter()
    as_operand(pool13[0])
    as_operand(pool2[0])
    t_decode = time.perf_counter() - t0

    t0, c0 = time.perf_counter(), time.process_time()
    out = fused_moe(x, weights, routing.weights, routing.ids, quant=quant, out_dtype=np.float32)
    t_layer, c_layer = time.perf_counter() - t0, time.process_time() - c0

    slots = int((routing.ids >= 0).sum())
    flops = 2.0 * slots * (2 * inter * hid + hid * inter)
    print(f"DeepSeek-V3 MoE layer reference: {m} tokens, {e} experts, top-{k}, hidden {hid}, "
          f"intermediate {inter}, {quant.name}")
    print(f"  BLAS threads: {os.environ.get('OPENBLAS_NUM_THREADS')}, load average: {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"  setup (weights pool of {a.pool}, routing): {t_build:.2f} s")
    print(f"  decode of one expert's w13 + w2: {t_decode:.3f} s")
    print(f"  reference layer: {t_layer:.2f} s for {flops / 1e9:.1f} GFLOP "
          f"({flops / t_layer / 1e9:.2f} GFLOP/s float64, exact per 128-block); CPU time {c_layer:.2f} s "
          "(wall > CPU when the machine is shared)")
    print(f"  with 256 distinct experts (extrapolated): {t_layer + (e - a.pool) * t_decode:.1f} s")
    print(f"  output: shape {out.shape}, max |out| = {float(np.abs(out).max()):.3g}, finite: {bool(np.isfinite(out).all())}")


if __name__ == "__main__":
    main()
