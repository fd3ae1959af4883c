"""The device bound's one-pass kernels against independent oracles, bit for bit (CPU: the Triton interpreter):
per-row statistics (:mod:`moeref.compare.device._stats_kernels`) against :func:`moeref.gemm.exact.quantum_and_max` and
ml_dtypes' bfloat16 cast, and the top-k weighted sums (:mod:`moeref.compare.device._reduce_kernels`) against the reference's
slot-order loop written out in NumPy."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from moeref.compare.device._reduce_kernels import weighted_slot_sums_t
from moeref.compare.device._stats_kernels import row_stats_t
from moeref.gemm.exact import quantum_and_max

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _row_oracle(row):
    fin = bool(np.isfinite(row).all())
    with np.errstate(over="ignore"):
        bf = fin and bool((row.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) == row).all())
    q, m = quantum_and_max(row[np.isfinite(row)])
    return fin, bf, q, m


def _bf16_values(rng, n):
    """Random bfloat16 values over the whole range, subnormals (multiples of 2^-133) and the largest included."""
    bits = rng.integers(0, 0x7F80, n).astype(np.uint16)  # finite, positive
    v = bits.view(ml_dtypes.bfloat16).astype(np.float64)
    return v * np.where(rng.random(n) < 0.5, -1.0, 1.0)


def test_row_stats_equal_quantum_and_max_and_the_bf16_cast():
    """Rows of zeros (both signs), NaN, infinities, float64 subnormals, bfloat16 values (subnormal to the largest: bf16
    flag set), values one bit off bfloat16 (flag clear), FP8-like integers and magnitudes over the whole float64
    range; K not a multiple of the kernel's column tile and more than one tile."""
    rng = np.random.default_rng(3)
    k = 700
    v = rng.standard_normal((12, k)) * np.exp2(rng.integers(-1100, 1000, (12, k)))
    v[0] = 0.0
    v[1] = -0.0
    v[2, 3] = np.nan
    v[3, 5] = -np.inf
    v[4] = 5e-324 * rng.integers(1, 1 << 20, k)                    # float64 subnormals
    v[5] = _bf16_values(rng, k)
    v[5, :3] = [2.0**-133, -(2.0**-133) * 127, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)]
    v[6] = _bf16_values(rng, k)
    v[6, 17] = np.nextafter(v[6, 17], np.inf)                     # one element off the bf16 grid
    v[7] = _bf16_values(rng, k)
    v[7, 4] = 2.0**-134                                            # below bf16's smallest subnormal
    v[8] = rng.integers(-448, 449, k).astype(np.float64) / 64.0
    v[9] = _bf16_values(rng, k)
    v[9, 9] = 2.0**128                                             # above bf16's range
    v[10, :] = 1.0
    v[10, 0] = 2.0**-1074
    got = row_stats_t(torch.as_tensor(v, device=DEV)).cpu().numpy()
    assert got.shape == (4, v.shape[0])
    for i, row in enumerate(v):
        fin, bf, q, m = _row_oracle(row)
        assert (bool(got[0, i]), bool(got[1, i])) == (fin, bf), (i, got[:2, i], fin, bf)
        assert got[2, i] == q and got[3, i] == m, (i, got[2:, i], q, m)
    assert bool(got[1, 5]) and not got[1, 6] and not got[1, 7] and not got[1, 9]  # the cases meant above


def test_row_stats_of_no_rows_and_no_columns():
    assert row_stats_t(torch.zeros((0, 5), dtype=torch.float64, device=DEV)).shape == (4, 0)
    got = row_stats_t(torch.zeros((3, 0), dtype=torch.float64, device=DEV)).cpu().numpy()
    assert (got[0] == 1).all() and (got[1] == 1).all() and np.isinf(got[2]).all() and (got[3] == 0).all()


def _slot_sums_oracle(y, dy, slot_row, w, apply):
    t, k = w.shape
    w = w.astype(np.float64) if apply else np.ones((t, k))
    outs = [np.zeros((t, y.shape[1])) for _ in range(3)]
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(k):  # the reference's zero rows for slots no row holds
            r = slot_row.reshape(t, k)[:, j]
            yy = np.where((r >= 0)[:, None], y[np.maximum(r, 0)], 0.0)
            dd = np.where((r >= 0)[:, None], dy[np.maximum(r, 0)], 0.0)
            outs[0] = outs[0] + w[:, j:j + 1] * yy
            outs[1] = outs[1] + np.abs(w[:, j:j + 1]) * dd
            outs[2] = outs[2] + np.abs(w[:, j:j + 1]) * (np.abs(yy) + dd)
    return outs


@pytest.mark.parametrize("apply", [True, False])
def test_weighted_slot_sums_equal_the_slot_order_loop(apply):
    """Random rows and routing with dropped slots, a negative, a zero and an infinite weight, NaN and signed zeros in
    the rows; columns not a multiple of the kernel's block."""
    rng = np.random.default_rng(5)
    t, k, d = 7, 3, 1100
    r = 15
    y = rng.standard_normal((r, d)) * np.exp2(rng.integers(-30, 30, (r, d)))
    y[2, :5] = [-0.0, 0.0, np.nan, -np.inf, 1e-320]
    dy = np.abs(rng.standard_normal((r, d)))
    dy[3, 7] = np.inf
    slots = rng.permutation(t * k)[:r]
    slot_row = np.full(t * k, -1, dtype=np.int64)
    slot_row[slots] = np.arange(r)
    w = rng.standard_normal((t, k)).astype(np.float32)
    w[0, 0], w[1, 1], w[2, 2] = -0.75, 0.0, np.inf
    got = weighted_slot_sums_t(torch.as_tensor(y, device=DEV), torch.as_tensor(dy, device=DEV),
                               torch.as_tensor(slot_row, device=DEV), torch.as_tensor(w, device=DEV), apply)
    for name, want, g in zip(("center", "radius", "magnitude"), _slot_sums_oracle(y, dy, slot_row, w, apply), got):
        g = g.cpu().numpy()
        assert g.shape == want.shape
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(g), nan), name  # NaN payloads are the engine's own
        assert np.array_equal(g[~nan].view(np.int64), want[~nan].view(np.int64)), name
