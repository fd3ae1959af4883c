"""Single-rounding regimes: exact in FP32 in any order, yet the bf16 store rounds, so an RZ store, a bf16 or
fp16 accumulator and a second store are each seen to differ by equality."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moeref.regimes import in_exact_regime, round_half_away_bf16, round_toward_zero_bf16, rounding_gemm

BF16 = ml_dtypes.bfloat16


def _rne_bf16(x):  # independent: ml_dtypes' cast of FP32 values (round to nearest even)
    return np.asarray(x, np.float32).astype(BF16).astype(np.float64)


def _exact(a, w):
    return a.astype(np.float64) @ w.astype(np.float64).T


def _running_sum(a, w, dtype):
    """A sequential accumulator of ``dtype`` (rounded after every addition), K in order."""
    acc = np.zeros((a.shape[0], w.shape[0]), np.float32)
    for j in range(a.shape[1]):
        acc = (acc + a[:, j:j + 1] * w[:, j][None, :]).astype(dtype).astype(np.float32)
    return acc.astype(np.float64)


@pytest.mark.parametrize("seed", range(3))
def test_exact_in_fp32_any_order(seed):
    a, w = rounding_gemm(16, 24, 128, seed=seed)
    assert in_exact_regime((a, w), "fp32").ok
    ex = _exact(a, w)
    assert np.all((np.abs(ex) >= 2**11) & (np.abs(ex) < 2**13))
    perm = np.random.default_rng(seed).permutation(128)
    assert np.array_equal((a[:, perm] @ w[:, perm].T).astype(np.float64), ex)
    assert np.array_equal(_running_sum(a[:, ::-1], w[:, ::-1], np.float32), ex)


def test_rz_store_and_narrow_accumulators_differ():
    a, w = rounding_gemm(16, 24, 128, seed=0)
    ex = _exact(a, w)
    rne = _rne_bf16(ex)
    assert np.count_nonzero(round_toward_zero_bf16(ex) != rne) > 0.2 * ex.size
    assert not in_exact_regime((a, w), "bf16_accumulator").ok
    assert not in_exact_regime((a, w), "fp16_accumulator").ok
    assert np.count_nonzero(_rne_bf16(_running_sum(a, w, BF16)) != rne) > 0
    assert np.count_nonzero(_rne_bf16(_running_sum(a, w, np.float16)) != rne) > 0


def test_a_second_store_differs_from_one():
    """Two slots' outputs stored in bf16 before their sum (two roundings) against the FP32 sum stored once."""
    a, w = rounding_gemm(8, 16, 64, seed=1)
    y1, y2 = _exact(a, w), _exact(a[::-1], w)
    once = _rne_bf16(0.5 * y1 + 0.25 * y2)
    twice = _rne_bf16(0.5 * _rne_bf16(y1) + 0.25 * _rne_bf16(y2))
    assert np.count_nonzero(once != twice) > 0


def test_ties_separate_rne_from_half_away_and_rz():
    a, w = rounding_gemm(4, 32, 2, ties=True, seed=2)
    ex = _exact(a, w)
    assert in_exact_regime((a, w), "fp32").ok
    assert np.all((ex - 4096 - 16) % 32 == 0)  # every sum a bf16 midpoint
    rne = _rne_bf16(ex)
    assert np.count_nonzero(round_half_away_bf16(ex) != rne) > 0
    assert np.count_nonzero(round_toward_zero_bf16(ex) != rne) > 0
    # by hand: 4112 = 4096 + 16 is a tie between 4096 (even) and 4128: RNE 4096, half-away 4128
    assert _rne_bf16(np.array([4112.0])).tolist() == [4096.0]
    assert round_half_away_bf16(np.array([4112.0])).tolist() == [4128.0]
