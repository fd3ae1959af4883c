"""Write the measured tables of docs/exact-regimes.md from bench_exact_regimes.py's JSON (never edited by hand).

    python bench/report_exact_regimes.py [docs/data/exact_regimes_*.json] [--docs docs/exact-regimes.md] [--check]

One section per run, oldest first, under a caption naming its GPU, date and torch version (and each model's wall
time when recorded): (1) per model (shape, scheme, activation) and implementation, the outputs that differ from the
reference out of all outputs (0 in bold: the reference's bits everywhere) and the seconds of the one call, one pair
of columns per token count when the run has several; an implementation that raised shows its error, one skipped
(DeepGEMM absent) says why; (2) per model and planted fault, the outputs that differ and whether equality caught
it; (3) the drawn cases (``--draws``): each draw's parameters and the implementations whose outputs differ.
Replaces the text between ``<!-- exact-regimes:begin -->`` and ``<!-- exact-regimes:end -->``; ``--check`` exits 1
when the page differs from what the JSON gives (a test runs it on the committed JSON).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main, runs_oldest_first  # noqa: E402

BEGIN, END = "<!-- exact-regimes:begin -->", "<!-- exact-regimes:end -->"
PATTERN = "exact_regimes_*.json"

# bench_exact_regimes.py's planted faults (FAULTS), as the table names them
FAULT_NAMES = {
    "skipped_last_k_block": "last K block of GEMM1 skipped (busiest expert)",
    "halved_w2_scale_block": "one 128x128 block of w2 halved (busiest expert)",
    "swapped_topk_weights": "top-k weights of slots 0 and 1 swapped (token 0)",
    "gate_up_swapped": "gate and up swapped (busiest expert)",
    "renormalized_weights": "router weights renormalised",
    "neighbour_expert": "token 0, slot 0 routed to the neighbouring expert",
    "last_bit_noise": "last bit flipped in 0.5% of the outputs",
    "tanh_gelu": "tanh GELU for erf GELU",
    "fastpath_tanh_gelu": "fastpath.moe computing tanh GELU for erf GELU",
    "rz_gemm1_store": "GEMM1 output stored rounding toward zero",
    "rz_intermediate": "intermediate rounded toward zero (FP8 codes, or the bf16 activation store)",
    "rz_output_store": "output stored rounding toward zero",
    "second_gemm2_store": "GEMM2 output stored in bf16 before the top-k sum (two stores)",
}


def _cell(text: str) -> str:
    """``text`` safe inside a markdown table cell (one line, no column separators)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _versions(d: dict) -> str:
    """", CUDA 13.0, DeepGEMM 2.8.2" from the run's meta (runs recorded before the bench kept them: "")."""
    out = ""
    if d.get("cuda") not in (None, "absent"):
        out += f", CUDA {d['cuda']}"
    if d.get("deep_gemm") is not None:
        out += ", DeepGEMM " + ("absent" if d["deep_gemm"] == "absent" else d["deep_gemm"])
    return out


def _date(iso: str) -> str:
    """``2026-11-28T18:46:35+00:00`` -> ``2026-11-28 18:46 UTC`` (other strings unchanged)."""
    if len(iso) >= 16 and iso[10] == "T" and iso.endswith("+00:00"):
        return f"{iso[:10]} {iso[11:16]} UTC"
    return iso


