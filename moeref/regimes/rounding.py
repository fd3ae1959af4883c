"""Single-rounding regimes: exact sums that the declared store must round, so that the faults an exact regime
cannot see become visible by equality.

On the exact regimes of :mod:`moeref.regimes.layer` a bf16 accumulator is exact (small integer sums) and a
round-toward-zero store is exact (exact values), so neither shows. :func:`rounding_gemm` makes GEMM inputs
that stay exact in FP32 (in any order: :func:`moeref.regimes.in_exact_regime` accepts them under ``"fp32"``)
but whose sums need 12 to 13 significant bits:

* every sum lies in ``[2^11, 2^13)`` with quantum 1, so the bf16 store (8 bits) discards 4 or 5 bits: a
  round-toward-zero store differs from round-to-nearest-even wherever RNE rounds up (about half of the
  outputs), and a bf16 (8-bit) or fp16 (11-bit) accumulator loses the small terms once the running sum
  passes ``2^11`` (a one-store-vs-two difference shows the same way: storing a partial result in bf16 and
  adding to it is a second rounding);
* ``ties=True``: every sum is exactly a bf16 midpoint (``4096 + 16 + 32 i``), so RNE, round-half-away
  and round-toward-zero stores all differ somewhere, while every FP32 accumulation order gives the same
  exact value and every RNE store the same bits.

The construction: column 0 is ``64 x 64 = 4096`` for every output; ``ties=False`` adds small random integer
terms (``|a|, |w| <= 4`` over ``k - 1 <= 127`` columns, at most 2032 in magnitude); ``ties=True`` adds one
term ``1 x (16 + 32 i)``, ``i`` in 0..3.

:func:`single_rounding_layer` does the same for a whole fused-MoE layer: GEMM1's bf16 store, the FP8
re-quantization (or bf16's activation store) and the bf16 output each round an exact value once, GEMM2's
output goes unrounded into the FP32 top-k sum (or, with ``gemm2_store="bfloat16"``, is rounded once at its
declared bf16 store and the top-k sum of the stored values stays exact), and every conforming order still
gives the reference's bits. :func:`single_rounding_stores` says which variant a declared profile admits.
"""
from __future__ import annotations

import numpy as np

from .._checks import check_positive_int
from .layer import _anchor_columns

__all__ = ["rounding_gemm", "round_toward_zero_bf16", "round_half_away_bf16", "single_rounding_layer",
           "single_rounding_stores", "ROUNDING_LAYER_SCHEMES", "ROUNDING_LAYER_ACTIVATIONS", "GEMM2_STORES"]


