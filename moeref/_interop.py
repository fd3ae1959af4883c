"""NumPy <-> torch bridging without copies where possible.

torch is optional. ``to_numpy`` turns a torch tensor into a NumPy array with the matching dtype
(bfloat16 and the float8 dtypes through a bit view into ml_dtypes, since ``Tensor.numpy()`` rejects
them); ``to_torch`` goes back. Everything else passes through unchanged.
"""
from __future__ import annotations

import os

import numpy as np
import ml_dtypes

__all__ = ["is_torch_tensor", "to_numpy", "to_torch", "to_device", "torch_dtype_for", "triton_interpreted"]

_BITVIEW = {  # torch dtype name -> (integer view dtype name, ml_dtypes/numpy dtype)
    "bfloat16": ("int16", ml_dtypes.bfloat16),
    "float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
    "float8_e5m2": ("uint8", ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": ("uint8", ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": ("uint8", ml_dtypes.float8_e5m2fnuz),
    "float8_e8m0fnu": ("uint8", ml_dtypes.float8_e8m0fnu),
}


def is_torch_tensor(x) -> bool:
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def to_numpy(x):
    """NumPy view of a torch tensor (moved to CPU first); other objects are returned unchanged."""
    if not is_torch_tensor(x):
        return x
    import torch

    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    name = str(x.dtype).replace("torch.", "")
    if name in _BITVIEW:
        int_name, np_dtype = _BITVIEW[name]
        return x.contiguous().view(getattr(torch, int_name)).numpy().view(np_dtype)
    return x.numpy()


def torch_dtype_for(np_dtype):
    import torch

    np_dtype = np.dtype(np_dtype)
    for name, (_, ml) in _BITVIEW.items():
        if np_dtype == np.dtype(ml):
            return getattr(torch, name)
    return torch.from_numpy(np.zeros(0, np_dtype)).dtype


def to_torch(a: np.ndarray, device=None):
    """torch tensor sharing memory with ``a`` where possible (bf16/fp8 through bit views)."""
    import torch

    a = np.ascontiguousarray(a)
    for name, (int_name, ml) in _BITVIEW.items():
        if a.dtype == np.dtype(ml):
            t = torch.from_numpy(a.view(np.dtype(int_name))).view(getattr(torch, name))
            break
    else:
        t = torch.from_numpy(a)
    return t if device is None else t.to(device)


def to_device(a, device, dtype=None):
    """A copy of the host array ``a`` (NumPy, or a CPU tensor) on ``device`` that does not wait for the device.

    A copy from pageable host memory makes the CPU wait for the stream (``cudaMemcpy`` semantics: torch's
    sync debug mode reports it); this one stages ``a`` in page-locked memory and copies with
    ``non_blocking=True``, so the copy is queued on the current stream in order with the kernels around it
    (later kernels read the copied values). Arrays of up to :data:`STAGING_MAX_BYTES` are staged in a pool of
    page-locked buffers kept by this module (:class:`_PinnedStaging`; a buffer is reused only once the copy that
    last read it has completed, told by a CUDA event), because page-locking fresh memory per call costs about a
    millisecond for a 1 MB array (H200, torch 2.11); larger arrays, and copies made while a CUDA graph is
    being captured, are staged in fresh page-locked memory (``Tensor.pin_memory``, held by torch's caching host
    allocator until the copy ends). A read-only array that is in page-locked memory already is copied from where
    it is, without staging (:func:`_read_only_pinned`). The values are ``a``'s (``dtype``: a torch dtype to convert to first, on
    the host). On a CPU device: ``torch.as_tensor``."""
    import torch

    t = a if torch.is_tensor(a) else torch.from_numpy(np.ascontiguousarray(a).reshape(np.shape(a)))
    if dtype is not None:
        t = t.to(dtype)
    dev = torch.device(device)
    if dev.type != "cuda":
        return t.to(dev)
    if dtype is None and _read_only_pinned(a, t):
        return t.to(dev, non_blocking=True)
    return _STAGING.copy(t.contiguous(), dev)


def _read_only_pinned(a, t) -> bool:
    """Whether ``a`` is a read-only C-contiguous NumPy array (``t`` its tensor) in page-locked memory, read-only
    along its whole chain of NumPy bases (nothing writes it through NumPy while the copy runs): :func:`to_device`
    then copies from where it is, without staging (e.g. a tensor that
    :meth:`moeref.checkpoint.SafetensorsCheckpoint.read_into` read into page-locked memory)."""
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or a.size == 0:
        return False
    b = a
    while isinstance(b, np.ndarray):
        if b.flags.writeable:
            return False
        b = b.base
    return bool(t.is_pinned())


STAGING_MAX_BYTES = 16 << 20
"""Largest array :func:`to_device` stages in its pool of page-locked buffers."""


class _PinnedStaging:
    """Page-locked staging buffers for :func:`to_device`, per power-of-two size (at least 4 KiB), at most
    ``per_size`` of each (with the default 8 and :data:`STAGING_MAX_BYTES`, under 256 MiB of page-locked memory
    in all, kept for the life of the process); a buffer is free when the CUDA event recorded after its last copy
    has completed. When every buffer of a size is still being read, the copy takes fresh page-locked memory."""

    def __init__(self, per_size: int = 8):
        import threading

        self._free: dict[int, list] = {}
        self._lock = threading.Lock()
        self._per_size = per_size

    def _buffer(self, nbytes: int):
        import torch

        size = max(4096, 1 << (nbytes - 1).bit_length())
        with self._lock:
            entries = self._free.setdefault(size, [])
            for entry in entries:
                if entry[1] is None or (entry[1] is not _IN_USE and entry[1].query()):
                    entry[1] = _IN_USE
                    return entry
            if len(entries) >= self._per_size:
                return None
            entry = [torch.empty(size, dtype=torch.uint8, pin_memory=True), _IN_USE]
            entries.append(entry)
            return entry

    def copy(self, t, dev):
        import torch

        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or nbytes > STAGING_MAX_BYTES or torch.cuda.is_current_stream_capturing():
            return t.pin_memory().to(dev, non_blocking=True)
        entry = self._buffer(nbytes)
        if entry is None:  # every buffer of this size still being read
            return t.pin_memory().to(dev, non_blocking=True)
        staged = entry[0][:nbytes]
        staged.copy_(t.reshape(-1).view(torch.uint8))
        out = staged.view(t.dtype).view(t.shape).to(dev, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
        entry[1] = event
        return out


_IN_USE = object()  # an entry's state while a thread fills it (before its copy's event exists)
_STAGING = _PinnedStaging()


def torch_e4m3_cast_saturates() -> bool:
    """Whether this torch's ``.to(torch.float8_e4m3fn)`` saturates (1000.0 -> 448) or gives NaN.

    torch >= 2.13 saturates finite overflow and +-Inf (pytorch/pytorch PRs #178817, #177870);
    torch <= 2.12 returns NaN. Measured, not read off the version string. Raises ImportError
    without torch.
    """
    import torch

    code = torch.tensor([1000.0]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    return code == 0x7E


def triton_interpreted() -> bool:
    """Whether Triton kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` in the environment
    (read on each call; Triton itself reads it when it is imported, so set it before). The one check moeref and
    fastpath make before launching a kernel on a CPU tensor."""
    return os.environ.get("TRITON_INTERPRET") == "1"
