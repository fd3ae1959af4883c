"""Benchmark of the token-dispatch fast paths (fastpath/dispatch.py) on a CUDA GPU.

For each operation and size: median time (``triton.testing.do_bench``, CUDA events, inputs rotated
among several sets so repeated calls do not hit a warm L2), achieved bandwidth (logical bytes read +
written / median time) next to the device copy bandwidth measured in the same run (a large
device-to-device ``copy_``, bytes read + written), and the speed-up over a torch-eager
implementation of the same operation and over ``torch.compile`` of it. Before timing, every fast
path is checked against the eager implementation (indices equal, rows equal).

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=$PWD python3 bench/bench_dispatch_gpu.py [--sweep] [--out DIR] [--no-compile]

``--sweep`` first times a few (BLOCK_T, row bytes, num_warps) configurations of the row kernels at
the largest size and prints the fastest (to be copied into ``fastpath.dispatch.ROW_CONFIG``); the
tables are then timed with the shipped ``ROW_CONFIG``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.testing

import fastpath.dispatch as F


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


def bench(fn_of_set, n_sets: int) -> float:
    """Median ms of fn_of_set(i) with i rotating over n_sets input sets."""
    state = {"i": 0}

    def run():
        fn_of_set(state["i"] % n_sets)
        state["i"] += 1

    return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")


def copy_bandwidth(device) -> float:
    n = 1 << 30  # 1 GiB
    a = torch.empty(n, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    del a, b
    return 2 * n / (ms * 1e-3) / 1e9


def fill_bandwidth(device) -> float:
    n = 1 << 30
    b = torch.empty(n, dtype=torch.uint8, device=device)
    ms = triton.testing.do_bench(lambda: b.fill_(7), warmup=25, rep=200, return_mode="median")
    del b
    return n / (ms * 1e-3) / 1e9


def sweep(device, M=16384, E=256, k=8, K=7168):
    sets = [routing(M, E, k, device, s) for s in range(2)]
    xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(2)]
    perms = [F.moe_permute(xs[i], sets[i][0], E, validate=False) for i in range(2)]
    cfgs = {  # (BLOCK_T, row bytes per program, num_warps)
        "scatter": [(1, 2048, 4), (1, 4096, 4), (1, 8192, 8), (1, 16384, 8), (1, 16384, 16), (2, 8192, 8),
                    (4, 2048, 8)],
        "reduce": [(1, 2048, 4), (1, 8192, 8), (1, 16384, 8), (2, 4096, 8)],
    }
    best = {}
    rows = []
    for kind in ("scatter", "reduce"):
        shipped = F.ROW_CONFIG[kind]
        for cfg in cfgs[kind]:
            F.ROW_CONFIG[kind] = cfg
            if kind == "scatter":
                ms = bench(lambda i: F.moe_permute(xs[i], sets[i][0], E, validate=False), 2)
            else:
                ms = bench(lambda i: F.moe_unpermute(perms[i].hidden, sets[i][1], perms[i].inv_permuted_idx,
                                                     perms[i].expert_first_token_offset, out_dtype=torch.bfloat16), 2)
            rows.append((kind, cfg, ms))
            print(f"sweep {kind:8s} BLOCK_T={cfg[0]} row_bytes={cfg[1]} warps={cfg[2]}: {ms * 1e3:8.1f} us", flush=True)
            if kind not in best or ms < best[kind][1]:
                best[kind] = (cfg, ms)
        F.ROW_CONFIG[kind] = shipped  # the tables below time the shipped configuration
    print("fastest in this sweep:", {k: v[0] for k, v in best.items()}, "; timing the shipped ROW_CONFIG",
          dict(F.ROW_CONFIG), flush=True)
    return rows, best


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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sizes", default="16384,4096,512,64,1")
    ap.add_argument("--compile-sizes", default="16384,512,1")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    if args.smoke:
        smoke(device)
        return 0
    gpu = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth(device)
    fill_bw = fill_bandwidth(device)
    print(f"# {gpu}; torch {torch.__version__}; triton {triton.__version__}; copy bandwidth {copy_bw:.0f} GB/s "
          f"(read + write); write-only (fill_) {fill_bw:.0f} GB/s", flush=True)
    sweep_rows, best = sweep(device) if args.sweep else ([], {})

    E, k, K, bs, align = 256, 8, 7168, 64, 128
    results = []
    comp = {}
    if not args.no_compile:
        comp = {
            "permute": torch.compile(eager_permute, dynamic=False),
            "align": torch.compile(eager_align, dynamic=False),
            "contiguous": torch.compile(eager_contiguous, dynamic=False),
            "masked": torch.compile(eager_masked, dynamic=False),
            "unpermute": torch.compile(eager_unpermute, dynamic=False),
        }
    for M in [int(s) for s in args.sizes.split(",")]:
        n_sets = 2 if M >= 4096 else 8
        sets = [routing(M, E, k, device, 100 + s) for s in range(n_sets)]
        xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(n_sets)]
        perms = [F.moe_permute(xs[i], sets[i][0], E, validate=False) for i in range(n_sets)]
        n = M * k
        # checks against eager before timing
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
        m_sum = fc.m_indices.numel()
        max_m = int(torch.stack([torch.bincount(st[0].reshape(-1).long(), minlength=E) for st in sets]).max())
        fm = F.to_masked(xs[0], sets[0][0], E, max_m, validate=False)
        em = eager_masked(xs[0], sets[0][0], E, max_m)
        assert torch.equal(em[0], fm.a) and torch.equal(em[1], fm.masked_m) and torch.equal(em[2], fm.src)
        rowb = K * 2
        ops = {
            # name: (fast, eager, bytes moved)
            "moe_align_block_size": (
                lambda i: F.moe_align_block_size(sets[i][0], bs, E, validate=False),
                lambda i, f=eager_align: f(sets[i][0], bs, E),
                "align", n * 4 + (n + E * (bs - 1)) * 4),
            "moe_permute (bf16 rows)": (
                lambda i: F.moe_permute(xs[i], sets[i][0], E, validate=False),
                lambda i, f=eager_permute: f(xs[i], sets[i][0], E),
                "permute", M * rowb + n * rowb + n * 4 * 3),
            "to_contiguous (align 128)": (
                lambda i: F.to_contiguous(xs[i], sets[i][0], E, align, m_sum="worst_case", validate=False),
                lambda i, f=eager_contiguous: f(xs[i], sets[i][0], E, align),
                "contiguous", M * rowb + m_sum * rowb + n * 4 + m_sum * 12),
            "to_masked (max_m given; 1 sync)": (
                lambda i: F.to_masked(xs[i], sets[i][0], E, max_m, validate=False),
                lambda i, f=eager_masked: f(xs[i], sets[i][0], E, max_m),
                "masked", M * rowb + E * max_m * rowb + n * 4 + E * max_m * 8),
            "moe_unpermute (bf16 in, bf16 out)": (
                lambda i: F.moe_unpermute(perms[i].hidden, sets[i][1], perms[i].inv_permuted_idx,
                                          perms[i].expert_first_token_offset, out_dtype=torch.bfloat16),
                lambda i, f=eager_unpermute: f(perms[i].hidden, sets[i][1], perms[i].inv_permuted_idx,
                                               perms[i].expert_first_token_offset).to(torch.bfloat16),
                "unpermute", n * rowb + M * rowb + n * 8),
        }
        # The permute's traffic mix (read each row once, write it k times) done by torch as a dense
        # broadcast copy: the ceiling for a gather/scatter with that read:write ratio on this device.
        # Also the row kernel alone with identity destinations (dense, sequential writes).
        bcast_out = torch.empty((M, k, K), dtype=torch.bfloat16, device=device)
        t_bcast = bench(lambda i: bcast_out.copy_(xs[i].unsqueeze(1).expand(M, k, K)), n_sets)
        bcast_bw = (M * rowb + n * rowb) / (t_bcast * 1e-3) / 1e9
        ident = torch.arange(n, dtype=torch.int32, device=device)
        flat_out = bcast_out.view(n, K)
        t_dense = bench(lambda i: F._scatter_rows(xs[i], ident, flat_out, k), n_sets)
        dense_bw = (M * rowb + n * rowb) / (t_dense * 1e-3) / 1e9
        print(f"{'broadcast copy (torch, 1 read : k writes)':36s} M={M:6d} {t_bcast * 1e3:9.1f} us  {bcast_bw:7.0f} GB/s; "
              f"same with the row kernel, identity destinations: {t_dense * 1e3:9.1f} us  {dense_bw:7.0f} GB/s", flush=True)
        del bcast_out, flat_out
        for name, (fast, eager, ckey, nbytes) in ops.items():
            t_fast = bench(fast, n_sets)
            t_eager = bench(eager, n_sets)
            t_comp = None
            if ckey in comp and str(M) in args.compile_sizes.split(","):
                try:
                    f = comp[ckey]
                    if ckey == "permute":
                        g = lambda i: f(xs[i], sets[i][0], E)  # noqa: E731
                    elif ckey == "align":
                        g = lambda i: f(sets[i][0], bs, E)  # noqa: E731
                    elif ckey == "contiguous":
                        g = lambda i: f(xs[i], sets[i][0], E, align)  # noqa: E731
                    elif ckey == "masked":
                        g = lambda i: f(xs[i], sets[i][0], E, max_m)  # noqa: E731
                    else:
                        g = lambda i: f(perms[i].hidden, sets[i][1], perms[i].inv_permuted_idx,  # noqa: E731
                                        perms[i].expert_first_token_offset).to(torch.bfloat16)
                    g(0)
                    t_comp = bench(g, n_sets)
                except Exception as e:  # report, do not hide
                    print(f"torch.compile failed for {name}: {type(e).__name__}: {e}", flush=True)
            t_graph = None
            if M <= 4096 and ckey != "masked":  # launch-free latency (to_masked syncs: not capturable): the same call replayed from a CUDA graph
                try:
                    t_graph = triton.testing.do_bench_cudagraph(lambda: fast(0), rep=100, return_mode="median")
                except Exception as e:
                    print(f"graph capture failed for {name}: {type(e).__name__}: {e}", flush=True)
            bw = nbytes / (t_fast * 1e-3) / 1e9
            r = dict(op=name, M=M, E=E, k=k, K=K, fast_us=t_fast * 1e3, eager_us=t_eager * 1e3,
                     bcast_gbps=bcast_bw, dense_row_kernel_gbps=dense_bw,
                     compile_us=None if t_comp is None else t_comp * 1e3, bytes=nbytes, gbps=bw,
                     graph_us=None if t_graph is None else t_graph * 1e3,
                     pct_copy=100 * bw / copy_bw, pct_bcast=100 * bw / bcast_bw, pct_dense=100 * bw / dense_bw,
                     x_eager=t_eager / t_fast,
                     x_compile=None if t_comp is None else t_comp / t_fast)
            results.append(r)
            print(f"{name:36s} M={M:6d} fast {r['fast_us']:9.1f} us  {bw:7.0f} GB/s ({r['pct_copy']:5.1f}% copy)  "
                  f"eager {r['eager_us']:9.1f} us (x{r['x_eager']:.2f})  compile "
                  + ("-" if t_comp is None else f"{r['compile_us']:9.1f} us (x{r['x_compile']:.2f})")
                  + ("" if t_graph is None else f"  graph {t_graph * 1e3:.1f} us"), flush=True)
        del sets, xs, perms
        torch.cuda.empty_cache()
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, copy_gbps=copy_bw,
                date=time.strftime("%Y-%m-%d"), row_config=dict(F.ROW_CONFIG), write_only_gbps=fill_bw,
                sweep=[dict(kind=a, cfg=list(b), us=c * 1e3) for a, b, c in sweep_rows])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_dispatch.json"), "w") as fh:
        json.dump(dict(meta=meta, results=results), fh, indent=1)
    # final table (markdown)
    print(f"\n| op | M | fast us | GB/s | % copy ({copy_bw:.0f} GB/s) | % dense 1:k | eager us | x eager | compile us | x compile | fast us (graph) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        cu = "-" if r["compile_us"] is None else f"{r['compile_us']:.1f}"
        xc = "-" if r["x_compile"] is None else f"{r['x_compile']:.2f}"
        print(f"| {r['op']} | {r['M']} | {r['fast_us']:.1f} | {r['gbps']:.0f} | {r['pct_copy']:.1f} | {r['pct_dense']:.1f} | "
              f"{r['eager_us']:.1f} | {r['x_eager']:.2f} | {cu} | {xc} | "
              + ("-" if r["graph_us"] is None else f"{r['graph_us']:.1f}") + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
