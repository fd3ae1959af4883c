"""The ``moeref`` command at 80 columns and in a pipe: every command prints through one console,
tables that do not fit 80 columns switch to layouts made for 80 columns (nothing cut, no header
truncated, verdicts in words), piped output is full width, and every command has ``--json``."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rich")

from rich.console import Console  # noqa: E402

from moeref.cli import build_parser, main  # noqa: E402
from moeref.explain import explain, explain_steps, scheme_presets  # noqa: E402
from moeref.format_tables import format_detail, formats_overview, parameter_rows, walk_value  # noqa: E402
from moeref.formats import FORMATS  # noqa: E402
from moeref.quant import SCHEMES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CUT = "…"  # what rich puts where a cell or a header did not fit


def _at(renderable, width: int = 80) -> str:
    """``renderable`` as an 80-column terminal shows it (plain text, no colour)."""
    con = Console(file=io.StringIO(), width=width, color_system=None, record=True)
    con.print(renderable)
    return con.export_text()


def _run(*args: str, columns: int | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """``python -m moeref ARGS`` in a child process, stdout a pipe; ``COLUMNS`` as given."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    r = subprocess.run([sys.executable, "-m", "moeref", *args], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _fits(text: str, width: int = 80) -> None:
    assert CUT not in text, "a cell or a header was cut"
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width


def _subcommands() -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(sub.choices)


# ---- explain ------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_explain_at_80_columns_cuts_nothing(scheme):
    """Every scheme, alone and with two presets side by side, on the hand-picked and a random
    example: nothing cut and every number of the walk printed whole."""
    fits = scheme_presets(scheme)
    for presets in [None] + ([list(fits[:2])] if len(fits) > 1 else []):
        for seed in (0, 1):
            text = _at(explain(scheme, presets=presets, seed=seed))
            _fits(text)
            steps = explain_steps(scheme, presets=presets, seed=seed)
            words = set(text.split())
            for run in steps["runs"]:
                for b in run["blocks"]:
                    assert {b["scale code"], b["scale"], b["decode multiplier"]} <= words
                for e in run["elements"]:
                    assert {e["x"], e["code"], e["dequantized"], e["error"]} <= words, (scheme, e)


def test_explain_side_by_side_stacks_one_table_per_preset_at_80_columns():
    text = _at(explain("nvfp4", presets=["nvfp4_te", "nvfp4_flashinfer"]))
    assert "Step 3 (A) nvfp4_te" in text and "Step 3 (B) nvfp4_flashinfer" in text
    assert re.search(r"^\(0, 1\)\s+1\.125\s+A\s+0x6b\s+88\s", text, re.M)  # Step 2: block, amax, A
    assert re.search(r"^\s+B\s+0x6a\s+80\s", text, re.M)                  # ... then B under it
    wide = _at(explain("nvfp4", presets=["nvfp4_te", "nvfp4_flashinfer"]), width=200)
    assert "scale code (A)" in wide and "Step 3 (A)" not in wide  # room enough: side by side


def test_explain_command_at_80_columns_and_piped():
    narrow = _run("explain", "nvfp4", "--preset", "nvfp4_te", "--preset", "nvfp4_flashinfer",
                  columns=80, check=True).stdout
    _fits(narrow)
    piped = _run("explain", "nvfp4", "--preset", "nvfp4_te", "--preset", "nvfp4_flashinfer",
                 check=True).stdout
    assert CUT not in piped and "x/(s*g) (A)" in piped  # full width: the side-by-side table
    assert max(len(line) for line in piped.splitlines()) > 80


# ---- formats ------------------------------------------------------------------------------------

def test_formats_at_80_columns_keeps_rows_on_one_line_and_bit_patterns_whole():
    text = _at(formats_overview())
    _fits(text)
    lines = text.splitlines()
    for r in parameter_rows():  # each format's numbers on one line, its specials on one line
        assert any(re.match(rf"\W*{r['name']}\W.*{re.escape(r['max'])}", ln) for ln in lines)
        assert any(r["specials"] in ln for ln in lines), r["specials"]
    for name in FORMATS:
        _fits(_at(format_detail(name)))
    for x, fmt in ((0.3, "e4m3fn"), (1.75, "e2m1"), (1e9, "e4m3fn"), (float("nan"), "e5m2")):
        _fits(_at(walk_value(x, fmt)))


