"""What cheaper per-step summaries cost the aligned-adder bound in tightness (issue 13, CPU study).

The data-dependent Hopper bound (:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound`, docs/error-bounds.md
"Hopper: the worst case and the data-dependent bound") needs, per output element and 32-column MMA step ``j``,
``max|P_j|`` (the step's largest product), ``n_j`` (its nonzero products) and ``S_j`` (the exact step sum). Only
``S_j`` is a matmul; the other two are per-product work. This study replaces them by upper bounds that need no
per-product work and measures what that costs:

* ``rank1`` (a): ``max|P_j| <= max_step |a| * max_step |w|`` per (row, output column);
  ``n_j <= min(nonzero a in the step, nonzero w in the step)``: per-step row and column summaries only.
* ``expsum`` (b): in the exact domain (unscaled FP8/FP4 elements ``x = s 2^e``, ``s`` in [1, 2),
  ``e = floor(log2|x|)``, so ``|a w| < 2^(e_a + e_w + 2)``), ``p2(max|P_j|) <= 2^(m_j + 1)``
  with ``m_j = max over nonzero products of
  (e_a + e_w)``; ``m_j = floor(floor(log2 sum_i 2^(6 e_a,i) 2^(6 e_w,i)) / 6)``, a matmul of powers (computed here
  in float32, i.e. any order and FP32 rounding). ``n_j`` exact, as a matmul of nonzero indicators. In the scaled
  form (GEMM2 with an operand radius, or scale blocks shorter than a chunk) it is ``rank1``.
* ``expsum_minn``: ``expsum`` with ``rank1``'s ``n_j``.
* ``min_both``: both bounds are upper bounds of ``p2(max|P_j|)``, so their minimum is one:
  ``min(2^(m_j + 1), p2(max|a| max|w|))`` in the exact domain, ``rank1``'s ``n_j``; ``rank1`` in the scaled form.

Every variant only replaces ``max|P_j|`` (or ``p2`` of it) and ``n_j`` by upper bounds; every term of the
recurrence is monotone in both (``p2``, ``max``, ``+``, ``*`` by positive numbers, and their float64 roundings),
so each variant is >= the current bound elementwise, hence sound under the same hardware model. The study
checks that on every GEMM it evaluates (``min variant/current >= 1``), and checks that its own copy of the
recurrence with the ``min_both`` summaries reproduces the library's bound bit for bit (adopted 2026-11-25: since then
:func:`~moeref.compare.gemm_bounds.aligned_adder_gemm_bound` is ``min_both``, and the study's "current" is its own
copy of the per-product definition it started from; docs/data/adder_summaries_study.json was written before the
change, when the check compared the per-product copy with the library).

Two measurements:

1. ``gemm``: FP8 1x128 x 128x128 operands (``moeref.quant.quantize`` with ``fp8_group(128)`` / ``fp8_block()``)
   of Gaussian data with per-block magnitudes (2^U(-3, 3) per activation 1x128 group, 2^U(-2, 2) per weight
   128x128 block), with and without outlier activation columns (8 columns x 50): median and max of
   ``variant / current`` and median ``bound / |exact output|``.
2. ``layer``: the FP8 cases of ``bench/bench_oracle_power.py`` (its default sizes) under
   ``HOPPER_FP8_DEEPGEMM_DATA``, the bound computed with each variant monkeypatched into
   ``moeref.compare.gemm_bounds.aligned_adder_gemm_bound`` (pseudo profile names ``...+variant``, so the bench's
   own ``measure`` builds the candidates once and scores every variant on them).

Run: ``PYTHONPATH=. .venv/bin/python bench/studies/study_adder_summaries.py [--seeds 2] [--rows 256]``; writes
``docs/data/adder_summaries_study.json``; ``--from-json FILE`` prints the docs tables.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

import moeref.compare.gemm_bounds as gb
from moeref.compare.aligned_adder import _grid_exact, _grid_scaled, adder_operands, adder_rows, adder_step_sums

VARIANTS = ("rank1", "expsum", "expsum_minn", "min_both")
LIBRARY = gb.aligned_adder_gemm_bound
"""moeref's bound: since 2026-11-25 the ``min_both`` summaries (the study's recommendation, adopted)."""
LAMBDA = 6
"""Power of the exponent matmul: a step has at most 32 = 2^5 nonzero products, so the sum of
``2^(LAMBDA (e_a + e_w))`` lies in ``[2^(LAMBDA m), 2^(LAMBDA m + 5)]`` (the top when all 32 share the largest
exponent sum), below the next group's ``2^(LAMBDA (m + 1))`` only when ``LAMBDA >= 6`` (with room for FP32 rounding
of the sum). For E4M3 (``e`` in [-9, 8]) ``6 (e_a + e_w)`` spans [-108, 96]: FP32's normal range."""


