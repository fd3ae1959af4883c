"""Sharded safetensors checkpoints: a lazy reader and a streaming, atomic shard writer.

Reading goes through the ``safetensors`` library (``safe_open``, memory-mapped: a tensor is read
when asked for). A checkpoint directory is either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {tensor:
shard}}``, huggingface_hub serialization). Shard names are taken from the index, never inferred
from the file names (gpt-oss numbers its shards from 0 and its "of" is the last index).

Writing streams: :class:`ShardWriter` appends each tensor's bytes to a side file as soon as it is
converted, so memory holds one tensor at a time; :meth:`ShardWriter.close` writes the safetensors
header (8-byte little-endian length, JSON, padded with spaces to 8 bytes; data offsets relative
to the data section), copies the data after it into ``<name>.partial``, fsyncs, and renames it to
``<name>``. A run that dies leaves only ``*.partial`` / ``*.data`` files, never a file with the
final name that is incomplete. Everything written is read back by ``safetensors`` in the tests.

The writer asks the kernel to start writing its bytes to the disk every :data:`WRITEBACK_BYTES` as it goes
(:func:`start_writeback`), so that the disk writes overlap whatever produces the tensors and the fsync of
:meth:`ShardWriter.close` waits only for the last of them (Linux otherwise keeps a shard's pages dirty in the
page cache until the fsync, up to a tenth of the memory, and the disk then writes the whole shard while the
caller waits). The bytes written are the same.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import shutil
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

__all__ = ["CheckpointError", "SafetensorsCheckpoint", "ShardWriter", "INDEX_NAME", "SINGLE_NAME",
           "DTYPE_NAMES", "dtype_name", "start_writeback", "WRITEBACK_BYTES"]

WRITEBACK_BYTES = 64 << 20
"""Bytes a :class:`ShardWriter` lets accumulate before it asks the kernel to start writing them out."""

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPE_NAMES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64), "BOOL": np.dtype(np.bool_),
}
_NAME_OF = {v: k for k, v in DTYPE_NAMES.items()}


class CheckpointError(ValueError):
    """Bad checkpoint input; the message names the tensor and the file."""


def dtype_name(dtype) -> str:
    """safetensors dtype string of a NumPy / ml_dtypes dtype."""
    d = np.dtype(dtype)
    if d not in _NAME_OF:
        raise TypeError(f"dtype {d} has no safetensors name; accepted: {', '.join(map(str, _NAME_OF))}")
    return _NAME_OF[d]


@dataclass
class SafetensorsCheckpoint:
    """A checkpoint directory: which shard holds which tensor, read lazily.

    Attributes:
        path: the directory.
        weight_map: tensor name -> shard file name (from the index, or the single file's keys).
        shards: shard file names in index order.
        indexed: whether the directory has ``model.safetensors.index.json``.
    """

    path: str
    weight_map: dict
    shards: list
    indexed: bool
    _handles: dict = field(default_factory=dict, repr=False)
    _headers: dict = field(default_factory=dict, repr=False)
    _spans: dict = field(default_factory=dict, repr=False)  # shard -> {name: (first byte, end) in the file}
    _fds: dict = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str) -> "SafetensorsCheckpoint":
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory (a checkpoint is a directory holding "
                                  f"{SINGLE_NAME} or {INDEX_NAME} and its shards)")
        idx = os.path.join(path, INDEX_NAME)
        if os.path.exists(idx):
            with open(idx) as f:
                try:
                    wm = json.load(f)["weight_map"]
                except (KeyError, json.JSONDecodeError) as e:
                    raise CheckpointError(f"{idx}: not a safetensors index ({e})") from None
            shards = list(dict.fromkeys(wm.values()))
            for s in shards:
                if not os.path.exists(os.path.join(path, s)):
                    raise CheckpointError(f"{idx} lists shard {s!r}, which is missing from {path}")
            return cls(path, dict(wm), shards, True)
        single = os.path.join(path, SINGLE_NAME)
        if os.path.exists(single):
            ck = cls(path, {}, [SINGLE_NAME], False)
            ck.weight_map = {n: SINGLE_NAME for n in ck.header(SINGLE_NAME)}
            return ck
        raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")

    def file(self, shard: str) -> str:
        return os.path.join(self.path, shard)

    def header(self, shard: str) -> dict:
        """``{name: (dtype string, shape tuple)}`` of one shard (read from its header only)."""
        if shard not in self._headers:
            fn = self.file(shard)
            try:
                with open(fn, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    h = json.loads(f.read(n))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{fn}: not a safetensors file ({e})") from None
            h.pop("__metadata__", None)
            self._headers[shard] = {k: (v["dtype"], tuple(v["shape"])) for k, v in h.items()}
            self._spans[shard] = {k: (8 + n + int(v["data_offsets"][0]), 8 + n + int(v["data_offsets"][1]))
                                  for k, v in h.items() if isinstance(v, dict) and "data_offsets" in v}
        return self._headers[shard]

    def names(self, shard: str | None = None) -> list:
        """Tensor names of one shard (file order) or of the whole checkpoint (index order)."""
        return list(self.header(shard)) if shard is not None else list(self.weight_map)

    def info(self, name: str) -> tuple:
        """``(dtype string, shape)`` of a tensor, from its shard's header."""
        shard = self.shard_of(name)
        h = self.header(shard)
        if name not in h:
            raise CheckpointError(f"tensor {name!r}: the index maps it to {self.file(shard)}, "
                                  "whose header does not hold it")
        return h[name]

    def shard_of(self, name: str) -> str:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {self.path}")
        return self.weight_map[name]

    def read(self, name: str) -> np.ndarray:
        """The tensor as a NumPy array (bfloat16 / float8 as ml_dtypes dtypes)."""
        from safetensors import safe_open

        from .._interop import to_numpy

        shard = self.shard_of(name)
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.file(shard), framework="pt")
        return to_numpy(self._handles[shard].get_tensor(name))

    def read_into(self, name: str, alloc) -> np.ndarray:
        """The tensor of :meth:`read` (the same values), read with ``os.preadv`` from its shard into memory that
        ``alloc(nbytes)`` gives (a writable 1-D uint8 NumPy array of at least ``nbytes`` bytes; e.g. page-locked
        memory that a device copy then reads directly), not through a memory map: one sequential read of its
        bytes, in which the interpreter lock is released, where :meth:`read`'s memory map reads by page faults
        wherever the bytes are first touched. The array is a read-only view of ``alloc``'s memory (nothing
        writes it afterwards, so :class:`~moeref.quant.QuantizedTensor` takes it without a copy)."""
        shard = self.shard_of(name)
        dt, shape = self.info(name)
        if dt not in DTYPE_NAMES:
            raise CheckpointError(f"tensor {name!r} in {self.file(shard)}: dtype {dt} has no NumPy dtype; "
                                  f"accepted: {', '.join(DTYPE_NAMES)}")
        begin, end = self._spans[shard][name]
        dtype = DTYPE_NAMES[dt]
        nbytes = end - begin
        if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(f"tensor {name!r} in {self.file(shard)}: {nbytes} bytes for shape {shape} "
                                  f"of {dt}")
        raw = alloc(nbytes)
        buf = raw[:nbytes]
        if shard not in self._fds:
            self._fds[shard] = os.open(self.file(shard), os.O_RDONLY)
        fd, done, view = self._fds[shard], 0, memoryview(buf)
        while done < nbytes:  # Linux reads at most 2 GiB - 4 KiB per call
            got = os.preadv(fd, [view[done:]], begin + done)
            if got <= 0:
                raise CheckpointError(f"tensor {name!r}: {self.file(shard)} ends before byte {end}")
            done += got
        del view, buf
        raw.setflags(write=False)  # then the views taken of it are read-only too
        return raw[:nbytes].view(dtype).reshape(shape)

    def read_bytes(self, name: str) -> bytes:
        """The raw little-endian payload of a tensor (for bit-exact copies and comparisons)."""
        a = np.ascontiguousarray(self.read(name))
        return a.view(np.uint8).tobytes() if a.size else b""

    def close(self) -> None:
        self._handles.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if not hasattr(os, "posix_fadvise") or not os.uname().sysname == "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing the dirty pages of ``nbytes`` bytes of the open file ``fd`` from ``offset``
    to the disk, without waiting for them (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; it waits only where
    the disk's queue is full). Not a durability guarantee: the fsync of :meth:`ShardWriter.close` is. Returns
    whether the call was made (False where the system has no such call, or it failed: nothing is lost then,
    the fsync writes the pages)."""
    fn = _sync_file_range()
    if fn is None or nbytes <= 0:
        return False
    return fn(fd, offset, nbytes, 2) == 0  # SYNC_FILE_RANGE_WRITE


class ShardWriter:
    """Write one safetensors shard tensor by tensor; atomic on :meth:`close`.

    ``reserve=0``: ``add(name, array)`` appends the bytes to ``<path>.data``; ``close()`` writes header + data
    to ``<path>.partial``, fsyncs and renames it to ``<path>`` (every byte written twice).

    ``reserve=N > 0`` (what the converter passes: an upper bound of the header's size from the plan): the
    data go straight into ``<path>.partial`` after ``8 + N`` bytes left for the header; ``close()`` writes the
    header there, padded with spaces to ``N`` bytes (the safetensors format allows trailing spaces in the
    header), fsyncs and renames: every byte written once. A header longer than ``N`` falls back to a second
    file with the exact header, as ``reserve=0`` writes it. ``N`` is a multiple of 8 (data stay 8-byte
    aligned). ``abort()`` removes the side files.

    Every :data:`WRITEBACK_BYTES` of data, the writer starts the disk writes of what it has written
    (:func:`start_writeback`; module docstring).

    ``expect`` (with ``reserve``): the ``[(name, dtype string, shape)]`` the shard is predicted to hold, in order.
    The writer then hashes the file as it writes it: the header those entries give, then each tensor's bytes as
    they are added; :attr:`sha256` is that SHA-256 (hex) after :meth:`close` when the header written is the one
    predicted, else None (a wrong prediction, or a header longer than ``reserve``: the caller hashes the file).
    The bytes written do not depend on ``expect``.
    """

    def __init__(self, path: str, metadata: dict | None = None, reserve: int = 0, expect: list | None = None):
        self.path = os.fspath(path)
        self.metadata = dict(metadata or {"format": "pt"})
        self._entries: list = []
        self._names: set = set()
        self._offset = 0
        self._flushed = 0  # data bytes whose write-out was started (start_writeback)
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"reserve must be a non-negative int; got {reserve!r}")
        self.reserve = -(-reserve // 8) * 8
        self.sha256: str | None = None
        self._sha, self._expected = None, None
        if expect is not None and self.reserve and all(e[1] in DTYPE_NAMES for e in expect):
            entries, at = [], 0
            for name, dt, shape in expect:
                n = int(np.prod(shape, dtype=np.int64)) * DTYPE_NAMES[dt].itemsize
                entries.append((name, dt, list(shape), at, at + n))
                at += n
            hb = self._header(entries)
            if len(hb) <= self.reserve:
                import hashlib

                self._expected = entries
                self._sha = hashlib.sha256(self.reserve.to_bytes(8, "little") + hb + b" " * (self.reserve - len(hb)))
        if self.reserve:
            self._data = open(self.path + ".partial", "wb")
            self._data.seek(8 + self.reserve)
        else:
            self._data = open(self.path + ".data", "wb")

    def add(self, name: str, array) -> None:
        a = np.asarray(array)
        a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
        if name in self._names:
            raise CheckpointError(f"tensor {name!r} written twice to {self.path}")
        raw = a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
        self._data.write(memoryview(raw))
        entry = (name, dtype_name(a.dtype), list(a.shape), self._offset, self._offset + raw.size)
        if self._sha is not None:  # the predicted entry, else the prediction is wrong: hash no further
            i = len(self._entries)
            if i < len(self._expected) and self._expected[i] == entry:
                self._sha.update(memoryview(raw))
            else:
                self._sha = None
        self._entries.append(entry)
        self._names.add(name)
        self._offset += raw.size
        if self._offset - self._flushed >= WRITEBACK_BYTES:
            self._data.flush()
            start = (8 + self.reserve if self.reserve else 0) + self._flushed
            start_writeback(self._data.fileno(), start, self._offset - self._flushed)
            self._flushed = self._offset

    @property
    def nbytes(self) -> int:
        return self._offset

    def _header(self, entries: list | None = None) -> bytes:
        header = {"__metadata__": {str(k): str(v) for k, v in self.metadata.items()}}
        for name, dt, shape, b, e in self._entries if entries is None else entries:
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [b, e]}
        hb = json.dumps(header, separators=(",", ":")).encode()
        return hb + b" " * (-len(hb) % 8)

    def close(self) -> None:
        hb = self._header()
        tmp = self.path + ".partial"
        if self.reserve and len(hb) <= self.reserve:
            out = self._data
            out.seek(0)
            out.write(self.reserve.to_bytes(8, "little"))
            out.write(hb + b" " * (self.reserve - len(hb)))
            if self._sha is not None and len(self._entries) == len(self._expected):
                self.sha256 = self._sha.hexdigest()  # the header written is the one hashed first
            out.flush()
            os.fsync(out.fileno())
            out.close()
            os.replace(tmp, self.path)
            return
        self._data.close()
        data_path, skip = (tmp, 8 + self.reserve) if self.reserve else (self.path + ".data", 0)
        if self.reserve:  # the header did not fit: the data move to a file with the exact header
            os.replace(tmp, self.path + ".data")
            data_path = self.path + ".data"
        with open(tmp, "wb") as out, open(data_path, "rb") as data:
            data.seek(skip)
            out.write(len(hb).to_bytes(8, "little"))
            out.write(hb)
            shutil.copyfileobj(data, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.remove(self.path + ".data")
        os.replace(tmp, self.path)

    def abort(self) -> None:
        if not self._data.closed:
            self._data.close()
        for suffix in (".data", ".partial"):
            if os.path.exists(self.path + suffix):
                os.remove(self.path + suffix)
