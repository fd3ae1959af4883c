"""The import rules of docs/architecture.md hold: every ``import`` in ``moeref/`` and ``fastpath/``
(module level and inside functions) goes to its own unit or to a lower layer. The layer table is
read from that page, so the page and the code cannot drift apart."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

# Edges allowed by name despite the layer rule (none today: the demonstration moved to moeref.demo).
ALLOWED: set = set()


def layer_table() -> dict[str, int]:
    """``{unit: layer}`` from the table of docs/architecture.md (units in backticks)."""
    table = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|(.*?)\|", line)
        if m:
            for unit in re.findall(r"`([\w.]+)`", m.group(2)):
                table[unit] = int(m.group(1))
    return table


def _is_submodule(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def unit_of(module: str, table: dict[str, int]) -> str | None:
    """The longest unit of ``table`` that ``module`` is or lies inside. The package root ``moeref``
    holds only its own names (``moeref.__version__``), not the subpackages, so a new subpackage
    missing from the table is reported instead of falling into the root's layer."""
    best = None
    for unit in table:
        inside = module.startswith(unit + ".") and not (unit == "moeref" and _is_submodule(module))
        if module == unit or inside:
            if best is None or len(unit) > len(best):
                best = unit
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, *, lazy: bool = False) -> list[str]:
    """Absolute names of the modules (or module attributes) ``path`` imports; with ``lazy=True``
    only those imported inside a function (run on a call, not when the module is imported)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []

    def visit(node, in_function: bool):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if in_function or not lazy:
            if isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if node.module:
                    out.append(target)
                else:  # from . import x: each name is a module (or an attribute) of ``target``
                    out.extend(f"{target}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(ast.parse(path.read_text()), False)
    return out


def source_files():
    return sorted(p for d in ("moeref", "fastpath") for p in (ROOT / d).rglob("*.py"))


def test_the_table_places_every_unit():
    table = layer_table()
    assert table["moeref.formats"] == 2 and table["fastpath"] == 17
    for path in source_files():
        assert unit_of(module_name(path), table), f"{path.relative_to(ROOT)} is in no layer of {DOC.name}"


def find_violations(entries, table) -> list[str]:
    """``entries``: ``(path relative to the root, module name, imported names, names imported
    inside functions)``; returns one line per import that does not go down the layers (and is not
    in :data:`ALLOWED`). A reference may call a fast path only through a lazy import (inside a
    function: an optional engine), so importing moeref never imports torch or triton."""
    bad = []
    for rel, module, targets, lazy in entries:
        src_unit = unit_of(module, table)
        if src_unit is None:
            continue  # reported by test_the_table_places_every_unit
        for target in targets:
            dst_unit = unit_of(target, table)
            if dst_unit is None or dst_unit == src_unit or (rel, dst_unit) in ALLOWED:
                continue  # third-party, inside its own unit, or the named exception
            if dst_unit == "fastpath" and target in lazy:
                continue  # an optional fast engine, imported on use
            if table[dst_unit] >= table[src_unit]:
                bad.append(f"{rel} (layer {table[src_unit]}) imports {target} (layer {table[dst_unit]})")
    return bad


def test_imports_go_down_the_layers():
    entries = [(str(p.relative_to(ROOT)), module_name(p), imports(p), imports(p, lazy=True))
               for p in source_files()]
    assert len(entries) > 50
    bad = find_violations(entries, layer_table())
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation():
    """The rule check is not vacuous: upward and sideways imports are reported, downward not."""
    table = layer_table()
    entries = [("moeref/formats/x.py", "moeref.formats.x", ["moeref.compare.report", "numpy"], []),
               ("moeref/quant/y.py", "moeref.quant.y", ["moeref.layouts", "moeref.formats.codec"], []),
               ("fastpath/z.py", "fastpath.z", ["moeref.quant", "moeref._checks"], []),
               ("moeref/routing/w.py", "moeref.routing.w", ["fastpath.quant"], []),
               ("moeref/moe/v.py", "moeref.moe.v", ["fastpath.registry"], ["fastpath.registry"])]
    assert find_violations(entries, table) == [
        "moeref/formats/x.py (layer 2) imports moeref.compare.report (layer 7)",
        "moeref/quant/y.py (layer 3) imports moeref.layouts (layer 3)",
        "moeref/routing/w.py (layer 3) imports fastpath.quant (layer 17)",
    ]
    assert unit_of("moeref.newpkg", table) is None or not _is_submodule("moeref.newpkg")
    tree = ROOT / "build" / "arch-probe.py"
    tree.parent.mkdir(exist_ok=True)
    tree.write_text("import fastpath.quant\n\ndef f():\n    from fastpath import registry\n")
    assert imports(tree, lazy=True) == ["fastpath"] and imports(tree) == ["fastpath.quant", "fastpath"]


def test_allowed_exceptions_still_exist():
    """An exception that no longer matches an import must be deleted, not left behind."""
    for rel, unit in ALLOWED:
        path = ROOT / rel
        if path.exists():
            assert any(unit_of(t, layer_table()) == unit for t in imports(path)), (rel, unit)
