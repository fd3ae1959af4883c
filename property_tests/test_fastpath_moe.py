"""fastpath.grouped_gemm and fastpath.moe against the exact reference, under the profile each declares.

CPU (CI): the Triton grouped GEMM under the interpreter with float32 operands (the interpreter's
low-precision dot is not the hardware's), checked against :func:`moeref.gemm.grouped_gemm_contiguous`
within the FP32 accumulation bound of :func:`moeref.compare.gemm_error_bound`; a planted fault (one row
assigned to the wrong expert) exceeds it. The whole float32 layer likewise. GPU: the FP8 (DeepGEMM recipe)
and bf16 layers through the Triton kernel and DeepGEMM, against the NumPy reference with
:func:`moeref.compare.compare` under the declared profile, over Hypothesis routings (skewed, empty
experts, all-to-one, -1 padding, top-1 with the router weight on the input).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device, on_gpu  # noqa: E402
from moeref.compare import FP32_ACCUM, PROFILES, compare, gemm_error_bound  # noqa: E402
from moeref.gemm import grouped_gemm_contiguous as ref_contiguous  # noqa: E402
from moeref.moe import MoEWeights, make_layer, make_tokens, quantize_weights, run_moe  # noqa: E402
from moeref.quant import fp8_block  # noqa: E402
from moeref.strategies import routings  # noqa: E402

DEV = device()


def _settings(cpu_examples: int):
    kw = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    return settings(**kw) if on_gpu() else settings(max_examples=cpu_examples, **kw)


def _contiguous_case(rng, e, m_per, k, n, alignment):
    counts = rng.integers(0, m_per + 1, e)
    counts[rng.integers(0, e)] = 0  # an empty expert
    seg = -(-counts // alignment) * alignment
    m_indices = np.concatenate([np.where(np.arange(s) < c, i, -1) for i, (c, s) in enumerate(zip(counts, seg))]
                               + [np.zeros(0, np.int64)]).astype(np.int32)
    a = rng.standard_normal((m_indices.size, k)).astype(np.float32)
    b = (rng.standard_normal((e, n, k)) / np.sqrt(k)).astype(np.float32)
    return a, b, m_indices


def _fp32_bound(a, b, m_indices):
    bound = np.zeros((a.shape[0], b.shape[1]))
    for e in np.unique(m_indices[m_indices >= 0]):
        rows = np.flatnonzero(m_indices == e)
        bound[rows] = gemm_error_bound(a[rows].astype(np.float64), b[e].astype(np.float64), FP32_ACCUM)
    return bound


@_settings(8)
@given(st.integers(1, 5), st.integers(0, 40), st.sampled_from([16, 32, 48]), st.sampled_from([24, 40]),
       st.integers(0, 2**16))
def test_triton_grouped_gemm_float32_within_fp32_bound(e, m_per, k, n, seed):
    rng = np.random.default_rng(seed)
    a, b, m_indices = _contiguous_case(rng, e, m_per, k, n, alignment=16)
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    got = grouped_gemm_contiguous(torch.as_tensor(a, device=DEV), torch.as_tensor(b, device=DEV),
                                  torch.as_tensor(m_indices, device=DEV), impl="triton", alignment=16,
                                  out_dtype=torch.float32).cpu().numpy().astype(np.float64)
    ref = ref_contiguous(a, b, m_indices)
    valid = m_indices >= 0
    # the FP32 accumulation bound plus the float32 output store (and tf32 is off: allow_tf32 is not used)
    bound = _fp32_bound(a, b, m_indices) + 2.0**-24 * np.abs(ref)
    if on_gpu():  # the GPU's fp32 tl.dot is TF32 by default: 10-bit products, bound by its unit
        bound = bound + 2.0**-10 * _fp32_abs(a, b, m_indices)
    assert np.all(np.abs(got - ref)[valid] <= bound[valid])


def _fp32_abs(a, b, m_indices):
    return ref_contiguous(np.abs(a), np.abs(b), m_indices)


def test_triton_grouped_gemm_catches_a_misrouted_row():
    """Planted fault: the kernel is handed one row's expert wrong; the bound must flag that row."""
    rng = np.random.default_rng(1)
    a, b, m_indices = _contiguous_case(rng, 3, 30, 32, 24, alignment=16)
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    ref = ref_contiguous(a, b, m_indices)
    bad = m_indices.copy()
    row = int(np.flatnonzero(bad >= 0)[0])
    # move the whole tile of this row to the next expert (a tile shares one expert)
    tile = slice(row - row % 16, row - row % 16 + 16)
    bad[tile] = np.where(bad[tile] >= 0, (bad[tile] + 1) % 3, -1)
    got = grouped_gemm_contiguous(torch.as_tensor(a, device=DEV), torch.as_tensor(b, device=DEV),
                                  torch.as_tensor(bad, device=DEV), impl="triton", alignment=16,
                                  out_dtype=torch.float32).cpu().numpy()
    bound = _fp32_bound(a, b, m_indices) + 2.0**-10 * _fp32_abs(a, b, m_indices)
    assert np.any(np.abs(got - ref)[row] > bound[row])


