"""Benchmark of the token-dispatch fast paths (fastpath/dispatch.py) on a CUDA GPU.

Shape: E = 256 experts, top-8, hidden 7168 bf16, ``block_size`` 64 (align), ``alignment`` 128
(contiguous, worst-case ``M_sum``: no sync). For each operation and number of tokens (a row), the
fast call is timed in the same interleaved rounds as its baselines (:func:`bench.interleaved.time_row`:
>= 7 rounds, ``--rounds``; CUDA events; calls per round calibrated to ``--round-ms``; inputs rotated
among several sets so repeated calls do not hit a warm L2; clocks spun up first):

* ``copy``: a device-to-device copy of the same logical bytes (each input read once, each output
  written once, metadata included); % of copy is the median of the per-round ratios;
* ``torch eager``: a sync-free torch implementation of the same operation (below);
* ``torch.compile``: of it (``dynamic=False``; at ``--compile-sizes``, within ``--compile-budget-s``
  of compilation: rows past the budget say so in the JSON);
* ``CUDA graph``: the same fast call replayed from a CUDA graph, one graph per input set (the
  GPU-side time without the Python launch); not for ``to_masked``, which syncs once;
* ``dense 1:k`` (permute only): the row kernel with identity destinations, the permute's traffic
  mix (read each row once, write it k times) with sequential writes.

Each case reports median, min, max and spread; a case whose spread exceeds 10% is flagged. Before
timing, every fast path is checked against the eager implementation (indices equal, rows equal).
The JSON (``bench_dispatch.json``: :func:`bench.interleaved.machine_meta`, the settings, the device
copy and fill bandwidth, one :func:`bench.interleaved.row_record` per row) is written after every
row; ``bench/report_dispatch.py`` turns it into docs/fastpaths-dispatch.md's table.

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=$PWD python3 bench/bench_dispatch_gpu.py [--sweep] [--out DIR] [--no-compile] [--sizes 16384,4096,512,1]

``--sweep`` first times a few (BLOCK_T, row bytes, num_warps) configurations of the row kernels at
16384 tokens, all in the same interleaved rounds, and prints the fastest (to be copied into
``fastpath.dispatch.ROW_CONFIG``); the rows are then timed with the shipped ``ROW_CONFIG``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fastpath.dispatch as F  # noqa: E402
from bench.interleaved import (  # noqa: E402
    FLAG_SPREAD, MIN_ROUNDS, copy_case, machine_meta, rotating, row_ratios_text, row_record, time_row)


# ----------------------------------------------------------------------------------------------
# torch-eager implementations (sync-free, so torch.compile can take them whole)
# ----------------------------------------------------------------------------------------------
def eager_permute(x, ids, E: int):
    n = ids.numel()
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, E)
    order = torch.sort(key, stable=True).indices
    inv = torch.empty_like(order)
    inv[order] = torch.arange(n, device=ids.device)
    counts = torch.bincount(key, minlength=E + 1)[:E]
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    rows = x.index_select(0, order // k)
    valid = torch.arange(n, device=ids.device) < offsets[-1]
    rows = torch.where(valid[:, None], rows, torch.zeros((), dtype=x.dtype, device=x.device))
    perm = torch.where(valid, order, n)
    return rows, offsets, perm.int(), inv.int()


def eager_align(ids, block_size: int, E: int):
    n = ids.numel()
    flat = ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, E)
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.bincount(key, minlength=E + 1)[:E]
    padded = (counts + block_size - 1) // block_size * block_size
    pstart = torch.cumsum(padded, 0) - padded
    cstart = torch.cumsum(counts, 0) - counts
    size = n + E * (block_size - 1)
    if n < E:
        size = min(n * block_size, size)
    valid = sorted_key < E
    ks = sorted_key.clamp(max=E - 1)
    pos = pstart[ks] + torch.arange(n, device=ids.device) - cstart[ks]
    pos = torch.where(valid, pos, size)
    out = torch.full((size + 1,), n, dtype=torch.int32, device=ids.device)
    out.scatter_(0, pos, order.int())
    nblk = (size + block_size - 1) // block_size
    ends = torch.cumsum(padded, 0)
    q = torch.arange(nblk, device=ids.device) * block_size
    e = torch.searchsorted(ends, q, right=True)
    expert_ids = torch.where(q < ends[-1], e, -1).int()
    return out[:size], expert_ids, ends[-1:].int()


def _eager_slots(ids, E: int):
    """The shared head of the eager layouts: slots sorted by expert (padding/-1 last, stable),
    per-expert counts and starts, and each sorted slot's expert clamped into range."""
    flat = ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, E)
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.bincount(key, minlength=E + 1)[:E]
    cstart = torch.cumsum(counts, 0) - counts
    valid = sorted_key < E
    ks = sorted_key.clamp(max=E - 1)
    rank = torch.arange(ids.numel(), device=ids.device) - cstart[ks]  # place within the expert
    return sorted_key, order, counts, valid, ks, rank


