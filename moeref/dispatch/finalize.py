"""Finalize: turn expert output rows back into token outputs (vLLM ``TopKWeightAndReduce*``).

Every layout in :mod:`moeref.dispatch` records, per row, the slot it came from (``src = t*k + j``, -1
for padding rows). :func:`weight_and_reduce` therefore finalizes any layout the same way:

    ``out[t] = sum_{j < k} w[t, j] * row(t*k + j)``

summing in float64 in slot order ``j = 0..k-1``; slots with no row (padding tokens, non-local
experts on this EP rank) contribute exactly 0. Rows with ``src == -1`` are ignored whatever they
hold (NaN included: kernels leave padding rows unspecified).

Variants (vLLM ``topk_weight_and_reduce.py``):

* :func:`finalize_noop` (``TopKWeightAndReduceNoOP``): the experts already weighted and reduced.
* ``apply_weights=False`` (``apply_router_weight_on_input``): the weight was applied to the *input*
  (:func:`apply_router_weight_on_input`), so finalize only sums. This equals weighting the output only
  when ``act(w*x) == w*act(x)``; vLLM/CUTLASS implement it only for ``top_k == 1`` (Llama 4), and
  applying the weight on both sides was a real bug (vLLM PR #43694).
"""
from __future__ import annotations

import numpy as np

from .._checks import as_float_array, as_int_array, check_ndim, check_positive_int, check_token_rows, first_bad_index

__all__ = ["apply_router_weight_on_input", "finalize_noop", "reduce_slot_rows", "weight_and_reduce"]


def reduce_slot_rows(slot_rows, topk_weights, *, apply_weights: bool = True, out_dtype=np.float32) -> np.ndarray:
    """``slot_rows``: float ``[M*k, K]`` (absent slots already zero); returns ``[M, K]``.

    The shared reduction of every finalize path: ``sum_j w[t, j] * slot_rows[t*k + j]`` in float64.
    """
    w = as_float_array(topk_weights, "topk_weights").astype(np.float64)
    check_ndim(w, 2, "topk_weights")
    m, k = w.shape
    rows = np.asarray(slot_rows, dtype=np.float64)
    rows = rows.reshape(m, k, rows.shape[-1])  # explicit K: M may be 0
    if not apply_weights:
        w = np.ones_like(w)
    # An explicit loop over j (k <= a few dozen) fixes the summation order: out = ((r0 + r1) + r2) ...
    out = np.zeros((m, rows.shape[2]), dtype=np.float64)
    for j in range(k):
        out += w[:, j : j + 1] * rows[:, j, :]
    return out.astype(out_dtype)


def weight_and_reduce(
    expert_rows,
    src,
    topk_weights,
    num_tokens: int,
    *,
    apply_weights: bool = True,
    out_dtype=np.float32,
) -> np.ndarray:
    """Weight and reduce rows of any layout back to tokens: float ``[num_tokens, K]``.

    ``expert_rows``: float ``[..., K]`` (e.g. contiguous ``[M_sum, K]``, masked ``[E, max_m, K]``);
    ``src``: int ``[...]`` with the same leading shape, the slot ``t*k + j`` of each row or -1;
    ``topk_weights``: float ``[num_tokens, k]``. A slot may appear in at most one row (``ValueError``
    naming the index otherwise).

    >>> rows = np.array([[1.0], [2.0], [99.0]])
    >>> # row 0 holds slot 2 = (token 1, j 0); row 1 holds slot 0 = (token 0, j 0); row 2 is padding
    >>> weight_and_reduce(rows, np.array([2, 0, -1]), np.array([[0.5, 0.25], [3.0, 0.0]]), 2)
    array([[1.],
           [3.]], dtype=float32)
    """
    num_tokens = check_positive_int(num_tokens, "num_tokens", allow_zero=True)
    w = as_float_array(topk_weights, "topk_weights")
    check_ndim(w, 2, "topk_weights")
    if w.shape[0] != num_tokens:
        raise ValueError(f"topk_weights must have num_tokens={num_tokens} rows; got shape {w.shape}")
    k = w.shape[1]
    y = as_float_array(expert_rows, "expert_rows")
    s = as_int_array(src, "src")
    if y.ndim < 1 or s.shape != y.shape[:-1]:
        raise ValueError(f"src must have the leading shape of expert_rows {y.shape[:-1]}; got {s.shape}")
    y = y.reshape(-1, y.shape[-1])
    s = s.reshape(-1)
    n_slots = num_tokens * k
    where = first_bad_index((s < -1) | (s >= n_slots))
    if where is not None:
        raise ValueError(f"src[{where[0]}] = {int(s[where])} is out of range [-1, {n_slots})")
    valid = s >= 0
    counts = np.bincount(s[valid], minlength=n_slots) if n_slots else np.zeros(0, dtype=np.int64)
    if (counts > 1).any():
        slot = int(np.flatnonzero(counts > 1)[0])
        raise ValueError(f"slot {slot} appears in rows {np.flatnonzero(s == slot).tolist()}; each slot at most once")
    slot_rows = np.zeros((n_slots, y.shape[1]), dtype=np.float64)
    slot_rows[s[valid]] = y[valid].astype(np.float64)
    return reduce_slot_rows(slot_rows, w, apply_weights=apply_weights, out_dtype=out_dtype)


def finalize_noop(fused_output, num_tokens: int, *, out_dtype=np.float32) -> np.ndarray:
    """Experts already weighted and reduced (``TopKWeightAndReduceNoOP``): check the shape
    ``[num_tokens, K]`` and return the rows as ``out_dtype``."""
    y = as_float_array(fused_output, "fused_output")
    check_ndim(y, 2, "fused_output")
    if y.shape[0] != num_tokens:
        raise ValueError(f"fused_output must have num_tokens={num_tokens} rows; got shape {y.shape}")
    return y.astype(out_dtype)


def apply_router_weight_on_input(hidden, topk_weights) -> np.ndarray:
    """Scale each token's input by its router weight (``top_k`` must be 1): float32 ``[M, K]``.

    Computed in float64, rounded once. Finalize afterwards with ``apply_weights=False``.

    >>> apply_router_weight_on_input(np.array([[2.0, 4.0]]), np.array([[0.5]]))
    array([[1., 2.]], dtype=float32)
    """
    x = as_float_array(hidden, "hidden")
    check_ndim(x, 2, "hidden")
    w = as_float_array(topk_weights, "topk_weights")
    check_ndim(w, 2, "topk_weights")
    if w.shape[1] != 1:
        raise ValueError(
            f"apply_router_weight_on_input needs top_k == 1 (weight-on-input is exact only then); got top_k={w.shape[1]}"
        )
    check_token_rows(x, w, None)
    return (x.astype(np.float64) * w.astype(np.float64)).astype(np.float32)
