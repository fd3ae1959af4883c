"""The device report (moeref.quant.device_report) against the host report, field by field, bit for bit.

Every draw is a source the converter reads (FP8 128x128 blocks with FP32 or UE8M0 scales, MXFP4, NVFP4, BF16
values) going to a target scheme of one of its layouts, with the special cases enumerated (zero blocks,
values the target holds exactly, a NaN code in an FP8 source, an Inf in BF16 values, magnitudes near
float32's limits).
The device report runs on torch CPU tensors here and on the CUDA GPU where there is one; the expected
values are the host report's (moeref.quant.requantize / quantize_and_report, NumPy), and the sum's order
is checked against an independent statement of it (a plain Python pairwise sum over the same rows).
"""
from __future__ import annotations

import math
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

torch = pytest.importorskip("torch")

from moeref.checkpoint import get_layout  # noqa: E402
from moeref.quant import QuantizedTensor, fp8_block, mxfp4, nvfp4, quantize, quantize_and_report, requantize  # noqa: E402
from moeref.quant.device_report import device_requantize, device_sum_of_squares  # noqa: E402
from moeref.quant.lossless import sample_blocks_representable  # noqa: E402
from moeref.quant.tensor import SUM_ROW, sum_of_squares  # noqa: E402

TARGETS = ("modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4", "gptoss-mxfp4", "deepseek-fp8", "deepseek-fp8-ue8m0",
           "ct-fp8-block")
SOURCES = {"fp8-fp32": lambda: fp8_block((128, 128), "fp32", "deepgemm"),
           "fp8-ue8m0": lambda: fp8_block((128, 128), "ue8m0", "deepgemm"),
           "mxfp4": lambda: mxfp4(), "nvfp4": lambda: nvfp4(), "bf16": None}


def _presets(target: str) -> list:
    """The presets ``moeref convert --to target --preset P`` accepts (None: the layout's default)."""
    from moeref.quant import PRESETS

    out = [None]
    for p in PRESETS:
        try:
            get_layout(target).scheme(p)
        except ValueError:
            continue
        out.append(p)
    return out


PRESETS_OF = {t: _presets(t) for t in TARGETS}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the same comparison on the device runs there"))]


def bits(v: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", v))[0]


def python_pairwise(values: list) -> float:
    """The documented order, stated independently: squares; rows of r = min(SUM_ROW, next power of two)
    zero-padded, each summed as a pairwise tree (i + r/2, then i + r/4, ...); the row sums again."""
    seq = [v * v for v in values]
    while True:
        n = len(seq)
        if n == 0:
            return 0.0
        if n == 1:
            return seq[0]
        r = min(SUM_ROW, 1 << (n - 1).bit_length())
        out = []
        for r0 in range(0, n, r):
            row = seq[r0:r0 + r] + [0.0] * (r - len(seq[r0:r0 + r]))
            h = r // 2
            while h:
                row = [row[i] + row[i + h] for i in range(h)]
                h //= 2
            out.append(row[0])
        seq = out


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, SUM_ROW, SUM_ROW + 1, 3 * SUM_ROW + 5])
def test_sum_of_squares_is_the_documented_order(n):
    v = np.random.default_rng(n).standard_normal(n) * np.exp(np.random.default_rng(n + 1).uniform(-20, 20, n))
    want = python_pairwise([float(a) for a in v]) if n <= SUM_ROW + 1 else None
    got = sum_of_squares(v)
    if want is not None:
        assert bits(got) == bits(want)
    assert bits(device_sum_of_squares(torch.from_numpy(v))) == bits(got)
    assert got == pytest.approx(float(np.dot(v, v)), rel=1e-13)


def test_sum_of_squares_edges():
    assert sum_of_squares(np.zeros(0)) == 0.0 and device_sum_of_squares(torch.zeros(0, dtype=torch.float64)) == 0.0
    assert sum_of_squares(np.array([3.0])) == 9.0
    assert math.isinf(sum_of_squares(np.array([1e200, 1.0]))) and math.isnan(sum_of_squares(np.array([np.nan])))


@st.composite
def cases(draw):
    source = draw(st.sampled_from(sorted(SOURCES)))
    target = draw(st.sampled_from(TARGETS))
    lead = draw(st.sampled_from([(), (2,)]))
    n = draw(st.integers(1, 260))
    k = draw(st.sampled_from([32, 64, 96, 256, 288]))
    seed = draw(st.integers(0, 2**32 - 1))
    special = draw(st.sampled_from(["none", "zero-block", "representable", "tiny", "nan", "inf", "huge"]))
    preset = draw(st.sampled_from(PRESETS_OF[target]))
    return source, (target, preset), lead + (n, k), seed, special


