"""Oracle power (issue 14): the contiguous-tree FP32 bound, the replayed bf16 stores, and the meta-test
that every honest bf16-store variant passes BF16_OUTPUT while the subtle planted faults fail it. The
measurement at realistic shapes is bench/bench_oracle_power.py (docs/error-bounds.md)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moeref.compare import BF16_OUTPUT, FP32_ACCUM, Profile, gamma, gemm_error_bound
from moeref.compare.bounds import HOPPER_FP8_DEEPGEMM_DATA, layer_bound, store_interval
from moeref.compare.faults import LayerCase, reference
from moeref.compare.subtle_faults import HONEST_BF16, HONEST_HOPPER, SUBTLE_FAULTS, tensor_core_gemm
from moeref.moe import MoEQuant, make_layer, make_tokens, quantize_weights
from moeref.quant import fp8_block, fp8_group
from moeref.routing import softmax_topk

U = 2.0**-24


def _bf16(x):
    return np.asarray(x, dtype=np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


# ------------------------------------------------------------------ the contiguous-tree FP32 bound


def test_contiguous_tree_hand_values():
    """Products 1, 1, -1 (K = 3): the prefix walk 0, 1, 2, 1 has range R = 2 (every lane walk has a
    smaller one), W = 3, C = 1; two adds at rho = 2.25, the two scale roundings gamma(2, u) on W."""
    got = gemm_error_bound(np.array([[1.0, 1.0, -1.0]]), np.ones((1, 3)), FP32_ACCUM)[0, 0]
    sigma = gamma(2, U)
    acc = (2.25 * 2 * U * 2 + sigma * 3) / (1 - 2.25 * 2 * U - sigma)
    assert got == pytest.approx(acc + U * (1 + acc), rel=1e-6)
    # one column: no add at all, only the scale roundings and the final bias add
    got = gemm_error_bound(np.array([[3.0]]), np.array([[2.0]]), FP32_ACCUM, bias=np.array([1.0]))[0, 0]
    acc = sigma * 6 / (1 - sigma)
    assert got == pytest.approx(acc + U * (6 + acc + 1), rel=1e-6)
    # inexact FP32 products (operands that are not bf16 values) add 2 u W
    got = gemm_error_bound(np.array([[0.1, 0.1]]), np.array([[0.1, -0.1]]), FP32_ACCUM)[0, 0]
    w = 0.02
    acc = (2.25 * U * 0.01 + (sigma + 2 * U) * w) / (1 - 2.25 * U - sigma)
    assert got == pytest.approx(acc + U * (0 + acc), rel=1e-6)


def _tree_sums(p: np.ndarray) -> dict:
    """FP32 (round-to-nearest) sums of ``p`` [rows, K] along K in orders built from contiguous ranges
    and SIMD lanes: an oracle written from the declared model, independent of the bound's code."""
    f = np.float32
    p = p.astype(f)
    k = p.shape[1]
    out = {}
    acc = np.zeros(p.shape[0], f)
    for i in range(k):
        acc = acc + p[:, i]
    out["forward"] = acc
    acc = np.zeros(p.shape[0], f)
    for i in range(k - 1, -1, -1):
        acc = acc + p[:, i]
    out["reverse"] = acc
    level = p
    while level.shape[1] > 1:
        if level.shape[1] % 2:
            level = np.concatenate([level, np.zeros((level.shape[0], 1), f)], axis=1)
        level = level[:, 0::2] + level[:, 1::2]
    out["pairwise"] = level[:, 0]
    chunks = [p[:, s:s + 128].sum(axis=1, dtype=f) for s in range(0, k, 128)]
    acc = np.zeros(p.shape[0], f)
    for c in chunks[::-1]:
        acc = acc + c
    out["chunks of 128, reversed"] = acc
    lanes = np.zeros((p.shape[0], 8), f)
    for i in range(0, k, 8):
        lanes = lanes + p[:, i:i + 8]
    while lanes.shape[1] > 1:  # halving reduction: lane r + lane r + L/2
        h = lanes.shape[1] // 2
        lanes = lanes[:, :h] + lanes[:, h:]
    out["8 SIMD lanes"] = lanes[:, 0]
    return out


