"""fastpath.moe touches only the routed rows of its layout (issue 13, performance): the token rows are
scattered to their slots' rows (padding rows never written), the fused activation skips tiles of padding
rows (``skip_rows``), and ``capturable=True`` (no host sync) gives the same bits as the default.

CPU: the Triton kernels under the interpreter, float32 layers (the interpreter's low-precision dot is not
the hardware's; the FP8 layer is covered on the GPU by property_tests/test_fastpath_moe*.py).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import POISON_BYTE, device, poisoned  # noqa: E402
from moeref.moe import make_layer, make_tokens  # noqa: E402

DEV = device()


def _labels(rows: int, seed: int) -> np.ndarray:
    """Contiguous-layout labels: segments of 32 rows, each with a random number of real rows first (>= 0),
    then padding (-1); one segment fully padding."""
    rng = np.random.default_rng(seed)
    lab = np.full(rows, -1, np.int64)
    for s in range(0, rows, 32):
        n = 0 if s == 32 else int(rng.integers(0, 33))
        lab[s:s + n] = np.arange(s, s + n)
    return lab


@pytest.mark.parametrize("act", ["silu_and_mul", "swigluoai"])
def test_fused_activation_quant_skips_padding_tiles(act):
    """Rows with a label >= 0: the reference quantizer applied to the kernel's float32 activation, bit for
    bit; a tile of padding rows only (the all -1 segment) is not written (its codes keep the poison)."""
    from fastpath.fused import silu_and_mul, silu_and_mul_quant_fp8, swigluoai, swigluoai_quant_fp8
    from moeref.quant import fp8_group, quantize

    rows, n = 128, 256
    x = torch.as_tensor(np.random.default_rng(1).standard_normal((rows, 2 * n)).astype(np.float32), device=DEV)
    lab = _labels(rows, 2)
    fused, plain = (silu_and_mul_quant_fp8, silu_and_mul) if act == "silu_and_mul" else \
        (swigluoai_quant_fp8, swigluoai)
    with poisoned():
        got = fused(x, scheme=fp8_group(128), skip_rows=torch.as_tensor(lab, device=DEV), hw_fp8=False)
    real = np.flatnonzero(lab >= 0)
    want = quantize(plain(x).cpu().numpy()[real], fp8_group(128))
    codes = got.codes.cpu().numpy()
    np.testing.assert_array_equal(codes[real], np.asarray(want.codes).view(np.uint8))
    np.testing.assert_array_equal(got.scales.cpu().numpy()[real], np.asarray(want.scales, np.float32))
    assert np.all(codes[32:64] == POISON_BYTE), "the all-padding segment was computed"


def test_fused_skip_rows_refuses_bad_labels():
    from fastpath.fused import silu_and_mul_quant_fp8

    x = torch.zeros((8, 256), device=DEV)
    with pytest.raises(TypeError, match="skip_rows"):
        silu_and_mul_quant_fp8(x, skip_rows=torch.zeros(8, device=DEV))
    with pytest.raises(ValueError, match="one label per row"):
        silu_and_mul_quant_fp8(x, skip_rows=torch.zeros(7, dtype=torch.int32, device=DEV))


def _layer_case(seed: int, tokens: int = 9, experts: int = 5, top_k: int = 2):
    from fastpath.moe import fast_weights

    rng = np.random.default_rng(seed)
    lw = make_layer(experts, 32, 16, seed=seed)
    x = torch.as_tensor(make_tokens(tokens, 32, seed=seed + 1), device=DEV)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[0, 1] = -1  # a padding slot
    tw = rng.random((tokens, top_k)).astype(np.float32)
    return x, fast_weights(lw, DEV), torch.as_tensor(tw, device=DEV), torch.as_tensor(ids, device=DEV)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_padding_rows_never_reach_the_output(layout):
    """The layer's output is the same bits whether its buffers start as poison (NaN/garbage in every row no
    kernel writes) or not: padding rows are neither written nor read outside the GEMMs' own tiles."""
    from fastpath.moe import fused_moe

    x, fw, tw, ids = _layer_case(3)
    kw = dict(alignment=16, out_dtype=torch.float32, layout=layout)
    plain = fused_moe(x, fw, tw, ids, **kw)
    with poisoned(0x7F):  # float32 0x7F7F7F7F: a huge finite value; 0xFF..: NaN below
        big = fused_moe(x, fw, tw, ids, **kw)
    with poisoned(0xFF):
        nan = fused_moe(x, fw, tw, ids, **kw)
    assert torch.isfinite(plain).all()
    assert torch.equal(plain, big) and torch.equal(plain, nan)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_capturable_gives_the_same_bits(layout):
    """``capturable=True`` (no host sync: worst-case contiguous buffer, masked capacity = tokens) and the
    default (tight buffers sized from the counts) give the same output bits; chunks and a shared expert too."""
    from fastpath.moe import fast_weights, fused_moe
    from moeref.moe import SharedExperts

    x, fw, tw, ids = _layer_case(4, tokens=11)
    s = make_layer(1, 32, 8, seed=9)
    shared = fast_weights(SharedExperts(s.w13[0], s.w2[0], s.w13_layout), DEV)
    kw = dict(alignment=16, out_dtype=torch.float32, layout=layout, chunk_size=4, shared_experts=shared)
    want = fused_moe(x, fw, tw, ids, **kw)
    with poisoned(0xFF):
        got = fused_moe(x, fw, tw, ids, capturable=True, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_bf16_output_is_the_float32_output_rounded(layout):
    """Without shared experts the reduce kernel stores each chunk's rows of the output in ``out_dtype``: the
    bf16 output is the float32 output (same weighted sums) rounded by torch, chunk by chunk."""
    from fastpath.moe import fused_moe

    x, fw, tw, ids = _layer_case(6, tokens=10)
    kw = dict(alignment=16, layout=layout, chunk_size=4)
    f32 = fused_moe(x, fw, tw, ids, out_dtype=torch.float32, **kw)
    with poisoned(0xFF):
        bf = fused_moe(x, fw, tw, ids, out_dtype=torch.bfloat16, **kw)
    assert bf.dtype == torch.bfloat16 and torch.isfinite(f32).all()
    assert not torch.equal(f32, bf.float()), "the float32 output has bits below bf16 (the check can fail)"
    assert torch.equal(f32.to(torch.bfloat16), bf)


def test_ids_checked_once_unless_capturable():
    from fastpath.moe import fused_moe

    x, fw, tw, ids = _layer_case(5)
    bad = ids.clone()
    bad[2, 0] = 7  # expert 7 of 5
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, fw, tw, bad, alignment=16)
    with pytest.raises(ValueError, match="expert_map"):
        fused_moe(x, fw, tw, ids, alignment=16, capturable=True, expert_map=np.arange(5))


