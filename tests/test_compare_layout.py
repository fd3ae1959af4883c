"""The layout of :mod:`moeref.compare`: the bounds' definitions (profiles, host bounds, the report) and their
device engine (:mod:`moeref.compare.device`, torch and Triton) in separate places, with imports going one way.

* The definitions never import the device engine, except the one call that bounds a device-engine run
  (:func:`moeref.compare.layer_bound` in ``report.py``, on a device run only).
* No import circle among the modules of ``moeref/compare`` (module level and inside functions alike).
* ``import moeref.compare`` imports neither torch nor triton.
* The device engine's old module paths (``moeref.compare.device_layer``, ...) still import, as the moved
  modules themselves, with a DeprecationWarning.

The import reader is the architecture test's (tests/test_architecture.py), so both read imports alike.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from test_architecture import ROOT, find_cycles, imports, module_name

COMPARE = ROOT / "moeref" / "compare"
DEVICE = "moeref.compare.device"
DISPATCH = {"moeref.compare.report"}  # layer_bound: a device run goes to moeref.compare.device.layer


def _compare_modules() -> dict[str, list[str]]:
    """``{module: imported names}`` of every module under moeref/compare."""
    return {module_name(p): imports(p) for p in sorted(COMPARE.rglob("*.py"))}


def _resolve(name: str, modules) -> str | None:
    """The module of ``modules`` that ``name`` (a module or a module attribute) is or lies in."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def _in_device(module: str) -> bool:
    return module == DEVICE or module.startswith(DEVICE + ".")


def test_definitions_do_not_import_the_device_engine():
    mods = _compare_modules()
    assert any(_in_device(m) for m in mods) and "moeref.compare.bounds" in mods
    bad = sorted(f"{m} imports {t}" for m, ts in mods.items() if not _in_device(m) and m not in DISPATCH
                 for t in ts if _in_device(t))
    assert not bad, bad
    # the dispatch imports only the device layer bound
    for m in DISPATCH:
        assert {t for t in mods[m] if _in_device(t)} == {"moeref.compare.device.layer"}, mods[m]


def test_no_import_circle_in_compare():
    mods = _compare_modules()
    graph = {m: {r: 0 for t in ts if (r := _resolve(t, mods)) is not None and r != m} for m, ts in mods.items()}
    assert find_cycles(graph) == []  # the architecture test's finder (its own test shows it sees a circle)


def test_import_compare_needs_no_torch():
    code = "import sys, moeref.compare; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("old, new", [("device_layer", "layer"), ("device_bounds", "bounds"),
                                      ("device_adder", "adder"), ("device_emulated", "emulated"),
                                      ("device_requant", "requant")])
def test_old_device_paths_warn_and_are_the_moved_modules(old, new):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    moved = importlib.import_module(f"moeref.compare.device.{new}")
    sys.modules.pop(f"moeref.compare.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(f"moeref.compare.{old}")
    assert mod is moved
    assert any(issubclass(w.category, DeprecationWarning) and f"moeref.compare.device.{new}" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    # the moved module keeps its own spec (the alias's would make its relative imports warn
    # "__package__ != __spec__.parent" everywhere after)
    assert mod.__spec__.name == f"moeref.compare.device.{new}" and mod.__spec__.parent == mod.__package__