def _command(argv: list, script: str = "bench/bench_exact_regimes.py") -> str:
    """The benchmark's (``script``'s) command line without its ``--out`` (a path on the measuring machine)."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            args.append(a)
    return " ".join(["python " + script, *args])


def _shape(s: dict) -> str:
    distinct = s.get("distinct_experts", s["experts"])
    pool = f" ({distinct} distinct)" if distinct < s["experts"] else ""
    return f"hidden {s['hidden']}, intermediate {s['intermediate']}, {s['experts']} experts{pool}, top-{s['top_k']}"


def _differing(r: dict) -> str:
    if "error" in r:
        return f"not run: {_cell(r['error'])}"
    text = f"{r['differing']:,} of {r['of']:,}"
    return f"**{text}**" if r["differing"] == 0 else text


def _fault(r: dict) -> tuple[str, str]:
    if "error" in r:
        return f"not run: {_cell(r['error'])}", "—"
    return f"{r['differing']:,} of {r['of']:,}", "yes" if r.get("caught") else "**no**"


def _not_run(m: dict) -> str | None:
    """Why a model has no rows (the benchmark recorded an error or an unsupported model), else None."""
    if "error" in m:
        return _cell(m["error"].strip().splitlines()[-1])
    if not m.get("supported", True):
        return _cell(m.get("why", "not supported"))
    if "torch_layer_error" in m:
        return "the torch layer failed: " + _cell(m["torch_layer_error"].strip().splitlines()[-1])
    return None


def _name(m: dict) -> str:
    return m["model"] + (" *(single rounding)*" if m.get("regime") == "single_rounding" else "")


def _by_model(models: list) -> dict:
    """``{name: [entries]}`` in the order the models first appear (one entry per token count)."""
    out: dict = {}
    for m in models:
        out.setdefault(_name(m), []).append(m)
    return out


def _rows(name: str, entries: list, counts: list) -> list:
    """The implementation rows of one model: one (differing, seconds) pair per token count of ``counts`` (None:
    the run's single count)."""
    pad = " | |" * (len(counts) - 1 if counts else 0)
    why = _not_run(entries[0])
    if why is not None:
        return [f"| {name} | | | | — | not run: {why} | |{pad}"]
    at = {e.get("tokens"): e for e in entries} if counts else {None: entries[0]}
    keys = counts or [None]
    impls: list = []
    for e in entries:
        for impl in list(e["implementations"]) + list(e.get("skipped", {})):
            if impl not in impls:
                impls.append(impl)
    s = entries[0]["shape"]
    first = f"| {name} | {_shape(s)} | {s['scheme']} | {s['activation']}"
    out = []
    for impl in impls:
        cells = []
        for t in keys:
            e = at.get(t, {})
            r = e.get("implementations", {}).get(impl)
            if r is not None:
                cells += [_differing(r), f"{r['seconds']:.3f}" if "seconds" in r else ""]
            elif impl in e.get("skipped", {}):
                cells += [f"skipped: {_cell(e['skipped'][impl])}", ""]
            else:
                cells += ["", ""]
        out.append(f"{first} | {_cell(impl)} | " + " | ".join(cells) + " |")
        first = "| | | |"
    return out


def _draw_result(impls: dict) -> tuple[int, str]:
    """(implementations that ran, their differing outputs: **0** in each, else the ones that differ; errors)."""
    ran = {n: r for n, r in impls.items() if "differing" in r}
    diff = [f"{_cell(n)}: {r['differing']:,} of {r['of']:,}" for n, r in ran.items() if r["differing"]]
    text = "; ".join(diff) if diff else "**0** in each"
    errors = [f"{_cell(n)} ({_cell(r['error'])})" for n, r in impls.items() if "error" in r]
    if errors:
        text += "; not run: " + "; ".join(errors)
    return len(ran), text


def _draws(draws: list) -> list:
    out = ["", "Drawn cases (`--draws`): each model's cases drawn by Hypothesis (derandomized; the first draw of "
           "each routing kind first): a token count, a routing kind of `moeref.testing.cases.CASE_KINDS` and its "
           "seed, padding tokens or none, and the EP shards (`moeref.strategies.ep_shards`); token rows of the "
           "model's layer with that routing and power-of-two top-k weights. Every implementation above runs on "
           "each; its EP-shard variants use the drawn shards.", "",
           "| model | draw | tokens | routing, seed | padding | EP shards | implementations | differing outputs |",
           "|---|---|---|---|---|---|---|---|"]
    last = None
    for d in draws:
        name = _name(d)
        if "error" in d:
            out.append(f"| {name} | {d.get('draw', '')} | | | | | — | not run: {_cell(d['error'])} |")
            continue
        p = d["params"]
        n, text = _draw_result(d["implementations"])
        out.append(f"| {name if name != last else ''} | {d['draw']} | {p['tokens']} | {p['routing']}, {p['seed']} | "
                   f"{'yes' if p['padding'] else 'no'} | {p['ep_size']} ({p['ep_strategy']}) | {n} | {text} |")
        last = name
    return out


def section(d: dict) -> list:
    """The lines of one run: the line naming its GPU, date and command, then its tables."""
    gpu = d.get("gpu", "no GPU")
    reduced = {m.get("bf16_reduced_precision_reduction") for m in d["models"]} - {None}
    note = ""
    if reduced == {True}:
        note = " (cuBLAS bf16 reduced-precision reduction allowed, torch's default)"
    elif reduced == {False}:
        note = " (cuBLAS bf16 reduced-precision reduction off)"
    groups = _by_model(d["models"])
    counts = []
    if any(len(v) > 1 for v in groups.values()):
        counts = list(dict.fromkeys(m["tokens"] for m in d["models"] if "tokens" in m))
    out = [f"Measured on an {gpu}, {_date(d['date'])}, torch {d.get('torch', '?')}{_versions(d)}{note}: "
           f"`{_command(d.get('argv', []))}`."]
    if d.get("model_seconds"):
        secs = d["model_seconds"]
        out[-1] += (" Wall time per model (layer construction, weight uploads, references and every call): "
                    + ", ".join(f"{k} {v:.1f} s" for k, v in secs.items())
                    + f"; {sum(secs.values()):.1f} s in all.")
    if any(m.get("regime") == "single_rounding" for m in d["models"]):
        out += ["", "Models marked *(single rounding)* run `moeref.regimes.single_rounding_layer` instead: every "
                "declared store rounds, and GEMM2's output goes into the FP32 top-k sum unstored, so an "
                "implementation that stores it in bf16 differs by design."]
    if counts:
        out += ["", "Each model's layer is built once at the largest token count; a smaller count runs its "
                "first tokens. Planted faults run at the first count."]
        head = "".join(f" {t} tokens: differing outputs | seconds |" for t in counts)
        out += ["", "| model | shape | scheme | activation | implementation |" + head,
                "|---|---|---|---|---" + "|---|---" * len(counts) + "|"]
    else:
        out += ["", "| model | shape | scheme | activation | implementation | differing outputs | seconds |",
                "|---|---|---|---|---|---|---|"]
    faults = []
    for name, entries in groups.items():
        out += _rows(name, entries, counts)
        for m in entries:
            for fault, r in m.get("faults", {}).items():
                faults.append((name, fault, *_fault(r)))
    if faults:
        out += ["", "| model | planted fault | differing outputs | caught by equality |", "|---|---|---|---|"]
        last = None
        for model, name, diff, caught in faults:
            out.append(f"| {model if model != last else ''} | {FAULT_NAMES.get(name, name)} | {diff} | {caught} |")
            last = model
    if d.get("draws"):
        out += _draws(d["draws"])
    return out


def table(runs: list) -> str:
    """The markdown tables of ``runs`` (bench_exact_regimes.py JSON documents, any order), oldest run first."""
    head = ["Each implementation runs the same exact-regime layer (`moeref.regimes.exact_layer`; skewed random "
            "routing, expert weights from a pool of distinct experts, `--expert-pool`) and its bf16 outputs are "
            "compared by equality with the reference: moeref's exact layer on the GPU "
            "(`run_moe(device=\"cuda\")`, bit-identical to the host reference), in which every declared store "
            "rounds an exact value once. In a regime every conforming kernel must give **0** differing outputs. "
            "Seconds: the one call, compilation and autotuning included (not a speed figure). The planted faults "
            "are made in the torch eager layer, except the one named `fastpath.moe` (the fast path's GELU layer run "
            "with tanh GELU where erf is declared)."]
    return runs_oldest_first(runs, section, date=lambda d: d["date"], head=head)


def default_json() -> list:
    """The committed benchmark JSON (what the docs tests check)."""
    return data_files(PATTERN)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_exact_regimes.py", pattern=PATTERN,
                       pages=("exact-regimes.md",), begin=BEGIN, end=END, render=table,
                       json_help="bench_exact_regimes.py --out files")


if __name__ == "__main__":
    sys.exit(main())
