"""Each kernel profile proven on real GPU kernels (``gpu`` marker: skipped on CPU machines, saying so).

For Hypothesis-drawn data (normal, outlier columns x100, and cancelling sums whose partial sums grow
large), the real kernel's output is checked against the exact reference under the profile that names
its arithmetic: every element must lie within the bound (the honest ratio ``|err| / bound <= 1``). The
worst ratio over all examples is printed (run with ``-s``): how much room the bound leaves.

Kernels: DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous`` / ``_masked`` (skipped with the reason when
``deep_gemm`` is not importable), ``torch._scaled_mm`` with and without fast accumulation,
``torch._grouped_mm`` (bf16, CUTLASS), a torch eager bf16 MoE layer, a layer built from
``torch._grouped_mm`` with bf16 caches, and torch's bf16 ``a @ w.T + b`` (the bias after the store).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moeref.compare import compare  # noqa: E402
from moeref.moe.mapping import (from_deepgemm_contiguous, from_deepgemm_masked, from_torch_grouped_mm,  # noqa: E402
                                from_torch_scaled_mm)
from moeref.testing import grouped_gemm_report, moe_cases  # noqa: E402

pytestmark = pytest.mark.gpu
DATA = ("normal", "outliers", "cancel")
FP8 = torch.float8_e4m3fn


def _data(rng, shape, kind):
    x = rng.standard_normal(shape)
    if kind == "outliers":
        x[..., rng.choice(shape[-1], size=min(8, shape[-1]), replace=False)] *= 100.0
    elif kind == "cancel":  # second half of K mirrors the first with flipped sign: large partial sums
        h = shape[-1] // 2
        x = np.abs(x) + 0.1
        x[..., h:2 * h] = -x[..., :h]
    return x.astype(np.float32)


def _fp8_1x128(x: np.ndarray):
    """Per-token 1x128 FP8 (amax / 448 scales), written here from DeepGEMM's recipe."""
    t = torch.from_numpy(x).cuda()
    m, k = t.shape
    g = t.view(m, k // 128, 128)
    s = (g.abs().amax(dim=-1).clamp(min=1e-4) / 448.0)
    return (g / s[..., None]).to(FP8).view(m, k), s.float()


def _fp8_128x128(w: np.ndarray):
    t = torch.from_numpy(w).cuda()
    e, n, k = t.shape
    g = t.view(e, n // 128, 128, k // 128, 128)
    s = g.abs().amax(dim=(2, 4)).clamp(min=1e-4) / 448.0
    return (g / s[:, :, None, :, None]).to(FP8).view(e, n, k), s.float()


def _worst(rep) -> float:
    valid = rep.bound > 0
    return float((rep.error[valid] / rep.bound[valid]).max()) if valid.any() else 0.0


def _prove(name, draw_and_check, max_examples=25):
    """Run ``draw_and_check`` (data -> report, or (report, FP32_ACCUM report) for GEMMs) on Hypothesis data;
    every report must pass; print the worst ratio, and the worst under FP32_ACCUM for comparison."""
    worst: list[float] = []
    fp32: list[float] = []

    @settings(max_examples=max_examples, deadline=None)
    @given(st.data())
    def run(data):
        rep = draw_and_check(data)
        if isinstance(rep, tuple):
            rep, other = rep
            fp32.append(_worst(other))
        worst.append(_worst(rep))
        assert rep.passed, rep.summary()

    run()
    extra = f"; under FP32_ACCUM the worst ratio would be {max(fp32):.2f}" if fp32 else ""
    print(f"\n[profile proof] {name}: worst |err|/bound = {max(worst):.3f} over {len(worst)} examples{extra}")
    assert max(worst) <= 1.0


def test_deepgemm_grouped_fp8_contiguous_within_DEEPGEMM_FP8():
    dg = pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (bash bench/run_gpu.sh builds it)")
    align = int(getattr(dg, "get_mk_alignment_for_contiguous_layout", lambda: 128)())

    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        e = data.draw(st.integers(1, 4))
        counts = [data.draw(st.integers(0, 2 * align)) for _ in range(e)]
        n, k = data.draw(st.sampled_from([(128, 256), (256, 512), (128, 1024)]))
        kind = data.draw(st.sampled_from(DATA))
        seg = [-(-max(c, 1) // align) * align for c in counts]
        m_idx = np.concatenate([np.r_[np.full(c, i), np.full(s - c, -1)] for i, (c, s) in enumerate(zip(counts, seg))])
        a, sa = _fp8_1x128(_data(rng, (m_idx.size, k), kind))
        b, sb = _fp8_128x128((0.02 * _data(rng, (e, n, k), "normal")).astype(np.float32))
        mi = torch.from_numpy(m_idx.astype(np.int32)).cuda()
        d = torch.empty(m_idx.size, n, dtype=torch.bfloat16, device="cuda")
        dg.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, mi, disable_ue8m0_cast=True)
        torch.cuda.synchronize()
        call = from_deepgemm_contiguous((a, sa), (b, sb), d, mi)
        return grouped_gemm_report(call, profile="DEEPGEMM_FP8"), grouped_gemm_report(call, profile="FP32_ACCUM")

    _prove("DeepGEMM m_grouped_fp8_gemm_nt_contiguous / DEEPGEMM_FP8", check)


def test_deepgemm_grouped_fp8_masked_within_DEEPGEMM_FP8():
    dg = pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (bash bench/run_gpu.sh builds it)")

    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        e, max_m = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([64, 128, 192]))
        masked = np.array([data.draw(st.integers(1, max_m)) for _ in range(e)], np.int32)
        n, k = data.draw(st.sampled_from([(128, 256), (256, 512)]))
        kind = data.draw(st.sampled_from(DATA))
        a, sa = _fp8_1x128(_data(rng, (e * max_m, k), kind))
        b, sb = _fp8_128x128((0.02 * _data(rng, (e, n, k), "normal")).astype(np.float32))
        d = torch.empty(e, max_m, n, dtype=torch.bfloat16, device="cuda")
        mm = torch.from_numpy(masked).cuda()
        a3, s3 = a.view(e, max_m, k), sa.view(e, max_m, -1)
        try:
            dg.m_grouped_fp8_gemm_nt_masked((a3, s3), (b, sb), d, mm, int(masked.max()), disable_ue8m0_cast=True)
        except TypeError:  # builds without the keyword
            dg.m_grouped_fp8_gemm_nt_masked((a3, s3), (b, sb), d, mm, int(masked.max()))
        torch.cuda.synchronize()
        call = from_deepgemm_masked((a3, s3), (b, sb), d, mm, int(masked.max()))
        return grouped_gemm_report(call, profile="DEEPGEMM_FP8"), grouped_gemm_report(call, profile="FP32_ACCUM")

    _prove("DeepGEMM m_grouped_fp8_gemm_nt_masked / DEEPGEMM_FP8", check)


@pytest.mark.parametrize("fast, profile", [(False, "CUBLAS_FP8"), (True, "CUBLAS_FP8_FAST_ACCUM")])
def test_scaled_mm_within_its_profile(fast, profile):
    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        m = data.draw(st.sampled_from([16, 64]))
        n, k = data.draw(st.sampled_from([(64, 256), (128, 2048), (128, 4096)]))
        kind = data.draw(st.sampled_from(DATA))
        x, w = _data(rng, (m, k), kind), 0.02 * _data(rng, (n, k), "normal")
        sa = np.abs(x).max(axis=1, keepdims=True).astype(np.float32) / 448
        sb = np.abs(w).max(axis=1, keepdims=True).astype(np.float32).T / 448
        a = torch.from_numpy(x / sa).cuda().to(FP8)
        b = torch.from_numpy(w / sb.T).cuda().to(FP8)
        tsa, tsb = torch.from_numpy(sa).cuda(), torch.from_numpy(sb).cuda()
        out = torch._scaled_mm(a, b.t(), tsa, tsb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        call = from_torch_scaled_mm(a, b.t(), tsa, tsb, out)
        return grouped_gemm_report(call, profile=profile), grouped_gemm_report(call, profile="FP32_ACCUM")

    _prove(f"torch._scaled_mm use_fast_accum={fast} / {profile}", check)


@pytest.mark.parametrize("profile", ["BF16_OUTPUT", "CUTLASS_BF16_GROUPED_MM"])
def test_grouped_mm_bf16_within_BF16_OUTPUT(profile):
    """The decision table's row for torch._grouped_mm (BF16_OUTPUT) and the looser alias kept by name."""

    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        e = data.draw(st.integers(1, 6))
        counts = [data.draw(st.integers(0, 96)) for _ in range(e)]
        n, k = data.draw(st.sampled_from([(64, 256), (128, 1024), (256, 2048)]))
        kind = data.draw(st.sampled_from(DATA))
        r = max(sum(counts), 1)
        a = torch.from_numpy(_data(rng, (r, k), kind)).cuda().bfloat16()
        b = torch.from_numpy(0.02 * _data(rng, (e, n, k), "normal")).cuda().bfloat16().transpose(1, 2)
        offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
        out = torch._grouped_mm(a, b, offs=offs)
        call = from_torch_grouped_mm(a, b, offs, out=out)
        return grouped_gemm_report(call, profile=profile), grouped_gemm_report(call, profile="FP32_ACCUM")

    _prove(f"torch._grouped_mm bf16 / {profile}", check)


@pytest.mark.parametrize("reduced_precision_reduction", [False, True])
def test_bf16_matmul_plus_bias_within_BF16_OUTPUT_BIAS_AFTER_STORE(reduced_precision_reduction):
    """torch ``a @ w.T + b`` on bf16 CUDA tensors per expert (cuBLAS; the bias added to the stored bf16
    product, the sum stored in bf16). False: the declared FP32 accumulation; True (torch's default): cuBLAS
    may reduce split-K partial sums in bf16, measured here as in the eager-layer test."""

    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        e = data.draw(st.integers(1, 4))
        counts = [data.draw(st.integers(1, 96)) for _ in range(e)]
        n, k = data.draw(st.sampled_from([(64, 256), (128, 1024), (256, 2048)]))
        kind = data.draw(st.sampled_from(DATA))
        rows = np.repeat(np.arange(e), counts)
        a = torch.from_numpy(_data(rng, (rows.size, k), kind)).cuda().bfloat16()
        w = torch.from_numpy(0.02 * _data(rng, (e, n, k), "normal")).cuda().bfloat16()
        b = torch.from_numpy(_data(rng, (e, n), "normal")).cuda().bfloat16()
        out = torch.empty(rows.size, n, dtype=torch.bfloat16, device="cuda")
        for x in range(e):  # a loop over experts: the kernel under test
            r = torch.from_numpy(np.flatnonzero(rows == x)).cuda()
            out[r] = a[r] @ w[x].T + b[x]
        return (grouped_gemm_report(out, a, w, "BF16_OUTPUT_BIAS_AFTER_STORE", m_indices=rows, bias=b),
                grouped_gemm_report(out, a, w, "FP32_ACCUM", m_indices=rows, bias=b))

    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = reduced_precision_reduction
    try:
        _prove(f"torch bf16 a @ w.T + b (CUDA, reduced-precision reduction {reduced_precision_reduction}) "
               "/ BF16_OUTPUT_BIAS_AFTER_STORE", check)
    finally:
        flags.allow_bf16_reduced_precision_reduction = saved


@pytest.mark.parametrize("reduced_precision_reduction", [False, True])
def test_torch_eager_bf16_layer_within_TORCH_EAGER_BF16(reduced_precision_reduction):
    """False: the declared arithmetic (FP32 accumulation). True (torch's default): cuBLAS may reduce split-K
    partial sums in bf16; whether the profile still holds on this GPU is what this case measures."""
    from kernels_for_tests import eager_bf16_moe

    def check(data):
        ki = data.draw(moe_cases(max_tokens=64, hidden=(256, 1024), intermediate=(128, 512)))
        out = eager_bf16_moe(**ki.torch("cuda"))
        return compare(out, ki.reference(), "TORCH_EAGER_BF16")

    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = reduced_precision_reduction
    try:
        _prove(f"torch eager bf16 MoE layer (CUDA, reduced-precision reduction {reduced_precision_reduction}) "
               "/ TORCH_EAGER_BF16", check, max_examples=15)
    finally:
        flags.allow_bf16_reduced_precision_reduction = saved


@pytest.mark.parametrize("profile", ["BF16_OUTPUT", "CUTLASS_BF16_GROUPED_MM"])
def test_grouped_mm_layer_within_BF16_OUTPUT(profile):
    """A layer from torch._grouped_mm (the decision table's BF16_OUTPUT row, and the alias): rows permuted by expert, bf16 GEMM1, SiLU(gate) * up in fp32 stored
    bf16, bf16 GEMM2, routed weights and the top-k sum in fp32, bf16 output."""

    def layer(t):
        x, w1, w2, tw, ids = t["hidden_states"], t["w1"], t["w2"], t["topk_weights"], t["topk_ids"].long()
        m, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w1.shape[0])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        rows = x[order // k]
        h = torch._grouped_mm(rows, w1.transpose(1, 2), offs=offs)
        gate, up = h.float().chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate) * up).bfloat16()
        y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
        slot = torch.empty_like(y)
        slot[order] = y
        return (slot.float().view(m, k, -1) * tw.float()[..., None]).sum(1).bfloat16()

    def check(data):
        ki = data.draw(moe_cases(max_tokens=64, hidden=(256, 1024), intermediate=(128, 512)))
        return compare(layer(ki.torch("cuda")), ki.reference(), profile)

    _prove(f"torch._grouped_mm MoE layer / {profile}", check, max_examples=15)


def test_scaled_grouped_mm_within_CUBLAS_FP8():
    """torch._scaled_grouped_mm (rowwise FP8, CUTLASS grouped; fast accumulation off)."""
    from moeref.moe.mapping import from_torch_scaled_grouped_mm

    def check(data):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        e = data.draw(st.integers(1, 4))
        counts = [16 * data.draw(st.integers(0, 6)) for _ in range(e)]
        n, k = data.draw(st.sampled_from([(64, 256), (128, 1024)]))
        kind = data.draw(st.sampled_from(DATA))
        r = max(sum(counts), 16)
        x, w = _data(rng, (r, k), kind), 0.02 * _data(rng, (e, n, k), "normal")
        sa = (np.abs(x).max(axis=1) / 448).astype(np.float32)
        sb = (np.abs(w).max(axis=2) / 448).astype(np.float32)
        a = torch.from_numpy(x / sa[:, None]).cuda().to(FP8)
        b = torch.from_numpy(w / sb[:, :, None]).cuda().to(FP8).transpose(1, 2)
        tsa, tsb = torch.from_numpy(sa).cuda(), torch.from_numpy(sb).cuda()
        offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
        out = torch._scaled_grouped_mm(a, b, tsa, tsb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False)
        call = from_torch_scaled_grouped_mm(a, b, tsa, tsb, offs, out=out)
        return grouped_gemm_report(call, profile="CUBLAS_FP8"), grouped_gemm_report(call, profile="FP32_ACCUM")

    _prove("torch._scaled_grouped_mm / CUBLAS_FP8", check)
