"""The operands of the device bounds (:mod:`moeref.compare.device.bounds`, :mod:`moeref.compare.device.adder`):
a block-scaled operand as float64 tensors (:class:`DeviceBlock`), one expert of a
:class:`~moeref.gemm.StackedExperts` read from its codes (:class:`_StackedExpert`, with the per-expert statistics
of the codes present), K-major weight stacks decoded once per group of experts (:func:`_weights_kt`), the per-row
statistics of one pass of :mod:`moeref.compare.device._stats_kernels`, and the helpers that place a group's rows
in an ``[R, N]`` result (:func:`_put_rows`, :func:`_or_zeros`, :func:`_rows_of`, :func:`_with_parts`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _torch():
    import torch

    return torch


@dataclass(frozen=True, eq=False)
class DeviceBlock:
    """A block-scaled ``[R, K]`` operand as float64 tensors: element ``values``, ``scales`` on the block grid
    ``block`` (:class:`moeref.gemm.BlockOperand` on a device)."""

    values: object
    scales: object
    block: tuple
    finite: bool | None = None
    quantum_max: tuple | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[0]), int(self.values.shape[1])

    def dequantize(self):
        """:meth:`moeref.gemm.BlockOperand.dequantize`: each element times its block scale (one multiply)."""
        r, k = self.shape
        br, bk = self.block
        s = self.scales.repeat_interleave(br, dim=0)[:r].repeat_interleave(bk, dim=1)[:, :k]
        return self.values * s

    @classmethod
    def of(cls, op) -> "DeviceBlock":
        """From a :class:`moeref.gemm.device.DeviceOperand`."""
        return cls(op.decode(), op.scales, tuple(int(b) for b in op.block))


def _row_stats(values):
    """Per row of float64 ``values`` ``[R, K]``: all finite, bf16-representable, and
    :func:`moeref.gemm.exact.quantum_and_max` (``(inf, 0)`` for a zero row) as NumPy arrays: one pass of
    :func:`moeref.compare.device._stats_kernels.row_stats_t`, one host copy."""
    from ._stats_kernels import row_stats_t

    out = row_stats_t(values).cpu().numpy()
    return out[0] > 0, out[1] > 0, out[2], out[3]



def _kt(x):
    """K-major contiguous copy ``[K, R]`` of ``[R, K]``."""
    return x.t().contiguous()


def _weights_kt(ws, sel=None, *, scaled: bool = True, magnitude: bool = False):
    """``[G, K, N]`` float64 K-major stack of experts ``ws[g]`` (``g`` in ``sel``, default all): their values
    times their block scales (``scaled``; else the element values), ``|.|`` if ``magnitude``. Experts of one
    :class:`~moeref.gemm.StackedExperts` are decoded together from their codes (:func:`_decode_kt`); others
    one by one (:meth:`DeviceBlock.dequantize`). The same numbers either way: one multiply per element, and
    ``|v * s| = |v| * |s|``."""
    torch = _torch()
    if isinstance(ws, _Experts) and scaled and not magnitude and (sel is None or list(sel) == list(range(len(ws)))):
        if ws.full is None:
            ws.full = _weights_kt(list(ws))
        return ws.full
    items = [ws[g] for g in (range(len(ws)) if sel is None else sel)]
    if items and all(isinstance(w, _StackedExpert) and w.stack is items[0].stack for w in items):
        return _decode_kt(items[0].stack, [w.e for w in items], scaled, magnitude)
    out = torch.stack([(w.dequantize() if scaled else w.values).t() for w in items]).contiguous()
    return out.abs() if magnitude else out


class _Experts(list):
    """The experts of one group (:func:`_expert_groups`) with their dequantized ``[G, K, N]`` stack, decoded at
    most once (``full``) for the GEMM2 radius term and error bound, which both read it."""

    full = None


def _abs_stack(ws):
    """``(stack, abs_w)`` for a kernel that reads ``|W|``: the group's decoded stack read through ``|.|`` when
    it exists (:class:`_Experts`), else a magnitude stack."""
    if isinstance(ws, _Experts) and ws.full is not None:
        return ws.full, True
    return _weights_kt(ws, magnitude=True), False


def _decode_kt(w, experts: list, scaled: bool, magnitude: bool):
    """Experts ``experts`` of the :class:`StackedExperts` ``w`` as float64 ``[G, K, N]``: the codes gathered and
    transposed (one byte each), decoded in one pass, then multiplied in place by their block scales broadcast
    over the blocks (no element-sized scale tensor)."""
    torch = _torch()
    from ...gemm.device import _decode

    n, k = (int(d) for d in w.shape)
    v = _decode(_codes_kt(w, experts), w.element, w.magnitude)
    if magnitude:
        v = v.abs_()
    if not scaled:
        return v
    st = w.scales.index_select(0, torch.as_tensor(experts, dtype=torch.int64, device=w.scales.device)).transpose(1, 2)
    st = st.abs() if magnitude else st
    br, bk = (int(b) for b in w.block)
    g = len(experts)
    if k % bk == 0 and n % br == 0:
        v.view(g, k // bk, bk, n // br, br).mul_(st[:, :, None, :, None])
    else:
        v.mul_(st.repeat_interleave(bk, dim=1)[:, :k].repeat_interleave(br, dim=2)[:, :, :n])
    return v


def _put_rows(dst, rows, part, total: int, *, whole: bool = False):
    """``dst`` with ``part`` (float64 ``[len(rows), N]``) at rows ``rows``: ``part`` itself where it holds every row in
    order and nothing is written yet (``whole``), else scattered into ``dst``, made here as zeros ``[total, N]`` on
    first use (``dst`` None). Results are made only where some rows are scattered (no float64 ``[R, N]`` of zeros
    that a whole result would replace)."""
    if whole and dst is None:
        return part
    if dst is None:
        dst = _torch().zeros((total, int(part.shape[1])), dtype=part.dtype, device=part.device)
    dst[rows] = part
    return dst


def _or_zeros(x, total: int, n: int, device):
    """``x``, or float64 zeros ``[total, n]`` where no row was put (None)."""
    torch = _torch()
    return torch.zeros((total, n), dtype=torch.float64, device=device) if x is None else x


def _with_parts(bound, term, product, rterm: bool, center: bool):
    """``bound``, or the tuple of it with the radius ``term`` (``rterm``) and the ``product`` (``center``) after it:
    what the bound functions return for those flags."""
    extra = ((term,) if rterm else ()) + ((product,) if center else ())
    return (bound,) + extra if extra else bound


def _rows_of(per_expert, counts):
    """``[G, N]`` -> ``[R, N]``: expert ``g``'s row repeated ``counts[g]`` times."""
    torch = _torch()
    return per_expert.repeat_interleave(torch.as_tensor(np.asarray(counts, dtype=np.int64), device=per_expert.device),
                                        dim=0)


