"""The FP8 grouped GEMM of the contiguous layout in Gluon (Hopper, sm_90): ``GemmTiles(kernel="gluon")``.

:func:`fastpath.grouped_gemm.grouped_gemm_contiguous` launches :func:`_gluon_fp8_grouped_gemm_kernel` for tiles
with ``kernel="gluon"``: FP8 E4M3 ``a [M, K]`` with FP32 1x128 scales, ``b [E, N, K]`` with FP32 128x128 scales,
the row -> expert map ``m_indices`` (-1: padding), any output dtype (bf16 in the layer). The design is
DeepGEMM's SM90 FP8 GEMM's (128-row tiles, one TMA producer, two math warpgroups, promotion in registers after
each 128-column K block), written with Triton's Gluon (``triton.experimental.gluon``, Triton 3.6):

* a persistent grid: ``min(tiles, SMs)`` programs, program ``p`` taking tiles ``p, p + P, ...`` of the
  ``cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N)`` output tiles in :func:`fastpath._grouped_gemm_tiles._tile_coords`'
  order (groups of ``group_m`` row tiles, row tiles fastest inside a group, so an expert's row tiles read each
  B tile together); a tile whose first row is padding (``m_indices < 0``) is skipped by every partition;
* three partitions (``gl.warp_specialize``): one warp issues the TMA loads of A ``[BLOCK_M, 128]`` and B
  ``[BLOCK_N, 128]`` (B read as ``[E * N, K]``; out-of-bounds rows and K columns read as zeros) into a ring of
  ``num_stages`` shared-memory stages (an mbarrier "ready" per stage with the bytes expected, an mbarrier
  "empty" per stage that both math warpgroups arrive on); two math warpgroups (4 warps each, rows
  ``0 .. BLOCK_M/2 - 1`` and ``BLOCK_M/2 ..`` of the tile) each issue per K block an asynchronous wgmma
  (``m64nBLOCK_Nk32`` instructions) into a fresh accumulator (``use_acc=False``), then wait until at most one
  MMA is in flight (``warpgroup_mma_wait(1)``), so block ``k + 1``'s MMA runs while block ``k`` is promoted
  (``acc + (part * sa) * sb`` in FP32, its stage released first). The K loop runs in chunks of :data:`K_UNROLL`
  blocks, unrolled, each ending with no MMA in flight: inside a chunk the in-flight products alternate between
  two register sets, written by MMAs only (ptxas serializes every wgmma of a kernel that copies or zeroes a
  running MMA's accumulator registers, its note C7515, or that runs short of registers, C7512);
* the FP32 accumulator is rounded to the output dtype and stored from registers (rows ``< M``, columns
  ``< N``).

Bits: every output is made with the FP32 operations of the Triton kernel's default tiles (``DEFAULT_TILES
["fp8_block"]``, :mod:`fastpath.grouped_gemm`): per 128-column K block the same wgmma instructions
(``m64n128k32``, K order, from a zeroed accumulator) and then ``acc += (part * sa) * sb`` in K-block order (the
compiled promotion is ``fma(fl(part * sa), sb, acc)`` in both), rounded once at the store; so the same bits
(``TRITON_FP8_BLOCK_EXACT`` holds for both; tests/test_grouped_gemm_gluon.py checks them on a GPU).

Gluon has no interpreter: under ``TRITON_INTERPRET=1`` the kernel cannot run (the launcher refuses), and
tests compile it for sm_90a on the CPU instead (bench/studies/triton_fp8_prefill_compile.py, which records
:func:`_launch` on CPU tensors).
"""
from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from moeref._interop import triton_interpreted

from ._grouped_gemm_tiles import _ordered, _tile_coords

__all__ = ["launch_gluon"]

SCALE_BLOCK = 128
"""The scales' block (1x128 activations, 128x128 weights) and the kernel's K step."""
PRODUCER_REGISTERS, MATH_REGISTERS, KERNEL_MAXNREG = gl.constexpr(40), gl.constexpr(232), 168
"""Registers per thread: the TMA warp's and the second math warpgroup's (``setmaxnreg``; the first math warpgroup,
the default partition, gets what is left of ``KERNEL_MAXNREG`` times the 12 warps the kernel is given, 232)."""

