"""Exact block-scaled GEMMs (moeref.gemm): oracles written here from the published algorithms.

* Fractions oracle: the exact rational value of sum_k a_k b_k from the decoded operands.
* vLLM ``native_w8a8_block_matmul``: ``C += (A_i @ B_j.T) * As_i * Bs_j`` tile by tile.
* CUTLASS NVFP4: ``alpha * sum_blocks (e_a s_a)(e_b s_b)`` with ``alpha = g_a g_b`` (``g1_alphas``).
"""
from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from moeref.gemm import (
    BlockOperand,
    as_operand,
    block_gemm,
    grouped_gemm_batched,
    grouped_gemm_contiguous,
    grouped_gemm_masked,
    grouped_gemm_standard,
    partial_dots_exact,
    quantum_and_max,
)
from moeref.quant import fp8_block, fp8_group, fp8_per_channel, fp8_per_tensor, fp8_per_token, int8_per_channel, \
    int8_per_token, mxfp4, mxfp8, quantize, w4a8_cutlass

RNG = np.random.default_rng(1234)


def _exact(a_deq: np.ndarray, b_deq: np.ndarray) -> np.ndarray:
    """sum_k a[m,k] b[n,k] as exact rationals, then rounded once to float64."""
    m, k = a_deq.shape
    n = b_deq.shape[0]
    fa = [[Fraction(float(v)) for v in row] for row in a_deq]
    fb = [[Fraction(float(v)) for v in row] for row in b_deq]
    return np.array([[float(sum(x * y for x, y in zip(fa[i], fb[j]))) for j in range(n)] for i in range(m)])


def _abs_sum(a_deq, b_deq):
    return np.abs(a_deq) @ np.abs(b_deq).T


# ------------------------------------------------------------------ exactness


def test_single_block_fp8_dot_is_exact():
    """One scale block on each side: the result is exactly s_a s_b sum e_a e_b (one rounding)."""
    a = quantize(RNG.standard_normal((3, 64)).astype(np.float32), fp8_per_token())
    b = quantize(RNG.standard_normal((5, 64)).astype(np.float32), fp8_per_channel())
    got = block_gemm(a, b)
    ea, eb = a.element_values(), b.element_values()
    sa, sb = a.scale_values().reshape(-1), b.scale_values().reshape(-1)
    exact_elems = _exact(ea, eb)  # exactly representable: 36 + 6 bits < 53
    want = (exact_elems * sa[:, None]) * sb[None, :]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "a_scheme,b_scheme",
    [
        (fp8_group(128), fp8_block()),  # DeepGEMM 1x128 x 128x128, FP32 scales
        (fp8_group(128, "ue8m0"), fp8_block(scale="ue8m0")),  # DeepGEMM UE8M0 scales
        (mxfp8(), mxfp8()),
        (fp8_group(128), mxfp4()),  # DeepGEMM FP4 experts: act blocks 128, weight blocks 32
        (None, mxfp4()),  # gpt-oss: bf16 x MXFP4
        (fp8_per_tensor(), fp8_per_tensor()),
        (int8_per_token(), int8_per_channel()),
        (fp8_per_token(), w4a8_cutlass()),
    ],
)
def test_block_gemm_matches_exact_rational_sum(a_scheme, b_scheme):
    a32 = RNG.standard_normal((4, 256)).astype(np.float32)
    b32 = RNG.standard_normal((6, 256)).astype(np.float32)
    if a_scheme is None:
        a = a32.astype(ml_dtypes.bfloat16)
        a_deq = a.astype(np.float64)
    else:
        a = quantize(a32, a_scheme)
        a_deq = a.dequantize(np.float64)
    b = quantize(b32, b_scheme)
    b_deq = b.dequantize(np.float64)
    got = block_gemm(a, b)
    want = _exact(a_deq, b_deq)
    # float64-accurate: scales applied per segment and at most K/32 segments summed
    tol = 64 * 2.0**-53 * _abs_sum(a_deq, b_deq)
    assert np.all(np.abs(got - want) <= tol)


