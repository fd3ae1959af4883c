"""Which engine quantizes a module: the NumPy reference or the Triton fast path, never silently.

``"auto"`` takes :mod:`fastpath.quant` only on a CUDA GPU and only where
``fastpath.quant.supports`` accepts the scheme and shape (``fastpath/registry.py`` lists what is
supported); ``"triton"`` also runs the kernels under ``TRITON_INTERPRET=1`` on the CPU and raises
when they cannot run; ``"numpy"`` is the reference. The reason goes into the report.
"""
from __future__ import annotations

import os

import numpy as np

from .safetensors_io import CheckpointError

__all__ = ["ENGINES", "choose_engine", "cuda_available"]

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
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


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
