"""Bounds of the element-wise stages between the two GEMMs: the activation (Lipschitz on the interval,
:func:`activation_error`, :func:`activation_magnitude`) and the flip-aware re-quantization of the
intermediate (:func:`requant_uncertainty`). Derivations: :mod:`moeref.compare.bounds`, stages 2-3."""
from __future__ import annotations

import math

import numpy as np

from ..activations import ACTIVATIONS

__all__ = ["lipschitz_on", "activation_error", "activation_magnitude", "requant_uncertainty"]


_LIPSCHITZ = {"silu": 1.1, "gelu": 1.13}  # max |silu'| = 1.09984, max |gelu'| = 1.12899 (erf and tanh forms)
# f' of silu (x sigma(x)) and erf-GELU (x Phi(x)) is monotone between its two critical points, where
# |f'| takes these values: (critical point, |f'| there)
_CRITICAL = {"silu": ((-2.3993572805154676, 0.09983933), (2.3993572805154676, 1.09983933)),
             "gelu": ((-math.sqrt(2.0), 0.12890415), (math.sqrt(2.0), 1.12890415))}


def _is_torch(x) -> bool:
    from ..elementary import is_torch

    return is_torch(x)


def _abs(x):
    return x.abs() if _is_torch(x) else np.abs(x)


def _where(c, a, b):
    if _is_torch(c):
        import torch

        return torch.where(c, a, b)
    return np.where(c, a, b)


def _f64(x):
    return x if _is_torch(x) else np.asarray(x, dtype=np.float64)


def _derivative(fam: str, x):
    """``f'`` of silu or erf-GELU from the portable elementary functions (:mod:`moeref.elementary`: the
    same bits on NumPy and torch), NumPy or torch float64."""
    from .. import elementary
    from ..activations import _gelu64

    if fam == "silu":
        s = elementary.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    phi = elementary.divide(elementary.exp(-0.5 * x * x), math.sqrt(2.0 * math.pi))
    with np.errstate(divide="ignore", invalid="ignore"):
        cdf = _where(x == 0, 0.5, _gelu64(x, "none") / _where(x == 0, 1.0, x))
    return cdf + x * phi


def lipschitz_on(fam: str, lo, hi):
    """``sup |f'|`` over ``[lo, hi]`` for ``f = silu`` or erf-GELU (elementwise, NumPy or torch float64): the
    larger of the endpoint values and of the critical values inside the interval, with a 1e-9 relative
    margin.

    >>> lipschitz_on("silu", np.array([-20.0, -1.0]), np.array([-19.0, 3.0])).round(4).tolist()
    [0.0, 1.0998]
    """
    lo, hi = _f64(lo), _f64(hi)
    d_lo, d_hi = _abs(_derivative(fam, lo)), _abs(_derivative(fam, hi))
    out = d_lo.maximum(d_hi) if _is_torch(d_lo) else np.maximum(d_lo, d_hi)
    for c, v in _CRITICAL[fam]:
        up = out.clamp(min=v) if _is_torch(out) else np.maximum(out, v)
        out = _where((lo <= c) & (c <= hi), up, out)
    return out * (1.0 + 1e-9) + 1e-15


def _split(h, layout: str):
    """``(gate, up)`` of the last axis (NumPy or torch views)."""
    from ..activations import W13_LAYOUTS, _norm_layout, _split_axis

    return _split_axis(h, _norm_layout(layout, W13_LAYOUTS, "layout"), -1)


_GATED = {  # name -> (gate family, layout override, |up offset| param)
    "silu_and_mul": ("silu", None, None),
    "mul_and_silu": ("silu", "up_gate", None),
    "gelu_and_mul": ("gelu", None, None),
    "swigluoai": ("silu", None, 1.0),
    "swiglu_bias": ("silu", None, "beta"),
    "swiglustep": ("silu", None, None),
}


