"""bench/bench_fault_catch.py on the CPU at small shapes: the planted faults are real (each changes the kernel's
output), the honest variants never alarm under any check, the exact FP8 cases stay in the regime, the
single-rounding cases follow the declared profile's stores and stay in their regime, and the report script renders
the JSON."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")

from bench import bench_fault_catch as bfc  # noqa: E402
from bench import report_fault_catch  # noqa: E402

ISSUE_FAULTS = ["skip_last_k_block", "halved_w2_scale_block", "swapped_topk_weights", "last_bit_noise",
                "gate_up_swapped"]


def test_the_fault_list_is_large_distinct_and_names_its_layers():
    faults = bfc.faults(bfc.SHAPES["small"])
    names = [f.name for f in faults]
    assert len(names) >= 25 and len(set(names)) == len(names)
    assert set(ISSUE_FAULTS + ["tanh_gelu", "ue8m0_rounded_down", "expert_map_last_rank", "padding_rows_leak",
                               "swizzle_partial_tile", "rz_output_store", "bf16_accumulation",
                               "renormalized_weights"]) <= set(names)
    for v in faults + bfc.honest(bfc.SHAPES["small"]):
        assert v.layers and set(v.layers) <= set(bfc.LAYERS), v.name


@pytest.mark.parametrize("layer", ["fp8", "fp8_ue8m0"])
def test_exact_fp8_cases_with_groups_at_their_edges_stay_in_the_regime(layer):
    from moeref.regimes import layer_in_exact_regime

    case = bfc.exact_case(layer, bfc.SHAPES["small"], 0)
    lay = case.meta["exact_layer"]
    assert np.array_equal(lay.hidden, case.hidden)
    assert layer_in_exact_regime(lay, "hopper_fp8").ok
    # the odd token group's maximum is its last column now (exact_layer puts it first)
    row = np.abs(case.hidden[0])
    assert np.argmax(row[128:256]) == 127 and np.argmax(row[:128]) == 0


@pytest.mark.parametrize("layer", list(bfc.LAYERS))
def test_single_rounding_cases_take_the_declared_profiles_stores(layer):
    from moeref.compare import get_profile
    from moeref.regimes import layer_in_exact_regime

    case, note = bfc.single_rounding_case(layer, bfc.SHAPES["small"], 0)
    lay = case.meta["exact_layer"]
    declared = get_profile(bfc.LAYERS[layer]["declared"])
    # DEEPGEMM_FP8 and BF16_OUTPUT both declare bf16 GEMM outputs: GEMM2's store is made, and rounds
    assert declared.gemm_out_dtype == "bfloat16" and lay.config.gemm2_out_dtype == "bfloat16"
    assert "gemm2_store='bfloat16'" in note and lay.excluded_stores == ()
    assert layer_in_exact_regime(lay, "fp32" if lay.scheme == "bf16" else "hopper_fp8").ok
    assert np.array_equal(lay.hidden, case.hidden) and case.options["gemm2_out_dtype"] == "bfloat16"


def test_a_small_cpu_run_catches_the_issue_faults_and_never_alarms_on_honest_variants(tmp_path):
    out = tmp_path / "fault_catch.json"
    res = bfc.main(["--layers", "fp8", "bf16_gelu", "--faults", *ISSUE_FAULTS, "tanh_gelu", "rz_gemm2_store",
                    "bf16_k_block_sum", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == res["summary"]
    assert {"date", "cpu", "torch", "tree", "argv"} <= set(res["meta"])
    assert all("error" not in info for info in res["layers"])
    assert res["layers"][0]["emulated"] == "DEEPGEMM_FP8_EXACT"
    for h in res["honest"]:
        assert "error" not in h and not any(c["caught"] for c in h["checks"].values()), h
    by = {f["name"]: f for f in res["faults"]}
    assert set(by) == set(ISSUE_FAULTS) | {"tanh_gelu", "rz_gemm2_store", "bf16_k_block_sum"}
    for f in res["faults"]:
        assert sum(f["changed"].values()) > 0, f  # a planted fault changes the kernel's output
        ch = f["checks"]
        assert "single_rounding" in ch  # both layers' declared profiles admit a single-rounding case
        assert ch["mixed"]["caught"] == (ch["exact"]["caught"] or ch["single_rounding"]["caught"]
                                         or ch["declared"]["caught"])
    for name in ISSUE_FAULTS + ["tanh_gelu"]:
        assert by[name]["checks"]["exact"]["caught"], name
    for name in ISSUE_FAULTS:  # input faults around the emulated DeepGEMM layer: its exact profile sees them
        assert by[name]["checks"]["emulated"]["caught"], name
    # the GEMM2 store is optional in the exact regime, so exact there, and the exact regime's small integer sums
    # fit a bf16 accumulator; the single-rounding case's declared GEMM2 store rounds, and its sums need 12 bits
    for name in ("rz_gemm2_store", "bf16_k_block_sum"):
        assert by[name]["changed"]["exact"] == 0 and not by[name]["checks"]["exact"]["caught"], name
        assert by[name]["changed"]["single_rounding"] > 0 and by[name]["checks"]["single_rounding"]["caught"], name
    s = res["summary"]
    assert s["mixed"]["faults"] == 8 and s["mixed"]["caught"] == 8 and s["mixed"]["false_alarms"] == 0
    assert s["exact"]["caught"] == 6 and s["single_rounding"]["false_alarms"] == 0

    page = tmp_path / "page.md"
    shutil.copy(report_fault_catch.os.path.join(report_fault_catch.os.path.dirname(report_fault_catch.__file__),
                                                "..", "docs", "error-bounds.md"), page)
    assert report_fault_catch.main([str(out), "--docs", str(page)]) == 0
    text = page.read_text()
    assert "| mixed (the default) |" in text and "8 / 8 (100 %)" in text and "| single-rounding regime only |" in text
    assert report_fault_catch.main([str(out), "--docs", str(page), "--check"]) == 0
