"""fastpath.requant: the fused FP8-block decode + FP4 quantize equals the reference path
``quantize(q.dequantize(np.float32), target)`` bit for bit (codes, scales, global), in both scale
layouts; on the CPU under TRITON_INTERPRET=1 (the conftest sets it without a GPU), on a GPU for real."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath import requant  # noqa: E402
from moeref import layouts  # noqa: E402
from moeref.checkpoint import get_layout  # noqa: E402
from moeref.quant import fp8_block, quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ("modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4", "gptoss-mxfp4")


def _source(shape, block, scale_fmt="fp32", seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    w[0, :8] = 0.0
    w[1, :5] = -0.0
    w[2, 3] = 1e-9          # a subnormal E4M3 code after scaling
    w[-1, -16:] *= 300.0    # a block with a large range
    return quantize(w, fp8_block(block, scale_fmt, "deepgemm"))


def _same(got, ref):
    return (np.array_equal(got.codes, ref.codes) and np.array_equal(got.scales, ref.scales)
            and got.global_scale == ref.global_scale)


@pytest.mark.parametrize("shape,block,scale_fmt", [((256, 256), (128, 128), "fp32"),
                                                   ((200, 160), (128, 128), "fp32"),
                                                   ((96, 96), (32, 32), "ue8m0")])
def test_fused_equals_reference(shape, block, scale_fmt):
    q = _source(shape, block, scale_fmt)
    x32 = q.dequantize(np.float32)
    src = requant.from_reference(q, DEV)
    for name in TARGETS:
        scheme = get_layout(name).scheme()
        ref = quantize(x32, scheme)
        got = requant.fp8_block_to_fp4(*src, scheme).to_reference()
        assert _same(got, ref), name


def test_swizzled_scales_are_the_layouts_swizzle_of_the_reference():
    q = _source((200, 160), (128, 128))
    ref_scales = quantize(q.dequantize(np.float32), get_layout("ct-nvfp4").scheme()).scales
    got = requant.fp8_block_to_fp4(*requant.from_reference(q, DEV), get_layout("ct-nvfp4").scheme(),
                                   scale_layout="swizzled_128x4")
    want = layouts.swizzle_128x4(np.ascontiguousarray(ref_scales).view(np.uint8))
    assert np.array_equal(got.scales.cpu().numpy().view(np.uint8).ravel(), want.ravel())


def test_static_global_equals_reference():
    q = _source((128, 256), (128, 128))
    x32 = q.dequantize(np.float32)
    for name in ("modelopt-nvfp4", "ct-nvfp4"):
        scheme = get_layout(name).scheme()
        conv = scheme.preset.option("global_convention")
        amax = float(np.max(np.abs(x32))) * 1.5
        g = {"amax": amax, "encode_scale": float(np.float32(2688.0 / amax)),
             "decode_scale": float(np.float32(amax / 2688.0))}[conv]
        ref = quantize(x32, scheme, global_scale=g)
        got = requant.fp8_block_to_fp4(*requant.from_reference(q, DEV), scheme, global_scale=g)
        assert _same(got.to_reference(), ref), name


def test_refusals_name_the_reason():
    q = _source((128, 128), (128, 128))
    ok, why = requant.supports(q.scheme, get_layout("ct-fp8-block").scheme(), q.shape, q.block_shape)
    assert not ok and "FP4" in why
    ok, why = requant.supports(q.scheme, get_layout("ct-mxfp4").scheme(), q.shape, (128, 48))
    assert not ok and "multiple of the target group" in why
    with pytest.raises(ValueError, match="scales must be float32"):
        c, s, b = requant.from_reference(q, DEV)
        requant.fp8_block_to_fp4(c, s.double(), b, get_layout("ct-mxfp4").scheme())


def test_converter_glue_refuses_non_finite_nvfp4_input_as_the_reference_does():
    from fastpath.checkpoint_engine import fused_source_quantizer
    from moeref.quant import QuantizedTensor

    q = _source((128, 128), (128, 128))
    codes = np.array(q.codes, copy=True)
    codes[3, 4] = 0x7F  # the E4M3 NaN
    q = QuantizedTensor(codes=codes, scales=q.scales, scheme=q.scheme, shape=q.shape)
    scheme = get_layout("ct-nvfp4").scheme()
    fq, why = fused_source_quantizer(q, scheme, DEV)
    assert fq is not None, why
    with pytest.raises(ValueError, match="finite"):
        fq(q.dequantize(np.float32), scheme)


def _all_codes_source(shape, block, nan, seed=1):
    """Every E4M3 code (random bytes; the NaN codes 0x7F / 0xFF only when ``nan``) under random
    positive FP32 block scales: subnormals, -0 and 448 pass through the data pass's decode."""
    from moeref.quant import QuantizedTensor

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[0, :256] = np.arange(256, dtype=np.uint8)[: min(256, shape[1])]
    if not nan:
        codes[(codes & 0x7F) == 0x7F] = 0x7E
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scales = (rng.uniform(0.5, 2.0, size=grid) * 2.0 ** rng.integers(-12, 4, size=grid)).astype(np.float32)
    q0 = quantize(np.zeros(shape, np.float32), fp8_block(block, "fp32", "deepgemm"))
    return QuantizedTensor(codes=codes.view(q0.codes.dtype), scales=scales, scheme=q0.scheme, shape=shape)


