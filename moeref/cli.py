"""The ``moeref`` command: ``formats``, ``explain`` and ``demo`` (also ``python -m moeref``).

Everything printed here is built by library functions (``moeref.format_tables``,
``moeref.explain``, ``moeref.demo``); this module only parses arguments and prints.

* ``moeref`` alone prints the help; ``moeref --version`` the installed version.
* ``--json`` on ``formats`` and ``explain`` prints the same numbers as plain JSON (the data
  functions :func:`moeref.format_tables.parameter_rows`, :func:`~moeref.format_tables.value_rows`,
  :func:`moeref.explain.explain_steps`), for scripts; so does ``--json`` on the comparison
  commands ``check``, ``replay`` and ``mutate`` (:mod:`moeref.testing.commands`).
* Output to a pipe or a file is not cut to 80 columns: each table is printed as wide as it needs.
* Bad input (an unknown format, scheme or preset, a preset that does not fit the scheme) exits 2
  with one line on stderr naming what was given and what is accepted.
* A reader that stops early (``moeref check --json | head``) ends any command quietly (status 1, no
  traceback).
"""
from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main", "build_parser"]


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("moeref")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree, not installed
        from . import __version__

        return __version__


def _console():
    try:
        from rich.console import Console
        from rich.measure import Measurement
    except ImportError:  # pragma: no cover - rich is in the cli extra
        sys.exit("moeref's command line needs rich: pip install 'moeref[cli]'")

    class _FullWidthConsole(Console):
        """A console that, when not writing to a terminal, prints each renderable at the width it
        needs (at least 80 columns) instead of cutting it to 80."""

        def print(self, *objects, **kwargs):  # noqa: A003 - rich's name
            if self.is_terminal or not objects:
                return super().print(*objects, **kwargs)
            options = self.options.update_width(1 << 16)
            need = max(Measurement.get(self, options, o).maximum for o in objects)
            saved = self.width
            self.width = max(saved, need)
            try:
                return super().print(*objects, **kwargs)
            finally:
                self.width = saved

    return _FullWidthConsole()


def _print_json(data) -> None:
    json.dump(data, sys.stdout, indent=1)
    sys.stdout.write("\n")


def _cmd_formats(args) -> int:
    from . import format_tables
    from .formats import get_format

    if args.json:
        if args.name:
            f = get_format(args.name)
            values = (format_tables.value_rows(f) if f.bits <= format_tables.MAX_LISTED_BITS
                      else None)
            _print_json({"parameters": format_tables.parameter_rows([f.name])[0],
                         "values": values})
        else:
            _print_json({"formats": format_tables.parameter_rows()})
        return 0
    console = _console()
    if args.name:
        console.print(format_tables.format_detail(args.name))
    else:
        console.print(format_tables.formats_overview())
    return 0


def _cmd_explain(args) -> int:
    from .explain import explain, explain_steps, scheme_presets
    from .quant import SCHEMES

    if args.list:
        listing = {name: list(scheme_presets(name)) for name in SCHEMES}
        if args.json:
            _print_json({"schemes": listing})
        else:
            for name, presets in listing.items():
                print(f"{name:18s} presets: {', '.join(presets) or '(none: the scheme fixes it)'}")
        return 0
    if args.scheme is None:
        raise ValueError("give a scheme name (list them with `moeref explain --list`)")
    if args.json:
        steps = explain_steps(args.scheme, presets=args.preset or None, seed=args.seed,
                              scale=args.scale)
        for run in steps["runs"]:  # private keys (leading underscore) are not part of the output
            run["elements"] = [{k: v for k, v in e.items() if not k.startswith("_")}
                               for e in run["elements"]]
        _print_json(steps)
        return 0
    _console().print(explain(args.scheme, presets=args.preset or None, seed=args.seed,
                             scale=args.scale))
    return 0


def _cmd_demo(args) -> int:
    from . import format_tables
    from .demo import run_demo

    console = _console()
    console.rule("[bold]1. Element formats")
    console.print(format_tables.formats_overview())
    console.print(format_tables.format_detail("e2m1"))
    console.rule("[bold]2. One value through encode and decode")
    console.print(format_tables.walk_value(0.3, "e4m3fn"))
    console.print(format_tables.walk_value(1.75, "e2m1"))
    console.rule("[bold]3. A whole MoE layer, a broken kernel, and the report that catches it")
    return run_demo(console, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``moeref`` (exposed so that the docs and tests can read it)."""
    parser = argparse.ArgumentParser(
        prog="moeref",
        description="Exact references for MoE numerics and quantization.",
        epilog="`moeref COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"moeref {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("formats", help="element format parameters and value tables",
                       description="Every element format's parameters, or one format's "
                                   "parameters and (6 bits or fewer) every value.")
    p.add_argument("name", nargs="?", help="a format name (e4m3fn, e5m2, e2m1, e8m0, ...)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(func=_cmd_formats)

    p = sub.add_parser("explain", help="walk a small example through a scaling scheme",
                       description="Walk a small example through a scaling scheme step by step; "
                                   "give --preset twice to put two presets side by side.")
    p.add_argument("scheme", nargs="?",
                   help="a scheme name (`moeref explain --list` lists them with their presets)")
    p.add_argument("--list", action="store_true",
                   help="list the schemes and the presets that fit each")
    p.add_argument("--preset", action="append",
                   help="a preset that fits the scheme; give twice to compare two")
    p.add_argument("--scale", choices=("fp32", "ue8m0"),
                   help="scale format, for the FP8 schemes that take one (default fp32)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the example data (0: the hand-picked example)")
    p.add_argument("--json", action="store_true", help="print the walk as JSON")
    p.set_defaults(func=_cmd_explain)

    from .checkpoint.cli import add_parser as _add_convert  # moeref convert (docs/convert.md)
    _add_convert(sub)

    p = sub.add_parser("demo", help="the main demonstration",
                       description="Element formats, one value through encode and decode, and a "
                                   "whole MoE layer with a broken kernel caught by the report.")
    p.add_argument("--seed", type=int, default=0, help="seed of the layer's data")
    p.set_defaults(func=_cmd_demo)

    from .testing.commands import add_subcommands  # replay, check, mutate (kernel validation)

    add_subcommands(sub)
    return parser


def main(argv=None) -> int:
    try:
        status = _run(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe raises while it can still be handled
        return status
    except BrokenPipeError:
        return _stdout_closed()


def _run(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"moeref {args.command}: {exc}", file=sys.stderr)
        return 2


def _stdout_closed() -> int:
    """The reader of stdout went away (``moeref check --json | head``): exit quietly, with no traceback and
    no second error when Python flushes stdout at exit (stdout is pointed at the null device: the Python
    docs' recipe, signal module, "Note on SIGPIPE"). Returns 1, as that recipe and rich (which handles a
    closed pipe in its own prints the same way) do."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (stdout replaced in-process)
        pass
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
