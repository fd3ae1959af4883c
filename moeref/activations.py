"""MoE activations (gated and non-gated) and the three layouts of the fused gate/up weight W13.

Every function takes NumPy (or torch CPU) floating input, computes in float64 and returns float64
for float64 input, float32 otherwise. Inputs are never modified (vLLM's ``relu2_no_mul`` mutates its
input in place; these do not). Definitions: vLLM
``model_executor/layers/activation.py`` and the fused-MoE activation kernels, cited per function.

Gated activations read ``x[..., 2N]`` (the output of the W13 GEMM) and return ``[..., N]``. Which
element is the gate and which is the up projection depends on how W13 was laid out, so the gated
functions take ``layout``:

* ``"gate_up"`` (alias ``"concatenated"``): gate = ``x[..., :N]``, up = ``x[..., N:]``.
  vLLM w13 ``[w1; w3]``, ``SiluAndMul``, ``SWIGLUOAI_UNINTERLEAVE``.
* ``"up_gate"``: up = ``x[..., :N]``, gate = ``x[..., N:]``. FlashInfer CUTLASS ``w31`` = ``[w3; w1]``.
* ``"interleaved"``: gate = ``x[..., 0::2]``, up = ``x[..., 1::2]``. gpt-oss, triton_kernels,
  vLLM ``SWIGLUOAI``.

Swapping the halves gives a different (wrong) answer silently: SGLang PR #32430 (NVFP4 W13
``[gate;up]`` vs FlashInfer ``[up;gate]``, GSM8K 0% -> 93.9%), NVIDIA/Megatron-LM PR #6045; vLLM
PR #44893, ROCm/ATOM PR #885, SGLang PR #26884 (interleaved vs concatenated SwiGLU for gpt-oss,
GSM8K ~ 0). The W13 converters below never guess a layout: ``src_layout``/``dst_layout``/``layout``
have no defaults.
"""
from __future__ import annotations

import inspect
import math
from typing import Callable, NamedTuple

import numpy as np

from . import _interop, elementary
from ._checks import as_float_array, check_choice

__all__ = [
    "W13_LAYOUTS",
    "ACTIVATION_LAYOUTS",
    "GELU_APPROXIMATIONS",
    "sigmoid",
    "silu",
    "gelu",
    "silu_and_mul",
    "mul_and_silu",
    "gelu_and_mul",
    "swigluoai",
    "swiglu_bias",
    "swiglustep",
    "relu2_no_mul",
    "silu_no_mul",
    "gelu_no_mul",
    "ActivationSpec",
    "ACTIVATIONS",
    "activation_values",
    "apply_activation",
    "split_w13",
    "join_w13",
    "convert_w13",
    "split_w13_bias",
    "join_w13_bias",
    "convert_w13_bias",
]

W13_LAYOUTS = ("gate_up", "up_gate", "interleaved")
"""Layouts of the fused gate/up axis (weights ``[E, 2N, K]`` along axis -2, biases ``[E, 2N]``)."""
ACTIVATION_LAYOUTS = (*W13_LAYOUTS, "concatenated")
"""Accepted ``layout`` values of gated activations; ``"concatenated"`` is an alias of ``"gate_up"``."""
GELU_APPROXIMATIONS = ("none", "tanh")


# ------------------------------------------------------------------ dtype policy and primitives


def _prepare(x, name: str = "x") -> tuple[np.ndarray, np.dtype]:
    """float64 working copy of ``x`` and the output dtype (float64 in -> float64, else float32)."""
    a = as_float_array(x, name)
    out_dtype = np.dtype(np.float64) if a.dtype == np.float64 else np.dtype(np.float32)
    return np.array(a, dtype=np.float64, copy=True), out_dtype


def _sigmoid64(z):
    """Stable logistic on float64 (NumPy or torch): only ``exp(-|z|)`` is evaluated (no overflow);
    the portable ``exp`` of :mod:`moeref.elementary`, so both engines give the same bits."""
    return elementary.sigmoid(z)


def _silu64(g):
    return g * _sigmoid64(g)


def _gelu64(g, approximate: str):
    check_choice(approximate, GELU_APPROXIMATIONS, "approximate")
    if approximate == "tanh":  # torch.nn.functional.gelu(approximate="tanh")
        return 0.5 * g * (1.0 + elementary.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * (g * g * g))))  # g*g*g, not pow: the same bits on every engine
    return 0.5 * g * (1.0 + elementary.erf(elementary.divide(g, math.sqrt(2.0))))


