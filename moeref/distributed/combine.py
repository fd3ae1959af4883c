"""EP combine over a torch.distributed group: the expert outputs go back to their source rank
(:func:`ep_combine`; the dispatch is :mod:`moeref.distributed.dispatch`).

Two summation orders:

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

The combine follows the engine of its dispatch (``engine="device"``: :mod:`moeref.distributed.device`, bit for
bit the host engine's result).
"""
from __future__ import annotations

import numpy as np

from .._checks import as_float_array, check_choice
from ..dispatch import reduce_slot_rows, weight_and_reduce
from ..moe.pipeline import _dtype
from .group import EPGroup, all_gather_int64, all_to_all_bytes, pack_rows, unpack_rows
from .header import _FLOAT_DTYPES
from .receive import CombineHandle, NormalDispatch

__all__ = ["COMBINE_ORDERS", "ep_combine", "reduce_local_slots"]

COMBINE_ORDERS = ("slot", "rank")


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
