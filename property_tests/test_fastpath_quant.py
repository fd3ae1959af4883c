"""The Triton quantization fast paths equal the moeref references, bit for bit.

Runs everywhere: on a CUDA GPU for real (``gpu`` Hypothesis profile: more and larger examples), and
on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py) with small shapes and
few examples. What is compared, and why it is a proof rather than a smoke test:

* element codes and scales, byte for byte, against :func:`moeref.quant.quantize` (the
  specification), for every scale layout, read back through the :mod:`moeref.layouts` inverses AND
  compared as raw storage with the layout functions' output (so padding bytes are checked too);
* output buffers are poisoned (0xA5) before every launch (:func:`fastpath.testing.poisoned`), so an
  element the kernel never writes shows up as a mismatch;
* inputs include NaN, +-Inf, -0.0, all-zero rows, subnormal-scale rows, huge values and
  non-contiguous strides, and bf16 / fp16 / fp32 dtypes;
* the only normalisation is the sign bit of NaN codes: IEEE leaves the sign of a NaN made by
  arithmetic unspecified (x86 makes -NaN from 0 * Inf, CUDA +NaN; torchao's
  ``assert_mxfp8_semantics`` treats 0x7F and 0xFF alike);
* the device rounding functions these kernels are built on are checked on their own in
  ``test_fastpath_rounding.py`` (every bf16 bit pattern against :func:`moeref.formats.encode`);
* on a GPU with DeepGEMM installed, DeepGEMM's own ``per_token_cast_to_fp8`` / layout helpers agree
  with the Triton kernels under the ``deepgemm`` preset.
"""
from __future__ import annotations

import numpy as np
import ml_dtypes
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
from hypothesis import HealthCheck, assume, given, settings, strategies as st  # noqa: E402

from moeref import activations as ACT  # noqa: E402
from moeref import layouts  # noqa: E402
from moeref.quant import (  # noqa: E402
    fp8_group, fp8_per_tensor, fp8_per_token, mxfp4, mxfp8, quantize as ref_quantize,
)
from moeref.quant.nvfp4 import nvfp4  # noqa: E402

from fastpath import fused as F  # noqa: E402
from fastpath import quant as Q  # noqa: E402
from fastpath import registry  # noqa: E402
from fastpath.testing import device, on_gpu, poisoned, to_device  # noqa: E402
from rounding_probes import probe_values  # noqa: E402

GPU = on_gpu()
DEV = device()
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # NaN/Inf arithmetic in inputs
if not GPU:
    pytestmark.append(pytest.mark.interp)

