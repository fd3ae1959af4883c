"""EP dispatch and combine over a torch.distributed group, with DeepEP's two receive layouts.

Protocol (the same on every rank, gloo or NCCL):

1. **Header** (:mod:`moeref.distributed.header`; ``all_gather`` of a small int64 vector per rank): input
   validity, the placement's ``ep_size`` and fingerprint, ``T``/``k``/``H``, a payload fingerprint (dtype,
   quantization, mode) and the per-destination counts. Every rank thus sees the whole count matrix ``C[src, dst]`` and
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

Combine (:func:`ep_combine`, :mod:`moeref.distributed.combine`) returns the expert outputs to their source
rank, summed in slot order (bit-identical to the single-process pipeline) or in rank order (DeepEP normal
combine).

Two engines, one result: ``engine="host"`` (NumPy arrays) and ``engine="device"`` (torch tensors on the
group's device, :mod:`moeref.distributed.device`), bit for bit the same; :func:`ep_combine` follows the
engine of its dispatch. Both send the same packed bytes.
"""
from __future__ import annotations

import numpy as np

from .._checks import as_float_array, check_choice, check_ndim, check_positive_int, check_token_rows
from ..dispatch import to_masked
from .combine import COMBINE_ORDERS, ep_combine, reduce_local_slots
from .group import EPGroup, all_to_all_bytes, pack_rows, unpack_rows
from .header import _FLOAT_DTYPES, _HEAD, _agree, _check_distinct_per_row, _check_quant, _digest
from .placement import EPPlacement
from .plan import SendPlan, send_plan
from .receive import DISPATCH_MODES, CombineHandle, LowLatencyDispatch, NormalDispatch, _received
from .recv_buffer import LowLatencyBuffer, _check_buffer, ep_low_latency_buffer

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

ENGINES = ("host", "device")


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
            from .device import device_send_plan, float_name, payload_specs, quantize_rows, to_group_device

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
                specs = payload_specs(x, qt, x.shape[1])
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
        from .device import receive_dispatch

        return receive_dispatch(group, placement, prep, rows, slots, mode, quant, bound if pad_to_max_recv else None,
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
