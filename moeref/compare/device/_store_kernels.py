"""One Triton pass for :func:`moeref.compare.device.layer.device_store_interval`: the bits of its torch definition
(:func:`store_interval_torch`, below).

Per element, from ``value`` ``v`` and ``radius`` ``r`` (float64), as the torch function:

* ``dtype=None``: ``center = v``, ``half = r + unit * (|v| + r)``, ``flipped = False``;
* else ``wide = r * (1 + 2^-40) + |v| * 2^-52``, ``lo = round(v - wide)``, ``hi = round(v + wide)``
  (:func:`moeref.moe.device.round_on_device`), ``center = 0.5 * lo + 0.5 * hi``,
  ``half = 0.5 * hi - 0.5 * lo``; where ``half`` is not finite and ``v`` is, ``center = v`` and
  ``half = inf``; ``flipped = lo != hi`` (true for NaN).

Arithmetic: each torch operation is one operation here, with the same operands (products, then their
sum), compiled with ``enable_fp_fusion=False`` so that no product becomes an FMA. The float64 constants
(``unit``, ``1 + 2^-40``, ``2^-52``, ``0.5``, ``inf``) are read from a float64 tensor, since Triton types a
Python float as float32 (``1 + 2^-40`` and ``unit`` would be rounded). ``isfinite(x)`` is ``|x| < inf``.

NaN operands: where both operands of a sum or difference are NaN, torch's add kernel (``a + alpha * b``,
an ``fmadd(b, alpha, a)`` on x86) returns ``b``'s NaN. Sums are therefore written ``b + a`` (the same
value: IEEE addition commutes, signed zeros included, and a NaN operand comes first in the result on
x86 and in NumPy), differences ``where(isnan(b), b, a - b)`` (``b`` is a quiet NaN there: an arithmetic
result).

Roundings (``round``):

* float64: none; float32: ``x.to(float32).to(float64)``: one RNE cast (``cvt.rn.f32.f64`` on the GPU,
  as torch; NumPy's cast under the interpreter, as x86 torch);
* bfloat16: float64 -> float32 cast, then float32 -> bfloat16 RNE on the integer bits,
  ``(b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000``, exact for every non-NaN input (subnormals, the carry
  into the exponent, overflow to inf), so equal to ``cvt.rn.bf16.f32`` (torch's on sm_80+), whereas the
  Triton interpreter's own bf16 cast truncates; a NaN is quieted and truncated;
* float16: the round-to-odd float32 of :func:`moeref.moe.device._round_to_odd_f32`, operation for
  operation, then ``.to(float16).to(float32).to(float64)``: RNE casts (``cvt.rn.f16.f32`` as torch's
  ``c10::Half`` on the GPU; NumPy's under the interpreter, equal to x86 torch's for quiet NaNs).

A NaN's rounding is the platform's choice (x86 torch: bf16 0xFFFF for every NaN, float32 and float16
payload-preserving; GPUs: canonical NaNs). So the NaNs torch's own rounding gives are probed once per
device and dtype (:func:`_nan_image`); where they are one NaN for every input NaN, NaN lanes take that
NaN (``NAN_IMG``), else the casts above give theirs. On a GPU a NaN's sign from the arithmetic is CUDA's choice
and can differ from torch's there (an H100 gave torch -NaN and this kernel +NaN for ``|-NaN| + 0``, 2026-11-28):
the NaNs are in the same places, and nothing downstream reads a NaN's sign or payload
(``tests/test_store_kernels.py`` compares NaN against NaN on a GPU, bit for bit on the CPU).

One program per ``BLOCK`` = 1024 contiguous elements of the flattened tensors, 16 warps: two float64
loads, two float64 stores and one bool store per element, 2 elements a thread, all in one register
layout (16-byte vector accesses, no layout conversion through shared memory).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from ..._interop import triton_interpreted
from ._constants import float64_constants

__all__ = ["store_interval_t", "store_interval_torch"]

_BLOCK, _WARPS = 1024, 16
_NAMES = {1: "float64", 2: "float32", 3: "bfloat16", 4: "float16"}
_PROBE_NANS = (0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0xFFF4000000000000,
               0x7FFC00000000ABCD, 0xFFFFFFFFFFFFFFFF, 0x7FF80000DEAD0000)


@triton.jit
def _round(x, img, MODE: tl.constexpr, NAN_IMG: tl.constexpr):
    """``round_on_device(x, dtype)`` (module docstring); ``img``: its NaN where ``NAN_IMG``."""
    if MODE == 1:
        y = x
    else:
        f = x.to(tl.float32)
        if MODE == 2:
            y = f.to(tl.float64)
        elif MODE == 3:
            b = f.to(tl.int32, bitcast=True)
            q = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            q = tl.where(f != f, (b | 0x400000) & -65536, q)
            y = q.to(tl.float32, bitcast=True).to(tl.float64)
        else:
            back = f.to(tl.float64)
            inexact = (back != x) & (x == x)
            b = f.to(tl.int32, bitcast=True)
            b = tl.where(inexact & (tl.abs(back) > tl.abs(x)), b - 1, b)
            b = tl.where(inexact, b | 1, b)
            y = b.to(tl.float32, bitcast=True).to(tl.float16).to(tl.float32).to(tl.float64)
    if NAN_IMG:
        y = tl.where(x != x, img, y)
    return y


@triton.jit
def _sub(a, b):
    """``a - b``, ``b`` itself when it is a NaN (module docstring)."""
    return tl.where(b != b, b, a - b)


@triton.jit
def _store_kernel(v_ptr, r_ptr, c_ptr, center_ptr, half_ptr, flip_ptr, n, MODE: tl.constexpr,
                  NAN_IMG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    r = tl.load(r_ptr + offs, mask=m, other=0.0)
    if MODE == 0:
        unit = tl.load(c_ptr + 0)
        tl.store(half_ptr + offs, unit * (r + tl.abs(v)) + r, mask=m)
        tl.store(flip_ptr + offs, tl.zeros([BLOCK], dtype=tl.int1), mask=m)
    else:
        c_wide = tl.load(c_ptr + 1)
        c_abs = tl.load(c_ptr + 2)
        c_half = tl.load(c_ptr + 3)
        inf = tl.load(c_ptr + 4)
        img = tl.load(c_ptr + 5)
        wide = tl.abs(v) * c_abs + r * c_wide
        lo = _round(_sub(v, wide), img, MODE, NAN_IMG)
        hi = _round(wide + v, img, MODE, NAN_IMG)
        center = c_half * hi + c_half * lo
        half = _sub(c_half * hi, c_half * lo)
        bad = ~(tl.abs(half) < inf) & (tl.abs(v) < inf)
        tl.store(center_ptr + offs, tl.where(bad, v, center), mask=m)
        tl.store(half_ptr + offs, tl.where(bad, inf, half), mask=m)
        tl.store(flip_ptr + offs, lo != hi, mask=m)


def store_interval_torch(value, radius, dtype: str | None, unit: float = 0.0):
    """:func:`moeref.compare.device.layer.device_store_interval` as torch operations, one per NumPy operation of
    :func:`moeref.compare.bounds.store_interval`: the definition the one-pass kernel follows bit for bit."""
    from ...moe.device import round_on_device

    if dtype is None:
        return value, radius + unit * (value.abs() + radius), torch.zeros(value.shape, dtype=torch.bool,
                                                                           device=value.device)
    wide = radius * (1.0 + 2.0**-40) + value.abs() * 2.0**-52
    lo = round_on_device(value - wide, dtype)
    hi = round_on_device(value + wide, dtype)
    center = 0.5 * lo + 0.5 * hi
    half = 0.5 * hi - 0.5 * lo
    bad = ~torch.isfinite(half) & torch.isfinite(value)
    center = torch.where(bad, value, center)
    half = torch.where(bad, torch.full_like(half, float("inf")), half)
    return center, half, lo != hi


def _mode(dtype) -> int:
    """0 for ``None``; else the rounding of :func:`moeref.moe.device.round_on_device`: the same checks,
    the same error for a dtype it does not store."""
    if dtype is None:
        return 0
    from ...moe.pipeline import _dtype

    dt = _dtype(dtype)
    if dt == np.float64:
        return 1
    if dt == np.float32:
        return 2
    if dt.name == "bfloat16":
        return 3
    if dt == np.float16:
        return 4
    raise ValueError(f"the device engine stores float64, float32, bfloat16 or float16; got {dt}")


@functools.lru_cache(maxsize=None)
def _nan_image(device: str, mode: int) -> int | None:
    """The int64 bits ``round_on_device`` gives every NaN of :data:`_PROBE_NANS` on ``device`` when it gives
    them all one NaN; else None (a synchronizing probe, once per device and dtype)."""
    if mode == 0:
        return None
    from ...moe.device import round_on_device

    bits = torch.tensor(np.array(_PROBE_NANS, np.uint64).view(np.int64), device=device)
    out = set(round_on_device(bits.view(torch.float64), _NAMES[mode]).view(torch.int64).tolist())
    return out.pop() if len(out) == 1 else None


@functools.lru_cache(maxsize=64)
def _consts(device: str, unit: float, mode: int):
    """The kernel's float64 constants (the last: the probed NaN image's bits, 0 without one) and whether there is
    an image."""
    img = _nan_image(device, mode)
    nan_img = 0.0 if img is None else float(np.array([img], np.int64).view(np.float64)[0])  # its bits kept
    return float64_constants(device, unit, 1.0 + 2.0**-40, 2.0**-52, 0.5, np.inf, nan_img), img is not None


def store_interval_t(value, radius, dtype, unit: float = 0.0):
    """:func:`store_interval_torch` in one Triton pass: ``(center, half,
    flipped)``, the same bits. ``value``, ``radius``: float64 tensors of one shape on one device (made
    contiguous). Anything else (another dtype or shape, CPU tensors without ``TRITON_INTERPRET=1``) runs
    the torch function itself."""
    mode = _mode(dtype)
    if (not isinstance(value, torch.Tensor) or not isinstance(radius, torch.Tensor)
            or value.dtype != torch.float64 or radius.dtype != torch.float64 or value.shape != radius.shape
            or value.device != radius.device
            or (value.device.type == "cpu" and not triton_interpreted())):
        return store_interval_torch(value, radius, dtype, unit)
    v, r = value.contiguous(), radius.contiguous()
    flipped = torch.empty(v.shape, dtype=torch.bool, device=v.device)
    half = torch.empty_like(v)
    center = value if mode == 0 else torch.empty_like(v)  # None: ``value`` itself, as the torch function
    n = v.numel()
    if n:
        consts, nan_img = _consts(str(v.device), float(unit), mode)
        _store_kernel[(triton.cdiv(n, _BLOCK),)](v, r, consts, v if mode == 0 else center, half, flipped, n,
                                                 MODE=mode, NAN_IMG=nan_img, BLOCK=_BLOCK, num_warps=_WARPS,
                                                 enable_fp_fusion=False)
    return center, half, flipped
