"""The ``moeref`` command as a user meets it: help, version, ``python -m moeref``, JSON output,
presets that do not fit a scheme, and piped output that is not cut to 80 columns."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moeref import __version__
from moeref.cli import main
from moeref.explain import SCHEME_PRESETS, explain_steps, scheme_presets
from moeref.quant import SCHEMES

pytest.importorskip("rich")

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    """``python -m moeref ARGS`` in a child process with stdout a pipe (not a terminal)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # no COLUMNS: the default width applies
    return subprocess.run([sys.executable, "-m", "moeref", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def test_bare_command_prints_help_and_module_entry_point_works():
    r = _run()
    assert r.returncode == 0 and r.stderr == ""
    for word in ("usage: moeref", "formats", "explain", "demo", "--version"):
        assert word in r.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"moeref {__version__}"


def test_explain_help_names_only_options_that_exist(capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    text = capsys.readouterr().out
    assert "--list" in text
    assert main(["explain", "--list"]) == 0          # the option the help mentions exists
    listing = capsys.readouterr().out
    assert all(name in listing for name in SCHEMES)


@pytest.mark.parametrize("scheme,preset", [("int4_group", "nvfp4_te"), ("fp8_per_tensor", "gptq"),
                                           ("mxfp6", "te_mxfp8"), ("fp8_per_token", "ocp")])
def test_preset_that_does_not_fit_is_an_error_naming_those_that_fit(capsys, scheme, preset):
    assert main(["explain", scheme, "--preset", preset]) == 2
    err = capsys.readouterr().err
    assert f"preset {preset!r} does not fit scheme {scheme!r}" in err
    assert ", ".join(SCHEME_PRESETS[scheme]) in err


def test_every_listed_preset_walks():
    for scheme in SCHEME_PRESETS:
        for preset in scheme_presets(scheme):
            run = explain_steps(scheme, presets=[preset])["runs"][0]
            assert run["elements"], (scheme, preset)


def test_unknown_names_still_say_so(capsys):
    assert main(["explain", "mxfp4", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["explain"]) == 2
    assert "moeref explain --list" in capsys.readouterr().err
    assert main(["formats", "e9m9"]) == 2


def test_nvfp4_scaled_column_is_labelled_with_the_global_factor(capsys):
    assert main(["explain", "nvfp4"]) == 0
    out = capsys.readouterr().out
    assert "x / (scale*g)" in out and "| x / scale |" not in out
    assert main(["explain", "mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "x / scale" in out and "scale*g" not in out


def test_deepgemm_scale_format_is_what_the_walk_shows():
    fp32 = explain_steps("fp8_block", presets=["deepgemm"])["runs"][0]
    ue8m0 = explain_steps("fp8_block", presets=["deepgemm"], scale="ue8m0")["runs"][0]
    assert "fp32 scales" in fp32["scheme description"] and fp32["blocks"][0]["scale code"] == "fp32"
    assert "ue8m0 scales" in ue8m0["scheme description"]
    # amax 6 (the hand-picked example): sf = 6/448, ceil_to_ue8m0 -> 2^-6 = code 127 - 6 = 0x79
    assert ue8m0["blocks"][0]["scale code"] == "0x79" and ue8m0["blocks"][0]["scale"] == "0.015625"
    assert "FP32 scales: sf itself" in fp32["description"]
    with pytest.raises(ValueError, match="fixed scale format"):
        explain_steps("mxfp4", scale="fp32")


def test_formats_json(capsys):
    assert main(["formats", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    e4m3 = next(r for r in data["formats"] if r["name"] == "e4m3fn")
    assert e4m3["max"] == "448" and e4m3["bits"] == "8"
    assert main(["formats", "e2m1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # E2M1's 16 codes, from the OCP MX v1.0 table: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    assert [v["value"] for v in data["values"][:8]] == ["0", "0.5", "1", "1.5", "2", "3", "4", "6"]
    assert len(data["values"]) == 16 and data["parameters"]["name"] == "e2m1"
    assert main(["formats", "e4m3fn", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] is None


def test_explain_json(capsys):
    assert main(["explain", "nvfp4", "--preset", "nvfp4_te", "--preset", "nvfp4_flashinfer", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["scheme"] == "nvfp4" and data["shape"] == [1, 32]
    # the UE4M3 tie of the hand-picked example: 84 rounds to 88 (TE) or 80 (FlashInfer)
    assert [r["blocks"][1]["scale code"] for r in data["runs"]] == ["0x6b", "0x6a"]
    assert all(not k.startswith("_") for r in data["runs"] for e in r["elements"] for k in e)
    assert main(["explain", "--list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)["schemes"]
    assert listing["int4_group"] == ["default", "gptq", "vllm_int4"]


def test_piped_output_is_not_cut_to_80_columns():
    r = _run("formats")
    assert r.returncode == 0
    assert "…" not in r.stdout
    # the e5m2 specials text is longer than an 80-column table leaves room for
    assert "Inf = S.11..1.00, NaN = S.11..1.xx (xx != 0), -0" in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) > 80
    r = _run("explain", "nvfp4", "--preset", "nvfp4_te", "--preset", "nvfp4_flashinfer")
    assert r.returncode == 0 and "…" not in r.stdout and "differs" in r.stdout
