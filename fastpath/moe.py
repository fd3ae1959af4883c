"""The fused-MoE layer on the GPU: ``prepare -> grouped GEMM1 -> activation (+ quantization) -> grouped
GEMM2 -> weight-and-reduce``, the semantics of :func:`moeref.moe.fused_moe`, contiguous layout.

Stages (each an existing fast path or :mod:`fastpath.grouped_gemm`):

1. input quantization (``quant.a1``: FP8 1x128 FP32 scales, :func:`fastpath.quant.quantize`) of the token
   rows, then the DeepGEMM contiguous layout (:func:`fastpath.dispatch.to_contiguous`: counting sort,
   ``alignment``-row expert segments, ``m_indices`` with -1 padding, ``src`` slot per row); the token rows
   (codes and scales) are scattered to their slots' rows for DeepGEMM, padding rows are left unwritten
   (DeepGEMM's contract leaves their outputs unspecified; rows are independent in both GEMMs), while the
   Triton kernel reads them through ``src`` (no scatter);
2. GEMM1 ``h = a @ W13[e].T`` (``impl``: ``"triton"`` or ``"deep_gemm"``), stored bf16;
3. activation in FP32 and, for FP8 layers, the 1x128 re-quantization in the same kernel
   (:func:`fastpath.fused.silu_and_mul_quant_fp8`, :func:`fastpath.fused.gelu_and_mul_quant_fp8`,
   :func:`fastpath.fused.swigluoai_quant_fp8`, tiles of padding rows skipped through ``skip_rows=src``); float
   layers keep the activation in bf16 (:func:`fastpath.fused.silu_and_mul` / ``gelu_and_mul`` / ``swigluoai``);
4. GEMM2 ``y = xq @ W2[e].T``, stored bf16;
5. ``out[t] = sum_j w[t, j] y[slot t*k+j]`` (:func:`fastpath.dispatch.weight_and_reduce`, FP32 sum in
   slot order), stored in ``out_dtype``.

The arithmetic it declares, for :func:`moeref.compare.compare` against the reference
(:func:`reference_config` gives the matching ``run_moe`` arguments): FP8 layers, profile
``HOPPER_FP8_DEEPGEMM_DATA`` with ``gemm1_out_dtype="bfloat16"``, ``act_out_dtype="float32"`` (the fused
kernel quantizes its FP32 activation) and the same a1/a2 schemes; float layers ``BF16_OUTPUT`` with bf16
GEMM and activation stores in the weights' dtype. Layouts ``"contiguous"`` (prefill) and ``"masked"`` (decode: DeepGEMM's
``m_grouped_fp8_gemm_nt_masked``, or the Triton kernel over the ``E x max_m`` rows); ``expert_map`` (EP:
the local experts' rows only; non-local slots contribute 0); token chunks (``chunk_size``); biases (added
in FP32 in the Triton kernel's epilogue; DeepGEMM has none and refuses them); shared experts (one more
expert, weight 1, added to the routed FP32 sum). 4-bit weights (:class:`fastpath.grouped_gemm_w4.W4Experts`:
MXFP4 incl. gpt-oss checkpoints, NVFP4, INT4 groups) run W4A16: bf16 hidden states, GEMM outputs and activation
stored bf16, profile ``BF16_OUTPUT`` (float32 hidden states, the CI path: float32 stores, ``FP32_ACCUM``);
``impl="triton"`` only; with ``w4_activations="float8_e4m3fn"`` (W4A8) the a1/a2 FP8 1x128 quantization of
the FP8 layer, profile ``BF16_OUTPUT_FP32_ACT``.

Activations (:data:`ACTIVATIONS`): ``silu_and_mul`` and ``gelu_and_mul`` (w13 ``gate_up``) and ``swigluoai``
(w13 ``interleaved``, ``activation_params`` ``alpha``, ``limit``). GELU follows
:func:`moeref.activations.gelu_and_mul`: ``activation_params={"approximate": "none"}`` (the default: erf,
``0.5 g (1 + erf(g / sqrt 2))``, PyTorch ``F.gelu`` and vLLM ``gelu_and_mul``) or ``{"approximate": "tanh"}``
(PyTorch's ``approximate="tanh"``, vLLM ``gelu_tanh_and_mul``), in float32 as
:func:`fastpath.quant._jit_codes._gelu` evaluates it (libdevice's ``erf``, which may differ from torch's by an
ulp or two; the tanh form through ``sigmoid(2 z)``). Every activation is evaluated within a few float32 ulps
of ``|gate| |up|``: erf GELU within about 2 (CUDA's 2-ulp ``erff``, the argument's and the three products'
roundings), tanh GELU within about 8 (the fast ``exp`` of the sigmoid, as SiLU); under Triton's interpreter
both measure below 3. That is inside the ``act_unit`` of 16 float32 ulps of ``|x| + |gate| |up|`` that every
profile :func:`reference_config` declares (:mod:`moeref.compare.bounds`, stage 3), so the declarations hold for
GELU as for SiLU.

Router weight on the input (``apply_router_weight_on_input=True``, top-1 only, as the reference and vLLM, whose
kernels serve it for ``top_k == 1`` only, Llama 4): the reference's semantics (:func:`moeref.moe.fused_moe`,
vLLM ``torch_experts``): each token row is multiplied by its weight and rounded once to float32
(:func:`fastpath.dispatch.apply_router_weight_on_input`) before the a1 quantization, and the reduce sums
the rows with unit weights (the reduce kernel's ``apply_weights=False``); shared experts take the unweighted
rows. FP8 activations quantize that float32 row; float and W4A16 layers hand it to the GEMM in their operand
dtype (bf16/fp16: one more rounding, which :func:`reference_config` declares as the a1 store, as vLLM's
``torch_experts`` keeps ``a * w`` in the activation dtype; float32: none).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from moeref.gemm import StackedExperts

from ._graph_cache import GraphCache, GraphEntry, weights_signature
from .grouped_gemm import EXACT_PROFILE_OF, PROFILE_OF, GemmTiles, grouped_gemm_contiguous, grouped_gemm_supports
from .grouped_gemm_w4 import PROFILE_OF as W4_PROFILE_OF
from .grouped_gemm_w4 import W4Experts, w4_supports

__all__ = ["FastMoEWeights", "fused_moe", "reference_config", "fast_weights", "stored_as", "exact_profile",
           "clear_graph_cache", "graph_cache_info", "gemm_tiles"]

ACTIVATIONS = ("silu_and_mul", "gelu_and_mul", "swigluoai")
"""The activations with a GPU layer (module docstring)."""


@dataclass(frozen=True, eq=False)
class FastMoEWeights:
    """Expert weights as the GPU kernels take them: ``w13 [E, 2N, K]`` and ``w2 [E, K, N]``, either bf16/fp16/fp32
    tensors or float8_e4m3fn with FP32 128x128 block scales ``w13_scales [E, 2N/128, K/128]``,
    ``w2_scales [E, K/128, N/128]`` (DeepGEMM's and vLLM's ``w1``/``w1_scale``), or both
    :class:`fastpath.grouped_gemm_w4.W4Experts` (MXFP4, NVFP4, INT4 groups: the W4A16 layer); optional
    float32 biases ``b13 [E, 2N]``, ``b2 [E, K]``."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_layout: str
    w13_scales: torch.Tensor | None = None
    w2_scales: torch.Tensor | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    w4_activations: str = "bfloat16"
    """4-bit layers: ``"bfloat16"`` (W4A16) or ``"float8_e4m3fn"`` (W4A8: a1 and a2 quantized FP8 1x128 with FP32
    scales, as the FP8 layer does; the activation is quantized from FP32 in the fused kernel)."""

    def __post_init__(self):
        if isinstance(self.w13, W4Experts) != isinstance(self.w2, W4Experts):
            raise ValueError("w13 and w2 must both be 4-bit W4Experts or both tensors (mixed layers have no kernel)")
        if self.w4_activations not in ("bfloat16", "float8_e4m3fn"):
            raise ValueError(f"w4_activations must be 'bfloat16' or 'float8_e4m3fn'; got {self.w4_activations!r}")

    @property
    def fp8_activations(self) -> bool:
        """Activations quantized FP8 1x128 (FP8 layers, and 4-bit layers with ``w4_activations`` FP8)."""
        return self.fp8 or (self.w4 and self.w4_activations == "float8_e4m3fn")

    @property
    def w4(self) -> bool:
        """4-bit weights (:class:`fastpath.grouped_gemm_w4.W4Experts`), run with bf16 activations (W4A16)."""
        return isinstance(self.w13, W4Experts)

    @property
    def fp8(self) -> bool:
        return not self.w4 and self.w13.dtype == torch.float8_e4m3fn

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])


