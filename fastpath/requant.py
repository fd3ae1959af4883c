"""Fused FP8-block decode + FP4 quantize on the GPU: one checkpoint weight, source bytes to target bytes.

:func:`fp8_block_to_fp4` converts an FP8 E4M3 weight with 2-D block scales (DeepSeek-V3's
``weight`` + ``weight_scale_inv`` 128x128 FP32 multipliers, their UE8M0 variant, the
compressed-tensors FP8 block layout) into NVFP4 (1x16, UE4M3 scales, per-tensor global) or
MXFP4 (1x32, UE8M0) codes and scales, bit-identical to the reference path
``moeref.quant.quantize(q.dequantize(np.float32), target)`` (``requantize(..., precision="float32")``):

* the source value is ``fl32(decode(code) * scale)``: the E4M3 decode is exact (integer fields,
  :func:`fastpath._triton_rounding.decode_minifloat`), the product one float32 RNE rounding, as
  NumPy's float32 dequantization (and vLLM's ``weight.float() * scale``) does. The kernels are
  compiled with ``enable_fp_fusion=False``, so that product is never contracted into a later
  add (an FMA would round once for both and change the values);
* the target's rules are :mod:`fastpath.quant`'s own Triton helpers (block amax, the scale
  rules of every preset, the scale layouts including the 128x4 swizzle, the E2M1 encode), so
  this module adds only the source decode in front of them;
* NVFP4's per-tensor global comes from a first pass over the FP8 codes (the amax of the decoded
  values, NaN policy as the preset's) whose last program runs :mod:`fastpath.quant`'s factor
  kernel body, or from a static ``global_scale`` (fused gate/up groups), as
  ``fastpath.quant.quantize`` takes it. On a GPU of compute capability >= 9.0 the amax and
  data kernels are launched with Programmatic Dependent Launch (:class:`RequantTuning`
  ``pdl``): each starts while the kernel before it runs and waits for it
  (``griddepcontrol.wait``) only where it needs that kernel's results, so the launch gaps
  between the zeroing, the amax and the data kernel are hidden and the data kernel's programs
  load their tiles while the amax kernel runs. ``RequantTuning(method="persistent")`` runs the
  amax and data phases in one persistent launch with a grid-wide barrier instead
  (:mod:`fastpath._requant_persistent`; not the default, see there);
* on a GPU the data pass decodes the codes two at a time with the hardware convert
  (``cvt.rn.f16x2.e4m3x2``, exact), which halves its instruction count (the kernel was
  issue-bound at about 32 SASS instructions per element, 16-17 after); the interpreter keeps
  the integer decode.

Why a fused kernel: the unfused path decodes to float32 (4 bytes per element written and read
again) before the quantizer reads it: 9 bytes moved per element against the 1.56 the conversion
needs (1-byte code in; half a byte of FP4 and 1/16 byte of scale out), so it cannot exceed about
17% of copy bandwidth even with every pass at the memory limit. Here the data pass reads the
FP8 codes once and writes the target once; NVFP4's amax pass reads the codes a second time.

Tiles: a program covers ``BLOCK_M`` rows by ``GPP`` target groups inside ONE source block, so
the source scale is one scalar load per program; :func:`supports` refuses block shapes where no
such tile exists (with the reason); :class:`RequantTuning` overrides the tiles (what
``bench/bench_convert.py --sweep`` measures). Measured speed: docs/convert.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from moeref._interop import triton_interpreted
from moeref.quant.scheme import Scheme

from . import _triton_rounding as R
from . import quant as FQ
from ._host import alloc, pdl_available
from ._requant_tiles import _block_scale, _data_tile, _e4m3_times
from .quant import _kernels as KN
from .quant import _launch as L
from .quant import _layouts as LY
from .quant import _preset_map as P

__all__ = ["supports", "fp8_block_to_fp4", "RequantTuning", "SCALE_LAYOUTS"]

SCALE_LAYOUTS = ("row_major", "swizzled_128x4")
# Default tiles, from `bench/bench_convert.py --sweep` on an H100 (docs/convert.md): the data
# pass takes 64 target groups per program on one warp per 1024 elements (32 elements per
# thread: NVFP4 8 rows x 8 groups on 1 warp, MXFP4 16 x 4 on 2); the amax pass a tile of up to
# _AMAX_ELEMS codes inside one source block, _AMAX_STACK of them stacked along rows where one
# fills a source block (DeepSeek-V3's 128 x 128: 256 x 128 per program, on 8 warps).
_TILE_GROUPS = 64
_ELEMS_PER_WARP = 1024
_AMAX_ELEMS = 16384
_AMAX_STACK = 2
_PERSISTENT_AMAX_ELEMS = 4096  # the persistent kernel's amax tile: 32 x 128 on its one warp


@triton.jit
def _fp8_block_amax_kernel(c_ptr, stride_cm, s_ptr, stride_sm, p_ptr, nv_ptr, glob_ptr, M, K,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SBM: tl.constexpr,
                           SBK: tl.constexpr, NONFINITE: tl.constexpr, ORDER: tl.constexpr,
                           GLOB: tl.constexpr, PDL_TRIGGER: tl.constexpr,
                           PDL_WAIT: tl.constexpr):
    """The tensor amax and, in the program that finishes last, NVFP4's tensor factors.

    ``p`` (int32[2], zeroed by the caller): ``p[0]`` the amax as float32 bits, ``p[1]`` a count
    of finished programs. Each program takes the amax of one [BLOCK_M, BLOCK_K] tile inside one
    source block, or of BLOCK_M // SBM source blocks stacked along rows (the maximum of each
    block's amax, computed as below, NaN policy applied to each before the maximum: fewer
    programs, so fewer atomics on the two words, which serialize at one L2 address)
    and folds it in with an integer atomic max (non-negative float32 bits order like
    the floats; NaN sorts above Inf, so it propagates, unless NONFINITE is 1 ignores it, as
    :mod:`fastpath.quant`'s amax pass does). One scale per tile and ``x -> |fl32(x * s)|``
    monotone in ``|x|`` (RNE is symmetric), so the tile's amax is the product of its largest code
    magnitude (E4M3 magnitudes order like their 7 bits; 0x7F, the NaN, sorts last) with the
    scale: the same value, and the same NaN, as the maximum over the decoded elements (an
    infinite scale, whose zeros decode to NaN, has no meaning in these layouts).

    Then each program counts itself in ``p[1]`` (acquire-release, after its max); the one that
    counts last has seen every program's max and runs :func:`fastpath.quant._kernels.
    _nvfp4_factors` on ``p[0]`` (``nv`` and ``glob`` as that kernel writes them): one launch
    instead of two, the factors computed once per tensor as before.

    PDL_TRIGGER: let the dependent data kernel launch at once (``griddepcontrol.
    launch_dependents``; it waits for this whole grid itself, so where the trigger sits is a
    matter of speed only). PDL_WAIT (this kernel launched dependent on the zeroing kernel):
    ``griddepcontrol.wait`` before the first atomic on ``p``."""
    if PDL_TRIGGER:  # the data kernel may launch now (it waits for this grid's end itself)
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows < M)[:, None] & (kk < K)[None, :]
    c = tl.load(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + kk[None, :], mask=m, other=0)
    mag = c.to(tl.uint32) & 0x7F
    if NONFINITE == 1:
        mag = tl.where(mag == 0x7F, 0, mag)
    if BLOCK_M <= SBM:  # inside one source block: one scale
        top = tl.max(tl.max(mag, axis=1), axis=0)
        s = _block_scale(s_ptr, stride_sm, pid_m * BLOCK_M, pid_k * BLOCK_K, M, K, SBM, SBK)
        a = R.f32_bits(_e4m3_times(top, s)) & 0x7FFFFFFF
        if NONFINITE == 1:
            a = tl.where(a > 0x7F800000, 0, a)
    else:  # BLOCK_M // SBM source blocks stacked along rows: the largest code and scale of each
        top = tl.max(tl.reshape(tl.max(mag, axis=1), (BLOCK_M // SBM, SBM)), axis=1)
        r0 = pid_m * BLOCK_M + tl.arange(0, BLOCK_M // SBM) * SBM
        s = tl.load(s_ptr + (r0 // SBM) * stride_sm + (pid_k * BLOCK_K) // SBK,
                    mask=(r0 < M) & (pid_k * BLOCK_K < K), other=0.0)
        a = R.f32_bits(_e4m3_times(top, s)) & 0x7FFFFFFF
        if NONFINITE == 1:
            a = tl.where(a > 0x7F800000, 0, a)
        a = tl.max(a, axis=0)
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    tl.atomic_max(p_ptr, a.to(tl.int32, bitcast=True), sem="release")
    done = tl.atomic_add(p_ptr + 1, 1, sem="acq_rel")
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.debug_barrier()  # the whole program reads after the counting thread's acquire
        KN._nvfp4_factors(p_ptr.to(tl.pointer_type(tl.float32), bitcast=True), p_ptr, nv_ptr,
                          glob_ptr, 0, True, ORDER, GLOB, 0)


@triton.jit
def _fp8_block_to_fp4_kernel(
    w_ptr, stride_wm, s_ptr, stride_sm, q_ptr, stride_qm,
    o_ptr, stride_om, stride_og, dummy_ptr, nv_ptr,
    M, K, NG, M_PAD, NG_PAD,
    SBM: tl.constexpr, SBK: tl.constexpr,
    GS: tl.constexpr, GB: tl.constexpr, GPP: tl.constexpr, BLOCK_M: tl.constexpr,
    ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
    SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr, FP32_POW2: tl.constexpr,
    E8_RULE: tl.constexpr, E8_LO: tl.constexpr, E8_HI: tl.constexpr, E8_NF: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, ZERO_BLOCK: tl.constexpr, NONFINITE: tl.constexpr,
    APPLY: tl.constexpr, SATURATE: tl.constexpr, ROUND: tl.constexpr,
    DROP_NEG_ZERO: tl.constexpr, NAN_CODE: tl.constexpr, FILL_CODE: tl.constexpr,
    SF_LAYOUT: tl.constexpr, TWO_LEVEL: tl.constexpr, NV_ORDER: tl.constexpr,
    DIV: tl.constexpr, E2M1_PTX: tl.constexpr, HW_SCALE: tl.constexpr, HW_DECODE: tl.constexpr,
    GDC_WAIT: tl.constexpr,
):
    """One data tile per program (:func:`_data_tile`), program ids (row tile, group tile)."""
    _data_tile(w_ptr, stride_wm, s_ptr, stride_sm, q_ptr, stride_qm, o_ptr, stride_om, stride_og,
               dummy_ptr, nv_ptr, M, K, NG, M_PAD, NG_PAD, tl.program_id(0), tl.program_id(1),
               SBM, SBK, GS, GB, GPP, BLOCK_M, ELEM_MAX, INV_M, EMAX, MBITS,
               SCALE_KIND, FP32_RULE, FP32_POW2, E8_RULE, E8_LO, E8_HI, E8_NF,
               AMAX_FLOOR, ZERO_BLOCK, NONFINITE, APPLY, SATURATE, ROUND,
               DROP_NEG_ZERO, NAN_CODE, FILL_CODE, SF_LAYOUT, TWO_LEVEL, NV_ORDER,
               DIV, E2M1_PTX, HW_SCALE, HW_DECODE, GDC_WAIT)


def _hw_decode(dev: torch.device) -> bool:
    """Whether the data pass decodes E4M3 pairs with the hardware convert (a CUDA device, not
    Triton's interpreter)."""
    return dev.type == "cuda" and not P._INTERPRETED


def _pdl_available(dev: torch.device) -> bool:
    """Whether Programmatic Dependent Launch runs here: :func:`fastpath._host.pdl_available` (the tests swap
    this name)."""
    return pdl_available(dev)


# With PDL, the amax kernel too is launched dependent on the kernel before it, the zeroing of its
# words (``torch.zeros``, launched normally: it starts only when all earlier work on the stream
# is complete, so the codes and scales the amax kernel reads before its wait are final); it
# waits before its first atomic. The bench's sweep turns it off ("pdl, amax kernel in turn").
_PDL_AMAX = True


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing ``n``, at most ``cap``."""
    return min(n & -n, cap)


METHODS = ("two_kernel", "persistent")


def _is_int(v, lo: int = 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


@dataclass(frozen=True)
class RequantTuning:
    """Tiles and launch method of :func:`fp8_block_to_fp4` (speed only: none changes a code, a
    scale or the global; the tests run several against the reference). ``None``: the default
    plan (:func:`_plan`); tile values powers of two; a tile must lie inside one source block.

    Attributes:
        block_m: rows per data tile.
        groups_per_program: target groups (1 x 16 NVFP4, 1 x 32 MXFP4) per data tile.
        num_warps: warps per program of the data pass (and of the persistent kernel).
        amax_block_m, amax_block_k: the NVFP4 amax tile (default for 128 x 128 source blocks:
            256 x 128 for the amax kernel, 32 x 128 for the persistent kernel's amax phase). The
            amax kernel's rows may also be a multiple of the source block's (blocks stacked).
        amax_warps: warps per program of the amax kernel (None: one per 4096 codes, at least 8).
        method: ``"two_kernel"`` (the default): NVFP4's amax kernel, then the data kernel, one
            tile per program; ``"persistent"``: :mod:`fastpath._requant_persistent`, one
            cooperative launch of co-resident programs with a grid-wide barrier between the
            amax and the data phase (under Triton's interpreter its two phases as two
            launches); not the default: its first version measured slower (docs/convert.md).
        programs: programs of a persistent launch (each takes tiles ``pid, pid + programs,
            ...``); None: the fewest with the trips per program of the co-resident count (SMs
            x the compiled kernel's occupancy); more than that count is refused. Under the
            interpreter, None: one program per tile.
        slots: counters (and barrier flags) the persistent amax phase spreads its programs over.
        poll_sleep_ns: ``nanosleep`` between two polls of the persistent barrier's flag (0: none).
        pdl: the ``two_kernel`` method's NVFP4 amax pass (MXFP4 and a static global have no
            amax pass, so one kernel and nothing to overlap): the data kernel launched with
            Programmatic Dependent Launch (``launch_pdl``) after an amax kernel that lets it
            launch at once (``griddepcontrol.launch_dependents``), so that its programs load
            and decode their tile while the amax kernel runs and wait (``griddepcontrol.wait``:
            the amax grid complete, its writes visible) only before reading the global
            factors; the amax kernel likewise after the zeroing (:data:`_PDL_AMAX`). Both read
            only the conversion's inputs before their wait, which were final before the
            zeroing (``torch.zeros``, launched normally) started; every write follows the
            wait. None: where :func:`_pdl_available` (a CUDA GPU of compute capability >= 9.0,
            not the interpreter); True: required (refused where not available, and with
            ``method="persistent"``); False: the kernels one after the other.
    """

    block_m: int | None = None
    groups_per_program: int | None = None
    num_warps: int | None = None
    amax_block_m: int | None = None
    amax_block_k: int | None = None
    amax_warps: int | None = None
    method: str = "two_kernel"
    programs: int | None = None
    slots: int = 64
    poll_sleep_ns: int = 100
    pdl: bool | None = None

    def __post_init__(self):
        for f in ("block_m", "groups_per_program", "num_warps", "amax_block_m", "amax_block_k",
                  "amax_warps", "slots"):
            v = getattr(self, f)
            if v is not None and not (_is_int(v) and v & (v - 1) == 0):
                raise ValueError(f"RequantTuning.{f} must be None or a power of two; got {v!r}")
        if self.method not in METHODS:
            raise ValueError(f"RequantTuning.method must be one of {METHODS}; got {self.method!r}")
        if self.programs is not None and not _is_int(self.programs):
            raise ValueError(f"RequantTuning.programs must be None or a positive int; got "
                             f"{self.programs!r}")
        if not (self.pdl is None or isinstance(self.pdl, bool)):
            raise ValueError(f"RequantTuning.pdl must be None, True or False; got {self.pdl!r}")
        if self.pdl and self.method == "persistent":
            raise ValueError("RequantTuning.pdl is the two_kernel method's; the persistent "
                             "method is one launch")
        if not (_is_int(self.poll_sleep_ns, 0) and self.poll_sleep_ns < 1 << 20):
            raise ValueError(f"RequantTuning.poll_sleep_ns must be an int in [0, 2**20); got "
                             f"{self.poll_sleep_ns!r}")


DEFAULT_TUNING = RequantTuning()


def _plan(shape, src_block, target: Scheme, tuning: RequantTuning = DEFAULT_TUNING):
    """(GS, GPP, BLOCK_M, BMa, BKa) or a str saying why no tile fits."""
    sbm, sbk = (int(b) for b in src_block)
    gs = int(target.resolve_block(tuple(shape))[-1])
    if sbk % gs:
        return f"source block width {sbk} is not a multiple of the target group {gs}"
    gpp = tuning.groups_per_program or _pow2_divisor(sbk // gs, max(1, 512 // gs))
    bm = tuning.block_m or _pow2_divisor(sbm, max(1, _TILE_GROUPS // gpp))
    if tuning.method == "persistent":
        bka = tuning.amax_block_k or _pow2_divisor(sbk, gs * gpp)
        bma = tuning.amax_block_m or _pow2_divisor(sbm, max(1, _PERSISTENT_AMAX_ELEMS // bka))
    else:
        bka = tuning.amax_block_k or _pow2_divisor(sbk, 1024)
        bma = _pow2_divisor(sbm, max(1, _AMAX_ELEMS // bka))
        bma = tuning.amax_block_m or (bma * _AMAX_STACK if bma == sbm else bma)
    stacked = tuning.method == "two_kernel" and bma > sbm and bma % sbm == 0  # amax kernel only
    if sbm % bm or sbk % (gs * gpp) or (sbm % bma and not stacked) or sbk % bka:
        return (f"tile {tuning} does not lie inside one {sbm} x {sbk} source block "
                f"(data {bm} x {gs * gpp}, amax {bma} x {bka}; the two_kernel amax tile may "
                f"also stack whole source blocks along rows)")
    return gs, gpp, bm, bma, bka


def _data_warps(gs: int, gpp: int, bm: int) -> int:
    """Default warps of the data pass: one per :data:`_ELEMS_PER_WARP` elements of the tile."""
    return max(1, gs * gpp * bm // _ELEMS_PER_WARP)


def supports(src_scheme: Scheme | None = None, target: Scheme | None = None, shape=None,
             src_block=None, scale_layout: str = "row_major", device=None) -> tuple[bool, str]:
    """Whether :func:`fp8_block_to_fp4` converts this source into ``target`` here, and why not.

    The source: E4M3 elements with 2-D block scales (FP32 or UE8M0 values), a 2-D tensor; the
    target: what :func:`fastpath.quant.supports` accepts among the FP4 schemes (NVFP4 1x16,
    MXFP4 1x32), with the target group dividing the source block width."""
    if device is not None and torch.device(device).type == "cpu":
        if not triton_interpreted():
            return False, "a CPU device needs TRITON_INTERPRET=1"
    if src_scheme is not None:
        if src_scheme.element != "e4m3fn" or src_scheme.family != "blockwise":
            return False, f"source {src_scheme.name!r} is not an FP8 E4M3 block-scaled scheme"
        if src_scheme.zero_point or src_scheme.channel_block:
            return False, "source has zero points / channel scales"
    if src_block is not None and (len(src_block) != 2 or any(b is None for b in src_block)):
        return False, f"source block {src_block} is not a 2-D block"
    if shape is not None and len(shape) != 2:
        return False, f"the fused kernel takes 2-D weights; got shape {tuple(shape)}"
    if shape is not None and shape[-1] % 2:
        return False, f"the fused kernel reads element pairs: K must be even; got {shape[-1]}"
    if scale_layout not in SCALE_LAYOUTS:
        return False, f"scale_layout {scale_layout!r} is not one of {SCALE_LAYOUTS}"
    if target is None:
        return True, "ok"
    if target.element != "e2m1":
        return False, f"target {target.name!r} is not an FP4 (E2M1) scheme"
    ok, why = FQ.supports(target, None, scale_layout)
    if not ok:
        return False, why
    if FQ._kind(target) != "rows":
        return False, f"target block {target.block} is not 1xG groups"
    if shape is not None and src_block is not None:
        plan = _plan(shape, src_block, target)
        if isinstance(plan, str):
            return False, plan
    return True, "ok"


def fp8_block_to_fp4(codes: torch.Tensor, scales: torch.Tensor, src_block, target: Scheme, *,
                     scale_layout: str = "row_major", global_scale=None,
                     tuning: RequantTuning | None = None) -> FQ.FastQuantized:
    """Convert an FP8 block-scaled weight into ``target`` (NVFP4 / MXFP4) on ``codes.device``.

    Args:
        codes: uint8 (or ``float8_e4m3fn``) ``[M, K]`` E4M3 codes, rows contiguous.
        scales: float32 ``[ceil(M/bm), ceil(K/bk)]`` block scale VALUES (multipliers; UE8M0
            sources as their float32 powers of two), on the same device.
        src_block: ``(bm, bk)``.
        target: an FP4 :class:`~moeref.quant.scheme.Scheme` (:func:`supports`).
        scale_layout: ``"row_major"`` (the reference grid) or ``"swizzled_128x4"``.
        global_scale: NVFP4 only: a static global in the preset's convention (number or
            one-element float32 tensor), as :func:`fastpath.quant.quantize` takes it.
        tuning: :class:`RequantTuning` tiles (None: the defaults).

    Returns:
        :class:`fastpath.quant.FastQuantized` (``.to_reference()``: a ``QuantizedTensor``
        equal, codes, scales and global, to ``quantize(dequantize(float32), target)``).
    """
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    shape = tuple(int(d) for d in codes.shape)
    ok, why = supports(None, target, shape, src_block, scale_layout, codes.device)
    if not ok:
        raise ValueError(f"fp8_block_to_fp4 cannot convert into {target.name!r}: {why}")
    if codes.dtype != torch.uint8 or codes.stride(-1) != 1 or codes.stride(0) % 2 \
            or codes.data_ptr() % 2:
        raise ValueError(f"codes must be uint8 / float8_e4m3fn with contiguous rows, an even row "
                         f"stride and 2-byte alignment; got {codes.dtype}, strides "
                         f"{tuple(codes.stride())}")
    M, K = shape
    sbm, sbk = (int(b) for b in src_block)
    grid_shape = (-(-M // sbm), -(-K // sbk))
    if tuple(scales.shape) != grid_shape or scales.dtype != torch.float32 \
            or scales.device != codes.device:
        raise ValueError(f"scales must be float32 {grid_shape} on {codes.device}; got "
                         f"{scales.dtype} {tuple(scales.shape)} on {scales.device}")
    scales = scales.contiguous()
    dev = codes.device
    tuning = DEFAULT_TUNING if tuning is None else tuning
    plan = _plan(shape, src_block, target, tuning)
    if isinstance(plan, str):
        raise ValueError(f"fp8_block_to_fp4: {plan}")
    gs, gpp, bm, bma, bka = plan
    ce = P.constexprs(target, dev.type == "cuda")
    ng = -(-K // gs)
    sshape, sdt, (m_pad, ng_pad, ssm, ssg) = LY.scale_storage_shape((1, M, K), target, scale_layout)
    out_scales = alloc(sshape, dtype=sdt, device=dev)
    out_codes = alloc((M, (K + 1) // 2), dtype=torch.uint8, device=dev)
    dummy = alloc(1, dtype=torch.float32, device=dev)
    two_level = target.family == "nvfp4"
    order = P.NVFP4_OP[target.preset.option("nvfp4_order")] if two_level else 0
    persistent = tuning.method == "persistent"
    if tuning.pdl and not _pdl_available(dev):
        raise ValueError(f"RequantTuning(pdl=True) needs a CUDA GPU of compute capability >= 9.0 "
                         f"outside Triton's interpreter; here: {dev}")
    nv, glob, bits, amax_phase, pdl = dummy, None, dummy, False, False
    if two_level and global_scale is not None:
        nv, glob, zero = L._nvfp4_static_factors(global_scale, target, dev)
        if zero:
            raise ValueError("a static NVFP4 amax that is 0 in float32 (an all-zero tensor) has "
                             "no fused path: use fastpath.quant.quantize")
    elif two_level:
        amax_phase = True
        # the amax kernel: amax bits, count; the persistent kernel: counters and barrier flags,
        # one per 128-byte line (fastpath._requant_persistent)
        bits = torch.zeros(32 * (1 + 2 * tuning.slots) if persistent else 2, dtype=torch.int32,
                           device=dev)
        nv = alloc(130, dtype=torch.float32, device=dev)
        glob = alloc(1, dtype=torch.float64, device=dev)
        if not persistent:
            pdl = _pdl_available(dev) if tuning.pdl is None else tuning.pdl
            grid_a = (triton.cdiv(M, bma), triton.cdiv(K, bka))
            xa = {"launch_pdl": True} if pdl and _PDL_AMAX else {}
            _fp8_block_amax_kernel[grid_a](codes, codes.stride(0), scales, scales.stride(0), bits,
                                           nv, glob, M, K, BLOCK_M=bma, BLOCK_K=bka, SBM=sbm,
                                           SBK=sbk, NONFINITE=ce["NONFINITE"], ORDER=order,
                                           GLOB=L._nvfp4_glob_kind(target, True),
                                           PDL_TRIGGER=pdl, PDL_WAIT=pdl and _PDL_AMAX,
                                           num_warps=tuning.amax_warps or max(8, bma * bka // 4096),
                                           enable_fp_fusion=False,
                                           **xa)
    elif global_scale is not None:
        raise ValueError(f"global_scale is the NVFP4 per-tensor factor; {target.name!r} is "
                         f"{target.family!r}")
    knobs = L._launch_knobs(ce, max(2, gs), gpp, bm, tuning.num_warps or _data_warps(gs, gpp, bm))
    names = set(_fp8_block_to_fp4_kernel.arg_names)
    words = codes.view(torch.int16)  # element pairs (the even one in the low byte)
    kw = dict(SBM=sbm, SBK=sbk, GS=gs, GB=max(2, gs), GPP=gpp, BLOCK_M=bm,
              SF_LAYOUT=LY.SF_LAYOUT[scale_layout], TWO_LEVEL=two_level, NV_ORDER=order,
              HW_DECODE=_hw_decode(dev), num_warps=knobs["num_warps"], enable_fp_fusion=False,
              **{k_: v_ for k_, v_ in knobs.items() if k_ in names})
    if persistent:
        from . import _requant_persistent as RP

        args = (codes, codes.stride(0), words, words.stride(0), scales, scales.stride(0),
                out_codes, out_codes.stride(0), out_scales, ssm, ssg, dummy, bits, bits, nv,
                glob if amax_phase else dummy, M, K, ng, m_pad, ng_pad)
        kw.update(BMA=bma, BKA=bka, GLOB=L._nvfp4_glob_kind(target, True) if two_level else 0,
                  NSLOT=tuning.slots, NFLAG=tuning.slots, LINE=RP.LINE,
                  SLEEP_NS=tuning.poll_sleep_ns)
        RP.launch(args, kw, -(-M // bma) * -(-K // bka), -(-m_pad // bm) * -(-ng_pad // gpp),
                  amax_phase, tuning, dev)
    else:
        grid = (triton.cdiv(m_pad, bm), triton.cdiv(ng_pad, gpp))
        if pdl:
            kw["launch_pdl"] = True
        _fp8_block_to_fp4_kernel[grid](
            words, words.stride(0), scales, scales.stride(0), out_codes, out_codes.stride(0),
            out_scales, ssm, ssg, dummy, nv, M, K, ng, m_pad, ng_pad, GDC_WAIT=pdl, **kw)
    out_scales = out_scales.reshape(LY.returned_scales_shape(shape, target, scale_layout, sshape))
    return FQ.FastQuantized(out_codes, out_scales, scale_layout, target, shape,
                            global_scale=glob if two_level else None)


def from_reference(q, device, codes=None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``(codes, scale values, block)`` of a reference FP8 block ``QuantizedTensor`` on ``device``
    (the arguments :func:`fp8_block_to_fp4` takes; the float32 scale values are exact: FP32
    scales as stored, UE8M0 ones as their powers of two). ``codes``: ``q.codes`` already on
    ``device`` (uint8), used instead of a copy."""
    if codes is None:
        codes = torch.from_numpy(np.array(q.codes, copy=True).view(np.uint8)).to(device)
    sv = np.ascontiguousarray(q.scale_values(), dtype=np.float64)
    s32 = sv.astype(np.float32)
    if not np.array_equal(s32.astype(np.float64), sv, equal_nan=True):
        raise ValueError("source scales are not float32 values")
    return codes, torch.from_numpy(s32).to(device), tuple(q.block_shape)