def _eager_gather(x, src, k: int):
    """Rows of ``x`` for slots ``src`` (token = slot // k); zero rows where ``src`` is -1."""
    a = x.index_select(0, src.clamp(min=0) // k)
    return torch.where((src >= 0)[:, None], a, torch.zeros((), dtype=x.dtype, device=x.device))


def eager_contiguous(x, ids, E: int, alignment: int):
    n, k = ids.numel(), ids.shape[1]
    sorted_key, order, counts, valid, ks, rank = _eager_slots(ids, E)
    padded = (counts + alignment - 1) // alignment * alignment
    pstart = torch.cumsum(padded, 0) - padded
    size = (n + E * (alignment - 1) + alignment - 1) // alignment * alignment
    pos = torch.where(valid, pstart[ks] + rank, size)
    src = torch.full((size + 1,), -1, dtype=torch.int64, device=ids.device)
    src.scatter_(0, pos, order)
    m_idx = torch.full((size + 1,), -1, dtype=torch.int32, device=ids.device)
    m_idx.scatter_(0, pos, sorted_key.int())
    src = src[:size]
    return _eager_gather(x, src, k), m_idx[:size], src


def eager_masked(x, ids, E: int, max_m: int):
    k = ids.shape[1]
    sorted_key, order, counts, valid, ks, rank = _eager_slots(ids, E)
    pos = torch.where(valid, ks * max_m + rank, E * max_m)
    src = torch.full((E * max_m + 1,), -1, dtype=torch.int64, device=ids.device)
    src.scatter_(0, pos, order)
    src = src[:-1]
    return _eager_gather(x, src, k).view(E, max_m, -1), counts.int(), src.view(E, max_m)


def eager_unpermute(y, w, inv, offsets):
    m, k = w.shape
    idx = inv.long()
    valid = (idx < offsets[-1]).view(m, k, 1)
    rows = y.index_select(0, idx.clamp(max=y.shape[0] - 1)).view(m, k, -1).float()
    rows = torch.where(valid, rows, 0.0)
    return (rows * w.float().unsqueeze(-1)).sum(1)


# ----------------------------------------------------------------------------------------------
def routing(M: int, E: int, k: int, device, seed: int, pad_frac: float = 0.0):
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(M, E, generator=g, device=device).argsort(dim=1)[:, :k].int()
    if pad_frac:
        ids[torch.rand(M, generator=g, device=device) < pad_frac] = -1
    w = torch.rand(M, k, generator=g, device=device)
    return ids.contiguous(), w / w.sum(1, keepdim=True)


def _sets(fn, n_sets: int):
    """The rotation of ``fn(i)`` over the input sets ``i < n_sets`` (a zero-argument call)."""
    return rotating(fn, [(i,) for i in range(n_sets)])


def device_ceilings(rounds: int, round_ms: float) -> dict:
    """A 1 GiB device copy (bytes read + written) and a 1 GiB ``fill_`` (written), in the same
    interleaved rounds: TB/s from the medians, and both cases' statistics."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    res = time_row({"fastpath": lambda: b.fill_(7), "copy": lambda: b.copy_(a)}, ["copy"], rounds, round_ms * 1e-3)
    rec = row_record(res, 0, n)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_TBps": 2 * n / (rec["cases"]["copy"]["median_us"] * 1e-6) / 1e12,
            "fill_TBps": n / (rec["cases"]["fastpath"]["median_us"] * 1e-6) / 1e12,
            "cases": {"copy 1 GiB": rec["cases"]["copy"], "fill_ 1 GiB": rec["cases"]["fastpath"]}}


def sweep(device, rounds: int, round_ms: float, M=16384, E=256, k=8, K=7168):
    """Every (BLOCK_T, row bytes, num_warps) candidate of the scatter and reduce row kernels at ``M``
    tokens, the candidates of a kind in the same interleaved rounds (the shipped one as the baseline):
    a list of {kind, cfg, median/min/max us, flagged, ratio to the shipped one}."""
    n_sets = 2
    sets = [routing(M, E, k, device, s) for s in range(n_sets)]
    xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
    perms = [F.moe_permute(xs[i], sets[i][0], E, validate=False) for i in range(n_sets)]
    cfgs = {  # (BLOCK_T, row bytes per program, num_warps)
        "scatter": [(1, 2048, 4), (1, 4096, 4), (1, 8192, 8), (1, 16384, 8), (1, 16384, 16), (2, 8192, 8),
                    (4, 2048, 8)],
        "reduce": [(1, 2048, 4), (1, 8192, 8), (1, 16384, 8), (2, 4096, 8)],
    }
    calls = {
        "scatter": lambda i: F.moe_permute(xs[i], sets[i][0], E, validate=False),
        "reduce": lambda i: F.moe_unpermute(perms[i].hidden, sets[i][1], perms[i].inv_permuted_idx,
                                            perms[i].expert_first_token_offset, out_dtype=torch.bfloat16),
    }
    rows = []
    for kind in ("scatter", "reduce"):
        shipped = F.ROW_CONFIG[kind]

        def with_cfg(cfg, kind=kind):
            def call(i):
                F.ROW_CONFIG[kind] = cfg
                return calls[kind](i)
            return _sets(call, n_sets)
        cfg_of = {"fastpath": shipped, **{str(c): c for c in cfgs[kind] if c != shipped}}
        cases = {name: with_cfg(c) for name, c in cfg_of.items()}  # the shipped one ("fastpath"): the baseline
        try:
            res = time_row(cases, ["fastpath"], rounds, round_ms * 1e-3)
        finally:
            F.ROW_CONFIG[kind] = shipped  # the rows below time the shipped configuration
        for name, c in res.cases.items():
            cfg = list(cfg_of[name])
            ratio = 1.0 if name == "fastpath" else res.ratios[name]["fastpath"].median  # shipped time / this one's
            rows.append(dict(kind=kind, cfg=cfg, shipped=name == "fastpath", median_us=c.median_s * 1e6,
                             min_us=c.min_s * 1e6, max_us=c.max_s * 1e6, flagged=c.flagged, x_shipped=ratio))
            print(f"sweep {kind:8s} {str(cfg):16s} {c.median_s * 1e6:9.1f} us [{c.min_s * 1e6:.1f}-{c.max_s * 1e6:.1f}]"
                  + (" (shipped)" if name == "fastpath" else f"  x{ratio:.3f} shipped")
                  + (" FLAGGED" if c.flagged else ""), flush=True)
    del sets, xs, perms
    torch.cuda.empty_cache()
    return rows


def graph_case(fast, n_sets: int):
    """The fast call of each input set captured in its own CUDA graph (after an eager call); a
    zero-argument call replaying the next graph of the rotation."""
    graphs = []
    for i in range(n_sets):
        fast(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fast(i)
        graphs.append((g,))
    torch.cuda.synchronize()
    return rotating(lambda g: g.replay(), graphs)


def smoke(device):
    """Every operation once on small shapes (EP map, padding rows, strided hidden): for
    ``compute-sanitizer --tool memcheck python3 bench/bench_dispatch_gpu.py --smoke``."""
    from moeref.routing import expert_map

    M, E, k, K = 37, 16, 4, 100
    ids, w = routing(M, E, k, device, 7, pad_frac=0.2)
    emap = expert_map(E, 3, 1, "round_robin")
    x = torch.randn(M, 2 * K, device=device).to(torch.bfloat16)[:, ::2]
    for em in (None, emap):
        F.moe_align_block_size(ids, 16, E, em, True, em is not None)
        F.moe_align_block_size(ids, 16, E, em)
        p = F.moe_permute(x, ids, E, em)
        F.moe_unpermute(p.hidden, w, p.inv_permuted_idx, p.expert_first_token_offset, out_dtype=torch.bfloat16)
        c = F.to_contiguous(x, ids, E, 96, em)
        F.weight_and_reduce(c.a, c.src, w, M)
        F.to_masked(x, ids, E, None, em)
        F.to_batched(x, ids, E, M, 1, em)
    torch.cuda.synchronize()
    print("smoke ok", flush=True)


def check(M, E, k, bs, align, sets, xs, perms, max_m):
    """Every fast path against the eager implementation on the first input set (before timing)."""
    ep = eager_permute(xs[0], sets[0][0], E)
    assert torch.equal(ep[0], perms[0].hidden) and torch.equal(ep[1], perms[0].expert_first_token_offset)
    assert torch.equal(ep[2], perms[0].permuted_idx) and torch.equal(ep[3], perms[0].inv_permuted_idx)
    fa = F.moe_align_block_size(sets[0][0], bs, E, validate=False)
    ea = eager_align(sets[0][0], bs, E)
    assert torch.equal(ea[0], fa.sorted_token_ids) and torch.equal(ea[1], fa.expert_ids)
    assert torch.equal(ea[2], fa.num_tokens_post_padded)
    fc = F.to_contiguous(xs[0], sets[0][0], E, align, m_sum="worst_case", validate=False)
    ec = eager_contiguous(xs[0], sets[0][0], E, align)
    assert torch.equal(ec[0], fc.a) and torch.equal(ec[1], fc.m_indices) and torch.equal(ec[2], fc.src)
    fu = F.moe_unpermute(perms[0].hidden, sets[0][1], perms[0].inv_permuted_idx, perms[0].expert_first_token_offset)
    eu = eager_unpermute(perms[0].hidden, sets[0][1], perms[0].inv_permuted_idx, perms[0].expert_first_token_offset)
    assert torch.allclose(fu, eu, rtol=1e-5, atol=1e-5)
    fm = F.to_masked(xs[0], sets[0][0], E, max_m, validate=False)
    em = eager_masked(xs[0], sets[0][0], E, max_m)
    assert torch.equal(em[0], fm.a) and torch.equal(em[1], fm.masked_m) and torch.equal(em[2], fm.src)
    return fc.m_indices.numel()


def operations(M, E, k, K, bs, align, sets, xs, perms, max_m, m_sum):
    """name -> (fast(i), eager function, its arguments of set i, compile key, logical bytes)."""
    n, rowb = M * k, K * 2
    return {
        "moe_align_block_size": (
            lambda i: F.moe_align_block_size(sets[i][0], bs, E, validate=False),
            eager_align, lambda i: (sets[i][0], bs, E), n * 4 + (n + E * (bs - 1)) * 4),
        "moe_permute (bf16 rows)": (
            lambda i: F.moe_permute(xs[i], sets[i][0], E, validate=False),
            eager_permute, lambda i: (xs[i], sets[i][0], E), M * rowb + n * rowb + n * 4 * 3),
        "to_contiguous (align 128)": (
            lambda i: F.to_contiguous(xs[i], sets[i][0], E, align, m_sum="worst_case", validate=False),
            eager_contiguous, lambda i: (xs[i], sets[i][0], E, align), M * rowb + m_sum * rowb + n * 4 + m_sum * 12),
        "to_masked (max_m given; 1 sync)": (
            lambda i: F.to_masked(xs[i], sets[i][0], E, max_m, validate=False),
            eager_masked, lambda i: (xs[i], sets[i][0], E, max_m), M * rowb + E * max_m * rowb + n * 4 + E * max_m * 8),
        "moe_unpermute (bf16 in, bf16 out)": (
            lambda i: F.moe_unpermute(perms[i].hidden, sets[i][1], perms[i].inv_permuted_idx,
                                      perms[i].expert_first_token_offset, out_dtype=torch.bfloat16),
            lambda *a: eager_unpermute(*a).to(torch.bfloat16),
            lambda i: (perms[i].hidden, sets[i][1], perms[i].inv_permuted_idx, perms[i].expert_first_token_offset),
            n * rowb + M * rowb + n * 8),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sizes", default="16384,4096,512,1")
    ap.add_argument("--compile-sizes", default="16384,4096,512,1")
    ap.add_argument("--compile-budget-s", type=float, default=90.0,
                    help="stop compiling new torch.compile baselines after this many seconds of compilation")
    ap.add_argument("--rounds", type=int, default=9, help=f"interleaved rounds per row (>= {MIN_ROUNDS})")
    ap.add_argument("--round-ms", type=float, default=5.0, help="time per case and round (calls calibrated)")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    if args.smoke:
        smoke(device)
        return 0
    E, k, K, bs, align = 256, 8, 7168, 64, 128
    meta = {**machine_meta(), "E": E, "k": k, "K": K, "block_size": bs, "alignment": align,
            "rounds": args.rounds, "round_ms": args.round_ms, "flag_spread": FLAG_SPREAD,
            "row_config": {kk: list(v) for kk, v in F.ROW_CONFIG.items()}}
    meta.update(device_ceilings(args.rounds, args.round_ms))
    print(f"# {meta['gpu']}; driver {meta['driver']}; torch {meta['torch']}; triton {meta['triton']}; {meta['date']}; "
          f"copy {meta['copy_TBps']:.3f} TB/s (read + write); fill_ {meta['fill_TBps']:.3f} TB/s", flush=True)
    out = {"meta": meta, "sweep": sweep(device, args.rounds, args.round_ms) if args.sweep else [], "rows": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_dispatch.json")
    compile_s = 0.0
    for M in [int(s) for s in args.sizes.split(",")]:
        n_sets = 2 if M >= 4096 else 8
        sets = [routing(M, E, k, device, 100 + s) for s in range(n_sets)]
        xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
        perms = [F.moe_permute(xs[i], sets[i][0], E, validate=False) for i in range(n_sets)]
        max_m = int(torch.stack([torch.bincount(st[0].reshape(-1).long(), minlength=E) for st in sets]).max())
        m_sum = check(M, E, k, bs, align, sets, xs, perms, max_m)
        ops = operations(M, E, k, K, bs, align, sets, xs, perms, max_m, m_sum)
        for name, (fast, eager, eargs, nbytes) in ops.items():
            rec_extra = {}
            cases = {"fastpath": _sets(fast, n_sets), "copy": copy_case(nbytes),
                     "torch eager": _sets(lambda i, f=eager, a=eargs: f(*a(i)), n_sets)}
            if not args.no_compile and str(M) in args.compile_sizes.split(","):
                if compile_s > args.compile_budget_s:
                    rec_extra["compile_error"] = f"skipped: compile budget ({args.compile_budget_s:.0f} s) spent"
                else:
                    t0 = time.time()
                    try:
                        cf = torch.compile(eager, dynamic=False)
                        cf(*eargs(0))
                        torch.cuda.synchronize()
                        cases["torch.compile"] = _sets(lambda i, f=cf, a=eargs: f(*a(i)), n_sets)
                    except Exception as e:  # reported, not hidden
                        rec_extra["compile_error"] = f"{type(e).__name__}: {e}"[:200]
                    rec_extra["compile_s"] = time.time() - t0
                    compile_s += rec_extra["compile_s"]
            if not name.startswith("to_masked"):  # to_masked syncs once (capacity, expected_m): not capturable
                try:
                    cases["CUDA graph"] = graph_case(fast, n_sets)
                except Exception as e:  # reported, not hidden
                    rec_extra["graph_error"] = f"{type(e).__name__}: {e}"[:200]
            dense = None
            if name.startswith("moe_permute"):
                dense = torch.empty((M * k, K), dtype=torch.bfloat16, device=device)
                ident = torch.arange(M * k, dtype=torch.int32, device=device)
                cases["dense 1:k"] = _sets(lambda i: F._scatter_rows(xs[i], ident, dense, k), n_sets)
            res = time_row(cases, [c for c in cases if c != "fastpath"], args.rounds, args.round_ms * 1e-3)
            rec = {"op": name, **row_record(res, M, nbytes), **rec_extra}
            out["rows"].append(rec)
            with open(path, "w") as fh:  # partial results too
                json.dump(out, fh, indent=1)
            fp = rec["cases"]["fastpath"]
            msg = (f"{name:36s} M={M:6d} {fp['median_us']:9.1f} us [{fp['min_us']:.1f}-{fp['max_us']:.1f}] "
                   f"{rec['TBps']:6.3f} TB/s ({rec['pct_copy']:5.1f}% copy)") + row_ratios_text(rec)
            print(msg + "".join(f"  [{kk}: {v}]" for kk, v in rec_extra.items() if kk.endswith("error")), flush=True)
            del cases, dense, res
        del sets, xs, perms, ops
        torch.cuda.empty_cache()
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
