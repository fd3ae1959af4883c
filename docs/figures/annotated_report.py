"""Draw an annotated failing report of moeref.compare (docs/figures/annotated_report.png).

The demo's FP8 layer with outputs scaled to about 1e-2 (vLLM's test scale), token 0 sent to a wrong
expert; the report is the real ``Report.summary()`` text of that comparison, and the notes in the
margin say how to read it: the bound check fails and names the token and its experts, while the
vLLM tolerances on the same output pass (DeepGEMM's ``calc_diff`` fails here only because the
layer has 16 tokens; one wrong row among thousands stays under its threshold).

Run from the repository root: ``python docs/figures/annotated_report.py``.
"""
from __future__ import annotations

import os
import re
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moeref.compare import FP32_ACCUM, compare  # noqa: E402
from moeref.compare.faults import FAULTS, reference  # noqa: E402
from moeref.demo import demo_case  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "annotated_report.png")
FAULT = "token 0 routed to a wrong expert"


def main() -> None:
    _, case = demo_case(seed=0, out_scale=2e-3)
    rep = compare(FAULTS[FAULT](case), reference(case), FP32_ACCUM, label=FAULT)
    lines = rep.summary().splitlines()
    times = re.search(r"\(x(\d+)\)", lines[3])
    # (line index, note): numbered markers in the margin, the notes below the report
    notes = [
        (0, "verdict: elements beyond the bound derived\nfrom the declared arithmetic"),
        (1, "global metrics of the whole output\n(rel. L2, SQNR, cosine)"),
        (2, "vLLM's two tolerances pass on the same\noutput; calc_diff fails only because the\n"
            "layer has 16 tokens (1 bad row in 32k\npasses it)"),
        (3, f"the culprit: token 0, how far beyond its\nbound (x{times.group(1) if times else '?'}) and the "
            "experts it was\nrouted to"),
    ]
    wrapped = [textwrap.wrap(line, 78, subsequent_indent="    ") or [""] for line in lines]
    n_rows = sum(len(w) for w in wrapped)
    fig, ax = plt.subplots(figsize=(10.0, 0.32 * n_rows + 2.6))
    ax.axis("off")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    step = 0.32 / (0.32 * n_rows + 2.6)
    y = 0.97
    marks = dict(notes)
    for i, parts in enumerate(wrapped):
        if i in marks:
            ax.text(0.0, y, str([n for n, _ in notes].index(i) + 1), fontsize=11, va="top", ha="left",
                    color="white", weight="bold", bbox=dict(boxstyle="circle,pad=0.2", facecolor="#c9a227",
                                                            edgecolor="none"))
        for part in parts:
            ax.text(0.045, y, part, family="monospace", fontsize=12, va="top",
                    color="#b03030" if lines[i].startswith("FAIL") else "#222222",
                    weight="bold" if lines[i].startswith("FAIL") else "normal")
            y -= step
    y -= step * 0.6
    for j, (_, text) in enumerate(notes):
        x, yy = 0.0 + 0.52 * (j % 2), y - (j // 2) * 0.5 * (y - 0.02)
        ax.text(x, yy, str(j + 1), fontsize=11, va="top", ha="left", color="white", weight="bold",
                bbox=dict(boxstyle="circle,pad=0.2", facecolor="#c9a227", edgecolor="none"))
        ax.text(x + 0.045, yy, textwrap.fill(text.replace("\n", " "), 38), fontsize=12.5, va="top", ha="left")
    fig.savefig(OUT, dpi=100, bbox_inches="tight")
    print(OUT)
    print(rep.summary())


if __name__ == "__main__":
    main()
