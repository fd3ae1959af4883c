"""Hypothesis properties of the MoE layer: every layout gives the same output; chunking, token order
and EP sharding invariances; the quantized layer equals the float64 layer on dequantized operands with
re-quantized intermediates (oracle written here, one token and slot at a time)."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeref.moe import LAYOUTS, MoEQuant, fused_moe, make_layer, make_tokens, quantize_weights
from moeref.quant import (
    fp8_block,
    fp8_group,
    fp8_per_channel,
    fp8_per_tensor,
    fp8_per_token,
    int8_per_channel,
    int8_per_token,
    mxfp4,
    mxfp8,
    quantize,
    w4a8_cutlass,
)
from moeref.quant.nvfp4 import nvfp4
from moeref.strategies import OPT_IN_KINDS, ROUTING_KINDS, routings

# every distribution, the opt-in repeated-expert routings included (each slot is its own row)
ALL_KINDS = ROUTING_KINDS + OPT_IN_KINDS

# name -> (a1 / a2 scheme, weight scheme, K and N multiple, row-wise activation scales)
SCHEMES = {
    "bf16": (None, None, 1, True),
    "fp8 per-tensor": (fp8_per_tensor(), fp8_per_tensor(), 1, False),
    "fp8 per-token x per-channel": (fp8_per_token(), fp8_per_channel(), 1, True),
    "fp8 1x16 x 16x16 ue8m0": (fp8_group(16, "ue8m0"), fp8_block((16, 16), "ue8m0"), 16, True),
    "fp8 1x32 fp32 x 32x32": (fp8_group(32), fp8_block((32, 32)), 32, True),
    "mxfp8": (mxfp8(), mxfp8(), 32, True),
    "fp8 1x64 x mxfp4": (fp8_group(64), mxfp4(), 64, True),  # refinement: 64 vs 32 blocks
    "int8": (int8_per_token(), int8_per_channel(), 1, True),
    "nvfp4": (nvfp4("activation"), nvfp4("weight"), 16, False),
    "w4a8: int4 groups x fp8 per-token": (fp8_per_token(), w4a8_cutlass(16), 16, True),
    "gpt-oss: bf16 x mxfp4": (None, mxfp4(), 32, True),
}
ACTIVATIONS = ("silu_and_mul", "gelu_and_mul", "swigluoai", "relu2_no_mul")
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layers(draw, rowwise_only: bool = False):
    names = [n for n, s in SCHEMES.items() if s[3] or not rowwise_only]
    name = draw(st.sampled_from(names))
    a_scheme, w_scheme, mult, _ = SCHEMES[name]
    k = mult * draw(st.integers(1, 3)) if mult > 1 else draw(st.sampled_from([1, 5, 17, 32]))
    n = mult * draw(st.integers(1, 2)) if mult > 1 else draw(st.sampled_from([1, 3, 8]))
    act = draw(st.sampled_from(ACTIVATIONS))
    layout = draw(st.sampled_from(["gate_up", "up_gate", "interleaved"]))
    r = draw(routings(max_tokens=6, max_experts=5, max_top_k=3, kinds=ALL_KINDS))
    seed = draw(st.integers(0, 2**16))
    lw = make_layer(r.num_experts, k, n, seed=seed, gated=act != "relu2_no_mul", w13_layout=layout,
                    bias=draw(st.booleans()))
    weights = quantize_weights(lw, w_scheme) if w_scheme is not None else lw
    x = make_tokens(r.num_tokens, k, seed=seed + 1)
    quant = MoEQuant(a_scheme, a_scheme, name)
    return dict(name=name, hidden=x, weights=weights, float_weights=lw, routing=r, activation=act, quant=quant,
                a_scheme=a_scheme)


def _run(case, **kw):
    r = case["routing"]
    return fused_moe(case["hidden"], case["weights"], r.weights, r.ids, activation=case["activation"],
                     quant=case["quant"], num_experts=r.num_experts, **kw)


@SLOW
@given(layers(), st.integers(1, 5))
def test_every_layout_gives_the_same_output(case, alignment):
    base = _run(case)
    for layout in LAYOUTS[1:]:
        got = _run(case, layout=layout, alignment=alignment)
        np.testing.assert_array_equal(got, base)  # every row's arithmetic is its own (moeref.gemm.block_gemm)


@SLOW
@given(layers(rowwise_only=True), st.integers(1, 4))
def test_chunking_invariance(case, chunk):
    base = _run(case)
    np.testing.assert_array_equal(_run(case, chunk_size=chunk), base)


@SLOW
@given(layers(rowwise_only=True), st.randoms(use_true_random=False))
def test_token_order_invariance(case, rnd):
    r = case["routing"]
    perm = np.arange(r.num_tokens)
    rnd.shuffle(perm)
    base = _run(case)
    got = fused_moe(case["hidden"][perm], case["weights"], r.weights[perm], r.ids[perm],
                    activation=case["activation"], quant=case["quant"], num_experts=r.num_experts)
    np.testing.assert_array_equal(got, base[perm])


@SLOW
@given(st.data())
def test_ep_shards_sum_to_the_full_layer(data):
    case = data.draw(layers(rowwise_only=True))
    r = case["routing"]
    size = data.draw(st.integers(1, 4))
    from moeref.routing import expert_map

    strategy = data.draw(st.sampled_from(["linear", "round_robin"]))
    base = _run(case)
    total = np.zeros_like(base)
    for rank in range(size):
        emap = expert_map(r.num_experts, size, rank, strategy)
        local = np.flatnonzero(emap >= 0)[np.argsort(emap[emap >= 0])]
        total = total + fused_moe(case["hidden"], case["weights"].select(local), r.weights, r.ids,
                                  activation=case["activation"], quant=case["quant"], expert_map=emap,
                                  num_experts=r.num_experts)
    np.testing.assert_allclose(total, base, rtol=1e-12, atol=1e-12 * (1 + np.nanmax(np.abs(base), initial=0)))


@SLOW
@given(layers())
def test_quantized_layer_equals_float64_layer_on_dequantized_operands(case):
    from moeref.activations import apply_activation

    r = case["routing"]
    w = case["weights"]
    a_scheme = case["a_scheme"]

    def deq(v):
        return v.dequantize(np.float64) if hasattr(v, "dequantize") else np.asarray(v, np.float64)

    x = case["hidden"].astype(np.float64)
    if a_scheme is not None:
        x = quantize(case["hidden"], a_scheme).dequantize(np.float64)
    hs, slots = [], []
    for t in range(r.num_tokens):
        for j in range(r.top_k):
            e = int(r.ids[t, j])
            if e >= 0:
                hs.append(deq(w.w13[e]) @ x[t] + (0 if w.b13 is None else w.b13[e]))
                slots.append((t, j, e))
    want = np.zeros_like(x)
    if slots:
        acts = np.stack([apply_activation(case["activation"], h[None, :], **(
            {"layout": w.w13_layout} if case["activation"] != "relu2_no_mul" else {}))[0] for h in hs])
        if a_scheme is not None:  # the a2 quantizer sees every valid row of the call at once
            acts = quantize(acts, a_scheme).dequantize(np.float64)
        for (t, j, e), a in zip(slots, acts):
            want[t] += np.float64(r.weights[t, j]) * (deq(w.w2[e]) @ a + (0 if w.b2 is None else w.b2[e]))
    got = _run(case)
    scale = 1 + np.nanmax(np.abs(want), initial=0)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * scale)
