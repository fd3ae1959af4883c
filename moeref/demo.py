"""The MoE part of ``moeref demo``: a small random layer, the reference in two schemes, an honest and a
broken variant, and the error-bounded report that catches the broken one where tolerances do not.

``run_demo(console, seed=0) -> int`` prints with ``rich`` and returns 0 when the honest variant passes
and every planted fault fails (the demo doubles as a smoke test).
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

__all__ = ["run_demo", "demo_case"]


def demo_case(seed: int = 0, out_scale: float = 1.0):
    """A DeepSeek-like layer in miniature: 8 experts, top-2, hidden 256, intermediate 128, 16 tokens,
    FP8 1x128 activations x 128x128 weights (DeepGEMM), structured tokens. ``out_scale`` scales w2
    (``2e-3`` gives outputs ~1e-2, the size of vLLM's randn/10 tests)."""
    from .compare.faults import LayerCase
    from .quant import fp8_block, fp8_group
    from .routing import softmax_topk
    from .moe import MoEQuant
    from .moe import make_layer, make_tokens, quantize_weights

    lw = make_layer(8, 256, 128, seed=seed)
    if out_scale != 1.0:
        lw = replace(lw, w2=[w * np.float32(out_scale) for w in lw.w2])
    x = make_tokens(16, 256, seed=seed + 1)
    r = softmax_topk(np.random.default_rng(seed + 2).standard_normal((16, 8)), 2, renormalize=True)
    fp8 = LayerCase(x, quantize_weights(lw, fp8_block()), r.weights, r.ids,
                    dict(quant=MoEQuant(fp8_group(128), fp8_group(128), "FP8 1x128 x 128x128"), out_dtype=np.float32))
    bf16 = LayerCase(x, lw, r.weights, r.ids, dict(out_dtype=np.float32))
    return bf16, fp8


def run_demo(console, seed: int = 0) -> int:
    from rich.table import Table
    from rich.text import Text

    from .compare import FP32_ACCUM, HOPPER_FP8_DEEPGEMM_DATA, compare, conventional_checks, metrics
    from .compare.faults import FAULTS, HONEST, reference

    bf16, fp8 = demo_case(seed)
    t0 = time.perf_counter()
    ref_bf16 = reference(bf16)
    t1 = time.perf_counter()
    ref_fp8 = reference(fp8)
    t2 = time.perf_counter()
    tab = Table(title="reference layer: 16 tokens, 8 experts, top-2, hidden 256, intermediate 128")
    for c in ("scheme", "max |out|", "vs float layer (rel L2)", "time"):
        tab.add_column(c)
    tab.add_row("float (bf16/fp32 weights)", f"{np.abs(ref_bf16.output).max():.3f}", "-", f"{(t1 - t0) * 1e3:.1f} ms")
    tab.add_row("FP8 1x128 x 128x128 (DeepGEMM)", f"{np.abs(ref_fp8.output).max():.3f}",
                f"{metrics(ref_fp8.output, ref_bf16.output)['rel_l2']:.3g}", f"{(t2 - t1) * 1e3:.1f} ms")
    console.print(tab)

    honest_name = "fp32 chunks of 32"
    honest = compare(HONEST[honest_name](fp8), ref_fp8, FP32_ACCUM, label=f"honest kernel ({honest_name})")
    console.print(honest)
    broken = compare(FAULTS["token 0 routed to a wrong expert"](fp8), ref_fp8, FP32_ACCUM,
                     label="broken kernel (token 0 on a wrong expert)")
    console.print(broken)

    small_bf16, small = demo_case(seed, out_scale=2e-3)
    ref_small = reference(small)
    ft = Table(title="planted faults, outputs ~1e-2 (vLLM test scale): bound check vs tolerances")
    for c in ("fault", "bounds [FP32_ACCUM]", "bounds [Hopper FP8, data]", "vLLM atol=2e-2",
              "modular 3e-2/3e-2", "calc_diff<1e-3"):
        ft.add_column(c)
    all_caught = True

    def cell(ok: bool, good_is_pass: bool = False) -> Text:
        return Text("pass", style="green" if good_is_pass else "red") if ok else Text("FAIL", style="green")

    for name, make in FAULTS.items():
        cand = make(small)
        rep = compare(cand, ref_small, FP32_ACCUM, label=name)
        hop = compare(cand, ref_small, HOPPER_FP8_DEEPGEMM_DATA, label=name)
        conv = conventional_checks(cand, ref_small.output)
        all_caught &= not rep.passed
        hop_cell = Text("within", style="yellow") if hop.passed else Text("FAIL", style="green")
        ft.add_row(name, cell(rep.passed), hop_cell, *(cell(v) for v in conv.values()))
    console.print(ft)
    console.print("[dim]'pass' in red: the check let the fault through. 'within' (Hopper FP8): the fault moves "
                  "the output less than a 14-bit accumulator may, so no sound check can call it wrong. "
                  "Bounds: docs/error-bounds.md[/dim]")
    return 0 if honest.passed and not broken.passed and all_caught else 1
