"""The Triton engine of ``moeref convert`` (``--engine triton``, and ``--engine auto`` on a CUDA GPU).

moeref does not import this module: it finds :data:`ENGINE` through the entry point group
``moeref.checkpoint_engines`` that ``pyproject.toml`` declares (``triton =
"fastpath.checkpoint_engine:ENGINE"``), or a caller passes it (``ConvertOptions(engine=ENGINE)``). The
engine only computes codes and scales; the conversion report and ``--verify`` measure them against the exact
source values with the NumPy reference (:func:`moeref.quant.requantize`, :func:`moeref.checkpoint.
verify_shard`), so no figure of the report comes from this code.

* :meth:`TritonEngine.choose`: :func:`fastpath.quant.quantize` where ``fastpath.quant.supports`` accepts
  the scheme and shape (``fastpath/registry.py`` lists what is supported); on a CUDA GPU, or under
  ``TRITON_INTERPRET=1`` on the CPU when asked for by name (the CPU test suite runs ``engine="triton"``
  this way). ``"auto"`` takes it only on a CUDA GPU. Its quantizers take the values as a host array or as a
  torch tensor (``quantizer.device_values``: the converter's device report keeps them on the device).
* :meth:`TritonEngine.source_quantizer`: the fused FP8-block decode + FP4 quantize of
  :mod:`fastpath.requant` for an FP8 block-scaled source (:func:`fused_source_quantizer`).
"""
from __future__ import annotations

import numpy as np

from moeref._interop import triton_interpreted

__all__ = ["TritonEngine", "ENGINE", "fused_source_quantizer"]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _triton_device() -> str | None:
    """``"cuda"``, or ``"cpu"`` under ``TRITON_INTERPRET=1`` (the kernels on the interpreter), or None."""
    if _cuda_available():
        return "cuda"
    return "cpu" if triton_interpreted() else None


def _quantizer(x, scheme, **static):
    """``fastpath.quant.quantize`` of ``x`` (a host array, or a torch tensor: the values
    :func:`moeref.quant.device_report.device_requantize` keeps on the device) on the engine's device, as a
    host QuantizedTensor."""
    import torch

    from .quant import quantize

    xt = x if torch.is_tensor(x) else torch.from_numpy(np.ascontiguousarray(x))
    return _host_copy(quantize(xt.to(_triton_device()), scheme, **static))


def _host_copy(fq):
    """``fq.to_reference()``, its device codes and scales recorded with moeref's device report
    (:func:`moeref.quant.device_report.remember_upload`: the report reads them there, not a second copy)."""
    from moeref.quant.device_report import remember_upload

    ref = fq.to_reference()
    if fq.scale_layout == "row_major":
        remember_upload(ref, fq.codes, fq.scales.reshape(ref.scales.shape))
    return ref


_quantizer.device_values = True  # takes the values as a device tensor (moeref.checkpoint.engines)


def _finite_flag(values):
    """Whether every element of ``values`` is finite: True or False for a host array, a 0-d bool tensor on the
    device for a torch tensor (computed there; the host reads it later)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.is_tensor(values):
        return torch.isfinite(values).all()
    return bool(np.all(np.isfinite(values)))


class TritonEngine:
    """The Triton fast path as a conversion engine (the protocol of :mod:`moeref.checkpoint.engines`)."""

    name = "triton"

    def choose(self, scheme, shape, *, auto: bool) -> tuple:
        """``(ok, reason, quantizer or None)`` for one tensor of ``shape`` going to ``scheme``; ``auto``: the
        engine was not asked for by name (then only a CUDA GPU counts)."""
        device = ("cuda" if _cuda_available() else None) if auto else _triton_device()
        if device is None:
            return False, ("no CUDA GPU" if auto else
                           "needs a CUDA GPU (or TRITON_INTERPRET=1); none is available"), None
        try:
            import torch

            from .quant import supports
        except ImportError as e:
            return False, f"cannot be imported: {e}", None
        if scheme is None or len(shape) > 3:
            ok, why = False, "the kernels take 1 to 3 axes of a quantized target"
        else:  # a zero-stride probe: the right shape, one element of memory
            probe = torch.empty_strided(tuple(shape), (0,) * len(shape), dtype=torch.float32, device=device)
            ok, why = supports(scheme=scheme, x=probe)
        if not ok:
            return False, f"cannot quantize {scheme.name if scheme is not None else scheme}: {why}", None
        where = "CUDA GPU" if device == "cuda" else "Triton interpreter (TRITON_INTERPRET=1)"
        return True, f"{where}; fastpath.quant supports {scheme.name}", _quantizer

    def source_quantizer(self, q, scheme, device: str | None = None) -> tuple:
        """:func:`fused_source_quantizer` (on this engine's device unless ``device`` is given)."""
        return fused_source_quantizer(q, scheme, device)


ENGINE = TritonEngine()
"""The engine the entry point ``moeref.checkpoint_engines: triton`` names."""


def fused_source_quantizer(q, scheme, device: str | None = None) -> tuple:
    """``(quantizer or None, reason)``: the fused FP8-block decode + FP4 quantize of
    :mod:`fastpath.requant` for a source ``QuantizedTensor`` ``q`` (E4M3 with 2-D block
    scales) into an FP4 ``scheme``, once the Triton engine is chosen. The quantizer reads the
    source's codes and scales (1 byte per element to the device, not the 4 of the float32
    values) and ignores the values :func:`moeref.quant.requantize` hands it, which are the
    same numbers (``precision="float32"``: ``fl32(code * scale)``, what the kernel computes),
    except to refuse non-finite NVFP4 input as the reference does (the kernel does not look)."""
    device = device or _triton_device()
    try:
        from . import requant
    except ImportError as e:
        return None, f"fastpath.requant cannot be imported: {e}"
    ok, why = requant.supports(q.scheme, scheme, q.shape, q.block_shape, device=device)
    if not ok:
        return None, why

    def quantizer(values, target, **static):
        from moeref._interop import to_numpy
        from moeref.quant import quantize  # the reference refuses non-finite NVFP4 input: its error

        finite = None  # a device tensor's check is read once the codes are back (no wait of its own)
        if target.family == "nvfp4" and values is not None:
            finite = _finite_flag(values)
            if finite is False:
                return quantize(to_numpy(values), target, **static)
        from moeref.quant.device_report import upload

        codes, _ = upload(q, device)  # the converter's device report uploads the same source: once
        codes, scales, block = requant.from_reference(q, device, codes=codes)
        ref = _host_copy(requant.fp8_block_to_fp4(codes, scales, block, target, **static))
        if finite is not None and finite is not True and not bool(finite):
            return quantize(to_numpy(values), target, **static)
        return ref

    quantizer.device_values = True  # reads the values (a host array or a device tensor) for finiteness only
    return quantizer, "fused FP8-block decode + quantize (fastpath.requant)"
