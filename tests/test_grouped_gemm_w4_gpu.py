"""The 4-bit-weight grouped GEMMs with bf16 activations on the GPU, at gpt-oss-120b shapes (hidden 2880,
intermediate 2880, 128 experts, top-4), and the gpt-oss MXFP4 layer (swigluoai, interleaved w13, biases)
against the exact reference under its declared profile.

GEMM level: the weights are random codes and scales made on the GPU (a gpt-oss checkpoint's
``*_blocks``/``*_scales`` for MXFP4); the exact product is computed here in float64 on the GPU from a
decode written in this file (E2M1 values from OCP MX v1.0 table 3, E8M0 ``2^(s-127)``, UE4M3 through
torch's float8_e4m3fn cast, two's-complement INT4), expert by expert. The bound is the worst-case FP32
accumulation bound of ``BF16_OUTPUT``'s arithmetic (:func:`moeref.compare.gemm_coefficient` with
``accum_model="worst_case"``: any summation order, which the declared contiguous-tree model refines; its
per-element NumPy evaluation at K = 2880 over thousands of rows is too slow for a test) plus the bf16
output store (``2^-8`` relative). Planted faults (the neighbouring K scale block, swapped nibbles) exceed it.
Layer level: :func:`fastpath.moe.fused_moe` against :func:`moeref.moe.run_moe` + :func:`moeref.compare.compare`
under the declared ``BF16_OUTPUT`` at a few tokens (the host bound's cost grows with the rows).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

E, HIDDEN, INTER, TOP = 128, 2880, 2880, 4
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _random_w4(kind: str, n: int, k: int, gen, group: int = 128):
    from fastpath.grouped_gemm_w4 import W4Experts

    codes = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    if kind == "mxfp4":  # through the gpt-oss checkpoint layout
        scales = torch.randint(118, 124, (E, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        return W4Experts.from_gptoss(codes.reshape(E, n, k // 32, 16), scales, "cuda")
    if kind == "nvfp4":
        scales = torch.randint(0x20, 0x60, (E, n, k // 16), dtype=torch.uint8, device="cuda", generator=gen)
        amax = (1.0 + torch.rand(E, generator=gen, device="cuda")).float()
        return W4Experts("nvfp4", codes, scales, 16, 1, k, amax, torch.full((E,), 2688.0, device="cuda"))
    scales = (torch.rand((E, n, -(-k // group)), device="cuda", generator=gen) * 0.02 + 0.001).float()
    return W4Experts("int4", codes, scales, group, 1, k)


def _decode64(w, e: int) -> torch.Tensor:
    """float64 ``[N, K]`` of expert ``e``, from the definitions (independent of the kernel's arithmetic)."""
    c = w.codes[e].to(torch.int64)
    nib = torch.stack([c & 15, c >> 4], dim=-1).reshape(c.shape[0], -1)
    rep_k = (lambda s: s.repeat_interleave(w.group, dim=1)[:, : w.k].repeat_interleave(w.scale_rows, dim=0)
             [: c.shape[0]])
    if w.kind == "int4":
        q = torch.where(nib >= 8, nib - 16, nib).to(torch.float64)
        return q * rep_k(w.scales[e].to(torch.float64))
    v = torch.tensor(E2M1, dtype=torch.float64, device=c.device)[nib & 7] * torch.where(nib >= 8, -1.0, 1.0).double()
    if w.kind == "mxfp4":
        return v * torch.exp2(rep_k(w.scales[e].to(torch.float64)) - 127)
    s = w.scales[e].view(torch.float8_e4m3fn).to(torch.float64)
    return v * rep_k(s) * (w.global_mul[e].double() / w.global_div[e].double())


def _layout(tokens: int, gen):
    from fastpath import dispatch

    ids = torch.rand((tokens, E), device="cuda", generator=gen).topk(TOP, dim=1).indices.to(torch.int32)
    return dispatch.to_contiguous(None, ids, E, 128)


def _check(w, a, m_idx, got, *, expect_pass=True) -> None:
    from moeref.compare import BF16_OUTPUT, gemm_coefficient

    coef = gemm_coefficient(replace(BF16_OUTPUT, accum_model="worst_case"), w.k)
    a64 = a.to(torch.float64)
    bad = 0
    for e in torch.unique(m_idx[m_idx >= 0]).tolist():  # a loop over experts
        rows = torch.nonzero(m_idx == e).reshape(-1)
        we = _decode64(w, e)
        ref = a64[rows] @ we.T
        bnd = coef * (a64[rows].abs() @ we.abs().T)
        bnd = bnd + 2.0**-8 * (ref.abs() + bnd)
        bad += int(((got[rows].double() - ref).abs() > bnd).sum())
    assert (bad == 0) == expect_pass, f"{bad} elements outside the bound"


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4", "int4"])
@pytest.mark.parametrize("tokens", [1, 64, 1024, 2048, 4096])
def test_w4_grouped_gemm_at_gpt_oss_shapes_within_the_bf16_bound(kind, tokens):
    """GEMM1 (N = 5760) and GEMM2 (N = 2880), K = 2880, 128 experts, top-4: bf16 activations, every
    valid row within the bound; the planted faults fail. The layer's rows per expert, ceil(tokens * 4 / 128),
    is passed as ``expected_m``, so every tile of the default rule runs: 16-row swap (1, 64 tokens), 32 (1024),
    64 (2048), 128 x 128 (4096; transposed for INT4)."""
    from fastpath.grouped_gemm_w4 import grouped_gemm_w4_contiguous

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    lay = _layout(tokens, gen)
    em = -(-tokens * TOP // E)
    for n in (2 * INTER, HIDDEN):
        w = _random_w4(kind, n, HIDDEN, gen)
        a = torch.randn((int(lay.m_indices.numel()), HIDDEN), device="cuda", generator=gen).to(torch.bfloat16)
        got = grouped_gemm_w4_contiguous(a, w, lay.m_indices, expected_m=em)
        _check(w, a, lay.m_indices, got)
        if tokens == 64:
            _check(w, a, lay.m_indices, grouped_gemm_w4_contiguous(a, replace(w, scales=w.scales.roll(1, dims=2)),
                                                                    lay.m_indices), expect_pass=False)
            swapped = replace(w, codes=((w.codes >> 4) | (w.codes << 4)).to(torch.uint8))
            _check(w, a, lay.m_indices, grouped_gemm_w4_contiguous(a, swapped, lay.m_indices), expect_pass=False)
        del w


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4", "int4"])
def test_w4_grouped_gemm_masked_layout_at_gpt_oss_shape(kind):
    from fastpath.grouped_gemm_w4 import grouped_gemm_w4_masked

    gen = torch.Generator(device="cuda").manual_seed(11)
    w = _random_w4(kind, HIDDEN, HIDDEN, gen)
    masked_m = torch.randint(0, 20, (E,), device="cuda", generator=gen)
    masked_m[3] = 128
    a = torch.randn((E, 128, HIDDEN), device="cuda", generator=gen).to(torch.bfloat16)
    got = grouped_gemm_w4_masked(a, w, masked_m).reshape(E * 128, -1)
    pos = torch.arange(128, device="cuda")
    m_idx = torch.where(pos[None, :] < masked_m[:, None], torch.arange(E, device="cuda")[:, None], -1).reshape(-1)
    _check(w, a.reshape(E * 128, -1), m_idx, got)


@pytest.mark.parametrize("tokens,layout,acts,on_input", [(1, "masked", "bfloat16", False),
                                                         (3, "contiguous", "bfloat16", False),
                                                         (2, "contiguous", "float8_e4m3fn", False),
                                                         (5, "contiguous", "bfloat16", True),
                                                         (4, "masked", "float8_e4m3fn", True)])
def test_gpt_oss_mxfp4_layer_within_declared_profile(tokens, layout, acts, on_input):
    """The gpt-oss-120b MoE layer (MXFP4 from checkpoint-layout blocks, swigluoai on interleaved w13,
    biases, 128 experts, top-4) through fastpath.moe against the exact reference under its declared profile
    (W4A16: BF16_OUTPUT; W4A8, FP8 1x128 activations: BF16_OUTPUT_FP32_ACT); the same layer with GEMM2
    reading the neighbouring scale block fails. ``on_input``: top-1 (each token's first expert) with the router
    weight on the input (W4A16: the weighted rows stored bf16, as reference_config declares)."""
    from fastpath.grouped_gemm_w4 import W4Experts
    from fastpath.moe import FastMoEWeights, fused_moe, profile_of, reference_config
    from moeref.compare import PROFILES, compare
    from moeref.gemm import StackedExperts
    from moeref.moe import MoEWeights

    rng = np.random.default_rng(tokens)

    def experts(n, k):
        blocks = rng.integers(0, 256, (E, n, k // 32, 16), dtype=np.uint8)
        scales = rng.integers(118, 123, (E, n, k // 32), dtype=np.uint8)
        ref = StackedExperts(blocks.reshape(E, n, k // 2), np.exp2(scales.astype(np.float64) - 127), "e2m1",
                             (1, 32), (n, k))
        return W4Experts.from_gptoss(blocks, scales, "cuda"), ref

    w13, r13 = experts(2 * INTER, HIDDEN)
    w2, r2 = experts(HIDDEN, INTER)
    b13 = rng.standard_normal((E, 2 * INTER)).astype(np.float32)
    b2 = rng.standard_normal((E, HIDDEN)).astype(np.float32)
    fw = FastMoEWeights(w13, w2, "interleaved", b13=torch.as_tensor(b13, device="cuda"),
                        b2=torch.as_tensor(b2, device="cuda"), w4_activations=acts)
    ref_w = MoEWeights(r13, r2, "interleaved", b13, b2)
    x = torch.randn((tokens, HIDDEN), device="cuda").to(torch.bfloat16)
    ids = np.stack([rng.choice(E, TOP, replace=False) for _ in range(tokens)]).astype(np.int32)
    tw = rng.random((tokens, TOP)).astype(np.float32)
    if on_input:
        ids, tw = ids[:, :1].copy(), tw[:, :1].copy()
    got = fused_moe(x, fw, torch.as_tensor(tw, device="cuda"), torch.as_tensor(ids, device="cuda"),
                    activation="swigluoai", layout=layout, apply_router_weight_on_input=on_input)
    cfg = reference_config(fw, apply_router_weight_on_input=on_input)
    prof = PROFILES[cfg.pop("profile")]
    assert prof.name == profile_of("triton", fw) == ("BF16_OUTPUT" if acts == "bfloat16" else "BF16_OUTPUT_FP32_ACT")
    from moeref.moe import run_moe

    run_ref = run_moe(x.float().cpu().numpy(), ref_w, tw, ids, activation="swigluoai", **cfg)
    rep = compare(got.float().cpu(), run_ref, prof)
    assert rep.passed, rep
    bad = replace(fw, w2=replace(w2, scales=w2.scales.roll(1, dims=2)))
    got_bad = fused_moe(x, bad, torch.as_tensor(tw, device="cuda"), torch.as_tensor(ids, device="cuda"),
                        activation="swigluoai", layout=layout, apply_router_weight_on_input=on_input)
    assert not compare(got_bad.float().cpu(), run_ref, prof).passed


@pytest.mark.parametrize("kind", ["mxfp4", "int4"])
def test_w4a8_fp8_activations_at_gpt_oss_shape(kind):
    """FP8 E4M3 activations with 1x128 FP32 scales (W4A8) x 4-bit weights, GEMM1 shape, 256 tokens."""
    from fastpath.grouped_gemm_w4 import grouped_gemm_w4_contiguous

    gen = torch.Generator(device="cuda").manual_seed(5)
    lay = _layout(256, gen)
    w = _random_w4(kind, 2 * INTER, HIDDEN, gen)
    rows = int(lay.m_indices.numel())
    a8 = torch.randn((rows, HIDDEN), device="cuda", generator=gen).mul(64).to(torch.float8_e4m3fn)
    sa = torch.rand((rows, -(-HIDDEN // 128)), device="cuda", generator=gen) * 0.01 + 0.001
    a64 = a8.to(torch.float64) * sa.double().repeat_interleave(128, dim=1)[:, :HIDDEN]
    got = grouped_gemm_w4_contiguous(a8, w, lay.m_indices, a_scales=sa)
    _check(w, a64, lay.m_indices, got)
    _check(w, a64, lay.m_indices, grouped_gemm_w4_contiguous(a8, w, lay.m_indices, a_scales=sa.roll(1, dims=1)),
           expect_pass=False)
