"""The regime check of a whole layer: :func:`layer_in_exact_regime`, from the values of the reference's trace stage
by stage, or from the :class:`RegimeCertificate` that :func:`moeref.regimes.exact_layer` attaches to a layer it
built (what its construction proves, bound to the layer's arrays). The layers themselves:
:mod:`moeref.regimes.layer`, which re-exports the public names.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..activations import activation_values, split_w13
from ..gemm.grouped import ExpertOperands, expert_rows_gemm
from ..moe.pipeline import round_to_dtype
from .arithmetic import Arithmetic, get_arithmetic
from .checker import RegimeCheck, in_exact_regime, lsb_exponents, significant_bits

__all__ = ["RegimeCertificate", "layer_in_exact_regime"]

# ExactLayer, in the annotations below, is moeref.regimes.layer's (which imports this module).

_BF16 = np.dtype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------------------------------ certificate


@dataclass(frozen=True, eq=False)
class RegimeCertificate:
    """What :func:`exact_layer`'s construction proves about a layer it built, from its parameters (module
    docstring; docs/exact-regimes.md, "Checks at speed"), so that :func:`layer_in_exact_regime` need not
    recompute it from the values. Every ratio is an upper bound, over all outputs, of ``S / Q``: the sum of
    the magnitudes of the terms over a whole K (so of every partial sum, in every order, split and
    promotion interval) divided by the smallest term's lowest set bit.

    Attributes:
        gemm1_ratio, gemm2_ratio: the bound for GEMM1 and GEMM2 (an accumulator of ``p`` bits is exact when
            ``log2(ratio) <= p``).
        y_ratio: the largest ``|y|`` of a token's GEMM2 outputs (every expert, every column) over the lowest set
            bit of any of them: with the top-k weights' own ratio and the slot count, it bounds the FP32 top-k sum.
        invariant_stores: the optional stores (``"gemm1"``, ``"act"``, ``"gemm2"``) that round nothing.
        act_values: float64, the exact activation values that are not saturated (GELU probes,
            SwiGLU-OAI's clamped gate), rounded by the declared ``act_out_dtype`` store; empty when none.
        binding: the identities of the layer's arrays, weights and config, and ``token_arrays``: copies of
            the bit patterns of the token-sized arrays (``hidden``, ``topk_ids``, ``topk_weights``; one more
            ``hidden`` in memory). A layer whose arrays were replaced or edited no longer matches, and the
            check reads its values. The weights are bound by identity only (comparing their codes would cost
            as much as the check it replaces).
    """

    gemm1_ratio: float
    gemm2_ratio: float
    y_ratio: float
    invariant_stores: tuple
    act_values: np.ndarray
    binding: tuple
    token_arrays: tuple


def _binding(lay) -> tuple:
    w = lay.weights
    shared = lay.config.shared_experts
    return (id(lay.hidden), id(lay.topk_ids), id(lay.topk_weights), id(lay.config), id(w),
            tuple(id(x) for x in w.w13), tuple(id(x) for x in w.w2), id(w.b13), id(w.b2),
            None if shared is None else (id(shared.w13), id(shared.w2)))


def _token_arrays(lay) -> tuple:
    """Bit-pattern copies of the token-sized arrays (``hidden``, ``topk_ids``, ``topk_weights``): comparing them
    is exact (no hash collisions) and faster than hashing."""
    out = []
    for arr in (lay.hidden, lay.topk_ids, lay.topk_weights):
        a = np.ascontiguousarray(arr)
        out.append(a.view(np.dtype(f"u{a.dtype.itemsize}")).copy() if a.dtype.itemsize in (1, 2, 4, 8) else a.copy())
    return tuple(out)


def _same_token_arrays(lay, saved: tuple) -> bool:
    for arr, kept in zip((lay.hidden, lay.topk_ids, lay.topk_weights), saved):
        a = np.ascontiguousarray(arr)
        if a.dtype.itemsize in (1, 2, 4, 8):
            a = a.view(np.dtype(f"u{a.dtype.itemsize}"))
        if a.shape != kept.shape or a.dtype != kept.dtype or not np.array_equal(a, kept):
            return False
    return True


def _certify(lay: ExactLayer, gemm1_ratio: float, gemm2_ratio: float, y_ratio: float, invariant_stores: tuple,
            act_values=np.zeros(0)) -> RegimeCertificate:
    """A :class:`RegimeCertificate` with these bounds, bound to ``lay``'s arrays (for a generator's proof)."""
    return RegimeCertificate(float(gemm1_ratio), float(gemm2_ratio), float(y_ratio), tuple(invariant_stores),
                             np.asarray(act_values, np.float64), _binding(lay), _token_arrays(lay))


def _certified(layer: ExactLayer, ar: Arithmetic) -> bool:
    """True when ``layer``'s certificate proves it in the regime of ``ar``; False: read the values."""
    cert = layer.certificate
    if (not isinstance(cert, RegimeCertificate) or cert.binding != _binding(layer)
            or not _same_token_arrays(layer, cert.token_arrays)):
        return False
    cfg = layer.config
    declared = {"gemm1": cfg.gemm1_out_dtype, "act": cfg.act_out_dtype, "gemm2": cfg.gemm2_out_dtype}
    optional = {s for s in ar.optional_stores if declared.get(s) is None}
    if not optional <= set(cert.invariant_stores) or ar.accumulator not in ("fp32", "hopper_fp8", "fp8_unpromoted"):
        return False
    if ar.gemm_store not in (None, "bfloat16", "float32"):  # float16's range: the values decide
        return False
    bits = 24 if ar.accumulator == "fp32" else ar.mma_bits
    if np.log2(cert.gemm1_ratio) > bits or np.log2(cert.gemm2_ratio) > bits:
        return False
    if cert.act_values.size:
        if cfg.act_out_dtype is None:
            return False
        _, same = _robust_round(cert.act_values, np.zeros(cert.act_values.shape, bool),
                                ar.activation_ulps * 2.0**-24, lambda v: round_to_dtype(v, cfg.act_out_dtype))
        if not same:
            return False
    # the top-k sum in FP32: powers-of-two weights; slots x y ratio x weight ratio within 24 bits
    ids, tw = np.asarray(layer.topk_ids), np.asarray(layer.topk_weights, np.float64)
    w = tw[(ids >= 0) & (tw != 0)]
    if cfg.shared_experts is not None:
        w = np.append(w, 1.0)
    if w.size == 0:
        return True
    if not np.all(np.isfinite(w)) or np.any(significant_bits(w) != 1):
        return False
    slots = ids.shape[1] + (cfg.shared_experts is not None)
    ratio = slots * cert.y_ratio * float(np.abs(w).max() / np.abs(w).min())
    return bool(np.log2(ratio) <= 24)


