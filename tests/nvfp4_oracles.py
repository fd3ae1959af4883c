"""Independent NVFP4 oracles, restated from the published reference code in float32 NumPy.

These do NOT import ``moeref.quant`` nor ``moeref.formats``: every float32 step is written out in
the order the anchor writes it, the E4M3 cast is ml_dtypes' (RNE, applied after the anchors'
clamp to +-448 so its non-saturating overflow never triggers) and the FP4 casts are the anchors'
own interval tables (TransformerEngine / FlashInfer / vLLM) or ml_dtypes' RNE cast (torchao's
``f32_to_f4_unpacked`` is RNE and keeps the sign of zero, as ml_dtypes does).

Sources:

* TransformerEngine ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``
  (``NVFP4QuantizerRef._quantize_blockwise_reference`` and ``cast_to_fp4x2``).
* FlashInfer ``tests/test_helpers/utils_fp4.py::ref_fp4_quant`` and vLLM
  ``tests/kernels/quantization/test_nvfp4_quant.py::ref_nvfp4_quant`` (the same op order; vLLM
  clamps the block scale to +-448 before the cast, FlashInfer relies on torch's cast, which
  saturates from torch 2.13 on, so both are the clamp here).
* torchao ``torchao/prototype/mx_formats/nvfp4_tensor.py::nvfp4_quantize`` (HEAD 36027d8:
  two-level data step ``x * ((1/pts)/s)``) and ``per_tensor_amax_to_scale``.

All oracles take a 2-D array (rows, cols); inputs that are not multiples of the tile are padded
with zeros like TE's ``_pad_tensor`` (zeros never change a block amax) and the padding is cut off
again. Every oracle returns unpacked E2M1 codes or values of x's shape and the E4M3 block-scale
codes with one row per input row (TE's layout: a 16x16 tile repeats its scale over its 16 rows).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1_MAX = F32(6.0)
E4M3_MAX = F32(448.0)
E4M3_TINY = F32(2.0 ** -6)  # torch.finfo(torch.float8_e4m3fn).tiny, torchao's E4M3_EPS


def _pad(x: np.ndarray, ty: int, tx: int) -> np.ndarray:
    m, n = x.shape
    pm, pn = (-m) % ty, (-n) % tx
    return np.pad(x, ((0, pm), (0, pn))) if pm or pn else x


def _vec_max(xp: np.ndarray, ty: int, tx: int) -> np.ndarray:
    """Block amax of a padded 2-D float32 array, repeated over the tile's rows: (M, N//tx)."""
    m, n = xp.shape
    t = np.abs(xp).reshape(m // ty, ty, n // tx, tx).max(axis=(1, 3))
    return np.repeat(t, ty, axis=0)


def e4m3_cast(v: np.ndarray) -> np.ndarray:
    """torch ``.to(float8_e4m3fn)`` of float32 values already clamped to +-448: RNE codes."""
    return np.asarray(v, F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_value(codes: np.ndarray) -> np.ndarray:
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)


def te_cast_to_fp4(x: np.ndarray) -> np.ndarray:
    """TransformerEngine ``cast_to_fp4x2`` before packing: the interval table, one code per value.

    Ties go to even (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4); -0.0 -> 0x0 but
    (-0.25, 0) -> 0x8; NaN matches no interval -> 0x0. FlashInfer's and vLLM's ``cast_to_fp4`` use
    the same table and return ``sign(x) * value``.
    """
    r = np.zeros(x.shape, np.uint8)
    r[(x >= 0.0) & (x <= 0.25)] = 0
    r[(x > 0.25) & (x < 0.75)] = 1
    r[(x >= 0.75) & (x <= 1.25)] = 2
    r[(x > 1.25) & (x < 1.75)] = 3
    r[(x >= 1.75) & (x <= 2.5)] = 4
    r[(x > 2.5) & (x < 3.5)] = 5
    r[(x >= 3.5) & (x <= 5.0)] = 6
    r[x > 5.0] = 7
    r[(x >= -0.25) & (x < -0.0)] = 8
    r[(x < -0.25) & (x > -0.75)] = 9
    r[(x <= -0.75) & (x >= -1.25)] = 10
    r[(x < -1.25) & (x > -1.75)] = 11
    r[(x <= -1.75) & (x >= -2.5)] = 12
    r[(x < -2.5) & (x > -3.5)] = 13
    r[(x <= -3.5) & (x >= -5.0)] = 14
    r[x < -5.0] = 15
    return r


E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], F32)


def te_global_encode_scale(global_amax) -> np.float32:
    """TE: ``min((448*6)/amax, FLT_MAX)``, then 0 -> 1 (an Inf amax gives 0)."""
    with np.errstate(over="ignore", divide="ignore"):
        s = F32(E4M3_MAX * E2M1_MAX) / F32(global_amax)
    s = min(F32(s), FLT_MAX)
    return F32(1.0) if s == 0 else F32(s)


