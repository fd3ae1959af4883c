"""Time the exact reference MoE layer at DeepSeek-V3 shape on the CPU.

Shape: 128 tokens, 256 experts, top-8, hidden 7168, intermediate 2048 (w13 [4096, 7168], w2
[7168, 2048] per expert), FP8 E4M3 weights with 128x128 FP32 block scales, FP8 1x128 activations
(dynamic, DeepGEMM), SiLU-and-mul, intermediate re-quantized 1x128. FLOPs counted as
``2 * M * k * (2N * K + K * N)`` (the expert GEMMs; routing, quantization and the activation are not
counted).

Weights (built before the timed region): by default every expert is distinct. The full layer holds
11.3 GB of FP8 codes, so the experts' code tensors are windows, at distinct shuffled offsets, of one
shared buffer of random valid E4M3 codes (``--code-mb``, 1 GiB by default: more than the L3 cache),
each with its own random positive FP32 block scales. They are :class:`moeref.quant.QuantizedTensor`
objects (a subclass that keeps the window instead of copying it), so the reference treats each one as
a separate expert and decodes every routed expert's codes inside the timed call: the time includes
decoding all of them. ``--pool P`` shares ``P`` fully random expert tensors across the experts instead
(the reference decodes the weights per GEMM call, so sharing saves no decoding).

The reference spreads each large GEMM over ``--workers`` threads (``moeref.gemm.exact.set_num_threads``;
results identical bit for bit for any count) with BLAS at ``--threads`` threads.

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_moe_reference.py [--tokens 128] [--workers 2] [--pool 8]``
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


def _fp8_codes(rng, size: int) -> np.ndarray:
    """``size`` uniform random E4M3 codes, NaN codes (S.1111.111) replaced by the max (S.1111.110)."""
    codes = rng.bit_generator.random_raw(-(-size // 8)).view(np.uint8)[:size]
    for start in range(0, size, 1 << 24):  # in place, 16 MiB at a time
        part = codes[start:start + (1 << 24)]
        part -= (part & 0x7F) == 0x7F
    return codes


def _block_scales(rng, rows: int, cols: int) -> np.ndarray:
    grid = (-(-rows // 128), -(-cols // 128))
    return (rng.uniform(0.5, 1.0, size=grid) / 448.0 / np.sqrt(cols) * 4).astype(np.float32)


def random_fp8_block_weight(rng, rows: int, cols: int, scheme):
    from moeref.quant import QuantizedTensor

    codes = _fp8_codes(rng, rows * cols).reshape(rows, cols)
    return QuantizedTensor(codes=codes, scales=_block_scales(rng, rows, cols), scheme=scheme, shape=(rows, cols))


def distinct_fp8_block_weights(rng, num: int, rows: int, cols: int, scheme, buffer: np.ndarray) -> list:
    """``num`` distinct FP8 128x128 weights ``[rows, cols]``: code windows of ``buffer`` at shuffled,
    evenly spaced offsets, each with its own random block scales (no copy of the codes)."""
    from moeref.quant import QuantizedTensor

    class WindowTensor(QuantizedTensor):
        """A QuantizedTensor whose codes are a read-only window of a shared buffer (not copied)."""

        def __post_init__(self):  # built below from valid parts; QuantizedTensor would copy the codes
            pass

    size = rows * cols
    if buffer.size < size + num - 1:
        raise ValueError(f"the code buffer ({buffer.size} bytes) is too small for {num} distinct windows of {size}")
    stride = (buffer.size - size) // max(num - 1, 1)
    offsets = rng.permutation(num) * stride
    return [WindowTensor(codes=buffer[o:o + size].reshape(rows, cols), scales=_block_scales(rng, rows, cols),
                         scheme=scheme, shape=(rows, cols)) for o in offsets.tolist()]


def main(argv=None) -> None:
    from moeref.gemm.exact import get_num_threads, set_num_threads
    from moeref.moe import MoEQuant, MoEWeights, fused_moe
    from moeref.quant import fp8_block, fp8_group
    from moeref.routing import grouped_topk

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--pool", type=int, default=0,
                   help="share this many random expert tensors across the experts (0: every expert distinct)")
    p.add_argument("--code-mb", type=int, default=1024,
                   help="MiB of shared codes the distinct experts' windows are cut from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None,
                   help="threads per GEMM in the reference (default: MOEREF_NUM_THREADS or the core count)")
    p.add_argument("--threads", type=int, default=1,
                   help="BLAS threads (default 1: each GEMM has ~4 rows, and a busy 2-core box makes "
                        "OpenBLAS threads spin; measured 3-10x slower with 2 threads under load)")
    a = p.parse_args(argv)

    rng = np.random.default_rng(a.seed)
    m, e, k, hid, inter = a.tokens, a.experts, a.top_k, a.hidden, a.intermediate
    t0 = time.perf_counter()
    wscheme = fp8_block()
    if a.pool > 0:
        pool13 = [random_fp8_block_weight(rng, 2 * inter, hid, wscheme) for _ in range(a.pool)]
        pool2 = [random_fp8_block_weight(rng, hid, inter, wscheme) for _ in range(a.pool)]
        w13 = [pool13[i % a.pool] for i in range(e)]
        w2 = [pool2[i % a.pool] for i in range(e)]
        what = f"a pool of {a.pool} expert tensors shared by the {e} experts"
    else:
        buffer = _fp8_codes(rng, max(a.code_mb << 20, 2 * inter * hid + e))
        buffer.setflags(write=False)
        w13 = distinct_fp8_block_weights(rng, e, 2 * inter, hid, wscheme, buffer)
        w2 = distinct_fp8_block_weights(rng, e, hid, inter, wscheme, buffer)
        what = f"{e} distinct experts (code windows of a {buffer.nbytes / 2**20:.0f} MiB buffer)"
    weights = MoEWeights(w13, w2, "gate_up")
    x = rng.standard_normal((m, hid)).astype(np.float32)
    logits = rng.standard_normal((m, e)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(e)).astype(np.float32)
    n_group = 8 if e % 8 == 0 and e >= 16 else 1  # DeepSeek-V3: 8 groups, 4 kept
    routing = grouped_topk(logits, k, n_group, min(4, n_group), scoring="sigmoid", bias=bias, renormalize=True,
                           routed_scaling_factor=2.5)
    quant = MoEQuant(fp8_group(128), fp8_group(128), "FP8 1x128 x 128x128")
    t_build = time.perf_counter() - t0
    if a.workers is not None:
        set_num_threads(a.workers)

    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    out = fused_moe(x, weights, routing.weights, routing.ids, quant=quant, out_dtype=np.float32)
    t_layer, c_layer = time.perf_counter() - t0, time.process_time() - c0

    slots = int((routing.ids >= 0).sum())
    used = np.unique(routing.ids[routing.ids >= 0])
    distinct_used = len({id(w13[i]) for i in used.tolist()})
    flops = 2.0 * slots * (2 * inter * hid + hid * inter)
    print(f"DeepSeek-V3 MoE layer reference: {m} tokens, {e} experts, top-{k}, hidden {hid}, "
          f"intermediate {inter}, {quant.name}")
    print(f"  weights: {what}; the routing uses {used.size} experts ({distinct_used} distinct weight tensors, "
          f"each decoded inside the timed call)")
    print(f"  threads per GEMM: {get_num_threads()}, BLAS threads: {os.environ.get('OPENBLAS_NUM_THREADS')}, "
          f"load average before/after: {load0:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"  setup (weights, routing; not timed): {t_build:.2f} s")
    print(f"  reference layer: {t_layer:.2f} s wall, {c_layer:.2f} s CPU, for {flops / 1e9:.1f} GFLOP "
          f"({flops / t_layer / 1e9:.2f} GFLOP/s float64, exact per 128-block)")
    print(f"  output: shape {out.shape}, max |out| = {float(np.abs(out).max()):.3g}, finite: {bool(np.isfinite(out).all())}")


if __name__ == "__main__":
    main()