def test_formats_command_at_80_columns_and_piped():
    _fits(_run("formats", columns=80, check=True).stdout)
    piped = _run("formats", check=True).stdout
    assert "Special values" not in piped  # full width: the one wide table


# ---- demo ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    from moeref.demo import demo_data

    said = []
    return demo_data(seed=0, progress=said.append), said


def test_demo_reports_progress_and_verdicts_in_words(demo):
    from moeref.demo import FAULT_CHECKS, VERDICTS

    data, said = demo
    assert len(said) >= 3 and all(isinstance(s, str) and s for s in said)
    assert data["passed"] and data["honest"].passed and not data["broken"].passed
    for f in data["faults"]:
        assert f["bounds FP32_ACCUM"] == "caught"
        assert {f[k] for k, _, _ in FAULT_CHECKS} <= set(VERDICTS)
    assert any(f["vLLM atol=2e-2"] == "MISSED" for f in data["faults"])  # the tolerance misses some


def test_demo_tables_and_reports_at_80_columns(demo):
    from moeref.demo import FAULT_CHECKS, fault_table

    data, _ = demo
    text = _at(fault_table(data["faults"]))
    _fits(text)
    for _, _, header in FAULT_CHECKS:  # every header word printed whole
        assert set(header.split()) <= set(text.split()), header
    for f in data["faults"]:
        assert set(f["fault"].split()) <= set(text.split())
    for report in (data["honest"], data["broken"]):
        _fits(_at(report))


def test_demo_on_an_80_column_terminal_shows_a_spinner_and_cuts_nothing():
    from moeref.demo import run_demo

    out = io.StringIO()
    con = Console(file=out, width=80, force_terminal=True, color_system=None)
    assert run_demo(con, seed=0) == 0
    text = out.getvalue()
    assert "planted faults" in text and CUT not in text
    assert "checking" in text  # the status line shown while the layer runs


def test_demo_command_at_80_columns_reads_without_colour():
    r = _run("demo", columns=80)
    assert r.returncode == 0, r.stderr
    _fits(r.stdout)
    assert "\x1b[" not in r.stdout  # a pipe gets no colour codes ...
    assert "in red" not in r.stdout  # ... and the legend does not rely on them
    assert "caught:" in r.stdout and "MISSED:" in r.stdout and "within:" in r.stdout