def _source(source, shape, seed, special):
    rng = np.random.default_rng(seed)
    scale = {"tiny": 1e-30, "huge": 1e37}.get(special, 0.02)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    x = np.clip(x, -3e38, 3e38)
    if special == "zero-block":
        x[..., : min(shape[-2], 128), :32] = 0
    if special == "representable":  # FP4 values times powers of two: every target's lossless search applies
        x = (rng.choice([0, 0.5, 1, 1.5, 2, 3, 4, 6], shape) * rng.choice([-1, 1], shape)
             * 2.0 ** rng.integers(-3, 3, shape[:-1] + (1,))).astype(np.float32)
    if special == "inf":
        x.reshape(-1)[seed % x.size] = np.inf
    if SOURCES[source] is None:
        return None, x.astype(ml_dtypes.bfloat16)
    q = quantize(np.where(np.isinf(x), 0, x) if special == "inf" else x, SOURCES[source]())
    if special == "nan" and source.startswith("fp8"):
        codes = np.array(q.codes)
        codes.reshape(-1)[seed % codes.size] = 0x7F  # E4M3 NaN
        q = type(q)(codes=codes, scales=q.scales, scheme=q.scheme, shape=q.shape, global_scale=q.global_scale)
    return q, None


def _host(q, values, target, precision):
    if q is None:
        return quantize_and_report(values, target)
    return requantize(q, target, precision=precision)


def _compare(host, dev):
    (ht, hr), (dt, dr) = host, dev
    assert np.array_equal(ht.codes, dt.codes)
    assert ht.scales.dtype == dt.scales.dtype and ht.scales.tobytes() == dt.scales.tobytes()  # NaN scales too
    assert ht.global_scale == dt.global_scale or (math.isnan(ht.global_scale) and math.isnan(dt.global_scale))
    for f in ("lossless", "method", "precision", "worst_block"):
        assert getattr(hr, f) == getattr(dr, f), f
    for f in ("max_abs_error", "rel_l2", "sqnr_db"):
        assert bits(getattr(hr, f)) == bits(getattr(dr, f)), (f, getattr(hr, f), getattr(dr, f))
    e_host, e_dev = np.asarray(hr.error), dr.error.cpu().numpy()
    nan = np.isnan(e_host)
    assert np.array_equal(nan, np.isnan(e_dev))
    assert np.array_equal(e_host[~nan].view(np.uint64), e_dev[~nan].view(np.uint64))


@pytest.mark.parametrize("device", DEVICES)
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases(), precision=st.sampled_from(["float32", "exact"]))
@example(case=("fp8-fp32", "ct-nvfp4", (130, 64), 7, "nan"), precision="float32")  # NVFP4 refuses the NaN
@example(case=("fp8-fp32", "ct-mxfp4", (130, 64), 7, "nan"), precision="float32")  # a NaN block: non-finite sums
@example(case=("bf16", "ct-mxfp4", (3, 64), 1, "inf"), precision="exact")
@example(case=("mxfp4", "modelopt-nvfp4", (2, 40, 64), 2, "representable"), precision="exact")  # host candidates
@example(case=("fp8-ue8m0", "deepseek-fp8", (2, 130, 288), 3, "zero-block"), precision="exact")
def test_device_report_equals_the_host_report_bit_for_bit(device, case, precision):
    source, target_name, shape, seed, special = case
    target_name, preset = target_name if isinstance(target_name, tuple) else (target_name, None)
    target = get_layout(target_name).scheme(preset)
    q, values = _source(source, shape, seed, special)
    try:
        host = _host(q, values, target, precision)
    except ValueError as e:  # e.g. a NaN the target cannot hold: the device path raises the same
        with pytest.raises(ValueError) as got:
            device_requantize(q, target, device=device, values=values, precision=precision)
        assert str(got.value) == str(e)
        return
    dev = device_requantize(q, target, device=device, values=values, precision=precision)
    if dev is None:  # the host runs the lossless candidates: the rule was lossy and the samples fit
        rule = (quantize_and_report(values, target, prefer_exact=False) if q is None else
                requantize(q, target, precision=precision, prefer_exact=False))[1]
        x = values.astype(np.float64) if q is None else q.dequantize(np.float64)
        assert not rule.lossless and sample_blocks_representable(x, target)
        return
    _compare(host, dev)


