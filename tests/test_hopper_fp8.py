"""The Hopper FP8 accumulation emulator (:mod:`moeref.gemm.hopper_fp8`) on hand-derived cases.

Every expected value below is worked out by hand from the model's statement (docs/hopper-fp8-accumulation.md),
not produced by the emulator; the comments give the arithmetic. The emulator's agreement with real
hardware is tested on the GPU (tests/test_hopper_fp8_gpu.py) and recorded in
bench/results/hopper_fp8_calibration.json.
"""
from __future__ import annotations

import numpy as np
import pytest

from moeref.gemm.hopper_fp8 import (HOPPER_FP8_MMA, MmaModel, deepgemm_fp8_gemm, deepgemm_grouped_contiguous,
                                    fp32_fma, mma_accumulate, operand_exponents, promote, round_significand)


def acc(a, b, c=None, model=HOPPER_FP8_MMA):
    a = np.zeros(32) + np.pad(np.asarray(a, float), (0, 32 - len(a)))
    b = np.zeros(32) + np.pad(np.asarray(b, float), (0, 32 - len(b)))
    return float(mma_accumulate(a, b, model, c=c))


def test_small_terms_below_the_grid_of_the_largest_are_cut():
    # 448 * 448 = 200704 = 1.53125 * 2^17, operand exponents 8 + 8 = 16 -> grid 2^(16 - 13) = 8:
    # sixteen products of 1 are each cut to 0 (FP32, or exact-then-normalise, would give 200720)
    assert acc([448] + [1] * 16, [448] + [1] * 16) == 200704.0
    # a product of 16 keeps 2 units of 8: 200720 is a multiple of 16, the lsb of 14 bits at 2^17
    assert acc([448, 4], [448, 4]) == 200720.0
    # two products of 15 keep 8 each: 200720 (exact 200734)
    assert acc([448, 3.75, 3.75], [448, 4, 4]) == 200720.0


def test_negative_addends_are_truncated_toward_zero():
    # -1 on the grid of 8: toward zero 0 -> 200704. Toward -inf it would be -8, and 200696 normalised
    # to 14 bits (lsb 16) is 200688; so is the exact 200703 truncated
    assert acc([448, -1], [448, 1]) == 200704.0
    assert acc([448, -1], [448, 1], model=MmaModel(align_rounding="floor")) == 200688.0
    assert acc([-448, 1], [448, 1]) == -200704.0


def test_alignment_uses_the_operand_exponents_not_the_product_value():
    # 1.875 * 1.875 = 3.515625 has value exponent 1 but operand exponents 0 + 0 = 0 -> grid 2^-13.
    # Two products 2^-6 * 2^-7 = 2^-13 (subnormal 2^-7 enters with exponent -6) are kept: 2^-12 in all.
    # The sum 3.515625 + 2^-12 has 14 significant bits (lsb 2^(1-13)), so normalisation keeps it.
    a, b = [1.875, 2.0**-6, 2.0**-6], [1.875, 2.0**-7, 2.0**-7]
    assert acc(a, b) == 3.515625 + 2.0**-12
    # aligned to the product's own exponent the grid is 2^-12 and both small products are cut
    assert acc(a, b, model=MmaModel(align_exponent="value")) == 3.515625


def test_the_sum_is_truncated_to_14_significant_bits():
    # 240 * 64 = 15360 (operand exponents 7 + 6 = 13 -> grid 1), twice, plus 1: 30721 needs 15 bits;
    # truncated to 14 significant bits (lsb 2) it is 30720
    assert acc([240, 240, 1], [64, 64, 1]) == 30720.0
    # 15361 fits in 14 bits and is kept
    assert acc([240, 1], [64, 1]) == 15361.0


def test_an_fp32_c_keeps_14_bits():
    # A = B = 0: C = 1 + 2^-13 + 2^-20 is aligned to its own exponent 0 and cut to the grid 2^-13
    # (SageAttention2's observation: the low 10 bits of C's significand are lost)
    assert acc([0.0], [0.0], c=1 + 2.0**-13 + 2.0**-20) == 1 + 2.0**-13
    # C = 2^20 dominates a product of 1 (grid 2^7): the product is cut
    assert acc([1.0], [1.0], c=2.0**20) == 2.0**20


def test_chained_mmas_carry_the_accumulator():
    # K = 64. Forward: the first MMA gives 200704; in the second the accumulator (value exponent 17)
    # sets the grid 2^4 = 16, and sixteen products of 1 are cut
    a = np.zeros(64)
    b = np.zeros(64)
    a[0] = b[0] = 448.0
    a[32:48] = b[32:48] = 1.0
    assert float(mma_accumulate(a, b)) == 200704.0
    # reversed: the ones come first and sum exactly to 16; then 448 * 448 sets the grid 8 and the
    # accumulator 16 is kept: 200720
    assert float(mma_accumulate(a[::-1].copy(), b[::-1].copy())) == 200720.0