def test_block_gemm_equals_vllm_native_block_matmul():
    """vLLM tests/kernels/quant_utils.py::native_w8a8_block_matmul, written out here (float64)."""
    a = quantize(RNG.standard_normal((5, 384)).astype(np.float32), fp8_group(128))
    b = quantize(RNG.standard_normal((256, 384)).astype(np.float32), fp8_block())
    ea, eb, sa, sb = a.element_values(), b.element_values(), a.scale_values(), b.scale_values()
    want = np.zeros((5, 256))
    for j in range(2):  # output-channel tiles of 128
        for i in range(3):  # K tiles of 128
            part = ea[:, i * 128:(i + 1) * 128] @ eb[j * 128:(j + 1) * 128, i * 128:(i + 1) * 128].T
            want[:, j * 128:(j + 1) * 128] += part * sa[:, i:i + 1] * sb[j, i]
    np.testing.assert_allclose(block_gemm(a, b), want, rtol=1e-15, atol=1e-13)


def test_nvfp4_matches_cutlass_alpha_formulation():
    """CUTLASS FP4 MoE: acc = sum_blocks (e_a ue4m3_a)(e_b ue4m3_b) in fp32, then * g1_alphas, where
    alpha = 1 / (a1_gscale * w1_gscale) = g_a * g_b in decode terms. Exact version here."""
    from moeref.quant.nvfp4 import nvfp4

    a = quantize(RNG.standard_normal((3, 64)).astype(np.float32), nvfp4("activation"))
    b = quantize(RNG.standard_normal((16, 64)).astype(np.float32), nvfp4("weight"))
    blk_a = a.scale_values() / a.global_scale
    blk_b = b.scale_values() / b.global_scale
    ea = a.element_values() * np.repeat(blk_a, 16, axis=1)
    eb = b.element_values() * np.repeat(np.repeat(blk_b, 16, axis=0), 16, axis=1)
    acc = _exact(ea, eb)
    want = acc * (a.global_scale * b.global_scale)
    tol = 16 * 2.0**-53 * _abs_sum(a.dequantize(np.float64), b.dequantize(np.float64))
    assert np.all(np.abs(block_gemm(a, b) - want) <= tol)


def test_bf16_operands_are_float64_accurate():
    a = RNG.standard_normal((4, 77)).astype(ml_dtypes.bfloat16)
    b = RNG.standard_normal((3, 77)).astype(ml_dtypes.bfloat16)
    got = block_gemm(a, b)
    want = _exact(a.astype(np.float64), b.astype(np.float64))
    assert np.all(np.abs(got - want) <= 77 * 2.0**-53 * _abs_sum(a.astype(np.float64), b.astype(np.float64)))


def test_quantum_and_partial_dot_exactness_bound():
    """E4M3: quantum 2^-9, max 448: 36 + log2(g) bits, exact up to g = 2^17 and not beyond."""
    assert quantum_and_max(np.array([448.0, 2.0**-9, -3.0])) == (2.0**-9, 448.0)
    assert quantum_and_max(np.zeros(3)) == (float("inf"), 0.0)

    def op(g):
        v = np.full((1, g), 2.0**-9)
        v[0, 0] = 448.0
        return BlockOperand(v, np.ones((1, 1)), (1, g), True)

    assert partial_dots_exact(op(2**17), op(2**17))
    assert not partial_dots_exact(op(2**18), op(2**18))


def test_common_refinement_of_k_blockings():
    """Scales of 128-wide activation blocks and 32-wide weight blocks: each 32-segment gets the
    product of its own two scales (changing one weight block's scale changes only its segment)."""
    a = BlockOperand(np.ones((1, 128)), np.array([[2.0]]), (1, 128), True)
    b = BlockOperand(np.ones((1, 128)), np.array([[1.0, 3.0, 5.0, 7.0]]), (1, 32), True)
    assert block_gemm(a, b).tolist() == [[2.0 * 32 * (1 + 3 + 5 + 7)]]
    odd = BlockOperand(np.ones((1, 100)), np.array([[1.0, 10.0, 100.0]]), (1, 48), True)  # partial last block
    assert block_gemm(np.ones((1, 100)), odd).tolist() == [[48.0 + 10.0 * 48 + 100.0 * 4]]
    with pytest.raises(ValueError, match="block grid"):
        BlockOperand(np.ones((1, 100)), np.array([[1.0, 10.0]]), (1, 48), True)


