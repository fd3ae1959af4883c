"""Probe: what limits the FP8 1x128 / per-token quantizers on Hopper, the memory pipeline or the
arithmetic? A stand-alone quantizer (amax over the group or the row, ``x / s``, hardware E4M3
cast) fed and computed several ways; prints TB/s and % of the copy bandwidth measured in the run:

* ``plain``: one tile per program through ``tl.load`` (as the fast paths do);
* ``tma``: ``ITERS`` tiles per program arriving through a tensor descriptor
  (``cp.async.bulk.tensor`` into shared memory) with ``num_stages`` buffers in flight, checked
  bit for bit against ``plain``;
* ``per-token``: one whole row per program (``[1, 64 slices of 128]``, one amax), TMA or plain;
* the division: Triton's ``/`` (approximate ``div.full.f32``), ``fastpath.quant._jit_codes.
  _div_exact`` (``EXACT=1``), its in-window FMA steps alone (2), ``div.rn.f32`` per element (3).

NVIDIA H200, 2026-11-21, 16384 x 7168 bf16 (docs/fastpaths.md, fifth round): TMA pipelining
61-93% of copy against 90% for the plain tiles (no gain); the whole-row per-token tile 96.7%
with the approximate division and 82% with the exact one, which located the per-token
kernel's limit in the division's per-element work.

    python bench/studies/tma_probe.py [--quick] [--no-tma]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/
import bench_quant_gpu as B  # noqa: E402
import fastpath.quant as Q  # noqa: E402
import fastpath.quant._jit_codes as QC  # noqa: E402
from moeref.quant import fp8_group, fp8_per_token  # noqa: E402


@triton.jit
def _tile_codes(x, c_ptr, s_ptr, rows, gidx, M, NG, K, PER_ROW: tl.constexpr,
                EXACT: tl.constexpr = 0):
    x = x.to(tl.float32)
    if PER_ROW:
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)[:, None]
    else:
        amax = tl.max(tl.abs(x), axis=2)
    s = tl.where(amax > 0, amax / 448.0, 1.0)
    if EXACT == 1:  # the fast path's correctly rounded division (_jit_codes._div_exact)
        y = QC._div_exact(x, s[:, :, None], 1, True)
    elif EXACT == 2:  # its in-window arithmetic alone (no out-of-window branch)
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[:, :, None]
        ns = -s[:, :, None]
        q0 = x * r
        q1 = tl.fma(tl.fma(q0, ns, x), r, q0)
        y = ((q1.to(tl.uint32, bitcast=True) & 0x7FFFFFFF)
             | (q0.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)
    elif EXACT == 3:  # correctly rounded per element by the hardware: div.rn.f32
        y = tl.math.div_rn(x, s[:, :, None] + tl.zeros(x.shape, tl.float32))
    else:  # Triton's "/" on float32: div.full.f32, approximate
        y = x / s[:, :, None]
    code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    kk = tl.arange(0, x.shape[2])
    rm = (rows < M)[:, None, None] & (gidx < NG)[None, :, None]
    off = rows.to(tl.int64)[:, None, None] * K + gidx[None, :, None] * 128 + kk[None, None, :]
    tl.store(c_ptr + off, code, mask=rm)
    if PER_ROW:
        tl.store(s_ptr + rows, tl.max(s, axis=1), mask=rows < M)
    else:
        tl.store(s_ptr + rows.to(tl.int64)[:, None] * NG + gidx[None, :], s,
                 mask=(rows < M)[:, None] & (gidx < NG)[None, :])


@triton.jit
def _plain(x_ptr, c_ptr, s_ptr, M, NG, K, BM: tl.constexpr, GPP: tl.constexpr,
           PER_ROW: tl.constexpr, EXACT: tl.constexpr = 0):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    gidx = tl.program_id(1) * GPP + tl.arange(0, GPP)
    kk = tl.arange(0, 128)
    m = (rows < M)[:, None, None] & (gidx < NG)[None, :, None]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None, None] * K + gidx[None, :, None] * 128
                + kk[None, None, :], mask=m, other=0.0)
    _tile_codes(x, c_ptr, s_ptr, rows, gidx, M, NG, K, PER_ROW, EXACT)


@triton.jit
def _tma(x_desc, c_ptr, s_ptr, M, NG, K, N_TILES, BM: tl.constexpr, GPP: tl.constexpr,
         ITERS: tl.constexpr, STAGES: tl.constexpr, PER_ROW: tl.constexpr):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    ngb = tl.cdiv(NG, GPP)
    for i in tl.range(0, ITERS, num_stages=STAGES):
        t = pid + i * npg
        t = tl.where(t < N_TILES, t, N_TILES)  # past the end: rows >= M, all stores masked
        r0 = (t // ngb) * BM
        g0 = (t % ngb) * GPP
        x = x_desc.load([r0, g0, 0])
        _tile_codes(x, c_ptr, s_ptr, r0 + tl.arange(0, BM), g0 + tl.arange(0, GPP), M, NG, K,
                    PER_ROW)


def run_plain(x, c, s, BM, GPP, W, per_row, exact=0):
    M, K = x.shape
    NG = K // 128
    _plain[(triton.cdiv(M, BM), triton.cdiv(NG, GPP))](x, c, s, M, NG, K, BM=BM, GPP=GPP,
                                                        PER_ROW=per_row, EXACT=exact,
                                                        num_warps=W)


def run_tma(x, c, s, BM, GPP, W, ST, IT, per_row):
    M, K = x.shape
    NG = K // 128
    d = TensorDescriptor(x, [M, NG, 128], [K, 128, 1], [BM, GPP, 128])
    n = triton.cdiv(M, BM) * triton.cdiv(NG, GPP)
    _tma[(triton.cdiv(n, IT),)](d, c, s, M, NG, K, n, BM=BM, GPP=GPP, ITERS=IT, STAGES=ST,
                                PER_ROW=per_row, num_warps=W)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-tma", action="store_true", help="plain kernels only")
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--K", type=int, default=7168)
    a = ap.parse_args()
    M, K = a.M, a.K
    print("GPU:", torch.cuda.get_device_name(), flush=True)
    cp = B.copy_bandwidth()
    print(f"copy {cp:.3f} TB/s", flush=True)
    xs = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16),) for _ in range(2)]
    c = torch.empty(M, K, dtype=torch.uint8, device="cuda")
    s = torch.empty(M, K // 128, dtype=torch.float32, device="cuda")
    nbytes = M * K * 3 + M * (K // 128) * 4

    def rep(name, fn, check=None):
        try:
            fn(*xs[0])
            if check is not None:
                check()
            ms = B.bench_fn(fn, xs, rep_ms=100)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print(f"{name:48s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        tb = nbytes / (ms * 1e-3) / 1e12
        print(f"{name:48s} {ms * 1e3:8.1f} us {tb:6.3f} TB/s {100 * tb / cp:5.1f}%", flush=True)

    # the fast paths as they are
    rep("fastpath default 1x128", lambda x: Q.quantize(x, fp8_group(128)))
    rep("fastpath deepgemm 1x128", lambda x: Q.quantize(x, fp8_group(128, "fp32", "deepgemm")))
    rep("fastpath per-token", lambda x: Q.quantize(x, fp8_per_token()))

    # correctness of the probe kernels: TMA == plain, bit for bit
    ref_c = torch.empty_like(c)
    ref_s = torch.empty_like(s)
    run_plain(xs[0][0], ref_c, ref_s, 1, 8, 4, False)

    def same():
        torch.cuda.synchronize()
        assert torch.equal(c, ref_c) and torch.equal(s, ref_s), "TMA tile != plain tile"

    for BM, GPP, W in ((1, 8, 2), (1, 8, 4), (1, 16, 4), (2, 8, 4), (4, 8, 8)):
        rep(f"plain 1x128 bm{BM} gpp{GPP} w{W}", lambda x, BM=BM, GPP=GPP, W=W:
            run_plain(x, c, s, BM, GPP, W, False))
    tiles = ((1, 8, 4), (1, 16, 4), (2, 8, 4), (4, 8, 8), (1, 32, 8), (8, 8, 8))
    if a.quick:
        tiles = tiles[:2]
    if a.no_tma:
        tiles = ()
    for BM, GPP, W in tiles:
        for ST in (2, 3, 4):
            for IT in (4, 16, 64):
                c.fill_(0x5A)
                rep(f"tma 1x128 bm{BM} gpp{GPP} w{W} st{ST} it{IT}",
                    lambda x, BM=BM, GPP=GPP, W=W, ST=ST, IT=IT:
                    run_tma(x, c, s, BM, GPP, W, ST, IT, False), same)
    # per-token: one scale per row of 7168 = 56 groups, a [1, 64, 128] box (groups 56..63 are
    # out of bounds: TMA fills zeros and fetches nothing)
    st = torch.empty(M, dtype=torch.float32, device="cuda")
    for W in (4, 8) if not a.no_tma else ():
        for ST in (2, 3):
            for IT in (4, 16):
                rep(f"tma per-token bm1 gpp64 w{W} st{ST} it{IT}",
                    lambda x, W=W, ST=ST, IT=IT: run_tma(x, c, st, 1, 64, W, ST, IT, True))
    for W in (4, 8, 16):
        rep(f"plain per-token bm1 gpp64 w{W}", lambda x, W=W: run_plain(x, c, st, 1, 64, W, True))
    division = {1: "_div_exact", 2: "in-window Markstein", 3: "div.rn"}
    for ex in (1, 2, 3):
        for W in (4, 8):
            rep(f"plain per-token {division[ex]} bm1 gpp64 w{W}",
                lambda x, W=W, ex=ex: run_plain(x, c, st, 1, 64, W, True, ex))
        for BM, GPP, W in ((1, 8, 2), (1, 32, 4)):
            rep(f"plain 1x128 {division[ex]} bm{BM} gpp{GPP} w{W}",
                lambda x, BM=BM, GPP=GPP, W=W, ex=ex: run_plain(x, c, s, BM, GPP, W, False, ex))


if __name__ == "__main__":
    main()