def test_round_significand_modes():
    x = np.array([1 + 2.0**-14, -(1 + 2.0**-14 + 2.0**-15), 3.0])
    assert round_significand(x, 14, "trunc").tolist() == [1.0, -1.0, 3.0]
    assert round_significand(x, 14, "floor").tolist() == [1.0, -(1 + 2.0**-13), 3.0]
    assert round_significand(np.array([1 + 2.0**-14, 1 + 3 * 2.0**-14]), 14, "nearest").tolist() == \
        [1.0, 1 + 2 * 2.0**-13]  # ties to even


def test_operand_exponents_put_subnormals_at_emin():
    assert operand_exponents(np.array([448.0, 1.0, 2.0**-6, 2.0**-9, -3.0])).tolist() == [8, 0, -6, -6, 1]


def test_fp32_fma_rounds_once():
    u = 2.0**-12
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: a tie between 1 + 2^-11 and 1 + 2^-11 + 2^-23 -> even
    assert float(fp32_fma(1 + u, 1 + u, 0.0)) == 1 + 2.0**-11
    # + 2^-80 lifts it above the tie: one rounding gives the upper neighbour (rounding through
    # float64 first would lose the 2^-80 and round to even)
    assert float(fp32_fma(1 + u, 1 + u, 2.0**-80)) == 1 + 2.0**-11 + 2.0**-23
    assert float(fp32_fma(1 + u, 1 + u, -(2.0**-80))) == 1 + 2.0**-11


def test_promotion_orders():
    acc_ = np.array([[[1 + 2.0**-12]]])
    sa = np.array([[1 + 2.0**-12]])
    sb = np.array([[1.0 + 2.0**-11]])
    # deepgemm: s = fl(sa sb) = 1 + 2^-11 + 2^-12 + 2^-23 (exact: 24 bits). s * acc = s + s 2^-12
    # = 1 + 2^-10 + 2^-22 + 2^-24 + 2^-35; below the lsb 2^-23 remains 2^-24 + 2^-35, above half an
    # ulp: rounds up to 1 + 2^-10 + 2^-22 + 2^-23
    assert float(promote(acc_, sa, sb, "deepgemm")[0, 0]) == 1 + 2.0**-10 + 2.0**-22 + 2.0**-23
    # a_then_b: fl(acc sa) = fl(1 + 2^-11 + 2^-24) = 1 + 2^-11 (tie to even); times sb:
    # 1 + 2^-11 + 2^-11 + 2^-22 = 1 + 2^-10 + 2^-22 exactly
    assert float(promote(acc_, sa, sb, "a_then_b")[0, 0]) == 1 + 2.0**-10 + 2.0**-22


def test_deepgemm_gemm_end_to_end_by_hand():
    # K = 256: block 0 holds 448*448 + seven 1*1 (accumulator 200704, see above), block 1 a single 2*2 = 4.
    # Scales: sa = [2^-10, 1], sb = [2^-8, 1] -> final = 200704 * 2^-18 + 4 = 0.765625 + 4 = 4.765625,
    # bf16 (8 significant bits, lsb 2^-5 at 4): 4.765625 = 4 + 0.765625 = 4 + 24.5 * 2^-5 -> tie -> even 4.75
    a = np.zeros((1, 256))
    b = np.zeros((1, 256))
    a[0, :8] = [448] + [1] * 7
    b[0, :8] = [448] + [1] * 7
    a[0, 128] = b[0, 128] = 2.0
    out = deepgemm_fp8_gemm(a, np.array([[2.0**-10, 1.0]]), b, np.array([[2.0**-8, 1.0]]))
    assert out.astype(np.float64)[0, 0] == 4.75
    f32 = deepgemm_fp8_gemm(a, np.array([[2.0**-10, 1.0]]), b, np.array([[2.0**-8, 1.0]]), out_dtype="float32")
    assert f32[0, 0] == np.float32(4.765625)


def test_grouped_contiguous_rows_and_padding():
    a = np.zeros((3, 128))
    a[:, 0] = [1.0, 2.0, 3.0]
    b = np.zeros((2, 128, 128))
    b[0, :, 0] = 1.0
    b[1, :, 0] = 2.0
    sa = np.ones((3, 1))
    sb = np.ones((2, 1, 1))
    out = deepgemm_grouped_contiguous(a, sa, b, sb, np.array([0, 1, -1]), out_dtype="float32")
    assert out[0, 0] == 1.0 and out[1, 0] == 4.0 and np.isnan(out[2]).all()


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="E4M3"):
        deepgemm_fp8_gemm(np.full((1, 128), 0.3), np.ones((1, 1)), np.ones((1, 128)), np.ones((1, 1)))
    with pytest.raises(ValueError, match="multiple of block_k"):
        deepgemm_fp8_gemm(np.ones((1, 64)), np.ones((1, 1)), np.ones((1, 64)), np.ones((1, 1)))
    with pytest.raises(ValueError, match="group must divide"):
        MmaModel(group=24)
    with pytest.raises(ValueError, match="m_indices"):
        deepgemm_grouped_contiguous(np.ones((1, 128)), np.ones((1, 1)), np.ones((1, 128, 128)), np.ones((1, 1, 1)),
                                    np.array([3]))