@pytest.mark.parametrize("name", TARGETS)
def test_every_e4m3_code_decodes_as_the_reference(name):
    scheme = get_layout(name).scheme()
    q = _all_codes_source((128, 256), (128, 128), nan=scheme.family != "nvfp4")
    ref = quantize(q.dequantize(np.float32), scheme)
    got = requant.fp8_block_to_fp4(*requant.from_reference(q, DEV), scheme).to_reference()
    assert np.array_equal(got.codes, ref.codes), name
    assert np.array_equal(np.asarray(got.scales).view(np.uint8), np.asarray(ref.scales).view(np.uint8)), name
    assert got.global_scale == ref.global_scale, name


@pytest.mark.parametrize("tile", [requant.RequantTuning(8, 2, 1, 16, 64, 2),
                                  requant.RequantTuning(128, 4, 8, 128, 128, 4),
                                  requant.RequantTuning(16, 1, 2, 128, 32, 1),
                                  requant.RequantTuning(8, 2, 1, 16, 64, method="persistent",
                                                        programs=3)])
@pytest.mark.parametrize("layout", ["row_major", "swizzled_128x4"])
def test_tiles_change_no_bit(tile, layout):
    q = _source((200, 256), (128, 128))
    for name in ("ct-nvfp4", "ct-mxfp4"):
        scheme = get_layout(name).scheme()
        want = requant.fp8_block_to_fp4(*requant.from_reference(q, DEV), scheme, scale_layout=layout)
        got = requant.fp8_block_to_fp4(*requant.from_reference(q, DEV), scheme, scale_layout=layout,
                                       tuning=tile)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales), (name, tile)
        assert got.to_reference().global_scale == want.to_reference().global_scale


@pytest.mark.parametrize("shape,block,scale_fmt,amax_rows", [((200, 256), (128, 128), "fp32", 256),
                                                             ((200, 256), (128, 128), "fp32", 512),
                                                             ((96, 96), (32, 32), "ue8m0", 64),
                                                             ((96, 96), (32, 32), "ue8m0", 128)])
def test_amax_tiles_stacking_source_blocks_equal_the_reference(shape, block, scale_fmt, amax_rows):
    """An amax tile of several source blocks stacked along rows (one scale each; rows past M
    masked): the global, and so every scale and code, is the reference's; a NaN code in one of
    the stacked blocks gives the same result as the one-block tile (NaN propagates, or is
    ignored, by the preset's policy, whatever the other blocks hold)."""
    q = _source(shape, block, scale_fmt, seed=3)
    x32 = q.dequantize(np.float32)
    tun = requant.RequantTuning(amax_block_m=amax_rows)
    one = requant.RequantTuning(amax_block_m=block[0])
    for name in ("modelopt-nvfp4", "ct-nvfp4"):
        scheme = get_layout(name).scheme()
        src = requant.from_reference(q, DEV)
        got = requant.fp8_block_to_fp4(*src, scheme, tuning=tun).to_reference()
        assert _same(got, quantize(x32, scheme)), name
        codes = src[0].clone()
        codes[1, -1] = 0x7F  # a NaN in the first source block row, in the column of the large block
        a = requant.fp8_block_to_fp4(codes, src[1], src[2], scheme, tuning=tun)
        b = requant.fp8_block_to_fp4(codes, src[1], src[2], scheme, tuning=one)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), name
        assert np.array_equal(a.global_scale.cpu().numpy(), b.global_scale.cpu().numpy(),
                              equal_nan=True), name


