"""moeref.testing.regime: the mix of exact-regime cases (equality) and general cases (the profile's bound) that
the pytest plugin and ``moeref check`` use by default."""
from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch

from kernels_for_tests import eager_bf16_moe, fp32_sum_bf16_moe
from moeref.regimes import exact_layer, exact_topk_weights, layer_in_exact_regime, single_rounding_layer
from moeref.testing import MoEMismatch, draw_cases
from moeref.testing.cases import _routing
from moeref.testing.regime import CheckMix, case_regime, check_case, equality_applies, single_rounding_applies


def test_check_mix_is_typed_and_splits_evenly():
    assert CheckMix().regime == "mixed"
    assert CheckMix().kinds(4) == ["bounds", "exact", "bounds", "single_rounding"]
    kinds = CheckMix().kinds(16)  # a quarter exact, a quarter single-rounding, half general
    assert (kinds.count("exact"), kinds.count("single_rounding"), kinds.count("bounds")) == (4, 4, 8)
    assert CheckMix("mixed", 0.5, 0.0).kinds(4) == ["bounds", "exact", "bounds", "exact"]  # no single-rounding
    assert CheckMix("mixed", 0.25, 0.0).kinds(8).count("exact") == 2
    assert CheckMix().kinds(1) == ["bounds"]  # one case: the sound bound on general data
    assert CheckMix("mixed", 0.99, 0.0).kinds(2) == ["bounds", "exact"]  # each kind at least once
    assert CheckMix("mixed", 0.01, 0.9).kinds(3).count("exact") == 1  # an exact-regime case in every mix
    with pytest.raises(ValueError, match="regime.*mixed"):
        CheckMix("both")
    with pytest.raises(ValueError, match="exact_fraction"):
        CheckMix("mixed", 1.0)
    with pytest.raises(ValueError, match="single_rounding_fraction"):
        CheckMix("mixed", 0.25, -0.1)
    with pytest.raises(ValueError, match="below 1"):
        CheckMix("mixed", 0.5, 0.5)
    with pytest.raises(TypeError, match="CheckMix or a regime name"):
        CheckMix.of(3)


def test_mixed_draws_keep_sizes_and_kinds_and_build_exact_cases_in_the_regime():
    general, mixed = draw_cases(6), draw_cases(6, mix="mixed")
    for g, m in zip(general, mixed):
        for key in ("num_tokens", "hidden", "intermediate", "num_experts", "top_k", "routing", "seed"):
            assert g.meta[key] == m.meta[key]
    assert [case_regime(c) for c in mixed] == CheckMix().kinds(6)
    for c in mixed:
        if case_regime(c) == "single_rounding":  # rebuilt here too: BF16_OUTPUT's stores, GEMM2's included
            meta = c.meta
            rng = np.random.default_rng([meta["seed"], 11])
            _, ids = _routing(meta["routing"], meta["num_tokens"], meta["num_experts"], meta["top_k"], rng, False)
            lay = single_rounding_layer(meta["num_tokens"], meta["hidden"], meta["intermediate"],
                                        meta["num_experts"], meta["top_k"], scheme="bf16", seed=rng, topk_ids=ids,
                                        topk_weights=exact_topk_weights(ids.shape, seed=rng),
                                        gemm2_store="bfloat16")
            assert np.array_equal(lay.hidden.astype(np.float32), c.hidden.astype(np.float32))
            assert meta["stores"] == {"gemm1_out_dtype": "bfloat16", "act_out_dtype": "bfloat16",
                                      "gemm2_out_dtype": "bfloat16"}
            assert layer_in_exact_regime(lay, "fp32").ok
        if case_regime(c) != "exact":
            continue
        # rebuilt here from the same draw: the layer is in the regime of an FP32-accumulating kernel
        meta = c.meta
        rng = np.random.default_rng([meta["seed"], 7])
        _, ids = _routing(meta["routing"], meta["num_tokens"], meta["num_experts"], meta["top_k"], rng, False)
        lay = exact_layer(meta["num_tokens"], meta["hidden"], meta["intermediate"], meta["num_experts"],
                          meta["top_k"], scheme="bf16", seed=rng, topk_ids=ids,
                          topk_weights=exact_topk_weights(ids.shape, seed=rng))
        assert np.array_equal(lay.hidden.astype(np.float32), c.hidden.astype(np.float32))
        assert layer_in_exact_regime(lay, "fp32").ok
        assert set(np.unique(c.topk_weights)) <= {0.125, 0.25, 0.5, 1.0}


def test_check_case_uses_equality_on_exact_cases_where_the_profile_allows():
    cases = draw_cases(4, mix="exact", max_tokens=40)
    for c in cases:
        out = fp32_sum_bf16_moe(**c.torch())
        assert type(check_case(out, c, "BF16_OUTPUT")).__name__ == "EqualityReport"
        bad = out.clone()
        bad.view(torch.int16)[0, 0] ^= 1
        with pytest.raises(MoEMismatch, match="exact regime"):
            check_case(bad, c, "BF16_OUTPUT")
    # a bf16 top-k sum is outside the regime's arithmetic: the bound of its profile, which it passes
    assert not equality_applies("TORCH_EAGER_BF16")[0] and equality_applies("DEEPGEMM_FP8")[0]
    for c in cases:
        assert check_case(eager_bf16_moe(**c.torch()), c, "TORCH_EAGER_BF16").passed