# ------------------------------------------------------------------------------------------ checker


def _robust_round(v: np.ndarray, exact: np.ndarray, delta: float, fn) -> tuple[np.ndarray, bool]:
    """``fn(v)`` and whether every value rounds the same at ``v (1 -+ delta)`` (exact values unperturbed)."""
    r = fn(v)
    lo = fn(np.where(exact, v, v * (1 - delta)))
    hi = fn(np.where(exact, v, v * (1 + delta)))
    same = np.array_equal(r, lo, equal_nan=True) and np.array_equal(r, hi, equal_nan=True)
    return r, same


def _saturated(name: str, h: np.ndarray, layout: str, params: dict) -> np.ndarray:
    """Where the activation's transcendental part is exactly 1 or 0 in every faithful float32/float64
    evaluation (gate >= 40 for SiLU/GELU; gate <= -750, or gate exactly 0, for all three)."""
    g, _ = split_w13(h, layout, axis=-1) if name != "mul_and_silu" else split_w13(h, "up_gate", axis=-1)
    hi = g >= 40.0 if name in ("silu_and_mul", "gelu_and_mul") else np.zeros(g.shape, bool)
    return hi | (g <= -750.0) | (g == 0.0)


def layer_in_exact_regime(layer: ExactLayer, arithmetic="fp32", *, run=None, from_values: bool = False) -> RegimeCheck:
    """Whether ``layer`` (an :class:`ExactLayer`) is in the exact regime of ``arithmetic``, and why not.

    Stage by stage, from the values of the reference's own trace: GEMM1 and GEMM2 with
    :func:`moeref.regimes.in_exact_regime` per expert; the GEMM1 bias addition exact in FP32; the
    activation and the ``a2`` re-quantization identical on every path a conforming kernel may take
    (with or without each of ``arithmetic.optional_stores`` not declared by the config; the float64 value
    and any float32 evaluation within ``activation_ulps`` where the activation is not saturated); the
    GEMM2 output exact in bf16 when its store is optional; the top-k weighted sum and the shared experts
    exact in FP32 in any order. Then every stage's result, and the output's single rounding, are the
    same for every such kernel.

    A layer :func:`exact_layer` built carries its :class:`RegimeCertificate`: when the certificate proves the
    layer in the regime of ``arithmetic`` (and the layer's arrays are still the ones it was built with), the
    answer comes from it in O(tokens x top-k), without a reference run. Otherwise (and with
    ``from_values=True``) every stage is checked from the values; ``run``: the layer's traced NumPy reference
    run (:meth:`ExactLayer.reference`) when you have it, so it is not computed twice.
    """
    ar = get_arithmetic(arithmetic)
    if layer.excluded_stores:
        ar = ar.with_(optional_stores=tuple(x for x in ar.optional_stores if x not in layer.excluded_stores))
    cfg = layer.config
    if not from_values and _certified(layer, ar):
        return RegimeCheck(True, [])
    run = layer.reference() if run is None else run
    reasons: list = []
    delta = ar.activation_ulps * 2.0**-24
    parts = [(run.chunks, layer.weights, "routed")]
    if run.shared_chunks:
        parts.append((run.shared_chunks, cfg.shared_experts.as_weights(), "shared"))
    for chunks, weights, what in parts:
        w13 = ExpertOperands(weights.w13, "w13")
        for ci, (p, eo) in enumerate(chunks):
            tag = f"{what} chunk {ci}"
            ws13 = list(weights.w13)  # the raw objects: experts sharing one are checked in one pass
            ok, why = in_exact_regime((p.a, ws13, p.row_expert), ar)
            reasons += [f"GEMM1 ({tag}) {r}" for r in why]
            valid = p.row_expert >= 0
            if not valid.any():
                continue
            if weights.b13 is None:  # the GEMM1 output the run kept (after the declared store, which
                h = np.asarray(eo.h, np.float64)  # _activation_paths applies again, idempotent): no second GEMM
            else:
                c = expert_rows_gemm(p.a, p.row_expert, w13)
                h = c if weights.b13 is None else c + np.asarray(weights.b13, np.float64)[np.maximum(p.row_expert, 0)]
            if weights.b13 is not None:
                h32 = c.astype(np.float32) + np.asarray(weights.b13, np.float32)[np.maximum(p.row_expert, 0)]
                if not np.array_equal(h32.astype(np.float64)[valid], h[valid]):
                    reasons.append(f"GEMM1 bias ({tag}): the FP32 sum of product and bias is not exact")
            reasons += _activation_paths(layer, ar, h[valid], delta, tag)
            ws2 = list(weights.w2)
            ok, why = in_exact_regime((eo.xq, ws2, p.row_expert), ar)
            reasons += [f"GEMM2 ({tag}) {r}" for r in why]
            if "gemm2" in ar.optional_stores and cfg.gemm2_out_dtype is None:  # a declared store is made
                y = eo.y[valid]
                if not np.array_equal(round_to_dtype(y, "bfloat16"), y):
                    bad = int(np.argmax(round_to_dtype(y, "bfloat16") != y))
                    reasons.append(f"GEMM2 output ({tag}): {y.reshape(-1)[bad]!r} is not exact in bf16, "
                                   "so a kernel that stores it before the top-k sum differs")
    reasons += _finalize_check(layer, run)
    return RegimeCheck(not reasons, reasons)


