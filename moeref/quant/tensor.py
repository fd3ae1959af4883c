"""QuantizedTensor (codes + scales + scheme), and quantize / dequantize / requantize.

Decoding is exact: ``element_values`` (float64) times the broadcast ``scale_values`` (float64:
block scale x global factor x per-channel factor) is the exact real value of every element
(at most 4 + 24 + 24 significant bits, well inside float64's 53); ``dequantize`` rounds that to
the requested dtype (once, except bfloat16: see :meth:`QuantizedTensor.dequantize`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import ml_dtypes

from ..formats import decode_table, encode, unpack_nibbles
from .blockwise import (block_amax, block_view, broadcast_to_blocks, expand_to_elements, grid_shape,
                        quantize_blockwise)
from .scheme import Scheme, _check_static_scale

__all__ = [
    "QuantizedTensor",
    "RequantReport",
    "quantize",
    "dequantize",
    "requantize",
    "QUANTIZERS",
    "register_quantizer",
]

_SCALE_DTYPE = {"fp32": np.dtype(np.float32), "ue8m0": np.dtype(np.uint8), "ue4m3": np.dtype(np.uint8)}


def _frozen(a, dtype=None):
    if a is None:
        return None
    a = np.array(a, dtype=dtype, copy=True, order="C")
    a.setflags(write=False)
    return a


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

    All arrays are copies, set read-only.
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
        """Decoded element values, zero point subtracted, logical shape. Exact (float32 too)."""
        table = decode_table(self.scheme.element).astype(dtype)
        v = table[self.element_codes()]
        if self.zero_points is not None:
            v = v - expand_to_elements(self.zero_points.astype(dtype), self.block_shape, self.shape)
        return v

    def scale_values(self) -> np.ndarray:
        """float64 decode multiplier per block (grid shape), global and channel factors included."""
        fmt = self.scheme.scale_format
        if fmt == "fp32":
            s = self.scales.astype(np.float64)
        else:
            s = decode_table("e8m0" if fmt == "ue8m0" else "ue4m3")[self.scales.astype(np.intp)]
        if self.global_scale is not None:
            s = s * self.global_scale
        if self.channel_scales is not None:
            s = s * self.channel_scales.astype(np.float64)
        return s

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
        vb = block_view(self.element_values(work), block)
        with np.errstate(invalid="ignore", over="ignore"):
            out = vb * broadcast_to_blocks(sv.astype(work), len(block))
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


# ---- quantize dispatch -------------------------------------------------------------------------

QUANTIZERS: dict[str, Callable] = {}


def register_quantizer(family: str, fn: Callable) -> Callable:
    """Register ``fn(x, scheme, **static) -> QuantizedTensor`` for ``Scheme.family == family``."""
    QUANTIZERS[family] = fn
    return fn


def _quantize_blockwise_family(x, scheme: Scheme, scale=None):
    static = scheme.static_scale if scale is None else _check_static_scale(scale, scheme.scale_format, "scale")
    return quantize_blockwise(x, scheme, static_scale=static,
                              need_minmax=scheme.preset.fp32_rule == "signed_minmax")


register_quantizer("blockwise", _quantize_blockwise_family)


def quantize(x, scheme: Scheme, **static) -> QuantizedTensor:
    """Quantize ``x`` (NumPy/ml_dtypes/torch CPU float array, any leading shape) with ``scheme``.

    ``static``: ``scale=`` a fixed positive decode scale (per-tensor static FP8; a power of two
    for UE8M0), overriding ``scheme.static_scale``.

    >>> from moeref.quant import fp8_group
    >>> q = quantize(np.array([[1.0, -2.0, 448.0, 0.0]], np.float32), fp8_group(2))
    >>> q.scales.tolist(), q.dequantize().tolist()
    ([[0.004464285913854837, 1.0]], [[1.0, -2.0, 448.0, 0.0]])
    """
    if not isinstance(scheme, Scheme):
        raise TypeError(f"scheme must be a Scheme (see moeref.quant.SCHEMES); got {type(scheme).__name__}")
    fn = QUANTIZERS.get(scheme.family)
    if fn is None:
        raise ValueError(f"no quantizer registered for family {scheme.family!r} "
                         f"(registered: {', '.join(QUANTIZERS)})")
    return fn(x, scheme, **static)


def dequantize(q: QuantizedTensor, dtype=np.float32) -> np.ndarray:
    """``q.dequantize(dtype)``."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor; got {type(q).__name__}")
    return q.dequantize(dtype)


# ---- requantize --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequantReport:
    """How faithful a requantization was.

    Attributes:
        lossless: every element decodes to exactly the source value (NaN to NaN).
        max_abs_error: max |target - source| over finite elements (0.0 when lossless).
        error: per-element exact error ``target - source`` (float64, logical shape; 0 where
            both are NaN, NaN where only one is).
        method: ``"rule"`` (the target scheme's scale rule on the exact source values) or
            ``"exact_rescale"`` (each target block takes its source block's decode scale,
            re-expressed in the target scale format, and the data are re-encoded with it).
    """

    lossless: bool
    max_abs_error: float
    error: np.ndarray = field(repr=False)
    method: str


