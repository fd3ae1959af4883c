"""One shard of a ``moeref convert`` run (:func:`.convert.convert_checkpoint` plans the run and hands out the
shards): where its report is computed (:func:`report_device`), what it is asked to do (:class:`ShardJob`), one
module converted into the target layout with its report (:func:`_convert_module`; a fused group's shared global:
:func:`_group_global`) or written as BF16 (:func:`_dequantize_module`), the shard converted on the host in turn or
as a pipeline with the report on a device (:func:`run_shard`; :mod:`.pipeline`), its SHA-256
(:func:`sha256_file`), and the written shard re-read and checked against the source (:func:`verify_shard`).

A :class:`ShardJob` holds the run's ``ConvertOptions`` (:mod:`.convert`); this module does not import
:mod:`.convert`, which imports it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..quant import QuantizedTensor, quantize_and_report, requantize
from ..quant.tensor import sum_of_squares
from .engines import choose_engine, source_quantizer
from .layouts import LAYOUTS, ModuleData
from .pipeline import device_amaxes, run_pipeline
from .report import ModuleReport, ShardRecord, StageTimes, timed
from .scale_layout import reading_view, swizzle_tensors
from .safetensors_io import CheckpointError, SafetensorsCheckpoint, ShardWriter


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
class ShardJob:
    """What one shard's conversion is asked to do (:func:`.convert.convert_checkpoint` makes one per shard from
    the plan; a worker process gets it pickled)."""

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


def _convert_module(data: ModuleData, job: ShardJob, ck) -> tuple:
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


def _group_global(members, job: ShardJob, ck, scheme, datas: list | None = None,
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
    if device is not None:  # the same numbers on the device: a max is exact in any order
        for a in device_amaxes(datas, job.opts.precision, device):
            amax = max(amax, a)
    for d in datas if device is None else ():
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


def _dequantize_module(data: ModuleData, job: ShardJob) -> tuple:
    with timed(job.timings, "dequantize"):
        return _dequantize_module_timed(data, job)


def _dequantize_module_timed(data: ModuleData, job: ShardJob) -> tuple:
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


def run_shard(job: ShardJob, hash_later: bool = False) -> ShardRecord:
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


def header_reserve(job: ShardJob) -> int:
    """Bytes to leave for a shard's safetensors header (:class:`ShardWriter`'s ``reserve``): an upper bound
    from the plan, the same on the host and the device path, so both write the same bytes. Per tensor its
    name and 160 bytes of dtype, shape and offsets; a module writes at most 6 tensors, named after it with a
    suffix of at most 32 characters; 1 KiB of metadata."""
    n = 1024
    for name, action, _ in job.actions:
        n += len(name.encode()) + 160 if action == "copy" else 6 * (len(name.encode()) + 32 + 160)
    return n


def expected_entries(job: ShardJob, ck) -> list | None:
    """``[(tensor name, dtype string, shape)]`` the shard of ``job`` will hold, in the order it is written,
    predicted from the plan alone (for :class:`ShardWriter`'s ``expect``: the file hashed as it is written), or
    None where a module's tensors cannot be predicted. A copied tensor keeps the source's dtype and shape; a
    module written as BF16 is its ``.weight``; a converted module gives what the target layout writes (and
    :func:`swizzle_tensors`) for a module of its shape with zero codes and scales (a static input scale where the
    source has one), its names following the module's. A wrong prediction costs only time: the writer checks
    every tensor against it and the shard is then hashed after it is closed."""
    tl = LAYOUTS[job.opts.target]
    scheme = tl.scheme(job.opts.preset)
    patterns: dict = {}
    out = []
    for name, action, shape in job.actions:
        if action == "copy":
            dt, sh = ck.info(name)
            out.append((name, dt, list(sh)))
            continue
        shape = tuple(int(d) for d in shape)
        if action != "convert":
            out.append((name + ".weight", "BF16", list(shape)))
            continue
        key = (shape, "input" in job.modules.get(name, {}))
        if key not in patterns:
            patterns[key] = _written_pattern(tl, scheme, shape, key[1], job.opts.scale_layout)
        if patterns[key] is None:
            return None
        out += [(name + suffix, dt, sh) for suffix, dt, sh in patterns[key]]
    return out


def _written_pattern(tl, scheme, shape: tuple, has_input: bool, scale_layout: str) -> list | None:
    """``[(name suffix, dtype string, shape)]`` of what ``tl`` writes for a module of ``shape`` in ``scheme``
    (:func:`expected_entries`), from a module of zero codes and scales; None where it cannot be told."""
    from ..quant.blocks import grid_shape
    from .safetensors_io import dtype_name

    probe = "moeref.probe"
    try:
        packed = shape[:-1] + ((shape[-1] + 1) // 2,) if scheme.packed else shape
        grid = grid_shape(shape, scheme.resolve_block(shape))
        codes = np.zeros(packed, np.uint8)
        scales = np.ones(grid, np.float32) if scheme.scale_format == "fp32" else np.zeros(grid, np.uint8)
        for a in (codes, scales):
            a.setflags(write=False)  # taken without a copy
        q = QuantizedTensor(codes=codes, scales=scales, scheme=scheme, shape=shape,
                            global_scale=1.0 if scheme.global_scale else None)
        tensors = tl.write(probe, ModuleData(probe, {}, q=q, input_scale=1.0 if has_input else None))
        if scale_layout == "swizzled":
            tensors = swizzle_tensors(tl.name, tensors)
    except (ValueError, TypeError, CheckpointError):
        return None
    pattern = []
    for tname, arr in tensors:
        if not tname.startswith(probe):
            return None
        a = np.asarray(arr)
        pattern.append((tname[len(probe):], dtype_name(a.dtype), list(a.shape)))
    return pattern


def _finish_shard(job: ShardJob, path: str, copied: int, reports: list, hash_later: bool = False,
                  digest: str | None = None) -> ShardRecord:
    """The shard's record; ``digest``: its SHA-256 where the writer hashed it as it wrote it, else the file is
    hashed here (or, ``hash_later``, by the caller)."""
    digest = digest or ""
    if not digest and not hash_later:
        with timed(job.timings, "hash"):
            digest = sha256_file(path)
    rec = ShardRecord(job.shard, os.path.getsize(path), digest, False, copied, reports)
    if job.opts.verify:
        with timed(job.timings, "verify"):
            verify_shard(job.src, job.dst, rec, job)
        rec.verified = True
    return rec


def _run_shard_pipelined(job: ShardJob, device: str, hash_later: bool = False) -> ShardRecord:
    """One shard as a bounded pipeline (:func:`.pipeline.run_pipeline`): a reader thread, the conversion and the
    report on ``device`` in this thread, and a writer thread, so that reading, converting and writing overlap.
    The same tensors in the same order as :func:`run_shard`'s host loop; a fused group's shared global is
    computed once per group, from the members read with it, on the device."""
    job = dataclasses.replace(job, device=device, group_state={"datas": {}, "globals": {}})
    ck = SafetensorsCheckpoint.open(job.src)
    path = os.path.join(job.dst, job.shard)
    writer = ShardWriter(path, {"format": "pt", "converted_by": "moeref convert",
                                "target_layout": job.opts.target}, reserve=header_reserve(job),
                         expect=expected_entries(job, ck))
    try:
        copied, reports = run_pipeline(job, ck, writer, _convert_module, _dequantize_module)
    finally:
        ck.close()
    return _finish_shard(job, path, copied, reports, hash_later, writer.sha256)


def sha256_file(path: str) -> str:
    """SHA-256 of the file ``path`` (hex). The file is read in 16 MiB pieces into two reused buffers, the next
    piece read (in a thread) while this one is hashed; the interpreter lock is released in both."""
    from concurrent.futures import ThreadPoolExecutor

    h = hashlib.sha256()
    bufs = (bytearray(16 << 20), bytearray(16 << 20))
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="moeref-sha-read") as ex:
        i = 0
        pending = ex.submit(f.readinto, bufs[0])
        while n := pending.result():
            pending = ex.submit(f.readinto, bufs[1 - i])
            h.update(memoryview(bufs[i])[:n])
            i = 1 - i
    return h.hexdigest()


def verify_shard(src: str, dst: str, rec: ShardRecord, job: ShardJob) -> None:
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