def test_single_rounding_cases_see_what_exact_cases_cannot():
    """An RZ GEMM2 store and bf16 K-block accumulation give an exact-regime case's bits (exact values, small
    integer sums) but not a single-rounding case's; the honest BF16_OUTPUT kernel gives both by equality."""
    cases = draw_cases(4, mix="mixed", max_tokens=60)
    assert [case_regime(c) for c in cases] == ["bounds", "exact", "bounds", "single_rounding"]
    exact, single = cases[1], cases[3]
    for c in (exact, single):
        assert type(check_case(fp32_sum_bf16_moe(**c.torch()), c, "BF16_OUTPUT")).__name__ == "EqualityReport"
    for bug in ("rz_gemm2_store", "bf16_k_blocks"):
        check_case(fp32_sum_bf16_moe(**exact.torch(), bug=bug), exact, "BF16_OUTPUT")  # passes: exact sums
        with pytest.raises(MoEMismatch, match="exact regime"):
            check_case(fp32_sum_bf16_moe(**single.torch(), bug=bug), single, "BF16_OUTPUT")


def test_a_profile_that_admits_no_single_rounding_layer_draws_none_and_says_so():
    cases = draw_cases(4, mix="mixed", max_tokens=40, profile="TORCH_EAGER_BF16")
    assert [case_regime(c) for c in cases] == ["bounds", "exact", "bounds", "exact"]
    assert "TORCH_EAGER_BF16" in cases[3].meta["single_rounding"] and "single_rounding" not in cases[1].meta
    # a single-rounding case checked under such a profile gets the profile's bound, and its label says why
    single = draw_cases(4, mix="mixed", max_tokens=40)[3]
    ok, why = single_rounding_applies("TORCH_EAGER_BF16", single)
    assert not ok and "top-k sum" in why
    report = check_case(eager_bf16_moe(**single.torch()), single, "TORCH_EAGER_BF16")
    assert type(report).__name__ == "Report" and report.passed and "single-rounding case under the bound" in report.label


def test_draw_cases_refuses_a_mix_with_a_strategy():
    from moeref.testing import moe_cases

    with pytest.raises(ValueError, match="strategy"):
        draw_cases(2, moe_cases(max_tokens=4), mix="exact")


def test_moeref_check_regime_option(tmp_path):
    from safetensors.torch import save_file

    from moeref.cli import main

    def run(case, out, regime):
        save_file(case.torch(), os.path.join(tmp_path, "in.safetensors"))
        save_file({"out": out}, os.path.join(tmp_path, "out.safetensors"))
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            status = main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
                           "--regime", regime, "--json"])
        return status, json.loads(printed.getvalue())

    general, exact = draw_cases(2, mix="mixed", max_tokens=30)
    out = fp32_sum_bf16_moe(**exact.torch())
    status, js = run(exact, out, "mixed")  # the default: in the regime, so equality and the bound
    assert status == 0 and js["equality"]["passed"] and js["violations"] == 0
    assert js["regime_choice"].startswith("equality (inputs in the fp32 exact regime)")
    bad = out.clone()
    bad.view(torch.int16)[0, 0] ^= 1
    status, js = run(exact, bad, "mixed")
    assert status == 1 and js["equality"]["num_differences"] == 1 and js["equality"]["differing"][0]["token"] == 0
    status, js = run(general, fp32_sum_bf16_moe(**general.torch()), "mixed")  # general data: the bound only
    assert status == 0 and js["equality"] is None and "not in the fp32 exact regime" in js["regime_choice"]
    status, js = run(exact, bad, "exact")
    assert status == 1 and "violations" not in js


def test_moeref_check_mixed_recognises_single_rounding_inputs(tmp_path):
    """Saved inputs of a single-rounding case (``single_rounding_layer``, BF16_OUTPUT's stores): ``moeref check``
    (``--regime mixed``, the default) checks them by equality against the reference replayed with the profile's
    stores, as the plugin's mix does: a GEMM2 store rounding toward zero (invisible on exact-regime inputs) fails
    it; under a profile that admits no single-rounding layer the same inputs get the bound only."""
    from safetensors.torch import save_file

    from moeref.cli import main

    single = draw_cases(4, mix="mixed", max_tokens=60)[3]
    assert case_regime(single) == "single_rounding"
    save_file(single.torch(), os.path.join(tmp_path, "in.safetensors"))

    def run(out):
        save_file({"out": out}, os.path.join(tmp_path, "out.safetensors"))
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            status = main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
                           "--profile", "BF16_OUTPUT", "--json"])
        return status, json.loads(printed.getvalue())

    status, js = run(fp32_sum_bf16_moe(**single.torch()))
    assert status == 0 and js["equality"]["passed"] and js["violations"] == 0, js["regime_choice"]
    assert js["regime_choice"].startswith("equality against the single-rounding replay")
    assert "gemm2 bfloat16" in js["regime_choice"]
    status, js = run(fp32_sum_bf16_moe(**single.torch(), bug="rz_gemm2_store"))
    assert status == 1 and not js["equality"]["passed"] and js["equality"]["num_differences"] > 0
    # top-k weights that are not powers of two (token 0's first weight 3/8): not single-rounding inputs
    inputs = single.torch()
    inputs["topk_weights"] = inputs["topk_weights"].clone()
    inputs["topk_weights"][0, 0] = 0.375
    save_file(inputs, os.path.join(tmp_path, "in.safetensors"))
    status, js = run(fp32_sum_bf16_moe(**inputs))
    assert js["equality"] is None and "nor in its single-rounding regime" in js["regime_choice"]
    save_file(single.torch(), os.path.join(tmp_path, "in.safetensors"))
    # the same inputs under a profile that admits no single-rounding layer: the bound only, and it says why
    save_file({"out": eager_bf16_moe(**single.torch())}, os.path.join(tmp_path, "out.safetensors"))
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        status = main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
                       "--profile", "TORCH_EAGER_BF16", "--json"])
    js = json.loads(printed.getvalue())
    assert status == 0 and js["equality"] is None and "bound only" in js["regime_choice"]