@pytest.mark.parametrize("data", ["normal", "cancelling", "outliers", "same sign"])
def test_contiguous_tree_bound_covers_every_contiguous_order(data):
    rng = np.random.default_rng(7)
    k = 1024
    a = rng.standard_normal((3, k))
    w = rng.standard_normal((40, k))
    if data == "cancelling":  # large partial sums that cancel: + then - halves
        a = np.abs(a)
        w = np.abs(w) * np.where(np.arange(k) < k // 2, 1.0, -1.0)
    elif data == "outliers":
        a[:, ::97] *= 300.0
    elif data == "same sign":
        a, w = np.abs(a), np.abs(w)
    a, w = _bf16(a), _bf16(w)
    exact = a @ w.T  # products of bf16 values: exact; the float64 sum is accurate to ~1e-16 relative
    for prof in (FP32_ACCUM, Profile("ieee", accum_model="contiguous_tree", adder_factor=1.0)):
        bound = gemm_error_bound(a, w, prof)
        prods = a[:, None, :] * w[None, :, :]
        for name, s in _tree_sums(prods.reshape(-1, k)).items():
            err = np.abs(s.astype(np.float64).reshape(exact.shape) - exact)
            assert np.all(err <= bound), (prof.name, name, float((err / bound).max()))
    # truncating tensor-core adders (16 and 8 products per MMA) are covered by rho = 2.25
    for mma in (16, 8):
        err = np.abs(np.asarray(tensor_core_gemm(mma_k=mma)(a, w), np.float64) - exact)
        assert np.all(err <= gemm_error_bound(a, w, FP32_ACCUM))


def test_contiguous_tree_is_much_tighter_than_the_worst_case_on_random_signs():
    rng = np.random.default_rng(3)
    a, w = _bf16(rng.standard_normal((4, 2048))), _bf16(rng.standard_normal((64, 2048)))
    tree = gemm_error_bound(a, w, FP32_ACCUM)
    worst = gemm_error_bound(a, w, Profile("w", accum_model="worst_case"))
    assert np.median(tree / worst) < 0.2
    assert np.all(tree <= worst * 2.25)  # R <= W: never looser than rho times the worst case


# ------------------------------------------------------------------ replayed stores


def test_store_interval_hand_values():
    one = 1.0
    c, r, f = store_interval(np.array([one, one + 2**-8]), np.array([0.0, 0.0]), "bfloat16")
    assert c.tolist() == [1.0, 1.0] and r.tolist() == [0.0, 0.0]  # a tie goes to even, known
    c, r, f = store_interval(np.array([one + 2**-8]), np.array([2**-20]), "bfloat16")
    assert c.tolist() == [1.0 + 2**-8] and r.tolist() == [2**-8] and f.tolist() == [True]
    c, r, f = store_interval(np.array([3.0]), np.array([0.5]), None, unit=2**-8)
    assert c.tolist() == [3.0] and r.tolist() == [0.5 + 2**-8 * 3.5]
    with pytest.raises(ValueError, match="float8"):
        store_interval(np.array([1.0]), np.array([0.0]), "float8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_store_interval_holds_every_reachable_rounding(dtype):
    from moeref.moe.pipeline import round_to_dtype

    rng = np.random.default_rng(5)
    v = rng.standard_normal(20000) * 10.0 ** rng.integers(-3, 3, 20000)
    r = np.abs(v) * 10.0 ** rng.uniform(-9, -2, v.size)
    c, rad, flip = store_interval(v, r, dtype)
    for t in (-1.0, -0.5, 0.0, 0.7, 1.0):
        stored = round_to_dtype((v + t * r).astype(np.float32).astype(np.float64), dtype)
        assert np.all(np.abs(stored - c) <= rad)
    assert np.all(rad[~flip] == 0) and 0 < flip.mean() < 1


def test_profile_validation():
    with pytest.raises(ValueError, match="gemm_out_dtype"):
        Profile("p", gemm_out_dtype="fp8")
    with pytest.raises(ValueError, match="adder_factor"):
        Profile("p", adder_factor=0.5)
    with pytest.raises(ValueError, match="accum_model"):
        Profile("p", accum_model="probabilistic")


# ------------------------------------------------------------------ the meta-test


def _bf16_case(seed=0, activation="silu_and_mul", bias=True, tokens=24) -> LayerCase:
    bf = ml_dtypes.bfloat16
    lw = make_layer(4, 256, 128, seed=seed, dtype=bf, bias=bias)
    x = make_tokens(tokens, 256, seed=seed + 1, dtype=bf)
    r = softmax_topk(np.random.default_rng(seed + 2).standard_normal((tokens, 4)), 2, renormalize=True)
    return LayerCase(x, lw, r.weights, r.ids, dict(out_dtype=bf, activation=activation))


def _fp8_case(seed=0, tokens=24) -> LayerCase:
    lw = quantize_weights(make_layer(4, 256, 128, seed=seed), fp8_block())
    x = make_tokens(tokens, 256, seed=seed + 1, dtype=ml_dtypes.bfloat16)
    r = softmax_topk(np.random.default_rng(seed + 2).standard_normal((tokens, 4)), 2, renormalize=True)
    q = MoEQuant(fp8_group(128), fp8_group(128), "fp8")
    return LayerCase(x, lw, r.weights, r.ids, dict(out_dtype=ml_dtypes.bfloat16, quant=q))


def _applicable(table, case):
    out = {}
    for name, make in table.items():
        try:
            out[name] = make(case)
        except ValueError:
            continue
    return out


@pytest.mark.parametrize("kind", ["bf16+bias", "bf16-gelu", "fp8"])
def test_honest_bf16_variants_pass_and_subtle_faults_fail(kind):
    case = {"bf16+bias": lambda: _bf16_case(), "bf16-gelu": lambda: _bf16_case(1, "gelu_and_mul", bias=False),
            "fp8": lambda: _fp8_case()}[kind]()
    ref = reference(case)
    bound = layer_bound(ref, BF16_OUTPUT).bound
    honest = _applicable(HONEST_BF16, case)
    assert len(honest) >= 5
    for name, cand in honest.items():
        err = np.abs(np.asarray(cand, np.float64) - ref.output)
        assert np.all(err <= bound), (name, float((err / bound).max()))
    faults = _applicable(SUBTLE_FAULTS, case)
    missed = [n for n, c in faults.items() if np.all(np.abs(np.asarray(c, np.float64) - ref.output) <= bound)]
    assert len(faults) >= 10 and missed == [], missed


def test_replayed_stores_make_the_bound_tight():
    """The honest error of a bf16-store kernel is mostly the replayed roundings themselves: a median
    |err|/bound of at least 0.2 here (the old u|x| store bounds gave about 0.02)."""
    case = _bf16_case(2)
    ref = reference(case)
    lb = layer_bound(ref, BF16_OUTPUT)
    err = np.abs(np.asarray(HONEST_BF16["fp32 chunks of 32"](case), np.float64) - ref.output)
    assert np.median(err / lb.bound) >= 0.2
    assert np.array_equal(lb.bound, np.abs(lb.center - ref.output) + lb.radius)


def test_honest_hopper_variants_pass_the_data_dependent_profile():
    case = _fp8_case(1, tokens=12)
    ref = reference(case)
    bound = layer_bound(ref, HOPPER_FP8_DEEPGEMM_DATA).bound
    for name, make in HONEST_HOPPER.items():
        err = np.abs(np.asarray(make(case), np.float64) - ref.output)
        assert np.all(err <= bound) and err.max() > 0, name


# ------------------------------------------------------------------ real hardware (the lead runs these)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1024, 4096])
@pytest.mark.parametrize("data", ["normal", "cancelling", "outliers"])
def test_cuda_bf16_matmul_stays_in_the_replayed_store_interval(k, data):
    """cuBLAS bf16 matmul (tensor cores, FP32 accumulation, bf16 output) against the contiguous-tree
    bound of BF16_OUTPUT plus its replayed bf16 store: every output element must lie in the interval."""
    import torch

    rng = np.random.default_rng(k)
    a = rng.standard_normal((256, k))
    w = rng.standard_normal((512, k)) * 0.02
    if data == "cancelling":
        a = np.abs(a)
        w = np.abs(w) * np.where(np.arange(k) < k // 2, 1.0, -1.0)
    elif data == "outliers":
        a[:, :8] *= 100.0
    a, w = _bf16(a), _bf16(w)
    exact = a @ w.T
    c, r, _ = store_interval(exact, gemm_error_bound(a, w, BF16_OUTPUT), "bfloat16")
    ta = torch.from_numpy(a).to("cuda", torch.bfloat16)
    tw = torch.from_numpy(w).to("cuda", torch.bfloat16)
    got = (ta @ tw.T).float().cpu().numpy().astype(np.float64)
    assert np.all(np.abs(got - c) <= r), float(np.max(np.abs(got - c) - r))


@pytest.mark.gpu
@pytest.mark.parametrize("fault", [None, "bf16 top-k sum"])
def test_cuda_bf16_moe_layer_against_bf16_output(fault):
    """A bf16 MoE layer on the GPU the way a CUTLASS/cuBLAS layer computes it (per-expert bf16 matmuls
    with bf16 outputs, FP32 SiLU-and-mul stored in bf16, FP32 top-k sum, bf16 output) passes
    BF16_OUTPUT; the same layer with its top-k sum accumulated in bf16 fails it."""
    import torch

    from moeref.activations import split_w13
    from moeref.compare import compare

    bf = ml_dtypes.bfloat16
    lw = make_layer(4, 1024, 512, seed=4, dtype=bf)
    x = make_tokens(64, 1024, seed=5, dtype=bf)
    r = softmax_topk(np.random.default_rng(6).standard_normal((64, 4)), 2, renormalize=True)
    case = LayerCase(x, lw, r.weights, r.ids, dict(out_dtype=bf))
    dev = "cuda"
    tx = torch.from_numpy(x.astype(np.float32)).to(dev, torch.bfloat16)
    acc = torch.zeros((64, 1024), device=dev, dtype=torch.bfloat16 if fault else torch.float32)
    for j in range(2):  # slot order
        for e in range(4):
            rows = np.flatnonzero(r.ids[:, j] == e)
            if rows.size == 0:
                continue
            w13 = torch.from_numpy(np.asarray(lw.w13[e], np.float32)).to(dev, torch.bfloat16)
            w2 = torch.from_numpy(np.asarray(lw.w2[e], np.float32)).to(dev, torch.bfloat16)
            h = (tx[rows] @ w13.T).float().cpu().numpy()
            g, u = split_w13(h, lw.w13_layout, axis=-1)
            act = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
            xa = torch.from_numpy(act).to(dev, torch.bfloat16)
            y = (xa @ w2.T).float()
            wj = torch.from_numpy(np.asarray(r.weights[rows, j], np.float32)).to(dev)[:, None]
            idx = torch.from_numpy(rows).to(dev)
            acc[idx] = (acc[idx].float() + wj * y).to(acc.dtype)
    out = acc.to(torch.bfloat16).float().cpu().numpy()
    rep = compare(out, reference(case), BF16_OUTPUT)
    assert rep.passed == (fault is None), rep.summary()


def test_weighted_gemm2_store_profile():
    """vLLM Triton's layer weights GEMM2's FP32 result before the bf16 store: honest for
    replace(BF16_OUTPUT, gemm2_weighted_store=True); truncating that store is caught. (A bf16 top-k sum
    is no fault there: with top-2 it adds two bf16 values once, the output's own rounding.)"""
    from dataclasses import replace

    from moeref.compare.subtle_faults import bf16_candidate

    case = _bf16_case(4)
    ref = reference(case)
    vllm = replace(BF16_OUTPUT, name="VLLM_TRITON_BF16", gemm2_weighted_store=True)
    bound = layer_bound(ref, vllm).bound
    for gemm in (None, tensor_core_gemm()):
        cand = bf16_candidate(case, gemm, dict(weight_before_store=True))
        assert np.all(np.abs(np.asarray(cand, np.float64) - ref.output) <= bound)
    bad = bf16_candidate(case, finalize=dict(weight_before_store=True, gemm_out_rounding="zero"))
    assert not np.all(np.abs(np.asarray(bad, np.float64) - ref.output) <= bound)
