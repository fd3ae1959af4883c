"""Draw how moeref.compare's error bound propagates through the MoE layer
(docs/figures/error_bound_flow.png).

Each box is a stage of the layer as the reference traces it (docs/error-bounds.md, "The bound,
stage by stage"); under it, the deviation bound that stage passes on, in the page's notation. The
bound grows stage by stage and is checked element by element at the end.

Run from the repository root: ``python docs/figures/error_bound_flow.py``.
"""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "error_bound_flow.png")

STAGES = [
    ("tokens x\nquantize (A1)", "same codes and scales\n(both run the declared\nquantizer): 0"),
    ("GEMM1\nh = A1 W13ᵀ", "dh <= coef\n  * |A1| |W13|ᵀ\n(+ bf16 store)"),
    ("activation\nx = act(g) * up", "dx <= L dg (|u|+|b|)\n  + (|g|+dg) du\nL: Lipschitz on\n[g-dg, g+dg]"),
    ("re-quantize (A2)\nflip-aware", "code kept unless\n[x-dx, x+dx] holds\na rounding boundary\n-> unc per element"),
    ("GEMM2\ny = A2 W2ᵀ", "dy <= |W2| unc\n  + coef (|xq|+unc)\n  * |W2|ᵀ"),
    ("finalize\nout = Σ w_j y_j", "Σ |w_j| dy_j\n + γ(k+2) Σ |w_j|\n   (|y_j| + dy_j)\n(+ output store)"),
]


def main() -> None:
    # One stage per row (box on the left, the bound it passes on to its right), so the text can be as
    # large as the page's body text at the docs' content width.
    n = len(STAGES)
    w, h, pitch = 2.5, 0.95, 1.45
    top = n * pitch + 0.3
    fig, ax = plt.subplots(figsize=(8.0, 10.2))
    for i, (title, bound) in enumerate(STAGES):
        y = top - (i + 1) * pitch
        shade = 0.93 - 0.09 * i
        ax.add_patch(FancyBboxPatch((0.0, y), w, h, boxstyle="round,pad=0.03",
                                    facecolor=(shade, shade, 1.0), edgecolor="#334"))
        ax.text(w / 2, y + h / 2, title, ha="center", va="center", fontsize=13, weight="bold")
        ax.text(w + 0.35, y + h / 2, bound, ha="left", va="center", fontsize=11.5, family="monospace")
        if i < n - 1:
            ax.add_patch(FancyArrowPatch((w / 2, y - 0.03), (w / 2, y - (pitch - h) + 0.03),
                                         arrowstyle="-|>", mutation_scale=14, color="#334"))
    x_red = 7.0
    ax.add_patch(FancyArrowPatch((x_red, top - pitch + h), (x_red, top - n * pitch), arrowstyle="-|>",
                                 mutation_scale=18, color="#b03030", linewidth=2.5))
    ax.text(x_red + 0.25, top - (n + 1) * pitch / 2 + h / 2, "the bound grows stage by stage", rotation=-90,
            ha="center", va="center", fontsize=12, color="#b03030")
    ax.text(3.7, top - n * pitch - 0.55, "at the end, for every output element:\n"
            "|candidate - reference| <= bound\n(else the report names the violating tokens and their experts)",
            ha="center", va="center", fontsize=12, color="#b03030")
    ax.text(3.7, top + 0.15, "coef = γ(n, u_acc) + (1 + γ(n, u_acc)) γ(⌈K/c⌉ + S + 3, u_fp32)\n"
            "c-column chunks at unit u_acc, S scale blocks,\nFP32 promotion (Higham, Lemma 3.1)",
            ha="center", va="center", fontsize=11.5)
    ax.set_xlim(-0.1, 7.6)
    ax.set_ylim(top - n * pitch - 1.1, top + 0.65)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
