"""Declared arithmetics: what an implementation is allowed to do when it computes a GEMM or a layer.

An exact regime is defined *relative to* one of these: the inputs are in the regime when every
computation the arithmetic allows (any summation order, any split-K, with or without each optional
store) gives the same bits. :func:`moeref.regimes.in_exact_regime` checks that from the values.

The accumulator models:

* ``fp32``: IEEE FP32 (24-bit significand) in any order, split-K included; also a tensor core whose
  multi-term adder keeps at least 24 bits below the largest addend (bf16/fp16 MMA with FP32
  accumulation on Ampere/Hopper/Blackwell: Fasi, Higham, Mikaitis, Pranesh, PeerJ CS 2021; Khattak and
  Mikaitis, arXiv 2512.07004).
* ``hopper_fp8``: the FP8 WGMMA accumulator of :mod:`moeref.gemm.hopper_fp8` (addends aligned to the
  largest one and cut ``align_bits = 13`` bits below it, group sums normalised to ``norm_bits = 14``
  bits, truncating), promoted into FP32 every ``promotion_k = 128`` columns (DeepGEMM
  ``sm90_fp8_gemm_1d2d``; DeepSeek-V3 report §3.3.2). Inside one promotion interval it is exact when
  every partial sum is a multiple of the smallest product's lowest bit and below ``2^14`` of it.
* ``fp8_unpromoted``: the same accumulator never promoted (cuBLAS ``use_fast_accum=True``; Triton's
  FP8 ``tl.dot`` without ``max_num_imprecise_acc``): the whole K must fit 14 bits.
* ``bf16`` / ``fp16``: an accumulator of 8 / 11 bits (not a conforming FP32 kernel: a fault model, and
  the arithmetic of a kernel that declares a half-precision accumulator).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .._checks import check_choice

__all__ = ["Arithmetic", "ARITHMETICS", "get_arithmetic", "ACCUMULATORS", "STORE_DTYPES"]

ACCUMULATORS = ("fp32", "hopper_fp8", "fp8_unpromoted", "bf16", "fp16")
STORE_DTYPES = ("bfloat16", "float16", "float32")

# significant bits an accumulator keeps exactly below its largest addend
_MMA_BITS = {"fp32": 24, "hopper_fp8": 14, "fp8_unpromoted": 14, "bf16": 8, "fp16": 11}


@dataclass(frozen=True)
class Arithmetic:
    """A declared arithmetic for a GEMM (and the stores of a layer around it).

    Attributes:
        name: label for reports.
        accumulator: one of :data:`ACCUMULATORS` (module docstring).
        promotion_k: columns of K the low-precision MMA accumulator holds before it is added into
            FP32 (``hopper_fp8``: 128; ``None``: never, the whole K); ignored for ``fp32``.
        gemm_store: dtype the GEMM output is stored in (``"bfloat16"``, ``"float16"``, ``"float32"``;
            None: not stored, float64 compared). One round-to-nearest-even of the exact sum.
        activation_ulps: float32 ulps an implementation's activation may be off by (its ``exp``,
            ``erf``, ``tanh``); a value that rounds at a declared store must sit farther than that from
            every rounding boundary (``2^-24 * activation_ulps`` relative) so every faithful evaluation
            rounds the same way.
        optional_stores: layer stores a conforming kernel may or may not make (``"gemm1"``: GEMM1
            output in bf16; ``"act"``: activation output in bf16 before the re-quantization;
            ``"gemm2"``: GEMM2 output in bf16 before the top-k sum). The layer regime requires every
            combination to give the same bits.
    """

    name: str
    accumulator: str = "fp32"
    promotion_k: int | None = None
    gemm_store: str | None = "bfloat16"
    activation_ulps: int = 8
    optional_stores: tuple = ("gemm1", "act", "gemm2")

    def __post_init__(self):
        check_choice(self.accumulator, ACCUMULATORS, "accumulator")
        if self.gemm_store is not None:
            check_choice(self.gemm_store, STORE_DTYPES, "gemm_store")
        if self.promotion_k is not None and (not isinstance(self.promotion_k, int) or self.promotion_k < 1):
            raise ValueError(f"promotion_k must be a positive int or None; got {self.promotion_k!r}")
        bad = [s for s in self.optional_stores if s not in ("gemm1", "act", "gemm2")]
        if bad:
            raise ValueError(f"optional_stores must be among 'gemm1', 'act', 'gemm2'; got {bad}")
        object.__setattr__(self, "optional_stores", tuple(self.optional_stores))

    @property
    def mma_bits(self) -> int:
        """Significant bits the (MMA) accumulator keeps exactly below its largest addend."""
        return _MMA_BITS[self.accumulator]

    @property
    def interval(self) -> int | None:
        """K columns one low-precision accumulator spans before FP32 takes over (None: all of K)."""
        if self.accumulator == "fp32":
            return None
        if self.accumulator == "hopper_fp8":
            return self.promotion_k or 128
        return self.promotion_k

    def with_(self, **changes) -> "Arithmetic":
        return replace(self, **changes)


ARITHMETICS = {
    "fp32": Arithmetic("fp32"),
    "hopper_fp8": Arithmetic("hopper_fp8", "hopper_fp8", promotion_k=128),
    "fp8_unpromoted": Arithmetic("fp8_unpromoted", "fp8_unpromoted"),
    "bf16_tensor_core": Arithmetic("bf16_tensor_core", "fp32"),
    "bf16_accumulator": Arithmetic("bf16_accumulator", "bf16"),
    "fp16_accumulator": Arithmetic("fp16_accumulator", "fp16"),
}
"""Named arithmetics: ``fp32`` (any FP32 order, split-K), ``hopper_fp8`` (DeepGEMM-style promotion every
128 K), ``fp8_unpromoted``, ``bf16_tensor_core`` (bf16 operands, FP32 accumulation: the ``fp32`` rule),
and the half-precision accumulators ``bf16_accumulator`` / ``fp16_accumulator``."""


def get_arithmetic(arithmetic) -> Arithmetic:
    """``arithmetic`` as an :class:`Arithmetic` (an instance or a name of :data:`ARITHMETICS`)."""
    if isinstance(arithmetic, Arithmetic):
        return arithmetic
    if isinstance(arithmetic, str):
        check_choice(arithmetic, tuple(ARITHMETICS), "arithmetic")
        return ARITHMETICS[arithmetic]
    raise TypeError(f"arithmetic must be an Arithmetic or one of {', '.join(ARITHMETICS)}; "
                    f"got {type(arithmetic).__name__}")