def _lipschitz_where_needed(fam: str, alpha: float, g, dg):
    """:func:`lipschitz_on` of ``alpha [g - dg, g + dg]``, NumPy or torch float64; on NumPy 0 instead where ``dg`` is
    0 and ``g`` finite (the constant is finite there and only ever multiplies ``dg``: the same bits, +0.0)."""
    if _is_torch(g):
        return lipschitz_on(fam, alpha * (g - dg), alpha * (g + dg))
    need = (dg != 0) | ~np.isfinite(g)
    if need.all():
        return lipschitz_on(fam, alpha * (g - dg), alpha * (g + dg))
    lip = np.zeros(np.broadcast(g, dg).shape)
    gn, dn = g[need], dg[need]
    lip[need] = lipschitz_on(fam, alpha * (gn - dn), alpha * (gn + dn))
    return lip


def activation_error(name: str, h: np.ndarray, dh: np.ndarray, w13_layout: str, params: dict | None = None) -> np.ndarray:
    """Bound on ``|act(h~) - act(h)|`` for ``|h~ - h| <= dh`` (stage 2), shape of the activation output.

    >>> float(activation_error("relu2_no_mul", np.array([3.0]), np.array([0.5]), "gate_up")[0])
    3.25
    """
    params = dict(params or {})
    h, dh = _f64(h), _f64(dh)
    if name in _GATED:
        fam, lay, beta = _GATED[name]
        lay = lay or params.get("layout", w13_layout)
        g, u = _split(h, lay)
        dg, du = _split(dh, lay)
        b = abs(float(params.get("beta", 0.0))) if beta == "beta" else (beta or 0.0)
        # d/dg [g sigmoid(alpha g)] = silu'(alpha g): the Lipschitz bound on [g - dg, g + dg] is that
        # of silu on alpha [g - dg, g + dg] (clamps only flatten it); tanh-GELU: the global constant
        if fam == "gelu" and params.get("approximate", "none") == "tanh":
            lip = _LIPSCHITZ["gelu"]
        else:
            alpha = float(params.get("alpha", 1.702 if name == "swigluoai" else 1.0))
            lip = _lipschitz_where_needed(fam, alpha, g, dg)
        return lip * dg * (_abs(u) + b) + (_abs(g) + dg) * du
    if name == "relu2_no_mul":
        return dh * (2.0 * _abs(h) + dh)
    if name == "silu_no_mul":
        return lipschitz_on("silu", h - dh, h + dh) * dh
    if name == "gelu_no_mul":
        if params.get("approximate", "none") == "tanh":
            return _LIPSCHITZ["gelu"] * dh
        return lipschitz_on("gelu", h - dh, h + dh) * dh
    raise ValueError(f"no error bound for activation {name!r}; known: {', '.join(ACTIVATIONS)}")


def activation_magnitude(name: str, h: np.ndarray, w13_layout: str, params: dict | None = None) -> np.ndarray:
    """Magnitude against which an activation's own evaluation error is measured: ``|g| (|u| + |beta|)``
    for gated activations, ``|h|`` (``h^2`` for relu2) otherwise. FP32 GELU loses relative accuracy
    where ``1 + erf`` cancels (large negative gates); its error stays below a few ulps of this."""
    params = dict(params or {})
    h = _abs(_f64(h))
    if name in _GATED:
        _, lay, beta = _GATED[name]
        g, u = _split(h, lay or params.get("layout", w13_layout))
        b = abs(float(params.get("beta", 0.0))) if beta == "beta" else (beta or 0.0)
        return g * (u + b)
    return h * h if name == "relu2_no_mul" else h


def _quantize_with(quantizer, x):
    from ..moe.pipeline import _run_quantizer

    return _run_quantizer(quantizer, x)[1]


