"""Tiles of the quantization kernels: the general choice, and the tables of what a device was
measured to run faster (bench/bench_quant_gpu.py --tune; docs/performance.md has the history).

* :func:`_tile`, :func:`_warps`: (group block, groups per program, rows per program) and warps of
  a launch from its group size and layout, for any device;
* :data:`_DEVICE_TILES`: 1x128 tiles a named CUDA device runs faster (:func:`_device_tile`);
* the looped per-token kernel's threshold and tile, the partial-amax pass's tile, the dequantize
  tile, and the FP4 word runs per thread (:data:`_WORD_RUN`).
"""
from __future__ import annotations

import functools

import torch

from .._host import next_pow2 as _next_pow2


# dequantize tiles: elements per program and warps (H200 sweep, bench_quant_gpu.py --tune,
# 2026-11-21: 4096-element tiles; with the 8-byte code loads 3.62 TB/s on 8 warps vs 3.58 on 4,
# about the run-to-run spread; 1x128 groups: see _tile)
_DQ_ELEMS = 4096
_DQ_WARPS = 8


def _tile(gs: int, block_m: int | None, gpp: int | None, layout: str, ng: int, elems: int = 4096,
          role: str = "quant"):
    """(GB, GPP, BLOCK_M): pow2 group block, groups per program, rows per program (about
    ``elems`` elements per program; the packed UE8M0 layout needs whole int32 words, 4 groups).

    1x128 groups (``role``: "quant", "dequant" or "fused"), from sweeps on an H100 and an H200
    (bench_quant_gpu.py --tune, 2026-11-21, 16384 x 7168): one row segment per program reads and
    writes contiguous runs. Quantize 1 row x 32 groups (4 warps): `deepgemm` FP32 3.99 TB/s on
    the H200 (94% of copy; 4 rows x 8 groups 3.79) and 2.84 on the H100 (2.75), `default` 3.53
    (3.45), packed UE8M0 3.93 (3.86). Dequantize 1 row x 64 groups on 8 warps: 3.87 (3.60) and
    2.84 (2.66). MN-major scales keep 4 rows x 8 groups (one row per program would scatter its
    4-byte scale writes with stride M), and so do the fused kernels (swigluoai 3.44 vs 3.36).
    Devices measured to prefer other 1x128 quantize tiles: :data:`_DEVICE_TILES`."""
    gb = max(2, _next_pow2(gs))
    if gpp is None:
        gpp = max(1, min(_next_pow2(ng), 512 // gb)) if gb < 512 else 1
        if gb == 128 and block_m is None and ng >= 8 and elems == 4096:
            if role == "dequant" and layout == "row_major":
                gpp, block_m = 64, 1
            elif role == "quant" and layout in ("row_major", "packed_ue8m0"):
                gpp, block_m = 32, 1
            else:
                gpp, block_m = 8, 4
    if layout == "packed_ue8m0":
        gpp = max(gpp, 4)
    if block_m is None:
        block_m = max(1, min(max(16, elems // 512), elems // (gb * gpp)))
    return gb, gpp, block_m


def _warps(gb: int, gpp: int, bm: int, num_warps: int | None, fp8: bool = True) -> int:
    """Warps per program, from a tile sweep on an H200 (bench_quant_gpu.py --tune, 2026-11-21):
    4096-element tiles run best with 4 warps for FP8 codes and 2 for FP4 (whose packing doubles
    the work per thread); larger tiles (per-token rows) get more."""
    if num_warps:
        return num_warps
    n = gb * gpp * bm
    if n <= 4096:
        return 4 if fp8 else 2
    return 8 if n <= 8192 else 16


# elements per program and warps of the partial-amax pass (per-tensor FP8, dynamic NVFP4)
_AMAX_TILE = 8192
_AMAX_WARPS = 8


# FP4 from 16-bit words: contiguous words per thread and group (see _quant_kernel's WORD_RUN;
# 0: the whole group), by scale kind (1 UE8M0: MXFP4, 2 UE4M3: NVFP4)
# (H200, 2026-11-21, bench_quant_gpu.py --tune: MXFP4 3.55 TB/s with whole 16-word groups,
# 3.63 with runs of 8, 2.30 with runs of 4; NVFP4's 8-word groups: runs of 4 1.93 vs 2.70)
_WORD_RUN = {1: 8, 2: 0}


# 1x128 tiles (groups per program, rows per program, warps) that a device was measured to run
# faster than the general choice (quantize: _tile's 1 row x 32 groups on 4 warps, 4 x 8 for
# MN-major scales; fused activation + quantize: 4 rows x 8 groups), keyed by (kernel: "quant" or
# "fused", scale layout, whether x is divided by FP32 scales): bench_quant_gpu.py --tune,
# 2026-11-21, 16384 x 7168 bf16. Only FP32-scale kernels and the packed UE8M0 layout are
# looked up (other UE8M0 kernels were not swept per device); everything else takes the
# general choice.
# * H200, `default` (x / s, exact division): 1 row x 8 groups on 2 warps (16 elements per
#   thread: the division's registers stay down, and a 56-group row has no idle lanes, where a
#   32-group program idles 12.5% of them): quantize 3.64 -> 3.77 TB/s; `deepgemm` (a product)
#   there: 3.98 on the general tile, 3.79 on that one. The fused kernels, after the division
#   lost its sign select (fifth round), on 1 row x 8 groups with ONE warp (32 elements per
#   thread): silu_and_mul 3.68 -> 4.00 TB/s, swigluoai 3.51 -> 3.90 (on 2 warps: 3.96, 3.71).
#   MN-major `deepgemm`: 8 rows x 8 groups on 8 warps, 3.83-3.85 -> 3.88-3.91 TB/s (four
#   interleaved pairs of runs).
# * H100: the same narrow tile is slower for `default` (2.84 -> 2.75, memory-bound either
#   way); `deepgemm` gains from 1 row x 64 groups on 8 warps: row-major 2.84 -> 2.92 TB/s,
#   MN-major 2.77 -> 2.86 (MXFP8 found nothing better than its tile, 2.75). Fifth round:
#   `default` 2.86 -> 2.91 and packed UE8M0 2.84 -> 2.89 on 1 row x 64 groups, 4 warps
#   (8 warps: the same; one warp: 2.73, 2.78). The packed layout is the one UE8M0 entry.
_DEVICE_TILES = {
    "NVIDIA H200": {("quant", "row_major", True): (8, 1, 2), ("fused", "row_major", True): (8, 1, 1),
                    ("quant", "mn_major", False): (8, 8, 8)},
    "NVIDIA H100 80GB HBM3": {("quant", "row_major", False): (64, 1, 8),
                              ("quant", "mn_major", False): (64, 1, 8),
                              ("quant", "row_major", True): (64, 1, 4),
                              ("quant", "packed_ue8m0", False): (64, 1, 4)},
}


def _device_tile(kernel: str, dev: torch.device, scale_layout: str, ce: dict, gs: int, ng: int,
                 overrides: tuple) -> tuple[int, int, int] | None:
    """(groups per program, rows per program, warps) from :data:`_DEVICE_TILES` for a launch of
    ``kernel`` ("quant" or "fused") with constexprs ``ce``; None unless the groups are 1x128
    over at least 8 groups, no tile override (block_m, groups_per_program, num_warps) is given,
    and the scales are FP32 or in the packed UE8M0 layout."""
    if overrides != (None, None, None) or gs != 128 or ng < 8:
        return None
    fp32 = ce["SCALE_KIND"] == 0
    if not fp32 and scale_layout != "packed_ue8m0":
        return None
    return _DEVICE_TILES.get(_device_name(dev), {}).get((kernel, scale_layout, fp32 and ce["APPLY"] == 1))


@functools.lru_cache(maxsize=16)
def _device_name(dev: torch.device) -> str:
    """CUDA device name (``torch.cuda.get_device_name``), "" for other devices."""
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""


# Rows longer than this with one scale per row (per-token) take _row_loop_kernel; tile
# (rows per program, columns per chunk, warps). H200 sweeps (bench_quant_gpu.py --tune,
# 2026-11-21, 16384 x 7168 bf16, per-token): before the register cut of _div_exact, one
# 8192-wide tile per row 3.46 TB/s against 3.43 for the loop at (1, 4096, 4); after it, the
# single tile 3.46 and the loop 3.55 at (1, 4096, 4), 3.52 at (1, 2048, 2), 3.40 at
# (1, 2048, 1), 2.4-2.8 with 1024-column chunks. So rows over 4096 columns loop.
_ROW_LOOP_MIN_K = 4096
_ROW_LOOP_TILE = (1, 4096, 4)


def _row_loop_applies(ng: int, gs: int, K: int, packed: bool, scale_layout: str) -> bool:
    """One FP8 scale per row over a row longer than one tile: :func:`_row_loop_kernel`."""
    return (ng == 1 and gs >= K and K > _ROW_LOOP_MIN_K and not packed
            and scale_layout in ("row_major", "mn_major"))
