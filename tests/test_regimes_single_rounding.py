"""moeref.regimes.single_rounding_layer: every declared store of the whole layer rounds an exact value once.

An independent float32 torch layer written here (FP32 GEMMs, bf16 stores, FP8 quantizers from their formulas,
rounding modes from the bit patterns) gives the reference's bits under honest reorderings (split-K, a permuted K
order, the top-k sum in reverse slot order, tokens in chunks, the optional activation store), on layers drawn by
Hypothesis; and each fault the exact regimes cannot see changes them: a round-toward-zero (or round-half-away)
store, a bf16 accumulator in either GEMM, and a second store (GEMM2's output in bf16 before the top-k sum)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
F = torch.nn.functional

from moeref.regimes import (ROUNDING_LAYER_SCHEMES, exact_layer, layer_in_exact_regime,  # noqa: E402
                            single_rounding_layer)
from moeref.regimes.strategies import single_rounding_layers  # noqa: E402
from test_regimes_layer import _dequant  # noqa: E402  (the weights' codes x scales, from their formulas)

BF16_MASK = -65536  # int32 0xFFFF0000


def slow(n: int):
    return settings(deadline=None, max_examples=min(n, settings().max_examples),
                    suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------ rounding, from the bit patterns


def bf16(x, mode: str = "rne"):
    """float32 ``x`` rounded to bf16 (returned as float32): ``rne`` (torch's cast), ``rz`` (cut the low 16 bits),
    ``half_away`` (add half an ulp to the magnitude, then cut)."""
    x = x.float().contiguous()
    if mode == "rne":
        return x.to(torch.bfloat16).float()
    b = x.view(torch.int32)
    if mode == "rz":
        return (b & BF16_MASK).view(torch.float32)
    assert mode == "half_away"
    sign = b & torch.tensor(-2**31, dtype=torch.int32)
    mag = b & 0x7FFFFFFF
    return (((mag + 0x8000) & BF16_MASK) | sign).view(torch.float32)


def e4m3(v, mode: str = "rne"):
    """float32 ``v`` (|v| <= 448) rounded to E4M3 values: torch's cast (RNE), or toward zero on the E4M3 grid
    (3 fraction bits, normal exponents >= -6)."""
    if mode == "rne":
        return v.to(torch.float8_e4m3fn).float()
    _, ex = torch.frexp(v)
    step = torch.exp2((torch.clamp(ex - 1, min=-6) - 3).float())
    return torch.trunc(v / step) * step


def fp8_quant(x, group: int, ue8m0: bool, mode: str = "rne"):
    """Dynamic FP8 per ``group`` columns (amax / 448; UE8M0: the power of two above): dequantized float32."""
    m, k = x.shape
    xg = x.reshape(m, k // group, group)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return (e4m3(xg / s, mode) * s).reshape(m, k)


# ------------------------------------------------------------------ GEMMs


def gemm(a, w, kind: str, perm=None):
    """``a [R, C] @ w [N, C].T`` in float32: ``fp32`` (one matmul), ``split_k`` (two halves added in FP32),
    ``permuted`` (K in the order ``perm``, four chunks summed last-first), ``bf16_acc`` (a bf16 accumulator
    rounded after every column, K in order), ``bf16_acc_reversed`` (the same, K backward), ``bf16_acc_tiles``
    (a bf16 accumulator rounded after every 16 columns), ``bf16_acc_blocks`` (FP32 sums of 128-column K blocks
    added in a bf16 accumulator)."""
    if kind == "fp32":
        return a @ w.T
    if kind == "bf16_acc_reversed":
        return gemm(a.flip(1), w.flip(1), "bf16_acc")
    if kind in ("bf16_acc_tiles", "bf16_acc_blocks"):  # FP32 products of 16 columns (one MMA k-step), or FP32
        step = 16 if kind == "bf16_acc_tiles" else 128  # sums of 128-column K blocks, added to a bf16 accumulator
        acc = torch.zeros(a.shape[0], w.shape[0])
        for j in range(0, a.shape[1], step):
            acc = bf16(acc + a[:, j:j + step] @ w[:, j:j + step].T)
        return acc
    if kind == "split_k":
        h = a.shape[1] // 2
        return a[:, h:] @ w[:, h:].T + a[:, :h] @ w[:, :h].T
    if kind == "permuted":
        parts = [a[:, p] @ w[:, p].T for p in torch.tensor_split(perm, 4)]
        out = parts[-1]
        for p in parts[-2::-1]:
            out = out + p
        return out
    assert kind == "bf16_acc"
    acc = torch.zeros(a.shape[0], w.shape[0])
    for j in range(a.shape[1]):
        acc = bf16(acc + a[:, j:j + 1] * w[:, j][None, :])
    return acc


def torch_layer(lay, *, gemm1="fp32", gemm2="fp32", gemm1_store="rne", act_store=None, a2_mode="rne",
                gemm2_store=False, out_store="rne", reverse_topk=False, chunk=None, seed=0, trace=None):
    """The layer in float32 torch eager. ``act_store``: None (FP8: no store; bf16: the declared RNE store), or a
    rounding mode for a bf16 store of the activation. ``a2_mode``: the FP8 re-quantization's rounding.
    ``gemm2_store``: GEMM2's output stored in bf16 before the top-k sum (True or ``"rne"``; ``"rz"``: toward
    zero): a second store, or the declared one of a layer with ``gemm2_store="bfloat16"``. ``trace``: a dict
    that receives the unrounded values each store rounds (``up``: GEMM1's up half, ``a2_in``: the FP8
    quantizer's scaled input or the activation before its bf16 store, ``y``, ``out``)."""
    tr = trace if trace is not None else {}
    for name in ("up", "a2_in", "y"):
        tr[name] = []
    cfg = lay.config
    m, k = lay.hidden.shape
    fp8 = lay.scheme.startswith("fp8")
    ue8m0 = lay.scheme.endswith("ue8m0")
    one_x_128 = lay.scheme.startswith("fp8_1x128")
    x = torch.from_numpy(lay.hidden)
    a = fp8_quant(x, 128 if one_x_128 else k, ue8m0) if fp8 else bf16(x)
    ids = lay.topk_ids.astype(np.int64)
    tw = torch.from_numpy(lay.topk_weights.astype(np.float32))
    emap = None if cfg.expert_map is None else np.asarray(cfg.expert_map).astype(np.int64)
    gen = torch.Generator().manual_seed(seed)
    if act_store is None and not fp8:
        act_store = "rne"  # the bf16 layer declares it

    def mlp(rows, weights, e):
        w13, w2 = _dequant(weights.w13[e]), _dequant(weights.w2[e])
        n = w2.shape[1]
        h = gemm(rows, w13, gemm1, torch.randperm(k, generator=gen))
        tr["up"].append(h[:, n:].reshape(-1))
        g, u = (bf16(h, gemm1_store)).split(n, dim=1)
        act = (F.silu(g) if cfg.activation == "silu_and_mul" else F.gelu(g)) * u
        if not fp8:
            tr["a2_in"].append(act.reshape(-1))
        if act_store is not None:
            act = bf16(act, act_store)
        if fp8:
            group = 128 if one_x_128 else n
            tr["a2_in"].append((act.reshape(len(act), -1, group)
                                / act.reshape(len(act), -1, group).abs().amax(-1, keepdim=True).clamp(min=1e-4)
                                * 448.0).reshape(-1))
            a2 = fp8_quant(act, group, ue8m0, a2_mode)
        else:
            a2 = act
        y = gemm(a2, w2, gemm2, torch.randperm(n, generator=gen))
        tr["y"].append(y.reshape(-1))
        return bf16(y, gemm2_store if isinstance(gemm2_store, str) else "rne") if gemm2_store else y

    out = torch.zeros(m, k)
    starts = range(0, m, chunk or max(m, 1))
    for s0 in starts:
        s1 = min(s0 + (chunk or m), m)
        slots_t, slots_j = np.nonzero(ids[s0:s1] >= 0)
        slots_t = slots_t + s0
        glob = ids[slots_t, slots_j]
        local = glob if emap is None else emap[glob]
        contrib = torch.zeros(len(slots_t), k)
        for e in np.unique(local[local >= 0]):
            sel = np.flatnonzero(local == e)
            y = mlp(a[torch.from_numpy(slots_t[sel])], lay.weights, int(e))
            weight = tw[torch.from_numpy(slots_t[sel]), torch.from_numpy(slots_j[sel])]
            contrib[torch.from_numpy(sel)] = weight[:, None] * y
        keep = torch.from_numpy(local >= 0)
        order = sorted(range(ids.shape[1]), reverse=reverse_topk)
        for j in order:  # the top-k sum slot by slot (index_add_ in FP32: exact in any order here)
            sel = torch.from_numpy(slots_j == j) & keep
            out.index_add_(0, torch.from_numpy(slots_t)[sel], contrib[sel])
    if cfg.shared_experts is not None:
        out = out + mlp(a, cfg.shared_experts.as_weights(), 0)
    tr["out"] = out.reshape(-1)
    return bf16(out, out_store)


_REFERENCE_OUT: dict = {}


def _differences(lay, got) -> int:
    if id(lay) not in _REFERENCE_OUT:
        _REFERENCE_OUT[id(lay)] = (lay, lay.reference().out.astype(np.float32))  # the layer kept: ids stay unique
    ref = _REFERENCE_OUT[id(lay)][1]
    got = got.numpy()
    return int(np.count_nonzero(~((ref == got) | (np.isnan(ref) & np.isnan(got)))))


# ------------------------------------------------------------------ honest orders give the reference's bits


@slow(12)
@given(single_rounding_layers(), st.sampled_from(["fp32", "split_k", "permuted"]),
       st.sampled_from(["fp32", "split_k", "permuted"]), st.booleans(), st.booleans(), st.integers(0, 3))
def test_honest_orders_equal_the_reference(lay, gemm1, gemm2, reverse, act_store, chunk):
    assert layer_in_exact_regime(lay, "fp32" if lay.scheme == "bf16" else "hopper_fp8").ok
    got = torch_layer(lay, gemm1=gemm1, gemm2=gemm2, reverse_topk=reverse, chunk=chunk or None,
                      act_store="rne" if act_store else None)
    assert _differences(lay, got) == 0


@functools.lru_cache(maxsize=None)
def _layer(scheme):
    return single_rounding_layer(24, 256, 256, 8, 4, scheme=scheme, seed=4, shared_experts=True)


@pytest.mark.parametrize("scheme", ROUNDING_LAYER_SCHEMES)
def test_every_declared_store_rounds(scheme):
    """The values really need their rounding (measured in the torch layer's trace): the exact GEMM1 up values,
    the intermediate (the FP8 codes' input, or the activation bf16 stores), GEMM2's output and the layer's FP32
    sum each differ from their rounded value in a good share of the elements."""
    lay = _layer(scheme)
    tr = {}
    torch_layer(lay, trace=tr)

    def share(name, rounded):
        v = torch.cat(tr[name]) if isinstance(tr[name], list) else tr[name]
        v = v[v != 0]
        return float((rounded(v) != v).float().mean())

    assert share("up", bf16) > 0.8
    assert share("a2_in", e4m3 if scheme != "bf16" else bf16) > 0.4
    assert share("y", bf16) > 0.6
    assert share("out", bf16) > 0.8


# ------------------------------------------------------------------ each fault changes the bits


FAULTS = {
    "RZ GEMM1 store": dict(gemm1_store="rz"),
    "RZ intermediate": None,  # per scheme: the FP8 codes, or bf16's declared activation store
    "RZ output store": dict(out_store="rz"),
    "half-away output store": dict(out_store="half_away"),
    "bf16 accumulator GEMM1": dict(gemm1="bf16_acc"),
    "bf16 accumulator GEMM1, K backward": dict(gemm1="bf16_acc_reversed"),
    "bf16 accumulator GEMM1, per 16-column tile": dict(gemm1="bf16_acc_tiles"),
    "bf16 accumulator GEMM2": dict(gemm2="bf16_acc"),
    "bf16 accumulator GEMM2, K backward": dict(gemm2="bf16_acc_reversed"),
    "bf16 accumulator GEMM2, per 16-column tile": dict(gemm2="bf16_acc_tiles"),
    "two stores (GEMM2 in bf16 before the top-k sum)": dict(gemm2_store=True),
}


@pytest.mark.parametrize("scheme", ROUNDING_LAYER_SCHEMES)
def test_the_fault_tests_honest_layer_is_equal(scheme):
    lay = _layer(scheme)
    assert _differences(lay, torch_layer(lay)) == 0


@pytest.mark.parametrize("scheme", ["fp8_1x128", "fp8_per_token", "bf16"])  # ue8m0: fp8_1x128's values
@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_is_caught(scheme, fault):
    lay = _layer(scheme)
    kw = FAULTS[fault]
    if kw is None:
        kw = dict(a2_mode="rz") if scheme != "bf16" else dict(act_store="rz")
    assert _differences(lay, torch_layer(lay, **kw)) > 0


@pytest.mark.parametrize("fault", ["RZ GEMM1 store", "bf16 accumulator GEMM1", "bf16 accumulator GEMM2",
                                   "two stores (GEMM2 in bf16 before the top-k sum)"])
def test_exact_layer_cannot_see_them(fault):
    """The contrast that motivates the construction: on exact_layer's layers the same faults give the
    reference's bits (an exact value has nothing to round, a small integer sum fits 8 bits)."""
    lay = exact_layer(24, 256, 256, 8, 4, scheme="fp8_1x128", seed=4)
    assert _differences(lay, torch_layer(lay, **FAULTS[fault])) == 0


def test_regime_check_names_the_excluded_store_and_narrow_accumulators():
    lay = _layer("fp8_1x128")
    assert lay.excluded_stores == ("gemm2",)
    assert layer_in_exact_regime(lay, "hopper_fp8").ok and layer_in_exact_regime(lay, "fp32").ok
    ok, why = layer_in_exact_regime(lay, "bf16_accumulator")
    assert not ok and any("bf16 accumulator" in r for r in why)
    from dataclasses import replace

    ok, why = layer_in_exact_regime(replace(lay, excluded_stores=()), "hopper_fp8")
    assert not ok and any("GEMM2 output" in r and "not exact in bf16" in r for r in why)


def test_bad_arguments():
    with pytest.raises(ValueError, match="scheme"):
        single_rounding_layer(2, 256, 256, 2, 1, scheme="mxfp4_w4a16")
    with pytest.raises(ValueError, match="activation"):
        single_rounding_layer(2, 256, 256, 2, 1, activation="swigluoai")
    with pytest.raises(ValueError, match="token_exponents"):
        single_rounding_layer(2, 256, 256, 2, 1, token_exponents=(-1, 0))
    with pytest.raises(TypeError, match="bias"):
        single_rounding_layer(2, 256, 256, 2, 1, bias=True)
