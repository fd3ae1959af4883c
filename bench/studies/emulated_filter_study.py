"""Study: can an interval filter replace the Hopper FP8 emulation for most outputs? (CPU, NumPy, about a minute.)

The idea: the emulated accumulator of a 128-column block differs from the block's exact sum by the cuts of the
aligned adder (:mod:`moeref.gemm.hopper_fp8`); bound that difference per block, carry ``exact -+ delta`` through
the FP32 promotion and emulate only the outputs whose interval straddles a bf16 rounding boundary. This script
measures, on GEMMs of DeepSeek-V3's K (7168: GEMM1, 2048: GEMM2), how many bf16 outputs **the tightest such
interval** would decide: ``delta`` is the sum of the *actual* magnitudes of every cut (each aligned addend's
residual and each normalisation's), which needs the emulation itself; any bound computed without emulating is at
least as wide, so it decides at most as many. Also: the share of outputs whose emulated bf16 value differs from
the bf16 rounding of the exact result, and a separable bound a filter could compute without emulating,
``33 * 2^(EA + EB - 13)`` per 32-column step (``EA``/``EB``: the largest operand exponents of the step's row and
column) plus ``2^-13`` of the step's exact sum for the normalisation: optimistic (a sound one must also follow the
running accumulator, which can set the alignment and is what gets normalised), so a sound separable bound decides
at most as many.

Data: ``gaussian`` (N(0, 1) activations, N(0, 0.02) weights, quantized to E4M3 with 1x128 / 128x128 amax scales,
as a model's layer) and ``codes`` (uniform random E4M3 codes, power-of-two scales: bench_compare_device's layer).

    python bench/studies/emulated_filter_study.py [--rows 16] [--cols 128] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def _data(kind: str, m: int, n: int, k: int, rng):
    import ml_dtypes

    e4 = ml_dtypes.float8_e4m3fn
    nb = k // 128
    if kind == "gaussian":
        x = rng.standard_normal((m, nb, 128))
        sa = np.abs(x).max(axis=2) / 448
        a = (x / sa[:, :, None]).astype(e4).astype(np.float64).reshape(m, k)
        w = rng.standard_normal((n, nb, 128)) * 0.02
        sb = np.abs(w).max(axis=(0, 2)) / 448  # one 128-row block of columns (n <= 128)
        b = (w / sb[None, :, None]).astype(e4).astype(np.float64).reshape(n, k)
    else:
        ca = rng.integers(0, 256, (m, k)).astype(np.uint8)
        ca[(ca & 0x7F) == 0x7F] -= 1
        cb = rng.integers(0, 256, (n, k)).astype(np.uint8)
        cb[(cb & 0x7F) == 0x7F] -= 1
        a, b = ca.view(e4).astype(np.float64), cb.view(e4).astype(np.float64)
        sa = np.exp2(rng.integers(-8, -4, (m, nb)).astype(np.float64))
        sb = np.exp2(rng.integers(-14, -10, nb).astype(np.float64))
    sa = sa.astype(np.float32).astype(np.float64)
    sbn = np.repeat(sb.astype(np.float32).astype(np.float64)[None], n, axis=0)
    return a, sa, b, sbn


def study(kind: str, m: int, n: int, k: int, seed: int = 0) -> dict:
    import ml_dtypes

    from moeref.gemm.hopper_fp8 import HOPPER_FP8_MMA, deepgemm_block_accumulators, operand_exponents, promote

    rng = np.random.default_rng(seed)
    a, sa, b, sbn = _data(kind, m, n, k, rng)
    nb, model = k // 128, HOPPER_FP8_MMA
    acc = deepgemm_block_accumulators(a, b)
    emu = promote(acc, sa, sbn)
    blocks = (a.reshape(m, 1, nb, 128) * b.reshape(1, n, nb, 128)).sum(axis=-1)  # exact: < 2^53
    exact = (blocks * sa[:, None, :] * sbn[None]).sum(axis=-1)
    # the cuts, step by step, as moeref.gemm.hopper_fp8.mma_accumulate makes them (checked against it below)
    steps = k // model.inst_k
    pa, pb = a.reshape(m, 1, steps, model.inst_k), b.reshape(1, n, steps, model.inst_k)
    prod = pa * pb
    ep = operand_exponents(pa) + operand_exponents(pb)
    ideal = np.zeros((m, n, nb))
    cheap = np.zeros((m, n, nb))
    ea = operand_exponents(a).reshape(m, steps, model.inst_k).max(axis=-1)
    eb = operand_exponents(b).reshape(n, steps, model.inst_k).max(axis=-1)
    cur = np.zeros((m, n))
    per = 128 // model.inst_k
    for s in range(steps):
        if s % per == 0:
            cur = np.zeros((m, n))
        e = np.maximum(ep[:, :, s].max(axis=-1), np.where(cur != 0, np.frexp(cur)[1] - 1, -2000))
        q = e - model.align_bits
        terms = np.concatenate([prod[:, :, s], cur[..., None]], axis=-1)
        cut = np.ldexp(np.trunc(np.ldexp(terms, -q[..., None])), q[..., None])
        v = cut.sum(axis=-1)
        mant, ex = np.frexp(v)
        nv = np.ldexp(np.trunc(np.ldexp(mant, model.norm_bits)), ex - model.norm_bits)
        ideal[:, :, s // per] += np.abs(terms - cut).sum(axis=-1) + np.abs(v - nv)
        step_exact = np.abs(prod[:, :, s].sum(axis=-1))
        cheap[:, :, s // per] += (33 * np.exp2(ea[:, None, s] + eb[None, :, s] - model.align_bits)
                                  + step_exact * 2.0 ** (1 - model.norm_bits))
        cur = nv
    assert np.array_equal(cur, acc[:, :, -1]), "the study's steps differ from moeref.gemm.hopper_fp8"
    bf = lambda x: x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    out = dict(kind=kind, rows=m, cols=n, k=k, outputs=m * n,
               bf16_differs_from_exact=float(np.mean(bf(emu) != bf(exact))))
    for name, d in (("ideal", ideal), ("cheap", cheap)):
        rad = (d * sa[:, None, :] * sbn[None]).sum(axis=-1) * (1 + 2.0**-20) + np.abs(exact) * 2.0**-50
        decided = bf(exact - rad) == bf(exact + rad)
        out[f"decided_by_{name}_interval"] = float(np.mean(decided))
        assert np.all(bf(emu)[decided] == bf(exact - rad)[decided]), "an interval missed the emulated value"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--cols", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [study(kind, args.rows, args.cols, k) for kind in ("gaussian", "codes") for k in (7168, 2048)]
    print("| data | K | outputs | emulated bf16 != bf16(exact) | decided by the tightest interval | "
          "decided by the separable bound |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['k']} | {r['outputs']} | {r['bf16_differs_from_exact']:.1%} | "
              f"{r['decided_by_ideal_interval']:.1%} | {r['decided_by_cheap_interval']:.1%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
