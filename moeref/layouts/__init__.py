"""Scale and weight layouts GPU kernels read, as pure NumPy functions with exact inverses.

* :mod:`.tma` — MN-major TMA-aligned scales (DeepGEMM SM90 FP32) and the cuBLAS/TE 1x128 layout.
* :mod:`.ue8m0_pack` — DeepGEMM packed UE8M0 (four E8M0 bytes per int32), refusing non-powers of two.
* :mod:`.swizzle` — the 128x4 scale swizzle (cuBLAS / CUTLASS / FlashInfer / torchao / TE).
* :mod:`.gptoss` — gpt-oss MXFP4 checkpoint ``*_blocks`` / ``*_scales``.

See ``docs/layouts.md`` for pictures, padding contracts and the bugs they prevent.
"""
from __future__ import annotations

from .gptoss import GPTOSS_BLOCK, GPTOSS_BYTES_PER_BLOCK, from_gptoss_mxfp4, to_gptoss_mxfp4
from .swizzle import (
    SWIZZLE_COLS,
    SWIZZLE_ROWS,
    SwizzlePaddingReport,
    check_swizzle_padding,
    swizzle_128x4,
    swizzle_128x4_offsets,
    swizzled_shape_128x4,
    unswizzle_128x4,
)
from .tma import (
    TMA_ALIGN_BYTES,
    from_cublas_1x128_scales,
    from_mn_major_tma_aligned,
    mn_major_storage,
    tma_aligned_mn,
    to_cublas_1x128_scales,
    to_mn_major_tma_aligned,
)
from .ue8m0_pack import (
    UE8M0_PER_WORD,
    pack_ue8m0,
    pow2_to_ue8m0_codes,
    ue8m0_codes_to_float32,
    unpack_ue8m0,
)

__all__ = [
    "GPTOSS_BLOCK",
    "GPTOSS_BYTES_PER_BLOCK",
    "SWIZZLE_COLS",
    "SWIZZLE_ROWS",
    "SwizzlePaddingReport",
    "TMA_ALIGN_BYTES",
    "UE8M0_PER_WORD",
    "check_swizzle_padding",
    "from_cublas_1x128_scales",
    "from_gptoss_mxfp4",
    "from_mn_major_tma_aligned",
    "mn_major_storage",
    "pack_ue8m0",
    "pow2_to_ue8m0_codes",
    "swizzle_128x4",
    "swizzle_128x4_offsets",
    "swizzled_shape_128x4",
    "tma_aligned_mn",
    "to_cublas_1x128_scales",
    "to_gptoss_mxfp4",
    "to_mn_major_tma_aligned",
    "ue8m0_codes_to_float32",
    "unpack_ue8m0",
    "unswizzle_128x4",
]
