"""Benchmark: ``compare`` of a device-engine reference run at the DeepSeek-V3 layer against the reference's own time,
with the aligned-adder bound's float64 tensor-core kernel (moeref.compare.device._adder_mma); its bits checked against the
NumPy bound on production rows first.

The layer of ``bench/bench_moe_device.py`` (hidden 7168, intermediate 2048, 256 experts, top-8, FP8 1x128 x 128x128,
bf16 GEMM1 store, float32 activation, bf16 output; random FP8 weights made on the GPU), a random top-8 routing. Per
token count, in this order (each part prints and is written to the JSON as soon as it is done, so a run cut short
keeps what it measured):

1. ``check``: rows of one expert through GEMM1's bound (the exact form, no radius) and GEMM2's (the steps form, a
   radius ``2^-9 |value|``, and its radius term) on the GPU against the NumPy bound (``gemm_error_bound``,
   ``radius_dot``) on the same operands, bit for bit;
2. ``timing``: ``run_moe(device="cuda")`` and ``compare`` under ``--profile`` (default ``HOPPER_FP8_DEEPGEMM_DATA``;
   the candidate is the reference's own bf16 output: compare's work does not depend on its values), interleaved
   rounds (``bench.interleaved``, CUDA events), the per-round ratio compare / reference, peak GPU memory. Under an
   emulated profile (``DEEPGEMM_FP8_EXACT``, ``TRITON_FP8_BLOCK_EXACT``: the activation store set to the run's
   float32, as ``fastpath.moe.exact_profile`` declares it) also ``emulated``: GEMM2's rows by path (certain,
   enumerated, data-dependent fallback), the combinations promoted and the 128-column blocks emulated for them,
   against the whole-row emulations enumerating each row's combinations would take;
3. ``--sweep``: GEMM1's and GEMM2's bound alone under tile variants of :data:`moeref.compare.device._adder_mma.TILE`;
4. ``--sources tensor_cores emulator`` (an emulated profile): instead of 2's rounds, ``compare`` with the block
   accumulators from each source (:data:`moeref.gemm.device_hopper_fp8.ACCUMULATOR_SOURCE`) and the reference,
   interleaved rounds; first whether the reports of the sources are the same bits (bound, error) and, for each
   source but the emulator, where its time goes (:class:`SourceCost`: the accumulator kernels, the proof's
   emulation of the proved rows), with ``--check-fraction``/``--min-check-rows`` setting the proof's size;
5. ``--emulator-sweep``: GEMM1's emulation alone (:func:`moeref.gemm.device_hopper_fp8.device_deepgemm_rows`, the
   rows of a random top-8 routing) under the variants :data:`EMULATOR_SWEEP` of its work items
   (:data:`~moeref.gemm.device_hopper_fp8.TILES` ``"many"``) and of its cut (float64 or int32,
   :data:`~moeref.gemm.device_hopper_fp8.INTEGER_ALIGN`), each checked bit for bit against the first.

    python bench/bench_compare_device.py [--tokens 128 4096] [--rounds 7] [--check-rows 2] [--sweep] [--out FILE]
    python bench/bench_compare_device.py --profile DEEPGEMM_FP8_EXACT --check-rows 0 --max-seconds 120 --rounds 3
    python bench/bench_compare_device.py --sweep-only [--variants "16x64 w4" ...]   # the tile sweep at each --tokens
    python bench/bench_compare_device.py --emulator-sweep --tokens 4096
    python bench/bench_compare_device.py --profile DEEPGEMM_FP8_EXACT --tokens 4096 --check-rows 0 \
        --sources tensor_cores emulator --out bench_out/compare_sources.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.interleaved import CudaEventClock, time_interleaved  # noqa: E402

SWEEP = {"16x64 w4": (16, 64, 4), "16x128 w4": (16, 128, 4), "16x64 w8": (16, 64, 8), "16x128 w8": (16, 128, 8),
         "32x64 w4": (32, 64, 4), "16x32 w2": (16, 32, 2), "16x64 w4 r168": (16, 64, 4, 168),
         "16x64 w4 r128": (16, 64, 4, 128), "32x64 w4 r168": (32, 64, 4, 168)}
"""Tile variants ``(rows, BN, warps[, maxnreg])`` of :data:`moeref.compare.device._adder_mma.TILE` timed by ``--sweep``."""


EMULATOR_SWEEP = {"16x16 w8 float64": (16, 16, 8, False), "16x16 w8 int32": (16, 16, 8, True),
                  "16x32 w8 int32": (16, 32, 8, True), "32x16 w8 int32": (32, 16, 8, True),
                  "16x16 w4 int32": (16, 16, 4, True), "8x32 w4 int32": (8, 32, 4, True),
                  "32x32 w8 int32": (32, 32, 8, True)}
"""Variants ``(rows, BLOCK_N, warps, int32 cut)`` of the device emulator timed by ``--emulator-sweep``."""


def emulator_sweep(weights, tokens: int, gen) -> dict:
    """GEMM1's emulation (random E4M3 rows of a random top-8 routing) under each :data:`EMULATOR_SWEEP` variant."""
    import moeref.gemm.device_hopper_fp8 as dh
    from bench.bench_moe_device import routing

    _, ids = routing(tokens, int(weights.w13.codes.shape[0]), 8, gen, DEV)
    row_e = np.sort(np.asarray(ids).reshape(-1)).astype(np.int64)
    codes, scales = _random_rows(row_e.size, int(weights.w13.shape[1]), gen)
    a = _operand(codes, scales)
    res, base = {}, None
    saved = dict(dh.TILES), dh.INTEGER_ALIGN
    try:
        for name, (rows, bn, warps, integer) in EMULATOR_SWEEP.items():
            dh.TILES["many"], dh.INTEGER_ALIGN = (rows, bn, warps), integer
            t0 = time.perf_counter()
            got = dh.device_deepgemm_rows(a, row_e, weights.w13, source="emulator")
            _sync()
            first = time.perf_counter() - t0
            base = got if base is None else base
            t0 = time.perf_counter()
            dh.device_deepgemm_rows(a, row_e, weights.w13, source="emulator")
            _sync()
            res[name] = dict(first_s=first, s=time.perf_counter() - t0, same_bits=bool(torch.equal(base, got)),
                             rows=int(row_e.size))
            print(f"  emulator sweep {tokens} {name}: {res[name]}", flush=True)
    finally:
        dh.TILES.update(saved[0])
        dh.INTEGER_ALIGN = saved[1]
    return res


