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
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from ..quant import quantize_and_report, requantize
from ..quant.tensor import sum_of_squares
from .engines import ENGINES, check_engine, choose_engine, engine_name, source_quantizer
from .layouts import LAYOUTS, ModuleData, get_layout
from .pipeline import device_amax, hash_in_thread, run_pipeline
from .plan import Plan, _load_json, plan_conversion
from .report import ConversionReport, ModuleReport, ShardRecord, StageTimes, timed
from .scale_layout import (SCALE_LAYOUTS, SWIZZLE_TARGETS, mark_config, reading_view,
                           swizzle_tensors)
from .safetensors_io import (DTYPE_NAMES, INDEX_NAME, CheckpointError, SafetensorsCheckpoint,
                             ShardWriter)

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


def report_device(opts: ConvertOptions) -> str | None:
    """The torch device the report of ``opts`` is computed on, or None for the host (NumPy)."""
    from .engines import cuda_available

    name = opts.report_device
    if name == "host":
        return None
    if name == "auto":
        return "cuda" if cuda_available() else None
    if name.startswith("cuda") and not cuda_available():
        raise CheckpointError(f"report_device {name!r}: torch sees no CUDA GPU (use 'auto' or 'host')")
    return name


# ---- one shard -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _ShardJob:
    src: str
    dst: str
    shard: str
    opts: ConvertOptions
    source_layout: str
    actions: tuple
    modules: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)      # module -> members sharing a global scale
    group_roles: dict = field(default_factory=dict)  # member -> its source tensors
    source_scale_layout: str = "linear"
    device: str | None = None  # where the report is computed (the pipelined path), None: the host
    group_state: dict | None = None  # {"globals": members -> (global, how)}, the pipelined path: and "datas"
    timings: StageTimes | None = field(default=None, compare=False, repr=False)  # convert_checkpoint(timings=)

    def read_source(self, module: str, roles: dict, ck) -> ModuleData:
        """One source module (its ``weight_scale`` unswizzled where the source is swizzled)."""
        sl = LAYOUTS[self.source_layout]
        return sl.read(module, roles, reading_view(ck, sl.name, roles, self.source_scale_layout))


