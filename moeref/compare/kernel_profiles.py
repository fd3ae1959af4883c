"""Profiles of real kernels, each derived from the kernel's arithmetic, and the profile name table.

A :class:`~moeref.compare.bounds.Profile` states the arithmetic a kernel uses (accumulator precision
and promotion, the stores it rounds, the precision of its top-k reduction). :mod:`.bounds` defines the
generic ones (``EXACT``, ``FP32_ACCUM``, ``BF16_OUTPUT``, ``HOPPER_FP8_DEEPGEMM[_DATA]``); this module
adds one per family of real kernels, registers them in :data:`moeref.compare.PROFILES` and resolves a
profile given by name (:func:`get_profile`). Which profile for which kernel: the table in
docs/test-your-kernel.md and :func:`suggest_profile`.

Derivations (``u`` is a unit roundoff; ``2^-24`` round-to-nearest FP32, ``2^-23`` truncating FP32,
``2^-8`` bf16, ``2^-13`` the ~14 bits a Hopper FP8 WGMMA keeps):

* :data:`DEEPGEMM_FP8`: DeepGEMM ``m_grouped_fp8_gemm_nt_*`` on Hopper. FP8 WGMMA accumulates with
  about 14 bits and DeepGEMM promotes into FP32 registers every 128 K columns, multiplying each
  promoted chunk by its 1x128 x 128x128 scales (DeepSeek-V3 report §3.3.2); bf16 ``d``. The
  data-dependent aligned-adder bound (:func:`moeref.compare.bounds.gemm_error_bound`).
* :data:`CUBLAS_FP8`: ``torch._scaled_mm(..., use_fast_accum=False)`` (cuBLAS / CUTLASS rowwise FP8).
  The non-fast-accumulation mainloop promotes the WGMMA accumulator into FP32 every
  ``mma_promotion_interval = 4`` MMAs of 32 columns, i.e. every 128 K (CUTLASS
  ``GmmaFP8Accumulation``); row/column scales are applied once in the epilogue (constant along K, so
  the data-dependent model's exact domain holds); bf16 output. The same arithmetic as
  :data:`DEEPGEMM_FP8`; measured on an H200 it exceeds ``FP32_ACCUM`` up to 1.64x.
* :data:`CUBLAS_FP8_FAST_ACCUM`: ``use_fast_accum=True``: no promotion, the ~14-bit WGMMA accumulator
  runs over all of K (``promote_every=None``: one chunk of K columns in the aligned-adder
  recurrence); exceeds ``FP32_ACCUM`` up to 6.4x on an H200.
* :data:`CUTLASS_BF16_GROUPED_MM`: ``torch._grouped_mm`` on bf16 (CUTLASS grouped GEMM): exact bf16
  products, FP32 accumulator that truncates its alignment (Fasi et al., PeerJ CS 2021: tensor cores
  align to the largest exponent and truncate, so ``u = 2^-23`` rather than ``2^-24``). A bf16 WGMMA is
  16 columns wide, which adds one aligned term per 16 columns where the worst-case count of
  :func:`~moeref.compare.bounds.gemm_coefficient` assumes 32: ``(c + c/16 + 1) / (c + c/32 + 1) < 2``, so
  ``accum_unit = 2 * 2^-23 = 2^-22`` covers it. bf16 GEMM outputs, bf16 activation store, FP32
  top-k sum, bf16 output.
* :data:`TORCH_EAGER_BF16`: a layer written in eager torch on bf16 tensors: bf16 matmuls (FP32
  accumulation, bf16 result, as above), ``F.silu(gate) * up`` rounds twice (the SiLU result to bf16,
  then the product to bf16): ``act_unit = (1 + 2^-8)^2 - 1 + 16 * 2^-24``; the weighted top-k sum
  ``(y * w).sum(1)`` with bf16 products and sums (``reduce_unit = 2^-8`` covers bf16 products and up
  to ``k + 2`` bf16 roundings of the sum); bf16 output. cuBLAS may split K and reduce the partial sums
  in bf16 when ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` is True (torch's
  default); this profile declares FP32 accumulation, which that flag set to False guarantees
  (``tests/test_kernel_profiles_gpu.py`` runs both settings).
* :data:`VLLM_MOE_SUM_BF16`: vLLM's Triton ``fused_moe`` (FP32 accumulation, bf16 caches, the router
  weight multiplied in GEMM2's epilogue) followed by ``ops.moe_sum``, which for top-k 2-4 sums the
  ``k`` bf16 rows in ``scalar_t`` (each ``x += in[k]`` rounded to bf16; csrc/moe
  ``moe_sum_kernel``): :data:`~moeref.compare.BF16_OUTPUT` with ``reduce_unit = 2^-8``.

* :data:`BF16_OUTPUT_FP32_ACT`: FP8 E4M3 activations (1x128 FP32 scales, a1 and a2) through a GEMM that
  widens the codes exactly to bf16 and multiplies exactly decoded weights (the 4-bit W4A8 path of
  ``fastpath.grouped_gemm_w4``): exact products, FP32 accumulation with every scale (activation block,
  INT4 group, NVFP4 global factor) applied in FP32 to partial sums inside one scale block (at most two
  roundings a product: the contiguous-tree model of :data:`~moeref.compare.BF16_OUTPUT`), bf16 GEMM
  outputs; the activation is evaluated in FP32 and quantized to FP8 in the same kernel, never stored in
  bf16 (``act_out_dtype=None``, ``act_unit`` of :data:`~moeref.compare.HOPPER_FP8_DEEPGEMM`, whose fused
  activation kernel it is); FP32 top-k sum, bf16 output.

* :data:`TRITON_FP8_BLOCK_EXACT`: our Triton FP8 block grouped GEMM (``fastpath.grouped_gemm``, ``impl="triton"``)
  predicted bit for bit (``accum_model="emulated"``): the WGMMA accumulation of
  :data:`~moeref.compare.DEEPGEMM_FP8_EXACT`, the promotion ``acc += (part * sa) * sb`` contracted to
  ``fma(fl(part*sa), sb, acc)`` (``promotion_order="a_then_b"``; docs/hopper-fp8-accumulation.md; the kernel's
  output equals the emulator's on an H100, tests/test_hopper_fp8_gpu.py).

Every profile keeps :class:`~moeref.compare.bounds.Profile`'s fields; none needed a new one.
"""
from __future__ import annotations

