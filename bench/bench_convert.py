"""Checkpoint conversion speed: one DeepSeek-V3 expert weight, and the projection to the whole model.

CPU (one core, NumPy): a 7168 x 2048 FP8 weight (float8_e4m3fn + 128x128 FP32 ``weight_scale_inv``,
as DeepSeek-V3 ships ``down_proj``) converted to each target layout the way ``moeref convert``
does it (:func:`moeref.checkpoint.shard._convert_module`'s two steps), timed separately:

* ``convert``: source decode (float32, ``precision="float32"``) + the target's quantizer + the
  layout's tensors (what is written);
* ``+ report``: the exact report against the source (lossless, max |err|, rel L2, SQNR, worst
  block) and the lossless candidates, i.e. :func:`moeref.quant.requantize` as the converter
  calls it.

The projection multiplies the per-element time by the quantized elements of DeepSeek-V3 (671B:
61 layers, 3 dense + 58 MoE with 256 routed + 1 shared expert, MLA attention; config_671B.json),
on one core and per ``--workers`` cores.

GPU (``--gpu``, needs CUDA): :func:`bench_gpu` times the fused FP8-block -> FP4 conversion of
the same weight on the device (:mod:`fastpath.requant`), the unfused path it replaced, and a
device copy of the same bytes (its docstring defines what is timed), checks every result bit for
bit against the CPU reference and writes the figures to ``--json`` (docs/data/convert_gpu_*.json,
from which ``bench/report_convert.py`` makes the table of docs/convert.md); then the whole
command on a synthetic checkpoint with the GPU engine.

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_convert.py [--repeat 3] [--gpu --json FILE]``.
"""
from __future__ import annotations

import argparse
import os
import re
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


