"""The fast path's device- and sweep-chosen tile knobs change speed only: every variant gives the
reference's codes and scales bit for bit.

* ``_DEVICE_TILES``: the 1x128 quantize and fused activation + quantize tiles a device was
  measured to prefer (the H200's 1 row x 8 groups on 2 warps, one warp for the fused kernels,
  for the exact division; the H100's 1 row x 64 groups on 8 warps for `deepgemm`). The GPU suite exercises an entry only on its device, so here every entry is
  given to the running device (``""`` for the CPU under ``TRITON_INTERPRET=1``), with a spy
  proving the tile was launched.
* ``QuantTuning.word_run_mxfp4`` / ``word_run_nvfp4``: how many contiguous 16-bit-pair words a
  thread loads per FP4 group (runs of 4, 8, or the whole group), for MXFP4 (UE8M0) and NVFP4
  (UE4M3).

Under ``TRITON_INTERPRET=1`` these check the index arithmetic and the host-side choice; the
register layouts they select (and MXFP4's packed bf16x2 encode on them) exist only on the GPU,
where the same tests run with more examples.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from moeref.quant import fp8_group, mxfp4, quantize as ref_quantize  # noqa: E402
from moeref.quant.nvfp4 import nvfp4  # noqa: E402

from fastpath import fused as F  # noqa: E402
from fastpath.quant import _launch as QL  # noqa: E402
from fastpath.quant import QuantTuning, _tiles as QT  # noqa: E402
from fastpath.testing import device, on_gpu  # noqa: E402

from property_tests.test_fastpath_quant import (  # noqa: E402
    assert_same_codes, assert_same_scales, device_input, make_input, run_and_check)

GPU = on_gpu()
SETTINGS = settings(max_examples=12 if not GPU else 60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _spy_launches(monkeypatch):
    """Record (num_warps, BLOCK_M, GPP) of every _quant_kernel launch."""
    seen = []
    real = QL._launch_knobs

    def spy(ce, gb, gpp, bm, num_warps, tuning):
        knobs = real(ce, gb, gpp, bm, num_warps, tuning)
        seen.append((knobs["num_warps"], bm, gpp))
        return knobs

    monkeypatch.setattr(QL, "_launch_knobs", spy)
    return seen


TILES = {("quant", "row_major", True): (8, 1, 2), ("quant", "row_major", False): (64, 1, 8),
         ("quant", "mn_major", False): (64, 1, 8), ("fused", "row_major", True): (8, 1, 1),
         ("quant", "packed_ue8m0", False): (64, 1, 4),
         ("fused", "mn_major", False): (64, 1, 8)}


# the kinds of 1x128 quantization a device entry can serve: (scheme, layout or None for the drawn
# one, the _DEVICE_TILES key's layout and divides flag, or None where no entry may apply)
KINDS = {
    "default": (lambda: fp8_group(128, "fp32", "default"), None, True),
    "deepgemm": (lambda: fp8_group(128, "fp32", "deepgemm"), None, False),
    "packed": (lambda: fp8_group(128, "ue8m0", "deepgemm"), "packed_ue8m0", False),
    "ue8m0": (lambda: fp8_group(128, "ue8m0", "deepgemm"), "row_major", None),  # never looked up
}


@SETTINGS
@given(M=st.integers(1, 6), groups=st.integers(1, 20), tail=st.integers(0, 127),
       dtype=st.sampled_from(("bfloat16", "float32")), specials=st.sampled_from(("none", "all")),
       layout=st.sampled_from(("row_major", "mn_major")), kind=st.sampled_from(sorted(KINDS)),
       seed=st.integers(0, 2**31))
def test_device_tiles_match_reference(monkeypatch, M, groups, tail, dtype, specials, layout,
                                      kind, seed):
    name = QT._device_name(torch.device(device()))
    monkeypatch.setattr(QT, "_DEVICE_TILES", {name: TILES})
    seen = _spy_launches(monkeypatch)
    make, fixed_layout, divides = KINDS[kind]
    layout = fixed_layout or layout
    K = groups * 128 + tail
    xn = make_input(seed, (M, K), dtype, 20.0, specials)
    run_and_check(make(), layout, xn, device_input(xn, False))
    ng = groups + (tail > 0)
    tile = None if divides is None else TILES.get(("quant", layout, divides))
    assert len(seen) == 1, seen
    if tile is not None and ng >= 8:  # the entries serve rows of 8 groups or more
        gpp, bm, warps = tile
        assert seen[0] == (warps, bm, gpp), seen
    else:
        assert seen[0] not in [(w, b, g) for g, b, w in TILES.values()], seen


def test_device_tiles_skip_unswept_ue8m0(monkeypatch):
    """Row-major UE8M0 scales were not swept per device: the FP32 row-major entry does not
    apply to them (the packed UE8M0 layout has its own entry)."""
    name = QT._device_name(torch.device(device()))
    monkeypatch.setattr(QT, "_DEVICE_TILES", {name: TILES})
    seen = _spy_launches(monkeypatch)
    xn = make_input(5, (3, 1024), "bfloat16", 4.0, "none")
    run_and_check(fp8_group(128, "ue8m0", "deepgemm"), "row_major", xn, device_input(xn, False))
    run_and_check(fp8_group(128, "ue8m0", "deepgemm"), "packed_ue8m0", xn, device_input(xn, False))
    assert seen == [(4, 1, 32), (4, 1, 64)], seen


@pytest.mark.parametrize("dev_name,key", [(n, k) for n, tiles in QT._DEVICE_TILES.items() for k in tiles])
def test_every_shipped_device_tile_matches_reference(monkeypatch, dev_name, key):
    """Each shipped entry, given to the running device: 9 rows of 9 groups and a partial one
    (so multi-row tiles have a partial last program), specials included."""
    name = QT._device_name(torch.device(device()))
    tile = QT._DEVICE_TILES[dev_name][key]
    monkeypatch.setattr(QT, "_DEVICE_TILES", {name: {key: tile}})
    seen = _spy_launches(monkeypatch)
    kernel, layout, divides = key
    preset = "default" if divides else "deepgemm"
    scheme = fp8_group(128, "ue8m0" if layout == "packed_ue8m0" else "fp32", preset)
    if kernel == "quant":
        xn = make_input(7, (9, 9 * 128 + 40), "bfloat16", 20.0, "all")
        run_and_check(scheme, layout, xn, device_input(xn, False))
    else:
        xn = make_input(8, (9, 2 * (9 * 128 + 40)), "bfloat16", 2.0, "none")
        x = device_input(xn, False)
        got = F.silu_and_mul_quant_fp8(x, scheme, scale_layout=layout)
        ref = ref_quantize(F.silu_and_mul(x).cpu().numpy(), scheme)
        assert_same_codes(got.codes.cpu().numpy(), ref.codes, "e4m3fn", str(key))
        assert_same_scales(got.scales_logical(), ref.scales, str(key))
    gpp, bm, warps = tile
    assert seen == [(warps, bm, gpp)], seen


def test_device_tiles_leave_other_devices_alone(monkeypatch):
    """A device without an entry takes _tile's general choice (1 row x 32 groups, 4 warps)."""
    monkeypatch.setattr(QT, "_DEVICE_TILES", {"some other device": TILES})
    seen = _spy_launches(monkeypatch)
    xn = make_input(3, (2, 1024), "bfloat16", 4.0, "none")
    run_and_check(fp8_group(128), "row_major", xn, device_input(xn, False))
    assert seen == [(4, 1, 32)], seen


