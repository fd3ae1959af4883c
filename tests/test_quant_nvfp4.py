"""NVFP4 (moeref.quant.nvfp4): hand-derived values, the anchors' oracles, conventions, errors.

Expected values come from hand derivations (commented) and from ``tests/nvfp4_oracles.py``, which
restates TransformerEngine's, FlashInfer's/vLLM's and torchao's reference code in float32 NumPy
without importing moeref.quant. Hypothesis sweeps are in property_tests/test_nvfp4_props.py.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nvfp4_oracles as orc
from moeref.quant import QuantizedTensor, dequantize, mxfp4, quantize, requantize
from moeref.quant.nvfp4 import global_scale_as, nvfp4, nvfp4_preset, nvfp4_weight, quantize_nvfp4

F32 = np.float32
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def _scale_value(code):
    return float(np.uint8(code).view(ml_dtypes.float8_e4m3fn).astype(np.float64))


# ---- hand-derived values ----------------------------------------------------------------------

def test_exact_grid_block_round_trips():
    # A = 6 -> S_enc = 2688/6 = 448; block amax 6 -> scale e4m3(448) = 0x7E; data factor 1.
    x = np.array([[0.5, -1.0, 3.0, 6.0] * 4], F32)
    for preset in ("te", "flashinfer", "torchao"):
        q = quantize(x, nvfp4(preset=f"nvfp4_{preset}"))
        assert q.scales.tolist() == [[0x7E]]
        assert q.global_scale == pytest.approx(6 / 2688, rel=1e-7)
        assert q.element_codes()[0, :4].tolist() == [0x1, 0x8 | 0x2, 0x5, 0x7]
        np.testing.assert_allclose(q.dequantize(np.float64), x, rtol=1e-7)
    # te and flashinfer: g = 6/2688 exactly as float64 of 1/448 -> dequant exact
    assert np.array_equal(quantize(x, nvfp4(preset="nvfp4_te")).dequantize(), x)


def test_ue4m3_tie_te_versus_flashinfer():
    # A = 6 (S_enc = 448) and a second block with amax 1.125: 1.125 * 448 / 6 = 84, exactly half
    # way between the E4M3 values 80 (mantissa 010, even) and 88 (011).
    s_enc = F32(2688) / F32(6)
    assert s_enc == 448
    te_product = F32(1.125) * (s_enc * (F32(1) / F32(6)))   # fl(448 * fl(1/6)) = 74.666672
    fi_product = s_enc * (F32(1.125) * (F32(1) / F32(6)))   # fl(1.125 * fl(1/6)) = 0.1875
    assert te_product > 84 and fi_product == 84
    x = np.zeros((1, 32), F32)
    x[0, 0], x[0, 16] = 6.0, 1.125
    te = quantize(x, nvfp4(preset="nvfp4_te"))
    fi = quantize(x, nvfp4(preset="nvfp4_flashinfer"))
    ao = quantize(x, nvfp4(preset="nvfp4_torchao"))
    assert _scale_value(te.scales[0, 1]) == 88.0 and int(te.scales[0, 1]) == 0x6B
    assert _scale_value(fi.scales[0, 1]) == 80.0 and int(fi.scales[0, 1]) == 0x6A
    # torchao: (1.125 / 6) / fl(6/2688) = 0.1875 / 0.00223214... = 83.99999 -> 80
    assert _scale_value(ao.scales[0, 1]) == 80.0
    # flashinfer: 1.125 * 448/80 = 6.3 -> saturates to 6; te: 1.125 * 448/88 = 5.727 -> 6
    assert fi.element_codes()[0, 16] == 7 and te.element_codes()[0, 16] == 7


@pytest.mark.parametrize("x,code", [(2.5, 4), (-5.0, 0xE), (0.25, 0), (1.75, 4), (3.5, 6),
                                    (0.75, 2), (1.25, 2), (5.0, 6), (-0.1, 0x8)])
def test_e2m1_ties_to_even_te_and_flashinfer(x, code):
    # a block holding 6 gives scale 448 and, for TE and FlashInfer, data factor exactly 1 (A = 6):
    # fl(1/448) * 448 rounds to 1 in float32, so the scaled value is x itself
    assert F32(1) / (F32(448) * (F32(1) / F32(448))) == 1
    row = np.array([[6.0, x] + [0.0] * 14], F32)
    for preset in ("te", "flashinfer"):
        assert quantize(row, nvfp4(preset=f"nvfp4_{preset}")).element_codes()[0, 1] == code


def test_torchao_factor_below_one_breaks_ties_downward():
    # torchao: pts = fl(6/2688), factor = fl(fl(1/pts)/448) = 0.99999994 < 1, so 1.75 scales to
    # 1.7499999 and rounds to 1.5 (code 3) where TE rounds the exact tie up to 2 (code 4)
    pts = F32(6) / F32(2688)
    factor = (F32(1) / pts) / F32(448)
    assert factor < 1 and F32(1.75) * factor < 1.75
    row = np.array([[6.0, 1.75, 3.5] + [0.0] * 13], F32)
    assert quantize(row, nvfp4(preset="nvfp4_torchao")).element_codes()[0, 1:3].tolist() == [3, 5]
    assert quantize(row, nvfp4(preset="nvfp4_te")).element_codes()[0, 1:3].tolist() == [4, 6]


def test_negative_zero_code_per_anchor():
    row = np.array([[6.0, -0.0, -0.1, 0.0] + [1.0] * 12], F32)
    # TE cast_to_fp4x2: -0.0 -> 0x0, (-0.25, 0) -> 0x8
    assert quantize(row, nvfp4(preset="nvfp4_te")).element_codes()[0, 1:4].tolist() == [0x0, 0x8, 0x0]
    # PTX cvt / torchao f32_to_f4_unpacked keep the sign of zero
    for preset in ("flashinfer", "torchao"):
        assert quantize(row, nvfp4(preset=f"nvfp4_{preset}")).element_codes()[0, 1:4].tolist() == [0x8, 0x8, 0x0]
    # a negative product that underflows to -0.0 in float32 is also 0x0 in TE: A = 3e38 gives
    # a data factor of about 6/3e38 = 2e-38, and -1e-45 * 2e-38 rounds to -0.0
    x = np.zeros((1, 16), F32)
    x[0, 0], x[0, 1] = 3e38, -1e-45
    assert F32(-1e-45) * (F32(6) / F32(3e38)) == 0
    assert quantize(x, nvfp4(preset="nvfp4_te")).element_codes()[0, 1] == 0x0
    assert orc.te_nvfp4_ref(x)[0][0, 1] == 0x0
    assert quantize(x, nvfp4(preset="nvfp4_flashinfer")).element_codes()[0, 1] == 0x8


def test_zero_blocks_and_zero_tensor():
    x = np.zeros((2, 32), F32)
    x[0, :16] = 3.0
    assert quantize(x, nvfp4(preset="nvfp4_te")).scales[:, 1].tolist() == [0x00, 0x00]
    assert quantize(x, nvfp4(preset="nvfp4_vllm")).scales[:, 1].tolist() == [0x00, 0x00]
    assert quantize(x, nvfp4(preset="nvfp4_torchao")).scales[:, 1].tolist() == [0x08, 0x08]  # 2^-6 clamp
    z = np.zeros((3, 20), F32)
    for preset in ("te", "flashinfer", "torchao"):
        q = quantize(z, nvfp4(preset=f"nvfp4_{preset}"))
        assert q.global_scale == 0.0
        assert not q.element_codes().any()
        assert np.array_equal(q.dequantize(), z)
        assert set(q.scales.ravel().tolist()) == ({0x08} if preset == "torchao" else {0x00})


def test_te_zero_scale_block_saturates_codes_and_decodes_to_zero():
    # A = 1e4: S_enc = 0.2688; block amax 1e-4 -> 1e-4 * 0.0448 = 4.5e-6 < 2^-10 -> UE4M3 0.
    # TE then encodes with min(1/0, FLT_MAX) = FLT_MAX: the nonzero elements saturate to +-6.
    x = np.zeros((1, 32), F32)
    x[0, 0] = 1e4
    x[0, 16:18] = [1e-4, -5e-5]
    q = quantize(x, nvfp4(preset="nvfp4_te"))
    assert int(q.scales[0, 1]) == 0
    assert q.element_codes()[0, 16:18].tolist() == [0x7, 0xF]
    assert q.dequantize()[0, 16:18].tolist() == [0.0, -0.0]
    codes, scales, _ = orc.te_nvfp4_ref(x)
    assert np.array_equal(q.element_codes(), codes) and np.array_equal(q.scales, scales)


# ---- the oracles on fixed random data ---------------------------------------------------------

def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.integers(-12, 12, size=shape[:-1] + (1,)))
    return (rng.standard_normal(shape) * mag).astype(F32)


@pytest.mark.parametrize("shape", [(4, 64), (3, 17), (33, 50), (1, 1)])
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_te_matches_reference(shape, tile):
    x = _data(shape)
    q = quantize(x, nvfp4("activation" if tile == (1, 16) else "weight", preset="nvfp4_te"))
    codes, scales, amax = orc.te_nvfp4_ref(x, tile)
    assert np.array_equal(q.element_codes(), codes)
    assert np.array_equal(np.repeat(q.scales, tile[0], axis=0)[: shape[0]], scales)
    assert global_scale_as(q, "amax") == amax


@pytest.mark.parametrize("preset", ["flashinfer", "vllm"])
@pytest.mark.parametrize("shape", [(4, 64), (3, 17), (9, 100)])
def test_flashinfer_vllm_match_reference(preset, shape):
    x = _data(shape, 1)
    gs = orc.flashinfer_global_scale(x)
    q = quantize(x, nvfp4(preset=f"nvfp4_{preset}"))
    values, scales = orc.flashinfer_ref_fp4_quant(x, gs)
    assert np.array_equal(q.element_values(np.float32), values)
    assert np.array_equal(orc.e4m3_value(q.scales), scales)
    assert global_scale_as(q, "encode_scale") == gs


@pytest.mark.parametrize("shape", [(4, 64), (3, 17), (9, 100)])
def test_torchao_matches_reference(shape):
    x = _data(shape, 2)
    pts = orc.torchao_per_tensor_amax_to_scale(np.abs(x).max())
    q = quantize(x, nvfp4(preset="nvfp4_torchao"))
    codes, scales = orc.torchao_nvfp4_quantize(x, pts)
    assert np.array_equal(q.element_codes(), codes) and np.array_equal(q.scales, scales)
    assert global_scale_as(q, "decode_scale") == pts


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_low_precision_input_matches_reference(dtype):
    x = _data((5, 48), 3).astype(dtype)
    q = quantize(x, nvfp4(preset="nvfp4_te"))
    codes, scales, _ = orc.te_nvfp4_ref(x)
    assert np.array_equal(q.element_codes(), codes) and np.array_equal(q.scales, scales)


def test_torch_input():
    torch = pytest.importorskip("torch")
    x = _data((2, 32), 4)
    q = quantize(torch.from_numpy(x).to(torch.bfloat16), nvfp4())
    ref = quantize(x.astype(ml_dtypes.bfloat16), nvfp4())
    assert np.array_equal(q.codes, ref.codes) and np.array_equal(q.scales, ref.scales)


# ---- static global scales and conventions ------------------------------------------------------

def test_static_encode_scale_vllm_a1_gscale():
    x = _data((4, 64), 5)
    gs = F32(2688) / F32(np.abs(x).max() * 0.25)   # calibrated on a smaller amax: scales saturate
    q = quantize(x, nvfp4(preset="nvfp4_vllm"), global_scale=gs)
    values, scales = orc.flashinfer_ref_fp4_quant(x, gs)
    assert np.array_equal(q.element_values(np.float32), values)
    assert np.array_equal(orc.e4m3_value(q.scales), scales)
    assert (q.scales == 0x7E).any()   # some block scales hit 448
    assert global_scale_as(q, "encode_scale") == gs


def test_static_amax_te_and_decode_scale_torchao():
    x = _data((4, 64), 6)
    amax = F32(np.abs(x).max() * 3)
    q = quantize(x, nvfp4(preset="nvfp4_te"), global_scale=amax)
    codes, scales, _ = orc.te_nvfp4_ref(x, global_amax=amax)
    assert np.array_equal(q.element_codes(), codes) and np.array_equal(q.scales, scales)
    pts = orc.torchao_per_tensor_amax_to_scale(amax)
    q = quantize(x, nvfp4(preset="nvfp4_torchao"), global_scale=pts)
    codes, scales = orc.torchao_nvfp4_quantize(x, pts)
    assert np.array_equal(q.element_codes(), codes) and np.array_equal(q.scales, scales)


def test_conventions_give_same_codes_and_read_back():
    x = _data((6, 40), 7)
    a = quantize(x, nvfp4(preset="nvfp4_te", convention="amax"))
    e = quantize(x, nvfp4(preset="nvfp4_te", convention="encode_scale"))
    assert np.array_equal(a.codes, e.codes) and np.array_equal(a.scales, e.scales)
    assert global_scale_as(a, "amax") == F32(np.abs(x).max())
    # the encode scale TE uses, min(2688/A, FLT_MAX)
    assert global_scale_as(e, "encode_scale") == F32(2688) / F32(np.abs(x).max())
    # static encode scale for te: the same result as the dynamic amax path
    s = quantize(x, nvfp4(preset="nvfp4_te", convention="encode_scale"),
                 global_scale=global_scale_as(e, "encode_scale"))
    assert np.array_equal(s.codes, a.codes) and np.array_equal(s.scales, a.scales)
    fi_amax = quantize(x, nvfp4(preset="nvfp4_flashinfer", convention="amax"))
    fi = quantize(x, nvfp4(preset="nvfp4_flashinfer"))
    A = F32(np.abs(x).max())
    assert np.array_equal(fi_amax.codes, fi.codes) and np.array_equal(fi_amax.scales, fi.scales)
    # the stored decode factor: A / 2688 for the amax convention, 1 / fl32(2688 / A) for the
    # encode-scale one (they differ by that float32 rounding)
    assert fi_amax.global_scale == float(A) / 2688
    assert fi.global_scale == 1.0 / float(F32(2688) / A)


def test_presets_registered_and_resolved():
    assert nvfp4_preset("nvfp4_te").name == "nvfp4_te"
    assert nvfp4_preset("nvfp4_vllm", "amax").name == "nvfp4_vllm_amax"
    assert nvfp4_preset("nvfp4_torchao_amax").option("global_convention") == "amax"
    s = nvfp4("weight", preset="nvfp4_torchao")
    assert (s.block, s.family, s.scale_format, s.global_scale) == ((16, 16), "nvfp4", "ue4m3", True)


def test_one_preset_naming_with_a_default_and_deprecated_order_names():
    """``default`` is TransformerEngine's order with the amax convention (the docs say so); the
    bare order names still give the same preset, with a DeprecationWarning naming the new one."""
    import warnings

    from moeref.quant import NVFP4_PRESETS, PRESETS

    assert nvfp4_preset("default") is PRESETS["nvfp4_te"]
    assert nvfp4().preset is PRESETS["nvfp4_te"] and nvfp4_weight().preset is PRESETS["nvfp4_te"]
    assert nvfp4_preset("default").option("global_convention") == "amax"
    assert set(NVFP4_PRESETS) == {"default"} | {k for k in PRESETS if k.startswith("nvfp4_")}
    for order in ("te", "flashinfer", "vllm", "torchao"):
        with pytest.warns(DeprecationWarning, match=f"'{order}' is deprecated; use 'nvfp4_{order}'"):
            assert nvfp4(preset=order).preset is PRESETS[f"nvfp4_{order}"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in NVFP4_PRESETS:  # the names of the one scheme never warn
            nvfp4(preset=name)


# ---- layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,kind,grid", [((3, 17), "activation", (3, 2)),
                                             ((17, 33), "weight", (2, 3)),
                                             ((2, 16, 32), "weight", (2, 1, 2)),
                                             ((5,), "activation", (1,)),
                                             ((2, 3, 40), "activation", (2, 3, 3))])
def test_shapes_and_packing(shape, kind, grid):
    x = _data(shape, 8)
    q = quantize(x, nvfp4(kind))
    assert q.scales.shape == grid and q.scales.dtype == np.uint8
    assert q.codes.shape == shape[:-1] + ((shape[-1] + 1) // 2,)
    codes = q.element_codes()
    # even element in the low nibble
    assert np.array_equal(q.codes[..., : shape[-1] // 2] & 0xF, codes[..., 0:2 * (shape[-1] // 2):2])
    assert np.array_equal(q.codes[..., : shape[-1] // 2] >> 4, codes[..., 1:2 * (shape[-1] // 2):2])


def test_weight_tiles_share_one_scale_and_transpose_agrees():
    # TE 2-D recipe: rowwise and columnwise quantization of a weight are the same numbers
    w = _data((32, 48), 9)
    q = quantize(w, nvfp4("weight"))
    qt = quantize(np.ascontiguousarray(w.T), nvfp4("weight"))
    assert np.array_equal(qt.scales, q.scales.T)
    assert np.array_equal(qt.element_codes(), q.element_codes().T)


# ---- dequantize error bound -------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["te", "flashinfer", "torchao"])
def test_error_bound(preset):
    x = _data((16, 64), 10)
    q = quantize(x, nvfp4(preset=f"nvfp4_{preset}"))
    from moeref.quant.blockwise import expand_to_elements
    d = expand_to_elements(q.scale_values(), q.block_shape, q.shape)
    s = expand_to_elements(orc.e4m3_value(q.scales).astype(np.float64), q.block_shape, q.shape)
    err = np.abs(q.dequantize(np.float64) - x)
    normal = s >= 2.0 ** -6
    # each element is within half an E2M1 gap (1 at most, at 4..6) of x/D, and a block max
    # overshoots 6 by at most 6/(1 - 2^-4) - 6 < 1 (UE4M3 RNE relative error <= 2^-4)
    assert np.all(err[normal] <= d[normal] * (1 + 1e-5))


# ---- MXFP4 -> NVFP4 ---------------------------------------------------------------------------

def test_mxfp4_to_nvfp4_lossless_when_exponents_fit():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((4, 64)) * np.exp2(rng.integers(-6, 8, size=(4, 1)))).astype(F32)
    src = quantize(x, mxfp4())
    for preset in ("te", "vllm", "torchao"):
        dst, rep = requantize(src, nvfp4(preset=f"nvfp4_{preset}"))
        assert rep.lossless and rep.max_abs_error == 0.0
        assert np.array_equal(dst.dequantize(np.float64), src.dequantize(np.float64))
        assert np.array_equal(dst.element_codes(), src.element_codes())  # same E2M1 codes


def test_mxfp4_to_nvfp4_lossy_beyond_17_binades():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 64)).astype(F32)
    x[0] *= F32(2.0 ** -24)   # block exponents 24 binades apart: UE4M3 spans 2^-9 .. 2^8
    dst, rep = requantize(quantize(x, mxfp4()), nvfp4())
    assert not rep.lossless and rep.max_abs_error > 0


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused_with_its_index(bad):
    x = np.ones((2, 16), F32)
    x[1, 3] = bad
    with pytest.raises(ValueError, match=r"x\[1, 3\]"):
        quantize(x, nvfp4())


@pytest.mark.parametrize("g", [0.0, -1.0, np.nan, np.inf])
def test_bad_static_global_scale(g):
    with pytest.raises(ValueError, match="global_scale"):
        quantize(np.ones((1, 16), F32), nvfp4(), global_scale=g)


@pytest.mark.parametrize("preset,convention,g", [
    ("vllm", "encode_scale", 1e-39), ("te", "encode_scale", 2e-39),
    ("torchao", "decode_scale", 1e-39)])
def test_static_global_scale_whose_reciprocal_overflows(preset, convention, g):
    """1/g is above FLT_MAX in float32: the data factor would be Inf/NaN, so it is refused."""
    assert not np.isfinite(F32(1) / F32(g))
    with pytest.raises(ValueError, match="reciprocal"):
        quantize(np.ones((1, 16), F32), nvfp4(preset=f"nvfp4_{preset}", convention=convention), global_scale=g)


def test_bad_arguments():
    with pytest.raises(TypeError, match="global_scale"):
        quantize(np.ones((1, 16), F32), nvfp4(), global_scale=True)
    with pytest.raises(TypeError, match="global_scale"):
        quantize(np.ones((1, 16), F32), nvfp4(), global_scale="1.0")
    with pytest.raises(ValueError, match="NVFP4 kind"):
        nvfp4("bias")
    with pytest.raises(ValueError, match="convention"):
        nvfp4(convention="scale")
    with pytest.raises(ValueError, match="float32 rounding"):
        nvfp4(preset="nvfp4_torchao", convention="encode_scale")
    with pytest.raises(ValueError, match="float32 rounding"):
        nvfp4(preset="nvfp4_te", convention="decode_scale")
    with pytest.raises(ValueError, match="not an NVFP4 preset"):
        nvfp4(preset="ocp")
    with pytest.raises(ValueError, match="unknown preset"):
        nvfp4(preset="fast")
    with pytest.raises(ValueError, match="shape"):
        quantize(np.ones(16, F32), nvfp4("weight"))
    with pytest.raises(TypeError, match="x must be"):
        quantize(np.ones((1, 16), np.int32), nvfp4())
    with pytest.raises(TypeError, match="NVFP4 Scheme"):
        quantize_nvfp4(np.ones((1, 16), F32), mxfp4())
    with pytest.raises(TypeError, match="NVFP4 QuantizedTensor"):
        global_scale_as(quantize(np.ones((1, 32), F32), mxfp4()), "amax")
    with pytest.raises(ValueError, match="overflows float32"):
        quantize(np.full((1, 16), 1e-38, F32), nvfp4(preset="nvfp4_vllm"))


def test_quantized_tensor_contract():
    q = quantize(_data((2, 32), 13), nvfp4())
    assert isinstance(q, QuantizedTensor)
    assert np.array_equal(dequantize(q), q.dequantize())
    with pytest.raises(ValueError):
        q.codes[0, 0] = 1  # read-only


def test_float64_input_is_computed_in_float64():
    # no anchor takes float64; moeref runs the same formulas in float64 (blockwise working dtype)
    x = _data((3, 40), 14).astype(np.float64) * (1 + 2.0 ** -40)   # not float32-representable
    q = quantize(x, nvfp4(preset="nvfp4_te"))
    q32 = quantize(x.astype(F32), nvfp4(preset="nvfp4_te"))
    assert q.global_scale == np.abs(x).max() / 2688                 # the float64 amax
    assert q32.global_scale != q.global_scale
    d = np.repeat(q.scale_values(), 16, axis=-1)[:, :40]
    normal = np.repeat(orc.e4m3_value(q.scales), 16, axis=-1)[:, :40] >= 2.0 ** -6
    assert normal.any()
    err = np.abs(q.dequantize(np.float64) - x)
    assert np.all(err[normal] <= d[normal] * (1 + 1e-9))
