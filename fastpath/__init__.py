"""GPU fast paths (Triton) for moeref operations, proven bit for bit against the references.

* :mod:`fastpath.quant` — quantize / dequantize kernels (FP8 per-tensor, per-token, 1xG with FP32,
  UE8M0 or packed UE8M0 scales, MN-major TMA-aligned scales; MXFP8; MXFP4; NVFP4 with scales in
  the 128x4 swizzle).
  NVFP4 takes a static global scale (one pass); FP8 rows with one scale per row of any length.
* :mod:`fastpath._packed_fp4` — E2M1 rounding in inline PTX (GPU only; the interpreter keeps the
  integer rounding of :mod:`fastpath._triton_rounding`): MXFP4 on packed bf16x2 pairs, NVFP4 and
  the other FP4 inputs one float32 lane at a time.
* :mod:`fastpath.fused` — ``silu_and_mul`` / ``gelu_and_mul`` / ``swigluoai`` + FP8 group quantization in one kernel.
* :mod:`fastpath.dispatch` — ``moe_align_block_size``, permute / unpermute-and-reduce, the DeepGEMM
  contiguous and masked layouts, the batched layout, finalize (same signatures as
  :mod:`moeref.dispatch`).
* :mod:`fastpath.registry` — which implementations each operation has and whether they run here
  (``get_implementation(op, name, **context)`` raises with the reason; no silent fallback).
* :mod:`fastpath.testing` — device selection and poisoned output buffers for tests.

Importing this package imports nothing heavy; the kernels need ``torch`` and ``triton`` (on a machine
without a GPU, set ``TRITON_INTERPRET=1`` before importing triton to run them on CPU tensors).
See docs/fastpaths.md and docs/fastpaths-dispatch.md; ``bench/sass_report.py`` counts the
kernels' SASS instructions and registers offline (no GPU needed), ``bench/profile_gpu.py`` runs
one launch of each benchmark kernel for Nsight Compute.
"""
from .registry import available, get_implementation, ImplementationUnavailable, operations

__all__ = ["available", "get_implementation", "ImplementationUnavailable", "operations"]
