"""The Triton grouped GEMM's tiles: :class:`GemmTiles` (one tile configuration, checked when made), the tables
(:data:`DEFAULT_TILES`, :data:`FP8_PREFILL_CANDIDATES`) and :func:`default_tiles`, which picks the tiles for an
operand kind, rows per expert, device and layout. :mod:`fastpath.grouped_gemm` (the host API that launches them)
re-exports every public name here; the sweep history behind the tables is in docs/moe-gpu.md."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

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
    ``"inline"``: each 128-column block's product, then its promotion ``acc = fma(part, fl(sa * sb), acc)``
    (DeepGEMM's).
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
