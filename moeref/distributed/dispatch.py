"""EP dispatch and combine over a torch.distributed group, with DeepEP's two receive layouts.

Protocol (the same on every rank, gloo or NCCL):

1. **Header** (``all_gather`` of a small int64 vector per rank): input validity, the placement's
   ``ep_size`` and fingerprint, ``T``/``k``/``H``, a payload fingerprint (dtype, quantization, mode)
   and the per-destination counts. Every rank thus sees the whole count matrix ``C[src, dst]`` and
   raises the **same** error for a bad input anywhere (mismatched world size / placement / shapes, a
   rank over ``max_tokens_per_rank`` or ``max_recv_tokens``) instead of leaving peers waiting.
2. **Rows** (one ``all_to_all_single`` of packed bytes, :func:`moeref.distributed.group.pack_rows`):
   the payload arrives bitwise unchanged, blocks in ascending source rank.

Receive layouts:

* ``mode="normal"`` (DeepEP ``Buffer.dispatch``) -> :class:`NormalDispatch`: ``x [N_recv, H]``, one row
  per (source token, destination rank), grouped by **source rank ascending, then source token
  ascending** (DeepEP's block structure; its within-block order is the same channel-wise token
  order). ``topk_idx [N_recv, k]``: local expert id where the slot's expert is here, ``-1`` otherwise;
  ``topk_weights``: ``0.0`` where ``-1``. ``num_recv_tokens_per_expert``: (row, slot) pairs per local
  expert, rounded up to ``expert_alignment`` (which changes only the counts, as in DeepEP).
  ``rank_prefix_matrix[i, j]``: rows from ranks ``<= i`` to rank ``j``. ``max_recv_tokens`` with
  ``pad_to_max_recv=True`` is DeepEP's ``num_worst_tokens`` (outputs padded to the bound). Grouping rows by expert is the
  caller's job: :meth:`NormalDispatch.contiguous` gives DeepGEMM's contiguous layout.
* ``mode="low_latency"`` (DeepEP ``low_latency_dispatch``) -> :class:`LowLatencyDispatch`: one message
  per valid (token, slot), received into the **masked** layout ``x [E_local, R*M, H]``
  (``M = max_tokens_per_rank``), ``recv_count [E_local]``, ``src_info [E_local, R*M]`` (source token,
  ``-1`` padding) and ``layout_range [E_local, R]`` (``begin << 32 | count`` of each source rank's
  block). The reference's order within an expert is source rank, then token; DeepEP's depends on
  arrival (atomics), so compare through ``(src_rank, src_info)``, never by position
  (:func:`moeref.distributed.validate_ep_kernel` does). ``recv_buffer=`` (:func:`ep_low_latency_buffer`, the
  device engine): receive into one reused buffer, as DeepEP's ``Buffer``; the result is valid until the next
  dispatch with it.

Optional quantization before dispatch (``quant=``, e.g. ``moeref.quant.fp8_group(128)``, the 1x128
FP8 cast of DeepEP's low-latency dispatch): the source runs :func:`moeref.quant.quantize` and sends
codes and scales; they arrive bitwise unchanged (``xq``: a :class:`~moeref.quant.QuantizedTensor`
of the received rows). Row-local schemes only (blocks ``(1, g)``), since a received row must
dequantize on its own. DeepEP's own cast (``scale = 448 / max(amax, 1e-4)``, stored
``scale_inv = amax * fl(1/448)``) is ``fp8_group(128, preset="deepep")``; moeref's default preset
rounds the scale differently.

Combine (:func:`ep_combine`), the expert outputs go back to the source rank:

* ``order="slot"`` (default; DeepEP low-latency combine, pplx): each destination returns the
  **unweighted** output of every slot it holds; the source weights and sums them in slot order
  ``j = 0..k-1`` in float64 with :func:`moeref.dispatch.weight_and_reduce`, the same function the
  single-process pipeline finalizes with, so the result is **bit-identical** to it.
* ``order="rank"`` (DeepEP normal combine as vLLM's DeepEP-HT finalize uses it): each destination
  returns one row per received row, already weighted and reduced over its local slots
  (:func:`reduce_local_slots`); the source adds the ranks' rows in ascending rank order in float64.
  This two-level sum differs from the slot order in the last bits (``(a+b)+c != a+(b+c)``).

``combine_dtype`` (e.g. ``"bfloat16"``, DeepEP's bf16 combine) rounds the returned rows before they
travel; the source still accumulates in float64 and rounds once (kernels accumulate in fp32).

Two engines, one result: ``engine="host"`` (NumPy arrays) and ``engine="device"`` (torch tensors on the
group's device, :mod:`moeref.distributed.device`), bit for bit the same; :func:`ep_combine` follows the
engine of its dispatch. Both send the same packed bytes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .._checks import as_float_array, check_choice, check_ndim, check_positive_int, check_token_rows
from ..dispatch import reduce_slot_rows, to_contiguous, to_masked, weight_and_reduce
from ..moe.pipeline import _dtype
from .group import EPGroup, all_gather_int64, all_to_all_bytes, pack_rows, unpack_rows
from .placement import EPPlacement
from .plan import SendPlan, send_plan

__all__ = [
    "COMBINE_ORDERS",
    "DISPATCH_MODES",
    "CombineHandle",
    "LowLatencyBuffer",
    "LowLatencyDispatch",
    "NormalDispatch",
    "ep_combine",
    "ep_dispatch",
    "ep_low_latency_buffer",
    "reduce_local_slots",
]

DISPATCH_MODES = ("normal", "low_latency")
COMBINE_ORDERS = ("slot", "rank")
ENGINES = ("host", "device")
_HEAD = 10  # ok, placement fp, ep_size, T, k, H, payload fp, M, bound, mode


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
    """DeepEP normal-mode receive buffers of one rank (module docstring). ``x`` float ``[N_recv, H]``
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
    """DeepEP low-latency receive buffers of one rank (module docstring), ``W = R * M``: ``x``
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


_FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


def _digest(*parts) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=7)
    return int.from_bytes(h.digest(), "little")


def _check_quant(quant, x: np.ndarray, quantizer=None):
    """The scheme's checks, then ``quantizer(x)`` (default :func:`moeref.quant.quantize`; the device engine
    passes the fast path's) and the check of what it carries."""
    from ..quant import Scheme, quantize

    if not isinstance(quant, Scheme):
        raise TypeError(f"quant must be a moeref.quant.Scheme or None; got {type(quant).__name__}")
    if any(b != 1 for b in quant.block[:-1]):
        raise ValueError(f"dispatch quantization must be row-local (blocks (1, g)); {quant.name!r} has block "
                         f"{quant.block}")
    qt = quantize(x, quant) if quantizer is None else quantizer(x)
    if any(getattr(qt, name, None) is not None for name in ("global_scale", "channel_scales", "zero_points")):
        raise ValueError(f"dispatch quantization must carry only per-block scales; {quant.name!r} has a global "
                         "scale, channel scales or zero points")
    return qt


