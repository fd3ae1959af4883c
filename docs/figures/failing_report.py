"""Render a failing kernel report (docs/figures/failing_report.svg).

The bf16 eager-torch MoE layer of docs/test-your-kernel.md with its planted bug (the last partial tile
of 8 tokens loses its last top-k slot), checked under TORCH_EAGER_BF16; the report is printed by rich
and exported as SVG, so the picture is exactly what a terminal shows.

Run from the repository root: ``python docs/figures/failing_report.py``.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moeref.moe import make_layer, make_tokens  # noqa: E402
from moeref.routing import softmax_topk  # noqa: E402
from moeref.testing import MoEMismatch, assert_moe_close, kernel_inputs  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "failing_report.svg")


def my_moe(hidden_states, w1, w2, topk_weights, topk_ids, drop_tail=False):
    out = torch.zeros_like(hidden_states)
    m, k = topk_ids.shape
    for j in range(k):
        part = torch.zeros_like(hidden_states)
        for e in torch.unique(topk_ids[:, j]).tolist():
            rows = (topk_ids[:, j] == e).nonzero().flatten()
            if drop_tail and j == k - 1:
                rows = rows[rows < m - m % 8]
            gate, up = (hidden_states[rows] @ w1[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[e].T
            part[rows] = (y.float() * topk_weights[rows, j, None]).to(torch.bfloat16)
        out = out + part
    return out


def main() -> None:
    lw = make_layer(8, 256, 128, seed=0)
    r = softmax_topk(np.random.default_rng(0).standard_normal((13, 8)), 2, renormalize=True)
    ki = kernel_inputs(make_tokens(13, 256), lw, r.weights, r.ids, dtype="bfloat16")
    try:
        assert_moe_close(my_moe(**ki.torch(), drop_tail=True), ki, "TORCH_EAGER_BF16", label="my_moe (tail bug)")
    except MoEMismatch as exc:
        console = Console(record=True, width=118, force_terminal=True)
        console.print(exc.report)
        console.save_svg(OUT, title="moeref: a failing kernel report")
        print(f"wrote {OUT}")
        return
    raise SystemExit("the planted bug was not caught")


if __name__ == "__main__":
    main()
