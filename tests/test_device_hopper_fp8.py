"""The device emulator of DeepGEMM's FP8 GEMM (:func:`moeref.gemm.device_hopper_fp8.device_deepgemm_rows`) equals
the NumPy emulator (:func:`~moeref.gemm.hopper_fp8.deepgemm_block_accumulators` then
:func:`~moeref.gemm.hopper_fp8.promote`, the specification) bit for bit, and the real kernels on a Hopper GPU.

* CPU (CI): the Triton kernel under ``TRITON_INTERPRET=1`` at tiny shapes (K = 128, 256), both promotion
  orders, the data of tests/test_hopper_fp8_gpu.py (Gaussian with per-block magnitudes, outlier columns,
  same-sign rows, random codes over the whole E4M3 range), non-power-of-two FP32 scales, -1 padding rows,
  and the enumeration's scale term against an in-order NumPy sum written here.
* GPU: the same at DeepSeek-V3's K (2048, 7168), with the block accumulators from the emulator or (``"auto"``, on
  Hopper) the tensor cores; and against real DeepGEMM
  (``m_grouped_fp8_gemm_nt_contiguous``) and our Triton FP8 grouped GEMM, both ``"deepgemm"`` promotion, at those K: the emulator's FP32 result rounded to bf16 equals the kernels' bf16 output.
Every comparison is by equality.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastpath.testing import device, on_gpu  # noqa: E402
from moeref.gemm import StackedExperts  # noqa: E402
from moeref.gemm.device import DeviceOperand  # noqa: E402
import moeref.gemm.device_hopper_fp8 as dh  # noqa: E402
from moeref.gemm.device_hopper_fp8 import device_deepgemm_rows  # noqa: E402
from moeref.gemm.hopper_fp8 import deepgemm_block_accumulators, promote  # noqa: E402
from tests.test_hopper_fp8_gpu import _hopper, _values  # noqa: E402

DEV = device()
KINDS = ["normal", "outliers", "positive", "codes"]


def _u8(x) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def _operands(a, sa, b, sb):
    """Device operand and stack of E4M3 ``a [R, K]`` / ``b [E, N, K]`` (ml_dtypes) with FP32 scales."""
    n, k = b.shape[1:]
    ad = DeviceOperand(None, torch.as_tensor(_u8(a), device=DEV), "e4m3fn",
                       torch.as_tensor(np.asarray(sa, np.float64), device=DEV), (1, 128), True)
    w = StackedExperts(torch.as_tensor(_u8(b), device=DEV), torch.as_tensor(np.asarray(sb, np.float64), device=DEV),
                       "e4m3fn", (128, 128), (n, k))
    return ad, w


def _numpy_rows(a, sa, b, sb, rows, promotion):
    """The specification, row by row: block accumulators, then the promotion (0 on padding rows); also the
    block accumulators and the per-column weight scales."""
    n = b.shape[1]
    out = np.zeros((rows.size, n))
    accs = np.zeros((rows.size, n, a.shape[1] // 128))
    sbs = np.zeros((rows.size, n, a.shape[1] // 128))
    for e in np.unique(rows[rows >= 0]):  # a loop over a few experts
        idx = np.flatnonzero(rows == e)
        acc = deepgemm_block_accumulators(a[idx].astype(np.float64), b[e].astype(np.float64))
        sbe = np.repeat(sb[e], 128, axis=0)[:n]
        out[idx] = promote(acc, sa[idx], sbe, promotion)
        accs[idx], sbs[idx] = acc, sbe[None]
    return out, accs, sbs


def _case(data, ks, rows_max, n_choices):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    k = data.draw(st.sampled_from(ks), label="K")
    e = data.draw(st.integers(1, 3), label="experts")
    r = data.draw(st.integers(1, rows_max), label="rows")
    n = data.draw(st.sampled_from(n_choices), label="N")
    kind = data.draw(st.sampled_from(KINDS), label="a data")
    a = _values(rng, (r, k), kind)
    b = _values(rng, (e, n, k), data.draw(st.sampled_from(KINDS), label="b data"))
    sa = (2.0 ** rng.uniform(-12, 0, size=(r, k // 128))).astype(np.float32).astype(np.float64)
    sb = (2.0 ** rng.uniform(-14, -6, size=(e, -(-n // 128), k // 128))).astype(np.float32).astype(np.float64)
    rows = rng.integers(-1, e, size=r)
    return a, sa, b, sb, rows


def _check_equal(data, ks, rows_max, n_choices):
    a, sa, b, sb, rows = _case(data, ks, rows_max, n_choices)
    promotion = data.draw(st.sampled_from(["deepgemm", "a_then_b"]), label="promotion")
    ad, w = _operands(a, sa, b, sb)
    ref, acc, sbs = _numpy_rows(a, sa, b, sb, rows, promotion)
    rng = np.random.default_rng(rows.size)
    ds = rng.random((rows.size, a.shape[1] // 128)) * 2.0**-20
    s_hi = rng.random((rows.size, a.shape[1] // 128))
    coef = 3.0 * 2.0**-24
    integer = data.draw(st.booleans(), label="integer alignment")  # both cuts: moeref.gemm.device_hopper_fp8
    block_acc = data.draw(st.booleans(), label="block accumulators")
    # "auto": the tensor cores on a Hopper GPU (proved on a sample by the emulator), else the emulator
    source = data.draw(st.sampled_from(["emulator", "auto"]), label="source")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dh, "INTEGER_ALIGN", integer)
        got, st_got, *acc_got = device_deepgemm_rows(
            ad, rows, w, promotion=promotion, block_acc=block_acc, source=source,
            scale_term=(torch.as_tensor(ds, device=DEV), torch.as_tensor(s_hi, device=DEV), coef))
    got = got.cpu().numpy()
    assert np.array_equal(got, ref), f"{int(np.sum(got != ref))} of {ref.size} outputs differ from the NumPy emulator"
    if block_acc:  # [R, K/128, N] float32: the NumPy emulator's block accumulators (0 on padding rows)
        want = np.where((rows >= 0)[:, None, None], acc.transpose(0, 2, 1), 0.0)
        assert np.array_equal(acc_got[0].cpu().numpy().astype(np.float64), want)
    # the scale term, summed here in block order from 0 (the declared order)
    mag = np.abs(acc) * np.abs(sbs)
    t1 = np.zeros(ref.shape)
    t2 = np.zeros(ref.shape)
    for j in range(mag.shape[2]):
        t1 = t1 + mag[:, :, j] * ds[:, None, j]
        t2 = t2 + mag[:, :, j] * s_hi[:, None, j]
    valid = rows >= 0
    assert np.array_equal(st_got.cpu().numpy()[valid], (t1 + coef * t2)[valid])
    return ref.size


@settings(deadline=None, max_examples=12 if not on_gpu() else 40, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_device_emulator_equals_numpy_small(data):
    """Tiny shapes (the interpreter on the CPU): every output and scale term equal."""
    _check_equal(data, [128, 256], 5, [32, 160])


@pytest.mark.gpu
def test_device_emulator_equals_numpy_at_deepseek_k():
    """K = 2048 and 7168 (DeepSeek-V3's GEMM2 and GEMM1), on the GPU: every output equal to the NumPy emulator."""
    if not on_gpu():
        pytest.skip("GPU only: K = 2048/7168 under the interpreter takes minutes")
    seen = []

    @settings(deadline=None, max_examples=16, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        seen.append(_check_equal(data, [2048, 7168], 24, [128, 256]))

    run()
    print(f"\n[device emulator] {sum(seen)} outputs at K = 2048/7168, all equal to the NumPy emulator")


def _contiguous_case(data):
    """DeepGEMM's contiguous layout at DeepSeek-V3's K: 1-4 experts of 0-300 rows each, 128-row aligned
    segments with -1 padding, N = 128-512, the data of tests/test_hopper_fp8_gpu.py."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    k = data.draw(st.sampled_from([2048, 7168]), label="K")
    e = data.draw(st.integers(1, 4), label="experts")
    counts = [data.draw(st.integers(0, 300), label="rows") for _ in range(e)]
    n = data.draw(st.sampled_from([128, 256, 512]), label="N")
    kind = data.draw(st.sampled_from(KINDS), label="a data")
    seg = [-(-max(c, 1) // 128) * 128 for c in counts]
    m_idx = np.concatenate([np.r_[np.full(c, i), np.full(s - c, -1)] for i, (c, s) in enumerate(zip(counts, seg))])
    a = _values(rng, (m_idx.size, k), kind)
    sa = (2.0 ** rng.uniform(-12, 0, size=(m_idx.size, k // 128))).astype(np.float32)
    b = _values(rng, (e, n, k), data.draw(st.sampled_from(KINDS), label="b data"))
    sb = (2.0 ** rng.uniform(-14, -6, size=(e, -(-n // 128), k // 128))).astype(np.float32)
    return a, sa, b, sb, m_idx.astype(np.int32)


def _check_kernel(impl: str, promotion: str, max_examples: int):
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    seen = []

    @settings(deadline=None, max_examples=max_examples, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        a, sa, b, sb, m_idx = _contiguous_case(data)
        f8 = torch.float8_e4m3fn
        at = torch.as_tensor(_u8(a), device="cuda").view(f8)
        bt = torch.as_tensor(_u8(b), device="cuda").view(f8)
        sat, sbt = torch.as_tensor(sa, device="cuda"), torch.as_tensor(sb, device="cuda")
        d = grouped_gemm_contiguous(at, bt, torch.as_tensor(m_idx, device="cuda"), impl=impl, a_scales=sat,
                                    b_scales=sbt, alignment=128)
        ad, w = _operands(a, sa.astype(np.float64), b, sb.astype(np.float64))
        pred = device_deepgemm_rows(ad, m_idx, w, promotion=promotion).float().bfloat16()
        valid = torch.as_tensor(m_idx >= 0, device="cuda")
        mism = int((d[valid].view(torch.int16) != pred[valid].view(torch.int16)).sum())
        seen.append(int(valid.sum()) * int(d.shape[1]))
        assert mism == 0, f"{mism} of {seen[-1]} bf16 outputs differ from the device emulator"

    run()
    print(f"\n[{impl}] {sum(seen)} bf16 outputs at K = 2048/7168, all equal to the device emulator ({promotion})")


@pytest.mark.gpu
def test_device_emulator_equals_real_deepgemm():
    _hopper()
    pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (source .gpu/deep_gemm/install.sh builds it)")
    _check_kernel("deep_gemm", "deepgemm", 40)


@pytest.mark.gpu
def test_device_emulator_equals_triton_fp8_grouped_gemm():
    _hopper()
    _check_kernel("triton", "deepgemm", 40)


def test_device_emulator_refuses_what_it_does_not_emulate():
    """Clear errors: a non-E4M3 operand value, weights with other blocks, an unknown promotion."""
    rng = np.random.default_rng(0)
    a = _values(rng, (2, 128), "normal")
    b = _values(rng, (1, 32, 128), "normal")
    ad, w = _operands(a, np.ones((2, 1)), b, np.ones((1, 1, 1)))
    with pytest.raises(ValueError, match="promotion"):
        device_deepgemm_rows(ad, np.zeros(2, np.int64), w, promotion="separate")
    bad = torch.as_tensor(a.astype(np.float64), device=DEV) + 1e-3
    with pytest.raises(ValueError, match="not E4M3"):
        device_deepgemm_rows(ad, np.zeros(2, np.int64), w, values=bad)
    w1 = StackedExperts(w.codes, torch.ones((1, 32, 1), dtype=torch.float64, device=DEV), "e4m3fn", (1, 128),
                        (32, 128))
    with pytest.raises(ValueError, match="128x128"):
        device_deepgemm_rows(ad, np.zeros(2, np.int64), w1)
