"""The layer of :func:`fastpath.moe.fused_moe` without its graph cache: :func:`_fused_moe` (the checks and the
token chunks) and :func:`_routed` (one chunk of the routed experts: quantization, dispatch, the two grouped GEMMs,
the activation, the reduce), with the activations and layouts it takes and the ``tiles`` argument's reading
(:func:`gemm_tiles`). The stages and their arithmetic: the module docstring of :mod:`fastpath.moe`, which
re-exports the public names."""
from __future__ import annotations

import functools

import numpy as np
import torch

from ._moe_weights import FastMoEWeights
from .grouped_gemm import GemmTiles, grouped_gemm_contiguous, grouped_gemm_supports
from .grouped_gemm_w4 import W4Experts, w4_supports

ACTIVATIONS = ("silu_and_mul", "gelu_and_mul", "swigluoai")
"""The activations with a GPU layer (module docstring)."""


LAYOUTS = ("contiguous", "masked")

ACT_ROUTED_ROWS_AT_DECODE = True
"""Whether the fused act+quant launch of an FP8 layer covers only the routed rows at decode sizes (at most
:data:`fastpath.grouped_gemm.DECODE_ROWS_PER_EXPERT` rows per expert on average): True gives it the slot -> row
map (``rows=`` of :func:`fastpath.fused.silu_and_mul_quant_fp8`: ``cdiv(m * top_k, block_m)`` row programs, each
gathering its rows), False the layout's row labels (``skip_rows=``: a program per tile of all the layout's rows,
the padding tiles returning at once; at 1 token of a 256-expert masked layout 4096 rows for 8 routed). The routed
rows' codes and scales are the same bits either way, and they are all that GEMM2 (a row's output depends on that
row alone) and the reduce (the slot -> row map) use; the padding rows are left unwritten. A cached graph keeps the
form it was captured with (``clear_graph_cache()`` after changing this)."""

ACT_ROUTED_ROWS_TILE: dict | None = None
"""The tile of the routed-rows act+quant launch (:data:`ACT_ROUTED_ROWS_AT_DECODE`): None the fused kernel's
(the device's own tile where it has one), else ``block_m``, ``groups_per_program``, ``num_warps`` as
:func:`fastpath.fused.silu_and_mul_quant_fp8` takes them (e.g. ``dict(block_m=1, groups_per_program=2,
num_warps=1)``: more, smaller programs over a few rows). The same bits with any tile (each row's 1x128 groups are
computed alone)."""


A1_QUANT_BRANCH = True
"""Whether, in a CUDA graph capture, the a1 quantization of the Triton FP8 layer (which does not depend on the
routing) runs on a side stream beside the dispatch, joined before GEMM1 (a parallel branch of the graph); False:
on the main stream before the dispatch. The same kernels, the same bits; which is faster depends on the
dispatch's length against the join's cost (``bench/studies/decode_graph_sweep.py --only decode_ab`` times
both). A cached graph keeps the form it was captured with."""

DECODE_PDL: tuple = ("gemm1", "act", "gemm2", "reduce")
"""The stages of a Triton FP8 layer at decode sizes (at most :data:`fastpath.grouped_gemm.DECODE_ROWS_PER_EXPERT`
rows per expert on average) launched with Programmatic Dependent Launch where it runs
(:func:`fastpath._host.pdl_available`; elsewhere ignored): any of ``"gemm1"``, ``"act"``, ``"gemm2"``,
``"reduce"``. Each such kernel may start while the kernel before it on the stream runs; its programs let the
kernel after them launch and wait for the kernel before them at their start (:func:`fastpath._host.pdl_launch`):
it saves part of each boundary's launch latency (a graph's kernel node
costs about 1.0 us, 0.67 us with PDL on an H200: ``node_floor`` of the decode sweep), the same arithmetic, the
same bits. ``"gemm1"`` follows the join of the a1 quantization branch (:data:`A1_QUANT_BRANCH`) in a graph.
All four by default: on an H200 (2026-11-29, 1 token of the DeepSeek-V3 layer, a graph of 4 calls) 104.3 us a
call against 106.8 without PDL, the same bits (``docs/data/decode_ab_h200_2026-11-29.json``); ``()`` turns it off.
Tiles given to ``fused_moe`` get ``pdl`` from here too. A cached graph keeps the form it was captured with."""

