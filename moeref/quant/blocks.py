"""Block geometry of the blockwise quantizers: the scale grid's shape, the zero-padded block view, the
exact block amax and reductions, and the broadcast of a grid back over blocks or elements.

Shared by the blockwise engine (:mod:`.blockwise`), :class:`~moeref.quant.quantized.QuantizedTensor`'s
decode, the lossless search (:mod:`.lossless`) and the device quantizer (:mod:`.device`); it imports
nothing of theirs.
"""
from __future__ import annotations

import numpy as np

__all__ = ["grid_shape", "block_view", "block_amax", "block_reduce", "broadcast_to_blocks",
           "expand_to_elements"]


def grid_shape(shape, block) -> tuple[int, ...]:
    """Shape of the scale grid: leading axes, then ``ceil(dim / b)`` per blocked axis."""
    k = len(block)
    lead = tuple(shape[: len(shape) - k])
    return lead + tuple(-(-int(d) // b) for d, b in zip(shape[len(shape) - k:], block))


def block_view(x: np.ndarray, block, pad_value=0) -> np.ndarray:
    """``x`` zero-padded on its last ``len(block)`` axes and viewed as ``[..., n0, b0, n1, b1]``.

    A view (no copy) when every blocked extent is already a multiple of its block.
    """
    k = len(block)
    lead = x.shape[: x.ndim - k]
    tail = x.shape[x.ndim - k:]
    padded = tuple(-(-d // b) * b for d, b in zip(tail, block))
    if padded != tail:
        xp = np.full(lead + padded, pad_value, dtype=x.dtype)
        xp[(...,) + tuple(slice(0, d) for d in tail)] = x
        x = xp
    new = lead + tuple(v for d, b in zip(padded, block) for v in (d // b, b))
    return x.reshape(new)


def _block_axes(ndim_lead: int, k: int) -> tuple[int, ...]:
    return tuple(ndim_lead + 2 * i + 1 for i in range(k))


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def block_amax(xb: np.ndarray, k: int, ignore_nan: bool = False) -> np.ndarray:
    """``max |x|`` over the ``b`` axes of a block view, exactly, from the IEEE bit patterns.

    With the sign bit cleared, the unsigned order of float bit patterns is the order of
    magnitudes, and NaN patterns sort above Inf: the max of the masked bits is the amax, or a
    NaN when the block holds one (``np.max``/``torch.amax`` propagation). ``ignore_nan`` drops
    NaN patterns first (TE's ``fmaxf`` from 0). Works on the input dtype (bfloat16 amax is
    exact in bfloat16, as torchao takes it) and is several times faster than ``abs`` + ``max``.
    """
    axes = tuple(xb.ndim - 2 * k + 2 * i + 1 for i in range(k))
    u = _UINT[xb.dtype.itemsize]
    nbits = 8 * xb.dtype.itemsize
    bits = xb.view(u) & u((1 << (nbits - 1)) - 1)
    if ignore_nan:
        inf_bits = np.array(np.inf, xb.dtype).view(u)
        bits = np.where(bits > inf_bits, u(0), bits)
    return np.max(bits, axis=axes).view(xb.dtype)


def block_reduce(xb: np.ndarray, k: int, how: str) -> np.ndarray:
    """Reduce the ``b`` axes of a block view: signed ``"max"``/``"min"`` (NaN propagates), or
    ``"amax"`` / ``"amax_ignore_nan"`` (:func:`block_amax`)."""
    axes = tuple(xb.ndim - 2 * k + 2 * i + 1 for i in range(k))
    if how in ("amax", "amax_ignore_nan"):
        return block_amax(xb, k, ignore_nan=how == "amax_ignore_nan")
    if how == "max":
        return np.max(xb, axis=axes)
    if how == "min":
        return np.min(xb, axis=axes)
    raise ValueError(f"unknown reduction {how!r}; accepted: 'amax', 'amax_ignore_nan', 'max', 'min'")


def broadcast_to_blocks(grid: np.ndarray, k: int) -> np.ndarray:
    """Insert a size-1 axis after each blocked grid axis so ``grid`` broadcasts over a block view."""
    nl = grid.ndim - k
    shape = grid.shape[:nl] + tuple(v for n in grid.shape[nl:] for v in (n, 1))
    return grid.reshape(shape)


def expand_to_elements(grid: np.ndarray, block, shape) -> np.ndarray:
    """Per-element copy of a block-grid array for a tensor of ``shape`` (cropped to ``shape``)."""
    k = len(block)
    out = grid
    nl = grid.ndim - k
    for i, b in enumerate(block):
        out = np.repeat(out, b, axis=nl + i)
    return out[(...,) + tuple(slice(0, d) for d in shape[len(shape) - k:])]
