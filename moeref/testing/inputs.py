"""The reference's inputs exactly as the kernel sees them.

A bf16 kernel never sees the float32 tokens and weights a test generates: it sees them rounded to bf16.
The reference must be given those rounded values, or every comparison carries the input rounding as
error. :func:`kernel_inputs` rounds once, keeps the rounded values for the reference (exact: every bf16,
fp16 and fp32 value is a float64) and hands the kernel the same values as torch tensors in the kernel's
layout (:meth:`KernelInputs.torch`: vLLM/DeepGEMM ``w1 [E, 2N, K]``, ``w2 [E, K, N]``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .. import _interop
from .._checks import check_token_rows, shape_of
from ..routing.ids import check_topk_ids

__all__ = ["KernelInputs", "as_kernel_sees", "kernel_inputs"]


def _np_dtype(dtype):
    name = str(getattr(dtype, "name", dtype)).replace("torch.", "")
    if name in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a float dtype moeref knows; accepted: bfloat16, float16, "
                         "float32, float64 (numpy, ml_dtypes or torch spellings)") from None


def as_kernel_sees(x, dtype) -> np.ndarray:
    """``x`` (NumPy or torch, any device) rounded once to ``dtype`` (round to nearest even, as
    ``Tensor.to`` and ml_dtypes do), returned as a NumPy array of that dtype (ml_dtypes for bf16).

    >>> as_kernel_sees(np.array([1.0 + 2.0**-9, 3.0], np.float32), "bfloat16").astype(np.float64).tolist()
    [1.0, 3.0]
    """
    a = np.asarray(_interop.to_numpy(x))
    dt = _np_dtype(dtype)
    if a.dtype == dt:
        return a
    if a.dtype.kind not in "fV" and a.dtype.name not in ("bfloat16",):
        raise TypeError(f"as_kernel_sees rounds floating tensors; got {a.dtype}")
    # float32 (or narrower) input: one rounding. float64 input goes through float32 first in ml_dtypes
    # (two roundings, differing from one only at a bf16 midpoint); cast float64 data to float32 yourself
    # first if your kernel's inputs are made that way
    return a.astype(dt)


@dataclass(frozen=True, eq=False)
class KernelInputs:
    """One layer call, every tensor already in the dtype the kernel reads.

    ``hidden [M, K]``, ``w13 [E, 2N, K]`` and ``w2 [E, K, N]`` in ``dtype``; ``topk_weights [M, k]`` in
    ``router_dtype``; ``topk_ids`` int32 ``[M, k]``; ``w13_layout`` the order of ``w13``'s halves;
    ``meta``: how the case was made (sizes, seed, routing kind), saved with reproducers.
    """

    hidden: np.ndarray
    w13: np.ndarray
    w2: np.ndarray
    topk_weights: np.ndarray
    topk_ids: np.ndarray
    w13_layout: str = "gate_up"
    dtype: str = "bfloat16"
    meta: dict = field(default_factory=dict)

    def __repr__(self) -> str:  # what Hypothesis and pytest print for a failing case
        return (f"KernelInputs(M={self.hidden.shape[0]}, K={self.hidden.shape[1]}, E={self.w13.shape[0]}, "
                f"w13={tuple(self.w13.shape[1:])}, top_k={self.topk_ids.shape[1]}, dtype={self.dtype}, "
                f"meta={self.meta})")

    @property
    def weights(self):
        """The reference's :class:`moeref.moe.MoEWeights` (per expert, the kernel's values)."""
        from ..moe import MoEWeights

        return MoEWeights([self.w13[e] for e in range(self.w13.shape[0])],
                          [self.w2[e] for e in range(self.w2.shape[0])], self.w13_layout)

    def reference(self, **options):
        """:func:`moeref.moe.run_moe` on exactly these inputs, output rounded to ``dtype`` (override with
        ``out_dtype=``); ``options`` as run_moe's (activation, quant, layout ...)."""
        from ..moe import run_moe

        options.setdefault("out_dtype", self.dtype)
        return run_moe(self.hidden, self.weights, self.topk_weights, self.topk_ids, **options)

    def layer_case(self, **options):
        """The same call as a :class:`moeref.compare.faults.LayerCase` (for faults and reproducers)."""
        from ..compare.faults import LayerCase

        options.setdefault("out_dtype", self.dtype)
        return LayerCase(self.hidden, self.weights, self.topk_weights, self.topk_ids, options)

    def torch(self, device=None) -> dict:
        """The kernel's tensors: ``hidden_states``, ``w1`` (= ``w13``), ``w2``, ``topk_weights``,
        ``topk_ids`` (torch, on ``device``), the same values the reference uses."""
        t = lambda a: _interop.to_torch(np.ascontiguousarray(a), device)  # noqa: E731
        return dict(hidden_states=t(self.hidden), w1=t(self.w13), w2=t(self.w2),
                    topk_weights=t(self.topk_weights), topk_ids=t(self.topk_ids.astype(np.int32)))

    def with_(self, **changes) -> "KernelInputs":
        return replace(self, **changes)


