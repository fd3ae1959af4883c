"""NVFP4 with a STATIC global scale on the Triton fast path equals the reference, bit for bit.

``fastpath.quant.quantize(x, scheme, global_scale=g)`` (vLLM's production path,
``scaled_fp4_quant(x, input_global_scale)``: one pass over x, no amax pass) against
:func:`moeref.quant.nvfp4.quantize_nvfp4` ``(x, scheme, global_scale=g)``, the specification:

* every NVFP4 operation order (te, flashinfer, vllm, torchao) x every global-scale convention it
  accepts (amax, encode_scale, decode_scale), random shapes, dtypes, strides and magnitudes, with
  a static scale drawn around the tensor amax (below it, so the top blocks saturate at UE4M3 448
  and their elements at E2M1 +-6; and above it);
* element codes, the logical scales and the raw 128x4-swizzled storage (padding included; every
  output buffer poisoned first, :func:`fastpath.testing.poisoned`), and ``global_scale`` (the
  float64 decode factor), plus ``.to_reference()`` and its dequantization;
* the static value as a Python float, a NumPy scalar, and a one-element float32 tensor;
* float32 extremes where the orders differ (TE's FLT_MAX clamp of S_enc and its 0 -> 1 rule, an
  amax that rounds to float32 0 or overflows to Inf) and every case where the reference raises,
  which must raise the same exception with the same message;
* the static path runs no amax kernel (the amax kernels are replaced by ones that fail), the
  dynamic path still does and is unchanged; the registry passes ``global_scale`` through.

Runs on CPU under ``TRITON_INTERPRET=1`` (conftest.py) with small shapes, and on a GPU for real.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from hypothesis import given, settings, strategies as st  # noqa: E402

from moeref.quant import fp8_group, fp8_per_tensor, mxfp4  # noqa: E402
from moeref.quant.nvfp4 import (  # noqa: E402
    NVFP4_CONVENTIONS, NVFP4_ORDERS, nvfp4, quantize_nvfp4,
)

from fastpath import quant as Q  # noqa: E402
from fastpath.quant import _launch as QL  # noqa: E402
from fastpath.quant import _plan as QPL  # noqa: E402
from fastpath import registry  # noqa: E402
from fastpath.testing import device, on_gpu, poisoned, to_device  # noqa: E402
from property_tests.test_fastpath_quant import (  # noqa: E402
    SETTINGS, assert_same_codes, assert_same_scales, device_input, expected_storage, make_input,
)

GPU = on_gpu()
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]
if not GPU:
    pytestmark.append(pytest.mark.interp)

_N = settings().max_examples
EXAMPLES = max(10, _N // 2) if GPU else max(4, _N // 5)
MAX_M = 300 if GPU else 20
MAX_K = 2048 if GPU else 100


def _combos():
    """Every (order, convention) pair an NVFP4 preset exists for (the others refuse to build)."""
    out = []
    for o in NVFP4_ORDERS:
        for c in NVFP4_CONVENTIONS:
            try:
                nvfp4(preset=f"nvfp4_{o}", convention=c)
            except ValueError:
                continue
            out.append((o, c))
    return out


COMBOS = _combos()


def test_combos_cover_every_order():
    # te/flashinfer/vllm: amax + encode_scale; torchao: amax + decode_scale
    assert len(COMBOS) == 8
    assert {o for o, _ in COMBOS} == set(NVFP4_ORDERS)
    assert {c for _, c in COMBOS} == set(NVFP4_CONVENTIONS)


def in_convention(amax: float, convention: str) -> float:
    """The static quantity of a tensor amax in ``convention`` (module docstring of
    moeref.quant.nvfp4: amax A, encode S_enc = 2688 / A, decode A / 2688)."""
    if convention == "amax":
        return amax
    return 2688.0 / amax if convention == "encode_scale" else amax / 2688.0


def as_form(g: float, form: str):
    """``g`` as the caller passes it, and the number the reference is given for it."""
    if form == "float":
        return g, g
    if form == "numpy":
        return np.float64(g), g
    t = torch.tensor([g], dtype=torch.float32)  # the float32 quantity, as vLLM holds it
    return t, float(t[0])


def check_static(scheme, xn, x, g, layout="swizzled_128x4", ref_g=None):
    """Fast path with ``global_scale=g`` equals the reference with ``ref_g`` (default ``g``)."""
    ref = quantize_nvfp4(xn, scheme, global_scale=g if ref_g is None else ref_g)
    with poisoned():
        got = Q.quantize(x, scheme, scale_layout=layout, global_scale=g)
    what = f"{scheme.preset.name}/{layout} g={g!r} shape={xn.shape} dtype={xn.dtype}"
    assert_same_codes(got.codes.cpu().numpy(), ref.codes, "e2m1", what)
    assert_same_scales(got.scales_logical(), ref.scales, what)
    if layout != "row_major":  # raw storage, padding included (poisoned: must be written 0)
        from moeref._interop import to_numpy
        want = expected_storage(ref.scales, layout)
        storage = np.ascontiguousarray(to_numpy(got.scales.cpu())).reshape(want.shape)
        assert_same_scales(storage.view(want.dtype), want, what + " storage")
    assert got.global_scale.dtype == torch.float64, what
    assert float(got.global_scale.reshape(-1)[0]) == ref.global_scale, what
    return got, ref


@st.composite
def static_cases(draw):
    order, conv = draw(st.sampled_from(COMBOS))
    layout = draw(st.sampled_from(("row_major", "swizzled_128x4")))
    M = draw(st.integers(1, MAX_M))
    K = draw(st.integers(1, MAX_K))
    shape = (draw(st.integers(1, 2)), M, K) if draw(st.booleans()) else (M, K)
    dtype = draw(st.sampled_from(("float32", "bfloat16", "float16")))
    specials = draw(st.sampled_from(("none", "finite")))
    strided = draw(st.booleans())
    log_range = draw(st.sampled_from((0.0, 4.0, 20.0)))
    # static amax = tensor amax * 2^u: u < 0 saturates the top blocks, u > 0 leaves headroom
    u = draw(st.floats(-4.0, 4.0, allow_nan=False))
    form = draw(st.sampled_from(("float", "numpy", "tensor")))
    seed = draw(st.integers(0, 2**32 - 1))
    return order, conv, layout, shape, dtype, specials, strided, log_range, u, form, seed


@settings(SETTINGS, max_examples=EXAMPLES)
@given(static_cases())
def test_static_global_scale_matches_reference(case):
    order, conv, layout, shape, dtype, specials, strided, log_range, u, form, seed = case
    scheme = nvfp4(preset=f"nvfp4_{order}", convention=conv)
    xn = make_input(seed, shape, dtype, log_range, specials)
    amax = float(np.abs(xn.astype(np.float64)).max())
    # a static amax stays a finite float32 (the 3e38 specials times 2^u would not)
    g, ref_g = as_form(in_convention(min((amax or 1.0) * 2.0 ** u, 3.0e38), conv), form)
    g = g.to(device()) if isinstance(g, torch.Tensor) else g
    check_static(scheme, xn, device_input(xn, strided), g, layout, ref_g)


@pytest.mark.parametrize("order,conv", COMBOS)
def test_below_and_above_the_amax(order, conv):
    """A static amax below the tensor amax saturates blocks (UE4M3 code 0x7E = 448 and E2M1 +-6,
    codes 0x7/0xF, for elements that would not reach 6 dynamically); above it, no block reaches
    448. Both equal the reference."""
    scheme = nvfp4(preset=f"nvfp4_{order}", convention=conv)
    rng = np.random.default_rng(7)
    xn = (rng.standard_normal((5, 64)) * np.exp2(rng.uniform(-3, 3, (5, 1)))).astype(np.float32)
    amax = float(np.abs(xn).max())
    x = to_device(xn)
    got, ref = check_static(scheme, xn, x, in_convention(amax / 8, conv))
    assert (ref.scales == 0x7E).sum() > 1
    dyn = quantize_nvfp4(xn, scheme)
    n6 = lambda c: int(np.isin(c & 0xF, (0x7, 0xF)).sum() + np.isin(c >> 4, (0x7, 0xF)).sum())
    assert n6(ref.codes) > n6(dyn.codes)
    _, ref = check_static(scheme, xn, x, in_convention(amax * 8, conv), layout="row_major")
    assert (ref.scales < 0x7E).all()


def test_to_reference_and_dequantize():
    scheme = nvfp4(preset="nvfp4_vllm")
    rng = np.random.default_rng(3)
    xn = rng.standard_normal((3, 48)).astype(np.float32)
    g = 2688.0 / (0.5 * float(np.abs(xn).max()))
    got, ref = check_static(scheme, xn, to_device(xn), g)
    back = got.to_reference()
    assert np.array_equal(back.codes, ref.codes) and np.array_equal(back.scales, ref.scales)
    assert back.global_scale == ref.global_scale == 1.0 / float(np.float32(g))
    assert np.array_equal(back.dequantize(), ref.dequantize())
    dq = Q.dequantize(got).cpu().numpy()
    assert np.array_equal(dq.view(np.uint32), ref.dequantize().view(np.uint32))


@pytest.mark.parametrize("order", ["te", "flashinfer", "torchao"])
@pytest.mark.parametrize("g", [1e-46, 1e-44, 1e-30, 3e38, 1e39, 1e300])
def test_float32_extremes_of_a_static_amax(order, g):
    """A static amax at the ends of float32: 1e-46 rounds to 0 (the reference's all-zero tensor:
    global 0, data codes +-0); 1e-44 (subnormal) makes 2688/A overflow (TE clamps S_enc to
    FLT_MAX, FlashInfer raises, torchao's A/2688 is 0 and raises); 1e39 and 1e300 are Inf in
    float32 (TE: S_enc 0 -> 1 and global Inf; the others raise). Fast path == reference, value
    or exception."""
    scheme = nvfp4(preset=f"nvfp4_{order}", convention="amax")
    rng = np.random.default_rng(11)
    xn = rng.standard_normal((3, 40)).astype(np.float32)
    xn[0, :7] = -0.0
    xn[1, 3] = -1e-3
    try:
        quantize_nvfp4(xn, scheme, global_scale=g)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            Q.quantize(to_device(xn), scheme, global_scale=g)
        assert str(got.value) == str(e)
        return
    _, ref = check_static(scheme, xn, to_device(xn), g)
    if g == 1e-46:  # hand-derived: the all-zero tensor of _nvfp4_rule
        assert ref.global_scale == 0.0
        neg = np.signbit(xn)
        want = np.zeros_like(xn, np.uint8) if order == "te" else np.where(neg, 8, 0).astype(np.uint8)
        assert np.array_equal(ref.codes, want[:, 0::2] | (want[:, 1::2] << 4))


# (scheme, value, the exception class): every way the reference refuses a static scale
ERROR_CASES = [
    (("vllm", None), 0.0, ValueError), (("vllm", None), -1.0, ValueError),
    (("vllm", None), float("nan"), ValueError), (("vllm", None), float("inf"), ValueError),
    (("te", "amax"), -np.inf, ValueError), (("torchao", None), 0, ValueError),
    (("vllm", None), "1.0", TypeError), (("vllm", None), True, TypeError),
    (("vllm", None), [1.0], TypeError),
    # derived scales that are 0 or non-finite in float32
    (("te", "encode_scale"), 1e-46, ValueError), (("te", "encode_scale"), 1e39, ValueError),
    (("flashinfer", None), 1e39, ValueError), (("torchao", None), 1e-46, ValueError),
    (("torchao", None), 1e39, ValueError), (("flashinfer", "amax"), 1e-44, ValueError),
    (("vllm", "amax"), 1e39, ValueError), (("torchao", "amax"), 1e-44, ValueError),
    (("torchao", "amax"), 1e39, ValueError),
]


@pytest.mark.parametrize("spec,value,exc", ERROR_CASES)
def test_errors_match_reference(spec, value, exc):
    scheme = nvfp4(preset=f"nvfp4_{spec[0]}", convention=spec[1])
    xn = np.ones((2, 16), np.float32)
    with pytest.raises(exc) as want:
        quantize_nvfp4(xn, scheme, global_scale=value)
    with pytest.raises(exc) as got:
        Q.quantize(to_device(xn), scheme, global_scale=value)
    assert str(got.value) == str(want.value)
    # a CPU float32 tensor holding a float32 value the reference refuses is refused the same way
    if isinstance(value, float) and exc is ValueError and float(np.float32(value)) == value:
        with pytest.raises(ValueError) as got_t:
            Q.quantize(to_device(xn), scheme, global_scale=torch.tensor([value], dtype=torch.float32))
        assert str(got_t.value) == str(want.value)


def test_bad_tensors_and_families_are_refused():
    xn = np.ones((2, 16), np.float32)
    x = to_device(xn)
    for t in (torch.tensor([1.0, 2.0]), torch.tensor([1.0], dtype=torch.float64),
              torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(TypeError, match="global_scale tensor must hold one float32 value"):
            Q.quantize(x, nvfp4(), global_scale=t)
    for scheme in (fp8_group(16), fp8_per_tensor(), mxfp4()):
        with pytest.raises(ValueError, match=r"global_scale=1\.0 is the NVFP4 per-tensor factor"):
            Q.quantize(x, scheme, global_scale=1.0)


def test_tensor_forms_equal_the_number():
    """0-d and [1] float32 tensors give what their float32 value gives as a number."""
    rng = np.random.default_rng(5)
    xn = rng.standard_normal((4, 33)).astype(np.float32)
    x = to_device(xn)
    for order, conv in COMBOS:
        scheme = nvfp4(preset=f"nvfp4_{order}", convention=conv)
        g = float(np.float32(in_convention(0.7 * float(np.abs(xn).max()), conv)))
        want = Q.quantize(x, scheme, global_scale=g)
        for t in (torch.tensor(g, dtype=torch.float32), torch.tensor([g], dtype=torch.float32)):
            got = Q.quantize(x, scheme, global_scale=t.to(x.device))
            assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
            assert torch.equal(got.global_scale, want.global_scale), (order, conv)


def test_static_path_runs_no_amax_kernel(monkeypatch):
    """The static data pass is the only pass over x: the amax kernels are not launched (they
    are replaced by failing stand-ins), while the dynamic path still needs them."""
    class Forbidden:
        def __getitem__(self, grid):
            raise AssertionError("amax kernel launched")

    xn = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    x = to_device(xn)
    scheme = nvfp4(preset="nvfp4_vllm")
    dyn = Q.quantize(x, scheme)
    monkeypatch.setattr(QL, "_amax_partial_kernel", Forbidden())
    monkeypatch.setattr(QL, "_amax_final_kernel", Forbidden())
    monkeypatch.setattr(QPL, "_PLANS", {})  # plans made before keep the real kernels
    for order, conv in COMBOS:
        s = nvfp4(preset=f"nvfp4_{order}", convention=conv)
        g = in_convention(float(np.abs(xn).max()), conv)
        for form in (g, torch.tensor([g], dtype=torch.float32)):
            Q.quantize(x, s, global_scale=form)
    with pytest.raises(AssertionError, match="amax kernel launched"):
        Q.quantize(x, scheme)
    # the static scale equal to the dynamic one reproduces the dynamic result
    st_ = Q.quantize(x, scheme, global_scale=float(1.0 / dyn.global_scale.item()))
    assert torch.equal(st_.codes, dyn.codes) and torch.equal(st_.scales, dyn.scales)


def test_dynamic_path_unchanged():
    rng = np.random.default_rng(9)
    for order, conv in COMBOS:
        scheme = nvfp4(preset=f"nvfp4_{order}", convention=conv)
        xn = (rng.standard_normal((3, 40)) * 5).astype(np.float32)
        ref = quantize_nvfp4(xn, scheme)
        with poisoned():
            got = Q.quantize(to_device(xn), scheme, scale_layout="swizzled_128x4")
        assert_same_codes(got.codes.cpu().numpy(), ref.codes, "e2m1", scheme.preset.name)
        assert_same_scales(got.scales_logical(), ref.scales, scheme.preset.name)
        assert float(got.global_scale[0]) == ref.global_scale


def test_registry_passes_global_scale():
    x = to_device(np.ones((2, 16), np.float32))
    fn = registry.get_implementation("quantize", "triton", scheme=nvfp4(), x=x, global_scale=3.0)
    assert fn is Q.quantize
    with pytest.raises(registry.ImplementationUnavailable, match="NVFP4 per-tensor factor"):
        registry.get_implementation("quantize", "triton", scheme=fp8_group(16), x=x, global_scale=3.0)
    with pytest.raises(registry.ImplementationUnavailable, match="positive finite"):
        registry.get_implementation("quantize", "triton", scheme=nvfp4(), x=x, global_scale=-3.0)
    vllm = nvfp4(preset="nvfp4_vllm")
    ref = registry.get_implementation("quantize", "reference", scheme=vllm, global_scale=3.0)
    assert ref(np.ones((2, 16), np.float32), vllm, global_scale=3.0).global_scale == 1.0 / 3.0


# Static scales that make the block-scale multiplier exactly 1 (module docstring of
# moeref.quant.nvfp4): TE s = e4m3(a * fl(S_enc * fl(1/6))) and fl(6 * fl(1/6)) = 1, so S_enc = 6
# (amax 448); FlashInfer/vLLM s = e4m3(S_enc * fl(a * fl(1/6))) with S_enc = 1 (amax 2688);
# torchao s = e4m3(fl(a / 6) / pts) with pts = 1 (amax 2688).
_UNIT = {"te": 448.0, "flashinfer": 2688.0, "vllm": 2688.0, "torchao": 2688.0}


def _ue4m3_midpoints() -> np.ndarray:
    """The midpoint between UE4M3 codes i and i + 1 for i = 8 .. 125: the normal values
    2^-6 .. 448 (torchao clamps block scales to >= 2^-6), each exact in float32."""
    from moeref.formats import decode_table
    v = np.unique(decode_table("ue4m3")[np.isfinite(decode_table("ue4m3"))])
    v = v[(v >= 2.0 ** -6) & (v <= 448)]
    assert v.size == 119
    return ((v[:-1] + v[1:]) / 2).astype(np.float32)


@pytest.mark.parametrize("order,conv", COMBOS)
def test_block_scale_ties_follow_the_static_scale(order, conv):
    """Block amaxes placed so that the UE4M3 cast sees an exact tie (midpoint of two codes) under
    the unit static scale: RNE picks the even code, and the next float32 static scale above
    breaks every tie upward. The fast path follows the reference to the last ulp of S_enc."""
    scheme = nvfp4(preset=f"nvfp4_{order}", convention=conv)
    mids = _ue4m3_midpoints()
    a = mids * (1.0 if order == "te" else 6.0)  # the block amax that lands on each midpoint
    rng = np.random.default_rng(2)
    xn = (rng.uniform(-1, 1, (a.size, 16)) * a[:, None]).astype(np.float32)
    xn[np.arange(a.size), rng.integers(0, 16, a.size)] = a * np.where(rng.random(a.size) < 0.5, -1, 1)
    unit = np.float32(_UNIT[order])
    x = to_device(xn)
    codes = []
    for amax in (unit, np.nextafter(unit, np.float32(0))):  # amax down = S_enc (or 1/pts) up
        g = float(np.float32(in_convention(float(amax), conv)))
        _, ref = check_static(scheme, xn, x, g, layout="row_major")
        codes.append(ref.scales[:, 0].astype(int))
        t = torch.tensor([g], dtype=torch.float32, device=x.device)  # the no-sync tensor form
        assert np.array_equal(Q.quantize(x, scheme, global_scale=t).scales_logical(), ref.scales)
    tie, nudged = codes
    lower = np.arange(8, 8 + a.size)  # midpoint i lies between UE4M3 codes i and i + 1
    assert np.array_equal(tie, np.where(lower % 2 == 0, lower, lower + 1))  # RNE: the even code
    assert np.array_equal(nudged, lower + 1)  # one ulp more: every tie goes up
