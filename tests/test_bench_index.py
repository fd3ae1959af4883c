"""bench/: one entry point (``python -m bench``) lists and resolves every maintained script; the one-off
studies are in bench/studies/ with an index that names each of them and data that exists."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BENCH = os.path.join(ROOT, "bench")


def _entry():
    import importlib

    return importlib.import_module("bench.__main__")


def _scripts(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith((".py", ".sh")) and f != "__main__.py")


def test_every_script_of_bench_is_an_entry_or_a_helper():
    entry = _entry()
    named = {script for script, _, _ in entry.BENCHMARKS.values()} | set(entry.HELPERS)
    assert set(_scripts(BENCH)) == named, "bench/__main__.py's BENCHMARKS and HELPERS list bench/ exactly"


def test_every_name_resolves_to_an_existing_script():
    entry = _entry()
    for name, (script, what, machine) in entry.BENCHMARKS.items():
        path = entry.resolve(name)
        assert os.path.isfile(path) and os.path.basename(path) == script, name
        assert entry.resolve(os.path.splitext(script)[0]) == path  # the script's own name works too
        assert what and machine in ("CPU", "GPU", "CPU/GPU", "any"), name
    with pytest.raises(ValueError, match="unknown benchmark 'no_such'"):
        entry.resolve("no_such")


def test_python_m_bench_lists_every_name():
    out = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert listed == set(_entry().BENCHMARKS)


def test_python_m_bench_runs_a_script_with_its_arguments(tmp_path):
    """A report script through the entry point: --check on the committed JSON passes, a changed page fails."""
    page = tmp_path / "convert.md"
    with open(os.path.join(ROOT, "docs", "convert.md")) as f:
        text = f.read()
    page.write_text(text)
    js = sorted(p for p in os.listdir(os.path.join(ROOT, "docs", "data")) if p.startswith("convert_gpu_"))
    args = [sys.executable, "-m", "bench", "report-convert", os.path.join("docs", "data", js[0]),
            "--docs", str(page), "--check"]
    assert subprocess.run(args, cwd=ROOT, capture_output=True).returncode == 0
    page.write_text(text.replace("<!-- convert-gpu:end -->", "changed\n<!-- convert-gpu:end -->"))
    assert subprocess.run(args, cwd=ROOT, capture_output=True).returncode == 1
    bad = subprocess.run([sys.executable, "-m", "bench", "no_such"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


def test_bench_readme_names_every_entry():
    with open(os.path.join(BENCH, "README.md")) as f:
        readme = f.read()
    missing = [n for n in _entry().BENCHMARKS if f"`{n}`" not in readme]
    assert not missing, f"bench/README.md does not name {missing}"


def test_studies_index_names_every_study_and_its_data_exists():
    studies = os.path.join(BENCH, "studies")
    with open(os.path.join(studies, "README.md")) as f:
        index = f.read()
    rows = {m.group(1) for m in re.finditer(r"^\| `([\w.]+\.py)` \|", index, re.M)}
    assert rows == set(_scripts(studies)), "bench/studies/README.md has one row per script"
    for name in re.findall(r"`([\w.-]+\.json)`", index):
        if "*" in name or name.startswith("..."):
            continue
        assert os.path.isfile(os.path.join(ROOT, "docs", "data", name)), name