from dataclasses import replace

from .bounds import (
    BF16_OUTPUT,
    DEEPGEMM_FP8_EXACT,
    HOPPER_FP8_DEEPGEMM,
    HOPPER_FP8_DEEPGEMM_DATA,
    PROFILES,
    U_BF16,
    U_FP32,
    Profile,
    get_profile,
)

__all__ = [
    "DEEPGEMM_FP8",
    "CUBLAS_FP8",
    "CUBLAS_FP8_FAST_ACCUM",
    "CUTLASS_BF16_GROUPED_MM",
    "TORCH_EAGER_BF16",
    "VLLM_MOE_SUM_BF16",
    "BF16_OUTPUT_FP32_ACT",
    "TRITON_FP8_BLOCK_EXACT",
    "KERNEL_PROFILES",
    "get_profile",
    "suggest_profile",
]

U_FP32_TRUNC = 2.0**-23
"""Unit roundoff of an FP32 accumulator that truncates (tensor cores' aligned adders)."""

DEEPGEMM_FP8 = replace(
    HOPPER_FP8_DEEPGEMM_DATA, name="DEEPGEMM_FP8",
    description="DeepGEMM m_grouped_fp8_gemm_nt_contiguous/_masked on Hopper: ~14-bit WGMMA accumulation "
    "promoted to FP32 every 128 K, 1x128 x 128x128 FP32 scales per chunk, bf16 output (data-dependent bound)")
CUBLAS_FP8 = replace(
    HOPPER_FP8_DEEPGEMM_DATA, name="CUBLAS_FP8",
    description="torch._scaled_mm FP8 rowwise/tensorwise, use_fast_accum=False: ~14-bit WGMMA accumulation "
    "promoted to FP32 every 4 MMAs (128 K), scales in the epilogue, bf16 output")
CUBLAS_FP8_FAST_ACCUM = replace(
    HOPPER_FP8_DEEPGEMM_DATA, name="CUBLAS_FP8_FAST_ACCUM", promote_every=None,
    description="torch._scaled_mm FP8, use_fast_accum=True: ~14-bit WGMMA accumulation over all of K, "
    "never promoted, scales in the epilogue, bf16 output")
CUTLASS_BF16_GROUPED_MM = replace(
    BF16_OUTPUT, name="CUTLASS_BF16_GROUPED_MM", accum_unit=2 * U_FP32_TRUNC, mma_k=16,
    description="torch._grouped_mm on bf16 (CUTLASS): exact bf16 products, truncating FP32 accumulation "
    "(16-wide WGMMA), bf16 GEMM outputs and activation, FP32 top-k sum, bf16 output")
TORCH_EAGER_BF16 = replace(
    CUTLASS_BF16_GROUPED_MM, name="TORCH_EAGER_BF16",
    act_unit=(1 + U_BF16) ** 2 - 1 + 16 * U_FP32, reduce_unit=U_BF16,
    description="eager torch on bf16 tensors: bf16 matmuls (FP32 accumulation), silu(gate) * up rounded "
    "twice to bf16, weighted top-k sum with bf16 products and sums, bf16 output")
VLLM_MOE_SUM_BF16 = replace(
    BF16_OUTPUT, name="VLLM_MOE_SUM_BF16", reduce_unit=U_BF16,
    description="vLLM Triton fused_moe + ops.moe_sum: FP32 accumulation, bf16 caches, router weight in "
    "GEMM2's epilogue, top-k 2-4 rows summed in bf16, bf16 output")

