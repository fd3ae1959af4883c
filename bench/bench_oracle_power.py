"""Oracle power: how many subtle planted faults each profile catches, and how tight it is on honest
kernels, measured on the same cases (issue 14).

Cases (``--seeds`` of each kind, hidden ``--hidden``, intermediate ``--inter``, ``--experts`` experts,
``--tokens`` tokens, top-2, softmax routing renormalised):

* ``bf16+bias``: bf16 weights and tokens, SiLU-and-mul, N(0, 0.25) biases b13 and b2;
* ``bf16-gelu``: bf16 weights and tokens, erf-GELU-and-mul, no bias;
* ``fp8``: FP8 E4M3 weights with 128x128 scales, FP8 1x128 activations and intermediate (DeepGEMM).

Per case and profile the bound (:func:`moeref.compare.bounds.layer_bound`) is computed once; every
honest variant (:data:`moeref.compare.subtle_faults.HONEST_BF16`, ``HONEST_HOPPER``) must pass it, and its
``|err| / bound`` is summarised by the median over elements (then the median over variants and cases)
and the maximum; every planted fault (:data:`~moeref.compare.subtle_faults.SUBTLE_FAULTS` and the gross
:data:`~moeref.compare.faults.FAULTS`) counts as caught when one element exceeds the bound. A fault the
layer cannot express (no bias, no scale blocks, another activation) is not counted.

``--baseline DIR`` also evaluates the bounds of another checkout of ``moeref`` (e.g. ``git worktree``
or ``git archive`` of main before this change) on the same cases and candidates, in a subprocess.

Writes JSON (``--out``, default bench/results/oracle_power.json); ``--markdown`` prints the docs table.
Run: ``PYTHONPATH=. .venv/bin/python bench/bench_oracle_power.py [--seeds 2] [--baseline /tmp/base]``
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

import numpy as np

KINDS = ("bf16+bias", "bf16-gelu", "fp8")
PROFILES_OF = {"bf16+bias": ("BF16_OUTPUT",), "bf16-gelu": ("BF16_OUTPUT",),
               "fp8": ("BF16_OUTPUT", "HOPPER_FP8_DEEPGEMM_DATA", "DEEPGEMM_FP8_EXACT")}
EXACT_PROFILES = ("DEEPGEMM_FP8_EXACT",)
"""Equality-level profiles of a known kernel: measured on the subtle faults planted into that kernel's
emulated layer (``subtle_faults(deepgemm_engine())``) and on its honest variants (``HONEST_DEEPGEMM``)."""


def make_case(kind: str, seed: int, hidden: int, inter: int, experts: int, tokens: int):
    """One layer call of ``kind`` (module docstring); built from public moeref functions only, so an older
    checkout builds the same case."""
    import ml_dtypes

    from moeref.compare.faults import LayerCase
    from moeref.moe import MoEQuant, make_layer, make_tokens, quantize_weights
    from moeref.quant import fp8_block, fp8_group
    from moeref.routing import softmax_topk

    bf16 = ml_dtypes.bfloat16
    r = softmax_topk(np.random.default_rng(seed + 2).standard_normal((tokens, experts)), 2, renormalize=True)
    opts = dict(out_dtype=bf16)
    if kind == "bf16+bias":
        lw = make_layer(experts, hidden, inter, seed=seed, dtype=bf16, bias=True)
    elif kind == "bf16-gelu":
        lw = make_layer(experts, hidden, inter, seed=seed, dtype=bf16)
        opts["activation"] = "gelu_and_mul"
    else:
        lw = quantize_weights(make_layer(experts, hidden, inter, seed=seed), fp8_block())
        opts["quant"] = MoEQuant(fp8_group(128), fp8_group(128), "fp8 1x128 x 128x128")
    x = make_tokens(tokens, hidden, seed=seed + 1, dtype=bf16)
    return LayerCase(x, lw, r.weights, r.ids, opts)


def _cases(args):
    return [(kind, seed) for kind in args.kinds for seed in range(args.seeds)]


def bounds_for(args) -> dict:
    """``{(kind, seed, profile): (bound, seconds)}`` with the ``moeref`` on ``sys.path``."""
    from moeref.compare.bounds import PROFILES, layer_bound
    from moeref.compare.faults import reference

    out = {}
    for kind, seed in _cases(args):
        ref = reference(make_case(kind, seed, args.hidden, args.inter, args.experts, args.tokens))
        for prof in PROFILES_OF[kind]:
            if prof not in PROFILES or prof not in args.profiles:  # an older checkout, or not asked for
                continue
            t0 = time.perf_counter()
            b = layer_bound(ref, PROFILES[prof]).bound
            out[(kind, seed, prof)] = (b, time.perf_counter() - t0)
    return out


def _ratio_stats(cand, output, bound) -> dict:
    err = np.abs(np.asarray(cand, dtype=np.float64) - output)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(np.isnan(err), np.inf, err / bound)
    q = np.where((err == 0) & (bound == 0), 0.0, q)
    return {"violations": int(np.count_nonzero(~(q <= 1))), "max": float(np.max(q)),
            "median": float(np.median(q))}


def measure(args) -> dict:
    from moeref.compare.faults import FAULTS, reference
    from moeref.compare.subtle_faults import HONEST_BF16, HONEST_HOPPER, SUBTLE_FAULTS

    try:  # checkouts before the DeepGEMM emulation have no exact profile
        from moeref.compare.subtle_faults import HONEST_DEEPGEMM, subtle_faults
        from moeref.gemm.hopper_fp8 import deepgemm_engine
        exact_tables = (("subtle-deepgemm", subtle_faults(deepgemm_engine())), ("honest-deepgemm", HONEST_DEEPGEMM))
    except ImportError:
        exact_tables = ()

    bounds = {"current": bounds_for(args)}
    if args.baseline:
        bounds["baseline"] = _baseline_bounds(args)
    rows = []
    for kind, seed in _cases(args):
        case = make_case(kind, seed, args.hidden, args.inter, args.experts, args.tokens)
        ref = reference(case)
        cands = {}
        tables = (("subtle", SUBTLE_FAULTS), ("gross", FAULTS), ("honest-bf16", HONEST_BF16),
                  ("honest-hopper", HONEST_HOPPER))
        if kind == "fp8" and any(p in PROFILES_OF[kind] for p in EXACT_PROFILES):
            tables += exact_tables
        for group, table in tables:
            for name, make in table.items():
                try:
                    cands[(group, name)] = make(case)
                except ValueError:  # the layer cannot express this variant
                    continue
        for prof in PROFILES_OF[kind]:
            for which, table in bounds.items():
                if (kind, seed, prof) not in table:
                    continue
                bound, secs = table[(kind, seed, prof)]
                for (group, name), cand in cands.items():
                    exact_group = group.endswith("-deepgemm")
                    if exact_group != (prof in EXACT_PROFILES) and group != "gross":
                        continue
                    if (group.startswith("honest") and not exact_group
                            and (group == "honest-hopper") != prof.startswith("HOPPER")):
                        continue
                    rows.append(dict(kind=kind, seed=seed, profile=prof, bounds=which,
                                     group=group.split("-deepgemm")[0], name=name,
                                     bound_seconds=secs, **_ratio_stats(cand, ref.output, bound)))
                rows.append(dict(kind=kind, seed=seed, profile=prof, bounds=which, group="bound", name="bound",
                                 bound_seconds=secs, median_bound_over_output=float(
                                     np.median(bound / np.maximum(np.abs(ref.output), 1e-300)))))
        print(f"{kind} seed {seed}: {len(cands)} candidates", file=sys.stderr, flush=True)
    return {"config": vars(args), "rows": rows, "summary": summarise(rows)}


def _baseline_bounds(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bounds.pkl")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
        cmd = [sys.executable, os.path.abspath(__file__), "--bounds-only", path] + _passthrough(args)
        subprocess.run(cmd, check=True, env=env, cwd=tmp)
        with open(path, "rb") as f:
            return pickle.load(f)


def _passthrough(args) -> list:
    out = ["--seeds", str(args.seeds), "--hidden", str(args.hidden), "--inter", str(args.inter),
           "--experts", str(args.experts), "--tokens", str(args.tokens), "--kinds", *args.kinds,
           "--profiles", *args.profiles]
    return out


def summarise(rows) -> list:
    """Per (profile, bounds): subtle and gross catch counts, honest false alarms and ratios."""
    out = []
    for key in sorted({(r["profile"], r["bounds"]) for r in rows}):
        sel = [r for r in rows if (r["profile"], r["bounds"]) == key]
        sub = [r for r in sel if r["group"] == "subtle"]
        gross = [r for r in sel if r["group"] == "gross"]
        hon = [r for r in sel if r["group"].startswith("honest")]
        bnd = [r for r in sel if r["group"] == "bound"]
        out.append(dict(profile=key[0], bounds=key[1],
                        subtle_caught=sum(r["violations"] > 0 for r in sub), subtle_total=len(sub),
                        gross_caught=sum(r["violations"] > 0 for r in gross), gross_total=len(gross),
                        honest_false_alarms=sum(r["violations"] > 0 for r in hon), honest_total=len(hon),
                        honest_median_ratio=float(np.median([r["median"] for r in hon])) if hon else None,
                        honest_max_ratio=float(max(r["max"] for r in hon)) if hon else None,
                        median_bound_over_output=float(np.median([r["median_bound_over_output"] for r in bnd])),
                        bound_seconds=float(np.median([r["bound_seconds"] for r in bnd]))))
    return out


def markdown(result: dict) -> str:
    """The docs tables: per profile, then per subtle fault."""
    lines = ["| profile | bounds | subtle faults caught | gross faults caught | honest false alarms | "
             "honest median / max \\|err\\|/bound | median bound / \\|out\\| |", "|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(f"| `{s['profile']}` | {s['bounds']} | {s['subtle_caught']} / {s['subtle_total']} | "
                     f"{s['gross_caught']} / {s['gross_total']} | {s['honest_false_alarms']} / {s['honest_total']} | "
                     f"{s['honest_median_ratio']:.3f} / {s['honest_max_ratio']:.3f} | "
                     f"{s['median_bound_over_output']:.4f} |")
    rows = [r for r in result["rows"] if r["group"] == "subtle"]
    cols = sorted({(r["profile"], r["bounds"]) for r in rows})
    lines += ["", "| subtle fault | " + " | ".join(f"{p} ({b})" for p, b in cols) + " |",
              "|---|" + "---|" * len(cols)]
    for name in dict.fromkeys(r["name"] for r in rows):
        cells = []
        for col in cols:
            sel = [r for r in rows if r["name"] == name and (r["profile"], r["bounds"]) == col]
            cells.append(f"{sum(r['violations'] > 0 for r in sel)} / {len(sel)}" if sel else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--profiles", nargs="+", default=sorted({p for v in PROFILES_OF.values() for p in v}),
                    help="profiles to measure (default: all)")
    ap.add_argument("--baseline", help="directory holding another checkout's moeref package")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "oracle_power.json"))
    ap.add_argument("--markdown", action="store_true", help="print the docs tables")
    ap.add_argument("--from-json", help="only print the tables of an earlier --out file")
    ap.add_argument("--bounds-only", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bounds_only:  # the --baseline subprocess
        with open(args.bounds_only, "wb") as f:
            pickle.dump(bounds_for(args), f)
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            print(markdown(json.load(f)))
        return 0
    result = measure(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    if args.markdown:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
