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
    block a fresh ``tl.dot`` (Hopper WGMMA: ~14-bit aligned accumulation inside the block), multiplied
    by the block's two scales and added to an FP32 accumulator: promotion every 128 K, DeepGEMM's
    recipe (profile ``HOPPER_FP8_DEEPGEMM_DATA``).
* ``"deep_gemm"``: ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` (FP8 1x128 x 128x128, FP32 scales;
  profile ``HOPPER_FP8_DEEPGEMM_DATA``), when the package is importable.

Under ``TRITON_INTERPRET=1`` (CI) the Triton kernel runs on CPU tensors; the interpreter's dot of
low-precision inputs is not the hardware's, so the CPU tests use float32 operands (the kernel's
``tl.dot`` then accumulates them in float32 through NumPy) and check the logic (tiling, expert
selection, padding, scale indexing) against the exact reference.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

__all__ = ["GROUPED_GEMM_IMPLEMENTATIONS", "GemmTiles", "grouped_gemm_contiguous", "grouped_gemm_masked",
           "grouped_gemm_supports", "PROFILE_OF"]

GROUPED_GEMM_IMPLEMENTATIONS = ("triton", "deep_gemm")
PROFILE_OF = {("triton", "float"): "BF16_OUTPUT", ("triton", "fp8_block"): "HOPPER_FP8_DEEPGEMM_DATA",
              ("deep_gemm", "fp8_block"): "HOPPER_FP8_DEEPGEMM_DATA"}
"""The :mod:`moeref.compare` profile each (implementation, operand kind) declares."""

_FP8 = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class GemmTiles:
    """Launch configuration of the Triton kernel (``block_m`` must divide the layout's alignment; FP8
    needs ``block_k == 128``, one scale block per step). Defaults: :data:`DEFAULT_TILES`; measured
    alternatives and their times are in docs/performance.md."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3


DEFAULT_TILES = {"fp8_block": GemmTiles(64, 128, 128, 4, 4), "float": GemmTiles(128, 256, 64, 8, 3)}
_INTERPRETER_TILES = {"fp8_block": GemmTiles(16, 32, 128, 1, 1), "float": GemmTiles(16, 32, 32, 1, 1)}


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, d_ptr, m_idx_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                         stride_am, stride_be, stride_bn, stride_dm, stride_sam, stride_sbe, stride_sbn,
                         FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
                         EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)  # n fastest: neighbouring programs share the expert's rows (A stays in L2)
    pid_m = tl.program_id(1)
    row0 = pid_m * BLOCK_M
    e = tl.load(m_idx_ptr + row0)
    if e < 0:  # a tile of padding rows: nothing to compute (output unspecified)
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_base = b_ptr + e.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(K_ITERS):
        k0 = it * BLOCK_K
        if EVEN_K:
            a = tl.load(a_base + (k0 + ks)[None, :], mask=rmask[:, None], other=0.0)
            b = tl.load(b_base + (k0 + ks)[:, None], mask=cmask[None, :], other=0.0)
        else:
            kmask = (k0 + ks) < K
            a = tl.load(a_base + (k0 + ks)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_base + (k0 + ks)[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        if FP8:
            # promotion: a fresh product per 128-column block, scaled and added in FP32 (DeepGEMM)
            part = tl.dot(a, b)
            sa = tl.load(sa_ptr + rows * stride_sam + k0 // SCALE_BLOCK, mask=rmask, other=0.0)
            sb = tl.load(sb_ptr + e.to(tl.int64) * stride_sbe + (cols // SCALE_BLOCK) * stride_sbn
                         + k0 // SCALE_BLOCK, mask=cmask, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
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
    import os

    if a is not None and a.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
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
                            out=None, tiles: GemmTiles | None = None, bias=None, psum=None) -> torch.Tensor:
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
    """
    ok, why = grouped_gemm_supports(impl, a, b, a_scales=a_scales, b_scales=b_scales, alignment=alignment)
    if not ok:
        raise ValueError(f"grouped GEMM {impl!r} cannot run: {why}")
    m, k = (int(d) for d in a.shape)
    e, n, kb = (int(d) for d in b.shape)
    if kb != k:
        raise ValueError(f"a has K={k} but b has K={kb}")
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
    fp8 = a.dtype in _FP8
    kind = _kind(a)
    t = tiles or (_INTERPRETER_TILES if a.device.type == "cpu" else DEFAULT_TILES)[kind]
    if alignment % t.block_m:
        t = replace(t, block_m=64 if alignment % 64 == 0 else 16)
    if fp8 and t.block_k != 128:
        raise ValueError(f"FP8 tiles need block_k = 128 (one scale block a step); got {t.block_k}")
    a = a.contiguous()
    b = b.contiguous()
    dummy = torch.empty(1, dtype=torch.float32, device=a.device)
    sa = a_scales.contiguous() if fp8 else dummy
    sb = b_scales.contiguous() if fp8 else dummy
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))
    bias_t = bias.to(torch.float32).contiguous() if bias is not None else dummy
    _grouped_gemm_kernel[grid](a, b, d, m_indices.to(torch.int32).contiguous(), sa, sb, bias_t, m, n, k,
                               a.stride(0), b.stride(0), b.stride(1), d.stride(0),
                               sa.stride(0) if fp8 else 0, sb.stride(0) if fp8 else 0, sb.stride(1) if fp8 else 0,
                               FP8=fp8, SCALE_BLOCK=128, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                               K_ITERS=triton.cdiv(k, t.block_k), EVEN_K=k % t.block_k == 0, HAS_BIAS=bias is not None,
                               num_warps=t.num_warps, num_stages=t.num_stages)
    return d


def grouped_gemm_masked(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor, *, impl: str, a_scales=None,
                        b_scales=None, expected_m: int | None = None, out_dtype=torch.bfloat16,
                        tiles: GemmTiles | None = None, bias=None) -> torch.Tensor:
    """DeepGEMM's masked layout: ``d[e, i] = a[e, i] @ b[e].T`` for ``i < masked_m[e]`` (rows past it
    unspecified). ``a [E, max_m, K]`` (FP8 with ``a_scales [E, max_m, K/128]``), ``b [E, N, K]``.
    ``"deep_gemm"`` calls ``m_grouped_fp8_gemm_nt_masked``; ``"triton"`` runs the contiguous kernel on the
    ``E * max_m`` rows with each row's expert (-1 past ``masked_m``; ``max_m`` a multiple of the tile)."""
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
    pos = torch.arange(max_m, device=a.device)
    m_idx = torch.where(pos[None, :] < masked_m.to(a.device)[:, None],
                        torch.arange(e, device=a.device)[:, None], -1).reshape(-1).to(torch.int32)
    sa = None if a_scales is None else a_scales.reshape(e * max_m, -1)
    d = grouped_gemm_contiguous(a.reshape(e * max_m, k), b, m_idx, impl=impl, a_scales=sa, b_scales=b_scales,
                                out_dtype=out_dtype, alignment=max_m, tiles=tiles, bias=bias)
    return d.reshape(e, max_m, n)
