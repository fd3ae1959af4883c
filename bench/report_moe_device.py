"""Write the GPU MoE tables of docs/moe-gpu.md from bench_moe_device.py's JSON (never edited by hand).

    python bench/report_moe_device.py [RUN.json ...] [--docs docs/moe-gpu.md] [--check]

(no JSON given: the committed runs, ``docs/data/moe_device_*.json``, in name order). Later files add sections
(:func:`merge`). Replaces the text between ``<!-- moe-device:begin -->`` and ``<!-- moe-device:end -->``;
``--check`` exits 1 when the page differs from what the JSON gives (a test runs it on the committed JSON).
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import report_main  # noqa: E402

BEGIN, END = "<!-- moe-device:begin -->", "<!-- moe-device:end -->"


def _tiles_text(tiles: str) -> str:
    """``GemmTiles(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)`` as ``64x128x128 w4 s4``."""
    m = re.fullmatch(r"GemmTiles\(block_m=(\d+), block_n=(\d+), block_k=(\d+), num_warps=(\d+), num_stages=(\d+)\)",
                     tiles)
    return f"{m[1]}x{m[2]}x{m[3]} w{m[4]} s{m[5]}" if m else tiles


def tables(data: dict) -> str:
    m = data["meta"]
    out = [f"Measured on an {m['gpu']}, {m['date']}, torch {m['torch']}, triton {m['triton']}; DeepSeek-V3 layer "
           f"(hidden 7168, intermediate 2048, {m['experts']} experts, top-8, FP8 1x128 x 128x128), "
           f"{m['weights_gib']:.1f} GiB of FP8 weight codes; median of {m['rounds']} interleaved rounds (min-max).", "",
           "**The exact reference on the GPU** (`run_moe(device=\"cuda\")`, the NumPy engine's result bit for bit):", "",
           "| tokens | time, s | min-max | expert GEMM work | peak extra GPU memory |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        out.append(f"| {r['tokens']} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} | "
                   f"{r['expert_tflop']:.2f} TFLOP | {r['peak_extra_gib']:.1f} GiB |")
    if data.get("compare"):
        cm = data.get("compare_meta") or m
        out += ["", "**`compare`** of `fastpath.moe` against that reference under `HOPPER_FP8_DEEPGEMM_DATA`, the bound "
                "on the GPU (`moeref.compare.device.layer`), beside the reference's own time in the same rounds "
                "(medians); peak extra GPU memory of the comparison; host synchronizations of one bound "
                f"(torch's sync debug mode); measured on an {cm['gpu']}, {cm['date']}, {cm['rounds']} interleaved "
                "rounds:", "",
                "| tokens | fast path | reference, s | compare, s | bound, s | compare / reference | passed | "
                "host syncs | peak extra GPU memory |", "|---|---|---|---|---|---|---|---|---|"]
        for r in data["compare"]:
            syncs = r.get("bound_host_syncs", "not counted")
            out.append(f"| {r['tokens']} | {r['impl']} | {r['reference_s']:.3f} | {r['compare_s']:.3f} | "
                       f"{r['bound_s']:.3f} | {r['compare_over_reference']:.1f}x | {r['passed']} | {syncs} | "
                       f"{r['peak_compare_gib']:.1f} GiB |")
    if data.get("variants"):
        out += ["", "Its paths, forced one at a time (same bits; interleaved rounds):", "",
                "| tokens | path | time, s |", "|---|---|---|"]
        for r in data["variants"]:
            out.append(f"| {r['tokens']} | {r['variant']} | {r['median_s']:.3f} |")
    layers = data.get("layers") or ([(data["layer"], data.get("layer_meta") or {})] if data.get("layer") else [])
    for rows, meta in layers:  # one table per run (each file's own GPU, date and cases)
        out += layer_tables(rows, meta)
    if not layers and data.get("fast"):
        out += ["", "**`fastpath.moe`** (whole layer, contiguous layout) and its two grouped GEMMs alone; the HBM "
                "roofline reads the touched experts' weights once at the measured copy bandwidth:", "",
                "| tokens | layout rows | implementation | layer, ms | GEMMs, ms | GEMM TFLOPS | roofline / layer | "
                "GEMMs / layer |", "|---|---|---|---|---|---|---|---|"]
        for r in data["fast"]:
            for impl in ("deep_gemm", "triton"):
                if f"layer_{impl}_ms" in r:
                    out.append(f"| {r['tokens']} | {r['rows']} | {impl} | {r[f'layer_{impl}_ms']:.2f} | "
                               f"{r[f'gemms_{impl}_ms']:.2f} | {r[f'gemms_{impl}_tflops']:.0f} | "
                               f"{r[f'layer_{impl}_of_roofline']:.0%} | {r[f'gemms_over_layer_{impl}']:.0%} |")
    if data.get("sweep"):
        out += ["", "Triton FP8 grouped GEMM (GEMM1 shape, 4096 tokens) by tile, against DeepGEMM:", "",
                "| tiles (MxNxK, warps, stages) | ms | TFLOPS | x DeepGEMM |", "|---|---|---|---|"]
        for r in data["sweep"]:
            out.append(f"| {_tiles_text(r['tiles'])} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['of_deep_gemm']:.2f} |")
    if data.get("bf16"):
        out += ["", "bf16 grouped GEMM: Triton (128-row aligned segments) against `torch._grouped_mm` (CUTLASS, "
                "tight segments), TFLOPS on the real rows:", "",
                "| GEMM | tiles | Triton TFLOPS | _grouped_mm TFLOPS | ratio |", "|---|---|---|---|---|"]
        for r in data["bf16"]:
            out.append(f"| {r['gemm']} | {r['tiles']} | {r['triton_tflops']:.0f} | {r['grouped_mm_tflops']:.0f} | "
                       f"{r['ratio']:.2f} |")
    if data.get("w4"):
        w = data["w4_meta"]
        out += ["", f"**4-bit weights (W4A16)**: `fastpath.grouped_gemm_w4` against the bf16 Triton grouped GEMM at "
                f"gpt-oss-120b shapes (K 2880, 128 experts, top-4, contiguous layout, bf16 activations), measured on "
                f"an {w['gpu']}, {w['date']}, torch {w['torch']}, triton {w['triton']}; median (min-max) of {w['rounds']} "
                "interleaved rounds, ⚠ where the spread exceeds 10%; TFLOPS on the real rows; x bf16: the median of "
                "the per-round ratios:", "",
                "| GEMM | tokens | kernel | ms | TFLOPS | x bf16 |", "|---|---|---|---|---|---|"]
        for r in data["w4"]:
            flag = " ⚠" if r["flagged"] else ""
            out.append(f"| {r['gemm']} | {r['tokens']} | {r['kernel']} | {r['ms']:.3f} ({r['min_ms']:.3f}-"
                       f"{r['max_ms']:.3f}){flag} | {r['tflops']:.0f} | {r['of_bf16']:.2f} |")
    return "\n".join(out)


CASE_TEXT = {
    "layer": "eager, default call (2 host syncs)",
    "layer_capturable": "eager, `capturable=True`",
    "layer_masked": "eager, masked, `capturable=True`",
    "layer_cached": "eager, default call, graph cache (1 host sync)",
    "layer_masked_cached": "eager, masked, `capturable=True`, graph cache",
    "graph_contiguous": "CUDA graph, contiguous",
    "graph_masked": "CUDA graph, masked",
    "gemms": "the two grouped GEMMs alone",
    "before": "the `--before` layer, eager",
}
IMPL_TEXT = {"deep_gemm": "DeepGEMM", "triton": "Triton", "torch": "torch"}


def _case_label(name: str) -> tuple[str, str]:
    """(implementation, what) of a case name such as ``graph_deep_gemm_masked``."""
    if name == "torch_compile":
        return "torch", "`torch.compile` of the layer in torch ops (bf16 weights)"
    for impl in ("deep_gemm", "triton"):
        if impl in name:
            key = name.replace(f"_{impl}", "")
            return impl, CASE_TEXT.get(key, key)
    return "", name


def layer_tables(rows: list, meta: dict) -> list:
    out = ["", f"**`fastpath.moe`, the whole layer**, measured on an {meta.get('gpu')}, {meta.get('date')}, driver "
           f"{meta.get('driver')}, CUDA {meta.get('cuda')}, torch {meta.get('torch')}, triton {meta.get('triton')}: median "
           f"(min-max) of {meta.get('rounds')} interleaved rounds (`bench.interleaved`) of {meta.get('calls_per_round')} "
           "back-to-back calls timed with CUDA events, ⚠ where the spread exceeds 10%. Roofline (in brackets after the "
           "token count): the touched experts' FP8 weight codes read once at the measured copy bandwidth; of roofline "
           "= roofline / time. GEMMs / layer: the median of the per-round ratios of the two grouped GEMMs alone (same "
           "implementation) to the case. The default call checks `topk_ids` on the host and sizes the layout from the "
           "counts (two host syncs); `capturable=True` has no host sync."
           + (f" Tree: {meta['tree']}." if meta.get("tree") else "")
           + (f" The `--before` layer: `{meta['before']}`." if meta.get("before") else "")]
    impls = sorted({_case_label(n)[0] for r in rows if "cases" in r for n in r["cases"]})
    for impl_name in impls:
        out += ["", f"{IMPL_TEXT.get(impl_name, impl_name)}:", "",
                "| tokens (roofline) | case | ms | of roofline | GEMMs / layer |", "|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                out.append(f"| {r['tokens']} | failed: {r['error'][:120]} | | | |")
                continue
            for name in sorted(r["cases"]):
                impl, what = _case_label(name)
                if impl != impl_name:
                    continue
                c = r["cases"][name]
                ratio = r["ratios"].get(name, {}).get(f"gemms_{impl}")
                flag = " ⚠" if c["flagged"] else ""
                out.append(f"| {r['tokens']} ({r['roofline_ms']:.2f} ms) | {what} | {c['median_ms']:.3f} "
                           f"({c['min_ms']:.3f}-{c['max_ms']:.3f}){flag} | {c['of_roofline']:.0%} | "
                           f"{'' if ratio is None or name.startswith('gemms') else f'{ratio:.2f}'} |")
    notes = {r["tokens"]: r.get("notes", {}) for r in rows if r.get("notes")}
    if notes:
        out += ["", "Checks made in the same run (bit equality with `torch.equal`; the torch.compile layer's relative "
                "L2 difference from the fast path):", ""]
        for m, n in notes.items():
            out.append(f"- {m} tokens: " + ", ".join(f"{k} = {v:.2e}" if isinstance(v, float) else f"{k} = {v}"
                                                     for k, v in n.items()))
    return out


def merge(runs: list[dict]) -> dict:
    """One document from ``runs`` (bench_moe_device.py JSON, in order): a later run's non-empty sections replace
    an earlier one's, except the whole-layer runs (``layer``, ``layer_meta``), which each keep their own table
    (``layers``, in order); ``compare_meta`` is the ``meta`` of the run that gave the compare table."""
    data: dict = {"layers": []}
    for part in runs:
        if part.get("layer"):  # each run of the whole layer keeps its own table
            data["layers"].append((part["layer"], part.get("layer_meta") or {}))
        if part.get("compare"):  # the compare table names its own run
            data["compare_meta"] = part["meta"]
        data.update({k: v for k, v in part.items() if v and k not in ("layer", "layer_meta")})
    return data


def render(runs: list[dict]) -> str:
    """The generated part of the page: the tables of the runs merged (:func:`merge`)."""
    return tables(merge(runs))


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_moe_device.py",
                       pattern="moe_device_*.json", pages=("moe-gpu.md",), begin=BEGIN, end=END, render=render,
                       json_help="bench_moe_device.py JSON files (later files add sections; each file's whole-layer "
                       "run gets its own table, in the order given)")


if __name__ == "__main__":
    sys.exit(main())
