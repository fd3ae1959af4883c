"""Tiles of the quantization kernels: the general choice, the tables of what a device was
measured to run faster, and the tuning knobs the benchmark sweeps (:class:`QuantTuning`).

* :func:`_tile`, :func:`_warps`: (group block, groups per program, rows per program) and warps of
  a launch from its group size and layout, for any device;
* :data:`_DEVICE_TILES`: 1x128 tiles a named CUDA device runs faster (:func:`_device_tile`);
* :class:`QuantTuning`: the register cap, the E2M1 lane encode, the FP4 word runs and the looped
  per-token kernel's threshold and tile, passed explicitly (``tuning=``);
* the partial-amax pass's tile and the dequantize tile.

Every choice here comes from ``bench/bench_quant_gpu.py --tune`` sweeps on an H200 and an H100
(2026-11-21, 16384 x 7168 bf16); the measurements behind each are in docs/performance.md,
"Tuning history of the quantization kernels". None of them changes a code or a scale (the
property tests run every tile and knob against the reference).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._host import next_pow2 as _next_pow2

# dequantize tiles: elements per program and warps (1x128 groups: see _tile)
_DQ_ELEMS = 4096
_DQ_WARPS = 8


def _tile(gs: int, block_m: int | None, gpp: int | None, layout: str, ng: int, elems: int = 4096,
          role: str = "quant"):
    """(GB, GPP, BLOCK_M): pow2 group block, groups per program, rows per program (about
    ``elems`` elements per program; the packed UE8M0 layout needs whole int32 words, 4 groups).

    1x128 groups (``role``: "quant", "dequant" or "fused"): one row segment per program reads and
    writes contiguous runs (quantize 1 row x 32 groups on 4 warps, dequantize 1 row x 64 groups
    on 8 warps). MN-major scales keep 4 rows x 8 groups (one row per program would scatter its
    4-byte scale writes with stride M), and so do the fused kernels. Devices measured to prefer
    other 1x128 quantize tiles: :data:`_DEVICE_TILES`."""
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
    """Warps per program: 4096-element tiles run best with 4 warps for FP8 codes and 2 for FP4
    (whose packing doubles the work per thread); larger tiles (per-token rows) get more."""
    if num_warps:
        return num_warps
    n = gb * gpp * bm
    if n <= 4096:
        return 4 if fp8 else 2
    return 8 if n <= 8192 else 16


# elements per program and warps of the partial-amax pass (per-tensor FP8, dynamic NVFP4)
_AMAX_TILE = 8192
_AMAX_WARPS = 8


# 1x128 tiles (groups per program, rows per program, warps) that a device was measured to run
# faster than the general choice (quantize: _tile's 1 row x 32 groups on 4 warps, 4 x 8 for
# MN-major scales; fused activation + quantize: 4 rows x 8 groups), keyed by (kernel: "quant" or
# "fused", scale layout, whether x is divided by FP32 scales). Only FP32-scale kernels and the
# packed UE8M0 layout are looked up (other UE8M0 kernels were not swept per device); everything
# else takes the general choice. The H200's `default` entry is narrow (16 elements per thread:
# the exact division's registers stay down, and a 56-group row has no idle lanes).
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


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class QuantTuning:
    """Knobs of the quantization kernels that change their speed, never their codes or scales:
    what ``bench/bench_quant_gpu.py --tune`` sweeps, given to :func:`fastpath.quant.quantize` and
    the fused kernels as ``tuning=`` (None: these defaults, the shipped choices).

    Attributes:
        maxnreg: register cap per thread (ptxas ``.maxnreg``) of every quantize launch; None the
            compiler's choice (Triton's interpreter has no registers: ignored there).
        e2m1_ptx: encode E2M1 through the float32 lane PTX (:mod:`fastpath._packed_fp4`) where
            it applies (a GPU, RNE, signed zeros kept); False the integer path everywhere.
        word_run_mxfp4, word_run_nvfp4: FP4 from 16-bit words: contiguous int32 words a thread
            loads per group (0: the whole group; a power of two otherwise), for MXFP4 (UE8M0
            scales, 16-word groups: runs of 8) and NVFP4 (UE4M3, 8-word groups: whole groups).
        row_loop_min_k: FP8 rows with one scale per row (per-token) longer than this take the
            looped kernel (two sweeps per row); shorter ones one tile per row.
        row_loop_tile: the looped kernel's (rows per program, columns per chunk, warps), powers
            of two.
    """

    maxnreg: int | None = None
    e2m1_ptx: bool = True
    word_run_mxfp4: int = 8
    word_run_nvfp4: int = 0
    row_loop_min_k: int = 4096
    row_loop_tile: tuple[int, int, int] = (1, 4096, 4)

    def __post_init__(self):
        if self.maxnreg is not None and not (isinstance(self.maxnreg, int) and 16 <= self.maxnreg <= 255):
            raise ValueError(f"QuantTuning.maxnreg must be None or an int in [16, 255]; got {self.maxnreg!r}")
        if not isinstance(self.e2m1_ptx, bool):
            raise TypeError(f"QuantTuning.e2m1_ptx must be a bool; got {self.e2m1_ptx!r}")
        for name in ("word_run_mxfp4", "word_run_nvfp4"):
            v = getattr(self, name)
            if not (v == 0 and isinstance(v, int) and not isinstance(v, bool)) and not _is_pow2(v):
                raise ValueError(f"QuantTuning.{name} must be 0 (whole group) or a power of two; got {v!r}")
        if not (isinstance(self.row_loop_min_k, int) and self.row_loop_min_k >= 1):
            raise ValueError(f"QuantTuning.row_loop_min_k must be a positive int; got {self.row_loop_min_k!r}")
        t = self.row_loop_tile
        if not (isinstance(t, tuple) and len(t) == 3 and all(_is_pow2(v) for v in t)):
            raise ValueError("QuantTuning.row_loop_tile must be (rows, columns, warps), powers of two; "
                             f"got {t!r}")

    def word_run(self, scale_kind: int) -> int:
        """The ``WORD_RUN`` constexpr of a launch whose ``SCALE_KIND`` is ``scale_kind`` (1 UE8M0,
        2 UE4M3; 0 for FP32 scales, whose FP8 tiles read no words)."""
        return {1: self.word_run_mxfp4, 2: self.word_run_nvfp4}.get(scale_kind, 0)


DEFAULT_TUNING = QuantTuning()


def _row_loop_applies(ng: int, gs: int, K: int, packed: bool, scale_layout: str,
                      tuning: QuantTuning = DEFAULT_TUNING) -> bool:
    """One FP8 scale per row over a row longer than ``tuning.row_loop_min_k``: the looped kernel."""
    return (ng == 1 and gs >= K and K > tuning.row_loop_min_k and not packed
            and scale_layout in ("row_major", "mn_major"))
