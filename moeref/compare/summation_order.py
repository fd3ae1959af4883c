"""The declared summation order of a float64 dot product, so every engine gets the same bits: :func:`ordered_dot`
(``x @ w.T`` in chunks of :data:`ORDER_CHUNK` columns cut into steps of :data:`ORDER_STEP`) and the column
grouping it and the aligned-adder bound read (:func:`grouped_columns`), and the rounding-error factor of a sum
that every bound states its roundings with (:func:`gamma`, Higham's ``gamma_n``; ``U_F64`` the float64 unit).

A float64 sum's bits depend on its order; the bounds that sum in float64 (the worst-case and contiguous-tree
models of :mod:`moeref.compare.gemm_bounds`, the operand radius of :mod:`moeref.compare.operand_radius` where its
grid does not apply) declare this order, and the device engine (:mod:`moeref.compare.device.bounds`, the kernels
of :mod:`moeref.compare.device._bound_kernels` and :mod:`moeref.compare.device._adder_mma`) follows it.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["ORDER_CHUNK", "ORDER_STEP", "grouped_columns", "ordered_dot", "ordered_dot_pairs", "gamma", "U_F64"]

_BLOCK_ELEMS = 1 << 22  # elements of the [rows, N, K] product tensor held at once
_ORDER_BLOCK_ELEMS = 1 << 20
"""Products of one row block of :func:`ordered_dot` (its two ``[rows, chunks, steps, N]`` buffers stay near L2; measured
on the 2-core VM, 2026-11-29: 0.73 ns a product against 1.0 with ``2^22``, 64 x 512 outputs at K = 256)."""


ORDER_CHUNK = 128
ORDER_STEP = 32
"""The summation order of :func:`ordered_dot` (chunks of 128 columns, steps of 32)."""


def grouped_columns(k: int, chunk: int, step: int) -> np.ndarray:
    """Column index of every (chunk, step, lane) position, ``[nch, steps, step]``, -1 on padding:
    chunk ``i`` holds columns ``[i chunk, min((i + 1) chunk, k))``, cut into steps of ``step``."""
    c = max(1, min(chunk, max(k, 1)))
    steps = -(-c // step)
    nch = -(-max(k, 1) // c)
    pos = np.arange(steps * step)
    cols = np.arange(nch)[:, None] * c + pos[None, :]
    cols = np.where((pos[None, :] < c) & (cols < k), cols, -1)
    return cols.reshape(nch, steps, step)


def _gather_cols(x: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``[R, K] -> [R, nch, steps, step]`` (zeros at padding)."""
    return np.where(cols >= 0, x[:, np.maximum(cols, 0)], 0.0)


def _step_major(x: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``[R, K] -> [step, nch, steps, R]``, contiguous: :func:`_gather_cols` with each step's columns leading and
    the rows last (no gather when the columns are ``0..K-1`` in order)."""
    if cols.size == x.shape[1] and np.array_equal(cols.reshape(-1), np.arange(cols.size)):
        g = x.reshape((x.shape[0],) + cols.shape)
    else:
        g = _gather_cols(x, cols)
    return np.ascontiguousarray(g.transpose(3, 1, 2, 0))


def ordered_dot(x, w, chunk: int = ORDER_CHUNK, step: int = ORDER_STEP, *, w_t=None) -> np.ndarray:
    """``x @ w.T`` (float64 ``[M, K]``, ``[N, K]``) summed in a declared order, so every engine gets the
    same bits (the device bounds, :mod:`moeref.compare.device.bounds`): per chunk of ``chunk`` columns
    and step of ``step`` columns, ``t = +0.0; t = t + x_k w_k`` in column order, the chunk's
    ``S = S + t`` over its steps, then ``total = total + S`` over the chunks, every operation rounded.
    ``w_t``: optional, ``w`` transposed as a C-contiguous float64 ``[K', N]`` array with ``K' >= K`` (rows from
    ``K`` on are not read), given instead of ``w`` (None) by a caller that holds it: read in place where the
    columns are whole chunks (``K`` a multiple of ``chunk``, ``chunk`` of ``step``), the same bits."""
    x = np.asarray(x, dtype=np.float64)
    m, k = x.shape
    if w is None:
        if w_t is None:
            raise TypeError("ordered_dot needs w or w_t; got neither")
        n = w_t.shape[1]
    else:
        w = np.asarray(w, dtype=np.float64)
        n = w.shape[0]
    out = np.zeros((m, n))
    if m == 0 or n == 0 or k == 0:
        return out
    cols = grouped_columns(k, chunk, step)
    xg = _step_major(x, cols)                                  # [step, nch, steps, M]
    if w_t is not None and cols.size == k and np.array_equal(cols.reshape(-1), np.arange(k)):
        wg = w_t[:k].reshape(cols.shape + (n,)).transpose(2, 0, 1, 3)  # [step, nch, steps, N], a view
    else:
        wg = _step_major(w_t[:k].T if w is None else w, cols)  # [step, nch, steps, N]
    rb = max(1, _ORDER_BLOCK_ELEMS // max(1, n * cols.size))
    for r0 in range(0, m, rb):
        r1 = min(r0 + rb, m)
        t = np.zeros((r1 - r0,) + cols.shape[:2] + (n,))                     # [rows, nch, steps, N]
        prod = np.empty_like(t)
        for i in range(cols.shape[2]):  # column order within a step
            np.multiply(np.moveaxis(xg[i, :, :, r0:r1], -1, 0)[..., None], wg[i][None], out=prod)
            t += prod
        s = np.zeros((r1 - r0, cols.shape[0], n))
        for j in range(cols.shape[1]):
            s += t[:, :, j]
        tot = np.zeros((r1 - r0, n))
        for c in range(cols.shape[0]):
            tot += s[:, c]
        out[r0:r1] = tot
    return out


def ordered_dot_pairs(x, w, chunk: int = ORDER_CHUNK, step: int = ORDER_STEP) -> np.ndarray:
    """``sum_k x[i, k] w[i, k]`` for each row ``i`` of float64 ``x``, ``w`` ``[X, K]``, float64 ``[X]``, in the order of
    :func:`ordered_dot` (``ordered_dot(x[i:i+1], w[i:i+1])[0, 0]`` for each ``i``, the same bits): for a caller that
    needs a few scattered outputs ``(m, n)`` of ``ordered_dot`` and passes the rows ``x[m]``, ``w[n]``."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    rows, k = x.shape
    out = np.zeros(rows)
    if rows == 0 or k == 0:
        return out
    cols = grouped_columns(k, chunk, step)
    xg, wg = _gather_cols(x, cols), _gather_cols(w, cols)                # [X, nch, steps, step]
    t = np.zeros(xg.shape[:3])
    for i in range(cols.shape[2]):  # column order within a step
        t += xg[..., i] * wg[..., i]
    s = np.zeros(xg.shape[:2])
    for j in range(cols.shape[1]):
        s += t[:, :, j]
    for c in range(cols.shape[0]):
        out += s[:, c]
    return out


U_F64 = 2.0**-53


def gamma(n, u: float) -> float:
    """``n u / (1 - n u)`` (Higham's gamma_n); ``inf`` when ``n u >= 1``.

    >>> gamma(128, 2.0**-24) < 128 * 2.0**-24 * 1.00001
    True
    """
    nu = float(n) * u
    return math.inf if nu >= 1 else nu / (1.0 - nu)