def fast_weights(weights, device="cuda", *, w4_activations: str = "bfloat16") -> FastMoEWeights:
    """:class:`FastMoEWeights` from a :class:`moeref.moe.MoEWeights` (or :class:`moeref.moe.SharedExperts`)
    whose stacks are FP8 128x128 quantized experts with float32-representable scales, 4-bit experts (MXFP4,
    NVFP4, INT4 groups: :meth:`fastpath.grouped_gemm_w4.W4Experts.from_quantized`; ``w4_activations`` picks
    W4A16 or W4A8), or float arrays."""
    if hasattr(weights, "as_weights"):
        weights = weights.as_weights()

    def one(ws):
        if isinstance(ws, W4Experts):
            return ws.to(device), None
        if isinstance(ws, (list, tuple)) and ws and hasattr(ws[0], "scheme") and ws[0].scheme.element in _W4_ELEMENTS:
            return W4Experts.from_quantized(ws, device), None
        if isinstance(ws, list) and ws and hasattr(ws[0], "codes"):
            ws = StackedExperts.from_quantized(ws)
        if isinstance(ws, StackedExperts):
            if ws.element != "e4m3fn" or ws.block != (128, 128):
                raise ValueError(f"the GPU layer takes E4M3 128x128 experts; got {ws.element} blocks {ws.block}")
            d = ws.to(device)
            s32 = d.scales.to(torch.float32)
            if not torch.equal(s32.to(torch.float64), d.scales):
                raise ValueError("block scales are not FP32 values (global/channel factors have no kernel here)")
            return d.codes.view(torch.float8_e4m3fn), s32
        if torch.is_tensor(ws):
            return ws.to(device), None
        return torch.stack([torch.as_tensor(np.asarray(w)) for w in ws]).to(device), None

    def bias(b):
        return None if b is None else torch.as_tensor(np.asarray(b, dtype=np.float32)).to(device)

    w13, s13 = one(weights.w13)
    w2, s2 = one(weights.w2)
    return FastMoEWeights(w13, w2, weights.w13_layout, s13, s2, bias(weights.b13), bias(weights.b2),
                          w4_activations=w4_activations)