def _report(target: QuantizedTensor, x: np.ndarray, method: str) -> RequantReport:
    y = target.dequantize(np.float64)
    with np.errstate(invalid="ignore"):
        err = y - x
    both_nan = np.isnan(x) & np.isnan(y)
    err = np.where(both_nan, 0.0, err)
    same_inf = np.isinf(x) & (x == y)
    err = np.where(same_inf, 0.0, err)
    lossless = bool(np.all(err == 0))
    fin = np.isfinite(err)
    mx = float(np.max(np.abs(err[fin]))) if fin.any() else 0.0
    err.setflags(write=False)
    return RequantReport(lossless=lossless, max_abs_error=mx, error=err, method=method)


def requantize(q: QuantizedTensor, target: Scheme, *, prefer_exact: bool = True):
    """Convert ``q`` to ``target`` by requantizing the DATA: exact dequantization, then quantization.

    Rounding a scale without re-encoding the data shipped two silently wrong checkpoints
    (huggingface/transformers#47030, sgl-project/sglang PR #28307; notes §5); this never does
    that. The target's rule runs on the exact source values (float32 input when every value is a
    float32, so the anchors' float32 arithmetic applies; float64 otherwise). When that is lossy
    and ``prefer_exact``, a second candidate keeps each source block's decode scale (target
    blocks nested in source blocks, scale exactly representable in the target scale format,
    with a power-of-two global factor for UE4M3) and re-encodes the data with it; it is used
    only if it is exact (an all-zero block takes any scale). MXFP4 -> NVFP4 is lossless this way
    whenever the exponents of the nonzero blocks span at most 17 binades (UE4M3 holds
    2^-9 .. 2^8).

    Returns:
        ``(QuantizedTensor, RequantReport)``.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor; got {type(q).__name__}")
    if not isinstance(target, Scheme):
        raise TypeError(f"target must be a Scheme; got {type(target).__name__}")
    x = q.dequantize(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        x32 = x.astype(np.float32)
        exact32 = np.array_equal(x32.astype(np.float64), x, equal_nan=True)
    first = quantize(x32 if exact32 else x, target)
    rep = _report(first, x, "rule")
    if rep.lossless or not prefer_exact:
        return first, rep
    alt = _exact_rescale(q, x, target)
    if alt is not None:
        rep2 = _report(alt, x, "exact_rescale")
        if rep2.lossless:
            return alt, rep2
    return first, rep


def _exact_rescale(q: QuantizedTensor, x: np.ndarray, target: Scheme):
    """Candidate for :func:`requantize` that reuses the source block scales (None if impossible)."""
    if target.family not in ("blockwise", "nvfp4") or target.zero_point or target.channel_block:
        return None
    try:
        tb = target.resolve_block(q.shape)
    except ValueError:
        return None
    sb = q.block_shape
    kk = max(len(tb), len(sb))
    tb = (1,) * (kk - len(tb)) + tuple(tb)  # unblocked leading axes are blocks of 1
    sb = (1,) * (kk - len(sb)) + tuple(sb)
    if any(s % t for s, t in zip(sb, tb)):
        return None  # a target block would straddle two source blocks
    cand = q.scale_values()  # grid ndim == tensor ndim for every scheme
    nl = len(q.shape) - kk
    for i in range(kk):
        n_t = -(-q.shape[nl + i] // tb[i])
        idx = (np.arange(n_t) * tb[i]) // sb[i]
        cand = np.take(cand, idx, axis=nl + i)
    # an all-zero target block decodes to zeros under any scale: give it the largest live one
    tblock = target.resolve_block(q.shape)
    with np.errstate(invalid="ignore"):
        zero_blk = block_amax(block_view(x, tblock), len(tblock)) == 0
    live = ~zero_blk
    if live.any():
        cand = np.where(zero_blk, np.max(np.where(live, cand, -np.inf)), cand)
    else:
        cand = np.ones_like(cand)
    if not np.all(np.isfinite(cand)) or np.any(cand <= 0):
        return None
    fmt = target.scale_format
    glob = None
    if fmt == "fp32":
        stored = cand.astype(np.float32)
        if not np.array_equal(stored.astype(np.float64), cand):
            return None
        per_block = cand
    else:
        name = "e8m0" if fmt == "ue8m0" else "ue4m3"
        base = cand
        if target.global_scale:
            top = float(cand.max())
            m, e = np.frexp(top)
            glob = float(np.ldexp(1.0, int(e) - 1 - 8)) if m == 0.5 else top / 448.0
            base = cand / glob
        stored = encode(base, name, overflow="saturate", rounding="rne")
        if not np.array_equal(decode_table(name)[stored] * (glob or 1.0), cand):
            return None
        per_block = cand
    sv = expand_to_elements(per_block, target.resolve_block(q.shape), q.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = x / sv
    from .blockwise import encode_elements
    el = target.element_format
    try:
        codes = encode_elements(y, el, target.preset)
    except ValueError:
        return None
    from ..formats import pack_nibbles
    if el.bits == 4:
        if q.shape[-1] % 2:
            codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
        codes = pack_nibbles(codes)
    return QuantizedTensor(codes=codes, scales=stored, scheme=target, shape=q.shape, global_scale=glob)
