"""GEMM operands from a kernel's own tensors: ``(elements, scales)`` in the layouts kernels use, read
into exact :class:`~moeref.gemm.exact.BlockOperand` objects, so nobody converts by hand.

A kernel takes a quantized operand as element tensor + scale tensor in its own layout:

* DeepGEMM (Hopper): ``(a_fp8 [M, K], sa float32 [M, ceil(K/128)])`` (1x128 per-token groups, often an
  MN-major TMA-aligned view: any strides are read logically) and ``(b_fp8 [E, N, K], sb float32
  [E, ceil(N/128), ceil(K/128)])`` (128x128 blocks); on Blackwell the scales are packed UE8M0 ``int32
  [..., mn, ceil(K/512)]`` (four E8M0 bytes per word, :func:`moeref.layouts.unpack_ue8m0`);
* vLLM ``fused_experts``: ``w1 [E, 2N, K]`` FP8 with ``w1_scale`` per tensor ``[E]``, per channel
  ``[E, 2N, 1]`` or per block ``[E, 2N/128, K/128]``;
* ``torch._scaled_mm`` / ``_scaled_grouped_mm``: rowwise ``scale_a [M, 1]``, ``scale_b [1, N]``;
* NVFP4 (FlashInfer, vLLM CUTLASS): packed E2M1 ``uint8 [R, K/2]`` (element ``2i`` in the low nibble)
  or ``torch.float4_e2m1fn_x2``, E4M3 scales per 16 elements, linear ``[R, K/16]`` or in the 128x4
  swizzle (:func:`moeref.layouts.unswizzle_128x4`), and a global factor (vLLM/FlashInfer pass the
  ENCODE factor ``448 * 6 / amax``; the decode factor is its reciprocal);
* MXFP4 / MXFP8: E8M0 scales (``uint8`` codes or ``torch.float8_e8m0fnu``) per 32 elements.

:func:`kernel_operand` reads one ``[R, K]`` operand; :func:`kernel_expert_operands` a stack of experts
``[E, R, K]`` (one operand per expert, as :class:`moeref.moe.MoEWeights` and the grouped GEMMs take
them). Every value is exact: the element decode and the scale decode are table lookups, the product is
a float64 multiplication of at most 4 + 24 significant bits, and a global factor multiplies each
block scale in float64 (``global_encode`` is inverted in float64 first; a kernel that inverts it in
float32 passes ``global_decode=`` the float32 value it uses).
"""
from __future__ import annotations

import numpy as np

from .. import _interop
from .exact import BlockOperand

__all__ = ["SCALE_LAYOUTS", "kernel_operand", "kernel_expert_operands"]

SCALE_LAYOUTS = ("linear", "swizzled_128x4", "mn_major_storage")
"""``linear``: the logical ``[rows, groups]`` grid (any strides: an MN-major view is read logically);
``swizzled_128x4``: the 128x4-swizzled bytes (flat or ``[roundup(rows,128), roundup(groups,4)]``);
``mn_major_storage``: DeepGEMM's padded MN-major storage ``[groups, align(rows, 4)]`` itself."""

_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_DENSE = ("bfloat16", "float16", "float32", "float64")


def _dtype_name(x) -> str:
    if _interop.is_torch_tensor(x):
        return str(x.dtype).replace("torch.", "")
    return np.asarray(x).dtype.name


def _numpy(x, name: str) -> np.ndarray:
    if _interop.is_torch_tensor(x):
        if str(x.dtype).replace("torch.", "") == "float4_e2m1fn_x2":
            import torch

            x = x.view(torch.uint8)
        return np.asarray(_interop.to_numpy(x))
    if x is None:
        raise TypeError(f"{name} is None")
    return np.asarray(x)


