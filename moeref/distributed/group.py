"""The process group an EP reference runs on, and the only collectives it uses.

Transport is torch.distributed, never a home-made one. The reference moves bytes only
(``all_gather`` of a small int64 header, ``all_to_all_single`` of packed rows, or where a backend lacks it
one ``batch_isend_irecv`` per peer: :func:`all_to_all_rows`) and reduces locally in
a fixed order, so results are bit-exact whatever the backend's reduction algorithms do (the
summation order inside an NCCL or gloo reduction is implementation-defined and may depend on the
algorithm and topology).

* **Backend -> device**: ``gloo`` runs on CPU tensors, ``nccl`` on ``cuda:<current device>``
  (call ``torch.cuda.set_device(local_rank)`` first, as torchrun scripts do). Nothing else changes.
* **Timeouts**: a collective that a peer never joins fails after the process group's timeout
  (``init_process_group(timeout=...)`` / ``new_group(timeout=...)``). On gloo the backend raises and
  moeref re-raises :class:`EPTimeoutError` naming this rank and the collective; a peer that exited
  gives :class:`EPPeerError`. On NCCL the watchdog enforces the same timeout by aborting the process
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), so there is nothing to catch there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EPCommError", "EPGroup", "EPPeerError", "EPTimeoutError", "ep_group"]

BACKENDS = ("gloo", "nccl")


class EPCommError(RuntimeError):
    """A collective of the EP reference failed (base class)."""


class EPTimeoutError(EPCommError, TimeoutError):
    """A collective did not complete within the process group's timeout (a peer hung, died or did
    not call the same collective)."""


class EPPeerError(EPCommError):
    """A peer's connection closed during a collective (the peer process exited)."""


@dataclass(frozen=True)
class EPGroup:
    """A torch.distributed process group as the EP reference uses it.

    ``group``: the ``ProcessGroup`` (None: the default group); ``rank`` / ``world_size`` within it;
    ``backend``: ``"gloo"`` or ``"nccl"``; ``device``: where tensors for the collectives live
    (``"cpu"`` for gloo, ``"cuda:i"`` for nccl); ``timeout_s``: the group's timeout in seconds as
    declared by whoever created it (reported in errors; None if unknown).
    """

    group: object
    rank: int
    world_size: int
    backend: str
    device: str
    timeout_s: float | None = None


def ep_group(group=None, *, timeout_s: float | None = None) -> EPGroup:
    """Wrap an initialized torch.distributed group (None: the default group) as an :class:`EPGroup`.

    ``timeout_s``: the timeout the group was created with (for error messages).
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group("
                           "backend, timeout=...) first (torchrun sets the rendezvous variables)")
    backend = str(dist.get_backend(group)).lower()
    if backend not in BACKENDS:
        raise ValueError(f"unsupported backend {backend!r}; accepted: {', '.join(map(repr, BACKENDS))}")
    device = "cpu" if backend == "gloo" else f"cuda:{torch.cuda.current_device()}"
    return EPGroup(group, dist.get_rank(group), dist.get_world_size(group), backend, device,
                   None if timeout_s is None else float(timeout_s))


def _collective(g: EPGroup, what: str, fn):
    """Run ``fn()``; turn a backend failure into an :class:`EPCommError` naming rank and collective."""
    try:
        return fn()
    except RuntimeError as e:  # torch's DistBackendError is a RuntimeError
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        low = str(e).lower()
        limit = "the process group's timeout"
        if g.timeout_s is not None:
            limit += f" ({g.timeout_s:g} s)"
        if "timed out" in low or "timeout" in low:
            raise EPTimeoutError(f"rank {g.rank} of {g.world_size}: {what} did not complete within {limit}: a peer "
                                 f"is dead, hung, or not calling the same collective (backend: {msg})") from e
        raise EPPeerError(f"rank {g.rank} of {g.world_size}: {what} failed, a peer's connection closed "
                          f"(the peer process exited?) (backend: {msg})") from e


def all_gather_int64(g: EPGroup, values: np.ndarray, what: str) -> np.ndarray:
    """``all_gather`` of a 1-D int64 vector of equal length on every rank -> int64 ``[R, n]``."""
    import torch
    import torch.distributed as dist

    v = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(g.device)
    outs = [torch.empty_like(v) for _ in range(g.world_size)]
    _collective(g, what, lambda: dist.all_gather(outs, v, group=g.group))
    return torch.stack(outs).cpu().numpy()


def all_to_all_bytes(g: EPGroup, rows: np.ndarray, send_counts, recv_counts, what: str) -> np.ndarray:
    """``all_to_all_single`` of packed rows: uint8 ``[S, B]`` split by ``send_counts [R]`` -> uint8
    ``[sum(recv_counts), B]``, blocks in ascending source rank (torch's contract)."""
    import torch

    b = int(rows.shape[1])
    inp = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.uint8).reshape(-1)).to(g.device)
    out = all_to_all_rows(g, inp, [int(c) * b for c in send_counts], [int(c) * b for c in recv_counts], what)
    return out.cpu().numpy().reshape(-1, b) if b else np.zeros((int(sum(int(c) for c in recv_counts)), 0), np.uint8)


