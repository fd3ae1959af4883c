"""The error bounds on torch float64 tensors (:mod:`moeref.compare.device.bounds`,
:mod:`moeref.compare.device.layer`) give the NumPy bounds bit for bit.

The oracle is the NumPy bound (:func:`moeref.compare.gemm_error_bound`, :func:`moeref.compare.layer_bound`
of a host run) on the same data. CPU (CI): torch CPU tensors with the Triton kernels under
``TRITON_INTERPRET=1``, at tiny shapes (the interpreter runs the per-column loops in Python). GPU: the
layer strategy of test_moe_props (every quantized scheme, activation, w13 layout, routing kind) under the
three accumulation models, and a DeepSeek-V3-shaped FP8 layer through ``fastpath.moe`` compared with the
bound on the GPU.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device, on_gpu  # noqa: E402
from moeref.compare import PROFILES, compare, gemm_error_bound, layer_bound  # noqa: E402
from moeref.compare.device.bounds import DeviceBlock, device_gemm_error_bound, device_quantum_and_max  # noqa: E402
from moeref.gemm.exact import as_operand, quantum_and_max  # noqa: E402
from moeref.moe import MoEQuant, make_layer, make_tokens, quantize_weights, run_moe  # noqa: E402
from moeref.quant import fp8_block, fp8_group, mxfp4, quantize  # noqa: E402
from test_moe_props import layers  # noqa: E402

DEV = device()
MODELS = ("HOPPER_FP8_DEEPGEMM_DATA", "FP32_ACCUM", "HOPPER_FP8_DEEPGEMM")
_HC = [HealthCheck.too_slow, HealthCheck.data_too_large]


def _block(op) -> DeviceBlock:
    o = as_operand(op)
    return DeviceBlock(torch.as_tensor(np.asarray(o.values, dtype=np.float64), device=DEV),
                       torch.as_tensor(np.asarray(o.scales, dtype=np.float64), device=DEV), o.block)


def _same(ref, got, what: str):
    got = got.cpu().numpy()
    assert np.array_equal(ref, got, equal_nan=True), (
        f"{what}: the device bound differs in {np.count_nonzero(ref != got)} of {ref.size} elements "
        f"(max relative {np.nanmax(np.abs(ref - got) / np.maximum(np.abs(ref), 1e-300), initial=0):.3g})")


SCHEMES = {"fp8 block": (fp8_group, fp8_block), "mxfp4": (mxfp4, mxfp4), "float": (None, None)}


@settings(deadline=None, max_examples=60 if on_gpu() else 6, suppress_health_check=_HC)
@given(st.sampled_from(sorted(SCHEMES)), st.sampled_from(MODELS), st.integers(1, 4), st.integers(1, 9),
       st.sampled_from([32, 64, 160]), st.booleans(), st.booleans(), st.integers(0, 2**16))
def test_device_gemm_bound_equals_numpy(scheme, model, m, n, k, radius, bias, seed):
    """One GEMM, every accumulation model, with and without an operand radius and a bias: the same bits."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32) * np.exp2(rng.integers(-6, 6, (m, 1)))
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    sa, sw = SCHEMES[scheme]
    if sa is not None:
        a, w = quantize(a, sa()), quantize(w, sw())
    rad = np.abs(rng.standard_normal((m, k))) * 2.0**-9 if radius else None
    b = rng.standard_normal(n) if bias else None
    prof = PROFILES[model]
    ref = gemm_error_bound(a, w, prof, a_radius=rad, bias=b)
    got = device_gemm_error_bound(_block(a), _block(w), prof,
                                  a_radius=None if rad is None else torch.as_tensor(rad, device=DEV),
                                  b_abs=None if b is None else torch.as_tensor(np.abs(b), device=DEV))
    _same(ref, got, f"{scheme} {model}")


@settings(deadline=None, max_examples=60 if on_gpu() else 8, suppress_health_check=_HC)
@given(st.sampled_from(["fp8 block", "mxfp4", "integers"]), st.integers(1, 5), st.integers(1, 9),
       st.sampled_from([32, 64, 160, 200]), st.booleans(), st.integers(0, 2**16))
