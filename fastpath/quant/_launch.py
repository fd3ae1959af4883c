"""Host-side launch helpers of :mod:`fastpath.quant`: how the input is viewed, the tensor amax
pass, NVFP4's tensor factors (dynamic and static global scales), the constexprs and register
cap of a :func:`~fastpath.quant._kernels._quant_kernel` launch, and the looped per-token launch;
the launches are :class:`fastpath._host.PlannedLaunch` objects a per-call plan keeps (issue 20).
"""
from __future__ import annotations

import functools

import torch

from moeref.quant.scheme import Scheme

from .._host import alloc as _alloc  # every buffer the kernels write (the tests' poisoning hook)
from .._host import SLOT, PlannedLaunch, cdiv, launch
from .._host import next_pow2 as _next_pow2
from . import _preset_map as P
from . import _tiles as T
from ._kernels import _amax_final_kernel, _amax_partial_kernel, _nvfp4_factors, _row_loop_kernel


def _pair_view(x3: torch.Tensor, want_pairs: bool):
    """(tensor to pass, PAIR, IN16): int32 words of 16-bit pairs when possible (PAIR 1), else the
    generic split tile (PAIR 2) where pairs are needed, else plain tiles (PAIR 0)."""
    if not want_pairs:
        return x3, 0, 0
    ok = (x3.dtype in (torch.bfloat16, torch.float16) and x3.stride(2) == 1 and x3.shape[2] % 2 == 0
          and x3.stride(1) % 2 == 0 and x3.stride(0) % 2 == 0 and x3.data_ptr() % 4 == 0)
    if ok:
        return x3.view(torch.int32), 1, 1 if x3.dtype == torch.bfloat16 else 2
    return x3, 2, 0


def _nvfp4_static_params(global_scale, scheme: Scheme, dev: torch.device | None = None):
    """Host side of a static NVFP4 global scale (no allocation, no device work).

    Returns ``("host", genc, gdec, glob, zero_tensor)`` for a real number:
    ``genc``/``gdec`` the float32 S_enc / decode scale the kernel's NVFP4 block rule reads (the
    preset's order uses one of them, as :func:`_nvfp4_factors` produces them), ``glob`` the
    reference's float64 decode factor, ``zero_tensor`` True when a static ``amax`` rounds to a
    float32 0 (the reference then treats x as an all-zero tensor). Or ``("device", t)`` for a
    one-element float32 tensor: validated as the number it holds when on the CPU, used as is on
    x's device (validating it there would cost a host sync).

    Validation is the reference's own: :func:`moeref.quant.nvfp4._static_value` (TypeError /
    ValueError for a non-real, non-positive or non-finite number), then
    :func:`moeref.quant.nvfp4._nvfp4_rule` on a one-block grid, which raises the reference's
    ValueError (with its reason) for a derived encode/decode scale that is zero or non-finite in
    float32, and yields ``glob``. The float32 factors are then ``_nvfp4_rule``'s global step in
    NumPy float32 (bit-identical to it).
    """
    if scheme.family != "nvfp4":
        raise ValueError(f"global_scale={global_scale!r} is the NVFP4 per-tensor factor; scheme "
                         f"{scheme.name!r} is of family {scheme.family!r} (for a static FP8/MX "
                         "scale pass scale=)")
    if isinstance(global_scale, torch.Tensor):
        t = global_scale
        if t.dtype != torch.float32 or t.numel() != 1:
            raise TypeError(f"global_scale tensor must hold one float32 value; got dtype {t.dtype}, "
                            f"shape {tuple(t.shape)}")
        if t.device.type == "cpu":
            _nvfp4_static_params(float(t.reshape(-1)[0]), scheme)  # the reference's checks
        elif dev is not None and t.device != torch.device(dev):
            raise ValueError(f"global_scale is on {t.device}, x on {dev}: pass it on x's "
                             "device (or on the CPU, or as a number)")
        return ("device", t)
    from moeref.quant.nvfp4 import _static_value

    return ("host",) + _nvfp4_static_host(_static_value(global_scale), scheme)


