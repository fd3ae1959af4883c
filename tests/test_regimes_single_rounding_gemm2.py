"""moeref.regimes.single_rounding_layer(gemm2_store="bfloat16"): GEMM2's output rounded once at its declared bf16
store (DeepGEMM pipelines, CUTLASS / torch bf16 layers), the top-k sum of the stored values exact.

The float32 torch layer of tests/test_regimes_single_rounding.py (FP32 GEMMs, bf16 stores and FP8 quantizers from
their formulas, rounding modes from the bit patterns), with GEMM2's bf16 store made, gives the reference's bits under
honest orders (split-K, a permuted K order, the top-k sum in reverse slot order, tokens in chunks, the optional
activation store) on layers drawn by Hypothesis; a round-toward-zero GEMM2 store, a skipped GEMM2 store, a bf16
accumulator over 128-column K blocks (either GEMM) and the other single-rounding faults change them."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from moeref.regimes import (ROUNDING_LAYER_SCHEMES, layer_in_exact_regime, single_rounding_layer,  # noqa: E402
                            single_rounding_stores)
from moeref.regimes.strategies import single_rounding_layers  # noqa: E402
from test_regimes_single_rounding import _differences, bf16, slow, torch_layer  # noqa: E402


@slow(10)
@given(single_rounding_layers(gemm2_store="bfloat16"), st.sampled_from(["fp32", "split_k", "permuted"]),
       st.sampled_from(["fp32", "split_k", "permuted"]), st.booleans(), st.booleans(), st.integers(0, 3))
def test_honest_orders_with_the_gemm2_store_equal_the_reference(lay, gemm1, gemm2, reverse, act_store, chunk):
    assert lay.config.gemm2_out_dtype == "bfloat16" and lay.excluded_stores == ()
    assert layer_in_exact_regime(lay, "fp32" if lay.scheme == "bf16" else "hopper_fp8").ok
    got = torch_layer(lay, gemm1=gemm1, gemm2=gemm2, reverse_topk=reverse, chunk=chunk or None,
                      act_store="rne" if act_store else None, gemm2_store="rne")
    assert _differences(lay, got) == 0


@functools.lru_cache(maxsize=None)
def _layer(scheme):
    return single_rounding_layer(24, 256, 256, 8, 4, scheme=scheme, seed=4, shared_experts=True,
                                 gemm2_store="bfloat16")


@pytest.mark.parametrize("scheme", ROUNDING_LAYER_SCHEMES)
def test_the_gemm2_store_really_rounds(scheme):
    """GEMM2's exact output (the torch layer's trace) differs from its bf16 rounding in most elements, and from
    round-toward-zero in a good share: the store is a rounding, and its rounding mode shows."""
    lay = _layer(scheme)
    tr = {}
    assert _differences(lay, torch_layer(lay, gemm2_store="rne", trace=tr)) == 0
    y = torch.cat(tr["y"])
    y = y[y != 0]
    assert float((bf16(y) != y).float().mean()) > 0.6
    assert float((bf16(y, "rz") != bf16(y)).float().mean()) > 0.3


FAULTS = {
    "RZ GEMM2 store": dict(gemm2_store="rz"),
    "GEMM2 store skipped (FP32 into the top-k sum)": dict(gemm2_store=False),
    "bf16 accumulation of 128-column K blocks, GEMM1": dict(gemm1="bf16_acc_blocks"),
    "bf16 accumulation of 128-column K blocks, GEMM2": dict(gemm2="bf16_acc_blocks"),
    "bf16 accumulation of 128-column K blocks, both GEMMs": dict(gemm1="bf16_acc_blocks", gemm2="bf16_acc_blocks"),
    "bf16 accumulator GEMM2, per 16-column tile": dict(gemm2="bf16_acc_tiles"),
    "RZ GEMM1 store": dict(gemm1_store="rz"),
    "RZ output store": dict(out_store="rz"),
}


@pytest.mark.parametrize("scheme", ["fp8_1x128", "fp8_per_token", "bf16"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_is_caught(scheme, fault):
    lay = _layer(scheme)
    kw = dict(gemm2_store="rne")
    kw.update(FAULTS[fault])
    assert _differences(lay, torch_layer(lay, **kw)) > 0


def test_a_layer_without_the_store_does_not_see_an_rz_gemm2_store_that_this_one_sees():
    """The contrast: single_rounding_layer without a GEMM2 store excludes the store from its arithmetic (a kernel
    that makes one differs by design), so it cannot tell an RNE GEMM2 store from an RZ one: both differ from it.
    With the declared store the RNE kernel is equal and the RZ one is not."""
    plain = single_rounding_layer(24, 256, 256, 8, 4, scheme="fp8_1x128", seed=4)
    assert _differences(plain, torch_layer(plain, gemm2_store="rne")) > 0
    assert _differences(plain, torch_layer(plain, gemm2_store="rz")) > 0
    lay = _layer("fp8_1x128")
    assert _differences(lay, torch_layer(lay, gemm2_store="rne")) == 0
    assert _differences(lay, torch_layer(lay, gemm2_store="rz")) > 0


def test_regime_check_with_the_declared_store():
    lay = _layer("fp8_1x128")
    for ar in ("hopper_fp8", "fp32", "fp8_unpromoted"):
        assert layer_in_exact_regime(lay, ar).ok and layer_in_exact_regime(lay, ar, from_values=True).ok
    ok, why = layer_in_exact_regime(lay, "bf16_accumulator", from_values=True)
    assert not ok and any("bf16 accumulator" in r for r in why)


# which profiles admit one: stated from each profile's declared arithmetic (docs/test-your-kernel.md's table)
ADMITTED = {  # profile: (admits a bf16 layer, admits an FP8 layer)
    "BF16_OUTPUT": (True, True),  # bf16 GEMM, activation and output stores, FP32 top-k sum
    "DEEPGEMM_FP8": (False, True),  # no declared activation store: an FP8 layer's activation is exact in bf16
    "CUBLAS_FP8_FAST_ACCUM": (False, True),  # 14-bit accumulator over all K: the layer's sums fit 14 bits
    "BF16_OUTPUT_FP32_ACT": (False, True),
    "TORCH_EAGER_BF16": (False, False),  # top-k sum in bf16
    "VLLM_MOE_SUM_BF16": (False, False),  # moe_sum in bf16
    "FP32_ACCUM": (False, False),  # no bf16 stores at all
}


@pytest.mark.parametrize("profile", list(ADMITTED))
def test_single_rounding_stores_follow_the_declared_profile(profile):
    for scheme, admitted in zip(("bf16", "fp8_1x128"), ADMITTED[profile]):
        opts, why = single_rounding_stores(profile, scheme)
        if admitted:
            assert opts == {"gemm2_store": "bfloat16"} and why == ""
        else:
            assert opts is None and profile in why


def test_bad_gemm2_store():
    with pytest.raises(ValueError, match="gemm2_store"):
        single_rounding_layer(2, 256, 256, 2, 1, gemm2_store="float16")
    with pytest.raises(ValueError, match="scheme"):
        single_rounding_stores("BF16_OUTPUT", "mxfp4_w4a16")
    assert np.isfinite(single_rounding_layer(2, 256, 256, 2, 1, gemm2_store="bfloat16").reference().output).all()


@pytest.mark.parametrize("scheme", ["fp8_1x128", "bf16"])
def test_a_weighted_gemm2_store_gives_the_same_bits(scheme):
    """vLLM's epilogue multiplies by the top-k weight before the store (``gemm2_weighted_store``): with power-of-two
    weights ``rnd(w y) = w rnd(y)``. Recomputed with moeref.compare.subtle_faults.finalize_in (GEMM2's epilogue and
    an FP32 top-k sum written as a kernel does) from the same layer traced without the store."""
    from moeref.compare.subtle_faults import finalize_in

    kw = dict(scheme=scheme, seed=5)
    plain = single_rounding_layer(24, 256, 256, 8, 4, **kw).reference()
    want = single_rounding_layer(24, 256, 256, 8, 4, gemm2_store="bfloat16", **kw).reference().out.astype(np.float64)
    for before in (False, True):
        for reverse in (False, True):
            got = finalize_in(plain, weight_before_store=before, reverse=reverse)
            assert np.array_equal(got, want), (before, reverse)
    assert not np.array_equal(finalize_in(plain, gemm_out_rounding="zero"), want)


def test_the_device_engine_replays_the_gemm2_store():
    """run_moe on a torch device (the CPU under TRITON_INTERPRET) makes the declared GEMM2 store as the NumPy engine
    does: the same output bits, and other bits than the same layer without the store."""
    from moeref.moe import run_moe

    lay = single_rounding_layer(6, 256, 256, 4, 2, scheme="fp8_1x128", seed=2, gemm2_store="bfloat16")
    host = lay.reference().out
    dev = run_moe(lay.hidden, lay.weights, lay.topk_weights, lay.topk_ids, lay.config, device="cpu")
    assert np.array_equal(np.asarray(dev.out.float().numpy()), host.astype(np.float32))
    plain = lay.reference(gemm2_out_dtype=None).out
    assert not np.array_equal(plain, host)


def test_layer_bound_refuses_a_run_with_a_gemm2_store():
    """The bounds do not model a GEMM2 store: ``layer_bound`` (and so ``compare``) refuses such a run instead of
    bounding a layer without it; the same layer without the store is bounded."""
    from dataclasses import replace

    from moeref.compare import layer_bound
    from moeref.moe import run_moe

    lay = single_rounding_layer(2, 256, 256, 2, 1, gemm2_store="bfloat16")
    run = lay.reference()
    with pytest.raises(ValueError, match="gemm2_out_dtype='bfloat16'"):
        layer_bound(run, "BF16_OUTPUT")
    cfg = replace(lay.config, gemm2_out_dtype=None)
    plain = run_moe(lay.hidden, lay.weights, lay.topk_weights, lay.topk_ids, cfg)
    assert np.isfinite(np.asarray(layer_bound(plain, "BF16_OUTPUT").bound, np.float64)).all()
