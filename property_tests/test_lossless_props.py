"""requantize / quantize_and_report find a lossless encoding whenever the target can hold the values.

The values are BUILT representable: random element codes times a random scale per target block
(FP32, UE8M0, or UE4M3 times a storable FP32 global), so a lossless encoding exists by
construction; the report must say lossless, and the encoding it returns must decode to exactly
the values. The scales are drawn independently of any rule, so the schemes' own rules usually
miss them (the search is what is tested).
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from moeref.formats import decode_table
from moeref.quant import (fp8_block, fp8_group, mxfp4, mxfp8, quantize, quantize_and_report,
                          requantize)
from moeref.quant.lossless import global_storable
from moeref.quant.nvfp4 import nvfp4

TARGETS = {
    "fp8_4x8_fp32": lambda: fp8_block((4, 8)),
    "fp8_4x8_ue8m0": lambda: fp8_block((4, 8), "ue8m0", "deepgemm"),
    "fp8_1x16_fp32": lambda: fp8_group(16),
    "mxfp4": lambda: mxfp4(),
    "mxfp8": lambda: mxfp8(),
    "nvfp4_te": lambda: nvfp4(),
    "nvfp4_vllm": lambda: nvfp4(preset="nvfp4_vllm"),
    "nvfp4_torchao": lambda: nvfp4(preset="nvfp4_torchao"),
}


SIBLINGS = {  # the same storage under another preset: a different scale rule
    "fp8_4x8_fp32": lambda: fp8_block((4, 8), preset="deepgemm"),
    "fp8_4x8_ue8m0": lambda: fp8_block((4, 8), "ue8m0", "vllm"),
    "fp8_1x16_fp32": lambda: fp8_group(16, preset="te_fp8"),
    "mxfp4": lambda: mxfp4(preset="ocp"),
    "mxfp8": lambda: mxfp8(preset="ocp"),
    "nvfp4_te": lambda: nvfp4(preset="nvfp4_vllm"),
    "nvfp4_vllm": lambda: nvfp4(preset="nvfp4_torchao"),
    "nvfp4_torchao": lambda: nvfp4(preset="nvfp4_te"),
}


@st.composite
def representable(draw, pow2_global=False):
    name = draw(st.sampled_from(sorted(TARGETS)))
    target = TARGETS[name]()
    rows = draw(st.integers(1, 9))
    cols = draw(st.integers(1, 40))
    block = target.resolve_block((rows, cols))
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    table = decode_table(target.element)
    finite = np.flatnonzero(np.isfinite(table))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    codes = rng.choice(finite, size=(rows, cols))
    glob = None
    if target.scale_format == "fp32":
        scales = np.ldexp(rng.integers(1 << 23, 1 << 24, grid).astype(np.float64),
                          rng.integers(-40, -10, grid))
    elif target.scale_format == "ue8m0":
        scales = np.ldexp(1.0, rng.integers(-30, 30, grid))
    else:
        ue = decode_table("ue4m3")
        scales = ue[rng.integers(1, 127, grid)]  # every positive UE4M3 value, subnormals too
        glob = float(np.float32(np.ldexp(rng.uniform(1, 2), int(rng.integers(-20, -2)))))
        if pow2_global or not global_storable(glob, target):
            glob = float(np.ldexp(1.0, int(rng.integers(-20, -2))))  # powers of two always are
        scales = scales * glob
    full = np.repeat(np.repeat(scales, block[0], 0), block[1], 1)[:rows, :cols]
    if not pow2_global:
        return name, target, table[codes] * full
    from moeref.formats import encode, pack_nibbles
    from moeref.quant import QuantizedTensor

    if target.scale_format == "fp32":
        stored = scales.astype(np.float32)
    else:
        stored = encode(scales / (glob or 1.0), "e8m0" if target.scale_format == "ue8m0" else "ue4m3",
                        overflow="error")
    c = codes.astype(np.uint8)
    if target.packed:
        c = pack_nibbles(np.concatenate([c, np.zeros((rows, cols % 2), np.uint8)], axis=1))
    src = QuantizedTensor(codes=c, scales=stored, scheme=target, shape=(rows, cols), global_scale=glob)
    assert np.array_equal(src.dequantize(np.float64), table[codes] * full)
    return name, src, table[codes] * full


@given(case=representable())
def test_representable_values_are_reported_lossless(case):
    name, target, x = case
    q, rep = quantize_and_report(x, target)
    assert rep.lossless, (name, rep.method, rep.max_abs_error)
    assert np.array_equal(q.dequantize(np.float64), x)
    assert rep.max_abs_error == 0.0 and rep.sqnr_db == float("inf") and rep.worst_block is None


@given(case=representable(pow2_global=True))
def test_lossless_from_a_quantized_source(case):
    """The same through requantize: the source holds the values in the target's storage; the
    target is that storage under another preset (another scale rule)."""
    name, src, x = case
    t, rep = requantize(src, SIBLINGS[name]())
    assert rep.lossless, (name, rep.method)
    assert np.array_equal(t.dequantize(np.float64), x)


def test_issue_example_mxfp4_to_fp8_block_with_fp32_scales():
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    q = quantize(x, mxfp4())
    t, rep = requantize(q, fp8_block((128, 128)))
    assert rep.lossless and rep.method == "lossless_search"
    assert np.array_equal(t.dequantize(np.float64), q.dequantize(np.float64))
    # the scales it found are powers of two (MXFP4 values are a power of two times E2M1)
    assert np.all(np.frexp(t.scales)[0] == 0.5)


def test_not_representable_stays_lossy():
    x = np.array([[1.0, 1.0 + 2.0 ** -10] + [0.0] * 14], np.float32)  # 11 significant bits apart
    for target in (fp8_group(16), mxfp8(), nvfp4()):
        _, rep = quantize_and_report(x, target)
        assert not rep.lossless and rep.max_abs_error > 0


def test_static_global_is_kept_by_the_lossless_candidates():
    """requantize(global_scale=...): the rule gets the static global, and a lossless candidate is
    taken only with that same global factor (a fused group must keep sharing it)."""
    import pytest

    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    q = quantize(x, mxfp4())
    g = 2.0 ** -6  # decode scale (torchao's convention): a power of two keeps MXFP4 exact
    t, rep = requantize(q, nvfp4(preset="nvfp4_torchao"), global_scale=g)
    assert t.global_scale == g and rep.lossless and rep.method == "exact_rescale"
    t2, rep2 = requantize(q, nvfp4(preset="nvfp4_torchao"), global_scale=3.0e-3)  # not a power of two
    assert t2.global_scale == float(np.float32(3.0e-3))
    assert rep2.lossless == np.array_equal(t2.dequantize(np.float64), q.dequantize(np.float64))
    with pytest.raises(ValueError, match="NVFP4"):
        requantize(q, mxfp8(), global_scale=1.0)
