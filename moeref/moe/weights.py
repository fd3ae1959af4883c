"""MoE weight containers, per-expert weight quantization, and test-layer builders.

:class:`MoEWeights` holds the experts of ONE rank (all experts without EP): ``w13[e]`` is expert
``e``'s fused gate/up weight ``[2N, K]`` (gated activations) or ``[N, K]`` (non-gated), ``w2[e]`` is
``[K, N]`` (NT layout: ``y = x @ w.T``, as vLLM, DeepGEMM and FlashInfer store them). Each entry is
a float array or a :class:`moeref.quant.QuantizedTensor` (one per expert: vLLM quantizes weights
per expert, ``moe_quantize_weights_2d``, so per-tensor/per-channel scales are per expert).
``w13_layout`` (no default) says which rows of ``w13`` are gate and which up
(:mod:`moeref.activations`); biases are float ``[E, 2N]`` (same layout) and ``[E, K]``.

The builders make data on which faults are observable (vacuous tolerances come from tiny
outputs: vLLM's ``test_fused_moe`` inputs ``randn/10`` give outputs near 1e-2 against ``atol=2e-2``):

* :func:`make_layer`: GEMM1 outputs have standard deviation ``gate_std`` (default 2.5), so SiLU/GELU
  work in their nonlinear range (|g| of 1 to 5), and gate rows differ from up rows in scale (up
  ``x 0.5``), so swapping gate and up changes the output visibly.
* :func:`make_tokens`: unit-variance rows with a DeepEP-style signature (``deep_ep`` tests put the
  token index in the last 128 columns): the last ``min(8, K // 4)`` columns hold ``(t + 1) / M``
  ramps, so every token's output differs and a routing fault shows on its own row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .._checks import as_float_array, check_choice, check_ndim, check_positive_int
from ..activations import W13_LAYOUTS

__all__ = ["MoEWeights", "SharedExperts", "make_layer", "make_tokens", "quantize_weights"]


@dataclass(frozen=True, eq=False)
class MoEWeights:
    """Expert weights of one rank.

    Attributes:
        w13: ``E_local`` per-expert operands ``[2N, K]`` (or ``[N, K]`` non-gated).
        w2: ``E_local`` per-expert operands ``[K, N]``.
        w13_layout: ``"gate_up"``, ``"up_gate"`` or ``"interleaved"`` (rows of ``w13``).
        b13: optional float ``[E_local, 2N]`` (``w13_layout`` order), added after GEMM1.
        b2: optional float ``[E_local, K]``, added after GEMM2.
    """

    w13: Sequence
    w2: Sequence
    w13_layout: str
    b13: np.ndarray | None = None
    b2: np.ndarray | None = None

    def __post_init__(self):
        check_choice(self.w13_layout, W13_LAYOUTS, "w13_layout")
        if len(self.w13) != len(self.w2):
            raise ValueError(f"w13 has {len(self.w13)} experts but w2 has {len(self.w2)}")

    @property
    def num_experts(self) -> int:
        return len(self.w13)

    def select(self, local: Sequence[int]) -> "MoEWeights":
        """The experts ``local`` (an EP shard of a full layer)."""
        idx = [int(e) for e in local]
        return replace(
            self,
            w13=[self.w13[e] for e in idx],
            w2=[self.w2[e] for e in idx],
            b13=None if self.b13 is None else np.asarray(self.b13)[idx],
            b2=None if self.b2 is None else np.asarray(self.b2)[idx],
        )


@dataclass(frozen=True, eq=False)
class SharedExperts:
    """A plain MLP added to the routed output (DeepSeek shared experts): ``w13 [2N_s, K]`` (or
    ``[N_s, K]``), ``w2 [K, N_s]``, with its own ``w13_layout``; run with the layer's quantization and
    activation, weight 1.0 (vLLM ``SharedFusedMoE`` adds ``shared_output`` to the routed output)."""

    w13: object
    w2: object
    w13_layout: str

    def as_weights(self) -> MoEWeights:
        return MoEWeights([self.w13], [self.w2], self.w13_layout)


def _split_rows(w: np.ndarray) -> list[np.ndarray]:
    return [w[e] for e in range(w.shape[0])]


def make_layer(num_experts: int, hidden: int, intermediate: int, *, seed: int = 0, gated: bool = True,
               w13_layout: str = "gate_up", gate_std: float = 2.5, bias: bool = False,
               dtype=np.float32) -> MoEWeights:
    """Random float expert weights whose GEMM1 outputs are in the activations' nonlinear range.

    ``w13`` rows are ``N(0, gate_std^2 / hidden)`` for gate rows and half that standard deviation for
    up rows, so for unit-variance tokens the gate pre-activations have std ``gate_std``; ``w2`` is
    ``N(0, 1 / intermediate)``. ``bias`` adds ``N(0, 0.25)`` biases. Returns float ``dtype`` weights.

    >>> lw = make_layer(2, 8, 4, seed=1)
    >>> lw.num_experts, lw.w13[0].shape, lw.w2[0].shape, lw.w13_layout
    (2, (8, 8), (8, 4), 'gate_up')
    """
    e = check_positive_int(num_experts, "num_experts")
    k = check_positive_int(hidden, "hidden")
    n = check_positive_int(intermediate, "intermediate")
    check_choice(w13_layout, W13_LAYOUTS, "w13_layout")
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((e, n, k)) * (gate_std / np.sqrt(k))
    if gated:
        from ..activations import join_w13

        up = rng.standard_normal((e, n, k)) * (0.5 * gate_std / np.sqrt(k))
        w13 = join_w13(gate, up, w13_layout, axis=-2)
    else:
        w13 = gate
    w2 = rng.standard_normal((e, k, n)) / np.sqrt(n)
    b13 = b2 = None
    if bias:
        b13 = (0.5 * rng.standard_normal((e, w13.shape[1]))).astype(np.float32)
        b2 = (0.5 * rng.standard_normal((e, k))).astype(np.float32)
    return MoEWeights(_split_rows(w13.astype(dtype)), _split_rows(w2.astype(dtype)), w13_layout, b13, b2)


def make_tokens(num_tokens: int, hidden: int, *, seed: int = 0, structured: bool = True,
                dtype=np.float32) -> np.ndarray:
    """Unit-variance token rows ``[num_tokens, hidden]``; ``structured`` writes a per-token ramp
    ``(t + 1) / num_tokens`` into the last ``min(8, hidden // 4)`` columns (DeepEP-style signature).

    >>> x = make_tokens(4, 16, seed=0)
    >>> x[:, -1].tolist()
    [0.25, 0.5, 0.75, 1.0]
    """
    m = check_positive_int(num_tokens, "num_tokens", allow_zero=True)
    k = check_positive_int(hidden, "hidden")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k))
    c = min(8, k // 4)
    if structured and c and m:
        x[:, k - c:] = (np.arange(1, m + 1) / m)[:, None]
    return x.astype(dtype)


def quantize_weights(weights: MoEWeights, w13_scheme, w2_scheme=None) -> MoEWeights:
    """Quantize every expert's ``w13`` and ``w2`` with :func:`moeref.quant.quantize`, per expert.

    ``w2_scheme`` defaults to ``w13_scheme``. ``None`` keeps that weight in float. Biases stay float.
    """
    from ..quant import quantize

    w2_scheme = w13_scheme if w2_scheme is None else w2_scheme

    def q(ws, scheme, name):
        if scheme is None:
            return list(ws)
        out = []
        for e, w in enumerate(ws):
            a = as_float_array(w, f"{name}[{e}]")
            check_ndim(a, 2, f"{name}[{e}]")
            out.append(quantize(a, scheme))
        return out

    return replace(weights, w13=q(weights.w13, w13_scheme, "w13"), w2=q(weights.w2, w2_scheme, "w2"))
