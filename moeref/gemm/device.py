"""The exact block-GEMM engine on torch tensors (float64 on a CUDA GPU): :func:`moeref.gemm.block_gemm`'s
result, bit for bit, at production shapes.

The arithmetic is :mod:`moeref.gemm.exact`'s, step for step, so the result is the same float64 value:

* each segment's partial dot ``P_s`` (``g = gcd`` of the operands' K blocks) is one batched float64
  matrix product (cuBLAS ``DgemmStridedBatched``): for quantized operands every partial sum is exact
  in float64 (module docstring of :mod:`moeref.gemm.exact`), so the order cuBLAS adds in cannot matter;
* then, per output element, ``acc = +0.0; acc = acc + (P_s * sa) * sb`` over ``s`` in order, in one
  Triton kernel compiled without FMA contraction (``enable_fp_fusion=False``), the exact sequence of
  IEEE roundings the NumPy engine performs.

For operands that are not quantized (bf16/fp16/fp32/float64 values) the partial dots are only
float64-accurate and depend on the BLAS, so the two engines agree to ``gamma_K(2^-53)`` of
``sum |a b|``, not bit for bit (as two BLAS libraries do).

Weights are never decoded whole: each expert's ``[N, K]`` codes are decoded to float64 just before its
product (``float8_e4m3fn`` / ``float8_e5m2`` through torch's exact cast, other formats through their
decode table), and the ``[S, R, N]`` partial dots are formed in row chunks of at most
:data:`PARTIALS_BYTES`. Row gathers (a slot's token row) move codes, not float64 values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .._interop import to_device
from ..quant.device import DeviceQuantized
from .exact import BlockOperand, as_operand
from .grouped import check_row_expert
from .stacked import StackedExperts

__all__ = ["DeviceOperand", "device_operand", "device_block_gemm", "device_expert_rows_gemm",
           "PARTIALS_BYTES"]

PARTIALS_BYTES = 1 << 30
"""Largest ``[S, R, N]`` float64 partial-dot tensor formed at once (rows are chunked to fit)."""

_TORCH_FP8 = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def _torch():
    import torch

    return torch


@dataclass(frozen=True, eq=False)
class DeviceOperand:
    """A block-scaled ``[R, K]`` operand on a torch device: ``value = element * scales[r // br, k // bk]``.

    Exactly one of ``values`` (float64 ``[R, K]``) and ``codes`` (uint8 ``[R, K]``, unpacked, read through
    ``element``'s decode table) is set; ``scales`` float64 ``[ceil(R/br), ceil(K/bk)]``; ``quantized`` as
    in :class:`moeref.gemm.BlockOperand`.
    """

    values: object
    codes: object
    element: str | None
    scales: object
    block: tuple
    quantized: bool
    magnitude: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        x = self.values if self.values is not None else self.codes
        return int(x.shape[0]), int(x.shape[1])

    @property
    def device(self):
        return self.scales.device

    packed_codes = False  # DeviceOperand codes are unpacked (one code a byte)

    def decode(self):
        """float64 element values ``[R, K]`` (not scaled)."""
        if self.values is not None:
            return self.values
        return _decode(self.codes, self.element, self.magnitude)

    def abs(self) -> "DeviceOperand":
        if self.values is not None:
            return replace(self, values=self.values.abs(), scales=self.scales.abs())
        return replace(self, scales=self.scales.abs(), magnitude=True)

    def take_rows(self, rows) -> "DeviceOperand":
        """Rows ``rows`` (int64 tensor or array; -1: a zero row with scale 1) with one scale row each
        (block ``(1, bk)``), as :meth:`BlockOperand.take_rows`."""
        torch = _torch()
        rows = torch.as_tensor(np.asarray(rows, dtype=np.int64) if not torch.is_tensor(rows) else rows,
                               dtype=torch.int64, device=self.device).reshape(-1)
        pad = rows < 0
        safe = torch.where(pad, torch.zeros_like(rows), rows)
        if self.shape[0] == 0:
            safe = torch.zeros_like(rows)
            pad = torch.ones_like(pad)
        sc = self.scales.index_select(0, torch.div(safe, self.block[0], rounding_mode="floor")) \
            if self.shape[0] else torch.ones((rows.numel(), self.scales.shape[1]), dtype=torch.float64,
                                             device=self.device)
        sc = torch.where(pad[:, None], torch.ones_like(sc), sc)
        if self.values is not None:
            src = self.values if self.shape[0] else torch.zeros((1, self.shape[1]), dtype=torch.float64,
                                                                device=self.device)
            vals = torch.where(pad[:, None], torch.zeros((), dtype=torch.float64, device=self.device),
                               src.index_select(0, safe))
            return DeviceOperand(vals, None, None, sc, (1, self.block[1]), self.quantized)
        zero = _zero_code(self.element)
        src = self.codes if self.shape[0] else torch.full((1, self.shape[1]), zero, dtype=torch.uint8,
                                                          device=self.device)
        codes = torch.where(pad[:, None], torch.full((), zero, dtype=torch.uint8, device=self.device),
                            src.index_select(0, safe))
        return DeviceOperand(None, codes, self.element, sc, (1, self.block[1]), self.quantized, self.magnitude)


def _zero_code(element: str) -> int:
    from ..formats import decode_table

    t = decode_table(element)
    return int(np.flatnonzero((t == 0) & ~np.signbit(t))[0])


_TABLES: dict = {}


def _table(element: str, magnitude: bool, device):
    from ..formats import decode_table

    key = (element, magnitude, str(device))
    if key not in _TABLES:
        t = decode_table(element)
        _TABLES[key] = _torch().tensor(np.abs(t) if magnitude else t, dtype=_torch().float64, device=device)
    return _TABLES[key]


def _decode(codes, element: str, magnitude: bool = False):
    """float64 values of uint8 ``codes`` (unpacked) in ``element``: torch's exact FP8 cast where it has
    the format, else the decode table (the same values: checked by the tests)."""
    torch = _torch()
    name = _TORCH_FP8.get(element)
    if name is not None and hasattr(torch, name) and codes.device.type == "cuda":
        v = codes.view(getattr(torch, name)).to(torch.float64)
        return v.abs() if magnitude else v
    return _table(element, magnitude, codes.device)[codes.to(torch.int32)]


def _unpack_nibbles(codes, k: int):
    """uint8 ``[..., ceil(k/2)]`` two codes a byte (element 2i low) -> ``[..., k]``."""
    torch = _torch()
    lo = codes & 0xF
    hi = codes >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*codes.shape[:-1], -1)[..., :k]


def device_operand(x, device) -> DeviceOperand:
    """A :class:`DeviceOperand` on ``device`` of ``x``: a :class:`DeviceOperand` (returned as is), a
    :class:`BlockOperand`, a quantized tensor (:func:`moeref.gemm.as_operand` input), a device-quantized
    tensor (:class:`moeref.quant.device.DeviceQuantized`), a fast-path quantized tensor (an object with
    ``codes`` tensor, ``scales``, ``scales_logical``, ``scale_layout == "row_major"``, ``grid``, ``scheme``,
    ``shape`` and ``global_scale``, as :mod:`fastpath.quant` returns) or a float array/tensor ``[R, K]``
    (one block, scale 1, not quantized)."""
    torch = _torch()
    if isinstance(x, DeviceOperand):
        return x
    if isinstance(x, DeviceQuantized):
        if len(x.shape) != 2:
            raise ValueError(f"a quantized operand must be 2-D; got shape {x.shape}")
        blk = tuple(int(b) for b in x.block_shape)
        return DeviceOperand(None, x.element_codes().to(device), x.scheme.element, x.scale_values.to(device), blk,
                             True)
    if hasattr(x, "scales_logical") and hasattr(x, "codes") and torch.is_tensor(getattr(x, "codes", None)):
        return _from_fast(x, device)
    if torch.is_tensor(x) and x.dtype.is_floating_point:
        if x.dim() != 2:
            raise ValueError(f"a float operand must be 2-D [R, K]; got shape {tuple(x.shape)}")
        v = x.to(device=device, dtype=torch.float64)
        return DeviceOperand(v, None, None, torch.ones((1, 1), dtype=torch.float64, device=device),
                             (max(v.shape[0], 1), max(v.shape[1], 1)), False)
    op = as_operand(x)
    sc = torch.as_tensor(np.asarray(op.scales, dtype=np.float64), device=device)
    scheme = getattr(x, "scheme", None)
    if (scheme is not None and getattr(scheme, "packed", False) and getattr(x, "zero_points", None) is None
            and len(getattr(x, "shape", ())) == 2):  # 4-bit codes: unpacked, read through the format's table
        codes = np.ascontiguousarray(x.element_codes())
        return DeviceOperand(None, torch.as_tensor(codes, device=device), scheme.element, sc, op.block, True)
    if op._codes is not None and op._values is None:
        found = _element_of_table(op._table)
        if found is not None:
            element, magnitude = found
            return DeviceOperand(None, torch.as_tensor(np.array(op._codes, copy=True), device=device), element,
                                 sc, op.block, op.quantized, magnitude)
    v = torch.as_tensor(np.ascontiguousarray(np.asarray(op.values, dtype=np.float64)), device=device)
    return DeviceOperand(v, None, None, sc, op.block, op.quantized)


def _element_of_table(table) -> tuple[str, bool] | None:
    """``(format, magnitude)`` whose decode table (``magnitude``: its absolute value) is ``table``."""
    from ..formats import FORMATS, decode_table

    for name in FORMATS:
        t = decode_table(name)
        if t.shape != table.shape:
            continue
        if np.array_equal(t, table, equal_nan=True):
            return name, False
        if np.array_equal(np.abs(t), table, equal_nan=True):
            return name, True
    return None


def _from_fast(q, device) -> DeviceOperand:
    """A fast-path quantized tensor (codes and scales already on the device): scales decoded in float64
    exactly as :meth:`moeref.quant.QuantizedTensor.scale_values` (block scale, times the global factor)."""
    torch = _torch()
    if q.scale_layout != "row_major":
        raise ValueError(f"the device engine reads row_major scales; got {q.scale_layout!r}")
    scheme = q.scheme
    shape = tuple(int(d) for d in q.shape)
    if len(shape) != 2:
        raise ValueError(f"a quantized operand must be 2-D; got shape {shape}")
    grid = q.grid
    s = q.scales.reshape(grid)
    fmt = scheme.scale_format
    if fmt == "fp32":
        sv = s.to(torch.float64)
    else:
        sv = _table("e8m0" if fmt == "ue8m0" else "ue4m3", False, s.device)[s.to(torch.int32)]
    if q.global_scale is not None:
        sv = sv * q.global_scale.reshape(()).to(torch.float64)
    codes = q.codes.reshape(shape[0], -1)
    if scheme.packed:
        codes = _unpack_nibbles(codes, shape[1])
    blk = tuple(int(b) for b in scheme.resolve_block(shape))
    return DeviceOperand(None, codes.to(device), scheme.element, sv.to(device), blk, True)


# ------------------------------------------------------------------------------------ the product


def _segment(bk_a: int, bk_b: int, k: int) -> int:
    return max(1, math.gcd(min(bk_a, max(k, 1)), min(bk_b, max(k, 1))))


def _expand_scales(scales, rows: int, block_rows: int, starts, block_cols: int):
    """Scales per (row, segment): float64 ``[rows, S]`` from the block grid."""
    torch = _torch()
    r_idx = torch.div(torch.arange(rows, device=scales.device), block_rows, rounding_mode="floor")
    c_idx = torch.div(starts, block_cols, rounding_mode="floor")
    return scales.index_select(0, r_idx).index_select(1, c_idx)


def _gemm_rows(av, sa, bv, sb, g: int, out, out_rows=None) -> None:
    """``out[out_rows] = sum_s (P_s * sa[:, s]) * sb[:, s]`` in segment order, ``P_s = av_s @ bv_s^T``.

    ``av`` float64 ``[R, K]``, ``sa`` ``[R, S]``, ``bv`` ``[N, K]``, ``sb`` ``[N, S]``."""
    torch = _torch()
    r, k = av.shape
    n = bv.shape[0]
    s = -(-k // g)
    if s * g != k:  # a last, shorter segment: pad with zeros (exact zero products)
        av = torch.nn.functional.pad(av, (0, s * g - k))
        bv = torch.nn.functional.pad(bv, (0, s * g - k))
    a3 = av.reshape(r, s, g).transpose(0, 1)      # [S, R, g] (strided view)
    b3 = bv.reshape(n, s, g).permute(1, 2, 0)     # [S, g, N] (column-major matrices)
    chunk = max(1, PARTIALS_BYTES // max(1, s * n * 8))
    for r0 in range(0, r, chunk):
        r1 = min(r0 + chunk, r)
        p = torch.bmm(a3[:, r0:r1], b3)          # [S, rows, N], exact partial dots
        rows = None if out_rows is None else out_rows[r0:r1]
        _ordered_scaled_sum(p, sa[r0:r1], sb, out, rows, r0)


def _ordered_scaled_sum(p, sa, sb, out, rows, r0: int) -> None:
    from ._device_kernels import ordered_scaled_sum

    ordered_scaled_sum(p, sa, sb, out, rows, r0)


def device_block_gemm(a, b, *, device=None):
    """``C = A @ B.T`` in float64 on a torch device: :func:`moeref.gemm.block_gemm`'s value (bit for bit
    for quantized operands). ``a``, ``b``: :func:`device_operand` inputs; ``device`` defaults to ``a``'s
    (or ``b``'s) device, else CUDA.

    Returns: float64 torch tensor ``[M, N]``.
    """
    torch = _torch()
    device = device or _device_of(a, b)
    a = device_operand(a, device)
    b = device_operand(b, device)
    m, k = a.shape
    n, kb = b.shape
    if k != kb:
        raise ValueError(f"a has K={k} columns but b has K={kb}")
    out = torch.zeros((m, n), dtype=torch.float64, device=device)
    if m == 0 or n == 0 or k == 0:
        return out
    _product(a.decode(), a.scales, a.block, b.decode(), b.scales, b.block, out)
    return out


def _product(av, a_scales, a_block, bv, b_scales, b_block, out, out_rows=None) -> None:
    torch = _torch()
    m, k = av.shape
    n = bv.shape[0]
    g = _segment(a_block[1], b_block[1], k)
    starts = torch.arange(0, k, g, device=av.device)
    sa = _expand_scales(a_scales, m, a_block[0], starts, a_block[1])
    sb = _expand_scales(b_scales, n, b_block[0], starts, b_block[1])
    _gemm_rows(av, sa, bv, sb, g, out, out_rows)


def _device_of(*xs):
    torch = _torch()
    for x in xs:
        for attr in ("device",):
            d = getattr(x, attr, None)
            if isinstance(d, torch.device):
                return d
    return torch.device("cuda")


def _expert_values(w, e: int):
    """float64 ``[N, K]`` element values of expert ``e`` and its scales (``w`` a device
    :class:`StackedExperts`)."""
    codes = w.codes[e]
    if w.packed:
        codes = _unpack_nibbles(codes, w.shape[1])
    return _decode(codes, w.element, w.magnitude), w.scales[e]


FEW_ROWS_MAX = 32
"""Experts with at most this many rows take the few-rows kernel (codes read directly, 8 rows a work
item); more rows take the decode + cuBLAS path. Both give the same bits (tested with both forced)."""
_FEW_ROWS_ITEM = 8
FEW_ROWS_ON_CPU = False


DIGITS = True
"""Use the int8-digit kernel where both operands qualify (:func:`_digits_path`) for experts with at most
``DIGITS_MAX_ROWS`` rows; on the CPU only when ``DIGITS_ON_CPU`` (its tests: the interpreter is slow for
it). H100, DeepSeek-V3 layer, 2026-11-24: 128 tokens 0.075 s with it against 0.13 s in float64; at 4096
tokens (about 128 rows an expert) the float64 cuBLAS path is faster (0.24 s against 0.65 s)."""
DIGITS_ON_CPU = False
DIGITS_MAX_ROWS = 16


def _integer_table(element: str, magnitude: bool):
    """``(I, q)``: int32 ``I[code] = value * 2^q`` for every finite code, when all are integers below 2^21 in
    magnitude (NaN codes map to 0: see :func:`_has_nan_codes`), else None."""
    from ..formats import decode_table
    from .exact import quantum_and_max

    t = decode_table(element)
    t = np.abs(t) if magnitude else t
    fin = np.isfinite(t)
    if not np.all(fin | np.isnan(t)):
        return None  # infinities have no integer value
    quantum, top = quantum_and_max(t[fin])
    if not math.isfinite(quantum):
        quantum = 1.0
    q = -int(round(math.log2(quantum)))
    if 2.0 ** -q != quantum or top * 2.0**q >= 2**21:
        return None
    return np.where(fin, t * 2.0**q, 0).astype(np.int32), q


def _integer_table_on(element: str, magnitude: bool, device):
    """:func:`_integer_table`'s int32 table on ``device``, made once per (format, device)."""
    key = ("int", element, magnitude, str(device))
    if key not in _TABLES:
        _TABLES[key] = _torch().as_tensor(_integer_table(element, magnitude)[0], device=device)
    return _TABLES[key]


def _digits_of(table: np.ndarray) -> int:
    top = int(np.abs(table).max(initial=0))
    return 1 if top < 128 else (2 if top < 16384 else 3)


def _cached_on(t, name: str, compute):
    """``compute()``, cached as attribute ``name`` of tensor ``t``: weights are constant between calls, so their
    statistics are computed once; a new tensor is a new cache, and a tensor that takes no attribute is computed each
    time."""
    val = getattr(t, name, None)
    if val is None:
        val = compute()
        try:
            setattr(t, name, val)
        except AttributeError:
            pass
    return val


def _has_nan_codes(codes, element: str) -> bool:
    """Whether ``codes`` hold a NaN code of ``element`` (cached on the tensor: weights are checked once)."""
    from ..formats import decode_table

    def compute():
        nan = np.flatnonzero(np.isnan(decode_table(element)))
        torch = _torch()
        return bool(nan.size) and bool(torch.isin(codes, torch.as_tensor(nan, dtype=codes.dtype,
                                                                          device=codes.device)).any().item())

    return _cached_on(codes, "_moeref_has_nan", compute)


def _digits_path(a: DeviceOperand, w: StackedExperts, g: int, device) -> bool:
    """The int8-digit kernel applies: both operands are codes of integer-valued formats (E4M3, E2M1, INT8,
    INT4, FP6 ...: :func:`_integer_table`), no NaN code present, segments a multiple of 32 columns."""
    if not DIGITS or (device.type != "cuda" and not DIGITS_ON_CPU) or a.codes is None or a.packed_codes:
        return False
    if g % 32 or g >= 44000:  # int8 tl.dot needs K >= 32
        return False
    if _integer_table(a.element, a.magnitude) is None or _integer_table(w.element, w.magnitude) is None:
        return False
    return not (_has_nan_codes(a.codes, a.element) or _has_nan_codes(w.codes, w.element))


def _items(starts, counts, rows: int):
    per = -(-counts // rows)
    first = np.repeat(starts, per) + rows * (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per))
    return per, first, np.minimum(np.repeat(starts + counts, per) - first, rows)


def _digit_rows(a_all: DeviceOperand, sa_all, order_t, w: StackedExperts, out, experts, starts, counts, g: int):
    """The experts through :func:`moeref.gemm._device_kernels.exact_digits`: 16-row work items for experts
    with at most 16 rows, 64-row items for the others."""
    from ._device_kernels import exact_digits

    ta, qa = _integer_table(a_all.element, a_all.magnitude)
    tw, qw = _integer_table(w.element, w.magnitude)
    itab_a = _integer_table_on(a_all.element, a_all.magnitude, out.device)
    itab_w = _integer_table_on(w.element, w.magnitude, out.device)
    for rows, sel in ((16, counts <= 16), (64, counts > 16)):
        if not sel.any():
            continue
        per, first, cnt = _items(starts[sel], counts[sel], rows)
        items = to_device(np.stack([np.repeat(experts[sel], per), first, cnt]).astype(np.int32), out.device)
        exact_digits(a_all.codes, sa_all.contiguous(), order_t, w.codes, itab_a, itab_w, 2.0 ** -(qa + qw),
                     (_digits_of(ta), _digits_of(tw)), w.scales, out, items, g=g, n=w.shape[0], k=w.shape[1],
                     w_block=w.block, packed=w.packed, rows=rows)


def _float64_rows(a_all, sa_all, order_t, w, out, experts, starts, counts, g, w_rows, w_cols, device) -> None:
    """The float64 paths: experts with a few rows through the few-rows kernel (codes read directly; on the
    CPU only when FEW_ROWS_ON_CPU: the interpreter is slow for it), the others decoded and multiplied by
    cuBLAS, one expert at a time."""
    few = (counts <= FEW_ROWS_MAX) & (device.type == "cuda" or FEW_ROWS_ON_CPU)
    if few.any():
        _few_rows(a_all.decode(), sa_all, order_t, w, out, experts[few], starts[few], counts[few], g)
    av_all = a_all.decode() if (~few).any() else None
    for e, s0, c in zip(experts[~few].tolist(), starts[~few].tolist(), counts[~few].tolist()):
        wv, ws = _expert_values(w, e)
        sb = ws.index_select(0, w_rows).index_select(1, w_cols)
        _gemm_rows(av_all[s0:s0 + c], sa_all[s0:s0 + c], wv, sb, g, out, order_t[s0:s0 + c])


def _few_rows(av_all, sa_all, order_t, w: StackedExperts, out, experts, starts, counts, g: int) -> None:
    """The experts ``experts`` (rows ``starts[i]:starts[i]+counts[i]`` of the sorted operand) through
    :func:`moeref.gemm._device_kernels.exact_few_rows`, in work items of :data:`_FEW_ROWS_ITEM` rows."""
    from ._device_kernels import exact_few_rows

    rows = _FEW_ROWS_ITEM
    per, first, item_c = _items(starts, counts, rows)
    items = to_device(np.stack([np.repeat(experts, per), first, item_c]).astype(np.int32), out.device)
    name = _TORCH_FP8.get(w.element)
    e4m3 = w.element == "e4m3fn" and out.device.type == "cuda" and not w.magnitude
    table = _table(w.element, w.magnitude, out.device)
    exact_few_rows(av_all, sa_all.contiguous(), order_t, w.codes, table, w.scales, out, items, g=g, n=w.shape[0],
                   k=w.shape[1], w_block=w.block, packed=w.packed, e4m3=e4m3 and name is not None,
                   rows=rows)


def device_expert_rows_gemm(a, row_expert, weights, bias=None, *, abs_values: bool = False):
    """:func:`moeref.gemm.expert_rows_gemm` on a torch device: ``out[r] = a[r] @ W[row_expert[r]].T (+ bias)``,
    0 on rows with ``row_expert == -1``; float64 ``[R, N]`` tensor, the NumPy engine's value.

    Args:
        a: ``[R, K]`` operand (:func:`device_operand` input; already on the device for speed).
        row_expert: int ``[R]`` (NumPy or torch): the local expert of each row, -1 padding.
        weights: :class:`StackedExperts` on the device (:meth:`StackedExperts.to`).
        bias: optional float ``[E, N]`` (tensor or array), added in float64 after the product.
        abs_values: ``|a| @ |W|.T + |bias|`` (error-bound sums).
    """
    torch = _torch()
    if not isinstance(weights, StackedExperts):
        raise TypeError(f"the device engine takes StackedExperts weights; got {type(weights).__name__} "
                        "(StackedExperts.from_quantized(...).to(device))")
    device = weights.codes.device
    a = device_operand(a, device)
    w = weights.abs() if abs_values else weights
    if abs_values:
        a = a.abs()
    rows = check_row_expert(row_expert.cpu() if torch.is_tensor(row_expert) else row_expert, a.shape[0], len(w))
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"a has K={a.shape[1]} columns but the experts have K={w.shape[1]}")
    n = w.shape[0]
    out = torch.zeros((rows.size, n), dtype=torch.float64, device=device)
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    first = int(np.searchsorted(sorted_rows, 0))
    experts, starts, counts = np.unique(sorted_rows[first:], return_index=True, return_counts=True)
    if experts.size:
        # every valid row gathered, decoded and given its per-segment scales once (a few launches), then
        # per expert: its weights decoded, one batched product, one in-order sum (views of the rest)
        order_t = to_device(order[first:], device)  # a queued copy: no host wait
        a_all = a.take_rows(order_t)
        k = a.shape[1]
        g = _segment(a_all.block[1], w.block[1], k)
        seg = torch.arange(0, k, g, device=device)
        sa_all = a_all.scales.index_select(1, torch.div(seg, a_all.block[1], rounding_mode="floor"))
        w_rows = torch.div(torch.arange(n, device=device), w.block[0], rounding_mode="floor")
        w_cols = torch.div(seg, w.block[1], rounding_mode="floor")
        # experts with few rows of integer-valued formats: exact on the int8 tensor cores (memory-bound
        # there: codes read once); the others in float64 (cuBLAS is faster once an expert has many rows)
        digits = (counts <= DIGITS_MAX_ROWS) & _digits_path(a_all, w, g, device)
        if digits.any():
            _digit_rows(a_all, sa_all, order_t, w, out, experts[digits], starts[digits], counts[digits], g)
        if (~digits).any():
            _float64_rows(a_all, sa_all, order_t, w, out, experts[~digits], starts[~digits], counts[~digits], g,
                          w_rows, w_cols, device)
    if bias is not None:
        add_expert_bias(out, rows, bias, len(w), magnitude=abs_values)
    return out


def add_expert_bias(out, rows, bias, num_experts: int, *, magnitude: bool = False):
    """``out[r] += bias[rows[r]]`` (``|bias|`` with ``magnitude``) in float64 on every row with ``rows[r] >= 0``, in
    place: :func:`device_expert_rows_gemm`'s bias step. ``out`` float64 ``[R, N]`` on a device, ``rows`` int NumPy
    ``[R]``, ``bias`` float ``[num_experts, N]`` (tensor or array). Returns ``out``."""
    torch = _torch()
    device = out.device
    n = int(out.shape[1])
    b = torch.as_tensor(bias if torch.is_tensor(bias) else np.asarray(bias, dtype=np.float64),
                        device=device).to(torch.float64)
    if tuple(b.shape) != (num_experts, n):
        raise ValueError(f"bias must have shape ({num_experts}, {n}); got {tuple(b.shape)}")
    rows = np.asarray(rows, dtype=np.int64)
    valid = np.flatnonzero(rows >= 0)
    vt = torch.as_tensor(valid, device=device)
    add = b.abs() if magnitude else b
    out[vt] += add.index_select(0, torch.as_tensor(rows[valid], device=device))
    return out