def _exponent(x: np.ndarray) -> np.ndarray:
    """``floor(log2|x|)`` (int64; 0 where ``x == 0``, masked by the callers)."""
    return (np.frexp(x)[1] - 1).astype(np.int64)


def _max_exponent_sum(ac, bd, r0, r1) -> np.ndarray:
    """``m_j`` per (row, column, chunk, step), -huge where no product is nonzero: the matmul of powers
    ``2^(6 e)`` in float32, checked against the direct maximum over the products."""
    pa = np.where(ac[r0:r1] != 0, np.ldexp(np.float32(1), LAMBDA * _exponent(ac[r0:r1])), 0).astype(np.float32)
    pw = np.where(bd != 0, np.ldexp(np.float32(1), LAMBDA * _exponent(bd)), 0).astype(np.float32)
    s = np.einsum("rcsi,ncsi->rncs", pa, pw, dtype=np.float32)
    m = np.where(s > 0, np.floor_divide(_exponent(s.astype(np.float64)), LAMBDA), -(1 << 20))
    ea = np.where(ac[r0:r1] != 0, _exponent(ac[r0:r1]), -(1 << 20))
    ew = np.where(bd != 0, _exponent(bd), -(1 << 20))
    direct = (ea[:, None] + ew[None, :]).max(axis=-1)
    direct = np.where(direct > -(1 << 19), direct, -(1 << 20))
    if not np.array_equal(m, direct):
        raise AssertionError("the exponent matmul disagrees with the direct maximum")
    return m


def _per_product(op, r0, r1):
    """The summaries of the definition the study started from: each step's largest product (ignoring NaN) and its
    nonzero products, per product ``[rb, N, nch, steps]``."""
    shape = (r1 - r0, op.bd.shape[0]) + op.ac.shape[1:3]
    p_max, cnt = np.zeros(shape), np.zeros(shape)
    for i in range(op.st.mma):
        pa = op.au[r0:r1, None, :, :, i] * op.bd_abs[None, :, :, :, i]
        p_max = np.where(pa > p_max, pa, p_max)
        cnt = cnt + (pa != 0)
    return p_max, cnt


def variant_adder_bound(a, w, profile, radius, b_abs, variant: str = "rank1") -> np.ndarray:
    """:func:`moeref.compare.gemm_bounds.aligned_adder_gemm_bound` with the per-step summaries of ``variant``
    (module docstring; ``per_product``: the definition before the change): its operands, step sums and recurrence
    (:func:`~moeref.compare.gemm_bounds.adder_operands`, ``adder_step_sums``, ``adder_rows``); only the grid of
    ``max|P_j|`` and ``n_j`` change."""
    m, k = a.values.shape
    n = w.values.shape[0]
    if m == 0 or n == 0 or k == 0:
        return LIBRARY(a, w, profile, radius, b_abs)
    op = adder_operands(a, w, profile, radius)
    grid = _grid_exact if op.exact else _grid_scaled
    a_max, w_max = op.au.max(axis=-1), op.bd_abs.max(axis=-1)               # [M|N, nch, steps]: rank-1 summaries
    a_nz, w_nz = (op.au != 0).sum(axis=-1), (op.bd_abs != 0).sum(axis=-1)
    use_exp = variant in ("expsum", "expsum_minn", "min_both") and op.exact
    out = np.empty((m, n))
    for r0, r1 in op.row_blocks():
        t_s, t_d = adder_step_sums(op, r0, r1)
        if variant == "per_product":
            p_max, cnt = _per_product(op, r0, r1)
        else:
            p_max = a_max[r0:r1, None] * w_max[None]
            if variant == "expsum":  # exact count: a matmul of nonzero indicators
                cnt = np.einsum("rcsi,ncsi->rncs", (op.au[r0:r1] != 0).astype(np.float64),
                                (op.bd_abs != 0).astype(np.float64))
            else:
                cnt = np.minimum(a_nz[r0:r1, None], w_nz[None]).astype(np.float64)
        top = grid(p_max)
        if use_exp:  # p2(max|P_j|) <= 2^(m_j + 1)
            mj = _max_exponent_sum(op.ac, op.bd, r0, r1)
            pw2 = np.where(mj > -(1 << 19), np.ldexp(1.0, np.maximum(mj, -1000) + 1), 0.0)
            top = np.minimum(pw2, top) if variant == "min_both" else pw2
        out[r0:r1] = adder_rows(op, r0, t_s, t_d, top, cnt, b_abs)
    return out * (1.0 + 1e-9)


