"""Checkpoint conversion speed: one DeepSeek-V3 expert weight, and the projection to the whole model.

CPU (one core, NumPy): a 7168 x 2048 FP8 weight (float8_e4m3fn + 128x128 FP32 ``weight_scale_inv``,
as DeepSeek-V3 ships ``down_proj``) converted to each target layout the way ``moeref convert``
does it (:func:`moeref.checkpoint.convert._convert_module`'s two steps), timed separately:

* ``convert``: source decode (float32, ``precision="float32"``) + the target's quantizer + the
  layout's tensors (what is written);
* ``+ report``: the exact report against the source (lossless, max |err|, rel L2, SQNR, worst
  block) and the lossless candidates, i.e. :func:`moeref.quant.requantize` as the converter
  calls it.

The projection multiplies the per-element time by the quantized elements of DeepSeek-V3 (671B:
61 layers, 3 dense + 58 MoE with 256 routed + 1 shared expert, MLA attention; config_671B.json),
on one core and per ``--workers`` cores.

GPU (``--gpu``, needs CUDA; the lead runs it): the Triton fast path on the same weight, timed
with CUDA events against a device-to-device copy of the source bytes (the bandwidth ceiling), and
checked bit for bit against the CPU path. The same check is the gpu-marked test
``tests/test_checkpoint_gpu.py``.

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_convert.py [--repeat 3] [--gpu]``.
"""
from __future__ import annotations

import argparse
import os
import time

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

from moeref.checkpoint import get_layout  # noqa: E402
from moeref.checkpoint.layouts import ModuleData  # noqa: E402
from moeref.quant import fp8_block, quantize, requantize  # noqa: E402

TARGETS = ("modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4", "gptoss-mxfp4", "deepseek-fp8-ue8m0")


def deepseek_v3_quantized_elements() -> int:
    """Elements of every FP8 weight of DeepSeek-V3 671B (config_671B.json: dim 7168, 61 layers,
    first 3 dense with inter_dim 18432, moe_inter_dim 2048, 256 routed + 1 shared expert, MLA
    q_lora_rank 1536, kv_lora_rank 512, 128 heads, qk_nope 128 + qk_rope 64, v_head 128)."""
    H, L, dense, I_d, I_m, E = 7168, 61, 3, 18432, 2048, 256
    heads, nope, rope, vdim, q_rank, kv_rank = 128, 128, 64, 128, 1536, 512
    attn = (q_rank * H + heads * (nope + rope) * q_rank + (kv_rank + rope) * H
            + heads * (nope + vdim) * kv_rank + H * heads * vdim)
    mlp_dense = 3 * H * I_d
    mlp_moe = (E + 1) * 3 * H * I_m
    return L * attn + dense * mlp_dense + (L - dense) * mlp_moe


def source_weight(seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((7168, 2048)) * 0.02).astype(np.float32)
    return quantize(w, fp8_block((128, 128), "fp32", "deepgemm"))


def _best(fn, repeat):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return best, out


def bench_cpu(repeat=3, workers=1):
    q = source_weight()
    n = q.codes.size
    total = deepseek_v3_quantized_elements()
    print(f"source: {q.shape} FP8 E4M3 + 128x128 FP32 scales; DeepSeek-V3 quantized elements: "
          f"{total / 1e9:.1f} G ({total / n:.0f} such weights)")
    print(f"{'target':22s} {'convert s':>10s} {'+report s':>10s} {'method':>16s} {'SQNR dB':>8s} "
          f"{'V3 convert h':>12s} {'V3 +report h':>12s}")
    rows = []
    for name in TARGETS:
        layout = get_layout(name)
        scheme = layout.scheme()

        def convert():
            x = q.dequantize(np.float32)
            return layout.write("m", ModuleData("m", {}, q=quantize(x, scheme)))

        t1, _ = _best(convert, repeat)

        def full():
            t, rep = requantize(q, scheme, precision="float32")
            layout.write("m", ModuleData("m", {}, q=t))
            return rep

        t2, rep = _best(full, repeat)
        h1 = t1 * total / n / 3600 / workers
        h2 = t2 * total / n / 3600 / workers
        rows.append((name, t1, t2, rep.method, rep.sqnr_db, h1, h2))
        print(f"{name:22s} {t1:10.3f} {t2:10.3f} {rep.method:>16s} {rep.sqnr_db:8.1f} "
              f"{h1:12.2f} {h2:12.2f}")
    return rows


