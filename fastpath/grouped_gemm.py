"""Grouped GEMMs on the GPU for the MoE layer (:mod:`fastpath.moe`), DeepGEMM's contiguous-layout contract.

``d[r] = a[r] @ b[m_indices[r]].T`` for rows ``r`` of ``a [M_sum, K]``, where ``m_indices [M_sum]`` names
each row's local expert and -1 marks padding rows (their output is left unspecified, as DeepGEMM and
vLLM leave it). Each expert's rows start on a multiple of ``BLOCK_M`` (the layout's alignment, 128 for
DeepGEMM; :func:`fastpath.dispatch.to_contiguous`), so every tile of ``BLOCK_M`` rows belongs to one
expert.

Two implementations, chosen explicitly (no silent fallback; :func:`grouped_gemm_supports` says why one
cannot run), each declaring the :mod:`moeref.compare` profile its arithmetic satisfies:

* ``"triton"``: one Triton kernel.
  - bf16/fp16 operands: ``tl.dot`` accumulating in FP32 over all of K, output rounded once to bf16
    (profile ``BF16_OUTPUT``).
  - FP8 E4M3 operands with 1x128 activation scales and 128x128 weight scales (FP32): per 128-column K
    block a fresh ``tl.dot`` (Hopper WGMMA: ~14-bit aligned accumulation inside the block), promoted into
    an FP32 accumulator as DeepGEMM does: the two scales multiplied in FP32, then one FP32 FMA,
    ``acc = fma(part, fl(sa * sb), acc)``, in K-block order (profile ``HOPPER_FP8_DEEPGEMM_DATA``; exact
    profile ``TRITON_FP8_BLOCK_EXACT``, which predicts DeepGEMM's bits).
  - :class:`GemmTiles` with a tile-loop option (``group_m``, ``persistent``, ``tma``, ``warp_specialize``,
    ``flatten``, ``promotion``; contiguous layout) run the same arithmetic in :mod:`fastpath._grouped_gemm_tiles`'
    kernel: the same bits, another tile order, grid, load path or order of MMAs and promotions (candidates:
    :data:`FP8_PREFILL_CANDIDATES`). ``GemmTiles(kernel="gluon")`` runs the same arithmetic in
    :mod:`fastpath._grouped_gemm_gluon`'s Hopper kernel: the same bits.
* ``"deep_gemm"``: ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` (FP8 1x128 x 128x128, FP32 scales;
  profile ``HOPPER_FP8_DEEPGEMM_DATA``), when the package is importable.

Under ``TRITON_INTERPRET=1`` (CI) the Triton kernel runs on CPU tensors; the interpreter's dot of
low-precision inputs is not the hardware's, so the CPU tests use float32 operands (the kernel's
``tl.dot`` then accumulates them in float32 through NumPy) and check the logic (tiling, expert
selection, padding, scale indexing) against the exact reference.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from moeref._interop import triton_interpreted

from . import _grouped_gemm_tiles
from ._grouped_gemm_tiles import _a_rows, _grouped_gemm_tile_loop_kernel, ensure_allocator
from ._host import cdiv, launch, next_pow2, pdl_launch
from ._grouped_gemm_table import (  # noqa: F401 (re-exported: the tiles' public names live here too)
    DECODE_ROWS_PER_EXPERT, DEFAULT_TILES, FP8_PREFILL_CANDIDATES, KERNELS, PROMOTIONS, GemmTiles, _PROMOTION_CODE,
    _capability, default_tiles)

__all__ = ["GROUPED_GEMM_IMPLEMENTATIONS", "FP8_PREFILL_CANDIDATES", "GemmTiles", "default_tiles",
           "grouped_gemm_contiguous", "grouped_gemm_masked", "grouped_gemm_supports", "PROFILE_OF",
           "EXACT_PROFILE_OF"]

GROUPED_GEMM_IMPLEMENTATIONS = ("triton", "deep_gemm")
PROFILE_OF = {("triton", "float"): "BF16_OUTPUT", ("triton", "fp8_block"): "HOPPER_FP8_DEEPGEMM_DATA",
              ("deep_gemm", "fp8_block"): "HOPPER_FP8_DEEPGEMM_DATA"}
"""The :mod:`moeref.compare` profile each (implementation, operand kind) declares."""
EXACT_PROFILE_OF = {("triton", "fp8_block"): "TRITON_FP8_BLOCK_EXACT", ("deep_gemm", "fp8_block"): "DEEPGEMM_FP8_EXACT"}
"""The equality-level profile of each implementation whose arithmetic :mod:`moeref.gemm.hopper_fp8` emulates bit for
bit (``accum_model="emulated"``; Hopper only: the emulator models sm_90's FP8 WGMMA), beside the declared one: an
honest kernel passes both, and a fault the declared bound cannot see (one misrouted token at K = 7168) fails it."""

_FP8 = (torch.float8_e4m3fn,)


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, d_ptr, m_idx_ptr, sa_ptr, sb_ptr, bias_ptr, src_ptr, M, N, K,
                         stride_am, stride_be, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn,
                         NG, CAP, TOPK,
                         FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
                         EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr,
                         MASKED: tl.constexpr, NG_POW2: tl.constexpr, GATHER: tl.constexpr,
                         GDC_WAIT: tl.constexpr = False):
    # MASKED: m_idx_ptr is masked_m [NG] of the masked layout (rows e * CAP + i) and
    # program row p * ceil(CAP / BLOCK_M) + t computes tile t of the p-th expert with rows (in expert order), so
    # the grid needs only as many experts as can have rows; otherwise m_idx_ptr is the row -> expert map.
    # SWAP_AB: the tile is computed transposed, acc [BLOCK_N, BLOCK_M] = B [BLOCK_N, BLOCK_K] @ a^T (the
    # weights are the MMA's wide side, the few rows its narrow N side); same products, same K order.
    # GATHER: a (and its scales) are token rows; layout row r reads token src[r] // TOPK (src < 0: padding,
    # read as zeros), the scatter of the token rows into the layout done by the loads.
    # GDC_WAIT: launched with PDL (GemmTiles.pdl), every program first lets the kernel after it launch and waits
    # for the kernel before it (fastpath._host.pdl_launch).
    if GDC_WAIT:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)  # n fastest: neighbouring programs share the expert's rows (A stays in L2)
    pid_m = tl.program_id(1)
    if MASKED:
        tpe = (CAP + BLOCK_M - 1) // BLOCK_M
        p = pid_m // tpe
        t = pid_m - p * tpe
        g = tl.arange(0, NG_POW2)
        cnt = tl.load(m_idx_ptr + g, mask=g < NG, other=0)
        hit = (cnt > 0) & (tl.cumsum((cnt > 0).to(tl.int32), 0) == p + 1)
        e = tl.sum(tl.where(hit, g, 0))
        if t * BLOCK_M >= tl.sum(tl.where(hit, cnt, 0)):  # past the expert's rows, or no p-th expert
            return
        local = t * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = e * CAP + local
        rmask = local < CAP  # the tile stays inside its expert's rows (any CAP)
    else:
        row0 = pid_m * BLOCK_M
        e = tl.load(m_idx_ptr + row0)
        if e < 0:  # a tile of padding rows: nothing to compute (output unspecified)
            return
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    amask, arow = _a_rows(src_ptr, rows, rmask, TOPK, GATHER)
    a_base = a_ptr + arow[:, None] * stride_am
    if SWAP_AB:
        b_base = b_ptr + e.to(tl.int64) * stride_be + cols[:, None].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        b_base = b_ptr + e.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(K_ITERS):
        k0 = it * BLOCK_K
        if EVEN_K:
            a = tl.load(a_base + (k0 + ks)[None, :], mask=amask[:, None], other=0.0)
            if SWAP_AB:
                b = tl.load(b_base + (k0 + ks)[None, :], mask=cmask[:, None], other=0.0)
            else:
                b = tl.load(b_base + (k0 + ks)[:, None], mask=cmask[None, :], other=0.0)
        else:
            kmask = (k0 + ks) < K
            a = tl.load(a_base + (k0 + ks)[None, :], mask=amask[:, None] & kmask[None, :], other=0.0)
            if SWAP_AB:
                b = tl.load(b_base + (k0 + ks)[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            else:
                b = tl.load(b_base + (k0 + ks)[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        if FP8:
            # promotion: a fresh product per 128-column block, scaled and added in FP32 (DeepGEMM)
            sa = tl.load(sa_ptr + arow * stride_sam + k0 // SCALE_BLOCK, mask=amask, other=0.0)
            sb = tl.load(sb_ptr + e.to(tl.int64) * stride_sbe + (cols // SCALE_BLOCK) * stride_sbn
                         + k0 // SCALE_BLOCK, mask=cmask, other=0.0)
            if SWAP_AB:  # the same FP32 operations: fl(sa * sb), then fma(part, that, acc)
                acc += tl.dot(b, tl.trans(a)) * (sa[None, :] * sb[:, None])
            else:
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        elif SWAP_AB:
            acc = tl.dot(b, tl.trans(a), acc)
        else:
            acc = tl.dot(a, b, acc)
    if SWAP_AB:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e.to(tl.int64) * N + cols, mask=cmask, other=0.0)[:, None]
        tl.store(d_ptr + rows[None, :].to(tl.int64) * stride_dm + cols[:, None],
                 acc.to(d_ptr.dtype.element_ty), mask=cmask[:, None] & rmask[None, :])
    else:
        if HAS_BIAS:  # FP32 epilogue: bias[e, n] added to the FP32 accumulator before the store
            acc += tl.load(bias_ptr + e.to(tl.int64) * N + cols, mask=cmask, other=0.0)[None, :]
        tl.store(d_ptr + rows[:, None].to(tl.int64) * stride_dm + cols[None, :],
                 acc.to(d_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def _kind(a: torch.Tensor) -> str:
    return "fp8_block" if a.dtype in _FP8 else "float"


def grouped_gemm_supports(impl: str, a=None, b=None, *, a_scales=None, b_scales=None, alignment=None,
                          **_) -> tuple[bool, str]:
    """Whether implementation ``impl`` runs these operands here, and why not."""
    if impl not in GROUPED_GEMM_IMPLEMENTATIONS:
        return False, f"unknown grouped GEMM implementation {impl!r}; known: {GROUPED_GEMM_IMPLEMENTATIONS}"
    if a is not None and a.device.type == "cpu" and not triton_interpreted():
        return False, "a is a CPU tensor and TRITON_INTERPRET=1 is not set"
    if a is not None and b is not None:
        fp8 = a.dtype in _FP8
        if fp8 != (b.dtype in _FP8):
            return False, f"mixed operand dtypes {a.dtype} x {b.dtype} have no grouped GEMM here"
        if fp8 and (a_scales is None or b_scales is None):
            return False, "FP8 operands need a_scales [M, K/128] and b_scales [E, N/128, K/128] (FP32)"
        if fp8 and (a_scales.dtype != torch.float32 or b_scales.dtype != torch.float32):
            return False, "FP8 block scales must be FP32 (UE8M0 scales have no kernel here)"
        if not fp8 and a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"operand dtype {a.dtype} has no grouped GEMM here"
    if impl == "deep_gemm":
        try:
            import deep_gemm  # noqa: F401
        except ImportError as e:
            return False, f"deep_gemm cannot be imported ({e})"
        if a is not None and a.dtype not in _FP8:
            return False, "the DeepGEMM path is FP8 1x128 x 128x128 only"
        if a is not None and a.device.type != "cuda":
            return False, "DeepGEMM needs CUDA tensors"
        if alignment is not None:
            need = deep_gemm.get_mk_alignment_for_contiguous_layout()
            if alignment % need:
                return False, f"DeepGEMM needs expert segments aligned to {need} rows; got {alignment}"
    elif alignment is not None and alignment % 64 and alignment not in (16, 32):
        return False, f"the Triton kernel's row tiles need an alignment that is a multiple of 16; got {alignment}"
    return True, "ok"


def grouped_gemm_contiguous(a: torch.Tensor, b: torch.Tensor, m_indices: torch.Tensor, *, impl: str,
                            a_scales=None, b_scales=None, out_dtype=torch.bfloat16, alignment: int = 128,
                            out=None, tiles: GemmTiles | None = None, bias=None, psum=None, a_src=None,
                            top_k: int = 1) -> torch.Tensor:
    """``d [M_sum, N] = a @ b[m_indices].T`` per row (padding rows unspecified).

    Args:
        a: ``[M_sum, K]`` bf16/fp16/fp32, or float8_e4m3fn with ``a_scales`` FP32 ``[M_sum, ceil(K/128)]``.
        b: ``[E, N, K]`` of the same kind, FP8 with ``b_scales`` FP32 ``[E, ceil(N/128), ceil(K/128)]``.
        m_indices: int32 ``[M_sum]``, -1 padding; each expert's rows start on a multiple of ``alignment``.
        impl: ``"triton"`` or ``"deep_gemm"``.
        bias: optional float32 ``[E, N]``, added in FP32 before the output store (Triton only).
        psum: optional int32 ``[E]``, the same layout as cumulative actual end rows (``psum`` of
            :func:`fastpath.dispatch.to_contiguous`: expert ``e`` holds rows ``align(psum[e-1]) ..
            psum[e]``). DeepGEMM then runs its psum layout, whose scheduler visits only the row blocks
            that hold an expert's rows (when ``alignment`` is DeepGEMM's ``BLOCK_M``, to which that layout
            aligns each expert's start; otherwise ``m_indices`` is used). With ``m_indices`` its SM90
            scheduler visits every ``BLOCK_M`` block of ``a`` and, in a block of padding rows, still loads
            A, its scales and expert 0's B tiles before skipping the math: a worst-case buffer
            (``capturable=True`` in :func:`fastpath.moe.fused_moe`, ``M*k + E*(alignment-1)`` rows) pays
            that for every padding block. Same kernel arithmetic per row, so the real rows' outputs are the
            same bits either way. The Triton kernel returns at once on a tile of padding rows and does not
            read ``psum``.
        a_src, top_k: (Triton only) ``a`` (and ``a_scales``) hold *token* rows ``[T, K]`` and ``a_src`` int
            ``[M_sum]`` is the layout's slot of each row (-1: padding; :func:`fastpath.dispatch.to_contiguous`'s
            ``src``): row ``r`` reads token ``a_src[r] // top_k``, so the token rows need no scatter into the
            layout (the same operands reach the same products: the same bits).
    """
    ok, why = grouped_gemm_supports(impl, a, b, a_scales=a_scales, b_scales=b_scales, alignment=alignment)
    if not ok:
        raise ValueError(f"grouped GEMM {impl!r} cannot run: {why}")
    k = int(a.shape[1])
    m = int(a.shape[0]) if a_src is None else int(m_indices.numel())
    e, n, kb = (int(d) for d in b.shape)
    if kb != k:
        raise ValueError(f"a has K={k} but b has K={kb}")
    if a_src is not None:
        if impl != "triton":
            raise ValueError(f"a_src (token rows read through the layout) is a Triton-kernel option; {impl!r} "
                             "takes the layout's rows")
        if int(a_src.numel()) != m or a_src.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"a_src must be int32/int64 with one slot per layout row ({m}); got "
                             f"{a_src.dtype} {tuple(a_src.shape)}")
    if m_indices.numel() != m:
        raise ValueError(f"m_indices has {m_indices.numel()} entries but a has {m} rows")
    d = out if out is not None else torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return d
    if bias is not None and impl != "triton":
        raise ValueError(f"bias has no {impl} epilogue (the Triton kernel adds it)")
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"bias must have shape ({e}, {n}); got {tuple(bias.shape)}")
    if impl == "deep_gemm":
        import deep_gemm

        if psum is not None and alignment == deep_gemm.get_mk_alignment_for_contiguous_layout():
            if psum.dtype != torch.int32 or tuple(psum.shape) != (e,) or psum.device != a.device:
                raise ValueError(f"psum must be int32 [{e}] on {a.device} (one end row per expert of b); got "
                                 f"{psum.dtype} {tuple(psum.shape)} on {psum.device}")
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_scales), (b, b_scales), d, psum.contiguous(),
                                                       disable_ue8m0_cast=True, use_psum_layout=True)
            return d
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_scales), (b, b_scales), d, m_indices.to(torch.int32),
                                                   disable_ue8m0_cast=True)
        return d
    t = tiles or default_tiles(_kind(a), 0 if m <= e * alignment else m / e, a.device.type, "contiguous",
                               gather=a_src is not None, alignment=alignment)  # one segment an expert: decode
    if t.kernel == "gluon" and alignment % t.block_m:
        raise ValueError(f"kernel='gluon' tiles have {t.block_m} rows, which must divide the layout's alignment; got "
                         f"alignment {alignment}")
    if alignment % t.block_m:
        t = replace(t, block_m=64 if alignment % 64 == 0 else 16)
    _launch_triton(a, b, d, m_indices.to(torch.int32).contiguous(), a_scales, b_scales, bias, t,
                   grid_m=cdiv(m, t.block_m), a_src=a_src, top_k=top_k)
    return d


def _tiles_of(a: torch.Tensor, rows_per_expert: float, layout: str) -> GemmTiles:
    return default_tiles(_kind(a), rows_per_expert, a.device.type, layout)


def _launch_triton(a, b, d, m_idx, a_scales, b_scales, bias, t: GemmTiles, *, grid_m: int, masked_cap: int = 0,
                   a_src=None, top_k: int = 1):
    """One launch of :func:`_grouped_gemm_kernel`: ``m_idx`` the row -> expert map, or (``masked_cap > 0``)
    the masked layout's ``masked_m`` with ``masked_cap`` rows per expert; ``a_src`` (``[d rows]``): ``a`` holds
    token rows, layout row ``r`` reads token ``a_src[r] // top_k``."""
    m, k = int(d.shape[0]), int(a.shape[1])
    e, n = (int(x) for x in b.shape[:2])
    fp8 = a.dtype in _FP8
    if fp8 and t.block_k != 128:
        raise ValueError(f"FP8 tiles need block_k = 128 (one scale block a step); got {t.block_k}")
    a = a.contiguous()
    b = b.contiguous()
    dummy = torch.empty(1, dtype=torch.float32, device=a.device)
    sa = a_scales.contiguous() if fp8 else dummy
    sb = b_scales.contiguous() if fp8 else dummy
    bias_t = bias.to(torch.float32).contiguous() if bias is not None else dummy
    ng = int(m_idx.numel()) if masked_cap else 0
    src = a_src.reshape(-1).contiguous() if a_src is not None else m_idx
    if t.kernel == "gluon":
        from ._grouped_gemm_gluon import launch_gluon

        cap = _capability(torch.cuda.current_device() if a.device.index is None else a.device.index) \
            if a.device.type == "cuda" else None
        launch_gluon(a, b, d, m_idx, sa, sb, bias_t if bias is not None else None, t, m, n, k, e, fp8=fp8,
                     masked=masked_cap > 0, gather=a_src is not None, capability=cap, sm_count=_sm_count(a.device))
        return
    if t.tile_loop:
        if masked_cap:
            raise ValueError(f"the tile-loop options run on the contiguous layout only; got {t} for the masked layout")
        _launch_tile_loop(a, b, d, m_idx, sa, sb, bias_t, src, t, m, n, k, e, fp8, bias is not None,
                          a_src is not None, top_k)
        return
    grid = (cdiv(n, t.block_n), grid_m)
    pdl = pdl_launch(a.device, t.pdl)
    launch(_grouped_gemm_kernel, grid, a, b, d, m_idx, sa, sb, bias_t, src, m, n, k,
           a.stride(0), b.stride(0), b.stride(1), d.stride(0),
           sa.stride(0) if fp8 else 0, sb.stride(0) if fp8 else 0, sb.stride(1) if fp8 else 0,
           ng, masked_cap, int(top_k),
           FP8=fp8, SCALE_BLOCK=128, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
           K_ITERS=cdiv(k, t.block_k), EVEN_K=k % t.block_k == 0, HAS_BIAS=bias is not None,
           SWAP_AB=t.swap_ab, MASKED=masked_cap > 0, NG_POW2=next_pow2(max(ng, 1)),
           GATHER=a_src is not None, num_warps=t.num_warps, num_stages=t.num_stages, **pdl)