DECODE_PDL_STAGES = ("gemm1", "act", "gemm2", "reduce")

GEMM1_SCATTER_FOR_GLUON = True
"""Whether an FP8 Triton layer whose GEMM1 takes the Gluon kernel's tiles (prefill sizes, contiguous layout, a
Hopper GPU: :func:`fastpath.grouped_gemm.default_tiles` without ``gather``, or Gluon tiles given to ``fused_moe``)
scatters the token rows' codes and scales to their layout rows first (:func:`fastpath.dispatch._scatter_rows`, as
the DeepGEMM layer does) and runs the Gluon kernel on them; False: GEMM1 reads the token rows through ``a_src``
with the TMA tiles (the Gluon kernel loads A by TMA, which has no row gather). The same arithmetic, the same
bits."""


def _fused_moe(hidden: torch.Tensor, weights: FastMoEWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
               impl: str, activation: str, activation_params: dict | None, layout: str, alignment: int,
               max_m: int | None, out_dtype, expert_map, num_experts: int | None, chunk_size: int | None,
               shared_experts: FastMoEWeights | None, apply_router_weight_on_input: bool,
               capturable: bool, tiles=None) -> torch.Tensor:
    """:func:`fused_moe` without the graph cache: every launch of the call."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} has no GPU layer; supported: {ACTIVATIONS}")
    params = _activation_params(activation, activation_params)
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} has no GPU layer; supported: {LAYOUTS}")
    if apply_router_weight_on_input and int(topk_ids.shape[1]) != 1:
        raise ValueError("apply_router_weight_on_input needs top_k == 1 (weight-on-input is exact only then); "
                         f"got top_k={int(topk_ids.shape[1])}")
    for w in (weights,) if shared_experts is None else (weights, shared_experts):
        need = params.get("layout", "interleaved" if activation == "swigluoai" else "gate_up")
        if w.w13_layout != need:
            raise ValueError(f"the fused {activation} kernel reads w13 in the {need!r} layout; the weights are "
                             f"{w.w13_layout!r} (convert them with moeref.activations.convert_w13)")
    tiles = gemm_tiles(tiles)
    if tiles != (None, None) and (impl != "triton" or weights.w4
                                  or (shared_experts is not None and shared_experts.w4)):
        raise ValueError(f"tiles are the Triton FP8/float grouped GEMM's (GemmTiles); impl {impl!r} with "
                         f"{'4-bit' if weights.w4 else 'these'} weights takes none (got {tiles})")
    supports = w4_supports if weights.w4 else grouped_gemm_supports
    ok, why = supports(impl, alignment=alignment if layout == "contiguous" else None)
    if not ok:
        raise ValueError(why)
    if impl == "deep_gemm" and (weights.b13 is not None or weights.b2 is not None):
        raise ValueError("biases have no DeepGEMM epilogue: use impl='triton'")
    num_experts = weights.num_experts if num_experts is None else int(num_experts)
    if capturable and expert_map is not None:
        raise ValueError("capturable=True takes no expert_map yet (the dispatch uploads or counts the map on the "
                         "host per call): use capturable=False")
    if not capturable:  # the reference's checks, once for all chunks (the dispatch below does not repeat them)
        from moeref._interop import to_numpy
        from moeref.routing.ids import check_topk_ids

        check_topk_ids(to_numpy(topk_ids), num_experts)
        if torch.is_tensor(expert_map):
            expert_map = to_numpy(expert_map)  # a host map: the dispatch validates it, with no device count
    m = int(hidden.shape[0])
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    chunk = max(m, 1) if chunk_size is None else int(chunk_size)  # no tokens: one empty chunk
    kw = dict(impl=impl, activation=activation, act_kw={k: v for k, v in params.items() if k != "layout"},
              layout=layout, alignment=alignment, max_m=max_m, capturable=capturable, tiles=tiles)
    ids_all = topk_ids.to(hidden.device)
    tw_all = topk_weights.to(hidden.device)
    # without shared experts, each chunk's weighted sum is stored by the reduce kernel straight into its rows
    # of the output (float32, or bf16 rounded to nearest even in the kernel as .to(bfloat16) rounds): no
    # float32 copy of the output, no cat, no conversion pass (at 16384 tokens x 7168 these were 0.5 ms)
    result = None
    if shared_experts is None and out_dtype in (torch.float32, torch.bfloat16):
        from fastpath._host import alloc

        result = alloc((m, int(hidden.shape[1])), dtype=out_dtype, device=hidden.device)
    parts = []
    for s0 in range(0, max(m, 1), chunk):
        x = hidden[s0:s0 + chunk]
        out = _routed(x, weights, tw_all[s0:s0 + chunk], ids_all[s0:s0 + chunk], num_experts, expert_map,
                      weight_on_input=apply_router_weight_on_input,
                      into=None if result is None else result[s0:s0 + chunk], **kw)
        if shared_experts is not None:
            n = int(x.shape[0])
            ones = torch.ones((n, 1), dtype=torch.float32, device=x.device)
            zeros = torch.zeros((n, 1), dtype=torch.int32, device=x.device)
            out = out + _routed(x, shared_experts, ones, zeros, 1, None, **kw)
        if result is None:
            parts.append(out)
    if result is not None:
        return result
    return torch.cat(parts, dim=0).to(out_dtype)



def gemm_tiles(tiles) -> tuple:
    """``(gemm1, gemm2)`` of :func:`fused_moe`'s ``tiles``: None gives ``(None, None)`` (the defaults), one
    :class:`fastpath.grouped_gemm.GemmTiles` ``(t, t)``, a pair (list or tuple) of ``GemmTiles`` or None itself.
    ``TypeError`` for anything else, ``ValueError`` for a sequence that is not a pair."""
    if tiles is None:
        return (None, None)
    if isinstance(tiles, GemmTiles):
        return (tiles, tiles)
    if isinstance(tiles, (tuple, list)):
        if len(tiles) != 2:
            raise ValueError(f"tiles must be one GemmTiles or a pair (gemm1, gemm2); got {len(tiles)} entries")
        for i, t in enumerate(tiles):
            if t is not None and not isinstance(t, GemmTiles):
                raise TypeError(f"tiles[{i}] must be a GemmTiles or None; got {type(t).__name__}")
        return tuple(tiles)
    raise TypeError(f"tiles must be None, a GemmTiles or a pair (gemm1, gemm2) of them; got {type(tiles).__name__}")


def _activation_params(activation: str, activation_params) -> dict:
    """``activation_params`` checked as the reference checks them: the keyword arguments of the activation's
    function in :data:`moeref.activations.ACTIVATIONS` (``TypeError`` for another name, as
    :func:`moeref.activations.activation_values` raises; so a misspelt ``approximate`` never runs erf
    GELU silently) and GELU's ``approximate`` one of :data:`moeref.activations.GELU_APPROXIMATIONS`."""
    import inspect

    from moeref._checks import check_choice
    from moeref.activations import ACTIVATIONS as REFERENCE_ACTIVATIONS
    from moeref.activations import GELU_APPROXIMATIONS

    params = dict(activation_params or {})
    try:
        inspect.signature(REFERENCE_ACTIVATIONS[activation].function).bind(None, **params)
    except TypeError as e:
        raise TypeError(f"activation_params {sorted(params)} for {activation!r}: {e}") from None
    if activation == "gelu_and_mul":
        check_choice(params.get("approximate", "none"), GELU_APPROXIMATIONS, "approximate")
    return params