@SETTINGS
@given(op=st.sampled_from(("silu_and_mul", "swigluoai", "gelu_and_mul")), M=st.integers(1, 5),
       groups=st.integers(1, 12), tail=st.integers(0, 127),
       layout=st.sampled_from(("row_major", "mn_major")), preset=st.sampled_from(("default", "deepgemm")),
       seed=st.integers(0, 2**31))
def test_fused_device_tiles_match_reference(monkeypatch, op, M, groups, tail, layout, preset, seed):
    """The fused kernels' device tiles: codes and scales equal the reference quantization of the
    kernel's own float32 activation (test_fastpath_quant.py bounds that activation)."""
    name = QT._device_name(torch.device(device()))
    monkeypatch.setattr(QT, "_DEVICE_TILES", {name: TILES})
    seen = _spy_launches(monkeypatch)
    N = groups * 128 + tail
    xn = make_input(seed, (M, 2 * N), "bfloat16", 2.0, "none")
    x = device_input(xn, False)
    scheme = fp8_group(128, "fp32", preset)
    if op == "silu_and_mul":
        got = F.silu_and_mul_quant_fp8(x, scheme, scale_layout=layout)
        act = F.silu_and_mul(x).cpu().numpy()
    elif op == "swigluoai":
        got = F.swigluoai_quant_fp8(x, 1.702, 7.0, scheme, scale_layout=layout)
        act = F.swigluoai(x).cpu().numpy()
    else:
        got = F.gelu_and_mul_quant_fp8(x, "none", scheme, scale_layout=layout)
        act = F.gelu_and_mul(x, "none").cpu().numpy()
    ref = ref_quantize(act, scheme)
    what = f"{op}/{preset}/{layout}"
    assert_same_codes(got.codes.cpu().numpy(), ref.codes, "e4m3fn", what)
    assert_same_scales(got.scales_logical(), ref.scales, what)
    tile = TILES.get(("fused", layout, preset == "default"))
    assert len(seen) == 1, seen
    if tile is not None and groups + (tail > 0) >= 8:
        gpp, bm, warps = tile
        assert seen[0] == (warps, bm, gpp), seen
    else:
        assert seen[0] not in [(w, b, g) for g, b, w in TILES.values()], seen


@SETTINGS
@given(run=st.sampled_from((0, 4, 8)), which=st.sampled_from(("mxfp4", "nvfp4")),
       M=st.integers(1, 5), K=st.integers(1, 300).map(lambda k: 2 * k),
       specials=st.sampled_from(("none", "finite")), seed=st.integers(0, 2**31))
def test_word_run_matches_reference(run, which, M, K, specials, seed):
    tuning = QuantTuning(word_run_mxfp4=run, word_run_nvfp4=run)
    scheme = mxfp4() if which == "mxfp4" else nvfp4(preset="nvfp4_vllm")
    xn = make_input(seed, (M, K), "bfloat16", 8.0, specials)
    run_and_check(scheme, "swizzled_128x4", xn, device_input(xn, False), tuning=tuning)