def bench_end_to_end(n_weights=4, target="ct-nvfp4", verify=False):
    """``convert_checkpoint`` on a synthetic 2-shard DeepSeek-style checkpoint of ``n_weights``
    such weights (reading, converting, report, writing, hashing): CPU seconds per weight."""
    import shutil
    import tempfile

    from moeref.checkpoint import ConvertOptions, ShardWriter, convert_checkpoint

    from moeref.checkpoint.engines import cuda_available

    cuda_available()  # imports torch (about a second of CPU, once per process): not conversion time
    q = source_weight()
    src_layout = get_layout("deepseek-fp8")
    root = tempfile.mkdtemp(prefix="moeref-bench-")
    try:
        src = os.path.join(root, "src")
        os.makedirs(src)
        wm = {}
        for s in range(2):
            shard = f"model-{s + 1:05d}-of-00002.safetensors"
            w = ShardWriter(os.path.join(src, shard))
            for i in range(s, n_weights, 2):
                for name, arr in src_layout.write(f"model.layers.{i}.mlp.experts.0.down_proj",
                                                  ModuleData("m", {}, q=q)):
                    w.add(name, arr)
                    wm[name] = shard
            w.close()
        import json
        json.dump({"weight_map": wm}, open(os.path.join(src, "model.safetensors.index.json"), "w"))
        json.dump({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
                  open(os.path.join(src, "config.json"), "w"))
        t0, w0 = time.process_time(), time.perf_counter()
        rep = convert_checkpoint(src, os.path.join(root, "dst"),
                                 ConvertOptions(target=target, verify=verify))
        cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    finally:
        shutil.rmtree(root)
    per = cpu / n_weights
    total = deepseek_v3_quantized_elements()
    print(f"end to end, {n_weights} weights -> {target}{' --verify' if verify else ''}: "
          f"{per:.3f} CPU s per weight (wall {wall / n_weights:.3f} s); DeepSeek-V3 on one core: "
          f"{per * total / q.codes.size / 3600:.2f} h; modules {len(rep.modules)}")
    return per


def bench_gpu(repeat=20):
    """Triton fast path on CUDA: quantize time vs a device copy of the input, bit-identical check."""
    import torch

    from fastpath.quant import quantize as fast_quantize

    q = source_weight()
    x32 = q.dequantize(np.float32)
    xt = torch.from_numpy(x32).cuda()
    out = {}
    for name in ("modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4"):
        scheme = get_layout(name).scheme()
        ref = quantize(x32, scheme)
        got = fast_quantize(xt, scheme).to_reference()
        same = (np.array_equal(got.codes, ref.codes) and np.array_equal(got.scales, ref.scales)
                and got.global_scale == ref.global_scale)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            fast_quantize(xt, scheme)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeat):
            fast_quantize(xt, scheme)
        end.record()
        torch.cuda.synchronize()
        t_q = start.elapsed_time(end) / repeat / 1e3
        dst = torch.empty_like(xt)
        start.record()
        for _ in range(repeat):
            dst.copy_(xt)
        end.record()
        torch.cuda.synchronize()
        t_c = start.elapsed_time(end) / repeat / 1e3
        bytes_moved = xt.numel() * 4 + ref.nbytes  # read float32, write codes + scales
        copy_bw = 2 * xt.numel() * 4 / t_c
        frac = bytes_moved / t_q / copy_bw
        total = deepseek_v3_quantized_elements()
        out[name] = (t_q, frac, same)
        print(f"{name:16s} quantize {t_q * 1e6:8.1f} us  {bytes_moved / t_q / 1e9:7.1f} GB/s = "
              f"{100 * frac:5.1f}% of copy ({copy_bw / 1e9:.0f} GB/s)  bit-identical: {same}  "
              f"V3 kernel time {t_q * total / xt.numel():.0f} s")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="cores for the projection")
    ap.add_argument("--gpu", action="store_true", help="also run the CUDA fast path")
    args = ap.parse_args()
    bench_cpu(args.repeat, args.workers)
    bench_end_to_end()
    bench_end_to_end(verify=True)
    if args.gpu:
        bench_gpu()


if __name__ == "__main__":
    main()