def _fp8_case(seed=0):
    import ml_dtypes

    from moeref.compare.faults import LayerCase
    from moeref.moe import MoEQuant, make_layer, make_tokens, quantize_weights
    from moeref.quant import fp8_block, fp8_group
    from moeref.routing import softmax_topk

    r = softmax_topk(np.random.default_rng(seed + 2).standard_normal((16, 4)), 2, renormalize=True)
    lw = quantize_weights(make_layer(4, 256, 256, seed=seed), fp8_block())
    opts = dict(out_dtype=ml_dtypes.bfloat16, quant=MoEQuant(fp8_group(128), fp8_group(128), "fp8 1x128 x 128x128"))
    return LayerCase(make_tokens(16, 256, seed=seed + 1, dtype=ml_dtypes.bfloat16), lw, r.weights, r.ids, opts)


def test_exact_profile_passes_the_emulated_kernel_and_catches_subtle_faults():
    from moeref.compare import compare
    from moeref.compare.bounds import DEEPGEMM_FP8_EXACT
    from moeref.compare.faults import reference
    from moeref.compare.subtle_faults import HONEST_DEEPGEMM, subtle_faults
    from moeref.gemm.hopper_fp8 import deepgemm_engine

    case = _fp8_case()
    ref = reference(case)
    for name, make in HONEST_DEEPGEMM.items():
        assert compare(make(case), ref, DEEPGEMM_FP8_EXACT).passed, name
    faults = subtle_faults(deepgemm_engine())
    for name in ("GEMM2 output truncated to bf16 (round toward zero)", "router weights rounded to bf16",
                 "bf16 accumulator in both GEMMs"):
        assert not compare(faults[name](case), ref, DEEPGEMM_FP8_EXACT).passed, name


def test_grouped_gemm_report_compares_by_equality():
    import ml_dtypes

    from moeref.quant import fp8_block, fp8_group, quantize
    from moeref.testing import grouped_gemm_report

    rng = np.random.default_rng(0)
    a = quantize(rng.standard_normal((128, 256)).astype(np.float32), fp8_group(128))
    w = [quantize(rng.standard_normal((128, 256)).astype(np.float32), fp8_block())]
    m_idx = np.zeros(128, dtype=np.int32)
    out = deepgemm_grouped_contiguous(a.element_values(), a.scale_values(), np.asarray(w[0].element_values())[None],
                                      np.asarray(w[0].scale_values())[None], m_idx)
    rep = grouped_gemm_report(out, a, w, "DEEPGEMM_FP8_EXACT", m_indices=m_idx)
    assert rep.passed
    bad = out.copy()
    bits = bad.view(np.uint16)
    bits[3, 5] ^= 1  # one bf16 ulp in one element
    rep = grouped_gemm_report(bad.astype(ml_dtypes.bfloat16), a, w, "DEEPGEMM_FP8_EXACT", m_indices=m_idx)
    assert not rep.passed and int(rep.violations.sum()) == 1


def _bench(name):
    import importlib

    return importlib.import_module(f"bench.{name}")


def test_docs_tables_are_generated_from_the_committed_json():
    """docs/hopper-fp8-accumulation.md's calibration and power tables are the scripts' --markdown output
    of bench/results/hopper_fp8_calibration*.json and oracle_power_exact.json."""
    import json
    import os

    root = os.path.join(os.path.dirname(__file__), os.pardir)
    doc = open(os.path.join(root, "docs", "hopper-fp8-accumulation.md")).read()
    results = os.path.join(root, "bench", "results")
    files = sorted(f for f in os.listdir(results) if f.startswith("hopper_fp8_calibration"))
    cal = _bench("studies.calibrate_hopper_fp8").markdown(
        [json.load(open(os.path.join(root, "bench", "results", f))) for f in files])
    assert cal.strip() in doc, ("run bench/studies/calibrate_hopper_fp8.py --markdown "
                                "bench/results/hopper_fp8_calibration*.json")
    power = _bench("bench_oracle_power").markdown(json.load(open(os.path.join(root, "bench", "results",
                                                                              "oracle_power_exact.json"))))
    assert power.strip() in doc, "run bench/bench_oracle_power.py --from-json bench/results/oracle_power_exact.json"