@_settings(6)
@given(routings(max_tokens=12, max_experts=6, max_top_k=3), st.integers(0, 2**16),
       st.sampled_from(["contiguous", "masked"]), st.booleans(), st.booleans(), st.sampled_from([None, 5]),
       st.sampled_from([1, 2]))
def test_fastpath_moe_float32_layer_within_fp32_bound(r, seed, layout, bias, shared, chunk, ep_size):
    """The whole layer (silu_and_mul) with float32 weights and stores, against the reference under FP32_ACCUM
    with float32 stores: both layouts, biases, a shared expert, token chunks, an expert-parallel rank."""
    from fastpath.moe import fast_weights, fused_moe
    from moeref.moe import SharedExperts
    from moeref.routing import expert_map

    lw = make_layer(r.num_experts, 32, 16, seed=seed, bias=bias)
    x = make_tokens(r.num_tokens, 32, seed=seed + 1)
    emap = None if ep_size == 1 else expert_map(r.num_experts, ep_size, seed % ep_size)
    local = lw if emap is None else lw.select(np.flatnonzero(emap >= 0))
    if local.num_experts == 0:
        return
    sx = None
    if shared:
        s = make_layer(1, 32, 8, seed=seed + 2)
        sx = SharedExperts(s.w13[0], s.w2[0], s.w13_layout)
    got = fused_moe(torch.as_tensor(x, device=DEV), fast_weights(local, DEV), torch.as_tensor(r.weights, device=DEV),
                    torch.as_tensor(r.ids, device=DEV), alignment=16, out_dtype=torch.float32, layout=layout,
                    expert_map=None if emap is None else torch.as_tensor(emap, device=DEV),
                    num_experts=r.num_experts, chunk_size=chunk,
                    shared_experts=None if sx is None else fast_weights(sx, DEV))
    run = run_moe(x, local, r.weights, r.ids, gemm1_out_dtype="float32", act_out_dtype="float32", out_dtype="float32",
                  expert_map=emap, num_experts=r.num_experts, chunk_size=chunk, shared_experts=sx)
    prof = PROFILES["FP32_ACCUM"]
    if on_gpu():  # fp32 tl.dot is TF32 on the GPU
        from dataclasses import replace

        prof = replace(prof, accum_unit=2.0**-10)
    rep = compare(got.cpu(), run, prof)
    assert rep.passed, rep


@_settings(6)
@given(routings(max_tokens=12, max_experts=6, top_k=1), st.integers(0, 2**16),
       st.sampled_from(["contiguous", "masked"]), st.booleans(), st.sampled_from([None, 5]))
def test_fastpath_moe_float32_layer_router_weight_on_input(r, seed, layout, capturable, chunk):
    """Top-1 with the router weight on the input (each row times its weight, rounded once to float32, then the
    reduce only sums): the float32 layer against the reference run with the option under FP32_ACCUM, both
    layouts, capturable or not, token chunks."""
    from fastpath.moe import fast_weights, fused_moe

    lw = make_layer(r.num_experts, 32, 16, seed=seed)
    x = make_tokens(r.num_tokens, 32, seed=seed + 1)
    got = fused_moe(torch.as_tensor(x, device=DEV), fast_weights(lw, DEV), torch.as_tensor(r.weights, device=DEV),
                    torch.as_tensor(r.ids, device=DEV), alignment=16, out_dtype=torch.float32, layout=layout,
                    chunk_size=chunk, capturable=capturable, apply_router_weight_on_input=True)
    run = run_moe(x, lw, r.weights, r.ids, gemm1_out_dtype="float32", act_out_dtype="float32", out_dtype="float32",
                  chunk_size=chunk, apply_router_weight_on_input=True)
    prof = PROFILES["FP32_ACCUM"]
    if on_gpu():  # fp32 tl.dot is TF32 on the GPU
        from dataclasses import replace

        prof = replace(prof, accum_unit=2.0**-10)
    rep = compare(got.cpu(), run, prof)
    assert rep.passed, rep


