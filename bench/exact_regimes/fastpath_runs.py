"""The exact-regime proof's ``fastpath.moe`` runs: the layer's weights as :func:`fastpath.moe.fused_moe` takes
them (:func:`fast_layer`), its implementations on a case (:func:`fastpath_runs`: Triton, and DeepGEMM on FP8
layers where ``deep_gemm`` imports; contiguous and masked, capturable or not), the same on EP shards
(:func:`fastpath_ep_runs`, :func:`shard_weights`), and the fault planted in ``fastpath.moe`` itself
(:data:`FASTPATH_FAULTS`)."""
from __future__ import annotations

from bench.exact_regimes.torch_layer import stack_weights

FASTPATH_FAULTS = ("fastpath_tanh_gelu",)
"""Faults planted in fastpath.moe itself (GPU only): the GELU layer run with tanh GELU where erf is declared."""


def fast_layer(lay, dev, dev_weights=None):
    """``(weights, shared experts or None)`` of ``lay`` as :func:`fastpath.moe.fused_moe` takes them, on ``dev``
    (stacked once per model; every case of the model's layer reuses them). ``dev_weights``: the layer's weights
    already stacked on ``dev`` (:func:`moeref.moe.device.device_weights`, the reference's): FP8 and bf16 layers
    use those tensors (no second host stack and upload); MXFP4 layers are packed from ``lay.weights``."""
    import torch

    from fastpath.moe import fast_weights

    weights = lay.weights
    if dev_weights is not None and not lay.scheme.startswith("mxfp4"):
        weights = dev_weights
    elif lay.scheme == "bf16":  # fastpath takes float experts as stacked tensors (MXFP4 and FP8: quantized tensors)
        from dataclasses import replace

        weights = replace(weights, w13=stack_weights(list(weights.w13), torch, dev),
                          w2=stack_weights(list(weights.w2), torch, dev))
    shared = None
    if lay.config.shared_experts is not None:
        shared = fast_weights(lay.config.shared_experts, dev)
    return fast_weights(weights, dev), shared


def deep_gemm_available() -> bool:
    """Whether ``deep_gemm`` imports (its rows run on FP8 layers only)."""
    return deep_gemm_version() != "absent"


def _fast_inputs(lay, dev):
    import torch

    return (torch.from_numpy(lay.hidden).to(dev).to(torch.bfloat16), torch.from_numpy(lay.topk_weights).to(dev),
            torch.from_numpy(lay.topk_ids).to(dev))


def _impls(lay) -> list:
    return ["triton"] + (["deep_gemm"] if lay.scheme.startswith("fp8") and deep_gemm_available() else [])


def fastpath_runs(lay, dev, activation_params=None, *, fast=None):
    """``{name: callable -> bf16 tensor}`` for fastpath.moe's implementations that can run here, with the layer's
    activation and ``activation_params`` (default: the layer's own, ``lay.config.activation_params``); ``fast``:
    :func:`fast_layer` of the layer's weights (default: made here)."""
    from fastpath.moe import fused_moe

    fw, shared = fast_layer(lay, dev) if fast is None else fast
    hidden, tw, ids = _fast_inputs(lay, dev)
    params = dict(lay.config.activation_params if activation_params is None else activation_params)
    runs = {}
    for impl in _impls(lay):
        for layout in ("contiguous", "masked"):
            for capturable in (False, True):
                name = f"fastpath.moe {impl} {layout}" + (" capturable" if capturable else "")
                runs[name] = (lambda impl=impl, layout=layout, capturable=capturable: fused_moe(
                    hidden, fw, tw, ids, impl=impl, activation=lay.config.activation, activation_params=params,
                    layout=layout, shared_experts=shared, capturable=capturable))
    return runs


def shard_weights(fw, experts):
    """The experts ``experts`` (int64 tensor of expert ids, on ``fw``'s device) of :class:`fastpath.moe.FastMoEWeights`
    ``fw``: every per-expert tensor (4-bit :class:`fastpath.grouped_gemm_w4.W4Experts` fields included) selected
    along its first dimension, on the device (an EP rank's weights without a second upload)."""
    from dataclasses import replace

    from fastpath.grouped_gemm_w4 import W4Experts

    def sel(t):
        if t is None:
            return None
        if isinstance(t, W4Experts):
            return replace(t, codes=sel(t.codes), scales=sel(t.scales), global_mul=sel(t.global_mul),
                           global_div=sel(t.global_div), zero_points=sel(t.zero_points))
        return t.index_select(0, experts)

    return replace(fw, w13=sel(fw.w13), w2=sel(fw.w2), w13_scales=sel(fw.w13_scales), w2_scales=sel(fw.w2_scales),
                   b13=sel(fw.b13), b2=sel(fw.b2))


def ep_name(placement) -> str:
    """``"4 EP shards (linear)"``: how the implementations' names say which shards ran."""
    n = placement.ep_size
    return f"{n} EP shard{'s' if n != 1 else ''} ({placement.strategy})"


def fastpath_ep_runs(lay, dev, placement, *, fast=None):
    """``{name: callable -> bf16 tensor}``: :func:`fastpath.moe.fused_moe` (contiguous; Triton, and DeepGEMM on FP8
    layers when it imports) on the EP shards of ``placement`` (an :class:`moeref.distributed.EPPlacement` of the
    layer's experts): rank ``r`` runs its experts (:func:`shard_weights`) with its ``expert_map`` (global ids in,
    non-local slots contribute 0) and an FP32 output; the ranks' partial outputs are added in rank order in FP32
    and stored once in bf16 (shared experts, if any, on rank 0). In an exact regime the top-k sum is exact in FP32
    in any order, so the shards' sum gives the reference's bits."""
    import torch

    from fastpath.moe import fused_moe

    fw, shared = fast_layer(lay, dev) if fast is None else fast
    hidden, tw, ids = _fast_inputs(lay, dev)
    params = dict(lay.config.activation_params)

    def run(impl):
        total = None
        for r in range(placement.ep_size):
            local = torch.as_tensor(placement.local_logical_experts(r), device=hidden.device)
            part = fused_moe(hidden, shard_weights(fw, local), tw, ids, impl=impl, activation=lay.config.activation,
                             activation_params=params, expert_map=placement.expert_map(r),
                             num_experts=placement.num_physical, out_dtype=torch.float32,
                             shared_experts=shared if r == 0 else None)
            total = part if total is None else total + part
        return total.to(torch.bfloat16)

    return {f"fastpath.moe {impl} contiguous, {ep_name(placement)}": (lambda impl=impl: run(impl))
            for impl in _impls(lay)}



def deep_gemm_version() -> str:
    """``deep_gemm.__version__`` (``"unknown"`` when it has none), or ``"absent"`` when it does not import."""
    try:
        import deep_gemm
    except Exception:  # noqa: BLE001 - DeepGEMM is optional
        return "absent"
    return str(getattr(deep_gemm, "__version__", "unknown"))
