"""Which implementations each operation has, and whether one can run here, for these arguments.

Every operation (``"quantize"``, ``"dequantize"``, ``"silu_and_mul_quant_fp8"`` ...) names its
implementations: ``"reference"`` (the exact NumPy specification in :mod:`moeref`), ``"triton"``
(the kernels of :mod:`fastpath`), and ``"deep_gemm"`` where DeepGEMM ships one. Each carries a
``supports(**context) -> (ok, reason)`` predicate; ``context`` holds what the call will be made with
(``scheme=``, ``x=``, ``layout=`` ...) and may be empty (then only the environment is checked:
is Triton importable, is there a GPU or the interpreter, is ``deep_gemm`` installed).

:func:`get_implementation` returns the callable or raises :class:`ImplementationUnavailable` with
the predicate's reason. There is no silent fallback: asking for ``"triton"`` never hands back the
reference. :func:`available` lists every (operation, implementation, ok, reason) so tests and users
can iterate over what runs here.

>>> from fastpath.registry import available, operations
>>> "quantize" in operations()
True
>>> rows = available("quantize")
>>> {r.implementation for r in rows} >= {"reference", "triton"}
True
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "Implementation",
    "ImplementationUnavailable",
    "Availability",
    "register",
    "get_implementation",
    "available",
    "operations",
    "implementations",
]


class ImplementationUnavailable(RuntimeError):
    """Raised by :func:`get_implementation` when an implementation cannot run; the message says why."""


@dataclass(frozen=True)
class Implementation:
    """One implementation of one operation.

    Attributes:
        op: operation name.
        name: ``"reference"``, ``"triton"`` or ``"deep_gemm"``.
        target: ``"module:attribute"`` of the callable (imported lazily, so listing costs nothing).
        supports: ``supports(**context) -> (ok, reason)``.
        description: one line for tables.
    """

    op: str
    name: str
    target: str
    supports: Callable[..., tuple[bool, str]]
    description: str = ""

    def load(self) -> Callable:
        module, attr = self.target.split(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Availability:
    op: str
    implementation: str
    ok: bool
    reason: str


_REGISTRY: dict[str, dict[str, Implementation]] = {}


def register(op: str, name: str, target: str, supports: Callable[..., tuple[bool, str]],
             description: str = "") -> Implementation:
    """Add an implementation (refuses a second, different one under the same (op, name))."""
    impl = Implementation(op, name, target, supports, description)
    old = _REGISTRY.setdefault(op, {}).get(name)
    if old is not None and old != impl:
        raise ValueError(f"an implementation {name!r} of {op!r} is already registered ({old.target})")
    _REGISTRY[op][name] = impl
    return impl


def operations() -> list[str]:
    """Names of the registered operations."""
    _ensure_loaded()
    return list(_REGISTRY)


def implementations(op: str) -> list[str]:
    """Implementation names of ``op`` (``ValueError`` for an unknown operation)."""
    return list(_lookup_op(op))


def _lookup_op(op: str) -> dict[str, Implementation]:
    _ensure_loaded()
    if op not in _REGISTRY:
        raise ValueError(f"unknown operation {op!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[op]


def _check(impl: Implementation, context: dict) -> tuple[bool, str]:
    try:
        ok, reason = impl.supports(**context)
    except (TypeError, ValueError) as e:  # a malformed context is a "no", with the reason
        return False, f"{type(e).__name__}: {e}"
    return bool(ok), str(reason)


def get_implementation(op: str, name: str, **context) -> Callable:
    """The callable of implementation ``name`` of ``op``, after ``supports(**context)`` said yes.

    Raises:
        ValueError: unknown ``op`` or ``name`` (listing the registered ones).
        ImplementationUnavailable: the implementation cannot run for this context; the message
            carries the predicate's reason (never a silent fallback to another implementation).
    """
    impls = _lookup_op(op)
    if name not in impls:
        raise ValueError(f"{op!r} has no implementation {name!r}; registered: {', '.join(impls)}")
    impl = impls[name]
    ok, reason = _check(impl, context)
    if not ok:
        raise ImplementationUnavailable(f"{op} / {name} cannot run: {reason}")
    return impl.load()


def available(op: str | None = None, **context) -> list[Availability]:
    """Every (operation, implementation) with whether it runs for ``context``, and why (not)."""
    ops = [op] if op is not None else operations()
    rows = []
    for o in ops:
        for impl in _lookup_op(o).values():
            ok, reason = _check(impl, context)
            rows.append(Availability(o, impl.name, ok, reason))
    return rows


# ---------------------------------------------------------------------------- the registrations


def _reference_supports(**context) -> tuple[bool, str]:
    """The NumPy references run everywhere on host data; a device tensor must be copied first."""
    for name, v in context.items():
        device = getattr(getattr(v, "device", None), "type", "cpu")
        if device != "cpu":
            return False, (f"the reference takes host data (NumPy or CPU tensors); {name} is on "
                           f"{device}: call .cpu() first")
    return True, "ok"


DISPATCH_OPERATIONS = (
    "moe_align_block_size",
    "expert_first_token_offset",
    "moe_permute",
    "moe_unpermute",
    "to_contiguous",
    "to_masked",
    "to_batched",
    "weight_and_reduce",
)
"""Operations of :mod:`moeref.dispatch` that :mod:`fastpath.dispatch` implements (same names and
signatures)."""


def _triton_supports(module: str, attr: str = "supports"):
    def supports(**context) -> tuple[bool, str]:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # triton or torch missing
            return False, f"{module} cannot be imported ({e})"
        return getattr(mod, attr)(**context)
    return supports


def _quantize_supports(global_scale=None, **context) -> tuple[bool, str]:
    """fastpath.quant.supports, then (NVFP4 static global scale) whether ``global_scale`` is
    accepted: :func:`fastpath.quant.global_scale_supports`."""
    ok, reason = _triton_supports("fastpath.quant")(**context)
    if not ok or global_scale is None:
        return ok, reason
    return _triton_supports("fastpath.quant", "global_scale_supports")(global_scale=global_scale,
                                                                       **context)


def _dequant_supports(q=None, **context) -> tuple[bool, str]:
    if q is None:
        return _triton_supports("fastpath.quant")()
    return _triton_supports("fastpath.quant")(scheme=q.scheme, scale_layout=q.scale_layout)


_LOADED = False


def _ensure_loaded() -> None:
    """Register the built-in implementations (once; nothing is imported until asked for)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    register("quantize", "reference", "moeref.quant:quantize", _reference_supports,
             "exact NumPy specification (moeref.quant.quantize)")
    register("quantize", "triton", "fastpath.quant:quantize", _quantize_supports,
             "Triton kernel: FP8 per-tensor/per-token/1xG, MXFP8, MXFP4, NVFP4 (dynamic or static "
             "global scale); every scale layout")
    register("quantize", "deep_gemm", "fastpath.quant:deep_gemm_quantize",
             _triton_supports("fastpath.quant", "deep_gemm_supports"),
             "DeepGEMM's torch quantizer (per_token_cast_to_fp8), deepgemm preset only")
    register("dequantize", "reference", "moeref.quant:dequantize", _reference_supports,
             "exact float64 product, rounded once")
    register("dequantize", "triton", "fastpath.quant:dequantize", _dequant_supports,
             "Triton kernel: exact product as a float32 pair, integer RNE to the output dtype")
    for op in DISPATCH_OPERATIONS:
        register(op, "reference", f"moeref.dispatch:{op}", _reference_supports,
                 "exact NumPy specification (moeref.dispatch, one stable sort)")
        register(op, "triton", f"fastpath.dispatch:{op}", _triton_supports("fastpath.dispatch"),
                 "Triton counting sort (deterministic, reference order) + one-pass row kernels")
    for op in ("grouped_gemm_w4_contiguous", "grouped_gemm_w4_masked"):
        register(op, "triton", f"fastpath.grouped_gemm_w4:{op}",
                 _triton_supports("fastpath.grouped_gemm_w4", "w4_supports"),
                 "Triton grouped GEMM, MXFP4/NVFP4/INT4 weights decoded in the K loop x bf16 activations")
    for op in ("silu_and_mul_quant_fp8", "gelu_and_mul_quant_fp8", "swigluoai_quant_fp8"):
        register(op, "reference", f"fastpath.fused:reference_{op}", _reference_supports,
                 "moeref.activations (float64) then moeref.quant.quantize")
        register(op, "triton", f"fastpath.fused:{op}", _triton_supports("fastpath.fused"),
                 "one Triton kernel: float32 activation, then the 1xG FP8 quantizer")