def _activation_paths(layer: ExactLayer, ar: Arithmetic, h: np.ndarray, delta: float, tag: str) -> list:
    """The activation and a2 re-quantization on every allowed path must give the same bits."""
    cfg = layer.config
    name, layout, params = cfg.activation, layer.weights.w13_layout, cfg.activation_params
    g1 = [cfg.gemm1_out_dtype] if cfg.gemm1_out_dtype is not None else (
        [None, "bfloat16"] if "gemm1" in ar.optional_stores else [None])
    act = [cfg.act_out_dtype] if cfg.act_out_dtype is not None else (
        [None, "bfloat16"] if "act" in ar.optional_stores else [None])
    if cfg.quant.a2 is None and cfg.act_out_dtype is None:
        return [f"activation ({tag}): no a2 quantizer and no declared act_out_dtype: the reference feeds "
                "GEMM2 float64 activations a kernel cannot hold"]
    results = {}
    for g_store in g1:
        hh = round_to_dtype(h, g_store)
        x = activation_values(name, hh, layout, params)
        exact = _saturated(name, hh, layout, params) & (x.astype(np.float32).astype(np.float64) == x)
        for a_store in act:
            def through(v, a_store=a_store):
                v = round_to_dtype(v, a_store) if a_store is not None else v.astype(np.float32).astype(np.float64)
                if cfg.quant.a2 is None:
                    return v
                src = v.astype(_BF16) if a_store is not None else v.astype(np.float32)
                q = cfg.quant.a2(src)
                return np.concatenate([q.element_values().reshape(-1), q.scale_values().reshape(-1)])

            r, same = _robust_round(x, exact, delta, through)
            if not same:
                return [f"activation ({tag}): a float32 evaluation within {ar.activation_ulps} ulps of the "
                        f"activation can round differently (GEMM1 store {g_store}, activation store {a_store})"]
            results[(g_store, a_store)] = r
    vals = list(results.values())
    if any(not np.array_equal(vals[0], v, equal_nan=True) for v in vals[1:]):
        return [f"activation ({tag}): the stores {list(results)} give different re-quantized intermediates"]
    return []


