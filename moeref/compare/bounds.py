"""Sound per-element error bounds for a MoE layer computed with a declared arithmetic (a :class:`Profile`).

The reference (:func:`moeref.moe.run_moe`) computes the layer exactly per block, in float64. A
kernel that follows the same semantics but accumulates in lower precision and stores its
intermediates in bf16 differs from it by at most the bound built here. The bound is carried as an
interval, a *center* and a *radius*: the center is the layer recomputed exactly with every declared
store applied (its rounding replayed), the radius what the accumulation order and the evaluation
errors can move the kernel's value away from it. Stage by stage (derivation: docs/error-bounds.md;
``gamma(n, u) = n u / (1 - n u)``, Higham, Accuracy and Stability, Lemma 3.1):

1. **GEMM** (:mod:`moeref.compare.gemm_bounds`, one function per error model): the center is the
   exact product of the center operands; the radius is ``|W| a_radius`` (the operand's own
   uncertainty) plus the arithmetic bound of the profile's ``accum_model``: ``"worst_case"``
   (``coef * |A||B|^T``, any order), ``"contiguous_tree"`` (FP32 accumulation over any tree of
   contiguous K ranges, from the ranges the exact partial sums reach) or ``"data_dependent"`` (the
   Hopper FP8 aligned-adder model, from the products and partial sums).
2. **Declared store** (GEMM outputs, activation output, layer output; :func:`store_interval`). A kernel
   that stores ``v~`` with ``|v~ - v| <= r`` rounded to nearest-even in ``dtype`` stores a value between
   ``rnd(v - r)`` and ``rnd(v + r)`` (rounding is monotone); that interval becomes the new center
   (its midpoint) and radius (its half-width): 0 where it holds no rounding boundary (the stored value
   is known exactly), half a ``dtype`` ulp where it straddles one. A profile without the store's dtype
   bounds it as ``u (|v| + r)`` (any rounding to nearest, or none). A GEMM's bias is in the GEMM's
   interval (``bias_add="epilogue"`` or ``"accumulator_init"``), or added to the stored interval in FP32
   and stored again (``"after_store"``, :func:`_add_bias_after_store`).
3. **Activation**: the Lipschitz bound of the gate function on ``[g - dg, g + dg]``
   (:func:`moeref.compare.stage_bounds.lipschitz_on`) and ``|f(g)| <= |g|`` give, for ``f(g) * up(u)``,
   ``dx <= L dg (|u| + |beta|) + (|g| + dg) du``; ``relu2``: ``dh (2|h| + dh)``. The kernel's own FP32
   evaluation adds ``act_unit (|x| + |g~|(|u~| + |beta|) + dx)`` with ``|g~| <= |g| + dg``
   (:func:`activation_magnitude`); then the activation store (stage 2).
4. **Intermediate re-quantization** (flip-aware, :func:`requant_uncertainty`): the center is the ``a2``
   quantization of the center activation; an element whose interval holds no rounding boundary keeps
   its code (uncertainty: the scale range only), one that straddles gets the reachable neighbour.
5. **GEMM2** on the quantized center with ``a_radius`` the re-quantization uncertainty (stage 1), then
   its store (stage 2); with ``gemm2_weighted_store`` the top-k weight is applied (one FP32 rounding)
   before the store and finalize only sums.
6. **Finalize**: center ``sum_j w_j y_j``; radius ``sum_j |w_j| dy_j + gamma(k + 2, u_red) sum_j |w_j|
   (|y_j| + dy_j)``; shared experts added the same way; the output store (stage 2).

The bound against the reference output is ``|center - output| + radius``. Every term is an upper bound
of what an implementation that follows the declared arithmetic can produce, whatever its summation
order or chunking: honest kernels never fail. A wrong kernel fails wherever its error exceeds that.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..dispatch import weight_and_reduce
from ..gemm.exact import as_operand, block_gemm, in_order_sum
from ..gemm.grouped import ExpertOperands, check_row_expert, expert_rows_gemm
from .gemm_bounds import (
    aligned_adder_gemm_bound,
    contiguous_tree_gemm_bound,
    contiguous_tree_parts,
    gamma,
    gemm_coefficient,
    gemm_error_bound,
    worst_case_gemm_bound,
)
from .operand_radius import exact_radius, radius_dot
from .stage_bounds import activation_error, activation_magnitude, lipschitz_on, requant_uncertainty

__all__ = [
    "Profile",
    "EXACT",
    "FP32_ACCUM",
    "BF16_OUTPUT",
    "HOPPER_FP8_DEEPGEMM",
    "HOPPER_FP8_DEEPGEMM_DATA",
    "DEEPGEMM_FP8_EXACT",
    "PROFILES",
    "STORE_DTYPES",
    "BIAS_ADDS",
    "get_profile",
    "gamma",
    "gemm_coefficient",
    "gemm_error_bound",
    "worst_case_gemm_bound",
    "contiguous_tree_gemm_bound",
    "aligned_adder_gemm_bound",
    "lipschitz_on",
    "activation_error",
    "activation_magnitude",
    "requant_uncertainty",
    "store_interval",
    "LayerBound",
    "layer_bound",
]

U_FP32 = 2.0**-24
U_BF16 = 2.0**-8
ACCUM_MODELS = ("worst_case", "contiguous_tree", "data_dependent", "emulated")
STORE_DTYPES = ("bfloat16", "float16", "float32")
"""Dtypes a :class:`Profile` can declare for a replayed store (round to nearest-even)."""
BIAS_ADDS = ("epilogue", "after_store", "accumulator_init")
"""Where a :class:`Profile` declares the GEMM bias is added (:attr:`Profile.bias_add`)."""


@dataclass(frozen=True)
class Profile:
    """The arithmetic a kernel declares.

    Attributes:
        name, description: labels.
        accum_unit: unit roundoff of the GEMM accumulator between promotions (FP32: ``2^-24``;
            Hopper FP8 WGMMA: ``2^-13``, about 14 bits kept, truncating).
        promote_every: K columns after which partial sums are promoted to FP32 (DeepGEMM: 128);
            None: never (one accumulator over K).
        promote_unit: unit roundoff of the promoted sum, scale products and bias add (FP32).
        gemm_out_unit: rounding of each GEMM output store when ``gemm_out_dtype`` is None (bf16
            ``2^-8``; 0 for none).
        act_unit: relative error of evaluating the activation, and of its store when
            ``act_out_dtype`` is None.
        reduce_unit: unit roundoff of the top-k weighted sum (FP32).
        out_unit: rounding of the output store when ``out_dtype`` is None (bf16 ``2^-8``, FP32 ``2^-24``).
        accum_model: ``"worst_case"`` (:func:`worst_case_gemm_bound`, any summation order),
            ``"contiguous_tree"`` (:func:`contiguous_tree_gemm_bound`: FP32 accumulation over any tree of
            contiguous K ranges or SIMD lanes, from the partial sums reached), ``"data_dependent"``
            (:func:`aligned_adder_gemm_bound`: the Hopper FP8 aligned-adder model; needs
            ``promote_every`` and ``mma_k``), ``"emulated"`` (a known kernel predicted bit for bit: the
            GEMMs are DeepGEMM's FP8 GEMM as :func:`moeref.gemm.hopper_fp8.deepgemm_engine` emulates it,
            with ``promotion_order``; radius 0 where the operand is known, the data-dependent bound plus
            the emulation's distance to the exact product where the re-quantized operand is uncertain).
        mma_k: K columns of one tensor-core MMA (one aligned multi-term addition); Hopper FP8 WGMMA: 32.
        adder_factor: ``contiguous_tree`` only: bound of one add's error in units of ``accum_unit``
            times the largest operand, per column merged (1: IEEE round-to-nearest adds or FMAs; 2.25:
            also truncating tensor-core adders of 9 or more addends).
        gemm_out_dtype, act_out_dtype, out_dtype: declared stores (one of :data:`STORE_DTYPES`,
            round to nearest-even) of each GEMM output (before the top-k weight), of the activation
            output and of the layer output; replayed flip-aware (:func:`store_interval`) instead of
            bounded by their unit. A kernel that declares a store must perform it.
        gemm2_weighted_store: GEMM2's epilogue multiplies its FP32 result by the token's top-k weight
            before the ``gemm_out_dtype`` store, and finalize only sums (vLLM Triton ``fused_moe``:
            ``MUL_ROUTED_WEIGHT``, then ``moe_sum``); False: the unweighted GEMM2 output is stored
            (CUTLASS / ``torch._grouped_mm`` layers, DeepGEMM).
        promotion_order: ``"emulated"`` only: the FP32 promotion (:func:`moeref.gemm.hopper_fp8.promote`):
            ``"deepgemm"`` (``fma(sa*sb, acc, final)``) or ``"a_then_b"`` (our Triton kernel).
        bias_add: where a GEMM's bias (``b13``, ``b2``) enters (:data:`BIAS_ADDS`; no effect on a layer
            without biases). ``"epilogue"``: added in FP32 to the accumulated result before the GEMM
            output store (CUTLASS / Triton epilogues); ``"after_store"``: the GEMM output is stored in
            ``gemm_out_dtype`` first, the bias added to the stored value in FP32 and the sum stored in
            ``gemm_out_dtype`` again (torch ``x @ w.T + b`` on bf16 tensors: the matmul returns bf16, the
            add computes in FP32 and returns bf16; gpt-oss's torch reference, ``einsum(...) + mlp1_bias``);
            ``"accumulator_init"``: the accumulator starts at the bias and the products are added to it
            (``acc = b; acc += a_k w_k``; with ``promote_every``, the FP32 accumulator the promoted chunks
            add into), so every add of the accumulation sees it
            (:func:`moeref.compare.gemm_bounds.contiguous_tree_gemm_bound`; the worst-case and
            aligned-adder bounds hold for the bias in any position of the FP32 sum).
    """

    name: str
    description: str = ""
    accum_unit: float = U_FP32
    promote_every: int | None = None
    promote_unit: float = U_FP32
    gemm_out_unit: float = 0.0
    act_unit: float = 16 * U_FP32
    reduce_unit: float = U_FP32
    out_unit: float = U_FP32
    accum_model: str = "worst_case"
    mma_k: int = 32
    adder_factor: float = 2.25
    gemm_out_dtype: str | None = None
    act_out_dtype: str | None = None
    out_dtype: str | None = None
    gemm2_weighted_store: bool = False
    promotion_order: str = "deepgemm"
    bias_add: str = "epilogue"

    def __post_init__(self):
        if self.accum_model not in ACCUM_MODELS:
            raise ValueError(f"accum_model must be one of {', '.join(map(repr, ACCUM_MODELS))}; "
                             f"got {self.accum_model!r}")
        if int(self.mma_k) < 1:
            raise ValueError(f"mma_k must be >= 1; got {self.mma_k}")
        if self.promote_every is not None and int(self.promote_every) < 1:
            raise ValueError(f"promote_every must be >= 1 or None; got {self.promote_every}")
        if not float(self.adder_factor) >= 1.0:
            raise ValueError(f"adder_factor must be >= 1 (an IEEE add); got {self.adder_factor}")
        for f in ("gemm_out_dtype", "act_out_dtype", "out_dtype"):
            v = getattr(self, f)
            if v is not None and v not in STORE_DTYPES:
                raise ValueError(f"{f} must be None or one of {', '.join(STORE_DTYPES)}; got {v!r}")
        if self.bias_add not in BIAS_ADDS:
            raise ValueError(f"bias_add must be one of {', '.join(map(repr, BIAS_ADDS))}; got {self.bias_add!r}")
        if self.bias_add != "epilogue" and self.accum_model == "emulated":
            raise ValueError(f"bias_add={self.bias_add!r} with accum_model='emulated': the emulated kernels add "
                             "the bias in their epilogue (bias_add='epilogue')")
        if self.bias_add == "after_store" and (self.gemm_out_dtype is None or self.gemm2_weighted_store):
            raise ValueError("bias_add='after_store' needs a declared GEMM output store (gemm_out_dtype; got "
                             f"{self.gemm_out_dtype!r}) and no weighted GEMM2 store (gemm2_weighted_store="
                             f"{self.gemm2_weighted_store})")


EXACT = Profile("EXACT", "float64 reference against itself (only float64 roundings)",
                accum_unit=2.0**-52, promote_unit=2.0**-52, act_unit=2.0**-48, reduce_unit=2.0**-52,
                out_unit=0.0)
FP32_ACCUM = Profile("FP32_ACCUM", "FP32 accumulation over any tree of contiguous K ranges (any order, "
                     "chunking, split-K, SIMD lanes, tensor-core FP32 adders), FP32 intermediates and output",
                     accum_model="contiguous_tree")
BF16_OUTPUT = Profile("BF16_OUTPUT", "FP32 accumulation as FP32_ACCUM; GEMM outputs (before the top-k weight), "
                      "activation and output stored as bf16, round to nearest-even (torch bf16 matmul, CUTLASS "
                      "grouped GEMM layers; vLLM Triton fused_moe weights before its store: "
                      "replace(BF16_OUTPUT, gemm2_weighted_store=True))", accum_model="contiguous_tree", gemm_out_unit=U_BF16,
                      gemm_out_dtype="bfloat16", act_out_dtype="bfloat16", out_unit=U_BF16, out_dtype="bfloat16")
HOPPER_FP8_DEEPGEMM = Profile(
    "HOPPER_FP8_DEEPGEMM",
    "Hopper FP8 WGMMA: ~14-bit accumulation promoted to FP32 every 128 K (DeepGEMM), bf16 GEMM outputs "
    "and output; the activation evaluated in FP32, stored in bf16 or not", accum_unit=2.0**-13,
    promote_every=128, gemm_out_unit=U_BF16, gemm_out_dtype="bfloat16", act_unit=U_BF16 + 16 * U_FP32,
    out_unit=U_BF16, out_dtype="bfloat16")
HOPPER_FP8_DEEPGEMM_DATA = replace(
    HOPPER_FP8_DEEPGEMM, name="HOPPER_FP8_DEEPGEMM_DATA",
    description="HOPPER_FP8_DEEPGEMM with the data-dependent aligned-adder bound (per 32-wide MMA, from the "
    "actual products and partial sums)", accum_model="data_dependent")
DEEPGEMM_FP8_EXACT = replace(
    HOPPER_FP8_DEEPGEMM, name="DEEPGEMM_FP8_EXACT",
    description="DeepGEMM's FP8 grouped GEMM (1x128 x 128x128, FP32 scales) on Hopper, emulated bit for bit "
    "(moeref.gemm.hopper_fp8, calibrated on an H100): bf16 GEMM outputs, activation evaluated in FP32 and "
    "stored in bf16 (a fused activation-quantization kernel: replace(..., act_out_dtype=None)), bf16 output",
    accum_model="emulated", act_unit=16 * U_FP32, act_out_dtype="bfloat16")
PROFILES = {p.name: p for p in (EXACT, FP32_ACCUM, BF16_OUTPUT, HOPPER_FP8_DEEPGEMM, HOPPER_FP8_DEEPGEMM_DATA,
                                DEEPGEMM_FP8_EXACT)}


def get_profile(profile) -> Profile:
    """``profile`` itself when it is a :class:`Profile`, else the profile of that name in
    :data:`moeref.compare.PROFILES` (case-insensitive): the profiles defined here and the kernel profiles
    :mod:`moeref.compare.kernel_profiles` registers (importing any part of :mod:`moeref.compare` imports it).

    >>> get_profile("fp32_accum").name
    'FP32_ACCUM'
    """
    if isinstance(profile, Profile):
        return profile
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a Profile or a profile name; got {type(profile).__name__}")
    key = profile.strip().upper()
    if key not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    return PROFILES[key]


def store_interval(value, radius, dtype: str | None, unit: float = 0.0):
    """One declared store, as an interval: ``(center, radius, may_flip)``.

    ``value``: float64 array, the center of what the kernel holds before the store; ``radius``: float64
    (same shape, >= 0), the bound on the kernel's deviation from it; ``dtype``: one of
    :data:`STORE_DTYPES` (the kernel rounds to nearest-even in it) or None (the store is bounded by
    ``unit (|value| + radius)`` instead and the center stays ``value``).

    Round to nearest is monotone, so the stored ``rnd(v~)`` for ``|v~ - value| <= radius`` lies in
    ``[rnd(value - radius), rnd(value + radius)]``; the result is that interval as its midpoint and
    half-width. Where both ends round alike the radius is exactly 0 (the stored value is known); where
    they straddle a rounding boundary the interval is one ulp of ``dtype`` wide (more for a wide
    input) and ``may_flip`` is set. The rounding is the float64 -> ``dtype`` cast of
    :func:`moeref.moe.round_to_dtype` (ml_dtypes rounds through float32 first: on an FP32 value, as a
    kernel holds it, that is the kernel's rounding; on a float64 value it is still monotone, which is all
    the interval needs). The ends are widened by ``2^-40`` relative for the float64 ``value -+ radius``.

    >>> v = np.array([1.0 + 2**-8 + 2**-12, 1.0 + 2**-9])    # bf16 ulp at 1: 2^-7, tie at 1 + 2^-8
    >>> c, r, f = store_interval(v, np.array([2**-11, 2**-30]), "bfloat16")
    >>> ((c - 1) * 2**8).tolist(), (r * 2**8).tolist(), f.tolist()  # the first straddles, the second is known
    ([1.0, 0.0], [1.0, 0.0], [True, False])
    """
    value = np.asarray(value, dtype=np.float64)
    radius = np.asarray(radius, dtype=np.float64)
    if dtype is None:
        return value, radius + unit * (np.abs(value) + radius), np.zeros(value.shape, dtype=bool)
    if dtype not in STORE_DTYPES:
        raise ValueError(f"dtype must be None or one of {', '.join(STORE_DTYPES)}; got {dtype!r}")
    lo, hi = _store_ends(value, radius, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        center = 0.5 * lo + 0.5 * hi        # exact: both are representable, halving is exact
        half = 0.5 * hi - 0.5 * lo
    bad = ~np.isfinite(half) & np.isfinite(value)
    center = np.where(bad, value, center)
    half = np.where(bad, np.inf, half)
    return center, half, lo != hi


def _store_ends(value, radius, dtype: str):
    """The two ends :func:`store_interval` rounds for a store to ``dtype`` (one of :data:`STORE_DTYPES`):
    ``(rnd(value - wide), rnd(value + wide))``, float64, ``wide`` the radius widened for the float64 evaluation; the
    first nonincreasing and the second nondecreasing in ``radius``."""
    from ..moe.pipeline import round_to_dtype

    with np.errstate(over="ignore", invalid="ignore"):
        wide = radius * (1.0 + 2.0**-40) + np.abs(value) * 2.0**-52
        return round_to_dtype(value - wide, dtype), round_to_dtype(value + wide, dtype)


@dataclass(frozen=True, eq=False)
class LayerBound:
    """``bound``: float64 ``[M, K]`` per-element bound on ``|candidate - reference output|``; ``flips``:
    intermediate elements (GEMM1 and activation stores, re-quantization) whose rounding the declared
    arithmetic may flip; ``center``/``radius``: float64 ``[M, K]``, the replayed layer and the bound on
    a kernel's distance from it (``bound = |center - output| + radius``)."""

    bound: np.ndarray
    flips: int
    center: np.ndarray | None = None
    radius: np.ndarray | None = None


def _rows_error_bound(a, a_radius, row_expert, weights, bias, profile: Profile) -> np.ndarray:
    """:func:`gemm_error_bound` of every row against its expert's weights (the row -> expert map of
    :func:`moeref.gemm.grouped.expert_rows_gemm`), float64 ``[R, N]``, 0 on padding rows."""
    a = as_operand(a, "a")
    w = ExpertOperands(weights)
    b = None if bias is None else np.asarray(bias, dtype=np.float64)
    out = np.zeros((row_expert.size, w[0].shape[0] if len(w) else 0))
    for e in np.unique(row_expert[row_expert >= 0]).tolist():  # a loop over experts
        idx = np.flatnonzero(row_expert == e)
        out[idx] = gemm_error_bound(a.take_rows(idx), w[e], profile,
                                    a_radius=None if a_radius is None else a_radius[idx],
                                    bias=None if b is None else b[e])
    return out


def _rows_gemm_interval(a, a_radius, row_expert, weights, bias, profile: Profile, ends=None):
    """``(center, radius)`` float64 ``[R, N]`` of a GEMM's interval before its store: the center
    :func:`moeref.gemm.grouped.expert_rows_gemm` of ``a`` (with ``bias``), the radius ``_rows_radius_term`` (with
    ``a_radius``) plus :func:`_rows_error_bound`; 0 on padding rows. The same bits, with one pass over the products
    where they coincide: under ``"contiguous_tree"`` the walk's in-order sum is the center wherever
    :func:`moeref.gemm.exact.in_order_sum` holds, and its ``ordered_dot`` of the radius is the radius term wherever
    :func:`moeref.compare.operand_radius.exact_radius` is None (:func:`moeref.compare.operand_radius.radius_dot`).

    ``ends``: optional, for a caller that only stores the interval: ``ends(rows, center, radius)`` -> the two ends
    the store rounds (:func:`_store_ends`, after any elementwise step between) for elements of the rows ``rows``
    (broadcast against ``center``), each
    nondecreasing or each nonincreasing in ``radius``. Under ``"contiguous_tree"`` the radius is then exact where its
    ends depend on it, and elsewhere a value with the same ends: the bound's brackets
    (:func:`moeref.compare.contiguous_tree._contiguous_tree_brackets`, which skip the walks of ``L >= 2``) give the
    same ends (both signs of zero told apart, every bracket finite), so they are the exact radius's ends; the other
    outputs walk the next lane count and are bracketed again, and those still open after every lane count get the
    exact radius (or the whole GEMM is walked where more than :data:`_EXACT_ALL_FROM` of its outputs are open at
    first)."""
    if profile.accum_model != "contiguous_tree":
        center = expert_rows_gemm(a, row_expert, weights, bias)
        bound = _rows_error_bound(a, a_radius, row_expert, weights, bias, profile)
        return center, bound if a_radius is None else _rows_radius_term(a_radius, row_expert, weights) + bound
    a = as_operand(a, "a")
    w = ExpertOperands(weights)
    rows = check_row_expert(row_expert, a.shape[0], len(w))
    b = None if bias is None else np.asarray(bias, dtype=np.float64)
    n = w[0].shape[0] if len(w) else 0
    center = np.zeros((rows.size, n))
    radius = np.zeros((rows.size, n))
    for e in np.unique(rows[rows >= 0]).tolist():  # a loop over experts
        idx = np.flatnonzero(rows == e)
        a_e, r_e = a.take_rows(idx), None if a_radius is None else a_radius[idx]
        b_e = None if b is None else b[e]
        grid = r_e is not None and r_e.shape[1] and n and exact_radius(r_e, w[e]) is not None
        if ends is not None and n:
            c_e, rad = _tree_interval_by_ends(a_e, w[e], r_e, b_e, profile, grid, ends, idx)
        else:
            bound, total, rdot = contiguous_tree_parts(a_e, w[e], profile, a_radius=r_e, bias=b_e)
            c_e = total + 0.0 if in_order_sum(a_e, w[e]) else block_gemm(a_e, w[e])
            if b_e is not None:
                c_e += b_e
            rad = bound
            if r_e is not None:
                if grid:  # radius_dot's grid
                    rdot = radius_dot(r_e, w[e])
                rad = rdot + bound
        center[idx] = c_e
        radius[idx] = rad
    return center, radius


_EXACT_ALL_FROM = 0.5
"""Fraction of a GEMM's outputs whose store ends the first brackets leave open from which :func:`_rows_gemm_interval`
walks the whole GEMM (:func:`contiguous_tree_parts`) instead of those outputs' products gathered."""


def _open_ends(ends, rows, center, lo, hi) -> np.ndarray:
    """Where the radius brackets ``lo <= radius <= hi`` leave the store's ends open (either end differs, a zero's sign
    included, or a bracket is not finite), bool of ``center``'s shape."""
    with np.errstate(invalid="ignore"):
        out = ~(np.isfinite(lo) & np.isfinite(hi))
        for x, y in zip(ends(rows, center, lo), ends(rows, center, hi)):
            out |= ~((x == y) & (np.signbit(x) == np.signbit(y)))
    return out


def _tree_interval_by_ends(a_e, w_e, r_e, b_e, profile: Profile, grid: bool, ends, idx):
    """One expert's ``(center, radius)`` of :func:`_rows_gemm_interval` with ``ends`` (rows ``idx``): the exact
    radius where the brackets' ends differ after every lane count is walked, the upper bracket of the first lane count
    that closes them elsewhere."""
    from .contiguous_tree import _TreeBrackets
    from .gemm_bounds import _checked

    a_c, w_c, radius, b_abs = _checked(a_e, w_e, r_e, b_e)
    tree = _TreeBrackets(a_c, w_c, radius, b_abs, profile)
    center = tree.total + 0.0 if in_order_sum(a_e, w_e) else block_gemm(a_e, w_e)
    if b_e is not None:
        center += b_e
    rdot = radius_dot(r_e, w_e) if grid else None

    def with_rdot(lo, hi, at=None):
        if r_e is None:
            return lo, hi
        if grid:
            rd = rdot if at is None else rdot[at]
            return rd + lo, rd + hi
        return tuple((v if at is None else v[at]) + x for v, x in zip(tree.rdot, (lo, hi)))

    lo, hi = with_rdot(*tree.bounds(1))
    open_ = _open_ends(ends, idx[:, None], center, lo, hi)
    if np.count_nonzero(open_) > _EXACT_ALL_FROM * open_.size:
        bound, _, rdot_all = contiguous_tree_parts(a_e, w_e, profile, a_radius=r_e, bias=b_e)
        return center, bound if r_e is None else (rdot if grid else rdot_all) + bound
    radius = hi

    def settle(mi, ni, lo, hi):
        lo, hi = with_rdot(lo, hi, at=(mi, ni))
        shut = ~_open_ends(ends, idx[mi], center[mi, ni], lo, hi)
        radius[mi[shut], ni[shut]] = hi[shut]
        return shut

    mi, ni, bound, rdot_p = tree.refine(*np.nonzero(open_), settle)
    if mi.size:
        radius[mi, ni] = bound if r_e is None else (rdot[mi, ni] if grid else rdot_p) + bound
    return center, radius


def _add_bias_after_store(stored, radius, row_expert, bias, profile: Profile):
    """``bias_add="after_store"``: the stored GEMM output (interval ``stored`` +- ``radius``, float64
    ``[R, N]``) plus its row's expert bias (``bias`` ``[E, N]``), added in FP32: center ``stored + b``,
    radius ``radius + promote_unit (|stored + b| + radius)`` (one FP32 rounding of the sum); padding rows
    (``row_expert`` -1) stay 0. The caller stores the result again."""
    center = np.array(stored, dtype=np.float64)
    valid = np.asarray(row_expert) >= 0
    center[valid] += np.asarray(bias, dtype=np.float64)[np.asarray(row_expert)[valid]]
    return center, radius + profile.promote_unit * (np.abs(center) + radius)


def _rows_radius_term(radius, row_expert, weights) -> np.ndarray:
    """``radius[r] @ |W[e(r)]|^T`` (the operand's own uncertainty through GEMM2), float64 ``[R, N]``:
    :func:`moeref.compare.operand_radius.radius_dot` (exact chunk sums on the radius's grid, else
    :func:`moeref.compare.summation_order.ordered_dot`'s order), so the device bound gets the same bits."""
    w = ExpertOperands(weights)
    out = np.zeros((row_expert.size, w[0].shape[0] if len(w) else 0))
    for e in np.unique(row_expert[row_expert >= 0]).tolist():  # a loop over experts
        idx = np.flatnonzero(row_expert == e)
        out[idx] = radius_dot(radius[idx], w[e])
    return out


_MAX_ENUMERATED = 4
"""Rows of GEMM2's operand with at most this many elements of uncertain code are emulated for every
combination of their codes; rows with more fall back to the data-dependent bound."""


def _emulated_gemm(a, a_radius, row_expert, weights, bias, profile: Profile, codes=None):
    """``(center, radius)`` of a GEMM of a known kernel (``accum_model="emulated"``): the center is the
    kernel's FP32 result on the center operand, predicted bit for bit
    (:func:`moeref.gemm.hopper_fp8.deepgemm_engine`), plus the bias in FP32 (radius ``u_fp32 |center|``
    for that add, 0 without a bias).

    Where the operand is uncertain (GEMM2: ``a_radius > 0``, the re-quantized intermediate; ``codes`` from
    :func:`requant_uncertainty` with ``detail=True``): the tensor cores see only the element codes, the
    scales enter in the FP32 promotion. A row whose uncertain codes are at most :data:`_MAX_ENUMERATED`,
    each one of two neighbours, is emulated for every combination of them (block accumulators exact);
    the scale range adds ``sum_b |ds_b| |sb_b acc_b| + 2 gamma(S + 2, u_fp32) sum_b s_hi_b |sb_b acc_b|`` (the
    scale difference, and both kernels' promotion roundings). Any other uncertain row gets the distance
    from the center to the exact product, ``|W| a_radius`` and the data-dependent arithmetic bound."""
    from ..gemm.hopper_fp8 import deepgemm_block_accumulators, deepgemm_engine, promote

    eng = deepgemm_engine(promotion=profile.promotion_order)
    center = expert_rows_gemm(a, row_expert, weights, None, gemm=eng)
    radius = np.zeros_like(center)
    rows_all = np.asarray(row_expert)
    if a_radius is not None:
        unsure = (np.asarray(a_radius).max(axis=1, initial=0.0) > 0) & (rows_all >= 0)
        fallback = unsure.copy()
        if codes is not None and unsure.any():
            done = _enumerate_codes(a, codes, rows_all, unsure, weights, profile, center, radius,
                                    deepgemm_block_accumulators, promote)
            fallback &= ~done
        rows_u = np.where(fallback, rows_all, -1)
        if (rows_u >= 0).any():
            exact = expert_rows_gemm(a, rows_u, weights, None)
            data = replace(profile, accum_model="data_dependent")
            far = (np.abs(center - exact) + _rows_radius_term(a_radius, rows_u, weights)
                   + _rows_error_bound(a, a_radius, rows_u, weights, None, data))
            radius = np.where(fallback[:, None], far, radius)
    if bias is not None:
        valid = rows_all >= 0
        center[valid] += np.asarray(bias, dtype=np.float64)[rows_all[valid]]
        radius = radius + profile.promote_unit * (np.abs(center) + radius)
    return center, radius


def _adjacent_e4m3(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``lo < hi`` are neighbouring E4M3 values (no value between them)."""
    import ml_dtypes

    mag = lambda v: (np.abs(v).astype(ml_dtypes.float8_e4m3fn).view(np.uint8) & 0x7F).astype(np.int64)  # noqa: E731
    ml, mh = mag(lo), mag(hi)
    return (((lo >= 0) & (mh - ml == 1)) | ((hi <= 0) & (ml - mh == 1)))


def _enumerate_codes(a, codes, rows_all, unsure, weights, profile, center, radius, block_acc, promote) -> np.ndarray:
    """Fills ``radius`` of the uncertain rows it can enumerate (see :func:`_emulated_gemm`); returns
    their mask."""
    a = as_operand(a, "a")
    w = ExpertOperands(weights)
    lo, hi = codes["code_lo"], codes["code_hi"]
    var = lo != hi
    nvar = var.sum(axis=1)
    ok = unsure & (nvar <= _MAX_ENUMERATED) & np.all(~var | _adjacent_e4m3(lo, hi), axis=1)
    base = a.values  # the center's element values (codes), unscaled
    for e in np.unique(rows_all[ok]).tolist():  # a loop over experts
        idx = np.flatnonzero(ok & (rows_all == e))
        we = w[e]
        k = a.shape[1]
        nb = k // 128
        sa = a.scales[idx] if a.scales.shape[0] == a.shape[0] else np.repeat(a.scales, idx.size, axis=0)
        sb = np.repeat(np.asarray(we.scales, dtype=np.float64), we.block[0], axis=0)[: we.shape[0]]
        ds = (codes["scale_hi"][idx] - codes["scale_lo"][idx]).reshape(idx.size, nb, -1).max(axis=2)
        s_hi = codes["scale_hi"][idx].reshape(idx.size, nb, -1).max(axis=2)
        pos = [np.flatnonzero(var[r]) for r in idx]
        worst = np.zeros((idx.size, we.shape[0]))
        for combo in range(1 << int(nvar[idx].max())):  # <= 2^4 emulations of these rows
            vals = np.array(base[idx], dtype=np.float64)
            for i, p_ in enumerate(pos):  # a loop over this expert's enumerated rows (a few uncertain codes each)
                for j, col in enumerate(p_):
                    vals[i, col] = hi[idx[i], col] if (combo >> j) & 1 else lo[idx[i], col]
            acc = block_acc(vals, we.values)
            y = promote(acc, sa, sb, profile.promotion_order)
            mag = np.abs(acc) * np.abs(sb)[None, :, :]
            scale_term = (_block_sum(mag, ds) + 2 * gamma(nb + 2, profile.promote_unit) * _block_sum(mag, s_hi))
            worst = np.maximum(worst, np.abs(y - center[idx]) + scale_term)
        radius[idx] = worst
    return ok


def _block_sum(mag: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``sum_b mag[r, n, b] * w[r, b]`` in block order from 0 (the order the device emulator sums in,
    :mod:`moeref.compare.device.emulated`: the same bits)."""
    out = np.zeros(mag.shape[:2])
    for b in range(mag.shape[2]):  # a loop over K blocks
        out = out + mag[:, :, b] * w[:, None, b]
    return out


def _chunk_interval(p, e, weights, profile: Profile, cfg) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-token ``(center, radius)`` of one chunk (stages 1-6 without the output store) and the count
    of intermediate elements whose rounding can flip. ``p``/``e``: the chunk's :class:`Prepared` and
    :class:`ExpertsOutput` (only the routing, the quantized input rows and the validity are read: the
    GEMMs are recomputed exactly from the replayed centers)."""
    from ..moe.pipeline import _activation, _run_quantizer

    w13 = ExpertOperands(weights.w13, "w13")
    w2 = ExpertOperands(weights.w2, "w2")
    valid = e.valid
    rows = p.row_expert
    k_out = w2[0].shape[0] if len(w2) else 0
    if not valid.any():
        return np.zeros((p.num_tokens, k_out)), np.zeros((p.num_tokens, k_out)), 0
    act, params, lay = cfg.activation, cfg.activation_params, weights.w13_layout
    flip_0 = None
    # stage 1-2: GEMM1 and its store (bias_add="after_store": stored, the bias added, stored again)
    if profile.accum_model == "emulated":
        h_pre, dh = _emulated_gemm(p.a, None, rows, w13, weights.b13, profile)
    elif profile.bias_add == "after_store" and weights.b13 is not None:
        h0, dh0, flip_0 = store_interval(expert_rows_gemm(p.a, rows, w13, None),
                                         _rows_error_bound(p.a, None, rows, w13, None, profile),
                                         profile.gemm_out_dtype, profile.gemm_out_unit)
        h_pre, dh = _add_bias_after_store(h0, dh0, rows, weights.b13, profile)
    else:
        h_pre, dh = _rows_gemm_interval(p.a, None, rows, w13, weights.b13, profile,
                                        ends=_ends_of(profile.gemm_out_dtype))
    h, dh, flip_h = store_interval(h_pre, dh, profile.gemm_out_dtype, profile.gemm_out_unit)
    if flip_0 is not None:
        flip_h = flip_h | flip_0
    # stage 3: activation, its FP32 evaluation and its store
    x_pre = _activation(act, h, lay, params)
    dx = activation_error(act, h, dh, lay, params)
    dx = dx + profile.act_unit * (np.abs(x_pre) + activation_magnitude(act, np.abs(h) + dh, lay, params) + dx)
    x, dx, flip_x = store_interval(x_pre, dx, profile.act_out_dtype)
    x[~valid] = 0.0
    dx[~valid] = 0.0
    flips = int(np.count_nonzero(flip_h[valid]) + np.count_nonzero(flip_x[valid]))
    # stage 4: re-quantization of the valid rows (padding rows are zero rows of the operand)
    quant = cfg.quant
    codes = None
    if e.a2 is None:
        xq, unc = as_operand(x, "x"), dx
    else:
        vidx = np.flatnonzero(valid)
        xq_valid, qt = _run_quantizer(quant.a2, x[vidx])
        unc = np.zeros_like(dx)
        if profile.accum_model == "emulated":
            unc[vidx], f, det = requant_uncertainty(x[vidx], dx[vidx], quant.a2, qt, detail=True)
            codes = {k: np.zeros_like(dx) for k in det}
            for k_, v in det.items():
                codes[k_][vidx] = v
        else:
            unc[vidx], f = requant_uncertainty(x[vidx], dx[vidx], quant.a2, qt)
        flips += f
        pos = np.full(x.shape[0], -1, dtype=np.int64)
        pos[vidx] = np.arange(vidx.size)
        xq = xq_valid.take_rows(pos)
    # stage 5: GEMM2 and its store
    weigh = p.apply_weights
    w_row = None
    if profile.gemm2_weighted_store and weigh:  # the epilogue weights (one FP32 multiply), then stores
        w_row = np.where(valid, np.asarray(p.topk_weights, np.float64).reshape(-1)[np.maximum(p.src, 0)], 0.0)
    if profile.accum_model == "emulated":
        y_pre, dy = _emulated_gemm(xq, unc, rows, w2, weights.b2, profile, codes)
    elif profile.bias_add == "after_store" and weights.b2 is not None:
        y0, dy0, _ = store_interval(expert_rows_gemm(xq, rows, w2, None),
                                    _rows_radius_term(unc, rows, w2) + _rows_error_bound(xq, unc, rows, w2, None, profile),
                                    profile.gemm_out_dtype, profile.gemm_out_unit)
        y_pre, dy = _add_bias_after_store(y0, dy0, rows, weights.b2, profile)
    else:
        y_pre, dy = _rows_gemm_interval(xq, unc, rows, w2, weights.b2, profile,
                                        ends=_ends_of(profile.gemm_out_dtype, w_row, profile.reduce_unit))
    if w_row is not None:
        y_pre, dy = _weighted(w_row[:, None], y_pre, dy, profile.reduce_unit)
        weigh = False
    y, dy, _ = store_interval(y_pre, dy, profile.gemm_out_dtype, profile.gemm_out_unit)
    y[~valid] = 0.0
    dy[~valid] = 0.0
    # stage 6: top-k weighted sum
    w_abs = np.abs(p.topk_weights)
    center = weight_and_reduce(y, p.src, p.topk_weights, p.num_tokens, apply_weights=weigh, out_dtype=np.float64)
    d_tok = weight_and_reduce(dy, p.src, w_abs, p.num_tokens, apply_weights=weigh, out_dtype=np.float64)
    mag = weight_and_reduce(np.abs(y) + dy, p.src, w_abs, p.num_tokens, apply_weights=weigh, out_dtype=np.float64)
    return center, d_tok + gamma(p.top_k + 2, profile.reduce_unit) * mag, flips


def _weighted(w, y_pre, dy, reduce_unit: float):
    """GEMM2's interval times its rows' top-k weights ``w`` (broadcast against ``y_pre``) in the epilogue (one FP32
    multiply, ``gemm2_weighted_store``), elementwise: ``(w y, |w| dy + reduce_unit (|w y| + |w| dy))``."""
    y_pre, dy = w * y_pre, np.abs(w) * dy
    return y_pre, dy + reduce_unit * (np.abs(y_pre) + dy)


_BRACKETED_STORES = ("bfloat16",)
"""Store dtypes whose GEMM intervals :func:`_rows_gemm_interval` brackets (``ends``): a bf16 ulp is wide against the
contiguous-tree bound, so a small fraction of the stores' ends depend on its exact bits (on the layers of
``bench/studies/bench_layer_bound_cpu.py``, 19 % at K = 512 and 4 % at K = 256 before any walk of ``L >= 2``); an
FP32 or FP16 ulp is not, and their GEMMs would mostly be walked twice."""


def _ends_of(dtype, w_row=None, reduce_unit: float = 0.0):
    """``ends(rows, center, radius)`` of :func:`_rows_gemm_interval` for a store to ``dtype``, after :func:`_weighted`
    by ``w_row`` where given; None (every radius exact) for a store that does not round (``dtype`` None) or one not
    in :data:`_BRACKETED_STORES`."""
    if dtype not in _BRACKETED_STORES:
        return None

    def ends(rows, center, radius):
        if w_row is not None:
            center, radius = _weighted(w_row[rows], center, radius, reduce_unit)
        return _store_ends(center, radius, dtype)

    return ends


def _is_device_run(run) -> bool:
    return type(run).__name__ == "DeviceRun"


def layer_bound(run, profile: Profile | str) -> LayerBound:
    """Per-element bound ``[M, K]`` for a traced reference ``run`` of the NumPy engine
    (:func:`moeref.moe.run_moe`): the layer replayed with ``profile``'s declared stores (center) and its
    radius, stage by stage (module docstring); ``bound = |center - run.output| + radius``. ``profile``: a
    :class:`Profile` or its name in :data:`PROFILES`.

    This is the bound's definition. :func:`moeref.compare.layer_bound` takes a run of either engine and
    bounds a device-engine run (:func:`moeref.moe.run_moe` with ``device=``) on its device
    (:func:`moeref.compare.device.layer.device_layer_bound`: the same bound, bit for bit, as torch tensors);
    given such a run, this function raises TypeError."""
    profile = get_profile(profile)
    if _is_device_run(run):
        raise TypeError("moeref.compare.bounds.layer_bound bounds a run of the NumPy engine; got a DeviceRun "
                        "(run_moe with device=): bound it with moeref.compare.layer_bound, which runs the device "
                        "engine (moeref.compare.device.layer)")
    with np.errstate(invalid="ignore"):
        return assemble_layer_bound(run, profile, _chunk_interval, np.asarray(run.output, dtype=np.float64),
                                    shared_weights=lambda w: w, store=store_interval,
                                    cat=lambda xs: np.concatenate(xs, axis=0), zeros_like=np.zeros_like)


def assemble_layer_bound(run, profile: Profile, chunk_interval, output, *, shared_weights, store, cat,
                         zeros_like) -> LayerBound:
    """The layer's bound from its chunks, as both engines assemble it (the same operations in the same
    order, so the device bound has the NumPy bound's bits): each chunk's ``chunk_interval(p, e, weights,
    profile, config)``, the shared experts' added (one more FP32 add per element, with the routed sum's
    rounding), the output store, ``bound = |center - output| + radius``. ``output``: the run's output in
    float64; ``shared_weights`` puts the shared experts where the engine computes; ``store`` is the
    engine's :func:`store_interval`; ``cat``/``zeros_like`` its row concatenation and zeros."""
    cfg = run.config
    centers, radii, flips = [], [], 0
    for p, e in run.chunks:
        c, r, f = chunk_interval(p, e, run.weights, profile, cfg)
        centers.append(c)
        radii.append(r)
        flips += f
    center = cat(centers) if centers else zeros_like(run.output)
    radius = cat(radii) if radii else zeros_like(run.output)
    if run.shared is not None:
        sw = shared_weights(cfg.shared_experts.as_weights())
        sc, sr = [], []
        for p, e in run.shared_chunks:
            c, r, f = chunk_interval(p, e, sw, profile, cfg)
            sc.append(c)
            sr.append(r)
            flips += f
        center = center + cat(sc)
        radius = radius + cat(sr)
        radius = radius + profile.reduce_unit * 2 * (abs(center) + radius)
    center, radius, _ = store(center, radius, profile.out_dtype, profile.out_unit)
    return LayerBound(abs(center - output) + radius, flips, center, radius)