def _check_distinct_per_row(topk_ids) -> None:
    """``ValueError`` unless every row of ``topk_ids`` (NumPy or torch, any device) names distinct experts
    (-1 padding aside). Low-latency mode needs it: an expert's masked buffer holds ``R*M`` rows, one per
    token of every rank, so a token sending two slots to one expert could overflow it on the receiver,
    an error only that rank would see after the exchange; checked on the source, before the header, it
    is raised on every rank."""
    if hasattr(topk_ids, "sort") and not isinstance(topk_ids, np.ndarray):  # a torch tensor
        s = topk_ids.sort(dim=1).values
        dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).nonzero()
        first = None if dup.numel() == 0 else (int(dup[0, 0]), s[dup[0, 0]].cpu().numpy())
    else:
        s = np.sort(np.asarray(topk_ids), axis=1)
        dup = np.argwhere((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0))
        first = None if dup.size == 0 else (int(dup[0, 0]), s[dup[0, 0]])
    if first is not None:
        t, row = first
        raise ValueError(f"topk_ids row {t} names an expert twice ({sorted(int(v) for v in row)}): mode='low_latency' "
                         "needs distinct experts per token (each expert's buffer holds one row per token); map "
                         "logical ids with EPPlacement.to_physical, or use mode='normal'")


