"""The import rules of docs/architecture.md hold: every ``import`` in ``moeref/`` and ``fastpath/``
(module level and inside functions) goes to its own unit or to a lower layer; no ``moeref`` module
imports ``fastpath`` (the oracle shares no code with what it judges); no two modules import each other,
directly or around a circle. The layer table is read from that page, so the page and the code cannot
drift apart."""
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
    in :data:`ALLOWED`), wherever it sits (module level or inside a function), and one per import of
    ``fastpath`` by a ``moeref`` module (docs/architecture.md: the oracle is independent of the fast
    paths; a fast engine is a plug-in, found through an entry point or passed in by the caller)."""
    bad = []
    for rel, module, targets, lazy in entries:
        src_unit = unit_of(module, table)
        if src_unit is None:
            continue  # reported by test_the_table_places_every_unit
        for target in targets:
            if module.split(".")[0] == "moeref" and target.split(".")[0] == "fastpath":
                where = "inside a function" if target in lazy else "at module level"
                bad.append(f"{rel} imports {target} ({where}): moeref never imports fastpath")
                continue
            dst_unit = unit_of(target, table)
            if dst_unit is None or dst_unit == src_unit or (rel, dst_unit) in ALLOWED:
                continue  # third-party, inside its own unit, or the named exception
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
        "moeref/routing/w.py imports fastpath.quant (at module level): moeref never imports fastpath",
        "moeref/moe/v.py imports fastpath.registry (inside a function): moeref never imports fastpath",
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


# ------------------------------------------------------------------------------------- import cycles


def module_edges(path: Path, modules: set) -> list[tuple[str, int]]:
    """``(imported project module, line)`` for every import in ``path``, module level and inside
    functions: each imported name resolved to the longest project module it names (``from pkg import
    sub`` counts as importing ``pkg.sub`` where that is a module, else ``pkg``). A package's parent
    ``__init__`` that Python runs first is not an edge (only what the source names is)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []

    def resolve(name: str) -> str | None:
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]  # a submodule, or an attribute of target
        for name in names:
            dst = resolve(name)
            if dst is not None and dst != mod:
                out.append((dst, node.lineno))
    return out


def find_cycles(graph: dict) -> list[list[str]]:
    """One import circle ``[a, b, ..., a]`` per strongly connected component of more than one module of
    ``graph`` (``{module: {imported module: line}}``): :func:`circles_and_components`."""
    return [c for c, _ in circles_and_components(graph)]


def circles_and_components(graph: dict) -> list[tuple[list[str], list[str]]]:
    """``(circle, component)`` per strongly connected component of more than one module (Tarjan's
    algorithm, iterative): the component's modules (sorted) and a shortest circle through its first."""
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(set(comp))
    cycles = []
    for comp in comps:  # a shortest circle through the component's first module (breadth first)
        start = min(comp)
        prev, frontier = {start: None}, [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, ())):
                    if w == start:
                        found = v
                        break
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v is not None and v != start:
            path.append(v)
            v = prev[v]
        cycles.append(([start] + path[1:][::-1] + [start], sorted(comp)))
    return cycles


def describe_cycle(cycle: list[str], graph: dict) -> str:
    """``a -> b -> a`` with the line of each import (``a.py:12 imports b``)."""
    steps = [f"{a.replace('.', '/')}.py:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "  (" + "; ".join(steps) + ")"


def import_graph() -> dict:
    files = {module_name(p): p for p in source_files()}
    graph = {}
    for mod, path in files.items():
        edges = graph.setdefault(mod, {})
        for dst, line in module_edges(path, set(files)):
            edges.setdefault(dst, line)
    return graph


def test_no_import_cycles():
    """No module imports itself around a circle, at module level or inside a function: an import inside
    a function that closes a circle only hides it (docs/architecture.md). Break one by moving the shared
    piece into a module both import."""
    graph = import_graph()
    assert len(graph) > 50 and any(graph.values())
    found = circles_and_components(graph)
    lines = [describe_cycle(c, graph) + ("" if len(comp) + 1 == len(c) else
                                         f"; the circle's modules and {', '.join(sorted(set(comp) - set(c)))} "
                                         "all reach each other")
             for c, comp in found]
    assert not found, "import cycles (move the shared piece down into a module both import):\n" + "\n".join(lines)


def test_the_cycle_finder_sees_a_cycle():
    """The cycle check is not vacuous: a direct pair, a longer circle and a self-contained acyclic part."""
    graph = {"a": {"b": 3}, "b": {"a": 7}, "c": {"d": 1}, "d": {"e": 2}, "e": {"c": 5, "f": 9}, "f": {}}
    cycles = find_cycles(graph)
    assert sorted(map(tuple, cycles)) == [("a", "b", "a"), ("c", "d", "e", "c")]
    assert describe_cycle(["a", "b", "a"], graph) == "a -> b -> a  (a.py:3 imports b; b.py:7 imports a)"
    assert find_cycles({"x": {"y": 1}, "y": {}}) == []
    probe = ROOT / "build" / "cycle-probe" / "pkg"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "m.py").write_text("from . import n\n\ndef f():\n    from .k import g\n")
    mods = {"build.cycle-probe.pkg.n", "build.cycle-probe.pkg.k"}
    got = module_edges(probe / "m.py", mods)
    assert sorted(got) == [("build.cycle-probe.pkg.k", 4), ("build.cycle-probe.pkg.n", 1)]