def _codes_kt(w, experts: list):
    """uint8 codes ``[G, K, N]`` (unpacked, K-major) of experts ``experts`` of the :class:`StackedExperts` ``w``."""
    torch = _torch()
    from ...gemm.device import _unpack_nibbles

    codes = w.codes.index_select(0, torch.as_tensor(experts, dtype=torch.int64, device=w.codes.device))
    if w.packed:
        codes = _unpack_nibbles(codes, int(w.shape[1]))
    return codes.transpose(1, 2).contiguous()


def _chunk_scales(scales, rows, block, blk, *, magnitude: bool = True):
    """``|scales|`` (the scales themselves without ``magnitude``) of each row's block at each chunk's first column,
    ``[R, NCH]``."""
    torch = _torch()
    s = scales.index_select(0, torch.div(rows, block[0], rounding_mode="floor")) \
        .index_select(1, torch.div(blk, block[1], rounding_mode="floor"))
    return (s.abs() if magnitude else s).contiguous()


def _finite(op: DeviceBlock) -> bool:
    return op.finite if op.finite is not None else bool(_row_stats(op.values)[0].all())


def _quantum_max(op: DeviceBlock) -> tuple[float, float]:
    if op.quantum_max is not None:
        return op.quantum_max
    _, _, q, mx = _row_stats(op.values)
    return (float(q.min(initial=math.inf)), float(mx.max(initial=0.0)))


