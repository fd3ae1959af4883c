"""The graph cache of eager ``fastpath.moe.fused_moe`` calls on the GPU (issue 33): a cached call (a replay
of the captured ``capturable=True`` form) gives the bits of the uncached call and of the capturable call, at
1, 4, 16 and 64 tokens, through Triton and DeepGEMM, both layouts, ``capturable`` False and True; new inputs
of the same shapes are followed; weights written in place are read by the replay; another weights object or
another shape is another entry; past ``GRAPH_CACHE_MAX_TOKENS`` nothing is cached; a call made while the
caller captures a graph never uses the cache.

GPU only: CUDA graphs need a CUDA device (skipped with the reason on the CPU). The cache's bookkeeping and
the cached call's logic are tested on the CPU in tests/test_fastpath_moe_graph_cache.py.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

E, HIDDEN, INTER, TOP_K = 16, 512, 256, 4


def _impls():
    from fastpath.grouped_gemm import grouped_gemm_supports

    return ["triton"] + (["deep_gemm"] if grouped_gemm_supports("deep_gemm")[0] else [])


def _fp8_layer(seed: int = 0):
    """Random FP8 E4M3 experts (NaN codes moved to the largest finite) with FP32 128x128 block scales."""
    from fastpath.moe import FastMoEWeights

    g = torch.Generator(device="cuda").manual_seed(seed)

    def codes(n, k):
        c = torch.randint(0, 256, (E, n, k), dtype=torch.uint8, device="cuda", generator=g)
        c[(c & 0x7F) == 0x7F] -= 1
        return c.view(torch.float8_e4m3fn)

    def scales(n, k):
        return 1e-3 * (1 + torch.rand((E, n // 128, k // 128), device="cuda", generator=g))

    return FastMoEWeights(codes(2 * INTER, HIDDEN), codes(HIDDEN, INTER), "gate_up", scales(2 * INTER, HIDDEN),
                          scales(HIDDEN, INTER))


def _tokens(m: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((m, HIDDEN), device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.rand((m, E), device="cuda", generator=g).topk(TOP_K, dim=1).indices.to(torch.int32)
    w = torch.rand((m, TOP_K), device="cuda", generator=g)
    return x, (w / w.sum(dim=1, keepdim=True)).to(torch.float32), ids


def _info():
    from fastpath.moe import graph_cache_info

    i = graph_cache_info()
    return {k: i[k] for k in ("hits", "captures", "entries")}


@pytest.fixture
def fresh_cache():
    from fastpath.moe import clear_graph_cache

    clear_graph_cache()
    yield
    clear_graph_cache()


@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("impl", _impls() if torch.cuda.is_available() else ["triton"])
def test_cached_call_gives_the_uncached_and_the_capturable_bits(fresh_cache, impl, layout, capturable, tokens):
    from fastpath.moe import fused_moe

    fw = _fp8_layer(1)
    x, tw, ids = _tokens(tokens, 2)
    kw = dict(impl=impl, layout=layout)
    want = fused_moe(x, fw, tw, ids, graph_cache=False, **kw)
    assert torch.equal(fused_moe(x, fw, tw, ids, capturable=True, graph_cache=False, **kw), want)
    i0 = _info()
    outs = [fused_moe(x, fw, tw, ids, capturable=capturable, **kw) for _ in range(3)]  # uncached, captured, replayed
    i1 = _info()
    assert (i1["captures"] - i0["captures"], i1["hits"] - i0["hits"]) == (1, 1), (i0, i1)
    for o in outs:
        assert torch.equal(o, want)
    assert outs[2].data_ptr() != outs[1].data_ptr(), "a replay returns a fresh tensor"
    x2, tw2, ids2 = _tokens(tokens, 3)  # new values, same shapes: copied in, replayed
    got = fused_moe(x2, fw, tw2, ids2, capturable=capturable, **kw)
    assert _info()["hits"] == i1["hits"] + 1
    want2 = fused_moe(x2, fw, tw2, ids2, graph_cache=False, **kw)
    assert torch.equal(got, want2) and not torch.equal(want2, want)
    assert torch.equal(outs[2], want), "a later replay rewrote an earlier call's result"


@pytest.mark.parametrize("impl", _impls() if torch.cuda.is_available() else ["triton"])
def test_weights_written_in_place_are_read_by_the_replay(fresh_cache, impl):
    from fastpath.moe import fused_moe

    fw = _fp8_layer(4)
    x, tw, ids = _tokens(2, 5)
    kw = dict(impl=impl, layout="masked", capturable=True)
    for _ in range(3):
        before = fused_moe(x, fw, tw, ids, **kw)
    i0 = _info()
    w13 = fw.w13.view(torch.uint8)
    w13.copy_(w13.roll(1, dims=1))  # other codes in the same memory
    fw.w2_scales.mul_(2)
    got = fused_moe(x, fw, tw, ids, **kw)
    i1 = _info()
    assert (i1["hits"], i1["captures"]) == (i0["hits"] + 1, i0["captures"]), "not served by the same graph"
    want = fused_moe(x, fw, tw, ids, graph_cache=False, **kw)
    assert torch.equal(got, want) and not torch.equal(got, before)


def test_another_weights_object_or_shape_is_another_entry(fresh_cache):
    from fastpath.moe import FastMoEWeights, fused_moe

    fw = _fp8_layer(6)
    x, tw, ids = _tokens(3, 7)
    for _ in range(2):
        fused_moe(x, fw, tw, ids)
    assert _info()["entries"] == 1
    other = FastMoEWeights(fw.w13.clone(), fw.w2, "gate_up", fw.w13_scales * 2, fw.w2_scales)
    got = [fused_moe(x, other, tw, ids) for _ in range(3)]
    assert _info()["entries"] == 2
    want = fused_moe(x, other, tw, ids, graph_cache=False)
    assert all(torch.equal(g, want) for g in got)
    assert not torch.equal(want, fused_moe(x, fw, tw, ids))
    x4, tw4, ids4 = _tokens(4, 8)
    got = [fused_moe(x4, fw, tw4, ids4) for _ in range(3)]
    assert _info()["entries"] == 3
    assert all(torch.equal(g, fused_moe(x4, fw, tw4, ids4, graph_cache=False)) for g in got)


def test_nothing_is_cached_past_the_token_limit_or_without_the_cache(fresh_cache):
    from fastpath.moe import GRAPH_CACHE_MAX_TOKENS, fused_moe

    fw = _fp8_layer(9)
    x, tw, ids = _tokens(GRAPH_CACHE_MAX_TOKENS + 1, 10)
    for _ in range(3):
        fused_moe(x, fw, tw, ids, layout="masked", capturable=True)
    x, tw, ids = _tokens(2, 11)
    for _ in range(3):
        fused_moe(x, fw, tw, ids, graph_cache=False)
    assert _info()["entries"] == 0


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_a_call_inside_the_callers_capture_never_uses_the_cache(fresh_cache, layout):
    from fastpath.moe import fused_moe

    fw = _fp8_layer(12)
    x, tw, ids = _tokens(2, 13)
    kw = dict(layout=layout, capturable=True)
    for _ in range(2):
        fused_moe(x, fw, tw, ids, **kw)  # the cache now holds this key (on the current stream)
    assert _info()["entries"] == 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the usual warm-up before a capture, without the cache
        fused_moe(x, fw, tw, ids, graph_cache=False, **kw)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    i0 = _info()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe(x, fw, tw, ids, **kw)
    assert _info() == i0, "the cache was used (or filled) during the caller's capture"
    x2, tw2, ids2 = _tokens(2, 14)
    x.copy_(x2)
    tw.copy_(tw2)
    ids.copy_(ids2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x2, fw, tw2, ids2, graph_cache=False, **kw))
