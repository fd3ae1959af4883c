"""Benchmark: the exact-domain aligned-adder bound of GEMM1 (issue 13) at DeepSeek-V3 shapes, the kernel alone.

GEMM1 of the DeepSeek-V3 layer (bench/bench_moe_device.py ``deepseek_v3_layer``: 256 experts, N = 4096, K = 7168,
random E4M3 weight codes with 128x128 block scales; activations random E4M3 codes with 1x128 scales, a random
top-8 routing) under HOPPER_FP8_DEEPGEMM_DATA. The rows are cut into the groups of experts
:func:`moeref.compare.device_bounds.device_rows_error_bound` forms, and each group's inputs (rows' element values,
weight codes K-major, chunk scales) are made before timing, as ``_adder`` makes them. Cases, timed in interleaved
rounds (bench/interleaved.py, CUDA events), one case = every group once:

* ``digits`` (and ``digits <variant>``, :data:`TILE_VARIANTS`):
  :func:`moeref.compare._adder_digits.adder_digits_bound_t`, the step sums on the int8 tensor cores, the
  per-launch operand preparation included;
* ``fma`` (``--fma``): the other exact-domain kernel, ``adder_exact_bound_t`` of moeref/compare/_adder_kernels.py
  (one float64 FMA and an int32 exponent maximum per product; the same bound, the same bits);
* ``gemm1_bound``: the whole ``device_rows_error_bound`` of GEMM1 (grouping, row statistics, code transposes).

``--check R``: the first ``R`` rows of expert 0 against the NumPy bound (``gemm_error_bound``), bit for bit.
JSON (machine, per case and token count the rounds' seconds, median, spread, ratio to ``fma``) to ``--out``.

    python bench/bench_adder_exact.py [--tokens 128 4096] [--rounds 7] [--fma] [--check 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.interleaved import machine_meta, time_interleaved  # noqa: E402
from moeref.compare import PROFILES  # noqa: E402
from moeref.compare.gemm_bounds import adder_setup  # noqa: E402

TILE_VARIANTS = {
    "bm64": {"bm": (16, 32, 64)},
    "s3": {"stages": 3},
    "bn32 w4": {"bn": 32, "warps": {16: 4, 32: 4}, "stages": None},
    "bm64 w4 s-": {"bm": (16, 32, 64), "warps": {16: 4, 32: 8, 64: 8}, "stages": None},
}
"""Tile variants timed besides :data:`moeref.compare._adder_digits.TILES` (overrides of it)."""


def random_e4m3_codes(shape, gen):
    c = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)
    c[(c & 0x7F) == 0x7F] -= 1  # no NaN codes
    return c


def gemm1_inputs(tokens: int, experts: int, gen, w13):
    """The activation operand (E4M3 codes, 1x128 scales, rows sorted by expert) and the row -> expert map."""
    from moeref.gemm.device import DeviceOperand

    k = int(w13.shape[1])
    ids = torch.rand((tokens, experts), device="cuda", generator=gen).topk(8, dim=1).indices
    row_e = np.sort(ids.reshape(-1).cpu().numpy()).astype(np.int64)
    m = row_e.size
    sa = torch.exp2(torch.randint(-8, -4, (m, k // 128), device="cuda", generator=gen).double())
    return DeviceOperand(None, random_e4m3_codes((m, k), gen), "e4m3fn", sa, (1, 128), True), row_e


def groups(a, row_e, w13, prof):
    """Per group of experts (``_expert_groups``), the exact branch's inputs as ``device_adder`` makes them."""
    from moeref.compare.device_adder import _exact_weights
    from moeref.compare.device_bounds import DeviceBlock, _chunk_scales, _expert_block, _expert_groups, _Experts

    out = []
    n, k = (int(d) for d in w13.shape)
    for es, idx, counts in _expert_groups(row_e, w13):
        rows = torch.as_tensor(idx, device="cuda")
        ag = DeviceBlock.of(a.take_rows(rows))
        ws = _Experts(_expert_block(w13, e) for e in es)
        st = adder_setup(k, ag.block, ws[0].block, prof)
        blk = torch.arange(-(-k // st.chunk), device="cuda") * st.chunk
        sa = _chunk_scales(ag.scales, torch.arange(len(idx), device="cuda"), ag.block, blk)
        sw = torch.stack([_chunk_scales(x.scales, torch.arange(n, device="cuda"), x.block, blk) for x in ws])
        wt, table, present = _exact_weights(ws, list(range(len(es))))
        out.append(dict(av=ag.values, wt=wt, table=table, present=present, sa=sa, sw=sw.contiguous(),
                        b=torch.zeros((len(es), n), dtype=torch.float64, device="cuda"), counts=counts, st=st))
    return out


def consts(prof, st):
    from moeref.compare.device_bounds import _consts
    from moeref.compare.gemm_bounds import _MIN_NORMAL

    return _consts("cuda", 2.0 * prof.accum_unit, st.g_prom, 1.0 + 2.0**-40, _MIN_NORMAL, 1.0 + 1e-9, 1.0, 0.0)


def digits_case(gs, prof, n, tiles=None):
    from moeref.compare._adder_digits import adder_digits_bound_t

    c = consts(prof, gs[0]["st"])

    def run():
        return [adder_digits_bound_t(g["av"], g["wt"], g["table"], g["sa"], g["sw"], g["b"], c, g["counts"], n=n,
                                     chunk=g["st"].chunk, mma=g["st"].mma, steps=g["st"].steps, present=g["present"],
                                     tiles=tiles)
                for g in gs]
    return run


def fma_case(gs, prof, n):
    from moeref.compare._adder_kernels import adder_exact_bound_t
    from moeref.compare._bound_kernels import items
    from moeref.compare.device_bounds import _kt

    c = consts(prof, gs[0]["st"])
    prepared = []
    for g in gs:
        it, bm = items(g["counts"], "cuda")
        prepared.append((_kt(g["av"]), it, bm))

    def run():
        return [adder_exact_bound_t(at, g["wt"], g["table"], g["sa"], g["sw"], g["b"], c, it, bm, n=n,
                                    chunk=g["st"].chunk, mma=g["st"].mma, steps=g["st"].steps)
                for g, (at, it, bm) in zip(gs, prepared)]
    return run


def check_rows(a, row_e, w13, prof, got, rows: int) -> dict:
    """The first ``rows`` rows of the lowest expert against the NumPy bound."""
    from moeref.compare import gemm_error_bound
    from moeref.formats import decode_table
    from moeref.gemm.exact import BlockOperand

    e = int(row_e[0])
    idx = np.flatnonzero(row_e == e)[:rows]
    codes = a.codes[torch.as_tensor(idx, device="cuda")].cpu().numpy()
    sc = a.scales[torch.as_tensor(idx, device="cuda")].cpu().numpy()
    ah = BlockOperand(None, sc, (1, 128), True, codes=codes, table=decode_table("e4m3fn"))
    t0 = time.perf_counter()
    ref = gemm_error_bound(ah, w13[e], prof)
    dev = got[:len(idx)].cpu().numpy()
    return dict(expert=e, rows=len(idx), identical=bool(np.array_equal(ref, dev)),
                differing=int(np.count_nonzero(ref != dev)), numpy_seconds=time.perf_counter() - t0)


def main(argv=None) -> int:
    from bench.bench_moe_device import random_fp8_experts
    from moeref.compare.device_bounds import device_rows_error_bound

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--fma", action="store_true", help="also time the FMA exact-domain kernel")
    ap.add_argument("--variants", nargs="*", default=list(TILE_VARIANTS), help="tile variants to time too")
    ap.add_argument("--check", type=int, default=0, help="rows of one expert checked against NumPy")
    ap.add_argument("--out", default="bench_out/adder_exact.json")
    args = ap.parse_args(argv)
    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = random_fp8_experts(args.experts, 4096, 7168, gen, 1e-4)
    n = int(w13.shape[0])
    result = dict(meta=machine_meta(), profile=prof.name, experts=args.experts, n=n, k=int(w13.shape[1]), rows={})
    for tokens in args.tokens:
        a, row_e = gemm1_inputs(tokens, args.experts, gen, w13)
        gs = groups(a, row_e, w13, prof)
        cases = {"digits": digits_case(gs, prof, n)}
        for v in args.variants:
            cases[f"digits {v}"] = digits_case(gs, prof, n, TILE_VARIANTS[v])
        cases["gemm1_bound"] = lambda: device_rows_error_bound(a, None, row_e, w13, None, prof)
        row = dict(tokens=tokens, rows=int(row_e.size), groups=len(gs), errors={})
        if args.fma:
            cases["fma"] = fma_case(gs, prof, n)
        for name in list(cases):  # compile and run once; a variant that fails is reported and dropped
            try:
                t0 = time.perf_counter()
                cases[name]()
                torch.cuda.synchronize()
                row.setdefault("first_call_s", {})[name] = time.perf_counter() - t0
            except Exception as e:  # reported in the JSON, not hidden
                row["errors"][name] = f"{type(e).__name__}: {e}"[-3000:]
                del cases[name]
        if args.check and "digits" in cases:
            first = digits_case(gs[:1], prof, n)()[0]
            row["check"] = check_rows(a, row_e, w13, prof, first, args.check)
        res = time_interleaved(cases, baselines=["fma"] if "fma" in cases else [], rounds=args.rounds, warmup=0)
        row["timing"] = res.to_json()
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["rows"][str(tokens)] = row
        print(f"--- {tokens} tokens ({row_e.size} rows, {len(gs)} groups) {result['meta']['gpu']}")
        for name, c in res.cases.items():
            ratio = res.ratios.get(name, {}).get("fma")
            print(f"{name:>16}: median {c.median_s * 1e3:9.1f} ms  [{c.min_s * 1e3:.1f}, {c.max_s * 1e3:.1f}]"
                  + (f"  fma/this {ratio.median:.1f}x" if ratio else "") + ("  FLAGGED" if c.flagged else ""))
        if row["errors"]:
            print("errors:", row["errors"])
        if "check" in row:
            print("check:", row["check"])
        del gs, cases, a
        torch.cuda.empty_cache()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # after every token count: a later one may run out of time
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