@pytest.mark.parametrize("device", DEVICES)
def test_device_report_of_a_deepseek_sized_weight(device):
    """One 7168 x 2048 FP8 weight (DeepSeek-V3 down_proj) to each FP4 target: every field equal."""
    x = (np.random.default_rng(3).standard_normal((2048, 7168)) * 0.02).astype(np.float32)
    q = quantize(x, fp8_block((128, 128), "fp32", "deepgemm"))
    for name in ("ct-nvfp4", "ct-mxfp4"):
        target = get_layout(name).scheme()
        _compare(requantize(q, target, precision="float32"),
                 device_requantize(q, target, device=device, precision="float32"))



def test_remember_upload_takes_only_tensors_laid_out_as_the_host_copy():
    """A device quantizer's tensors stand in for an upload only when they have the host arrays' layout."""
    from moeref.quant.device_report import clear_uploads, remember_upload, upload

    q = quantize(np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64), nvfp4())
    clear_uploads()
    codes, scales = torch.from_numpy(np.array(q.codes)), torch.from_numpy(np.array(q.scales))
    assert not remember_upload(q, codes, scales.view(torch.int8))  # another dtype: refused
    assert not remember_upload(q, codes.reshape(-1), scales)  # another shape: refused
    assert remember_upload(q, codes, scales)
    got = upload(q, "cpu")
    assert got[0] is codes and got[1] is scales
    clear_uploads()
    fresh = upload(q, "cpu")
    assert fresh[0] is not codes and torch.equal(fresh[0], codes) and torch.equal(fresh[1], scales)


def _amax_cases():
    """FP8 128x128 sources (FP32 and UE8M0 scales) with the cases that decide the maximum: NaN codes (both
    signs), an infinite scale over a block with and without a zero code, a NaN scale, negative scales,
    an all-zero tensor, scales near float32's limit, and a leading batch axis."""
    rng = np.random.default_rng(7)
    for trial in range(28):
        fmt = ("fp32", "ue8m0")[trial % 2]
        shape = (256, 384) if trial % 3 else (2, 128, 256)
        codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 1  # NaN codes only where a case puts them
        grid = shape[:-2] + (shape[-2] // 128, shape[-1] // 128)
        if fmt == "fp32":
            scales = (rng.standard_normal(grid) * 10.0 ** rng.integers(-30, 30, size=grid)).astype(np.float32)
        else:
            scales = rng.integers(0, 256, size=grid, dtype=np.uint8)
        case = trial % 7
        if case == 1:
            codes.reshape(-1)[rng.integers(codes.size)] = 0x7F | (0x80 * (trial % 2))
        if case in (2, 3) and fmt == "fp32":
            scales.reshape(-1)[0] = np.inf
            if case == 3:  # no zero code in the infinite block: inf, not NaN
                codes[..., :128, :128] = rng.integers(1, 0x7F, size=codes[..., :128, :128].shape, dtype=np.uint8)
        if case == 4 and fmt == "fp32":
            scales.reshape(-1)[-1] = np.nan
        if case == 5:
            codes[...] = 0
        if case == 6 and fmt == "fp32":
            scales[...] = np.float32(3e38)
        yield QuantizedTensor(codes=codes, scales=scales, scheme=fp8_block((128, 128), fmt), shape=shape)


@pytest.mark.parametrize("device", DEVICES)
def test_device_codes_amax_is_the_decoded_maximum(device):
    """The maximum from block code maxima x scales equals NumPy's max |dequantize| (float64 and float32),
    NaN where that is NaN; shapes that are not whole blocks and packed codes are left to the decode (None)."""
    from moeref.quant.device_report import device_codes_amax, upload

    seen_nan = seen_inf = False
    for q in _amax_cases():
        codes, scales = upload(q, device)
        for f32 in (False, True):
            want = float(np.max(np.abs(q.dequantize(np.float32 if f32 else np.float64))))
            got = float(device_codes_amax(codes, scales, q.scheme, q.shape, None, float32=f32))
            assert bits(got) == bits(want) or (math.isnan(got) and math.isnan(want)), (want, got)
            seen_nan, seen_inf = seen_nan or math.isnan(want), seen_inf or math.isinf(want)
    assert seen_nan and seen_inf
    ragged = quantize(np.ones((130, 128), np.float32), fp8_block((128, 128), "fp32"))
    assert device_codes_amax(*upload(ragged, device), ragged.scheme, ragged.shape) is None
    packed = quantize(np.ones((4, 64), np.float32), nvfp4())
    assert device_codes_amax(*upload(packed, device), packed.scheme, packed.shape, packed.global_scale) is None