def _elements(data, element, name: str) -> tuple[np.ndarray, str]:
    """float64 element values ``[R, K]`` and the element format name."""
    from ..formats import decode_table, unpack_nibbles

    kind = _dtype_name(data)
    arr = _numpy(data, name)
    if kind == "float4_e2m1fn_x2":
        kind, element = "uint8", element or "e2m1"
    if kind in _FP8:
        if element not in (None, kind.replace("float8_", "")):
            raise ValueError(f"{name} is {kind} but element={element!r} was given")
        return arr.astype(np.float64), kind.replace("float8_", "")
    if kind == "uint8":
        if element not in ("e2m1", "int4"):
            raise ValueError(f"{name} is uint8: say what it holds with element='e2m1' (packed FP4, two per byte, "
                             f"element 2i in the low nibble); got element={element!r}")
        codes = unpack_nibbles(arr)
        return decode_table(element)[codes].astype(np.float64), element
    if kind in _DENSE or kind.startswith("float"):
        if element is not None:
            raise ValueError(f"{name} is a dense {kind} tensor; element={element!r} applies to fp8/packed fp4 only")
        return arr.astype(np.float64), kind
    raise TypeError(f"{name} has dtype {kind}; accepted: float8 (e4m3fn, e5m2), packed fp4 (uint8 with "
                    "element='e2m1', float4_e2m1fn_x2), bfloat16, float16, float32, float64")


