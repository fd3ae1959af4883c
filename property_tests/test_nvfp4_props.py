"""Hypothesis properties of NVFP4 (moeref.quant.nvfp4).

* bit-for-bit against the three anchors' references (tests/nvfp4_oracles.py: TransformerEngine,
  FlashInfer/vLLM, torchao), dynamic and static global scales, 1x16 and 16x16 blocks, shapes that
  are not multiples of 16;
* idempotence: a tensor already on the NVFP4 grid (every block reaching +-6) quantizes to itself;
* the dequantization error bound; sign symmetry; TE's rowwise == columnwise for 16x16 tiles.

Inputs are built block by block from enumerated families: zero blocks (with -0.0), normal data
over a wide exponent range, tiny (zero/subnormal UE4M3 scales) and huge blocks, exact E2M1
midpoint ties, and block amaxes on, just above and just below UE4M3 midpoints (ties of the scale
cast, where TE's and FlashInfer's operation orders part).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import nvfp4_oracles as orc  # noqa: E402

from moeref.quant import quantize  # noqa: E402
from moeref.quant.blockwise import expand_to_elements  # noqa: E402
from moeref.quant.nvfp4 import global_scale_as, nvfp4  # noqa: E402

F32 = np.float32
E2M1_POS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)
E2M1_MID = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
_E4M3 = orc.e4m3_value(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)  # 0 .. 448
E4M3_MID = ((_E4M3[1:-1] + _E4M3[2:]) / 2)  # midpoints from 2^-9 upward

MIXED = ("zero", "normal", "normal", "tiny", "huge")
TIES = ("ties", "scale_tie", "scale_tie", "zero")


def _block(family: str, rng: np.random.Generator, exp: int) -> np.ndarray:
    if family == "zero":
        return np.where(rng.random(16) < 0.5, F32(-0.0), F32(0.0)).astype(F32)
    if family == "normal":
        return (rng.standard_normal(16) * 2.0 ** exp).astype(F32)
    if family == "tiny":
        return (rng.standard_normal(16) * 2.0 ** (exp - 100)).astype(F32)
    if family == "huge":
        return (rng.standard_normal(16) * 2.0 ** (exp + 90)).astype(F32)
    if family == "ties":  # E2M1 grid values and midpoints times 2^exp (exp <= 0), amax 6 * 2^exp
        v = rng.choice(np.concatenate([E2M1_POS, E2M1_MID]), 16) * rng.choice([-1, 1], 16)
        v[rng.integers(16)] = 6.0
        return (v * 2.0 ** min(exp, 0)).astype(F32)
    # scale_tie: block amax a with a * 448 / 6 on a UE4M3 midpoint, or one float32 ulp off it
    mid = rng.choice(E4M3_MID[E4M3_MID < 440])
    a = F32(mid * 6 / 448)
    a = [np.nextafter(a, F32(0)), a, np.nextafter(a, F32(10))][rng.integers(3)]
    v = (rng.random(16) * a).astype(F32)
    v[rng.integers(16)] = a
    return v


@st.composite
def nvfp4_inputs(draw, weight: bool = False):
    """float32 (rows, cols) with rows/cols not multiples of 16, built from block families."""
    rows = draw(st.integers(1, 40 if weight else 5))
    cols = draw(st.integers(1, 70))
    mode = draw(st.sampled_from(["mixed", "ties"]))
    nb_r, nb_c = (-(-rows // 16) if weight else rows), -(-cols // 16)
    fams = draw(st.lists(st.sampled_from(MIXED if mode == "mixed" else TIES),
                         min_size=nb_r * nb_c, max_size=nb_r * nb_c))
    exps = draw(st.lists(st.integers(-20, 20), min_size=nb_r * nb_c, max_size=nb_r * nb_c))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    h = 16 if weight else 1
    x = np.zeros((nb_r * h, nb_c * 16), F32)
    for i, (f, e) in enumerate(zip(fams, exps)):  # a handful of blocks: building the test input
        r, c = divmod(i, nb_c)
        x[r * h:(r + 1) * h, c * 16:(c + 1) * 16] = np.stack([_block(f, rng, e) for _ in range(h)])
    x = x[:rows, :cols]
    if mode == "ties" and x.size:
        x.flat[rng.integers(x.size)] = 6.0  # tensor amax 6: S_enc = 448, ties stay exact
    return x


statics = st.one_of(st.none(), st.sampled_from([0.25, 0.5, 1.0, 3.0, 1000.0]))


# ---- bit-for-bit against each anchor ----------------------------------------------------------

@given(x=nvfp4_inputs(), static=statics)
def test_te_1x16_matches_reference(x, static):
    A = None if static is None else F32(max(np.abs(x).max(), 1e-30) * static)
    q = quantize(x, nvfp4(preset="nvfp4_te"), **({} if A is None else {"global_scale": A}))
    codes, scales, amax = orc.te_nvfp4_ref(x, (1, 16), A)
    assert np.array_equal(q.element_codes(), codes)
    assert np.array_equal(q.scales, scales)
    assert global_scale_as(q, "amax") == amax


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(x=nvfp4_inputs(weight=True))
def test_te_16x16_matches_reference(x):
    q = quantize(x, nvfp4("weight", preset="nvfp4_te"))
    codes, scales, _ = orc.te_nvfp4_ref(x, (16, 16))
    assert np.array_equal(q.element_codes(), codes)
    assert np.array_equal(np.repeat(q.scales, 16, axis=0)[: x.shape[0]], scales)


@given(x=nvfp4_inputs(), static=statics, preset=st.sampled_from(["flashinfer", "vllm"]))
def test_flashinfer_vllm_match_reference(x, static, preset):
    A = F32(np.abs(x).max())
    assume(A > 0)
    gs = orc.flashinfer_global_scale(x) if static is None else F32(2688) / F32(A * static)
    if not np.isfinite(gs):  # 2688 / A overflows: the anchor has no clamp; moeref refuses
        with pytest.raises(ValueError, match="overflows"):
            quantize(x, nvfp4(preset=f"nvfp4_{preset}"), **({} if static is None else {"global_scale": gs}))
        return
    q = quantize(x, nvfp4(preset=f"nvfp4_{preset}"), **({} if static is None else {"global_scale": gs}))
    values, scales = orc.flashinfer_ref_fp4_quant(x, gs)
    assert np.array_equal(q.element_values(np.float32), values)
    assert np.array_equal(orc.e4m3_value(q.scales), scales)
    assert global_scale_as(q, "encode_scale") == gs


@given(x=nvfp4_inputs(), static=statics)
def test_torchao_matches_reference(x, static):
    A = F32(np.abs(x).max())
    assume(A > 0)
    pts = orc.torchao_per_tensor_amax_to_scale(A if static is None else F32(A * static))
    assume(pts > 0)
    kw = {} if static is None else {"global_scale": pts}
    overflow = not np.isfinite(orc.torchao_nvfp4_factors(x, pts)[2]).all()
    if overflow:  # torchao multiplies by Inf here (NaN codes); the reference refuses
        with pytest.raises(ValueError, match="overflows"):
            quantize(x, nvfp4(preset="nvfp4_torchao"), **kw)
        return
    q = quantize(x, nvfp4(preset="nvfp4_torchao"), **kw)
    codes, scales = orc.torchao_nvfp4_quantize(x, pts)
    assert np.array_equal(q.element_codes(), codes)
    assert np.array_equal(q.scales, scales)


# ---- idempotence on the grid ------------------------------------------------------------------

@given(data=st.data(), preset=st.sampled_from(["te", "flashinfer", "torchao"]),
       g=st.integers(-30, 30), kind=st.sampled_from(["activation", "weight"]))
def test_grid_tensors_quantize_to_themselves(data, preset, g, kind):
    rows = data.draw(st.integers(1, 3)) * (16 if kind == "weight" else 1)
    nb = data.draw(st.integers(1, 4))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    h = 16 if kind == "weight" else 1
    lo = 0x08 if preset == "torchao" else 0x01      # torchao clamps scales below at 2^-6
    scodes = rng.integers(lo, 0x7F, size=(rows // h, nb)).astype(np.uint8)
    scodes.flat[rng.integers(scodes.size)] = 0x7E   # the top block uses 448
    codes = rng.integers(0, 16, size=(rows, nb * 16)).astype(np.uint8)
    # every block reaches +-6 (code 7/15), so its amax / 6 is its scale exactly
    cb = codes.reshape(rows // h, h, nb, 16)
    cb[:, 0, :, 0] = 7 | (cb[:, 0, :, 0] & 8)
    vals = orc.E2M1_VALUES[codes].astype(np.float64)
    s = np.repeat(np.repeat(orc.e4m3_value(scodes).astype(np.float64), h, 0), 16, 1)
    x = (vals * s * 2.0 ** g).astype(F32)
    assert np.array_equal(x.astype(np.float64), vals * s * 2.0 ** g)  # exact in float32
    q = quantize(x, nvfp4(kind, preset=f"nvfp4_{preset}"))
    assert np.array_equal(q.scales, scodes)
    assert np.array_equal(orc.E2M1_VALUES[q.element_codes()], orc.E2M1_VALUES[codes])
    assert np.array_equal(q.dequantize(), x)
    q2 = quantize(q.dequantize(), nvfp4(kind, preset=f"nvfp4_{preset}"))
    assert np.array_equal(q2.codes, q.codes) and np.array_equal(q2.scales, q.scales)


# ---- error bound, symmetry, 2-D tiles ----------------------------------------------------------

def _half_gap(v):
    return np.where(v <= 2, 0.25, np.where(v <= 4, 0.5, 1.0))


@given(x=nvfp4_inputs(), preset=st.sampled_from(["te", "flashinfer", "torchao"]))
def test_dequantization_error_bound(x, preset):
    assume(np.abs(x).max() > 1e-30)
    q = quantize(x, nvfp4(preset=f"nvfp4_{preset}"))
    d = expand_to_elements(q.scale_values(), q.block_shape, q.shape)
    s = expand_to_elements(orc.e4m3_value(q.scales).astype(np.float64), q.block_shape, q.shape)
    err = np.abs(q.dequantize(np.float64) - x.astype(np.float64))
    ok = (s >= 2.0 ** -6) & (d > 0)     # normal UE4M3 scales (subnormal ones lose precision)
    v = np.abs(x.astype(np.float64))[ok] / d[ok]
    # within half an E2M1 gap of x / D, or the overshoot of a saturated block max (< 0.4)
    bound = d[ok] * (np.maximum(_half_gap(np.minimum(v, 6)), v - 6) + 1e-5)
    assert np.all(err[ok] <= bound)
    assert np.all(v <= 6 / (1 - 2.0 ** -4) * (1 + 1e-6))  # UE4M3 RNE: relative error <= 2^-4


@given(x=nvfp4_inputs(), preset=st.sampled_from(["te", "flashinfer", "torchao"]))
def test_sign_symmetry(x, preset):
    q, qn = quantize(x, nvfp4(preset=f"nvfp4_{preset}")), quantize(-x, nvfp4(preset=f"nvfp4_{preset}"))
    assert np.array_equal(q.scales, qn.scales)
    assert np.array_equal(qn.element_values(), -q.element_values())


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(x=nvfp4_inputs(weight=True))
def test_weight_rowwise_equals_columnwise(x):
    q = quantize(x, nvfp4("weight"))
    qt = quantize(np.ascontiguousarray(x.T), nvfp4("weight"))
    assert np.array_equal(qt.scales, q.scales.T)
    assert np.array_equal(qt.element_values(), q.element_values().T)
