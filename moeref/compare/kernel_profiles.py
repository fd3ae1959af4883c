"""Profiles of real kernels, each derived from the kernel's arithmetic, and the profile name table.

A :class:`~moeref.compare.bounds.Profile` states the arithmetic a kernel uses (accumulator precision
and promotion, the stores it rounds, the precision of its top-k reduction). :mod:`.bounds` defines the
generic ones (``EXACT``, ``FP32_ACCUM``, ``BF16_OUTPUT``, ``HOPPER_FP8_DEEPGEMM[_DATA]``); this module
adds one per family of real kernels, registers them in :data:`moeref.compare.PROFILES` and resolves a
profile given by name (:func:`get_profile`). Which profile for which kernel: one rule, the decision table
from the kernel's arithmetic (:data:`DECISION_TABLE`, :class:`Arithmetic`, :func:`profile_for`), printed in
docs/test-your-kernel.md; every default of the package goes through :func:`suggest_profile`, which reads it.

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

* :data:`BF16_OUTPUT_BIAS_AFTER_STORE`: :data:`~moeref.compare.BF16_OUTPUT`'s arithmetic with each GEMM's
  bias added after its output store: ``rnd_bf16(fl32(rnd_bf16(acc) + b))``, as torch computes ``x @ w.T + b``
  on bf16 tensors (the matmul returns bf16; the elementwise add computes in FP32 and returns bf16) and as
  gpt-oss's torch reference writes its MLP (``einsum(...) + mlp1_bias``, ``t += mlp2_bias``). The bound
  replays the first store (:func:`~moeref.compare.bounds.store_interval`), adds the bias with one FP32
  rounding ``u_fp32 (|h + b| + r)`` and replays the second store (``bias_add="after_store"``). Under
  ``BF16_OUTPUT`` the honest torch layer fails: the double rounding moves a bf16 GEMM output by one ulp.
* :data:`BF16_OUTPUT_BIAS_INIT`: ``BF16_OUTPUT``'s arithmetic with the bias as the FP32 accumulator's
  initial value (``acc = b``, then the products added; ``bias_add="accumulator_init"``): the bias is a leaf
  before column 0 of the accumulation tree, so every partial sum holds it and each add can round at its
  magnitude (:func:`~moeref.compare.gemm_bounds.contiguous_tree_gemm_bound`: ``K`` adds on nodes within
  ``R + |b|``). An epilogue bias is rounded once; a bias of a thousand times the products at K = 256 puts an
  honest FP32 chain 5x over that bound (tests/test_bias_profiles.py).

* :data:`TRITON_FP8_BLOCK_EXACT`: our Triton and Gluon FP8 block grouped GEMMs (``fastpath.grouped_gemm``,
  ``impl="triton"``) predicted bit for bit (``accum_model="emulated"``): the arithmetic of
  :data:`~moeref.compare.DEEPGEMM_FP8_EXACT` (its WGMMA accumulation and its promotion ``acc += part * (sa * sb)``
  contracted to ``fma(part, fl(sa*sb), acc)``, ``promotion_order="deepgemm"``; docs/hopper-fp8-accumulation.md);
  the kernels' outputs equal the emulator's and DeepGEMM's on an H200 (tests/test_hopper_fp8_gpu.py). The
  emulator also offers the order ``"a_then_b"`` (``fma(fl(part*sa), sb, acc)``) for kernels that scale by the
  activation scale first.

Every profile is a :class:`~moeref.compare.bounds.Profile`; the two bias placements are its ``bias_add`` field.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

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
    "BF16_OUTPUT_BIAS_AFTER_STORE",
    "BF16_OUTPUT_BIAS_INIT",
    "TRITON_FP8_BLOCK_EXACT",
    "KERNEL_PROFILES",
    "Arithmetic",
    "DECISION_TABLE",
    "ALIASES",
    "get_profile",
    "profile_for",
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

BF16_OUTPUT_BIAS_AFTER_STORE = replace(
    BF16_OUTPUT, name="BF16_OUTPUT_BIAS_AFTER_STORE", bias_add="after_store",
    description="BF16_OUTPUT with each GEMM output stored in bf16 before its bias: the bias added to the stored "
    "value in FP32 and the sum stored in bf16 again (torch x @ w.T + b on bf16 tensors; gpt-oss's torch reference)")
BF16_OUTPUT_BIAS_INIT = replace(
    BF16_OUTPUT, name="BF16_OUTPUT_BIAS_INIT", bias_add="accumulator_init",
    description="BF16_OUTPUT with the bias as the FP32 accumulator's initial value (acc = b; acc += a w), the sum "
    "stored in bf16")

TRITON_FP8_BLOCK_EXACT = replace(
    DEEPGEMM_FP8_EXACT, name="TRITON_FP8_BLOCK_EXACT",
    description="fastpath.grouped_gemm's Triton and Gluon FP8 block GEMMs (1x128 x 128x128, FP32 scales) on Hopper, "
    "emulated bit for bit: DeepGEMM's arithmetic (WGMMA accumulation per 128 K, promoted as fma(acc, fl(sa*sb), "
    "final)) and stores, so DEEPGEMM_FP8_EXACT's predictions")

KERNEL_PROFILES = {p.name: p for p in (DEEPGEMM_FP8, CUBLAS_FP8, CUBLAS_FP8_FAST_ACCUM, CUTLASS_BF16_GROUPED_MM,
                                       TORCH_EAGER_BF16, VLLM_MOE_SUM_BF16, BF16_OUTPUT_FP32_ACT,
                                       BF16_OUTPUT_BIAS_AFTER_STORE, BF16_OUTPUT_BIAS_INIT, TRITON_FP8_BLOCK_EXACT)}
PROFILES.update(KERNEL_PROFILES)  # one name table: moeref.compare.PROFILES


_BF16 = ("bfloat16", "bf16", "float16", "fp16", "half")
_FP8 = ("float8_e4m3fn", "float8_e5m2", "e4m3fn", "e5m2", "fp8", "float8_e4m3fnuz", "float8_e5m2fnuz")
_FP4 = ("fp4", "e2m1", "nvfp4", "mxfp4", "float4_e2m1fn_x2", "uint8")


@dataclass(frozen=True)
class Arithmetic:
    """A kernel's arithmetic in the terms of the decision table (:data:`DECISION_TABLE`,
    docs/test-your-kernel.md), each field one question about the kernel:

    * ``accumulator``: ``"fp32"`` (FP32 accumulation in any order: BLAS, ``tl.dot``, CUTLASS/cuBLAS bf16
      and FP4 block-scaled MMAs, split-K); ``"fp8_promoted"`` (Hopper FP8 WGMMA, ~14 bits, promoted into
      FP32 every 128 K: DeepGEMM, ``torch._scaled_mm(use_fast_accum=False)``); ``"fp8_unpromoted"`` (the
      same never promoted: ``use_fast_accum=True``); ``"deepgemm_emulated"`` / ``"triton_fp8_emulated"``
      (DeepGEMM's / ``fastpath.grouped_gemm``'s FP8 GEMM predicted bit for bit).
    * ``gemm_out``: the store of GEMM1's and GEMM2's outputs: ``"bf16"`` or ``"fp32"`` (kept in FP32).
    * ``activation``: ``"bf16"`` (evaluated in FP32, one bf16 store), ``"bf16_twice"`` (``silu(gate)`` and
      then ``* up`` each rounded to bf16, eager torch), ``"fp32"`` (kept in FP32 or quantized from FP32).
    * ``router_weight``: ``"finalize"`` (the top-k sum multiplies the stored GEMM2 outputs) or
      ``"gemm2_epilogue"`` (GEMM2's epilogue multiplies before its store, vLLM ``MUL_ROUTED_WEIGHT``).
    * ``bias``: ``"epilogue"`` (added in FP32 before the GEMM output store), ``"after_store"`` (added to the
      stored GEMM output, the sum stored again: torch ``x @ w.T + b`` on bf16 tensors) or
      ``"accumulator_init"`` (the accumulator starts at it); a layer without biases: ``"epilogue"``.
    * ``topk_sum``: ``"fp32"`` or ``"bf16"`` (each weighted row and each add rounded to bf16).
    * ``output``: the layer output's dtype, ``"bf16"`` or ``"fp32"``.
    """

    accumulator: str = "fp32"
    gemm_out: str = "bf16"
    activation: str = "bf16"
    router_weight: str = "finalize"
    bias: str = "epilogue"
    topk_sum: str = "fp32"
    output: str = "bf16"

    def __post_init__(self):
        for f, allowed in _ARITHMETIC_VALUES.items():
            if getattr(self, f) not in allowed:
                raise ValueError(f"{f} must be one of {', '.join(allowed)}; got {getattr(self, f)!r}")


_ARITHMETIC_VALUES = {
    "accumulator": ("fp32", "fp8_promoted", "fp8_unpromoted", "deepgemm_emulated", "triton_fp8_emulated"),
    "gemm_out": ("bf16", "fp32"),
    "activation": ("bf16", "bf16_twice", "fp32"),
    "router_weight": ("finalize", "gemm2_epilogue"),
    "bias": ("epilogue", "after_store", "accumulator_init"),
    "topk_sum": ("fp32", "bf16"),
    "output": ("bf16", "fp32"),
}

_FP8_ACT = ("bf16", "fp32")  # the Hopper FP8 profiles bound the activation stored in bf16 or not
DECISION_TABLE = (
    (dict(gemm_out="fp32", activation="fp32", output="fp32"), "FP32_ACCUM",
     "FP32 kernels; FP4 block-scaled MMAs with an FP32 output"),
    (dict(), "BF16_OUTPUT",
     "Triton/CUTLASS fused MoE and `torch._grouped_mm` layers on bf16, FP4 block-scaled MMAs with a bf16 output"),
    (dict(bias="after_store"), "BF16_OUTPUT_BIAS_AFTER_STORE",
     "torch `x @ w.T + b` on bf16 tensors (gpt-oss's torch reference)"),
    (dict(bias="accumulator_init"), "BF16_OUTPUT_BIAS_INIT", "GEMMs whose accumulator starts at the bias"),
    (dict(activation="bf16_twice", topk_sum="bf16"), "TORCH_EAGER_BF16",
     "a layer in eager torch on bf16 tensors (`F.silu(gate) * up`, `(y * w).sum(1)` in bf16)"),
    (dict(router_weight="gemm2_epilogue", topk_sum="bf16"), "VLLM_MOE_SUM_BF16",
     "vLLM Triton `fused_moe` + `moe_sum` (top-k 2-4)"),
    (dict(activation="fp32"), "BF16_OUTPUT_FP32_ACT",
     "FP8 activations widened to bf16 x exactly decoded 4-bit weights (`fastpath.grouped_gemm_w4` W4A8)"),
    (dict(accumulator="fp8_promoted", activation=_FP8_ACT), "DEEPGEMM_FP8",
     "DeepGEMM `m_grouped_fp8_gemm_nt_contiguous` / `_masked` (Hopper), `torch._scaled_mm` FP8 "
     "`use_fast_accum=False`"),
    (dict(accumulator="fp8_unpromoted", activation=_FP8_ACT), "CUBLAS_FP8_FAST_ACCUM",
     "`torch._scaled_mm` FP8 `use_fast_accum=True`"),
    (dict(accumulator="deepgemm_emulated"), "DEEPGEMM_FP8_EXACT", "DeepGEMM's FP8 GEMM, predicted bit for bit"),
    (dict(accumulator="triton_fp8_emulated"), "TRITON_FP8_BLOCK_EXACT",
     "`fastpath.grouped_gemm`'s Triton and Gluon FP8 block GEMMs, predicted bit for bit (DeepGEMM's bits)"),
)
"""The one rule from a kernel's arithmetic to its profile: ``(fields, profile name, kernels)`` rows, where
``fields`` are the :class:`Arithmetic` fields that differ from its defaults (a tuple: any of those
values). :func:`profile_for` reads it; every default of the package (:func:`suggest_profile`, ``moeref
check`` and ``mutate``, the pytest plugin's ``moe_profile``) goes through it; docs/test-your-kernel.md
prints it (a test checks the page against it). No two rows match one arithmetic."""

ALIASES = {
    "CUBLAS_FP8": "DEEPGEMM_FP8",
    "HOPPER_FP8_DEEPGEMM_DATA": "DEEPGEMM_FP8",
    "HOPPER_FP8_DEEPGEMM": "DEEPGEMM_FP8",
    "CUTLASS_BF16_GROUPED_MM": "BF16_OUTPUT",
}
"""Profiles of :data:`moeref.compare.PROFILES` that declare the arithmetic of a decision-table row under
another name: ``CUBLAS_FP8`` and ``HOPPER_FP8_DEEPGEMM_DATA`` are the same declaration as ``DEEPGEMM_FP8``;
``HOPPER_FP8_DEEPGEMM`` bounds it with the data-independent coefficient (looser); ``CUTLASS_BF16_GROUPED_MM``
bounds BF16_OUTPUT's arithmetic with a 4x accumulator unit (the worst-case count of a 16-wide truncating
MMA; the contiguous-tree model of BF16_OUTPUT covers truncating adders of 9 or more addends with
``adder_factor`` 2.25). Kept so that code and reproducers naming them still resolve; ``EXACT`` (the float64
reference against itself) is no kernel's."""


def _row_matches(fields: dict, arith: Arithmetic) -> bool:
    default = Arithmetic()
    for f in _ARITHMETIC_VALUES:
        want = fields.get(f, getattr(default, f))
        if getattr(arith, f) not in (want if isinstance(want, tuple) else (want,)):
            return False
    return True


def profile_for(arithmetic: Arithmetic | None = None, **fields) -> Profile:
    """The profile of a kernel's arithmetic: the :data:`DECISION_TABLE` row it matches. ``arithmetic``: an
    :class:`Arithmetic`, or its fields by name (the rest default: FP32 accumulation, bf16 GEMM outputs and
    activation, the router weight in the top-k sum, the bias in the epilogue, an FP32 top-k sum, a bf16
    output).

    >>> profile_for().name, profile_for(bias="after_store").name
    ('BF16_OUTPUT', 'BF16_OUTPUT_BIAS_AFTER_STORE')
    >>> profile_for(accumulator="fp8_promoted").name
    'DEEPGEMM_FP8'
    """
    if arithmetic is None:
        arithmetic = Arithmetic(**fields)
    elif fields:
        arithmetic = replace(arithmetic, **fields)
    if not isinstance(arithmetic, Arithmetic):
        raise TypeError(f"arithmetic must be an Arithmetic; got {type(arithmetic).__name__}")
    for row, name, _ in DECISION_TABLE:
        if _row_matches(row, arithmetic):
            return PROFILES[name]
    raise ValueError(f"no profile declares {arithmetic}; the declared arithmetics are the rows of "
                     "moeref.compare.kernel_profiles.DECISION_TABLE (docs/test-your-kernel.md). Declare yours with "
                     "dataclasses.replace on the nearest profile (moeref.compare.Profile's fields)")


def _dtype_name(dt) -> str:
    if dt is None:
        return "float32"
    name = getattr(dt, "name", None) if not isinstance(dt, str) else dt
    name = str(name if name is not None else dt).replace("torch.", "").lower()
    return name


_KERNELS = ("vllm", "torch", "cutlass", "deepgemm", "cublas")
_KERNEL_ARITHMETIC = {
    "vllm": dict(router_weight="gemm2_epilogue", topk_sum="bf16"),
    "torch": dict(activation="bf16_twice", topk_sum="bf16"),
}


def suggest_profile(operand_dtype, out_dtype=None, *, fast_accum: bool = False, kernel: str | None = None) -> Profile:
    """The default profile of every entry point: the :data:`DECISION_TABLE` row (:func:`profile_for`) of the
    arithmetic a kernel with these dtypes has unless told otherwise. ``operand_dtype``/``out_dtype``: names
    as numpy, ml_dtypes or torch spell them; ``kernel``: the family, where the dtypes do not decide it.

    * FP8 operands (``float8_e4m3fn``...): the Hopper WGMMA promoted every 128 K, :data:`DEEPGEMM_FP8`
      (``kernel="cublas"`` too: ``_scaled_mm`` without fast accumulation is the same arithmetic), or never
      promoted with ``fast_accum``, :data:`CUBLAS_FP8_FAST_ACCUM`;
    * FP4 operands (``e2m1``, packed ``uint8``): Blackwell block-scaled MMAs accumulate in FP32 with the
      scales inside the MMA: :data:`~moeref.compare.BF16_OUTPUT` for a bf16/fp16 output, else
      :data:`~moeref.compare.FP32_ACCUM`;
    * bf16/fp16 operands: FP32 accumulation, bf16 stores, the bias in the epilogue, an FP32 top-k sum:
      :data:`~moeref.compare.BF16_OUTPUT` (``kernel="cutlass"`` or ``"deepgemm"`` too); ``kernel="vllm"``: the
      router weight in GEMM2's epilogue and ``moe_sum`` in bf16, :data:`VLLM_MOE_SUM_BF16`; ``"torch"``
      (eager): the activation rounded twice and the top-k sum in bf16, :data:`TORCH_EAGER_BF16`;
    * float32/float64: :data:`~moeref.compare.FP32_ACCUM` (a bf16 output: ``BF16_OUTPUT``).

    >>> suggest_profile("bfloat16", "bfloat16").name, suggest_profile("float8_e4m3fn", "bfloat16").name
    ('BF16_OUTPUT', 'DEEPGEMM_FP8')
    >>> suggest_profile("bfloat16", kernel="vllm").name
    'VLLM_MOE_SUM_BF16'
    """
    a = _dtype_name(operand_dtype)
    o = _dtype_name(out_dtype) if out_dtype is not None else a
    if kernel is not None and kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(_KERNELS)} or None; got {kernel!r}")
    if a in _FP8:
        return profile_for(accumulator="fp8_unpromoted" if fast_accum else "fp8_promoted")
    if a in _FP4:
        return profile_for() if o in _BF16 else profile_for(gemm_out="fp32", activation="fp32", output="fp32")
    if a in _BF16:
        return profile_for(**_KERNEL_ARITHMETIC.get(kernel, {}))
    if a in ("float32", "float64", "fp32", "fp64"):
        return profile_for(gemm_out="fp32", activation="fp32", output="fp32") if o not in _BF16 else profile_for()
    raise ValueError(f"no profile suggestion for operand dtype {operand_dtype!r}; accepted: fp8 "
                     f"({', '.join(_FP8[:2])}), fp4 (e2m1, uint8 packed), bf16/fp16, float32/float64")
