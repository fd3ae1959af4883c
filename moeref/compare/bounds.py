"""Sound per-element error bounds for a MoE layer computed with a declared arithmetic (a :class:`Profile`).

The reference (:func:`moeref.moe.run_moe`) computes the layer exactly per block, in float64. A
kernel that follows the same semantics but accumulates in lower precision differs from it by at
most the bound built here, stage by stage (derivation: docs/error-bounds.md). With
``gamma(n, u) = n u / (1 - n u)`` (Higham, Accuracy and Stability, Lemma 3.1):

1. **GEMM** (``K`` columns, ``S`` scale blocks along K): within a promotion chunk of ``c`` columns
   the accumulator has unit roundoff ``u_acc`` (Hopper FP8 tensor cores keep about 14 bits until
   DeepGEMM promotes every 128 columns into FP32 registers; a plain FP32 GEMM has ``c = K``); the
   promoted sum, the scale multiplications and the bias add are FP32. Any order of the sums gives
   ``|C~ - C| <= coef * (|A| |B|^T + |bias|)`` with ``n = c + ceil(c/32) + 1`` and
   ``coef = gamma(n, u_acc) + (1 + gamma(n, u_acc)) * gamma(ceil(K/c) + S + 3, u_fp32)``.
   ``n`` covers any summation order with one rounding per add (``c + 1``) and also a tensor core's
   aligned multi-term adder: per 32-wide MMA, 33 terms (32 products and the accumulator) are aligned to
   the largest and truncated, each losing less than one unit in the last place of the largest
   (``2^-13`` of it for 14 bits), i.e. ``33 u_acc`` of the chunk's ``sum |a||b|`` per MMA.
   Products of FP8/FP4/bf16 elements are exact in FP32 (an FP32 x FP32 product rounding is the
   ``+ 1`` in ``n``).
   A stored GEMM output (bf16) adds ``u_out (|C| + bound)``. That is ``accum_model="worst_case"``;
   ``accum_model="data_dependent"`` (:data:`HOPPER_FP8_DEEPGEMM_DATA`) bounds each output element from
   its own products instead: per 32-wide MMA, ``(nonzero addends) * 2 u_acc * 2^floor(log2 M)`` with
   ``M`` the larger of the step's largest product and ``|exact partial sum| + error so far`` (the
   incoming accumulator), plus the normalisation of the MMA result (:func:`gemm_error_bound` states the
   hardware model). On the demo layer it is about 8x tighter.
2. **Activation**: the Lipschitz bound of the gate function on the interval ``[g - dg, g + dg]``
   (:func:`lipschitz_on`: ``|silu'| <= 1.0998`` and ``|gelu'| <= 1.1290`` globally, near 0 where they
   saturate; clamps only flatten) and ``|f(g)| <= |g|`` give, for ``f(g) * up(u)``,
   ``dx <= L dg (|u| + |beta|) + (|g| + dg) du``; ``relu2``: ``dh (2|h| + dh)``. The kernel's own
   evaluation and store add ``u_act (|x| + |g|(|u| + |beta|) + dx)`` (:func:`activation_magnitude`).
3. **Intermediate re-quantization** (flip-aware). The kernel rounds ``x~`` where the reference rounds
   ``x``. The candidate's block scale ``s~`` lies in ``[s_lo, s_hi]``, the scales of the block with
   every magnitude lowered by ``dx`` and raised by ``dx`` (every scale rule is monotone in the amax;
   widened by ``2^-21`` for a float32 scale computation). Its scaled element ``x~/s~`` then lies
   between the extremes of ``(x -+ dx) / {s_lo, s_hi}`` (widened by ``2^-20`` for the float32
   ``x * (1/s)``), its code between the roundings of the two ends (the scheme's rounding and
   saturation), and ``q~ = s~ code~`` between the four corner products. An element whose interval holds
   no rounding boundary keeps its code (uncertainty: the scale range only, 0 for a certain scale); one
   that straddles a boundary gets the distance to the reachable neighbour (one element-format ulp at
   its block scale when ``dx`` is small).
4. **GEMM2**: ``dy <= |W2| unc + coef (|xq| + unc) |W2|^T + ...`` (the ``|w2|`` sums of the uncertain
   intermediate elements).
5. **Finalize**: ``sum_j |w_j| dy_j + gamma(k + 2, u_red) sum_j |w_j| (|y_j| + dy_j)``, shared experts
   added the same way, then the output store ``u_out (|out| + bound)``.

Every term is an upper bound of the exact error of an implementation that follows the declared
arithmetic, whatever its summation order or chunking: honest kernels never fail. A wrong kernel
fails wherever its error exceeds what that arithmetic can produce.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..activations import ACTIVATIONS, split_w13
from ..dispatch import weight_and_reduce
from ..gemm.exact import BlockOperand
from ..gemm.grouped import ExpertOperands, expert_rows_gemm

__all__ = [
    "Profile",
    "EXACT",
    "FP32_ACCUM",
    "BF16_OUTPUT",
    "HOPPER_FP8_DEEPGEMM",
    "HOPPER_FP8_DEEPGEMM_DATA",
    "PROFILES",
    "gamma",
    "gemm_coefficient",
    "gemm_error_bound",
    "lipschitz_on",
    "activation_error",
    "activation_magnitude",
    "requant_uncertainty",
    "layer_bound",
]

U_FP32 = 2.0**-24
U_BF16 = 2.0**-8


def gamma(n, u: float) -> float:
    """``n u / (1 - n u)`` (Higham's gamma_n); ``inf`` when ``n u >= 1``.

    >>> gamma(128, 2.0**-24) < 128 * 2.0**-24 * 1.00001
    True
    """
    nu = float(n) * u
    return math.inf if nu >= 1 else nu / (1.0 - nu)


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
        gemm_out_unit: rounding of each GEMM output store (bf16 ``2^-8``; 0 for none).
        act_unit: relative error of evaluating and storing the activation (incl. a bf16 store).
        reduce_unit: unit roundoff of the top-k weighted sum (FP32).
        out_unit: rounding of the output store (bf16 ``2^-8``, FP32 ``2^-24``).
        accum_model: ``"worst_case"``: the GEMM bound is ``coef * |A||B|^T`` (:func:`gemm_coefficient`,
            any summation order); ``"data_dependent"``: the aligned-adder model of
            :func:`gemm_error_bound`, computed from the operands' actual products (Hopper only makes
            sense with ``promote_every`` and ``mma_k`` set).
        mma_k: K columns of one tensor-core MMA (one aligned multi-term addition); Hopper FP8 WGMMA: 32.
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

    def __post_init__(self):
        if self.accum_model not in ("worst_case", "data_dependent"):
            raise ValueError(f"accum_model must be 'worst_case' or 'data_dependent'; got {self.accum_model!r}")
        if int(self.mma_k) < 1:
            raise ValueError(f"mma_k must be >= 1; got {self.mma_k}")
        if self.promote_every is not None and int(self.promote_every) < 1:
            raise ValueError(f"promote_every must be >= 1 or None; got {self.promote_every}")


EXACT = Profile("EXACT", "float64 reference against itself (only float64 roundings)",
                accum_unit=2.0**-52, promote_unit=2.0**-52, act_unit=2.0**-48, reduce_unit=2.0**-52,
                out_unit=0.0)
FP32_ACCUM = Profile("FP32_ACCUM", "FP32 accumulation in any order/chunking, FP32 intermediates and output")
BF16_OUTPUT = Profile("BF16_OUTPUT", "FP32 accumulation; GEMM outputs, activations and output stored as bf16 "
                      "(torch bf16 matmul, vLLM Triton fused_moe)", gemm_out_unit=U_BF16,
                      act_unit=U_BF16 + 16 * U_FP32, out_unit=U_BF16)
HOPPER_FP8_DEEPGEMM = Profile(
    "HOPPER_FP8_DEEPGEMM",
    "Hopper FP8 WGMMA: ~14-bit accumulation promoted to FP32 every 128 K (DeepGEMM), bf16 GEMM outputs "
    "and output", accum_unit=2.0**-13, promote_every=128, gemm_out_unit=U_BF16,
    act_unit=U_BF16 + 16 * U_FP32, out_unit=U_BF16)
HOPPER_FP8_DEEPGEMM_DATA = replace(
    HOPPER_FP8_DEEPGEMM, name="HOPPER_FP8_DEEPGEMM_DATA",
    description="HOPPER_FP8_DEEPGEMM with the data-dependent aligned-adder bound (per 32-wide MMA, from the "
    "actual products and partial sums)", accum_model="data_dependent")
PROFILES = {p.name: p for p in (EXACT, FP32_ACCUM, BF16_OUTPUT, HOPPER_FP8_DEEPGEMM, HOPPER_FP8_DEEPGEMM_DATA)}


def gemm_coefficient(profile: Profile, k: int, num_k_blocks: int = 1) -> float:
    """``coef`` of stage 1: ``|C~ - C| <= coef * (|A||B|^T + |bias|)`` (module docstring)."""
    c = k if profile.promote_every is None else min(profile.promote_every, k)
    c = max(c, 1)
    # c products + one aligned-adder term per 32-wide MMA + the final add: see the module docstring
    g_acc = gamma(c + -(-c // 32) + 1, profile.accum_unit)
    n_prom = -(-k // c) + num_k_blocks + 3
    return g_acc + (1.0 + g_acc) * gamma(n_prom, profile.promote_unit)


def gemm_error_bound(a, w, profile: Profile, *, a_radius=None, bias=None) -> np.ndarray:
    """Bound on the arithmetic error of ``C = A @ W.T (+ bias)`` computed as ``profile`` declares,
    float64 ``[M, N]``.

    ``a``: ``[M, K]`` and ``w``: ``[N, K]`` operands (:func:`moeref.gemm.exact.as_operand` input);
    ``a_radius``: optional float ``[M, K]`` (>= 0): the kernel multiplies some ``A~`` with
    ``|A~ - A| <= a_radius`` elementwise (the uncertain re-quantized intermediate of GEMM2); the bound
    covers the arithmetic error of ``A~ @ W.T`` for every such ``A~`` (the operand difference itself,
    ``a_radius @ |W|.T``, is not included); ``bias``: optional float ``[N]``.

    ``accum_model="worst_case"``: ``coef * ((|A| + a_radius) |W|^T + |bias|)`` with ``coef`` of
    :func:`gemm_coefficient` (any summation order).

    ``accum_model="data_dependent"`` (the hardware model, docs/error-bounds.md): K is cut into promotion
    chunks of ``c = promote_every`` columns (``K`` when None), each into MMA steps of ``mma_k`` columns.
    Each chunk starts a fresh accumulator (DeepGEMM issues the first WGMMA of a promotion block with
    the accumulator cleared). One MMA step adds its products (exact: FP8/FP4/bf16 products fit an FP32
    significand) and the incoming accumulator (steps after the first) in an aligned multi-term adder:
    every addend is aligned to the largest addend's exponent ``e = floor(log2 max|addend|)`` and cut to
    a grid no finer than ``2^(e + 1) * u_acc`` (``u_acc = 2^-13``: 14 bits kept, plus one bit of headroom
    for a carry or a 13-bit alignment: twice the grid of a 14-bit significand of the largest), any
    rounding direction; the sum is exact and then normalised, losing less than ``2 u_acc`` of its
    magnitude (again one bit of headroom). Block scales are constant over a chunk (DeepGEMM's 1x128 and
    128x128 blocks); each chunk is multiplied by its scales and added in FP32. Sources: DeepSeek-V3
    technical report §3.3.2 (~14 bits, promotion every 128 columns); Fasi, Higham, Mikaitis, Pranesh,
    "Numerical behavior of NVIDIA tensor cores" (PeerJ CS 2021: alignment to the largest exponent,
    truncation). Per output element, chunk and step ``j`` (``P_j`` the products of the step, ``S_j`` the
    exact partial sum of the chunk through step ``j``, ``E_j`` the error bound so far, ``n_j`` the nonzero
    products plus 1 for the accumulator when ``j > 0``, ``p2(x) = 2^floor(log2 x)``):

        M_j     = max(max |P_j|, |S_{j-1}| + E_{j-1})          (bound on the largest addend)
        align_j = n_j * 2 u_acc * p2(M_j)                        (>= n_j * 2^(e + 1) * u_acc)
        E_j     = E_{j-1} + align_j + 2 u_acc p2(|S_j| + E_{j-1} + align_j)

    and the chunk's accumulator satisfies ``|acc| <= |S| + E``. This runs on the unscaled elements (exact
    in float64 when ``c * max|a| * max|w| <= 2^53 q_a q_w``, :func:`moeref.gemm.exact.quantum_and_max`) and
    is multiplied by the chunk's ``|scale_a scale_w|``. Otherwise (a scale block shorter than a chunk,
    inexact partial sums, or ``a_radius`` given) it runs on the scaled products with ``p2`` replaced by the
    identity: ``2^floor(log2 x_unscaled) * scale <= x``, whatever the scale, so the bound holds whether the
    kernel scales before or after accumulating. The promotions, scale products and the bias add are FP32:
    ``gamma(ceil(K/c) + S + 3, u_fp32) (sum_chunks scale (|S| + E) + |bias|)`` (as in
    :func:`gemm_coefficient`). With ``a_radius``, ``max |P_j|`` uses ``(|A| + a_radius) |W|`` and ``|S_j|``
    grows by the partial sums of ``a_radius |W|``. ``M_j`` is widened by ``2^-40`` before ``p2`` and the
    result by ``1e-9`` relative, for the float64 rounding of the bound's own arithmetic.

    Cost: the product tensor ``[M, N, K]`` in float64 (in row blocks of at most 2^22 elements) plus an
    ``O(M N K / mma_k)`` recurrence: fine for test-sized layers, not for production shapes.

    >>> hop = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    >>> a = np.array([[1.0, 1.0, 0.0]]); w = np.array([[1.0, -1.0, 0.0]])
    >>> round(float(gemm_error_bound(a, w, hop)[0, 0]) / 2.0**-13, 4)  # 2 products, M = 1: 2 * 2 u_acc
    4.001
    """
    from ..gemm.exact import as_operand, quantum_and_max

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
    s_blocks = _num_k_blocks(a, w)
    if profile.accum_model == "worst_case":
        coef = gemm_coefficient(profile, k, s_blocks)
        a_abs = np.abs(a.dequantize()) + (0.0 if radius is None else radius)
        return coef * (a_abs @ np.abs(w.dequantize()).T + b_abs[None, :])
    c = max(1, k if profile.promote_every is None else min(int(profile.promote_every), k))
    n_prom = -(-k // c) + s_blocks + 3
    g_prom = gamma(n_prom, profile.promote_unit)
    if m == 0 or n == 0 or k == 0:
        return np.broadcast_to(g_prom * b_abs, (m, n)).copy()
    mma = int(profile.mma_k)
    steps = -(-c // mma)
    nch = -(-k // c)
    # chunk-major column grid [nch, steps * mma]: column index or -1 (padding: zero products)
    pos = np.arange(steps * mma)
    cols = np.arange(nch)[:, None] * c + pos[None, :]
    cols = np.where((pos[None, :] < c) & (cols < k), cols, -1)

    def gathered(x):  # [R, K] -> [R, nch, steps, mma], zeros at padding
        g = np.where(cols >= 0, x[:, np.maximum(cols, 0)], 0.0)
        return g.reshape(x.shape[0], nch, steps, mma)

    # exact domain: the unscaled element products and chunk sums are exact in float64 and every chunk
    # lies in one scale block of each operand, so the adder's grid is known up to a power of two
    blk = np.arange(nch) * c
    last = np.minimum(blk + c, k) - 1
    const_scales = all(np.array_equal(blk // op.block[1], last // op.block[1]) for op in (a, w))
    exact = radius is None and const_scales and bool(np.all(np.isfinite(a.values)) and np.all(np.isfinite(w.values)))
    if exact:
        qa, ma = quantum_and_max(a.values)
        qw, mw = quantum_and_max(w.values)
        exact = ma == 0 or mw == 0 or c * ma * mw <= 2.0**53 * qa * qw
    if exact:
        ac, bd = gathered(a.values.astype(np.float64)), gathered(w.values.astype(np.float64))
        sa = np.abs(a.scales[(np.arange(m) // a.block[0])[:, None], (blk // a.block[1])[None, :]])
        sw = np.abs(w.scales[(np.arange(n) // w.block[0])[:, None], (blk // w.block[1])[None, :]])

        def grid(x):  # 2^floor(log2 x) (0 for x = 0), x widened by 2^-40 for the float64 sums of E
            _, ex = np.frexp(x * (1.0 + 2.0**-40))
            return np.where(x > 0, np.ldexp(1.0, ex - 1), 0.0)
    else:
        ac, bd = gathered(a.dequantize()), gathered(w.dequantize())

        def grid(x):  # scaled domain: 2^floor(log2 x_unscaled) * scale <= x
            return x
    ar = None if radius is None else gathered(radius)
    bd_abs = np.abs(bd)
    au = np.abs(ac) if ar is None else np.abs(ac) + ar
    u2 = 2.0 * profile.accum_unit
    out = np.empty((m, n))
    rb = max(1, (1 << 22) // max(1, n * nch * steps * mma))
    for r0 in range(0, m, rb):  # row blocks bound the memory of the [rb, N, K] product tensor
        r1 = min(r0 + rb, m)
        p_abs = au[r0:r1, None] * bd_abs[None]                           # [rb, N, nch, steps, mma]
        p_max = p_abs.max(axis=-1)
        cnt = np.count_nonzero(p_abs, axis=-1).astype(np.float64)
        s_part = np.abs(np.cumsum((ac[r0:r1, None] * bd[None]).sum(axis=-1), axis=-1))  # |S_j|
        if ar is not None:
            s_part = s_part + np.cumsum((ar[r0:r1, None] * bd_abs[None]).sum(axis=-1), axis=-1)
        err = np.zeros(p_max.shape[:-1])                                 # [rb, N, nch]
        prev = np.zeros_like(err)                                        # |S_{j-1}| + E_{j-1}
        for j in range(steps):  # <= promote_every / mma_k steps (4 for DeepGEMM): the recurrence
            align = (cnt[..., j] + (j > 0)) * u2 * grid(np.maximum(p_max[..., j], prev))
            err = err + align + u2 * grid(s_part[..., j] + err + align)
            prev = s_part[..., j] + err
        if exact:
            scale = sa[r0:r1, None, :] * sw[None, :, :]
            err, prev = err * scale, prev * scale
        out[r0:r1] = err.sum(axis=-1) + g_prom * (prev.sum(axis=-1) + b_abs[None, :])
    return out * (1.0 + 1e-9)


def _rows_error_bound(a, a_radius, row_expert, weights, bias, profile: Profile) -> np.ndarray:
    """:func:`gemm_error_bound` of every row against its expert's weights (the row -> expert map of
    :func:`moeref.gemm.grouped.expert_rows_gemm`), float64 ``[R, N]``, 0 on padding rows."""
    from ..gemm.exact import as_operand

    a = as_operand(a, "a")
    w = ExpertOperands(weights)
    b = None if bias is None else np.asarray(bias, dtype=np.float64)
    out = None
    for e in np.unique(row_expert[row_expert >= 0]).tolist():  # a loop over experts
        idx = np.flatnonzero(row_expert == e)
        r = gemm_error_bound(a.take_rows(idx), w[e], profile,
                             a_radius=None if a_radius is None else a_radius[idx],
                             bias=None if b is None else b[e])
        if out is None:
            out = np.zeros((row_expert.size, r.shape[1]))
        out[idx] = r
    return np.zeros((row_expert.size, w[0].shape[0])) if out is None else out


_LIPSCHITZ = {"silu": 1.1, "gelu": 1.13}  # max |silu'| = 1.09984, max |gelu'| = 1.12899 (erf and tanh forms)
# f' of silu (x sigma(x)) and erf-GELU (x Phi(x)) is monotone between its two critical points, where
# |f'| takes these values: (critical point, |f'| there)
_CRITICAL = {"silu": ((-2.3993572805154676, 0.09983933), (2.3993572805154676, 1.09983933)),
             "gelu": ((-math.sqrt(2.0), 0.12890415), (math.sqrt(2.0), 1.12890415))}


def _derivative(fam: str, x: np.ndarray) -> np.ndarray:
    from ..activations import gelu, sigmoid

    if fam == "silu":
        s = sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    with np.errstate(divide="ignore", invalid="ignore"):
        cdf = np.where(x == 0, 0.5, gelu(x) / np.where(x == 0, 1.0, x))
    return cdf + x * phi


def lipschitz_on(fam: str, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``sup |f'|`` over ``[lo, hi]`` for ``f = silu`` or erf-GELU (elementwise): the larger of the
    endpoint values and of the critical values inside the interval, with a 1e-9 relative margin.

    >>> lipschitz_on("silu", np.array([-20.0, -1.0]), np.array([-19.0, 3.0])).round(4).tolist()
    [0.0, 1.0998]
    """
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    out = np.maximum(np.abs(_derivative(fam, lo)), np.abs(_derivative(fam, hi)))
    for c, v in _CRITICAL[fam]:
        out = np.where((lo <= c) & (c <= hi), np.maximum(out, v), out)
    return out * (1.0 + 1e-9) + 1e-15