def requant_uncertainty(x: np.ndarray, dx: np.ndarray, quantizer, qt, *, detail: bool = False):
    """Bound on ``|q~ - q|`` for the re-quantized intermediate (stage 3, flip-aware), and the number
    of elements whose rounding can flip.

    ``x``: float64 ``[R, N]`` the reference's activation output (valid rows), ``dx`` its bound,
    ``quantizer``: the ``a2`` quantizer, ``qt``: the reference's quantized ``x``. ``detail=True`` also
    returns a dict of float64 ``[R, N]`` arrays: ``code_lo``/``code_hi`` (the lowest and highest element
    value, before scaling, a kernel can store), ``scale_lo``/``scale_hi`` (its scale range) and
    ``scale_ref`` (the reference's scale); used by an emulated GEMM that needs the codes themselves.
    """
    from ..formats import round_to_format
    from ..quant.blockwise import expand_to_elements

    x = np.asarray(x, dtype=np.float64)
    dx = np.asarray(dx, dtype=np.float64)
    if x.size == 0:
        z = np.zeros_like(x)
        return (z, 0, dict(code_lo=z, code_hi=z, scale_lo=z, scale_hi=z, scale_ref=z)) if detail else (z, 0)
    scheme = qt.scheme
    fmt = scheme.element_format
    q_ref = qt.dequantize(np.float64)
    s_ref = expand_to_elements(qt.scale_values(), qt.block_shape, qt.shape)
    mag = np.abs(x)
    sign = np.where(x < 0, -1.0, 1.0)
    up = _quantize_with(quantizer, sign * (mag + dx))
    dn = _quantize_with(quantizer, sign * np.maximum(mag - dx, 0.0))
    # widened by 2^-21: a kernel computes the scale in float32 from a float32 amax (one more rounding
    # than the float64 reference's quantizer); every rule is monotone, so this covers it
    s_hi = np.maximum(expand_to_elements(up.scale_values(), up.block_shape, up.shape), s_ref) * (1 + 2.0**-21)
    s_lo = np.minimum(expand_to_elements(dn.scale_values(), dn.block_shape, dn.shape), s_ref) * (1 - 2.0**-21)
    # the candidate's scaled value x~/s~ lies in [t_lo, t_hi] for any s~ in [s_lo, s_hi]
    s_lo_safe = np.where(s_lo > 0, s_lo, s_hi)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ends = np.stack([(x - dx) / s_lo_safe, (x - dx) / s_hi, (x + dx) / s_lo_safe, (x + dx) / s_hi])
    ends = np.where(np.isfinite(ends), ends, 0.0)
    t_lo, t_hi = ends.min(axis=0), ends.max(axis=0)
    # x * fl(1/s) or x / s in FP32 adds at most two roundings: widen by 2^-20 relative
    widen = 2.0**-20 * np.maximum(np.abs(t_lo), np.abs(t_hi)) + 1e-300
    zp = getattr(qt, "zero_points", None)
    if fmt.kind == "int" or zp is not None:
        r_lo, r_hi = np.floor(t_lo - widen), np.ceil(t_hi + widen)
    else:
        nan_code = None if fmt.has_nan else 0
        rounding = scheme.preset.rounding
        r_lo = round_to_format(t_lo - widen, fmt, overflow="saturate", rounding=rounding, nan_code=nan_code)
        r_hi = round_to_format(t_hi + widen, fmt, overflow="saturate", rounding=rounding, nan_code=nan_code)
    # q~ = s~ * code~ is monotone in each factor: its extremes are at the corners
    corners = np.stack([s_lo * r_lo, s_lo * r_hi, s_hi * r_lo, s_hi * r_hi])
    unc = np.abs(corners - q_ref).max(axis=0)
    unc = np.where(np.isfinite(unc), unc, np.inf)
    if detail:
        return unc, int(np.count_nonzero(r_lo != r_hi)), dict(code_lo=r_lo, code_hi=r_hi, scale_lo=s_lo,
                                                               scale_hi=s_hi, scale_ref=s_ref)
    return unc, int(np.count_nonzero(r_lo != r_hi))
