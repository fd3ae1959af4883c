"""A DeepSeek-V3-sized checkpoint conversion: real layer names and shapes, random weights, the whole command.

For each of ``--layers`` MoE layers of DeepSeek-V3 671B (config_671B.json: hidden 7168, 256 routed + 1 shared
expert of intermediate 2048, MLA attention with q_lora_rank 1536, kv_lora_rank 512, 128 heads of 128 + 64 (rope)
query/key and 128 value dimensions), the script writes a source checkpoint in DeepSeek's own FP8 layout
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` F8_E4M3 + ``weight_scale_inv`` F32 per 128x128 block,
the attention projections likewise, BF16 norms and router, the F32 router bias; shards of at most ``--shard-gib``
GiB, as the published checkpoint's ~4.3 GB) into ``--dir``, with random weights generated on the fly on the host
(:func:`bench.convert_v3.source._arrays`: E4M3 codes uniform over the finite codes from PCG64 random bytes, in
threads; scales uniform in [0.5, 2] x 2^-9). Each source shard is fsync'd and dropped from the page cache
(``posix_fadvise(DONTNEED)``), so the conversion reads it from the disk. Then ``moeref convert``
(:func:`moeref.checkpoint.convert_checkpoint`; ``--engine`` and ``--report-device`` as the command's, default
``auto``: on a GPU the Triton engine and the device report with reading, converting and writing overlapped)
converts the layer into ``--dir``; timed: that call only (reads, conversion, report, writes with their fsync,
hashing, index). Then both directories are deleted, so the disk holds one layer's source and output at a time
(about 11.5 + 6.5 GB for NVFP4). ``--same-weights`` writes the source once and gives it each next layer's names
(:func:`~bench.convert_v3.source.rename_source`: the shard headers rewritten in place, fsync'd, dropped from the
page cache): the conversion reads and writes the same bytes, and the run does not spend the disk's write time on a
new source each layer. Before the timed layers, one untimed conversion of a small checkpoint with the same shapes
compiles the kernels.

Where the time goes: every layer's row has ``stages`` (``source``, ``convert``, ``delete``), ``source_stages``
(``generate``, ``write``, ``fsync``, ``drop_cache``; ``rename`` with ``--same-weights``) and ``convert_stages``
(``moeref convert``'s own, :class:`moeref.checkpoint.report.StageTimes`: read, quantize, report, write, close
with its fsync, hash, ..., and the waits of the pipelined path), the warm-up likewise. The JSON is rewritten
after every stage, every shard and every ``--heartbeat`` seconds (``current``: the layer in progress), with a
progress line on stdout each time, so a run stopped by a time limit still says where its time went (SIGTERM
and Ctrl-C remove the directories and write the JSON). ``--max-seconds`` starts no layer once that many
seconds have passed or when the last layer would not fit in what is left; the JSON then holds the layers done
and says why it stopped (``stopped``; ``complete`` is false), and the projection is from those layers.

Disk bandwidth, in the same run: one ``--bandwidth-gib`` GiB file written sequentially (64 MiB writes,
fsync'd), dropped from the page cache, read back sequentially, deleted. The disk bound of a layer is its
bytes read / read bandwidth + bytes written / write bandwidth (one disk does both), and, for a disk that
overlaps them perfectly, the larger of the two.

Projection to the whole model: the measured seconds per source byte times the source bytes of all 61 layers
plus the embedding and ``lm_head`` (the same tensor list, not generated), next to the disk bound of the whole
model at the measured bandwidths.

Run (GPU; about 18 GB of disk at a time, 8 layers = 1/8 of the model)::

    python -m bench convert-v3 --layers 8 --same-weights --max-seconds 220 --json docs/data/convert_v3_h200_DATE.json

``--tiny`` shrinks every dimension (same names, same structure) for a CPU test run in seconds; its JSON is a
measurement of nothing but the mechanics. ``--experts N`` and ``--heads N`` keep the real matrix shapes with
fewer of them (a layer that converts in seconds on a CPU; ``--profile FILE`` cProfiles the run).
``bench/report_convert_v3.py`` turns the JSON into the table of docs/convert.md.

This script is the driver (the timed conversion of each layer, the warm-up, the projection, the arguments); its
parts are the package ``bench/convert_v3/``: the tensor list and the random source writer in ``source.py``, the disk
bandwidth and the page-cache drop in ``disk.py``, the JSON rewritten as the run goes in ``recorder.py``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.convert_v3.disk import disk_bandwidth, filesystem  # noqa: E402
from bench.convert_v3.recorder import Recorder  # noqa: E402
from bench.convert_v3.source import (TINY, V3, layer_tensors, model_source_bytes, rename_source,  # noqa: E402
                                     write_source)

GIB = 1 << 30


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _report_on(mods) -> dict:
    where = {}
    for m in mods:
        w = m.note.rsplit("report on ", 1)[-1].split(" (")[0] if "report on " in m.note else "host"
        where[w] = where.get(w, 0) + 1
    return where


def convert_layer(root: str, layer: int, d: dict, args, rec: "Recorder") -> dict:
    """Write one layer's source, convert it (timed), delete both; the row of the JSON. Every stage is timed
    into ``rec.current`` (``stages``: ``source`` (the whole source written), ``convert``, ``delete``;
    ``source_stages``: :func:`write_source`'s; ``convert_stages``: ``moeref convert``'s own,
    :class:`moeref.checkpoint.report.StageTimes`), and ``rec`` rewrites the JSON after each."""
    from moeref.checkpoint import ConvertOptions, convert_checkpoint
    from moeref.checkpoint.report import StageTimes

    keep = args.same_weights
    src, dst = os.path.join(root, "src" if keep else f"src-{layer}"), os.path.join(root, f"dst-{layer}")
    tensors = layer_tensors(layer, d)
    row = rec.start_layer(layer)
    src_times, conv_times = StageTimes(), StageTimes()
    try:
        with rec.stage("source", src_times, "source_stages"):
            if keep and rec.res.get("source_layer") is not None:
                read = rename_source(src, rec.res["source_layer"], layer, times=src_times)
            else:
                read = write_source(src, tensors, int(args.shard_gib * GIB), seed=layer, times=src_times)
            if keep:
                rec.res["source_layer"] = layer
        row["bytes_read"] = read
        t_conv = time.perf_counter()
        row["shards_done"] = []

        def shard_done(done, total, shard):
            row["shards_done"].append({"shard": shard, "modules_done": done, "modules": total,
                                       "source_bytes": os.path.getsize(os.path.join(src, shard)),
                                       "seconds": round(time.perf_counter() - t_conv, 4)})
            rec.note(f"  layer {layer}: {shard} converted ({done}/{total} modules)", conv_times, "convert_stages")

        with rec.stage("convert", conv_times, "convert_stages"):
            rep = convert_checkpoint(src, dst, ConvertOptions(target=args.target, engine=args.engine,
                                                              report_device=args.report_device),
                                     progress=shard_done, timings=conv_times)
        written = _dir_bytes(dst)
    finally:
        with rec.stage("delete"):
            if not keep:
                shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(dst, ignore_errors=True)
    mods = rep.modules
    row.update({"shards": len(rep.shards), "modules": len(mods),
                "copied": sum(s.copied for s in rep.shards), "bytes_read": read, "bytes_written": written,
                "seconds": row["stages"]["convert"], "source_write_seconds": row["stages"]["source"],
                "module_seconds": sum(m.seconds for m in mods),
                "engines": sorted({m.engine for m in mods}), "report_on": _report_on(mods),
                "lossless_modules": sum(m.lossless for m in mods),
                "sqnr_db_median": float(np.median([m.sqnr_db for m in mods])) if mods else None})
    return row


def warm_up(root: str, d: dict, args, rec: "Recorder") -> float:
    """One untimed conversion of a small checkpoint with the layer's real shapes (the attention projections,
    one routed and the shared expert), so that the kernels are compiled before the timed layers: seconds. Its
    stages go to ``rec.res["warm_up"]`` as a layer's do."""
    from moeref.checkpoint import ConvertOptions, convert_checkpoint
    from moeref.checkpoint.report import StageTimes

    keep = [t for t in layer_tensors(args.first_layer, d) if ".experts." not in t[0] or ".experts.0." in t[0]]
    src, dst = os.path.join(root, "warm-src"), os.path.join(root, "warm-dst")
    rec.res["warm_up"] = rec.start_layer("warm-up")
    src_times, conv_times = StageTimes(), StageTimes()
    t0 = time.perf_counter()
    try:
        with rec.stage("source", src_times, "source_stages"):
            write_source(src, keep, int(args.shard_gib * GIB), seed=0, times=src_times)
        with rec.stage("convert", conv_times, "convert_stages"):
            rep = convert_checkpoint(src, dst, ConvertOptions(target=args.target, engine=args.engine,
                                                              report_device=args.report_device), timings=conv_times)
        mods = rep.modules
        rec.res["warm_up"].update(engines=sorted({m.engine for m in mods}), report_on=_report_on(mods),
                                  notes=sorted({m.note for m in mods}))
        rec.note(f"warm-up: engines {rec.res['warm_up']['engines']}, report on {rec.res['warm_up']['report_on']}; "
                 f"why: {rec.res['warm_up']['notes'][0]}")
    finally:
        with rec.stage("delete"):
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(dst, ignore_errors=True)
        rec.res["current"] = None
    return time.perf_counter() - t0