def _stacked_block(w, e: int) -> "_StackedExpert":
    return _StackedExpert(w, e)


class _StackedExpert:
    """Expert ``e`` of a :class:`StackedExperts` as a :class:`DeviceBlock` whose values are decoded only when
    read (stacks of experts are decoded together by :func:`_weights_kt`). ``finite``, ``quantum_max``
    (:func:`moeref.gemm.exact.quantum_and_max`) and ``bf16`` (every value bf16-representable) come from the
    codes present (a histogram of the codes read through the decode table: the same numbers as over the
    values)."""

    def __init__(self, w, e: int):
        self.stack, self.e = w, int(e)
        self.scales = w.scales[e]
        self.block = tuple(int(b) for b in w.block)
        finite, qm, bf16 = _stack_expert_stats(w)
        self.finite = bool(finite[e])
        self.quantum_max = (float(qm[e, 0]), float(qm[e, 1])) if self.finite else None
        self.bf16 = bool(bf16[e])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(d) for d in self.stack.shape)

    @property
    def values(self):
        """float64 element values ``[N, K]`` (a view of a K-major tensor: codes transposed, then decoded)."""
        return _decode_kt(self.stack, [self.e], scaled=False, magnitude=False)[0].t()

    dequantize = DeviceBlock.dequantize


def _codes_present(w) -> np.ndarray:
    """bool ``[E, 256]``: which codes each expert holds, one histogram per expert and one host copy for the
    stack, cached on the codes tensor (weights are constant between calls; a new tensor is a new cache)."""
    torch = _torch()
    from ...gemm.device import _cached_on, _unpack_nibbles

    def compute():
        hist = []
        for e in range(int(w.codes.shape[0])):
            c = w.codes[e]
            c = _unpack_nibbles(c, w.shape[1]) if w.packed else c
            hist.append(torch.bincount(c.reshape(-1), minlength=256)[:256])
        return (torch.stack(hist) > 0).cpu().numpy() if hist else np.zeros((0, 256), dtype=bool)

    return _cached_on(w.codes, "_moeref_codes_present", compute)


def _stack_expert_stats(w):
    """Per expert of a :class:`StackedExperts`: ``(finite bool [E], quantum and max float64 [E, 2], bf16 bool [E])``
    over the values of the codes it holds (:func:`_codes_present`): all finite; ``(q, m)`` of
    :func:`moeref.gemm.exact.quantum_and_max` (the smallest per-value quantum and the largest magnitude over the
    nonzero codes present: the same numbers as over the values; ``(inf, 0)`` for an all-zero expert); every value
    bf16-representable. Computed for all experts at once and cached on the codes tensor beside the histogram."""
    import ml_dtypes

    from ...formats import decode_table
    from ...gemm.device import _cached_on
    from ...gemm.exact import quantum_and_max

    def compute():
        table = decode_table(w.element)
        table = np.abs(table) if w.magnitude else table
        present = _codes_present(w)[:, :table.size]
        fin_code = np.isfinite(table)
        finite = ~(present & ~fin_code[None, :]).any(axis=1)
        mag = np.where(fin_code, np.abs(table), 0.0)
        quantum = np.array([quantum_and_max([v])[0] if (f and v != 0) else math.inf for v, f in zip(table, fin_code)])
        qm = np.stack([np.where(present, quantum[None, :], math.inf).min(axis=1, initial=math.inf),
                       np.where(present, mag[None, :], 0.0).max(axis=1, initial=0.0)], axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            bf_code = fin_code & (table.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) == table)
        return finite, qm, finite & ~(present & ~bf_code[None, :]).any(axis=1)

    return _cached_on(w.codes, "_moeref_expert_stats", compute)