def _deep_gemm_or_skip():
    from fastpath.grouped_gemm import grouped_gemm_supports
    from fastpath.testing import on_gpu

    if not on_gpu():
        pytest.skip("DeepGEMM needs a CUDA GPU (Hopper)")
    ok, why = grouped_gemm_supports("deep_gemm")
    if not ok:
        pytest.skip(why)


@pytest.mark.gpu
def test_deep_gemm_psum_layout_gives_the_m_indices_bits():
    """DeepGEMM through ``psum`` (its psum layout: only the experts' own row blocks are visited, which
    fastpath.moe uses for the contiguous layout) gives every real row of a worst-case buffer the same bits as
    ``m_indices`` (every block visited), with NaN codes and scales in the padding rows; a planted psum (one
    non-empty expert emptied, which moves the next expert's start) leaves rows unwritten or wrong."""
    _deep_gemm_or_skip()
    from fastpath import dispatch
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    gen = torch.Generator(device="cuda").manual_seed(0)
    e, n, k, m, top_k = 8, 256, 512, 300, 2
    ids = torch.rand((m, e), device="cuda", generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    ids[ids == 5] = 6  # expert 5 empty (each token still has distinct experts unless it had 5 and 6)
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], -1, ids[:, 1])
    lay = dispatch.to_contiguous(None, ids, e, 128, m_sum="worst_case")
    rows = int(lay.m_indices.numel())
    real = lay.m_indices >= 0
    codes = torch.randint(0, 256, (rows, k), dtype=torch.uint8, device="cuda", generator=gen)
    codes[(codes & 0x7F) == 0x7F] -= 1
    codes[~real] = 0x7F  # NaN codes in the padding rows
    sa = torch.exp2(torch.randint(-8, -4, (rows, k // 128), device="cuda", generator=gen).float())
    sa[~real] = float("nan")
    b = torch.randint(0, 256, (e, n, k), dtype=torch.uint8, device="cuda", generator=gen)
    b[(b & 0x7F) == 0x7F] -= 1
    bs = torch.exp2(torch.randint(-10, -6, (e, n // 128, k // 128), device="cuda", generator=gen).float())
    a8, b8 = codes.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn)
    assert bool((lay.m_indices.view(-1, 128)[:, 0] < 0).any()), "the buffer has blocks of padding rows only"

    def run(**kw):
        d = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        return grouped_gemm_contiguous(a8, b8, lay.m_indices, impl="deep_gemm", a_scales=sa, b_scales=bs, out=d, **kw)

    want, got = run(), run(psum=lay.psum)
    assert torch.isfinite(want[real].float()).all()
    assert torch.equal(got[real], want[real])
    bad = lay.psum.clone()
    j = int(torch.nonzero(torch.diff(lay.psum, prepend=lay.psum.new_zeros(1)) > 0)[1])  # a non-empty expert
    bad[j] = int(bad[j - 1]) if j > 0 else 0
    planted = run(psum=bad)
    assert not torch.equal(planted[real], want[real])


@pytest.mark.gpu
def test_deep_gemm_layer_capturable_and_bf16_store_give_the_same_bits():
    """The FP8 layer through DeepGEMM: ``capturable=True`` (worst-case buffer, psum layout) gives the default's
    (tight buffer) output bits, and the bf16 output the reduce kernel stores is torch's rounding of the
    float32 output (``out_dtype=torch.float32``, the same weighted sums) to bfloat16."""
    _deep_gemm_or_skip()
    from fastpath.moe import fast_weights, fused_moe
    from moeref.moe import quantize_weights
    from moeref.quant import fp8_block

    rng = np.random.default_rng(7)
    weights = fast_weights(quantize_weights(make_layer(6, 256, 128, seed=7), fp8_block()), "cuda")
    x = torch.as_tensor(make_tokens(150, 256, seed=8), device="cuda").to(torch.bfloat16)
    ids = torch.as_tensor(np.stack([rng.choice(6, 2, replace=False) for _ in range(150)]).astype(np.int32),
                          device="cuda")
    tw = torch.as_tensor(rng.random((150, 2)).astype(np.float32), device="cuda")
    for out_dtype in (torch.bfloat16, torch.float32):
        want = fused_moe(x, weights, tw, ids, impl="deep_gemm", out_dtype=out_dtype)
        with poisoned(0xFF):
            got = fused_moe(x, weights, tw, ids, impl="deep_gemm", out_dtype=out_dtype, capturable=True)
        assert want.dtype == out_dtype and torch.isfinite(want.float()).all()
        assert torch.equal(got, want), out_dtype
    f32 = fused_moe(x, weights, tw, ids, impl="deep_gemm", out_dtype=torch.float32)
    bf16 = fused_moe(x, weights, tw, ids, impl="deep_gemm", out_dtype=torch.bfloat16)
    assert not torch.equal(f32, bf16.float()), "the float32 output has bits below bf16 (the check can fail)"
    assert torch.equal(f32.to(torch.bfloat16), bf16)
