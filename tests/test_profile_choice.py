"""One rule for choosing a profile: the decision table from a kernel's arithmetic
(:data:`moeref.compare.DECISION_TABLE`), and every default of the package going through it."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from moeref.compare import DECISION_TABLE, PROFILES, Arithmetic, profile_for, suggest_profile
from moeref.compare.kernel_profiles import _ARITHMETIC_VALUES, ALIASES, _row_matches

pytest_plugins = ["pytester"]

DOC = Path(__file__).resolve().parents[1] / "docs" / "test-your-kernel.md"


def test_no_two_rows_match_one_arithmetic_and_every_row_is_reached():
    reached = set()
    for combo in itertools.product(*_ARITHMETIC_VALUES.values()):
        arith = Arithmetic(**dict(zip(_ARITHMETIC_VALUES, combo)))
        rows = [name for fields, name, _ in DECISION_TABLE if _row_matches(fields, arith)]
        assert len(rows) <= 1, (arith, rows)
        reached.update(rows)
    assert reached == {name for _, name, _ in DECISION_TABLE}


def test_each_row_names_a_registered_profile_whose_fields_state_that_arithmetic():
    """The row's arithmetic, read off the profile's own fields (the stores it replays, where the bias goes)."""
    assert len({name for _, name, _ in DECISION_TABLE}) == len(DECISION_TABLE)
    for fields, name, _ in DECISION_TABLE:
        p = PROFILES[name]
        want = dict(vars(Arithmetic()), **fields)
        assert p.bias_add == want["bias"], name
        assert (p.gemm_out_dtype == "bfloat16") == (want["gemm_out"] == "bf16"), name
        assert (p.out_dtype == "bfloat16") == (want["output"] == "bf16"), name
        assert (p.reduce_unit == 2.0**-8) == (want["topk_sum"] == "bf16"), name
        assert (p.accum_unit == 2.0**-13) == want["accumulator"].startswith(("fp8", "deepgemm", "triton")), name
        assert (p.promote_every is None) == (want["accumulator"] in ("fp32", "fp8_unpromoted")), name
    for alias, row in ALIASES.items():
        assert alias in PROFILES and row in PROFILES and alias not in {n for _, n, _ in DECISION_TABLE}


def test_profile_for_names_what_has_no_profile():
    assert profile_for(Arithmetic(), bias="after_store") is PROFILES["BF16_OUTPUT_BIAS_AFTER_STORE"]
    assert profile_for(accumulator="fp8_promoted", activation="fp32").name == "DEEPGEMM_FP8"
    with pytest.raises(ValueError, match="no profile declares Arithmetic.*topk_sum='bf16'.*dataclasses.replace"):
        profile_for(topk_sum="bf16")  # bf16 top-k sum with a once-rounded activation: not declared
    with pytest.raises(ValueError, match="bias must be one of epilogue, after_store, accumulator_init; got 'late'"):
        profile_for(bias="late")


def _doc_table():
    """The rows of the decision table on docs/test-your-kernel.md: (cells, profile name)."""
    text = DOC.read_text()
    start = text.index("| accumulator |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells, re.search(r"`([A-Z0-9_]+)`", cells[7]).group(1)))
    return rows


_DOC_WORDS = {"FP32": "fp32", "bf16": "bf16", "FP32 or bf16": ("fp32", "bf16"), "bf16 or FP32": ("bf16", "fp32")}


def test_the_docs_page_prints_the_decision_table():
    """docs/test-your-kernel.md leads with the table, row for row the code's, each profile once."""
    text = DOC.read_text()
    assert text.index("| accumulator |") < text.index("## A bf16 fused MoE")
    doc = _doc_table()
    assert [name for _, name in doc] == [name for _, name, _ in DECISION_TABLE]
    for (cells, name), (fields, _, kernels) in zip(doc, DECISION_TABLE):
        want = dict(vars(Arithmetic()), **fields)
        assert _ACCUMULATOR_WORDS[want["accumulator"]] in cells[0], name
        for i, f in ((1, "gemm_out"), (3, "router_weight"), (4, "bias"), (5, "topk_sum")):
            assert cells[i] == _CELL[f][want[f]], (name, f, cells[i])
        assert cells[2] == _CELL["activation"][want["activation"]], (name, cells[2])
        assert cells[6] == _CELL["output"][want["output"]], name
        assert cells[8] == kernels, name