_GATED = {  # name -> (gate family, layout override, |up offset| param)
    "silu_and_mul": ("silu", None, None),
    "mul_and_silu": ("silu", "up_gate", None),
    "gelu_and_mul": ("gelu", None, None),
    "swigluoai": ("silu", None, 1.0),
    "swiglu_bias": ("silu", None, "beta"),
    "swiglustep": ("silu", None, None),
}


def activation_error(name: str, h: np.ndarray, dh: np.ndarray, w13_layout: str, params: dict | None = None) -> np.ndarray:
    """Bound on ``|act(h~) - act(h)|`` for ``|h~ - h| <= dh`` (stage 2), shape of the activation output.

    >>> float(activation_error("relu2_no_mul", np.array([3.0]), np.array([0.5]), "gate_up")[0])
    3.25
    """
    params = dict(params or {})
    h = np.asarray(h, dtype=np.float64)
    dh = np.asarray(dh, dtype=np.float64)
    if name in _GATED:
        fam, lay, beta = _GATED[name]
        lay = lay or params.get("layout", w13_layout)
        g, u = split_w13(h, lay, axis=-1)
        dg, du = split_w13(dh, lay, axis=-1)
        b = abs(float(params.get("beta", 0.0))) if beta == "beta" else (beta or 0.0)
        # d/dg [g sigmoid(alpha g)] = silu'(alpha g): the Lipschitz bound on [g - dg, g + dg] is that
        # of silu on alpha [g - dg, g + dg] (clamps only flatten it); tanh-GELU: the global constant
        if fam == "gelu" and params.get("approximate", "none") == "tanh":
            lip = _LIPSCHITZ["gelu"]
        else:
            alpha = float(params.get("alpha", 1.702 if name == "swigluoai" else 1.0))
            lip = lipschitz_on(fam, alpha * (g - dg), alpha * (g + dg))
        return lip * dg * (np.abs(u) + b) + (np.abs(g) + dg) * du
    if name == "relu2_no_mul":
        return dh * (2.0 * np.abs(h) + dh)
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
    h = np.abs(np.asarray(h, dtype=np.float64))
    if name in _GATED:
        _, lay, beta = _GATED[name]
        g, u = split_w13(h, lay or params.get("layout", w13_layout), axis=-1)
        b = abs(float(params.get("beta", 0.0))) if beta == "beta" else (beta or 0.0)
        return g * (u + b)
    return h * h if name == "relu2_no_mul" else h


