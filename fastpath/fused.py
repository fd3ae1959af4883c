"""Gated activation + FP8 quantization in one kernel (``silu_and_mul`` / ``gelu_and_mul`` /
``swigluoai`` -> 1xG or per token; per tensor in two passes, the first for the tensor amax).

The MoE expert's first GEMM produces ``h[..., 2N]``; the second GEMM wants FP8 codes of
``act(h)[..., N]`` with per-token-group scales (DeepGEMM / vLLM 1x128). Fusing saves writing the
activation and reading it back: per row, 4N bytes of bf16 input are read and N code bytes plus
the scales written, instead of an extra 2N-byte write and 2N-byte read of the bf16 activation.
The kernel is :func:`fastpath.quant._kernels._quant_kernel` with ``ACT`` set: the tile loader
computes the activation in float32 (:func:`fastpath.quant._jit_codes._activation`) and
everything after is the group quantizer, so every preset/layout of
:func:`fastpath.quant.quantize` is available.

What is proven, and how (tests: ``property_tests/test_fastpath_quant.py``):

* The quantization is exact: ``fused(x)`` equals, bit for bit, the reference quantizer
  (:func:`moeref.quant.quantize`) applied to the float32 activation this module computes
  (:func:`silu_and_mul` / :func:`swigluoai`, the same device function in an unfused kernel).
* The activation is float32 arithmetic (``exp`` is the GPU's fast ``ex2``; GELU's ``erf`` is libdevice's
  ``__nv_erff``, its tanh form a sigmoid: :func:`fastpath.quant._jit_codes._gelu`), so it matches the
  float64 reference (:mod:`moeref.activations`) to a few float32 ulps, not bitwise; the tests
  bound it (relative 1e-5 plus an absolute floor). Consequently the fused codes equal the codes of
  the exact reference activation except where the float32 activation sits next to an FP8 rounding
  boundary: those differ by one code, and the tests bound how many.

Layouts: ``silu_and_mul`` and ``gelu_and_mul`` read ``gate = h[..., :N]``, ``up = h[..., N:]`` (vLLM
``SiluAndMul`` / ``GeluAndMul``, ``layout="gate_up"``); ``swigluoai`` reads interleaved pairs ``gate = h[..., 0::2]``,
``up = h[..., 1::2]`` (gpt-oss, ``layout="interleaved"``), with ``alpha``/``limit``.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from moeref._checks import check_choice
from moeref.activations import GELU_APPROXIMATIONS
from moeref.quant import fp8_group
from moeref.quant.scheme import Scheme

from . import quant as Q
from .quant import _launch as QL
from .quant import _plan as QPL
from .quant import _preset_map as QP
from .quant import _tiles as QT
from .quant._jit_codes import _activation
from .quant._kernels import _quant_kernel
from .quant._layouts import SF_LAYOUT, grid_of, returned_scales_shape
from ._host import alloc as _alloc
from ._host import SLOT, PlannedLaunch, cdiv, launch, next_pow2, pdl_launch

__all__ = [
    "silu_and_mul_quant_fp8",
    "gelu_and_mul_quant_fp8",
    "swigluoai_quant_fp8",
    "silu_and_mul",
    "gelu_and_mul",
    "swigluoai",
    "reference_silu_and_mul_quant_fp8",
    "reference_gelu_and_mul_quant_fp8",
    "reference_swigluoai_quant_fp8",
    "supports",
]

_ACT = {"silu_and_mul": 1, "swigluoai": 2, "gelu_and_mul": 3, "gelu_tanh_and_mul": 4}
"""The kernels' ``ACT`` code of each activation (:func:`fastpath.quant._jit_codes._activation`); the two GELU
forms are two codes (:func:`_gelu_key`)."""
_GATE_UP = ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")


def _gelu_key(approximate: str) -> str:
    """The ``_ACT`` key of GELU with ``approximate`` (``"none"``: erf, ``"tanh"``), as
    :data:`moeref.activations.GELU_APPROXIMATIONS` names them (``ValueError`` otherwise)."""
    check_choice(approximate, GELU_APPROXIMATIONS, "approximate")
    return "gelu_tanh_and_mul" if approximate == "tanh" else "gelu_and_mul"


def supports(scheme: Scheme | None = None, x=None, scale_layout: str = "row_major", **_) -> tuple[bool, str]:
    """Whether the fused kernel runs ``scheme`` on ``x`` (``[..., 2N]``) here."""
    if scheme is None:
        scheme = fp8_group(128)
    if scheme.element not in ("e4m3fn", "e5m2") or scheme.family != "blockwise":
        return False, "the fused kernels produce FP8 (E4M3/E5M2) codes only"
    kind = Q._kind(scheme)
    if kind not in ("rows", "per_tensor"):
        return False, "the fused kernels quantize per-token, 1xG groups or per tensor"
    xx = None
    if x is not None:
        if x.shape[-1] % 2:
            return False, f"the gated input needs an even last axis (2N); got {x.shape[-1]}"
        if kind == "per_tensor" and (x.dim() == 3 and x.shape[0] > 1):
            return False, "a per-tensor scheme takes a 1-D or 2-D input here (one tensor amax)"
        xx = x[..., : x.shape[-1] // 2]
    return Q.supports(scheme, xx, scale_layout)


@triton.jit
def _act_kernel(x_ptr, stride_xm, stride_xk, o_ptr, amax_ptr, M, N, ACT: tl.constexpr, ALPHA: tl.constexpr,
                LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, AMAX: tl.constexpr,
                NONFINITE: tl.constexpr, STORE: tl.constexpr = True, PARTIAL: tl.constexpr = False):
    """The float32 activation alone (the same device function the fused kernel uses). ``AMAX``:
    also the tensor amax of the activation, as the quantizer's amax pass reduces it (``|out|`` bit
    patterns, NaN above Inf unless ``NONFINITE`` 1 drops it): each program's max joins ``amax_ptr``
    (int32, zeroed first) by an atomic max, exact in any order; with ``PARTIAL`` each program stores
    its max at ``amax_ptr[pid_m * num_programs(1) + pid_n]`` instead (the amax pass's partials, which
    the per-tensor scale kernel reduces). ``STORE`` False: the activation is not written (the amax
    pass of the fused per-tensor quantizer, which computes the activation again in its data pass)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_N // 2)
    t = tl.arange(0, 2)
    cols = tl.program_id(1) * BLOCK_N + 2 * j[:, None] + t[None, :]  # [BN/2, 2]
    cols4 = cols[None, None, :, :] + tl.zeros((BLOCK_M, 1, BLOCK_N // 2, 2), tl.int32)
    m = (rows < M)[:, None, None, None] & (cols4 < N)
    xb = x_ptr + rows.to(tl.int64)[:, None, None, None] * stride_xm
    out = _activation(xb, cols4, stride_xk, N, m, ACT, ALPHA, LIMIT)
    if STORE:
        tl.store(o_ptr + rows.to(tl.int64)[:, None, None, None] * N + cols4, out, mask=m)
    if AMAX:
        a = tl.where(m, out.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        if NONFINITE == 1:
            a = tl.where(a > 0x7F800000, 0, a)
        a_max = tl.max(tl.max(tl.max(tl.max(a, axis=3), axis=2), axis=1), axis=0)
        if PARTIAL:
            tl.store(amax_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), a_max)
        else:
            tl.atomic_max(amax_ptr, a_max)


def _flat2(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 1:
        return x.unsqueeze(0)
    return x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x


def _activation_torch(x: torch.Tensor, act: str, alpha: float, limit: float, amax_for: Scheme | None = None):
    shape = tuple(x.shape)
    x2 = _flat2(x)
    M, two_n = x2.shape
    N = two_n // 2
    out = _alloc((M, N), dtype=torch.float32, device=x.device)
    nonfinite = 0
    if amax_for is not None:
        if not isinstance(amax_for, Scheme) or not (Q._kind(amax_for) == "per_tensor" or amax_for.family == "nvfp4"):
            raise ValueError("amax_for must be a per-tensor FP8 or an NVFP4 scheme (the schemes with a tensor "
                             f"amax pass); got {getattr(amax_for, 'name', amax_for)!r}")
        if Q._kind(amax_for) == "per_tensor" and x.dim() == 3 and x.shape[0] > 1:
            raise ValueError("amax_for a per-tensor scheme gives one amax for the whole activation: a 3-D x "
                             f"with {x.shape[0]} matrices needs one per matrix (quantize's own amax pass)")
        nonfinite = QP.constexprs(amax_for, False)["NONFINITE"]
        amax_bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    BM, BN = 4, min(1024, max(2, next_pow2(max(N, 1))))
    launch(_act_kernel, (cdiv(M, BM), cdiv(N, BN)),
           x2, x2.stride(0), x2.stride(1), out, out if amax_for is None else amax_bits, M, N, ACT=_ACT[act],
           ALPHA=float(alpha), LIMIT=float(limit), BLOCK_M=BM, BLOCK_N=BN, AMAX=amax_for is not None,
           NONFINITE=nonfinite)
    out = out.reshape(shape[:-1] + (N,))
    return out if amax_for is None else (out, amax_bits.view(torch.float32))


def silu_and_mul(x: torch.Tensor, *, amax_for: Scheme | None = None):
    """float32 ``silu(x[..., :N]) * x[..., N:]`` computed by the fused kernel's activation code.

    ``amax_for``: a per-tensor FP8 or NVFP4 scheme: returns ``(activation, amax)``, ``amax`` float32
    ``[1]`` the tensor amax :func:`fastpath.quant.quantize` would reduce from the activation under
    that scheme's NaN policy, produced by the same kernel (atomic max): pass it as
    ``quantize(activation, scheme, amax=amax)`` and the quantizer reads the activation once
    instead of twice (issue 20's two-pass kernels)."""
    return _activation_torch(x, "silu_and_mul", 0.0, 0.0, amax_for)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", *, amax_for: Scheme | None = None):
    """float32 ``gelu(x[..., :N], approximate) * x[..., N:]`` computed by the fused kernel's activation code
    (:func:`fastpath.quant._jit_codes._gelu`: ``approximate="none"`` the erf form, ``"tanh"`` PyTorch's tanh
    approximation; the semantics of :func:`moeref.activations.gelu_and_mul`); ``amax_for`` as in
    :func:`silu_and_mul`."""
    return _activation_torch(x, _gelu_key(approximate), 0.0, 0.0, amax_for)


def swigluoai(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0, *, amax_for: Scheme | None = None):
    """float32 gpt-oss SwiGLU of interleaved ``x[..., 2N]`` by the fused kernel's activation code;
    ``amax_for`` as in :func:`silu_and_mul`."""
    return _activation_torch(x, "swigluoai", alpha, limit, amax_for)


def _fused(x: torch.Tensor, act: str, alpha: float, limit: float, scheme: Scheme | None,
           scale_layout: str, hw_fp8: bool | None, block_m=None, groups_per_program=None,
           num_warps=None, tuning: Q.QuantTuning | None = None, skip_rows=None, rows=None,
           pdl: bool = False) -> Q.FastQuantized:
    try:  # the plan's key (fastpath.quant._plan): ids of the scheme and tuning, which the plan keeps
        skip_key = None if skip_rows is None else (skip_rows.dtype, skip_rows.shape, skip_rows.device)
        if rows is not None:
            skip_key = (skip_key, "rows", rows.dtype, rows.shape, rows.device)
        key = ("fused", act, alpha, limit, id(scheme), scale_layout, hw_fp8, block_m, groups_per_program,
               num_warps, id(tuning), x.dtype, x.shape, x.stride(), x.data_ptr() & 15, x.device, skip_key, pdl)
        plan = QPL._PLANS.get(key)
        if plan is not None:
            return plan(x, skip_rows, rows)
        if not (QPL.plain(alpha) and QPL.plain(limit)):
            key = None
    except (AttributeError, TypeError):  # not a tensor, unhashable options: validated below
        key = None
    plan = _FusedPlan(x, act, alpha, limit, scheme, scale_layout, hw_fp8, block_m, groups_per_program,
                      num_warps, tuning, skip_rows, rows, pdl)
    plan.kept = (scheme, tuning)  # the key holds their ids
    return QPL.keep(key, plan, x.device)(x, skip_rows, rows)


class _FusedPlan:
    """Everything :func:`_fused` computes from its key (fastpath.quant._plan); ``plan(x)`` runs
    one call: two allocations and one planned launch. ``skip_rows`` (a MoE layout's row labels) is
    checked here against x's shape, which the key fixes with its own dtype, shape and device; so is ``rows``
    (row indices of a 2-D x: the grid covers them, ``ROW_GATHER`` of :func:`fastpath.quant._kernels.
    _quant_kernel`)."""

    def __init__(self, x, act, alpha, limit, scheme, scale_layout, hw_fp8, block_m, groups_per_program,
                 num_warps, tuning, skip_rows=None, rows=None, pdl=False):
        scheme = fp8_group(128) if scheme is None else scheme
        if not isinstance(pdl, bool):
            raise TypeError(f"pdl must be a bool; got {pdl!r}")
        if tuning is not None and not isinstance(tuning, Q.QuantTuning):
            raise TypeError(f"tuning must be a fastpath.quant.QuantTuning or None; got {type(tuning).__name__}")
        ok, why = supports(scheme, x, scale_layout)
        if not ok:
            raise ValueError(f"fastpath.fused cannot run {scheme.name!r}: {why}")
        shape_in = tuple(int(d) for d in x.shape)
        N = shape_in[-1] // 2
        shape = shape_in[:-1] + (N,)
        x3 = x.reshape((1, 1) + shape_in) if x.dim() == 1 else (x.unsqueeze(0) if x.dim() == 2 else x)
        B, M = int(x3.shape[0]), int(x3.shape[1])
        self.dev = dev = x.device
        self.scheme, self.shape, self.scale_layout = scheme, shape, scale_layout
        if hw_fp8 is None:
            hw_fp8 = dev.type == "cuda"
        ce = QP.constexprs(scheme, hw_fp8)
        cs = QPL._strides((B, M, N))
        self.per_tensor = Q._kind(scheme) == "per_tensor"
        if self.per_tensor:
            if rows is not None:
                raise ValueError("rows applies to per-token and 1xG schemes (a per-tensor amax reads every row)")
            if pdl:
                raise ValueError("pdl applies to per-token and 1xG schemes (one launch); a per-tensor scheme's three "
                                 "launches take none")
            self._plan_per_tensor(x3, act, alpha, limit, scheme, ce, cs, skip_rows, block_m, groups_per_program,
                                  num_warps, tuning)
            return
        gs = scheme.resolve_block(shape)[-1]
        ng = cdiv(N, gs)
        sshape, self.sdt, (m_pad, ng_pad, ssm, ssg) = Q.scale_storage_shape((B, M, N), scheme, scale_layout)
        ssb = QPL._strides(sshape)[0]
        self.scales_shape = returned_scales_shape(shape, scheme, scale_layout, sshape)
        tile = QT._device_tile("fused", dev, scale_layout, ce, gs, ng, (block_m, groups_per_program, num_warps))
        if tile is not None:  # a device's own tile (fastpath.quant._tiles._DEVICE_TILES)
            groups_per_program, block_m, num_warps = tile
        elif act in _GATE_UP and gs == 128 and block_m is None and groups_per_program is None \
                and num_warps is None:
            # the general tile (devices without their own): two loads per element (gate, up), 4 rows
            # x 8 groups on 8 warps (docs/performance.md, "Tuning history of the quantization kernels";
            # measured with SiLU, used for GELU's same loads)
            num_warps = 8
        gb, gpp, bm = QT._tile(gs, block_m, groups_per_program, scale_layout, ng, role="fused")
        dummy = _alloc(1, dtype=torch.float32, device=dev)  # never read or written by the kernel
        grid = (cdiv(m_pad, bm), cdiv(ng_pad, gpp), B)
        self.row_skip = skip_rows is not None
        self.row_gather = 0 if rows is None else int(rows.numel()) if torch.is_tensor(rows) else -1
        if rows is not None:
            if skip_rows is not None:
                raise ValueError("give skip_rows (labels of every row) or rows (the rows to compute), not both")
            if not torch.is_tensor(rows) or rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1:
                raise TypeError("rows must be a 1-D int32/int64 tensor of row indices of x (< 0: none); got "
                                f"{type(rows).__name__ if not torch.is_tensor(rows) else (rows.dtype, tuple(rows.shape))}")
            if B != 1 or scale_layout != "row_major" or m_pad != M:
                raise ValueError("rows needs a 1-D or 2-D x with row-major scales (the rows not listed are not "
                                 f"written); got x of shape {shape_in}, scale_layout {scale_layout!r}")
            if rows.device != dev:
                raise ValueError(f"rows is on {rows.device} but x is on {dev}")
            if self.row_gather == 0:
                raise ValueError("rows must list at least one entry")
            grid = (cdiv(self.row_gather, bm), cdiv(ng_pad, gpp), 1)
        if self.row_skip:
            if scale_layout != "row_major":
                raise ValueError(f"skip_rows needs row-major scales (a skipped tile writes no scale); got {scale_layout!r}")
            if not torch.is_tensor(skip_rows) or skip_rows.dtype not in (torch.int32, torch.int64):
                raise TypeError("skip_rows must be an int32/int64 tensor (one label per row of x, < 0: skipped)")
            if tuple(skip_rows.shape) != tuple(x3.shape[:2]) and skip_rows.numel() != B * M:
                raise ValueError(f"skip_rows must have one label per row of x ({B * M}); got shape "
                                 f"{tuple(skip_rows.shape)}")
            if skip_rows.device != dev:
                raise ValueError(f"skip_rows is on {skip_rows.device} but x is on {dev}")
        xk, pair, in16 = QL._pair_view(x3, act == "swigluoai")
        self.pair_words = pair == 1
        if pair == 2:
            pair = 0  # the generic swigluoai path loads gate/up with stride 2 on plain tiles
        self.launch = PlannedLaunch(
            _quant_kernel, grid,
            SLOT, xk.stride(0), xk.stride(1), xk.stride(2), SLOT, cs[0], cs[1],
            SLOT, ssb, ssm, ssg, dummy, dummy, dummy, SLOT if self.row_skip or self.row_gather else dummy, M, N, ng,
            m_pad, ng_pad, 1,
            GS=gs, GB=gb, GPP=gpp, BLOCK_M=bm, SF_LAYOUT=SF_LAYOUT[scale_layout], AMAX_SRC=0,
            STATIC=False, TWO_LEVEL=False, NV_ORDER=0, WRITE_SCALES=True, ROW_SKIP=self.row_skip, ACT=_ACT[act],
            ACT_ALPHA=float(alpha), ACT_LIMIT=float(limit), PAIR=pair, IN16=in16,
            **QL._launch_knobs(ce, gb, gpp, bm, num_warps, tuning or QT.DEFAULT_TUNING),
            **({"ROW_GATHER": self.row_gather} if self.row_gather else {}),
            **pdl_launch(dev, pdl))

    def _plan_per_tensor(self, x3, act, alpha, limit, scheme, ce, cs, skip_rows, block_m, groups_per_program,
                         num_warps, tuning):
        """Per-tensor FP8: two passes over the gated input, three launches: the activation's amax
        (:func:`_act_kernel` without its store, one partial per program), the scale kernel (reduces the
        partials, stores the amax and the scale: :func:`fastpath.quant._plan.per_tensor_scale_launches`),
        then the data pass (:func:`_quant_kernel` with ``ACT`` and ``AMAX_SRC=1``), which computes the same
        float32 activation again. Bit for bit :func:`fastpath.quant.quantize` of :func:`silu_and_mul`'s
        output: the same device function gives the same activation in both passes."""
        if skip_rows is not None:
            raise ValueError("skip_rows applies to per-token and 1xG schemes (a per-tensor amax reads every row)")
        if self.scale_layout != "row_major":
            raise ValueError(f"a per-tensor scale has the row-major layout only; got {self.scale_layout!r}")
        B, M, two_n = (int(d) for d in x3.shape)
        N = two_n // 2
        dev = self.dev
        p = scheme.preset
        self.row_skip, self.row_gather, self.pair_words = False, 0, False
        static = scheme.static_scale
        static_t = _alloc(1, dtype=torch.float32, device=dev)  # never read unless static
        if static is not None:
            sv = float(np.float32(static)) if scheme.scale_format == "fp32" else \
                float(int(np.frexp(static)[1]) - 1 + 127)
            static_t = torch.full((1,), sv, dtype=torch.float32, device=dev)
        self.need_amax = static is None or p.nonfinite == "nan_block"
        self.sdt = torch.float32 if scheme.scale_format == "fp32" else torch.uint8
        self.scales_shape = grid_of(self.shape, scheme)
        if self.need_amax:
            bm_a, bn_a = 4, min(1024, max(2, next_pow2(max(N, 1))))
            grid_a = (cdiv(M, bm_a), cdiv(N, bn_a))
            self.nprog = grid_a[0] * grid_a[1]
            x2 = x3.reshape(M, two_n) if B == 1 else None  # B is 1 here (supports); the call passes _flat2(x)
            self.amax_launch = PlannedLaunch(
                _act_kernel, grid_a, SLOT, x2.stride(0), x2.stride(1), static_t, SLOT, M, N, ACT=_ACT[act],
                ALPHA=float(alpha),
                LIMIT=float(limit), BLOCK_M=bm_a, BLOCK_N=bn_a, AMAX=True, NONFINITE=ce["NONFINITE"], STORE=False,
                PARTIAL=True)
        else:
            self.zero_amax = torch.zeros(1, dtype=torch.float32, device=dev)  # read only
        self.scale_launch, self.scale_reduce_launch = QPL.per_tensor_scale_launches(
            ce, static_t, static is not None, 1, self.nprog if self.need_amax else None)
        gs = next_pow2(min(N, 128))
        ng = cdiv(N, gs)
        gb, gpp, bm = QT._tile(gs, block_m, groups_per_program, "row_major", ng, role="fused")
        xk, pair, in16 = QL._pair_view(x3, act == "swigluoai")
        self.pair_words = pair == 1
        if pair == 2:
            pair = 0
        self.quant_launch = PlannedLaunch(
            _quant_kernel, (cdiv(M, bm), cdiv(ng, gpp), B),
            SLOT, xk.stride(0), xk.stride(1), xk.stride(2), SLOT, cs[0], cs[1],
            static_t, 0, 0, 0, SLOT, static_t, static_t, static_t, M, N, ng, M, ng, M,
            GS=gs, GB=gb, GPP=gpp, BLOCK_M=bm, SF_LAYOUT=0, AMAX_SRC=1, STATIC=static is not None,
            TWO_LEVEL=False, NV_ORDER=0, WRITE_SCALES=False, ROW_SKIP=False, ACT=_ACT[act],
            ACT_ALPHA=float(alpha), ACT_LIMIT=float(limit), PAIR=pair, IN16=in16,
            **QL._launch_knobs(ce, gb, gpp, bm, num_warps, tuning or QT.DEFAULT_TUNING))

    def _call_per_tensor(self, x: torch.Tensor) -> Q.FastQuantized:
        codes = _alloc(self.shape, dtype=torch.uint8, device=self.dev)
        scales = _alloc(self.scales_shape, dtype=self.sdt, device=self.dev)
        if self.need_amax:
            x2 = _flat2(x)
            part = _alloc(self.nprog, dtype=torch.int32, device=self.dev)
            self.amax_launch(_flat2(x), part)
            amax = _alloc(1, dtype=torch.float32, device=self.dev)
            self.scale_reduce_launch(amax, scales, part)
        else:
            amax = self.zero_amax
            self.scale_launch(amax, scales, amax)
        xk = x.view(torch.int32) if self.pair_words else x
        self.quant_launch(xk, codes, amax)
        return Q.FastQuantized(codes, scales, "row_major", self.scheme, self.shape)

    def __call__(self, x: torch.Tensor, skip_rows=None, rows=None) -> Q.FastQuantized:
        if self.per_tensor:
            return self._call_per_tensor(x)
        codes = _alloc(self.shape, dtype=torch.uint8, device=self.dev)
        scales = _alloc(self.scales_shape, dtype=self.sdt, device=self.dev)
        xk = x.view(torch.int32) if self.pair_words else x
        if self.row_skip:
            self.launch(xk, codes, scales, skip_rows.reshape(-1).contiguous())
        elif self.row_gather:
            self.launch(xk, codes, scales, rows.contiguous())
        else:
            self.launch(xk, codes, scales)
        return Q.FastQuantized(codes, scales, self.scale_layout, self.scheme, self.shape)


def silu_and_mul_quant_fp8(x: torch.Tensor, scheme: Scheme | None = None, *,
                           scale_layout: str = "row_major", hw_fp8: bool | None = None,
                           **tile) -> Q.FastQuantized:
    """FP8 group quantization of ``silu(x[..., :N]) * x[..., N:]`` in one kernel.

    Args:
        x: float32/bfloat16/float16 ``[..., 2N]`` (1 to 3 dims, any strides).
        scheme: an FP8 per-token, 1xG or per-tensor scheme (default ``fp8_group(128)``, moeref's
            default preset; ``fp8_group(128, "ue8m0", "deepgemm")`` for DeepGEMM's recipe). Per tensor:
            two passes over x, the first for the tensor amax (:meth:`_FusedPlan._plan_per_tensor`).
        scale_layout: see :data:`fastpath.quant.SCALE_LAYOUTS`.
        tile: ``block_m``, ``groups_per_program``, ``num_warps`` (tile overrides) and ``tuning``
            (:class:`fastpath.quant.QuantTuning`), as :func:`fastpath.quant.quantize` takes them;
            ``skip_rows``: int tensor, one label per row of ``x``: a tile of rows whose labels are all < 0
            (a MoE layout's padding rows, ``src`` of :func:`fastpath.dispatch.to_contiguous`) is not
            computed, its codes and scales are left unspecified (row-major scales only); ``rows``: 1-D int
            tensor of row indices of a 1-D or 2-D ``x`` (entries < 0 ignored; a MoE layer's slot -> row map):
            the grid covers these entries instead of x's rows, each listed row gets the codes and scales of
            the whole-x launch and every other row is left unspecified (row-major scales only; not with
            ``skip_rows``); ``pdl`` (per-token and 1xG schemes): launched with Programmatic Dependent Launch
            where it runs (sm_90+, not the interpreter; elsewhere ignored): it may start while the kernel
            before it on the stream runs, every program letting the kernel after it launch and waiting for the
            kernel before it before its first load (:func:`fastpath._host.pdl_launch`); the same codes and
            scales.
    """
    return _fused(x, "silu_and_mul", 0.0, 0.0, scheme, scale_layout, hw_fp8, **tile)


def gelu_and_mul_quant_fp8(x: torch.Tensor, approximate: str = "none", scheme: Scheme | None = None, *,
                           scale_layout: str = "row_major", hw_fp8: bool | None = None,
                           **tile) -> Q.FastQuantized:
    """FP8 group quantization of ``gelu(x[..., :N], approximate) * x[..., N:]`` in one kernel: the float32
    activation of :func:`gelu_and_mul` (``approximate``: ``"none"`` erf, ``"tanh"``), then the group
    quantizer; arguments as :func:`silu_and_mul_quant_fp8`."""
    return _fused(x, _gelu_key(approximate), 0.0, 0.0, scheme, scale_layout, hw_fp8, **tile)


def swigluoai_quant_fp8(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0,
                        scheme: Scheme | None = None, *, scale_layout: str = "row_major",
                        hw_fp8: bool | None = None, **tile) -> Q.FastQuantized:
    """FP8 group quantization of gpt-oss ``swigluoai`` (interleaved ``x[..., 2N]``) in one kernel."""
    return _fused(x, "swigluoai", alpha, limit, scheme, scale_layout, hw_fp8, **tile)


def reference_silu_and_mul_quant_fp8(x, scheme: Scheme | None = None):
    """The specification: :func:`moeref.activations.silu_and_mul` (float64, rounded to float32),
    then :func:`moeref.quant.quantize` (a :class:`moeref.quant.QuantizedTensor`)."""
    from moeref.activations import silu_and_mul as act
    from moeref.quant import quantize
    return quantize(np.asarray(act(x), np.float32), fp8_group(128) if scheme is None else scheme)


def reference_gelu_and_mul_quant_fp8(x, approximate: str = "none", scheme: Scheme | None = None):
    """The specification: :func:`moeref.activations.gelu_and_mul` (float64, rounded to float32), then
    :func:`moeref.quant.quantize`."""
    from moeref.activations import gelu_and_mul as act
    from moeref.quant import quantize
    return quantize(np.asarray(act(x, approximate), np.float32), fp8_group(128) if scheme is None else scheme)


def reference_swigluoai_quant_fp8(x, alpha: float = 1.702, limit: float = 7.0,
                                  scheme: Scheme | None = None):
    """The specification: :func:`moeref.activations.swigluoai` (interleaved), then quantize."""
    from moeref.activations import swigluoai as act
    from moeref.quant import quantize
    return quantize(np.asarray(act(x, alpha=alpha, limit=limit), np.float32),
                    fp8_group(128) if scheme is None else scheme)
