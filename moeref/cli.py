"""The ``moeref`` command: ``formats``, ``explain`` and ``demo``.

Everything printed here is built by library functions (``moeref.format_tables``,
``moeref.explain``, ``moeref.demo``); this module only parses arguments and prints.
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _console():
    try:
        from rich.console import Console
    except ImportError:  # pragma: no cover - rich is in the cli extra
        sys.exit("moeref's command line needs rich: pip install 'moeref[cli]'")
    return Console()


def _cmd_formats(args) -> int:
    from . import format_tables

    console = _console()
    if args.name:
        console.print(format_tables.format_detail(args.name))
    else:
        console.print(format_tables.formats_overview())
    return 0


def _cmd_explain(args) -> int:
    from .explain import explain

    console = _console()
    console.print(explain(args.scheme, presets=args.preset or None, seed=args.seed))
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="moeref",
        description="Exact references for MoE numerics and quantization.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("formats", help="element format parameters and value tables")
    p.add_argument("name", nargs="?", help="a format name (e4m3fn, e5m2, e2m1, e8m0, ...)")
    p.set_defaults(func=_cmd_formats)

    p = sub.add_parser("explain", help="walk a small example through a scaling scheme")
    p.add_argument("scheme", help="a scheme name (see `moeref explain --list`)")
    p.add_argument("--preset", action="append", help="preset to use; give twice to compare two")
    p.add_argument("--seed", type=int, default=0, help="seed of the example data")
    p.set_defaults(func=_cmd_explain)

    from .checkpoint.cli import add_parser as _add_convert  # moeref convert (docs/convert.md)
    _add_convert(sub)

    p = sub.add_parser("demo", help="the main demonstration")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_demo)

    from .testing.commands import add_subcommands  # replay, check, mutate (kernel validation)

    add_subcommands(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"moeref {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
