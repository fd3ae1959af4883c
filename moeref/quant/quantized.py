"""QuantizedTensor: element codes, block scales and the scheme that produced them, with the exact decode.

Decoding is exact: ``element_values`` (float64) times the broadcast ``scale_values`` (float64:
block scale x global factor x per-channel factor) is the exact real value of every element
(at most 4 + 24 + 24 significant bits, well inside float64's 53); ``dequantize`` rounds that to
the requested dtype (once, except bfloat16: see :meth:`QuantizedTensor.dequantize`). The
quantizers (:mod:`.blockwise`, :mod:`.tensor`, :mod:`.device`) build it; it imports none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import ml_dtypes

from ..formats import decode_table, unpack_nibbles
from .blocks import block_view, broadcast_to_blocks, expand_to_elements, grid_shape
from .scheme import Scheme

__all__ = ["QuantizedTensor", "scale_values"]

_SCALE_DTYPE = {"fp32": np.dtype(np.float32), "ue8m0": np.dtype(np.uint8), "ue4m3": np.dtype(np.uint8)}


def _frozen(a, dtype=None):
    """``a`` as a read-only C-contiguous array of ``dtype``: a copy, except where ``a`` is such an array already
    and read-only along its whole chain of NumPy bases (a QuantizedTensor's own array, an array that
    :meth:`moeref.checkpoint.SafetensorsCheckpoint.read_into` read), which nothing can write through NumPy: it is
    taken as it is."""
    if a is None:
        return None
    if isinstance(a, np.ndarray) and a.flags.c_contiguous and (dtype is None or a.dtype == np.dtype(dtype)):
        b = a
        while isinstance(b, np.ndarray) and not b.flags.writeable:
            b = b.base
        if not isinstance(b, np.ndarray):
            return a
    a = np.array(a, dtype=dtype, copy=True, order="C")
    a.setflags(write=False)
    return a


def scale_values(scheme: Scheme, scales: np.ndarray, global_scale: float | None = None,
                 channel_scales: np.ndarray | None = None) -> np.ndarray:
    """float64 decode multiplier per block of stored ``scales`` (grid shape): FP32 scales widened, UE8M0 and
    UE4M3 codes through their decode tables, times the global factor and the channel scales when given.
    What :meth:`QuantizedTensor.scale_values` returns; the device quantizer (:mod:`.device`) decodes its
    host scale step with it."""
    fmt = scheme.scale_format
    if fmt == "fp32":
        s = np.asarray(scales).astype(np.float64)
    else:
        s = decode_table("e8m0" if fmt == "ue8m0" else "ue4m3")[np.asarray(scales).astype(np.intp)]
    if global_scale is not None:
        s = s * global_scale
    if channel_scales is not None:
        s = s * np.asarray(channel_scales).astype(np.float64)
    return s


@lru_cache(maxsize=None)
def _pair_table(element: str, dtype_name: str) -> np.ndarray:
    """The (low, high) nibble values of every byte (even element low), one 2-element record
    per byte (a 256-entry table of complex128 / float64 items viewed back as pairs: a 1-D
    gather of records is 4x faster in NumPy than indexing a [256, 2] table)."""
    t = decode_table(element).astype(dtype_name)
    b = np.arange(256)
    pairs = np.ascontiguousarray(np.stack([t[b & 0xF], t[b >> 4]], axis=1))
    rec = {16: np.complex128, 8: np.uint64, 4: np.uint32, 2: np.uint16}[2 * pairs.itemsize]
    out = pairs.view(rec).ravel()
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A quantized tensor: element codes, block scales, and the scheme that produced them.

    Attributes:
        codes: ``uint8`` element codes of the logical shape; 4-bit formats are packed two per
            byte along the last axis (element ``2i`` in the low nibble; an odd last axis gets one
            zero nibble of padding), so the last axis has ``ceil(n / 2)`` bytes.
        scales: block scales on the grid ``leading axes + ceil(dim / block)`` per blocked axis:
            float32 decode scales (``scale_format="fp32"``) or ``uint8`` codes (UE8M0 biased
            exponent, UE4M3 bits).
        scheme: the :class:`~moeref.quant.scheme.Scheme`.
        shape: logical shape.
        global_scale: per-tensor DECODE factor multiplying every block scale (NVFP4's
            ``amax / (448 * 6)``), or None.
        channel_scales: float32 second-level decode scales (W4A8 per-output-channel), shaped
            like the scale grid with size 1 on the axes they do not vary along, or None.
        zero_points: integer zero points per block (asymmetric INT), grid-shaped int16, or None;
            element value = code - zero point.

    All arrays are read-only copies, except an array given read-only along its whole chain of NumPy bases
    (another QuantizedTensor's, one that :meth:`moeref.checkpoint.SafetensorsCheckpoint.read_into` read), which
    is kept as it is.
    """

    codes: np.ndarray
    scales: np.ndarray
    scheme: Scheme
    shape: tuple
    global_scale: float | None = None
    channel_scales: np.ndarray | None = None
    zero_points: np.ndarray | None = None

    def __post_init__(self):
        s = self.scheme
        if not isinstance(s, Scheme):
            raise TypeError(f"scheme must be a Scheme; got {type(s).__name__}")
        shape = tuple(int(d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        codes = np.asarray(self.codes)
        if codes.dtype != np.uint8:
            raise TypeError(f"codes must be uint8; got {codes.dtype}")
        want = shape[:-1] + ((shape[-1] + 1) // 2,) if s.packed else shape
        if codes.shape != want:
            raise ValueError(f"codes shape {codes.shape} does not match logical shape {shape} "
                             f"(expected {want} for {s.element})")
        scales = np.asarray(self.scales)
        if scales.dtype != _SCALE_DTYPE[s.scale_format]:
            raise TypeError(f"scales for scale_format {s.scale_format!r} must be "
                            f"{_SCALE_DTYPE[s.scale_format]}; got {scales.dtype}")
        g = grid_shape(shape, self.block_shape)
        if scales.shape != g:
            raise ValueError(f"scales shape {scales.shape} does not match the block grid {g} of "
                             f"shape {shape} with blocks {self.block_shape}")
        if self.global_scale is not None:
            object.__setattr__(self, "global_scale", float(self.global_scale))
        object.__setattr__(self, "codes", _frozen(codes))
        object.__setattr__(self, "scales", _frozen(scales))
        object.__setattr__(self, "channel_scales", _frozen(self.channel_scales, np.float32))
        object.__setattr__(self, "zero_points", _frozen(self.zero_points, np.int16))

    # ---- views --------------------------------------------------------------------------------
    @property
    def block_shape(self) -> tuple[int, ...]:
        """Block extents as ints for this tensor's blocked axes."""
        return self.scheme.resolve_block(self.shape)

    def element_codes(self) -> np.ndarray:
        """Unpacked element codes (``uint8``, logical shape)."""
        if not self.scheme.packed:
            return self.codes
        return unpack_nibbles(self.codes)[..., : self.shape[-1]]

    def element_values(self, dtype=np.float64) -> np.ndarray:
        """Decoded element values, zero point subtracted, logical shape. Exact (float32 too).

        Packed 4-bit codes decode a byte at a time (a 256 x 2 table of value pairs: the same
        values as unpacking, then one lookup per element, in half the gathers)."""
        if self.scheme.packed:
            pairs = _pair_table(self.scheme.element, np.dtype(dtype).name)
            v = pairs[self.codes].view(dtype).reshape(self.shape[:-1] + (2 * self.codes.shape[-1],))
            if v.shape[-1] != self.shape[-1]:
                v = np.ascontiguousarray(v[..., : self.shape[-1]])
        else:
            v = decode_table(self.scheme.element).astype(dtype)[self.codes]
        if self.zero_points is not None:
            v = v - expand_to_elements(self.zero_points.astype(dtype), self.block_shape, self.shape)
        return v

    def scale_values(self) -> np.ndarray:
        """float64 decode multiplier per block (grid shape), global and channel factors included
        (:func:`scale_values`)."""
        return scale_values(self.scheme, self.scales, self.global_scale, self.channel_scales)

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """``element_values * scale_values`` (exact in float64), rounded to ``dtype``.

        ``dtype``: float16, bfloat16 (ml_dtypes), float32 or float64. float16/float32/float64 are
        one rounding (round to nearest even) of the exact product. bfloat16 is what ml_dtypes'
        cast does, float64 -> float32 -> bfloat16: two roundings, which differ from one rounding
        only when the float32 result lands exactly on a bfloat16 midpoint (a product of up to
        4 + 24 + 24 significant bits). The Triton dequantize kernel reproduces this bit for bit.
        """
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
                         np.dtype(ml_dtypes.bfloat16)):
            raise ValueError(f"dtype must be float16, bfloat16, float32 or float64; got {dtype}")
        sv = self.scale_values()
        block = self.block_shape
        # float32 output from float32-exact scales: fl32(code * scale) is the exact product
        # rounded once, the same as rounding the float64 product; otherwise go through float64
        work = np.float64
        if dtype == np.float32:
            with np.errstate(over="ignore", invalid="ignore"):
                if np.array_equal(sv.astype(np.float32).astype(np.float64), sv, equal_nan=True):
                    work = np.float32
        vb = block_view(self.element_values(work), block)  # a new array: scaled in place
        with np.errstate(invalid="ignore", over="ignore"):
            out = np.multiply(vb, broadcast_to_blocks(sv.astype(work), len(block)), out=vb)
        k = len(block)
        padded = self.shape[: len(self.shape) - k] + tuple(
            n * b for n, b in zip(sv.shape[len(sv.shape) - k:], block))
        out = out.reshape(padded)[(...,) + tuple(slice(0, d) for d in self.shape[len(self.shape) - k:])]
        return np.ascontiguousarray(out.astype(dtype, copy=False))

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scales (+ channel scales, zero points, 4 for a global scale)."""
        n = self.codes.nbytes + self.scales.nbytes
        if self.channel_scales is not None:
            n += self.channel_scales.nbytes
        if self.zero_points is not None:
            n += self.zero_points.size * (1 if self.scheme.element_format.bits <= 8 else 2)
        if self.global_scale is not None:
            n += 4
        return n

    def __repr__(self) -> str:
        return (f"QuantizedTensor(scheme={self.scheme.name!r}, shape={self.shape}, "
                f"element={self.scheme.element}, block={self.block_shape}, "
                f"scale_format={self.scheme.scale_format!r}, preset={self.scheme.preset.name!r})")