_SM_COUNT: dict = {}
INTERPRETER_SMS = 2
"""The SM count a persistent grid assumes under ``TRITON_INTERPRET=1`` (programs run one after another)."""


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = int(torch.cuda.get_device_properties(i).multi_processor_count)
    return _SM_COUNT[i]


def _launch_tile_loop(a, b, d, m_idx, sa, sb, bias_t, src, t: GemmTiles, m, n, k, e, fp8, has_bias, gather, top_k):
    """One launch of :func:`fastpath._grouped_gemm_tiles._grouped_gemm_tile_loop_kernel` (contiguous layout)."""
    if t.promotion != "inline" and not fp8:
        raise ValueError(f"promotion={t.promotion!r} orders the FP8 kernel's per-block promotions; {a.dtype} operands "
                         f"accumulate in the MMA (no promotion): use promotion='inline'; got {t}")
    if t.warp_specialize and gather:
        raise ValueError("warp_specialize tiles need both operands through TMA, and rows read through a_src are "
                         "gathered by pointer loads (Hopper's TMA has no row gather; Triton 3.6's warp "
                         f"specialization does not compile them): pass the layout's rows, or tiles without it; got {t}")
    if t.tma:
        esize = a.element_size()
        bad = [f"{name} (address {x.data_ptr()})" for name, x in (("a", a), ("b", b)) if x.data_ptr() % 16]
        if (k * esize) % 16 or bad:
            raise ValueError(f"TMA tiles need 16-byte aligned rows and bases: K = {k} of {a.dtype} is {k * esize} "
                             f"bytes a row{'; unaligned: ' + ', '.join(bad) if bad else ''}")
        if a.device.type == "cuda":
            ensure_allocator()
    tiles = cdiv(m, t.block_m) * cdiv(n, t.block_n)
    programs = min(tiles, _sm_count(a.device) * t.programs_per_sm) if t.persistent else tiles
    launch(_grouped_gemm_tile_loop_kernel, (programs,), a, b, d, m_idx, sa, sb, bias_t, src, m, n, k, e,
           a.stride(0), b.stride(0), b.stride(1), d.stride(0),
           sa.stride(0) if fp8 else 0, sb.stride(0) if fp8 else 0, sb.stride(1) if fp8 else 0, int(top_k), programs,
           FP8=fp8, SCALE_BLOCK=128, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
           K_ITERS=cdiv(k, t.block_k), EVEN_K=k % t.block_k == 0, HAS_BIAS=has_bias, GATHER=gather,
           PERSISTENT=t.persistent, TMA=t.tma, WARP_SPECIALIZE=t.warp_specialize, FLATTEN=t.flatten,
           GROUP_M=t.group_m, INTERPRETED=_grouped_gemm_tiles._INTERPRETED, PROMOTION=_PROMOTION_CODE[t.promotion],
           num_warps=t.num_warps, num_stages=t.num_stages)