def _meta() -> dict:
    import platform

    import torch

    tree = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    if torch.cuda.is_available():
        from bench.interleaved import machine_meta

        meta = machine_meta()
    else:
        import datetime

        meta = {"gpu": "none (CPU)", "driver": "-", "cuda": torch.version.cuda, "torch": torch.__version__,
                "python": sys.version.split()[0],
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    meta.update(tree=tree, cpu=platform.processor() or platform.machine(), cpus=os.cpu_count())
    return meta


def projection(rows: list, d: dict, disk: dict) -> dict | None:
    """The whole model (``d``'s 61 layers, embedding and ``lm_head``) at the measured seconds per source byte of
    the layers in ``rows`` (None before the first), next to its disk bound at the measured bandwidths."""
    if not rows:
        return None
    read = sum(r["bytes_read"] for r in rows)
    written = sum(r["bytes_written"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    total = model_source_bytes(d)
    out_ratio = written / read
    return {"layers": len(rows), "model_source_bytes": total, "fraction_converted": read / total,
            "seconds": secs * total / read,
            "disk_bound_seconds": total / disk["read_GBps"] / 1e9 + total * out_ratio / disk["write_GBps"] / 1e9,
            "disk_bound_overlapped_seconds": max(total / disk["read_GBps"],
                                                 total * out_ratio / disk["write_GBps"]) / 1e9}


def dims(args) -> dict:
    """DeepSeek-V3's dimensions (``--tiny``: every one shrunk), with ``--experts`` and ``--heads`` applied."""
    d = dict(TINY if args.tiny else V3)
    if args.experts is not None:
        d["experts"] = args.experts
    if args.heads is not None:
        d["heads"] = args.heads
    return d


def run(args) -> dict:
    d = dims(args)
    layers = list(range(args.first_layer, args.first_layer + args.layers))
    res = {"meta": None, "dims": d, "tiny": bool(args.tiny),
           "scaled": bool(args.experts is not None or args.heads is not None), "target": args.target,
           "engine": args.engine, "report_device": args.report_device, "shard_gib": args.shard_gib,
           "layers_asked": len(layers), "max_seconds": args.max_seconds, "same_weights": bool(args.same_weights),
           "complete": False, "stopped": None,
           "layers": [], "current": None, "projection": None}
    rec = Recorder(args.json, res, args.heartbeat)
    root = tempfile.mkdtemp(prefix="moeref-convert-v3-", dir=args.dir)
    rows = res["layers"]
    try:
        res["meta"] = _meta()
        rec.note(f"{res['meta']['gpu']}, torch {res['meta']['torch']}, {res['meta']['cpus']} CPUs (torch imported)")
        fs = filesystem(root)
        rec.note(f"writing under {root}: {fs['type']} {fs['device']} on {fs['mount']}, "
                 f"{fs['free_bytes'] / 1e9:.0f} GB free of {fs['size_bytes'] / 1e9:.0f} GB")
        disk = disk_bandwidth(root, int(args.bandwidth_gib * GIB))
        disk["filesystem"] = fs
        res["disk"] = disk
        rec.note(f"disk: write {disk['write_GBps']:.2f} GB/s, read {disk['read_GBps']:.2f} GB/s "
                 f"({disk['bytes'] / GIB:.1f} GiB, fsync'd, page cache dropped)")
        res["warm_up_seconds"] = warm_up(root, d, args, rec)
        rec.note(f"warm-up (kernels compiled, untimed): {res['warm_up_seconds']:.1f} s")
        for layer in layers:
            left = None if args.max_seconds is None else args.max_seconds - rec.elapsed()
            need = rows[-1]["total_seconds"] if rows else 0.0
            if left is not None and left < need or left is not None and left <= 0:
                res["stopped"] = (f"--max-seconds {args.max_seconds:g}: {rec.elapsed():.0f} s elapsed, the last layer "
                                  f"took {need:.0f} s; {len(rows)} of {len(layers)} layers converted")
                rec.note(res["stopped"])
                break
            t0 = time.perf_counter()
            r = convert_layer(root, layer, d, args, rec)
            r["total_seconds"] = time.perf_counter() - t0
            r["disk_bound_seconds"] = r["bytes_read"] / disk["read_GBps"] / 1e9 + \
                r["bytes_written"] / disk["write_GBps"] / 1e9
            r["disk_bound_overlapped_seconds"] = max(r["bytes_read"] / disk["read_GBps"],
                                                     r["bytes_written"] / disk["write_GBps"]) / 1e9
            rows.append(r)
            res["current"] = None
            res["projection"] = projection(rows, d, disk)
            rec.note(f"layer {layer}: {r['modules']} modules, read {r['bytes_read'] / 1e9:.2f} GB, wrote "
                     f"{r['bytes_written'] / 1e9:.2f} GB in {r['seconds']:.2f} s (disk bound "
                     f"{r['disk_bound_seconds']:.2f} s, overlapped {r['disk_bound_overlapped_seconds']:.2f} s); "
                     f"engines {r['engines']}, report on {r['report_on']}; source written in "
                     f"{r['source_write_seconds']:.1f} s")
        res["complete"] = len(rows) == len(layers)
    except BaseException as e:  # a time limit (SIGINT, SIGTERM) or an error: the JSON says so, with what was done
        res["stopped"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        rec.note(f"stopped: {res['stopped']}; {len(rows)} layers converted")
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
        rec.close()
        rec.save()
    proj = res["projection"]
    if proj is not None:
        read = sum(r["bytes_read"] for r in rows)
        rec.note(f"{len(rows)} layers, {read / 1e9:.1f} GB of {proj['model_source_bytes'] / 1e9:.0f} GB "
                 f"({100 * proj['fraction_converted']:.1f}% of the model) in {sum(r['seconds'] for r in rows):.1f} s; "
                 f"whole model: {proj['seconds'] / 60:.1f} min (disk bound {proj['disk_bound_seconds'] / 60:.1f} min, "
                 f"overlapped {proj['disk_bound_overlapped_seconds'] / 60:.1f} min)")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="MoE layers to convert (8 = 1/8 of the model)")
    ap.add_argument("--first-layer", type=int, default=3, help="the first one (3: the first MoE layer)")
    ap.add_argument("--target", default="ct-nvfp4", help="target layout (moeref convert --to)")
    ap.add_argument("--engine", default="auto", help="moeref convert --engine")
    ap.add_argument("--report-device", default="auto", help="moeref convert --report-device")
    ap.add_argument("--dir", default=None, help="where to write (default: the system's temp dir)")
    ap.add_argument("--shard-gib", type=float, default=4.0, help="source shard size bound, GiB")
    ap.add_argument("--bandwidth-gib", type=float, default=8.0, help="size of the bandwidth test file, GiB")
    ap.add_argument("--tiny", action="store_true", help="every dimension shrunk: a CPU test of the mechanics")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts per MoE layer (default 256; fewer: a layer of the real matrix shapes that "
                         "converts in seconds on a CPU)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default 128)")
    ap.add_argument("--same-weights", action="store_true",
                    help="write the random source once and give it each next layer's names (its shard headers "
                         "rewritten in place, fsync'd, dropped from the page cache): the conversion reads and "
                         "writes the same bytes from and to the disk; the source is not written again each layer")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no layer once this many seconds have passed since the start, or when the last "
                         "layer would not fit in what is left; the JSON then holds the layers done")
    ap.add_argument("--heartbeat", type=float, default=10.0,
                    help="seconds between progress lines (and JSON rewrites) while a stage runs")
    ap.add_argument("--profile", default=None, metavar="FILE.pstats",
                    help="cProfile the run (the main thread) into this file")
    ap.add_argument("--json", default=None, help="write the result here (rewritten after every stage)")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.first_layer < 0 or args.first_layer + args.layers > 61:
        ap.error(f"layers {args.first_layer}..{args.first_layer + args.layers - 1}: DeepSeek-V3 has layers 0..60")
    for opt in ("experts", "heads"):
        if getattr(args, opt) is not None and getattr(args, opt) < 1:
            ap.error(f"--{opt} must be at least 1; got {getattr(args, opt)}")
    if args.max_seconds is not None and args.max_seconds <= 0:
        ap.error(f"--max-seconds must be positive; got {args.max_seconds}")
    if args.heartbeat <= 0:
        ap.error(f"--heartbeat must be positive; got {args.heartbeat}")
    import signal

    def _terminate(signum, frame):
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)  # `timeout` sends it: clean up and write the JSON, as for Ctrl-C
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        try:
            prof.runcall(run, args)
        finally:
            prof.dump_stats(args.profile)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