K_UNROLL = 4
"""K blocks per iteration of a math warpgroup's K loop (unrolled; no MMA in flight between iterations). On an H200
(2026-11-29) 4 ran GEMM1 (K = 7168) in 3.44 ms, 8 in 3.67 ms and the whole K loop unrolled (56 blocks, 343 KB of
code) in 7.8 ms (the instruction cache, presumably); 2 ran as fast as 4 (3.41 ms; GEMM2 2.06 against 2.01 ms)."""

_tile_coords_g = gluon.jit(_tile_coords.fn)  # the tile-loop kernel's tile order, compiled as a Gluon function
_ordered_g = gluon.jit(_ordered.fn)  # its ordering barrier: a promotion done before the next MMA is issued (else
# LLVM moves it past that MMA, whose accumulator then needs a third register set, and ptxas spills)


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, m_idx_ptr, M, N, NUM_PROGRAMS,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_ITERS: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The TMA warp: for each live tile and K block, wait for the stage to be empty, then load A and B into it."""
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K  # FP8: one byte an element
    c = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords_g(tile, num_pid_m, num_pid_n, GROUP_M)
        e = gl.load(m_idx_ptr + pid_m * BLOCK_M)
        if e >= 0:
            row0 = pid_m * BLOCK_M
            brow0 = e * N + pid_n * BLOCK_N
            for k in range(K_ITERS):
                s = c % STAGES
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, k * BLOCK_K], ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [brow0, k * BLOCK_K], ready.index(s), b_bufs.index(s))
                c += 1


@gluon.jit
def _issue(a_bufs, b_bufs, ready, c, regs, HALF: gl.constexpr, STAGES: gl.constexpr):
    """Block ``c``'s (global K-block count) product, asynchronous: wait for its stage, one wgmma of this
    warpgroup's rows of A against B^T into a fresh accumulator (``use_acc=False``: the first instruction ignores
    the accumulator's values). ``regs``: a product already retired, whose registers the MMA takes: they are then
    written by MMAs only (zeroing a fresh accumulator would write them while the other product's MMA runs, and
    ptxas then serializes every MMA, its C7515 note)."""
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    hm: gl.constexpr = regs.shape[0]
    a = a_bufs.index(s).slice(HALF * hm, hm, dim=0)
    return warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), regs, use_acc=False, is_async=True)


@gluon.jit
def _scales(sa_row, rmask, sb_base, k):
    """``(sa [rows], sb)`` of K block ``k``: the rows' activation scales and the tile's weight scale."""
    return gl.load(sa_row + k, mask=rmask, other=0.0), gl.load(sb_base + k)


@gluon.jit
def _retire(acc, part, sa, sb, empty, c, STAGES: gl.constexpr, OUTSTANDING: gl.constexpr):
    """Wait for block ``c``'s product (``OUTSTANDING`` later MMAs may still run), release its stage, promote it:
    ``(acc + (part * sa) * sb, part)`` (the Triton kernel's ``acc += part * sa[:, None] * sb``)."""
    part = warpgroup_mma_wait(OUTSTANDING, deps=(part,))
    mbarrier.arrive(empty.index(c % STAGES), count=1)
    return _ordered_g(acc + part * gl.expand_dims(sa, 1) * sb), part


@gluon.jit
def _zeros_here(like):
    """Zeros shaped as ``like``, made here (a ``mov`` per element in inline PTX, not pure, so LLVM neither hoists
    them out of the K loop nor shares them between the two register sets). ``gl.zeros_like`` compiles without
    spills too (the ordering of :func:`_retire` is what keeps the register sets at two); this form is the one
    measured on the H200."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [like], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _k_run(acc, a_bufs, b_bufs, ready, empty, sa_row, rmask, sb_base, k0, c, NB: gl.constexpr,
           HALF: gl.constexpr, STAGES: gl.constexpr):
    """``(acc, c)`` after K blocks ``k0 .. k0 + NB - 1`` (global block count ``c ..``), from no MMA in flight to
    none: products alternate between two register sets ``p`` and ``q`` (the first MMA of each from ``zero``, then
    from a retired product), block ``k + 1``'s MMA issued before block ``k``'s wait (``warpgroup_mma_wait(1)``)
    and promotion."""
    zero = _zeros_here(acc)
    p = _issue(a_bufs, b_bufs, ready, c, zero, HALF, STAGES)
    q = zero
    sa_p, sb_p = _scales(sa_row, rmask, sb_base, k0)
    for j in gl.static_range((NB - 1) // 2):  # p: block k0 + 2j in flight
        q = _issue(a_bufs, b_bufs, ready, c + 1, q, HALF, STAGES)
        sa_q, sb_q = _scales(sa_row, rmask, sb_base, k0 + 2 * j + 1)
        acc, p = _retire(acc, p, sa_p, sb_p, empty, c, STAGES, 1)
        p = _issue(a_bufs, b_bufs, ready, c + 2, p, HALF, STAGES)
        sa_p, sb_p = _scales(sa_row, rmask, sb_base, k0 + 2 * j + 2)
        acc, q = _retire(acc, q, sa_q, sb_q, empty, c + 1, STAGES, 1)
        c += 2
    if NB % 2 == 0:  # the last two blocks
        q = _issue(a_bufs, b_bufs, ready, c + 1, q, HALF, STAGES)
        sa_q, sb_q = _scales(sa_row, rmask, sb_base, k0 + NB - 1)
        acc, p = _retire(acc, p, sa_p, sb_p, empty, c, STAGES, 1)
        acc, q = _retire(acc, q, sa_q, sb_q, empty, c + 1, STAGES, 0)
        c += 2
    else:
        acc, p = _retire(acc, p, sa_p, sb_p, empty, c, STAGES, 0)
        c += 1
    return acc, c


@gluon.jit
def _math(a_bufs, b_bufs, ready, empty, d_ptr, sa_ptr, sb_ptr, bias_ptr, m_idx_ptr, M, N, stride_dm, stride_sam,
          stride_sbe, stride_sbn, NUM_PROGRAMS, HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          K_ITERS: gl.constexpr, K_UNROLL: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
          HAS_BIAS: gl.constexpr):
    """A math warpgroup: rows ``HALF * BLOCK_M / 2 ..`` of each live tile, K blocks in chunks (see the module)."""
    HM: gl.constexpr = BLOCK_M // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    zero = gl.zeros([HM, BLOCK_N], gl.float32, mma)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    c = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords_g(tile, num_pid_m, num_pid_n, GROUP_M)
        e = gl.load(m_idx_ptr + pid_m * BLOCK_M)
        if e >= 0:
            rows = pid_m * BLOCK_M + HALF * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
            rmask = rows < M
            sa_row = sa_ptr + rows.to(gl.int64) * stride_sam
            sb_base = sb_ptr + e.to(gl.int64) * stride_sbe + ((pid_n * BLOCK_N) // 128) * stride_sbn
            acc = zero
            for kc in range(K_ITERS // K_UNROLL):  # chunks of K_UNROLL blocks, each ending with no MMA in flight
                acc, c = _k_run(acc, a_bufs, b_bufs, ready, empty, sa_row, rmask, sb_base, kc * K_UNROLL, c,
                                K_UNROLL, HALF, STAGES)
            if K_ITERS % K_UNROLL != 0:
                acc, c = _k_run(acc, a_bufs, b_bufs, ready, empty, sa_row, rmask, sb_base,
                                (K_ITERS // K_UNROLL) * K_UNROLL, c, K_ITERS % K_UNROLL, HALF, STAGES)
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
            if HAS_BIAS:  # FP32 epilogue: bias[e, n] added to the accumulator before the store (as the Triton kernel)
                acc = acc + gl.expand_dims(gl.load(bias_ptr + e.to(gl.int64) * N + cols, mask=cols < N, other=0.0), 0)
            ptrs = d_ptr + gl.expand_dims(rows.to(gl.int64) * stride_dm, 1) + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cols < N, 0)
            gl.store(ptrs, acc.to(d_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _gluon_fp8_grouped_gemm_kernel(a_ptr, b_ptr, d_ptr, m_idx_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, E,
                                   stride_am, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn, NUM_PROGRAMS,
                                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                   K_ITERS: gl.constexpr, K_UNROLL: gl.constexpr, STAGES: gl.constexpr,
                                   GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr):
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], smem)
    b_desc = tma.make_tensor_descriptor(b_ptr, [E * N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K], smem)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], smem)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], smem)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per math warpgroup
    gl.warp_specialize([
        (_math, (a_bufs, b_bufs, ready, empty, d_ptr, sa_ptr, sb_ptr, bias_ptr, m_idx_ptr, M, N, stride_dm,
                 stride_sam, stride_sbe, stride_sbn, NUM_PROGRAMS, gl.constexpr(0), BLOCK_M, BLOCK_N, K_ITERS,
                 K_UNROLL, STAGES, GROUP_M, HAS_BIAS)),
        (_math, (a_bufs, b_bufs, ready, empty, d_ptr, sa_ptr, sb_ptr, bias_ptr, m_idx_ptr, M, N, stride_dm,
                 stride_sam, stride_sbe, stride_sbn, NUM_PROGRAMS, gl.constexpr(1), BLOCK_M, BLOCK_N, K_ITERS,
                 K_UNROLL, STAGES, GROUP_M, HAS_BIAS)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, m_idx_ptr, M, N, NUM_PROGRAMS, BLOCK_M, BLOCK_N,
                     BLOCK_K, K_ITERS, STAGES, GROUP_M)),
    ], [4, 1], [MATH_REGISTERS, PRODUCER_REGISTERS])


def launch_gluon(a, b, d, m_idx, sa, sb, bias, t, m: int, n: int, k: int, e: int, *, fp8: bool, masked: bool,
                 gather: bool, capability: tuple | None, sm_count: int) -> None:
    """``d [m, n] = a @ b[m_idx].T`` (+ ``bias`` FP32 ``[e, n]`` if given) by :func:`_gluon_fp8_grouped_gemm_kernel`
    for tiles ``t`` (``kernel="gluon"``), after the checks of what it runs (a ``ValueError`` naming what was given):
    FP8 operands, the contiguous layout's rows (not ``masked``, not ``gather``-ed through ``a_src``), a CUDA GPU
    of compute capability 9.0 (``capability`` of ``a``'s GPU; wgmma, setmaxnreg; Gluon has no interpreter), 16-byte
    aligned rows and bases (TMA). The grid: ``min(tiles, sm_count)`` programs."""
    if not fp8 or masked or gather:
        what = "a_src (gathered token rows: Hopper's TMA has no row gather)" if gather else \
            "the masked layout" if masked else f"{a.dtype} operands"
        raise ValueError(f"kernel='gluon' runs FP8 E4M3 operands with 1x128 / 128x128 scales on the contiguous "
                         f"layout's rows; got {what}: use kernel='triton' tiles")
    if a.device.type != "cuda" or triton_interpreted():
        raise ValueError("kernel='gluon' needs a CUDA GPU (Gluon kernels have no interpreter; TRITON_INTERPRET="
                         f"{os.environ.get('TRITON_INTERPRET')!r}, device {a.device})")
    if tuple(capability) != (9, 0):
        raise ValueError(f"kernel='gluon' is a Hopper (sm_90) kernel (wgmma, setmaxnreg); this GPU is "
                         f"sm_{capability[0]}{capability[1]}")
    bad = [f"{name} (address {x.data_ptr()})" for name, x in (("a", a), ("b", b)) if x.data_ptr() % 16]
    if k % 16 or bad:
        raise ValueError(f"kernel='gluon' loads through TMA: 16-byte aligned rows and bases; K = {k} FP8 bytes a row"
                         f"{'; unaligned: ' + ', '.join(bad) if bad else ''}")
    programs = min(-(-m // t.block_m) * -(-n // t.block_n), sm_count)
    _launch(a, b, d, m_idx, sa, sb, bias, t, m, n, k, e, programs)


def _launch(a, b, d, m_idx, sa, sb, bias, t, m: int, n: int, k: int, e: int, programs: int) -> None:
    """One launch of :func:`_gluon_fp8_grouped_gemm_kernel` on ``programs`` programs (no checks: the sm_90a compile
    study records it on CPU tensors)."""
    from ._grouped_gemm_tiles import ensure_allocator
    from ._host import launch

    ensure_allocator()  # the in-kernel tensor descriptors' scratch
    launch(_gluon_fp8_grouped_gemm_kernel, (programs,), a, b, d, m_idx, sa, sb, sa if bias is None else bias, m, n,
           k, e, a.stride(0), b.stride(1), d.stride(0), sa.stride(0), sb.stride(0), sb.stride(1), programs,
           BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=SCALE_BLOCK, K_ITERS=-(-k // SCALE_BLOCK), K_UNROLL=K_UNROLL,
           STAGES=t.num_stages, GROUP_M=t.group_m, HAS_BIAS=bias is not None, num_warps=4, maxnreg=KERNEL_MAXNREG)
