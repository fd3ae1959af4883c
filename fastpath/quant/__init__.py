"""Triton quantizers and dequantizers for the blockwise schemes of :mod:`moeref.quant`.

One kernel serves FP8 per-tensor / per-token / 1xG groups, MXFP8, MXFP4 and NVFP4: every knob of
the scheme's :class:`~moeref.quant.scheme.Preset` (scale rule, amax floor, zero-block and
non-finite policy, how the scale is applied, element rounding, overflow, signed zero, NaN code)
becomes a ``tl.constexpr``, so each preset compiles to its own straight-line code. The scale
output is written directly in the layout the consuming GEMM reads (:data:`SCALE_LAYOUTS`:
``row_major``, ``mn_major``, ``packed_ue8m0``, ``swizzled_128x4``; every padding element is
written, so output buffers come from ``torch.empty`` and the tests poison them first).

The package, split the way triton_kernels separates host API, kernels and layout details:

==========================  ==========================================================================
this module                 the host API: :func:`supports`, :func:`quantize`, :func:`dequantize`,
                            :class:`FastQuantized`, DeepGEMM's quantizer as a baseline
``_kernels``                the ``@triton.jit`` kernels; their device functions in ``_jit_scales``
                            (amax, block scales, scale layouts) and ``_jit_codes`` (data scaling,
                            element codes, activations)
``_preset_map``             Preset -> the kernels' compile-time constants, derived from the scheme
                            definitions of :mod:`moeref.quant.scheme`
``_tiles``                  tiles: the general choice and the per-device tables
``_layouts``                the scale layouts: names, addressing, storage shapes
``_launch``                 host-side launch helpers (amax pass, NVFP4 factors, launch knobs)
``_plan``                   per-call plans: what a call computes from its shape, dtype, strides, layout
                            and options, made once per key and reused (the host cost at decode
                            sizes, issue 20; schemes are keyed by identity: make a scheme once)
==========================  ==========================================================================

Exactness: the arithmetic is the reference's, operation for operation, in float32:
``tl.math.div_rn`` for a division (Triton's ``/`` is an approximate ``div.full.f32`` on the
GPU), or, for the data divided by a per-group scale, ``_div_exact`` (reciprocal per group,
one FMA correction per element, which gives the codes of ``RN(x / s)`` in a proven window,
``div_rn`` outside it), products and the block amax as in :mod:`moeref.quant.blockwise`, the
amax a NaN-propagating max of ``|x|`` (the integer max of the bit patterns: non-negative floats
order like their bits and NaN patterns sort above Inf; or ``max.NaN.f32`` where a NaN amax's
payload is not kept), E8M0 scales from exponent bits, and element codes from
:mod:`fastpath._triton_rounding`. On a GPU the FP8 element cast may instead use the hardware
``cvt.rn.satfinite`` (``hw_fp8=True``, the default on CUDA for saturating RNE presets): the GPU
suite checks that both give identical codes. NaN element codes are compared modulo their sign
bit: IEEE leaves the sign of a NaN produced by arithmetic unspecified (x86 yields -NaN for
0 * Inf, CUDA +NaN).

Tiles: a program quantizes ``BLOCK_M`` rows x ``GPP`` groups (about 4096 elements). FP8 uses
plain ``[BLOCK_M, GPP, GB]`` tiles. FP4 packs element pairs into bytes, and ``swigluoai`` reads
interleaved (gate, up) pairs: for contiguous 16-bit input both read int32 words, one pair per
word (16-byte loads, no shuffles; ``PAIR=1``); other inputs (float32, strided, odd K) take a
generic ``[.., GB/2, 2]`` tile split on its last axis (``PAIR=2``). Per-tensor and NVFP4 first
reduce the tensor amax (partial-amax kernel, one-program reduction), then quantize, unless the
scale is static (``scale=``; NVFP4 ``global_scale=``): then x is read once. NVFP4's data
factor is a function of the block's UE4M3 code alone: ``_nvfp4_factors`` tabulates it per
tensor (127 codes, the order's own float32 divisions) and the data pass loads it. FP8 rows with
one scale per row longer than 4096 columns (per-token) take ``_row_loop_kernel`` (two sweeps
per row, the second from cache). Tiles and warps come from sweeps on an H200 and an H100; the
device-specific choices are in ``_tiles._DEVICE_TILES``. The knobs that change speed and never
results (register cap, E2M1 lane encode, FP4 word runs, the looped kernel's threshold and tile)
are an explicit argument, ``tuning=`` (:class:`QuantTuning`), which the benchmark's ``--tune``
sweeps. Measured speeds and their limits: docs/fastpaths.md; tuning history:
docs/performance.md.

Unsupported combinations (INT/FP6 elements, 2-D blocks, the ``signed_minmax`` and
``encode_decode_pair`` FP32 rules, groups wider than 32768) are refused by :func:`supports` with the
reason; :func:`quantize` raises ``ValueError`` with it. Nothing falls back silently.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeref._interop import triton_interpreted
from moeref.formats import get_format
from moeref.quant.scheme import Scheme

from . import _plan
from . import _preset_map as P
from . import _tiles as T
from ._launch import global_scale_supports  # noqa: F401 (public: the registry's supports)
from ._layouts import SCALE_LAYOUTS, scale_storage_shape
from ._tiles import QuantTuning

__all__ = [
    "SCALE_LAYOUTS",
    "FastQuantized",
    "QuantTuning",
    "supports",
    "quantize",
    "dequantize",
    "scale_storage_shape",
]

MAX_GROUP = 32768
_TENSOR = object()  # key of a tensor global_scale (checked per call)
_NO_KEY = object()  # an option no plan is kept for
_kind = _plan._kind


@dataclass(frozen=True)
class FastQuantized:
    """Output of :func:`quantize`: device tensors plus what is needed to read them.

    Attributes:
        codes: uint8 ``[..., M, K]`` (FP8) or ``[..., M, ceil(K/2)]`` (FP4, even element low).
        scales: the scale storage in ``scale_layout`` (see the module docstring); for per-tensor
            schemes ``[..., 1, 1]`` float32/uint8.
        scale_layout: one of :data:`SCALE_LAYOUTS`.
        scheme: the :class:`~moeref.quant.scheme.Scheme`.
        shape: logical shape of x.
        global_scale: float64 tensor ``[1]``: the NVFP4 decode factor exactly as the reference's
            ``QuantizedTensor.global_scale`` (``A/2688``, ``1/S_enc`` or torchao's ``pts``,
            computed in float64 from the float32 quantity of the preset's convention), or None.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    scale_layout: str
    scheme: Scheme
    shape: tuple
    global_scale: torch.Tensor | None = None

    @property
    def grid(self) -> tuple[int, ...]:
        """Logical scale grid shape (the reference's ``QuantizedTensor.scales.shape``)."""
        from moeref.quant.blockwise import grid_shape
        return grid_shape(self.shape, self.scheme.resolve_block(self.shape))

    def scales_logical(self) -> np.ndarray:
        """The scales as the reference's grid (NumPy), read back through moeref.layouts inverses."""
        from moeref._interop import to_numpy

        return self._logical(to_numpy(self.scales.cpu()))

    def _logical(self, s: np.ndarray) -> np.ndarray:
        """:meth:`scales_logical` of the host copy ``s`` of the scale storage."""
        from moeref import layouts

        g = self.grid
        if self.scale_layout == "row_major":
            return np.ascontiguousarray(s).reshape(g)
        mn, ng = g[-2], g[-1]
        if self.scale_layout == "mn_major":
            return layouts.from_mn_major_tma_aligned(s, mn=mn).reshape(g)
        if self.scale_layout == "packed_ue8m0":
            v = np.swapaxes(s, -1, -2)[..., :mn, :]
            return layouts.unpack_ue8m0(v, ng, as_codes=True).reshape(g)
        return layouts.unswizzle_128x4(s, mn, ng).reshape(g)

    def to_reference(self):
        """A :class:`moeref.quant.QuantizedTensor` with these codes and scales (host copies; from a CUDA device
        copied into page-locked memory, with one wait for the device)."""
        from moeref.quant import QuantizedTensor

        if self.codes.device.type == "cuda":  # one wait: the copies queued into page-locked memory first
            from moeref._interop import to_numpy

            codes = self.codes.to("cpu", non_blocking=True)
            scales = self.scales.to("cpu", non_blocking=True)
            g = None if self.global_scale is None else self.global_scale.reshape(-1)[:1].to("cpu", non_blocking=True)
            torch.cuda.current_stream(self.codes.device).synchronize()
            c = codes.numpy()
            c.setflags(write=False)  # nothing else holds this copy: the QuantizedTensor takes it as it is
            return QuantizedTensor(codes=c, scales=self._logical(to_numpy(scales)), scheme=self.scheme,
                                   shape=self.shape, global_scale=None if g is None else float(g[0]))
        gs = None
        if self.global_scale is not None:
            gs = float(self.global_scale.reshape(-1)[0].item())
        return QuantizedTensor(codes=self.codes.cpu().numpy(), scales=self.scales_logical(),
                               scheme=self.scheme, shape=self.shape, global_scale=gs)


_plan.FastQuantized = FastQuantized


def supports(scheme: Scheme | None = None, x=None, scale_layout: str = "row_major",
             tuning: QuantTuning | None = None, **_) -> tuple[bool, str]:
    """Whether :func:`quantize` can run ``scheme`` on ``x`` with ``scale_layout`` here, and why not.

    Checks the environment (a CUDA device, or TRITON_INTERPRET=1 for CPU tensors), the scheme
    (element, block shape, preset knobs) and the layout (packed UE8M0 needs UE8M0 scales; the
    swizzle needs 1-byte scales).
    """
    if x is not None and isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and not triton_interpreted():
            return False, "x is a CPU tensor and TRITON_INTERPRET=1 is not set (no GPU to run on)"
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False, f"x dtype {x.dtype} not supported (float32, bfloat16, float16)"
        if x.dim() < 1 or x.dim() > 3:
            return False, f"x must have 1 to 3 dims; got {x.dim()}"
    elif not torch.cuda.is_available() and not triton_interpreted():
        return False, "no CUDA device and TRITON_INTERPRET is not 1"
    if scheme is None:
        return True, "ok"
    if not isinstance(scheme, Scheme):
        return False, f"scheme must be a moeref Scheme; got {type(scheme).__name__}"
    if scale_layout not in SCALE_LAYOUTS:
        return False, f"scale_layout {scale_layout!r} is not one of {SCALE_LAYOUTS}"
    if scheme.element not in P.ELEMENTS:
        return False, (f"element {scheme.element!r} has no Triton kernel "
                       f"(supported: {', '.join(P.ELEMENTS)})")
    if scheme.family not in ("blockwise", "nvfp4"):
        return False, f"family {scheme.family!r} has no Triton kernel"
    if scheme.zero_point or scheme.channel_block:
        return False, "zero points / channel scales have no Triton kernel"
    kind = _kind(scheme)
    if kind is None:
        return False, f"block {scheme.block} has no Triton kernel (per-tensor, per-token and 1xG only)"
    p = scheme.preset
    if scheme.scale_format == "fp32" and p.fp32_rule not in P.FP32_RULES_RUN:
        return False, f"fp32_rule {p.fp32_rule!r} has no Triton kernel"
    if p.zero_block not in P.ZERO_BLOCKS_RUN:
        return False, f"zero_block {p.zero_block!r} has no Triton kernel"
    if p.element_max is not None and p.element_max != get_format(scheme.element).max_finite:
        return False, "element_max override has no Triton kernel"
    if scheme.family == "nvfp4":
        if scheme.scale_format != "ue4m3" or scheme.block[-1] != 16 or kind != "rows":
            return False, "NVFP4 kernel covers the 1x16 UE4M3 recipe only"
        if p.option("nvfp4_order") not in P.NVFP4_OP:
            return False, f"NVFP4 order {p.option('nvfp4_order')!r} has no Triton kernel"
    elif scheme.scale_format == "ue4m3":
        return False, "UE4M3 scales belong to the nvfp4 family"
    if scheme.element == "e2m1" and p.overflow != "saturate":
        pass  # E2M1 always saturates (the codec refuses inf_nan for it)
    if kind == "per_tensor" and scale_layout != "row_major":
        return False, "per-tensor scales have only the row_major layout"
    if scale_layout == "packed_ue8m0" and scheme.scale_format != "ue8m0":
        return False, "packed_ue8m0 needs UE8M0 scales"
    if scale_layout == "swizzled_128x4" and scheme.scale_format == "fp32":
        return False, "the 128x4 swizzle holds 1-byte scales (UE8M0/UE4M3), not FP32"
    if x is not None:
        K = int(x.shape[-1])
        gs = scheme.resolve_block(tuple(x.shape))[-1]
        if kind == "rows" and gs > MAX_GROUP and not T._row_loop_applies(
                -(-K // gs), gs, K, scheme.element == "e2m1", scale_layout,
                tuning or T.DEFAULT_TUNING):
            return False, (f"group of {gs} elements exceeds the tile kernel's limit {MAX_GROUP} "
                           "(only one FP8 scale per row, row_major/mn_major, has a looped kernel)")
        if scheme.element == "e2m1" and gs % 2 and gs < K:
            return False, "FP4 groups of odd size are not supported"
        if scheme.element == "e2m1" and kind == "per_tensor" and K % 2:
            return False, "per-tensor FP4 with odd K is not supported"
        if kind == "per_tensor" and scheme.static_scale is None and x.dim() < 1:
            return False, "per-tensor needs at least one axis"
    return True, "ok"


def quantize(x: torch.Tensor, scheme: Scheme, *, scale_layout: str = "row_major", scale=None,
             hw_fp8: bool | None = None, block_m: int | None = None, groups_per_program: int | None = None,
             num_warps: int | None = None, global_scale=None, amax=None,
             tuning: QuantTuning | None = None) -> FastQuantized:
    """Quantize ``x`` (CUDA tensor, or CPU under TRITON_INTERPRET=1) with ``scheme``.

    Args:
        x: float32/bfloat16/float16 ``[K]``, ``[M, K]`` or ``[B, M, K]``, any strides.
        scheme: a :mod:`moeref.quant` scheme (FP8 per-tensor/per-token/1xG, MXFP8, MXFP4, NVFP4).
        scale_layout: where the scales go (:data:`SCALE_LAYOUTS`).
        scale: static per-tensor decode scale (overrides ``scheme.static_scale``).
        global_scale: NVFP4 only (ValueError for other families): a static per-tensor quantity
            in the scheme's convention, as :func:`moeref.quant.nvfp4.quantize_nvfp4` takes it
            (``amax``; ``encode_scale`` S_enc = 2688 / amax, e.g. vLLM's ``a1_gscale`` for
            ``scaled_fp4_quant(x, input_global_scale)``; ``decode_scale``). A real number is
            validated like the reference (TypeError / ValueError, with the reason, where it
            raises); a one-element float32 tensor holds the float32 quantity: on the CPU it is
            validated the same way, on x's device it is used as is, with no host sync (it must be
            positive and give a finite nonzero encode/decode scale; nothing checks it). The
            data pass is then the only pass over x (None: dynamic, the tensor amax is reduced in
            a first pass). Codes, scales and ``global_scale`` equal the reference's.
        amax: per-tensor FP8 and dynamic NVFP4 only (ValueError otherwise): the tensor amax of
            ``x`` as the amax pass would reduce it (float32 ``|x|`` max under the scheme's NaN
            policy; per-tensor: one per matrix, shape ``[B]``; NVFP4: ``[1]``), already on x's
            device, e.g. from the kernel that produced ``x``
            (:func:`fastpath.fused.silu_and_mul` with ``amax_for=scheme``): then x is read once
            (no amax pass). Used as given, no host sync; nothing checks it against x.
        hw_fp8: use the hardware FP8 cast on CUDA (default: yes on CUDA for saturating RNE presets).
        block_m, groups_per_program, num_warps: tile overrides (benchmarks).
        tuning: the kernels' speed knobs (:class:`QuantTuning`; None: the shipped defaults).

    Returns:
        :class:`FastQuantized`; ``.to_reference()`` gives the :class:`moeref.quant.QuantizedTensor`.
    """
    try:  # the plan's key (fastpath.quant._plan): ids of the scheme and tuning, which the plan keeps
        gkey = global_scale if _plan.plain(global_scale) else \
            (_TENSOR if isinstance(global_scale, torch.Tensor) else _NO_KEY)
        key = (id(scheme), scale_layout, scale, hw_fp8, block_m, groups_per_program, num_warps, gkey,
               id(tuning), x.dtype, x.shape, x.stride(), x.data_ptr() & 15, x.device)
        plan = _plan._PLANS.get(key)
        if plan is not None:
            return plan(x, amax, global_scale)
        if gkey is _NO_KEY or not _plan.plain(scale):
            key = None
    except (AttributeError, TypeError):  # not a tensor, unhashable options: validated below
        key = None
    if tuning is not None and not isinstance(tuning, QuantTuning):
        raise TypeError(f"tuning must be a fastpath.quant.QuantTuning or None; got {type(tuning).__name__}")
    ok, why = supports(scheme, x, scale_layout, tuning or T.DEFAULT_TUNING)
    if not ok:
        raise ValueError(f"fastpath.quant.quantize cannot run {getattr(scheme, 'name', scheme)!r}: {why}")
    plan = _plan.QuantPlan(x, scheme, scale_layout, scale, hw_fp8, block_m, groups_per_program, num_warps,
                           global_scale, tuning or T.DEFAULT_TUNING)
    plan.tuning = tuning  # kept: the key holds its id
    return _plan.keep(key, plan, x.device)(x, amax, global_scale)


_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dequantize(q: FastQuantized, dtype: torch.dtype = torch.float32, *, block_m: int | None = None,
               groups_per_program: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``decode(codes) * scale`` (x global factor), rounded ONCE to ``dtype`` (float32, bfloat16,
    float16), like :meth:`moeref.quant.QuantizedTensor.dequantize`: the product is formed exactly
    as a float32 pair (hi, lo) and rounded with integer RNE. Exact wherever the float32 partial
    products stay normal (|value| >= 2^-100 or so; a subnormal product may round twice).
    ``block_m``, ``groups_per_program``, ``num_warps``: tile overrides (benchmarks)."""
    if dtype not in _OUT:
        raise ValueError(f"dtype must be float32, bfloat16 or float16; got {dtype}")
    c, s = q.codes, q.scales
    key = ("dequantize", id(q.scheme), q.shape, q.scale_layout, q.global_scale is None, dtype, block_m,
           groups_per_program, num_warps, c.dtype, c.shape, c.stride(), c.data_ptr() & 15, c.device,
           s.dtype, s.shape, s.stride(), s.data_ptr() & 15)
    plan = _plan._PLANS.get(key)
    if plan is None:
        plan = _plan.DequantPlan(q, dtype, block_m, groups_per_program, num_warps)
        plan.scheme = q.scheme  # kept: the key holds its id
        _plan.keep(key, plan, c.device)
    return plan(q)


# ============================================================================ DeepGEMM adapter


def deep_gemm_supports(scheme: Scheme | None = None, x=None, scale_layout: str = "row_major", **_) -> tuple[bool, str]:
    """Whether DeepGEMM's own quantizer (``deep_gemm.utils.per_token_cast_to_fp8``) can produce
    ``scheme``: DeepGEMM installed, a CUDA tensor, FP8 E4M3 1xG with the ``deepgemm`` preset."""
    try:
        import deep_gemm  # noqa: F401
    except Exception as e:  # ImportError, or a broken build
        return False, f"deep_gemm is not importable ({type(e).__name__}: {e})"
    if x is not None and (not isinstance(x, torch.Tensor) or x.device.type != "cuda" or x.dim() != 2):
        return False, "deep_gemm's quantizer takes a 2-D CUDA tensor"
    if scheme is None:
        return True, "ok"
    if scheme.element != "e4m3fn" or scheme.family != "blockwise" or len(scheme.block) != 2 \
            or scheme.block[0] != 1 or scheme.block[1] is None:
        return False, "deep_gemm's per_token_cast_to_fp8 produces E4M3 1xG groups only"
    if scheme.preset.name != "deepgemm":
        return False, f"deep_gemm computes the 'deepgemm' preset, not {scheme.preset.name!r}"
    if scale_layout not in ("row_major", "mn_major", "packed_ue8m0"):
        return False, f"scale_layout {scale_layout!r} is not produced by deep_gemm"
    if scale_layout == "packed_ue8m0" and scheme.scale_format != "ue8m0":
        return False, "packed_ue8m0 needs UE8M0 scales"
    return True, "ok"


def deep_gemm_quantize(x: torch.Tensor, scheme: Scheme, *, scale_layout: str = "row_major") -> FastQuantized:
    """DeepGEMM's torch quantizer (``per_token_cast_to_fp8``, then ``get_mn_major_tma_aligned_tensor``
    or ``get_mn_major_tma_aligned_packed_ue8m0_tensor``) wrapped as a :class:`FastQuantized`.

    Used to cross-check the Triton kernels on the GPU and as a speed baseline. The storage of
    mn_major / packed layouts is DeepGEMM's (its MN padding is not written: ``torch.empty_strided``)."""
    ok, why = deep_gemm_supports(scheme, x, scale_layout)
    if not ok:
        raise ValueError(f"deep_gemm quantize cannot run: {why}")
    import deep_gemm

    gs = scheme.block[1]
    ue8m0 = scheme.scale_format == "ue8m0"
    q, sf = deep_gemm.utils.per_token_cast_to_fp8(x, use_ue8m0=ue8m0, gran_k=gs)
    codes = q.view(torch.uint8)
    if scale_layout == "row_major":
        scales = sf if not ue8m0 else ((sf.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    elif scale_layout == "mn_major":
        if ue8m0:
            raise ValueError("deep_gemm's MN-major FP32 layout holds FP32 scales; use packed_ue8m0")
        v = deep_gemm.utils.get_mn_major_tma_aligned_tensor(sf)
        scales = torch.as_strided(v, (v.shape[1], v.stride(1)), (v.stride(1), 1))
    else:
        v = deep_gemm.utils.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
        scales = torch.as_strided(v, (v.shape[1], v.stride(1)), (v.stride(1), 1))
    return FastQuantized(codes, scales, scale_layout, scheme, tuple(x.shape))
