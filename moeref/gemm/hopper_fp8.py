"""Bit-level emulation of Hopper's FP8 tensor-core accumulation and of DeepGEMM's FP8 grouped GEMM.

A Hopper FP8 ``wgmma`` (``QGMMA`` in SASS) computes ``D = A·B + C`` with E4M3 ``A``, ``B`` and an FP32
``C``/``D`` accumulator, but it does not add in IEEE FP32. The model here, parameterised by
:class:`MmaModel` (calibrated against an H100/H200 by ``bench/studies/calibrate_hopper_fp8.py``; the
measured parameters and their evidence are in docs/hopper-fp8-accumulation.md), is the multi-term
fused adder of Fasi, Higham, Mikaitis and Pranesh (*Numerical behavior of NVIDIA tensor cores*,
PeerJ CS 2021) and of Khattak and Mikaitis (*Accurate models of NVIDIA tensor cores*, arXiv
2512.07004), with the FP8 facts reported by DeepSeek (DeepSeek-V3 technical report §3.3.2: "aligning
32 mantissa products by right-shifting based on the maximum exponent ... only uses the highest 14
bits of each mantissa product ... truncates bits exceeding this range") and SageAttention2 (an FP8
MMA returns ``C`` with its 10 low significand bits cut when ``A = B = 0``):

* every product of two E4M3 values is exact (8 significant bits);
* K is consumed in groups of ``group`` products; a group's addends are its products and (after the
  first group, or when a ``C`` is given) the incoming accumulator;
* every addend is aligned to the exponent ``e = floor(log2 max|addend|)`` of the largest one and cut
  to the grid ``2^(e - align_bits)`` (``align_rounding``: ``"trunc"`` toward zero, ``"floor"``
  toward -inf, the two's-complement "sign-fill right shift");
* the aligned addends are summed exactly and the sum is normalised to ``norm_bits`` significant bits
  (``norm_rounding``: ``"trunc"`` toward zero or ``"nearest"`` even); that is the new accumulator.

DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` on sm90 (``sm90_fp8_gemm_1d2d.cuh`` of DeepGEMM;
``deepinfer-gemm`` 2.8.2 here) runs, per 128-column K block, ``BLOCK_K / 32 = 4`` wgmma of K = 32
into a cleared accumulator (the first wgmma's scale-d is 0), then promotes on the CUDA cores::

    scale = sa[m, kb] * sb[n // 128, kb]          (FP32 multiply, round to nearest)
    final[m, n] += scale * acc                    (contracted to one FP32 FMA by nvcc)

from ``final = 0`` in K order, and stores ``__float22bfloat162_rn(final)`` (bf16, round to nearest
even). Our FP8 block grouped GEMMs (:mod:`fastpath.grouped_gemm`: the Triton and Gluon kernels) promote the
same way, ``final = fma(acc, fl(sa * sb), final)`` (``promotion="deepgemm"``). The other orders of
:func:`promote` (``"a_then_b"``: ``fma(fl(acc * sa), sb, final)``; ``"separate"``) model kernels that scale
differently.

Everything is float64 arithmetic that is exact: aligned addends are integers times a power of two of
at most ``align_bits + 1 + log2(group + 1)`` bits; FP32 multiply-adds are rounded once through an
error-free sum and round-to-odd (:func:`fp32_fma`). Vectorised over output elements; loops run over
K groups only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MmaModel", "HOPPER_FP8_MMA", "mma_accumulate", "operand_exponents", "round_significand", "fp32_fma",
           "deepgemm_block_accumulators", "promote", "deepgemm_fp8_gemm", "deepgemm_grouped_contiguous",
           "deepgemm_engine"]

_ROUNDINGS = ("trunc", "floor", "nearest")


@dataclass(frozen=True)
class MmaModel:
    """One tensor-core MMA's fused accumulation (see the module docstring).

    Attributes:
        group: products added at once by one fused multi-term adder (divides ``inst_k``).
        align_bits: fraction bits kept below the leading bit of the largest addend.
        align_rounding: ``"trunc"`` (toward zero) or ``"floor"`` (toward -inf) for each aligned addend.
        norm_bits: significant bits of the normalised group sum (24: FP32).
        norm_rounding: ``"trunc"`` or ``"nearest"`` for the normalisation.
        align_exponent: ``"operands"``: a product's exponent is the sum of its operands' exponents
            (its significand product, in [1, 4), is not renormalised first); ``"value"``:
            ``floor(log2 |product|)``.
        inst_k: K of one MMA instruction (32 for an FP8 wgmma).
    """

    group: int = 32
    align_bits: int = 13
    align_rounding: str = "trunc"
    norm_bits: int = 14
    norm_rounding: str = "trunc"
    align_exponent: str = "operands"
    inst_k: int = 32

    def __post_init__(self):
        if self.group < 1 or self.inst_k % self.group:
            raise ValueError(f"group must divide inst_k = {self.inst_k}; got {self.group}")
        if not 1 <= self.align_bits <= 40:
            raise ValueError(f"align_bits must be in [1, 40]; got {self.align_bits}")
        if not 1 <= self.norm_bits <= 24:
            raise ValueError(f"norm_bits must be in [1, 24] (the result is FP32); got {self.norm_bits}")
        if self.align_rounding not in ("trunc", "floor"):
            raise ValueError(f"align_rounding must be 'trunc' or 'floor'; got {self.align_rounding!r}")
        if self.align_exponent not in ("operands", "value"):
            raise ValueError(f"align_exponent must be 'operands' or 'value'; got {self.align_exponent!r}")
        if self.norm_rounding not in ("trunc", "nearest"):
            raise ValueError(f"norm_rounding must be 'trunc' or 'nearest'; got {self.norm_rounding!r}")


HOPPER_FP8_MMA = MmaModel()
"""The model calibrated on an H100 (docs/hopper-fp8-accumulation.md)."""


def _round(x: np.ndarray, mode: str) -> np.ndarray:
    if mode == "trunc":
        return np.trunc(x)
    if mode == "floor":
        return np.floor(x)
    if mode == "nearest":
        return np.rint(x)  # ties to even
    raise ValueError(f"rounding must be one of {_ROUNDINGS}; got {mode!r}")


def round_significand(x, bits: int, mode: str = "trunc") -> np.ndarray:
    """Round float64 ``x`` to ``bits`` significant bits (``"trunc"`` toward zero, ``"floor"``,
    ``"nearest"`` even); zeros stay zero. Exact: one scaling by a power of two, one rounding."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1
    return np.ldexp(_round(np.ldexp(m, bits), mode), e - bits)


