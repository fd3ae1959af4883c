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
    fig, ax = plt.subplots(figsize=(11.0, 3.9))
    n = len(STAGES)
    w, h, gap = 1.6, 0.9, 0.45
    for i, (title, bound) in enumerate(STAGES):
        x = i * (w + gap)
        shade = 0.93 - 0.09 * i
        ax.add_patch(FancyBboxPatch((x, 2.0), w, h, boxstyle="round,pad=0.03",
                                    facecolor=(shade, shade, 1.0), edgecolor="#334"))
        ax.text(x + w / 2, 2.0 + h / 2, title, ha="center", va="center", fontsize=9, weight="bold")
        ax.text(x + w / 2, 1.78, bound, ha="center", va="top", fontsize=7.6, family="monospace")
        if i < n - 1:
            ax.add_patch(FancyArrowPatch((x + w + 0.02, 2.0 + h / 2), (x + w + gap - 0.02, 2.0 + h / 2),
                                         arrowstyle="-|>", mutation_scale=12, color="#334"))
    total = n * (w + gap) - gap
    ax.add_patch(FancyArrowPatch((0.1, 0.55), (total - 0.1, 0.55), arrowstyle="-|>",
                                 mutation_scale=16, color="#b03030", linewidth=2))
    ax.text(total / 2, 0.3, "the bound grows stage by stage; at the end, for every output element: "
            "|candidate - reference| <= bound  (else the report names the violating tokens and their experts)",
            ha="center", va="center", fontsize=8.5, color="#b03030")
    ax.text(total / 2, 3.25, "coef = γ(n, u_acc) + (1 + γ(n, u_acc)) γ(⌈K/c⌉ + S + 3, u_fp32):  "
            "c-column chunks at unit u_acc, S scale blocks, FP32 promotion (Higham, Lemma 3.1)",
            ha="center", va="center", fontsize=8.2)
    ax.set_xlim(-0.1, total + 0.1)
    ax.set_ylim(0.0, 3.45)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
