"""``--scale-layout swizzled``: FP4 block scales written in the 128x4 swizzle (opt-in), and read back.

Every real FP4 checkpoint layout stores its block scales LINEAR, ``[..., N, K/group]``:
ModelOpt NVFP4 ``weight_scale`` (``nvfp4_tensor.py``; the notes' checkpoint-formats.md §5),
compressed-tensors NVFP4 and MXFP4 ``weight_scale``, gpt-oss ``*_scales``. The 128x4 swizzle
that Blackwell's block-scaled MMAs read (cuBLAS / CUTLASS) is applied by the runtimes when they
LOAD such a checkpoint: vLLM's NVFP4 loaders pad and swizzle ``weight_scale`` after loading, and
FlashInfer and TensorRT-LLM do the same (shared/notes/checkpoint-formats.md, "Load-time
conversions" and §5). A checkpoint whose scales are already swizzled would be swizzled twice by
all of them; nothing checks for it, and it goes unnoticed where ``N % 128 == 0`` and
``(K/group) % 4 == 0``, since the swizzled buffer then has the linear shape. The one serializer
of swizzled NVFP4 scales found (2026-11-24) is torchao's ``NVFP4Tensor`` (``is_swizzled_scales``;
safetensors support in pytorch/ao PR #3668), in torchao's own tensor-subclass format, not one of
these layouts.

So the default stays ``linear``, and ``swizzled`` is for consumers that take the MMA's layout
straight from disk (one's own kernels, a loader that skips the swizzle): the ``weight_scale``
tensors of the NVFP4 and compressed-tensors MXFP4 targets are written as
:func:`moeref.layouts.swizzle_128x4` ``out="2d"`` (``[..., roundup(N, 128), roundup(K/group, 4)]``,
zero padding), and ``config.json``'s ``quantization_config`` (and ModelOpt's
``hf_quant_config.json``) say ``"moeref_scale_layout": "swizzled_128x4"``: a key no runtime
reads, which moeref reads back (``--verify``, and such a checkpoint as a source).
"""
from __future__ import annotations

import numpy as np

from ..layouts import check_swizzle_padding, swizzle_128x4, swizzled_shape_128x4, unswizzle_128x4
from .safetensors_io import CheckpointError

__all__ = ["SCALE_LAYOUTS", "SCALE_LAYOUT_KEY", "SWIZZLED", "SWIZZLE_TARGETS", "scale_layout_of",
           "swizzle_tensors", "reading_view", "mark_config"]

SCALE_LAYOUTS = ("linear", "swizzled")
SCALE_LAYOUT_KEY = "moeref_scale_layout"
SWIZZLED = "swizzled_128x4"
SWIZZLE_TARGETS = {"modelopt-nvfp4": 16, "ct-nvfp4": 16, "ct-mxfp4": 32}
"""Layouts whose ``weight_scale`` may be swizzled, with their group size along K."""


def scale_layout_of(config: dict | None, hf_quant_config: dict | None = None) -> str:
    """``"swizzled"`` when the checkpoint's configs carry the key, else ``"linear"``."""
    qc = (config or {}).get("quantization_config") or {}
    hq = (hf_quant_config or {}).get("quantization") or {}
    return "swizzled" if SWIZZLED in (qc.get(SCALE_LAYOUT_KEY), hq.get(SCALE_LAYOUT_KEY)) \
        else "linear"


def swizzle_tensors(layout_name: str, tensors: list) -> list:
    """The written ``[(name, array)]`` of one module with its ``.weight_scale`` swizzled."""
    out = []
    for name, arr in tensors:
        if name.endswith(".weight_scale"):
            codes = np.ascontiguousarray(arr).view(np.uint8)
            arr = swizzle_128x4(codes, out="2d").view(arr.dtype)
        out.append((name, arr))
    return out


class _Unswizzled:
    """A checkpoint seen with one module's swizzled ``weight_scale`` unswizzled (the rest as is)."""

    def __init__(self, ck, scale: str, rows: int, cols: int):
        self._ck, self._scale, self._rows, self._cols = ck, scale, rows, cols

    def __getattr__(self, attr):
        return getattr(self._ck, attr)

    def info(self, name):
        dt, shape = self._ck.info(name)
        if name == self._scale:
            shape = tuple(shape[:-2]) + (self._rows, self._cols)
        return dt, shape

    def read(self, name):
        a = self._ck.read(name)
        if name != self._scale:
            return a
        want = swizzled_shape_128x4(self._rows, self._cols)
        where = f"tensor {name!r} in {self._ck.file(self._ck.shard_of(name))}"
        if tuple(a.shape[-2:]) != want:
            raise CheckpointError(f"{where}: a 128x4-swizzled scale of a {self._rows} x "
                                  f"{self._cols} grid must have shape [..., {want[0]}, {want[1]}]; "
                                  f"got {tuple(a.shape)}")
        codes = np.ascontiguousarray(a).view(np.uint8)
        if codes.ndim == 2:
            rep = check_swizzle_padding(codes, self._rows, self._cols)
            if not rep.ok:
                raise CheckpointError(f"{where}: {rep}")
        return unswizzle_128x4(codes, self._rows, self._cols).view(a.dtype)


def reading_view(ck, layout_name: str, roles: dict, scale_layout: str):
    """``ck`` itself, or for a swizzled module of a :data:`SWIZZLE_TARGETS` layout a view that
    unswizzles its ``weight_scale`` (rows and groups from the packed weight's shape)."""
    if scale_layout != "swizzled" or layout_name not in SWIZZLE_TARGETS or "scale" not in roles:
        return ck
    _, wshape = ck.info(roles["weight"])
    rows, k = wshape[-2], 2 * wshape[-1]
    return _Unswizzled(ck, roles["scale"], rows, -(-k // SWIZZLE_TARGETS[layout_name]))


def mark_config(qc: dict | None, extra: dict) -> None:
    """Record the swizzled layout in the written configs (in place)."""
    if qc is not None:
        qc[SCALE_LAYOUT_KEY] = SWIZZLED
    hf = extra.get("hf_quant_config.json")
    if hf is not None:
        hf["quantization"][SCALE_LAYOUT_KEY] = SWIZZLED