def kernel_inputs(hidden, weights, topk_weights, topk_ids, *, dtype="bfloat16", router_dtype="float32",
                  num_experts: int | None = None) -> KernelInputs:
    """Round a layer's float inputs to the kernel's dtypes once: ``hidden`` and every expert weight to
    ``dtype``, ``topk_weights`` to ``router_dtype`` (vLLM and FlashInfer pass float32 router weights).

    ``weights``: a :class:`moeref.moe.MoEWeights` of float arrays (quantized weights are given to the
    reference as the kernel's own tensors instead: :func:`moeref.gemm.from_kernel.kernel_expert_operands`),
    or a pair ``(w13 [E, 2N, K], w2 [E, K, N])`` in vLLM's ``gate_up`` order.

    Checked here, before any rounding (``ValueError`` naming what was given and what is accepted):
    ``hidden [M, K]``, ``topk_weights`` and ``topk_ids`` ``[M, top_k]`` with one row per token and the same
    top_k (:func:`moeref._checks.check_token_rows`); ``w13 [E, 2N or N, K]`` and ``w2 [E, K, N]`` with the
    same E and ``hidden``'s K; every id in ``[0, num_experts)`` or -1 (padding; the message names the index
    and the value, :func:`moeref.routing.check_topk_ids`). ``num_experts``: the global expert count the ids
    index, default E (larger only for an EP shard whose reference runs with ``expert_map=``).

    >>> from moeref.moe import make_layer, make_tokens
    >>> lw = make_layer(4, 64, 32, seed=0)
    >>> ki = kernel_inputs(make_tokens(5, 64), lw, np.full((5, 2), 0.5, np.float32), np.array([[0, 1]] * 5))
    >>> ki.hidden.dtype.name, ki.w13.shape, ki.w2.shape, ki.reference().out.dtype.name
    ('bfloat16', (4, 64, 64), (4, 64, 32), 'bfloat16')
    """
    if isinstance(weights, tuple):
        w13, w2 = (np.asarray(_interop.to_numpy(w)) for w in weights)
        layout = "gate_up"
    else:
        from ..moe import MoEWeights

        if not isinstance(weights, MoEWeights):
            raise TypeError(f"weights must be MoEWeights or a (w13, w2) pair; got {type(weights).__name__}")
        if any(hasattr(w, "element_values") for w in list(weights.w13) + list(weights.w2)):
            raise TypeError("kernel_inputs rounds float weights; quantized weights go to the reference as the "
                            "kernel's tensors (moeref.gemm.from_kernel.kernel_expert_operands)")
        w13 = np.stack([np.asarray(_interop.to_numpy(w)) for w in weights.w13])
        w2 = np.stack([np.asarray(_interop.to_numpy(w)) for w in weights.w2])
        layout = weights.w13_layout
        if weights.b13 is not None or weights.b2 is not None:
            raise ValueError("kernel_inputs does not carry biases yet; round them with as_kernel_sees")
    ids = np.asarray(_interop.to_numpy(topk_ids))
    if ids.dtype.kind not in "iu":
        raise TypeError(f"topk_ids must be integer; got {ids.dtype}")
    _check_layer_shapes(hidden, w13, w2, topk_weights, ids)
    check_topk_ids(ids.astype(np.int64), w13.shape[0] if num_experts is None else num_experts)
    name = str(_np_dtype(dtype))
    return KernelInputs(as_kernel_sees(hidden, dtype), as_kernel_sees(w13, dtype), as_kernel_sees(w2, dtype),
                        as_kernel_sees(topk_weights, router_dtype), ids.astype(np.int32), layout,
                        "bfloat16" if name == "bfloat16" else name)


def _check_layer_shapes(hidden, w13, w2, topk_weights, topk_ids) -> None:
    """``ValueError`` unless one layer call's shapes agree (:func:`kernel_inputs`' docstring)."""
    check_token_rows(hidden, topk_weights, topk_ids)
    h = shape_of(hidden)
    for w, name, want in ((w13, "w13", "[E, 2N, K]"), (w2, "w2", "[E, K, N]")):
        if w.ndim != 3:
            raise ValueError(f"{name} must be 3-D {want}; got shape {w.shape}")
    if w13.shape[0] != w2.shape[0]:
        raise ValueError(f"w13 has {w13.shape[0]} experts (shape {w13.shape}) but w2 has {w2.shape[0]} "
                         f"(shape {w2.shape}): both must be [E, ...] with the same E")
    if not h[1] == w13.shape[2] == w2.shape[1]:
        raise ValueError(f"hidden has hidden size K={h[1]} (shape {h}) but w13 {w13.shape} and w2 {w2.shape} "
                         f"need K = w13.shape[2] = w2.shape[1] (w13 [E, 2N, K], w2 [E, K, N])")
    n = w2.shape[2]
    if w13.shape[1] not in (n, 2 * n):
        raise ValueError(f"w13 has {w13.shape[1]} rows per expert (shape {w13.shape}) but w2 {w2.shape} has "
                         f"N={n}: w13 must have 2N={2 * n} rows (gated activation) or N={n} (non-gated)")
