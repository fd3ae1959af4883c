"""The one top-k every routing method uses, with a declared tie and NaN policy.

Policy (moeref's; the libraries leave it unspecified, see below):

* **Order.** Scores are ranked by value, descending: ``+inf`` first, then finite values, then ``-inf``.
  ``+0.0`` and ``-0.0`` are equal.
* **Ties.** Equal scores are broken by expert id: the **lower id wins** and comes first. This is the
  rule of triton_kernels ``topk_torch`` (``argsort(-x, stable=True)``) and of vLLM PR #55514's
  deterministic grouped_topk fallback. ``torch.topk``, which the vLLM/SGLang/FlashInfer references
  call, leaves ties unspecified (PyTorch's ``torch.topk`` documentation: the order of equal
  elements is not guaranteed).
* **NaN.** A NaN score ranks **below every number, -inf included**; NaNs among themselves follow the
  tie rule (lower id first). So a NaN expert is chosen only when fewer than ``k`` experts have a
  number. (vLLM PR #32058 review: padding lanes with idx 0 must not win when scores are non-finite.)
* **Excluded entries** (``exclude=True``, e.g. experts of groups that grouped_topk dropped) rank below
  everything, NaN included: they are chosen only if ``k`` exceeds the number of included entries,
  which the callers rule out.
* **Distinct ids.** The result holds ``k`` distinct ids per row by construction: selection is a
  ranking, never "take the max, set it to -inf, repeat" (that loop returns duplicates once the rest
  is -inf: vllm-project/vllm-omni PR #7175).
* **Output order.** Each row's ids are in rank order (best first), like ``torch.topk(sorted=True)``.

Implementation: every score is mapped to an int64 key that is monotone in the order above (IEEE-754
bit trick), the k-th largest key per row is found with ``np.partition``, and the boundary ties are
resolved by id. No Python loop over tokens.
"""
from __future__ import annotations

import numpy as np

from .._checks import check_ndim, check_positive_int

__all__ = ["EXCLUDED_KEY", "keys_to_values", "order_keys", "stable_topk", "top_values", "topk_from_keys"]

_INT64_MIN = np.iinfo(np.int64).min
_EXCLUDED_KEY = _INT64_MIN  # below everything
EXCLUDED_KEY = _EXCLUDED_KEY
_NAN_KEY = _INT64_MIN + 1  # below every number, above excluded entries


def order_keys(scores: np.ndarray, exclude: np.ndarray | None = None) -> np.ndarray:
    """int64 keys whose order is the declared score order (larger key = better rank).

    ``scores``: any real float array (converted to float64 exactly). ``exclude``: optional bool array
    of the same shape; excluded entries get the smallest key. Equal scores (``+0.0 == -0.0``) get
    equal keys; NaN maps to a key below ``-inf``.
    """
    s = np.asarray(scores, dtype=np.float64) + 0.0  # + 0.0 turns -0.0 into +0.0
    bits = s.view(np.int64)
    # Non-negative floats: the bit pattern already increases with value. Negative floats: flipping
    # the magnitude bits (xor with 0x7FF..F, selected by the arithmetic shift of the sign) reverses
    # their order and keeps them below every non-negative key.
    keys = bits ^ ((bits >> np.int64(63)) & np.int64(0x7FFFFFFFFFFFFFFF))
    nan = np.isnan(s)
    if nan.any():
        keys[nan] = _NAN_KEY
    if exclude is not None:
        keys[np.asarray(exclude, dtype=bool)] = _EXCLUDED_KEY
    return keys


def stable_topk(scores: np.ndarray, k: int, *, exclude: np.ndarray | None = None) -> np.ndarray:
    """Ids of the ``k`` best entries of each row of ``scores`` ``[M, N]``, best first.

    Returns int64 ``[M, k]``. Ties: lower id wins; NaN below -inf; ``exclude`` below NaN (module
    docstring). ``k`` must satisfy ``0 < k <= N`` (``ValueError`` otherwise).

    >>> import numpy as np
    >>> stable_topk(np.array([[1.0, 3.0, 3.0, np.nan, 2.0]]), 3)
    array([[1, 2, 4]])
    >>> stable_topk(np.array([[np.nan, -np.inf, np.nan]]), 3)  # -inf beats NaN; NaNs by id
    array([[1, 0, 2]])
    """
    scores = np.asarray(scores)
    check_ndim(scores, 2, "scores")
    return topk_from_keys(order_keys(scores, exclude), k)


def topk_from_keys(keys: np.ndarray, k: int) -> np.ndarray:
    """:func:`stable_topk` on precomputed :func:`order_keys` ``[M, N]`` (int64): ids ``[M, k]``."""
    k = check_positive_int(k, "k")
    m, n = keys.shape
    if k > n:
        raise ValueError(f"k must be <= the number of columns ({n}); got k={k}")
    if m == 0:
        return np.zeros((0, k), dtype=np.int64)
    kth = np.partition(keys, n - k, axis=1)[:, n - k : n - k + 1]  # k-th largest key per row
    above = keys > kth
    at = keys == kth
    need = k - above.sum(axis=1)
    chosen = above | at
    tied = np.flatnonzero(at.sum(axis=1) > need)  # rows whose k-th key is shared past the k-th place
    if tied.size:
        # Among entries equal to the k-th key, the lowest ids fill the remaining places.
        at_t = at[tied]
        chosen[tied] = above[tied] | (at_t & (np.cumsum(at_t, axis=1) <= need[tied, None]))
    ids = np.nonzero(chosen)[1].reshape(m, k)  # ascending id within each row
    chosen_keys = np.take_along_axis(keys, ids, axis=1)
    # Descending key, stable: ~key is strictly decreasing in key and cannot overflow.
    rank = np.argsort(~chosen_keys, axis=1, kind="stable")
    return np.take_along_axis(ids, rank, axis=1)


def keys_to_values(keys: np.ndarray) -> np.ndarray:
    """Inverse of :func:`order_keys`: float64 values (NaN for NaN and excluded keys; -0.0 comes back
    as +0.0)."""
    keys = np.asarray(keys, dtype=np.int64)
    bits = keys ^ ((keys >> np.int64(63)) & np.int64(0x7FFFFFFFFFFFFFFF))  # the transform is an involution
    out = bits.view(np.float64).copy()
    out[keys <= _NAN_KEY] = np.nan
    return out


def top_values(scores: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` best values of each row of ``scores [M, N]`` in the declared order (best first):
    float64 ``[M, k]``. Same ranking as :func:`stable_topk` (NaN below -inf), without the ids.

    >>> top_values(np.array([[1.0, np.nan, 3.0, -np.inf]]), 3)
    array([[  3.,   1., -inf]])
    """
    scores = np.asarray(scores)
    check_ndim(scores, 2, "scores")
    return top_values_from_keys(order_keys(scores), k)


def top_values_from_keys(keys: np.ndarray, k: int) -> np.ndarray:
    """:func:`top_values` on precomputed :func:`order_keys` ``[M, N]``."""
    k = check_positive_int(k, "k")
    n = keys.shape[1]
    if k > n:
        raise ValueError(f"k must be <= the number of columns ({n}); got k={k}")
    best = np.partition(keys, n - k, axis=1)[:, n - k:]
    return keys_to_values(np.sort(best, axis=1)[:, ::-1])
