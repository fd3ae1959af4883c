"""``moeref convert SRC DST --to LAYOUT``: argument parsing and printing for the converter.

:func:`add_parser` registers the subcommand on ``moeref``'s parser (moeref/cli.py); everything
it does is :func:`moeref.checkpoint.convert_checkpoint`.
"""
from __future__ import annotations

import os
import sys

from .layouts import LAYOUTS

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Add the ``convert`` subcommand to an ``argparse`` subparsers object."""
    p = sub.add_parser(
        "convert", help="convert a safetensors checkpoint between quantized layouts",
        description="Convert a checkpoint directory (model.safetensors or sharded with "
                    "model.safetensors.index.json) tensor by tensor into another layout, with a "
                    "per-module error report. LAYOUT is one of: " + "; ".join(
                        f"{k}: {v.description}" for k, v in LAYOUTS.items()))
    p.add_argument("src", help="source checkpoint directory (never written)")
    p.add_argument("dst", help="destination directory (must not exist, unless --overwrite/--resume)")
    p.add_argument("--to", required=True, choices=list(LAYOUTS), metavar="LAYOUT",
                   help="target layout (the list above)")
    p.add_argument("--from", dest="source_layout", choices=list(LAYOUTS), metavar="LAYOUT",
                   help="source layout (default: detected from config.json)")
    p.add_argument("--preset", help="preset of the target scheme (default: the layout's)")
    p.add_argument("--precision", choices=("float32", "exact"), default="float32",
                   help="what the target's rule runs on: the source dequantized to float32 "
                        "(default, as vLLM/DeepSeek/compressed-tensors do) or its exact values")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="convert only modules matching this fnmatch pattern (repeatable)")
    p.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                   help="leave modules matching this pattern unconverted (repeatable)")
    p.add_argument("--workers", type=int, default=1, help="processes converting shards")
    p.add_argument("--engine", choices=("auto", "numpy", "triton"), default="auto",
                   help="auto: the Triton fast path on a CUDA GPU where supported, else NumPy")
    p.add_argument("--report-device", default="auto", metavar="DEVICE",
                   help="where the report is computed: auto (a CUDA GPU where there is one, with reading, "
                        "converting and writing overlapped; else the host), host (NumPy), or a torch device "
                        "(cuda, cuda:1); the same figures bit for bit")
    p.add_argument("--no-share-global", dest="share_global", action="store_false",
                   help="NVFP4: do not give fused gate/up and q/k/v one global scale")
    p.add_argument("--scale-layout", choices=("linear", "swizzled"), default="linear",
                   help="FP4 block scales on disk: linear (default; what ModelOpt, "
                        "compressed-tensors and gpt-oss store and every runtime expects) or the "
                        "128x4 swizzle of Blackwell MMAs (NVFP4 / ct-mxfp4 targets; marked in the "
                        "config; no usual runtime reads it: docs/convert.md)")
    p.add_argument("--verify", action="store_true", help="re-read the written shards and check "
                   "them against the source")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument("--resume", action="store_true", help="finish an interrupted conversion, "
                   "skipping shards already written")
    p.add_argument("--dry-run", action="store_true", help="list what would change; write nothing")
    p.add_argument("--report", metavar="FILE.json", help="also write the JSON report here")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the "
                   "table (what --report writes)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.set_defaults(func=run)


def run(args) -> int:
    from .convert import ConvertOptions, convert_checkpoint

    opts = ConvertOptions(target=args.to, source_layout=args.source_layout, preset=args.preset,
                          precision=args.precision, only=tuple(args.only), skip=tuple(args.skip),
                          workers=args.workers, verify=args.verify, overwrite=args.overwrite,
                          resume=args.resume, dry_run=args.dry_run, engine=args.engine,
                          share_global=args.share_global, scale_layout=args.scale_layout,
                          report_device=args.report_device)
    console = None
    if not (args.quiet or args.json):
        from .._console import console as make_console

        console = make_console()
    if console is None or args.dry_run or not console.is_terminal:
        # a progress bar only on a terminal: in a pipe it would only leave a blank line
        report = convert_checkpoint(args.src, args.dst, opts)
    else:
        from rich.progress import Progress

        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("converting", total=None)

            def progress(done, total, shard):
                bar.update(task, completed=done, total=total, description=f"wrote {shard}")

            report = convert_checkpoint(args.src, args.dst, opts, progress=progress)
    if args.report:
        report.to_json(args.report)
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
    if console is not None:
        console.print(report.table())
        for w in report.warnings:
            console.print(f"[yellow]warning:[/] {w}")
        n = len(report.modules)
        if args.dry_run:
            copies = sum(s.copied for s in report.shards)
            console.print(f"dry run: {n} modules would change, {copies} tensors would be copied; "
                          "nothing was written")
        else:
            console.print(f"{n} modules converted ({sum(m.lossless for m in report.modules)} "
                          f"lossless) in {report.seconds:.2f} s; report: "
                          f"{os.path.join(args.dst, 'moeref-convert.json')}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: moeref convert ...")