def test_device_adder_exact_domain_equals_numpy(scheme, m, n, k, bias, seed):
    """The aligned-adder bound's exact domain (element values, chunk scales after; no radius) on the float64 tensor
    cores (:mod:`moeref.compare.device._adder_mma`) at several tiles (rows an item, columns, warps: the bits do not depend on
    the tile): FP8 and FP4 elements and integers of 16 and 12 bits; zeros among the activations (the nonzero counts);
    K not a multiple of the chunk."""
    import dataclasses

    import moeref.compare.device._adder_mma as mma

    rng = np.random.default_rng(seed)
    if scheme == "integers":
        a = rng.integers(-65535, 65536, (m, k)).astype(np.float32)
        w = rng.integers(-4095, 4096, (n, k)).astype(np.float32)
    else:
        a = rng.standard_normal((m, k)).astype(np.float32) * np.exp2(rng.integers(-6, 6, (m, 1)))
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    a[rng.random((m, k)) < 0.2] = 0
    if scheme != "integers":
        sa, sw = SCHEMES[scheme]
        a, w = quantize(a, sa()), quantize(w, sw())
    b = rng.standard_normal(n) if bias else None
    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    ref = gemm_error_bound(a, w, prof, bias=b)
    for tile in (mma.TILE, dataclasses.replace(mma.TILE, rows=32), mma.MmaTile(rows=16, bn=32, warps=8)):
        saved = mma.TILE, mma.EXACT_ROWS
        mma.TILE, mma.EXACT_ROWS = tile, (tile.rows,)
        try:
            got = device_gemm_error_bound(_block(a), _block(w), prof,
                                          b_abs=None if b is None else torch.as_tensor(np.abs(b), device=DEV))
        finally:
            mma.TILE, mma.EXACT_ROWS = saved
        _same(ref, got, f"{scheme} exact domain, tile {tile}")


@pytest.mark.parametrize("element, block, k, special", [("e4m3fn", (128, 128), 200, False),
                                                        ("e4m3fn", (16, 64), 160, True),
                                                        ("e2m1", (1, 32), 96, True)])