_W4_ELEMENTS = ("e2m1", "int4", "uint4")


def reference_config(weights: FastMoEWeights, *, apply_router_weight_on_input: bool = False) -> dict:
    """The :func:`moeref.moe.run_moe` keyword arguments whose declared stores match this layer, and the
    :mod:`moeref.compare` profile name under ``"profile"`` (4-bit layers: for bf16 hidden states; float32
    hidden states store in float32 under ``FP32_ACCUM``), for every activation of :data:`ACTIVATIONS` (their
    float32 evaluation is inside the profiles' ``act_unit``: module docstring).
    ``apply_router_weight_on_input``: the layer run with it; for bf16/fp16 GEMM operands the weighted float32
    rows are declared stored in that dtype (an a1 quantizer that rounds them, :func:`stored_as`; module
    docstring)."""
    from moeref.moe import MoEQuant
    from moeref.quant import fp8_group

    on_input = dict(apply_router_weight_on_input=True) if apply_router_weight_on_input else {}
    if weights.fp8_activations:
        q = MoEQuant(fp8_group(), fp8_group(), "fp8 1x128")
        return dict(quant=q, gemm1_out_dtype="bfloat16", act_out_dtype="float32", out_dtype="bfloat16",
                    profile="HOPPER_FP8_DEEPGEMM_DATA" if weights.fp8 else "BF16_OUTPUT_FP32_ACT", **on_input)
    # W4A16: bf16 activations, GEMM outputs and activation stored bf16 (W4A8: above); float layers store the
    # GEMM operand, h and x in the weights' dtype
    store = "bfloat16" if weights.w4 else str(weights.w13.dtype).replace("torch.", "")
    if on_input and store != "float32":
        on_input["quant"] = MoEQuant(stored_as(store), None, f"weighted input stored {store}")
    profile = W4_PROFILE_OF[("triton", weights.w13.kind)] if weights.w4 else "BF16_OUTPUT"
    return dict(gemm1_out_dtype=store, act_out_dtype=store, out_dtype="bfloat16", profile=profile, **on_input)


