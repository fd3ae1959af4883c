"""Triton kernel of stage 3 of :func:`moeref.compare.device.layer._chunk_interval` for the SiLU-gated
activations: in one pass over ``h, dh [R, 2I]`` float64 it gives, bit for bit, what these torch lines give::

    x_pre = activation_values(act, h, lay, params)
    dx = activation_error(act, h, dh, lay, params)
    dx = dx + act_unit * (x_pre.abs() + activation_magnitude(act, h.abs() + dh, lay, params) + dx)

Mirrored operation for operation, in the same order and association: :func:`moeref.elementary.exp` (Cody-Waite
reduction, degree-13 Horner polynomial, ``k >> 1`` split of ``2^k`` assembled from bits) and ``sigmoid``,
:func:`moeref.activations._gated_core`, :func:`moeref.compare.stage_bounds.lipschitz_on` (``_derivative`` of
silu, ``_CRITICAL`` points, the ``1 + 1e-9`` / ``1e-15`` margin), ``activation_error``, ``activation_magnitude``.

Constants: every float64 constant (``elementary``'s ``_INV_LN2``, ``_LN2_*``, ``_EXP_*``, ``_TAYLOR``; the
critical points and values; ``1 + 1e-9``, ``1e-15``; ``act_unit``, ``alpha``, ``beta``, ``limit``; ``inf`` and
``nan``) is read from a float64 tensor (:func:`_consts`, index names ``_C_*``): Triton types a float argument,
and a literal outside a binary op with a float64 tensor (``tl.where``), as float32. Compiled with
``enable_fp_fusion=False`` (no FMA contraction). ``torch.round`` (half to even) is ``(t + 1.5 * 2^52) - 1.5 * 2^52``,
exact for the clipped ``|t| < 1100``; divisions are IEEE float64 divisions where the torch code divides
(``1.0 / t`` is ``t.reciprocal() * 1.0`` in torch: the same bits); ``maximum``/``minimum``/``clamp`` are
``tl.where`` forms that propagate NaN as torch does (``tl.maximum``'s default ignores NaN on a GPU).
Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

import inspect
import math

import torch
import triton
import triton.language as tl

from ... import elementary
from ...activations import ACTIVATIONS, W13_LAYOUTS
from ..stage_bounds import _CRITICAL
from ._constants import float64_constants

__all__ = ["gated_silu_stage_t", "SUPPORTED"]

SUPPORTED = ("silu_and_mul", "mul_and_silu", "swigluoai", "swiglu_bias", "swiglustep")
"""Activations :func:`gated_silu_stage_t` computes (any other: ``None``)."""

_MODES = {"silu_and_mul": 0, "mul_and_silu": 0, "swiglustep": 1, "swigluoai": 2, "swiglu_bias": 3}
_BLOCK = 1024  # outputs per program

# indices into the constant table (_consts); constexpr: a @triton.jit function reads only constexpr globals
_C_INV_LN2, _C_LN2_HI, _C_LN2_LO = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_C_CLIP_LO, _C_CLIP_HI, _C_EXP_MAX, _C_EXP_MIN = tl.constexpr(3), tl.constexpr(4), tl.constexpr(5), tl.constexpr(6)
_C_INF, _C_NAN, _C_ZERO, _C_ONE, _C_MAGIC = (tl.constexpr(i) for i in range(7, 12))
_C_CRIT = tl.constexpr(12)  # c0, v0, c1, v1 of _CRITICAL["silu"]
_C_MARGIN, _C_FLOOR, _C_UNIT, _C_ALPHA, _C_BETA, _C_BABS, _C_LIM = (tl.constexpr(i) for i in range(16, 23))
_C_TAYLOR = tl.constexpr(23)  # 1/n! for n = 0..13


def _consts(device: torch.device, act_unit: float, alpha: float, beta: float, b_abs: float, lim: float):
    """The float64 constant table on ``device`` (:func:`moeref.compare.device._constants.float64_constants`,
    cached by the values' exact bits: ``-0.0`` is not ``0.0``)."""
    crit = [x for cv in _CRITICAL["silu"] for x in cv]
    vals = [elementary._INV_LN2, elementary._LN2_HI, elementary._LN2_LO, elementary._EXP_MIN - 1.0,
            elementary._EXP_MAX + 1.0, elementary._EXP_MAX, elementary._EXP_MIN, math.inf, math.nan, 0.0, 1.0,
            1.5 * 2.0**52, *crit, 1.0 + 1e-9, 1e-15, act_unit, alpha, beta, b_abs, lim, *elementary._TAYLOR]
    assert len(crit) == 4 and len(vals) == _C_TAYLOR.value + 14
    return float64_constants(device, *vals)


@triton.jit
def _pow2(k):
    """``2^k`` for int64 ``k`` in the normal range, from its bits (``elementary._Torch.pow2``)."""
    return ((k + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _exp(x, c_ptr):
    """:func:`moeref.elementary._exp`, operation for operation."""
    nan = x != x
    xs = tl.where(nan, tl.load(c_ptr + _C_ZERO), x)
    lo = tl.load(c_ptr + _C_CLIP_LO)
    hi = tl.load(c_ptr + _C_CLIP_HI)
    xs = tl.where(xs < lo, lo, xs)  # clamp(lo, hi); xs is not NaN
    xs = tl.where(xs > hi, hi, xs)
    magic = tl.load(c_ptr + _C_MAGIC)
    t = xs * tl.load(c_ptr + _C_INV_LN2)
    k = ((t + magic) - magic).to(tl.int64)  # torch.round(t).to(int64): half to even, |t| < 1100
    kf = k.to(tl.float64)
    r = (xs - kf * tl.load(c_ptr + _C_LN2_HI)) - kf * tl.load(c_ptr + _C_LN2_LO)
    q = r * tl.load(c_ptr + _C_TAYLOR + 13) + tl.load(c_ptr + _C_TAYLOR + 12)
    for i in tl.static_range(10):  # c = 1/11!, ..., 1/2!
        q = q * r
        q = q + tl.load(c_ptr + _C_TAYLOR + 11 - i)
    s = r * r
    s = s * q
    s = s + r
    p = tl.load(c_ptr + _C_ONE) + s
    k1 = k >> 1
    out = (p * _pow2(k1)) * _pow2(k - k1)
    out = tl.where(xs > tl.load(c_ptr + _C_EXP_MAX), tl.load(c_ptr + _C_INF), out)
    out = tl.where(xs < tl.load(c_ptr + _C_EXP_MIN), tl.load(c_ptr + _C_ZERO), out)
    return tl.where(nan, tl.load(c_ptr + _C_NAN), out)


@triton.jit
def _sigmoid(x, c_ptr):
    """:func:`moeref.elementary.sigmoid`: ``where(x >= 0, 1 / (1 + e), e / (1 + e))``, ``e = exp(-|x|)``."""
    one = tl.load(c_ptr + _C_ONE)
    e = _exp(-tl.abs(x), c_ptr)
    d = one + e
    return tl.where(x >= 0, one / d, e / d)


@triton.jit
def _dsilu_abs(x, c_ptr):
    """``|silu'(x)|`` = ``|s * (1 + x * (1 - s))|`` (``stage_bounds._derivative``)."""
    one = tl.load(c_ptr + _C_ONE)
    s = _sigmoid(x, c_ptr)
    return tl.abs(s * (one + x * (one - s)))


@triton.jit
def _min_lim(x, lim):
    """``torch.minimum(x, lim)`` for a lim > 0 (not NaN): NaN stays NaN."""
    return tl.where(x > lim, lim, x)


@triton.jit
def _clip_sym(x, lim):
    """``torch.maximum(torch.minimum(x, lim), -lim)`` (``activations._clip_sym``)."""
    m = tl.where(x > lim, lim, x)
    return tl.where(m < -lim, -lim, m)


@triton.jit
def _gated_silu_kernel(h_ptr, dh_ptr, x_ptr, dx_ptr, c_ptr, R, I, G0, U0, S: tl.constexpr, MODE: tl.constexpr,
                       HAS_LIM: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """One ``[BR, BC]`` tile of outputs. Gate ``h[r, S * j + G0]``, up ``h[r, S * j + U0]`` (``_split_axis``);
    ``MODE``: 0 silu_and_mul, 1 swiglustep, 2 swigluoai, 3 swiglu_bias (``activations._gated_core``)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    msk = (rows < R)[:, None] & (cols < I)[None, :]
    row64 = rows.to(tl.int64)[:, None]
    c64 = cols.to(tl.int64)[None, :]
    gi = row64 * (2 * I) + (c64 * S + G0)
    ui = row64 * (2 * I) + (c64 * S + U0)
    g = tl.load(h_ptr + gi, mask=msk, other=0.0)
    u = tl.load(h_ptr + ui, mask=msk, other=0.0)
    dg = tl.load(dh_ptr + gi, mask=msk, other=0.0)
    du = tl.load(dh_ptr + ui, mask=msk, other=0.0)
    alpha = tl.load(c_ptr + _C_ALPHA)
    beta = tl.load(c_ptr + _C_BETA)
    b_abs = tl.load(c_ptr + _C_BABS)
    lim = tl.load(c_ptr + _C_LIM)
    # x_pre: activations._gated_core
    if MODE == 0:
        x_pre = (g * _sigmoid(g, c_ptr)) * u
    elif MODE == 1:
        x_pre = _min_lim(g * _sigmoid(g, c_ptr), lim) * _clip_sym(u, lim)
    else:
        gc = g
        uc = u
        if HAS_LIM:
            gc = _min_lim(g, lim)
            uc = _clip_sym(u, lim)
        if MODE == 2:
            x_pre = ((uc + beta) * gc) * _sigmoid(alpha * gc, c_ptr)
        else:
            x_pre = (gc * _sigmoid(alpha * gc, c_ptr)) * (uc + beta)
    # activation_error: lipschitz_on("silu", alpha (g - dg), alpha (g + dg))
    lo = alpha * (g - dg)
    hi = alpha * (g + dg)
    d_lo = _dsilu_abs(lo, c_ptr)
    d_hi = _dsilu_abs(hi, c_ptr)
    lip = tl.where((d_lo > d_hi) | (d_lo != d_lo), d_lo, d_hi)  # torch.maximum: NaN propagates
    for i in tl.static_range(2):
        c = tl.load(c_ptr + _C_CRIT + 2 * i)
        v = tl.load(c_ptr + _C_CRIT + 2 * i + 1)
        up = tl.where(lip < v, v, lip)  # clamp(min=v): NaN stays
        lip = tl.where((lo <= c) & (hi >= c), up, lip)
    lip = lip * tl.load(c_ptr + _C_MARGIN) + tl.load(c_ptr + _C_FLOOR)
    ga = tl.abs(g) + dg
    err = (lip * dg) * (tl.abs(u) + b_abs) + ga * du
    # activation_magnitude(|h| + dh): |g'| (|u'| + |beta|), then the act_unit term
    mag = tl.abs(ga) * (tl.abs(tl.abs(u) + du) + b_abs)
    dx = err + tl.load(c_ptr + _C_UNIT) * ((tl.abs(x_pre) + mag) + err)
    oi = row64 * I + c64
    tl.store(x_ptr + oi, x_pre, mask=msk)
    tl.store(dx_ptr + oi, dx, mask=msk)


def _resolve(act: str, layout: str, params: dict | None):
    """``(layout, mode, alpha, beta, |beta|, limit or None)`` as the three torch lines read them, or None where
    they raise or the kernel does not cover the case."""
    if act not in SUPPORTED:
        return None
    params = dict(params or {})
    try:
        inspect.signature(ACTIVATIONS[act].function).bind(None, **params)  # as activation_values checks
    except TypeError:
        return None
    lay = "up_gate" if act == "mul_and_silu" else params.pop("layout", layout)
    if lay not in W13_LAYOUTS:  # stage_bounds._split accepts W13_LAYOUTS only ("concatenated" raises)
        return None
    try:
        alpha = float(params.get("alpha", 1.702 if act == "swigluoai" else 1.0))
        beta = 1.0 if act == "swigluoai" else float(params.get("beta", 0.0))
        b_abs = abs(float(params.get("beta", 0.0))) if act == "swiglu_bias" else (1.0 if act == "swigluoai" else 0.0)
        lim = params.get("limit", 7.0 if act in ("swigluoai", "swiglustep") else None)
        if lim is not None:
            lim_t = torch.as_tensor(lim, dtype=torch.float64)
            if lim_t.ndim or not bool(lim_t > 0):  # per-expert arrays: torch path; <= 0 or NaN: it raises
                return None
            lim = float(lim_t)
    except (TypeError, ValueError):
        return None
    return lay, _MODES[act], alpha, beta, b_abs, lim


def gated_silu_stage_t(h, dh, act: str, layout: str, params: dict | None, act_unit: float):
    """``(x_pre, dx)`` float64 ``[..., I]`` of stage 3 (module docstring) for float64 ``h``, ``dh`` ``[..., 2I]``
    of one shape on one device (CUDA; CPU under ``TRITON_INTERPRET=1``), ``layout`` the W13 layout.

    Supported: ``silu_and_mul`` (layout ``"gate_up"``, ``"up_gate"``, ``"interleaved"``, from ``layout`` or
    ``params["layout"]``), ``mul_and_silu`` (always ``"up_gate"``, no params), ``swigluoai``, ``swiglu_bias``,
    ``swiglustep`` (their params, a scalar ``limit`` or none). Returns ``None`` for anything else (another
    activation, the alias ``"concatenated"`` or an unknown layout, invalid or per-expert params, other dtypes
    or shapes): the caller then keeps the torch path (which raises where the inputs are invalid).
    """
    got = _resolve(act, layout, params)
    if got is None or not (isinstance(h, torch.Tensor) and isinstance(dh, torch.Tensor)):
        return None
    lay, mode, alpha, beta, b_abs, lim = got
    if mode == 1 and lim is None:  # swiglustep(limit=None): the torch path raises
        return None
    if (h.dtype != torch.float64 or dh.dtype != torch.float64 or h.shape != dh.shape or h.device != dh.device
            or h.ndim == 0 or h.shape[-1] % 2):
        return None
    n = h.shape[-1] // 2
    out_shape = (*h.shape[:-1], n)
    x_pre = torch.empty(out_shape, dtype=torch.float64, device=h.device)
    dx = torch.empty_like(x_pre)
    r = x_pre.numel() // n if n else 0
    if r == 0:
        return x_pre, dx
    hc = h.contiguous()
    dhc = dh.contiguous()
    c = _consts(h.device, float(act_unit), alpha, beta, b_abs, 0.0 if lim is None else lim)
    s, g0, u0 = {"gate_up": (1, 0, n), "up_gate": (1, n, 0), "interleaved": (2, 0, 1)}[lay]
    bc = min(_BLOCK, triton.next_power_of_2(n))
    br = _BLOCK // bc
    grid = (triton.cdiv(r, br), triton.cdiv(n, bc))
    _gated_silu_kernel[grid](hc, dhc, x_pre, dx, c, r, n, g0, u0, S=s, MODE=mode, HAS_LIM=lim is not None, BR=br,
                             BC=bc, enable_fp_fusion=False)
    return x_pre, dx