def _exponent(x: np.ndarray) -> np.ndarray:
    """floor(log2 |x|) for x != 0 (any value for 0)."""
    return np.frexp(x)[1] - 1


_E4M3_EMIN = -6


def operand_exponents(x) -> np.ndarray:
    """The exponent an E4M3 element enters the multiplier with: ``floor(log2 |x|)`` for normal values,
    ``-6`` (E4M3's ``emin``) for subnormals; zeros get ``-1000`` (their products are zero and never set
    the alignment). Integer array of ``x``'s shape."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(x != 0, np.maximum(np.frexp(x)[1] - 1, _E4M3_EMIN), -1000)



def mma_accumulate(a_terms, b_terms, model: MmaModel = HOPPER_FP8_MMA, c=None) -> np.ndarray:
    """Accumulate the exact products ``a_terms * b_terms`` (E4M3 values, broadcastable ``[..., K]``, K a
    multiple of ``model.group``) through a chain of fused groups in K order, starting from the FP32
    accumulator ``c`` (``None``: cleared, so the first group has no accumulator addend).

    Per group: ``e = max(ea + eb over the group's products, floor(log2 |acc|))`` with ``ea``, ``eb``
    from :func:`operand_exponents` (``align_exponent="operands"``; ``"value"`` uses
    ``floor(log2 |product|)`` instead, one more when the significand product reaches 2); every addend
    is cut to the grid ``2^(e - align_bits)``; the exact sum is normalised to ``norm_bits`` bits.
    Returns the float64 accumulator ``[...]`` (an FP32 value)."""
    a = np.asarray(a_terms, dtype=np.float64)
    b = np.asarray(b_terms, dtype=np.float64)
    p = a * b  # exact: 4-bit x 4-bit significands
    k = p.shape[-1]
    if k % model.group:
        raise ValueError(f"K = {k} is not a multiple of the group size {model.group}")
    if model.align_exponent == "operands":
        ep = operand_exponents(a) + operand_exponents(b)
    else:
        ep = np.where(p != 0, np.frexp(p)[1] - 1, -2000)
    ep = np.broadcast_to(ep, p.shape)
    acc = None if c is None else np.broadcast_to(np.asarray(c, dtype=np.float64), p.shape[:-1])
    for g0 in range(0, k, model.group):
        terms = p[..., g0:g0 + model.group]
        e = ep[..., g0:g0 + model.group].max(axis=-1)
        if acc is not None:
            e = np.maximum(e, np.where(acc != 0, np.frexp(acc)[1] - 1, -2000))
            terms = np.concatenate([terms, acc[..., None]], axis=-1)
        q = e - model.align_bits  # exponent of the grid
        s = _round(np.ldexp(terms, -q[..., None]), model.align_rounding).sum(axis=-1)
        acc = round_significand(np.ldexp(s, q), model.norm_bits, model.norm_rounding)
    return acc if acc is not None else np.zeros(p.shape[:-1])


def _two_sum(a: np.ndarray, b: np.ndarray):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def fp32_fma(a, b, c) -> np.ndarray:
    """``fl32(a·b + c)`` rounded once to nearest even, for FP32 values ``a, b, c`` (float64 arrays).

    ``a·b`` is exact in float64 (48 bits); ``a·b + c`` is summed error-free (``hi + lo``) and ``hi``
    is made round-to-odd (nudged one float64 ulp toward ``lo`` when inexact and even), which rounds
    to FP32 exactly as the infinitely precise sum would (53 >= 24 + 2 bits)."""
    p = np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)
    hi, lo = _two_sum(p, np.asarray(c, dtype=np.float64))
    hi = np.array(hi, dtype=np.float64)  # a contiguous copy (0-d for scalars) to read the bits of
    even = (hi.view(np.int64) & 1) == 0
    hi = np.where((lo != 0) & even, np.nextafter(hi, np.where(lo > 0, np.inf, -np.inf)), hi)
    return hi.astype(np.float32).astype(np.float64)


def _fp32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def _check_e4m3(x: np.ndarray, name: str) -> np.ndarray:
    v = np.asarray(x)
    if v.dtype.name == "float8_e4m3fn":
        v = v.astype(np.float32)
    v = np.asarray(v, dtype=np.float64)
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{name} holds NaN or inf; E4M3 operands must be finite")
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - ml_dtypes is a dependency
        raise ImportError("the E4M3 check needs ml_dtypes") from e
    if not np.array_equal(v.astype(ml_dtypes.float8_e4m3fn).astype(np.float64), v):
        raise ValueError(f"{name} holds values that are not E4M3 (float8_e4m3fn) values")
    return v


def deepgemm_block_accumulators(a, b, model: MmaModel = HOPPER_FP8_MMA, *, block_k: int = 128,
                                max_elems: int = 1 << 22) -> np.ndarray:
    """The tensor-core accumulator of every 128-column K block: ``acc [M, N, K/block_k]`` (float64
    holding FP32 values) for E4M3 element values ``a [M, K]``, ``b [N, K]`` (unscaled), each block
    from a cleared accumulator through ``block_k / inst_k`` chained MMAs. K must be a multiple of
    ``block_k`` (DeepGEMM's contract). Row blocks bound the ``[rows, N, block_k]`` product tensor to
    ``max_elems`` elements."""
    a = _check_e4m3(a, "a")
    b = _check_e4m3(b, "b")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need a [M, K] and b [N, K] with one K; got {a.shape} and {b.shape}")
    m, k = a.shape
    n = b.shape[0]
    if k % block_k or block_k % model.inst_k:
        raise ValueError(f"K = {k} must be a multiple of block_k = {block_k}, itself of inst_k = {model.inst_k}")
    nb = k // block_k
    out = np.empty((m, n, nb))
    rows = max(1, max_elems // max(1, n * block_k))
    for r0 in range(0, m, rows):
        ar = a[r0:r0 + rows]
        for j in range(nb):
            ks = slice(j * block_k, (j + 1) * block_k)
            out[r0:r0 + rows, :, j] = mma_accumulate(ar[:, None, ks], b[None, :, ks], model)
    return out


_PROMOTIONS = ("deepgemm", "a_then_b", "separate")


def promote(acc: np.ndarray, sa: np.ndarray, sb: np.ndarray, promotion: str = "deepgemm") -> np.ndarray:
    """FP32 promotion of block accumulators ``acc [M, N, S]`` with scales ``sa [M, S]``,
    ``sb [N, S]`` (FP32 values), in K-block order from 0. ``"deepgemm"``: ``final = fma(fl(sa·sb),
    acc, final)`` (DeepGEMM's SM90 kernel, and our Triton and Gluon FP8 block GEMMs); ``"a_then_b"``:
    ``final = fma(fl(acc·sa), sb, final)`` (the activation scale first, then the weight scale);
    ``"separate"``: ``final = fl(final + fl(fl(sa·sb)·acc))`` (no contraction). Returns float64
    ``[M, N]`` holding FP32 values."""
    if promotion not in _PROMOTIONS:
        raise ValueError(f"promotion must be one of {_PROMOTIONS}; got {promotion!r}")
    sa = _fp32(sa)
    sb = _fp32(sb)
    final = np.zeros(acc.shape[:2])
    for j in range(acc.shape[2]):
        a_j = sa[:, None, j]
        b_j = sb[None, :, j]
        if promotion == "deepgemm":
            final = fp32_fma(_fp32(a_j * b_j), acc[..., j], final)
        elif promotion == "a_then_b":
            final = fp32_fma(_fp32(acc[..., j] * a_j), b_j, final)
        else:
            final = fp32_fma(_fp32(_fp32(a_j * b_j) * acc[..., j]), 1.0, final)
    return final


def _bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return x.astype(np.float32).astype(ml_dtypes.bfloat16)  # FP32 -> bf16, round to nearest even


def deepgemm_fp8_gemm(a, sa, b, sb, model: MmaModel = HOPPER_FP8_MMA, *, promotion: str = "deepgemm",
                      out_dtype: str = "bfloat16"):
    """DeepGEMM's FP8 GEMM ``D = (A·sa) (B·sb)^T``, predicted bit for bit.

    Args:
        a: E4M3 element values ``[M, K]`` (float array or ``ml_dtypes.float8_e4m3fn``), 1x128 scales
            ``sa`` FP32 ``[M, K/128]``.
        b: E4M3 ``[N, K]`` with 128x128 scales ``sb`` FP32 ``[ceil(N/128), K/128]``.
        promotion: see :func:`promote`.
        out_dtype: ``"bfloat16"`` (returns an ``ml_dtypes.bfloat16`` array) or ``"float32"``.
    """
    acc = deepgemm_block_accumulators(a, b, model)
    n, s = acc.shape[1], acc.shape[2]
    sa = np.asarray(sa, dtype=np.float64)
    sb = np.asarray(sb, dtype=np.float64)
    if sa.shape != (acc.shape[0], s) or sb.shape != (-(-n // 128), s):
        raise ValueError(f"scales must be sa [{acc.shape[0]}, {s}] and sb [{-(-n // 128)}, {s}]; "
                         f"got {sa.shape} and {sb.shape}")
    final = promote(acc, sa, np.repeat(sb, 128, axis=0)[:n], promotion)
    if out_dtype == "float32":
        return final.astype(np.float32)
    if out_dtype != "bfloat16":
        raise ValueError(f"out_dtype must be 'bfloat16' or 'float32'; got {out_dtype!r}")
    return _bf16(final)


def deepgemm_grouped_contiguous(a, sa, b, sb, m_indices, model: MmaModel = HOPPER_FP8_MMA, *,
                                promotion: str = "deepgemm", out_dtype: str = "bfloat16"):
    """:func:`deepgemm_fp8_gemm` per expert in DeepGEMM's contiguous layout: row ``r`` of ``a [M, K]``
    uses expert ``m_indices[r]`` of ``b [E, N, K]`` / ``sb [E, ceil(N/128), K/128]``; rows with index
    -1 (padding) are returned as NaN (DeepGEMM leaves them unspecified)."""
    a = np.asarray(a)
    m_indices = np.asarray(m_indices)
    b = np.asarray(b)
    if m_indices.shape != (a.shape[0],):
        raise ValueError(f"m_indices must have shape ({a.shape[0]},); got {m_indices.shape}")
    if b.ndim != 3:
        raise ValueError(f"b must be [E, N, K]; got shape {b.shape}")
    bad = (m_indices < -1) | (m_indices >= b.shape[0])
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"m_indices[{i}] = {int(m_indices[i])} is not -1 or an expert in [0, {b.shape[0]})")
    out = np.full((a.shape[0], b.shape[1]), np.nan, dtype=np.float32)
    sa = np.asarray(sa)
    for e in np.unique(m_indices[m_indices >= 0]):  # a handful of experts
        rows = np.nonzero(m_indices == e)[0]
        out[rows] = deepgemm_fp8_gemm(a[rows], sa[rows], b[e], np.asarray(sb)[e], model, promotion=promotion,
                                      out_dtype="float32")
    if out_dtype == "float32":
        return out
    if out_dtype != "bfloat16":
        raise ValueError(f"out_dtype must be 'bfloat16' or 'float32'; got {out_dtype!r}")
    return _bf16(out)


def _check_deepgemm_operands(a, w):
    from .exact import as_operand

    a = as_operand(a, "a")
    w = as_operand(w, "w")
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"a has K={k} but w has K={w.shape[1]}")
    if k % 128:
        raise ValueError(f"DeepGEMM's FP8 GEMM needs K to be a multiple of 128; got K={k}")
    if not (a.quantized and w.quantized):
        raise ValueError("the DeepGEMM emulation needs quantized E4M3 operands (got a float operand)")
    if a.block[1] != 128 or (a.block[0] != 1 and m > 1):
        raise ValueError(f"a must have 1x128 scale blocks (DeepGEMM's activations); got blocks {a.block}")
    if w.block != (min(128, n), 128) and not (w.block[0] == 128 and w.block[1] == 128):
        raise ValueError(f"w must have 128x128 scale blocks (DeepGEMM's weights); got blocks {w.block}")
    return a, w


def deepgemm_engine(model: MmaModel = HOPPER_FP8_MMA, promotion: str = "deepgemm"):
    """A GEMM engine ``(a, w) -> FP32 [M, N]`` (float64 array of FP32 values) for
    :func:`moeref.gemm.expert_rows_gemm` and :func:`moeref.moe.run_moe` (``gemm=``): DeepGEMM's FP8 GEMM
    on block operands (:class:`moeref.gemm.BlockOperand`: E4M3 elements, ``a`` with 1x128 scales, ``w``
    with 128x128 scales; scales rounded to FP32 as the kernel reads them), predicted bit for bit before
    the output store; the default ``promotion="deepgemm"`` is also our Triton and Gluon FP8 block GEMMs'
    (:mod:`fastpath.grouped_gemm`). ``promotion="a_then_b"`` or ``"separate"``: the other orders of
    :func:`promote`."""
    if promotion not in _PROMOTIONS:
        raise ValueError(f"promotion must be one of {_PROMOTIONS}; got {promotion!r}")

    def gemm(a, w):
        a, w = _check_deepgemm_operands(a, w)
        n = w.shape[0]
        acc = deepgemm_block_accumulators(a.values, w.values, model)
        sa = np.asarray(a.scales, dtype=np.float64)
        if sa.shape[0] == 1 and a.shape[0] > 1:
            sa = np.repeat(sa, a.shape[0], axis=0)
        sb = np.repeat(np.asarray(w.scales, dtype=np.float64), w.block[0], axis=0)[:n]
        return promote(acc, sa, sb, promotion)

    return gemm