def _quantize_with(quantizer, x):
    from ..moe.pipeline import _run_quantizer

    return _run_quantizer(quantizer, x)[1]


def requant_uncertainty(x: np.ndarray, dx: np.ndarray, quantizer, qt) -> tuple[np.ndarray, int]:
    """Bound on ``|q~ - q|`` for the re-quantized intermediate (stage 3, flip-aware), and the number
    of elements whose rounding can flip.

    ``x``: float64 ``[R, N]`` the reference's activation output (valid rows), ``dx`` its bound,
    ``quantizer``: the ``a2`` quantizer, ``qt``: the reference's quantized ``x``.
    """
    from ..formats import round_to_format
    from ..quant.blockwise import expand_to_elements

    x = np.asarray(x, dtype=np.float64)
    dx = np.asarray(dx, dtype=np.float64)
    if x.size == 0 or not np.any(dx > 0):
        return np.zeros_like(x), 0
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
    return unc, int(np.count_nonzero(r_lo != r_hi))


@dataclass(frozen=True, eq=False)
class LayerBound:
    """``bound``: float64 ``[M, K]`` per-element bound; ``flips``: intermediate elements whose rounding
    the declared arithmetic may flip."""

    bound: np.ndarray
    flips: int


def _num_k_blocks(a: BlockOperand, w: BlockOperand) -> int:
    k = a.values.shape[1]
    bk = max(1, min(a.block[1], w.block[1], max(k, 1)))
    return -(-k // bk)


def _chunk_bound(p, e, weights, profile: Profile, cfg) -> tuple[np.ndarray, int]:
    """Per-token bound of one chunk (stages 1-5 without the output store) and the count of
    intermediate elements whose rounding can flip."""
    w13 = ExpertOperands(weights.w13, "w13")
    w2 = ExpertOperands(weights.w2, "w2")
    valid = e.valid
    rows = p.row_expert
    used = np.unique(rows[valid])
    if used.size == 0:
        return np.zeros((p.num_tokens, e.y.shape[1])), 0
    dh = _rows_error_bound(p.a, None, rows, w13, weights.b13, profile)
    dh += profile.gemm_out_unit * (np.abs(e.h) + dh)
    dx = activation_error(cfg.activation, e.h, dh, weights.w13_layout, cfg.activation_params)
    mag_act = activation_magnitude(cfg.activation, e.h, weights.w13_layout, cfg.activation_params)
    dx += profile.act_unit * (np.abs(e.x) + mag_act + dx)
    dx[~valid] = 0.0
    quant = cfg.quant
    flips = 0
    if e.a2 is None:
        unc = dx
    else:
        vidx = np.flatnonzero(valid)
        unc = np.zeros_like(dx)
        unc[vidx], flips = requant_uncertainty(e.x[vidx], dx[vidx], quant.a2, e.a2)
    dy = expert_rows_gemm(unc, rows, w2, None, abs_values=True) + _rows_error_bound(e.xq, unc, rows, w2,
                                                                                     weights.b2, profile)
    dy += profile.gemm_out_unit * (np.abs(e.y) + dy)
    w_abs = np.abs(p.topk_weights)
    k = p.top_k
    d_tok = weight_and_reduce(dy, p.src, w_abs, p.num_tokens, apply_weights=p.apply_weights, out_dtype=np.float64)
    mag = weight_and_reduce(np.abs(e.y) + dy, p.src, w_abs, p.num_tokens, apply_weights=p.apply_weights,
                            out_dtype=np.float64)
    return d_tok + gamma(k + 2, profile.reduce_unit) * mag, flips


def layer_bound(run, profile: Profile) -> LayerBound:
    """Per-element bound ``[M, K]`` for a traced reference ``run`` (:func:`moeref.moe.run_moe`)."""
    cfg = run.config
    weights = run.weights
    parts, flips = [], 0
    for p, e in run.chunks:
        b, f = _chunk_bound(p, e, weights, profile, cfg)
        parts.append(b)
        flips += f
    bound = np.concatenate(parts, axis=0) if parts else np.zeros_like(run.output)
    if run.shared is not None:
        sw = cfg.shared_experts.as_weights()
        sparts = []
        for p, e in run.shared_chunks:
            b, f = _chunk_bound(p, e, sw, profile, cfg)
            sparts.append(b)
            flips += f
        bound = bound + np.concatenate(sparts, axis=0) + profile.reduce_unit * 2 * (np.abs(run.output) + bound)
    bound = bound + profile.out_unit * (np.abs(run.output) + bound)
    return LayerBound(bound, flips)
