"""The 128x4 scale-factor swizzle read by cuBLAS / CUTLASS SM100 block-scaled GEMMs.

Used for MXFP8 / MXFP4 (E8M0 scales) and NVFP4 (E4M3 scales) on Blackwell; the same bytes are
produced by torchao ``to_blocked``, FlashInfer ``get_sf_out_offset_128x4`` / ``swizzle_sf``, vLLM
``nvfp4_utils.cuh`` and TransformerEngine.

A scale matrix ``[rows, cols]`` (rows = M or N, cols = K / block) is padded to
``[roundup(rows, 128), roundup(cols, 4)]`` and cut into 128x4 tiles of 512 bytes; tiles are stored
row-block-major. The byte of logical scale ``(r, c)`` lands at::

    (r // 128) * ceil(cols / 4) * 512      # row block
  + (c // 4) * 512                          # column block (tile)
  + (r % 32) * 16                           # row inside a 32-row slab
  + ((r % 128) // 32) * 4                   # which of the four 32-row slabs
  + c % 4                                   # column inside the tile

Padding contract: every padding byte is **zero** (torchao pads with zeros; TE zero-fills since PR
#2924; vLLM PR #45739 / #31097 and FlashInfer PR #2025 fixed buffers left uninitialised, and TE PR
#3070 saw NaN loss from garbage E8M0 padding that the GEMM consumed). :func:`check_swizzle_padding`
reports violations.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_choice, check_positive_int
from ._common import align, as_array, as_byte_codes, check_min_ndim

__all__ = [
    "SWIZZLE_ROWS",
    "SWIZZLE_COLS",
    "swizzled_shape_128x4",
    "swizzle_128x4",
    "unswizzle_128x4",
    "swizzle_128x4_offsets",
    "check_swizzle_padding",
    "SwizzlePaddingReport",
]

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4
_OUT_FORMS = ("flat", "2d")


def swizzled_shape_128x4(rows: int, cols: int) -> tuple[int, int]:
    """Padded logical shape ``(roundup(rows, 128), roundup(cols, 4))``.

    >>> swizzled_shape_128x4(200, 6)
    (256, 8)
    """
    rows = check_positive_int(rows, "rows", allow_zero=True)
    cols = check_positive_int(cols, "cols", allow_zero=True)
    return align(rows, SWIZZLE_ROWS), align(cols, SWIZZLE_COLS)


def _tiles_forward(padded: np.ndarray) -> np.ndarray:
    """``[..., R, C]`` (R % 128 == 0, C % 4 == 0) -> ``[..., R*C]`` in swizzled order.

    Row ``r = rb*128 + q*32 + i`` and column ``c = cb*4 + j`` go to position ``(rb, cb, i, q, j)``:
    the TransformerEngine statement ``view(R/128, 4, 32, C/4, 4).permute(0, 3, 2, 1, 4)``.
    """
    *lead, R, C = padded.shape
    nd = len(lead)
    t = padded.reshape(*lead, R // 128, 4, 32, C // 4, 4)
    perm = (*range(nd), nd + 0, nd + 3, nd + 2, nd + 1, nd + 4)
    return t.transpose(perm).reshape(*lead, R * C)


def _tiles_inverse(flat: np.ndarray, R: int, C: int) -> np.ndarray:
    """Inverse of :func:`_tiles_forward`: ``[..., R*C]`` -> ``[..., R, C]`` (padded logical)."""
    *lead, _ = flat.shape
    nd = len(lead)
    t = flat.reshape(*lead, R // 128, C // 4, 32, 4, 4)  # (rb, cb, i, q, j)
    perm = (*range(nd), nd + 0, nd + 3, nd + 2, nd + 1, nd + 4)  # -> (rb, q, i, cb, j)
    return t.transpose(perm).reshape(*lead, R, C)


def swizzle_128x4(scales, *, out: str = "flat") -> np.ndarray:
    """Swizzle 1-byte scales ``[..., rows, cols]`` into the 128x4 layout.

    Args:
        scales: any 1-byte dtype (uint8 E8M0 codes, ``float8_e8m0fnu``, ``float8_e4m3fn`` NVFP4 scales,
            int8); leading axes (experts) are kept and swizzled independently.
        out: ``"flat"`` -> ``[..., roundup(rows,128) * roundup(cols,4)]`` (torchao ``to_blocked``);
            ``"2d"`` -> the same bytes viewed as ``[..., roundup(rows,128), roundup(cols,4)]``
            (FlashInfer / vLLM allocate the buffer with that shape; it is NOT the padded logical matrix).

    Returns:
        A new C-contiguous array with the input's dtype; padding bytes are 0x00.

    >>> import numpy as np
    >>> s = np.arange(1, 9, dtype=np.uint8).reshape(2, 4)
    >>> b = swizzle_128x4(s)
    >>> b.shape, b[:4].tolist(), b[16:20].tolist(), int(b[20:].sum())
    ((512,), [1, 2, 3, 4], [5, 6, 7, 8], 0)
    """
    check_choice(out, _OUT_FORMS, "out")
    src = as_array(scales, "scales")
    codes = as_byte_codes(src, "scales")
    check_min_ndim(codes, 2, "scales", "[..., rows, cols]")
    *lead, rows, cols = codes.shape
    R, C = swizzled_shape_128x4(rows, cols)
    padded = np.zeros((*lead, R, C), dtype=np.uint8)
    padded[..., :rows, :cols] = codes
    flat = _tiles_forward(padded)
    if out == "2d":
        flat = flat.reshape(*lead, R, C)
    return flat.view(src.dtype)


def _buffer_as_flat(buf, rows: int, cols: int) -> tuple[np.ndarray, np.dtype, int, int]:
    b = as_array(buf, "buf")
    dtype = b.dtype
    codes = as_byte_codes(b, "buf")
    R, C = swizzled_shape_128x4(rows, cols)
    if codes.ndim >= 2 and codes.shape[-2:] == (R, C):
        flat = codes.reshape(*codes.shape[:-2], R * C)
    elif codes.ndim >= 1 and codes.shape[-1] == R * C:
        flat = codes
    else:
        raise ValueError(
            f"buf must have shape [..., {R * C}] (flat) or [..., {R}, {C}] (2d) for rows={rows}, "
            f"cols={cols}; got {codes.shape}"
        )
    return flat, dtype, R, C


def unswizzle_128x4(buf, rows: int, cols: int) -> np.ndarray:
    """Inverse of :func:`swizzle_128x4`: swizzled bytes -> logical ``[..., rows, cols]`` (input dtype).

    ``buf`` may be flat ``[..., R*C]`` or 2d ``[..., R, C]`` with ``R, C = swizzled_shape_128x4(rows,
    cols)``; the two readings cannot collide because ``R >= 128``. Padding is dropped without
    checking; use :func:`check_swizzle_padding` for the contract.

    >>> import numpy as np
    >>> s = np.arange(1, 9, dtype=np.uint8).reshape(2, 4)
    >>> unswizzle_128x4(swizzle_128x4(s, out="2d"), 2, 4).tolist()
    [[1, 2, 3, 4], [5, 6, 7, 8]]
    """
    flat, dtype, R, C = _buffer_as_flat(buf, rows, cols)
    logical = _tiles_inverse(flat, R, C)[..., :rows, :cols]
    return np.ascontiguousarray(logical).view(dtype)


def swizzle_128x4_offsets(rows: int, cols: int) -> np.ndarray:
    """Byte offset of every padded logical position: int64 ``[roundup(rows,128), roundup(cols,4)]``.

    ``offsets[r, c]`` is where :func:`swizzle_128x4` puts scale ``(r, c)`` (computed by the same
    permutation applied to ``arange``; useful to draw or audit the layout).

    >>> swizzle_128x4_offsets(200, 6)[[0, 1, 32, 127, 128, 199], [0, 0, 0, 3, 5, 5]].tolist()
    [0, 16, 4, 511, 1537, 1657]
    """
    R, C = swizzled_shape_128x4(rows, cols)
    flat = np.arange(R * C, dtype=np.int64)
    offsets = np.empty(R * C, dtype=np.int64)
    offsets[_tiles_forward(flat.reshape(R, C))] = flat
    return offsets.reshape(R, C)


@dataclass(frozen=True)
class SwizzlePaddingReport:
    """Nonzero padding bytes found in a 128x4-swizzled buffer.

    ``positions`` is int64 ``[count, ndim]``: (leading indices..., padded row, padded col) of each
    nonzero padding byte, C order; ``offsets`` the byte offsets inside each flat buffer; ``values`` the
    bytes. ``ok`` is True when there are none.
    """

    rows: int
    cols: int
    positions: np.ndarray
    offsets: np.ndarray
    values: np.ndarray

    @property
    def count(self) -> int:
        return int(self.values.size)

    @property
    def ok(self) -> bool:
        return self.count == 0

    def __str__(self) -> str:
        if self.ok:
            return f"128x4 swizzle padding OK (rows={self.rows}, cols={self.cols})"
        first = ", ".join(
            f"{tuple(int(v) for v in p)}@{int(o)}={int(b):#04x}"
            for p, o, b in zip(self.positions[:4], self.offsets[:4], self.values[:4])
        )
        return (
            f"{self.count} nonzero padding byte(s) in 128x4 swizzle (rows={self.rows}, cols={self.cols}); "
            f"first (index@offset=byte): {first}"
        )


def check_swizzle_padding(buf, rows: int, cols: int) -> SwizzlePaddingReport:
    """Report every padding byte of a 128x4-swizzled buffer that is not zero.

    Padding is every padded logical position with ``r >= rows`` or ``c >= cols``. GEMMs that read
    the padded rows/cols (TE PR #3070) turn garbage there into NaN; the contract is zero.

    >>> import numpy as np
    >>> b = swizzle_128x4(np.ones((3, 2), np.uint8))
    >>> check_swizzle_padding(b, 3, 2).ok
    True
    >>> b[2] = 0x7F  # (r=0, c=2) is column padding
    >>> print(check_swizzle_padding(b, 3, 2))
    1 nonzero padding byte(s) in 128x4 swizzle (rows=3, cols=2); first (index@offset=byte): (0, 2)@2=0x7f
    """
    flat, _, R, C = _buffer_as_flat(buf, rows, cols)
    logical = _tiles_inverse(flat, R, C)
    pad = np.ones((R, C), dtype=bool)
    pad[:rows, :cols] = False
    mask = (logical != 0) & pad
    positions = np.argwhere(mask)
    offsets = swizzle_128x4_offsets(rows, cols)[positions[:, -2], positions[:, -1]]
    return SwizzlePaddingReport(rows, cols, positions, offsets, logical[mask])