def _agree(g: EPGroup, local_fn, placement: EPPlacement, mode: str, bound: int):
    """Run the local preparation, exchange the header, raise the same error on every rank."""
    r = g.world_size
    head = np.zeros(_HEAD + 2 * r, dtype=np.int64)
    err, prep = None, None
    try:
        if not isinstance(placement, EPPlacement):
            raise TypeError(f"placement must be an EPPlacement; got {type(placement).__name__}")
        head[1:3] = (placement.fingerprint, placement.ep_size)
        prep = local_fn()
        head[3:7] = (prep["T"], prep["k"], prep["H"], prep["payload"])
        if placement.ep_size == r:
            head[_HEAD:_HEAD + r] = prep["plan"].rows_to
            head[_HEAD + r:] = prep["plan"].slots_to
        head[0] = 1
    except (ValueError, TypeError) as e:
        err = e
    head[7:10] = (prep["M"] if prep else 0, bound, DISPATCH_MODES.index(mode))
    table = all_gather_int64(g, head, "the dispatch header all_gather")
    if err is not None:
        raise type(err)(f"rank {g.rank}: {err}") from err
    bad = np.flatnonzero(table[:, 0] == 0).tolist()
    if bad:
        raise ValueError(f"rank {g.rank}: ranks {bad} rejected their dispatch inputs (see their errors)")
    for col, what in ((9, "mode"), (8, "max_recv_tokens"), (7, "max_tokens_per_rank")):
        if len(set(table[:, col].tolist())) > 1:
            raise ValueError(f"ranks disagree on {what}: {dict(enumerate(table[:, col].tolist()))}")
    if (table[:, 2] != r).any():
        wrong = {i: int(v) for i, v in enumerate(table[:, 2]) if v != r}
        raise ValueError(f"the expert placement of ranks {sorted(wrong)} is for ep_size {sorted(set(wrong.values()))} "
                         f"but the process group has world_size={r}")
    if len(set(table[:, 1].tolist())) > 1:
        raise ValueError("ranks disagree on the expert placement (fingerprints "
                         f"{dict(enumerate(table[:, 1].tolist()))}): build it the same way on every rank")
    for col, what in ((4, "top_k"), (5, "hidden size"), (6, "payload (dtype / quantization)")):
        if len(set(table[:, col].tolist())) > 1:
            raise ValueError(f"ranks disagree on the {what}: {dict(enumerate(table[:, col].tolist()))}")
    return prep, table


