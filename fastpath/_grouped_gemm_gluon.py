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
  (``acc + part * fl(sa * sb)`` in FP32, its stage released first). The K loop runs in chunks of :data:`K_UNROLL`
  blocks, unrolled, each ending with no MMA in flight: inside a chunk the in-flight products alternate between
  two register sets, written by MMAs only (ptxas serializes every wgmma of a kernel that copies or zeroes a
  running MMA's accumulator registers, its note C7515, or that runs short of registers, C7512);
* 128 x 192 tiles (``block_n=192``; Gluon's tensors, shared buffers and TMA boxes are powers of two): B in three
  64-row TMA boxes, the two of one 128-column weight-scale block into a 128-row buffer and the third into a
  64-row one, so each math warpgroup runs per K block an ``m64n128k32`` and an ``m64n64k32`` product, each with
  one weight scale, and waits for both before promoting (one product in flight: a third register set does not
  fit; :func:`_tile192`);
* the FP32 accumulator is rounded to the output dtype and stored (rows ``< M``, columns ``< N``) from registers
  (``epilogue="store"``), or (``epilogue="tma"``) into a shared-memory buffer per math warpgroup and from there
  by a TMA store, which runs on while the next tile's MMAs do (the warpgroup waits for it before it writes the
  buffer again).

Bits: every output is made with the FP32 operations of the Triton kernel's default tiles (``DEFAULT_TILES
["fp8_block"]``, :mod:`fastpath.grouped_gemm`) and of DeepGEMM's SM90 kernel: per 128-column K block the same
wgmma instructions (``m64n128k32``, K order, from a zeroed accumulator; 128 x 192 tiles' ``m64n64k32`` gave the
same bits on an H200) and then DeepGEMM's promotion ``acc = fma(part, fl(sa * sb), acc)`` in K-block order, rounded
once at the store; so the same bits (``TRITON_FP8_BLOCK_EXACT`` = ``DEEPGEMM_FP8_EXACT`` holds for all three;
on a GPU tests/test_grouped_gemm_gluon.py checks them against the Triton tiles, and tests/test_hopper_fp8_gpu.py
against the emulator and against DeepGEMM where it is installed).