def fp8_block_layer(rng, e, k, n):
    """FP8 128x128 experts whose 128-column blocks differ in magnitude (x 2^-3..2^3, as real weight
    channels do), so that a wrong scale block changes the output (also tests/test_hopper_fp8_gpu.py's layers)."""
    lw = make_layer(e, k, n, seed=int(rng.integers(2**16)))
    def vary(w):
        f = np.exp2(rng.integers(-3, 4, (1, -(-w.shape[1] // 128)))).repeat(128, axis=1)[:, : w.shape[1]]
        return (w * f).astype(np.float32)
    lw = MoEWeights([vary(w) for w in lw.w13], [vary(w) for w in lw.w2], lw.w13_layout)
    return quantize_weights(lw, fp8_block())


@pytest.mark.gpu
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(routings(max_tokens=200, max_experts=8, max_top_k=4), st.sampled_from(["triton", "deep_gemm"]),
       st.integers(0, 2**16), st.sampled_from(["contiguous", "masked"]),
       st.sampled_from([("silu_and_mul", {}), ("gelu_and_mul", {}), ("gelu_and_mul", {"approximate": "tanh"})]))
def test_fastpath_moe_fp8_layer_within_declared_profile(r, impl, seed, layout, act):
    """FP8 1x128 x 128x128 layer (DeepGEMM recipe) at K = 512, N = 256, SiLU or erf / tanh GELU: every example
    passes under the declared profile, with the Triton kernel and with DeepGEMM."""
    from fastpath.grouped_gemm import grouped_gemm_supports
    from fastpath.moe import fast_weights, fused_moe, profile_of, reference_config

    if not grouped_gemm_supports(impl)[0]:
        pytest.skip(grouped_gemm_supports(impl)[1])
    rng = np.random.default_rng(seed)
    weights = fp8_block_layer(rng, r.num_experts, 512, 256)
    x = make_tokens(r.num_tokens, 512, seed=seed)
    fw = fast_weights(weights, "cuda")
    got = fused_moe(torch.as_tensor(x, device="cuda").to(torch.bfloat16), fw, torch.as_tensor(r.weights, device="cuda"),
                    torch.as_tensor(r.ids, device="cuda"), impl=impl, layout=layout, activation=act[0],
                    activation_params=act[1])
    cfg = reference_config(fw)
    prof = PROFILES[cfg.pop("profile")]
    assert prof.name == profile_of(impl, fw)
    x_seen = torch.as_tensor(x).to(torch.bfloat16).float().numpy()  # the kernel's input, as it sees it
    run = run_moe(x_seen, weights, r.weights, r.ids, activation=act[0], activation_params=act[1], **cfg)
    rep = compare(got.float().cpu(), run, prof)
    assert rep.passed, rep


@pytest.mark.gpu
@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(routings(max_tokens=200, max_experts=8, top_k=1), st.sampled_from(["triton", "deep_gemm", "bf16"]),
       st.integers(0, 2**16), st.sampled_from(["contiguous", "masked"]), st.booleans())
def test_fastpath_moe_router_weight_on_input_within_declared_profile(r, impl, seed, layout, capturable):
    """Top-1, router weight on the input: the FP8 layer through the Triton kernel and DeepGEMM (the weighted
    float32 rows quantized FP8 1x128) and the bf16 layer (the weighted rows stored bf16, declared by
    reference_config), K = 512, N = 256, both layouts, capturable or not: every example passes under the
    declared profile; the same output fails against the reference with the weights on the output."""
    from fastpath.grouped_gemm import grouped_gemm_supports
    from fastpath.moe import FastMoEWeights, fast_weights, fused_moe, reference_config

    rng = np.random.default_rng(seed)
    if impl == "bf16":
        import ml_dtypes

        lw = make_layer(r.num_experts, 512, 256, seed=seed)
        bf = (lambda ws: [w.astype(ml_dtypes.bfloat16).astype(np.float32) for w in ws])
        weights = MoEWeights(bf(lw.w13), bf(lw.w2), lw.w13_layout)
        fw = FastMoEWeights(torch.as_tensor(np.stack(weights.w13), device="cuda").bfloat16(),
                            torch.as_tensor(np.stack(weights.w2), device="cuda").bfloat16(), lw.w13_layout)
        impl = "triton"
    else:
        if not grouped_gemm_supports(impl)[0]:
            pytest.skip(grouped_gemm_supports(impl)[1])
        weights = fp8_block_layer(rng, r.num_experts, 512, 256)
        fw = fast_weights(weights, "cuda")
    x = torch.as_tensor(make_tokens(r.num_tokens, 512, seed=seed), device="cuda").to(torch.bfloat16)
    got = fused_moe(x, fw, torch.as_tensor(r.weights, device="cuda"), torch.as_tensor(r.ids, device="cuda"), impl=impl,
                    layout=layout, capturable=capturable, apply_router_weight_on_input=True)
    cfg = reference_config(fw, apply_router_weight_on_input=True)
    prof = PROFILES[cfg.pop("profile")]
    x_seen = x.float().cpu().numpy()
    rep = compare(got.float().cpu(), run_moe(x_seen, weights, r.weights, r.ids, **cfg), prof)
    assert rep.passed, rep
    if np.any((r.ids[:, 0] >= 0) & (r.weights[:, 0] < 0.5)):  # a weight far from 1 moves the output
        cfg.pop("apply_router_weight_on_input")
        assert not compare(got.float().cpu(), run_moe(x_seen, weights, r.weights, r.ids, **cfg), prof).passed


@pytest.mark.gpu
def test_fastpath_moe_fp8_planted_neighbour_scale_block_fails():
    """Planted fault: GEMM2 reads the neighbouring K-block's weight scale; the comparison must fail."""
    from fastpath.moe import FastMoEWeights, fused_moe, reference_config

    rng = np.random.default_rng(3)
    weights = fp8_block_layer(rng, 4, 512, 256)
    from fastpath.moe import fast_weights

    fw = fast_weights(weights, "cuda")
    bad = FastMoEWeights(fw.w13, fw.w2, fw.w13_layout, fw.w13_scales, fw.w2_scales.roll(1, dims=2))
    x = make_tokens(64, 512, seed=4)
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(64)]).astype(np.int32)
    tw = rng.random((64, 2)).astype(np.float32)
    got = fused_moe(torch.as_tensor(x, device="cuda").to(torch.bfloat16), bad, torch.as_tensor(tw, device="cuda"),
                    torch.as_tensor(ids, device="cuda"))
    cfg = reference_config(fw)
    prof = PROFILES[cfg.pop("profile")]
    run = run_moe(torch.as_tensor(x).to(torch.bfloat16).float().numpy(), weights, tw, ids, **cfg)
    assert not compare(got.float().cpu(), run, prof).passed


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_fastpath_moe_fp8_chunk_without_routed_slots_is_zero(layout):
    """A chunk whose slots are all -1 (padding tokens, or every expert on another EP rank) has no rows to
    multiply: the FP8 layer returns the reference's output (zeros) instead of failing on empty scales."""
    from fastpath.moe import fast_weights, fused_moe, reference_config

    weights = fp8_block_layer(np.random.default_rng(0), 2, 128, 128)
    x = make_tokens(3, 128, seed=1)
    ids = np.full((3, 2), -1, dtype=np.int32)
    tw = np.ones((3, 2), dtype=np.float32)
    fw = fast_weights(weights, DEV)
    got = fused_moe(torch.as_tensor(x, device=DEV).to(torch.bfloat16), fw, torch.as_tensor(tw, device=DEV),
                    torch.as_tensor(ids, device=DEV), impl="triton", layout=layout)
    cfg = reference_config(fw)
    cfg.pop("profile")
    want = run_moe(torch.as_tensor(x).to(torch.bfloat16).float().numpy(), weights, tw, ids, **cfg).output
    np.testing.assert_array_equal(got.float().cpu().numpy(), want)
