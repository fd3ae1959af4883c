"""The tile-loop variant of :mod:`fastpath.grouped_gemm`'s Triton kernel (contiguous layout, ``a @ B^T`` tiles).

:func:`fastpath.grouped_gemm.grouped_gemm_contiguous` launches :func:`_grouped_gemm_tile_loop_kernel` when its
:class:`~fastpath.grouped_gemm.GemmTiles` ask for any of:

* ``group_m``: the tile order. Tile ``t`` of the ``cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N)`` tiles is in the group
  of ``group_m`` row tiles ``t // (group_m * n_tiles)``, row tiles fastest inside it, so the row tiles of an
  expert read each B tile at about the same time (one DRAM read, the others L2 hits); 1 gives the order of
  the one-tile-per-program kernel (column tiles fastest: neighbouring programs share A).
* ``persistent``: ``programs_per_sm`` programs per SM, program ``p`` computing tiles ``p, p + P, ...``.
* ``tma``: B (``[E, N, K]`` read as ``[E * N, K]``) and, unless ``a`` is read through ``a_src`` (a gather,
  which Hopper's TMA does not do), A through tensor descriptors made in the kernel
  (``tl.make_tensor_descriptor``; their scratch comes from the allocator given to ``triton.set_allocator``,
  :func:`ensure_allocator`). Out-of-bounds rows and K columns read as zeros, as the masked loads do.
* ``warp_specialize``: ``tl.range(..., warp_specialize=True)`` on the tile loop (persistent) or on the
  K loop; not with ``a_src`` (pointer-loaded A fails Triton 3.6's Hopper warp specialization pass; the host
  refuses it). Triton 3.6 applies it on Hopper with 4 warps only (with 8 it compiles without; the compiled IR
  shows which, recorded by bench/studies/triton_fp8_prefill_sweep.py).
* ``flatten``: ``tl.range(..., flatten=True)`` on the tile loop (persistent only).
* ``promotion`` (FP8): the K loop's order of MMAs and promotions: :func:`_k_block` per block (``"inline"``),
  or :func:`_k_loop_lagged_pair` (``"lagged_pair"``: each block's product made by :func:`_k_partial`, promoted
  by :func:`_promote`).

Every output is computed with the FP32 operations of the one-tile-per-program kernel in the same order:
per 128-column K block a fresh ``tl.dot`` of the same operands, then (FP8) DeepGEMM's promotion
``acc = fma(part, fl(sa * sb), acc)`` in K-block order, bias and store unchanged; so the same bits
(``TRITON_FP8_BLOCK_EXACT`` holds for both). With ``BLOCK_N <= 128`` the weight scale of a tile and K block is
one number, loaded once as a scalar and broadcast: the same product per output.

Under ``TRITON_INTERPRET=1`` a loop over a runtime bound cannot use ``range`` (NumPy 2.4 refuses the
interpreter's one-element arrays as an index), so there the tile loop and a persistent program's K loop
are ``while`` loops over the same bounds and the same body (:func:`_k_block`); the ``tl.range`` forms
(and their ``warp_specialize`` / ``flatten`` options) are compiled only on the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeref._interop import triton_interpreted

__all__ = ["ensure_allocator"]

_INTERPRETED = triton_interpreted()
"""Whether the kernels run under Triton's interpreter (the ``while`` loops; bench/sass_report.py's recorder sets
it False to compile the GPU form on a machine without one)."""


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton an allocator for the tensor descriptors' scratch (``torch.empty`` on the current CUDA
    device) when none is set; one set by the caller is kept."""
    from triton.runtime import _allocation  # the ContextVar triton.set_allocator sets

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of tile ``tile``: groups of ``GROUP_M`` row tiles, row tiles fastest within
    a group; ``GROUP_M == 1``: column tiles fastest."""
    if GROUP_M == 1:
        pid_m = tile // num_pid_n
        pid_n = tile - pid_m * num_pid_n
    else:
        in_group = GROUP_M * num_pid_n
        first = (tile // in_group) * GROUP_M
        size = tl.minimum(num_pid_m - first, GROUP_M)
        r = tile - (tile // in_group) * in_group
        pid_m = first + r % size
        pid_n = r // size
    return pid_m, pid_n


@triton.jit
def _a_rows(src_ptr, rows, rmask, TOPK, GATHER: tl.constexpr):
    """``(mask, int64 row of a)`` of layout rows ``rows``: themselves, or (``GATHER``) token ``src[r] // TOPK``
    (``src < 0``: padding, masked). Both grouped GEMM kernels read ``a`` through it."""
    if GATHER:
        slot = tl.load(src_ptr + rows, mask=rmask, other=-1)
        amask = rmask & (slot >= 0)
        arow = tl.where(amask, slot // TOPK, 0).to(tl.int64)
    else:
        amask = rmask
        arow = rows.to(tl.int64)
    return amask, arow


@triton.jit
def _k_operands(it, a_base, a_desc, b_base, b_desc, amask, cmask, row0, brow0, K, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, TMA_A: tl.constexpr, TMA_B: tl.constexpr):
    """``(a [BLOCK_M, BLOCK_K], b [BLOCK_K, BLOCK_N])`` of K block ``it`` (out-of-bounds rows and K columns zero)."""
    k0 = it * BLOCK_K
    ks = tl.arange(0, BLOCK_K)
    if TMA_A:
        a = a_desc.load([row0, k0])
    elif EVEN_K:
        a = tl.load(a_base + (k0 + ks)[None, :], mask=amask[:, None], other=0.0)
    else:
        a = tl.load(a_base + (k0 + ks)[None, :], mask=amask[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
    if TMA_B:
        b = b_desc.load([brow0, k0]).T
    elif EVEN_K:
        b = tl.load(b_base + (k0 + ks)[:, None], mask=cmask[None, :], other=0.0)
    else:
        b = tl.load(b_base + (k0 + ks)[:, None], mask=((k0 + ks) < K)[:, None] & cmask[None, :], other=0.0)
    return a, b


@triton.jit
def _k_scales(it, amask, cmask, arow, e64, n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn,
              SCALE_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, SCALAR_SB: tl.constexpr):
    """``(sa [BLOCK_M], sb)`` of K block ``it``: ``sb`` one number when the tile's columns lie in one 128-column
    scale block (``SCALAR_SB``), else ``[BLOCK_N]``."""
    k0 = it * BLOCK_K
    sa = tl.load(sa_ptr + arow * stride_sam + k0 // SCALE_BLOCK, mask=amask, other=0.0)
    if SCALAR_SB:
        sb = tl.load(sb_ptr + e64 * stride_sbe + (n0 // SCALE_BLOCK) * stride_sbn + k0 // SCALE_BLOCK)
    else:
        sb = tl.load(sb_ptr + e64 * stride_sbe + (cols // SCALE_BLOCK) * stride_sbn + k0 // SCALE_BLOCK,
                     mask=cmask, other=0.0)
    return sa, sb


@triton.jit
def _promote(acc, part, sa, sb, SCALAR_SB: tl.constexpr):
    """The promotion of one K block's partial product: ``acc + part * fl(sa * sb)`` in FP32 (compiled to
    ``fma(part, fl(sa * sb), acc)``, DeepGEMM's promotion)."""
    if SCALAR_SB:
        acc += part * (sa * sb)[:, None]
    else:
        acc += part * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def _k_block(acc, it, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0, n0, cols,
             sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K,
             FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
             TMA_A: tl.constexpr, TMA_B: tl.constexpr, SCALAR_SB: tl.constexpr):
    """``acc`` after K block ``it``: the one-tile-per-program kernel's step (same operands, same FP32 ops)."""
    a, b = _k_operands(it, a_base, a_desc, b_base, b_desc, amask, cmask, row0, brow0, K, BLOCK_K, EVEN_K, TMA_A,
                       TMA_B)
    if FP8:  # promotion: a fresh product per 128-column block, fma(part, fl(sa * sb), acc) in FP32, K-block order
        sa, sb = _k_scales(it, amask, cmask, arow, e64, n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe,
                           stride_sbn, SCALE_BLOCK, BLOCK_K, SCALAR_SB)
        acc = _promote(acc, tl.dot(a, b), sa, sb, SCALAR_SB)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _k_partial(it, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0, n0, cols,
               sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K,
               SCALE_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               TMA_A: tl.constexpr, TMA_B: tl.constexpr, SCALAR_SB: tl.constexpr):
    """``(part, sa, sb)`` of FP8 K block ``it``: its fresh product and its scales, promoted later
    (:func:`_promote`) by the ``"lagged_pair"`` K loop."""
    a, b = _k_operands(it, a_base, a_desc, b_base, b_desc, amask, cmask, row0, brow0, K, BLOCK_K, EVEN_K, TMA_A,
                       TMA_B)
    sa, sb = _k_scales(it, amask, cmask, arow, e64, n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn,
                       SCALE_BLOCK, BLOCK_K, SCALAR_SB)
    return tl.dot(a, b), sa, sb


