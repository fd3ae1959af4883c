"""Which engine quantizes a module: the NumPy reference or the Triton fast path, never silently.

``"auto"`` takes :mod:`fastpath.quant` only on a CUDA GPU and only where
``fastpath.quant.supports`` accepts the scheme and shape (``fastpath/registry.py`` lists what is
supported); ``"triton"`` also runs the kernels under ``TRITON_INTERPRET=1`` on the CPU and raises
when they cannot run; ``"numpy"`` is the reference. The reason goes into the report.
"""
from __future__ import annotations

import numpy as np

from .._interop import triton_interpreted
from .safetensors_io import CheckpointError

__all__ = ["ENGINES", "choose_engine", "cuda_available", "fused_source_quantizer"]

ENGINES = ("auto", "numpy", "triton")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _triton_device() -> str | None:
    """``"cuda"``, or ``"cpu"`` under ``TRITON_INTERPRET=1`` (the kernels on the interpreter: the
    CPU test suite runs ``engine="triton"`` this way), or None."""
    if cuda_available():
        return "cuda"
    return "cpu" if triton_interpreted() else None


def _triton_quantizer(x, scheme, **static):
    import torch

    from fastpath.quant import quantize as fast_quantize

    xt = torch.from_numpy(np.ascontiguousarray(x)).to(_triton_device())
    return fast_quantize(xt, scheme, **static).to_reference()


def choose_engine(engine: str, scheme, shape) -> tuple:
    """``(engine name, reason, quantizer or None)`` for one tensor; never silent.

    ``"auto"`` takes the Triton fast path only on a CUDA GPU; ``"triton"`` also runs the kernels
    under ``TRITON_INTERPRET=1`` on the CPU, and raises when they cannot run."""
    if engine == "numpy":
        return "numpy", "asked for", None
    device = _triton_device() if engine == "triton" else ("cuda" if cuda_available() else None)
    if device is None:
        if engine == "triton":
            raise CheckpointError("engine 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1); "
                                  "none is available")
        return "numpy", "no CUDA GPU", None
    try:
        import torch

        from fastpath.quant import supports
    except ImportError as e:
        if engine == "triton":
            raise CheckpointError(f"engine 'triton' cannot be imported: {e}") from None
        return "numpy", f"triton: {e}", None
    if scheme is None or len(shape) > 3:
        ok, why = False, "the kernels take 1 to 3 axes of a quantized target"
    else:  # a zero-stride probe: the right shape, one element of memory
        probe = torch.empty_strided(tuple(shape), (0,) * len(shape), dtype=torch.float32,
                                    device=device)
        ok, why = supports(scheme=scheme, x=probe)
    if not ok:
        if engine == "triton":
            raise CheckpointError(f"engine 'triton' cannot quantize {scheme.name}: {why}")
        return "numpy", f"triton: {why}", None
    where = "CUDA GPU" if device == "cuda" else "Triton interpreter (TRITON_INTERPRET=1)"
    return "triton", f"{where}; fastpath.quant supports {scheme.name}", _triton_quantizer


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
        from fastpath import requant
    except ImportError as e:
        return None, f"fastpath.requant cannot be imported: {e}"
    ok, why = requant.supports(q.scheme, scheme, q.shape, q.block_shape, device=device)
    if not ok:
        return None, why

    def quantizer(values, target, **static):
        if target.family == "nvfp4" and values is not None and not np.all(np.isfinite(values)):
            from ..quant import quantize  # the reference refuses non-finite NVFP4 input: its error
            return quantize(values, target, **static)
        codes, scales, block = requant.from_reference(q, device)
        return requant.fp8_block_to_fp4(codes, scales, block, target, **static).to_reference()

    return quantizer, "fused FP8-block decode + quantize (fastpath.requant)"