Gluon has no interpreter: under ``TRITON_INTERPRET=1`` the kernel cannot run (the launcher refuses), and
tests compile it for sm_90a on the CPU instead (bench/studies/triton_fp8_prefill_compile.py, which records
:func:`_launch` on CPU tensors).
"""
from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

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

IN_FLIGHT = None
"""Products in flight in a math warpgroup's K loop of 128 x 128 tiles: 2 (block ``k + 1``'s MMA runs while block
``k`` is promoted) or 1 (each MMA waited for before its promotion; only the other warpgroup's MMA overlaps it,
DeepGEMM's order); ``None``: 2 (128 x 192 tiles: always 1). On an H200 (2026-11-29, DeepSeek-V3 at 4096 tokens)
1 ran GEMM1 in 3.67 ms and GEMM2 in 2.21 ms against 2's 3.46 / 1.97 ms."""

_tile_coords_g = gluon.jit(_tile_coords.fn)  # the tile-loop kernel's tile order, compiled as a Gluon function
_ordered_g = gluon.jit(_ordered.fn)  # its ordering barrier: a promotion done before the next MMA is issued (else
# LLVM moves it past that MMA, whose accumulator then needs a third register set, and ptxas spills)


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, b2_bufs, ready, empty, m_idx_ptr, M, N, NUM_PROGRAMS,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_ITERS: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The TMA warp: for each live tile and K block, wait for the stage to be empty, then load A and B into it.
    192-column tiles: B in three 64-row boxes, the two of one 128-column scale block into ``b_bufs`` (128 rows),
    the third into ``b2_bufs`` (64 rows): boxes 0, 1 | 2 for an even column tile, 1, 2 | 0 for an odd one."""
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
            odd = pid_n % 2
            for k in range(K_ITERS):
                s = c % STAGES
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, k * BLOCK_K], ready.index(s), a_bufs.index(s))
                if BLOCK_N == 192:
                    for j in gl.static_range(2):
                        tma.async_copy_global_to_shared(b_desc, [brow0 + (j + odd) * 64, k * BLOCK_K],
                                                        ready.index(s), b_bufs.index(s).slice(j * 64, 64, dim=0))
                    tma.async_copy_global_to_shared(b_desc, [brow0 + (1 - odd) * 128, k * BLOCK_K], ready.index(s),
                                                    b2_bufs.index(s))
                else:
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
    ``(fma(part, fl(sa * sb), acc), part)`` (DeepGEMM's promotion and the Triton kernel's)."""
    part = warpgroup_mma_wait(OUTSTANDING, deps=(part,))
    mbarrier.arrive(empty.index(c % STAGES), count=1)
    return _ordered_g(acc + part * gl.expand_dims(sa * sb, 1)), part


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
def _k_run1(acc, part, a_bufs, b_bufs, ready, empty, sa_row, rmask, sb_base, k0, c, NB: gl.constexpr,
            HALF: gl.constexpr, STAGES: gl.constexpr):
    """``(acc, part, c)`` after K blocks ``k0 .. k0 + NB - 1`` with one product in flight (:data:`IN_FLIGHT` 1):
    per block, its MMA into the retired product's registers ``part``, a full wait, its promotion."""
    for j in gl.static_range(NB):
        part = _issue(a_bufs, b_bufs, ready, c, part, HALF, STAGES)
        sa, sb = _scales(sa_row, rmask, sb_base, k0 + j)
        acc, part = _retire(acc, part, sa, sb, empty, c, STAGES, 0)
        c += 1
    return acc, part, c


@gluon.jit
def _tile192(a_bufs, b_bufs, b2_bufs, ready, empty, d_ptr, sa_ptr, sb_ptr, bias_ptr, e, pid_m, pid_n, c, M, N,
             stride_dm, stride_sam, stride_sbe, stride_sbn, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
             K_ITERS: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr):
    """One 128 x 192 tile's rows of a math warpgroup (returns ``c``): two products per K block, ``p`` of the
    128 columns of one scale block in ``b_bufs`` (``m64n128k32``) and ``q`` of the other 64 in ``b2_bufs``
    (``m64n64k32``), each waited for before its promotion (one product in flight); each with its scalar weight
    scale (columns ``n0 .. n0 + 127 | n0 + 128 ..`` for an even column tile, ``n0 + 64 .. | n0 ..`` for an odd)."""
    HM: gl.constexpr = BLOCK_M // 2
    lp: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    lq: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    odd = pid_n % 2
    col_p = pid_n * 192 + odd * 64
    col_q = pid_n * 192 + (1 - odd) * 128
    rows = pid_m * BLOCK_M + HALF * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, lp))
    rmask = rows < M
    sa_row = sa_ptr + rows.to(gl.int64) * stride_sam
    sb_e = sb_ptr + e.to(gl.int64) * stride_sbe
    sb_p, sb_q = sb_e + (col_p // 128) * stride_sbn, sb_e + (col_q // 128) * stride_sbn
    acc_p, acc_q = gl.zeros([HM, 128], gl.float32, lp), gl.zeros([HM, 64], gl.float32, lq)
    p, q = acc_p, acc_q
    for k in range(K_ITERS):
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        a = a_bufs.index(s).slice(HALF * HM, HM, dim=0)
        p = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), p, use_acc=False, is_async=True)
        q = warpgroup_mma(a, b2_bufs.index(s).permute((1, 0)), q, use_acc=False, is_async=True)
        sa = gl.load(sa_row + k, mask=rmask, other=0.0)
        sbp = gl.load(sb_p + k, mask=col_p < N, other=0.0)
        sbq = gl.load(sb_q + k, mask=col_q < N, other=0.0)
        p, q = warpgroup_mma_wait(0, deps=(p, q))
        mbarrier.arrive(empty.index(s), count=1)
        acc_p = _ordered_g(acc_p + p * gl.expand_dims(sa * sbp, 1))
        acc_q = _ordered_g(acc_q + q * gl.expand_dims(gl.convert_layout(sa, gl.SliceLayout(1, lq)) * sbq, 1))
        c += 1
    _store(acc_p, d_ptr, bias_ptr, e, rows, rmask, col_p, N, stride_dm, HAS_BIAS)
    _store(acc_q, d_ptr, bias_ptr, e, gl.convert_layout(rows, gl.SliceLayout(1, lq)),
           gl.convert_layout(rmask, gl.SliceLayout(1, lq)), col_q, N, stride_dm, HAS_BIAS)
    return c