def test_tuning_refuses_bad_tiles():
    with pytest.raises(ValueError, match="power of two"):
        requant.RequantTuning(block_m=24)
    q = _source((128, 128), (64, 64))
    with pytest.raises(ValueError, match="inside one 64 x 64 source block"):
        requant.fp8_block_to_fp4(*requant.from_reference(q, DEV), get_layout("ct-mxfp4").scheme(),
                                 tuning=requant.RequantTuning(block_m=128))


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a CUDA GPU")
def test_nvfp4_conversion_replays_from_a_cuda_graph_bit_equal():
    scheme = get_layout("ct-nvfp4").scheme()
    q = _source((256, 256), (128, 128), seed=4)
    codes, scales, block = requant.from_reference(q, DEV)
    eager = requant.fp8_block_to_fp4(codes, scales, block, scheme)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        requant.fp8_block_to_fp4(codes, scales, block, scheme)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = requant.fp8_block_to_fp4(codes, scales, block, scheme)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.codes, eager.codes) and torch.equal(out.scales, eager.scales)
        assert torch.equal(out.global_scale, eager.global_scale)


@pytest.mark.parametrize("name", ("modelopt-nvfp4", "ct-nvfp4"))
def test_persistent_phases_equal_the_reference_at_any_grid(name):
    """The persistent kernel (fastpath._requant_persistent): under the interpreter its amax and
    data phases as two launches, on a GPU one launch with the grid barrier; one tile per program
    and a few programs looping over many tiles, slot counters shared unevenly."""
    q = _source((200, 256), (128, 128), seed=7)
    scheme = get_layout(name).scheme()
    ref = quantize(q.dequantize(np.float32), scheme)
    src = requant.from_reference(q, DEV)
    for programs, slots in ((None, 64), (1, 64), (3, 64), (1000, 64), (5, 2)):
        got = requant.fp8_block_to_fp4(*src, scheme, tuning=requant.RequantTuning(
            method="persistent", programs=programs, amax_block_m=16, slots=slots)).to_reference()
        assert _same(got, ref), (programs, slots)


def test_tuning_refuses_bad_method_and_programs():
    with pytest.raises(ValueError, match="method must be one of"):
        requant.RequantTuning(method="barrier")
    with pytest.raises(ValueError, match="positive int"):
        requant.RequantTuning(programs=0)
    with pytest.raises(ValueError, match="power of two"):
        requant.RequantTuning(slots=48)
    with pytest.raises(ValueError, match="poll_sleep_ns"):
        requant.RequantTuning(poll_sleep_ns=-1)
    with pytest.raises(ValueError, match="pdl must be"):
        requant.RequantTuning(pdl=1)
    with pytest.raises(ValueError, match="persistent method is one launch"):
        requant.RequantTuning(method="persistent", pdl=True)


def test_pdl_is_refused_where_it_cannot_run(monkeypatch):
    """``pdl=True`` where Programmatic Dependent Launch is not available (the interpreter, a CPU
    device: ``_pdl_available`` is False there; forced False on a GPU) is an error, not a silent
    sequential launch; the default (None) takes the sequential launch there."""
    assert not requant._pdl_available(torch.device("cpu"))
    q = _source((128, 128), (128, 128))
    src = requant.from_reference(q, DEV)
    scheme = get_layout("ct-nvfp4").scheme()
    monkeypatch.setattr(requant, "_pdl_available", lambda dev: False)
    with pytest.raises(ValueError, match="compute capability >= 9.0"):
        requant.fp8_block_to_fp4(*src, scheme, tuning=requant.RequantTuning(pdl=True))
    got = requant.fp8_block_to_fp4(*src, scheme).to_reference()
    assert _same(got, quantize(q.dequantize(np.float32), scheme))


