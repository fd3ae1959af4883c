"""Float64 constants for the device bound's Triton kernels, in a tensor.

Triton types a Python float argument or literal as float32, so a kernel that needs a float64 constant (``1 +
2^-40``, a unit roundoff, ``inf``, a probed NaN) reads it from a float64 tensor. :func:`float64_constants` makes
that tensor on the kernel's device, once per device and sequence of values (cached by the values' bits: ``-0.0``
is not ``0.0``, NaN payloads are kept); the kernels only read it.
"""
from __future__ import annotations

import functools

import numpy as np

__all__ = ["float64_constants"]


def float64_constants(device, *values):
    """A float64 tensor of ``values`` (Python floats, bit for bit) on ``device``: the same tensor for the same
    device and bits (do not write to it).

    >>> import torch
    >>> float64_constants("cpu", 1.0 + 2.0**-40, -0.0).tolist() == [1.0 + 2.0**-40, -0.0]
    True
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    bits = tuple(np.array([float(v) for v in values], dtype=np.float64).view(np.int64).tolist())
    return _table(str(dev), bits)


@functools.lru_cache(maxsize=256)
def _table(device: str, bits: tuple):
    import torch

    return torch.tensor(bits, dtype=torch.int64, device=device).view(torch.float64)
