"""Whole fused-MoE layers on which every conforming kernel must give the reference's bits.

:func:`exact_layer` builds the weights, the tokens and the routing of a layer (any number of tokens,
production shapes allowed) whose every stage is exact or one deterministic rounding of an exact value,
in float32 as in float64; :func:`layer_in_exact_regime` checks a layer from its values.

The construction (element values; every scale a power of two), per expert:

* **Tokens.** Small integers ``|t| <= token_max`` times ``2^k`` per token (``k`` in ``token_exponents``),
  with two constant columns: the first column of every 128-column group is ``448 * 2^k`` (the E4M3
  maximum: a dynamic 1x128 or per-token FP8 scale is then exactly ``2^k``, with any FP8 scale rule,
  ``amax / 448``, ``448 / amax`` or UE8M0's ``ceil``), column 1 is ``8 * 2^k``.
* **Gate rows** read column 0 only: ``g = 448 * 2^k * beta`` with ``beta`` in ``{1/8, 1/4, 1/2}``, so
  ``g`` in ``{56, 112, 224} * 2^k``: the logistic of ``g >= 40`` is exactly 1.0 in float32 and float64
  (``exp(-40) < 2^-57``), so SiLU(g) = GELU(g) = g exactly, for every faithful ``exp``/``erf``/``tanh``. One
  gate row in eight is *off*: ``g = -896 * 2^k``, whose logistic is exactly 0 (``exp(-896)`` underflows
  float64), so the output is a zero. SwiGLU-OAI clamps the gate at 7: ``7 * sigmoid(1.702 * 7)`` is
  ``7 (1 - 6.7e-6)``, inexact in every precision, and the declared bf16 store of the activation rounds
  ``(u + 1) * 7 (1 - 6.7e-6)`` to ``(u + 1) * 7`` from float32 as from float64 (6.7e-6 is far from
  bf16's half ulp 2^-9 and far above float32's error): one deterministic rounding.
* **GELU probes.** With ``gelu_and_mul``, every token at scale 1 and FP8 or bf16 weights (MXFP4's 32-element
  blocks cannot hold the probe's up weights 1/4 and 7/8 under one scale), one gate row in eight is a probe in
  GELU's transition zone: ``g = 0.875`` (column 0 times ``2^-9``), ``u = 119`` (column 0 times 1/4, column 1
  times 7/8). ``gelu(0.875) * 119`` lies more than 8 float32 ulps from every bf16 rounding boundary, so
  the declared bf16 activation store gives the same bits from any faithful float32 or float64 erf;
  tanh-GELU's value rounds to the neighbouring bf16 value, and the two land on different E4M3 codes
  of the intermediate too: erf-vs-tanh GELU is visible by equality (found by a search over gate
  weights of E4M3 values and integer ``u < 128``; this pair is the only one for FP8 intermediates).
* **Up rows** read a few random columns with weights ``+-2^s`` (``s`` the 128x128 block's scale
  exponent, 0 or 1), at most ``up_budget / token_max`` of them, so ``|u| <= 31 * 2^k``: ``u`` is an integer
  of at most 5 bits times ``2^k``, and ``x = g * u`` has at most 8 significant bits: exact in float32 and
  in bf16, so a kernel that stores the activation in bf16 and one that does not see the same value.
* **The intermediate's re-quantization.** The first intermediate column of every 128-column group
  (column 0 for per-token schemes) is an *anchor*: gate ``112 * 2^k``, up ``64 * 2^k`` (column 1 times 8),
  ``x = 7168 * 4^k = 448 * 16 * 4^k``, at least every other ``|x| <= 224 * 31 * 4^k``. So every group's amax
  is ``448 * 2^j`` exactly and its scale ``2^j``; the codes ``x / 2^j`` are one RNE rounding of an exact
  value to E4M3.
* **w2** has one nonzero per row (``+-1, 2, 4`` times a power-of-two block scale): GEMM2's partial sums
  hold one term (exact in every accumulator, the 14-bit FP8 one included) and its output has at most
  6 significant bits, exact in bf16, so storing it before the top-k sum (vLLM, DeepGEMM) changes nothing.
* **Top-k weights** are powers of two ``2^-e`` (``e`` in 0..3), so the weighted top-k sum (and the shared
  experts') is exact in FP32 in any order; the bf16 output store is then one rounding of an exact value.

Biases (``bias=True``): up biases are small integers (the up budget shrinks to keep ``|u| <= 31 * 2^k``),
gate biases and ``b2`` are zero (given, so the bias paths run). Shared experts are one more expert built
the same way. What the construction cannot make exact is said in docs/exact-regimes.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from .._checks import check_choice, check_positive_int
from ..activations import activation_values, join_w13, join_w13_bias
from ..formats import decode, encode
from ..moe import LayerConfig, MoEQuant, MoEWeights, SharedExperts, run_moe
from ..formats import pack_nibbles
from ..quant import QuantizedTensor, fp8_block, fp8_group, fp8_per_channel, fp8_per_token, mxfp4
from .layer_check import _BF16, RegimeCertificate, _certify, layer_in_exact_regime  # noqa: F401  (re-exported)

__all__ = ["LAYER_SCHEMES", "LAYER_ACTIVATIONS", "ExactLayer", "RegimeCertificate", "exact_layer",
           "layer_in_exact_regime", "exact_topk_weights"]

LAYER_SCHEMES = ("bf16", "fp8_1x128", "fp8_1x128_ue8m0", "fp8_per_token", "mxfp4_w4a16")
"""``bf16``: bf16 tokens and weights, no quantization; ``fp8_1x128`` / ``fp8_1x128_ue8m0``: DeepSeek-V3
(1x128 FP8 activations, 128x128 FP8 weights, FP32 or UE8M0 scales); ``fp8_per_token``: per-token FP8
activations and per-channel FP8 weights; ``mxfp4_w4a16``: gpt-oss (MXFP4 weights, E2M1 with UE8M0 1x32
scales; bf16 activations)."""
LAYER_ACTIVATIONS = ("silu_and_mul", "gelu_and_mul", "swigluoai")

_GATES = np.array([56.0, 112.0, 224.0])  # on-gate values (times 2^k); 3 significant bits each
_OFF_GATE = -896.0
_ANCHOR_GATE, _ANCHOR_UP = 112.0, 64.0  # x = 7168 = 448 * 16
_X_MAX = 224.0 * 31.0  # largest |x| of a non-anchor column (times 4^k)
_PROBE_GATE = 0.875  # GELU probes: gelu(0.875) * 119 rounds robustly, and differently with tanh-GELU


@dataclass(frozen=True, eq=False)
class ExactLayer:
    """A layer and its inputs in an exact regime (:func:`exact_layer`).

    ``hidden`` float32 ``[M, K]``; ``weights`` :class:`moeref.moe.MoEWeights`; ``topk_weights`` float32 and
    ``topk_ids`` int32 ``[M, k]``; ``config`` the :class:`moeref.moe.LayerConfig` with the declared stores
    (bf16 output; bf16 GEMM1 and activation stores for bf16 layers and SwiGLU-OAI). ``token_exponents``:
    int ``[M]``, each token's scale ``2^k``. Run it with :meth:`reference` or pass :attr:`case` to
    :func:`moeref.testing.assert_moe_close`. ``certificate``: the construction's own proof
    (:class:`RegimeCertificate`, set by :func:`exact_layer`; None on a layer built any other way, and
    ``dataclasses.replace`` drops it), which :func:`layer_in_exact_regime` reads instead of the values.
    ``excluded_stores``: optional stores (of :attr:`Arithmetic.optional_stores`) that this layer's declared
    arithmetic forbids, because they round (:func:`~moeref.regimes.single_rounding_layer`: ``("gemm2",)``, a
    bf16 store of GEMM2's output before the top-k sum): a kernel that makes one is not conforming, and the
    regime check does not ask for invariance under it.
    """

    hidden: np.ndarray
    weights: MoEWeights
    topk_weights: np.ndarray
    topk_ids: np.ndarray
    config: LayerConfig
    scheme: str
    token_exponents: np.ndarray = field(repr=False, default=None)
    excluded_stores: tuple = ()
    certificate: object = field(repr=False, default=None, init=False, compare=False)

    @property
    def options(self) -> dict:
        """The config's fields as keyword arguments of :func:`moeref.moe.run_moe`."""
        return {f.name: getattr(self.config, f.name) for f in fields(LayerConfig)}

    @property
    def case(self):
        """A :class:`moeref.compare.faults.LayerCase` of this layer (for the planted faults and reports)."""
        from ..compare.faults import LayerCase

        return LayerCase(self.hidden, self.weights, self.topk_weights, self.topk_ids, self.options)

    def reference(self, **overrides):
        """The traced reference run (:func:`moeref.moe.run_moe`), ``overrides`` replacing config fields."""
        return run_moe(self.hidden, self.weights, self.topk_weights, self.topk_ids,
                       LayerConfig.build(self.config, **overrides))


def exact_topk_weights(shape, *, seed=0, max_exponent: int = 3) -> np.ndarray:
    """float32 top-k weights ``2^-e``, ``e`` uniform in ``0..max_exponent`` (exact products and sums).

    >>> sorted(set(exact_topk_weights((4, 8), seed=0).ravel().tolist())) <= [0.125, 0.25, 0.5, 1.0]
    True
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return np.ldexp(np.float32(1.0), -rng.integers(0, max_exponent + 1, size=shape)).astype(np.float32)


def _schemes(scheme: str):
    """(a1 scheme, w13/w2 scheme) or (None, None) for bf16."""
    if scheme == "bf16":
        return None, None
    if scheme == "mxfp4_w4a16":
        return None, mxfp4()
    if scheme == "fp8_per_token":
        return fp8_per_token(), fp8_per_channel()
    sf = "ue8m0" if scheme.endswith("ue8m0") else "fp32"
    return fp8_group(128, sf), fp8_block((128, 128), sf)


def _anchor_columns(k: int, group: int) -> np.ndarray:
    return np.arange(0, k, group)


def _quantized(real: np.ndarray, scheme, exps: np.ndarray) -> QuantizedTensor:
    """A weight ``[R, C]`` of real values on the block grid ``exps`` (scale ``2^exps``) as a QuantizedTensor:
    codes ``real / 2^s`` must be E4M3 values (checked: ``overflow="error"`` and an exact round trip)."""
    block = scheme.resolve_block(real.shape)
    if scheme.element == "e2m1":  # MXFP4: every block's nonzeros share one magnitude; it becomes the code 4
        r, c = real.shape
        mx = np.abs(real).reshape(r, c // block[1], block[1]).max(axis=-1)
        exps = np.where(mx > 0, np.frexp(np.where(mx > 0, mx, 1.0))[1] - 1 - 2, 0)
    rows, cols = np.nonzero(real)  # the weights are sparse: encode the nonzeros (code 0 is +0)
    elem = np.ldexp(real[rows, cols], -exps[rows // block[0], cols // block[1]])
    nz_codes = np.asarray(encode(elem, scheme.element, overflow="error"), dtype=np.uint8)
    if not np.array_equal(decode(nz_codes, scheme.element, np.float64), elem):
        raise AssertionError("an exact-layer weight is not representable (a bug in the construction)")
    codes = np.zeros(real.shape, np.uint8)
    codes[rows, cols] = nz_codes
    if scheme.scale_format == "fp32":
        scales = np.ldexp(np.float32(1.0), exps).astype(np.float32)
    else:
        scales = (exps + 127).astype(np.uint8)
    if scheme.packed:
        codes = pack_nibbles(codes)
    return QuantizedTensor(codes, scales, scheme, real.shape)


def _expert(rng, k: int, n: int, *, scheme, group1: int, group2: int, token_max: int, up_budget: int,
            bias_max: int, activation: str, off_fraction: float, probes: bool = False):
    """One expert's real-valued ``gate [n, k]``, ``up [n, k]``, ``w2 [k, n]``, their block-scale exponents,
    and the up bias ``[n]``."""
    w_scheme = scheme
    br, bk = (128, 128) if w_scheme is None else w_scheme.resolve_block((n, k))
    # 128x128 (or per-channel) block scale exponents of w13 (gate and up halves share a grid each)
    nb_rows, nb_cols = -(-n // br), -(-k // bk)
    s_gate = rng.integers(0, 2, size=(nb_rows, nb_cols))
    s_up = rng.integers(0, 2, size=(nb_rows, nb_cols))
    gate = np.zeros((n, k))
    on = rng.random(n) >= off_fraction
    beta = _GATES[rng.integers(0, _GATES.size, size=n)] / 448.0
    gate[:, 0] = np.where(on, beta, _OFF_GATE / 448.0)
    anchors2 = _anchor_columns(n, group2)
    gate[anchors2, 0] = _ANCHOR_GATE / 448.0
    # up rows: random columns outside the anchor columns, +-2^s, within the budget
    free = np.setdiff1d(np.arange(k), np.concatenate([_anchor_columns(k, group1), [1]]))
    up = np.zeros((n, k))
    nnz = max(1, up_budget // token_max)
    if free.size:
        cols = free[rng.integers(0, free.size, size=(n, nnz))]
        mags = np.ldexp(1.0, s_up[np.arange(n)[:, None] // br, cols // bk])
        keep = np.cumsum(mags * token_max, axis=1) <= up_budget
        signs = rng.choice(np.array([-1.0, 1.0]), size=(n, nnz))
        rows = np.repeat(np.arange(n), nnz)
        vals = (signs * mags * keep).reshape(-1)
        up[rows, cols.reshape(-1)] = vals  # a repeated column keeps one of its draws: still in the budget
    up[anchors2, :] = 0.0
    up[anchors2, 1] = _ANCHOR_UP / 8.0
    b_up = rng.integers(-bias_max, bias_max + 1, size=n).astype(np.float64) if bias_max else np.zeros(n)
    b_up[anchors2] = 0.0
    if probes:  # GELU's transition zone: g = 1.75, u = 57 (module docstring)
        p = np.setdiff1d(np.flatnonzero(rng.random(n) < 0.125), anchors2)
        gate[p, :] = 0.0
        gate[p, 0] = _PROBE_GATE / 448.0
        up[p, :] = 0.0
        up[p, 0], up[p, 1] = 0.25, 0.875  # 448/4 + 8 * 7/8 = 119
        s_gate[:, 0] = 0  # the probe weight 2^-9 is E4M3's smallest value: its block scale must be 1
        b_up[p] = 0.0
    # w2 [k, n]: one nonzero per row
    br2, bk2 = (128, 128) if w_scheme is None else w_scheme.resolve_block((k, n))
    s2 = rng.integers(-1, 2, size=(-(-k // br2), -(-n // bk2)))
    w2 = np.zeros((k, n))
    col2 = rng.integers(0, n, size=k)
    w2[np.arange(k), col2] = rng.choice(np.array([-4.0, -2.0, -1.0, 1.0, 2.0, 4.0]), size=k) * np.ldexp(
        1.0, s2[np.arange(k) // br2, col2 // bk2])
    return gate, up, w2, (s_gate, s_up, s2), b_up


def _layer_sizes(num_tokens, hidden, intermediate, num_experts, top_k, scheme, activation, schemes, activations):
    """The checked ``(M, K, N, E, k)`` of a regime layer's arguments, with ``scheme`` in ``schemes`` and
    ``activation`` in ``activations`` (shared by :func:`exact_layer` and
    :func:`moeref.regimes.single_rounding_layer`): ValueError names the argument and what is accepted."""
    m = check_positive_int(num_tokens, "num_tokens", allow_zero=True)
    k = check_positive_int(hidden, "hidden")
    n = check_positive_int(intermediate, "intermediate")
    e = check_positive_int(num_experts, "num_experts")
    top = check_positive_int(top_k, "top_k")
    check_choice(scheme, schemes, "scheme")
    check_choice(activation, activations, "activation")
    if scheme.startswith("fp8_1x128") and (k % 128 or n % 128):
        raise ValueError(f"scheme {scheme!r} needs hidden and intermediate multiples of 128; got {k}, {n}")
    return m, k, n, e, top


def exact_layer(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                scheme: str = "fp8_1x128", activation: str = "silu_and_mul", seed=0, topk_ids=None,
                topk_weights=None, w13_layout: str | None = None, bias: bool = False, shared_experts: bool = False,
                token_max: int = 2, token_exponents=None, off_fraction: float = 0.125, expert_pool: int | None = None,
                **options) -> ExactLayer:
    """A fused-MoE layer and its inputs in the exact regime (module docstring).

    Args:
        num_tokens, hidden, intermediate, num_experts, top_k: the shapes (``hidden`` and ``intermediate``
            multiples of 128 for the 1x128 schemes).
        scheme: one of :data:`LAYER_SCHEMES`. activation: one of :data:`LAYER_ACTIVATIONS`.
        seed: an int or a ``numpy.random.Generator``.
        topk_ids: int ``[M, k]`` (-1 padding) to use instead of a uniform routing (e.g. a
            :class:`moeref.strategies.RoutingCase`'s ids); topk_weights: exact weights to use (default
            :func:`exact_topk_weights`; padding slots get 0).
        w13_layout: default ``"interleaved"`` for SwiGLU-OAI with per-row weight scales (``bf16``,
            ``fp8_per_token``: a 128x128 scale block would mix gate and up rows), else ``"gate_up"``.
        bias: small-integer up biases, zero gate and ``b2`` biases. shared_experts: one shared expert.
        token_max, token_exponents: token element magnitudes and per-token scale exponents (default
            ``(0, 1)``; ``(0,)`` for GELU, whose probe rows need every token at scale 1).
        expert_pool: build only this many distinct experts and give expert ``e`` the weights of
            ``e % expert_pool`` (neighbouring experts still differ; production shapes in seconds).
        options: further :class:`moeref.moe.LayerConfig` fields (``chunk_size``, ``layout``,
            ``expert_map`` with ``num_experts``...).

    >>> lay = exact_layer(4, 256, 256, 4, 2, seed=0)
    >>> lay.hidden.shape, lay.config.out_dtype, layer_in_exact_regime(lay, "hopper_fp8").ok
    ((4, 256), 'bfloat16', True)
    """
    m, k, n, e, top = _layer_sizes(num_tokens, hidden, intermediate, num_experts, top_k, scheme, activation,
                                   LAYER_SCHEMES, LAYER_ACTIVATIONS)
    if scheme == "mxfp4_w4a16" and (k % 32 or n % 32):
        raise ValueError(f"scheme {scheme!r} needs hidden and intermediate multiples of 32; got {k}, {n}")
    if k < 2:
        raise ValueError(f"hidden must be at least 2 (two constant token columns); got {k}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    _, w_scheme = _schemes(scheme)
    group1 = 128 if scheme.startswith("fp8_1x128") else k
    group2 = 128 if scheme.startswith("fp8_1x128") else n
    interleave = activation == "swigluoai" and scheme in ("bf16", "fp8_per_token", "mxfp4_w4a16")
    layout = w13_layout or ("interleaved" if interleave else "gate_up")
    if token_exponents is None:
        token_exponents = (0,) if activation == "gelu_and_mul" else (0, 1)
    probes = activation == "gelu_and_mul" and tuple(set(token_exponents)) == (0,) and scheme != "mxfp4_w4a16"
    kmax = int(max(token_exponents))
    bias_max = 3 if bias else 0
    up_budget = (31 - bias_max) // (1 << max(kmax - int(min(token_exponents)), 0)) if bias else 31
    if activation == "swigluoai":
        up_budget = min(up_budget, 6)  # |u| <= 7 stays inside the clamp: (u + 1) * 7 has <= 6 bits
    x, kt = _tokens(rng, m, k, group1, token_max, token_exponents)

    def expert(r):
        return _expert(r, k, n, scheme=w_scheme, group1=group1, group2=group2, token_max=token_max,
                       up_budget=up_budget, bias_max=bias_max, activation=activation, off_fraction=off_fraction,
                       probes=probes)

    stores = dict(out_dtype="bfloat16")
    if scheme in ("bf16", "mxfp4_w4a16") or activation == "swigluoai" or probes:
        stores.update(gemm1_out_dtype="bfloat16", act_out_dtype="bfloat16")
    lay = _assemble(rng, expert, x, kt, num_experts=e, top_k=top, scheme=scheme, layout=layout, bias=bias,
                    expert_pool=expert_pool, shared_experts=shared_experts, topk_ids=topk_ids,
                    topk_weights=topk_weights, config=dict(activation=activation, **stores, **options))
    object.__setattr__(lay, "certificate", _certificate(lay, token_exponents=token_exponents, token_max=token_max,
                                                        up_budget=up_budget, probes=probes))
    return lay


def _tokens(rng, m: int, k: int, group1: int, token_max: int, token_exponents) -> tuple[np.ndarray, np.ndarray]:
    """float32 tokens ``[m, k]``: integers ``|t| <= token_max`` times ``2^k`` per token (``k`` drawn from
    ``token_exponents``' range), ``448 * 2^k`` in the first column of every ``group1`` columns, ``8 * 2^k`` in
    column 1; and the exponents ``k`` ``[m]``."""
    kt = rng.integers(int(min(token_exponents)), int(max(token_exponents)) + 1, size=m)
    t = rng.integers(-token_max, token_max + 1, size=(m, k)).astype(np.float64)
    t[:, _anchor_columns(k, group1)] = 448.0
    t[:, 1] = 8.0
    return np.ldexp(t, kt[:, None]).astype(np.float32), kt


def _assemble(rng, expert, x: np.ndarray, kt: np.ndarray, *, num_experts: int, top_k: int, scheme: str, layout: str,
              bias: bool, expert_pool, shared_experts: bool, topk_ids, topk_weights, config: dict,
              excluded_stores: tuple = ()) -> ExactLayer:
    """An :class:`ExactLayer` from tokens ``x`` and a per-expert builder ``expert(rng) -> (gate [n, k], up [n, k],
    w2 [k, n], (gate, up, w2 block-scale exponents), up bias [n])`` (real values): the weights (bf16 or quantized
    with ``scheme``'s weight scheme, from a pool with ``expert_pool``), a shared expert, the routing (uniform, or
    ``topk_ids``) and exact top-k weights, and the :class:`moeref.moe.LayerConfig` of ``config`` with the
    scheme's quantizers."""
    m, e, top = x.shape[0], num_experts, top_k
    a1_scheme, w_scheme = _schemes(scheme)

    def build(count):
        w13, w2, b13, b2 = [], [], [], []
        for _ in range(count):
            gate, up, w2r, (sg, su, s2), b_up = expert(rng)
            if w_scheme is None:
                w13.append(join_w13(gate, up, layout, axis=-2).astype(_BF16))
                w2.append(w2r.astype(_BF16))
            else:
                qg = _quantized(gate, w_scheme, sg)
                qu = _quantized(up, w_scheme, su)
                w13.append(_join_quantized(qg, qu, layout, w_scheme))
                w2.append(_quantized(w2r, w_scheme, s2))
            b13.append(join_w13_bias(np.zeros(gate.shape[0]), b_up, layout))
            b2.append(np.zeros(w2r.shape[0]))
        return w13, w2, np.asarray(b13, np.float32), np.asarray(b2, np.float32)

    if expert_pool is None:
        w13, w2, b13, b2 = build(e)
    else:  # experts drawn from a pool of distinct ones (expert e is pool[e % P]): production shapes in seconds
        pool = build(min(check_positive_int(expert_pool, "expert_pool"), e))
        p = len(pool[0])
        w13, w2 = [pool[0][i % p] for i in range(e)], [pool[1][i % p] for i in range(e)]
        b13, b2 = pool[2][np.arange(e) % p], pool[3][np.arange(e) % p]
    weights = MoEWeights(w13, w2, layout, b13 if bias else None, b2 if bias else None)
    shared = None
    if shared_experts:
        sw13, sw2, _, _ = build(1)
        shared = SharedExperts(sw13[0], sw2[0], layout)
    if topk_ids is None:
        if top > e:
            raise ValueError(f"top_k={top} > num_experts={e} (give topk_ids to route with repeats)")
        ids = np.argsort(rng.random((m, e)), axis=1)[:, :top].astype(np.int32) if m else np.zeros((0, top), np.int32)
    else:
        ids = np.asarray(topk_ids).astype(np.int32)
        if ids.shape != (m, top):
            raise ValueError(f"topk_ids must be [{m}, {top}]; got {ids.shape}")
    if topk_weights is None:
        tw = exact_topk_weights((m, top), seed=rng)
    else:
        tw = np.asarray(topk_weights, dtype=np.float32)
    tw = np.where(ids >= 0, tw, np.float32(0.0)).astype(np.float32)
    quant = MoEQuant() if a1_scheme is None else MoEQuant(a1_scheme, a1_scheme, name=scheme)
    cfg = LayerConfig.build(quant=quant, shared_experts=shared, **config)
    return ExactLayer(x, weights, tw, ids, cfg, scheme, kt, excluded_stores)


def _join_quantized(qg: QuantizedTensor, qu: QuantizedTensor, layout: str, scheme) -> QuantizedTensor:
    """Gate and up halves (each ``[n, k]``, scale grids ``[n/128, k/128]`` or per row) joined as ``w13``.
    ``"interleaved"`` needs per-row scales (a 128-row block would mix gate and up rows)."""
    if layout == "interleaved" and scheme.block[0] != 1:
        raise ValueError("an interleaved w13 needs per-row weight scales (scheme 'fp8_per_token' or 'bf16')")
    codes = join_w13(qg.codes, qu.codes, layout, axis=-2)
    scales = join_w13(qg.scales, qu.scales, layout, axis=-2)
    return QuantizedTensor(codes, scales, scheme, (codes.shape[0], qg.shape[1]))


# ------------------------------------------------------------------------------------------ certificate
# (what the construction proves; the certificate itself and its reading: moeref.regimes.layer_check)


def _unsaturated_act_values(activation: str, probes: bool) -> np.ndarray:
    """The exact activation values the construction leaves unsaturated: the GELU probe ``gelu(0.875) * 119``;
    SwiGLU-OAI's ``(u + 1) * 7 * sigmoid(1.702 * 7)`` for every clamped up value ``u`` in -7..7."""
    if activation == "gelu_and_mul" and probes:
        h = np.array([[_PROBE_GATE, 119.0]])
    elif activation == "swigluoai":
        h = np.stack([np.full(15, 56.0), np.arange(-7.0, 8.0)], axis=1)
    else:
        return np.zeros(0)
    return activation_values(activation, h, "gate_up", {}).reshape(-1)


def _certificate(lay: ExactLayer, *, token_exponents, token_max: int, up_budget: int, probes: bool):
    """The :class:`RegimeCertificate` of a layer :func:`exact_layer` just built, or None where the construction's
    argument is not written out (then the check reads the values)."""
    cfg = lay.config
    kmin, kmax = int(min(token_exponents)), int(max(token_exponents))
    fp8_a2 = cfg.quant.a2 is not None
    if (cfg.activation_params or cfg.apply_router_weight_on_input or not 0 <= kmin <= kmax <= 20
            or not 0 <= token_max <= 16 or (cfg.activation == "swigluoai" and fp8_a2)):
        return None  # (token elements above 16 are not all E4M3 values: the FP8 tokens would round)
    # GEMM1: gate rows hold one term of 3 significant bits (odd part <= 7); up rows sum at most up_budget
    # token quanta (|t w| summed <= up_budget 2^k, lowest bits >= 2^k); GELU probes: 448/4 + 8 * 7/8 = 119.
    gemm1 = max(7.0, float(up_budget), 119.0 if probes else 0.0)
    if fp8_a2:
        # a2 codes: |x| >= 56 2^k (gate) * 1 (integer up) over the scale 16 4^k: |x / 2^j| >= 3.5 2^-k, so a
        # nonzero code's lowest bit is at least E4M3's step in that binade; the largest code is 448.
        vmin = 3.5 * 2.0**-kmax
        a2_ratio = 448.0 / 2.0 ** (np.floor(np.log2(vmin)) - 3)
        gemm2 = 15.0  # one term: a 4-bit code times a power of two
    else:
        # bf16 intermediates: x = g u, lowest bit >= 8 2^k, largest the anchor 7168 4^k; probes: bf16(84.3...)
        # has lowest bit >= 1/2; SwiGLU-OAI: (u + 1) * 7 stored, integers up to 56
        a2_ratio = 56.0 if cfg.activation == "swigluoai" else max(896.0 * 2.0**kmax, 14336.0 if probes else 0.0)
        gemm2 = 255.0  # one term: an 8-bit bf16 value times a power of two
    # y = a2 * w2 (one nonzero per w2 row: +-1, 2, 4 times 2^s2, s2 in -1..1: largest 8, lowest bit 1/2)
    return _certify(lay, gemm1, gemm2, a2_ratio * 16.0, ("gemm1", "act", "gemm2"),
                   _unsaturated_act_values(cfg.activation, probes))
