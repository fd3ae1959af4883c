"""The scaling schemes (moeref.quant) equal the anchors' own algorithms bit for bit on random
shapes: DeepGEMM's ``per_token_cast_to_fp8`` and torchao's ``to_mx`` (every scale calculation
mode, FP8/FP6/FP4 elements), as the torch oracles of tests/quant_oracles.py restate them. The
torch part of the scheme properties, kept apart so that test_quant_props.py runs without torch.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moeref.quant import fp8_group, mxfp4, mxfp6, mxfp8, quantize

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import quant_oracles as O  # noqa: E402
from property_tests.test_quant_props import N_EX, tensors  # noqa: E402


@settings(max_examples=N_EX)
@given(x=tensors(min_ndim=2, max_ndim=2, max_side=300), ue8m0=st.booleans(),
       bf16=st.booleans())
def test_deepgemm_per_token_oracle(x, ue8m0, bf16):
    t = torch.from_numpy(x).to(torch.bfloat16 if bf16 else torch.float32)
    codes, sf = O.deepgemm_per_token_cast_to_fp8(t, ue8m0, 128)
    q = quantize(t, fp8_group(128, "ue8m0" if ue8m0 else "fp32", "deepgemm"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scale_values().astype(np.float32), sf)


@settings(max_examples=N_EX)
@given(x=tensors(min_ndim=2, max_ndim=2, max_side=4), mode=st.sampled_from(
    [("floor", "ocp"), ("ceil", "torchao_ceil"), ("even", "torchao_even"), ("rceil", "torchao_rceil")]),
    elem=st.sampled_from(["e4m3fn", "e5m2", "e2m1", "e2m3", "e3m2"]))
def test_torchao_oracle(x, mode, elem):
    x = np.tile(x, (1, 32))[:, : 32 * max(1, x.shape[1] // 2)]  # multiple of 32, as to_mx needs
    codes, scales = O.torchao_to_mx(torch.from_numpy(np.ascontiguousarray(x)), elem, mode[0])
    scheme = (mxfp4(preset=mode[1]) if elem == "e2m1" else
              mxfp6(elem, preset=mode[1]) if elem in ("e2m3", "e3m2") else mxfp8(elem, preset=mode[1]))
    q = quantize(x, scheme)
    assert np.array_equal(q.scales, scales)
    assert np.array_equal(q.element_codes(), codes)
