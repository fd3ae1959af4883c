"""Reproducer: a float64 ``tl.dot`` accumulator zeroed inside a flat loop (``if s % 2 == 0: acc = 0``) gives wrong
sums in rows 8-15 of a 16-row tile on an H100 / H200 with Triton 3.6, where the same loop written as two nested loops
(the accumulator made fresh in the outer one) and plain float64 dots are exact.

The bound kernel :mod:`moeref.compare.device._adder_mma` had the flat form until 2026-11-28 (its chunks' accumulators
restarted with ``if j == 0``); it now has the nested form. Operands are small integers and halves, so every sum is
exact and any order gives the same bits: a difference from torch's float64 product is a wrong result, not a
rounding. Prints and writes (``--out``) the wrong rows of each variant. GPU only.

    python bench/studies/repro_f64_dot_loop_reset.py [--out bench_out/repro_f64_dot_loop_reset.json]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _load_w(w_ptr, code_ptr, tab_ptr, col, rn, BN: tl.constexpr, CODES: tl.constexpr):
    """The ``[MP, BN]`` float64 operand: loaded, or decoded from uint8 codes through a table (the codes through an
    impure move, as moeref.compare.device._adder_mma does: a float64 MMA fed by 8-bit loads does not compile otherwise)."""
    if CODES:
        code = tl.load(code_ptr + col[:, None] * BN + rn[None, :]).to(tl.int32)
        code = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [code], dtype=tl.int32, is_pure=False, pack=1)
        return tl.load(tab_ptr + code)
    return tl.load(w_ptr + col[:, None] * BN + rn[None, :])


@triton.jit
def _kernel(a_ptr, w_ptr, code_ptr, tab_ptr, c_ptr, K, STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            MP: tl.constexpr, NESTED: tl.constexpr, CODES: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    kk = tl.arange(0, MP)
    tot = tl.zeros((BM, BN), dtype=tl.float64)
    if NESTED:
        for ch in range(0, STEPS // 2):
            acc = tl.zeros((BM, BN), dtype=tl.float64)
            for j in range(0, 2):
                col = (2 * ch + j) * MP + kk
                a = tl.load(a_ptr + rm[:, None] * K + col[None, :])
                acc = acc + tl.dot(a, _load_w(w_ptr, code_ptr, tab_ptr, col, rn, BN, CODES))
                tot = tot + acc
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float64)
        for s in range(0, STEPS):
            if s % 2 == 0:
                acc = tl.zeros((BM, BN), dtype=tl.float64)
            col = s * MP + kk
            a = tl.load(a_ptr + rm[:, None] * K + col[None, :])
            acc = acc + tl.dot(a, _load_w(w_ptr, code_ptr, tab_ptr, col, rn, BN, CODES))
            tot = tot + acc
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], tot)


def _reference(a, w, steps: int, mp: int):
    tot = torch.zeros((a.shape[0], w.shape[1]), dtype=torch.float64, device=a.device)
    acc = torch.zeros_like(tot)
    for s in range(steps):
        acc = torch.zeros_like(tot) if s % 2 == 0 else acc
        acc = acc + a[:, s * mp:(s + 1) * mp] @ w[s * mp:(s + 1) * mp]
        tot = tot + acc
    return tot


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/repro_f64_dot_loop_reset.json")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(1)
    bm, bn, mp, steps = 16, 64, 32, 4
    a = torch.randint(-6, 7, (bm, steps * mp), device="cuda", generator=gen).double()
    codes = torch.randint(100, 157, (steps * mp, bn), device="cuda", generator=gen).to(torch.uint8)
    table = (torch.arange(256, device="cuda").double() - 128.0) * 0.5
    w = table[codes.long()].contiguous()
    want = _reference(a, w, steps, mp)
    res = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__, variants={})
    for codes_in, nested, warps in [(c, n, wp) for c in (False, True) for n in (False, True) for wp in (1, 2, 4, 8)]:
        key = f"{'nested' if nested else 'flat'} loop, {warps} warps, {'codes' if codes_in else 'float64'} operand"
        got = torch.empty_like(want)
        try:
            _kernel[(1,)](a, w, codes, table, got, steps * mp, STEPS=steps, BM=bm, BN=bn, MP=mp, NESTED=nested,
                          CODES=codes_in, num_warps=warps, num_stages=1)
        except Exception as e:  # noqa: BLE001 - a variant Triton cannot compile is reported
            res["variants"][key] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            print(f"{key}: {res['variants'][key]['error']}", flush=True)
            continue
        rows = sorted({int(r) for r in (got != want).any(dim=1).nonzero().reshape(-1).tolist()})
        res["variants"][key] = dict(wrong_rows=rows, wrong=int((got != want).sum()), of=int(want.numel()))
        print(f"{key}: wrong rows {rows}", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