def test_as_operand_resolves_blocks_and_errors():
    q = quantize(RNG.standard_normal((4, 256)).astype(np.float32), fp8_per_tensor())
    op = as_operand(q)
    assert op.block == (4, 256) and op.scales.shape == (1, 1) and op.quantized
    np.testing.assert_array_equal(op.dequantize(), q.dequantize(np.float64))
    with pytest.raises(ValueError, match="K=3"):
        block_gemm(np.ones((2, 3)), np.ones((2, 4)))
    with pytest.raises(TypeError):
        as_operand(np.ones((2, 2), dtype=np.int32))
    taken = op.take_rows(np.array([2, -1]))
    assert taken.block == (1, 256)
    np.testing.assert_array_equal(taken.dequantize()[1], 0.0)


# ------------------------------------------------------------------ grouped GEMMs per layout


def _weights(e=4, n=8, k=32, scheme=None):
    ws = [RNG.standard_normal((n, k)).astype(np.float32) for _ in range(e)]
    return [quantize(w, scheme) for w in ws] if scheme else ws


def test_standard_layout_against_per_slot_loop():
    w = _weights(scheme=mxfp8())
    a = quantize(RNG.standard_normal((3, 32)).astype(np.float32), mxfp8())
    ids = np.array([[2, 0], [1, -1], [3, 2]], dtype=np.int32)
    bias = RNG.standard_normal((4, 8))
    got = grouped_gemm_standard(a, w, ids, 4, bias=bias)
    a_deq = a.dequantize(np.float64)
    for t in range(3):
        for j in range(2):
            e = ids[t, j]
            want = 0.0 if e < 0 else w[e].dequantize(np.float64) @ a_deq[t] + bias[e]
            np.testing.assert_allclose(got[t, j], want, rtol=1e-13, atol=1e-13)


def test_layouts_give_identical_rows():
    from moeref.dispatch import to_batched, to_contiguous, to_masked

    w = _weights(scheme=fp8_block((4, 16)))
    x = RNG.standard_normal((5, 32)).astype(np.float32)
    a = quantize(x, fp8_group(16))
    ids = np.array([[0, 3], [3, 1], [-1, -1], [1, 0], [3, 2]], dtype=np.int32)
    std = grouped_gemm_standard(a, w, ids, 4).reshape(10, -1)
    op = as_operand(a)
    c = to_contiguous(None, ids, 4, alignment=3)
    cont = grouped_gemm_contiguous(op.take_rows(np.where(c.src >= 0, c.src // 2, -1)), w, c.m_indices)
    m = to_masked(None, ids, 4, max_m=4)
    mask = grouped_gemm_masked(op.take_rows(np.where(m.src >= 0, m.src // 2, -1).ravel()), w, m.masked_m)
    b = to_batched(None, ids, 4, max_tokens_per_dispatcher=5)
    bat = grouped_gemm_batched(op.take_rows(np.where(b.src >= 0, b.src // 2, -1).ravel()), w, b.expert_num_tokens)
    for rows, src in ((cont, c.src), (mask.reshape(-1, 8), m.src.ravel()), (bat.reshape(-1, 8), b.src.ravel())):
        valid = src >= 0
        np.testing.assert_array_equal(rows[valid], std[src[valid]])
        np.testing.assert_array_equal(rows[~valid], 0.0)


def test_grouped_errors_name_the_argument():
    w = _weights()
    with pytest.raises(ValueError, match="masked_m"):
        grouped_gemm_masked(np.ones((8, 32)), w, np.array([5, 0, 0, 0], dtype=np.int32))
    with pytest.raises(ValueError, match="row_expert"):
        grouped_gemm_contiguous(np.ones((2, 32)), w, np.array([0, 7], dtype=np.int32))


def test_fast_element_decode_equals_element_values():
    for scheme in (fp8_block(), int8_per_channel(), mxfp4(), w4a8_cutlass()):
        q = quantize(RNG.standard_normal((8, 256)).astype(np.float32), scheme)
        np.testing.assert_array_equal(as_operand(q).values, q.element_values(np.float64))
