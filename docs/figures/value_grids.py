"""Draw the E2M1 and E4M3FN value grids into docs/figures/value_grids.png.

Run from the repository root: ``python docs/figures/value_grids.py``. The values come from
``moeref.formats.representable_values`` (checked against ml_dtypes by tests/test_formats.py).
"""
from __future__ import annotations

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from moeref.formats import get_format, representable_values  # noqa: E402

OUT = pathlib.Path(__file__).with_suffix(".png")


def main() -> pathlib.Path:
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.2), gridspec_kw={"height_ratios": [1, 1.15]})

    # E2M1: every value on a linear axis, midpoints (where rounding decides) as grey ticks
    v = representable_values("e2m1")
    sub = np.abs(v) < get_format("e2m1").min_normal
    ax1.scatter(v[~sub], np.zeros((~sub).sum()), s=36, color="tab:blue", zorder=3, label="normal")
    ax1.scatter(v[sub], np.zeros(sub.sum()), s=36, color="tab:orange", zorder=3, label="subnormal / zero")
    mids = (v[:-1] + v[1:]) / 2
    ax1.vlines(mids, -0.4, 0.4, color="0.6", lw=0.8, label="midpoints (ties)")
    for x in v[v >= 0]:
        ax1.annotate(f"{x:g}", (x, 0), xytext=(0, 9), textcoords="offset points", ha="center", fontsize=11.6)
    ax1.axhline(0, color="0.3", lw=0.6, zorder=1)
    ax1.set_xlim(-6.6, 6.6)
    ax1.set_ylim(-1, 1.3)
    ax1.set_yticks([])
    ax1.set_title("E2M1 (FP4): 15 distinct values; the step doubles each binade", fontsize=14.5)
    ax1.legend(loc="lower left", fontsize=10.2, ncol=3, frameon=False)

    # E4M3FN: positive values on a log2 axis; each binade holds 8 values, subnormals are evenly spaced
    f = get_format("e4m3fn")
    p = representable_values("e4m3fn")
    p = p[p > 0]
    sub = p < f.min_normal
    ax2.scatter(np.log2(p[~sub]), np.zeros((~sub).sum()), marker="|", s=120, color="tab:blue", label="normal")
    ax2.scatter(np.log2(p[sub]), np.zeros(sub.sum()), marker="|", s=120, color="tab:orange", label="subnormal")
    ax2.axhline(0, color="0.3", lw=0.6, zorder=1)
    for k in range(f.emin, f.emax + 2):
        ax2.axvline(k, color="0.85", lw=0.6, zorder=0)
    ax2.annotate("2^-9 = min subnormal", (np.log2(f.min_subnormal), 0), xytext=(0, -22),
                 textcoords="offset points", ha="left", fontsize=11.6)
    ax2.annotate("448 = max (0x7E); 0x7F is NaN", (np.log2(448), 0), xytext=(0, 12),
                 textcoords="offset points", ha="right", fontsize=11.6)
    ax2.set_xticks(range(-9, 10))
    ax2.set_xticklabels([f"$2^{{{k}}}$" for k in range(-9, 10)], fontsize=10.2)
    ax2.set_ylim(-1, 1)
    ax2.set_yticks([])
    ax2.set_title("E4M3FN positive values on a log2 axis: 8 per binade, 126 in all", fontsize=14.5)
    ax2.legend(loc="upper left", fontsize=10.2, frameon=False)

    fig.tight_layout()
    fig.savefig(OUT, dpi=95)
    return OUT


if __name__ == "__main__":
    out = main()
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")