def stored_as(dtype: str):
    """An a1 quantizer function of the reference (:class:`moeref.moe.Quantizer`) that rounds its float rows
    to ``dtype`` (RNE, :func:`moeref.moe.round_to_dtype`): the store of the router-weighted input in a bf16/fp16
    GEMM operand."""
    from moeref.moe import round_to_dtype

    def store(x):
        return round_to_dtype(x, dtype)

    store.__name__ = f"stored_{dtype}"
    return store


LAYOUTS = ("contiguous", "masked")


GRAPH_CACHE = GraphCache(size=16)
"""The graph cache of eager :func:`fused_moe` calls (:mod:`fastpath._graph_cache`): at most ``GRAPH_CACHE.size``
captured calls (16; set it to 0 to turn the cache off in the whole process), least recently used evicted; a
key is captured on its second call (``GRAPH_CACHE.capture_after``)."""
GRAPH_CACHE_MAX_TOKENS = 64
"""The most tokens an eager call has for the graph cache to serve it (decode sizes: the host time of a call is
about constant, its GPU time grows with the tokens; past a few dozen tokens the call is GPU-bound)."""
_GRAPH_POOLS: dict = {}
"""One CUDA graph memory pool per (device, stream) for the cache's graphs (their replays on one stream never
overlap, so one graph's intermediate buffers can reuse another's)."""


def clear_graph_cache() -> None:
    """Drop every graph of :func:`fused_moe`'s graph cache (and the memory its buffers hold)."""
    GRAPH_CACHE.clear()


def graph_cache_info() -> dict:
    """Counts of :func:`fused_moe`'s graph cache: ``entries``, ``size``, ``hits``, ``misses``, ``captures``,
    ``evictions``, ``failures`` (why a capture failed; such a call runs uncached)."""
    return GRAPH_CACHE.info()


def fused_moe(hidden: torch.Tensor, weights: FastMoEWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              impl: str = "triton", activation: str = "silu_and_mul", activation_params: dict | None = None,
              layout: str = "contiguous", alignment: int = 128, max_m: int | None = None, out_dtype=torch.bfloat16,
              expert_map=None, num_experts: int | None = None, chunk_size: int | None = None,
              shared_experts: FastMoEWeights | None = None,
              apply_router_weight_on_input: bool = False, capturable: bool = False,
              graph_cache: bool = True, tiles=None) -> torch.Tensor:
    """The MoE layer on the GPU (module docstring). ``hidden`` ``[M, K]`` (bf16 for the FP8 layer; the weights'
    dtype for float layers), ``topk_weights`` float ``[M, k]``, ``topk_ids`` int ``[M, k]`` (-1 padding; global
    ids with ``expert_map``). Returns ``out_dtype [M, K]``.

    ``capturable=False`` (default): ``topk_ids`` (and a device ``expert_map``) are checked once on the host
    as the reference checks them (one sync; ``ValueError``), and the layout buffers are sized from the
    expert counts (one sync per chunk: contiguous ``m_sum="tight"``, masked ``max_m`` = the largest count
    unless given). ``capturable=True``: no host synchronisation at all, so the call can be captured in a
    CUDA graph (vLLM's and SGLang's decode): the ids are not checked (invalid ids are undefined behaviour,
    as in vLLM's kernels), the contiguous buffer has vLLM's worst-case size ``round_up(M*k + E*(alignment-1),
    alignment)`` rows (the extra tiles are padding, skipped by both GEMMs), the masked layout a capacity of
    ``max_m`` (default: the chunk's tokens) with ``expected_m = ceil(M*k / E)``; an ``expert_map`` is
    refused (the dispatch uploads it per call). The result is the same bits either way.

    ``graph_cache=True`` (default): an eager call at decode sizes (CUDA tensors, ``1 <= M <=``
    :data:`GRAPH_CACHE_MAX_TOKENS`, no ``expert_map``, the current stream not capturing a graph, no launch
    hooks, the default allocator) is served from a per-key CUDA graph of its ``capturable=True`` form
    (:data:`GRAPH_CACHE`, :mod:`fastpath._graph_cache`): from a key's second call on, the inputs are copied
    into the graph's buffers, the graph is replayed and its output copied into a fresh tensor. The key is the
    options, the inputs' shapes and dtypes, the device, the current stream, and the weights objects with the
    address, shape, strides and dtype of each of their tensors: weights written in place are read by the
    replay as by an eager call; another weights object is another key. The result is the same bits as the
    uncached call. ``capturable=False`` keeps its checks: the ids are checked on the host per call (the one
    sync left), and a masked call whose routing repeats an expert within a token runs uncached (its capacity
    is sized from the counts). ``graph_cache=False``: every call runs its launches.

    ``tiles`` (``impl="triton"``, FP8 and float weights): the Triton grouped GEMM's launch tiles
    (:class:`fastpath.grouped_gemm.GemmTiles`): None (default: :func:`fastpath.grouped_gemm.default_tiles` by
    rows per expert, the same for both GEMMs), one ``GemmTiles`` for both GEMMs, or a pair ``(gemm1, gemm2)``
    whose ``None`` entry takes the default (:func:`gemm_tiles`). Tiles change the speed, not the products: FP8
    tiles (``block_k`` 128) compute the same per-block products promoted in the same K order (bit equality
    of decode tiles: ``tests/test_grouped_gemm_decode.py``, ``bench/studies/decode_graph_sweep.py``); float
    operands sum K in ``block_k`` pieces, so another ``block_k`` may change the last bits."""
    opts = dict(impl=impl, activation=activation, activation_params=activation_params, layout=layout,
                alignment=alignment, max_m=max_m, out_dtype=out_dtype, num_experts=num_experts, chunk_size=chunk_size,
                shared_experts=shared_experts, apply_router_weight_on_input=apply_router_weight_on_input,
                tiles=gemm_tiles(tiles))
    if graph_cache and expert_map is None:
        key = _graph_key(hidden, weights, topk_weights, topk_ids, opts)
        if key is not None:
            return _graph_call(key, hidden, weights, topk_weights, topk_ids, opts, capturable)
    return _fused_moe(hidden, weights, topk_weights, topk_ids, expert_map=expert_map, capturable=capturable, **opts)