def _convert_module(data: ModuleData, job: _ShardJob, ck) -> tuple:
    """``(tensors, ModuleReport)`` of one module; the report on ``job.device`` (None: the host). A fused group's
    shared global: :func:`_group_global`, once per group where ``job.group_state`` keeps them (from the members
    the reader brought on the pipelined path, from the members read here on the host path), else per module."""
    device = job.device
    tl = LAYOUTS[job.opts.target]
    t0 = time.perf_counter()
    spent = {"group_global": 0.0, "quantize": 0.0, "report": 0.0}  # the rest of the time: "layout"
    scheme = tl.scheme(job.opts.preset)
    engine, why, quantizer = choose_engine(job.opts.engine, scheme, data.shape)
    if quantizer is not None and data.q is not None and job.opts.precision == "exact":
        engine, why, quantizer = "numpy", "precision 'exact' may need float64 arithmetic", None
    elif quantizer is not None and data.q is not None:
        chosen = engine if isinstance(job.opts.engine, str) else job.opts.engine  # a name, or the object passed
        fused, how = source_quantizer(chosen, data.q, scheme)
        why += f"; {how}" if fused is not None else f"; source decoded on the host ({how})"
        quantizer = fused or quantizer
    static = None
    t1 = time.perf_counter()
    if data.module in job.groups:
        members = job.groups[data.module]
        st = job.group_state
        if st is None:
            static, how = _group_global(members, job, ck, scheme)
        else:  # once per group: from the members the reader brought (the pipelined path), else read here
            if members not in st["globals"]:
                datas = [st["datas"].pop(m) for m in members] if "datas" in st else None
                st["globals"][members] = _group_global(members, job, ck, scheme, datas=datas, device=device)
            static, how = st["globals"][members]
        if static is not None:
            why += f"; global scale shared with {', '.join(job.groups[data.module])} ({how})"
    spent["group_global"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    if job.timings is not None:
        quantizer = _timed_quantizer(quantizer, spent)
    result = None
    if device is not None:
        from ..quant.device_report import device_report_unavailable, device_requantize

        not_here = device_report_unavailable(scheme, data.q)
        if not_here is None:
            result = device_requantize(data.q, scheme, device=device, values=data.values,
                                       precision=job.opts.precision, quantizer=quantizer, global_scale=static)
        why += (f"; report on {device}" if result is not None else
                f"; report on the host ({not_here or 'the rule is lossy and the lossless candidates may apply'})")
    if result is not None:
        q, rep = result
    elif data.q is not None:
        q, rep = requantize(data.q, scheme, precision=job.opts.precision, quantizer=quantizer,
                            global_scale=static)
    else:
        q, rep = quantize_and_report(data.values, scheme, quantizer=quantizer, global_scale=static)
    spent["report"] = time.perf_counter() - t1 - spent["quantize"]
    out = ModuleData(data.module, {}, q=q, input_scale=data.input_scale)
    kept = tl.stored_input_scale(data.input_scale)
    if data.input_scale is not None:
        why += ("; static input scale dropped (the target layout has no slot)" if kept is None
                else "" if kept == data.input_scale else
                f"; static input scale stored as {kept!r} (was {data.input_scale!r})")
    mr = ModuleReport(data.module, job.shard, list(data.shape), job.source_layout, tl.name,
                      engine, rep.method, rep.lossless, rep.max_abs_error, rep.rel_l2,
                      rep.sqnr_db, None if rep.worst_block is None else list(rep.worst_block),
                      round(time.perf_counter() - t0, 4), note=why)
    tensors = tl.write(data.module, out)
    if job.opts.scale_layout == "swizzled":
        tensors = swizzle_tensors(tl.name, tensors)
    if job.timings is not None:
        for k, v in spent.items():
            if k != "group_global" or data.module in job.groups:
                job.timings.add(k, v)
        job.timings.add("layout", time.perf_counter() - t0 - sum(spent.values()))
    return tensors, mr


def _timed_quantizer(quantizer, spent: dict):
    """``quantizer`` (None: the NumPy :func:`~moeref.quant.quantize`, what ``requantize`` calls for None) with
    its seconds added to ``spent["quantize"]``; the same calls, the same results (``device_values`` kept)."""
    from ..quant import quantize

    fn = quantizer or quantize

    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent["quantize"] += time.perf_counter() - t0

    if getattr(fn, "device_values", False):
        run.device_values = True
    return run


def _group_global(members, job: _ShardJob, ck, scheme, datas: list | None = None,
                  device: str | None = None) -> tuple:
    """``(static global scale in the preset's convention, how)`` shared by a fused group, or
    ``(None, reason)`` for an all-zero group (each member then quantizes as zeros on its own).

    A source whose members already share one NVFP4 global keeps it when the target's float32
    can store it; otherwise the global comes from the max of the members' amax, in float32 (the
    value the rule reads; rounded up if the exact maximum is not a float32), through the same
    arithmetic as the dynamic rule (:func:`moeref.quant.nvfp4.global_factors`), so the member
    holding the maximum is quantized exactly as it would be alone."""
    from ..quant.lossless import global_storable
    from ..quant.nvfp4 import global_factors

    conv = scheme.preset.option("global_convention")
    if datas is None:
        datas = [job.read_source(m, job.group_roles[m], ck) for m in members]
    qs = [d.q for d in datas]
    if all(q is not None and q.scheme.family == "nvfp4" for q in qs):
        gs = {float(q.global_scale) for q in qs}
        g = gs.pop() if len(gs) == 1 else 0.0
        if g > 0 and global_storable(g, scheme):
            return {"decode_scale": g, "encode_scale": float(np.float32(1.0 / g)),
                    "amax": float(np.float32(g * 2688.0))}[conv], "the source's shared global"
    amax = 0.0
    for d in datas:
        if device is not None:  # the same numbers on the device: a max is exact in any order
            amax = max(amax, device_amax(d, job.opts.precision, device))
            continue
        if d.q is not None:
            v = d.q.dequantize(np.float32 if job.opts.precision == "float32" else np.float64)
        else:
            v = np.asarray(d.values, np.float32)
        amax = max(amax, float(np.max(np.abs(v))) if v.size else 0.0)
    if amax == 0:
        return None, "all zero"
    a32 = np.float32(amax)
    if float(a32) < amax:
        a32 = np.nextafter(a32, np.float32(np.inf))
    s_enc, pts, _, _ = global_factors(scheme.preset, a32, None, np.float32)
    return {"amax": float(a32), "encode_scale": float(s_enc), "decode_scale": float(pts)}[conv], \
        "max of the members' amax"


def _dequantize_module(data: ModuleData, job: _ShardJob) -> tuple:
    with timed(job.timings, "dequantize"):
        return _dequantize_module_timed(data, job)


def _dequantize_module_timed(data: ModuleData, job: _ShardJob) -> tuple:
    t0 = time.perf_counter()
    bf = LAYOUTS["bf16"]
    tensors = bf.write(data.module, data)
    x = data.q.dequantize(np.float64) if data.q is not None else np.asarray(data.values, np.float64)
    err = tensors[0][1].astype(np.float64) - x
    e2, x2 = sum_of_squares(err), sum_of_squares(x)
    mr = ModuleReport(data.module, job.shard, list(data.shape), job.source_layout, "bf16",
                      "dequantize" if data.q is not None else "copy", "bf16", e2 == 0,
                      float(np.max(np.abs(err))) if err.size else 0.0,
                      float(np.sqrt(e2 / x2)) if x2 > 0 and e2 > 0 else 0.0,
                      float(10 * np.log10(x2 / e2)) if e2 > 0 and x2 > 0 else float("inf"), None,
                      round(time.perf_counter() - t0, 4), note="not selected: written as BF16")
    return tensors, mr


def _run_shard(job: _ShardJob, hash_later: bool = False) -> ShardRecord:
    """Convert one shard (runs in a worker process when ``workers > 1``): in turn on the host, or as a
    pipeline where the report is computed on a device (:func:`_run_shard_pipelined`). ``hash_later``: the
    record's ``sha256`` is left empty for the caller to fill (:func:`.pipeline.hash_in_thread` hashes it in a
    thread)."""
    device = report_device(job.opts)
    if device is not None:
        return _run_shard_pipelined(job, device, hash_later)
    job = dataclasses.replace(job, group_state={"globals": {}})  # a fused group's global: once per shard
    ck = SafetensorsCheckpoint.open(job.src)
    path = os.path.join(job.dst, job.shard)
    writer = ShardWriter(path, {"format": "pt", "converted_by": "moeref convert",
                                "target_layout": job.opts.target}, reserve=header_reserve(job))
    reports, copied, tm = [], 0, job.timings
    try:
        for name, action, _ in job.actions:
            if action == "copy":
                with timed(tm, "read"):
                    arr = ck.read(name)
                with timed(tm, "write"):
                    writer.add(name, arr)
                copied += 1
                continue
            with timed(tm, "read"):
                data = job.read_source(name, job.modules[name], ck)
            if action == "convert":
                tensors, mr = _convert_module(data, job, ck)
            else:
                tensors, mr = _dequantize_module(data, job)
            with timed(tm, "write"):
                for tname, arr in tensors:
                    writer.add(tname, arr)
            reports.append(mr)
        with timed(tm, "close"):
            writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        ck.close()
    return _finish_shard(job, path, copied, reports, hash_later)


def header_reserve(job: _ShardJob) -> int:
    """Bytes to leave for a shard's safetensors header (:class:`ShardWriter`'s ``reserve``): an upper bound
    from the plan, the same on the host and the device path, so both write the same bytes. Per tensor its
    name and 160 bytes of dtype, shape and offsets; a module writes at most 6 tensors, named after it with a
    suffix of at most 32 characters; 1 KiB of metadata."""
    n = 1024
    for name, action, _ in job.actions:
        n += len(name.encode()) + 160 if action == "copy" else 6 * (len(name.encode()) + 32 + 160)
    return n


def _finish_shard(job: _ShardJob, path: str, copied: int, reports: list, hash_later: bool = False) -> ShardRecord:
    digest = ""
    if not hash_later:
        with timed(job.timings, "hash"):
            digest = _sha256(path)
    rec = ShardRecord(job.shard, os.path.getsize(path), digest, False, copied, reports)
    if job.opts.verify:
        with timed(job.timings, "verify"):
            verify_shard(job.src, job.dst, rec, job)
        rec.verified = True
    return rec


def _run_shard_pipelined(job: _ShardJob, device: str, hash_later: bool = False) -> ShardRecord:
    """One shard as a bounded pipeline (:func:`.pipeline.run_pipeline`): a reader thread, the conversion and the
    report on ``device`` in this thread, and a writer thread, so that reading, converting and writing overlap.
    The same tensors in the same order as :func:`_run_shard`'s host loop; a fused group's shared global is
    computed once per group, from the members read with it, on the device."""
    job = dataclasses.replace(job, device=device, group_state={"datas": {}, "globals": {}})
    ck = SafetensorsCheckpoint.open(job.src)
    path = os.path.join(job.dst, job.shard)
    writer = ShardWriter(path, {"format": "pt", "converted_by": "moeref convert",
                                "target_layout": job.opts.target}, reserve=header_reserve(job))
    try:
        copied, reports = run_pipeline(job, ck, writer, _convert_module, _dequantize_module)
    finally:
        ck.close()
    return _finish_shard(job, path, copied, reports, hash_later)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_shard(src: str, dst: str, rec: ShardRecord, job: _ShardJob) -> None:
    """Re-read a written shard and check it against the source; ``CheckpointError`` lists what
    differs. Copied tensors: same dtype, shape and bytes. Converted modules: read back through
    the target layout, measured against the exact source values again; every figure must equal
    the report's (the written file holds what was measured)."""
    ck = SafetensorsCheckpoint.open(src)
    out = SafetensorsCheckpoint(dst, {}, [rec.shard], False)
    out.weight_map = {n: rec.shard for n in out.header(rec.shard)}
    tl = LAYOUTS[job.opts.target]
    by_module = {m.module: m for m in rec.modules}
    problems = []
    for name, action, _ in job.actions:
        if action == "copy":
            if name not in out.weight_map or out.info(name) != ck.info(name) or \
                    out.read_bytes(name) != ck.read_bytes(name):
                problems.append(f"copied tensor {name!r} differs from the source")
            continue
        src_data = job.read_source(name, job.modules[name], ck)
        x = src_data.q.dequantize(np.float64) if src_data.q is not None else \
            np.asarray(src_data.values, np.float64)
        layout = tl if action == "convert" else LAYOUTS["bf16"]
        roles = layout.roles(name, out) if layout.name != "bf16" else {"weight": name + ".weight"}
        got = layout.read(name, roles, reading_view(out, layout.name, roles, job.opts.scale_layout))
        y = got.q.dequantize(np.float64) if got.q is not None else np.asarray(got.values, np.float64)
        mr = by_module[name]
        err = y - x
        mx = float(np.max(np.abs(err))) if err.size else 0.0
        if (not np.any(err)) != mr.lossless or mx != mr.max_abs_error:
            problems.append(f"module {name!r}: the written tensors give max |err| {mx!r}, the "
                            f"report says {mr.max_abs_error!r}")
        want = tl.stored_input_scale(src_data.input_scale) if action == "convert" else None
        if action == "convert" and got.input_scale != want:
            problems.append(f"module {name!r}: input scale {got.input_scale!r}, expected {want!r} "
                            f"(source {src_data.input_scale!r})")
    ck.close()
    if problems:
        raise CheckpointError(f"verification of {os.path.join(dst, rec.shard)} failed:\n  "
                              + "\n  ".join(problems))


# ---- the whole checkpoint ------------------------------------------------------------------

def _job(src: str, dst: str, shard: str, opts: ConvertOptions, plan: Plan,
         timings: StageTimes | None = None) -> _ShardJob:
    mods = {n: plan.modules[n] for n, a, _ in plan.actions[shard] if a != "copy"}
    groups = {m: plan.groups[m] for m in mods if m in plan.groups}
    roles = {x: plan.modules[x] for members in groups.values() for x in members}
    return _ShardJob(src, dst, shard, opts, plan.source_layout, tuple(plan.actions[shard]), mods,
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
                and _sha256(path) == r.sha256:
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
            for rec in ex.map(_run_shard, [dataclasses.replace(j, timings=None) for j in jobs]):
                record(rec)
    elif jobs:  # a shard's SHA-256 is computed in a thread while the next shard converts
        hash_in_thread(jobs, _run_shard, _sha256, dst, record, timings)
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
