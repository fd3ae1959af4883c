"""Write the cost table of an emulated profile's `compare` (docs/hopper-fp8-accumulation.md) from
bench_compare_device.py ``--sources`` JSON (never edited by hand).

    python bench/report_compare_sources.py [docs/data/compare_sources_*.json] \\
        [--docs docs/hopper-fp8-accumulation.md] [--check]

Per run (oldest first) a caption naming its GPU, date, torch and Triton versions, tree, profile and command, then
one row per token count and source of the block accumulators (:data:`moeref.gemm.device_hopper_fp8.ACCUMULATOR_SOURCE`):
the reference's and ``compare``'s medians over the interleaved rounds (min-max), the median of the per-round ratios
compare / reference, whether the source's report has the first source's bits; then, for the tensor cores, where
one compare's emulated GEMMs go (the tensor-core kernels, the proof with its emulator run) and what is left of the
median compare. Replaces the text between ``<!-- compare-sources:begin -->`` and ``<!-- compare-sources:end -->``;
``--check`` exits 1 when the page differs from what the JSON gives (a test runs it on the committed JSON).
"""
from __future__ import annotations

import os
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main, runs_oldest_first  # noqa: E402
from bench.report_exact_regimes import _date  # noqa: E402

BEGIN, END = "<!-- compare-sources:begin -->", "<!-- compare-sources:end -->"
PATTERN = "compare_sources_*.json"
SOURCE_NAMES = {"tensor_cores": "tensor cores", "emulator": "emulator (CUDA cores)"}


def _s(x: float) -> str:
    """Seconds: three decimals below 1 s, two below 10 s, one above."""
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def _range(case: dict) -> str:
    return f"{_s(case['median_s'])} ({_s(case['min_s'])}-{_s(case['max_s'])})"


def command(d: dict) -> str:
    """The benchmark's command line, rebuilt from what the JSON records (``--check-rows 0`` where no row has the
    bound's check)."""
    m, rows = d["meta"], d["rows"]
    args = ["python -m bench compare", f"--profile {m['profile']}",
            "--tokens " + " ".join(str(r["tokens"]) for r in rows)]
    if not any("check" in r for r in rows):
        args.append("--check-rows 0")
    args += ["--sources " + " ".join(rows[0]["sources"]), f"--rounds {m['rounds']}"]
    return " ".join(args)


def section(d: dict) -> list:
    m = d["meta"]
    out = [f"Measured on an {m['gpu']}, {_date(m['date'])}, torch {m.get('torch', '?')}, "
           f"triton {m.get('triton', '?')}, tree {m.get('tree', '?')}: `{command(d)}`. The reference is "
           "`run_moe(device=\"cuda\")`; `compare` of its "
           f"run under `{m['profile']}`, median (min-max) of {m['rounds']} interleaved rounds in seconds; *x*: the "
           "median of the per-round ratios compare / reference. The candidate is the reference's own bf16 output "
           "(`compare`'s work does not depend on its values; under an equality-level profile it fails, not being "
           "the emulated kernel's bits). *Same bits*: the report's bound and error equal the first source's bit for "
           "bit; *passed*: the report's verdict.", "",
           "| tokens | block accumulators from | reference, s | compare, s | x | same bits | passed |",
           "|---|---|---|---|---|---|---|"]
    costs = []
    for r in d["rows"]:
        cases = r["timing"]["cases"]
        frac = Fraction(r["check_fraction"]).limit_denominator(1 << 20)
        for i, s in enumerate(r["sources"]):
            name = SOURCE_NAMES.get(s, s)
            if s == "tensor_cores":
                name += f" (each call proves {frac} of its rows, at least {r['min_check_rows']}, on the emulator)"
            same = {True: "yes", False: "**no**"}.get(r.get("same_bits", {}).get(s), "—")
            out.append(f"| {r['tokens'] if i == 0 else ''} | {name} | {_range(cases['reference']) if i == 0 else ''} | "
                       f"{_range(cases['compare ' + s])} | **{r['compare_over_reference ' + s]:.1f}x** | {same} | "
                       f"{r.get('passed ' + s, '—')} |")
            c = r.get(f"cost {s}")
            if c:
                costs.append((r["tokens"], s, c, cases["compare " + s]["median_s"]))
    if costs:
        out += ["", "Where one more `compare` with the tensor cores spends its emulated GEMMs (each part timed between "
                "two device synchronisations, in a call outside the rounds); *rest*: the median compare less the "
                "tensor-core kernels and the proofs: compare's other stages (the re-quantization, the combinations of "
                "GEMM2's uncertain codes and their promotion, the centers, the check of the elements), not broken "
                "down by this run:", "",
                "| tokens | source | accumulator kernels: calls, rows, s | proofs: calls, rows, s (their emulator run) "
                "| rest of the median compare, s |", "|---|---|---|---|---|"]
        for tokens, s, c, med in costs:
            k = "tensor_core"
            out.append(f"| {tokens} | {SOURCE_NAMES.get(s, s)} | {c[k + '_calls']}, {c[k + '_rows']:,}, "
                       f"{_s(c[k + '_s'])} | {c['proof_calls']}, {c['proved_rows']:,}, {_s(c['proof_s'])} "
                       f"({_s(c['emulator_s'])}) | {_s(med - c[k + '_s'] - c['proof_s'])} |")
    return out


def table(runs: list) -> str:
    """The markdown of ``runs`` (bench_compare_device.py ``--sources`` JSON documents, any order), oldest first."""
    return runs_oldest_first(runs, section, date=lambda d: d["meta"]["date"])


def default_json() -> list:
    """The committed benchmark JSON (what the docs tests check)."""
    return data_files(PATTERN)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_compare_sources.py",
                       pattern=PATTERN, pages=("hopper-fp8-accumulation.md",), begin=BEGIN, end=END,
                       render=table, json_help="bench_compare_device.py --sources --out files")


if __name__ == "__main__":
    sys.exit(main())
