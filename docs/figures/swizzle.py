"""Draw the 128x4 scale-factor swizzle (docs/figures/swizzle_128x4.png).

Left: one logical 128x4 tile of scales (rows r, scale columns c), coloured by the 32-row slab
q = r // 32 and shaded by r % 32. Right: the same 512 bytes as they sit in memory, 16 bytes per
line: line i holds rows i, i+32, i+64, i+96 (4 columns each). Offsets come from
moeref.layouts.swizzle_128x4_offsets, so the picture is the implementation's layout.

Run from the repository root: ``python docs/figures/swizzle.py``.
"""
from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moeref.layouts import swizzle_128x4_offsets  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "swizzle_128x4.png")


def main() -> None:
    offsets = swizzle_128x4_offsets(128, 4)  # [128, 4]
    r = np.arange(128)[:, None].repeat(4, axis=1)
    slab = r // 32
    shade = (r % 32) / 31.0
    base = np.array([[0.20, 0.45, 0.85], [0.90, 0.45, 0.15], [0.20, 0.65, 0.30], [0.60, 0.30, 0.70]])
    colour = base[slab] * (1.0 - 0.45 * shade[..., None]) + 0.45 * shade[..., None]

    mem = np.zeros((512, 3))
    mem[offsets.ravel()] = colour.reshape(-1, 3)
    mem = mem.reshape(32, 16, 3)

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(7.0, 5.0), gridspec_kw={"width_ratios": [1, 2.3]})
    ax0.imshow(colour, aspect="auto", interpolation="nearest", extent=(-0.5, 3.5, 127.5, -0.5))
    ax0.set_title("logical tile\nscales[r, c], 128 x 4", fontsize=12.2)
    ax0.set_xlabel("c (scale column)", fontsize=10.8)
    ax0.set_ylabel("r (row)", fontsize=10.8)
    ax0.set_xticks(range(4))
    ax0.set_yticks([0, 32, 64, 96, 127])
    ax0.tick_params(labelsize=9.5)
    for q in range(1, 4):
        ax0.axhline(32 * q - 0.5, color="k", lw=0.8)
    for q in range(4):
        ax0.text(1.5, 32 * q + 15.5, f"q={q}", ha="center", va="center", fontsize=10.8, color="white")

    ax1.imshow(mem, aspect="auto", interpolation="nearest", extent=(-0.5, 15.5, 31.5, -0.5))
    ax1.set_title("memory: 512 bytes, 16 per line\noffset = (r%32)*16 + (r//32)*4 + c", fontsize=12.2)
    ax1.set_xlabel("byte within line  (q*4 + c)", fontsize=10.8)
    ax1.set_ylabel("line = r % 32", fontsize=10.8)
    ax1.set_xticks(range(16))
    ax1.set_yticks([0, 8, 16, 24, 31])
    ax1.tick_params(labelsize=9.5)
    for q in range(1, 4):
        ax1.axvline(4 * q - 0.5, color="k", lw=0.8)
    for b in range(1, 16):
        ax1.axvline(b - 0.5, color="w", lw=0.3)
    for line in (0, 31):
        for q in range(4):
            ax1.text(4 * q + 1.5, line, f"r={line + 32 * q}", ha="center", va="center", fontsize=9.5)
    fig.suptitle("128x4 scale swizzle (cuBLAS / CUTLASS / FlashInfer / torchao / TE)\n"
                 "tiles: (r//128)*ceil(C/4)*512 + (c//4)*512", fontsize=10.8)
    fig.tight_layout()
    fig.savefig(OUT, dpi=100)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
