"""The looped one-scale-per-row kernel (``fastpath.quant._kernels._row_loop_kernel``,
per-token FP8 rows longer than ``QuantTuning.row_loop_min_k``) equals the reference bit for bit.

CI shapes are small, so the tests lower the threshold and the chunk width (``tuning=``
:data:`SMALL`): every row then spans
several chunks (partial last chunk included), which is the structure the large rows have. On the
GPU the natural threshold is also exercised with real 7168-wide rows.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from moeref.quant import fp8_group, fp8_per_token, quantize as ref_quantize  # noqa: E402

from fastpath import quant as Q  # noqa: E402
from fastpath.quant import _launch as QL  # noqa: E402
from fastpath.testing import on_gpu  # noqa: E402

from property_tests.test_fastpath_quant import device_input, make_input, run_and_check  # noqa: E402

GPU = on_gpu()


# every one-scale-per-row FP8 quantization with K > 8 to the loop kernel, in chunks of 16
# columns (2 rows per program, one warp)
SMALL = Q.QuantTuning(row_loop_min_k=8, row_loop_tile=(2, 16, 1))


def _launches(monkeypatch):
    """Count plans that launch the loop kernel (to prove the test runs it; each test's schemes
    are new objects, so each call makes its plan)."""
    calls = []
    real = QL._row_loop_launch

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(QL, "_row_loop_launch", spy)
    return calls


SCHEMES = [
    lambda: fp8_per_token(),
    lambda: fp8_per_token(preset="vllm"),
    lambda: fp8_per_token(preset="deepgemm"),
    lambda: fp8_per_token(element="e5m2"),
]


# the fixture installs a counting spy: sharing it across the generated examples is intended
@settings(max_examples=30 if not GPU else 200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(i=st.integers(0, len(SCHEMES) - 1), M=st.integers(1, 9), K=st.integers(9, 70),
       ndim=st.sampled_from((2, 3)), dtype=st.sampled_from(("float32", "bfloat16", "float16")),
       specials=st.sampled_from(("none", "finite", "all")), strided=st.booleans(),
       log_range=st.sampled_from((0.0, 4.0, 30.0)), seed=st.integers(0, 2**32 - 1),
       layout=st.sampled_from(("row_major", "mn_major")))
def test_row_loop_matches_reference(monkeypatch, i, M, K, ndim, dtype, specials,
                                    strided, log_range, seed, layout):
    scheme = SCHEMES[i]()
    if layout == "mn_major" and scheme.scale_format != "fp32":
        layout = "row_major"
    shape = (2, M, K) if ndim == 3 else (M, K)
    xn = make_input(seed, shape, dtype, log_range, specials)
    calls = _launches(monkeypatch)
    run_and_check(scheme, layout, xn, device_input(xn, strided), tuning=SMALL)
    assert calls, "the loop kernel was not used"


def test_row_loop_group_as_wide_as_the_row(monkeypatch):
    """A 1xG group at least as wide as the row is one scale per row too."""
    xn = make_input(3, (5, 40), "bfloat16", 4.0, "all")
    calls = _launches(monkeypatch)
    run_and_check(fp8_group(64), "row_major", xn, device_input(xn, False), tuning=SMALL)
    assert calls


def test_row_loop_static_scale(monkeypatch):
    xn = make_input(4, (6, 50), "float32", 4.0, "finite")
    scheme = fp8_per_token(preset="vllm")
    calls = _launches(monkeypatch)
    for s in (0.01, 3.0):
        ref = ref_quantize(xn, scheme, scale=s)
        got = Q.quantize(device_input(xn, False), scheme, scale=s, tuning=SMALL)
        np.testing.assert_array_equal(got.codes.cpu().numpy(), ref.codes)
        np.testing.assert_array_equal(got.scales_logical(), ref.scales)
    assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(257, 4097), (300, 7168), (3, 40000), (64, 16384)])
def test_gpu_row_loop_real_sizes(M, K):
    """At the natural threshold and tile, on the GPU: rows longer than 4096 (7168: DeepSeek's
    hidden size; 40000: beyond the tile kernel's 32768 limit), random magnitudes and
    specials."""
    xn = make_input(M + K, (M, K), "bfloat16", 30.0, "all")
    for scheme in (fp8_per_token(), fp8_per_token(preset="vllm")):
        run_and_check(scheme, "row_major", xn, device_input(xn, False))


def test_tuning_is_explicit(monkeypatch):
    """The default tuning keeps short rows on the tile kernel; SMALL routes the same call to the
    loop, with the same codes (the knob changes speed, never results)."""
    xn = make_input(6, (4, 50), "bfloat16", 4.0, "finite")
    calls = _launches(monkeypatch)
    got_tile, _ = run_and_check(fp8_per_token(), "row_major", xn, device_input(xn, False))
    assert not calls
    got_loop, _ = run_and_check(fp8_per_token(), "row_major", xn, device_input(xn, False), tuning=SMALL)
    assert calls and torch.equal(got_tile.codes, got_loop.codes)


@pytest.mark.parametrize("bad", [dict(maxnreg=8), dict(word_run_mxfp4=3), dict(word_run_nvfp4=-4),
                                 dict(row_loop_tile=(3, 16, 1)), dict(row_loop_min_k=0),
                                 dict(e2m1_ptx="no")])
def test_quant_tuning_refuses_bad_values(bad):
    with pytest.raises((ValueError, TypeError), match="QuantTuning"):
        Q.QuantTuning(**bad)


def test_tuning_must_be_a_quant_tuning():
    x = device_input(make_input(1, (2, 16), "float32", 1.0, "none"), False)
    with pytest.raises(TypeError, match="QuantTuning"):
        Q.quantize(x, fp8_per_token(), tuning={"maxnreg": 32})
