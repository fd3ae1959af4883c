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
  - :class:`GemmTiles` with a tile-loop option (``group_m``, ``persistent``, ``tma``, ``warp_specialize``,
    ``flatten``, ``promotion``; contiguous layout) run the same arithmetic in :mod:`fastpath._grouped_gemm_tiles`'
    kernel: the same bits, another tile order, grid, load path or order of MMAs and promotions (candidates:
    :data:`FP8_PREFILL_CANDIDATES`).
* ``"deep_gemm"``: ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` (FP8 1x128 x 128x128, FP32 scales;
  profile ``HOPPER_FP8_DEEPGEMM_DATA``), when the package is importable.

Under ``TRITON_INTERPRET=1`` (CI) the Triton kernel runs on CPU tensors; the interpreter's dot of
low-precision inputs is not the hardware's, so the CPU tests use float32 operands (the kernel's
``tl.dot`` then accumulates them in float32 through NumPy) and check the logic (tiling, expert
selection, padding, scale indexing) against the exact reference.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moeref._interop import triton_interpreted

from . import _grouped_gemm_tiles
from ._grouped_gemm_tiles import _a_rows, _grouped_gemm_tile_loop_kernel, ensure_allocator
from ._host import cdiv, launch, next_pow2, pdl_launch

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
PROMOTIONS = ("inline", "lagged_pair")
"""The K-loop orders of :attr:`GemmTiles.promotion` (FP8; one set of bits)."""
_PROMOTION_CODE = {"inline": 0, "lagged_pair": 1}  # the tile-loop kernel's PROMOTION constexpr
KERNELS = ("triton", "gluon")
"""The kernels of :attr:`GemmTiles.kernel`: the Triton kernels, or the Gluon FP8 kernel of the contiguous layout
(:mod:`fastpath._grouped_gemm_gluon`)."""


@dataclass(frozen=True)
class GemmTiles:
    """Launch configuration of the Triton kernel (``block_m`` must divide the layout's alignment; FP8
    needs ``block_k == 128``, one scale block per step). Defaults: :data:`DEFAULT_TILES`; measured
    alternatives and their times are in docs/performance.md. The tile-loop options (``persistent``, ``tma``,
    ``warp_specialize``, ``flatten``, ``group_m``, ``promotion``; contiguous layout, not with ``swap_ab``) run
    :mod:`fastpath._grouped_gemm_tiles`' kernel: the same FP32 operations per output, so the same bits."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    swap_ab: bool = False
    """Compute each tile transposed (``B @ a^T``: the weights are the MMA's wide M side, the rows its
    narrow N side, 16 at decode); the same products and K order as ``a @ B^T``."""
    persistent: bool = False
    """``programs_per_sm`` programs per SM, each looping over output tiles (the tile-loop kernel)."""
    programs_per_sm: int = 1
    tma: bool = False
    """Load B, and A unless it is read through ``a_src``, with TMA tensor descriptors made in the kernel."""
    warp_specialize: bool = False
    """``tl.range(..., warp_specialize=True)`` on the tile loop (persistent) or the K loop. Triton 3.6 applies it
    on Hopper with 4 warps only and compiles without it otherwise (the compiled IR shows which:
    bench/studies/triton_fp8_prefill_compile.py); with ``tma`` only, and not with ``a_src`` (a ``ValueError``):
    its producer takes TMA loads, and gathered rows are pointer loads."""
    flatten: bool = False
    """``tl.range(..., flatten=True)`` on a persistent program's tile loop."""
    group_m: int = 1
    """Tile order: groups of ``group_m`` row tiles, row tiles fastest inside a group (an expert's row tiles
    read each B tile together); 1: column tiles fastest, the one-tile-per-program kernel's order."""
    promotion: str = "inline"
    """FP8 only: the order of the K loop's MMAs and promotions (:data:`PROMOTIONS`; the tile-loop kernel).
    ``"inline"``: each 128-column block's product, then its promotion ``acc += (part * sa) * sb``.
    ``"lagged_pair"``: per iteration block ``2j``'s product, block ``2j - 1``'s promotion (carried), block
    ``2j + 1``'s product (carried to the next iteration), block ``2j``'s promotion: the form Triton 3.6's Hopper MMA
    pipeliner leaves in flight past a promotion (bench/studies/triton_fp8_prefill_compile.py shows where the
    compiled MMAs wait). Both orders make the same products (each block's dot from zero) and the same promotions in
    K-block order: the same bits. Simpler orders (block ``k + 1``'s product before block ``k``'s promotion; two
    products, then two promotions) compiled to a wait after each MMA on Triton 3.6 and were dropped; on an H200
    ``"lagged_pair"`` ran slower than ``"inline"`` (docs/moe-gpu.md)."""
    kernel: str = "triton"
    """:data:`KERNELS`. ``"gluon"``: :mod:`fastpath._grouped_gemm_gluon`'s Hopper kernel (FP8 operands in the
    contiguous layout, layout rows (no ``a_src``), sm_90 only; a ``ValueError`` elsewhere): a persistent grid of
    ``block_m x block_n`` tiles (128 x 128 or 128 x 192; ``num_warps=4`` warps in each of its two math warpgroups, plus
    one TMA warp), ``num_stages`` shared-memory stages, tile order ``group_m``; the same bits as the Triton kernel. The
    Triton tile-loop options (``persistent``, ``tma``, ``warp_specialize``, ``flatten``, ``promotion``) are its
    design and are not taken with it."""
    pdl: bool = False
    """Launch with Programmatic Dependent Launch (Triton's ``launch_pdl``) where it runs (sm_90+, not the
    interpreter; elsewhere ignored): the kernel may start while the kernel before it on the stream runs; every
    program lets the kernel after it launch and waits for the kernel before it before its first load
    (:func:`fastpath._host.pdl_launch`); what is computed is unchanged (the same bits). The
    one-tile-per-program kernel only (not the tile-loop options: ``ValueError``). :mod:`fastpath.moe` sets it at decode sizes where
    ``fastpath._moe_layer.DECODE_PDL`` names the GEMM."""
    epilogue: str = "store"
    """``"store"`` (the outputs stored from registers) or, with ``kernel="gluon"`` and ``block_n`` 128, ``"tma"``
    (through shared memory and a TMA store that runs on during the next tile's MMAs; bf16 / fp16 outputs with
    16-byte aligned rows, others stored from registers). The same values either way."""

    def __post_init__(self):
        for name in ("persistent", "tma", "warp_specialize", "flatten", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GemmTiles.{name} must be a bool; got {getattr(self, name)!r}")
        if not isinstance(self.promotion, str):
            raise TypeError(f"GemmTiles.promotion must be a str, one of {PROMOTIONS}; got {self.promotion!r}")
        if self.promotion not in PROMOTIONS:
            raise ValueError(f"GemmTiles.promotion must be one of {PROMOTIONS}; got {self.promotion!r}")
        for name in ("programs_per_sm", "group_m"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GemmTiles.{name} must be an int >= 1; got {v!r}")
        if self.epilogue not in ("store", "tma") or \
                (self.epilogue == "tma" and (self.kernel, self.block_n) != ("gluon", 128)):
            raise ValueError(f"GemmTiles.epilogue is 'store', or 'tma' with kernel='gluon', block_n 128; got {self}")
        if self.kernel not in KERNELS:
            raise ValueError(f"GemmTiles.kernel must be one of {KERNELS}; got {self.kernel!r}")
        if self.kernel == "gluon":
            if (self.block_m, self.block_k, self.num_warps) != (128, 128, 4) or self.block_n not in (128, 192):
                raise ValueError("kernel='gluon' takes 128 x 128 or 128 x 192 tiles, block_k 128 and num_warps 4 "
                                 f"(each of its two math warpgroups); got {self}")
            if self.swap_ab or self.tile_loop_options or self.programs_per_sm != 1:
                raise ValueError("kernel='gluon' is persistent, TMA-loaded and warp-specialized by design; the Triton "
                                 "options swap_ab, persistent, programs_per_sm, tma, warp_specialize, flatten and "
                                 f"promotion are not taken with it; got {self}")
            if self.num_stages < 2:
                raise ValueError(f"kernel='gluon' needs num_stages >= 2; got {self}")
        if self.swap_ab and self.tile_loop:
            raise ValueError("the tile-loop options (persistent, tma, warp_specialize, flatten, group_m > 1, "
                             "promotion other than 'inline') compute "
                             f"a @ B^T tiles; swap_ab=True has none; got {self}")
        if self.warp_specialize and not self.tma:
            raise ValueError(f"warp_specialize needs tma=True (its producer issues TMA loads); got {self}")
        if self.warp_specialize and self.block_m > 64:
            raise ValueError("warp_specialize with block_m > 64 gave wrong outputs on an H200 (Triton 3.6, 2026-11-28: "
                             "128x128 tiles, persistent or not, differed from the default tiles in whole rows); "
                             f"use block_m <= 64; got {self}")
        if not self.persistent and (self.flatten or self.programs_per_sm != 1):
            raise ValueError(f"flatten and programs_per_sm are options of persistent=True tiles; got {self}")
        if self.pdl and (self.tile_loop or self.kernel != "triton"):
            raise ValueError(f"pdl is an option of the one-tile-per-program kernel, not of the tile-loop options; "
                             f"got {self}")

    @property
    def tile_loop_options(self) -> bool:
        """Whether any Triton tile-loop option other than ``group_m`` is set."""
        return self.persistent or self.tma or self.warp_specialize or self.flatten or self.promotion != "inline"

    @property
    def tile_loop(self) -> bool:
        """Whether these tiles run :mod:`fastpath._grouped_gemm_tiles`' kernel (contiguous layout only)."""
        return self.kernel == "triton" and (self.tile_loop_options or self.group_m != 1)


DEFAULT_TILES = {"fp8_block": GemmTiles(64, 128, 128, 4, 4), "float": GemmTiles(128, 256, 64, 8, 3),
                 "fp8_block_decode": GemmTiles(16, 128, 128, 4, 3, swap_ab=True),
                 "fp8_block_contiguous_tma": GemmTiles(64, 128, 128, 4, 4, tma=True),
                 "fp8_block_contiguous_gluon": GemmTiles(128, 128, 128, 4, 6, group_m=8, kernel="gluon",
                                                         epilogue="tma")}
"""Tiles when none are given (:func:`default_tiles`): ``"fp8_block_decode"`` for FP8 operands with few rows per
expert; ``"fp8_block_contiguous_gluon"`` (the Gluon kernel) for FP8 prefill in the contiguous layout on a Hopper
GPU (sm_90) where it runs (the layout's rows, an alignment that is a multiple of 128); ``"fp8_block_contiguous_tma"``
for the rest of FP8 prefill in the contiguous layout on a GPU with TMA (compute capability 9 or more; token rows
read through ``a_src``); both faster than ``"fp8_block"`` on an H200 with the same bits (docs/moe-gpu.md);
``"fp8_block"`` elsewhere (the masked layout, older GPUs)."""
_INTERPRETER_TILES = {"fp8_block": GemmTiles(16, 32, 128, 1, 1), "float": GemmTiles(16, 32, 32, 1, 1),
                      "fp8_block_decode": GemmTiles(16, 32, 128, 1, 1, swap_ab=True)}
FP8_PREFILL_CANDIDATES = {
    "64x128 w4 s4": GemmTiles(64, 128, 128, 4, 4),
    "64x128 w4 s3": GemmTiles(64, 128, 128, 4, 3),
    "128x128 w8 s3": GemmTiles(128, 128, 128, 8, 3),
    "64x128 w4 s4 g4": GemmTiles(64, 128, 128, 4, 4, group_m=4),
    "64x128 w4 s4 pers2 g4": GemmTiles(64, 128, 128, 4, 4, persistent=True, programs_per_sm=2, group_m=4),
    "64x128 w4 s4 tma": GemmTiles(64, 128, 128, 4, 4, tma=True),
    "64x128 w4 s4 tma g4": GemmTiles(64, 128, 128, 4, 4, tma=True, group_m=4),
    "64x128 w4 s3 tma g4": GemmTiles(64, 128, 128, 4, 3, tma=True, group_m=4),
    "64x128 w4 s3 pers3 tma g4": GemmTiles(64, 128, 128, 4, 3, persistent=True, programs_per_sm=3, tma=True,
                                           group_m=4),
    "64x128 w4 s4 pers2 tma g4": GemmTiles(64, 128, 128, 4, 4, persistent=True, programs_per_sm=2, tma=True,
                                           group_m=4),
    "64x128 w4 s4 pers2 tma flat g4": GemmTiles(64, 128, 128, 4, 4, persistent=True, programs_per_sm=2, tma=True,
                                                flatten=True, group_m=4),
    "64x128 w4 s3 tma ws": GemmTiles(64, 128, 128, 4, 3, tma=True, warp_specialize=True),
    "64x128 w4 s3 pers1 tma ws g4": GemmTiles(64, 128, 128, 4, 3, persistent=True, tma=True, warp_specialize=True,
                                              group_m=4),
    "128x128 w8 s3 tma g2": GemmTiles(128, 128, 128, 8, 3, tma=True, group_m=2),
    "128x128 w8 s3 pers1 tma g2": GemmTiles(128, 128, 128, 8, 3, persistent=True, tma=True, group_m=2),
    "128x64 w4 s4 tma g2": GemmTiles(128, 64, 128, 4, 4, tma=True, group_m=2),
    "64x256 w8 s3 tma g4": GemmTiles(64, 256, 128, 8, 3, tma=True, group_m=4),
    "64x128 w8 s4 tma": GemmTiles(64, 128, 128, 8, 4, tma=True),
    "64x128 w4 s2 tma lagpair": GemmTiles(64, 128, 128, 4, 2, tma=True, promotion="lagged_pair"),
    "64x128 w4 s2 tma g4 lagpair": GemmTiles(64, 128, 128, 4, 2, tma=True, group_m=4, promotion="lagged_pair"),
    "64x128 w8 s2 tma lagpair": GemmTiles(64, 128, 128, 8, 2, tma=True, promotion="lagged_pair"),
    "128x128 w8 s2 tma g2 lagpair": GemmTiles(128, 128, 128, 8, 2, tma=True, group_m=2, promotion="lagged_pair"),
    "128x128 w4 s6 g8 gluon": GemmTiles(128, 128, 128, 4, 6, group_m=8, kernel="gluon"),
    "128x128 w4 s6 g8 gluon tmastore": GemmTiles(128, 128, 128, 4, 6, group_m=8, kernel="gluon", epilogue="tma"),
    "128x192 w4 s4 g8 gluon": GemmTiles(128, 192, 128, 4, 4, group_m=8, kernel="gluon"),
}
"""FP8 prefill tiles (``wN`` warps, ``sN`` stages, ``gN`` group_m, ``persN`` persistent with N programs per SM,
``flat`` flatten, ``ws`` warp_specialize; ``lagpair``: ``promotion="lagged_pair"``; ``gluon``: ``kernel="gluon"``
(``tmastore``: ``epilogue="tma"``),
sm_90 only): what bench/studies/triton_fp8_prefill_sweep.py times against DeepGEMM at DeepSeek-V3's
4096-token shapes, and what the GPU test checks bit for bit against :data:`DEFAULT_TILES`. ``"64x128 w4 s4"`` is
``DEFAULT_TILES["fp8_block"]`` (the sweep's bit reference), ``"64x128 w4 s4 tma"``
``DEFAULT_TILES["fp8_block_contiguous_tma"]``, ``"128x128 w4 s6 g8 gluon tmastore"``
``DEFAULT_TILES["fp8_block_contiguous_gluon"]``."""
DECODE_ROWS_PER_EXPERT = 16
"""FP8 operands with at most this many rows per expert on average take the decode tiles."""


def default_tiles(kind: str, rows_per_expert: float, device_type: str = "cuda", layout: str = "contiguous", *,
                  gather: bool = False, alignment: int = 128) -> GemmTiles:
    """The Triton kernel's tiles for operand ``kind`` (``"fp8_block"`` or ``"float"``) when the experts
    have ``rows_per_expert`` rows on average: FP8 with at most :data:`DECODE_ROWS_PER_EXPERT` takes the
    decode tiles (a 16-row swapped tile: the weights stream through the wide side of the MMA); FP8 above it in
    the ``"contiguous"`` layout on a Hopper GPU (sm_90) takes the Gluon kernel's tiles, unless the rows are
    gathered through ``a_src`` (``gather``) or ``alignment`` is not a multiple of its 128-row tiles; those, and
    other GPUs with TMA, take the TMA tiles (the tile-loop kernel, contiguous layout only; ``layout="masked"`` keeps
    ``"fp8_block"``)."""
    if layout not in ("contiguous", "masked"):
        raise ValueError(f"layout must be 'contiguous' or 'masked'; got {layout!r}")
    table = _INTERPRETER_TILES if device_type == "cpu" else DEFAULT_TILES
    if kind == "fp8_block" and rows_per_expert <= DECODE_ROWS_PER_EXPERT:
        return table["fp8_block_decode"]
    if kind == "fp8_block" and layout == "contiguous" and device_type == "cuda" and _has_tma():
        if not gather and alignment % 128 == 0 and _is_sm90():
            return table["fp8_block_contiguous_gluon"]
        return table["fp8_block_contiguous_tma"]
    return table[kind]


def _has_tma() -> bool:
    """Whether the current CUDA device (where the kernels launch) has TMA (compute capability 9.0 or more)."""
    return _capability_major(torch.cuda.current_device()) >= 9


def _is_sm90() -> bool:
    """Whether the current CUDA device is a Hopper GPU of compute capability 9.0 (the Gluon kernel's target)."""
    return _capability(torch.cuda.current_device()) == (9, 0)


def _capability_major(device_index: int) -> int:
    return _capability(device_index)[0]


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(device_index))


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
            if SWAP_AB:  # the same FP32 operations in the same order: (part * sa) * sb, then the sum
                acc += tl.dot(b, tl.trans(a)) * sa[None, :] * sb[:, None]
            else:
                acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
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