def test_demo_json():
    r = _run("demo", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert data["passed"] is True and data["honest"]["passed"] is True
    assert data["broken"]["passed"] is False and len(data["faults"]) >= 5
    assert data["formats"] == json.loads(json.dumps(parameter_rows()))


# ---- check / replay / convert: the one console ----------------------------------------------------

def test_every_command_prints_through_the_one_console():
    """No module of the command line builds its own ``Console`` (the plain ``Console()`` of the
    comparison commands and of convert cut piped output to 80 columns)."""
    made = []
    for path in (ROOT / "moeref").rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bConsole\(", line):
                made.append(f"{path.relative_to(ROOT)}:{i}")
    # only explain_text's recording console (a string at a given width); the factory,
    # moeref/_console.py, subclasses Console as _CommandConsole
    assert {m.split(":")[0] for m in made} == {"moeref/explain.py"}, made


def test_comparison_report_piped_is_full_width():
    """``moeref check``/``replay`` print their report with ``_print``: in a pipe, a table wider
    than 80 columns comes out whole."""
    code = ("from rich.table import Table\n"
            "from moeref.testing.commands import _print\n"
            "t = Table(); t.add_column('c' * 150); t.add_row('v' * 150); _print(t)\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "c" * 150 in r.stdout and "v" * 150 in r.stdout and CUT not in r.stdout


def test_console_width_rules(monkeypatch):
    from rich.table import Table

    from moeref._console import console

    t = Table()
    t.add_column("h" * 120)
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    console(file=out).print(t)  # not a terminal, no COLUMNS: as wide as it needs
    assert "h" * 120 in out.getvalue()
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    console(file=out).print(t)  # COLUMNS fixes the width
    assert max(len(line) for line in out.getvalue().splitlines()) == 80


def test_convert_piped_at_80_columns_json_and_errors(tmp_path):
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "tests"))
    import checkpoint_fixtures as F

    src = str(tmp_path / "src")
    F.BUILDERS["deepseek-fp8"](src, np.random.default_rng(0))
    piped = _run("convert", src, str(tmp_path / "a"), "--to", "modelopt-nvfp4", "--engine", "numpy")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.splitlines()[0].strip(), "a blank line before the first output"
    assert "model.layers.0.mlp.experts.0.down_proj" in piped.stdout and CUT not in piped.stdout
    narrow = _run("convert", src, str(tmp_path / "b"), "--to", "modelopt-nvfp4", "--engine",
                  "numpy", columns=80)
    assert narrow.returncode == 0, narrow.stderr
    _fits(narrow.stdout)
    lines = narrow.stdout.splitlines()
    body = lines[[i for i, ln in enumerate(lines) if ln.startswith("─")][0] + 1:]
    body = body[:[i for i, ln in enumerate(body) if ln.startswith("warning")][0]]
    names = "".join(ln.split()[0] for ln in body if ln.strip())  # the module column, wrapped
    assert names == ("model.layers.0.mlp.experts.0.down_proj"
                     "model.layers.0.mlp.experts.1.down_proj")
    js = _run("convert", src, str(tmp_path / "c"), "--to", "modelopt-nvfp4", "--engine", "numpy",
              "--json")
    assert js.returncode == 0, js.stderr
    rep = json.loads(js.stdout)
    assert rep["target_layout"] == "modelopt-nvfp4" and rep["modules_converted"] == 2
    err = _run("convert", src, str(tmp_path / "c"), "--to", "modelopt-nvfp4")  # exists
    assert err.returncode == 2 and err.stdout == ""
    assert err.stderr.startswith("moeref convert: destination")


# ---- options ------------------------------------------------------------------------------------

def test_every_command_has_json_and_every_option_says_what_it_does():
    commands = _subcommands()
    assert {"formats", "explain", "demo", "convert", "check", "replay", "mutate"} <= set(commands)
    for name, p in commands.items():
        opts = {s for a in p._actions for s in a.option_strings}
        assert "--json" in opts, name
        for a in p._actions:
            assert a.help and a.help.strip(), (name, a.option_strings or a.dest)


def test_convert_help_lists_the_layouts_once(capsys):
    from moeref.checkpoint import LAYOUTS

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in LAYOUTS:
        assert len(re.findall(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)) == 1, name


def test_cli_docs_name_every_command():
    import moeref.cli

    page = (ROOT / "docs" / "api" / "cli.md").read_text()
    for name in _subcommands():
        assert f"`{name}" in page, name
        assert f"``{name}``" in moeref.cli.__doc__, name


@pytest.mark.parametrize("argv", [["explain", "nvfp4", "--seed", "-1"], ["demo", "--seed", "-1"],
                                  ["mutate", "x:y", "--seed", "-1"], ["explain", "nvfp4", "--seed", "x"]])
def test_a_bad_seed_names_the_flag(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "argument --seed: expected a non-negative integer" in capsys.readouterr().err


# ---- presets ------------------------------------------------------------------------------------

def test_a_preset_of_another_scheme_lists_the_presets_of_this_one(capsys):
    assert main(["explain", "mxfp4", "--preset", "te"]) == 2
    err = capsys.readouterr().err
    assert "preset 'te' does not fit scheme 'mxfp4'" in err
    assert err.strip().endswith(", ".join(scheme_presets("mxfp4")))
    assert "nvfp4" not in err and "gptq" not in err


def test_nvfp4_presets_one_naming_scheme_a_default_and_deprecated_aliases(capsys):
    assert main(["explain", "--list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)["schemes"]
    for scheme in ("nvfp4", "nvfp4_weight"):
        assert listing[scheme][0] == "default"
        assert all(p == "default" or p.startswith("nvfp4_") for p in listing[scheme])
    assert main(["explain", "nvfp4", "--preset", "default", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["preset"] == "nvfp4_te"
    assert main(["explain", "nvfp4", "--preset", "te", "--preset", "flashinfer", "--json"]) == 0
    out = capsys.readouterr()
    assert [r["preset"] for r in json.loads(out.out)["runs"]] == ["nvfp4_te", "nvfp4_flashinfer"]
    assert "'te' is deprecated; use 'nvfp4_te'" in out.err
    assert "'flashinfer' is deprecated; use 'nvfp4_flashinfer'" in out.err
