"""The device-report path of ``moeref convert`` (:mod:`.shard` chooses it where the report is computed on a
device, ``ConvertOptions.report_device``): a shard read, converted and written as a bounded pipeline, and a fused
group's amax on the device; and, on either path, the written shards hashed in a thread while the next one
converts (:func:`hash_in_thread`) where they were not hashed as they were written.

:func:`run_pipeline` runs the threads of one shard: a reader thread (:data:`PIPELINE_DEPTH` modules ahead, each
tensor read with one ``os.preadv`` into page-locked memory where the report's device is a CUDA GPU, which the
device copies then read directly (:class:`DirectReads`); the shard's file prefetched into the page cache by
:func:`prefetch`), the conversion and the report in the calling thread (the steps :mod:`.shard` passes in), and a
writer thread (the :class:`.safetensors_io.ShardWriter`, which hashes the file as it writes it where :mod:`.shard`
predicted its tensors from the plan, so that no shard is read back to be hashed). It writes the same tensors in
the same order as the host loop of :mod:`.shard`, so both paths write the same bytes. This module imports nothing
of :mod:`.shard` or :mod:`.convert`; the conversion's steps come in as arguments.
"""
from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np

from .layouts import ModuleData
from .report import timed

PIPELINE_DEPTH = 2
"""Modules read ahead of the conversion, and converted modules queued for the writer, in a pipelined shard."""

_DONE = object()


class _Stage(threading.Thread):
    """A pipeline thread: runs ``fn``; on an exception keeps it for the main thread and sets ``stop``, so that
    no stage waits on a queue the failed one no longer serves."""

    def __init__(self, fn, name, stop):
        super().__init__(name=name, daemon=True)
        self.fn, self.error, self.stop = fn, None, stop

    def run(self):
        try:
            self.fn()
        except BaseException as e:  # re-raised by the main thread
            self.error = e
            self.stop.set()


def _put(q, item, stop) -> bool:
    """Put ``item`` into the bounded queue ``q`` unless ``stop`` is set first (the other side failed)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class DirectReads:
    """A view of a :class:`.safetensors_io.SafetensorsCheckpoint` whose ``read`` is
    :meth:`~.safetensors_io.SafetensorsCheckpoint.read_into`: each tensor read with ``os.preadv`` (the interpreter
    lock released while the disk or the page cache delivers) into fresh memory, page-locked where ``device`` is a
    CUDA device (``torch.empty(..., pin_memory=True)``: torch's caching host allocator reuses a block once the
    tensors on it are dropped and the copies that read it have ended), so that the device copies of the report
    read it at the bus's speed, without a staging copy (:func:`moeref._interop.to_device`); plain NumPy memory
    elsewhere. The arrays are read-only (a :class:`~moeref.quant.QuantizedTensor` takes them without a copy);
    the same values as ``read``. Everything else is the checkpoint's."""

    def __init__(self, ck, device: str | None):
        self._ck = ck
        self._pinned = device is not None and str(device).startswith("cuda")

    def __getattr__(self, name):
        return getattr(self._ck, name)

    def _alloc(self, nbytes: int) -> np.ndarray:
        if self._pinned:
            import torch

            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(nbytes, np.uint8)

    def read(self, name: str) -> np.ndarray:
        return self._ck.read_into(name, self._alloc)


def prefetch(path: str) -> None:
    """Ask the kernel to read the file ``path`` into the page cache, sequentially, in the background
    (``posix_fadvise(WILLNEED)`` from a daemon thread; nothing where the call does not exist). safetensors
    maps a shard and reads it by page faults as its tensors are touched; this turns that into one sequential
    read at the disk's bandwidth, ahead of the reader."""
    if not hasattr(os, "posix_fadvise"):
        return

    def advise():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    threading.Thread(target=advise, name="moeref-convert-prefetch", daemon=True).start()


