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
from ..gemm.exact import as_operand
from ..gemm.grouped import ExpertOperands, expert_rows_gemm
from .emulated_gemm import _emulated_gemm
from .gemm_bounds import (
    aligned_adder_gemm_bound,
    contiguous_tree_gemm_bound,
    gamma,
    gemm_coefficient,
    gemm_error_bound,
    worst_case_gemm_bound,
)
from .gemm_intervals import (
    _add_bias_after_store,
    _ends_of,
    _rows_error_bound,
    _rows_gemm_interval,
    _rows_radius_term,
    _weighted,
)
from .stage_bounds import activation_error, activation_magnitude, lipschitz_on, requant_uncertainty
from .stores import STORE_DTYPES, store_interval

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
            ``"deepgemm"`` (``fma(sa*sb, acc, final)``: DeepGEMM, and our Triton and Gluon FP8 block
            GEMMs) or ``"a_then_b"`` (``fma(acc*sa, sb, final)``).
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
                                        ends=_ends_of(profile.gemm_out_dtype, exact_center=False))
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
                                        ends=_ends_of(profile.gemm_out_dtype, w_row, profile.reduce_unit,
                                                      exact_center=False))
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