@gluon.jit
def _store(acc, d_ptr, bias_ptr, e, rows, rmask, col0, N, stride_dm, HAS_BIAS: gl.constexpr):
    """Store ``acc`` (+ the bias, FP32, as the Triton kernel) to rows ``rows``, columns ``col0 ..`` of ``d``
    (rows ``< M``, columns ``< N``), from registers."""
    cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
    if HAS_BIAS:
        acc = acc + gl.expand_dims(gl.load(bias_ptr + e.to(gl.int64) * N + cols, mask=cols < N, other=0.0), 0)
    ptrs = d_ptr + gl.expand_dims(rows.to(gl.int64) * stride_dm, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cols < N, 0)
    gl.store(ptrs, acc.to(d_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _math(a_bufs, b_bufs, b2_bufs, ready, empty, d_ptr, d_desc, c_smem, sa_ptr, sb_ptr, bias_ptr, m_idx_ptr, M, N,
          stride_dm, stride_sam, stride_sbe, stride_sbn, NUM_PROGRAMS, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, K_ITERS: gl.constexpr, K_UNROLL: gl.constexpr, STAGES: gl.constexpr,
          GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, INFLIGHT: gl.constexpr, EPI_TMA: gl.constexpr):
    """A math warpgroup: rows ``HALF * BLOCK_M / 2 ..`` of each live tile, K blocks in chunks (see the module)."""
    HM: gl.constexpr = BLOCK_M // 2
    BN: gl.constexpr = 128 if BLOCK_N == 192 else BLOCK_N  # the one-product tiles (192: :func:`_tile192`)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    zero = gl.zeros([HM, BN], gl.float32, mma)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    c = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords_g(tile, num_pid_m, num_pid_n, GROUP_M)
        e = gl.load(m_idx_ptr + pid_m * BLOCK_M)
        if BLOCK_N == 192:
            if e >= 0:
                c = _tile192(a_bufs, b_bufs, b2_bufs, ready, empty, d_ptr, sa_ptr, sb_ptr, bias_ptr, e, pid_m, pid_n,
                             c, M, N, stride_dm, stride_sam, stride_sbe, stride_sbn, HALF, BLOCK_M, K_ITERS, STAGES,
                             HAS_BIAS)
        elif e >= 0:
            rows = pid_m * BLOCK_M + HALF * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
            rmask = rows < M
            sa_row = sa_ptr + rows.to(gl.int64) * stride_sam
            sb_base = sb_ptr + e.to(gl.int64) * stride_sbe + ((pid_n * BLOCK_N) // 128) * stride_sbn
            acc = zero
            if INFLIGHT == 1:
                part = zero
                for kc in range(K_ITERS // K_UNROLL):
                    acc, part, c = _k_run1(acc, part, a_bufs, b_bufs, ready, empty, sa_row, rmask, sb_base,
                                           kc * K_UNROLL, c, K_UNROLL, HALF, STAGES)
                if K_ITERS % K_UNROLL != 0:
                    acc, part, c = _k_run1(acc, part, a_bufs, b_bufs, ready, empty, sa_row, rmask, sb_base,
                                           (K_ITERS // K_UNROLL) * K_UNROLL, c, K_ITERS % K_UNROLL, HALF, STAGES)
            else:
                for kc in range(K_ITERS // K_UNROLL):  # chunks of K_UNROLL blocks, each ending with no MMA in flight
                    acc, c = _k_run(acc, a_bufs, b_bufs, ready, empty, sa_row, rmask, sb_base, kc * K_UNROLL,
                                    c, K_UNROLL, HALF, STAGES)
                if K_ITERS % K_UNROLL != 0:
                    acc, c = _k_run(acc, a_bufs, b_bufs, ready, empty, sa_row, rmask, sb_base,
                                    (K_ITERS // K_UNROLL) * K_UNROLL, c, K_ITERS % K_UNROLL, HALF, STAGES)
            if EPI_TMA:  # through shared memory: the TMA store runs on while the next tile's MMAs do
                if HAS_BIAS:  # FP32: bias[e, n] added to the accumulator before the store (as the Triton kernel)
                    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                    acc = acc + gl.expand_dims(gl.load(bias_ptr + e.to(gl.int64) * N + cols, mask=cols < N,
                                                       other=0.0), 0)
                tma.store_wait(0)  # this warpgroup's previous tile has left its buffer
                c_smem.index(HALF).store(acc.to(c_smem.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(d_desc, [pid_m * BLOCK_M + HALF * HM, pid_n * BLOCK_N],
                                                c_smem.index(HALF))
            else:
                _store(acc, d_ptr, bias_ptr, e, rows, rmask, pid_n * BLOCK_N, N, stride_dm, HAS_BIAS)
    if EPI_TMA:
        tma.store_wait(0)


@gluon.jit
def _gluon_fp8_grouped_gemm_kernel(a_ptr, b_ptr, d_ptr, m_idx_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, E,
                                   stride_am, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn, NUM_PROGRAMS,
                                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                   K_ITERS: gl.constexpr, K_UNROLL: gl.constexpr, STAGES: gl.constexpr,
                                   GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, INFLIGHT: gl.constexpr,
                                   C_LAYOUT: gl.constexpr):
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], smem)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], smem)
    if BLOCK_N == 192:  # Gluon's tensors, buffers and TMA boxes are powers of two: 128 + 64 rows of B a stage
        b_desc = tma.make_tensor_descriptor(b_ptr, [E * N, K], [stride_bn, 1], [64, BLOCK_K], smem)
        b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, BLOCK_K], smem)
        b2_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, BLOCK_K], smem)
    else:
        b_desc = tma.make_tensor_descriptor(b_ptr, [E * N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K], smem)
        b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], smem)
        b2_bufs = b_bufs
    EPI_TMA: gl.constexpr = C_LAYOUT is not None
    if EPI_TMA:  # the epilogue's buffer: each math warpgroup's [BLOCK_M / 2, BLOCK_N] outputs
        d_desc = tma.make_tensor_descriptor(d_ptr, [M, N], [stride_dm, 1], [BLOCK_M // 2, BLOCK_N], C_LAYOUT)
        c_smem = gl.allocate_shared_memory(d_ptr.dtype.element_ty, [2, BLOCK_M // 2, BLOCK_N], C_LAYOUT)
    else:
        d_desc = a_desc
        c_smem = a_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per math warpgroup
    gl.warp_specialize([
        (_math, (a_bufs, b_bufs, b2_bufs, ready, empty, d_ptr, d_desc, c_smem, sa_ptr, sb_ptr, bias_ptr, m_idx_ptr, M,
                 N, stride_dm, stride_sam, stride_sbe, stride_sbn, NUM_PROGRAMS, gl.constexpr(0), BLOCK_M, BLOCK_N,
                 K_ITERS, K_UNROLL, STAGES, GROUP_M, HAS_BIAS, INFLIGHT, EPI_TMA)),
        (_math, (a_bufs, b_bufs, b2_bufs, ready, empty, d_ptr, d_desc, c_smem, sa_ptr, sb_ptr, bias_ptr, m_idx_ptr, M,
                 N, stride_dm, stride_sam, stride_sbe, stride_sbn, NUM_PROGRAMS, gl.constexpr(1), BLOCK_M, BLOCK_N,
                 K_ITERS, K_UNROLL, STAGES, GROUP_M, HAS_BIAS, INFLIGHT, EPI_TMA)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, b2_bufs, ready, empty, m_idx_ptr, M, N, NUM_PROGRAMS, BLOCK_M,
                     BLOCK_N, BLOCK_K, K_ITERS, STAGES, GROUP_M)),
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
           STAGES=t.num_stages, GROUP_M=t.group_m, HAS_BIAS=bias is not None, INFLIGHT=IN_FLIGHT or 2,
           C_LAYOUT=_tma_store_layout(d, t), num_warps=4, maxnreg=KERNEL_MAXNREG)


def _tma_store_layout(d, t):
    """The shared layout of the TMA store epilogue (``t.epilogue == "tma"``) for output ``d``, or None (the
    register store) where the tiles ask for none or TMA cannot store ``d``: an output dtype other than bf16 / fp16,
    rows or base not 16-byte aligned."""
    import torch

    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}.get(d.dtype)
    if t.epilogue != "tma" or dtype is None or d.stride(1) != 1 or d.data_ptr() % 16 or \
            (d.stride(0) * d.element_size()) % 16:
        return None
    return gl.NVMMASharedLayout.get_default_for([t.block_m // 2, t.block_n], dtype)