_SIDE: dict = {}
"""One side stream per device for the graph branch of :func:`_routed` (created on first capture)."""


@functools.lru_cache(maxsize=256)
def _activation_scheme():
    """The a1 / a2 scheme of the FP8 layer (FP8 E4M3 1x128, FP32 scales), made once: the quantizers keep
    their per-shape plans keyed by the scheme object (:mod:`fastpath.quant._plan`), so a scheme made per
    call would build the plans (block resolution, tiles, launch arguments) on every call."""
    from moeref.quant import fp8_group

    return fp8_group()


@functools.lru_cache(maxsize=256)
def _used_rows_bound(slots: int, num_experts: int, alignment: int) -> int:
    """Most rows the contiguous layout of ``slots`` slots over ``num_experts`` experts can use: each
    present expert's segment is its count rounded up to ``alignment``, at most ``alignment - 1`` rows
    of padding for each of at most ``min(num_experts, slots)`` present experts; past it every row is
    padding (vLLM's worst-case buffer counts the padding of all experts): vLLM's worst-case rule of
    :func:`moeref.dispatch.contiguous.contiguous_m_sum` over the experts that can be present."""
    from moeref.dispatch.contiguous import contiguous_m_sum

    return contiguous_m_sum(np.zeros(min(num_experts, slots)), alignment, "worst_case", num_slots=slots)