def _median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def bench_gpu(rounds=21, reps=20, n_src=8, json_path=None):
    """The GPU conversion of one 7168 x 2048 DeepSeek-V3 FP8 weight, against a device copy.

    What is timed (device time, CUDA events around a CUDA graph of ``reps`` back-to-back calls,
    so host launch overhead is out; ``n_src`` different source weights in rotation, 117 MB of
    codes, more than the H100's 50 MB L2, so every call reads its source from HBM):

    * ``fused``: :func:`fastpath.requant.fp8_block_to_fp4`, FP8 codes + 128x128 FP32 scales on
      the device to the target's codes + scales (+ NVFP4's global) on the device: for NVFP4
      the zeroing, the amax pass (which computes the factors) and the data pass, the last two
      launched with Programmatic Dependent Launch where the GPU has it (the default); for MXFP4
      the data pass (the default method; ``persistent``: the sweep).
    * ``unfused``: the path the converter took before: the source decoded to float32 on the
      device (``codes.float() * scales`` broadcast) and :func:`fastpath.quant.quantize`.
    * ``copy``: ``dst.copy_(src)`` of ``(source bytes + target bytes) / 2`` bytes, so that it
      reads plus writes exactly the bytes the conversion must move (source read once, target
      written once); the fraction is copy time / conversion time.

    Rounds interleave the variants (each round times every variant once, in turn): the median
    and min-max over rounds; the fraction of copy is the median (min-max) of the per-round
    ratios (the copy and the conversion timed in the same round, seconds apart). ``host``
    columns: the same calls issued eagerly from Python (one call after another, synchronized
    at the end): what one tensor costs including the launch
    overhead, which the device-only figure excludes. Codes, scales and global of every target
    are checked bit for bit against the CPU reference on the first source."""
    import json
    import time as _t

    import torch

    from fastpath import requant
    from fastpath.quant import quantize as fast_quantize

    dev = torch.device("cuda")
    qs = [source_weight(seed) for seed in range(n_src)]
    srcs = [requant.from_reference(q, dev) for q in qs]
    M, K = qs[0].shape
    x32 = qs[0].dequantize(np.float32)
    targets = ("modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4")
    variants, nbytes, checks = {}, {}, {}

    def decode_dev(c, s, b):
        v = c.view(torch.float8_e4m3fn).float().view(M // b[0], b[0], K // b[1], b[1])
        return (v * s[:, None, :, None]).view(M, K)

    for name in targets:
        scheme = get_layout(name).scheme()
        ref = quantize(x32, scheme)
        got = requant.fp8_block_to_fp4(*srcs[0], scheme).to_reference()
        x_dev = decode_dev(*srcs[0])
        old = fast_quantize(x_dev, scheme).to_reference()
        same = lambda g: bool(np.array_equal(g.codes, ref.codes)  # noqa: E731
                              and np.array_equal(g.scales, ref.scales)
                              and g.global_scale == ref.global_scale)
        checks[name] = {"fused_bit_identical": same(got), "unfused_bit_identical": same(old)}
        src_bytes = M * K + srcs[0][1].numel() * 4
        dst_bytes = M * ((K + 1) // 2) + ref.scales.size + (4 if ref.global_scale is not None else 0)
        nbytes[name] = (src_bytes, dst_bytes)
        variants[f"fused {name}"] = (lambda i, sc=scheme: requant.fp8_block_to_fp4(*srcs[i % n_src], sc))
        variants[f"unfused {name}"] = (lambda i, sc=scheme: fast_quantize(decode_dev(*srcs[i % n_src]), sc))
    copy_n = {}
    for name in targets:
        n = sum(nbytes[name]) // 2
        copy_n[name] = n
    bufs = {n: ([torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(n_src)],
                [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(n_src)])
            for n in set(copy_n.values())}
    for n, (a, b) in bufs.items():
        for t in a:
            t.random_(0, 255)
        variants[f"copy {n}"] = (lambda i, a=a, b=b: b[i % n_src].copy_(a[i % n_src]))

    graphs = {}
    for key, fn in variants.items():
        for i in range(3):
            fn(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                fn(i)
        graphs[key] = g
    torch.cuda.synchronize()
    dev_t = {k: [] for k in variants}
    host_t = {k: [] for k in variants}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for key, g in graphs.items():
            g.replay()  # warm
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            dev_t[key].append(start.elapsed_time(end) / 1e3 / reps)
            t0 = _t.perf_counter()
            for i in range(reps):
                variants[key](i)
            torch.cuda.synchronize()
            host_t[key].append((_t.perf_counter() - t0) / reps)
    total = deepseek_v3_quantized_elements()
    rows = []
    print(f"{torch.cuda.get_device_name()}: {M} x {K} FP8 + 128x128 FP32 scales; device time per "
          f"call, median (min-max) of {rounds} interleaved rounds, graphs of {reps} calls")
    for name in targets:
        cp = f"copy {copy_n[name]}"
        for kind in ("fused", "unfused"):
            key = f"{kind} {name}"
            med, lo, hi = _median(dev_t[key]), min(dev_t[key]), max(dev_t[key])
            cmed = _median(dev_t[cp])
            per_round = [c / t for c, t in zip(dev_t[cp], dev_t[key])]  # same round, seconds apart
            frac = _median(per_round)
            fr = [min(per_round), max(per_round)]
            moved = sum(nbytes[name])
            row = {"target": name, "path": kind, "seconds_median": med, "seconds_min": lo,
                   "seconds_max": hi, "copy_seconds_median": cmed,
                   "copy_seconds_min": min(dev_t[cp]), "copy_seconds_max": max(dev_t[cp]),
                   "bytes_source": nbytes[name][0], "bytes_target": nbytes[name][1],
                   "copy_bytes": copy_n[name], "fraction_of_copy": frac,
                   "fraction_of_copy_range": fr, "fraction_of_copy_per_round": per_round,
                   "spread": (hi - lo) / med, "GBps": moved / med / 1e9,
                   "copy_GBps": 2 * copy_n[name] / cmed / 1e9,
                   "host_seconds_median": _median(host_t[key]),
                   "v3_device_seconds": med * total / (M * K),
                   "bit_identical": checks[name][f"{kind}_bit_identical"]}
            rows.append(row)
            print(f"{key:24s} {med * 1e6:8.1f} us ({lo * 1e6:.1f}-{hi * 1e6:.1f})  "
                  f"{row['GBps']:7.0f} GB/s  {100 * frac:5.1f}% of copy ({row['copy_GBps']:.0f} GB/s, "
                  f"{cmed * 1e6:.1f} us)  host-issued {row['host_seconds_median'] * 1e6:8.1f} us  "
                  f"bit-identical {row['bit_identical']}  V3 {row['v3_device_seconds']:.1f} s")
    result = {"gpu": torch.cuda.get_device_name(), "date": _t.strftime("%Y-%m-%d", _t.gmtime()),
              "shape": [M, K], "source": "float8_e4m3fn + 128x128 float32 scales",
              "rounds": rounds, "reps_per_graph": reps, "rotating_sources": n_src,
              "torch": torch.__version__, "v3_quantized_elements": total, "rows": rows}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


# The sweep's tiles: (rows, groups per program, warps) of the data pass per target group size
# (the first is the default plan), (rows, columns, warps) of the NVFP4 amax pass (rows beyond a
# 128-row source block stack source blocks). The
# persistent launch (RequantTuning(method="persistent")): its amax tile (rows, columns), slot
# counters, barrier poll interval and programs per SM.
SWEEP_DATA = {16: [(8, 8, 1), (4, 8, 1), (8, 4, 1), (16, 8, 1), (16, 8, 2), (32, 8, 2)],
              32: [(16, 4, 2), (16, 4, 1), (8, 4, 1), (32, 4, 2), (32, 4, 4)]}
SWEEP_AMAX = [(128, 128, 8), (256, 128, 8), (512, 128, 16), (1024, 128, 32), (64, 128, 4)]
SWEEP_PERSISTENT_AMAX = [(16, 128), (64, 128)]
SWEEP_SLOTS = [16, 256]
SWEEP_SLEEP_NS = [0, 400]
SWEEP_PROGRAMS_PER_SM = [8, 16, 24]


def bench_gpu_sweep(json_path=None, rounds=9, reps=20, n_src=8, match=None):
    """Tile sweep of :func:`fastpath.requant.fp8_block_to_fp4` on the benchmark weight: every
    :data:`SWEEP_DATA` data tile (default amax tile) and every :data:`SWEEP_AMAX` amax tile
    (default data tile) per target; the persistent launch at its defaults and at
    :data:`SWEEP_PROGRAMS_PER_SM` programs per SM, for NVFP4 also with each
    :data:`SWEEP_PERSISTENT_AMAX` amax tile, :data:`SWEEP_SLOTS` counters and
    :data:`SWEEP_SLEEP_NS` poll interval; and the integer E4M3 decode against the hardware one
    (``requant._hw_decode``) at the default tiles; for NVFP4 the default without Programmatic
    Dependent Launch (``no-pdl``: the amax kernel, then the data kernel; with the 128 x 128 amax
    tile on 8 warps, the default before PDL) and with PDL for the data kernel only (``pdl, amax
    kernel in turn``: ``requant._PDL_AMAX`` off); ``match``: a regular
    expression, only the tunings whose name it finds are timed; each checked bit for bit against the CPU
    reference, timed as :func:`bench_gpu` times (graphs of ``reps`` calls over ``n_src``
    rotating weights), in interleaved rounds (bench.interleaved) with the copy of the same bytes.
    """
    import json

    import torch

    from bench.interleaved import machine_meta, time_interleaved
    from fastpath import requant

    dev = torch.device("cuda")
    qs = [source_weight(seed) for seed in range(n_src)]
    srcs = [requant.from_reference(q, dev) for q in qs]
    M, K = qs[0].shape
    x32 = qs[0].dequantize(np.float32)
    out = {"meta": machine_meta(), "shape": [M, K], "reps": reps, "rounds": rounds, "targets": {}}
    hw = requant._hw_decode
    for name in ("ct-nvfp4", "modelopt-nvfp4", "ct-mxfp4"):
        scheme = get_layout(name).scheme()
        ref = quantize(x32, scheme)
        gs = int(scheme.resolve_block((M, K))[-1])
        R = requant.RequantTuning
        tunings = {f"data {t}": R(*t) for t in SWEEP_DATA[gs]}
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        P_ = "persistent"
        tunings[P_] = R(method=P_)
        if scheme.family == "nvfp4":
            tunings.update({f"amax {t}": R(amax_block_m=t[0], amax_block_k=t[1], amax_warps=t[2])
                            for t in SWEEP_AMAX})
            tunings.update({f"{P_} amax {t}": R(method=P_, amax_block_m=t[0], amax_block_k=t[1])
                            for t in SWEEP_PERSISTENT_AMAX})
            tunings.update({f"{P_} slots {n}": R(method=P_, slots=n) for n in SWEEP_SLOTS})
            tunings.update({f"{P_} poll sleep {n} ns": R(method=P_, poll_sleep_ns=n)
                            for n in SWEEP_SLEEP_NS})
            tunings["no-pdl"] = R(pdl=False)
            tunings["no-pdl amax (128, 128, 8)"] = R(pdl=False, amax_block_m=128, amax_warps=8)
            tunings["pdl, amax kernel in turn"] = requant.DEFAULT_TUNING
        tunings.update({f"{P_} {p}/SM": R(method=P_, programs=p * sms)
                        for p in SWEEP_PROGRAMS_PER_SM})
        tunings["int-decode"] = requant.DEFAULT_TUNING
        if match:
            tunings = {k: v for k, v in tunings.items() if re.search(match, k)}
        cases, checks = {}, {}
        pdl_amax = requant._PDL_AMAX
        for key, tun in tunings.items():
            requant._hw_decode = (lambda d: False) if key == "int-decode" else hw
            requant._PDL_AMAX = pdl_amax and key != "pdl, amax kernel in turn"
            try:
                got = requant.fp8_block_to_fp4(*srcs[0], scheme, tuning=tun).to_reference()
                checks[key] = bool(np.array_equal(got.codes, ref.codes)
                                   and np.array_equal(got.scales, ref.scales)
                                   and got.global_scale == ref.global_scale)
                for i in range(3):
                    requant.fp8_block_to_fp4(*srcs[i], scheme, tuning=tun)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(reps):
                        requant.fp8_block_to_fp4(*srcs[i % n_src], scheme, tuning=tun)
                cases[key] = g.replay
            except Exception as e:  # a tile the compiler refuses: reported, not timed
                checks[key] = f"{type(e).__name__}: {e}"[:300]
            finally:
                requant._hw_decode = hw
                requant._PDL_AMAX = pdl_amax
        src_b = M * K + srcs[0][1].numel() * 4
        dst_b = M * ((K + 1) // 2) + ref.scales.size + (4 if ref.global_scale is not None else 0)
        n = (src_b + dst_b) // 2
        a = [torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255) for _ in range(n_src)]
        b = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(n_src)]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                b[i % n_src].copy_(a[i % n_src])
        cases["copy"] = g.replay
        res = time_interleaved(cases, baselines=["copy"], rounds=rounds, warmup=2)
        rows = {}
        cp = res.cases["copy"]
        for key in tunings:
            if key not in res.cases:
                rows[key] = {"error": checks[key]}
                continue
            c = res.cases[key]
            rows[key] = {"us_median": c.median_s / reps * 1e6, "us_min": c.min_s / reps * 1e6,
                         "us_max": c.max_s / reps * 1e6,
                         "fraction_of_copy": res.ratios[key]["copy"].median,
                         "bit_identical": checks[key]}
        out["targets"][name] = {"copy_us_median": cp.median_s / reps * 1e6, "rows": rows}
        print(f"{name}: copy {cp.median_s / reps * 1e6:.1f} us")
        for key, r in sorted(rows.items(), key=lambda kv: kv[1].get("us_median", 1e9)):
            if "error" in r:
                print(f"  {key:28s} ERROR {r['error'][:100]}")
            else:
                print(f"  {key:28s} {r['us_median']:6.1f} us ({r['us_min']:.1f}-{r['us_max']:.1f}) "
                      f"{100 * r['fraction_of_copy']:5.1f}% of copy  bit-identical {r['bit_identical']}")
    from fastpath import _requant_persistent as RP

    out["resident"] = RP.RESIDENT_LOG
    for r in RP.RESIDENT_LOG:
        print("resident:", r)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="cores for the projection")
    ap.add_argument("--gpu", action="store_true", help="only the CUDA part (bench_gpu)")
    ap.add_argument("--json", default=None, help="write the GPU figures to this JSON file")
    ap.add_argument("--sweep", action="store_true", help="only the GPU tile sweep (bench_gpu_sweep)")
    ap.add_argument("--match", default=None,
                    help="with --sweep: time only the tunings whose name this regex finds")
    args = ap.parse_args()
    if args.sweep:
        bench_gpu_sweep(json_path=args.json, match=args.match)
        return
    if args.gpu:
        bench_gpu(json_path=args.json)
        bench_end_to_end(target="ct-nvfp4")
        return
    bench_cpu(args.repeat, args.workers)
    bench_end_to_end()
    bench_end_to_end(verify=True)


if __name__ == "__main__":
    main()
