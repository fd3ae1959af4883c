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


def test_ids_checked_once_unless_capturable():
    from fastpath.moe import fused_moe

    x, fw, tw, ids = _layer_case(5)
    bad = ids.clone()
    bad[2, 0] = 7  # expert 7 of 5
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, fw, tw, bad, alignment=16)
    with pytest.raises(ValueError, match="expert_map"):
        fused_moe(x, fw, tw, ids, alignment=16, capturable=True, expert_map=np.arange(5))
