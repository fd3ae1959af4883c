"""The fused-MoE layer on the GPU: ``prepare -> grouped GEMM1 -> activation (+ quantization) -> grouped
GEMM2 -> weight-and-reduce``, the semantics of :func:`moeref.moe.fused_moe`, contiguous layout.

Stages (each an existing fast path or :mod:`fastpath.grouped_gemm`):

1. input quantization (``quant.a1``: FP8 1x128 FP32 scales, :func:`fastpath.quant.quantize`) of the token
   rows, then the DeepGEMM contiguous layout (:func:`fastpath.dispatch.to_contiguous`: counting sort,
   ``alignment``-row expert segments, ``m_indices`` with -1 padding, ``src`` slot per row); the token rows
   (codes and scales) are scattered to their slots' rows for DeepGEMM, padding rows are left unwritten
   (DeepGEMM's contract leaves their outputs unspecified; rows are independent in both GEMMs), and for the
   Triton layer's Gluon GEMM1 (FP8 prefill in the contiguous layout on a Hopper GPU:
   :data:`fastpath._moe_layer.GEMM1_SCATTER_FOR_GLUON`), while the Triton kernel's other tiles read them through
   ``src`` (no scatter);
2. GEMM1 ``h = a @ W13[e].T`` (``impl``: ``"triton"`` or ``"deep_gemm"``), stored bf16;
3. activation in FP32 and, for FP8 layers, the 1x128 re-quantization in the same kernel
   (:func:`fastpath.fused.silu_and_mul_quant_fp8`, :func:`fastpath.fused.gelu_and_mul_quant_fp8`,
   :func:`fastpath.fused.swigluoai_quant_fp8`, tiles of padding rows skipped through ``skip_rows=src``; at
   decode sizes only the routed rows, through ``rows=`` the slot -> row map:
   :data:`fastpath._moe_layer.ACT_ROUTED_ROWS_AT_DECODE`); float
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

import numpy as np
import torch

from ._graph_cache import GraphCache, GraphEntry, weights_signature
from ._moe_layer import ACTIVATIONS, LAYOUTS, _fused_moe, gemm_tiles
from ._moe_weights import FastMoEWeights, exact_profile, fast_weights, profile_of, reference_config, stored_as

__all__ = ["FastMoEWeights", "fused_moe", "reference_config", "fast_weights", "stored_as", "exact_profile",
           "clear_graph_cache", "graph_cache_info", "gemm_tiles"]

# Re-exported from fastpath._moe_weights (the weights, their reference arguments and profiles) and
# fastpath._moe_layer (the layer without the graph cache); the graph cache's plumbing is below.

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