def CURRENT(a, w, profile, radius, b_abs):
    """The bound before the change: the per-product summaries (the study's baseline, "current" in its tables)."""
    return variant_adder_bound(a, w, profile, radius, b_abs, "per_product")


def _ratio(v, c) -> dict:
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(c > 0, v / c, np.where(v > 0, np.inf, 1.0))
    return {"min": float(q.min()), "median": float(np.median(q)), "max": float(q.max())}


# ---------------------------------------------------------------- 1. GEMM level

def make_operands(m: int, n: int, k: int, seed: int, outliers: bool):
    """FP8 1x128 activations and 128x128 weights (module docstring)."""
    from moeref.quant import fp8_block, fp8_group, quantize

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.repeat(2.0 ** rng.uniform(-3, 3, (m, -(-k // 128))), 128, axis=1)[:, :k]
    if outliers:
        x[:, rng.choice(k, 8, replace=False)] *= 50.0
    wb = 2.0 ** rng.uniform(-2, 2, (-(-n // 128), -(-k // 128)))
    w = 0.02 * rng.standard_normal((n, k)) * np.repeat(np.repeat(wb, 128, axis=0), 128, axis=1)[:n, :k]
    return quantize(x, fp8_group(128)), quantize(w, fp8_block())


def gemm_study(args) -> list:
    from moeref.compare.bounds import PROFILES
    from moeref.gemm.exact import as_operand, block_gemm

    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    rows = []
    for k in args.ks:
        for outliers in (False, True):
            qa, qw = make_operands(args.rows, args.cols, k, seed=k + outliers, outliers=outliers)
            a, w = as_operand(qa, "a"), as_operand(qw, "w")
            b0 = np.zeros(args.cols)
            t0 = time.perf_counter()
            cur = CURRENT(a, w, prof, None, b0)
            row = dict(k=k, rows=args.rows, cols=args.cols, outliers=outliers, current_seconds=time.perf_counter() - t0)
            out = np.abs(block_gemm(qa, qw))
            row["current_bound_over_out"] = float(np.median(cur / np.maximum(out, 1e-300)))
            if k <= args.copy_check_k:  # the study's min_both (exponents from the matmul) is the library's bound
                lib = LIBRARY(a, w, prof, None, b0)
                row["min_both_is_library"] = bool(np.array_equal(variant_adder_bound(a, w, prof, None, b0, "min_both"), lib))
            for v in VARIANTS:
                b = variant_adder_bound(a, w, prof, None, b0, v)
                row[v] = dict(ratio=_ratio(b, cur), bound_over_out=float(np.median(b / np.maximum(out, 1e-300))))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------- 2. layer level

PROFILE = "HOPPER_FP8_DEEPGEMM_DATA"


def layer_study(args) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/
    import bench_oracle_power as bop

    from moeref.compare.bounds import PROFILES, layer_bound
    from moeref.compare.faults import reference

    gemm_calls = {v: {"gemm1": [], "gemm2": []} for v in VARIANTS}
    layer_ratio = {}
    state = {"variant": None}

    def patched(a, w, profile, radius, b_abs):
        cur = CURRENT(a, w, profile, radius, b_abs)
        if state["variant"] is None:
            return cur
        b = variant_adder_bound(a, w, profile, radius, b_abs, state["variant"])
        gemm_calls[state["variant"]]["gemm1" if radius is None else "gemm2"].append(_ratio(b, cur))
        return b

    def bounds_for(bargs) -> dict:
        out = {}
        gb.aligned_adder_gemm_bound = patched
        try:
            for kind, seed in bop._cases(bargs):
                ref = reference(bop.make_case(kind, seed, bargs.hidden, bargs.inter, bargs.experts, bargs.tokens))
                base = None
                for v in (None,) + VARIANTS:
                    state["variant"] = v
                    t0 = time.perf_counter()
                    bnd = layer_bound(ref, PROFILES[PROFILE]).bound
                    secs = time.perf_counter() - t0
                    out[(kind, seed, PROFILE if v is None else f"{PROFILE}+{v}")] = (bnd, secs)
                    if v is None:
                        base = bnd
                    else:
                        layer_ratio.setdefault(v, []).append(_ratio(bnd, base))
                state["variant"] = None
        finally:
            gb.aligned_adder_gemm_bound = LIBRARY
        return out

    bop.bounds_for = bounds_for
    bop.PROFILES_OF = dict(bop.PROFILES_OF, fp8=(PROFILE,) + tuple(f"{PROFILE}+{v}" for v in VARIANTS))
    bargs = argparse.Namespace(seeds=args.seeds, hidden=args.hidden, inter=args.inter, experts=args.experts,
                               tokens=args.tokens, kinds=["fp8"], profiles=[PROFILE], baseline=None)
    res = bop.measure(bargs)

    def agg(lst):
        return {"calls": len(lst), "min": min((r["min"] for r in lst), default=None),
                "median_of_medians": float(np.median([r["median"] for r in lst])) if lst else None,
                "max": max((r["max"] for r in lst), default=None)}

    faults = {}
    for r in res["rows"]:
        if r["group"] in ("subtle", "gross"):
            v = r["profile"].split("+")[1] if "+" in r["profile"] else "current"
            faults.setdefault(f"{r['group']}: {r['name']} (seed {r['seed']})", {})[v] = r["max"]
    return {"config": vars(bargs), "summary": res["summary"], "fault_max_err_over_bound": faults,
            "gemm_ratio": {v: {g: agg(c) for g, c in d.items()} for v, d in gemm_calls.items()},
            "layer_bound_ratio": {v: agg(r) for v, r in layer_ratio.items()}}


# ---------------------------------------------------------------- tables

def markdown(result: dict) -> str:
    lines = ["| K | outlier columns | current bound / \\|out\\| | "
             + " | ".join(f"{v}: median / max ratio, bound / \\|out\\|" for v in VARIANTS) + " |",
             "|---|---|---|" + "---|" * len(VARIANTS)]
    for r in result.get("gemm", []):
        cells = [f"{r[v]['ratio']['median']:.3f} / {r[v]['ratio']['max']:.3f}, {r[v]['bound_over_out']:.4f}" for v in VARIANTS]
        lines.append(f"| {r['k']} | {'yes' if r['outliers'] else 'no'} | {r['current_bound_over_out']:.4f} | "
                     + " | ".join(cells) + " |")
    lay = result.get("layer")
    if lay:
        lines += ["", "| bound | subtle caught | gross caught | honest false alarms | median / max honest \\|err\\|/bound "
                  "| median bound / \\|out\\| | GEMM1 median / max ratio | GEMM2 median / max ratio | layer median / max ratio |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s in lay["summary"]:
            v = s["profile"].split("+")[1] if "+" in s["profile"] else "current"
            g = lay["gemm_ratio"].get(v)
            lr = lay["layer_bound_ratio"].get(v)
            fmt = (lambda d: f"{d['median_of_medians']:.3f} / {d['max']:.3f}" if d and d["calls"] else "-")
            lines.append(f"| {v} | {s['subtle_caught']} / {s['subtle_total']} | {s['gross_caught']} / {s['gross_total']} | "
                         f"{s['honest_false_alarms']} / {s['honest_total']} | {s['honest_median_ratio']:.4f} / "
                         f"{s['honest_max_ratio']:.4f} | {s['median_bound_over_output']:.4f} | "
                         f"{fmt(g['gemm1']) if g else '1 / 1'} | {fmt(g['gemm2']) if g else '1 / 1'} | "
                         f"{fmt(lr) if lr else '1 / 1'} |")
        faults = lay.get("fault_max_err_over_bound", {})
        names = ["current"] + list(VARIANTS)
        differ = {f: d for f, d in faults.items() if len({d.get(v, 0) > 1 for v in names}) > 1}
        if differ:
            lines += ["", "| fault caught by some bounds only (max \\|err\\|/bound) | " + " | ".join(names) + " |",
                      "|---|" + "---|" * len(names)]
            for f, d in differ.items():
                lines.append(f"| {f} | " + " | ".join(f"{d[v]:.3f}" if v in d else "-" for v in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[512, 2048, 7168])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--copy-check-k", type=int, default=2048, help="check min_both against the library up to this K")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--skip", choices=("gemm", "layer"), action="append", default=[])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "data",
                                                  "adder_summaries_study.json"))
    ap.add_argument("--from-json")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print(markdown(json.load(f)))
        return 0
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    result = {"machine": f"CPU ({model}, {os.cpu_count()} cores shared)", "date": "2026-11-25",
              "config": vars(args)}
    if "gemm" not in args.skip:
        result["gemm"] = gemm_study(args)
    if "layer" not in args.skip:
        result["layer"] = layer_study(args)
    bad = [r for r in result.get("gemm", []) for v in VARIANTS if r[v]["ratio"]["min"] < 1]
    bad += [(v, g) for v, d in result.get("layer", {}).get("gemm_ratio", {}).items() for g, c in d.items()
            if c["calls"] and c["min"] < 1]
    result["variant_below_current"] = len(bad)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    if bad:
        print("VARIANT BELOW CURRENT:", bad, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