def _routed(x, weights: FastMoEWeights, topk_weights, topk_ids, num_experts, expert_map, *, impl, activation, act_kw,
            layout, alignment, max_m, capturable, weight_on_input: bool = False, into=None,
            tiles=(None, None)) -> torch.Tensor:
    """One chunk of the routed experts: float32 ``[m, K]`` (the weighted sum before the output store), or
    ``into`` (float32 or bfloat16 ``[m, K]``) with the sum stored in its dtype by the reduce kernel.

    Only the routed rows of the layout are written and read outside the GEMMs: the Triton GEMM1 reads the token
    rows (FP8 codes and scales, or float rows) through the layout's ``src`` (``a_src``), and for DeepGEMM, the
    4-bit kernels and a Gluon GEMM1 (:data:`GEMM1_SCATTER_FOR_GLUON`) they are scattered to their slots' rows
    (:func:`fastpath.dispatch._scatter_rows`, each token read once, padding rows never written, as DeepGEMM leaves
    them unspecified); the reduce reads
    each slot's row through the slot -> row map that the dispatch's placement computed (``slot_rows=True``;
    inverted from ``src`` instead where the masked rows are padded here), with the kernel of
    :func:`fastpath.dispatch.weight_and_reduce` (whose host check that each slot appears once is skipped:
    the layout holds each slot once by construction).

    Decode sizes: the capturable contiguous layout is cut to the rows any routing of its slots can use
    (:func:`_used_rows_bound`; vLLM's worst-case buffer is sized for every expert's padding, which the
    GEMMs' and the activation's grids would otherwise cover), and the masked capacity is rounded to the
    row tile of the GEMM that reads it (16 rows for the Triton kernel, whose masked grid covers at most
    ``min(E, m * top_k)`` experts; 128 for DeepGEMM). The FP8 act+quant launch covers the routed rows only at
    decode sizes (:data:`ACT_ROUTED_ROWS_AT_DECODE`), else every tile of the layout's rows with a routed row."""
    from fastpath import dispatch
    from fastpath._dispatch_kernels import _invert_kernel
    from fastpath._host import alloc, cdiv, launch
    from fastpath.fused import gelu_and_mul_quant_fp8, silu_and_mul_quant_fp8, swigluoai_quant_fp8
    from fastpath.grouped_gemm import DECODE_ROWS_PER_EXPERT, default_tiles, grouped_gemm_masked
    from fastpath.quant import quantize

    m, k = (int(d) for d in x.shape)
    top_k = int(topk_ids.shape[1])
    expected_m = max(1, -(-m * top_k // num_experts))  # rows per expert on average (host ints: no sync)
    if weight_on_input:  # top-1 (checked): the float32 rows x * w; the reduce then sums (module docstring)
        x = dispatch.apply_router_weight_on_input(x, topk_weights)
    scheme = _activation_scheme()
    gather = impl == "triton" and not weights.w4  # GEMM1 reads the token rows through src: no scatter
    if gather and GEMM1_SCATTER_FOR_GLUON and weights.fp8_activations and layout == "contiguous":
        t1 = tiles[0] if tiles[0] is not None else default_tiles("fp8_block", expected_m, x.device.type, layout,
                                                                  alignment=alignment)
        if t1.kernel == "gluon":  # the Gluon kernel reads layout rows: the token rows are scattered to them
            gather, tiles = False, (t1, tiles[1])  # GEMM1's tiles chosen here, not again below
    side = None
    if A1_QUANT_BRANCH and weights.fp8_activations and gather and x.is_cuda \
            and torch.cuda.is_current_stream_capturing():
        # in a CUDA graph the a1 quantization (independent of the routing) is a parallel branch beside the
        # dispatch's sort / rank / fill, joined before GEMM1: the same kernels and bits, one step shorter
        main = torch.cuda.current_stream(x.device)
        side = _SIDE.setdefault(x.device, torch.cuda.Stream(x.device))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            qa = quantize(x, scheme)
    m_idx = None
    if layout == "contiguous":
        lay, dst = dispatch.to_contiguous(None, topk_ids, num_experts, alignment, expert_map,
                                          m_sum="worst_case" if capturable else None, validate=False, slot_rows=True)
        src, m_idx = lay.src, lay.m_indices
        if capturable:  # rows past the most any routing of m * top_k slots uses are padding: never computed
            used = _used_rows_bound(m * top_k, num_experts, alignment)
            src, m_idx = src[:used], m_idx[:used]
    else:
        tile = 16 if gather else 128  # rows of each expert padded to the GEMM's row tile (Triton FP8/float: 16)
        if capturable:  # default capacity: the tokens, rounded up to the tile (no padding copy below)
            cap = -(-max(m, 1) // tile) * tile if max_m is None else int(max_m)
            lay, dst = dispatch.to_masked(None, topk_ids, num_experts, cap, expert_map,
                                          expected_m=expected_m, validate=False,
                                          slot_rows=True)
        else:
            lay, dst = dispatch.to_masked(None, topk_ids, num_experts, max_m, expert_map, validate=False,
                                          slot_rows=True)
        cap = int(lay.src.shape[1])
        pad = -(-cap // tile) * tile - cap
        src = lay.src
        if pad:  # the rows move (e * padded capacity + i): the slot -> row map is rebuilt from src below
            src, dst = torch.nn.functional.pad(lay.src, (0, pad), value=-1), None
    if side is not None:  # join the quantization branch (after the dispatch's launches, which it overlaps)
        main.wait_stream(side)
    if src.numel() == 0 or m == 0:  # no slot of this chunk is routed to a local expert (a host-known shape: no sync)
        return torch.zeros((m, k), dtype=torch.float32, device=x.device) if into is None else into.zero_()
    src_flat = src.reshape(-1)
    n_rows = int(src_flat.numel())
    if dst is None:
        dst = torch.full((m * top_k,), -1, dtype=torch.int32, device=x.device)  # slot -> row (-1: not local)
        launch(_invert_kernel, (cdiv(n_rows, 1024),), src_flat, dst, n_rows, BLOCK=1024)

    def to_rows(t):  # token rows [m, c] -> layout rows [n_rows, c] (bit copies; padding rows unwritten)
        out = alloc((n_rows, int(t.shape[1])), dtype=t.dtype, device=t.device)
        if m:
            dispatch._scatter_rows(t, dst, out, top_k)
        return out

    if weights.w4:  # W4A16 (float32 hidden states: the CI path, IEEE FP32 dot and float32 stores)
        store = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    else:
        store = torch.bfloat16 if weights.fp8 else weights.w13.dtype
    if weights.fp8_activations:
        if side is None:
            qa = quantize(x, scheme)
        codes, scales = qa.codes.reshape(m, k), qa.scales.reshape(m, -1)
        a, sa = (codes, scales) if gather else (to_rows(codes), to_rows(scales))
        a = a.view(torch.float8_e4m3fn)
    else:
        xs = x.to(store).contiguous()
        a, sa = (xs if gather else to_rows(xs)), None

    def gemm(a, b, sa, sb, bias, tiles, a_src=None):
        if isinstance(b, W4Experts):
            from fastpath.grouped_gemm_w4 import grouped_gemm_w4_contiguous, grouped_gemm_w4_masked

            if layout == "contiguous":
                return grouped_gemm_w4_contiguous(a, b, m_idx, impl=impl, a_scales=sa, alignment=alignment,
                                                  out_dtype=store, bias=bias, expected_m=expected_m)
            e, mm = (int(d) for d in src.shape)
            return grouped_gemm_w4_masked(a.reshape(e, mm, -1), b, lay.masked_m, impl=impl,
                                          a_scales=None if sa is None else sa.reshape(e, mm, -1), out_dtype=store,
                                          bias=bias, expected_m=expected_m).reshape(e * mm, -1)
        if layout == "contiguous":
            return grouped_gemm_contiguous(a, b, m_idx, impl=impl, a_scales=sa, b_scales=sb,
                                           alignment=alignment, out_dtype=store, bias=bias, tiles=tiles,
                                           psum=lay.psum, a_src=a_src, top_k=top_k)
        e, mm = (int(d) for d in src.shape)
        if a_src is None:
            a, sa = a.reshape(e, mm, -1), None if sa is None else sa.reshape(e, mm, -1)
        return grouped_gemm_masked(a, b, lay.masked_m, impl=impl, a_scales=sa, b_scales=sb,
                                   expected_m=lay.expected_m, out_dtype=store, bias=bias, tiles=tiles,
                                   max_groups=min(e, m * top_k), a_src=a_src, top_k=top_k).reshape(e * mm, -1)

    pdl = set()  # the stages launched with PDL (DECODE_PDL): FP8 Triton layers at decode sizes
    if DECODE_PDL and impl == "triton" and weights.fp8_activations and expected_m <= DECODE_ROWS_PER_EXPERT:
        bad = set(DECODE_PDL) - set(DECODE_PDL_STAGES)
        if bad:
            raise ValueError(f"DECODE_PDL names stages {sorted(bad)}; the stages are {DECODE_PDL_STAGES}")
        pdl = set(DECODE_PDL)
    tiles1 = tiles2 = None  # the Triton kernel's tiles: given (fused_moe's tiles), else by rows per expert
    if impl == "triton" and not weights.w4:
        kind = "fp8_block" if weights.fp8 else "float"  # GEMM1 reads gathered token rows where gather is set
        tiles1, tiles2 = (default_tiles(kind, expected_m, x.device.type, layout, gather=g, alignment=alignment)
                          if t is None else t for t, g in zip(tiles, (gather, False)))
        if pdl:
            from dataclasses import replace

            def plain(t):  # the one-tile-per-program Triton kernel takes pdl
                return not t.tile_loop and t.kernel == "triton"

            tiles1 = replace(tiles1, pdl=True) if "gemm1" in pdl and plain(tiles1) else tiles1
            tiles2 = replace(tiles2, pdl=True) if "gemm2" in pdl and plain(tiles2) else tiles2
    h = gemm(a, weights.w13, sa, weights.w13_scales, weights.b13, tiles1, a_src=src if gather else None)
    if weights.fp8_activations:
        fused = {"silu_and_mul": silu_and_mul_quant_fp8, "gelu_and_mul": gelu_and_mul_quant_fp8,
                 "swigluoai": swigluoai_quant_fp8}[activation]
        if ACT_ROUTED_ROWS_AT_DECODE and expected_m <= DECODE_ROWS_PER_EXPERT and 0 < m * top_k < n_rows:
            tile = ACT_ROUTED_ROWS_TILE or {}  # the routed rows only: a program per block of slots
            fq = fused(h, scheme=scheme, rows=dst, **tile, **act_kw, pdl="act" in pdl)
        else:
            fq = fused(h, scheme=scheme, skip_rows=src_flat, **act_kw, pdl="act" in pdl)
        n = int(h.shape[1]) // 2
        xq = fq.codes.reshape(-1, n).view(torch.float8_e4m3fn)
        sx = fq.scales.reshape(xq.shape[0], -1)
    else:
        from fastpath.fused import gelu_and_mul, silu_and_mul, swigluoai

        plain = {"silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul, "swigluoai": swigluoai}[activation]
        xq = plain(h, **act_kw).to(store)
        sx = None
    y = gemm(xq, weights.w2, sx, weights.w2_scales, weights.b2, tiles2)
    shape = (int(topk_weights.shape[0]), int(y.shape[-1]))
    if into is not None and tuple(into.shape) != shape:
        raise ValueError(f"the layer's output rows have shape {tuple(into.shape)}; the reduce gives {shape}")
    out = alloc(shape, dtype=torch.float32, device=y.device) if into is None else into
    dispatch._reduce(y.reshape(n_rows, -1), dst, topk_weights, out, nvalid=n_rows, apply_weights=not weight_on_input,
                     pdl="reduce" in pdl)
    return out
