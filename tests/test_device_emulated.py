"""``layer_bound`` of a device-engine run under the emulated profiles (``DEEPGEMM_FP8_EXACT`` and its
``promotion_order="a_then_b"`` variant) is the host's bound bit for bit (:mod:`moeref.compare.device.emulated`).

The oracle is :func:`moeref.compare.layer_bound` of the NumPy run on the same data. Small FP8 layers (1x128
activations, 128x128 weights, biases, a padded slot, bf16 GEMM1 store, FP32 activation store as
``fastpath.moe`` declares), both promotion orders; the three ways GEMM2's uncertain rows are bounded are each
exercised and counted: rows without an uncertain code, rows whose uncertain codes are enumerated, and the
data-dependent fallback (forced by allowing no enumeration). CPU: the Triton kernels under the interpreter;
GPU: more examples and wider layers.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastpath.testing import device, on_gpu  # noqa: E402
from moeref.compare import PROFILES, layer_bound  # noqa: E402
from moeref.moe import MoEQuant, make_layer, make_tokens, quantize_weights, run_moe  # noqa: E402
from moeref.quant import fp8_block, fp8_group  # noqa: E402

DEV = device()
KW = dict(quant=None, gemm1_out_dtype="bfloat16", act_out_dtype="float32", out_dtype="bfloat16")


def _layer(e, k, n, tokens, top_k, seed):
    w = quantize_weights(make_layer(e, k, n, seed=seed, bias=True), fp8_block())
    x = make_tokens(tokens, k, seed=seed + 1)
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[0, -1] = -1  # a padded slot
    tw = rng.random((tokens, top_k)).astype(np.float32)
    return w, x, tw, ids


def _profile(promotion: str):
    return replace(PROFILES["DEEPGEMM_FP8_EXACT"], act_out_dtype="float32", promotion_order=promotion)


class _Paths:
    """Counts the device path's calls: enumerated combinations (the uncertain blocks' accumulators,
    ``device_block_accumulators``) and data-dependent fallbacks."""

    def __init__(self, monkeypatch):
        import moeref.compare.device.emulated as de
        import moeref.gemm.device_hopper_fp8 as dh

        self.enumerated = self.fallback = 0
        blocks, bound = dh.device_block_accumulators, de.device_rows_error_bound

        def blocks_(*a, **k):
            self.enumerated += 1
            return blocks(*a, **k)

        def bound_(*a, **k):
            self.fallback += 1
            return bound(*a, **k)

        monkeypatch.setattr(dh, "device_block_accumulators", blocks_)
        monkeypatch.setattr(de, "device_rows_error_bound", bound_)


def _same_bound(w, x, tw, ids, promotion):
    kw = dict(KW, quant=MoEQuant(fp8_group(), fp8_group(), "fp8"))
    host = run_moe(x, w, tw, ids, **kw)
    dev = run_moe(x, w, tw, ids, device=DEV, **kw)
    prof = _profile(promotion)
    hb, db = layer_bound(host, prof), layer_bound(dev, prof)
    assert torch.is_tensor(db.bound)
    for name in ("bound", "center", "radius"):
        h, d = getattr(hb, name), getattr(db, name).cpu().numpy()
        assert np.array_equal(h, d), f"{name}: {int(np.sum(h != d))} of {h.size} elements differ"
    assert hb.flips == db.flips


_N = 6 if not on_gpu() else 30


_SEEN = {"enumerated": 0, "fallback": 0}


def _run(promotion, tokens, enumerate_codes, seed, k, n):
    import moeref.compare.emulated_gemm as host_emulated

    with pytest.MonkeyPatch.context() as mp:
        paths = _Paths(mp)
        if not enumerate_codes:
            mp.setattr(host_emulated, "_MAX_ENUMERATED", 0)
        _same_bound(*_layer(3, k, n, tokens, 2, seed), promotion)
    _SEEN["enumerated" if enumerate_codes else "fallback"] += paths.enumerated if enumerate_codes else paths.fallback


@settings(deadline=None, max_examples=_N, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(["deepgemm", "a_then_b"]), st.integers(4, 40 if on_gpu() else 24), st.booleans(),
       st.integers(0, 2**16))
def test_device_emulated_bound_equals_host(promotion, tokens, enumerate_codes, seed):
    """Both promotion orders; ``enumerate_codes=False`` allows no enumeration (every uncertain row takes the
    data-dependent fallback): the same bound, center and radius bits, the same flip count."""
    k, n = (256, 256) if on_gpu() else (128, 128)
    _run(promotion, tokens, enumerate_codes, seed, k, n)


def test_device_emulated_paths_were_exercised():
    """Both of GEMM2's uncertain-row paths ran with equal bits: those the property drew, else fixed layers
    (seed 2, 24 tokens: two rows with one uncertain code each)."""
    for path, enumerate_codes in (("enumerated", True), ("fallback", False)):
        if _SEEN[path] == 0:
            _run("deepgemm", 24, enumerate_codes, 2, 128, 128)
    assert _SEEN["enumerated"] > 0 and _SEEN["fallback"] > 0, _SEEN


def test_device_emulated_refuses_float_weights():
    """The emulated profile predicts DeepGEMM's FP8 GEMM: a bf16 layer is refused with a clear error."""
    w = make_layer(2, 128, 128, seed=0)
    x = make_tokens(3, 128, seed=1)
    ids = np.array([[0, 1]] * 3, dtype=np.int32)
    tw = np.ones((3, 2), np.float32)
    dev = run_moe(x, w, tw, ids, device=DEV, quant=MoEQuant(fp8_group(), fp8_group(), "fp8"))
    with pytest.raises((TypeError, ValueError), match="FP8|E4M3|StackedExperts"):
        layer_bound(dev, _profile("deepgemm"))


def test_fastpath_exact_profile_declared_per_implementation():
    """``fastpath.moe.exact_profile``: DeepGEMM -> DEEPGEMM_FP8_EXACT (``"deepgemm"`` promotion), the Triton FP8 GEMM
    -> TRITON_FP8_BLOCK_EXACT (the same ``"deepgemm"`` promotion), both emulated, with the stores ``reference_config`` declares; a bf16
    layer has none."""
    from fastpath.moe import exact_profile, fast_weights, reference_config

    fw = fast_weights(quantize_weights(make_layer(2, 128, 128, seed=0), fp8_block()), DEV)
    cfg = reference_config(fw)
    for impl, name, order in (("deep_gemm", "DEEPGEMM_FP8_EXACT", "deepgemm"),
                              ("triton", "TRITON_FP8_BLOCK_EXACT", "deepgemm")):
        p = exact_profile(impl, fw)
        assert (p.name, p.accum_model, p.promotion_order) == (name, "emulated", order)
        assert (p.gemm_out_dtype, p.act_out_dtype, p.out_dtype) == (cfg["gemm1_out_dtype"], cfg["act_out_dtype"],
                                                                     cfg["out_dtype"])
    with pytest.raises(ValueError, match="no emulated profile"):
        exact_profile("triton", fast_weights(make_layer(2, 128, 128, seed=0), DEV))
