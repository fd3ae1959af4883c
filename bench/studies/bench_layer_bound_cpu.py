"""CPU time of ``layer_bound`` under a contiguous-tree profile against the reference run of the same layer.

The layers of docs/error-bounds.md ("Cost on the CPU"): ``make_layer(32, hidden, intermediate)`` float32 weights,
``make_tokens`` rows and softmax top-4 routing of random logits; by default 64 tokens, hidden 512, intermediate
1024, and 512 tokens, hidden 512, intermediate 256. Per round and case, in this order (the order rotates by one each
round): the reference ``run_moe`` of the layer and ``layer_bound(run, profile)`` (default ``BF16_OUTPUT``). Reported
per case: the median over rounds of the wall and CPU seconds of each, and the median of the per-round ratio
``layer_bound / run_moe``.

``--trees A B ...`` times the same cases for several checkouts (each a directory holding ``moeref/``, e.g. a
``git worktree`` of the tree before a change), interleaved: every round runs one child process per tree in turn
(the order rotating), each child timing one round of every case with that tree's ``moeref`` first on
``sys.path``. ``--check-bits`` also asserts that every tree gives the same bound bits (first round).

BLAS runs on one thread in every child (``OPENBLAS_NUM_THREADS=1``, as the repository's CPU benchmarks do).

    python bench/studies/bench_layer_bound_cpu.py [--rounds 3] [--cases 64:512:1024 512:512:256]
    python bench/studies/bench_layer_bound_cpu.py --trees /work/main . --rounds 5 --check-bits [--out FILE.json]
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

DEFAULT_CASES = ["64:512:1024", "512:512:256"]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="TOKENS:HIDDEN:INTERMEDIATE (32 experts, top-4)")
    ap.add_argument("--profile", default="BF16_OUTPUT")
    ap.add_argument("--trees", nargs="+", default=None, help="checkouts to compare, interleaved (child processes)")
    ap.add_argument("--check-bits", action="store_true", help="assert the trees' bounds are bit-identical")
    ap.add_argument("--out", default=None, help="JSON of every round")
    ap.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)  # child: one round, JSON on stdout
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)      # child: first case of the rotation
    return ap.parse_args(argv)


def _case(spec: str):
    t, h, i = (int(v) for v in spec.split(":"))
    return t, h, i


def _make(spec: str):
    import numpy as np

    from moeref.moe import make_layer, make_tokens
    from moeref.routing import softmax_topk

    t, h, i = _case(spec)
    layer = make_layer(32, h, i, seed=0)
    x = make_tokens(t, h, seed=1)
    r = softmax_topk(np.random.default_rng(2).standard_normal((t, 32)).astype(np.float32), 4)
    return layer, x, r


def _timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def one_round(cases, profile: str, start: int = 0) -> dict:
    """Times every case once (the reference, then ``layer_bound``), starting at case ``start``; returns
    ``{case: {"ref_wall", "ref_cpu", "bound_wall", "bound_cpu", "bits"}}``."""
    from moeref.compare import layer_bound
    from moeref.moe import run_moe

    out = {}
    for j in range(len(cases)):
        spec = cases[(start + j) % len(cases)]
        layer, x, r = _make(spec)
        run, rw, rc = _timed(lambda: run_moe(x, layer, r.weights, r.ids))
        lb, bw, bc = _timed(lambda: layer_bound(run, profile))
        digest = hashlib.sha256(lb.bound.tobytes() + lb.radius.tobytes() + lb.center.tobytes()).hexdigest()
        out[spec] = {"ref_wall": rw, "ref_cpu": rc, "bound_wall": bw, "bound_cpu": bc, "bits": digest,
                     "flips": int(lb.flips)}
    return out


def _summary(rounds: list[dict], cases) -> dict:
    summ = {}
    for spec in cases:
        rows = [r[spec] for r in rounds]
        med = {k: statistics.median(row[k] for row in rows) for k in ("ref_wall", "ref_cpu", "bound_wall", "bound_cpu")}
        med["ratio_wall"] = statistics.median(row["bound_wall"] / row["ref_wall"] for row in rows)
        med["ratio_cpu"] = statistics.median(row["bound_cpu"] / row["ref_cpu"] for row in rows)
        summ[spec] = med
    return summ


def _print(label: str, summ: dict):
    for spec, s in summ.items():
        t, h, i = _case(spec)
        print(f"{label:>12} {t:5d} tok, hidden {h}, inter {i}: run_moe {s['ref_wall']:.3f} s ({s['ref_cpu']:.3f} cpu)"
              f"  layer_bound {s['bound_wall']:.3f} s ({s['bound_cpu']:.3f} cpu)"
              f"  ratio {s['ratio_wall']:.2f}x ({s['ratio_cpu']:.2f}x cpu)")


def main(argv=None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    if args.one_round:
        json.dump(one_round(args.cases, args.profile, args.start), sys.stdout)
        return 0
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "profile": args.profile, "cases": args.cases, "rounds": args.rounds}
    if not args.trees:
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        sys.path.insert(0, os.path.abspath(here))
        rounds = [one_round(args.cases, args.profile, r % len(args.cases)) for r in range(args.rounds)]
        summ = _summary(rounds, args.cases)
        _print("this tree", summ)
        result = {"meta": meta, "rounds": rounds, "summary": summ}
    else:
        trees = [os.path.abspath(t) for t in args.trees]
        rounds = {t: [] for t in trees}
        for r in range(args.rounds):
            for j in range(len(trees)):
                tree = trees[(r + j) % len(trees)]
                env = dict(os.environ, PYTHONPATH=tree)
                cmd = [sys.executable, os.path.abspath(__file__), "--one-round", "--profile", args.profile,
                       "--start", str(r % len(args.cases)), "--cases", *args.cases]
                res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
                rounds[tree].append(json.loads(res.stdout))
        summ = {t: _summary(rounds[t], args.cases) for t in trees}
        for t in trees:
            _print(os.path.basename(t.rstrip("/")) or t, summ[t])
        if args.check_bits:
            for spec in args.cases:
                digests = {t: rounds[t][0][spec]["bits"] for t in trees}
                assert len(set(digests.values())) == 1, f"{spec}: the trees' bounds differ: {digests}"
            print("bits: identical across trees")
        result = {"meta": meta, "rounds": rounds, "summary": summ}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
