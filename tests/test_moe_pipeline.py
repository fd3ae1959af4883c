"""The MoE layer (moeref.moe): against a per-token oracle written here from vLLM ``torch_experts``."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from moeref.moe import (
    LAYOUTS,
    MoEQuant,
    MoEWeights,
    SharedExperts,
    experts,
    finalize,
    fused_moe,
    make_layer,
    make_tokens,
    prepare,
    quantize_weights,
)
from moeref.quant import fp8_block, fp8_group, mxfp4, quantize
from moeref.routing import expert_map as make_expert_map
from moeref.routing import softmax_topk

RNG = np.random.default_rng(7)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _oracle(x, w13, w2, tw, ids, act, layout="gate_up", b13=None, b2=None, requant=None):
    """vLLM torch_experts in float64, one token and slot at a time (``tests/kernels/utils.py::torch_experts``)."""
    m, k = ids.shape
    out = np.zeros((m, w2[0].shape[0]))
    for t in range(m):
        for j in range(k):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            n = h.size // 2
            if layout == "gate_up":
                g, u = h[:n], h[n:]
            elif layout == "up_gate":
                u, g = h[:n], h[n:]
            else:
                g, u = h[0::2], h[1::2]
            a = {"silu": _silu(g) * u, "gelu": _gelu(g) * u, "relu2": np.maximum(h, 0) ** 2}[act]
            if requant is not None:
                a = requant(a)
            out[t] += tw[t, j] * (w2[e] @ a + (0 if b2 is None else b2[e]))
    return out


def _routing(m, e, k, seed=0):
    r = softmax_topk(np.random.default_rng(seed).standard_normal((m, e)), k, renormalize=True)
    return r.weights, r.ids


def _f64(ws):
    return [np.asarray(w, dtype=np.float64) for w in ws]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("w13_layout", ["gate_up", "up_gate", "interleaved"])
def test_float_layer_matches_oracle(layout, w13_layout):
    lw = make_layer(5, 24, 12, seed=1, w13_layout=w13_layout, bias=True)
    x = make_tokens(7, 24, seed=2)
    tw, ids = _routing(7, 5, 2)
    got = fused_moe(x, lw, tw, ids, layout=layout, alignment=4)
    want = _oracle(x.astype(np.float64), _f64(lw.w13), _f64(lw.w2), tw.astype(np.float64), ids, "silu",
                   w13_layout, lw.b13, lw.b2)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act,name", [("gelu", "gelu_and_mul"), ("relu2", "relu2_no_mul")])
def test_other_activations(act, name):
    lw = make_layer(3, 16, 8, seed=3, gated=(act != "relu2"))
    x = make_tokens(4, 16, seed=4)
    tw, ids = _routing(4, 3, 2, seed=5)
    got = fused_moe(x, lw, tw, ids, activation=name)
    want = _oracle(x.astype(np.float64), _f64(lw.w13), _f64(lw.w2), tw.astype(np.float64), ids, act)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_test_data_is_in_the_nonlinear_range():
    lw = make_layer(4, 64, 32, seed=0)
    x = make_tokens(32, 64, seed=0)
    h = np.stack([x @ w.T for w in lw.w13])[..., :32]
    assert 1.5 < h.std() < 4.0  # silu is far from linear for |g| of this size
    assert len({row.tobytes() for row in x}) == 32  # every token distinct


def test_fp8_layer_equals_float64_layer_on_dequantized_operands():
    """Quantized layer = float64 layer on dequantized weights/tokens with re-quantized intermediates."""
    lw = make_layer(4, 256, 128, seed=6)
    qw = quantize_weights(lw, fp8_block())
    x = make_tokens(6, 256, seed=7)
    tw, ids = _routing(6, 4, 2, seed=8)
    q = MoEQuant(fp8_group(128), fp8_group(128))
    got = fused_moe(x, qw, tw, ids, quant=q)
    xq = quantize(x, fp8_group(128)).dequantize(np.float64)
    w13 = [w.dequantize(np.float64) for w in qw.w13]
    w2 = [w.dequantize(np.float64) for w in qw.w2]

    def requant(a):
        return quantize(a[None, :], fp8_group(128)).dequantize(np.float64)[0]

    want = _oracle(xq, w13, w2, tw.astype(np.float64), ids, "silu", requant=requant)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_mxfp4_weights_bf16_activations_gptoss_style():
    lw = make_layer(3, 64, 32, seed=9, w13_layout="interleaved")
    qw = quantize_weights(lw, mxfp4())
    x = make_tokens(5, 64, seed=10).astype(ml_dtypes.bfloat16)
    tw, ids = _routing(5, 3, 2, seed=11)
    got = fused_moe(x, qw, tw, ids, activation="swigluoai")
    w13 = [w.dequantize(np.float64) for w in qw.w13]
    w2 = [w.dequantize(np.float64) for w in qw.w2]
    xf = x.astype(np.float64)
    want = np.zeros((5, 64))
    for t in range(5):
        for j in range(2):
            e = ids[t, j]
            h = w13[e] @ xf[t]
            g, u = np.minimum(h[0::2], 7.0), np.clip(h[1::2], -7.0, 7.0)
            want[t] += tw[t, j] * (w2[e] @ ((u + 1) * g / (1 + np.exp(-1.702 * g))))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_router_weight_on_input_top1():
    lw = make_layer(3, 16, 8, seed=12)
    x = make_tokens(4, 16, seed=13)
    tw, ids = _routing(4, 3, 1, seed=14)
    got = fused_moe(x, lw, tw, ids, apply_router_weight_on_input=True)
    xs = (x.astype(np.float64) * tw.astype(np.float64)).astype(np.float32).astype(np.float64)
    want = _oracle(xs, _f64(lw.w13), _f64(lw.w2), np.ones_like(tw, dtype=np.float64), ids, "silu")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="top_k"):
        tw2, ids2 = _routing(4, 3, 2)
        fused_moe(x, lw, tw2, ids2, apply_router_weight_on_input=True)


def test_chunking_padding_and_ep_sharding():
    lw = make_layer(8, 32, 16, seed=15)
    x = make_tokens(9, 32, seed=16)
    tw, ids = _routing(9, 8, 3, seed=17)
    ids[4] = -1  # a padding token
    tw[4] = 0.0
    full = fused_moe(x, lw, tw, ids)
    np.testing.assert_array_equal(full[4], 0.0)
    # float operands too: each output's K-sum has a fixed order (moeref.gemm.block_gemm), whatever the chunk
    np.testing.assert_array_equal(fused_moe(x, lw, tw, ids, chunk_size=2), full)
    parts = []
    for rank in range(4):
        emap = make_expert_map(8, 4, rank, "round_robin")
        local = np.flatnonzero(emap >= 0)[np.argsort(emap[emap >= 0])]
        parts.append(fused_moe(x, lw.select(local), tw, ids, expert_map=emap, num_experts=8))
    np.testing.assert_allclose(sum(parts), full, rtol=1e-13, atol=1e-13)


def test_shared_experts_are_a_plain_mlp_added():
    lw = make_layer(3, 16, 8, seed=18)
    sh = make_layer(1, 16, 12, seed=19)
    shared = SharedExperts(sh.w13[0], sh.w2[0], "gate_up")
    x = make_tokens(5, 16, seed=20)
    tw, ids = _routing(5, 3, 2, seed=21)
    got = fused_moe(x, lw, tw, ids, shared_experts=shared)
    xf = x.astype(np.float64)
    h = xf @ sh.w13[0].astype(np.float64).T
    mlp = (_silu(h[:, :12]) * h[:, 12:]) @ sh.w2[0].astype(np.float64).T
    want = fused_moe(x, lw, tw, ids) + mlp
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_stages_are_public_and_output_dtype_rounds_once():
    lw = make_layer(3, 16, 8, seed=22)
    x = make_tokens(4, 16, seed=23)
    tw, ids = _routing(4, 3, 2, seed=24)
    p = prepare(x, tw, ids, num_experts=3, layout="masked")
    assert p.a.values.shape[0] == 3 * p.dispatch.max_m
    e = experts(p, lw)
    y64 = finalize(p, e)
    y16 = finalize(p, e, out_dtype="bfloat16")
    assert y16.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(y16, y64.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(fused_moe(x, lw, tw, ids), y64)


def test_mapping_table_and_flashinfer_arguments():
    from moeref.moe.mapping import MAPPING, from_flashinfer_cutlass

    assert any(row.flashinfer.startswith("fc1_expert_weights") and "up_gate" in row.note for row in MAPPING)
    lw = make_layer(3, 16, 8, seed=25)  # gate_up
    x = make_tokens(4, 16, seed=26)
    tw, ids = _routing(4, 3, 2, seed=27)
    w31 = np.stack([np.concatenate([w[8:], w[:8]]) for w in lw.w13])  # FlashInfer: [w3 (up); w1 (gate)]
    w2 = np.stack(lw.w2)
    kwargs = from_flashinfer_cutlass(x, ids, tw, w31, w2)
    np.testing.assert_allclose(fused_moe(**kwargs), fused_moe(x, lw, tw, ids), rtol=1e-13, atol=1e-13)


def test_bad_arguments():
    lw = make_layer(3, 16, 8, seed=28)
    x = make_tokens(4, 16)
    tw, ids = _routing(4, 3, 2)
    with pytest.raises(ValueError, match="layout"):
        fused_moe(x, lw, tw, ids, layout="ragged")
    with pytest.raises(ValueError, match="w13_layout"):
        MoEWeights(lw.w13, lw.w2, "gate-up")
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, lw, tw, ids, activation="swish")
    with pytest.raises(ValueError, match="num_experts"):
        fused_moe(x, lw, tw, ids, expert_map=np.array([0, 1, 2], dtype=np.int32))


def test_nvfp4_with_static_global_scales_cutlass_path():
    """CUTLASS FP4 MoE (vLLM/FlashInfer): a1_gscale / a2_gscale are static ENCODE factors 448*6/amax;
    the layer equals the float64 layer on the dequantized NVFP4 operands."""
    from moeref.moe import quantizer
    from moeref.quant.nvfp4 import nvfp4

    lw = make_layer(3, 64, 32, seed=30)
    qw = quantize_weights(lw, nvfp4("weight", preset="vllm"))
    x = make_tokens(4, 64, seed=31)
    tw, ids = _routing(4, 3, 2, seed=32)
    a1_gscale, a2_gscale = 448.0 * 6 / 4.0, 448.0 * 6 / 8.0
    s = nvfp4("activation", preset="vllm")
    q = MoEQuant(quantizer(s, global_scale=a1_gscale), quantizer(s, global_scale=a2_gscale), "nvfp4")
    got = fused_moe(x, qw, tw, ids, quant=q)
    a1 = quantize(x, s, global_scale=a1_gscale)
    assert a1.global_scale == pytest.approx(1 / a1_gscale)
    xq = a1.dequantize(np.float64)
    w13 = [w.dequantize(np.float64) for w in qw.w13]
    w2 = [w.dequantize(np.float64) for w in qw.w2]
    hs = np.array([w13[e] @ xq[t] for t in range(4) for e in ids[t]])
    acts = _silu(hs[:, :32]) * hs[:, 32:]
    acts = quantize(acts, s, global_scale=a2_gscale).dequantize(np.float64)
    want = np.zeros((4, 64))
    for i, (t, e) in enumerate((t, e) for t in range(4) for e in ids[t]):
        want[t] += tw[t, list(ids[t]).index(e)] * (w2[e] @ acts[i])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_bench_script_runs_at_a_small_shape(capsys):
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_moe_reference.py"
    main = runpy.run_path(str(path))["main"]
    main(["--tokens", "4", "--experts", "8", "--top-k", "2", "--hidden", "256", "--intermediate", "128",
          "--pool", "2"])
    out = capsys.readouterr().out
    assert "GFLOP" in out and "finite: True" in out