def _finalize_check(layer: ExactLayer, run) -> list:
    """The top-k weighted sum (and shared experts) must be exact in FP32 in any order."""
    m = layer.hidden.shape[0]
    if m == 0 or not run.chunks:
        return []
    terms = []
    start = 0
    for p, eo in run.chunks:
        mt = p.num_tokens
        kk = p.top_k
        slot_y = np.zeros((mt * kk, eo.y.shape[1]))
        ok = p.src >= 0
        slot_y[p.src[ok]] = eo.y[ok]
        w = np.asarray(p.topk_weights, np.float64).reshape(-1, 1) if p.apply_weights else 1.0
        terms.append((slot_y * w).reshape(mt, kk, -1))
        start += mt
    t = np.concatenate(terms, axis=0)
    if run.shared is not None:
        t = np.concatenate([t, run.shared[:, None, :]], axis=1)
    lsb = lsb_exponents(t).min(axis=1)
    s = np.maximum(np.maximum(t, 0).sum(axis=1), np.maximum(-t, 0).sum(axis=1))
    with np.errstate(divide="ignore"):
        excess = np.where(s > 0, np.log2(np.where(s > 0, s, 1.0)) - lsb - 24, -np.inf)
    if np.any(excess > 0):
        tok, col = np.unravel_index(int(np.argmax(excess)), excess.shape)
        return [f"finalize: the top-k sum of token {tok}, column {col} spans {excess[tok, col] + 24:.2f} bits "
                "(FP32 keeps 24)"]
    return []
