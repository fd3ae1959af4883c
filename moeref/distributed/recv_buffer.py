"""The reusable receive buffer of low-latency dispatch on the device (DeepEP ``Buffer``'s low-latency receive
buffer): :func:`ep_low_latency_buffer` makes one, ``ep_dispatch(mode="low_latency", engine="device",
recv_buffer=...)`` receives into it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_positive_int
from ..moe.pipeline import _dtype
from .group import EPGroup
from .header import _FLOAT_DTYPES, _check_quant
from .placement import EPPlacement

__all__ = ["LowLatencyBuffer", "ep_low_latency_buffer"]


@dataclass(eq=False)
class LowLatencyBuffer:
    """A reusable receive buffer of low-latency dispatch on the device (DeepEP ``Buffer``'s low-latency receive
    buffer): made by :func:`ep_low_latency_buffer`, passed as ``ep_dispatch(..., recv_buffer=)``.

    ``parts``: the masked receive tensors ``[E_local, R*M, ...]`` on ``device``, one per payload field (the rows;
    or the codes, then the scales, with ``quant``), zero outside the rows of the last dispatch; ``specs``: their
    ``(torch dtype, row shape)``; ``written``: the flat rows (int64 tensor) the last dispatch wrote, None before
    the first. A dispatch through it zeroes ``written`` again and writes its own rows, so its result equals a
    fresh buffer's; the result's ``x`` / ``xq`` **are** these tensors, valid until the next dispatch with the
    buffer (DeepEP's ``low_latency_dispatch`` has the same contract). Don't write into them: the rows past
    ``recv_count`` are zero because only a dispatch writes there."""

    parts: tuple
    specs: tuple
    num_local_experts: int
    capacity: int
    device: str
    quant: object = None
    written: object = None

    def receive(self, index, payload) -> tuple:
        """Zero the rows of the last dispatch, write ``payload`` (each part's rows as bytes, uint8 ``[Q, nbytes]``)
        at the flat rows ``index`` (int64 ``[Q]``, distinct), remember them; returns ``parts``."""
        from .device import scatter_row_bytes

        rows = self.num_local_experts * self.capacity
        if self.written is not None and self.written.numel():
            for buf in self.parts:
                buf.view(rows, -1).index_fill_(0, self.written, 0)
        self.written = None
        for buf, part in zip(self.parts, payload):
            scatter_row_bytes(buf, rows, index, part)
        self.written = index
        return self.parts


def ep_low_latency_buffer(placement: EPPlacement, group: EPGroup, *, max_tokens_per_rank: int, hidden_size: int,
                          dtype="bfloat16", quant=None) -> LowLatencyBuffer:
    """A :class:`LowLatencyBuffer` for ``ep_dispatch(mode="low_latency", engine="device", recv_buffer=...)`` on this
    rank: ``E_local = placement.num_local(group.rank)`` experts, ``R*M`` rows each (``M = max_tokens_per_rank``),
    rows of ``hidden_size`` elements of ``dtype`` (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"float64"``), or
    with ``quant`` (a row-local :class:`moeref.quant.Scheme`) its codes and scales. Allocated zeroed once, on
    ``group.device``; a dispatch with other sizes, dtype or scheme raises ``ValueError`` naming both."""
    import torch

    from .. import _interop
    from .device import zeros

    if not isinstance(placement, EPPlacement):
        raise TypeError(f"placement must be an EPPlacement; got {type(placement).__name__}")
    placement.check_world_size(group.world_size)
    m = check_positive_int(max_tokens_per_rank, "max_tokens_per_rank")
    h = check_positive_int(hidden_size, "hidden_size")
    if not isinstance(dtype, (str, np.dtype, type)):  # a torch dtype
        dtype = str(dtype).replace("torch.", "")
    name = str(_dtype(dtype))
    if name not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(_FLOAT_DTYPES)}; got {name}")
    if quant is None:
        specs = ((getattr(torch, name), (h,)),)
    else:
        qt = _check_quant(quant, np.zeros((1, h), _dtype(dtype)))  # the scheme's checks; the shapes of a row
        specs = ((torch.uint8, tuple(qt.codes.shape[1:])),
                 (_interop.to_torch(np.zeros(0, qt.scales.dtype)).dtype, tuple(qt.scales.shape[1:])))
    n_local, cap = placement.num_local(group.rank), group.world_size * m
    parts = tuple(zeros((n_local, cap) + tail, dt, group.device) for dt, tail in specs)
    return LowLatencyBuffer(parts, specs, n_local, cap, str(group.device), quant)


def _check_buffer(buf, specs, n_local: int, cap: int, device, quant) -> None:
    """``TypeError``/``ValueError`` unless ``buf`` is a :class:`LowLatencyBuffer` for this dispatch."""
    if not isinstance(buf, LowLatencyBuffer):
        raise TypeError(f"recv_buffer must be a LowLatencyBuffer (ep_low_latency_buffer); got {type(buf).__name__}")
    got = (buf.num_local_experts, buf.capacity, tuple(buf.specs), str(buf.device))
    want = (n_local, cap, tuple((dt, tuple(t)) for dt, t in specs), str(device))
    if got != want or buf.quant is not quant and buf.quant != quant:
        raise ValueError(f"recv_buffer holds (E_local, R*M, fields, device, quant) = {got + (buf.quant,)}; this "
                         f"dispatch needs {want + (quant,)}: make it with ep_low_latency_buffer for these sizes")