def graph_key(hidden, weights, topk_weights, topk_ids, opts: dict, stream: int) -> tuple:
    """The graph cache's key of a call (:func:`fused_moe`; ``opts``: its options but ``expert_map`` and
    ``capturable``, which the cached graph does not depend on): the inputs' shapes, dtypes and device, the
    ``stream``, the options (``tiles`` as :func:`gemm_tiles` gives them), and
    :func:`fastpath._graph_cache.weights_signature` of the weights and the shared experts. ``TypeError`` where a
    part is not hashable."""
    params = opts["activation_params"]
    key = (hidden.shape, hidden.dtype, hidden.device, stream, topk_weights.shape, topk_weights.dtype,
           topk_ids.shape, topk_ids.dtype, opts["impl"], opts["activation"],
           tuple(sorted(params.items())) if params else None, opts["layout"], opts["alignment"], opts["max_m"],
           opts["out_dtype"], opts["num_experts"], opts["chunk_size"], opts["apply_router_weight_on_input"],
           weights_signature(weights), weights_signature(opts["shared_experts"]), opts.get("tiles"))
    hash(key)
    return key


def _graph_key(hidden, weights, topk_weights, topk_ids, opts: dict):
    """:func:`graph_key` of a call the graph cache serves (:func:`fused_moe`'s docstring), else None."""
    if GRAPH_CACHE.size <= 0 or not (isinstance(hidden, torch.Tensor) and hidden.is_cuda and hidden.dim() == 2
                                     and isinstance(topk_weights, torch.Tensor)
                                     and isinstance(topk_ids, torch.Tensor)):
        return None
    m = int(hidden.shape[0])
    if not 1 <= m <= GRAPH_CACHE_MAX_TOKENS:
        return None
    max_m = opts["max_m"]
    if opts["layout"] == "masked" and max_m is not None and not (type(max_m) is int and max_m >= m):
        return None  # the capturable form needs max_m >= M (the uncached call checks the counts instead)
    from fastpath import _host

    if _host._ALLOCATOR is not torch.empty or _host._hooks_installed():
        return None  # poisoned buffers (tests) or launch hooks (profilers) see every call's own launches
    if hidden.device.index != torch.cuda.current_device() or torch.cuda.is_current_stream_capturing():
        return None
    try:
        return graph_key(hidden, weights, topk_weights, topk_ids, opts, torch.cuda.current_stream().cuda_stream)
    except (TypeError, AttributeError):  # an unhashable option or an unknown weights type: the uncached call
        return None


def _repeats_an_expert(ids: np.ndarray) -> bool:
    """Whether a row of ``ids`` names one expert (>= 0) twice."""
    s = np.sort(ids, axis=1)
    return bool(np.any((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)))


