"""Independent re-statements of each anchor's published quantization algorithm (test oracles).

Written from the anchors' published source (torchao ``mx_formats``, TransformerEngine, DeepGEMM
``utils/math.py``, vLLM, microxcaling), in the
anchors' own medium (torch ops where the anchor uses torch, float32 bit tricks where it uses bit
tricks). Nothing here imports ``moeref.quant``; element casts use torch / ml_dtypes, not the
moeref codec. Each function takes a 2-D float tensor (bf16 or fp32) and returns NumPy arrays:
``(codes uint8 [M, N] unpacked, scales)``, scales float32 or uint8 E8M0 bytes.

torch 2.13 CPU ``.to(float8_e4m3fn)`` saturates finite overflow and Inf to +-448
(pytorch/pytorch PR #178817; torch <= 2.12 gives NaN);
tests that rely on it check the torch version.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch
from moeref._interop import torch_e4m3_cast_saturates

F32 = torch.float32


def _align(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def _fp8_codes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().copy()


# ---- DeepGEMM deep_gemm/utils/math.py -----------------------------------------------------------

def deepgemm_ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    bits = x.abs().float().view(torch.int)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    return (exp.clamp(1, 254) << 23).view(torch.float)


def deepgemm_per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128,
                                   cuda_division: bool = False):
    """``cuda_division``: compute ``amax / 448.0`` as torch does on a CUDA tensor, where ATen
    divides by a CPU scalar through its float32 reciprocal (``BinaryDivTrueKernel.cu``)."""
    m, n = x.shape
    pn = _align(n, gran_k)
    xp = torch.zeros((m, pn), dtype=x.dtype)
    xp[:, :n] = x
    xv = xp.view(m, pn // gran_k, gran_k)
    amax = xv.abs().float().amax(dim=2).view(m, pn // gran_k).clamp(1e-4)
    sf = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32) if cuda_division else amax / 448.0
    sf = deepgemm_ceil_to_ue8m0(sf) if use_ue8m0 else sf
    q = (xv * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, pn)[:, :n]
    return _fp8_codes(q), sf.numpy()


def deepgemm_per_block_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128):
    m, n = x.shape
    xp = torch.zeros((_align(m, gran_k), _align(n, gran_k)), dtype=x.dtype)
    xp[:m, :n] = x
    xv = xp.view(-1, gran_k, xp.size(1) // gran_k, gran_k)
    amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    sf = deepgemm_ceil_to_ue8m0(sf) if use_ue8m0 else sf
    q = (xv * (1.0 / sf)).to(torch.float8_e4m3fn)
    return _fp8_codes(q.view_as(xp)[:m, :n]), sf.view(xv.size(0), xv.size(2)).numpy()


def deepgemm_per_channel_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128):
    m, n = x.shape
    assert m % gran_k == 0
    xv = x.view(-1, gran_k, n)
    amax = xv.abs().float().amax(dim=1).view(-1, n).clamp(1e-4)
    sf = amax / 448.0
    sf = deepgemm_ceil_to_ue8m0(sf) if use_ue8m0 else sf
    q = (xv * (1.0 / sf.unsqueeze(1))).to(torch.float8_e4m3fn).view(m, n)
    return _fp8_codes(q), sf.numpy()


def deepgemm_per_token_cast_to_fp4(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 32):
    m, n = x.shape
    pn = _align(n, gran_k)
    xp = torch.zeros((m, pn), dtype=x.dtype)
    xp[:, :n] = x
    xv = xp.view(m, -1, gran_k)
    amax = xv.abs().float().amax(dim=2).clamp_min(1e-4)
    sf = amax / 6.0
    sf = deepgemm_ceil_to_ue8m0(sf) if use_ue8m0 else sf
    xs = xv * (1.0 / sf.unsqueeze(2))
    ax = xs.abs().clamp_max(6.0)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=ax.dtype)
    idx = torch.bucketize(ax, bounds)
    code = idx.to(torch.uint8) | (((xs < 0) & (idx != 0)).to(torch.uint8) << 3)
    return code.view(m, pn)[:, :n].numpy().copy(), sf.numpy()


# ---- vLLM per_token_group_quant_fp8 (Triton path, exact-math log2) -----------------------------

def vllm_per_token_group_quant_fp8(x: torch.Tensor, group_size: int, use_ue8m0: bool,
                                   eps: float = 1e-10):
    m, n = x.shape
    assert n % group_size == 0
    y = x.reshape(m, n // group_size, group_size).to(F32)
    amax = torch.clamp(y.abs().amax(dim=-1, keepdim=True), min=eps)
    ys = amax / 448.0
    if use_ue8m0:
        # exp2(ceil(log2(ys))) with an exact log2: frexp gives the exponent without rounding
        mant, ex = torch.frexp(ys)
        ex = torch.where(mant == 0.5, ex - 1, ex)
        ys = torch.ldexp(torch.ones_like(ys), ex)
    q = torch.clamp(y / ys, -448.0, 448.0).to(torch.float8_e4m3fn)
    return _fp8_codes(q.reshape(m, n)), ys.reshape(m, -1).numpy()


# ---- TransformerEngine ------------------------------------------------------------------------

def te_compute_scale_from_amax(amax: np.ndarray, max_fp8: float = 448.0, pow2: bool = False):
    """recipe_common.cuh compute_scale_from_amax, float32, epsilon 0 (returns encode scale)."""
    amax = amax.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        scale = np.float32(max_fp8) / amax
    scale = np.where(np.isinf(scale), np.finfo(np.float32).max, scale).astype(np.float32)
    scale = np.where((amax == 0) | np.isinf(amax), np.float32(1), scale).astype(np.float32)
    if pow2:
        scale = (scale.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return scale


def te_fp8_per_tensor(x: torch.Tensor):
    amax = x.abs().float().amax().numpy().reshape(1, 1)
    scale = te_compute_scale_from_amax(amax)
    q = (x.float() * torch.from_numpy(scale)).to(torch.float8_e4m3fn)  # satfinite (2.13)
    return _fp8_codes(q), (np.float32(1) / scale).astype(np.float32)


def te_fp8_block_1d(x: torch.Tensor, block: int = 128):
    """TE Float8BlockScaling 1 x block rows: per-block current scaling with power-of-two scales
    (encode scale rounded down), data clamp(x * scale) cast, scale_inv = 1 / scale."""
    m, n = x.shape
    xv = x.float().numpy().reshape(m, n // block, block)
    amax = np.abs(xv).max(-1)
    scale = te_compute_scale_from_amax(amax, pow2=True)
    data = np.clip(xv * scale[..., None], -448.0, 448.0).astype(np.float32)
    q = torch.from_numpy(data.reshape(m, n)).to(torch.float8_e4m3fn)
    return _fp8_codes(q), (np.float32(1) / scale).astype(np.float32)


def te_float_to_e8m0(v: np.ndarray) -> np.ndarray:
    """TE ptx_arch_spec.cuh float_to_e8m0 software fallback (satfinite RCEIL)."""
    v = v.astype(np.float32)
    bits = v.view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int32)
    mant = (bits & 0x7FFFFF).astype(np.int32)
    up = (mant != 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    out = exp + up
    out = np.where(np.isinf(v), 0xFE, out)
    out = np.where(np.isnan(v), 0xFF, out)
    return out.astype(np.uint8)


def te_mxfp8(x: torch.Tensor):
    m, n = x.shape
    xv = x.float().numpy().reshape(m, n // 32, 32)
    a = np.abs(xv)
    amax = np.max(np.where(np.isnan(a), np.float32(0), a), axis=-1)  # fmaxf from 0: NaN ignored
    e = te_float_to_e8m0(amax * np.float32(1.0 / 448.0))
    rcp = np.ldexp(np.float64(1.0), 127 - e.astype(np.int32)).astype(np.float32)  # exp2f_rcp
    scaled = xv * rcp[..., None]
    q = torch.from_numpy(scaled.reshape(m, n)).to(torch.float8_e4m3fn)  # satfinite
    return _fp8_codes(q), e


# ---- torchao to_mx ------------------------------------------------------------------------------

_TORCHAO = {  # elem -> (max_pow2, mbits, max_pos)
    "e4m3fn": (8, 3, 448.0), "e5m2": (15, 2, 57344.0), "e2m3": (2, 3, 7.5), "e3m2": (4, 2, 28.0),
    "e2m1": (2, 1, 6.0),
}


def _e8m0_to_rcp_fp32(b: torch.Tensor) -> torch.Tensor:
    r = (254 - b.to(torch.int32)).to(torch.uint8)
    bits = torch.bitwise_left_shift(r.to(torch.int32), 23)
    bits = torch.where(r == 0, 0x00400000, bits)
    bits = torch.where(r == 255, 0x7F800001, bits)
    return bits.view(torch.float32)


_TORCH_E4M3_SATURATES = torch_e4m3_cast_saturates()


def _lowp_cast(data: torch.Tensor, elem: str) -> np.ndarray:
    if elem == "e4m3fn":
        # torchao clamps before the cast where torch's E4M3 cast does not saturate (torch < 2.13,
        # pytorch/ao PR #4364); on torch >= 2.13 the cast saturates by itself.
        if not _TORCH_E4M3_SATURATES:
            data = torch.clamp(data, -448.0, 448.0)
        return _fp8_codes(data.to(torch.float8_e4m3fn))
    if elem == "e5m2":
        return _fp8_codes(torch.clamp(data, -57344.0, 57344.0).to(torch.float8_e5m2))
    dt = {"e2m1": ml_dtypes.float4_e2m1fn, "e2m3": ml_dtypes.float6_e2m3fn,
          "e3m2": ml_dtypes.float6_e3m2fn}[elem]
    # ml_dtypes: RNE, overflow saturates to max for these NaN-less formats
    d = data.numpy()
    with np.errstate(invalid="ignore"):
        codes = d.astype(dt).view(np.uint8).copy()
    nan = np.isnan(d)
    if nan.any():
        codes[nan] = torchao_floatx_nan_code(d[nan], elem)
    return codes


def torchao_floatx_nan_code(nans: np.ndarray, elem: str) -> np.ndarray:
    """What torchao's ``custom_fp_utils._f32_to_floatx_unpacked`` writes for float32 NaNs: a NaN
    compares false with both thresholds, so it takes the "normal" branch, which adds the exponent
    re-bias and the rounding magic to the bit pattern, shifts it down and keeps 8 bits, then ORs
    the sign back (re-stated from that function; quiet +NaN 0x7FC00000 gives E2M1 0x3)."""
    ebits, mbits = {"e2m1": (2, 1), "e2m3": (2, 3), "e3m2": (3, 2)}[elem]
    bias = (1 << (ebits - 1)) - 1
    bits = nans.astype(np.float32).view(np.uint32).astype(np.int64)
    sign = bits & 0x80000000
    mag = bits ^ sign
    odd = (mag >> (23 - mbits)) & 1
    add = ((bias - 127) << 23) + (1 << (23 - mbits - 1)) - 1
    code = ((mag + add + odd) >> (23 - mbits)) & 0xFF
    return (code | (sign >> (32 - 1 - ebits - mbits))).astype(np.uint8)


def torchao_to_mx(x: torch.Tensor, elem: str, mode: str, block: int = 32):
    """torchao mx_tensor.py to_mx (FLOOR / CEIL / EVEN / RCEIL), codes unpacked."""
    max_pow2, mbits, max_pos = _TORCHAO[elem]
    shape = x.shape
    d = x.reshape(*shape[:-1], shape[-1] // block, block)
    max_abs = torch.amax(torch.abs(d), -1).unsqueeze(-1).to(torch.float32)
    d = d.to(torch.float32)
    if mode == "rceil":
        descale = max_abs * (1.0 / max_pos)
        bits = descale.view(torch.int32)
        be = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        up = torch.where(be == 0, mant > 0x400000, mant != 0)
        sc = torch.where(torch.isfinite(descale), be + up.to(torch.int32), 255).to(torch.uint8)
    else:
        if mode == "even":
            nan = torch.isnan(max_abs)
            mi = max_abs.view(torch.int32)
            mi = (mi + (1 << (23 - mbits - 1))) & (((1 << 9) - 1) << 23)
            max_abs = mi.view(torch.float32)
            max_abs[nan] = float("nan")
        mi = max_abs.view(torch.int32)
        p2 = ((mi >> 23) & 0xFF) - 127
        if mode == "ceil":
            p2 = p2 + ((mi & 0x7FFFFF) > 0).to(torch.int32)
        unb = torch.clamp(p2 - max_pow2, min=-127, max=128)
        sc = (unb + 127).to(torch.uint8)
        sc = torch.where(torch.isfinite(max_abs), sc, torch.tensor(255, dtype=torch.uint8))
    data = d * _e8m0_to_rcp_fp32(sc)
    codes = _lowp_cast(data.reshape(shape), elem)
    return codes, sc.squeeze(-1).numpy()


# ---- microxcaling (CUDA path semantics): FLOOR from bits, ties-away elements --------------------

def microxcaling_mxfp4(x: np.ndarray):
    """FLOOR shared exponent from FP32 bits, E2M1 rounding ties away, saturate (numpy float32)."""
    m, n = x.shape
    xv = x.astype(np.float32).reshape(m, n // 32, 32)
    amax = np.abs(xv).max(-1)
    e = ((amax.view(np.uint32) >> 23) & 0xFF).astype(np.int32) - 127 - 2
    e = np.clip(e, -127, 127)
    xs = xv / np.ldexp(np.float32(1), e)[..., None].astype(np.float32)
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a = np.minimum(np.abs(xs).astype(np.float64), 6.0)
    # nearest grid point, ties away from zero: largest index whose midpoint below is <= a
    mids = (grid[1:] + grid[:-1]) / 2
    idx = np.searchsorted(mids, a, side="right")
    code = idx.astype(np.uint8) | (np.signbit(xs) << 3).astype(np.uint8)
    return code.reshape(m, n), (e + 127).astype(np.uint8)


# ---- integers -----------------------------------------------------------------------------------

def gptq_quantize(w: torch.Tensor, group: int, sym: bool, bits: int = 4):
    """GPTQ quant.py Quantizer.find_params + quantize, per row group along the last axis."""
    n, k = w.shape
    x = w.float().reshape(n, k // group, group)
    maxq = 2 ** bits - 1
    xmin = torch.minimum(x.amin(-1), torch.zeros(1))
    xmax = torch.maximum(x.amax(-1), torch.zeros(1))
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    tmp = (xmin == 0) & (xmax == 0)
    xmin[tmp] = -1
    xmax[tmp] = +1
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    q = torch.clamp(torch.round(x / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, maxq)
    return q.reshape(n, k).to(torch.int64).numpy(), scale.numpy(), zero.numpy()


def vllm_quantize_weights_int4(w: torch.Tensor, group: int):
    """vLLM quant_utils.quantize_weights(int4, zero_points=False), per row group (rows = N)."""
    n, k = w.shape
    x = w.float().reshape(n, k // group, group)
    max_val = x.amax(-1, keepdim=True)
    min_val = x.amin(-1, keepdim=True)
    s = torch.maximum(torch.abs(max_val / 7), torch.abs(min_val / -8))
    q = torch.clamp(torch.round(x / s), -8, 7)
    return q.reshape(n, k).to(torch.int64).numpy(), s.squeeze(-1).numpy()


def vllm_dynamic_int8(x: np.ndarray):
    """vLLM dynamic_scaled_int8_quant: scale = amax/127, q = rint(x * (127/amax)) clamped."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    scale = amax / np.float32(127.0)
    tmp = np.float32(127.0) / amax
    q = np.clip(np.rint(x * tmp), -128, 127).astype(np.int64)
    return q, scale


def e8m0_value(b) -> float:
    return math.ldexp(1.0, int(b) - 127)


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """E2M1 code -> value from the OCP MX v1.0 table (0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign)."""
    table = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    c = np.asarray(codes).astype(np.int64)
    v = table[c & 7]
    return np.where(c & 8, -v, v)
