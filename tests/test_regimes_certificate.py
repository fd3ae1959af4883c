"""The fast paths of the exact-regime checks change no verdict.

* ``in_exact_regime``'s matmul-free bound only ever answers "inside"; checked against an oracle written here from
  the definition (every partial sum of every output, per promotion interval, within the accumulator's bits).
* A generated layer's ``RegimeCertificate`` gives the verdict of the check from the values, without a reference
  run, and stops applying once the layer's arrays are replaced or edited.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeref.regimes import (ExactLayer, RegimeCertificate, exact_layer, in_exact_regime, layer_in_exact_regime,
                            single_rounding_layer)
from moeref.regimes.strategies import exact_layers, single_rounding_layers


def slow(n: int):
    return settings(deadline=None, max_examples=min(n, settings().max_examples),
                    suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------ the GEMM checker against an oracle


def _lsb(v):  # lowest set bit exponent of nonzero finite floats, by repeated halving (independent of the code)
    out = np.full(v.shape, 10**6, dtype=np.int64)
    for idx in zip(*np.nonzero(v)):
        m, e = np.frexp(abs(float(v[idx])))
        m = int(m * 2**53)
        e -= 53
        while m % 2 == 0:
            m //= 2
            e += 1
        out[idx] = e
    return out


def oracle(a, w, bits: int, interval: int | None) -> bool:
    """Inside when, per output and per interval (the whole K for FP32), max(sum of positive terms, |sum of
    negative terms|) <= 2^bits times min lsb(a row) * min lsb(w row) over that interval, and over the whole K
    within FP32's 24 bits."""
    k = a.shape[1]
    spans = [(0, k, 24)] + ([] if interval is None else [(s, min(s + interval, k), bits)
                                                         for s in range(0, k, interval)])
    for s0, s1, b in spans:
        aa, ww = a[:, s0:s1], w[:, s0:s1]
        t = aa[:, None, :] * ww[None, :, :]
        s = np.maximum(np.where(t > 0, t, 0).sum(-1), np.where(t < 0, -t, 0).sum(-1))
        q = _lsb(aa).min(axis=1)[:, None] + _lsb(ww).min(axis=1)[None, :]
        nz = s > 0
        if np.any(np.log2(s[nz]) > q[nz] + b):
            return False
    return True


@settings(deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.sampled_from([1, 2, 8, 64]),
       st.sampled_from(["fp32", "hopper_fp8", "fp8_unpromoted"]))
def test_gemm_verdict_equals_the_oracle(seed, span, scale, arithmetic):
    rng = np.random.default_rng(seed)
    m, n, k = 3, 4, 160
    a = rng.integers(-scale, scale + 1, size=(m, k)) * np.ldexp(1.0, rng.integers(0, span, size=(m, k)))
    w = rng.integers(-scale, scale + 1, size=(n, k)) * np.ldexp(1.0, rng.integers(0, span, size=(n, k)))
    bits, interval = {"fp32": (24, None), "hopper_fp8": (14, 128), "fp8_unpromoted": (14, k)}[arithmetic]
    assert in_exact_regime((a, w), arithmetic).ok == oracle(a, w, bits, interval)


# ------------------------------------------------------------------ layer certificates


@slow(15)
@given(st.one_of(exact_layers(expert_maps=False), single_rounding_layers(expert_maps=False)),
       st.sampled_from(["fp32", "hopper_fp8", "fp8_unpromoted"]))
def test_certificate_verdict_equals_the_values_verdict(lay, arithmetic):
    assert isinstance(lay.certificate, RegimeCertificate) or lay.certificate is None
    assert layer_in_exact_regime(lay, arithmetic).ok == layer_in_exact_regime(lay, arithmetic, from_values=True).ok


@pytest.mark.parametrize("build", [exact_layer, single_rounding_layer])
def test_certified_check_runs_no_reference(build, monkeypatch):
    lay = build(6, 256, 256, 4, 2, seed=1, shared_experts=True)
    assert isinstance(lay.certificate, RegimeCertificate)

    def no_reference(self, **overrides):
        raise AssertionError("the certified check ran the reference")

    monkeypatch.setattr(ExactLayer, "reference", no_reference)
    assert layer_in_exact_regime(lay, "hopper_fp8").ok
    with pytest.raises(AssertionError, match="ran the reference"):
        layer_in_exact_regime(lay, "hopper_fp8", from_values=True)


def test_an_edited_layer_is_checked_from_its_values():
    lay = exact_layer(4, 256, 256, 4, 2, scheme="fp8_1x128", seed=1)
    assert layer_in_exact_regime(lay, "fp32").ok
    lay.hidden[1] *= np.float32(1.1)  # in place: no longer small integers times a power of two
    ok, why = layer_in_exact_regime(lay, "fp32")
    assert not ok and why


