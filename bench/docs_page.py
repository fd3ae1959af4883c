"""The generated part of a docs page: the text between a ``begin`` and an ``end`` marker, rewritten by a
report script from a benchmark's JSON (never edited by hand), or checked against it (``--check``; the
docs tests run every report that way on the committed JSON)."""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys


DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "data")
"""Where the committed benchmark JSON lives (what the report scripts and the docs tests read)."""


def data_files(pattern: str) -> list[str]:
    """The committed benchmark JSON files ``docs/data/<pattern>``, sorted (a report script's default input)."""
    return sorted(glob.glob(os.path.join(DATA_DIR, pattern)))


def runs_oldest_first(runs, section, *, date, head=()) -> str:
    """The lines ``head`` and then ``section(d)`` (a list of lines) of each document ``d`` in ``runs``, oldest
    first by ``date(d)`` (a stable sort: runs of one date keep their order), joined by newlines with one blank
    line between the head and each section. ``date`` is a callable because the benchmarks keep the date in
    different places (``d["date"]``, ``d["meta"]["date"]``); any sortable key works."""
    out = list(head)
    for d in sorted(runs, key=date):
        out += ([""] if out else []) + section(d)
    return "\n".join(out)


def replace_between(page: str, begin: str, end: str, body: str) -> str:
    """``page`` with the text between ``begin`` and ``end`` replaced by ``body`` (on lines of its own);
    ``ValueError`` when the markers are missing or out of order."""
    i, j = page.find(begin), page.find(end)
    if i < 0 or j < i:
        raise ValueError(f"the page has no {begin} ... {end} markers")
    return page[: i + len(begin)] + "\n" + body + "\n" + page[j:]


def update_page(path: str, begin: str, end: str, body: str, *, check: bool, remedy: str = "") -> int:
    """Write ``body`` between the markers of the page at ``path`` and return 0; with ``check``, write
    nothing and return 1 (saying so on stderr, with ``remedy``) when the page differs from that."""
    with open(path) as f:
        old = f.read()
    new = replace_between(old, begin, end, body)
    if check:
        if new != old:
            print(f"{path} differs from what the benchmark JSON gives" + (f": {remedy}" if remedy else ""),
                  file=sys.stderr)
            return 1
        return 0
    with open(path, "w") as f:
        f.write(new)
    return 0


def report_main(argv, *, description: str, script: str, pattern: str, pages, begin: str, end: str, render,
                json_help: str, options: dict | None = None) -> int:
    """The command line every page report shares: ``[JSON ...] [--docs PAGE ...] [--check]``. The JSON files
    given (default: the committed ``docs/data/<pattern>``; SystemExit when there are none) are loaded in order,
    ``render(list of documents)`` gives the generated text, and each page (default ``pages``, names under
    ``docs/``) gets it between ``begin`` and ``end`` (:func:`update_page`). Returns 0, or 1 when ``--check``
    finds a page that differs.

    ``options`` adds a script's own options: ``{flag: keyword arguments of argparse's add_argument}``; each
    one's parsed value reaches ``render`` as the keyword argument named by its ``dest`` (for instance
    ``{"--plot": dict(dest="plot_png", default="")}`` calls ``render(runs, plot_png=...)``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("json", nargs="*", help=f"{json_help} (default: docs/data/{pattern})")
    ap.add_argument("--docs", nargs="+", default=[os.path.join(os.path.dirname(DATA_DIR), p) for p in pages],
                    help="the page(s) to write (default: " + ", ".join(f"docs/{p}" for p in pages) + ")")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")
    extra = [ap.add_argument(flag, **kwargs).dest for flag, kwargs in (options or {}).items()]
    args = ap.parse_args(argv)
    paths = args.json or data_files(pattern)
    if not paths:
        raise SystemExit(f"no JSON given and no docs/data/{pattern}")
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    body = render(runs, **{dest: getattr(args, dest) for dest in extra})
    status = 0
    for page in args.docs:
        status |= update_page(page, begin, end, body, check=args.check,
                              remedy=f"run bench/{script} " + " ".join(paths))
    return status