def grouped_gemm_masked(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor, *, impl: str, a_scales=None,
                        b_scales=None, expected_m: int | None = None, out_dtype=torch.bfloat16,
                        tiles: GemmTiles | None = None, bias=None, max_groups: int | None = None, a_src=None,
                        top_k: int = 1) -> torch.Tensor:
    """DeepGEMM's masked layout: ``d[e, i] = a[e, i] @ b[e].T`` for ``i < masked_m[e]`` (rows past it
    unspecified). ``a [E, max_m, K]`` (FP8 with ``a_scales [E, max_m, K/128]``), ``b [E, N, K]``.
    ``"deep_gemm"`` calls ``m_grouped_fp8_gemm_nt_masked``; ``"triton"`` runs the kernel in its masked mode:
    program row ``p * ceil(max_m / block_m) + t`` finds the ``p``-th expert with ``masked_m > 0`` (a prefix
    count over ``masked_m`` in the kernel) and computes its row tile ``t`` (tiles past ``masked_m`` exit), so
    ``max_groups`` (an upper bound on the experts with rows, e.g. ``min(E, tokens * top_k)``; default ``E``)
    sizes the grid without a host sync. Rows are computed exactly as in the contiguous layout. Tiles default
    to :func:`default_tiles` with ``expected_m`` (else ``max_m``) rows per expert. ``a_src`` ``[E, max_m]``
    (Triton): ``a`` holds token rows ``[T, K]`` read through the layout (:func:`grouped_gemm_contiguous`)."""
    if a_src is not None:
        if impl != "triton" or a_src.dim() != 2:
            raise ValueError("a_src (token rows read through the layout, [E, max_m]) is a Triton-kernel option")
        e, max_m = (int(d) for d in a_src.shape)
        k = int(a.shape[1])
    else:
        e, max_m, k = (int(d) for d in a.shape)
    n = int(b.shape[1])
    if impl == "deep_gemm":
        ok, why = grouped_gemm_supports(impl, a.reshape(-1, k), b, a_scales=a_scales, b_scales=b_scales)
        if not ok:
            raise ValueError(f"grouped GEMM {impl!r} cannot run: {why}")
        if bias is not None:
            raise ValueError("bias has no deep_gemm epilogue (the Triton kernel adds it)")
        import deep_gemm

        d = torch.empty((e, max_m, n), dtype=out_dtype, device=a.device)
        exp_m = int(expected_m) if expected_m is not None else max(1, max_m)
        try:
            deep_gemm.m_grouped_fp8_gemm_nt_masked((a, a_scales), (b, b_scales), d, masked_m.to(torch.int32), exp_m,
                                                   disable_ue8m0_cast=True)
        except TypeError:  # builds whose masked entry point has no disable_ue8m0_cast (FP32 scales are kept)
            deep_gemm.m_grouped_fp8_gemm_nt_masked((a, a_scales), (b, b_scales), d, masked_m.to(torch.int32), exp_m)
        return d
    if bias is not None and tuple(bias.shape) != (int(b.shape[0]), n):
        raise ValueError(f"bias must have shape ({int(b.shape[0])}, {n}); got {tuple(bias.shape)}")
    ok, why = grouped_gemm_supports(impl, a.reshape(-1, k), b, a_scales=a_scales, b_scales=b_scales)
    if not ok:
        raise ValueError(f"grouped GEMM {impl!r} cannot run: {why}")
    if a_src is not None and a_src.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"a_src must be int32/int64; got {a_src.dtype}")
    if int(masked_m.numel()) != e or int(b.shape[0]) != e or int(b.shape[2]) != k:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)} and masked_m ({masked_m.numel()}) disagree on E/K")
    groups = e if max_groups is None else max(0, min(e, int(max_groups)))
    d = torch.empty((e, max_m, n), dtype=out_dtype, device=a.device)
    if groups == 0 or max_m == 0:
        return d
    t = tiles or _tiles_of(a, max_m if expected_m is None else expected_m, "masked")
    rows = -1 if a_src is not None else e * max_m
    sa = None if a_scales is None else a_scales.reshape(rows, a_scales.shape[-1])
    _launch_triton(a.reshape(rows, k), b, d.view(e * max_m, n), masked_m.to(torch.int32).contiguous(), sa,
                   b_scales, bias, t, grid_m=groups * cdiv(max_m, t.block_m), masked_cap=max_m,
                   a_src=a_src, top_k=top_k)
    return d
