"""The MoE part of ``moeref demo``: a small random layer, the reference in two schemes, an honest and a
broken variant, and the error-bounded report that catches the broken one where tolerances do not.

``run_demo(console, seed=0) -> int`` prints with ``rich`` and returns 0 when the honest variant passes
and every planted fault fails (the demo doubles as a smoke test).
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

__all__ = ["run_demo", "demo_case", "demo_data", "demo_json", "fault_table"]


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


#: The checks of the planted-fault table: (key in :func:`demo_data`, wide header, narrow header).
FAULT_CHECKS = (
    ("bounds FP32_ACCUM", "bounds [FP32_ACCUM]", "bounds\nFP32_ACCUM"),
    ("bounds Hopper FP8 data", "bounds [Hopper FP8, data]", "bounds\nHopper FP8\ndata"),
    ("vLLM atol=2e-2", "vLLM atol=2e-2", "vLLM\natol=2e-2"),
    ("modular 3e-2/3e-2", "modular 3e-2/3e-2", "modular\n3e-2/3e-2"),
    ("calc_diff<1e-3", "calc_diff<1e-3", "calc_diff\n<1e-3"),
)
#: What a cell of the planted-fault table says (words, so that it reads without colour too).
VERDICTS = {
    "caught": "the check failed the faulty output, as it should",
    "MISSED": "the check passed the faulty output: it let the fault through",
    "within": "Hopper FP8: the fault moves the output less than a 14-bit accumulator may, so no "
              "sound check can call it wrong",
}


def demo_data(seed: int = 0, progress=None) -> dict:
    """Everything the MoE part of the demo shows, as plain data (``moeref demo --json``).

    ``progress(text)``: called before each slow step (the command shows it on a terminal).

    Returns ``{"reference": [row, ...], "honest": report, "broken": report, "faults": [row, ...],
    "passed": bool}``: the reference layer in two schemes (max |out|, rel L2 against the float
    layer, milliseconds), the honest and the broken kernel's :class:`~moeref.compare.Report`
    objects, and per planted fault the verdict of each check of :data:`FAULT_CHECKS`
    (:data:`VERDICTS`); ``passed`` is True when the honest kernel passes and every fault fails the
    FP32_ACCUM bound check.
    """
    from .compare import FP32_ACCUM, HOPPER_FP8_DEEPGEMM_DATA, compare, conventional_checks, metrics
    from .compare.faults import FAULTS, HONEST, reference

    say = progress or (lambda text: None)
    say("running the reference layer in two schemes")
    bf16, fp8 = demo_case(seed)
    t0 = time.perf_counter()
    ref_bf16 = reference(bf16)
    t1 = time.perf_counter()
    ref_fp8 = reference(fp8)
    t2 = time.perf_counter()
    rows = [
        {"scheme": "float (bf16/fp32 weights)", "max |out|": float(np.abs(ref_bf16.output).max()),
         "rel L2 vs float layer": None, "ms": (t1 - t0) * 1e3},
        {"scheme": "FP8 1x128 x 128x128 (DeepGEMM)", "max |out|": float(np.abs(ref_fp8.output).max()),
         "rel L2 vs float layer": float(metrics(ref_fp8.output, ref_bf16.output)["rel_l2"]),
         "ms": (t2 - t1) * 1e3},
    ]
    say("checking an honest and a broken kernel")
    honest_name = "fp32 chunks of 32"
    honest = compare(HONEST[honest_name](fp8), ref_fp8, FP32_ACCUM, label=f"honest kernel ({honest_name})")
    broken = compare(FAULTS["token 0 routed to a wrong expert"](fp8), ref_fp8, FP32_ACCUM,
                     label="broken kernel (token 0 on a wrong expert)")
    say(f"checking {len(FAULTS)} planted faults")
    _, small = demo_case(seed, out_scale=2e-3)
    ref_small = reference(small)
    faults = []
    for name, make in FAULTS.items():
        cand = make(small)
        rep = compare(cand, ref_small, FP32_ACCUM, label=name)
        hop = compare(cand, ref_small, HOPPER_FP8_DEEPGEMM_DATA, label=name)
        conv = list(conventional_checks(cand, ref_small.output).values())
        verdicts = ["caught" if not rep.passed else "MISSED",
                    "caught" if not hop.passed else "within"]
        verdicts += ["caught" if not ok else "MISSED" for ok in conv]
        faults.append({"fault": name, **{k: v for (k, _, _), v in zip(FAULT_CHECKS, verdicts)}})
    passed = honest.passed and not broken.passed and all(
        f["bounds FP32_ACCUM"] == "caught" for f in faults)
    return {"reference": rows, "honest": honest, "broken": broken, "faults": faults, "passed": passed}


def demo_json(data: dict) -> dict:
    """:func:`demo_data` with the reports as :meth:`~moeref.compare.Report.to_dict` (strict JSON)."""
    return dict(data, honest=data["honest"].to_dict(), broken=data["broken"].to_dict(),
                verdicts=dict(VERDICTS))


def fault_table(faults: list[dict]):
    """rich renderable of the planted-fault rows of :func:`demo_data`: one table, or at 80 columns
    the same with headers over several lines (:class:`moeref._console.Fit`)."""
    from rich.table import Table
    from rich.text import Text

    from ._console import Fit, compact_table

    colour = {"caught": "green", "MISSED": "bold red", "within": "yellow"}
    title = "planted faults, outputs ~1e-2 (vLLM test scale): bound check vs tolerances"
    wide = Table(title=title)
    narrow = compact_table(title=title)
    wide.add_column("fault")
    narrow.add_column("fault", ratio=1)
    for _, w, n in FAULT_CHECKS:
        wide.add_column(w)
        narrow.add_column(n, no_wrap=True)
    for f in faults:
        cells = [Text(f[k], style=colour[f[k]]) for k, _, _ in FAULT_CHECKS]
        wide.add_row(f["fault"], *cells)
        narrow.add_row(f["fault"], *cells)
    return Fit(wide, narrow)


def run_demo(console, seed: int = 0) -> int:
    """Print the MoE part of the demo on ``console``; 0 when :func:`demo_data` passed, else 1."""
    from contextlib import nullcontext

    from rich.table import Table
    from rich.text import Text

    status = console.status("") if console.is_terminal else nullcontext()
    with status as live:
        data = demo_data(seed, progress=(lambda text: live.update(text + " ...")) if live else None)
    tab = Table(title="reference layer: 16 tokens, 8 experts, top-2, hidden 256, intermediate 128")
    for c in ("scheme", "max |out|", "vs float layer (rel L2)", "time"):
        tab.add_column(c)
    for r in data["reference"]:
        rel = r["rel L2 vs float layer"]
        tab.add_row(r["scheme"], f"{r['max |out|']:.3f}", "-" if rel is None else f"{rel:.3g}",
                    f"{r['ms']:.1f} ms")
    console.print(tab)
    console.print(data["honest"])
    console.print(data["broken"])
    console.print(fault_table(data["faults"]))
    console.print(Text("; ".join(f"{k}: {v}" for k, v in VERDICTS.items())
                       + ". Bounds: docs/error-bounds.md", style="dim"))
    return 0 if data["passed"] else 1