def run_pipeline(job, ck, writer, convert_module, dequantize_module) -> tuple[int, list]:
    """Read, convert and write the shard of ``job`` (a :class:`.shard.ShardJob` with ``device`` and ``group_state``
    set) from the open checkpoint ``ck`` into ``writer``; ``(tensors copied, ModuleReports)``. ``convert_module(data,
    job, ck)`` and ``dequantize_module(data, job)`` each give ``(tensors, ModuleReport)`` of one module. A module of
    a fused group brings its group's members, read once, into ``job.group_state["datas"]`` (``convert_module``
    computes the group's shared global once, from them, on the device). The writer is closed when the shard is
    complete; on an error in any stage both threads stop, the writer is aborted (no partial file is left) and the
    error is raised here. The members held and the device uploads are cleared at the end; ``ck`` stays open.
    ``job.timings`` (a :class:`.report.StageTimes`, or None) receives ``read`` (the reader thread), ``write``
    (the writer thread), ``close``, and the conversion thread's ``wait_read`` and ``wait_write``."""
    stop = threading.Event()
    tm = job.timings
    to_convert, to_write = queue.Queue(PIPELINE_DEPTH), queue.Queue(PIPELINE_DEPTH)
    held = {}  # group members read ahead, by module
    src = DirectReads(ck, job.device)

    def read():
        groups_read = set()
        for name, action, _ in job.actions:
            if stop.is_set():
                return
            t0 = time.perf_counter()
            if action == "copy":
                item = (name, action, src.read(name))
            else:
                data = held.pop(name, None) or job.read_source(name, job.modules[name], src)
                if action == "convert" and name in job.groups and job.groups[name] not in groups_read:
                    groups_read.add(job.groups[name])  # the group's members, read once, for its global
                    for m in job.groups[name]:
                        md = data if m == name else held.get(m) or job.read_source(m, job.group_roles[m], src)
                        job.group_state["datas"][m] = md
                        if m != name and m in job.modules:
                            held[m] = md
                item = (name, action, data)
            if tm is not None:
                tm.add("read", time.perf_counter() - t0)
            if not _put(to_convert, item, stop):
                return
        _put(to_convert, _DONE, stop)

    def write():
        while not stop.is_set():
            try:
                item = to_write.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is _DONE:
                return
            with timed(tm, "write"):
                for tname, arr in item:
                    writer.add(tname, arr)

    reader = _Stage(read, "moeref-convert-read", stop)
    writer_thread = _Stage(write, "moeref-convert-write", stop)
    reports, copied = [], 0

    prefetch(ck.file(job.shard))
    reader.start()
    writer_thread.start()
    try:
        while True:
            t0 = time.perf_counter()
            try:
                item = to_convert.get(timeout=0.1)
            except queue.Empty:
                if tm is not None:
                    tm.add("wait_read", time.perf_counter() - t0, 0)
                if reader.error is not None:
                    raise reader.error
                if writer_thread.error is not None:
                    raise writer_thread.error
                continue
            if tm is not None:
                tm.add("wait_read", time.perf_counter() - t0)
            if item is _DONE:
                break
            name, action, data = item
            if action == "copy":
                tensors = [(name, data)]
                copied += 1
            elif action == "convert":
                tensors, mr = convert_module(data, job, ck)
                reports.append(mr)
            else:
                tensors, mr = dequantize_module(data, job)
                reports.append(mr)
            with timed(tm, "wait_write"):
                if not _put(to_write, tensors, stop):
                    break
        with timed(tm, "wait_write"):
            _put(to_write, _DONE, stop)
            writer_thread.join()
        for t in (reader, writer_thread):
            if t.error is not None:
                raise t.error
        with timed(tm, "close"):
            writer.close()
    except BaseException:
        stop.set()
        reader.join()
        writer_thread.join()
        writer.abort()
        raise
    finally:
        from ..quant.device_report import clear_uploads

        held.clear()
        job.group_state["datas"].clear()
        clear_uploads()
    return copied, reports


def device_amax(d: ModuleData, precision: str, device: str) -> float:
    """``max |v|`` of :func:`.shard._group_global`'s member values ``v`` (the source decoded to float32, or
    float64 for ``precision="exact"``; float values as float32), computed on ``device``: the one member of
    :func:`device_amaxes`."""
    return device_amaxes([d], precision, device)[0]


def device_amaxes(datas: list, precision: str, device: str) -> list:
    """``[max |v|]`` of each of ``datas`` (:func:`device_amax`'s values; NaN where a value is NaN, 0.0 for an
    empty tensor), computed on ``device`` and brought to the host together (one wait for the device per fused
    group). A quantized source's maximum comes from its codes and block scales
    (:func:`moeref.quant.device_report.device_codes_amax`, the same float without decoding the tensor), else
    from the decoded values."""
    import torch

    from .._interop import to_device, to_torch
    from ..quant.device_report import device_codes_amax, device_dequantize, upload

    f32 = precision == "float32"
    out = []
    for d in datas:
        if d.q is not None:
            if d.q.zero_points is not None or d.q.channel_scales is not None:
                v = torch.from_numpy(d.q.dequantize(np.float32 if f32 else np.float64))
            else:
                codes, scales = upload(d.q, device)
                m = device_codes_amax(codes, scales, d.q.scheme, d.q.shape, d.q.global_scale, float32=f32)
                if m is not None:
                    out.append(m)
                    continue
                v = device_dequantize(codes, scales, d.q.scheme, d.q.shape, d.q.global_scale)
                v = v.to(torch.float32) if f32 else v
        else:
            v = to_device(to_torch(np.asarray(d.values)), device).to(torch.float32)
        out.append(v.abs().max() if v.numel() else None)
    on_device = [m for m in out if m is not None]
    got = iter(torch.stack([m.to(device=device, dtype=torch.float64) for m in on_device]).tolist()
               if on_device else [])  # float32 to float64: exact
    return [0.0 if m is None else next(got) for m in out]


def hash_in_thread(jobs, run_shard, sha256, dst: str, record, timings=None) -> None:
    """Run ``run_shard(job, hash_later=True)`` for each of ``jobs`` in turn; a shard's SHA-256 (``sha256`` of the
    file just written, under ``dst``) is computed in a thread while the next shard converts, and ``record(rec)``
    is called once its hash is known, in shard order; a record that comes with its ``sha256`` already (the
    writer hashed the file as it wrote it: :class:`.safetensors_io.ShardWriter`'s ``expect``) is not hashed again.
    The shards finished before a failure are recorded (a resumed run skips them). ``timings`` (a
    :class:`.report.StageTimes`, or None) receives ``hash`` (the hashing thread) and ``wait_hash`` (this thread
    waiting for a hash)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="moeref-convert-hash") as hasher:
        pending = []

        def hashed(path):
            with timed(timings, "hash"):
                return sha256(path)

        def done(wait: bool):
            while pending and (wait or pending[0][1] is None or pending[0][1].done()):
                rec, fut = pending.pop(0)
                if fut is not None:
                    with timed(timings, "wait_hash"):
                        rec.sha256 = fut.result()
                record(rec)

        try:
            for job in jobs:
                rec = run_shard(job, hash_later=True)
                pending.append((rec, None if rec.sha256 else hasher.submit(hashed, os.path.join(dst, rec.shard))))
                done(wait=False)
        finally:
            done(wait=True)