def rounding_gemm(m: int, n: int, k: int, *, ties: bool = False, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """``(a [m, k], w [n, k])`` float32 (bf16-exact) whose products ``a @ w.T`` are exact in FP32 and need
    a rounding at a bf16 store (module docstring). ``k`` in 2..128.

    >>> a, w = rounding_gemm(2, 3, 2, ties=True)
    >>> (a.astype(np.float64) @ w.T.astype(np.float64)).tolist()[0][:1][0] in (4112.0, 4144.0, 4176.0, 4208.0)
    True
    """
    m = check_positive_int(m, "m")
    n = check_positive_int(n, "n")
    k = check_positive_int(k, "k")
    if not 2 <= k <= 128:
        raise ValueError(f"k must be in 2..128 (sums stay in [2^11, 2^13)); got {k}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    a = np.zeros((m, k))
    w = np.zeros((n, k))
    a[:, 0] = 64.0
    w[:, 0] = 64.0
    if ties:
        a[:, 1] = 1.0
        w[:, 1] = 16.0 + 32.0 * rng.integers(0, 4, size=n)
    else:
        a[:, 1:] = rng.integers(-4, 5, size=(m, k - 1))
        w[:, 1:] = rng.integers(-4, 5, size=(n, k - 1))
    return a.astype(np.float32), w.astype(np.float32)


def round_toward_zero_bf16(x) -> np.ndarray:
    """float64 values of ``x`` (float32-exact) rounded toward zero to bf16: the low 16 bits of the FP32
    pattern cut (a truncating store, the fault model)."""
    f = np.asarray(x, dtype=np.float32)
    return (f.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)


def round_half_away_bf16(x) -> np.ndarray:
    """float64 values of ``x`` (float32-exact) rounded to nearest bf16, ties away from zero."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x8000) & 0xFFFF0000).astype(np.uint32)
    return r.view(np.float32).astype(np.float64)


# ------------------------------------------------------------------------------------------ whole layer

ROUNDING_LAYER_SCHEMES = ("bf16", "fp8_1x128", "fp8_1x128_ue8m0", "fp8_per_token")
"""Schemes of :func:`single_rounding_layer` (those of :data:`moeref.regimes.LAYER_SCHEMES` but MXFP4 W4A16, whose
32-element blocks cannot hold the up rows' large and small weights under one scale)."""
ROUNDING_LAYER_ACTIVATIONS = ("silu_and_mul", "gelu_and_mul")
GEMM2_STORES = (None, "bfloat16")
"""GEMM2 output stores of :func:`single_rounding_layer`: None (FP32 into the top-k sum, ``excluded_stores=("gemm2",)``)
or ``"bfloat16"`` (one declared RNE store before the top-k sum, ``config.gemm2_out_dtype``)."""

_UP_FIRST, _UP_MID, _UP_LAST = 4.0, 16.0, 224.0  # up rows: 448 * 4 + 8 * 16 + 8 * 224 = 3712 (columns 0, 1, -1)
_UP_SMALL = 32  # small terms per up row: t * w with |t| <= 2, |w| <= 2
_ANCHOR_GATE2, _ANCHOR_UP2 = 32.0, 16.0  # anchor x = (8 * 32) * (448 * 16) = 448 * 4096
_W2_BIG = 16.0
_W2_SMALL = 8


def _rounding_expert(rng, k: int, n: int, *, scheme, group1: int, group2: int, bf16_gates: bool,
                     off_fraction: float):
    """One expert's real ``gate [n, k]``, ``up [n, k]``, ``w2 [k, n]``, block-scale exponents and (zero) up
    bias for :func:`single_rounding_layer` (its docstring has the values). The gate and up values do not depend
    on their 128x128 block scale ``2^s`` (``s`` in 0..1: the FP8 element is the value over it); ``w2``'s do
    (times ``2^s2``, ``s2`` in -1..1)."""
    br, bk = (128, 128) if scheme is None else scheme.resolve_block((n, k))
    nb_rows, nb_cols = -(-n // br), -(-k // bk)
    s_gate = rng.integers(0, 2, size=(nb_rows, nb_cols))
    s_up = rng.integers(0, 2, size=(nb_rows, nb_cols))
    rows = np.arange(n)
    on = rng.random(n) >= off_fraction
    gate = np.zeros((n, k))
    if bf16_gates:  # g = 448 * 2^k * {1/8, 1/4, 1/2}: three significant bits, so x = g u needs the act store
        gate[:, 0] = np.where(on, np.array([0.125, 0.25, 0.5])[rng.integers(0, 3, size=n)], -2.0)
    else:  # g = 8 * 2^k * {8, 16, 32}: powers of two, so x = g u is exact in bf16
        gate[:, 1] = np.where(on, np.array([8.0, 16.0, 32.0])[rng.integers(0, 3, size=n)], 0.0)
        gate[~on, 0] = -2.0
    up = np.zeros((n, k))
    sign = rng.choice(np.array([-1.0, 1.0]), size=n)
    up[:, 0] = sign * _UP_FIRST  # 448 * 4 = 1792 at the start of K ...
    up[:, 1] = sign * _UP_MID  # ... 8 * 16 = 128 ...
    up[:, k - 1] = sign * _UP_LAST  # ... and 8 * 224 = 1792 at its end: 3712, a midpoint of E4M3 codes (below)
    free = np.setdiff1d(np.arange(k), np.concatenate([_anchor_columns(k, group1), [1, k - 1]]))
    if free.size:
        cols = free[rng.integers(0, free.size, size=(n, _UP_SMALL))]  # a repeated column keeps one term
        vals = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size=cols.shape)
        up[np.repeat(rows, cols.shape[1]), cols.reshape(-1)] = vals.reshape(-1)
    anchors2 = _anchor_columns(n, group2)
    gate[anchors2, :] = 0.0
    gate[anchors2, 1] = _ANCHOR_GATE2
    up[anchors2, :] = 0.0
    up[anchors2, 0] = _ANCHOR_UP2
    # w2 [k, n]: a large weight on intermediate column 0 (the anchor) and small ones elsewhere, per 128x128
    # block times 2^s2
    br2, bk2 = (128, 128) if scheme is None else scheme.resolve_block((k, n))
    s2 = rng.integers(-1, 2, size=(-(-k // br2), -(-n // bk2)))
    w2 = np.zeros((k, n))
    w2[:, 0] = rng.choice(np.array([-_W2_BIG, _W2_BIG]), size=k)
    free2 = np.setdiff1d(np.arange(n), anchors2)
    if free2.size:
        c2 = free2[rng.integers(0, free2.size, size=(k, _W2_SMALL))]
        v2 = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size=c2.shape)
        w2[np.repeat(np.arange(k), c2.shape[1]), c2.reshape(-1)] = v2.reshape(-1)
    w2 *= np.ldexp(1.0, np.repeat(np.repeat(s2, br2, axis=0)[:k], bk2, axis=1)[:, :n])
    return gate, up, w2, (s_gate, s_up, s2), np.zeros(n)


def single_rounding_layer(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                          scheme: str = "fp8_1x128", activation: str = "silu_and_mul", seed=0, topk_ids=None,
                          topk_weights=None, shared_experts: bool = False, token_exponents=(0, 1),
                          off_fraction: float = 0.125, expert_pool: int | None = None, gemm2_store: str | None = None,
                          **options):
    """A whole fused-MoE layer whose every declared store rounds an exact value once, and rounds it for real.

    On :func:`~moeref.regimes.exact_layer`'s layers every stage is exact, so a kernel that truncates (RZ) at
    a store, accumulates in bf16 or stores GEMM2's output in bf16 before the top-k sum gives the reference's
    bits all the same. Here every partial sum is still exact in FP32 (any order, split-K) and in Hopper's FP8
    accumulator (every 128 K), but the values need more bits than the stores keep:

    * **GEMM1, declared bf16 store** (``gemm1_out_dtype="bfloat16"``). Tokens as in ``exact_layer``
      (``|t| <= 2`` times ``2^k``, ``448 * 2^k`` in the first column of every 128, ``8 * 2^k`` in column 1). Up
      rows: ``+-(448 * 4 + 8 * 16 + 8 * 224) * 2^k = +-3712 * 2^k`` from columns 0, 1 and the last one (also
      ``8 * 2^k`` here), plus 32 small terms ``t * (+-1, +-2)``: ``|u| / 2^k`` in ``[3584, 3840]``, an integer of
      12 bits that the bf16 store rounds to 8 (step 16). With large terms at both ends of K, a bf16
      accumulator loses the small terms whether it runs forward or backward. Gates read one column:
      ``{64, 128, 256} * 2^k`` (powers of two) for FP8 schemes, ``{56, 112, 224} * 2^k`` (three bits) for bf16;
      one in eight is ``-896 * 2^k`` (output exactly 0). Every gate saturates SiLU and GELU (``|g| >= 40``).
    * **The intermediate.** FP8 schemes: ``x = g * bf16(u)`` has 8 bits (exact in bf16, so the optional
      activation store changes nothing); an anchor per 128-column group (gate ``256 * 2^k``, up ``7168 * 2^k``,
      ``x = 448 * 4096 * 4^k``, above every other ``|x| <= 256 * 3840 * 4^k``) makes each group's scale
      ``2^(12 + 2k)`` exactly, and the E4M3 codes are one RNE rounding of ``x / 2^j`` (8 bits to 4). The up
      values straddle 3712, where ``x / 2^j`` is the midpoint between two E4M3 codes (3584 and 3840 times
      ``g / 2^j``): a change of one bf16 step in ``u`` (a GEMM1 store rounded the wrong way, a bf16
      accumulator) moves the code, where 3584 (a code itself, half a code step from either boundary) would
      hide it. bf16: ``x`` has up to 11 bits, and the declared bf16 activation store rounds it once.
    * **GEMM2, no store** (``gemm2_store=None``, the default). Each ``w2`` row has ``+-16`` on the anchor column
      and 8 small weights ``+-1, +-2``, times a power-of-two 128x128 block scale ``2^s2`` (``s2`` in -1..1): ``y``
      needs up to 13 significant bits, exact in FP32 and in the 14-bit FP8 accumulator (FP8 schemes), and goes
      into the FP32 top-k sum unrounded: the layer's declared arithmetic has no GEMM2 store
      (``excluded_stores=("gemm2",)``), so a kernel that stores ``y`` in bf16 first rounds twice.
    * **GEMM2, declared bf16 store** (``gemm2_store="bfloat16"``: ``config.gemm2_out_dtype``, the arithmetic of
      DeepGEMM pipelines and of CUTLASS / torch bf16 layers, ``Profile.gemm_out_dtype``). The same ``y``, exact
      before the store, is rounded once by it (RNE, 13 bits to 8: a round-toward-zero store differs wherever
      RNE rounds up); the stored values are multiples of the same quantum as ``y`` (rounding to a coarser grid
      keeps them so) and at most twice as large, so their weighted top-k sum stays exact in FP32 in any order,
      and the output store rounds it once. A kernel that skips the store (FP32 into the sum) now rounds at
      another point and differs.
    * **The output, declared bf16 store.** Top-k weights ``2^-e``: the weighted sum (and a shared expert) is
      exact in FP32 in any order and needs more than 8 bits; the bf16 store rounds it once.

    Every conforming kernel (FP32 or FP8-promoted accumulation in any order, split-K, any top-k order or token
    chunking, with or without the optional activation store) gives the reference's bits; a kernel that rounds
    toward zero (or half away from zero) at any of the rounding stores, accumulates either GEMM in bf16 in K
    order (per column, per 16-column tile or per 128-column K block), or makes a GEMM2 store the layer does not
    declare (or skips the one it declares) does not (tests/test_regimes_single_rounding.py,
    tests/test_regimes_single_rounding_gemm2.py). What it cannot separate is in docs/exact-regimes.md.

    Args: as :func:`~moeref.regimes.exact_layer` (``scheme`` one of :data:`ROUNDING_LAYER_SCHEMES`,
    ``activation`` one of :data:`ROUNDING_LAYER_ACTIVATIONS`; ``hidden`` at least 32; no biases). Tokens as
    ``exact_layer``'s, with their last column ``8 * 2^k`` too. ``gemm2_store``: one of :data:`GEMM2_STORES`
    (:func:`single_rounding_stores` picks it from a declared profile).

    >>> from moeref.regimes import layer_in_exact_regime
    >>> lay = single_rounding_layer(4, 256, 256, 4, 2, seed=0)
    >>> lay.config.gemm1_out_dtype, lay.excluded_stores, layer_in_exact_regime(lay, "hopper_fp8").ok
    ('bfloat16', ('gemm2',), True)
    >>> lay2 = single_rounding_layer(4, 256, 256, 4, 2, seed=0, gemm2_store="bfloat16")
    >>> lay2.config.gemm2_out_dtype, lay2.excluded_stores, layer_in_exact_regime(lay2, "hopper_fp8").ok
    ('bfloat16', (), True)
    """
    from .._checks import check_choice
    from .layer import _assemble, _layer_sizes, _schemes, _tokens
    from .layer_check import _certify

    m, k, n, e, top = _layer_sizes(num_tokens, hidden, intermediate, num_experts, top_k, scheme, activation,
                                   ROUNDING_LAYER_SCHEMES, ROUNDING_LAYER_ACTIVATIONS)
    check_choice(gemm2_store, GEMM2_STORES, "gemm2_store")
    if k < 32:
        raise ValueError(f"hidden must be at least 32 (room for 16 small up terms); got {k}")
    exps = tuple(int(v) for v in token_exponents)
    if not exps or min(exps) < 0 or max(exps) > 20:
        raise ValueError(f"token_exponents must be integers in 0..20 (saturated gates need 2^k >= 1); "
                         f"got {token_exponents}")
    bad = sorted(set(options) & {"bias", "w13_layout", "token_max", "activation", "quant"})
    if bad:
        raise TypeError(f"single_rounding_layer takes no {bad} (no biases, gate_up w13, tokens |t| <= 2)")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    _, w_scheme = _schemes(scheme)
    group1 = 128 if scheme.startswith("fp8_1x128") else k
    group2 = 128 if scheme.startswith("fp8_1x128") else n
    x, kt = _tokens(rng, m, k, group1, 2, exps)
    x[:, k - 1] = np.ldexp(np.float32(8.0), kt)  # a second constant column, at the end of K

    def expert(r):
        return _rounding_expert(r, k, n, scheme=w_scheme, group1=group1, group2=group2,
                                bf16_gates=scheme == "bf16", off_fraction=off_fraction)

    stores = dict(out_dtype="bfloat16", gemm1_out_dtype="bfloat16")
    if scheme == "bf16":
        stores["act_out_dtype"] = "bfloat16"
    if gemm2_store is not None:
        stores["gemm2_out_dtype"] = gemm2_store
    lay = _assemble(rng, expert, x, kt, num_experts=e, top_k=top, scheme=scheme, layout="gate_up", bias=False,
                    expert_pool=expert_pool, shared_experts=shared_experts, topk_ids=topk_ids,
                    topk_weights=topk_weights, config=dict(activation=activation, **stores, **options),
                    excluded_stores=("gemm2",) if gemm2_store is None else ())
    if lay.config.activation_params or lay.config.apply_router_weight_on_input:
        return lay
    # the construction's bounds (RegimeCertificate): GEMM1 up rows sum at most 3712 + 32 * 4 = 3840 quanta 2^k;
    # GEMM2 (FP8): codes G U / 2^12 in [56, 448] (lowest bit >= 4) times w2 (largest 16 * 2, lowest bit 1/2):
    # |y| / 2^j <= 448 * 32 + 8 * 240 * 4 = 22016 over a quantum of 2; bf16: x = g bf16(u) >= 56 * 3584 4^k has
    # lowest bit >= 2^10 4^k, the anchor 256 * 7168 4^k is the largest: (1835008 * 32 + 8 * 224 * 3840 * 4) / 512
    gemm2 = 22016.0 / 2.0 if scheme != "bf16" else (1835008.0 * 32 + 8 * 224 * 3840 * 4) / 512.0
    # a declared GEMM2 store: the stored y keeps y's quantum and is at most twice |y| (module docstring)
    y_ratio = gemm2 if gemm2_store is None else 2.0 * gemm2
    object.__setattr__(lay, "certificate", _certify(lay, 3840.0, gemm2, y_ratio, ("act",)))
    return lay


def single_rounding_stores(profile, scheme: str = "bf16"):
    """``(options, reason)``: the :func:`single_rounding_layer` keyword arguments whose declared stores are those of
    ``profile`` (a :class:`moeref.compare.Profile` or its name) for ``scheme``, or ``(None, why not)`` where the
    profile's arithmetic admits no single-rounding layer.

    The layer declares a bf16 GEMM1 store, a bf16 output store, an FP32 top-k sum of power-of-two weights, no
    biases, partial sums within 14 bits (exact in FP32 and in Hopper's FP8 accumulator) and, for ``bf16``, a bf16
    activation store (FP8 schemes: the activation is exact in bf16, so the store is free). GEMM2's store follows
    the profile's ``gemm_out_dtype``: ``"bfloat16"`` gives ``gemm2_store="bfloat16"``. A profile admits one when
    it declares those stores (``gemm_out_dtype`` and ``out_dtype`` bf16, ``act_out_dtype`` bf16 for ``bf16``),
    an FP32 top-k sum (``reduce_unit``) and an accumulator of at least 14 bits (``accum_unit``); a GEMM2 epilogue
    that weights before its store (``gemm2_weighted_store``) is admitted too: a power-of-two weight commutes with
    the rounding.

    >>> single_rounding_stores("BF16_OUTPUT")
    ({'gemm2_store': 'bfloat16'}, '')
    >>> single_rounding_stores("DEEPGEMM_FP8", "fp8_1x128")
    ({'gemm2_store': 'bfloat16'}, '')
    >>> single_rounding_stores("TORCH_EAGER_BF16")[0] is None
    True
    """
    from .._checks import check_choice
    from ..compare.bounds import U_FP32
    from ..compare.kernel_profiles import get_profile

    check_choice(scheme, ROUNDING_LAYER_SCHEMES, "scheme")
    p = get_profile(profile)
    why = []
    if p.gemm_out_dtype != "bfloat16":
        why.append(f"GEMM outputs stored as {p.gemm_out_dtype!r} (the layer's GEMM1 store is bf16)")
    if p.out_dtype != "bfloat16":
        why.append(f"output stored as {p.out_dtype!r} (the layer's output store is bf16)")
    if scheme == "bf16" and p.act_out_dtype != "bfloat16":
        why.append(f"activation stored as {p.act_out_dtype!r} (a bf16 layer's activation store is bf16)")
    if p.reduce_unit > U_FP32:
        why.append(f"top-k sum rounded to a lower precision (reduce_unit {p.reduce_unit:g}; the layer's is FP32)")
    if p.accum_unit > 2.0**-13:
        why.append(f"accumulator of fewer than 14 bits (accum_unit {p.accum_unit:g})")
    if why:
        return None, f"profile {p.name} admits no single-rounding layer: " + "; ".join(why)
    return {"gemm2_store": "bfloat16"}, ""
