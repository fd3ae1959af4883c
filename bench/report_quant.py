"""Write the quantization tables of docs/fastpaths.md from bench_quant_gpu.py's JSON (never edited by hand).

    python bench/report_quant.py [RUN.json ...] [--docs docs/fastpaths.md] [--check]
        [--plot docs/figures/fastpath_bandwidth.png]

(no JSON given: the committed runs, ``docs/data/quant_*.json``, in name order). One section per JSON file
(one GPU each), in the order given; ``--plot`` also writes the bandwidth plot of the first. Replaces the text
between ``<!-- fastpath-quant:begin -->`` and ``<!-- fastpath-quant:end -->``; ``--check`` exits 1 when the
page differs from what the JSON gives. The JSON's schema is :func:`bench.bench_quant_gpu.row_record`'s rows
under ``kernels[name]["rows"]`` and :func:`bench.bench_quant_gpu.run_meta`'s ``meta``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import report_main  # noqa: E402

BEGIN, END = "<!-- fastpath-quant:begin -->", "<!-- fastpath-quant:end -->"
FLAG = "⚠"
# The project's targets, stated on the medians (issue 20): bold where met.
TARGET_PCT_COPY = 90.0
TARGET_X_COMPILE = 1.0
BASELINES = ("torch eager", "torch.compile", "DeepGEMM")


def _span(case: dict) -> str:
    """``median (min-max)`` in us, with the flag when the spread is over the threshold."""
    s = f"{case['median_us']:.1f} ({case['min_us']:.1f}-{case['max_us']:.1f})"
    return s + (f" {FLAG}" if case["flagged"] else "")


def _bold(text: str, met: bool) -> str:
    return f"**{text}**" if met else text


def tables(data: dict) -> str:
    """Markdown for one run: the large-size table (bandwidth, % of copy, time, ratios to each baseline)
    and the latency table over every M of the sweep."""
    m = data["meta"]
    out = [f"**{m['gpu']}**, {m['date']} (driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
           f"triton {m['triton']}); input {m['M']} x {m['K']} bfloat16; device copy {m['copy_TBps']:.2f} TB/s. "
           f"Every row is timed in {m['rounds']} interleaved rounds with its baselines (the same bytes copied, "
           f"torch eager, torch.compile, DeepGEMM where present): times are medians (min-max), ratios the "
           f"median of the per-round ratios (baseline time / fast-path time); {FLAG} marks a case whose spread "
           f"(max - min) / median exceeds {m['flag_spread']:.0%}. Targets, on the medians: >= "
           f"{TARGET_PCT_COPY:.0f}% of copy and >= {TARGET_X_COMPILE:.1f}x torch.compile (bold where met).", "",
           "| kernel | TB/s | % of copy | time, us | spread | " + " | ".join(f"x {b}" for b in BASELINES) + " |",
           "|---" * (5 + len(BASELINES)) + "|"]
    for name, rec in data["kernels"].items():
        big = rec["rows"][-1]
        fp = big["cases"]["fastpath"]
        cells = [name, f"{big['TBps']:.2f}", _bold(f"{big['pct_copy']:.1f}%", big["pct_copy"] >= TARGET_PCT_COPY)
                 + (f" {FLAG}" if big["cases"]["copy"]["flagged"] else ""),
                 _span(fp), f"{fp['spread']:.1%}"]
        for b in BASELINES:
            if b not in big["ratio_median"]:
                cells.append("—")
                continue
            r = big["ratio_median"][b]
            met = r >= TARGET_X_COMPILE if b == "torch.compile" else False
            cells.append(_bold(f"{r:.2f}", met) + (f" {FLAG}" if big["cases"][b]["flagged"] else ""))
        out.append("| " + " | ".join(cells) + " |")
    sizes = sorted({row["M"] for rec in data["kernels"].values() for row in rec["rows"]})
    out += ["", "Latency per call (us, median (min-max) of the interleaved rounds; one eager call each, host "
            "overhead included) and, at the smallest M, one call replayed from a CUDA graph (the GPU-side time):", "",
            "| kernel | " + " | ".join(f"M={s}" for s in sizes) + f" | M={sizes[0]} graph replay |",
            "|---" * (len(sizes) + 2) + "|"]
    for name, rec in data["kernels"].items():
        by_m = {row["M"]: row for row in rec["rows"]}
        cells = [name] + [_span(by_m[s]["cases"]["fastpath"]) if s in by_m else "—" for s in sizes]
        cells.append(f"{rec['small_graph_us']:.1f}" if "small_graph_us" in rec else "—")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    """Bandwidth (median) vs bytes moved per call, one line per kernel, the device copy dashed: ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = plt.get_cmap("tab20").colors
    markers = "os^vD<>pP*Xh"
    for i, (name, r) in enumerate(res["kernels"].items()):
        xs = [p["bytes"] / 1e6 for p in r["rows"]]
        ys = [p["TBps"] for p in r["rows"]]
        ax.plot(xs, ys, marker=markers[i % len(markers)], color=colors[(2 * i) % 20 + (i >= 10)],
                label=name)
    ax.axhline(res["meta"]["copy_TBps"], color="k", linestyle="--", label="device copy")
    ax.set_xscale("log")
    ax.set_xlabel("bytes moved per call (MB, read + write)", fontsize=12)
    ax.set_ylabel("achieved bandwidth (TB/s)", fontsize=12)
    ax.tick_params(labelsize=11)
    ax.set_title(f"quantization kernels, {res['meta']['gpu']},\n{res['meta']['date']}", fontsize=12)
    # the legend below the axes, in type as large as the page's text at the docs' content width
    ax.legend(fontsize=10.5, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def render(runs: list[dict], plot_png: str = "") -> str:
    """The generated part of the page: the tables of each run, in order; with ``plot_png``, also writes the
    bandwidth plot of the first run there (:func:`plot`)."""
    if plot_png:
        plot(runs[0], plot_png)
    return "\n\n".join(tables(d) for d in runs)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_quant.py", pattern="quant_*.json",
                       pages=("fastpaths.md",), begin=BEGIN, end=END, render=render,
                       json_help="bench_quant_gpu.py JSON files, one section each",
                       options={"--plot": dict(dest="plot_png", default="", metavar="PNG",
                                               help="also write the bandwidth plot of the first JSON to this PNG")})


if __name__ == "__main__":
    sys.exit(main())