def ep_dispatch(hidden, topk_ids, topk_weights, placement: EPPlacement, group: EPGroup, *, mode: str = "normal",
                quant=None, max_tokens_per_rank: int | None = None, max_recv_tokens: int | None = None,
                pad_to_max_recv: bool = False, expert_alignment: int = 1, engine: str = "host", recv_buffer=None):
    """Send this rank's tokens to the ranks owning their experts; return the receive buffers.

    Args:
        hidden: float ``[T, H]`` (float64/32/16, bfloat16; numpy or torch), this rank's tokens.
        topk_ids: int ``[T, k]`` physical expert ids (-1 padding, distinct per row;
            :meth:`EPPlacement.to_physical` maps logical ids with redundant experts).
        topk_weights: float ``[T, k]`` router weights (kept on this rank for the combine).
        placement: the same :class:`EPPlacement` on every rank, made for ``group.world_size`` ranks.
        group: an :class:`EPGroup` (:func:`moeref.distributed.ep_group`).
        mode: ``"normal"`` -> :class:`NormalDispatch`; ``"low_latency"`` -> :class:`LowLatencyDispatch`.
        quant: None or a row-local :class:`moeref.quant.Scheme` applied before dispatch.
        max_tokens_per_rank: ``M``, required for ``"low_latency"`` (``T <= M`` on every rank; the masked
            buffers have ``R*M`` rows per expert), optional for ``"normal"`` (checked when given).
        max_recv_tokens: optional bound on the rows any rank receives in ``"normal"`` mode (DeepEP
            ``num_worst_tokens``); exceeding it raises ``ValueError`` on every rank, naming the rank.
        pad_to_max_recv: size the normal-mode outputs to ``max_recv_tokens`` rows, as DeepEP does with
            ``num_worst_tokens``: the real rows first, then padding rows with ``topk_idx = -1``,
            weight 0, ``src_rank = src_token = -1`` and zero payload.
        expert_alignment: rounds ``num_recv_tokens_per_expert`` up (DeepEP), normal mode only.
        engine: ``"host"`` (NumPy arrays in and out) or ``"device"`` (torch tensors on ``group.device``, the
            same results bit for bit: :mod:`moeref.distributed.device`); :func:`ep_combine` follows the
            dispatch's engine.
        recv_buffer: a :class:`LowLatencyBuffer` (:func:`ep_low_latency_buffer`) to receive into, for
            ``mode="low_latency"`` with ``engine="device"``: instead of zeroing a fresh ``E_local x R*M x H``
            buffer, the dispatch zeroes the rows the buffer's last dispatch wrote and writes its own. The result
            is the same; its ``x`` / ``xq`` are the buffer's tensors, **valid until the next dispatch with the
            buffer** (DeepEP's ``low_latency_dispatch`` contract). None (default): fresh buffers.

    Every rank raises the same ``ValueError``/``TypeError`` for a bad input on any rank; a peer that
    never joins raises :class:`~moeref.distributed.EPTimeoutError` after the group's timeout.
    """
    check_choice(mode, DISPATCH_MODES, "mode")
    check_choice(engine, ENGINES, "engine")
    expert_alignment = check_positive_int(expert_alignment, "expert_alignment")
    bound = -1 if max_recv_tokens is None else check_positive_int(max_recv_tokens, "max_recv_tokens", allow_zero=True)
    if pad_to_max_recv and (mode != "normal" or bound < 0):
        raise ValueError("pad_to_max_recv=True needs mode='normal' and max_recv_tokens (the padded size)")

    def local():
        if engine == "device":
            from .device import device_send_plan, float_name, quantize_rows, to_group_device

            x = to_group_device(hidden, group.device, "hidden", kind="float")
            name = float_name(x)
        else:
            x = as_float_array(hidden, "hidden")
            name = str(x.dtype)
        check_ndim(x, 2, "hidden")
        if name not in _FLOAT_DTYPES:
            raise TypeError(f"hidden must be one of {', '.join(_FLOAT_DTYPES)}; got {name}")
        check_token_rows(x, topk_weights, topk_ids)
        if engine == "device":
            plan = device_send_plan(topk_ids, topk_weights, placement, group.device,
                                    check_repeats=mode == "low_latency")
        else:
            plan = send_plan(topk_ids, topk_weights, placement)
        m = -1
        if max_tokens_per_rank is not None:
            m = check_positive_int(max_tokens_per_rank, "max_tokens_per_rank")
            if x.shape[0] > m:
                raise ValueError(f"{x.shape[0]} tokens on this rank, more than max_tokens_per_rank={m}")
        elif mode == "low_latency":
            raise ValueError("mode='low_latency' needs max_tokens_per_rank (the masked buffers have R*M rows)")
        if mode == "low_latency" and (engine != "device" or plan.repeats):  # (the device plan checked it)
            _check_distinct_per_row(topk_ids)
        if recv_buffer is not None and (mode != "low_latency" or engine != "device"):
            raise ValueError(f"recv_buffer is for mode='low_latency' with engine='device'; got mode={mode!r}, "
                             f"engine={engine!r}")
        if engine == "device":
            qt = None if quant is None else quantize_rows(x, quant, _check_quant)
            w = to_group_device(topk_weights, group.device, "topk_weights", kind="float")
            if recv_buffer is not None and mode == "low_latency" and placement.ep_size == group.world_size:
                specs = _device_specs(x, qt, x.shape[1])
                _check_buffer(recv_buffer, specs, placement.num_local(group.rank), group.world_size * m,
                              group.device, quant)
        else:
            qt = None if quant is None else _check_quant(quant, x)
            w = np.asarray(as_float_array(topk_weights, "topk_weights"))
        payload = _digest(name, None if quant is None else (quant.name, quant.block, quant.scale_format))
        return dict(T=x.shape[0], k=plan.top_k, H=x.shape[1], payload=payload, M=m, x=x, qt=qt, plan=plan, w=w)

    prep, table = _agree(group, local, placement, mode, bound)
    r, me = group.world_size, group.rank
    rows = table[:, _HEAD:_HEAD + r]  # rows[src, dst]
    slots = table[:, _HEAD + r:]
    plan: SendPlan = prep["plan"]
    if mode == "normal" and bound >= 0:
        recv = rows.sum(axis=0)
        over = np.flatnonzero(recv > bound)
        if over.size:
            d = int(over[0])
            raise ValueError(f"rank {d} would receive {int(recv[d])} tokens (from ranks {rows[:, d].tolist()}), "
                             f"more than the declared bound max_recv_tokens={bound}")
    if engine == "device":
        return _dispatch_device(group, placement, prep, rows, slots, mode, quant, bound if pad_to_max_recv else None,
                                expert_alignment, recv_buffer)
    x, qt, k, h = prep["x"], prep["qt"], prep["k"], prep["H"]
    if qt is None:
        specs = [(x.dtype, (h,))]
        token_fields = lambda idx: [x[idx]]  # noqa: E731
    else:
        specs = [(np.uint8, qt.codes.shape[1:]), (qt.scales.dtype, qt.scales.shape[1:])]
        token_fields = lambda idx: [qt.codes[idx], qt.scales[idx]]  # noqa: E731
    w = prep["w"]
    if mode == "normal":
        send = pack_rows(*token_fields(plan.row_token), plan.row_token, plan.row_local_ids, plan.row_weights)
        got = all_to_all_bytes(group, send, rows[me], rows[:, me], "the dispatch all_to_all_single")
        *payload, tok, ids, wts = unpack_rows(got, specs + [(np.int64, ()), (np.int64, (k,)), (np.float32, (k,))])
        n_local = placement.num_local(me)
        counts = np.bincount(ids[ids >= 0], minlength=n_local).astype(np.int64)
        counts = -(-counts // expert_alignment) * expert_alignment
        valid = ids.reshape(-1) >= 0
        src_rank = np.repeat(np.arange(r, dtype=np.int64), rows[:, me])
        ret_counts = np.bincount(np.repeat(src_rank, k)[valid], minlength=r).astype(np.int64)
        n_rows = got.shape[0]
        if pad_to_max_recv:  # DeepEP num_worst_tokens: real rows first, then -1 / 0 padding
            n_rows = bound
            pad = bound - got.shape[0]
            payload = [np.concatenate([p, np.zeros((pad,) + p.shape[1:], p.dtype)]) for p in payload]
            ids = np.concatenate([ids, np.full((pad, k), -1, np.int64)])
            wts = np.concatenate([wts, np.zeros((pad, k), np.float32)])
            src_rank = np.concatenate([src_rank, np.full(pad, -1, np.int64)])
            tok = np.concatenate([tok, np.full(pad, -1, np.int64)])
        handle = CombineHandle(mode, plan, w, np.flatnonzero(valid), ret_counts, rows[:, me].copy())
        xr, xq = _received(payload, qt, quant, (n_rows, h))
        return NormalDispatch(xr, xq, ids, wts, src_rank, tok, np.cumsum(rows, axis=0), counts, handle)
    m = prep["M"]
    src_tok = plan.slot_src // max(k, 1)
    send = pack_rows(*token_fields(src_tok), src_tok, plan.slot_local)
    got = all_to_all_bytes(group, send, slots[me], slots[:, me], "the dispatch all_to_all_single")
    *payload, tok, loc = unpack_rows(got, specs + [(np.int64, ()), (np.int64, ())])
    n_local = placement.num_local(me)
    cap = r * m
    msg_rank = np.repeat(np.arange(r, dtype=np.int64), slots[:, me])
    if n_local:
        masked = to_masked(None, loc[:, None], n_local, max_m=cap)
        src, recv_count = masked.src, masked.masked_m
    else:
        src, recv_count = np.full((0, cap), -1, np.int64), np.zeros(0, np.int32)
    here = src >= 0
    per = np.bincount(loc * r + msg_rank, minlength=n_local * r).reshape(n_local, r).astype(np.int64)
    layout_range = ((np.cumsum(per, axis=1) - per) << 32) | per
    src_info = np.where(here, tok[np.maximum(src, 0)] if tok.size else 0, -1).astype(np.int32)
    src_rank = np.where(here, msg_rank[np.maximum(src, 0)] if tok.size else 0, -1).astype(np.int32)
    entry = np.flatnonzero(here.reshape(-1))  # flat entries, sorted
    ret_index = np.empty(tok.size, dtype=np.int64)
    ret_index[src.reshape(-1)[entry]] = entry  # message q lives at flat entry ret_index[q]
    handle = CombineHandle(mode, plan, w, ret_index, slots[:, me].copy(), slots[:, me].copy())
    masked_payload = []
    for part in payload:
        buf = np.zeros((n_local, cap) + part.shape[1:], dtype=part.dtype)
        buf[here] = part[src[here]]
        masked_payload.append(buf)
    xr, xq = _received(masked_payload, qt, quant, (n_local, cap, h))
    return LowLatencyDispatch(xr, xq, recv_count.astype(np.int32), src_info, src_rank, layout_range, handle)


def _dispatch_device(group: EPGroup, placement: EPPlacement, prep: dict, rows: np.ndarray, slots: np.ndarray,
                     mode: str, quant, pad_to: int | None, expert_alignment: int, recv_buffer=None):
    """The receive side of :func:`ep_dispatch` with ``engine="device"`` (:mod:`moeref.distributed.device`)."""
    import torch

    from .._interop import to_device
    from . import device as dv
    from .group import all_to_all_rows

    r, me, dev = group.world_size, group.rank, group.device
    x, qt, k, h, w = prep["x"], prep["qt"], prep["k"], prep["H"], prep["w"]
    plan = prep["plan"]
    engines = ()
    specs = _device_specs(x, qt, h)
    if qt is None:
        token_fields = lambda idx: [(x, idx)]  # noqa: E731 (gathered into the packed rows)
    else:
        codes, scales, qengine = qt
        engines = (f"quantize: {qengine}",)
        token_fields = lambda idx: [(codes, idx), (scales, idx)]  # noqa: E731
    n_local = placement.num_local(me)
    what = "the dispatch all_to_all_single"
    if mode == "normal":
        n_send = int(plan.row_token.shape[0])
        send = dv.pack(n_send, *token_fields(plan.row_token), plan.row_token, plan.row_local_ids, plan.row_weights)
        got = all_to_all_rows(group, send, rows[me], rows[:, me], what)
        fields = dv.unpack(got, specs + [(torch.int64, ()), (torch.int64, (k,)), (torch.float32, (k,))])
        payload, ids, wts, src_rank, tok, counts, ret_index = dv.receive_normal(
            fields, r, me, rows, slots, n_local, k, expert_alignment, pad_to, dev)
        handle = CombineHandle(mode, plan, w, ret_index, slots[:, me].copy(), rows[:, me].copy(), "device")
        n_rows = int(ids.shape[0])
        xr, xq = _received_device(payload, qt, quant, (n_rows, h))
        prefix = to_device(np.cumsum(rows, axis=0), dev)
        return NormalDispatch(xr, xq, ids, wts, src_rank, tok, prefix, counts, handle, engines)
    m = prep["M"]
    src_tok = torch.div(plan.slot_src, max(k, 1), rounding_mode="floor")
    send = dv.pack(int(src_tok.shape[0]), *token_fields(src_tok), src_tok, plan.slot_local)
    got = all_to_all_rows(group, send, slots[me], slots[:, me], what)
    meta = [(torch.int64, ()), (torch.int64, ())]
    *payload, _, _ = dv.field_bytes(got, specs + meta)  # scattered from the received rows, no copy first
    tok, loc = dv.unpack(got[:, sum(int(p.shape[1]) for p in payload):], meta)
    cap = r * m
    masked, recv_count, src_info, src_rank, layout_range, ret_index = dv.receive_low_latency(
        payload, specs, tok, loc, r, me, slots, n_local, cap, dev, recv_buffer)
    handle = CombineHandle(mode, plan, w, ret_index, slots[:, me].copy(), slots[:, me].copy(), "device")
    xr, xq = _received_device(masked, qt, quant, (n_local, cap, h))
    return LowLatencyDispatch(xr, xq, recv_count, src_info, src_rank, layout_range, handle, engines)


def _device_specs(x, qt, h: int) -> list:
    """The device engine's payload fields: ``[(torch dtype, row shape), ...]`` (the rows, or codes and scales)."""
    import torch

    if qt is None:
        return [(x.dtype, (h,))]
    codes, scales, _ = qt
    return [(torch.uint8, tuple(codes.shape[1:])), (scales.dtype, tuple(scales.shape[1:]))]


def _received_device(payload, qt, quant, shape):
    if qt is None:
        return payload[0], None
    from .device import DeviceQuantized

    return None, DeviceQuantized(payload[0], payload[1], quant, shape)


def _received(payload, qt, quant, shape):
    if qt is None:
        return payload[0], None
    from ..quant import QuantizedTensor

    return None, QuantizedTensor(payload[0], payload[1], quant, shape)


def reduce_local_slots(expert_out, dispatched: NormalDispatch) -> np.ndarray:
    """Weight and reduce a normal-mode rank's per-slot outputs ``[N_recv, k, H]`` over its local slots,
    in slot order, float64 -> ``[N_recv, H]`` (what ``order="rank"`` combines; vLLM's DeepEP-HT
    finalize does this with ``TopKWeightAndReduceContiguous`` before DeepEP's combine)."""
    y = as_float_array(expert_out, "expert_out")
    n, k = dispatched.topk_idx.shape
    if y.ndim != 3 or y.shape[:2] != (n, k):
        raise ValueError(f"expert_out must have shape [N_recv={n}, k={k}, H]; got {y.shape}")
    rows = np.where((dispatched.topk_idx >= 0)[..., None], y.astype(np.float64), 0.0).reshape(n * k, y.shape[-1])
    return reduce_slot_rows(rows, dispatched.topk_weights, out_dtype=np.float64)


def ep_combine(expert_out, dispatched, group: EPGroup, *, order: str = "slot", combine_dtype=None,
               apply_weights: bool = True, out_dtype=None) -> np.ndarray:
    """Return expert outputs to their source ranks and reduce there: float ``[T, H]`` for this rank's tokens.

    ``expert_out`` on each rank, in its receive layout:

    * normal, ``order="slot"``: ``[N_recv, k, H]``, the output of row ``i``'s slot ``j`` (entries where
      ``topk_idx == -1`` are ignored);
    * normal, ``order="rank"``: ``[N_recv, H]``, already weighted and reduced over the local slots
      (:func:`reduce_local_slots`);
    * low-latency: ``[E_local, R*M, H]`` (rows past ``recv_count`` are ignored).

    ``apply_weights=False``: the router weight was applied on the input (top-1), only sum.
    ``combine_dtype``: round the returned rows to this dtype before they travel (None: float64).
    Result: float64, or ``out_dtype`` rounded once (module docstring for the summation orders); with a
    dispatch of ``engine="device"``, a torch tensor on ``group.device`` (``expert_out`` a tensor there,
    or a host array, which is copied there), bit for bit the host engine's result.
    """
    check_choice(order, COMBINE_ORDERS, "order")
    hd: CombineHandle = dispatched.handle
    plan = hd.plan
    rank_order = order == "rank"
    on_device = hd.engine == "device"
    if on_device:
        from . import device as dv
    err, rows = None, None
    head = np.zeros(4, dtype=np.int64)
    try:
        if rank_order and hd.mode != "normal":
            raise ValueError("order='rank' is the normal-mode combine; low-latency combines in slot order")
        if on_device:
            y = dv.to_group_device(expert_out, group.device, "expert_out", kind="float")
            if dv.float_name(y) not in _FLOAT_DTYPES:
                raise TypeError(f"expert_out must be one of {', '.join(_FLOAT_DTYPES)}; got {dv.float_name(y)}")
        else:
            y = as_float_array(expert_out, "expert_out")
        shape = tuple(y.shape)
        if hd.mode == "normal" and not rank_order:
            want = (dispatched.num_recv, plan.top_k)
            if len(shape) != 3 or shape[:2] != want:
                raise ValueError(f"expert_out must have shape [N_recv={want[0]}, k={want[1]}, H]; got {shape}")
        elif hd.mode == "normal":
            if len(shape) != 2 or shape[0] != dispatched.num_recv:
                raise ValueError(f"expert_out must have shape [N_recv={dispatched.num_recv}, H]; got {shape}")
        else:
            want = tuple(dispatched.src_info.shape)
            if len(shape) != 3 or shape[:2] != want:
                raise ValueError(f"expert_out must have shape [E_local={want[0]}, W={want[1]}, H]; got {shape}")
        flat = y.reshape(-1, shape[-1])
        rows = flat[:int(hd.rows_from.sum())] if rank_order else flat[hd.return_index]  # not the padding
        # one RNE rounding to the travel dtype (float32/bf16 inputs widen exactly first)
        if on_device:
            rows = dv.travel_cast(rows, combine_dtype)
        else:
            rows = rows.astype(np.float64 if combine_dtype is None else _dtype(combine_dtype))
        head[:] = (1, shape[-1], rows.element_size() if on_device else rows.dtype.itemsize, int(rank_order))
    except (ValueError, TypeError) as e:
        err = e
    table = all_gather_int64(group, head, "the combine header all_gather")
    if err is not None:
        raise type(err)(f"rank {group.rank}: {err}") from err
    if (table[:, 0] == 0).any():
        raise ValueError(f"rank {group.rank}: ranks {np.flatnonzero(table[:, 0] == 0).tolist()} rejected their "
                         "combine inputs (see their errors)")
    for col, what in ((1, "hidden size"), (2, "combine dtype"), (3, "combine order")):
        if len(set(table[:, col].tolist())) > 1:
            raise ValueError(f"ranks disagree on the {what}: {dict(enumerate(table[:, col].tolist()))}")
    h = int(head[1])
    send_counts = hd.rows_from if rank_order else hd.return_counts
    recv_counts = plan.rows_to if rank_order else plan.slots_to
    what = "the combine all_to_all_single"
    if on_device:
        from .group import all_to_all_rows

        got = all_to_all_rows(group, dv.as_bytes(rows, int(rows.shape[0])), send_counts, recv_counts, what)
        back = dv.unpack(got, [(rows.dtype, (h,))])[0]
        if rank_order:
            out = dv.reduce_ranks(back, plan.row_token, plan.rows_to, plan.num_tokens)
        else:
            out = dv.reduce_slots(back, plan.slot_src, hd.topk_weights, plan.num_tokens, plan.top_k, apply_weights)
        return dv.store(out, out_dtype)
    got = all_to_all_bytes(group, pack_rows(rows), send_counts, recv_counts, what)
    back = unpack_rows(got, [(rows.dtype, (h,))])[0].astype(np.float64)
    t = plan.num_tokens
    if rank_order:
        out = np.zeros((t, h), dtype=np.float64)
        ends = np.cumsum(plan.rows_to)
        for r in range(group.world_size):  # ascending rank order (DeepEP normal combine)
            sl = slice(int(ends[r] - plan.rows_to[r]), int(ends[r]))
            out[plan.row_token[sl]] += back[sl]
    else:
        out = weight_and_reduce(back, plan.slot_src, hd.topk_weights, t, apply_weights=apply_weights,
                                out_dtype=np.float64)
    if out_dtype is None:
        return out
    return out.astype(_dtype(out_dtype))
