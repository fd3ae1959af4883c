"""The console every ``moeref`` command prints with, and the pieces that let a table fit it.

* :func:`console`: the one console of the command line (``moeref/cli.py``, the ``check``,
  ``replay`` and ``mutate`` commands in :mod:`moeref.testing.commands`, ``convert`` in
  :mod:`moeref.checkpoint.cli`). On a terminal it is rich's console at the terminal's width. To a
  pipe or a file each renderable is printed as wide as it needs (at least 80 columns), so nothing is
  cut; ``COLUMNS`` set in the environment fixes the width in both cases (``COLUMNS=80 moeref formats
  | less`` gives the 80-column layouts).
* :class:`Fit`: several layouts of the same content (a wide table, then narrower ones: stacked
  tables, fewer columns, abbreviated headers); it renders the first whose natural width fits the
  width available, so an 80-column terminal gets a layout made for 80 columns and a pipe the widest.
* :func:`compact_table`: a table without vertical rules or edge padding, for the narrow layouts.
* :func:`seed_argument`: the ``type`` of every ``--seed`` option (argparse then names the flag in
  its error).

``rich`` is the ``cli`` extra; it is imported only when one of these is used.
"""
from __future__ import annotations

import os
import sys

__all__ = ["console", "Fit", "compact_table", "natural_width", "seed_argument"]

_UNBOUNDED = 1 << 16  # "as wide as it likes": the width a renderable is measured at
_PIPE_MIN = 80


def natural_width(con, renderable) -> int:
    """The width ``renderable`` takes when nothing constrains it (a rule or other filler that
    takes whatever it is given counts as 0)."""
    from rich.measure import Measurement

    width = Measurement.get(con, con.options.update_width(_UNBOUNDED), renderable).maximum
    return 0 if width >= _UNBOUNDED else width


def console(file=None):
    """The ``moeref`` command's console (module docstring): rich's ``Console`` writing to
    ``file`` (default stdout), full width when that is not a terminal and ``COLUMNS`` is not set."""
    try:
        from rich.console import Console
    except ImportError:  # pragma: no cover - rich is in the cli extra
        sys.exit("moeref's command line needs rich: pip install 'moeref[cli]'")

    fixed = os.environ.get("COLUMNS", "").strip().isdigit()

    class _CommandConsole(Console):
        """A console that, writing to a pipe or a file with no ``COLUMNS`` set, prints each
        renderable at the width it needs (at least 80 columns) instead of cutting it to 80."""

        def print(self, *objects, **kwargs):  # noqa: A003 - rich's name
            if self.is_terminal or fixed or not objects:
                return super().print(*objects, **kwargs)
            need = max(natural_width(self, o) for o in objects)
            saved = self.width
            self.width = max(_PIPE_MIN, need)
            try:
                return super().print(*objects, **kwargs)
            finally:
                self.width = saved

    return _CommandConsole(file=file)


class Fit:
    """The first of ``layouts`` whose natural width fits the width available (else the last).

    Measured (by a full-width console sizing a pipe's output) as the first, the widest layout.
    """

    def __init__(self, *layouts):
        if not layouts:
            raise ValueError("Fit needs at least one layout")
        self.layouts = layouts

    def __rich_console__(self, con, options):
        from rich.measure import Measurement

        wide = options.update_width(_UNBOUNDED)
        for layout in self.layouts[:-1]:
            if Measurement.get(con, wide, layout).maximum <= options.max_width:
                yield layout
                return
        yield self.layouts[-1]

    def __rich_measure__(self, con, options):
        from rich.measure import Measurement

        return Measurement.get(con, options, self.layouts[0])


def compact_table(*columns, title: str | None = None, **kwargs):
    """A rich ``Table`` for the 80-column layouts: a rule under the header, no vertical rules, no
    padding at the edges; ``columns`` are ``(header, justify)`` pairs or headers (left)."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
              pad_edge=False, collapse_padding=True, **kwargs)
    for c in columns:
        header, justify = (c, "left") if isinstance(c, str) else c
        t.add_column(header, justify=justify)
    return t


def seed_argument(text: str) -> int:
    """``type=`` of the ``--seed`` options: a non-negative integer (NumPy's generators take no
    negative seed); anything else makes argparse exit 2 with ``argument --seed: ...``."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {value}")
    return value
