"""moeref.regimes, GEMM level: the checker's arithmetic, the operands, and the regime's promise (inside it,
FP32 GEMMs in any order and the emulated Hopper FP8 accumulators give the exact result; outside it a
narrower accumulator is seen to differ)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeref.gemm import as_operand, block_gemm, expert_rows_gemm
from moeref.gemm.hopper_fp8 import HOPPER_FP8_MMA, deepgemm_engine, mma_accumulate
from moeref.regimes import (ARITHMETICS, EXACT_SCHEMES, Arithmetic, exact_operand, in_exact_regime,
                            lsb_exponents, significant_bits)
from moeref.regimes.checker import operand_real_values
from moeref.regimes.strategies import GEMM_PAIRS, exact_grouped_gemms

def slow(n: int):
    """Settings for a slow property: at most ``n`` examples (fewer when the profile asks for fewer)."""
    return settings(deadline=None, max_examples=min(n, settings().max_examples),
                    suppress_health_check=list(HealthCheck))


def test_lsb_and_bits_by_hand():
    # 448 = 7 * 2^6; 0.375 = 3 * 2^-3; 2^-149 is FP32's smallest subnormal
    assert lsb_exponents(np.array([448.0, -0.375, 2.0**-149, 6.0])).tolist() == [6, -3, -149, 1]
    assert significant_bits(np.array([255.0, 256.0, 257.0, -7.0])).tolist() == [8, 1, 9, 3]


def test_checker_thresholds_by_hand():
    # FP32: integers up to 2^24 are exact; 2^24 + 1 is not
    a = np.array([[2.0**23, 2.0**23, 1.0]])
    w = np.ones((1, 3))
    assert not in_exact_regime((a, w), "fp32").ok  # sum 2^24 + 1 with quantum 1: 25 bits
    assert in_exact_regime((a[:, :2], w[:, :2]), "fp32").ok  # 2^24 with quantum 2^23: 2 bits
    # opposite signs: the partial sums never exceed the larger one-sided sum
    b = np.array([[2.0**23 - 1, -(2.0**23 - 1), 1.0]])
    assert in_exact_regime((b, w), "fp32").ok
    # 14-bit MMA, quantum 1: 128 products 7 x 7 sum to 6272 < 2^14, 15 x 15 to 28800 > 2^14
    a7 = np.full((1, 128), 7.0)
    assert in_exact_regime((a7, a7), "hopper_fp8").ok
    ok, why = in_exact_regime((2 * a7 + 1, 2 * a7 + 1), "hopper_fp8")
    assert not ok and "hopper_fp8 accumulator" in why[0]
    # never promoted: the whole K counts (512 x 49 = 25088 > 2^14); promoted every 128: 6272 each
    a7 = np.full((1, 512), 7.0)
    assert not in_exact_regime((a7, a7), "fp8_unpromoted").ok
    assert in_exact_regime((a7, a7), "hopper_fp8").ok


def test_checker_rejects_bad_input():
    with pytest.raises(TypeError, match="inputs must be"):
        in_exact_regime(np.ones((2, 2)), "fp32")
    with pytest.raises(ValueError, match="accumulator"):
        Arithmetic("x", accumulator="tf32")
    with pytest.raises(ValueError, match="arithmetic"):
        in_exact_regime((np.ones((1, 2)), np.ones((1, 2))), "fp64")
    with pytest.raises(ValueError, match="row_expert"):
        in_exact_regime((np.ones((2, 2)), [np.ones((1, 2))], np.array([0, 1])), "fp32")


@pytest.mark.parametrize("name", sorted(EXACT_SCHEMES))
def test_operands_are_small_values_times_powers_of_two(name):
    q = exact_operand((4, 256), name, seed=3, max_abs=4)
    ev = q.element_values()
    assert np.all(np.abs(ev) <= 4)
    assert np.all(ev * 2 == np.round(ev * 2))  # integers or halves
    sv = q.scale_values()
    assert np.all(significant_bits(sv) == 1)  # every decode factor a power of two
    # the real values are exactly element * scale (independent: ml_dtypes' decode through dequantize)
    assert np.array_equal(q.dequantize(np.float64), operand_real_values(as_operand(q)))


def _fp32_orders(av: np.ndarray, wv: np.ndarray, seed: int) -> list[np.ndarray]:
    """Three FP32 computations of av @ wv.T: BLAS float32, K reversed one column at a time, a random
    K permutation in 4 split-K parts summed pairwise."""
    a32, w32 = av.astype(np.float32), wv.astype(np.float32)
    out = [(a32 @ w32.T).astype(np.float64)]
    acc = np.zeros((av.shape[0], wv.shape[0]), np.float32)
    for k in range(av.shape[1] - 1, -1, -1):
        acc = (acc + a32[:, k:k + 1] * w32[:, k][None, :]).astype(np.float32)
    out.append(acc.astype(np.float64))
    perm = np.random.default_rng(seed).permutation(av.shape[1])
    parts = [(a32[:, p] @ w32[:, p].T).astype(np.float32) for p in np.array_split(perm, 4)]
    out.append(((parts[0] + parts[1]) + (parts[2] + parts[3])).astype(np.float64))
    return out


@slow(30)
@given(exact_grouped_gemms(arithmetics=("fp32",)), st.integers(0, 2**16))
def test_fp32_any_order_gives_the_exact_product(case, seed):
    ref = expert_rows_gemm(case.a, case.row_expert, case.weights)
    av = operand_real_values(as_operand(case.a))
    for e in np.unique(case.row_expert[case.row_expert >= 0]):
        rows = case.row_expert == e
        wv = operand_real_values(as_operand(case.weights[e]))
        for got in _fp32_orders(av[rows], wv, seed):
            assert np.array_equal(got, ref[rows])


@slow(15)
@given(exact_grouped_gemms(pairs=("fp8_1x128_128x128",), arithmetics=("hopper_fp8",), ks=(256, 384)))
def test_emulated_deepgemm_gives_the_exact_product_in_the_hopper_regime(case):
    exact = expert_rows_gemm(case.a, case.row_expert, case.weights)
    emulated = expert_rows_gemm(case.a, case.row_expert, case.weights, gemm=deepgemm_engine())
    assert np.array_equal(exact, emulated)


def test_unpromoted_accumulator_exact_inside_its_regime_and_not_outside():
    rng = np.random.default_rng(5)
    a = rng.integers(-2, 3, size=(4, 512)).astype(np.float64)
    w = rng.integers(-2, 3, size=(6, 512)).astype(np.float64)
    assert in_exact_regime((a, w), "fp8_unpromoted").ok
    acc = mma_accumulate(a[:, None, :], w[None, :, :], HOPPER_FP8_MMA)
    assert np.array_equal(acc, a @ w.T)
    # outside: large terms and a small one never promoted lose the small one
    a2 = np.concatenate([np.full((1, 64), 448.0), np.full((1, 64), 0.015625)], axis=1)
    w2 = np.ones((1, 128))
    assert not in_exact_regime((a2, w2), "fp8_unpromoted").ok
    acc2 = mma_accumulate(a2[:, None, :], w2[None, :, :], HOPPER_FP8_MMA)
    assert not np.array_equal(acc2, a2 @ w2.T)


def test_bf16_accumulator_regime_separates_it_from_fp32():
    # integer sums below 2^8: a bf16 accumulator is exact (the regime says so) ...
    a = np.full((1, 16), 3.0)
    w = np.ones((1, 16))
    assert in_exact_regime((a, w), "bf16_accumulator").ok
    # ... and above 2^8 with odd terms it is not, and indeed a bf16 running sum drifts
    a = np.full((1, 128), 3.0)
    ok, why = in_exact_regime((a, w.repeat(8, axis=1)), "bf16_accumulator")
    assert not ok and "bf16" in why[0]
    import ml_dtypes

    acc = np.float32(0)
    for v in (a * 1.0).ravel():
        acc = np.float32(np.float32(acc + v).astype(ml_dtypes.bfloat16))
    assert float(acc) != 384.0


def test_every_pair_and_arithmetic_is_named():
    assert set(ARITHMETICS) >= {"fp32", "hopper_fp8", "fp8_unpromoted", "bf16_accumulator"}
    for a_s, w_s in GEMM_PAIRS.values():
        for s in (a_s, w_s):
            assert s in EXACT_SCHEMES or s in ("bfloat16", "float16", "float32")


def test_block_gemm_matches_float64_real_values_on_an_exact_pair():
    a = exact_operand((3, 256), "nvfp4", seed=1, max_abs=6, global_exponent=-2)
    w = exact_operand((5, 256), "nvfp4_weight", seed=2, max_abs=6, global_exponent=1)
    av, wv = operand_real_values(as_operand(a)), operand_real_values(as_operand(w))
    assert in_exact_regime((a, w), "fp32").ok
    assert np.array_equal(block_gemm(a, w), av @ wv.T)
