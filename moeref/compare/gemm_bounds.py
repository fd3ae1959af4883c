"""Per-element bounds on the arithmetic error of one GEMM ``C = A @ W.T (+ bias)``, one function per
error model (:func:`gemm_error_bound` picks the one a :class:`moeref.compare.Profile` declares):

* :func:`worst_case_gemm_bound` (``accum_model="worst_case"``): ``coef * (|A||W|^T + |bias|)``, any
  summation order (Higham's ``gamma``);
* :func:`contiguous_tree_gemm_bound` (``accum_model="contiguous_tree"``): FP32 accumulation over any
  tree whose nodes sum contiguous K ranges (or SIMD lanes of them), bounded from the ranges the
  exact partial sums actually reach, so a random-sign sum is not bounded as if every term had one sign;
* :func:`aligned_adder_gemm_bound` (``accum_model="data_dependent"``): the Hopper FP8 tensor-core
  model (aligned multi-term adder per 32-wide MMA, promotion to FP32 every 128 columns), computed
  from the actual products and partial sums.

Every function takes validated operands (:class:`moeref.gemm.exact.BlockOperand`), the profile, the
optional operand radius ``a_radius`` float ``[M, K]`` and ``|bias|`` float ``[N]``, and returns float64
``[M, N]``. The bounds are vectorised NumPy over rows, columns and K (row blocks only cap memory).

The models live in their own modules, re-exported here: :mod:`moeref.compare.contiguous_tree` (the contiguous-tree
walks) and :mod:`moeref.compare.aligned_adder` (the aligned-adder recurrence); :func:`gamma` and the float64 unit
``U_F64`` in :mod:`moeref.compare.summation_order`, beside the declared summation order the bounds sum in.
"""
from __future__ import annotations

import numpy as np

from ..gemm.exact import BlockOperand, as_operand
from .aligned_adder import (  # noqa: F401  (re-exported: the aligned-adder model's pieces)
    NO_EXPONENT,
    AdderOperands,
    AdderSetup,
    adder_exact,
    adder_form,
    adder_operands,
    adder_rows,
    adder_setup,
    adder_step_sums,
    adder_summaries,
    aligned_adder_gemm_bound,
    step_exponents,
    step_maxima,
)
from .contiguous_tree import TREE_LANES, _contiguous_tree, contiguous_tree_gemm_bound
from .summation_order import ORDER_CHUNK, ORDER_STEP, U_F64, grouped_columns  # noqa: F401  (their home)
from .summation_order import gamma, ordered_dot

__all__ = [
    "gamma",
    "gemm_coefficient",
    "gemm_error_bound",
    "worst_case_gemm_bound",
    "contiguous_tree_gemm_bound",
    "aligned_adder_gemm_bound",
    "contiguous_tree_parts",
    "TREE_LANES",
]

U_FP32 = 2.0**-24