def test_replaced_arrays_drop_the_certificate():
    lay = exact_layer(4, 256, 256, 4, 2, scheme="fp8_1x128", seed=1)
    bad = dataclasses.replace(lay, hidden=(lay.hidden * np.float32(1.1)).astype(np.float32))
    assert bad.certificate is None
    assert not layer_in_exact_regime(bad, "fp32").ok


def test_edited_topk_weights_and_swapped_weights_are_seen():
    lay = exact_layer(4, 256, 256, 4, 2, scheme="fp8_1x128", seed=1)
    lay.topk_weights[0, 0] = np.float32(0.3)  # not a power of two: the top-k sum is inexact
    assert not layer_in_exact_regime(lay, "fp32").ok
    other = exact_layer(4, 256, 256, 4, 2, scheme="fp8_1x128", seed=2)
    lay2 = exact_layer(4, 256, 256, 4, 2, scheme="fp8_1x128", seed=1)
    cert = lay2.certificate
    lay2.weights.w13[0] = other.weights.w13[0]  # a different object: the binding no longer matches
    from moeref.regimes.layer_check import _binding

    assert cert.binding != _binding(lay2)


def test_run_is_reused():
    lay = exact_layer(5, 256, 256, 4, 2, scheme="bf16", seed=3, bias=True)
    run = lay.reference()
    assert layer_in_exact_regime(lay, "fp32", run=run, from_values=True) == layer_in_exact_regime(
        lay, "fp32", from_values=True)


# ------------------------------------------------------------------ the equality report's bit comparison


def test_equality_from_bits_keeps_signed_zeros_and_nans_equal():
    import ml_dtypes

    from moeref.regimes import moe_equality_report

    lay = exact_layer(6, 256, 256, 4, 2, scheme="fp8_1x128", seed=2)
    run = lay.reference()
    ref = run.out
    assert ref.dtype == np.dtype(ml_dtypes.bfloat16)
    cand = ref.copy()
    bits = cand.view(np.uint16)
    zero = np.flatnonzero(ref.reshape(-1).astype(np.float64) == 0)
    assert zero.size
    bits.reshape(-1)[zero[0]] ^= 0x8000  # +0 <-> -0: no declared sign, equal
    assert moe_equality_report(cand, run).passed
    bits.reshape(-1)[7] ^= 1  # one last bit: differs
    r = moe_equality_report(cand, run)
    assert r.num_differences == 1 and r.differing[0]["index"] == np.unravel_index(7, ref.shape)
    assert r.by_expert == {int(e): 1 for e in lay.topk_ids[r.differing[0]["token"]] if e >= 0}
    nan_ref = dataclasses.replace(run, out=np.full_like(ref, np.nan))
    nan_cand = np.full_like(ref, np.nan)
    nan_cand.view(np.uint16)[:] = 0x7FC1  # another NaN payload
    assert moe_equality_report(nan_cand, nan_ref).passed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_bit_comparison_equals_the_value_comparison(dtype):
    """Random bit patterns (NaNs, infinities, both zeros, subnormals included) against their float64 values."""
    import ml_dtypes

    from moeref.regimes.equality import _differ, _differ_native

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    ui = np.dtype(f"u{dt.itemsize}")
    rng = np.random.default_rng(0)
    pool = rng.integers(0, np.iinfo(ui).max, size=64, dtype=ui, endpoint=True)
    pool[:4] = [0, 1 << (8 * dt.itemsize - 1), pool[4], pool[4] ^ 1]
    a = pool[rng.integers(0, pool.size, size=(50, 40))].view(dt)
    b = pool[rng.integers(0, pool.size, size=(50, 40))].view(dt)
    with np.errstate(invalid="ignore"):
        expected = _differ(a.astype(np.float64), b.astype(np.float64))
    assert np.array_equal(_differ_native(a, b), expected)


def test_a_float16_gemm_store_is_judged_from_the_values():
    """The certificate covers bf16 and FP32 stores; float16's range (65504) is checked on the values."""
    from moeref.regimes import get_arithmetic

    lay = exact_layer(4, 256, 256, 4, 2, scheme="fp8_1x128", seed=1, token_exponents=(3, 4))
    ar = get_arithmetic("hopper_fp8").with_(gemm_store="float16")
    ok, why = layer_in_exact_regime(lay, ar)
    assert not ok and any("beyond the float16 range" in r for r in why)
    assert layer_in_exact_regime(lay, "hopper_fp8").ok
