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
from hypothesis import given, settings
from hypothesis import strategies as st

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


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_float_operands_sum_in_k_order_whatever_the_rows_of_the_call(dtype):
    """A float pair's K-sum is the sequential float64 sum of the products in k order from +0.0 (written
    here as a scalar loop), so a row gives the same bits alone, in a batch and among other rows: the
    distributed layer's shared experts and redundant replicas rely on it (BLAS rounds a one-row call
    differently from a two-row one)."""
    a = (RNG.standard_normal((5, 67)) * np.exp2(RNG.integers(-20, 20, (5, 67)))).astype(dtype)
    b = (RNG.standard_normal((4, 67)) * np.exp2(RNG.integers(-20, 20, (4, 67)))).astype(dtype)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = np.zeros((5, 4))
    for i in range(5):
        for j in range(4):
            acc = 0.0
            for k in range(67):
                acc = acc + float(a64[i, k]) * float(b64[j, k])
            want[i, j] = acc
    got = block_gemm(a, b)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    for i in range(5):
        np.testing.assert_array_equal(_bits(block_gemm(a[i:i + 1], b)), _bits(want[i:i + 1]))
    np.testing.assert_array_equal(_bits(block_gemm(a[::-1], b)), _bits(want[::-1]))


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


# ------------------------------------------------------------------ blocked path == per-segment definition, bit for bit
#
# block_gemm computes quantized x quantized GEMMs blocked over rows of B and steps of segments, from
# the 8-bit codes, on several threads. The oracle below is the definition written out from the module
# docstring, one segment at a time over all rows and columns (one BLAS call per segment, as the
# reference computed it before), from QuantizedTensor.element_values / scale_values only:
#     C = 0;  for each segment s (in order):  p = A_s @ B_s.T;  p *= sa[:, s];  p *= sb[:, s];  C += p
# Exact partial dots make the two bit-identical; the tests compare the float64 bit patterns.


def _segment_oracle(a, b) -> np.ndarray:
    ea, eb = a.element_values(np.float64), b.element_values(np.float64)
    m, k = ea.shape
    n = eb.shape[0]

    def full_scales(q, rows):  # the decode scale of every element, from the block grid
        br, bk = (list(q.block_shape) + [rows, k])[:2] if len(q.block_shape) == 2 else (rows, k)
        s = q.scale_values().reshape(-(-rows // br), -(-k // bk))
        return np.repeat(np.repeat(s, br, axis=0)[:rows], bk, axis=1)[:, :k], bk

    sa, bka = full_scales(a, m)
    sb, bkb = full_scales(b, n)
    g = np.gcd(min(bka, k), min(bkb, k))
    out = np.zeros((m, n))
    for s in range(0, k, g):
        p = ea[:, s:s + g] @ eb[:, s:s + g].T
        p *= sa[:, s][:, None]
        p *= sb[:, s][None, :]
        out += p
    return out


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)


@pytest.fixture
def threads():
    from moeref.gemm.exact import set_num_threads

    yield set_num_threads
    set_num_threads(None)


def _q(shape, scheme, spread=True):
    x = RNG.standard_normal(shape).astype(np.float32)
    if spread:  # rows and columns of very different magnitudes: many block scales, wide exponents
        x *= np.exp2(RNG.integers(-12, 12, size=(shape[0], 1))).astype(np.float32)
        x *= np.exp2(RNG.integers(-6, 6, size=(1, shape[1]))).astype(np.float32)
    return quantize(x, scheme)


@pytest.mark.parametrize(
    "a_scheme,b_scheme,m,n,k",
    [
        (fp8_group(128), fp8_block(), 4, 4096, 1024),  # DeepGEMM 1x128 x 128x128: many row blocks, threaded
        (fp8_group(128), fp8_block(), 1, 300, 7168),  # one row, N not a multiple of any block
        (fp8_group(128), fp8_block(), 33, 257, 1000),  # odd N, K = 7 * 128 + 104: a short last segment
        (fp8_group(128, "ue8m0"), fp8_block(scale="ue8m0"), 6, 1100, 2048),
        (fp8_group(128), mxfp4(), 5, 1300, 1024),  # DeepGEMM FP4 experts: segments of 32, packed codes
        (fp8_group(64), mxfp4(), 3, 70, 200),  # K = 6 * 32 + 8
        (mxfp8(), mxfp8(), 7, 600, 1900),  # 1x32 both sides, K odd multiple of 4
        (fp8_per_token(), fp8_block(), 4, 1024, 1001),  # bk = K = 1001 vs 128: segments of gcd = 1
        (fp8_per_token(), fp8_block(), 300, 200, 1001),  # many rows and 1001 segments: fewer per step
        (fp8_per_tensor(), fp8_per_tensor(), 9, 2000, 640),  # one segment of the whole K
        (int8_per_token(), int8_per_channel(), 4, 1500, 777),
        (fp8_per_token(), w4a8_cutlass(), 3, 130, 384),  # INT4 with zero-point-free groups x FP8
    ],
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_blocked_gemm_is_bit_identical_to_per_segment_definition(a_scheme, b_scheme, m, n, k, num_threads,
                                                                 threads):
    threads(num_threads)
    a, b = _q((m, k), a_scheme), _q((n, k), b_scheme)
    got = block_gemm(a, b)
    want = _segment_oracle(a, b)
    assert got.dtype == np.float64 and got.shape == (m, n)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_blocked_gemm_signed_zeros_and_nan_codes(threads):
    """Zero partial dots times a negative scale are -0.0 in every segment, and their sum is +0.0 (the
    sum starts at +0.0, as in the definition); an E4M3 NaN code makes exactly its column's outputs NaN."""
    threads(2)
    scheme = fp8_block()
    a = _q((3, 640), fp8_group(128), spread=False)
    b = _q((1200, 640), scheme, spread=False)
    codes = np.array(b.codes)
    codes[:, :128] = 0x80  # -0.0 in the first segment of every row of B
    codes[5, 300] = 0x7F  # E4M3 NaN
    codes[7, :] = 0x80  # an all -0.0 row: every output of column 7 is +0.0
    from moeref.quant import QuantizedTensor

    scales = np.array(b.scales)
    scales[0] *= -1  # rows 0..127 of B: negative block scales
    b = QuantizedTensor(codes=codes, scales=scales, scheme=scheme, shape=b.shape)
    got = block_gemm(a, b)
    want = _segment_oracle(a, b)
    assert np.isnan(got[:, 5]).all() and not np.isnan(np.delete(got, 5, axis=1)).any()
    assert _bits(got[:, 7]).tolist() == [0, 0, 0]  # +0.0, not -0.0
    np.testing.assert_array_equal(_bits(np.delete(got, 5, axis=1)), _bits(np.delete(want, 5, axis=1)))


@given(
    m=st.integers(1, 9),
    n=st.integers(1, 700),
    k=st.integers(1, 1100),
    pair=st.sampled_from([
        (fp8_group(128), fp8_block()),
        (fp8_group(32), fp8_block((32, 32), "ue8m0")),
        (fp8_group(128), mxfp4()),
        (fp8_per_token(), fp8_block()),
        (mxfp8(), mxfp8()),
    ]),
    num_threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=max(10, settings().max_examples // 4))  # each example is a few small GEMMs
def test_blocked_gemm_bit_identity_property(m, n, k, pair, num_threads, seed):
    from moeref.gemm.exact import set_num_threads

    rng = np.random.default_rng(seed)
    xa = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-10, 10, size=(m, 1)))).astype(np.float32)
    xb = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-10, 10, size=(n, 1)))).astype(np.float32)
    a, b = quantize(xa, pair[0]), quantize(xb, pair[1])
    set_num_threads(num_threads)
    try:
        got = block_gemm(a, b)
    finally:
        set_num_threads(None)
    np.testing.assert_array_equal(_bits(got), _bits(_segment_oracle(a, b)))


