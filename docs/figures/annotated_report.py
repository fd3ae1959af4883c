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
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moeref.compare import FP32_ACCUM, compare  # noqa: E402
from moeref.compare.faults import FAULTS, reference  # noqa: E402
from moeref.moe.demo import demo_case  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "annotated_report.png")
FAULT = "token 0 routed to a wrong expert"


def main() -> None:
    _, case = demo_case(seed=0, out_scale=2e-3)
    rep = compare(FAULTS[FAULT](case), reference(case), FP32_ACCUM, label=FAULT)
    lines = rep.summary().splitlines()
    fig, ax = plt.subplots(figsize=(11.5, 3.8))
    ax.axis("off")
    top, step = 0.97, 0.075
    for i, line in enumerate(lines):
        ax.text(0.005, top - i * step, line, family="monospace", fontsize=7.6, va="top",
                color="#b03030" if line.startswith("FAIL") else "#222222",
                weight="bold" if line.startswith("FAIL") else "normal")
    # (line index, x of the arrow's head in axes fraction, note)
    notes = [
        (0, 0.08, "verdict: elements beyond the bound\nderived from the declared arithmetic"),
        (1, 0.33, "global metrics of the whole\noutput (rel. L2, SQNR, cosine)"),
        (2, 0.55, "vLLM's two tolerances on the same\noutput pass; calc_diff fails only\n"
                  "because the layer has 16 tokens\n(1 bad row in 32k passes it)"),
        (3, 0.50, "the culprit: token 0, how far\nbeyond its bound (x327), and\nthe experts it was routed to"),
    ]
    for j, (i, x, text) in enumerate(notes):
        y = top - i * step - 0.045
        ax.annotate(text, xy=(x, y), xytext=(0.01 + j * 0.25, 0.30), textcoords="axes fraction",
                    fontsize=8, va="top",
                    bbox=dict(boxstyle="round,pad=0.3", facecolor="#fff6d5", edgecolor="#c9a227"),
                    arrowprops=dict(arrowstyle="->", color="#c9a227"))
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(OUT)
    print(rep.summary())


if __name__ == "__main__":
    main()
