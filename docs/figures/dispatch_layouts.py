"""Draw the dispatch layouts of docs/dispatch.md (docs/figures/dispatch_layouts.png).

The routing of that page (6 tokens, 4 experts, top-2, token 2 padding, expert 3 empty) placed in
the standard layout (one row per slot), vLLM's permuted layout, DeepGEMM's contiguous layout
(alignment 4), DeepGEMM's masked layout and vLLM's batched layout (capacity 6). Every cell is a
row of the layout, coloured by expert and labelled with the slot ``s = t*k + j`` it holds; hatched
cells are padding. The rows come from moeref.dispatch (each layout's ``src``), so the picture is
the implementation's layout.

Run from the repository root: ``python docs/figures/dispatch_layouts.py``.
"""
from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moeref.dispatch import moe_permute, to_batched, to_contiguous, to_masked  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "dispatch_layouts.png")
IDS = np.array([[2, 0], [1, 2], [-1, -1], [0, 2], [2, 1], [1, 0]], dtype=np.int32)
E, K = 4, 2
COLOURS = ["#3b6fd6", "#e07b28", "#3a9a4d", "#9b55b5"]
PAD = "#eeeeee"


def _row(ax, y, label, src, experts, gaps=()):
    """One layout as a row of cells: ``src`` slots (-1 padding), ``experts`` colour index."""
    ax.text(-0.6, y + 0.5, label, ha="right", va="center", fontsize=12.2)
    x = 0.0
    for i, (s, e) in enumerate(zip(src, experts)):
        if i in gaps:
            x += 0.5
        pad = s < 0
        ax.add_patch(Rectangle((x, y), 0.95, 0.9, facecolor=PAD if pad else COLOURS[e],
                               edgecolor="#888888", hatch="///" if pad else None, linewidth=0.6))
        ax.text(x + 0.47, y + 0.45, "pad" if pad else f"s{s}", ha="center", va="center",
                fontsize=8, color="#666666" if pad else "white")
        x += 1.0
    return x


def main() -> None:
    fig, ax = plt.subplots(figsize=(9.5, 5.0))
    rows = []
    flat = IDS.reshape(-1)
    rows.append(("standard [M*k]", np.where(flat >= 0, np.arange(flat.size), -1), flat, ()))
    p = moe_permute(None, IDS, E)
    src = p.src
    rows.append(("permuted (vLLM)", src, np.where(src >= 0, flat[np.maximum(src, 0)], 0), ()))
    c = to_contiguous(None, IDS, E, alignment=4)
    gaps = tuple(i for i in range(4, c.src.size, 4))
    rows.append(("contiguous, align 4\n(DeepGEMM)", c.src, np.maximum(c.m_indices, 0), gaps))
    m = to_masked(None, IDS, E)
    cap = m.src.shape[1]
    rows.append((f"masked [E, {cap}]\n(DeepGEMM / DeepEP)", m.src.reshape(-1),
                 np.repeat(np.arange(E), cap), tuple(range(cap, m.src.size, cap))))
    b = to_batched(None, IDS, E, 6)
    capb = b.src.shape[1]
    rows.append((f"batched [E, {capb}]\n(vLLM)", b.src.reshape(-1), np.repeat(np.arange(E), capb),
                 tuple(range(capb, b.src.size, capb))))
    width = 0
    for i, (label, src, experts, gaps) in enumerate(rows):
        width = max(width, _row(ax, (len(rows) - 1 - i) * 1.5, label, src, experts, gaps))
    ax.set_xlim(-5.2, width + 0.2)
    ax.set_ylim(-0.4, len(rows) * 1.5)
    ax.axis("off")
    ax.set_title("6 tokens, top-2, 4 experts (token 2 padding, expert 3 empty): one cell per row",
                 fontsize=13.5)
    ax.legend(handles=[Patch(facecolor=COLOURS[e], label=f"expert {e}") for e in range(E)]
              + [Patch(facecolor=PAD, hatch="///", edgecolor="#888888", label="padding row")],
              loc="lower center", bbox_to_anchor=(0.5, -0.12), ncol=5, fontsize=10.8, frameon=False)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
