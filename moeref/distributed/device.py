"""The EP dispatch and combine reference on the process group's device: ``engine="device"``.

:func:`~moeref.distributed.ep_dispatch` / :func:`~moeref.distributed.ep_combine` with ``engine="device"``
run the same protocol as the NumPy engine (header ``all_gather``, one ``all_to_all_single`` of packed
rows, the same packed byte format, so ranks may even mix engines) with every per-token step a torch
tensor operation on ``group.device`` (``cuda:<i>`` on NCCL, the CPU on gloo). The results are the NumPy
engine's, bit for bit (``property_tests/test_distributed_props.py`` checks every field of both modes,
quantized or not, and every combine), because every step is one of:

* **integer work** (destinations, the send order, counts, prefix sums, the masked layout's positions):
  exact in any engine; the orders are the NumPy engine's (rows by destination then token; slots by
  destination then flat slot, a stable sort; low-latency rows of an expert in arrival order);
* **moving bytes** (gathers, the all-to-all, scatters into zeroed buffers): values arrive unchanged;
* **the declared casts**: router weights to float32 (one RNE), the combine's travel dtype and the
  ``out_dtype`` store (:func:`moeref.moe.round_on_device`, the NumPy engine's roundings: bfloat16 through
  float32 as ml_dtypes casts, float16 with one rounding), FP8 quantization before dispatch (below);
* **the combine sums**: ``order="slot"``: ``out = 0; out += w[:, j] * row(t, j)`` for ``j = 0..k-1`` in
  float64 (a product rounded, then a sum rounded: no fused multiply-add), as
  :func:`moeref.dispatch.reduce_slot_rows`; ``order="rank"``: the ranks' rows added in ascending rank
  order in float64.

Quantization before dispatch (``quant=``): on a CUDA device :func:`moeref.quant.device.device_quantize`
where it runs the scheme (its codes and scales equal :func:`moeref.quant.quantize`'s bit for bit:
``property_tests/test_quant_device.py``; the reference never runs the fast paths it judges), otherwise :func:`moeref.quant.quantize` on a host copy (on the CPU device,
always: the host is the device); which one ran is in the result's ``engines``.

Results: the same :class:`~moeref.distributed.NormalDispatch` / :class:`~moeref.distributed.LowLatencyDispatch`
with every array a torch tensor on ``group.device`` (``xq``: a :class:`DeviceQuantized`); the combine
handle keeps the split sizes (``return_counts``, ``rows_from`` and the plan's ``rows_to`` /
``slots_to``) as host int64 arrays, since ``all_to_all_single`` takes them as host lists. A NaN keeps
its position, not necessarily its payload bits (CUDA writes one canonical NaN).

Cost: two host synchronizations per dispatch (the plan's counts, with the ids' range check and, in
low-latency mode, the repeated-expert check; the header), a third with ``quant=`` on CUDA (the quantizer's
amax grid) and one more in low-latency mode (the masked layout's capacity check); one per combine (the
header). Every other size comes from the counts on the host (the orders are stable sorts sized by them),
and the rest is queued on the device: the payload is gathered straight into the packed send rows and, in
low-latency mode, scattered from the received rows into the masked buffers. The placement's tables are
copied to a device once per (placement, device). Memory: the low-latency buffers are ``E_local x R*M x H``,
zeroed: fresh per dispatch, or one :class:`~moeref.distributed.LowLatencyBuffer` reused
(``recv_buffer=``: only the rows its last dispatch wrote are zeroed again); the slot-order combine holds
``T*k x H`` rows of the travel dtype and ``T x H`` float64.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from ..quant.device import DeviceQuantized  # the received FP8 rows: moeref.quant's device-side quantized tensor
from .group import EPGroup, all_to_all_rows
from .placement import EPPlacement
from .receive import CombineHandle, LowLatencyDispatch, NormalDispatch

__all__ = ["DeviceQuantized"]


def _torch():
    import torch

    return torch


_TORCH_FLOAT_NAMES = {"float64", "float32", "float16", "bfloat16"}


def zeros(shape, dtype, device):
    """``torch.zeros``; on the CPU through NumPy's ``zeros`` (``calloc``: the system zeroes a page when it is
    first touched, so a large masked buffer costs the rows written, as in the NumPy engine)."""
    torch = _torch()
    n = int(np.prod(shape, dtype=np.int64))
    if torch.device(device).type != "cpu" or n == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(n * size, dtype=np.uint8)).view(dtype).reshape(tuple(shape))


def scatter_rows(buf, index, rows):
    """``buf.view(-1, row)[index] = rows`` (``index`` distinct) with ``index_copy_``."""
    if index.numel():
        width = int(np.prod(tuple(buf.shape[buf.dim() - rows.dim() + 1:]), dtype=np.int64))
        buf.view(-1, width).index_copy_(0, index, rows.reshape(int(index.numel()), width))
    return buf


def scatter_row_bytes(buf, rows_per_entry: int, index, row_bytes):
    """Write the byte rows ``row_bytes`` (uint8 ``[Q, nbytes]``, may be strided) at the flat rows ``index`` of
    ``buf`` (``[..., row...]`` contiguous, ``rows_per_entry`` rows of ``nbytes`` bytes in all): ``index_copy_`` on
    its bytes."""
    torch = _torch()
    if index.numel():
        buf.view(rows_per_entry, -1).view(torch.uint8).index_copy_(0, index, row_bytes)
    return buf


def float_name(x) -> str:
    """The NumPy-style dtype name of a float tensor (``"bfloat16"``, ``"float32"``, ...)."""
    return str(x.dtype).replace("torch.", "")


def to_group_device(x, device, name: str, *, kind: str):
    """``x`` (a torch tensor or a host array) as a tensor on ``device``; ``kind`` ``"float"`` or ``"int"``.
    TypeError names the dtype given and those accepted (the NumPy engine's messages)."""
    torch = _torch()
    from .. import _interop
    from .._checks import as_float_array, as_int_array

    if not torch.is_tensor(x):
        a = as_float_array(x, name) if kind == "float" else as_int_array(x, name)
        x = _interop.to_torch(np.array(a, order="C"))  # a writable copy (torch refuses read-only memory)
    if kind == "float" and not x.is_floating_point():
        raise TypeError(f"{name} must be floating point (float16/float32/float64/bfloat16); got {x.dtype}")
    if kind == "int" and x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64; got {x.dtype}")
    return x.to(device)


@dataclass(frozen=True, eq=False)
class DevicePlan:
    """:class:`~moeref.distributed.SendPlan` on the device: the same fields (torch int64 / float32 tensors),
    except ``rows_to`` / ``slots_to``: host int64 ``[R]`` (split sizes)."""

    num_tokens: int
    top_k: int
    dest: object
    row_token: object
    row_dest: object
    rows_to: np.ndarray
    row_local_ids: object
    row_weights: object
    slot_src: object
    slot_dest: object
    slot_local: object
    slots_to: np.ndarray
    repeats: bool | None = None  # a row names an expert twice (None: not checked)


# placement -> {device name: (owner, local_id) tensors}; a placement's arrays are read-only, so its tables never
# change; weak keys: the tables go with the placement
_PLACEMENT_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _placement_tables(placement, device):
    """The placement's ``owner`` and ``local_id`` as int64 tensors on ``device``, copied there once per
    (placement, device) and reused (a copy is a host synchronization)."""
    torch = _torch()
    per_device = _PLACEMENT_TABLES.setdefault(placement, {})
    key = str(torch.device(device))
    if key not in per_device:
        per_device[key] = (torch.tensor(placement.owner, dtype=torch.int64, device=device),
                           torch.tensor(placement.local_id, dtype=torch.int64, device=device))
    return per_device[key]


def device_send_plan(topk_ids, topk_weights, placement, device, *, check_repeats: bool = False) -> DevicePlan:
    """:func:`~moeref.distributed.send_plan` on ``device`` (the same orders and values). One host
    synchronization: the counts with the range check of the ids (a bad id raises the NumPy engine's
    ``ValueError``, index and value) and, with ``check_repeats``, whether a row names an expert twice
    (``DevicePlan.repeats``); the orders are sized by the counts."""
    torch = _torch()
    from ..routing.ids import check_topk_ids

    ids = to_group_device(topk_ids, device, "topk_ids", kind="int")
    if ids.dim() != 2:
        check_topk_ids(ids.cpu().numpy(), placement.num_physical)  # the NumPy engine's message
    w = to_group_device(topk_weights, device, "topk_weights", kind="float")
    if w.dim() != 2:
        raise ValueError(f"topk_weights must be a 2-D array; got shape {tuple(w.shape)}")
    if tuple(w.shape) != tuple(ids.shape):
        raise ValueError(f"topk_weights has shape {tuple(w.shape)} but topk_ids has {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    t, k = ids.shape
    r, p = placement.ep_size, placement.num_physical
    owner, local_id = _placement_tables(placement, device)
    bad = (ids < -1) | (ids >= p)
    valid = ids >= 0
    safe = ids.clamp(0, p - 1)  # an id out of range never indexes (it raises below)
    dest = torch.where(valid, owner[safe], -1)
    local = torch.where(valid, local_id[safe], -1)
    hit = torch.zeros((t, r + 1), dtype=torch.bool, device=device)  # column r collects padding slots
    hit.scatter_(1, torch.where(dest >= 0, dest, r), True)
    flat_dest = dest.reshape(-1)
    flags = [bad.any().reshape(1).to(torch.int64)]
    if check_repeats and t and k > 1:  # the sorted row holds two equal ids (padding aside)
        srt = ids.sort(dim=1).values
        flags.append(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any().reshape(1).to(torch.int64))
    counts = torch.cat([hit[:, :r].sum(0), bincount(flat_dest, r), *flags]).cpu().numpy()
    if counts[2 * r]:
        check_topk_ids(ids.cpu().numpy(), p)  # raises the NumPy engine's message
    # the (rank, token) pairs of hit.T in row-major order (by rank, then token): the first S of a stable sort
    # that puts the hits first (S from the counts: no further synchronization)
    pos = first_true(hit[:, :r].t().reshape(-1), int(counts[:r].sum()))
    row_dest = torch.div(pos, max(t, 1), rounding_mode="floor")
    row_token = pos - row_dest * t
    here = dest[row_token] == row_dest[:, None]
    row_local = torch.where(here, local[row_token], -1)
    row_w = torch.where(here, w[row_token].to(torch.float32), 0.0).to(torch.float32)
    # the valid slots by destination, then flat slot: a stable sort with the padding slots' key r after every rank
    slot_src = torch.sort(torch.where(flat_dest >= 0, flat_dest, r), stable=True).indices[:int(counts[r:2 * r].sum())]
    return DevicePlan(t, k, dest, row_token, row_dest, counts[:r].astype(np.int64), row_local, row_w, slot_src,
                      flat_dest[slot_src], local.reshape(-1)[slot_src], counts[r:2 * r].astype(np.int64),
                      bool(counts[2 * r + 1]) if len(flags) > 1 else (False if check_repeats else None))


def first_true(mask, n: int):
    """The indices of the ``n`` True entries of the 1-D bool tensor ``mask``, ascending (``torch.nonzero`` when
    the caller knows ``n``: a stable sort of the keys 0 for True, 1 for False, with no host synchronization)."""
    torch = _torch()
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:n]


def bincount(values, n: int):
    """``torch.bincount(values[values >= 0], minlength=n)`` for values in ``-1 .. n-1``, without the host
    synchronizations of a boolean selection and of ``bincount``'s size (integer sums: exact in any order)."""
    torch = _torch()
    flat = values.reshape(-1)
    out = torch.zeros(n + 1, dtype=torch.int64, device=values.device)
    out.scatter_add_(0, torch.where(flat >= 0, flat, n), torch.ones_like(flat, dtype=torch.int64))
    return out[:n]


def quantize_rows(x, quant, check_quant):
    """Quantize ``x [T, H]`` (device tensor) before dispatch -> ``(codes, scales, engine)`` on x's device.
    ``check_quant(scheme, x, quantizer=None)``: the NumPy engine's checks around a quantizer (default: the NumPy
    one; module docstring)."""
    from .. import _interop
    from ..quant import Scheme

    if x.is_cuda and isinstance(quant, Scheme):  # (anything else: the NumPy engine's TypeError below)
        from ..quant.device import device_quantize, device_quantize_unavailable

        why = device_quantize_unavailable(quant, x, {})
        if why is None and quant.packed:
            why = "its codes are packed (the host engine sends one byte an element)"
        if why is None:
            dq = check_quant(quant, x, lambda v: device_quantize(v, quant))
            return dq.codes, dq.scales, f"moeref.quant.device ({quant.name})"
        engine = f"moeref.quant on a host copy ({why})"
    else:
        engine = "moeref.quant"
    qt = check_quant(quant, _interop.to_numpy(x))
    return (_interop.to_torch(qt.codes).to(x.device), _interop.to_torch(qt.scales).to(x.device), engine)


def as_bytes(t, rows: int):
    """A contiguous tensor ``[rows, ...]`` as uint8 ``[rows, nbytes]`` (a view where possible)."""
    torch = _torch()
    width = int(np.prod(tuple(t.shape[1:]), dtype=np.int64))
    if t.numel() == 0:  # no rows (or no columns): nothing to view
        return torch.zeros((rows, width * t.element_size()), dtype=torch.uint8, device=t.device)
    return t.contiguous().reshape(rows, width).view(torch.uint8)


def pack(rows: int, *fields):
    """:func:`moeref.distributed.group.pack_rows` on the device (the same byte layout). A field is a tensor
    ``[rows, ...]``, or ``(source, index)``: the rows ``source[index]``, gathered straight into the packed rows
    (one pass over the payload, not a gather and then a concatenation)."""
    torch = _torch()
    parts = []
    for f in fields:
        src, idx = f if isinstance(f, tuple) else (f, None)
        tail = tuple(src.shape[1:])
        width = int(np.prod(tail, dtype=np.int64)) * src.element_size()
        parts.append((src, idx, width))
    total = sum(w for _, _, w in parts)
    device = parts[0][0].device if parts else None
    out = torch.empty((rows, total), dtype=torch.uint8, device=device)
    at = 0
    for src, idx, width in parts:
        if rows and width:
            dst = out[:, at:at + width]
            if idx is None:
                dst.copy_(as_bytes(src, rows))
            else:
                torch.index_select(as_bytes(src, int(src.shape[0])), 0, idx, out=dst)
        at += width
    return out


def field_bytes(rows, specs) -> list:
    """The packed rows' fields as uint8 views ``[N, nbytes]`` (strided: no copy), ``specs`` as :func:`unpack`."""
    torch = _torch()
    out, at = [], 0
    for dtype, tail in specs:
        width = int(np.prod(tail, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        out.append(rows[:, at:at + width])
        at += width
    if at != rows.shape[1]:
        raise ValueError(f"packed rows have {rows.shape[1]} bytes but the fields take {at}")
    return out


def unpack(rows, specs):
    """Inverse of :func:`pack`: ``specs`` is a list of ``(torch dtype, tail shape)``."""
    torch = _torch()
    n = int(rows.shape[0])
    out, at = [], 0
    for dtype, tail in specs:
        size = torch.empty((), dtype=dtype).element_size()
        width = int(np.prod(tail, dtype=np.int64)) * size
        if n and width:  # a fresh row-major copy (a one-row slice keeps its parent's strides)
            chunk = torch.empty((n, width), dtype=torch.uint8, device=rows.device)
            chunk.copy_(rows[:, at:at + width])
            out.append(chunk.view(dtype).reshape((n,) + tuple(tail)))
        else:
            out.append(torch.empty((n,) + tuple(tail), dtype=dtype, device=rows.device))
        at += width
    if at != rows.shape[1]:
        raise ValueError(f"packed rows have {rows.shape[1]} bytes but the fields take {at}")
    return out


def receive_normal(got_fields, r: int, me: int, rows_matrix: np.ndarray, slots_matrix: np.ndarray, n_local: int,
                   k: int, expert_alignment: int, pad_to: int | None, device):
    """The normal-mode receive buffers from the unpacked fields ``(payload..., token, ids, weights)``:
    ``(payload list, ids, weights, src_rank, token, counts, return_index)`` (the returned slots per source
    are the header's count matrix: no device work; so is the number of valid slots received, the header's
    ``slots_matrix[:, me]``, which sizes ``return_index``)."""
    torch = _torch()
    from .._interop import to_device

    *payload, tok, ids, wts = got_fields
    counts = bincount(ids, n_local)
    counts = torch.div(counts + (expert_alignment - 1), expert_alignment, rounding_mode="floor") * expert_alignment
    src_rank = to_device(np.repeat(np.arange(r, dtype=np.int64), rows_matrix[:, me]), device)
    ret_index = first_true(ids.reshape(-1) >= 0, int(slots_matrix[:, me].sum()))
    if pad_to is not None:  # DeepEP num_worst_tokens: real rows first, then -1 / 0 padding
        pad = pad_to - int(tok.shape[0])
        payload = [torch.cat([p, torch.zeros((pad,) + tuple(p.shape[1:]), dtype=p.dtype, device=device)])
                   for p in payload]
        ids = torch.cat([ids, torch.full((pad, k), -1, dtype=torch.int64, device=device)])
        wts = torch.cat([wts, torch.zeros((pad, k), dtype=torch.float32, device=device)])
        src_rank = torch.cat([src_rank, torch.full((pad,), -1, dtype=torch.int64, device=device)])
        tok = torch.cat([tok, torch.full((pad,), -1, dtype=torch.int64, device=device)])
    return payload, ids, wts, src_rank, tok, counts, ret_index


def receive_low_latency(payload, specs, tok, loc, r: int, me: int, slots_matrix: np.ndarray, n_local: int,
                        cap: int, device, buffer=None):
    """The masked receive buffers from the messages (``payload``: each field's bytes, uint8 ``[Q, nbytes]``, of
    ``specs``' dtype and row shape; source ``tok``, local expert ``loc``):
    ``(masked payload list, recv_count int32, src_info int32, src_rank int32, layout_range, return_index)``.
    Rows of an expert in arrival order (source rank, then the sender's slot order), as
    :func:`moeref.dispatch.to_masked` of the messages. ``buffer``: a
    :class:`~moeref.distributed.LowLatencyBuffer` written instead of fresh zeroed tensors."""
    torch = _torch()
    from .._interop import to_device

    q = int(tok.shape[0])
    msg_rank = to_device(np.repeat(np.arange(r, dtype=np.int64), slots_matrix[:, me]), device)
    counts = bincount(loc, n_local)
    if q and bool((counts > cap).any()):  # an expert repeated within a row: the masked layout's error
        e = int(torch.nonzero(counts > cap)[0, 0])
        raise ValueError(f"local expert {e} has {int(counts[e])} rows, more than the capacity {cap}")
    order = torch.sort(loc, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty(q, dtype=torch.int64, device=device)
    pos[order] = torch.arange(q, dtype=torch.int64, device=device) - starts[loc[order]]
    src = torch.full((n_local, cap), -1, dtype=torch.int64, device=device)
    src_info = torch.full((n_local, cap), -1, dtype=torch.int32, device=device)
    src_rank = torch.full((n_local, cap), -1, dtype=torch.int32, device=device)
    if q:
        src[loc, pos] = torch.arange(q, dtype=torch.int64, device=device)
        src_info[loc, pos] = tok.to(torch.int32)
        src_rank[loc, pos] = msg_rank.to(torch.int32)
    per = bincount(loc * r + msg_rank, n_local * r).reshape(n_local, r)
    layout_range = ((torch.cumsum(per, 1) - per) << 32) | per
    ret_index = loc * cap + pos  # message q lives at flat entry ret_index[q]
    if buffer is not None:
        masked = list(buffer.receive(ret_index, payload))
    else:
        masked = [scatter_row_bytes(zeros((n_local, cap) + tuple(tail), dtype, device), n_local * cap, ret_index, part)
                  for (dtype, tail), part in zip(specs, payload)]
    return masked, counts.to(torch.int32), src_info, src_rank, layout_range, ret_index


def travel_cast(rows, combine_dtype):
    """The combine's one rounding of the returned rows to the travel dtype (None: float64), as the NumPy
    engine's ``astype`` (from float32/bfloat16/float16 one RNE, from float64 :func:`moeref.moe.round_on_device`)."""
    torch = _torch()
    from ..moe.device import _work_dtype, round_on_device

    if combine_dtype is None:
        return rows.to(torch.float64)
    target = _work_dtype(combine_dtype)
    if rows.dtype == target:
        return rows
    if rows.dtype == torch.float64:
        return round_on_device(rows, combine_dtype).to(target)
    return rows.to(target)  # values of a float32/bf16/f16 tensor: one RNE to a narrower or equal format


def store(out64, out_dtype):
    """The ``out_dtype`` store of a float64 result (None: float64), as ``astype`` on the host."""
    torch = _torch()
    from ..moe.device import _work_dtype, round_on_device

    if out_dtype is None:
        return out64
    return round_on_device(out64, out_dtype).to(_work_dtype(out_dtype))


def reduce_slots(back, slot_src, topk_weights, num_tokens: int, top_k: int, apply_weights: bool):
    """``order="slot"``: :func:`moeref.dispatch.weight_and_reduce` of the returned rows ``back`` (travel
    dtype) at slots ``slot_src`` -> float64 ``[T, H]``: ``out = 0; out += w[:, j] * row(t, j)``, ``j``
    ascending, absent slots zero."""
    torch = _torch()
    h = int(back.shape[1])
    device = back.device
    slot_rows = scatter_rows(zeros((num_tokens * top_k, h), back.dtype, device), slot_src, back)
    slot_rows = slot_rows.reshape(num_tokens, top_k, h)
    w = topk_weights.to(torch.float64)
    out = torch.zeros((num_tokens, h), dtype=torch.float64, device=device)
    for j in range(top_k):  # the fixed order ((0 + w0 r0) + w1 r1) + ...; a product, then a sum
        row = slot_rows[:, j, :]  # travel dtype: torch widens it exactly to float64 inside each operation
        out += (w[:, j:j + 1] * row) if apply_weights else row
    return out


def reduce_ranks(back, row_token, rows_to: np.ndarray, num_tokens: int):
    """``order="rank"``: the ranks' rows added in ascending rank order, float64 ``[T, H]``."""
    torch = _torch()
    out = torch.zeros((num_tokens, int(back.shape[1])), dtype=torch.float64, device=back.device)
    ends = np.cumsum(rows_to)
    back = back.to(torch.float64)
    for r in range(len(rows_to)):  # a rank's rows hold distinct tokens: one add per element
        a, b = int(ends[r] - rows_to[r]), int(ends[r])
        if b > a:
            idx = row_token[a:b]
            out[idx] = out[idx] + back[a:b]
    return out


def payload_specs(x, qt, h: int) -> list:
    """The device engine's payload fields: ``[(torch dtype, row shape), ...]`` (the rows, or codes and scales)."""
    import torch

    if qt is None:
        return [(x.dtype, (h,))]
    codes, scales, _ = qt
    return [(torch.uint8, tuple(codes.shape[1:])), (scales.dtype, tuple(scales.shape[1:]))]


def receive_dispatch(group: EPGroup, placement: EPPlacement, prep: dict, rows: np.ndarray, slots: np.ndarray,
                     mode: str, quant, pad_to: int | None, expert_alignment: int, recv_buffer=None):
    """The receive side of :func:`~moeref.distributed.ep_dispatch` with ``engine="device"``: ``prep`` is this rank's
    prepared inputs (tokens, quantized payload, plan, weights), ``rows`` / ``slots`` the agreed count matrices
    ``[src, dst]``; returns the :class:`~moeref.distributed.NormalDispatch` or
    :class:`~moeref.distributed.LowLatencyDispatch` of this rank."""
    import torch

    from .._interop import to_device

    r, me, dev = group.world_size, group.rank, group.device
    x, qt, k, h, w = prep["x"], prep["qt"], prep["k"], prep["H"], prep["w"]
    plan = prep["plan"]
    engines = ()
    specs = payload_specs(x, qt, h)
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
        send = pack(n_send, *token_fields(plan.row_token), plan.row_token, plan.row_local_ids, plan.row_weights)
        got = all_to_all_rows(group, send, rows[me], rows[:, me], what)
        fields = unpack(got, specs + [(torch.int64, ()), (torch.int64, (k,)), (torch.float32, (k,))])
        payload, ids, wts, src_rank, tok, counts, ret_index = receive_normal(
            fields, r, me, rows, slots, n_local, k, expert_alignment, pad_to, dev)
        handle = CombineHandle(mode, plan, w, ret_index, slots[:, me].copy(), rows[:, me].copy(), "device")
        n_rows = int(ids.shape[0])
        xr, xq = _received(payload, qt, quant, (n_rows, h))
        prefix = to_device(np.cumsum(rows, axis=0), dev)
        return NormalDispatch(xr, xq, ids, wts, src_rank, tok, prefix, counts, handle, engines)
    m = prep["M"]
    src_tok = torch.div(plan.slot_src, max(k, 1), rounding_mode="floor")
    send = pack(int(src_tok.shape[0]), *token_fields(src_tok), src_tok, plan.slot_local)
    got = all_to_all_rows(group, send, slots[me], slots[:, me], what)
    meta = [(torch.int64, ()), (torch.int64, ())]
    *payload, _, _ = field_bytes(got, specs + meta)  # scattered from the received rows, no copy first
    tok, loc = unpack(got[:, sum(int(p.shape[1]) for p in payload):], meta)
    cap = r * m
    masked, recv_count, src_info, src_rank, layout_range, ret_index = receive_low_latency(
        payload, specs, tok, loc, r, me, slots, n_local, cap, dev, recv_buffer)
    handle = CombineHandle(mode, plan, w, ret_index, slots[:, me].copy(), slots[:, me].copy(), "device")
    xr, xq = _received(masked, qt, quant, (n_local, cap, h))
    return LowLatencyDispatch(xr, xq, recv_count, src_info, src_rank, layout_range, handle, engines)


def _received(payload, qt, quant, shape):
    if qt is None:
        return payload[0], None
    return None, DeviceQuantized(payload[0], payload[1], quant, shape)