def _graph_call(key, hidden, weights, topk_weights, topk_ids, opts: dict, capturable: bool) -> torch.Tensor:
    """A call the graph cache serves: the replay of its entry, else the uncached call (and, on the key's
    second call, its capture)."""
    shared = opts["shared_experts"]
    objs = (weights,) if shared is None else (weights, shared)
    entry = GRAPH_CACHE.get(key, objs)
    if entry is not None and not capturable:  # the default call's check of the ids (the one host sync)
        from moeref._interop import to_numpy
        from moeref.routing.ids import check_topk_ids

        ids_host = check_topk_ids(to_numpy(topk_ids), entry.extra)
        if opts["layout"] == "masked" and _repeats_an_expert(ids_host):
            # the capturable form's capacity is the tokens: a repeated expert could overflow it; the uncached
            # call sizes the capacity from the counts
            return _fused_moe(hidden, weights, topk_weights, topk_ids, expert_map=None, capturable=False, **opts)
    if entry is not None:
        with GRAPH_CACHE.lock, torch.no_grad():  # one replay at a time; the copies record no autograd history
            x, tw, ids = entry.inputs
            x.copy_(hidden)
            tw.copy_(topk_weights)
            ids.copy_(topk_ids)
            entry.graph.replay()
            return entry.output.clone()
    out = _fused_moe(hidden, weights, topk_weights, topk_ids, expert_map=None, capturable=capturable, **opts)
    if GRAPH_CACHE.want_capture(key):
        if opts["layout"] == "masked" and not capturable:
            from moeref._interop import to_numpy

            if _repeats_an_expert(to_numpy(topk_ids)):
                return out  # the capturable form could overflow its capacity on these ids: no capture now
        _capture(key, hidden, weights, topk_weights, topk_ids, opts, objs)
    return out


def _graph_pool(device, stream: int):
    pool = _GRAPH_POOLS.get((device, stream))
    if pool is None:
        pool = _GRAPH_POOLS[(device, stream)] = torch.cuda.graph_pool_handle()
    return pool


