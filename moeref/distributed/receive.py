"""What :func:`~moeref.distributed.ep_dispatch` hands back on one rank: the receive buffers of its two modes
(:class:`NormalDispatch`, :class:`LowLatencyDispatch`; layouts in :mod:`moeref.distributed.dispatch`) and the
:class:`CombineHandle` that :func:`~moeref.distributed.ep_combine` reads. NumPy arrays from ``engine="host"``, torch
tensors on the group's device from ``engine="device"`` (the same fields, bit for bit)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dispatch import to_contiguous
from .plan import SendPlan

__all__ = ["DISPATCH_MODES", "CombineHandle", "LowLatencyDispatch", "NormalDispatch"]

DISPATCH_MODES = ("normal", "low_latency")


@dataclass(frozen=True, eq=False)
class CombineHandle:
    """What :func:`ep_combine` needs. Source side: this rank's :class:`SendPlan` and router weights
    ``[T, k]``. Destination side: ``return_index`` (int64, flat indices into the expert-output rows
    this rank returns for ``order="slot"``, in receive order) with ``return_counts [R]`` per source,
    and ``rows_from [R]`` (received rows per source, for ``order="rank"``)."""

    mode: str
    plan: SendPlan
    topk_weights: np.ndarray
    return_index: np.ndarray
    return_counts: np.ndarray
    rows_from: np.ndarray
    engine: str = "host"


@dataclass(frozen=True, eq=False)
class NormalDispatch:
    """DeepEP normal-mode receive buffers of one rank (:mod:`moeref.distributed.dispatch`). ``x`` float ``[N_recv, H]``
    in the senders' dtype (None with quantized dispatch), ``xq`` the received
    :class:`~moeref.quant.QuantizedTensor` (or None), ``topk_idx`` int64 ``[N_recv, k]``,
    ``topk_weights`` float32 ``[N_recv, k]``, ``src_rank`` / ``src_token`` int64 ``[N_recv]``,
    ``rank_prefix_matrix`` int64 ``[R, R]``, ``num_recv_tokens_per_expert`` int64 ``[E_local]``."""

    x: np.ndarray | None
    xq: object
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    src_rank: np.ndarray
    src_token: np.ndarray
    rank_prefix_matrix: np.ndarray
    num_recv_tokens_per_expert: np.ndarray
    handle: CombineHandle
    engines: tuple = ()

    @property
    def num_recv(self) -> int:
        return int(self.topk_idx.shape[0])

    @property
    def num_local_experts(self) -> int:
        return int(self.num_recv_tokens_per_expert.size)

    def contiguous(self, alignment: int):
        """DeepGEMM's contiguous layout (indices only) of the received rows:
        :func:`moeref.dispatch.to_contiguous` with the received rows as tokens; ``src = row*k + j``."""
        return to_contiguous(None, self.topk_idx, max(self.num_local_experts, 1), alignment)


@dataclass(frozen=True, eq=False)
class LowLatencyDispatch:
    """DeepEP low-latency receive buffers of one rank (:mod:`moeref.distributed.dispatch`), ``W = R * M``: ``x``
    ``[E_local, W, H]`` (zero past ``recv_count``; None with quantized dispatch), ``xq`` the received
    :class:`~moeref.quant.QuantizedTensor` of shape ``[E_local, W, H]`` (or None), ``recv_count`` int32
    ``[E_local]``, ``src_info`` / ``src_rank`` int32 ``[E_local, W]`` (-1 padding), ``layout_range``
    int64 ``[E_local, R]``."""

    x: np.ndarray | None
    xq: object
    recv_count: np.ndarray
    src_info: np.ndarray
    src_rank: np.ndarray
    layout_range: np.ndarray
    handle: CombineHandle
    engines: tuple = ()

    @property
    def num_local_experts(self) -> int:
        return int(self.recv_count.size)


def _received(payload, qt, quant, shape):
    if qt is None:
        return payload[0], None
    from ..quant import QuantizedTensor

    return None, QuantizedTensor(payload[0], payload[1], quant, shape)
