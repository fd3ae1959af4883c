"""Expert parallelism across processes on torch.distributed: exact dispatch/combine references
(DeepEP normal and low-latency semantics), a distributed fused-MoE layer bit-identical to the
single-process one, and validation of a user's distributed kernel. See docs/expert-parallel.md.

* :mod:`.placement`: :class:`EPPlacement`, every rank's experts (linear, round-robin, custom,
  redundant replicas).
* :mod:`.plan`: what a source rank sends where (NumPy; DeepEP ``get_dispatch_layout``).
* :mod:`.group`: :class:`EPGroup`, the collectives used, their errors and timeouts.
* :mod:`.dispatch`: :func:`ep_dispatch`, the protocol and its receive layouts (``engine="host"``: NumPy);
  :mod:`.header` its header exchange and input checks; :mod:`.receive` what it returns
  (:class:`NormalDispatch`, :class:`LowLatencyDispatch`, :class:`CombineHandle`); :mod:`.recv_buffer`
  :class:`LowLatencyBuffer`, the reused low-latency receive buffer.
* :mod:`.combine`: :func:`ep_combine`, :func:`reduce_local_slots`.
* :mod:`.device`: the same on each rank's device (``engine="device"``: torch tensors, the same bits).
* :mod:`.layer`: :func:`ep_fused_moe`.
* :mod:`.validate`: :func:`validate_ep_kernel`.
* :mod:`.world`: :class:`LocalWorld`, local worker processes for tests without torchrun.
* :mod:`.demo`: ``torchrun --nproc-per-node 2 -m moeref.distributed.demo``.

torch is imported only when a process group is used.
"""
from __future__ import annotations

from .combine import COMBINE_ORDERS, ep_combine, reduce_local_slots
from .dispatch import ep_dispatch
from .receive import DISPATCH_MODES, CombineHandle, LowLatencyDispatch, NormalDispatch
from .recv_buffer import LowLatencyBuffer, ep_low_latency_buffer
from .layer import ep_fused_moe, local_weights
from .group import EPCommError, EPGroup, EPPeerError, EPTimeoutError, ep_group
from .placement import EPPlacement, ep_placement
from .plan import DispatchLayout, SendPlan, dispatch_layout, send_plan
from .validate import EPKernelOutput, EPValidation, RankCheck, validate_ep_kernel
from .world import LocalWorld, RankError

__all__ = [
    "COMBINE_ORDERS",
    "DISPATCH_MODES",
    "CombineHandle",
    "DispatchLayout",
    "EPCommError",
    "EPGroup",
    "EPKernelOutput",
    "EPPeerError",
    "EPPlacement",
    "EPTimeoutError",
    "EPValidation",
    "LocalWorld",
    "LowLatencyBuffer",
    "LowLatencyDispatch",
    "NormalDispatch",
    "RankCheck",
    "RankError",
    "SendPlan",
    "dispatch_layout",
    "ep_combine",
    "ep_dispatch",
    "ep_fused_moe",
    "ep_group",
    "ep_low_latency_buffer",
    "ep_placement",
    "local_weights",
    "reduce_local_slots",
    "send_plan",
    "validate_ep_kernel",
]