@functools.lru_cache(maxsize=64)
def _nvfp4_static_host(v: float, scheme: Scheme) -> tuple[float, float, float, bool]:
    """(genc, gdec, glob, zero_tensor) of a validated static value ``v`` (see
    :func:`_nvfp4_static_params`): :func:`moeref.quant.nvfp4.global_factors`, the reference's own
    per-tensor step (its float32 S_enc and decode scale, float64 ``glob``, and its ValueErrors);
    cached, a static scale being the same call after call (a refused value raises every time)."""
    from moeref.quant.nvfp4 import global_factors

    s_enc, pts, glob, zero = global_factors(scheme.preset, static=v)
    return float(s_enc), float(pts), float(glob), zero


def global_scale_supports(scheme: Scheme | None = None, x=None, global_scale=None, **_) -> tuple[bool, str]:
    """Whether :func:`quantize` accepts ``global_scale`` for ``scheme`` (NVFP4 only; a valid
    number or one-element float32 tensor), and why not: the ``supports`` of the registry's
    ``quantize``/``triton`` entry adds this to :func:`supports`."""
    if global_scale is None or scheme is None:
        return True, "ok"
    try:
        _nvfp4_static_params(global_scale, scheme, getattr(x, "device", None))
    except (TypeError, ValueError) as e:
        return False, str(e)
    return True, "ok"


def _nvfp4_static_factors(global_scale, scheme: Scheme, dev: torch.device):
    """(nv, glob, zero_tensor) for a static NVFP4 global scale (:func:`_nvfp4_static_params`):
    ``nv`` the float32 factor buffer of :func:`_nvfp4_factors` for the data kernel, ``glob`` the
    float64 ``[1]`` reference decode factor. A number costs one fill (``glob``, the caller's to
    keep): ``nv`` is made once per value and device (:func:`_nvfp4_static_nv`), no host sync;
    a device tensor no host sync either (``amax``: :func:`_nvfp4_factors` from it as a tensor
    amax; ``encode_scale`` / ``decode_scale``: from the tensor itself)."""
    params = _nvfp4_static_params(global_scale, scheme, dev)
    if params[0] == "host":
        _, s_enc, pts, glob, zero = params
        return (_nvfp4_static_nv(s_enc, pts, scheme, torch.device(dev)),
                torch.full((1,), glob, dtype=torch.float64, device=dev), zero)
    t = params[1].reshape(1).to(dev)
    if scheme.preset.option("global_convention") == "amax":  # the tensor amax, as if reduced
        return _nvfp4_device_globals(scheme, amax=t) + (False,)
    # the order reads only its own quantity (TE/FlashInfer S_enc, torchao pts)
    return _nvfp4_device_globals(scheme, quantity=t) + (False,)


@functools.lru_cache(maxsize=64)
def _nvfp4_static_nv(s_enc: float, pts: float, scheme: Scheme, dev: torch.device) -> torch.Tensor:
    """:func:`_nvfp4_factors`'s buffer for host float32 factors, made once per (value, scheme,
    device) and kept: read-only for the kernels, a static scale being the same call after call
    (so later calls launch nothing for it)."""
    src = torch.tensor([s_enc, pts], dtype=torch.float32).to(dev)
    nv = torch.empty(130, dtype=torch.float32, device=dev)
    unused = torch.empty(1, dtype=torch.float64, device=dev)
    launch(_nvfp4_factors, (1,), src, src[1:], nv, unused, 0, FROM_AMAX=False,
           ORDER=P.NVFP4_OP[scheme.preset.option("nvfp4_order")], GLOB=1, P_ITERS=0)
    return nv


