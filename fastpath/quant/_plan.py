"""Per-call plans of :func:`fastpath.quant.quantize` and :func:`fastpath.quant.dequantize` (issue 20).

At decode sizes a quantizer's host code costs more than its kernel: scheme checks, block
resolution, tile choice, storage shapes and strides, about 60 launch arguments and constexprs
bound and specialized per launch. A *plan* does that once per key (scheme, layout, options, and
x's dtype, shape, strides, 16-byte misalignment and device) and keeps the grid, the constexprs,
the output shapes and one :class:`fastpath._host.PlannedLaunch` per kernel, so a repeated call is:
the key, a dictionary look-up, the output allocations and the planned launches. Validation:
everything :func:`~fastpath.quant.supports` checks depends only on the key, so it runs when the
plan is made; what varies per call (``amax=``, a tensor ``global_scale``) is checked per call in
O(1) attribute reads. A call whose options are not plain values (a tensor ``scale``) makes a
plan and runs it without keeping it; so does a call made while a CUDA graph is being captured
(a plan's constant tensors must be filled by an executed kernel, not a captured one).

The plan runs exactly the launches the unplanned code ran, with the same arguments (outputs are
allocated in their final shape: the same contiguous strides the reshaped 3-D buffers had).
"""
from __future__ import annotations

import numpy as np
import torch

from moeref.quant.scheme import Scheme

from .._host import SLOT, PlannedLaunch, cdiv
from .._host import alloc as _alloc
from .._host import next_pow2 as _next_pow2
from . import _launch as L
from . import _preset_map as P
from . import _tiles as T
from ._kernels import _dequant_kernel, _per_tensor_scale_kernel, _quant_kernel
from ._layouts import SF_LAYOUT, grid_of, returned_scales_shape, scale_storage_shape

PLAN_CACHE_MAX = 512  # plans kept; the cache is emptied when full (schemes made per call would grow it)
_PLANS: dict = {}
_PLAIN = (int, float, str, bool, type(None))
FastQuantized = None  # fastpath.quant.FastQuantized, set by fastpath.quant (which imports this module)


def plain(v) -> bool:
    """A value a plan may be keyed on (hashable, compared by value, never mutated in place)."""
    return type(v) in _PLAIN