def _capture(key, hidden, weights, topk_weights, topk_ids, opts: dict, objs) -> None:
    """Capture the ``capturable=True`` form of the call in a CUDA graph reading its own input buffers (two
    warm-up calls first, on a side stream, as ``torch.cuda.graph`` asks: they compile the kernels and record
    the launch plans) and store it in :data:`GRAPH_CACHE`. A failure is recorded (the key then runs
    uncached) and reported once as a ``RuntimeWarning``."""
    dev = hidden.device
    bufs = tuple(torch.empty(t.shape, dtype=t.dtype, device=dev) for t in (hidden, topk_weights, topk_ids))
    for b, t in zip(bufs, (hidden, topk_weights, topk_ids)):
        b.copy_(t)
    x, tw, ids = bufs

    def run():
        return _fused_moe(x, weights, tw, ids, expert_map=None, capturable=True, **opts)

    try:
        main = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=_graph_pool(dev, key[3]), capture_error_mode="thread_local"):
            out = run()
        num_experts = weights.num_experts if opts["num_experts"] is None else int(opts["num_experts"])
        GRAPH_CACHE.put(key, GraphEntry(graph, bufs, out, num_experts), objs)
    except Exception as e:  # noqa: BLE001 - any failure leaves the key uncached, with the reason recorded
        import warnings

        reason = f"{type(e).__name__}: {e}"[:300]
        GRAPH_CACHE.fail(key, reason)
        warnings.warn(f"fastpath.moe: the graph cache could not capture this call ({reason}); calls of this "
                      "shape run uncached", RuntimeWarning, stacklevel=4)


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
    chunk = m if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
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
    rows (FP8 codes and scales, or float rows) through the layout's ``src`` (``a_src``), and for DeepGEMM and
    the 4-bit kernels they are scattered to their slots' rows (:func:`fastpath.dispatch._scatter_rows`, each
    token read once, padding rows never written, as DeepGEMM leaves them unspecified); the reduce reads
    each slot's row through the slot -> row map that the dispatch's placement computed (``slot_rows=True``;
    inverted from ``src`` instead where the masked rows are padded here), with the kernel of
    :func:`fastpath.dispatch.weight_and_reduce` (whose host check that each slot appears once is skipped:
    the layout holds each slot once by construction).

    Decode sizes: the capturable contiguous layout is cut to the rows any routing of its slots can use
    (:func:`_used_rows_bound`; vLLM's worst-case buffer is sized for every expert's padding, which the
    GEMMs' and the activation's grids would otherwise cover), and the masked capacity is rounded to the
    row tile of the GEMM that reads it (16 rows for the Triton kernel, whose masked grid covers at most
    ``min(E, m * top_k)`` experts; 128 for DeepGEMM)."""
    from fastpath import dispatch
    from fastpath._dispatch_kernels import _invert_kernel
    from fastpath._host import alloc, cdiv, launch
    from fastpath.fused import gelu_and_mul_quant_fp8, silu_and_mul_quant_fp8, swigluoai_quant_fp8
    from fastpath.grouped_gemm import default_tiles, grouped_gemm_masked
    from fastpath.quant import quantize

    m, k = (int(d) for d in x.shape)
    top_k = int(topk_ids.shape[1])
    expected_m = max(1, -(-m * top_k // num_experts))  # rows per expert on average (host ints: no sync)
    if weight_on_input:  # top-1 (checked): the float32 rows x * w; the reduce then sums (module docstring)
        x = dispatch.apply_router_weight_on_input(x, topk_weights)
    scheme = _activation_scheme()
    gather = impl == "triton" and not weights.w4  # GEMM1 reads the token rows through src: no scatter
    side = None
    if weights.fp8_activations and gather and x.is_cuda and torch.cuda.is_current_stream_capturing():
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
    if src.numel() == 0:  # no slot of this chunk is routed to a local expert (a host-known shape: no sync)
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

    tiles1 = tiles2 = None  # the Triton kernel's tiles: given (fused_moe's tiles), else by rows per expert
    if impl == "triton" and not weights.w4:
        default = default_tiles("fp8_block" if weights.fp8 else "float", expected_m, x.device.type, layout)
        tiles1, tiles2 = (default if t is None else t for t in tiles)
    h = gemm(a, weights.w13, sa, weights.w13_scales, weights.b13, tiles1, a_src=src if gather else None)
    if weights.fp8_activations:
        fused = {"silu_and_mul": silu_and_mul_quant_fp8, "gelu_and_mul": gelu_and_mul_quant_fp8,
                 "swigluoai": swigluoai_quant_fp8}[activation]
        fq = fused(h, scheme=scheme, skip_rows=src_flat, **act_kw)
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
    dispatch._reduce(y.reshape(n_rows, -1), dst, topk_weights, out, nvalid=n_rows, apply_weights=not weight_on_input)
    return out


def profile_of(impl: str, weights: FastMoEWeights) -> str:
    """The declared :mod:`moeref.compare` profile of ``impl`` on these weights."""
    if weights.w4:
        return "BF16_OUTPUT_FP32_ACT" if weights.fp8_activations else W4_PROFILE_OF[(impl, weights.w13.kind)]
    return PROFILE_OF[(impl, "fp8_block" if weights.fp8 else "float")]


def exact_profile(impl: str, weights: FastMoEWeights, *, apply_router_weight_on_input: bool = False):
    """The equality-level :class:`moeref.compare.Profile` of the FP8 layer through ``impl``
    (:data:`fastpath.grouped_gemm.EXACT_PROFILE_OF`: both GEMMs predicted bit for bit on Hopper) with the stores
    :func:`reference_config` declares (GEMM outputs, activation, output), for every activation of
    :data:`ACTIVATIONS` (``act_unit`` 16 float32 ulps, the activation's evaluation: module docstring).
    ``ValueError`` for layers without one (bf16 and 4-bit weights: their GEMMs are not emulated)."""
    from dataclasses import replace

    from moeref.compare.kernel_profiles import get_profile

    if not weights.fp8 or weights.w4 or (impl, "fp8_block") not in EXACT_PROFILE_OF:
        raise ValueError(f"no emulated profile for impl {impl!r} on these weights (FP8 block weights through "
                         f"{sorted(i for i, _ in EXACT_PROFILE_OF)} only)")
    cfg = reference_config(weights, apply_router_weight_on_input=apply_router_weight_on_input)
    return replace(get_profile(EXACT_PROFILE_OF[(impl, "fp8_block")]), gemm_out_dtype=cfg["gemm1_out_dtype"],
                   act_out_dtype=cfg["act_out_dtype"], out_dtype=cfg["out_dtype"])