BF16_OUTPUT_FP32_ACT = replace(
    BF16_OUTPUT, name="BF16_OUTPUT_FP32_ACT", act_out_dtype=None, act_unit=HOPPER_FP8_DEEPGEMM.act_unit,
    description="FP8 1x128 activations widened exactly x exactly decoded weights (4-bit W4A8), FP32 accumulation "
    "with scales on partial sums inside a scale block, bf16 GEMM outputs, the activation quantized from FP32 "
    "(no bf16 store), FP32 top-k sum, bf16 output")

TRITON_FP8_BLOCK_EXACT = replace(
    DEEPGEMM_FP8_EXACT, name="TRITON_FP8_BLOCK_EXACT", promotion_order="a_then_b",
    description="fastpath.grouped_gemm's Triton FP8 block GEMM (1x128 x 128x128, FP32 scales) on Hopper, emulated "
    "bit for bit: DeepGEMM's WGMMA accumulation per 128 K, promoted as fma(fl(acc*sa), sb, final); stores as "
    "DEEPGEMM_FP8_EXACT")

KERNEL_PROFILES = {p.name: p for p in (DEEPGEMM_FP8, CUBLAS_FP8, CUBLAS_FP8_FAST_ACCUM, CUTLASS_BF16_GROUPED_MM,
                                       TORCH_EAGER_BF16, VLLM_MOE_SUM_BF16, BF16_OUTPUT_FP32_ACT,
                                       TRITON_FP8_BLOCK_EXACT)}
PROFILES.update(KERNEL_PROFILES)  # one name table: moeref.compare.PROFILES


_BF16 = ("bfloat16", "bf16", "float16", "fp16", "half")
_FP8 = ("float8_e4m3fn", "float8_e5m2", "e4m3fn", "e5m2", "fp8", "float8_e4m3fnuz", "float8_e5m2fnuz")
_FP4 = ("fp4", "e2m1", "nvfp4", "mxfp4", "float4_e2m1fn_x2", "uint8")


def _dtype_name(dt) -> str:
    if dt is None:
        return "float32"
    name = getattr(dt, "name", None) if not isinstance(dt, str) else dt
    name = str(name if name is not None else dt).replace("torch.", "").lower()
    return name


def suggest_profile(operand_dtype, out_dtype=None, *, fast_accum: bool = False, kernel: str | None = None) -> Profile:
    """The profile to check a kernel with, from its operand dtype and output dtype (names as numpy, ml_dtypes
    or torch spell them) and, where the dtypes do not decide it, the kernel family.

    * FP8 operands (``float8_e4m3fn``...): :data:`CUBLAS_FP8_FAST_ACCUM` when ``fast_accum``, else
      :data:`DEEPGEMM_FP8` (the same arithmetic as :data:`CUBLAS_FP8`);
    * FP4 operands (``e2m1``, packed ``uint8``): Blackwell block-scaled MMAs accumulate in FP32 with the
      scales applied inside the MMA: :data:`~moeref.compare.BF16_OUTPUT` for a bf16/fp16 output, else
      :data:`~moeref.compare.FP32_ACCUM`;
    * bf16/fp16 operands: ``kernel="vllm"`` -> :data:`VLLM_MOE_SUM_BF16`, ``"torch"`` (eager) ->
      :data:`TORCH_EAGER_BF16`, otherwise :data:`CUTLASS_BF16_GROUPED_MM`;
    * float32/float64: :data:`~moeref.compare.FP32_ACCUM`.

    >>> suggest_profile("float8_e4m3fn", "bfloat16").name
    'DEEPGEMM_FP8'
    >>> suggest_profile("bfloat16", kernel="vllm").name
    'VLLM_MOE_SUM_BF16'
    """
    a = _dtype_name(operand_dtype)
    o = _dtype_name(out_dtype) if out_dtype is not None else a
    if kernel is not None and kernel not in ("vllm", "torch", "cutlass", "deepgemm", "cublas"):
        raise ValueError(f"kernel must be one of vllm, torch, cutlass, deepgemm, cublas or None; got {kernel!r}")
    if a in _FP8:
        return CUBLAS_FP8_FAST_ACCUM if fast_accum else (CUBLAS_FP8 if kernel == "cublas" else DEEPGEMM_FP8)
    if a in _FP4:
        return BF16_OUTPUT if o in _BF16 else PROFILES["FP32_ACCUM"]
    if a in _BF16:
        if kernel == "vllm":
            return VLLM_MOE_SUM_BF16
        if kernel == "torch":
            return TORCH_EAGER_BF16
        return CUTLASS_BF16_GROUPED_MM
    if a in ("float32", "float64", "fp32", "fp64"):
        return PROFILES["FP32_ACCUM"] if o not in _BF16 else BF16_OUTPUT
    raise ValueError(f"no profile suggestion for operand dtype {operand_dtype!r}; accepted: fp8 "
                     f"({', '.join(_FP8[:2])}), fp4 (e2m1, uint8 packed), bf16/fp16, float32/float64")