@triton.jit
def _ordered(x):
    """``x`` unchanged (a ``mov.b32`` of each element's bits in inline PTX, not pure), so the operations that make
    ``x`` stay before the next side-effecting operation (an MMA's issue): an ordering barrier for LLVM's scheduler.
    The compiled kernels only (the interpreter runs no PTX)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _k_loop_lagged_pair(acc, n_iters, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0, n0,
                        cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K,
                        SCALE_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TMA_A: tl.constexpr,
                        TMA_B: tl.constexpr, SCALAR_SB: tl.constexpr, WS_K: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    """``acc`` (the tile's zeros) after K blocks ``0 .. n_iters - 1`` (FP8, ``promotion="lagged_pair"``): per
    iteration block ``2j``'s product, the promotion of block ``2j - 1`` (carried from the iteration before), block
    ``2j + 1``'s product (carried to the next), the promotion of block ``2j``; then the last carried block's
    promotion and an odd count's last block. The first iteration's carried block is zeros with zero scales: its
    promotion adds +0 to the zeros (no operation on the data), and no product is computed before the loop, whose
    operands would take shared memory of their own. The form Triton 3.6's Hopper MMA pipeliner keeps in flight:
    block ``2j``'s product is waited for at once (its promotion follows unconditionally), that wait also
    completes the carried product, and block ``2j + 1``'s MMA, used only in the next iteration, stays in flight
    during block ``2j``'s promotion. Block ``2j - 1``'s promotion passes through :func:`_ordered` before block
    ``2j + 1``'s MMA is issued: otherwise LLVM schedules it after that MMA, the carried product and block
    ``2j + 1``'s then need registers of their own, and the copy between them at the loop's end reads an MMA's
    accumulator while it runs, so ptxas serializes every MMA (its C7514 note) and spills at 4 warps (Triton 3.6,
    sm_90a). The same partials and promotions in the same order as :func:`_k_block`'s loop: the same bits."""
    part = tl.zeros_like(acc)
    sa = tl.zeros((acc.shape[0],), dtype=tl.float32)
    if SCALAR_SB:
        sb = tl.full((), 0.0, dtype=tl.float32)
    else:
        sb = tl.zeros((acc.shape[1],), dtype=tl.float32)
    if INTERPRETED:
        j = 0
        while j < n_iters // 2:
            p1, sa1, sb1 = _k_partial(2 * j, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0,
                                      n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K, SCALE_BLOCK,
                                      BLOCK_K, EVEN_K, TMA_A, TMA_B, SCALAR_SB)
            acc = _promote(acc, part, sa, sb, SCALAR_SB)
            p2, sa2, sb2 = _k_partial(2 * j + 1, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0,
                                      brow0, n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K,
                                      SCALE_BLOCK, BLOCK_K, EVEN_K, TMA_A, TMA_B, SCALAR_SB)
            acc = _promote(acc, p1, sa1, sb1, SCALAR_SB)
            part, sa, sb = p2, sa2, sb2
            j += 1
    else:
        for j in tl.range(0, n_iters // 2, warp_specialize=WS_K):
            p1, sa1, sb1 = _k_partial(2 * j, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0,
                                      n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K, SCALE_BLOCK,
                                      BLOCK_K, EVEN_K, TMA_A, TMA_B, SCALAR_SB)
            acc = _promote(acc, part, sa, sb, SCALAR_SB)
            acc = _ordered(acc)  # block 2j - 1's promotion before block 2j + 1's MMA (see the docstring)
            p2, sa2, sb2 = _k_partial(2 * j + 1, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0,
                                      brow0, n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K,
                                      SCALE_BLOCK, BLOCK_K, EVEN_K, TMA_A, TMA_B, SCALAR_SB)
            acc = _promote(acc, p1, sa1, sb1, SCALAR_SB)
            part, sa, sb = p2, sa2, sb2
    acc = _promote(acc, part, sa, sb, SCALAR_SB)
    if n_iters % 2 == 1:  # the last block, after the pairs
        part, sa, sb = _k_partial(n_iters - 1, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0,
                                  n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K, SCALE_BLOCK,
                                  BLOCK_K, EVEN_K, TMA_A, TMA_B, SCALAR_SB)
        acc = _promote(acc, part, sa, sb, SCALAR_SB)
    return acc


@triton.jit
def _tile(pid_m, pid_n, e, a_ptr, a_desc, b_ptr, b_desc, d_ptr, sa_ptr, sb_ptr, bias_ptr, src_ptr, M, N, K,
          stride_am, stride_be, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn, TOPK,
          FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
          GATHER: tl.constexpr, TMA: tl.constexpr, DYNAMIC_K: tl.constexpr, WS_K: tl.constexpr,
          INTERPRETED: tl.constexpr, PROMOTION: tl.constexpr):
    """One output tile. ``DYNAMIC_K``: a tile of padding rows (``e < 0``) runs no K block and stores nothing
    (otherwise the caller has returned on it); ``WS_K``: the K loop warp-specialized; ``PROMOTION`` (FP8): the
    K loop's order of MMAs and promotions, 0 :func:`_k_block`'s, 1 :func:`_k_loop_lagged_pair`'s."""
    live = e >= 0
    e64 = tl.maximum(e, 0).to(tl.int64)
    row0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < N
    amask, arow = _a_rows(src_ptr, rows, rmask, TOPK, GATHER)
    a_base = a_ptr + arow[:, None] * stride_am
    b_base = b_ptr + e64 * stride_be + cols[None, :].to(tl.int64) * stride_bn
    brow0 = (e64 * N + n0).to(tl.int32)
    TMA_A: tl.constexpr = TMA and not GATHER
    SCALAR_SB: tl.constexpr = (SCALE_BLOCK % BLOCK_N) == 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PROMOTION != 0:
        if DYNAMIC_K:
            n_blocks = tl.where(live, K_ITERS, 0)
        else:
            n_blocks = K_ITERS
        acc = _k_loop_lagged_pair(acc, n_blocks, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0,
                                  brow0, n0, cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K,
                                  SCALE_BLOCK, BLOCK_K, EVEN_K, TMA_A, TMA, SCALAR_SB, WS_K, INTERPRETED)
    elif DYNAMIC_K:
        n_iters = tl.where(live, K_ITERS, 0)
        if INTERPRETED:
            it = 0
            while it < n_iters:
                acc = _k_block(acc, it, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0, n0,
                               cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K, FP8, SCALE_BLOCK,
                               BLOCK_K, EVEN_K, TMA_A, TMA, SCALAR_SB)
                it += 1
        else:
            for it in tl.range(0, n_iters, warp_specialize=WS_K):
                acc = _k_block(acc, it, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0, n0,
                               cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K, FP8, SCALE_BLOCK,
                               BLOCK_K, EVEN_K, TMA_A, TMA, SCALAR_SB)
    else:
        for it in tl.range(0, K_ITERS):
            acc = _k_block(acc, it, a_base, a_desc, b_base, b_desc, amask, cmask, arow, e64, row0, brow0, n0,
                           cols, sa_ptr, sb_ptr, stride_sam, stride_sbe, stride_sbn, K, FP8, SCALE_BLOCK,
                           BLOCK_K, EVEN_K, TMA_A, TMA, SCALAR_SB)
    if HAS_BIAS:  # FP32 epilogue: bias[e, n] added to the FP32 accumulator before the store
        acc += tl.load(bias_ptr + e64 * N + cols, mask=cmask, other=0.0)[None, :]
    tl.store(d_ptr + rows[:, None].to(tl.int64) * stride_dm + cols[None, :], acc.to(d_ptr.dtype.element_ty),
             mask=(rmask & live)[:, None] & cmask[None, :])


@triton.jit
def _grouped_gemm_tile_loop_kernel(a_ptr, b_ptr, d_ptr, m_idx_ptr, sa_ptr, sb_ptr, bias_ptr, src_ptr, M, N, K, E,
                                   stride_am, stride_be, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn,
                                   TOPK, NUM_PROGRAMS,
                                   FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
                                   EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
                                   PERSISTENT: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                                   FLATTEN: tl.constexpr, GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr,
                                   PROMOTION: tl.constexpr):
    # m_idx_ptr: the row -> expert map of the contiguous layout (-1: padding); each BLOCK_M rows one expert.
    # GATHER: a (and its scales) are token rows; layout row r reads token src[r] // TOPK (src < 0: zeros).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if TMA:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[stride_bn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
        if GATHER:
            a_desc = a_ptr  # rows gathered through src: pointer loads
        else:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
    else:
        a_desc = a_ptr
        b_desc = b_ptr
    if PERSISTENT:
        num_tiles = num_pid_m * num_pid_n
        if INTERPRETED:
            tile = tl.program_id(0)
            while tile < num_tiles:
                pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
                e = tl.load(m_idx_ptr + pid_m * BLOCK_M)
                _tile(pid_m, pid_n, e, a_ptr, a_desc, b_ptr, b_desc, d_ptr, sa_ptr, sb_ptr, bias_ptr, src_ptr,
                      M, N, K, stride_am, stride_be, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn, TOPK,
                      FP8, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, K_ITERS, EVEN_K, HAS_BIAS, GATHER, TMA,
                      True, False, INTERPRETED, PROMOTION)
                tile += NUM_PROGRAMS
        else:
            for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE,
                                 flatten=FLATTEN):
                pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
                e = tl.load(m_idx_ptr + pid_m * BLOCK_M)
                _tile(pid_m, pid_n, e, a_ptr, a_desc, b_ptr, b_desc, d_ptr, sa_ptr, sb_ptr, bias_ptr, src_ptr,
                      M, N, K, stride_am, stride_be, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn, TOPK,
                      FP8, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, K_ITERS, EVEN_K, HAS_BIAS, GATHER, TMA,
                      True, False, INTERPRETED, PROMOTION)
    elif WARP_SPECIALIZE:  # no early return (Hopper's warp specialization fails on it): a padding tile runs
        # no K block and stores nothing
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        e = tl.load(m_idx_ptr + pid_m * BLOCK_M)
        _tile(pid_m, pid_n, e, a_ptr, a_desc, b_ptr, b_desc, d_ptr, sa_ptr, sb_ptr, bias_ptr, src_ptr,
              M, N, K, stride_am, stride_be, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn, TOPK,
              FP8, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, K_ITERS, EVEN_K, HAS_BIAS, GATHER, TMA,
              True, True, INTERPRETED, PROMOTION)
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        e = tl.load(m_idx_ptr + pid_m * BLOCK_M)
        if e < 0:  # a tile of padding rows: nothing to compute (output unspecified)
            return
        _tile(pid_m, pid_n, e, a_ptr, a_desc, b_ptr, b_desc, d_ptr, sa_ptr, sb_ptr, bias_ptr, src_ptr,
              M, N, K, stride_am, stride_be, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn, TOPK,
              FP8, SCALE_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, K_ITERS, EVEN_K, HAS_BIAS, GATHER, TMA,
              False, False, INTERPRETED, PROMOTION)
