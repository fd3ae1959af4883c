"""The exact-domain aligned-adder kernel (:mod:`moeref.compare._adder_digits`: step sums from int8 digits on the
tensor cores, ``m_j`` from the bf16 exponent matmul) gives the NumPy bound bit for bit.

The oracle is :func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound` (through ``_rows_error_bound`` /
``gemm_error_bound``) on the same data; it takes ``m_j`` as the direct maximum of the exponent sums, so any wrong
``m_j`` that changes ``T_j = min(2^(m_j + 1), p2(max|a| max|w|))`` shows (with random data the two maxima sit in
different columns of a step in most steps, so ``2^(m_j + 1)`` is the smaller term). CPU (CI): Triton's interpreter,
tiny shapes; GPU: the same properties with many more examples (E4M3 codes with subnormals and zeros on both sides).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device, on_gpu  # noqa: E402
from moeref.compare import PROFILES, gemm_error_bound  # noqa: E402
from moeref.compare.bounds import _rows_error_bound  # noqa: E402
from moeref.compare.device_bounds import DeviceBlock, device_gemm_error_bound, device_rows_error_bound  # noqa: E402
from moeref.formats import decode_table, get_format, pack_nibbles  # noqa: E402
from moeref.gemm import StackedExperts  # noqa: E402
from moeref.gemm.device import DeviceOperand  # noqa: E402
from moeref.gemm.exact import BlockOperand  # noqa: E402

DEV = device()
_HC = [HealthCheck.too_slow, HealthCheck.data_too_large]
BASE = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
# (promotion chunk, MMA step): DeepGEMM's; a 16-wide step (zero-padded to 32 columns); a 48-wide step (64 padded
# columns: the exponent matmul does not apply, m_j is the direct maximum); chunks of 64
STEPPINGS = [(128, 32), (128, 16), (128, 48), (64, 32)]
# on the GPU fewer shapes (each chunk and step shape is a compilation; the interpreter covers the others)
GPU_STEPPINGS = [(128, 32), (128, 48)]


def _profile(chunk, mma):
    return dataclasses.replace(BASE, promote_every=chunk, mma_k=mma)


def _codes(rng, fmt, shape, zeros, subnormals):
    """Random finite codes of ``fmt`` with a fraction ``zeros`` of +0/-0 and ``subnormals`` of subnormal codes."""
    t = decode_table(fmt)
    spec = get_format(fmt)
    fin = np.flatnonzero(np.isfinite(t))
    min_normal = 2.0 ** spec.emin if spec.kind == "float" else 0.0
    small = fin[(t[fin] != 0) & (np.abs(t[fin]) < min_normal)]
    c = rng.choice(fin, shape)
    r = rng.random(shape)
    c = np.where(r < zeros, rng.choice(np.flatnonzero(t == 0), shape), c)
    if small.size:
        c = np.where((r >= zeros) & (r < zeros + subnormals), rng.choice(small, shape), c)
    return c.astype(np.uint8)


def _same(ref, got, what):
    got = got.cpu().numpy()
    assert np.array_equal(ref, got, equal_nan=True), (
        f"{what}: the device bound differs in {np.count_nonzero(ref != got)} of {ref.size} elements "
        f"(max relative {np.nanmax(np.abs(ref - got) / np.maximum(np.abs(ref), 1e-300), initial=0):.3g})")


@settings(deadline=None, max_examples=120 if on_gpu() else 6, suppress_health_check=_HC)
@given(st.sampled_from(["e4m3fn", "e2m1", "int8"]), st.lists(st.integers(0, 70 if on_gpu() else 5), min_size=1,
                                                              max_size=4),
       st.integers(1, 80 if on_gpu() else 9), st.sampled_from([160, 200] if on_gpu() else [32, 160, 256, 200]),
       st.sampled_from(GPU_STEPPINGS if on_gpu() else STEPPINGS),
       st.floats(0, 0.6), st.floats(0, 0.3), st.booleans(), st.integers(0, 2**16))
def test_codes_rows_bound_equals_numpy(w_fmt, counts, n, k, stepping, zeros, subnormals, bias, seed):
    """Rows against experts whose weights are codes (the layer's GEMM1): E4M3 activations (zeros, subnormals),
    E4M3 / E2M1 / INT8 weight codes, empty experts, K not a multiple of the chunk, every stepping."""
    rng = np.random.default_rng(seed)
    e = len(counts)
    prof = _profile(*stepping)
    row_e = rng.permutation(np.repeat(np.arange(e), counts)).astype(np.int64)
    r = row_e.size
    a_codes = _codes(rng, "e4m3fn", (r, k), zeros, subnormals)
    a_scales = np.exp2(rng.integers(-8, 4, (r, -(-k // 128)))).astype(np.float64)
    a_host = BlockOperand(None, a_scales, (1, 128), True, codes=a_codes, table=decode_table("e4m3fn"))
    a_dev = DeviceOperand(None, torch.as_tensor(a_codes, device=DEV), "e4m3fn",
                          torch.as_tensor(a_scales, device=DEV), (1, 128), True)
    w_codes = _codes(rng, w_fmt, (e, n, k), zeros / 2, subnormals)
    w_scales = np.exp2(rng.integers(-10, 2, (e, -(-n // 128), -(-k // 128)))).astype(np.float64)
    packed = get_format(w_fmt).bits <= 4  # two codes a byte (StackedExperts' layout for 4-bit formats)
    w = StackedExperts(pack_nibbles(w_codes) if packed else w_codes, w_scales, w_fmt, (128, 128), (n, k))
    b = rng.standard_normal((e, n)) if bias else None
    ref = _rows_error_bound(a_host, None, row_e, w, b, prof)
    got = device_rows_error_bound(a_dev, None, row_e, w.to(DEV), None if b is None else torch.as_tensor(b, device=DEV),
                                  prof)
    _same(ref, got, f"{w_fmt} {stepping}")


# element values (not codes): integers of more than three base-128 digits (the float64 step sums), exponent
# spans over 41 (the direct maximum), both, and neither; each pair in the exact domain (c max|a| max|w| <= 2^53 q_a q_w)
WIDE = {
    "digits, exponent matmul": ((1, 7, -9, 8), (1, 3, -9, 8)),
    "float64 sums, exponent matmul": ((1, 7, -20, 15), (1, 2, 0, 0)),
    "float64 sums, direct maximum": ((1, 7, -20, 20), (1, 2, -2, 0)),
    "float64 sums, direct maximum (E5M2-like spans)": ((1, 1, -10, 10), (1, 1, -12, 12)),
}


@settings(deadline=None, max_examples=60 if on_gpu() else 6, suppress_health_check=_HC)
@given(st.sampled_from(sorted(WIDE)), st.integers(1, 40 if on_gpu() else 4), st.integers(1, 40 if on_gpu() else 9),
       st.sampled_from([200] if on_gpu() else [32, 128, 200]), st.floats(0, 0.5), st.integers(0, 2**16))
def test_values_bound_equals_numpy(case, m, n, k, zeros, seed):
    """One GEMM of element values (``device_gemm_error_bound``): odd integers ``lo..hi`` times ``2^e``, ``e`` in
    ``[e0, e1]`` per operand, chosen to take each of the kernel's paths."""
    rng = np.random.default_rng(seed)

    def draw(shape, spec):
        lo, hi, e0, e1 = spec
        v = (2 * rng.integers((lo - 1) // 2, (hi - 1) // 2 + 1, shape) + 1) * np.exp2(rng.integers(e0, e1 + 1, shape))
        v = v * rng.choice([-1.0, 1.0], shape)
        return np.where(rng.random(shape) < zeros, 0.0, v)

    sa, sw = WIDE[case]
    a, w = draw((m, k), sa), draw((n, k), sw)
    ref = gemm_error_bound(a, w, BASE)

    def block(v):
        return DeviceBlock(torch.as_tensor(v, device=DEV), torch.ones((1, 1), dtype=torch.float64, device=DEV),
                           v.shape)

    _same(ref, device_gemm_error_bound(block(a), block(w), BASE), case)


def test_exponent_offsets_keep_every_power_and_sum_in_float32_range():
    """For every pair of exponent ranges whose spans add to at most 41 (and a few positions of each), the offsets
    put every offset exponent in [-21, 21] (a normal bf16 power 2^(6x)) and every pair sum in [-21, 20] (a normal
    float32 product whose sum of 32 stays below 2^128); wider spans and steps wider than 32 columns take the
    direct maximum (None)."""
    from moeref.compare._adder_digits import _exponent_offsets

    for span_a in range(0, 42):
        for span_w in range(0, 42 - span_a):
            for lo_a, lo_w in ((-9, -9), (0, -300), (500, -1074), (-1074, 1000)):
                sa, sw = (lo_a, lo_a + span_a), (lo_w, lo_w + span_w)
                oa, ow = _exponent_offsets(sa, sw, 32)
                xa, xw = (sa[0] - oa, sa[1] - oa), (sw[0] - ow, sw[1] - ow)
                assert -21 <= xa[0] and xa[1] <= 21 and -21 <= xw[0] and xw[1] <= 21, (sa, sw, xa, xw)
                assert xa[0] + xw[0] >= -21 and xa[1] + xw[1] <= 20, (sa, sw, xa, xw)
    assert _exponent_offsets((0, 30), (0, 12), 32) is None
    assert _exponent_offsets((0, 3), (0, 3), 64) is None