def _tensor_amax(x3: torch.Tensor, nonfinite: int, per_matrix: bool) -> torch.Tensor:
    """float32 amax of ``|x3|`` on its device (``[B, M, K]``; the NaN policy ``nonfinite`` as
    the kernels' constexpr): one per matrix (``[B]``, per-tensor FP8) or one for the whole
    tensor (``[1]``, NVFP4). A partial-amax pass over [BM, BK] tiles, then a one-program
    reduction of the partials (:class:`AmaxPlan`)."""
    return AmaxPlan(tuple(int(d) for d in x3.shape), x3.stride(), nonfinite, per_matrix, x3.device)(x3)


class AmaxPlan:
    """The two launches of :func:`_tensor_amax` for one (shape, strides, NaN policy, device):
    ``plan(x)`` allocates the partials and the amax and launches both passes; ``x`` any tensor
    at the address of the ``[B, M, K]`` view with ``strides`` (the caller's x itself)."""

    __slots__ = ("nprog_total", "nprog", "n_out", "dev", "partial", "final")

    def __init__(self, shape3, strides, nonfinite: int, per_matrix: bool, dev):
        B, M, K = shape3
        BKa = min(1024, _next_pow2(K))
        BMa = min(_next_pow2(M), max(1, T._AMAX_TILE // BKa))
        grid = (cdiv(M, BMa), cdiv(K, BKa), B)
        self.nprog = nprog = grid[0] * grid[1]  # partials per matrix
        self.nprog_total = B * nprog
        self.n_out = B if per_matrix else 1
        self.dev = dev
        self.partial = PlannedLaunch(_amax_partial_kernel, grid, SLOT, strides[0], strides[1], strides[2], SLOT,
                                     M, K, nprog, BLOCK_M=BMa, BLOCK_K=BKa, NONFINITE=nonfinite,
                                     num_warps=T._AMAX_WARPS)
        per_out = nprog if per_matrix else B * nprog  # partials per output amax
        self.final = PlannedLaunch(_amax_final_kernel, (self.n_out,), SLOT, SLOT, per_out, BLOCK=1024,
                                   ITERS=cdiv(per_out, 1024))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        part = self.partials(x)
        amax = _alloc(self.n_out, dtype=torch.float32, device=self.dev)
        self.final(part, amax)
        return amax

    def partials(self, x: torch.Tensor) -> torch.Tensor:
        """The first pass alone: int32 ``[B * nprog]`` partial amax bit patterns (matrix b's at
        ``b * nprog``), for a consumer kernel that reduces them itself."""
        part = _alloc(self.nprog_total, dtype=torch.int32, device=self.dev)
        self.partial(x, part)
        return part


def _nvfp4_device_globals(scheme: Scheme, amax=None, quantity=None):
    """(nv, glob) on the device: the float32 factor buffer the NVFP4 data pass reads
    (:func:`_nvfp4_factors`: S_enc, decode scale, the data factor of each UE4M3 code) and the
    reference's float64 decode factor. From a float32 ``[1]`` tensor ``amax`` (the reduced
    tensor amax, or a static amax tensor): :func:`moeref.quant.nvfp4.global_factors` on the
    device; or from a static ``quantity`` tensor in the preset's own convention (encode scale;
    torchao: decode scale), read as it is."""
    src = amax if amax is not None else quantity
    nv = _alloc(130, dtype=torch.float32, device=src.device)
    glob = _alloc(1, dtype=torch.float64, device=src.device)
    _factors_launch(scheme, amax is not None)(src, src, nv, glob)
    return nv, glob


@functools.lru_cache(maxsize=64)
def _factors_launch(scheme: Scheme, from_amax: bool, n_partials: int = 0) -> PlannedLaunch:
    """The :func:`_nvfp4_factors` launch of :func:`_nvfp4_device_globals` (slots: the two
    sources, nv, glob): the reference's float64 decode factor from the float32 quantity of the
    preset's convention. ``n_partials`` > 0: the sources are the amax pass's ``n_partials``
    partials (:meth:`AmaxPlan.partials`), reduced by the factors kernel itself."""
    order = P.NVFP4_OP[scheme.preset.option("nvfp4_order")]
    return PlannedLaunch(_nvfp4_factors, (1,), SLOT, SLOT, SLOT, SLOT, n_partials, FROM_AMAX=from_amax, ORDER=order,
                         GLOB=_nvfp4_glob_kind(scheme, from_amax), P_ITERS=cdiv(n_partials, 1024))


def _nvfp4_glob_kind(scheme: Scheme, from_amax: bool) -> int:
    """:func:`_nvfp4_factors`' ``GLOB``: how the reference's float64 decode factor comes from the
    float32 quantity of the preset's convention (0 the tensor amax, 1 torchao's pts, 2 1/S_enc)."""
    if from_amax and scheme.preset.option("global_convention") == "amax":
        return 0
    return 1 if P.NVFP4_OP[scheme.preset.option("nvfp4_order")] == 2 else 2


def _signed_zero_codes(x3: torch.Tensor, te: bool) -> torch.Tensor:
    """Packed E2M1 codes of ``x * 0`` (the reference's all-zero data factor): 0x0, or 0x8 for a
    negative x (sign bit set) except under TE's order (an exact zero product is 0x0)."""
    B, M, K = x3.shape
    s = torch.zeros((B, M, K + K % 2), dtype=torch.uint8, device=x3.device)
    if not te:
        s[..., :K] = torch.signbit(x3).to(torch.uint8) * 8
    return s[..., 0::2] | (s[..., 1::2] << 4)


def _launch_knobs(ce: dict, gb: int, gpp: int, bm: int, num_warps: int | None,
                  tuning: T.QuantTuning = T.DEFAULT_TUNING) -> dict:
    """``num_warps`` and the constexprs of a :func:`~fastpath.quant._kernels._quant_kernel`
    launch, with ``tuning``'s word runs, lane encode switch and register cap. The packed-bf16 FP4
    encode (``PACKED_BF16``) groups four int32 words per asm call; it is kept only where every
    thread holds at least four words of the tile (tiles and thread counts are powers of two, so
    then a multiple of four): with fewer, Triton pads the packed call and the bytes came out
    wrong (H200, 2026-11-21, 2-element blocks on 64-word tiles)."""
    nw = T._warps(gb, gpp, bm, num_warps, ce["ELEM"] != 2)
    if ce.get("PACKED_BF16") and bm * gpp * max(gb // 2, 1) < 4 * 32 * nw:
        ce = dict(ce, PACKED_BF16=False)
    if not tuning.e2m1_ptx and ce.get("E2M1_PTX"):
        ce = dict(ce, E2M1_PTX=False)
    knobs = dict(ce, num_warps=nw, WORD_RUN=tuning.word_run(ce["SCALE_KIND"]))
    if tuning.maxnreg is not None and not P._INTERPRETED:
        knobs["maxnreg"] = tuning.maxnreg
    return knobs


def _row_loop_launch(shape3, x_strides, c_strides, ssb, ssm, m_pad, static_t, static, ce, block_m,
                     num_warps, tuning: T.QuantTuning = T.DEFAULT_TUNING) -> PlannedLaunch:
    """The looped one-scale-per-row kernel's launch on its tile (``tuning.row_loop_tile``;
    ``block_m`` and ``num_warps`` override its rows and warps); slots: x, codes, scales."""
    B, M, K = shape3
    bm, bk, nw = tuning.row_loop_tile
    bm = block_m or bm
    grid = (cdiv(m_pad, bm), B)
    names = _row_loop_kernel.arg_names
    return PlannedLaunch(
        _row_loop_kernel, grid,
        SLOT, x_strides[0], x_strides[1], x_strides[2], SLOT, c_strides[0], c_strides[1],
        SLOT, ssb, ssm, static_t, M, K, m_pad, BLOCK_M=bm, BLOCK_K=bk,
        K_ITERS=cdiv(K, bk), STATIC=static is not None, num_warps=num_warps or nw,
        **{k_: v_ for k_, v_ in ce.items() if k_ in names})
