"""The fast path's device- and sweep-chosen tile knobs change speed only: every variant gives the
reference's codes and scales bit for bit.

* ``_NARROW_DIVISION_TILE``: the 1 row x 8 groups, 2-warp tile the exact division takes on an
  H200. The GPU suite exercises it only on a device named in the tuple, so here the running
  device (``""`` for the CPU under ``TRITON_INTERPRET=1``) is added to it, with a spy proving the
  narrow tile was launched.
* ``_WORD_RUN``: how many contiguous 16-bit-pair words a thread loads per FP4 group (runs of 4,
  8, or the whole group), for MXFP4 (UE8M0) and NVFP4 (UE4M3).

Under ``TRITON_INTERPRET=1`` these check the index arithmetic and the host-side choice; the
register layouts they select (and MXFP4's packed bf16x2 encode on them) exist only on the GPU,
where the same tests run with more examples.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from moeref.quant import fp8_group, mxfp4  # noqa: E402
from moeref.quant.nvfp4 import nvfp4  # noqa: E402

from fastpath import quant as Q  # noqa: E402
from fastpath.testing import device, on_gpu  # noqa: E402

from property_tests.test_fastpath_quant import device_input, make_input, run_and_check  # noqa: E402

GPU = on_gpu()
SETTINGS = settings(max_examples=12 if not GPU else 60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _spy_launches(monkeypatch):
    """Record (num_warps, BLOCK_M, GPP) of every _quant_kernel launch."""
    seen = []
    real = Q._launch_knobs

    def spy(ce, gb, gpp, bm, num_warps):
        knobs = real(ce, gb, gpp, bm, num_warps)
        seen.append((knobs["num_warps"], bm, gpp))
        return knobs

    monkeypatch.setattr(Q, "_launch_knobs", spy)
    return seen


@SETTINGS
@given(M=st.integers(1, 6), groups=st.integers(1, 20), tail=st.integers(0, 127),
       dtype=st.sampled_from(("bfloat16", "float32")), specials=st.sampled_from(("none", "all")),
       layout=st.sampled_from(("row_major", "mn_major")), seed=st.integers(0, 2**31))
def test_narrow_division_tile_matches_reference(monkeypatch, M, groups, tail, dtype, specials,
                                               layout, seed):
    name = Q._device_name(torch.device(device()))
    monkeypatch.setattr(Q, "_NARROW_DIVISION_TILE", Q._NARROW_DIVISION_TILE + (name,))
    seen = _spy_launches(monkeypatch)
    K = groups * 128 + tail
    xn = make_input(seed, (M, K), dtype, 20.0, specials)
    run_and_check(fp8_group(128), layout, xn, device_input(xn, False))
    ng = groups + (tail > 0)
    # the narrow tile on rows of 8 groups or more; MN-major scales keep their row-block tile
    if layout == "row_major" and ng >= 8:
        assert seen == [(2, 1, 8)], seen
    else:
        assert len(seen) == 1 and seen[0] != (2, 1, 8), seen


def test_narrow_division_tile_is_for_division_only(monkeypatch):
    """`deepgemm` multiplies by 1/s: it keeps the general tile on every device."""
    name = Q._device_name(torch.device(device()))
    monkeypatch.setattr(Q, "_NARROW_DIVISION_TILE", Q._NARROW_DIVISION_TILE + (name,))
    seen = _spy_launches(monkeypatch)
    xn = make_input(3, (2, 1024), "bfloat16", 4.0, "none")
    run_and_check(fp8_group(128, "fp32", "deepgemm"), "row_major", xn, device_input(xn, False))
    assert seen == [(4, 1, 32)], seen


@SETTINGS
@given(run=st.sampled_from((0, 4, 8)), which=st.sampled_from(("mxfp4", "nvfp4")),
       M=st.integers(1, 5), K=st.integers(1, 300).map(lambda k: 2 * k),
       specials=st.sampled_from(("none", "finite")), seed=st.integers(0, 2**31))
def test_word_run_matches_reference(monkeypatch, run, which, M, K, specials, seed):
    monkeypatch.setattr(Q, "_WORD_RUN", {1: run, 2: run})
    scheme = mxfp4() if which == "mxfp4" else nvfp4(preset="vllm")
    xn = make_input(seed, (M, K), "bfloat16", 8.0, specials)
    run_and_check(scheme, "swizzled_128x4", xn, device_input(xn, False))