def _minimum(x, lim):
    """``min(x, lim)`` elementwise (``lim`` a float or an array broadcastable to ``x``)."""
    if elementary.is_torch(x):
        import torch

        return torch.minimum(x, torch.as_tensor(lim, dtype=x.dtype, device=x.device))
    return np.minimum(x, lim)


def _clip_sym(x, lim):
    """``clip(x, -lim, lim)`` elementwise."""
    if elementary.is_torch(x):
        import torch

        t = torch.as_tensor(lim, dtype=x.dtype, device=x.device)
        return torch.maximum(torch.minimum(x, t), -t)
    return np.clip(x, -lim, lim)


def _gated_core(name: str, g, u, params: dict):
    """The gated activations on float64 ``gate``/``up`` arrays (NumPy or torch), one definition for
    both engines; ``params`` are the public functions' keyword arguments (defaults filled in there)."""
    if name == "silu_and_mul":
        return _silu64(g) * u
    if name == "gelu_and_mul":
        return _gelu64(g, params.get("approximate", "none")) * u
    if name in ("swigluoai", "swiglu_bias"):
        alpha = float(params.get("alpha", 1.702 if name == "swigluoai" else 1.0))
        beta = 1.0 if name == "swigluoai" else float(params.get("beta", 0.0))
        lim = _check_limit(params.get("limit", 7.0 if name == "swigluoai" else None))
        if lim is not None:
            g = _minimum(g, lim)
            u = _clip_sym(u, lim)
        if name == "swigluoai":
            return (u + beta) * g * _sigmoid64(alpha * g)
        return g * _sigmoid64(alpha * g) * (u + beta)
    if name == "swiglustep":
        lim = _check_limit(params.get("limit", 7.0))
        return _minimum(_silu64(g), lim) * _clip_sym(u, lim)
    raise ValueError(f"{name!r} is not a gated activation")


def _plain_core(name: str, h, params: dict):
    """The non-gated activations on a float64 array (NumPy or torch)."""
    if name == "relu2_no_mul":
        r = h.clamp(min=0.0) if elementary.is_torch(h) else np.maximum(h, 0.0)
        return r * r
    if name == "silu_no_mul":
        return _silu64(h)
    if name == "gelu_no_mul":
        return _gelu64(h, params.get("approximate", "none"))
    raise ValueError(f"{name!r} is not a non-gated activation")


def sigmoid(x) -> np.ndarray:
    """Stable logistic ``1 / (1 + exp(-x))`` (no overflow warning for any finite ``x``).

    >>> sigmoid(np.array([-1e4, 0.0, 1e4])).tolist()
    [0.0, 0.5, 1.0]
    """
    a, dt = _prepare(x)
    return _sigmoid64(a).astype(dt)


def silu(x) -> np.ndarray:
    """``x * sigmoid(x)`` (SiLU / swish, torch ``F.silu``), stable sigmoid."""
    a, dt = _prepare(x)
    return _silu64(a).astype(dt)


def gelu(x, approximate: str = "none") -> np.ndarray:
    """GELU: ``0.5 x (1 + erf(x / sqrt 2))`` (``"none"``) or the tanh form (``"tanh"``), as torch.

    The erf form is evaluated as written (like torch), so for ``x << 0`` the ``1 + erf`` cancels and
    the error is absolute, about ``|x| * 1e-16``, not relative.
    """
    a, dt = _prepare(x)
    return _gelu64(a, approximate).astype(dt)


# ------------------------------------------------------------------ W13 layouts


def _norm_layout(layout, accepted, name: str) -> str:
    check_choice(layout, accepted, name)
    return "gate_up" if layout == "concatenated" else layout


def _two_n(w: np.ndarray, axis: int, name: str) -> tuple[int, int]:
    if w.ndim == 0:
        raise ValueError(f"{name} must have at least 1 dimension; got a scalar")
    if not -w.ndim <= axis < w.ndim:
        raise ValueError(f"axis {axis} is out of range for {name} of shape {w.shape}")
    axis = axis % w.ndim
    two_n = w.shape[axis]
    if two_n % 2:
        raise ValueError(f"{name} axis {axis} must have even length 2N (gate and up); got shape {w.shape}")
    return axis, two_n // 2


