"""Static census of the W4 grouped-GEMM kernel's main loop, without a GPU: compile ``_w4_kernel`` for sm_90 on
the CPU (Triton's bundled ptxas; pointers and integer arguments specialised as divisible by 16, as a launch on
aligned tensors specialises them) and count the SASS instructions of the loop that holds the HGMMAs, by opcode,
with the global/shared memory operations by width and the HGMMA form (``R`` operand: the decoded weights are the
register operand). A proxy to compare kernel variants before spending device time on them; it measures nothing.

    python bench/studies/w4_sass_census.py --kind mxfp4 --tiles 64,64,128,4,4,0 [--k 2880] [--sass out.sass]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastpath.grouped_gemm_w4 import _w4_kernel  # noqa: E402

_INS = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)(.*)")


def compile_sass(kind: str, tiles: list[int], k: int) -> str:
    bm, bn, bk, warps, stages, swap = tiles
    fmt = {"mxfp4": 0, "nvfp4": 1, "int4": 2}[kind]
    sig = dict(a_ptr="*bf16", sa_ptr="*fp32", w_ptr="*u8", s_ptr="*fp32" if fmt == 2 else "*u8", zp_ptr="*u8",
               gm_ptr="*fp32", gd_ptr="*fp32", d_ptr="*bf16", m_idx_ptr="*i32", bias_ptr="*fp32", M="i32", N="i32",
               K="i32", stride_am="i32", stride_sam="i32", stride_we="i32", stride_wn="i32", stride_se="i32",
               stride_sn="i32", stride_dm="i32")
    const = dict(FMT=fmt, GROUP={0: 32, 1: 16, 2: 128}[fmt], SCALE_ROWS=1, HAS_ZP=False, A_FP8=False, BLOCK_M=bm,
                 BLOCK_N=bn, BLOCK_K=bk, K_ITERS=-(-k // bk), EVEN_K=k % bk == 0, HAS_BIAS=False, IEEE=False,
                 DOT_T=tl.bfloat16, PROMOTE=fmt == 2, SWAP_AB=bool(swap))
    const = {n: v for n, v in const.items() if n in _w4_kernel.arg_names}  # kernels without SWAP_AB / EVEN_K
    sig.update({name: "constexpr" for name in const})
    aligned = [n for n in sig if n not in const and n != "stride_sam"]
    attrs = {(_w4_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kern = triton.compile(ASTSource(_w4_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    cubin = f"/tmp/w4_census_{os.getpid()}.cubin"
    with open(cubin, "wb") as f:
        f.write(kern.asm["cubin"])
    try:
        return subprocess.run([path, "-c", cubin], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(cubin)


def main_loop(sass: str) -> list[tuple[str, str]]:
    """The instructions of the largest backward-branch loop that holds an HGMMA."""
    labels, ins = {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = _INS.match(line)
        if m:
            ins.append((m.group(1), m.group(2)))
    best: list = []
    for j, (op, rest) in enumerate(ins):
        t = re.search(r"(\.L_x_\d+)", rest) if op.startswith("BRA") else None
        if t and labels.get(t.group(1), j + 1) < j:
            body = ins[labels[t.group(1)]: j + 1]
            if any(o.startswith("HGMMA") for o, _ in body) and len(body) > len(best):
                best = body
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["mxfp4", "nvfp4", "int4"], default="mxfp4")
    ap.add_argument("--tiles", default="64,64,128,4,4,0",
                    help="block_m,block_n,block_k,warps,stages,swap_ab (swap_ab ignored by a kernel without it)")
    ap.add_argument("--k", type=int, default=2880)
    ap.add_argument("--sass", help="write the whole SASS here")
    args = ap.parse_args(argv)
    tiles = [int(v) for v in args.tiles.split(",")]
    sass = compile_sass(args.kind, tiles, args.k)
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    loop = main_loop(sass)
    if not loop:
        print("no loop with an HGMMA found")
        return 1
    per_thread = tiles[1] * tiles[2] // (32 * tiles[3])  # weight elements decoded per thread per K step
    ops = collections.Counter(o.split(".")[0] for o, _ in loop)
    mem = collections.Counter(o for o, _ in loop if o.startswith(("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDL", "STL")))
    hgmma = sorted({o + (" (A in registers)" if re.search(r"R\d+,\s*R\d+,\s*gdesc", r) else " (A in shared memory)")
                    for o, r in loop if o.startswith("HGMMA")})
    print(f"{args.kind} tiles {args.tiles} K {args.k}: main loop {len(loop)} instructions, "
          f"{len(loop) / per_thread:.1f} per decoded weight element a thread")
    print("  opcodes:", dict(ops.most_common(16)))
    print("  memory:", dict(sorted(mem.items())))
    print("  mma:", "; ".join(hgmma))
    return 0


if __name__ == "__main__":
    sys.exit(main())