def _scale_values(scales, rows: int, k: int, block, scale_layout: str, element: str, name: str):
    """(float64 scale grid, block) from a kernel's scale tensor."""
    from ..formats import decode_table
    from ..layouts import from_mn_major_tma_aligned, unpack_ue8m0, unswizzle_128x4

    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {', '.join(SCALE_LAYOUTS)}; got {scale_layout!r}")
    kind = _dtype_name(scales)
    s = _numpy(scales, f"{name} scales")
    default_bk = {"float8_e4m3fn": 16, "float8_e8m0fnu": 32, "uint8": 32}.get(kind, 128)
    if element == "e2m1" and kind == "uint8":
        raise ValueError(f"{name}: uint8 scales of packed e2m1 are ambiguous; pass float8_e4m3fn (NVFP4) or "
                         "float8_e8m0fnu (MXFP4) scales (numpy: ml_dtypes, or view the bytes)")
    if block is not None:
        br, bk = (int(b) for b in block)
    else:
        br, bk = None, None
    if s.size == 1 and scale_layout == "linear":
        val = float(np.asarray(s, dtype=np.float64).reshape(-1)[0]) if kind not in ("uint8", "float8_e8m0fnu") \
            else float(decode_table("e8m0")[int(s.reshape(-1).view(np.uint8)[0])])
        return np.full((1, 1), val), (max(rows, 1), max(k, 1))
    if kind in ("int32", "uint32"):  # packed UE8M0 words [rows, ceil(groups/4)]
        bk = bk or 128
        s = unpack_ue8m0(s.reshape(rows, -1) if s.ndim != 2 else s, -(-k // bk), check_padding=False)
        return np.asarray(s, dtype=np.float64), (br or 1, min(bk, max(k, 1)))
    if scale_layout == "swizzled_128x4":
        bk = bk or default_bk
        s = unswizzle_128x4(s, -(-rows // (br or 1)), -(-k // bk))
    elif scale_layout == "mn_major_storage":
        bk = bk or default_bk
        s = from_mn_major_tma_aligned(s, mn=-(-rows // (br or 1)), check_padding=False)
    if s.ndim == 1:
        s = s.reshape(-1, 1) if s.size == rows else s.reshape(1, -1)
    if s.ndim != 2:
        raise ValueError(f"{name} scales must be 2-D [row groups, K groups] (or 1-D / scalar); got shape {s.shape}")
    sr, sc = s.shape
    if br is None:
        br = next((b for b in (1, 128, max(rows, 1)) if -(-rows // b) == sr), None)
    if bk is None:
        bk = next((b for b in (default_bk, 128, 32, 16, max(k, 1)) if -(-k // b) == sc), None)
    if br is None or bk is None or (-(-rows // br), -(-k // bk)) != (sr, sc):
        raise ValueError(f"{name} scales of shape {s.shape} do not fit an operand [{rows}, {k}] with blocks "
                         f"{block if block is not None else '(1 | 128 | rows) x (16 | 32 | 128 | K)'}; pass block=")
    if kind in ("uint8", "float8_e8m0fnu"):
        vals = decode_table("e8m0")[s.view(np.uint8).astype(np.intp)]
    else:
        vals = s.astype(np.float64)
    return vals, (min(br, max(rows, 1)), min(bk, max(k, 1)))


def kernel_operand(data, scales=None, *, element: str | None = None, block=None, scale_layout: str = "linear",
                   global_decode=None, global_encode=None, name: str = "operand") -> BlockOperand:
    """An exact operand ``[R, K]`` from a kernel's element tensor and scale tensor.

    Args:
        data: ``[R, K]`` torch tensor (any device) or NumPy array: float8 (e4m3fn/e5m2, ml_dtypes in
            NumPy), packed fp4 (``uint8 [R, K/2]`` with ``element="e2m1"``, or ``float4_e2m1fn_x2``), or a
            dense bf16/fp16/fp32/fp64 tensor (then ``scales`` must be None).
        scales: None (scale 1), a scalar/size-1 tensor (per tensor), or the block grid: float32 (DeepGEMM
            Hopper, vLLM, ``_scaled_mm``), ``float8_e4m3fn`` (NVFP4), ``float8_e8m0fnu`` / ``uint8`` E8M0
            codes (MX), or ``int32`` packed UE8M0 words (DeepGEMM Blackwell, ``block`` default ``(1, 128)``).
        element: the element format of ``uint8`` data (``"e2m1"``); inferred from fp8 dtypes.
        block: ``(rows, cols)`` of one scale block; inferred from the grid when None (rows 1/128/all,
            cols 16 for E4M3 scales, 32 for E8M0, else 128, or all of K).
        scale_layout: one of :data:`SCALE_LAYOUTS`.
        global_decode / global_encode: optional per-tensor factor multiplying every block scale (NVFP4),
            given as the decode factor or as the encode factor (``448 * 6 / amax``, vLLM's ``a1_gscale``,
            FlashInfer's ``input_sf``), not both.

    >>> import ml_dtypes
    >>> a = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=ml_dtypes.float8_e4m3fn)
    >>> op = kernel_operand(a, np.array([[0.5, 2.0]], np.float32), block=(1, 2))
    >>> op.dequantize().tolist()
    [[0.5, 1.0, 6.0, 8.0]]
    """
    vals, element_name = _elements(data, element, name)
    if vals.ndim != 2:
        raise ValueError(f"{name} must be 2-D [R, K]; got shape {vals.shape} "
                         "(use kernel_expert_operands for [E, R, K])")
    rows, k = vals.shape
    dense = element_name in _DENSE
    if global_decode is not None and global_encode is not None:
        raise ValueError(f"{name}: give global_decode or global_encode, not both")
    if dense and (scales is not None or global_decode is not None or global_encode is not None):
        raise ValueError(f"{name} is a dense {element_name} tensor: it takes no scales")
    if dense:
        return BlockOperand(vals, np.ones((1, 1)), (max(rows, 1), max(k, 1)), False)
    if scales is None:
        grid, blk = np.ones((1, 1)), (max(rows, 1), max(k, 1))
    else:
        grid, blk = _scale_values(scales, rows, k, block, scale_layout, element_name, name)
    g = 1.0
    if global_decode is not None:
        g = float(np.asarray(_numpy(global_decode, "global_decode"), dtype=np.float64).reshape(-1)[0])
    elif global_encode is not None:
        g = 1.0 / float(np.asarray(_numpy(global_encode, "global_encode"), dtype=np.float64).reshape(-1)[0])
    return BlockOperand(vals, grid * g, blk, True)


def kernel_expert_operands(data, scales=None, **kw) -> list[BlockOperand]:
    """One :func:`kernel_operand` per expert of ``data [E, R, K]`` with ``scales [E, ...]`` (per-expert
    scalars ``[E]``, grids ``[E, r, c]``, or a sequence of per-expert tensors); the same keywords for every
    expert, except ``global_decode`` / ``global_encode``, which may be per expert ``[E]``."""
    shape = tuple(data.shape) if hasattr(data, "shape") else np.shape(data)
    if len(shape) != 3:
        raise ValueError(f"expert weights must be [E, R, K]; got shape {shape}")
    e = shape[0]
    name = kw.pop("name", "weights")

    def pick(x, i, what):
        if x is None or (not isinstance(x, (list, tuple)) and len(getattr(x, "shape", ())) == 0):
            return x  # one value for every expert
        n = len(x) if isinstance(x, (list, tuple)) else x.shape[0]
        if n != e:
            raise ValueError(f"{name} {what} has {n} entries along its first axis; expected one per expert ({e})")
        return x[i]

    per = {key: kw.pop(key) for key in ("global_decode", "global_encode") if key in kw}
    return [kernel_operand(data[i], pick(scales, i, "scales"), name=f"{name}[{i}]",
                           **{key: pick(v, i, key) for key, v in per.items()}, **kw)
            for i in range(e)]