def num_k_blocks(a: BlockOperand, w: BlockOperand) -> int:
    """Scale blocks along K of the finer of the two operands' K blockings."""
    k = a.values.shape[1]
    bk = max(1, min(a.block[1], w.block[1], max(k, 1)))
    return -(-k // bk)


def gemm_coefficient(profile, k: int, num_k_blocks: int = 1) -> float:
    """``coef`` of the worst-case model: ``|C~ - C| <= coef * (|A||B|^T + |bias|)`` (bounds module
    docstring, stage 1)."""
    c = k if profile.promote_every is None else min(profile.promote_every, k)
    c = max(c, 1)
    # c products + one aligned-adder term per 32-wide MMA + the final add: see the module docstring
    g_acc = gamma(c + -(-c // 32) + 1, profile.accum_unit)
    n_prom = -(-k // c) + num_k_blocks + 3
    return g_acc + (1.0 + g_acc) * gamma(n_prom, profile.promote_unit)


def gemm_error_bound(a, w, profile, *, a_radius=None, bias=None) -> np.ndarray:
    """Bound on the arithmetic error of ``C = A @ W.T (+ bias)`` computed as ``profile`` declares,
    float64 ``[M, N]``: validates the inputs and calls the function of ``profile.accum_model``.

    ``a``: ``[M, K]`` and ``w``: ``[N, K]`` operands (:func:`moeref.gemm.exact.as_operand` input);
    ``a_radius``: optional float ``[M, K]`` (>= 0): the kernel multiplies some ``A~`` with
    ``|A~ - A| <= a_radius`` elementwise (the uncertain re-quantized intermediate of GEMM2); the bound
    covers the arithmetic error of ``A~ @ W.T`` for every such ``A~`` (the operand difference itself,
    ``a_radius @ |W|.T``, is not included); ``bias``: optional float ``[N]``.

    >>> from moeref.compare.bounds import PROFILES
    >>> hop = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    >>> a = np.array([[1.0, 1.0, 0.0]]); w = np.array([[1.0, -1.0, 0.0]])
    >>> round(float(gemm_error_bound(a, w, hop)[0, 0]) / 2.0**-13, 4)  # 2 products, M = 1: 2 * 2 u_acc
    4.001
    """
    a, w, radius, b_abs = _checked(a, w, a_radius, bias)
    models = {"worst_case": worst_case_gemm_bound, "contiguous_tree": contiguous_tree_gemm_bound,
              "data_dependent": aligned_adder_gemm_bound}
    if profile.accum_model not in models:
        raise ValueError(f"accum_model must be one of {sorted(models)}; got {profile.accum_model!r}")
    return models[profile.accum_model](a, w, profile, radius, b_abs)


def _checked(a, w, a_radius, bias):
    """:func:`gemm_error_bound`'s inputs validated: ``(a, w, radius, |bias|)`` (operands, float64 radius or None,
    float64 ``[N]``)."""
    a = as_operand(a, "a")
    w = as_operand(w, "w")
    m, k = a.values.shape
    n = w.values.shape[0]
    if w.values.shape[1] != k:
        raise ValueError(f"a has K={k} columns but w has K={w.values.shape[1]}")
    b_abs = np.zeros(n) if bias is None else np.abs(np.asarray(bias, dtype=np.float64)).reshape(-1)
    if b_abs.shape != (n,):
        raise ValueError(f"bias must have shape ({n},); got {np.shape(bias)}")
    radius = None
    if a_radius is not None:
        radius = np.asarray(a_radius, dtype=np.float64)
        if radius.shape != (m, k):
            raise ValueError(f"a_radius must have the shape of a, ({m}, {k}); got {radius.shape}")
        if np.any(radius < 0):
            raise ValueError("a_radius must be >= 0")
    return a, w, radius, b_abs


def contiguous_tree_parts(a, w, profile, *, a_radius=None, bias=None):
    """:func:`gemm_error_bound` under ``accum_model="contiguous_tree"`` with two by-products of its walk, the
    same inputs: ``(bound, total, radius_dot)``, float64 ``[M, N]`` each. ``total``: ``sum_k a_k w_k`` of the
    dequantized operands, in K order from the first product (every add rounded; the last prefix sum of the walk of
    ``L = 1``); ``radius_dot``: :func:`moeref.compare.summation_order.ordered_dot` of ``a_radius`` and ``|W|``
    (None without a radius). A caller that needs either (the GEMM's in-order sum, the operand's own uncertainty)
    takes it from here instead of computing it again."""
    if profile.accum_model != "contiguous_tree":
        raise ValueError(f"contiguous_tree_parts needs accum_model='contiguous_tree'; got {profile.accum_model!r}")
    return _contiguous_tree(*_checked(a, w, a_radius, bias), profile)


def worst_case_gemm_bound(a: BlockOperand, w: BlockOperand, profile, radius, b_abs) -> np.ndarray:
    """``coef * ((|A| + a_radius) |W|^T + |bias|)`` with ``coef`` of :func:`gemm_coefficient`: any
    summation order, any chunking (one rounding per add, or 33 ``u_acc`` per 32-wide aligned MMA)."""
    coef = gemm_coefficient(profile, a.values.shape[1], num_k_blocks(a, w))
    a_abs = np.abs(a.dequantize()) + (0.0 if radius is None else radius)
    return coef * (ordered_dot(a_abs, np.abs(w.dequantize())) + b_abs[None, :])
