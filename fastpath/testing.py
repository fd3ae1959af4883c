"""Test helpers for the fast paths: device selection and poisoned output buffers.

* :func:`device` — ``"cuda"`` when a CUDA GPU is present, else ``"cpu"`` with the kernels running
  under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before ``triton`` is imported; the
  repository's ``conftest.py`` does it; :func:`device` refuses to guess when it is not set).
* :func:`poisoned` — a context manager under which every buffer the fast paths allocate for their
  kernels to write (:func:`fastpath._host.alloc`: :mod:`fastpath.quant`, :mod:`fastpath.fused`,
  :mod:`fastpath.dispatch`) is filled with a poison byte pattern instead of whatever
  ``torch.empty`` returned. An element the kernel fails to write then keeps the poison
  (uint8 codes 0xA5, float32 scales -2.87e-16, int32 words 0xA5A5A5A5), which the comparison with
  the reference — and the explicit padding checks (padding must be 0) — catch.
* :func:`to_device` — NumPy/ml_dtypes array -> torch tensor on :func:`device` (bf16 through a bit view).
"""
from __future__ import annotations

import contextlib

import numpy as np

from moeref._interop import triton_interpreted

__all__ = ["POISON_BYTE", "device", "on_gpu", "to_device", "poisoned", "poison_"]

POISON_BYTE = 0xA5


def on_gpu() -> bool:
    import torch
    return bool(torch.cuda.is_available())


def device() -> str:
    """``"cuda"`` if a GPU is present; ``"cpu"`` when ``TRITON_INTERPRET=1`` runs kernels on CPU."""
    if on_gpu():
        return "cuda"
    if not triton_interpreted():
        raise RuntimeError("no CUDA GPU and TRITON_INTERPRET is not 1: set TRITON_INTERPRET=1 before "
                           "importing triton to run the Triton kernels on CPU tensors")
    return "cpu"


def to_device(a, dev: str | None = None):
    """torch tensor on ``dev`` (default :func:`device`) from a NumPy/ml_dtypes array."""
    from moeref._interop import to_torch
    return to_torch(np.ascontiguousarray(a), dev or device())


def poison_(t, byte: int = POISON_BYTE):
    """Fill tensor ``t`` (any dtype) with the repeated byte ``byte``; returns ``t``."""
    import torch
    if t.numel():
        t.view(torch.uint8).fill_(byte)  # the allocator's buffers are contiguous
    return t


@contextlib.contextmanager
def poisoned(byte: int = POISON_BYTE):
    """Within the block, kernel output buffers are poisoned with ``byte`` before the launch."""
    import torch
    from . import _host

    def alloc(*shape, **kw):
        return poison_(torch.empty(*shape, **kw), byte)

    old = _host._ALLOCATOR
    _host._ALLOCATOR = alloc
    try:
        yield byte
    finally:
        _host._ALLOCATOR = old