def te_nvfp4_ref(x, tile=(1, 16), global_amax=None):
    """``NVFP4QuantizerRef`` rowwise quantization (no RHT, no 4over6, no pow2 scales).

    Returns ``(codes uint8 (m, n), scale_codes uint8 (m, ceil(n/16)), global_amax float32)``.
    """
    x = np.asarray(x).astype(F32)
    m, n = x.shape
    ty, tx = tile
    if global_amax is None:
        global_amax = np.abs(x).max() if x.size else F32(0)
    global_amax = F32(global_amax)
    xp = _pad(x, ty, tx)
    vec_max = _vec_max(xp, ty, tx)[..., None]                     # (M, nb, 1)
    s_enc = te_global_encode_scale(global_amax)
    s_dec_global = F32(1.0) / s_enc
    multiplier = s_enc * (F32(1.0) / E2M1_MAX)                     # S_enc * reciprocal(6)
    decode_scale = vec_max * multiplier
    decode_scale = np.minimum(decode_scale, FLT_MAX)
    decode_scale = np.clip(decode_scale, -E4M3_MAX, E4M3_MAX)
    scale_codes = e4m3_cast(decode_scale)
    with np.errstate(divide="ignore"):
        encode_scale = np.minimum(F32(1.0) / (e4m3_value(scale_codes) * s_dec_global), FLT_MAX)
    M, N = xp.shape
    with np.errstate(over="ignore"):
        scaled = xp.reshape(M, N // tx, tx) * encode_scale
    clipped = np.clip(scaled, -E2M1_MAX, E2M1_MAX).reshape(M, N)
    codes = te_cast_to_fp4(clipped)
    return codes[:m, :n], scale_codes[:m, :, 0], global_amax


def _reciprocal(v):
    """FlashInfer/vLLM ``get_reciprocal``: 1/x with 1/0 := 0."""
    v = np.asarray(v, F32)
    with np.errstate(divide="ignore"):
        return np.where(v == 0, F32(0.0), F32(1.0) / v).astype(F32)


def flashinfer_global_scale(x) -> np.float32:
    """The tests' dynamic global scale: ``(448*6) / amax`` in float32 (an ENCODE scale)."""
    return F32(E4M3_MAX * E2M1_MAX) / F32(np.abs(np.asarray(x, F32)).max())


def flashinfer_ref_fp4_quant(x, global_scale, block_size=16):
    """FlashInfer ``ref_fp4_quant`` / vLLM ``ref_nvfp4_quant`` (UE4M3 branch).

    Returns ``(e2m1 values float32 (m, n), scale float32 (m, ceil(n/16)))`` as the references do
    (values, not codes: their ``cast_to_fp4`` returns ``sign(x) * value``).
    """
    x = np.asarray(x).astype(F32)
    m, n = x.shape
    gs = F32(global_scale)
    xp = _pad(x, 1, block_size)
    M, N = xp.shape
    sliced = xp.reshape(M, N // block_size, block_size)
    vec_max = np.abs(sliced).max(axis=-1, keepdims=True)
    scale = gs * (vec_max * _reciprocal(E2M1_MAX))
    scale = np.clip(scale, -E4M3_MAX, E4M3_MAX)                     # vLLM clamp / torch>=2.13 satfinite
    scale = e4m3_value(e4m3_cast(scale))
    output_scale = _reciprocal(scale * _reciprocal(gs))
    scaled = sliced * output_scale
    clipped = np.clip(scaled, -6.0, 6.0).reshape(M, N)
    values = E2M1_VALUES[te_cast_to_fp4(clipped)]
    return values[:m, :n], scale[:m, :, 0]


def torchao_per_tensor_amax_to_scale(amax) -> np.float32:
    """torchao ``per_tensor_amax_to_scale``: ``amax / (448*6)``, a DECODE scale."""
    return F32(amax) / F32(E4M3_MAX * E2M1_MAX)


def torchao_nvfp4_factors(x, per_tensor_scale=None, block_size=16):
    """The blocks of :func:`torchao_nvfp4_quantize` (float32 ``[m, n/16, 16]``, zero-padded), its
    UE4M3 scale codes and its float32 data factor per block (``recip``; Inf where torchao's
    ``fl(1/pts) / s`` overflows)."""
    xp = _pad(np.asarray(x).astype(F32), 1, block_size)
    M, N = xp.shape
    data = xp.reshape(M, N // block_size, block_size)
    block_scale = np.abs(data).max(axis=-1) / E2M1_MAX
    with np.errstate(over="ignore"):
        if per_tensor_scale is None:
            s_codes = e4m3_cast(np.clip(block_scale, E4M3_TINY, E4M3_MAX))
            recip = F32(1.0) / e4m3_value(s_codes)
        else:
            pts = F32(per_tensor_scale)
            s_codes = e4m3_cast(np.clip(block_scale / pts, E4M3_TINY, E4M3_MAX))
            recip = (F32(1.0) / pts) / e4m3_value(s_codes)
    return data, s_codes, recip


def torchao_nvfp4_quantize(x, per_tensor_scale=None, block_size=16):
    """torchao ``nvfp4_quantize`` (HEAD 36027d8).

    Two-level (``per_tensor_scale`` given): ``s = e4m3(clamp((amax/6)/pts, 2^-6, 448))``,
    ``data = clamp(x * ((1/pts)/s), -6, 6)``; single-level: ``s = e4m3(clamp(amax/6, 2^-6, 448))``,
    ``data = x * (1/s)``. FP4 cast RNE keeping the sign of zero (``f32_to_f4_unpacked``).
    Returns ``(codes uint8 (m, n), scale_codes uint8 (m, ceil(n/16)))``.
    """
    x = np.asarray(x).astype(F32)
    m, n = x.shape
    data, s_codes, recip = torchao_nvfp4_factors(x, per_tensor_scale, block_size)
    M, N = data.shape[0], data.shape[1] * block_size
    scaled = data * recip[..., None]
    scaled = np.clip(scaled, -E2M1_MAX, E2M1_MAX).reshape(M, N)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return codes[:m, :n], s_codes[:m]