def _operand(codes, scales):
    from moeref.gemm.device import DeviceOperand

    return DeviceOperand(None, codes, "e4m3fn", scales, (1, 128), True)


DEV = "cuda"


def _random_rows(m: int, k: int, gen):
    codes = torch.randint(0, 256, (m, k), dtype=torch.uint8, device=DEV, generator=gen)
    codes[(codes & 0x7F) == 0x7F] -= 1
    scales = torch.exp2(torch.randint(-8, -4, (m, -(-k // 128)), device=DEV, generator=gen).double())
    return codes, scales


def small_layer(experts: int, gen):
    """A layer of the DeepSeek-V3 kind at hidden 256, intermediate 128 (``--small``: a smoke test, CPU included)."""
    from moeref.gemm import StackedExperts
    from moeref.moe import MoEWeights

    def stack(n, k):
        codes = torch.randint(0, 256, (experts, n, k), dtype=torch.uint8, device=DEV, generator=gen)
        codes[(codes & 0x7F) == 0x7F] -= 1
        grid = (experts, -(-n // 128), -(-k // 128))
        sc = 1e-4 * (1.0 + torch.rand(grid, device=DEV, generator=gen, dtype=torch.float64))
        return StackedExperts(codes, sc.to(torch.float32).to(torch.float64), "e4m3fn", (128, 128), (n, k))

    return MoEWeights(stack(256, 256), stack(256, 128), "gate_up")


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def check_rows(weights, rows: int, gen) -> dict:
    """GEMM1 (no radius) and GEMM2 (radius ``2^-9 |value|``, with the radius term) of ``rows`` random E4M3 rows
    against expert 3 on the GPU and in NumPy."""
    from moeref.compare import PROFILES
    from moeref.compare.bounds import _rows_error_bound, _rows_radius_term
    from moeref.compare.device.bounds import device_rows_error_bound
    from moeref.formats import decode_table
    from moeref.gemm.exact import BlockOperand

    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    out = {}
    for name, w in (("gemm1", weights.w13), ("gemm2", weights.w2)):
        k = int(w.shape[1])
        codes, scales = _random_rows(rows, k, gen)
        row_e = np.full(rows, 3, dtype=np.int64)
        a_host = BlockOperand(None, scales.cpu().numpy(), (1, 128), True, codes=codes.cpu().numpy(),
                              table=decode_table("e4m3fn"))
        rad = None
        if name == "gemm2":
            rad = np.abs(np.asarray(a_host.dequantize(), dtype=np.float64)) * 2.0**-9
        w_host = _host_stack(w, 3)
        t0 = time.perf_counter()
        ref = _rows_error_bound(a_host, rad, row_e, w_host, None, prof)
        ref_r = None if rad is None else _rows_radius_term(rad, row_e, w_host)
        numpy_s = time.perf_counter() - t0
        rad_d = None if rad is None else torch.as_tensor(rad, device=DEV)
        if rad is None:
            got, got_r = device_rows_error_bound(_operand(codes, scales), None, row_e, w, None, prof), None
        else:
            got_r, got = device_rows_error_bound(_operand(codes, scales), rad_d, row_e, w, None, prof, radius_term=True)
        row = dict(rows=rows, k=k, identical=bool(np.array_equal(ref, got.cpu().numpy())),
                   differing=int(np.count_nonzero(ref != got.cpu().numpy())), numpy_s=numpy_s)
        if ref_r is not None:
            row["radius_term_identical"] = bool(np.array_equal(ref_r, got_r.cpu().numpy()))
        out[name] = row
    return out


def _host_stack(w, e: int):
    """Expert ``e`` of a device :class:`StackedExperts` as a host stack of one expert at index ``e`` (the other
    experts' codes zero: only ``e`` is read)."""
    from moeref.gemm import StackedExperts

    codes = np.zeros((e + 1,) + tuple(w.codes.shape[1:]), dtype=np.uint8)
    codes[e] = w.codes[e].cpu().numpy()
    scales = np.ones((e + 1,) + tuple(w.scales.shape[1:]))
    scales[e] = w.scales[e].cpu().numpy()
    return StackedExperts(codes, scales, w.element, w.block, tuple(int(d) for d in w.shape), w.magnitude)


def sweep(weights, tokens: int, gen, variants=None) -> dict:
    """GEMM1's and GEMM2's bound alone (all experts' rows of a random top-8 routing) under each tile variant."""
    import moeref.compare.device._adder_mma as mma
    from moeref.compare import PROFILES
    from moeref.compare.device.bounds import device_rows_error_bound

    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    from bench.bench_moe_device import routing

    _, ids = routing(tokens, int(weights.w13.codes.shape[0]), 8, gen, DEV)
    row_e = np.sort(ids.reshape(-1)).astype(np.int64)
    res = {}
    saved, saved_rows = mma.TILE, mma.EXACT_ROWS
    try:
        for gname, w in (("gemm1", weights.w13), ("gemm2", weights.w2)):
            k = int(w.shape[1])
            codes, scales = _random_rows(row_e.size, k, gen)
            a = _operand(codes, scales)
            rad = (a.decode() * a.scales.repeat_interleave(128, dim=1)).abs() * 2.0**-9 if gname == "gemm2" else None
            base = None
            for vname, (rows, bn, warps, *reg) in SWEEP.items():
                if variants and vname not in variants:
                    continue
                mma.TILE = dataclasses.replace(saved, rows=rows, bn=bn, warps=warps, maxnreg=reg[0] if reg else None)
                mma.EXACT_ROWS = (rows,)
                fn = lambda: device_rows_error_bound(a, rad, row_e, w, None, prof, radius_term=rad is not None)  # noqa: E731
                t0 = time.perf_counter()
                got = fn()
                _sync()
                first = time.perf_counter() - t0
                got = got[1] if isinstance(got, tuple) else got
                base = got if base is None else base
                t0 = time.perf_counter()
                fn()
                _sync()
                res[f"{gname} {vname}"] = dict(first_s=first, s=time.perf_counter() - t0,
                                               same_bits=bool(torch.equal(base, got)))
                print(f"  sweep {tokens} {gname} {vname}: {res[f'{gname} {vname}']}", flush=True)
    finally:
        mma.TILE, mma.EXACT_ROWS = saved, saved_rows
    return res


class EmulatedPaths:
    """Counts, over the compares run inside it, what :mod:`moeref.compare.device.emulated` did for GEMM2's rows (a
    wrapper around its ``device_emulated_gemm`` and ``_block_variants``; nothing is changed)."""

    def __init__(self):
        self.stats = dict(gemm2_rows=0, uncertain_rows=0, enumerated_rows=0, fallback_rows=0, combinations=0,
                          block_emulations=0, blocks_per_row=0, whole_row_block_emulations=0)

    def __enter__(self):
        import moeref.compare.device.emulated as em
        import moeref.compare.device.layer as layer

        self._saved = (em.device_emulated_gemm, em._block_variants, layer.device_emulated_gemm)
        gemm, variants = em.device_emulated_gemm, em._block_variants
        st = self.stats

        def gemm_(a, a_radius, row_expert, weights, bias, profile, codes=None):
            if a_radius is not None:
                rows = np.asarray(row_expert)
                unsure = (a_radius.amax(dim=1) > 0).cpu().numpy() & (rows >= 0)
                ok = unsure & em._enumerable(codes) if codes is not None else np.zeros_like(unsure)
                st["gemm2_rows"] += int((rows >= 0).sum())
                st["uncertain_rows"] += int(unsure.sum())
                st["enumerated_rows"] += int(ok.sum())
                st["fallback_rows"] += int((unsure & ~ok).sum())
                st["blocks_per_row"] = nb = int(a.shape[1]) // 128
                # enumerated rows without an uncertain code (one combination, the center: their blocks are emulated
                # with the center, not through _block_variants; whole-row enumeration emulates them twice)
                one = int((ok & (em._code_counts(codes)[0] == 0)).sum()) if codes is not None else 0
                st["combinations"] += one
                st["block_emulations"] += one * nb
                st["whole_row_block_emulations"] += 2 * one * nb
            return gemm(a, a_radius, row_expert, weights, bias, profile, codes)

        def variants_(sub, lo, hi, rows_c, weights):
            out = variants(sub, lo, hi, rows_c, weights)
            ncomb = (1 << out[4]).sum()
            st["combinations"] += int(ncomb)
            st["block_emulations"] += int(out[0].shape[0]) + int(lo.shape[0]) * (int(lo.shape[1]) // 128)
            st["whole_row_block_emulations"] += (int(ncomb) + int(lo.shape[0])) * (int(lo.shape[1]) // 128)
            return out

        em.device_emulated_gemm, em._block_variants, layer.device_emulated_gemm = gemm_, variants_, gemm_
        return self

    def __exit__(self, *exc):
        import moeref.compare.device.emulated as em
        import moeref.compare.device.layer as layer

        em.device_emulated_gemm, em._block_variants, layer.device_emulated_gemm = self._saved
        return False


class SourceCost:
    """Where :func:`moeref.gemm.device_hopper_fp8.device_deepgemm_rows`'s time goes over the compares run inside
    it: per source, the kernel runs (``_rows``: calls, rows, seconds) and the proofs (``_prove``: calls, proved
    rows, seconds, its emulator run included), each timed between two device synchronisations (so only in a call
    that is not itself timed)."""

    def __init__(self):
        self.stats = dict(tensor_core_calls=0, tensor_core_rows=0, tensor_core_s=0.0, emulator_calls=0,
                          emulator_rows=0, emulator_s=0.0, proof_calls=0, proved_rows=0, proof_s=0.0)

    def __enter__(self):
        import moeref.gemm.device_hopper_fp8 as dh

        self._saved = (dh._rows, dh._prove)
        rows_fn, prove_fn = self._saved
        st = self.stats

        def timed(fn):
            _sync()
            t0 = time.perf_counter()
            out = fn()
            _sync()
            return out, time.perf_counter() - t0

        def rows_(a, rows, weights, promotion, model, values, scale_term, block_acc, tc):
            out, dt = timed(lambda: rows_fn(a, rows, weights, promotion, model, values, scale_term, block_acc, tc))
            key = "tensor_core" if tc else "emulator"
            st[f"{key}_calls"] += 1
            st[f"{key}_rows"] += int((np.asarray(rows) >= 0).sum())
            st[f"{key}_s"] += dt
            return out

        def prove_(got, a, rows, proved, *args):
            _, dt = timed(lambda: prove_fn(got, a, rows, proved, *args))
            st["proof_calls"] += 1
            st["proved_rows"] += int(proved.size)
            st["proof_s"] += dt

        dh._rows, dh._prove = rows_, prove_
        return self

    def __exit__(self, *exc):
        import moeref.gemm.device_hopper_fp8 as dh

        dh._rows, dh._prove = self._saved
        return False


def time_sources(run, reference, prof, sources, rounds: int) -> dict:
    """``compare(run.out, run, prof)`` with the block accumulators from each of ``sources`` against ``reference``
    (the run itself), interleaved rounds; before them one compare per source (compilation), whether the reports
    are the same bits, and :class:`SourceCost` of one more compare per source but ``"emulator"``."""
    import moeref.gemm.device_hopper_fp8 as dh
    from moeref.compare import compare

    out = dict(sources=list(sources), tensor_cores_available=bool(dh.tensor_cores_available(DEV)),
               check_fraction=dh.CHECK_FRACTION, min_check_rows=dh.CHECK_ROWS)
    saved = dh.ACCUMULATOR_SOURCE
    try:
        reports = {}
        for s in sources:
            dh.ACCUMULATOR_SOURCE = s
            t0 = time.perf_counter()
            reports[s] = compare(run.out, run, prof)
            _sync()
            out[f"first_compare_s {s}"] = time.perf_counter() - t0
            out[f"passed {s}"] = bool(reports[s].passed)
            print(f"    first compare ({s}) {out[f'first_compare_s {s}']:.2f} s, passed {reports[s].passed}",
                  flush=True)
        base = reports[sources[0]]
        out["same_bits"] = {s: bool(np.array_equal(base.bound.view(np.int64), r.bound.view(np.int64))
                                    and np.array_equal(base.error.view(np.int64), r.error.view(np.int64)))
                            for s, r in reports.items()}
        print(f"    reports the same bits as {sources[0]}'s: {out['same_bits']}", flush=True)
        reports = base = None
        for s in [s for s in sources if s != "emulator"]:  # the emulator's time is all emulation
            dh.ACCUMULATOR_SOURCE = s
            with SourceCost() as cost:
                compare(run.out, run, prof)
            out[f"cost {s}"] = cost.stats
            print(f"    where compare ({s})'s emulated GEMMs go: {cost.stats}", flush=True)
        cases = {"reference": reference}
        for s in sources:
            def case(s=s):
                dh.ACCUMULATOR_SOURCE = s
                return compare(run.out, run, prof)
            cases[f"compare {s}"] = case
        res = time_interleaved(cases, baselines=["reference"], rounds=rounds, warmup=0,
                               clock=CudaEventClock() if DEV == "cuda" else None)
    finally:
        dh.ACCUMULATOR_SOURCE = saved
    out["timing"] = res.to_json()
    r = res.cases["reference"]
    print(f"    reference {r.median_s:.3f} s ({r.min_s:.3f}-{r.max_s:.3f})", flush=True)
    for s in sources:
        c = res.cases[f"compare {s}"]
        out[f"compare_over_reference {s}"] = 1.0 / res.ratios[f"compare {s}"]["reference"].median
        print(f"    compare ({s}) {c.median_s:.3f} s ({c.min_s:.3f}-{c.max_s:.3f}): compare / reference "
              f"{out[f'compare_over_reference {s}']:.2f}x (median of per-round ratios)", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--check-rows", type=int, default=2)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--variants", nargs="+", default=None, help="names of SWEEP to time (default: all)")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the tile sweep, at every --tokens (no check, no timed rounds)")
    ap.add_argument("--max-seconds", type=float, default=4.0,
                    help="a compare slower than this is timed once, without rounds or sweep (a lease's budget)")
    ap.add_argument("--emulator-sweep", action="store_true",
                    help="time GEMM1's device emulation under EMULATOR_SWEEP's variants at every --tokens (then stop)")
    ap.add_argument("--small", action="store_true", help="a small layer on --device (a smoke test of this script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="HOPPER_FP8_DEEPGEMM_DATA",
                    help="the compare profile (DEEPGEMM_FP8_EXACT / TRITON_FP8_BLOCK_EXACT: emulated, "
                    "act store float32)")
    ap.add_argument("--sources", nargs="+", default=None, choices=["tensor_cores", "emulator", "auto"],
                    help="under an emulated profile: time compare with the block accumulators from each source "
                    "(moeref.gemm.device_hopper_fp8.ACCUMULATOR_SOURCE) against the reference, interleaved")
    ap.add_argument("--check-fraction", type=float, default=None,
                    help="device_hopper_fp8.CHECK_FRACTION: the share of rows the tensor cores' proof emulates")
    ap.add_argument("--min-check-rows", type=int, default=None,
                    help="device_hopper_fp8.CHECK_ROWS: the fewest rows the tensor cores' proof emulates per call")
    ap.add_argument("--tree", default="", help="what the measured tree is (the docs table's tree column)")
    ap.add_argument("--out", default="bench_out/compare_device.json")
    args = ap.parse_args(argv)
    global DEV
    DEV = args.device
    from bench.bench_moe_device import deepseek_v3_layer, routing
    from moeref.compare import compare, get_profile
    from moeref.moe import MoEQuant, run_moe
    from moeref.quant import fp8_group
    import triton

    prof = get_profile(args.profile)
    emulated = prof.accum_model == "emulated"
    if emulated:  # the run stores the activation in float32 (kw below), as fastpath.moe.exact_profile declares
        prof = dataclasses.replace(prof, act_out_dtype="float32")
    if args.sources and not emulated:
        ap.error(f"--sources needs an emulated profile (DEEPGEMM_FP8_EXACT, TRITON_FP8_BLOCK_EXACT); "
                 f"got {prof.name}")
    import moeref.gemm.device_hopper_fp8 as dh
    if args.check_fraction is not None:
        dh.CHECK_FRACTION = args.check_fraction
    if args.min_check_rows is not None:
        dh.CHECK_ROWS = args.min_check_rows
    gen = torch.Generator(device=DEV).manual_seed(0)
    weights = small_layer(8, gen) if args.small else deepseek_v3_layer(256, gen)
    n_exp = int(weights.w13.codes.shape[0])
    hidden = int(weights.w13.shape[1])
    kw = dict(quant=MoEQuant(fp8_group(), fp8_group(), "fp8 1x128 (DeepGEMM)"), gemm1_out_dtype="bfloat16",
              act_out_dtype="float32", out_dtype="bfloat16")
    meta = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), experts=n_exp,
                rounds=args.rounds, profile=prof.name)
    if args.tree:
        meta["tree"] = args.tree
    print(meta, flush=True)
    result = dict(meta=meta, rows=[])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.emulator_sweep:
        for m in args.tokens:
            try:
                result[f"emulator_sweep_{m}"] = emulator_sweep(weights, m, gen)
            except Exception as e:  # noqa: BLE001
                result[f"emulator_sweep_{m}_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            save()
        return 0
    for m in ([] if args.sweep_only else args.tokens):
        row = dict(tokens=m)
        result["rows"].append(row)
        try:
            if args.check_rows and m == args.tokens[0]:  # the same kernels at every token count: checked once
                row["check"] = check_rows(weights, args.check_rows, gen)
                print(f"--- {m} tokens: check {row['check']}", flush=True)
                save()
            x = torch.randn((m, hidden), device=DEV, generator=gen).to(torch.bfloat16)
            tw, ids = routing(m, n_exp, 8, gen, DEV)
            _sync()
            t0 = time.perf_counter()
            run = run_moe(x, weights, tw, ids, device=DEV, **kw)
            if args.sources:
                _sync()
                row["first_reference_s"] = time.perf_counter() - t0
                row.update(time_sources(run, lambda: run_moe(x, weights, tw, ids, device=DEV, **kw), prof,
                                        args.sources, args.rounds))
                save()
                run = None
                continue
            rep = compare(run.out, run, prof)
            _sync()
            row["first_call_s"] = time.perf_counter() - t0
            row.update(passed=bool(rep.passed), violations=int(rep.violations.sum()), flips=int(rep.flips))
            print(f"    first reference + compare {row['first_call_s']:.2f} s, passed {rep.passed}", flush=True)
            t0 = time.perf_counter()
            compare(run.out, run, prof)
            _sync()
            row["second_compare_s"] = time.perf_counter() - t0
            print(f"    second compare {row['second_compare_s']:.3f} s", flush=True)
            if emulated:
                with EmulatedPaths() as paths:
                    compare(run.out, run, prof)
                row["emulated"] = paths.stats
                print(f"    emulated GEMM2 paths: {paths.stats}", flush=True)
            if row["second_compare_s"] > args.max_seconds:
                row["skipped"] = f"compare took {row['second_compare_s']:.1f} s > --max-seconds: no rounds"
                args.sweep = False
                save()
                continue
            cuda = DEV == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            res = time_interleaved({"reference": lambda: run_moe(x, weights, tw, ids, device=DEV, **kw),
                                    "compare": lambda: compare(run.out, run, prof)},
                                   baselines=["reference"], rounds=args.rounds, warmup=0,
                                   clock=CudaEventClock() if cuda else None)
            row["timing"] = res.to_json()
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
            ratio = res.ratios["compare"]["reference"].median
            row["compare_over_reference"] = 1.0 / ratio
            c, r = res.cases["compare"], res.cases["reference"]
            print(f"    reference {r.median_s:.3f} s ({r.min_s:.3f}-{r.max_s:.3f}), compare {c.median_s:.3f} s "
                  f"({c.min_s:.3f}-{c.max_s:.3f}): compare / reference {1.0 / ratio:.2f}x (median of per-round "
                  f"ratios); peak extra {row['peak_extra_gib']:.1f} GiB", flush=True)
            save()
            run = rep = None
            if DEV == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a failed row is reported, the others still run
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            save()
    if args.sweep or args.sweep_only:
        for m in (args.tokens if args.sweep_only else args.tokens[-1:]):
            try:
                result["sweep" if m == args.tokens[-1] else f"sweep_{m}"] = sweep(weights, m, gen, args.variants)
            except Exception as e:  # noqa: BLE001
                result["sweep_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
