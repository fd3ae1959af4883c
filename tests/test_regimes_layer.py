"""moeref.regimes, whole layer: an independent float32 torch eager layer (FP32 accumulation, bf16 stores
as declared, the FP8 quantizers written here from their published formulas) gives the reference's bits
on exact-regime layers drawn by Hypothesis, with and without the optional stores; planted faults are
caught by equality alone."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
F = torch.nn.functional

from moeref.regimes import LAYER_SCHEMES, exact_layer, layer_in_exact_regime  # noqa: E402
from moeref.regimes.strategies import exact_layers  # noqa: E402
from moeref.routing.expert_map import expert_map as make_expert_map  # noqa: E402


def slow(n: int):
    return settings(deadline=None, max_examples=min(n, settings().max_examples),
                    suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------ the independent float32 layer


def _dequant(w) -> "torch.Tensor":
    """float32 [R, C] of a bf16 array or an FP8 E4M3 QuantizedTensor (codes viewed as torch float8, scales
    FP32 or UE8M0 2^(code - 127), per 128x128 block or per row)."""
    if isinstance(w, np.ndarray):
        return torch.from_numpy(w.astype(np.float32))
    r, c = w.shape
    if w.scheme.element == "e2m1":  # OCP MX E2M1: sign bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; even element low
        mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        packed = torch.from_numpy(np.array(w.codes, copy=True)).long()
        nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(r, -1)[:, :c]
        codes = mag[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
    else:
        codes = torch.from_numpy(np.array(w.codes, copy=True)).view(torch.float8_e4m3fn).float()
    if w.scheme.scale_format == "ue8m0":
        s = torch.from_numpy(np.ldexp(1.0, w.scales.astype(np.int64) - 127).astype(np.float32))
    else:
        s = torch.from_numpy(w.scales.astype(np.float32))
    br = 1 if s.shape[0] == r else 128
    bc = c if s.shape[1] == 1 else -(-c // s.shape[1])
    return codes * s.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]


def _fp8_quant(x: "torch.Tensor", group: int, ue8m0: bool) -> "torch.Tensor":
    """Dynamic FP8 quantization per ``group`` columns (DeepGEMM ``per_token_cast_to_fp8``): amax / 448,
    UE8M0 rounds the scale up to a power of two; codes RNE; returns the dequantized float32 values."""
    m, k = x.shape
    xg = x.reshape(m, k // group, group)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return ((xg / s).to(torch.float8_e4m3fn).float() * s).reshape(m, k)


def _bf16(x):
    return x.to(torch.bfloat16).float()


def torch_layer(lay, *, fault: str | None = None, act_store: bool = False, gemm1_store: bool = False,
                fault_expert: int = 0):
    """The layer in float32 torch eager. ``fault`` plants one bug (in local expert ``fault_expert``)."""
    cfg = lay.config
    m, k = lay.hidden.shape
    fp8 = lay.scheme.startswith("fp8")
    ue8m0 = lay.scheme.endswith("ue8m0")
    g1 = 128 if lay.scheme.startswith("fp8_1x128") else k
    x = torch.from_numpy(lay.hidden)
    a = _fp8_quant(x, g1, ue8m0) if fp8 else _bf16(x)
    w = torch.from_numpy(lay.topk_weights.astype(np.float32)).clone()
    ids = lay.topk_ids.astype(np.int64)
    if fault == "renormalized_weights":
        w = w / w.sum(1, keepdim=True).clamp(min=1e-30)
    if fault == "swapped_topk_weights":
        w[0, [0, 1]] = w[0, [1, 0]].clone()
    emap = None if cfg.expert_map is None else np.asarray(cfg.expert_map).astype(np.int64)
    if fault == "expert_map_off_by_one":
        emap = np.roll(emap, 1)

    def mlp(rows, weights, e, faulty):
        w13 = _dequant(weights.w13[e])
        w2 = _dequant(weights.w2[e])
        n = w2.shape[1]
        if faulty and fault == "skipped_last_k_block":
            h = rows[:, :k - 128] @ w13[:, :k - 128].T
        else:
            h = rows @ w13.T
        if weights.b13 is not None:
            h = h + torch.from_numpy(np.asarray(weights.b13[e], np.float32))
        if cfg.gemm1_out_dtype is not None or gemm1_store:
            h = _bf16(h)
        layout = weights.w13_layout
        if layout == "interleaved":
            gate, up = h[:, 0::2], h[:, 1::2]
        elif layout == "up_gate":
            up, gate = h[:, :n], h[:, n:]
        else:
            gate, up = h[:, :n], h[:, n:]
        if faulty and fault == "gate_up_swapped":
            gate, up = up, gate
        if cfg.activation == "silu_and_mul":
            act = F.silu(gate) * up
        elif cfg.activation == "gelu_and_mul":
            act = F.gelu(gate, approximate="tanh" if fault == "tanh_gelu" else "none") * up
        else:  # swigluoai (gpt-oss): gate clamped above, up both sides, (up + 1) * gate * sigmoid(1.702 gate)
            gc = gate.clamp(max=7.0)
            act = (up.clamp(-7.0, 7.0) + 1) * (gc * torch.sigmoid(1.702 * gc))
        if cfg.act_out_dtype is not None or act_store:
            act = _bf16(act)
        a2 = _fp8_quant(act, 128 if lay.scheme.startswith("fp8_1x128") else n, ue8m0) if fp8 else act
        if faulty and fault == "halved_w2_scale_block":
            w2 = w2.clone()
            w2[:128, :128] *= 0.5
        y = a2 @ w2.T
        if weights.b2 is not None:
            y = y + torch.from_numpy(np.asarray(weights.b2[e], np.float32))
        return _bf16(y)  # GEMM2's output stored in bf16 before the top-k sum, as vLLM and DeepGEMM do

    out = torch.zeros(m, k)
    slots_t, slots_j = np.nonzero(ids >= 0)
    glob = ids[slots_t, slots_j]
    local = glob if emap is None else emap[glob]
    for e in np.unique(local[local >= 0]):
        sel = local == e
        t, j = slots_t[sel], slots_j[sel]
        y = mlp(a[torch.from_numpy(t)], lay.weights, int(e), int(e) == fault_expert)
        out.index_add_(0, torch.from_numpy(t), w[torch.from_numpy(t), torch.from_numpy(j)][:, None] * y)
    if cfg.shared_experts is not None:
        out = out + mlp(a, cfg.shared_experts.as_weights(), 0, False)
    return out.to(torch.bfloat16)


def _differences(lay, cand) -> int:
    ref = lay.reference().out.astype(np.float32)
    got = cand.float().numpy()
    return int(np.count_nonzero(~((ref == got) | (np.isnan(ref) & np.isnan(got)))))


# ------------------------------------------------------------------ equality on drawn layers


@slow(12)
@given(exact_layers(), st.booleans(), st.booleans())
def test_float32_torch_layer_equals_the_reference_bit_for_bit(lay, act_store, gemm1_store):
    ok, why = layer_in_exact_regime(lay, "hopper_fp8")
    assert ok, why
    assert _differences(lay, torch_layer(lay, act_store=act_store, gemm1_store=gemm1_store)) == 0


@pytest.mark.parametrize("scheme", LAYER_SCHEMES)
def test_larger_shape_equal(scheme):
    """Hidden 512, intermediate 256, 8 experts, top-4, 33 tokens (past a 32-row tile), biases, a shared expert."""
    lay = exact_layer(33, 512, 256, 8, 4, scheme=scheme, seed=7, bias=True, shared_experts=True)
    assert layer_in_exact_regime(lay, "hopper_fp8").ok
    assert _differences(lay, torch_layer(lay)) == 0


# ------------------------------------------------------------------ planted faults, caught by equality


def _busiest(lay) -> int:
    ids = lay.topk_ids[lay.topk_ids >= 0]
    return int(np.bincount(ids).argmax())


@pytest.mark.parametrize("scheme", ["fp8_1x128", "fp8_1x128_ue8m0", "bf16", "mxfp4_w4a16"])
@pytest.mark.parametrize("fault", ["skipped_last_k_block", "halved_w2_scale_block", "swapped_topk_weights",
                                   "gate_up_swapped", "renormalized_weights"])
def test_planted_faults_are_caught(scheme, fault):
    m, e, top = 16, 8, 4
    lay = exact_layer(m, 256, 256, e, top, scheme=scheme, seed=11)
    tw = lay.topk_weights.copy()
    tw[0, :2] = [1.0, 0.25]  # token 0's first two weights differ, so swapping them is a change
    lay = exact_layer(m, 256, 256, e, top, scheme=scheme, seed=11, topk_ids=lay.topk_ids, topk_weights=tw)
    assert _differences(lay, torch_layer(lay)) == 0  # the honest layer first
    assert _differences(lay, torch_layer(lay, fault=fault, fault_expert=_busiest(lay))) > 0


@pytest.mark.parametrize("scheme", ["fp8_1x128", "bf16", "fp8_per_token"])
def test_tanh_gelu_is_caught(scheme):
    lay = exact_layer(16, 256, 256, 8, 4, scheme=scheme, activation="gelu_and_mul", seed=3)
    assert layer_in_exact_regime(lay, "hopper_fp8").ok
    assert _differences(lay, torch_layer(lay)) == 0
    assert _differences(lay, torch_layer(lay, fault="tanh_gelu")) > 0


def test_expert_map_off_by_one_is_caught():
    full = exact_layer(16, 256, 256, 8, 4, scheme="fp8_1x128", seed=5)
    emap = make_expert_map(8, 4, 3, "linear")  # the last rank
    local = np.flatnonzero(emap >= 0)[np.argsort(emap[emap >= 0])]
    from moeref.moe import LayerConfig
    from moeref.regimes import ExactLayer

    cfg = LayerConfig.build(full.config, expert_map=emap, num_experts=8)
    lay = ExactLayer(full.hidden, full.weights.select(local), full.topk_weights, full.topk_ids, cfg, full.scheme,
                     full.token_exponents)
    assert _differences(lay, torch_layer(lay)) == 0
    assert _differences(lay, torch_layer(lay, fault="expert_map_off_by_one")) > 0


@pytest.mark.parametrize("scheme", ["bf16", "mxfp4_w4a16"])
def test_swiglu_oai_layer_equal_and_gate_up_swap_caught(scheme):
    lay = exact_layer(16, 256, 256, 8, 4, scheme=scheme, activation="swigluoai", seed=2, bias=True)
    assert lay.weights.w13_layout == "interleaved" and lay.config.act_out_dtype == "bfloat16"
    assert layer_in_exact_regime(lay, "fp32").ok
    assert _differences(lay, torch_layer(lay)) == 0
    assert _differences(lay, torch_layer(lay, fault="gate_up_swapped", fault_expert=_busiest(lay))) > 0


def test_outside_the_regime_the_checker_says_why():
    lay = exact_layer(4, 256, 256, 4, 2, scheme="fp8_1x128", seed=1)
    from dataclasses import replace

    bad = replace(lay, hidden=(lay.hidden * np.float32(1.1)).astype(np.float32))
    ok, why = layer_in_exact_regime(bad, "fp32")
    assert not ok and any("GEMM1" in r for r in why)
