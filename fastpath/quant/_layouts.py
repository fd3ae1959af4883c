"""Scale layouts of the quantizers' output: names, how the kernels address them, storage shapes.

``"row_major"``      the reference's scale grid ``[..., M, groups]`` (float32 or uint8 codes).
``"mn_major"``       DeepGEMM SM90 / cuBLAS 1x128: storage ``[..., groups, align(M, 16/itemsize)]``,
                     padding zero (:func:`moeref.layouts.to_mn_major_tma_aligned`).
``"packed_ue8m0"``   DeepGEMM SM100: int32 storage ``[..., ceil(groups/4), align(M, 4)]``, four
                     E8M0 bytes per word, K padding 0x00 (:func:`moeref.layouts.pack_ue8m0`).
``"swizzled_128x4"`` cuBLAS / CUTLASS block-scaled: flat ``[..., roundup(M,128) * roundup(groups,4)]``
                     bytes, padding zero (:func:`moeref.layouts.swizzle_128x4`).

Every padding element is WRITTEN by the kernels (the grid covers the padded extents).
"""
from __future__ import annotations

import torch

from moeref.quant.blockwise import grid_shape
from moeref.quant.scheme import Scheme

SCALE_LAYOUTS = ("row_major", "mn_major", "packed_ue8m0", "swizzled_128x4")
# the kernels' SF_LAYOUT: 0 for the strided layouts (row-major and MN-major storage differ only
# in their strides), else the layout's position in SCALE_LAYOUTS (2 packed words, 3 the swizzle)
SF_LAYOUT = {name: 0 if name in ("row_major", "mn_major") else i
             for i, name in enumerate(SCALE_LAYOUTS)}


def grid_of(shape, scheme: Scheme) -> tuple[int, ...]:
    """The reference's scale grid of a tensor of ``shape`` (``QuantizedTensor.scales.shape``)."""
    return grid_shape(tuple(shape), scheme.resolve_block(tuple(shape)))


def returned_scales_shape(shape, scheme: Scheme, scale_layout: str, storage_shape) -> tuple[int, ...]:
    """The shape of the scales a quantizer returns for an input of ``shape``, whose storage
    :func:`scale_storage_shape` gave for the batched ``(B, M, K)`` view: the reference's grid when
    row-major, else the storage, without its batch axis for a 1-D or 2-D input."""
    if scale_layout == "row_major":
        return grid_of(shape, scheme)
    return tuple(storage_shape[1:]) if len(shape) <= 2 else tuple(storage_shape)


def scale_storage_shape(shape, scheme: Scheme, scale_layout: str) -> tuple[tuple[int, ...], torch.dtype, tuple]:
    """(storage shape, dtype, (M_PAD, NG_PAD, stride_sm, stride_sg)) of the scale output."""
    g = grid_shape(tuple(shape), scheme.resolve_block(tuple(shape)))
    mn, ng = (g[-2], g[-1]) if len(g) >= 2 else (1, g[-1])
    lead = tuple(g[:-2])
    fp32 = scheme.scale_format == "fp32"
    dt = torch.float32 if fp32 else torch.uint8
    if scale_layout == "row_major":
        return g, dt, (mn, ng, ng, 1)
    if scale_layout == "mn_major":
        align = 4 if fp32 else 16
        mp = -(-mn // align) * align
        return lead + (ng, mp), dt, (mp, ng, 1, mp)
    if scale_layout == "packed_ue8m0":
        mp = -(-mn // 4) * 4
        nw = -(-ng // 4)
        return lead + (nw, mp), torch.int32, (mp, nw * 4, 1, mp)
    mp = -(-mn // 128) * 128
    gp = -(-ng // 4) * 4
    return lead + (mp * gp,), torch.uint8, (mp, gp, 0, 0)
