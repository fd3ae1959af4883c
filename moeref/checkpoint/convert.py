"""Streaming checkpoint conversion: plan, convert shard by shard, verify, resume.

:func:`convert_checkpoint` reads a source directory (one ``model.safetensors`` or shards with
``model.safetensors.index.json``), finds the quantized modules of the source layout
(:mod:`.layouts`), requantizes each selected module into the target layout with
:func:`moeref.quant.requantize` (exact report, lossless search) and copies every other tensor
bit for bit. Output shard ``i`` holds what input shard ``i`` held (a module's scale tensors go
with its weight, wherever the source kept them); ``weight_map`` is rewritten.

Memory: one module's source, target and float64 report arrays at a time (a small multiple of
the largest tensor); shards are written by :class:`.safetensors_io.ShardWriter`, which streams.

Safety: the destination must differ from the source and not contain it; an existing
destination is refused unless ``overwrite`` (removed first) or ``resume``. Shards are written
under a temporary name and renamed when complete; ``moeref-convert.json`` records each finished
shard (size, SHA-256, verified) and says ``"complete": true`` only after the index and configs
are written, last. ``resume`` skips shards whose file matches the record (and were verified, when
``verify`` is asked for; an unverified one is verified, not rewritten).

Modules that ``only``/``skip`` leave out of a quantized source are dequantized to BF16 (a
checkpoint has one quantization format; vLLM and ModelOpt list such modules in the config's
ignore list), and every unquantized ``*.weight`` with two or more axes is listed there.

This module holds the options (:class:`ConvertOptions`) and the whole checkpoint (plan, destination, record,
workers, index and configs); one shard's conversion, its modules, its pipelined path and its verification are in
:mod:`.shard`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from .engines import ENGINES, check_engine, engine_name
from .layouts import get_layout
from .pipeline import hash_in_thread
from .plan import Plan, _load_json, plan_conversion
from .report import ConversionReport, ModuleReport, ShardRecord, StageTimes, timed
from .scale_layout import SCALE_LAYOUTS, SWIZZLE_TARGETS, mark_config
from .safetensors_io import DTYPE_NAMES, INDEX_NAME, CheckpointError, SafetensorsCheckpoint
from .shard import ShardJob, report_device, run_shard, sha256_file, verify_shard

__all__ = ["ConvertOptions", "Plan", "plan_conversion", "convert_checkpoint", "verify_shard",
           "RECORD_NAME", "ENGINES"]

RECORD_NAME = "moeref-convert.json"
_CONFIG_FILES = ("config.json", "hf_quant_config.json")


@dataclass(frozen=True)
class ConvertOptions:
    """What ``moeref convert`` was asked to do.

    Attributes:
        target: target layout name (:data:`.layouts.LAYOUTS`).
        source_layout: source layout name, or None to detect it from ``config.json``.
        preset: preset of the target scheme (None: the layout's default).
        precision: ``"float32"`` (default; the source dequantized to float32 first, as the
            producing libraries do) or ``"exact"`` (:func:`moeref.quant.requantize`).
        only, skip: fnmatch patterns on module names: convert the modules matching any ``only``
            pattern (all when empty) and no ``skip`` pattern.
        workers: processes converting shards in parallel.
        verify: re-read every written shard and check it against the source.
        overwrite, resume, dry_run: see the module docstring.
        engine: ``"auto"`` (the Triton fast path where it is installed, a CUDA GPU is present and the
            scheme is supported, else NumPy; the report says which, and why), ``"numpy"``, ``"triton"``
            (an error when it cannot run), or a fast engine object (:mod:`.engines`: found by name
            through the ``moeref.checkpoint_engines`` entry points, or passed here). The engine computes
            codes only: the report and ``verify`` are the NumPy reference's.
        share_global: NVFP4 targets: the converted members of a fused group (``gate_proj`` and
            ``up_proj``, ``w1`` and ``w3``, ``q_proj``/``k_proj``/``v_proj`` of one parent) share
            one global scale, as ModelOpt exports them (``preprocess_linear_fusion``: the max of
            the members' amax) and as vLLM (w1's for w13) and TensorRT-LLM (asserts equality)
            load them; a source whose members already share one keeps it.
        report_device: where the report is computed: ``"auto"`` (default: a CUDA GPU where torch sees one,
            else the host), ``"host"`` (NumPy, the path for machines without a GPU), or a torch device name
            (``"cuda"``, ``"cuda:1"``, ``"cpu"``): :func:`moeref.quant.device_report.device_requantize`,
            bit-identical to the host report (``tests/test_device_report.py``), and the shard read, converted
            and written as a pipeline (a reader thread, the conversion, a writer thread). Modules whose
            lossless candidates must be tried, and schemes with zero points or channel scales, are measured
            on the host; every module's note says where its report was computed. It changes no byte
            written and no figure of the report.
        scale_layout: ``"linear"`` (default: what every real layout stores) or ``"swizzled"``
            (NVFP4 / compressed-tensors MXFP4 targets: ``weight_scale`` in the 128x4 swizzle,
            marked in the config; :mod:`.scale_layout` says which consumers want it: none of
            the usual runtimes).
    """

    target: str
    source_layout: str | None = None
    preset: str | None = None
    precision: str = "float32"
    only: tuple = ()
    skip: tuple = ()
    workers: int = 1
    verify: bool = False
    overwrite: bool = False
    resume: bool = False
    dry_run: bool = False
    engine: object = "auto"
    share_global: bool = True
    scale_layout: str = "linear"
    report_device: str = "auto"

    def __post_init__(self):
        get_layout(self.target)
        if self.source_layout is not None:
            get_layout(self.source_layout)
        if self.precision not in ("float32", "exact"):
            raise ValueError(f"precision must be 'float32' or 'exact'; got {self.precision!r}")
        check_engine(self.engine)
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive int; got {self.workers!r}")
        if self.target == "bf16" and self.preset is not None:
            raise ValueError("the bf16 target has no preset")
        get_layout(self.target).scheme(self.preset)  # validates the preset
        _check_report_device(self.report_device)
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"scale_layout must be one of {', '.join(SCALE_LAYOUTS)}; got "
                             f"{self.scale_layout!r}")
        if self.scale_layout == "swizzled" and self.target not in SWIZZLE_TARGETS:
            raise ValueError(f"scale_layout 'swizzled' is for the {', '.join(SWIZZLE_TARGETS)} "
                             f"targets; {self.target!r} has no 1-byte 2-D block scale to swizzle")


def _check_report_device(name) -> None:
    ok = isinstance(name, str) and bool(name)
    if ok and name not in ("auto", "host"):
        try:
            import torch

            torch.device(name)
        except (ImportError, RuntimeError):
            ok = False
    if not ok:
        raise ValueError(f"report_device must be 'auto', 'host' or a torch device name such as 'cuda' (with "
                         f"torch installed); got {name!r}")


# ---- the whole checkpoint ------------------------------------------------------------------

def _job(src: str, dst: str, shard: str, opts: ConvertOptions, plan: Plan,
         timings: StageTimes | None = None) -> ShardJob:
    mods = {n: plan.modules[n] for n, a, _ in plan.actions[shard] if a != "copy"}
    groups = {m: plan.groups[m] for m in mods if m in plan.groups}
    roles = {x: plan.modules[x] for members in groups.values() for x in members}
    return ShardJob(src, dst, shard, opts, plan.source_layout, tuple(plan.actions[shard]), mods,
                    groups, roles, plan.source_scale_layout, timings=timings)


def _prepare_destination(src: str, dst: str, opts: ConvertOptions, settings: dict) -> dict:
    """Check the destination; return the records of shards a resumed run may skip."""
    rs, rd = os.path.realpath(src), os.path.realpath(dst)
    if rs == rd or rs.startswith(rd + os.sep) or rd.startswith(rs + os.sep):
        raise CheckpointError(f"destination {dst} must be outside the source {src} (and not "
                              "contain it): moeref never writes into the source")
    if not os.path.exists(dst):
        if not opts.dry_run:
            os.makedirs(dst)
        return {}
    if opts.resume:
        rec = _load_json(os.path.join(dst, RECORD_NAME))
        if rec is None:
            raise CheckpointError(f"{dst} exists but holds no {RECORD_NAME}: nothing to resume "
                                  "(pass --overwrite to start again)")
        if rec.get("settings") != settings:
            raise CheckpointError(f"{dst} holds a conversion with other settings "
                                  f"({rec.get('settings')}); pass --overwrite to start again")
        return {s: ShardRecord.from_json(r) for s, r in rec.get("shards", {}).items()}
    if opts.overwrite:
        if not opts.dry_run:
            shutil.rmtree(dst)
            os.makedirs(dst)
        return {}
    raise CheckpointError(f"destination {dst} exists; pass --overwrite to replace it or --resume "
                          "to finish an interrupted conversion")


def _write_json(path: str, obj) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def convert_checkpoint(src: str, dst: str, opts: ConvertOptions, progress=None,
                       timings: StageTimes | None = None) -> ConversionReport:
    """Convert the checkpoint in directory ``src`` into ``dst`` (module docstring).

    ``progress(done_modules, total_modules, shard)`` is called after each shard. ``timings``: a
    :class:`.report.StageTimes` that receives the seconds of each stage (read, quantize, report, write,
    close and fsync, hash, index; its docstring lists them) as the conversion goes; it changes nothing
    written. Returns the
    :class:`.report.ConversionReport` (also written to ``dst/moeref-convert.json``); with
    ``opts.dry_run`` nothing is written and the report's shards list the plan with no figures.
    """
    t0 = time.perf_counter()
    with timed(timings, "plan"):
        plan = plan_conversion(src, opts)
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(opts).items()
                if k not in ("workers", "verify", "overwrite", "resume", "dry_run", "report_device")}
    settings["engine"] = engine_name(opts.engine)
    settings["source_layout"] = plan.source_layout
    done = _prepare_destination(src, dst, opts, settings)
    report = ConversionReport(src, dst, plan.source_layout, plan.target_layout, opts.preset,
                              opts.precision, dry_run=opts.dry_run)
    if plan.has_input_scales is False and opts.target in ("modelopt-nvfp4", "ct-nvfp4") \
            and any(a == "convert" for *_, a, _s in plan.rows()):
        report.warnings.append("the source has no static input scales: the NVFP4 checkpoint has "
                               "none (W4A4 runtimes need calibrated activation scales)")
    if opts.dry_run:
        for shard in plan.shards:
            rows = [ModuleReport(n, shard, list(s), plan.source_layout,
                                 plan.target_layout if a == "convert" else "bf16", "planned", a,
                                 False, 0.0, 0.0, 0.0, None, 0.0)
                    for n, a, s in plan.actions[shard] if a != "copy"]
            copies = sum(a == "copy" for _, a, _ in plan.actions[shard])
            report.shards.append(ShardRecord(shard, 0, "", False, copies, rows))
        return report

    jobs, records = [], {}
    for shard in plan.shards:
        r = done.get(shard)
        path = os.path.join(dst, shard)
        if r is not None and os.path.exists(path) and os.path.getsize(path) == r.nbytes \
                and sha256_file(path) == r.sha256:
            records[shard] = r
            continue
        jobs.append(_job(src, dst, shard, opts, plan, timings))
    record_path = os.path.join(dst, RECORD_NAME)

    def save(complete=False):
        with timed(timings, "record"):
            _write_json(record_path, {"settings": settings, "complete": complete,
                                      "shards": {s: records[s].as_json() for s in plan.shards
                                                 if s in records},
                                      **({"report": report.as_json()} if complete else {})})

    for shard, r in list(records.items()):  # resumed shards that still need --verify
        if opts.verify and not r.verified:
            with timed(timings, "verify"):
                verify_shard(src, dst, r, _job(src, dst, shard, opts, plan))
            r.verified = True
    total = sum(1 for *_, a, _s in plan.rows() if a != "copy")
    count = sum(len(r.modules) for r in records.values())
    save()

    def record(rec: ShardRecord) -> None:
        nonlocal count
        records[rec.shard] = rec
        save()
        count += len(rec.modules)
        if progress:
            progress(count, total, rec.shard)

    if opts.workers > 1 and len(jobs) > 1:
        import multiprocessing as mp

        from .engines import cuda_available

        # spawn where torch works in the parent (CUDA, or a device report's torch threads): a forked torch hangs
        ctx = mp.get_context("spawn" if cuda_available() or report_device(opts) is not None else "fork")
        with ProcessPoolExecutor(max_workers=opts.workers, mp_context=ctx) as ex:
            for rec in ex.map(run_shard, [dataclasses.replace(j, timings=None) for j in jobs]):
                record(rec)
    elif jobs:  # a shard's SHA-256 is computed in a thread while the next shard converts
        hash_in_thread(jobs, run_shard, sha256_file, dst, record, timings)
    report.shards = [records[s] for s in plan.shards]
    with timed(timings, "finish"):
        _finish(src, dst, plan, report, opts.scale_layout)
    report.seconds = round(time.perf_counter() - t0, 3)
    save(complete=True)
    return report


def _finish(src: str, dst: str, plan: Plan, report: ConversionReport, scale_layout: str) -> None:
    """Index, configs and the other files of the source directory (written last)."""
    tl = get_layout(plan.target_layout)
    weight_map, total = {}, 0
    for shard in plan.shards:
        h = SafetensorsCheckpoint(dst, {}, [shard], False).header(shard)
        for n, (dt, shape) in h.items():
            weight_map[n] = shard
            total += int(np.prod(shape, dtype=np.int64)) * DTYPE_NAMES[dt].itemsize
    for name in os.listdir(src):
        p = os.path.join(src, name)
        if name.endswith(".safetensors") or name in (INDEX_NAME, *_CONFIG_FILES) or not os.path.isfile(p):
            continue
        shutil.copy2(p, os.path.join(dst, name))
    config = _load_json(os.path.join(src, "config.json"))
    qc, extra = tl.quantization_config(plan.ignore, plan.has_input_scales)
    if scale_layout == "swizzled":
        mark_config(qc, extra)
    if config is not None:
        config.pop("quantization_config", None)
        if qc is not None:
            config["quantization_config"] = qc
        _write_json(os.path.join(dst, "config.json"), config)
    for name, obj in extra.items():
        _write_json(os.path.join(dst, name), obj)
    if SafetensorsCheckpoint.open(src).indexed:
        _write_json(os.path.join(dst, INDEX_NAME), {"metadata": {"total_size": total},
                                                     "weight_map": weight_map})