# backend name -> True once it answered "does not support" to ``all_to_all_single`` (then every later call
# takes the point-to-point transport); tests set it to exercise that transport.
_P2P_FALLBACK: dict = {}


def all_to_all_rows(g: EPGroup, rows, send_counts, recv_counts, what: str):
    """``all_to_all_single`` of a device tensor of rows ``[S, ...]`` (any dtype, contiguous), split along
    dim 0 by ``send_counts [R]`` (host ints) -> ``[sum(recv_counts), ...]`` on ``g.device``, blocks in
    ascending source rank.

    Backends without ``alltoall_base`` (PyTorch's table marks gloo's all-to-all unsupported, while
    ``ProcessGroupGloo.cpp`` implements it: builds differ) answer "does not support"; the transport then
    falls back, for this backend and for the rest of the process, to its documented equivalent: one
    ``batch_isend_irecv`` of a send and a receive per peer (the own block is copied locally), which
    moves the same blocks to the same offsets."""
    import torch
    import torch.distributed as dist

    send = [int(c) for c in send_counts]
    recv = [int(c) for c in recv_counts]
    tail = tuple(rows.shape[1:])
    out = torch.empty((sum(recv),) + tail, dtype=rows.dtype, device=rows.device)
    if not _P2P_FALLBACK.get(g.backend, False):
        try:
            _collective(g, what, lambda: dist.all_to_all_single(out, rows, recv, send, group=g.group))
            return out
        except EPCommError as e:
            if "does not support" not in str(e):
                raise
            _P2P_FALLBACK[g.backend] = True
    return _all_to_all_p2p(g, rows, out, send, recv, what)


def _all_to_all_p2p(g: EPGroup, rows, out, send, recv, what: str):
    """The ``all_to_all_single`` contract with point-to-point operations (:func:`all_to_all_rows`)."""
    import torch.distributed as dist

    s_at = np.concatenate([[0], np.cumsum(send)]).astype(int)
    r_at = np.concatenate([[0], np.cumsum(recv)]).astype(int)
    me = g.rank
    out[r_at[me]:r_at[me + 1]] = rows[s_at[me]:s_at[me + 1]]
    ops = []
    for peer in range(g.world_size):
        if peer == me:
            continue
        peer_global = peer if g.group is None else dist.get_global_rank(g.group, peer)
        if send[peer]:
            ops.append(dist.P2POp(dist.isend, rows[s_at[peer]:s_at[peer + 1]].contiguous(), peer_global, g.group))
        if recv[peer]:
            ops.append(dist.P2POp(dist.irecv, out[r_at[peer]:r_at[peer + 1]], peer_global, g.group))

    def run():
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    _collective(g, what + " (point-to-point fallback)", run)
    return out


def pack_rows(*fields: np.ndarray) -> np.ndarray:
    """Concatenate the bytes of per-row fields (each ``[S, ...]``, any dtype) -> uint8 ``[S, B]``."""
    s = int(fields[0].shape[0])
    parts = []
    for f in fields:
        flat = np.ascontiguousarray(f).reshape(s, int(np.prod(f.shape[1:], dtype=np.int64)))
        parts.append(flat.view(np.uint8).reshape(s, flat.shape[1] * flat.dtype.itemsize))
    return np.concatenate(parts, axis=1) if parts else np.zeros((s, 0), np.uint8)


def unpack_rows(rows: np.ndarray, specs) -> list[np.ndarray]:
    """Inverse of :func:`pack_rows`: ``specs`` is a list of ``(dtype, tail shape)``; returns arrays
    ``[N, *tail]`` (copies, bitwise equal to what was packed)."""
    n = int(rows.shape[0])
    out, at = [], 0
    for dtype, tail in specs:
        dt = np.dtype(dtype)
        width = int(np.prod(tail, dtype=np.int64)) * dt.itemsize
        chunk = np.ascontiguousarray(rows[:, at:at + width])
        out.append(chunk.view(dt).reshape((n,) + tuple(tail)).copy())
        at += width
    if at != rows.shape[1]:
        raise ValueError(f"packed rows have {rows.shape[1]} bytes but the fields take {at}")
    return out
