"""Write the planted-fault tables of docs/error-bounds.md from bench_fault_catch.py's JSON (never edited by hand).

    python bench/report_fault_catch.py [docs/data/fault_catch_*.json] [--docs docs/error-bounds.md] [--check]

One section per run, oldest first, under a caption naming its machine (GPU, else CPU), date, torch (and CUDA)
version, tree and command: (1) per check (the mixed default, the exact regime only, the declared profile only, the
emulated profile; the single-rounding regime only where the run has it), the planted faults caught, the false
alarms on honest variants, and the median time of one check next to the reference's own; (2) per layer, the reference's and each check's time; (3) per planted fault, which
checks caught it (a fault the mixed default misses in bold); (4) per honest variant, the false alarms of each
check. Replaces the text between ``<!-- fault-catch:begin -->`` and ``<!-- fault-catch:end -->``; ``--check``
exits 1 when the page differs from what the JSON gives (a test runs it on the committed JSON).
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main, runs_oldest_first  # noqa: E402
from bench.report_exact_regimes import _cell, _command, _date  # noqa: E402

BEGIN, END = "<!-- fault-catch:begin -->", "<!-- fault-catch:end -->"
PATTERN = "fault_catch_*.json"

CHECKS = {  # JSON key -> (name in the tables, what it runs)
    "mixed": ("mixed (the default)", "equality on the exact-regime and single-rounding cases, and the declared "
              "profile's bound on the general case"),
    "exact": ("exact regime only", "equality on the exact-regime case"),
    "single_rounding": ("single-rounding regime only", "equality on the single-rounding case (layers whose declared "
                        "profile admits one)"),
    "declared": ("declared profile only", "the declared profile's sound bound on the general case"),
    "emulated": ("emulated profile", "the emulated kernel's profile on the general case (input faults around the "
                 "emulated kernel; layers with an emulation)"),
}


def _secs(x) -> str:
    """Seconds with their unit, three significant digits below 10 s ("—" when not measured)."""
    if x is None:
        return "—"
    return f"{x:.3g} s" if x < 10 else f"{x:.1f} s"


def _pct(a: int, b: int) -> str:
    return f"{a} / {b} ({100.0 * a / b:.0f} %)" if b else "—"


def _machine(d: dict) -> str:
    m = d["meta"]
    where = m.get("gpu") or f"{m.get('cpu', 'CPU')} (CPU)"
    ver = f"torch {m.get('torch', '?')}" + (f", CUDA {m['cuda']}" if m.get("cuda") else "")
    return f"{where}, {_date(m['date'])}, {ver}, tree {m.get('tree', '?')}"


def _shape(s: dict) -> str:
    return (f"hidden {s['hidden']}, intermediate {s['intermediate']}, {s['experts']} experts, top-{s['top_k']}, "
            f"{s['tokens']} tokens")


def _mark(check: dict | None) -> str:
    if check is None:
        return "n/a"
    return "caught" if check["caught"] else "—"


def section(d: dict) -> list:
    cmd = _command(d["meta"].get("argv", []), "bench/bench_fault_catch.py")
    out = [f"Measured on {_machine(d)}: `{cmd}` ({_shape(d['shape'])}; {d['meta'].get('seconds', '?')} s in all).",
           "", "| check | what it runs | planted faults caught | false alarms (honest variants) | "
           "time per check (median) | the reference's own time (median) |", "|---|---|---|---|---|---|"]
    s = d["summary"]
    for key, (name, what) in CHECKS.items():
        r = s.get(key)
        if not r or not r["faults"] and not r["honest"]:
            continue
        if key == "mixed" and "single_rounding" not in s:  # a run from before the single-rounding cases
            what = "equality on the exact-regime case, and the declared profile's bound on the general case"
        out.append(f"| {name} | {what} | {_pct(r['caught'], r['faults'])} | {r['false_alarms']} / {r['honest']} | "
                   f"{_secs(r['median_seconds'])} | {_secs(s.get('reference_median_seconds'))} |")
    out += ["", "| layer | scheme, activation | declared profile | emulated profile | reference, exact case | "
            "reference, single-rounding case | reference, general case | equality (median) | declared bound | "
            "emulated bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for info in d["layers"]:
        if "error" in info:
            out.append(f"| {info['layer']} | not run: {_cell(info['error'].strip().splitlines()[-1])} | | | | | | | | |")
            continue
        eq = [f["checks"]["exact"]["seconds"] for f in d["faults"] + d["honest"]
              if f["layer"] == info["layer"] and "exact" in f["checks"]]
        ref, bnd = info["reference_seconds"], info["bound_seconds"]
        emu = info.get("emulated") or ("error: " + _cell(info["emulated_error"]) if info.get("emulated_error")
                                       else "—")
        sr = _secs(ref["single_rounding"]) if "single_rounding" in ref else (
            "none: " + _cell(info["single_rounding"]) if info.get("single_rounding") else "—")
        out.append(f"| {info['layer']} | {info['scheme']}, {info['activation']} | `{info['declared']}` | "
                   f"{'`' + emu + '`' if info.get('emulated') else emu} | {_secs(ref.get('exact'))} | {sr} | "
                   f"{_secs(ref.get('general'))} | {_secs(statistics.median(eq) if eq else None)} | "
                   f"{_secs(bnd.get('declared'))} | {_secs(bnd.get('emulated'))} |")
    out += ["", "| layer | planted fault | planted as | exact regime | single-rounding regime | declared profile | "
            "emulated profile | mixed |", "|---|---|---|---|---|---|---|---|"]
    last = None
    for f in d["faults"]:
        ch = f["checks"]
        if "error" in f:
            out.append(f"| {f['layer'] if f['layer'] != last else ''} | {_cell(f['what'])} | {f['level']} | "
                       f"not run: {_cell(f['error'])} | | | | |")
        else:
            mixed = ch.get("mixed")
            cell = "caught" if mixed and mixed["caught"] else "**missed**"
            out.append(f"| {f['layer'] if f['layer'] != last else ''} | {_cell(f['what'])} | {f['level']} | "
                       f"{_mark(ch.get('exact'))} | {_mark(ch.get('single_rounding'))} | {_mark(ch.get('declared'))} | "
                       f"{_mark(ch.get('emulated'))} | {cell} |")
        last = f["layer"]
    names = list(dict.fromkeys(h["name"] for h in d["honest"]))
    out += ["", "| honest variant | layers | false alarms: exact regime | single-rounding regime | declared profile | "
            "emulated profile |", "|---|---|---|---|---|---|"]
    for name in names:
        rows = [h for h in d["honest"] if h["name"] == name]
        cells = []
        for key in ("exact", "single_rounding", "declared", "emulated"):
            got = [h["checks"][key]["caught"] for h in rows if key in h["checks"]]
            cells.append(f"{sum(got)} / {len(got)}" if got else "n/a")
        errs = sum("error" in h for h in rows)
        layers = ", ".join(h["layer"] for h in rows) + (f" ({errs} not run)" if errs else "")
        out.append(f"| {_cell(rows[0]['what'])} | {layers} | " + " | ".join(cells) + " |")
    return out


def table(runs: list) -> str:
    """The markdown of ``runs`` (bench_fault_catch.py JSON documents, any order), oldest run first."""
    head = ["Each planted fault and honest variant runs on up to three cases per layer: one in the exact regime "
            "(`moeref.regimes.exact_layer`, Zipf-skewed routing, experts from a pool of 8; in the FP8 layers the "
            "odd quantization groups reversed and their scales staggered, `boundary_groups`), one in the "
            "single-rounding regime where the declared profile admits one (`moeref.regimes.single_rounding_layer` "
            "with the profile's stores, GEMM2's bf16 store included: `single_rounding_stores`) and one general "
            "(random weights, N(0, 1) bf16 tokens, top-k weights that do not sum to 1). *Caught*: an exact-regime or "
            "single-rounding output differs from the reference's bits, or an element of the general output lies "
            "beyond the bound. "
            "Time per check: the equality, or the bound (computed once per case) and the comparison; the "
            "reference's own time is one `run_moe` call. *inputs* faults change what the kernel is given or "
            "returns (so they also wrap the emulated kernel); *internal* faults replace one step of the torch "
            "layer."]
    return runs_oldest_first(runs, section, date=lambda d: d["meta"]["date"], head=head)


def default_json() -> list:
    """The committed benchmark JSON (what the docs tests check)."""
    return data_files(PATTERN)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_fault_catch.py", pattern=PATTERN,
                       pages=("error-bounds.md",), begin=BEGIN, end=END, render=table,
                       json_help="bench_fault_catch.py --out files")


if __name__ == "__main__":
    sys.exit(main())
