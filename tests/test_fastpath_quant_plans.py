"""Per-call plans of the quantization and fused fast paths (fastpath.quant._plan, issue 20).

A repeated call reuses the plan made by the first call with the same key (scheme, layout, options,
x's dtype, shape, strides, 16-byte misalignment and device): the tests check that a plan hit gives
bit for bit what a cold call (empty plan cache) gives, that changing any part of the key makes a
new plan, that per-call input is still validated on a hit, and (GPU) that the planned launches
through ``CompiledKernel.run`` equal ``kernel[grid]`` for every decode-sized row of the benchmark."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import fastpath.fused as F  # noqa: E402
import fastpath.quant as Q  # noqa: E402
from fastpath.quant import _plan  # noqa: E402
from moeref.quant import fp8_group, fp8_per_tensor, fp8_per_token, mxfp4, nvfp4  # noqa: E402
from moeref.quant import quantize as ref_quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def _same(a, b):
    ta = [a.codes, a.scales] + ([a.global_scale] if a.global_scale is not None else [])
    tb = [b.codes, b.scales] + ([b.global_scale] if b.global_scale is not None else [])
    assert len(ta) == len(tb)
    for u, v in zip(ta, tb):
        assert u.shape == v.shape and u.dtype == v.dtype and u.stride() == v.stride()
        assert torch.equal(_bits(u), _bits(v))


def _x(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)


CASES = {
    "1x128": (fp8_group(128), {}),
    "1x128 packed": (fp8_group(128, "ue8m0", "deepgemm"), dict(scale_layout="packed_ue8m0")),
    "1x128 mn_major": (fp8_group(128, "fp32", "deepgemm"), dict(scale_layout="mn_major")),
    "per_token": (fp8_per_token(), {}),
    "per_tensor": (fp8_per_tensor(), {}),
    "mxfp4 swizzled": (mxfp4(), dict(scale_layout="swizzled_128x4")),
    "nvfp4 swizzled": (nvfp4(), dict(scale_layout="swizzled_128x4")),
    "nvfp4 static": (nvfp4(preset="nvfp4_vllm"), dict(scale_layout="swizzled_128x4", global_scale=300.0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_plan_hit_equals_a_cold_call_and_the_reference(name):
    scheme, kw = CASES[name]
    x = _x((3, 256))
    _plan._PLANS.clear()
    cold = Q.quantize(x, scheme, **kw)
    assert len(_plan._PLANS) == 1
    plan = next(iter(_plan._PLANS.values()))
    x2 = _x((3, 256), seed=1)  # same key, other values: the plan is reused for new data
    hot = Q.quantize(x2, scheme, **kw)
    assert list(_plan._PLANS.values()) == [plan]
    _plan._PLANS.clear()
    _same(hot, Q.quantize(x2, scheme, **kw))
    _same(cold, Q.quantize(x, scheme, **kw))
    gkw = {"global_scale": kw["global_scale"]} if "global_scale" in kw else {}
    for xi, got in ((x, cold), (x2, hot)):  # and both are the reference's
        ref = ref_quantize(xi.float().cpu().numpy(), scheme, **gkw)
        np.testing.assert_array_equal(got.codes.cpu().numpy(), ref.codes)
        np.testing.assert_array_equal(got.scales_logical(), ref.scales)


def test_every_part_of_the_key_makes_a_new_plan():
    s, s64, dg = fp8_group(128), fp8_group(64), fp8_group(128, "ue8m0", "deepgemm")
    x = _x((4, 256))
    base = torch.zeros(4 * 256 + 8, dtype=torch.bfloat16, device=DEV)
    calls = [
        lambda: Q.quantize(x, s),
        lambda: Q.quantize(x[:2], s),  # shape
        lambda: Q.quantize(x.float(), s),  # dtype
        lambda: Q.quantize(x.t().contiguous().t(), s),  # strides (same shape, column-major)
        lambda: Q.quantize(base[1:1 + 4 * 256].view(4, 256).copy_(x), s),  # 2-byte misaligned address
        lambda: Q.quantize(x, s64),  # scheme
        lambda: Q.quantize(x, dg, scale_layout="packed_ue8m0"),  # layout
        lambda: Q.quantize(x, s, num_warps=2),  # options
        lambda: F.silu_and_mul_quant_fp8(x, s),  # the fused kernels
        lambda: F.swigluoai_quant_fp8(x, 1.702, 7.0, s),
        lambda: F.swigluoai_quant_fp8(x, 1.5, 7.0, s),  # an activation parameter
    ]  # schemes are keyed by identity (a plan keeps its scheme): an equal new Scheme is a new plan
    _plan._PLANS.clear()
    results = []
    for i, call in enumerate(calls):
        results.append(call())
        assert len(_plan._PLANS) == i + 1, i
        _same(call(), results[-1])  # the second call hits
        assert len(_plan._PLANS) == i + 1, i
    for call, got in zip(calls, results):  # each cold call gives what its plan gave
        _plan._PLANS.clear()
        _same(call(), got)


def test_dequantize_plan_hit_equals_a_cold_call():
    s = fp8_group(128)
    q, q2 = Q.quantize(_x((3, 256)), s), Q.quantize(_x((3, 256), seed=2), s)
    _plan._PLANS.clear()
    cold = Q.dequantize(q, torch.bfloat16)
    hot = Q.dequantize(q2, torch.bfloat16)
    assert len(_plan._PLANS) == 1  # the second call hit the first call's plan
    _plan._PLANS.clear()
    assert torch.equal(_bits(Q.dequantize(q2, torch.bfloat16)), _bits(hot))
    assert torch.equal(_bits(Q.dequantize(q, torch.bfloat16)), _bits(cold))
    Q.dequantize(q, torch.float32)  # the output dtype is part of the key
    assert len(_plan._PLANS) == 2


def test_per_call_input_is_still_checked_on_a_hit():
    s = fp8_per_tensor()
    x = _x((2, 128))
    Q.quantize(x, s)
    Q.quantize(x, s, amax=x.float().abs().amax().reshape(1))  # the plan of this key exists now
    with pytest.raises(TypeError, match="amax must be a float32 torch tensor"):
        Q.quantize(x, s, amax=x.abs().amax().reshape(1))  # bfloat16
    with pytest.raises(ValueError, match=r"amax must hold 1 value\(s\)"):
        Q.quantize(x, s, amax=torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="amax= is for per-tensor FP8"):
        Q.quantize(x, fp8_group(128), amax=torch.ones(1, device=DEV))
    n = len(_plan._PLANS)
    for _ in range(2):  # refused calls keep no plan and raise every time
        with pytest.raises(ValueError, match="cannot run"):
            Q.quantize(x.to(torch.int32), s)
        with pytest.raises(ValueError, match="global_scale"):
            Q.quantize(x, nvfp4(), global_scale=-1.0)
    assert len(_plan._PLANS) == n


def test_a_tensor_scale_is_read_every_call():
    """A static scale given as a tensor (not a plain number) is not part of any plan: changing it
    between calls changes the codes."""
    s = fp8_per_token()
    x = _x((2, 128))
    sc = torch.tensor(0.5)
    a = Q.quantize(x, s, scale=sc)
    sc.fill_(0.25)
    b = Q.quantize(x, s, scale=sc)
    want = Q.quantize(x, s, scale=0.25)
    assert torch.equal(_bits(b.codes), _bits(want.codes)) and not torch.equal(_bits(a.codes), _bits(b.codes))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64])
def test_gpu_planned_launches_equal_kernel_getitem(M):
    """Every decode-sized quantization row of the latency benchmark: the plan's launches through
    ``CompiledKernel.run`` (third call) give the bytes of ``kernel[grid]`` (launch cache off)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run `bash bench/run_gpu.sh` on a GPU machine")
    from bench.latency_cases import bits_equal, quant_cases, tensors, uncached

    for case in quant_cases():
        state = case.make(M)
        _plan._PLANS.clear()
        with uncached():
            want = tensors(case.fast(state))
        case.fast(state)  # the plan's first launches: kernel[grid], compiled kernels kept
        got = tensors(case.fast(state))
        torch.cuda.synchronize()
        assert len(got) == len(want), case.name
        for g, w in zip(got, want):
            assert bits_equal(g, w), case.name