def keep(key, plan, dev: torch.device):
    """Store ``plan`` under ``key`` (unless key is None or a CUDA graph is being captured)."""
    if key is None or (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return plan
    if len(_PLANS) >= PLAN_CACHE_MAX:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _strides(shape) -> tuple:
    """Strides of a contiguous tensor of ``shape`` as torch gives them."""
    return torch.empty(shape, device="meta").stride()


def _kind(scheme: Scheme) -> str | None:
    """"per_tensor", "rows" (per-token / 1xG groups) or None for unsupported blocks."""
    b = scheme.block
    if len(b) == 2 and b[0] is None and b[1] is None:
        return "per_tensor"
    if len(b) == 2 and b[0] == 1 or len(b) == 1:
        return "rows"
    return None


def check_amax(amax, scheme: Scheme, B: int, dev: torch.device, static_global: bool) -> torch.Tensor:
    """:func:`~fastpath.quant.quantize`'s ``amax=``: where a tensor amax pass would run (per-tensor
    FP8 without a static scale, dynamic NVFP4), a float32 tensor of one amax per matrix
    (per-tensor) or one (NVFP4) on x's device; anything else is a ValueError / TypeError naming
    what is wrong."""
    kind = _kind(scheme)
    static = scheme.static_scale is not None
    if not ((kind == "per_tensor" and not static) or (scheme.family == "nvfp4" and not static_global)):
        raise ValueError("amax= is for per-tensor FP8 without a static scale and NVFP4 without a "
                         f"global_scale (the schemes with a tensor amax pass); got {scheme.name!r}")
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
        raise TypeError(f"amax must be a float32 torch tensor; got {getattr(amax, 'dtype', type(amax).__name__)}")
    want = B if kind == "per_tensor" else 1
    if amax.numel() != want or amax.device != dev:
        raise ValueError(f"amax must hold {want} value(s) on {dev}; got shape {tuple(amax.shape)} "
                         f"on {amax.device}")
    return amax.reshape(want)


def _x3(x: torch.Tensor) -> torch.Tensor:
    return x.reshape((1, 1) + tuple(x.shape)) if x.dim() == 1 else (x.unsqueeze(0) if x.dim() == 2 else x)


def per_tensor_scale_launches(ce: dict, static_t, static: bool, B: int, nprog: int | None):
    """The per-tensor scale kernel's two planned launches ``(scale, scale_reduce)``: ``scale(amax, scales,
    amax)`` from ``B`` amaxes given (or none needed); ``scale_reduce(amax_out, scales, partials)`` reduces an
    amax pass's ``nprog`` int32 partials per matrix first and stores the amaxes (None when ``nprog`` is None).
    Shared by :class:`QuantPlan` and the fused activation's per-tensor plan (:mod:`fastpath.fused`)."""
    keys = ("ELEM_MAX", "INV_M", "EMAX", "MBITS", "SCALE_KIND", "FP32_RULE", "FP32_POW2",
            "E8_RULE", "E8_LO", "E8_HI", "E8_NF", "AMAX_FLOOR", "ZERO_BLOCK", "NONFINITE", "APPLY")
    sk = dict(BLOCK=_next_pow2(max(B, 2)), STATIC=static, **{k_: ce[k_] for k_ in keys})
    scale = PlannedLaunch(_per_tensor_scale_kernel, (1,), SLOT, SLOT, static_t, B, SLOT, 0, P_ITERS=0, **sk)
    reduce = None if nprog is None else PlannedLaunch(_per_tensor_scale_kernel, (1,), SLOT, SLOT, static_t, B,
                                                      SLOT, nprog, P_ITERS=cdiv(nprog, 1024), **sk)
    return scale, reduce


class QuantPlan:
    """Everything :func:`~fastpath.quant.quantize` computes from its key; ``plan(x, amax,
    global_scale)`` runs one call (x of the key's dtype, shape, strides and device)."""

    def __init__(self, x: torch.Tensor, scheme: Scheme, scale_layout: str, scale, hw_fp8, block_m,
                 groups_per_program, num_warps, global_scale, tuning: T.QuantTuning):
        # validated by the caller: supports(scheme, x, scale_layout, tuning), tuning's type
        self.static_kind = None  # NVFP4 static global scale: "host" (a number) or "device" (a tensor)
        if global_scale is not None:  # validated before any allocation or launch
            params = L._nvfp4_static_params(global_scale, scheme, x.device)
            self.static_kind = params[0]
            if params[0] == "host":
                _, s_enc, pts, self.glob_value, self.zero_tensor = params
                self.static_nv = L._nvfp4_static_nv(s_enc, pts, scheme, torch.device(x.device))
        shape = tuple(int(d) for d in x.shape)
        x3 = _x3(x)
        B, M, K = (int(d) for d in x3.shape)
        dev = x.device
        self.scheme, self.shape, self.B, self.dev, self.scale_layout = scheme, shape, B, dev, scale_layout
        if hw_fp8 is None:
            hw_fp8 = dev.type == "cuda"
        ce = P.constexprs(scheme, bool(hw_fp8))
        self.kind = kind = _kind(scheme)
        p = scheme.preset
        static = scheme.static_scale if scale is None else scale
        if static is not None:
            from moeref.quant.scheme import _check_static_scale
            static = _check_static_scale(static, scheme.scale_format, "scale")
        packed = scheme.element == "e2m1"
        cshape = (B, M, (K + 1) // 2 if packed else K)
        self.codes_shape = shape[:-1] + (cshape[-1],)
        cs = _strides(cshape)
        dummy = _alloc(1, dtype=torch.float32, device=dev)  # never read or written by the kernels
        static_t = dummy
        if static is not None:
            sv = float(np.float32(static)) if scheme.scale_format == "fp32" else \
                float(int(np.frexp(static)[1]) - 1 + 127)
            static_t = torch.full((1,), sv, dtype=torch.float32, device=dev)
        self.row_loop = False
        self.amax_plan = None
        self.pair_words = False

        if kind == "per_tensor":
            # one scale per matrix: amax pass, scale kernel, then the data pass with AMAX_SRC=1
            self.need_amax = static is None or p.nonfinite == "nan_block"
            if self.need_amax:
                self.amax_plan = L.AmaxPlan((B, M, K), x3.stride(), ce["NONFINITE"], True, dev)
            else:
                self.zero_amax = torch.zeros(B, dtype=torch.float32, device=dev)  # read only
            self.sdt = torch.float32 if scheme.scale_format == "fp32" else torch.uint8
            self.scales_shape = grid_of(shape, scheme)  # the (B, 1, 1) storage, reshaped
            self.scale_launch, self.scale_reduce_launch = per_tensor_scale_launches(
                ce, static_t, static is not None, B, self.amax_plan.nprog if self.need_amax else None)
            gs = min(K, 128) if not packed else max(2, min(_next_pow2(K), 128))
            gs = _next_pow2(gs)
            ng = cdiv(K, gs)
            gb, gpp, bm = T._tile(gs, block_m, groups_per_program, "row_major", ng)
            grid = (cdiv(M, bm), cdiv(ng, gpp), B)
            xk, pair, in16 = L._pair_view(x3, packed)
            self.pair_words = pair == 1
            self.quant_launch = PlannedLaunch(
                _quant_kernel, grid,
                SLOT, xk.stride(0), xk.stride(1), xk.stride(2), SLOT, cs[0], cs[1],
                dummy, 0, 0, 0, SLOT, static_t, dummy, dummy, M, K, ng, M, ng, M,
                GS=gs, GB=gb, GPP=gpp, BLOCK_M=bm, SF_LAYOUT=0, AMAX_SRC=1, STATIC=static is not None,
                TWO_LEVEL=False, NV_ORDER=0, WRITE_SCALES=False, ROW_SKIP=False, ACT=0, ACT_ALPHA=0.0, ACT_LIMIT=0.0,
                PAIR=pair, IN16=in16,
                **L._launch_knobs(ce, gb, gpp, bm, num_warps, tuning))
            return

        gs = scheme.resolve_block(shape)[-1]
        ng = cdiv(K, gs)
        sshape, self.sdt, (m_pad, ng_pad, ssm, ssg) = scale_storage_shape((B, M, K), scheme, scale_layout)
        ssb = _strides(sshape)[0]
        self.scales_shape = returned_scales_shape(shape, scheme, scale_layout, sshape)
        tile = T._device_tile("quant", dev, scale_layout, ce, gs, ng, (block_m, groups_per_program, num_warps))
        if tile is not None:
            groups_per_program, block_m, num_warps = tile
        gb, gpp, bm = T._tile(gs, block_m, groups_per_program, scale_layout, ng)
        self.two_level = two_level = scheme.family == "nvfp4"
        self.order = P.NVFP4_OP[p.option("nvfp4_order")] if two_level else 0
        if two_level and self.static_kind is None:
            self.amax_plan = L.AmaxPlan((B, M, K), x3.stride(), ce["NONFINITE"], False, dev)
            # L._nvfp4_device_globals(scheme, amax=amax), from an amax given or from the amax
            # pass's partials (its last step in the factors kernel)
            self.factors = L._factors_launch(scheme, True)
            self.factors_reduce = L._factors_launch(scheme, True, self.amax_plan.nprog_total)
        self.dummy = dummy
        if T._row_loop_applies(ng, gs, K, packed, scale_layout, tuning) and groups_per_program is None:
            self.row_loop = True
            self.quant_launch = L._row_loop_launch((B, M, K), x3.stride(), cs, ssb, ssm, m_pad, static_t, static,
                                                   ce, block_m, num_warps, tuning)
        else:
            grid = (cdiv(m_pad, bm), cdiv(ng_pad, gpp), B)
            xk, pair, in16 = L._pair_view(x3, packed)
            self.pair_words = pair == 1
            self.quant_launch = PlannedLaunch(
                _quant_kernel, grid,
                SLOT, xk.stride(0), xk.stride(1), xk.stride(2), SLOT, cs[0], cs[1],
                SLOT, ssb, ssm, ssg, dummy, static_t, SLOT, dummy, M, K, ng, m_pad, ng_pad, 1,
                GS=gs, GB=gb, GPP=gpp, BLOCK_M=bm, SF_LAYOUT=SF_LAYOUT[scale_layout], AMAX_SRC=0,
                STATIC=static is not None, TWO_LEVEL=two_level, NV_ORDER=self.order, WRITE_SCALES=True, ROW_SKIP=False,
                ACT=0, ACT_ALPHA=0.0, ACT_LIMIT=0.0, PAIR=pair, IN16=in16,
                **L._launch_knobs(ce, gb, gpp, bm, num_warps, tuning))

    def __call__(self, x: torch.Tensor, amax=None, global_scale=None):
        dev = self.dev
        scheme = self.scheme
        if amax is not None:
            amax = check_amax(amax, scheme, self.B, dev, self.static_kind is not None)
        codes = _alloc(self.codes_shape, dtype=torch.uint8, device=dev)
        scales = _alloc(self.scales_shape, dtype=self.sdt, device=dev)
        xk = x.view(torch.int32) if self.pair_words else x  # the same address as the 3-D view
        if self.kind == "per_tensor":
            if amax is None and self.need_amax:  # amax pass; its last step in the scale kernel
                part = self.amax_plan.partials(x)
                amax = _alloc(self.B, dtype=torch.float32, device=dev)
                self.scale_reduce_launch(amax, scales, part)
            else:
                if amax is None:
                    amax = self.zero_amax
                self.scale_launch(amax, scales, amax)
            self.quant_launch(xk, codes, amax)
            return FastQuantized(codes, scales, "row_major", scheme, self.shape)
        glob = None
        nv = self.dummy
        if self.static_kind == "host":
            nv = self.static_nv
            glob = torch.full((1,), self.glob_value, dtype=torch.float64, device=dev)
        elif self.static_kind == "device":
            nv, glob, _ = L._nvfp4_static_factors(global_scale, scheme, dev)
        elif self.two_level:
            nv = _alloc(130, dtype=torch.float32, device=dev)
            glob = _alloc(1, dtype=torch.float64, device=dev)
            if amax is None:
                part = self.amax_plan.partials(x)
                self.factors_reduce(part, part, nv, glob)
            else:
                self.factors(amax, amax, nv, glob)
        if self.row_loop:
            self.quant_launch(x, codes, scales)
        else:
            self.quant_launch(xk, codes, scales, nv)
        if self.static_kind == "host" and self.zero_tensor:
            # a static amax that is 0 in float32: the reference's data factor is 0
            codes.copy_(L._signed_zero_codes(_x3(x), self.order == 0).reshape(self.codes_shape))
        return FastQuantized(codes, scales, self.scale_layout, scheme, self.shape, global_scale=glob)


_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _direct(t: torch.Tensor, shape) -> tuple[bool, tuple]:
    """(whether ``t.reshape(shape)`` is a view, its strides): a view has t's address, so the plan
    passes t itself with these strides; otherwise each call reshapes (copies)."""
    v = t.reshape(shape)
    return v.data_ptr() == t.data_ptr() and v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), \
        v.stride()


class DequantPlan:
    """Everything :func:`~fastpath.quant.dequantize` computes from its key; ``plan(q)`` runs one call."""

    def __init__(self, q, dtype: torch.dtype, block_m, groups_per_program, num_warps):
        scheme = q.scheme
        shape = q.shape
        x3shape = (1, 1) + shape if len(shape) == 1 else ((1,) + shape if len(shape) == 2 else shape)
        B, M, K = x3shape
        self.shape, self.dtype, self.dev = shape, dtype, q.codes.device
        self.codes3 = (B, M, -1)
        self.codes_direct, cst = _direct(q.codes, self.codes3)
        os_ = _strides(x3shape)
        kind = _kind(scheme)
        ce = dict(ELEM=P.position(scheme.element, P.ELEMENTS),
                  SCALE_KIND=P.position(scheme.scale_format, P.S.SCALE_FORMATS),
                  HW=self.dev.type == "cuda")
        self.per_tensor = kind == "per_tensor"
        if self.per_tensor:
            gs = 128
            ng = cdiv(K, gs)
            gb, gpp, bm = T._tile(gs, block_m, groups_per_program, "row_major", ng, T._DQ_ELEMS, "dequant")
            self.s_shape = (B,)
            self.s_direct, _ = _direct(q.scales, self.s_shape)
            grid = (cdiv(M, bm), cdiv(ng, gpp), B)
            self.launch = PlannedLaunch(
                _dequant_kernel, grid, SLOT, cst[0], cst[1], SLOT, 1, 0, 0, SLOT, SLOT,
                os_[0], os_[1], M, K, ng, M, GS=gs, GB=gb, GPP=gpp,
                BLOCK_M=bm, SF_LAYOUT=0, PER_TENSOR=True, TWO_LEVEL=False,
                OUT=_OUT[dtype], num_warps=num_warps or T._DQ_WARPS, **ce)
            return
        gs = scheme.resolve_block(shape)[-1]
        ng = cdiv(K, gs)
        _, _, (m_pad, ng_pad, ssm, ssg) = scale_storage_shape((B, M, K), scheme, q.scale_layout)
        if q.scale_layout == "row_major":
            self.s_shape = (B, M, ng)
        elif q.scale_layout != "swizzled_128x4":
            self.s_shape = (B,) + tuple(q.scales.shape[-2:])
        else:
            self.s_shape = (B, -1)
        self.s_direct, sst = _direct(q.scales, self.s_shape)
        gb, gpp, bm = T._tile(gs, block_m, groups_per_program, q.scale_layout, ng, T._DQ_ELEMS, "dequant")
        self.two_level = q.global_scale is not None
        grid = (cdiv(M, bm), cdiv(ng, gpp), B)
        self.launch = PlannedLaunch(
            _dequant_kernel, grid, SLOT, cst[0], cst[1], SLOT, sst[0], ssm, ssg, SLOT, SLOT,
            os_[0], os_[1], M, K, ng_pad, 1, GS=gs, GB=gb, GPP=gpp,
            BLOCK_M=bm, SF_LAYOUT=SF_LAYOUT[q.scale_layout], PER_TENSOR=False,
            TWO_LEVEL=self.two_level, OUT=_OUT[dtype],
            num_warps=num_warps or T._DQ_WARPS, **ce)

    def __call__(self, q) -> torch.Tensor:
        codes = q.codes if self.codes_direct else q.codes.reshape(self.codes3)
        s = q.scales if self.s_direct else q.scales.reshape(self.s_shape)
        out = _alloc(self.shape, dtype=self.dtype, device=self.dev)
        if self.per_tensor:
            self.launch(codes, s, s, out)
        else:
            self.launch(codes, s, q.global_scale if self.two_level else s, out)
        return out