def test_device_gemm2_bound_from_codes_equals_numpy(element, block, k, special):
    """GEMM2's bound (data-dependent profile, an operand radius; the radius term from the same kernel) against
    experts given as codes (:class:`moeref.gemm.StackedExperts`: the scaled form reads the codes through the
    decode table and multiplies by the block scale in the kernel, no float64 copy) is the NumPy bound, bit for
    bit: 8-bit codes with 128x128 blocks (K = 200: a partial chunk), blocks narrower than the chunk, packed
    4-bit codes; ``special``: NaN codes, a zero scale, an infinite scale, zero radii, zero rows."""
    from moeref.compare.bounds import _rows_error_bound, _rows_radius_term
    from moeref.compare.device.bounds import device_rows_error_bound
    from moeref.gemm import StackedExperts
    from moeref.gemm.device import device_operand

    rng = np.random.default_rng(k)
    e, n, r = 3, 40, 9
    kc = (k + 1) // 2 if element == "e2m1" else k
    codes = rng.integers(0, 256, (e, n, kc), dtype=np.uint8)
    if element == "e4m3fn" and not special:
        codes[(codes & 0x7F) == 0x7F] -= 1  # no NaN codes
    grid = (e, -(-n // block[0]), -(-k // block[1]))
    scales = np.exp2(rng.integers(-12, -4, grid)).astype(np.float64) * (1 + rng.random(grid))
    if special:
        scales[0, 0, 0] = 0.0
        scales[1, -1, -1] = np.inf
    host = StackedExperts(codes, scales, element, block, (n, k))
    dev = StackedExperts(torch.as_tensor(codes, device=DEV), torch.as_tensor(scales, device=DEV), element, block, (n, k))
    a = rng.standard_normal((r, k)).astype(np.float32)
    a[2] = 0
    aq = quantize(a, fp8_group())
    rad = np.abs(np.asarray(aq.dequantize(), dtype=np.float64)) * 2.0**-9
    if special:
        rad[:, : k // 3] = 0
    row_expert = np.array([0, 2, 1, -1, 0, 2, 2, 1, 0])
    bias = rng.standard_normal((e, n))
    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    ref_b = _rows_error_bound(aq, rad, row_expert, host, bias, prof)
    ref_r = _rows_radius_term(rad, row_expert, host)
    got_r, got_b = device_rows_error_bound(device_operand(aq, DEV), torch.as_tensor(rad, device=DEV), row_expert, dev,
                                           torch.as_tensor(bias, device=DEV), prof, radius_term=True)
    _same(ref_b, got_b, f"{element} bound")
    _same(ref_r, got_r, f"{element} radius term")


@pytest.mark.parametrize("radius, normal", [(False, True), (False, False), (True, True)])
def test_device_adder_many_rows_equals_numpy(radius, normal, monkeypatch):
    """Experts with more rows than one work item (40 and 19 rows of two experts, E4M3 codes, 1x128 x 128x128): every
    row of the device bound is NumPy's, in the exact form (no radius) and the steps form (a radius, with its radius
    term). On an H100 this case showed rows 8-15 of each 16-row tile wrong while the kernel zeroed its accumulators
    inside a flat loop over the steps (2026-11-28; bench/studies/repro_f64_dot_loop_reset.py); it now runs nested loops.
    ``normal=False``: the exact form without its normal-range shortcut (the grid's subnormal branch kept; the
    threshold raised so no group qualifies), the same numbers."""
    import moeref.compare.device._adder_mma as mma

    if not normal:
        monkeypatch.setattr(mma, "NORMAL_QUANTUM", math.inf)
    from moeref.compare.bounds import _rows_error_bound, _rows_radius_term
    from moeref.compare.device.bounds import device_rows_error_bound
    from moeref.gemm import StackedExperts
    from moeref.gemm.device import device_operand

    rng = np.random.default_rng(7)
    e, n, k = 3, 40, 256
    codes = rng.integers(0, 256, (e, n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] -= 1
    scales = np.exp2(rng.integers(-12, -4, (e, 1, 2))).astype(np.float64) * (1 + rng.random((e, 1, 2)))
    host = StackedExperts(codes, scales, "e4m3fn", (128, 128), (n, k))
    dev = StackedExperts(torch.as_tensor(codes, device=DEV), torch.as_tensor(scales, device=DEV), "e4m3fn", (128, 128),
                         (n, k))
    row_expert = np.array([2] * 40 + [0] * 19)
    aq = quantize(rng.standard_normal((row_expert.size, k)).astype(np.float32), fp8_group())
    rad = np.abs(np.asarray(aq.dequantize(), dtype=np.float64)) * 2.0**-9 if radius else None
    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    ref = _rows_error_bound(aq, rad, row_expert, host, None, prof)
    if radius:
        got_r, got = device_rows_error_bound(device_operand(aq, DEV), torch.as_tensor(rad, device=DEV), row_expert,
                                             dev, None, prof, radius_term=True)
        _same(_rows_radius_term(rad, row_expert, host), got_r, "radius term, many rows")
    else:
        got = device_rows_error_bound(device_operand(aq, DEV), None, row_expert, dev, None, prof)
    _same(ref, got, f"{'steps' if radius else 'exact'} form, many rows")


@pytest.mark.parametrize("radius", [False, True])
def test_device_bound_kernel_product_equals_the_engines(radius):
    """``device_rows_error_bound(center=True)``: the product the aligned-adder kernel forms from its exact chunk sums
    (exact form without a radius, steps form with one) is the NumPy engine's ``a W^T`` bit for bit, with weight scales
    of both signs, a padding row and experts with one to many rows; with a bias the layer adds it
    (:func:`moeref.gemm.device.add_expert_bias`) as the engine does."""
    from moeref.compare.device.bounds import device_rows_error_bound
    from moeref.gemm import StackedExperts, expert_rows_gemm
    from moeref.gemm.device import add_expert_bias, device_operand

    rng = np.random.default_rng(23)
    e, n, k = 3, 72, 384
    codes = rng.integers(0, 256, (e, n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] -= 1
    scales = np.exp2(rng.integers(-12, -4, (e, 1, 3))) * (1 + rng.random((e, 1, 3)))
    scales *= np.where(rng.random((e, 1, 3)) < 0.5, -1.0, 1.0)
    host = StackedExperts(codes, scales, "e4m3fn", (128, 128), (n, k))
    dev = StackedExperts(torch.as_tensor(codes, device=DEV), torch.as_tensor(scales, device=DEV), "e4m3fn", (128, 128),
                         (n, k))
    row_expert = np.array([2] * 21 + [-1] + [0] + [1] * 3)
    aq = quantize(rng.standard_normal((row_expert.size, k)).astype(np.float32), fp8_group())
    rad = torch.as_tensor(np.abs(np.asarray(aq.dequantize(), dtype=np.float64)) * 2.0**-9, device=DEV) if radius else None
    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    got = device_rows_error_bound(device_operand(aq, DEV), rad, row_expert, dev, None, prof, radius_term=radius,
                                  center=True)
    assert got[-1] is not None, "the kernel gives the product in the exact and steps forms"
    _same(expert_rows_gemm(aq, row_expert, host), got[-1], "product")
    bias = rng.standard_normal((e, n))
    with_bias = add_expert_bias(got[-1].clone(), row_expert, torch.as_tensor(bias, device=DEV), e)
    _same(expert_rows_gemm(aq, row_expert, host, bias), with_bias, "product + bias")
    plain = device_rows_error_bound(device_operand(aq, DEV), rad, row_expert, dev, None, prof, radius_term=radius)
    for x, y in zip(got[:-1], plain if radius else (plain,)):
        assert torch.equal(x.view(torch.int64), y.view(torch.int64)), "center=True leaves the bound's bits alone"


def test_device_radius_term_per_expert_equals_numpy():
    """GEMM2's radius term when the bound is in the scaled form (float rows against E4M3 experts) and one expert's
    rows hold an infinite radius: that expert keeps the ordered sum, the other takes the exact chunk sums on the
    radius's grid (:func:`moeref.compare.operand_radius.radius_dot`), as NumPy decides per expert."""
    from moeref.compare.bounds import _rows_error_bound, _rows_radius_term
    from moeref.compare.device.bounds import device_rows_error_bound
    from moeref.gemm import StackedExperts
    from moeref.gemm.device import device_operand

    rng = np.random.default_rng(11)
    e, n, k = 2, 24, 256
    codes = rng.integers(0, 256, (e, n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] -= 1
    scales = np.exp2(rng.integers(-12, -4, (e, 1, 2))).astype(np.float64)
    host = StackedExperts(codes, scales, "e4m3fn", (128, 128), (n, k))
    dev = StackedExperts(torch.as_tensor(codes, device=DEV), torch.as_tensor(scales, device=DEV), "e4m3fn", (128, 128),
                         (n, k))
    row_expert = np.array([0, 1, 0, 1, 1])
    a = rng.standard_normal((5, k))
    rad = np.abs(a) * 2.0**-9
    rad[1, 7] = np.inf  # a row of expert 1
    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    ref_r = _rows_radius_term(rad, row_expert, host)
    ref_b = _rows_error_bound(a, rad, row_expert, host, None, prof)
    got_r, got_b = device_rows_error_bound(device_operand(torch.as_tensor(a, device=DEV), DEV),
                                           torch.as_tensor(rad, device=DEV), row_expert, dev, None, prof,
                                           radius_term=True)
    _same(ref_r, got_r, "radius term per expert")
    _same(ref_b, got_b, "scaled-form bound")


def test_device_quantum_and_max_equals_numpy():
    v = np.array([448.0, -0.001953125, 0.0, 3.5, -2.0**-20, 1e-300])
    assert device_quantum_and_max(torch.as_tensor(v, device=DEV)) == quantum_and_max(v)
    assert device_quantum_and_max(torch.zeros(3, dtype=torch.float64, device=DEV)) == quantum_and_max(np.zeros(3))


def _small_layer(e=3, k=64, n=32, tokens=5, seed=0):
    w = quantize_weights(make_layer(e, k, n, seed=seed, bias=True), fp8_block())
    x = make_tokens(tokens, k, seed=seed + 1)
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(e, 2, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[0, 1] = -1  # a padded slot
    tw = rng.random((tokens, 2)).astype(np.float32)
    return w, x, tw, ids


def test_host_definition_rejects_a_device_run():
    """``moeref.compare.bounds.layer_bound`` is the bound's NumPy definition: given a device-engine run it raises
    TypeError naming :func:`moeref.compare.layer_bound`, which bounds that run on its device."""
    from moeref.compare import bounds

    w, x, tw, ids = _small_layer()
    dev = run_moe(x, w, tw, ids, device=DEV, quant=MoEQuant(fp8_group(), fp8_group(), "fp8"))
    with pytest.raises(TypeError, match=r"moeref\.compare\.layer_bound"):
        bounds.layer_bound(dev, "BF16_OUTPUT")
    assert torch.is_tensor(layer_bound(dev, "BF16_OUTPUT").bound)


@pytest.mark.parametrize("model, k, n", [("HOPPER_FP8_DEEPGEMM_DATA", 64, 32), ("BF16_OUTPUT", 64, 32),
                                         ("HOPPER_FP8_DEEPGEMM", 64, 32), ("HOPPER_FP8_DEEPGEMM_DATA", 200, 72)])
def test_device_layer_bound_equals_numpy_small_layer(model, k, n):
    """A small FP8 layer (biases, a padded slot, bf16 GEMM1 store; K = 200: partial 128-blocks): ``layer_bound``
    of the device run is the host run's, bit for bit (bound, center, radius, flips), under the three
    accumulation models (data-dependent, contiguous tree, worst case)."""
    w, x, tw, ids = _small_layer(k=k, n=n)
    kw = dict(quant=MoEQuant(fp8_group(), fp8_group(), "fp8"), gemm1_out_dtype="bfloat16", act_out_dtype="float32",
              out_dtype="bfloat16")
    host = run_moe(x, w, tw, ids, **kw)
    dev = run_moe(x, w, tw, ids, device=DEV, **kw)
    hb, db = layer_bound(host, PROFILES[model]), layer_bound(dev, PROFILES[model])
    assert torch.is_tensor(db.bound) and db.bound.device.type == torch.device(DEV).type
    _same(hb.bound, db.bound, f"{model} bound")
    _same(hb.radius, db.radius, f"{model} radius")
    assert hb.flips == db.flips


@pytest.mark.parametrize("stores, model, recomputed, flips", [
    (dict(), "EXACT", 0, False),  # the bound's intermediate is the run's: both products read from the run
    # flips: GEMM2's product again, from the aligned-adder kernel (it forms the exact chunk sums for its bound)
    (dict(gemm1_out_dtype="bfloat16", act_out_dtype="float32"), "HOPPER_FP8_DEEPGEMM_DATA", 0, True),
    (dict(gemm1_out_dtype="bfloat16", act_out_dtype="float32"), "HOPPER_FP8_DEEPGEMM", 1, True),  # or computed here
])
def test_device_layer_bound_reads_the_runs_exact_products(monkeypatch, stores, model, recomputed, flips):
    """The device bound takes GEMM1's exact output from the run (``ExpertsOutput.h_pre``) and GEMM2's when its
    re-quantized intermediate is the run's GEMM2 operand bit for bit; otherwise GEMM2's product comes from the
    data-dependent bound's own kernel where it forms it, else the device engine computes it again. Counted through
    the engine's GEMM entry point; the bound stays the NumPy bound (which recomputes both)."""
    import moeref.moe.device as engine

    w, x, tw, ids = _small_layer()
    kw = dict(quant=MoEQuant(fp8_group(), fp8_group(), "fp8"), out_dtype="bfloat16", **stores)
    host = run_moe(x, w, tw, ids, **kw)
    dev = run_moe(x, w, tw, ids, device=DEV, **kw)
    assert all(e.h_pre is not None and e.h_pre.shape == e.h.shape for _, e in dev.chunks)
    calls = []
    real = engine._weights_gemm
    monkeypatch.setattr(engine, "_weights_gemm", lambda *a: calls.append(a[0].shape) or real(*a))
    hb, db = layer_bound(host, PROFILES[model]), layer_bound(dev, PROFILES[model])
    assert len(calls) == recomputed, calls
    _same(hb.bound, db.bound, f"{model} bound")
    _same(hb.radius, db.radius, f"{model} radius")
    assert hb.flips == db.flips and (hb.flips > 0) == flips


@pytest.mark.parametrize("shift", [0.0, 1.0])
def test_compare_of_a_device_run_equals_the_host_compare(shift):
    """``compare`` of a device run (checks and metrics on the device) reports what the host compare of the host
    run reports: the same error, bound, violations, per-token and per-expert counts, suspects (bit for bit) and
    checks, the metrics to rounding (torch's summation order). ``shift`` 1.0 plants violations on two tokens."""
    w, x, tw, ids = _small_layer()
    kw = dict(quant=MoEQuant(fp8_group(), fp8_group(), "fp8"), gemm1_out_dtype="bfloat16", act_out_dtype="float32",
              out_dtype="bfloat16")
    host = run_moe(x, w, tw, ids, **kw)
    dev = run_moe(x, w, tw, ids, device=DEV, **kw)
    cand = np.asarray(host.output, dtype=np.float32).copy()
    cand[[1, 3], :4] += shift
    prof = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]
    hr, dr = compare(cand, host, prof), compare(torch.as_tensor(cand, device=DEV), dev, prof)
    assert dr.passed == (shift == 0.0) and dr.passed == hr.passed
    for f in ("error", "bound", "violations", "token_violations"):
        assert isinstance(getattr(dr, f), np.ndarray), f
        assert np.array_equal(getattr(hr, f), getattr(dr, f)), f
    assert hr.expert_violations == dr.expert_violations and hr.checks == dr.checks and hr.flips == dr.flips
    assert hr.suspects == dr.suspects  # slot, expert and float64 correlation: one formula on both engines
    for key, v in hr.metrics.items():
        assert dr.metrics[key] == pytest.approx(v, rel=1e-12, abs=1e-12), key  # calc_diff = 1 - x: absolute


@pytest.mark.gpu
@settings(deadline=None, max_examples=40, suppress_health_check=_HC)
@given(layers(), st.sampled_from(MODELS + ("BF16_OUTPUT", "VLLM_MOE_SUM_BF16")), st.data())
def test_device_layer_bound_equals_numpy_over_layers(case, model, data):
    """The layer strategy of test_moe_props (quantized schemes: the device run is the host run bit for bit):
    the layer bound computed on the GPU is the NumPy bound."""
    if not on_gpu():
        pytest.skip("GPU only: the interpreter is too slow for the layer strategy's shapes (CPU: the small layer)")
    assume(case["a_scheme"] is not None)
    r = case["routing"]
    kw = dict(activation=case["activation"], quant=case["quant"], num_experts=r.num_experts,
              gemm1_out_dtype=data.draw(st.sampled_from([None, "bfloat16"])), act_out_dtype="float32")
    host = run_moe(case["hidden"], case["weights"], r.weights, r.ids, **kw)
    dev = run_moe(case["hidden"], case["weights"], r.weights, r.ids, device="cuda", **kw)
    hb, db = layer_bound(host, PROFILES[model]), layer_bound(dev, PROFILES[model])
    _same(hb.bound, db.bound, f"{case['name']} {model}")
    assert hb.flips == db.flips


@pytest.mark.gpu
def test_compare_on_the_gpu_deepseek_v3_shape():
    """A DeepSeek-V3-shaped FP8 layer (hidden 7168, intermediate 2048, top-8; 32 experts to keep the test
    short) through ``fastpath.moe`` against the GPU reference: ``compare`` runs with the bound on the GPU and
    passes under the declared profile. (Planted faults are inside this profile's bound at K = 7168, which lets
    every bf16 store flip; a neighbouring scale block passed on an H100: docs/moe-gpu.md.)"""
    if not on_gpu():
        pytest.skip("GPU only: a DeepSeek-V3-shaped layer")
    from fastpath.moe import FastMoEWeights, fused_moe, reference_config
    from moeref.moe import MoEWeights

    gen = torch.Generator(device="cuda").manual_seed(0)
    e, hid, inter, m = 32, 7168, 2048, 64

    from test_fastpath_moe_production import _fp8_experts

    def experts(n, k):
        return _fp8_experts(gen, e, n, k)

    weights = MoEWeights(experts(2 * inter, hid), experts(hid, inter), "gate_up")
    fw = FastMoEWeights(weights.w13.codes.view(torch.float8_e4m3fn), weights.w2.codes.view(torch.float8_e4m3fn),
                        "gate_up", weights.w13.scales.float(), weights.w2.scales.float())
    x = torch.randn((m, hid), device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand((m, e), device="cuda", generator=gen).topk(8, dim=1).indices.to(torch.int32)
    tw = torch.rand((m, 8), device="cuda", generator=gen)
    tw = (tw / tw.sum(dim=1, keepdim=True)).float()
    cfg = reference_config(fw)
    prof = cfg.pop("profile")
    run = run_moe(x, weights, tw, ids.cpu().numpy(), device="cuda", **cfg)
    got = fused_moe(x, fw, tw, ids)
    rep = compare(got, run, prof)
    assert rep.passed, rep.summary()
    assert rep.flips > 0 and rep.bound.shape == (m, hid)
    # a device run is bounded on its device (a tensor there), not on the host
    assert torch.is_tensor(layer_bound(run, prof).bound)
