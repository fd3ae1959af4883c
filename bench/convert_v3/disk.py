"""The disk under the DeepSeek-V3-sized conversion: its sequential write and read bandwidth
(:func:`disk_bandwidth`), the filesystem holding a path (:func:`filesystem`), and a file dropped from the page
cache so that the next read comes from the disk (:func:`drop_cache`)."""
from __future__ import annotations

import os
import time

import numpy as np

def drop_cache(path: str) -> None:
    """Evict ``path``'s pages from the page cache (written and fsync'd: clean pages), so the next read of it
    comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_bandwidth(directory: str, nbytes: int, chunk: int = 64 << 20) -> dict:
    """Sequential write (fsync'd) and read (after dropping the page cache) of one ``nbytes`` file, in
    ``chunk``-byte calls: GB/s each way."""
    path = os.path.join(directory, "bandwidth.bin")
    chunk = min(chunk, nbytes)
    buf = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8)
    n = max(1, nbytes // chunk)
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(n):
                f.write(memoryview(buf))
            f.flush()
            os.fsync(f.fileno())
        tw = time.perf_counter() - t0
        drop_cache(path)
        out = bytearray(chunk)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(out):
                pass
        tr = time.perf_counter() - t0
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"bytes": n * chunk, "chunk": chunk, "write_seconds": tw, "read_seconds": tr,
            "write_GBps": n * chunk / tw / 1e9, "read_GBps": n * chunk / tr / 1e9}


def filesystem(path: str) -> dict:
    """The mount holding ``path`` (from /proc/mounts: device, mount point, type) and its size and free space:
    a tmpfs would measure memory, not a disk."""
    real = os.path.realpath(path)
    best = ("?", "/", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, typ)
    except OSError:
        pass
    st = os.statvfs(real)
    return {"device": best[0], "mount": best[1], "type": best[2], "size_bytes": st.f_frsize * st.f_blocks,
            "free_bytes": st.f_frsize * st.f_bavail}
