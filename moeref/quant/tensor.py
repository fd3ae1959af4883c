"""QuantizedTensor (codes + scales + scheme), and quantize / dequantize / requantize.

Decoding is exact: ``element_values`` (float64) times the broadcast ``scale_values`` (float64:
block scale x global factor x per-channel factor) is the exact real value of every element
(at most 4 + 24 + 24 significant bits, well inside float64's 53); ``dequantize`` rounds that to
the requested dtype (once, except bfloat16: see :meth:`QuantizedTensor.dequantize`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
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
    "PRECISIONS",
    "quantize_and_report",
]

_SCALE_DTYPE = {"fp32": np.dtype(np.float32), "ue8m0": np.dtype(np.uint8), "ue4m3": np.dtype(np.uint8)}


def _frozen(a, dtype=None):
    if a is None:
        return None
    a = np.array(a, dtype=dtype, copy=True, order="C")
    a.setflags(write=False)
    return a


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
    """How faithful a requantization was (every figure against the EXACT source values).

    Attributes:
        lossless: every element decodes to exactly the source value (NaN to NaN).
        max_abs_error: max |target - source| over finite elements (0.0 when lossless).
        error: per-element exact error ``target - source`` (float64, logical shape; 0 where
            both are NaN, NaN where only one is).
        method: ``"rule"`` (the target scheme's scale rule on the source values),
            ``"exact_rescale"`` (each target block takes its source block's decode scale,
            re-expressed in the target scale format, and the data are re-encoded with it) or
            ``"lossless_search"`` (:func:`moeref.quant.lossless.find_lossless` found scales that
            make every element exact).
        rel_l2: ``||error||_2 / ||source||_2`` over finite elements (0.0 for a zero source).
        sqnr_db: ``10 log10(||source||^2 / ||error||^2)`` (``inf`` when lossless).
        worst_block: index (on the target's block grid) of the block holding the first element
            (C order) of largest |error|, i.e. a block with the largest max |error|; None when
            lossless.
        precision: ``"exact"`` or ``"float32"`` (see :func:`requantize`).
    """

    lossless: bool
    max_abs_error: float
    error: np.ndarray = field(repr=False)
    method: str
    rel_l2: float = 0.0
    sqnr_db: float = float("inf")
    worst_block: tuple | None = None
    precision: str = "exact"


def _report(target: QuantizedTensor, x: np.ndarray, method: str, precision: str = "exact") -> RequantReport:
    err = target.dequantize(np.float64)  # y, then y - x in place
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(err, x, out=err)
        xf = x.reshape(-1)
        x2 = float(np.dot(xf, xf))
        e2 = float(np.dot(err.reshape(-1), err.reshape(-1)))
    allfin = np.isfinite(x2) and np.isfinite(e2)  # a NaN/Inf anywhere makes a sum non-finite
    if not allfin:
        y = err + x
        both_nan = np.isnan(x) & np.isnan(y)
        err = np.where(both_nan | (np.isinf(x) & (x == y)), 0.0, err)
        fin = np.isfinite(err)
        ef, xf = err[fin], np.where(fin, x, 0.0)[fin]
        e2, x2 = float(np.dot(ef, ef)), float(np.dot(xf, xf))
    lossless = not np.any(err)  # NaN counts as an error
    mx, rel, sqnr, worst = 0.0, 0.0, float("inf"), None
    if not lossless:
        ef = err if allfin else np.where(np.isfinite(err), err, 0.0)
        hi, lo = float(ef.max()), float(ef.min())
        mx = max(hi, -lo)
        flat = int(np.argmax(ef)) if hi >= -lo else int(np.argmin(ef))  # first largest |err|
        pos = np.unravel_index(flat, ef.shape)
        block = target.block_shape
        nl = ef.ndim - len(block)
        worst = tuple(int(p) for p in pos[:nl]) + tuple(
            int(p) // b for p, b in zip(pos[nl:], block))
        rel = float(np.sqrt(e2 / x2)) if x2 > 0 else float("inf")
        sqnr = float(10 * np.log10(x2 / e2)) if e2 > 0 and x2 > 0 else float("inf")
    err.setflags(write=False)
    return RequantReport(lossless=bool(lossless), max_abs_error=mx, error=err, method=method,
                         rel_l2=rel, sqnr_db=sqnr, worst_block=worst, precision=precision)


PRECISIONS = ("exact", "float32")


def requantize(q: QuantizedTensor, target: Scheme, *, prefer_exact: bool = True,
               precision: str = "exact", quantizer: Callable | None = None, global_scale=None):
    """Convert ``q`` to ``target`` by requantizing the DATA: exact dequantization, then quantization.

    Rounding a scale without re-encoding the data shipped two silently wrong checkpoints
    (huggingface/transformers#47030, sgl-project/sglang PR #28307); this never does
    that. ``precision`` says what the target's rule runs on:

    * ``"exact"`` (default): the exact source values, as float32 when every value is a float32
      (so the anchors' float32 arithmetic applies), float64 otherwise.
    * ``"float32"``: the source dequantized to float32 (one RNE rounding of the exact product),
      which is what the producing libraries do before they requantize a checkpoint: vLLM
      ``requant_weight_ue8m0`` (``weight.float() * scale``), DeepSeek ``fp8_cast_bf16.py``,
      compressed-tensors ``FP8BlockDequantizer``. Identical to ``"exact"`` whenever the source
      values are float32 (MX, UE8M0 and power-of-two scales; FP8 with FP32 scales usually not).

    The report always measures against the exact source values. When the rule's result is lossy
    and ``prefer_exact``, two further candidates are tried and used only if exact: the source
    block scales re-expressed in the target (target blocks nested in source blocks; MXFP4 ->
    NVFP4 is lossless this way whenever the exponents of the nonzero blocks span at most 17
    binades, UE4M3 holds 2^-9 .. 2^8), then :func:`moeref.quant.lossless.find_lossless`, which
    finds a lossless encoding whenever the target can hold the values (its docstring says how).

    ``quantizer(values, target) -> QuantizedTensor`` replaces :func:`quantize` for the rule step
    (the checkpoint converter passes the Triton fast path there, which is bit-identical).

    ``global_scale`` (NVFP4 targets): a static global scale in the target preset's convention
    (:func:`moeref.quant.nvfp4.quantize_nvfp4`), given to the rule; the lossless candidates then
    keep the global factor the rule used, so tensors that must share one (ModelOpt's fused
    gate/up and q/k/v) still do.

    Returns:
        ``(QuantizedTensor, RequantReport)``.
    """
    from .._checks import check_choice

    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor; got {type(q).__name__}")
    if not isinstance(target, Scheme):
        raise TypeError(f"target must be a Scheme; got {type(target).__name__}")
    check_choice(precision, PRECISIONS, "requantize precision")
    x = q.dequantize(np.float64)
    if precision == "float32":
        with np.errstate(invalid="ignore", over="ignore"):
            src = x.astype(np.float32)  # one RNE rounding of the exact value = dequantize(float32)
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            x32 = x.astype(np.float32)
            src = x32 if np.array_equal(x32.astype(np.float64), x, equal_nan=True) else x
    return _requantize_values(x, src, target, q, prefer_exact, precision, quantizer, global_scale)


def quantize_and_report(x, target: Scheme, *, prefer_exact: bool = True,
                        quantizer: Callable | None = None, global_scale=None):
    """Quantize float values ``x`` (float16/bfloat16/float32/float64) with ``target`` and report
    against ``x`` exactly, as :func:`requantize` does for a quantized source (same report, same
    lossless search). Returns ``(QuantizedTensor, RequantReport)``."""
    from .blockwise import as_input

    xa = as_input(x)
    src = xa if xa.dtype in (np.float32, np.float64) else xa.astype(np.float32)
    return _requantize_values(xa.astype(np.float64), src, target, None, prefer_exact, "exact",
                              quantizer, global_scale)


def _requantize_values(x, src, target, q, prefer_exact, precision, quantizer, global_scale=None):
    from .lossless import find_lossless, sample_blocks_representable

    if global_scale is not None:
        if target.family != "nvfp4":
            raise ValueError(f"global_scale is for NVFP4 targets; got scheme {target.name!r}")
        first = (quantizer or quantize)(src, target, global_scale=global_scale)
    else:
        first = (quantizer or quantize)(src, target)
    fixed = first.global_scale if global_scale is not None else None
    rep = _report(first, x, "rule", precision)
    if rep.lossless or not prefer_exact:
        return first, rep
    if not sample_blocks_representable(x, target):
        return first, rep  # a few blocks already have no exact encoding: neither candidate can be
    alt = _exact_rescale(q, x, target, fixed) if q is not None else None
    if alt is not None:
        rep2 = _report(alt, x, "exact_rescale", precision)
        if rep2.lossless:
            return alt, rep2
    alt = find_lossless(x, target, fixed)
    if alt is not None:
        rep3 = _report(alt, x, "lossless_search", precision)
        if rep3.lossless:
            return alt, rep3
    return first, rep


def _exact_rescale(q: QuantizedTensor, x: np.ndarray, target: Scheme, fixed_global=None):
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
        if target.global_scale and fixed_global is not None:
            glob = float(fixed_global)
            if glob <= 0:
                return None
            base = cand / glob
        elif target.global_scale:
            top = float(cand.max())
            m, e = np.frexp(top)
            glob = float(np.ldexp(1.0, int(e) - 1 - 8)) if m == 0.5 else top / 448.0
            from .lossless import global_storable
            if not global_storable(glob, target):
                return None
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