def test_grouped_gemm_over_coded_experts_is_bit_identical(threads):
    """The grouped engine over per-expert FP8 tensors (codes read block by block) equals the per-expert
    definition, row by row; padding rows stay 0."""
    threads(2)
    w = [_q((1024, 1280), fp8_block()) for _ in range(3)]
    a = _q((7, 1280), fp8_group(128))
    row_expert = np.array([2, 0, -1, 2, 1, 0, 2])
    got = grouped_gemm_contiguous(a, w, row_expert)
    op = as_operand(a)
    for e in range(3):
        rows = np.flatnonzero(row_expert == e)
        ea = op.take_rows(rows)
        want = np.zeros((rows.size, 1024))
        for s in range(0, 1280, 128):  # the definition, on the gathered rows
            p = ea.values[:, s:s + 128].astype(np.float64) @ w[e].element_values()[:, s:s + 128].T
            p *= ea.scales[:, s // 128][:, None]
            p *= np.repeat(w[e].scale_values()[:, s // 128], 128)[None, :]
            want += p
        np.testing.assert_array_equal(_bits(got[rows]), _bits(want))
    assert _bits(got[2]).tolist() == [0] * 1024


def test_coded_operand_reads_like_its_values():
    """An operand kept as 8-bit codes: values, blocks, rows and |.| all equal the decoded tensor's."""
    q = _q((300, 520), fp8_block())
    op = as_operand(q)
    ev = q.element_values(np.float64)
    assert op.shape == (300, 520) and op.quantized and op.block == (128, 128)
    out = np.empty((20, 130))
    np.testing.assert_array_equal(op.read_block(slice(270, 290), slice(390, 520), out), ev[270:290, 390:520])
    rows = op.take_rows(np.array([299, -1, 0]))
    np.testing.assert_array_equal(rows.values, np.stack([ev[299], np.zeros(520), ev[0]]))
    np.testing.assert_array_equal(rows.scales[:, 0], [q.scale_values()[2, 0], 1.0, q.scale_values()[0, 0]])
    ab = op.abs()
    np.testing.assert_array_equal(ab.values, np.abs(ev))
    np.testing.assert_array_equal(ab.dequantize(), np.abs(q.dequantize(np.float64)))
    np.testing.assert_array_equal(op.values, ev)
    import pickle

    again = pickle.loads(pickle.dumps(op))
    np.testing.assert_array_equal(again.values, ev)
    np.testing.assert_array_equal(again.scales, op.scales)
    with pytest.raises(AttributeError, match="immutable"):
        op.scales = None
    with pytest.raises(ValueError, match="codes must be uint8"):
        BlockOperand(None, np.ones((1, 1)), (1, 4), True, codes=np.zeros((1, 4), np.int8), table=np.zeros(256))
    with pytest.raises(ValueError, match="codes and table"):
        BlockOperand(None, np.ones((1, 1)), (1, 4), True)


def test_num_threads_setting():
    from moeref.gemm.exact import get_num_threads, set_num_threads

    set_num_threads(3)
    try:
        assert get_num_threads() == 3
    finally:
        set_num_threads(None)
    assert get_num_threads() >= 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_threads"):
            set_num_threads(bad)