@pytest.mark.skipif(DEV != "cuda", reason="Programmatic Dependent Launch needs a CUDA GPU")
@pytest.mark.parametrize("name", ("modelopt-nvfp4", "ct-nvfp4"))
def test_pdl_launch_equals_the_reference_back_to_back(name):
    """The data kernel launched dependent on the amax kernel (PDL) and the two launched in turn:
    eight conversions of different sources issued back to back without a synchronization (so
    each one's kernels overlap the launches around them), each bit-identical to the reference:
    a data program that read the global factors before the amax grid finished would change the
    scales of some call."""
    if not requant._pdl_available(torch.device(DEV)):
        pytest.skip("this GPU has no Programmatic Dependent Launch (compute capability < 9.0)")
    scheme = get_layout(name).scheme()
    qs = [_source((1024, 2048), (128, 128), seed=40 + i) for i in range(4)]
    refs = [quantize(q.dequantize(np.float32), scheme) for q in qs]
    srcs = [requant.from_reference(q, DEV) for q in qs]
    for pdl in (True, False):
        tun = requant.RequantTuning(pdl=pdl)
        outs = [requant.fp8_block_to_fp4(*srcs[i % 4], scheme, tuning=tun) for i in range(8)]
        torch.cuda.synchronize()
        for i, o in enumerate(outs):
            assert _same(o.to_reference(), refs[i % 4]), (pdl, i)


@pytest.mark.skipif(DEV != "cuda", reason="the grid barrier runs only on a CUDA GPU")
@pytest.mark.parametrize("name", ("modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4"))
def test_persistent_launch_equals_the_reference_repeatedly(name):
    """One cooperative launch (amax phase, grid barrier, data phase) at the co-resident grid and
    at small grids, called again and again on fresh sources: each result bit-identical to the
    reference (a barrier that opened early, or a counter not reset, changes the global or the
    scales of some call)."""
    scheme = get_layout(name).scheme()
    for seed in range(4):
        q = _source((1024, 2048), (128, 128), seed=10 + seed)
        ref = quantize(q.dequantize(np.float32), scheme)
        src = requant.from_reference(q, DEV)
        for programs, slots, sleep in ((None, 64, 100), (1, 64, 100), (7, 2, 0), (300, 16, 0)):
            for _ in range(3):
                got = requant.fp8_block_to_fp4(*src, scheme, tuning=requant.RequantTuning(
                    method="persistent", programs=programs, slots=slots,
                    poll_sleep_ns=sleep)).to_reference()
                assert _same(got, ref), (seed, programs, slots)


@pytest.mark.skipif(DEV != "cuda", reason="co-residency is a CUDA GPU's")
def test_persistent_grid_larger_than_resident_is_refused():
    q = _source((128, 128), (128, 128))
    with pytest.raises(ValueError, match="resident at once"):
        requant.fp8_block_to_fp4(*requant.from_reference(q, DEV), get_layout("ct-nvfp4").scheme(),
                                 tuning=requant.RequantTuning(method="persistent", programs=10**6))


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("tuning", (dict(method="persistent"), dict(pdl=False), dict()))
def test_nvfp4_graph_replay_on_new_source_values(tuning):
    """A captured conversion replayed after the source buffers change: the result is the new
    source's (the amax words, count and barrier flag are zeroed inside the graph every replay)."""
    scheme = get_layout("modelopt-nvfp4").scheme()
    tun = requant.RequantTuning(**tuning)  # dict(): the default, PDL on a GPU that has it
    qs = [_source((512, 1024), (128, 128), seed=20 + i) for i in range(3)]  # three amaxes
    assert len({float(np.max(np.abs(q.dequantize(np.float32)))) for q in qs}) == 3
    srcs = [requant.from_reference(q, DEV) for q in qs]
    codes, scales, block = (srcs[0][0].clone(), srcs[0][1].clone(), srcs[0][2])
    requant.fp8_block_to_fp4(codes, scales, block, scheme, tuning=tun)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = requant.fp8_block_to_fp4(codes, scales, block, scheme, tuning=tun)
    for q, (c, s, _) in zip(qs * 2, srcs * 2):
        codes.copy_(c)
        scales.copy_(s)
        g.replay()
        torch.cuda.synchronize()
        ref = quantize(q.dequantize(np.float32), scheme)
        assert _same(out.to_reference(), ref)