_ACCUMULATOR_WORDS = {"fp32": "FP32", "fp8_promoted": "promoted to FP32 every 128 K",
                      "fp8_unpromoted": "never promoted", "deepgemm_emulated": "DeepGEMM",
                      "triton_fp8_emulated": "Triton"}
_CELL = {
    "gemm_out": {"bf16": "bf16", "fp32": "FP32"},
    "activation": {"bf16": "bf16", "bf16_twice": "bf16 twice", "fp32": "FP32", ("bf16", "fp32"): "bf16 or FP32"},
    "router_weight": {"finalize": "top-k sum", "gemm2_epilogue": "GEMM2 epilogue"},
    "bias": {"epilogue": "epilogue", "after_store": "after the store", "accumulator_init": "accumulator init"},
    "topk_sum": {"fp32": "FP32", "bf16": "bf16"},
    "output": {"bf16": "bf16", "fp32": "FP32"},
}


# ---------------------------------------------------------------------------------- every default, one rule


def test_every_entry_point_defaults_through_suggest_profile(monkeypatch):
    """`moeref check` without --profile, `moeref mutate` / mutation_score without a profile, and the
    pytest plugin's moe_profile all give suggest_profile's choice: the table's row for a bf16 kernel."""
    from moeref.testing import draw_cases, mutation_score
    from moeref.testing import asserts

    default = suggest_profile("bfloat16", "bfloat16")
    assert default is profile_for() is PROFILES["BF16_OUTPUT"]
    seen = []
    real = asserts.assert_moe_close
    monkeypatch.setattr(asserts, "assert_moe_close", lambda out, case, profile, **kw: seen.append(profile)
                        or real(out, case, profile, **kw))
    ki = draw_cases(1)[0]
    mutation_score(lambda k: k.reference().out, [ki])
    assert seen and all(p is default for p in seen)


def test_cli_check_and_mutate_default_to_the_same_profile(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    import json

    from safetensors.torch import save_file

    from moeref.cli import main
    from moeref.testing import draw_cases

    ki = draw_cases(1)[0]
    save_file({k: v.contiguous() for k, v in ki.torch().items()}, str(tmp_path / "in.safetensors"))
    save_file({"out": torch.from_numpy(ki.reference().out.astype("float32")).bfloat16()}, str(tmp_path / "o.safetensors"))
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "o.safetensors"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] == suggest_profile("bfloat16").name
    (tmp_path / "refkernel.py").write_text("def run(ki):\n    return ki.reference().out\n")
    monkeypatch.chdir(tmp_path)
    seen = []
    from moeref.testing import mutation

    real = mutation.mutation_score
    monkeypatch.setattr(mutation, "mutation_score", lambda *a, **kw: seen.append(kw.get("profile")) or real(*a, **kw))
    assert main(["mutate", "refkernel:run", "--cases", "1", "--json"]) == 0
    assert seen == [None]  # the CLI passes no profile: mutation_score's default, suggest_profile
    capsys.readouterr()


def test_plugin_default_is_suggest_profile_of_the_case(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_d="""
from moeref.compare import suggest_profile

def test_case_default(moe_case, moe_profile):
    assert moe_profile is suggest_profile(moe_case.dtype)
    assert moe_profile.name == "BF16_OUTPUT"

def test_no_case_default(moe_profile):
    assert moe_profile is suggest_profile("bfloat16")
""")
    pytester.runpytest("-p", "moeref.testing.plugin", "--moeref-cases", "2").assert_outcomes(passed=3)
