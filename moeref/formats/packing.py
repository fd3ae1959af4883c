"""Packing of 4-bit codes: two per byte, and eight per int32.

Nibble order: element ``2i`` goes to the LOW nibble of byte ``i`` and element ``2i+1`` to the high
nibble. This is the ecosystem convention (torchao ``pack_uint4``, TransformerEngine's reference,
DeepGEMM, FlashInfer, vLLM ``break_fp4_bytes``). Two other orders exist and are NOT produced here:
the PTX instruction ``cvt.rn.satfinite.e2m1x2.f32 d, a, b`` puts its FIRST operand ``a`` in the
HIGH nibble (so kernels pass (odd, even) to get even-low bytes), and GGML's MXFP4 blocks use a
split order (element j low, element j+16 high within a 32-element block).

int32 packing (:func:`pack_int4_to_int32`): element ``8i + j`` occupies bits ``4j .. 4j+3`` of word
``i`` (the lowest nibble first), the order in which CUTLASS's W4A8 path in vLLM reads its int4
weights.
"""
from __future__ import annotations

import numpy as np

from .. import _interop

__all__ = ["pack_nibbles", "unpack_nibbles", "pack_int4_to_int32", "unpack_int4_from_int32"]


def _codes(x, name, bits=4):
    a = np.asarray(_interop.to_numpy(x))
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array of {bits}-bit codes; got {a.dtype}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= (1 << bits)):
        bad = (a < 0) | (a >= (1 << bits))
        idx = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad.ravel())[0]), a.shape))
        raise ValueError(f"{name}[{idx}] = {int(a[idx])} is not a {bits}-bit code (0..{(1 << bits) - 1})")
    return a


def pack_nibbles(codes, axis: int = -1) -> np.ndarray:
    """Pack 4-bit codes two per byte along ``axis``: ``[..., 2n] -> uint8[..., n]``, even element low.

    >>> pack_nibbles(np.array([1, 2, 15, 0], np.uint8)).tolist()
    [33, 15]
    """
    a = _codes(codes, "codes")
    a = np.moveaxis(a, axis, -1)
    if a.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({a.shape[-1]}) of 4-bit codes along axis {axis}; "
                         "pad to an even length first")
    a = a.astype(np.uint8)
    out = a[..., 0::2] | (a[..., 1::2] << 4)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))


def unpack_nibbles(packed, axis: int = -1) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: ``uint8[..., n] -> uint8[..., 2n]``.

    >>> unpack_nibbles(np.array([33, 15], np.uint8)).tolist()
    [1, 2, 15, 0]
    """
    p = np.asarray(_interop.to_numpy(packed))
    if p.dtype != np.uint8:
        if p.dtype == np.int8:
            p = p.view(np.uint8)
        else:
            raise TypeError(f"packed must be uint8 (or int8) bytes; got {p.dtype}")
    p = np.moveaxis(p, axis, -1)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return np.moveaxis(out, -1, axis)


def pack_int4_to_int32(codes, axis: int = -1) -> np.ndarray:
    """Pack 4-bit codes eight per int32 along ``axis`` (element 8i+j at bits 4j..4j+3).

    >>> hex(int(pack_int4_to_int32(np.arange(8, dtype=np.uint8))[0]))
    '0x76543210'
    """
    a = _codes(codes, "codes")
    a = np.moveaxis(a, axis, -1)
    if a.shape[-1] % 8:
        raise ValueError(f"cannot pack {a.shape[-1]} 4-bit codes eight per int32 along axis {axis}; "
                         "the length must be a multiple of 8")
    a = a.astype(np.uint32).reshape(a.shape[:-1] + (a.shape[-1] // 8, 8))
    words = np.zeros(a.shape[:-1], np.uint32)
    for j in range(8):  # eight nibble positions, not a loop over data
        words |= a[..., j] << np.uint32(4 * j)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def unpack_int4_from_int32(words, axis: int = -1) -> np.ndarray:
    """Inverse of :func:`pack_int4_to_int32`: ``int32[..., n] -> uint8[..., 8n]`` codes."""
    w = np.asarray(_interop.to_numpy(words))
    if w.dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
        raise TypeError(f"words must be int32 or uint32; got {w.dtype}")
    w = np.moveaxis(w.view(np.uint32), axis, -1)
    out = np.empty(w.shape + (8,), np.uint8)
    for j in range(8):
        out[..., j] = (w >> np.uint32(4 * j)) & 0xF
    out = out.reshape(w.shape[:-1] + (w.shape[-1] * 8,))
    return np.moveaxis(out, -1, axis)