def split_w13(w, layout: str, axis: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """Split a fused gate/up tensor into ``(gate, up)`` along ``axis`` (views, no copy).

    Args:
        w: any array (weights ``[E, 2N, K]``, packed bytes, scales ...); dtype is kept.
        layout: one of ``"gate_up"``, ``"up_gate"``, ``"interleaved"`` (no default: never guessed).
        axis: the 2N axis (-2 for ``[E, 2N, K]`` weights; -1 for biases and GEMM outputs; -3 for
            gpt-oss ``*_blocks [E, 2N, K/32, 16]``).

    >>> import numpy as np
    >>> w = np.arange(4).reshape(4, 1)
    >>> [a.ravel().tolist() for a in split_w13(w, "interleaved")]
    [[0, 2], [1, 3]]
    >>> [a.ravel().tolist() for a in split_w13(w, "up_gate")]
    [[2, 3], [0, 1]]
    """
    layout = _norm_layout(layout, W13_LAYOUTS, "layout")
    return _split_axis(np.asarray(_interop.to_numpy(w)), layout, axis)


def _split_axis(a, layout: str, axis: int):
    """:func:`split_w13` on an array of either kind (NumPy or torch: views of ``a``)."""
    axis, n = _two_n(a, axis, "w")
    index = [slice(None)] * a.ndim

    def take(sl):
        index[axis] = sl
        return a[tuple(index)]

    if layout == "gate_up":
        return take(slice(0, n)), take(slice(n, 2 * n))
    if layout == "up_gate":
        return take(slice(n, 2 * n)), take(slice(0, n))
    return take(slice(0, 2 * n, 2)), take(slice(1, 2 * n, 2))


def join_w13(gate, up, layout: str, axis: int = -2) -> np.ndarray:
    """Fuse ``gate`` and ``up`` (same shape) into one tensor in ``layout`` along ``axis`` (new array).

    >>> import numpy as np
    >>> join_w13(np.array([[0], [2]]), np.array([[1], [3]]), "interleaved").ravel().tolist()
    [0, 1, 2, 3]
    """
    layout = _norm_layout(layout, W13_LAYOUTS, "layout")
    g, u = np.asarray(_interop.to_numpy(gate)), np.asarray(_interop.to_numpy(up))
    if g.shape != u.shape:
        raise ValueError(f"gate and up must have the same shape; got {g.shape} and {u.shape}")
    if g.ndim == 0 or not -g.ndim <= axis < g.ndim:
        raise ValueError(f"axis {axis} is out of range for gate of shape {g.shape}")
    if layout == "gate_up":
        return np.concatenate([g, u], axis=axis)
    if layout == "up_gate":
        return np.concatenate([u, g], axis=axis)
    axis = axis % g.ndim
    stacked = np.stack([g, u], axis=axis + 1)  # [..., N, 2, ...]
    return stacked.reshape(*g.shape[:axis], 2 * g.shape[axis], *g.shape[axis + 1:])


def convert_w13(w, src_layout: str, dst_layout: str, axis: int = -2) -> np.ndarray:
    """Re-lay a fused gate/up tensor from ``src_layout`` to ``dst_layout`` (both required).

    A pure row permutation along ``axis``; dtype kept, always a new array.

    >>> import numpy as np
    >>> w = np.array([[10], [11], [20], [21]])       # [gate0, gate1, up0, up1] ("gate_up")
    >>> convert_w13(w, "gate_up", "interleaved").ravel().tolist()
    [10, 20, 11, 21]
    >>> convert_w13(w, "gate_up", "up_gate").ravel().tolist()
    [20, 21, 10, 11]
    """
    gate, up = split_w13(w, src_layout, axis)
    return join_w13(gate, up, dst_layout, axis)


def split_w13_bias(b, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`split_w13` for biases ``[E, 2N]`` (axis -1)."""
    return split_w13(b, layout, axis=-1)


def join_w13_bias(gate, up, layout: str) -> np.ndarray:
    """:func:`join_w13` for biases ``[E, N]`` -> ``[E, 2N]`` (axis -1)."""
    return join_w13(gate, up, layout, axis=-1)


def convert_w13_bias(b, src_layout: str, dst_layout: str) -> np.ndarray:
    """:func:`convert_w13` for biases ``[E, 2N]`` (axis -1)."""
    return convert_w13(b, src_layout, dst_layout, axis=-1)


def _gate_up(x, layout) -> tuple[np.ndarray, np.ndarray, np.dtype]:
    a, dt = _prepare(x)
    layout = _norm_layout(layout, ACTIVATION_LAYOUTS, "layout")
    g, u = split_w13(a, layout, axis=-1)
    return g, u, dt


def _check_limit(limit, name: str = "limit"):
    if limit is None:
        return None
    lim = np.asarray(limit, dtype=np.float64)
    if np.any(np.isnan(lim)) or np.any(lim <= 0):
        raise ValueError(f"{name} must be > 0 (or None for no clamp); got {limit!r}")
    return lim


# ------------------------------------------------------------------ gated activations


def silu_and_mul(x, layout: str = "gate_up") -> np.ndarray:
    """``silu(gate) * up`` over ``x[..., 2N]`` -> ``[..., N]`` (vLLM ``SiluAndMul``: gate first).

    >>> silu_and_mul(np.array([0.0, 1.0, 5.0, 3.0])).tolist()   # gate = [0, 1], up = [5, 3]
    [0.0, 2.193176...]
    """
    g, u, dt = _gate_up(x, layout)
    return _gated_core("silu_and_mul", g, u, {}).astype(dt)


def mul_and_silu(x) -> np.ndarray:
    """``x[..., :N] * silu(x[..., N:])`` (vLLM ``MulAndSilu``) = :func:`silu_and_mul` with ``"up_gate"``."""
    return silu_and_mul(x, layout="up_gate")


def gelu_and_mul(x, approximate: str = "none", layout: str = "gate_up") -> np.ndarray:
    """``gelu(gate, approximate) * up`` (vLLM ``GeluAndMul``; MoE ``GELU`` = erf, ``GELU_TANH`` = tanh).

    Note: vLLM's ROCm ``forward_native`` silently swapped tanh for erf; here ``approximate`` is obeyed.
    """
    g, u, dt = _gate_up(x, layout)
    return _gated_core("gelu_and_mul", g, u, {"approximate": approximate}).astype(dt)


def swigluoai(x, alpha: float = 1.702, limit: float = 7.0, layout: str = "interleaved") -> np.ndarray:
    """gpt-oss SwiGLU: ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``,
    ``out = (u + 1) * g * sigmoid(alpha * g)``.

    Defaults follow HF gpt-oss / triton_kernels ``swiglu_torch`` (alpha 1.702, limit 7.0, interleaved
    gate = even, up = odd). vLLM ``SWIGLUOAI_UNINTERLEAVE`` is ``layout="concatenated"``.

    >>> swigluoai(np.array([1.0, 0.5, 9.0, 9.0])).round(6).tolist()  # pairs (gate, up)
    [1.268694, 55.999625]
    """
    g, u, dt = _gate_up(x, layout)
    return _gated_core("swigluoai", g, u, {"alpha": alpha, "limit": limit}).astype(dt)


def swiglu_bias(x, *, layout: str, alpha: float = 1.0, beta: float = 0.0, limit: float | None = None) -> np.ndarray:
    """FlashInfer CUTLASS SwiGLU with (alpha, beta, limit): ``g = min(gate, limit)``,
    ``u = clip(up, -limit, limit) + beta``, ``out = g * sigmoid(alpha * g) * u``.

    ``limit=None`` means no clamp. FlashInfer tests use ``(alpha, beta, limit)`` in
    ``{(0.5, 0, 7), (1.702, 1, 7)}``; ``(1.702, 1, 7)`` equals :func:`swigluoai`. ``layout`` is
    required: FlashInfer's CUTLASS W13 is ``[up; gate]`` (``"up_gate"``) while gpt-oss checkpoints
    are ``"interleaved"``.

    >>> x = np.array([1.0, 0.5, 9.0, 9.0])
    >>> bool(np.allclose(swiglu_bias(x, layout="interleaved", alpha=1.702, beta=1.0, limit=7.0), swigluoai(x)))
    True
    """
    g, u, dt = _gate_up(x, layout)
    return _gated_core("swiglu_bias", g, u, {"alpha": alpha, "beta": beta, "limit": limit}).astype(dt)


def swiglustep(x, limit: float = 7.0, layout: str = "gate_up") -> np.ndarray:
    """``min(silu(gate), limit) * clip(up, -limit, limit)`` (vLLM ``SwigluStepAndMul``, FlashInfer
    ``ActivationType.SwigluStep``). ``limit`` may be an array broadcastable to the output (per-expert).

    >>> swiglustep(np.array([10.0, -9.0])).tolist()  # silu(10) = 9.9995 -> 7; up -9 -> -7
    [-49.0]
    """
    g, u, dt = _gate_up(x, layout)
    return _gated_core("swiglustep", g, u, {"limit": limit}).astype(dt)


# ------------------------------------------------------------------ non-gated activations


def relu2_no_mul(x) -> np.ndarray:
    """``relu(x)^2`` (non-gated; W1 is ``[E, N, K]``). Does NOT modify ``x`` (vLLM's does, in place)."""
    a, dt = _prepare(x)
    return _plain_core("relu2_no_mul", a, {}).astype(dt)


def silu_no_mul(x) -> np.ndarray:
    """``silu(x)`` as a non-gated MoE activation (vLLM)."""
    return silu(x)


def gelu_no_mul(x, approximate: str = "none") -> np.ndarray:
    """``gelu(x)`` as a non-gated MoE activation (vLLM)."""
    return gelu(x, approximate)


# ------------------------------------------------------------------ registry


class ActivationSpec(NamedTuple):
    """Registry entry: the function and whether it is gated (``x[..., 2N] -> [..., N]``)."""

    function: Callable[..., np.ndarray]
    gated: bool


ACTIVATIONS: dict[str, ActivationSpec] = {
    "silu_and_mul": ActivationSpec(silu_and_mul, True),
    "mul_and_silu": ActivationSpec(mul_and_silu, True),
    "gelu_and_mul": ActivationSpec(gelu_and_mul, True),
    "swigluoai": ActivationSpec(swigluoai, True),
    "swiglu_bias": ActivationSpec(swiglu_bias, True),
    "swiglustep": ActivationSpec(swiglustep, True),
    "relu2_no_mul": ActivationSpec(relu2_no_mul, False),
    "silu_no_mul": ActivationSpec(silu_no_mul, False),
    "gelu_no_mul": ActivationSpec(gelu_no_mul, False),
}


def activation_values(name: str, h, w13_layout: str, params: dict | None = None):
    """The activation ``name`` of float64 GEMM1 outputs ``h [..., 2N]`` (gated) or ``[..., N]``, as
    NumPy or torch (any device) float64, with the gate/up split of ``w13_layout`` unless ``params``
    names a ``layout`` (``mul_and_silu`` is always ``"up_gate"``). The same definition as the public
    functions above (:func:`apply_activation` on float64 input gives the same bits), written once for
    both engines of the MoE reference (:mod:`moeref.moe.pipeline`, :mod:`moeref.moe.cuda`).

    >>> activation_values("silu_and_mul", np.array([[0.0, 1.0, 5.0, 3.0]]), "gate_up").round(6).tolist()
    [[0.0, 2.193176]]
    """
    check_choice(name, tuple(ACTIVATIONS), "activation")
    spec = ACTIVATIONS[name]
    params = dict(params or {})
    inspect.signature(spec.function).bind(None, **params)  # TypeError for an unknown parameter
    if not spec.gated:
        return _plain_core(name, h, params)
    layout = "up_gate" if name == "mul_and_silu" else params.pop("layout", w13_layout)
    g, u = _split_axis(h, _norm_layout(layout, ACTIVATION_LAYOUTS, "layout"), -1)
    return _gated_core("silu_and_mul" if name == "mul_and_silu" else name, g, u, params)


def apply_activation(name: str, x, **params) -> np.ndarray:
    """Look ``name`` up in :data:`ACTIVATIONS` and apply it with ``params``.

    >>> apply_activation("relu2_no_mul", np.array([-2.0, 3.0])).tolist()
    [0.0, 9.0]
    >>> apply_activation("swish", np.zeros(2))
    Traceback (most recent call last):
    ...
    ValueError: unknown activation 'swish'; accepted: 'silu_and_mul', ...
    """
    check_choice(name, tuple(ACTIVATIONS), "activation")
    return ACTIVATIONS[name].function(x, **params)