_N = settings().max_examples
# CPU interpreter: each example is ~0.1-0.5 s, keep the file under a few minutes on 2 cores
EXAMPLES = max(10, _N // 2) if GPU else max(4, _N // 3)
MAX_M = 600 if GPU else 40
MAX_K = 4096 if GPU else 300
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------- helpers

def canon_codes(codes: np.ndarray, element: str) -> np.ndarray:
    """Codes with the sign of NaN codes cleared (the one thing IEEE leaves unspecified)."""
    c = np.array(codes, dtype=np.uint8, copy=True)
    if element == "e4m3fn":
        c[(c & 0x7F) == 0x7F] = 0x7F
    elif element == "e5m2":
        c[((c & 0x7C) == 0x7C) & ((c & 0x3) != 0)] = 0x7E
    return c


def assert_same_scales(got: np.ndarray, ref: np.ndarray, what: str):
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    if ref.dtype == np.float32:
        same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    else:
        same = got == ref
    if not same.all():
        i = tuple(np.argwhere(~same)[0])
        raise AssertionError(f"{what}: {int((~same).sum())} scales differ; first at {i}: "
                             f"kernel {got[i]!r} reference {ref[i]!r}")


def assert_same_codes(got, ref, element: str, what: str):
    g, r = canon_codes(got, element), canon_codes(ref, element)
    assert g.shape == r.shape, (what, g.shape, r.shape)
    if not np.array_equal(g, r):
        i = tuple(np.argwhere(g != r)[0])
        raise AssertionError(f"{what}: {int((g != r).sum())} codes differ; first at {i}: "
                             f"kernel {g[i]:#04x} reference {r[i]:#04x}")


def expected_storage(ref_scales: np.ndarray, layout: str) -> np.ndarray:
    """The raw storage the kernel must write, built by the moeref.layouts functions."""
    if layout == "mn_major":
        if ref_scales.dtype == np.float32:
            return layouts.mn_major_storage(layouts.to_mn_major_tma_aligned(ref_scales))
        # 1-byte codes: the same layout with 16-byte (16-element) alignment, zero padding
        *lead, mn, ng = ref_scales.shape
        st_ = np.zeros((*lead, ng, layouts.tma_aligned_mn(mn, 1)), np.uint8)
        st_[..., :mn] = np.swapaxes(ref_scales, -1, -2)
        return st_
    if layout == "packed_ue8m0":
        return layouts.mn_major_storage(layouts.pack_ue8m0(ref_scales))
    if layout == "swizzled_128x4":
        return layouts.swizzle_128x4(ref_scales)
    return ref_scales


def make_input(seed: int, shape, dtype: str, log_range: float, specials: str):
    """float32 values (then cast to ``dtype``): rows with their own magnitude 2^[-lr, lr], plus
    specials: 'none', 'finite' (zero rows, -0.0, huge/tiny values), 'all' (also NaN, +-Inf)."""
    rng = np.random.default_rng(seed)
    if dtype == "float16":
        log_range = min(log_range, 10.0)  # float16 overflows at 65504
    M, K = shape[-2], shape[-1]
    lead = shape[:-2]
    x = rng.standard_normal(shape).astype(np.float64)
    x *= np.exp2(rng.uniform(-log_range, log_range, lead + (M, 1)))
    if specials != "none":
        flat = x.reshape(-1, K)
        n = flat.shape[0]
        flat[rng.integers(0, n)] = 0.0
        flat[rng.integers(0, n), rng.integers(0, K)] = -0.0
        flat[rng.integers(0, n), : max(1, K // 3)] = -0.0
        flat[rng.integers(0, n), rng.integers(0, K)] = 3.0e38 if dtype == "float32" else 6.0e4
        flat[rng.integers(0, n), rng.integers(0, K)] = 1e-30 if dtype != "float16" else 1e-7
        if specials == "all":
            flat[rng.integers(0, n), rng.integers(0, K)] = np.nan
            flat[rng.integers(0, n), rng.integers(0, K)] = np.inf
            flat[rng.integers(0, n), rng.integers(0, K)] = -np.inf
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(np_dtype)


def device_input(xn: np.ndarray, strided: bool):
    """Torch tensor on the device; ``strided`` gives a non-contiguous view with the same values."""
    if not strided:
        return to_device(xn)
    # store transposed, hand the kernel the transposed view: strides (1, M)
    t = to_device(np.ascontiguousarray(np.swapaxes(xn, -1, -2)))
    return t.transpose(-1, -2)


# (scheme factory, allowed layouts, specials allowed)
SCHEMES = [
    (lambda: fp8_group(128), ("row_major", "mn_major"), "all"),
    (lambda: fp8_group(128, "ue8m0", "deepgemm"), ("row_major", "mn_major", "packed_ue8m0"), "all"),
    (lambda: fp8_group(128, "fp32", "deepgemm"), ("row_major", "mn_major"), "all"),
    (lambda: fp8_group(128, "fp32", "deepgemm_cuda"), ("row_major", "mn_major"), "all"),
    (lambda: fp8_group(128, "ue8m0", "deepgemm_cuda"), ("row_major", "packed_ue8m0"), "all"),
    (lambda: fp8_group(128, "ue8m0", "vllm"), ("row_major", "packed_ue8m0"), "all"),
    (lambda: fp8_group(64, "fp32", "te_fp8_block"), ("row_major",), "all"),
    (lambda: fp8_group(32, "fp32", "te_fp8", element="e5m2"), ("row_major", "mn_major"), "all"),
    (lambda: fp8_per_token(), ("row_major",), "all"),
    (lambda: fp8_per_token(preset="vllm"), ("row_major",), "all"),
    (lambda: fp8_per_tensor(), ("row_major",), "all"),
    (lambda: fp8_per_tensor(preset="deepgemm"), ("row_major",), "all"),
    (lambda: fp8_per_tensor(static_scale=0.0125), ("row_major",), "all"),
    (lambda: mxfp8(), ("row_major", "swizzled_128x4"), "all"),
    (lambda: mxfp8(preset="ocp"), ("row_major", "swizzled_128x4"), "all"),
    (lambda: mxfp8(preset="te_mxfp8"), ("row_major",), "all"),
    (lambda: mxfp8(preset="torchao_even"), ("row_major",), "all"),
    (lambda: mxfp8("e5m2", preset="torchao_ceil"), ("row_major", "packed_ue8m0"), "all"),
    (lambda: mxfp4(), ("row_major", "swizzled_128x4"), "all"),
    (lambda: mxfp4(preset="deepgemm"), ("row_major", "packed_ue8m0"), "all"),
    (lambda: mxfp4(preset="microxcaling"), ("row_major",), "all"),
    (lambda: nvfp4(preset="nvfp4_te"), ("row_major", "swizzled_128x4"), "finite"),
    (lambda: nvfp4(preset="nvfp4_flashinfer"), ("swizzled_128x4",), "finite"),
    (lambda: nvfp4(preset="nvfp4_vllm"), ("swizzled_128x4",), "finite"),
    (lambda: nvfp4(preset="nvfp4_torchao"), ("row_major", "swizzled_128x4"), "finite"),
]


@st.composite
def cases(draw):
    i = draw(st.integers(0, len(SCHEMES) - 1))
    factory, lays, specials_ok = SCHEMES[i]
    scheme = factory()
    layout = draw(st.sampled_from(lays))
    ndim = draw(st.sampled_from((2, 2, 3)))
    M = draw(st.integers(1, MAX_M))
    K = draw(st.integers(1, MAX_K))
    shape = (draw(st.integers(1, 3)), M, K) if ndim == 3 else (M, K)
    dtype = draw(st.sampled_from(("float32", "bfloat16", "float16")))
    specials = draw(st.sampled_from(("none", "finite", "all") if specials_ok == "all" else ("none", "finite")))
    if scheme.element == "e2m1" and scheme.preset.nan_code is None and scheme.preset.nonfinite != "nan_block":
        specials = "finite" if specials == "all" else specials  # reference refuses NaN codes
    strided = draw(st.booleans())
    log_range = draw(st.sampled_from((0.0, 4.0, 30.0)))
    seed = draw(st.integers(0, 2**32 - 1))
    return scheme, layout, shape, dtype, specials, strided, log_range, seed


def run_and_check(scheme, layout, xn, x, hw_fp8=None, tuning=None):
    ref = ref_quantize(xn, scheme)
    with poisoned():
        got = Q.quantize(x, scheme, scale_layout=layout, hw_fp8=hw_fp8, tuning=tuning)
    what = f"{scheme.name}/{scheme.preset.name}/{layout} shape={xn.shape} dtype={xn.dtype}"
    codes = got.codes.cpu().numpy()
    assert_same_codes(codes, ref.codes, scheme.element, what)
    assert_same_scales(got.scales_logical(), ref.scales, what)
    if layout != "row_major":  # the raw storage, padding included (poisoned -> must be written 0)
        from moeref._interop import to_numpy
        storage = to_numpy(got.scales.cpu())
        want = expected_storage(ref.scales, layout)
        assert_same_scales(np.ascontiguousarray(storage).reshape(want.shape).view(want.dtype),
                           want, what + " storage")
    if scheme.family == "nvfp4":
        assert float(got.global_scale.reshape(-1)[0]) == ref.global_scale, what
    return got, ref


# ----------------------------------------------------------------------------- quantize

@SETTINGS
@given(cases())
def test_quantize_matches_reference(case):
    scheme, layout, shape, dtype, specials, strided, log_range, seed = case
    xn = make_input(seed, shape, dtype, log_range, specials)
    run_and_check(scheme, layout, xn, device_input(xn, strided))


@pytest.mark.parametrize("factory,layout", [
    (lambda: fp8_group(128, "ue8m0", "deepgemm"), "packed_ue8m0"),
    (lambda: fp8_group(128), "mn_major"),
    (lambda: mxfp4(), "swizzled_128x4"),
    (lambda: nvfp4(), "swizzled_128x4"),
    (lambda: fp8_per_tensor(), "row_major"),
])
def test_padding_is_zero_and_rows_of_zeros(factory, layout):
    """Shapes whose padding is large (M=5 -> 128 swizzle rows; 3 groups -> 4 packed) and all-zero
    input: padding must be 0 despite the poisoned buffers, zero blocks follow the preset."""
    scheme = factory()
    xn = np.zeros((5, 96 if scheme.element != "e2m1" else 96), np.float32)
    xn[1, :] = np.linspace(-3, 3, xn.shape[1])
    run_and_check(scheme, layout, xn, to_device(xn))


def test_1d_input_and_odd_fp4_width():
    for scheme in (fp8_group(128), fp8_per_token(), mxfp8()):
        xn = np.linspace(-5, 5, 77).astype(np.float32)
        run_and_check(scheme, "row_major", xn, to_device(xn))
    xn = np.linspace(-5, 5, 3 * 77).astype(np.float32).reshape(3, 77)
    run_and_check(mxfp4(), "row_major", xn, to_device(xn))  # odd K: one zero nibble of padding


# ----------------------------------------------------------------------------- dequantize

DQ_SCHEMES = [
    (lambda: fp8_group(128), "row_major"), (lambda: fp8_group(128, "ue8m0", "deepgemm"), "packed_ue8m0"),
    (lambda: fp8_per_tensor(), "row_major"), (lambda: fp8_per_token(preset="vllm"), "row_major"),
    (lambda: fp8_group(32, element="e5m2"), "mn_major"), (lambda: mxfp8(), "swizzled_128x4"),
    (lambda: mxfp4(), "row_major"), (lambda: nvfp4(preset="nvfp4_te"), "swizzled_128x4"),
    (lambda: nvfp4(preset="nvfp4_torchao"), "row_major"),
]


@SETTINGS
@given(st.integers(0, len(DQ_SCHEMES) - 1), st.integers(1, MAX_M), st.integers(1, MAX_K),
       st.sampled_from((0.0, 4.0, 20.0)), st.integers(0, 2**32 - 1))
def test_dequantize_matches_reference(i, M, K, log_range, seed):
    factory, layout = DQ_SCHEMES[i]
    scheme = factory()
    if scheme.element == "e2m1":
        K += K % 2
    xn = make_input(seed, (M, K), "float32", log_range, "none")
    q = Q.quantize(to_device(xn), scheme, scale_layout=layout)
    ref = q.to_reference()
    for dt, npdt, iview in [(torch.float32, np.float32, np.uint32),
                            (torch.bfloat16, ml_dtypes.bfloat16, np.uint16),
                            (torch.float16, np.float16, np.uint16)]:
        with poisoned():
            got = Q.dequantize(q, dt)
        g = got.cpu()
        g = g.view(torch.int32 if dt == torch.float32 else torch.int16).numpy().view(iview)
        want = ref.dequantize(npdt)
        w = want.view(iview)
        nan = np.isnan(want.astype(np.float32)) & np.isnan(got.float().cpu().numpy())
        bad = (g != w) & ~nan
        assert not bad.any(), (scheme.name, dt, np.argwhere(bad)[:3])


# ----------------------------------------------------------------------------- fused activation + quant

@SETTINGS
@given(st.sampled_from(("silu_and_mul", "swigluoai", "gelu_and_mul", "gelu_tanh_and_mul")), st.integers(1, MAX_M),
       st.integers(1, MAX_K // 2), st.sampled_from(("float32", "bfloat16")),
       st.sampled_from(("row_major", "mn_major", "packed_ue8m0")), st.booleans(),
       st.integers(0, 2**32 - 1))
def test_fused_activation_quant(op, M, N, dtype, layout, ue8m0, seed):
    scheme = fp8_group(128, "ue8m0", "deepgemm") if ue8m0 else fp8_group(128)
    assume(not (layout == "packed_ue8m0" and not ue8m0))
    xn = make_input(seed, (M, 2 * N), dtype, 2.0, "none")
    x = to_device(xn)
    with poisoned():
        if op == "silu_and_mul":
            got = F.silu_and_mul_quant_fp8(x, scheme, scale_layout=layout)
            act = F.silu_and_mul(x).cpu().numpy()
            exact = ACT.silu_and_mul(xn.astype(np.float64))
        elif op == "swigluoai":
            got = F.swigluoai_quant_fp8(x, 1.702, 7.0, scheme, scale_layout=layout)
            act = F.swigluoai(x).cpu().numpy()
            exact = ACT.swigluoai(xn.astype(np.float64))
        else:  # GELU, erf or tanh
            approx = "tanh" if op == "gelu_tanh_and_mul" else "none"
            got = F.gelu_and_mul_quant_fp8(x, approx, scheme, scale_layout=layout)
            act = F.gelu_and_mul(x, approx).cpu().numpy()
            exact = ACT.gelu_and_mul(xn.astype(np.float64), approx)
    # 1. the float32 activation is within a few float32 ulps of the float64 reference (GELU: of |gate| |up|,
    #    the profiles' act_unit measure: 1 + erf cancels for negative gates, as in every float32 GELU)
    err = np.abs(act.astype(np.float64) - exact)
    if op.startswith("gelu"):
        gu = np.abs(xn[:, :N].astype(np.float64) * xn[:, N:].astype(np.float64))
        assert np.all(err <= 4 * 2.0**-24 * (gu + np.abs(exact))), float(np.max(err / (gu + 1e-30)))
    else:
        assert np.all(err <= 1e-5 * np.abs(exact) + 1e-30), float(np.max(err / (np.abs(exact) + 1e-30)))
    # 2. the quantization of that activation is exact (bitwise vs the reference quantizer)
    ref = ref_quantize(act, scheme)
    what = f"{op}/{scheme.name}/{layout}"
    assert_same_codes(got.codes.cpu().numpy(), ref.codes, "e4m3fn", what)
    assert_same_scales(got.scales_logical(), ref.scales, what)
    # 3. against the exact activation, codes move by at most one step, and rarely
    ref_exact = ref_quantize(exact.astype(np.float32), scheme)
    d = np.abs(got.codes.cpu().numpy().astype(int) - ref_exact.codes.astype(int))
    d = np.where(d > 0x40, 0, d)  # sign flips of tiny values at zero are not a step
    assert d.max(initial=0) <= 1 and d.mean() < 0.02


@SETTINGS
@given(st.sampled_from(("silu_and_mul", "swigluoai")), st.integers(1, MAX_M),
       st.integers(1, MAX_K // 2), st.sampled_from(("float32", "bfloat16")),
       st.sampled_from(("fp32", "ue8m0", "static")), st.sampled_from(("none", "finite", "all")),
       st.integers(0, 2**32 - 1))
def test_fused_activation_quant_per_tensor(op, M, N, dtype, scale, special, seed):
    """The two-pass fused per-tensor quantizer (activation amax pass, then the data pass computing the
    activation again) equals the reference quantizer of the float32 activation, bit for bit, scale and
    codes, with NaN and Inf inputs and a static scale."""
    scheme = {"fp32": fp8_per_tensor(), "ue8m0": fp8_per_tensor(scale="ue8m0"),
              "static": fp8_per_tensor(static_scale=0.75)}[scale]
    xn = make_input(seed, (M, 2 * N), dtype, 2.0, special)
    x = to_device(xn)
    with poisoned():
        if op == "silu_and_mul":
            got = F.silu_and_mul_quant_fp8(x, scheme)
            act = F.silu_and_mul(x).cpu().numpy()
        else:
            got = F.swigluoai_quant_fp8(x, 1.702, 7.0, scheme)
            act = F.swigluoai(x).cpu().numpy()
    ref = ref_quantize(act, scheme)
    what = f"{op}/{scheme.name}/{special}"
    assert_same_codes(got.codes.cpu().numpy(), ref.codes, "e4m3fn", what)
    assert_same_scales(got.scales_logical(), ref.scales, what)


def test_fused_per_tensor_refuses_batched_input_and_skip_rows():
    x = to_device(np.ones((2, 3, 256), np.float32))
    with pytest.raises(ValueError, match="per-tensor"):
        F.silu_and_mul_quant_fp8(x, fp8_per_tensor())
    with pytest.raises(ValueError, match="skip_rows"):
        F.silu_and_mul_quant_fp8(x[0], fp8_per_tensor(), skip_rows=torch.zeros(3, dtype=torch.int32,
                                                                                     device=x.device))


# ----------------------------------------------------------------------------- registry

def test_registry_lists_and_refuses_with_reason():
    rows = registry.available("quantize", scheme=fp8_group(128), x=to_device(np.zeros((2, 128), np.float32)))
    names = {r.implementation: r for r in rows}
    assert names["triton"].ok
    with pytest.raises(registry.ImplementationUnavailable, match="128x128|block"):
        registry.get_implementation("quantize", "triton", scheme=__import__("moeref.quant", fromlist=["fp8_block"]).fp8_block())
    with pytest.raises(registry.ImplementationUnavailable, match="packed_ue8m0 needs UE8M0"):
        registry.get_implementation("quantize", "triton", scheme=fp8_group(128), scale_layout="packed_ue8m0")
    with pytest.raises(ValueError, match="no implementation"):
        registry.get_implementation("quantize", "cutlass")
    fn = registry.get_implementation("quantize", "triton", scheme=mxfp4())
    assert fn is Q.quantize
    with pytest.raises(ValueError, match="cannot run"):
        Q.quantize(to_device(np.zeros((2, 32), np.float32)), fp8_group(128), scale_layout="swizzled_128x4")


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_gpu_hardware_fp8_cast_equals_integer_rounding():
    """On the GPU the default FP8 path uses cvt.rn.satfinite; it must equal the integer path."""
    x = probe_values()
    xt = to_device(x[: (x.size // 256) * 256].reshape(-1, 256))
    for scheme in (fp8_group(128), fp8_group(128, "ue8m0", "deepgemm"), mxfp8("e5m2")):
        a = Q.quantize(xt, scheme, hw_fp8=True)
        b = Q.quantize(xt, scheme, hw_fp8=False)
        assert np.array_equal(canon_codes(a.codes.cpu().numpy(), scheme.element),
                              canon_codes(b.codes.cpu().numpy(), scheme.element))


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(4096, 7168), (1, 7168), (333, 2880), (16384, 4096)])
def test_gpu_large_shapes(M, K):
    rng = np.random.default_rng(M * K)
    xn = (rng.standard_normal((M, K)) * 3).astype(ml_dtypes.bfloat16)
    x = to_device(xn)
    for scheme, layout in [(fp8_group(128, "ue8m0", "deepgemm"), "packed_ue8m0"),
                           (fp8_group(128), "mn_major"), (mxfp4(), "swizzled_128x4"),
                           (nvfp4(), "swizzled_128x4"), (fp8_per_tensor(), "row_major")]:
        run_and_check(scheme, layout, xn, x)


@pytest.mark.gpu
def test_gpu_deep_gemm_agrees():
    """DeepGEMM's own torch quantizer and layout helpers against the kernels and the reference.

    On CUDA, PyTorch computes DeepGEMM's ``x_amax / 448.0`` (a CPU-scalar divisor) as
    ``x_amax * fl(1/448)`` (ATen ``BinaryDivTrueKernel.cu``: "compute a * reciprocal(b)"), so
    DeepGEMM on a GPU is reproduced by the ``deepgemm_cuda`` preset (the ``deepgemm`` preset is the
    same code run by torch on the CPU, which divides). Pinned here, bit for bit: DeepGEMM's scales
    and codes equal both our kernel's and the CPU reference's under ``deepgemm_cuda``, for FP32
    and UE8M0 scales; and DeepGEMM's layout helpers lay its scales out exactly as the
    moeref.layouts functions do (the layouts our kernels are proven against).
    """
    try:
        import deep_gemm as dg
    except Exception as e:  # say why: not installed, or a broken build
        pytest.skip(f"deep_gemm not importable ({type(e).__name__}: {e}); bench/run_gpu.sh builds it")
    from moeref._interop import to_numpy
    from moeref.quant import quantize as ref_quantize
    rng = np.random.default_rng(7)
    for M, K in [(300, 7168), (7, 512), (128, 4096)]:
        xn = (rng.standard_normal((M, K)) * np.exp2(rng.uniform(-6, 6, (M, 1)))).astype(ml_dtypes.bfloat16)
        x = to_device(xn)
        for ue8m0 in (False, True):
            scheme = fp8_group(128, "ue8m0" if ue8m0 else "fp32", "deepgemm_cuda")
            q_dg, sf_dg = dg.utils.per_token_cast_to_fp8(x, use_ue8m0=ue8m0, gran_k=128)
            ours = Q.quantize(x, scheme)
            ours_sf = ((ours.scales.to(torch.int32) << 23).view(torch.float32) if ue8m0 else ours.scales)
            assert torch.equal(ours_sf.view(torch.int32), sf_dg.view(torch.int32))
            assert torch.equal(q_dg.view(torch.uint8), ours.codes)
            ref = ref_quantize(xn, scheme)
            ref_sf = (ref.scales.astype(np.int32) << 23).view(np.float32) if ue8m0 else ref.scales
            assert np.array_equal(to_numpy(sf_dg.cpu()).view(np.int32), np.asarray(ref_sf).view(np.int32))
            assert np.array_equal(to_numpy(q_dg.cpu()).view(np.uint8), ref.codes)
            # layouts: DeepGEMM's helpers vs the moeref.layouts functions, on DeepGEMM's scales
            sf_host = to_numpy(sf_dg.cpu())
            if ue8m0:
                packed = dg.utils.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf_dg)
                want = layouts.pack_ue8m0(sf_host)
                assert tuple(packed.stride()) == tuple(st // 4 for st in want.strides)  # (1, align(M, 4))
                assert np.array_equal(to_numpy(packed.cpu()), want)
            else:
                mn = dg.utils.get_mn_major_tma_aligned_tensor(sf_dg)
                want = layouts.to_mn_major_tma_aligned(sf_host)
                assert tuple(mn.stride()) == tuple(st // 4 for st in want.strides)
                assert np.array_equal(to_numpy(mn.cpu()).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("factory", [lambda: mxfp4(preset="torchao_even"),
                                     lambda: mxfp8(preset="torchao_even")])
def test_even_rule_rounding_past_flt_max_is_a_nan_block(factory):
    """torchao's EVEN rule rounds a block amax near FLT_MAX up past it: scale 0xFF (NaN) for a
    block of finite data, whose codes the reference fills like any NaN-scaled block (found by
    the packed-FP4 sweep on an H200, 2026-11-21: the kernel had encoded the data instead)."""
    scheme = factory()
    xn = np.ones((2, 64), np.float32)
    xn[0, :32] = np.float32(3.3e38) * np.where(np.arange(32) % 2, -1, 1)  # rounds past FLT_MAX
    xn[1, 32:] = np.float32(1.5e38)  # does not
    xb = xn.astype(ml_dtypes.bfloat16)
    got, ref = run_and_check(scheme, "row_major", xb, to_device(xb))
    assert ref.scales[0, 0] == 0xFF and ref.scales[1, 1] != 0xFF
