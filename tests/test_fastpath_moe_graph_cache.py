"""The graph cache of eager ``fastpath.moe.fused_moe`` calls (issue 33), on the CPU: the cache's bookkeeping
(LRU eviction, capture on a key's second call, failed keys, entries dropped with their weights), the key
(what changes it and what does not), the cache staying off for CPU tensors (TRITON_INTERPRET=1), and the
cached call's logic (copy-in, the host check of the ids, the masked fallback, copy-out) with a stand-in
for the CUDA graph that runs the captured call again on the entry's own buffers.

The CUDA graphs themselves: tests/test_fastpath_moe_graph_cache_gpu.py.
"""
from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath._graph_cache import GraphCache, GraphEntry, weights_signature  # noqa: E402
from fastpath.testing import device  # noqa: E402
from moeref.moe import make_layer, make_tokens  # noqa: E402

DEV = device()


class _Obj:
    pass


def test_lru_evicts_the_least_recently_used_entry():
    c = GraphCache(size=2)
    a, b, d = _Obj(), _Obj(), _Obj()
    c.put("a", GraphEntry("ga", (), None), (a,))
    c.put("b", GraphEntry("gb", (), None), (b,))
    assert c.get("a", (a,)).graph == "ga"  # "a" is now the most recently used: "b" goes next
    c.put("d", GraphEntry("gd", (), None), (d,))
    assert c.get("b", (b,)) is None
    assert c.get("a", (a,)).graph == "ga" and c.get("d", (d,)).graph == "gd"
    info = c.info()
    assert (info["entries"], info["evictions"], info["captures"], info["hits"], info["misses"]) == (2, 1, 3, 3, 1)


def test_a_key_is_captured_on_its_second_call_unless_it_failed_or_the_cache_is_off():
    c = GraphCache(size=4)
    assert [c.want_capture("k") for _ in range(2)] == [False, True]
    c.fail("k", "RuntimeError: no")
    assert not c.want_capture("k") and not c.want_capture("k")
    assert c.info()["failures"] == ["RuntimeError: no"]
    off = GraphCache(size=0)
    assert not any(off.want_capture("j") for _ in range(3))
    once = GraphCache(size=4, capture_after=1)
    assert once.want_capture("j")


def test_an_entry_goes_with_its_weights_and_is_not_served_for_other_objects():
    c = GraphCache(size=4)
    o, other = _Obj(), _Obj()
    c.put("k", GraphEntry("g", (), None), (o,))
    assert c.get("k", (other,)) is None and len(c) == 0  # not the object the key named: dropped
    c.put("k", GraphEntry("g", (), None), (o,))
    assert len(c) == 1
    del o
    gc.collect()
    assert len(c) == 0, "the entry outlived its weights (its graph would read freed memory)"


def _layer_case(seed: int, tokens: int = 6, experts: int = 5, top_k: int = 2):
    from fastpath.moe import fast_weights

    rng = np.random.default_rng(seed)
    lw = make_layer(experts, 32, 16, seed=seed)
    x = torch.as_tensor(make_tokens(tokens, 32, seed=seed + 1), device=DEV)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    tw = rng.random((tokens, top_k)).astype(np.float32)
    return x, fast_weights(lw, DEV), torch.as_tensor(tw, device=DEV), torch.as_tensor(ids, device=DEV)


def _opts(**kw):
    o = dict(impl="triton", activation="silu_and_mul", activation_params=None, layout="contiguous", alignment=16,
             max_m=None, out_dtype=torch.float32, num_experts=None, chunk_size=None, shared_experts=None,
             apply_router_weight_on_input=False)
    o.update(kw)
    return o


def test_the_key_follows_the_weights_memory_and_the_options():
    from fastpath.moe import FastMoEWeights, graph_key

    x, fw, tw, ids = _layer_case(1)
    k0 = graph_key(x, fw, tw, ids, _opts(), 7)
    assert graph_key(x, fw, tw, ids, _opts(), 7) == k0
    fw.w13.mul_(2)  # written in place: same memory, the same key (a replay reads the new values)
    assert graph_key(x, fw, tw, ids, _opts(), 7) == k0
    assert graph_key(x, dataclasses.replace(fw), tw, ids, _opts(), 7) != k0  # another object, same tensors
    moved = FastMoEWeights(fw.w13.clone(), fw.w2, fw.w13_layout)
    assert weights_signature(moved)[1] != weights_signature(fw)[1]  # w13's address
    view = FastMoEWeights(fw.w13, fw.w2.transpose(1, 2), fw.w13_layout)
    assert weights_signature(view)[2] != weights_signature(fw)[2]  # w2: same address, other shape and strides
    for other in (graph_key(x[:5], fw, tw[:5], ids[:5], _opts(), 7), graph_key(x, fw, tw, ids, _opts(), 8),
                  graph_key(x, fw, tw, ids.long(), _opts(), 7), graph_key(x, fw, tw, ids, _opts(layout="masked"), 7),
                  graph_key(x, fw, tw, ids, _opts(chunk_size=2), 7),
                  graph_key(x, fw, tw, ids, _opts(activation_params={"layout": "gate_up"}), 7),
                  graph_key(x, fw, tw, ids, _opts(shared_experts=fw), 7)):
        assert other != k0
    with pytest.raises(TypeError):
        graph_key(x, fw, tw, ids, _opts(activation_params={"alpha": [1.0]}), 7)
    with pytest.raises(TypeError, match="dataclass"):
        weights_signature(object())


def test_nested_4bit_weights_are_in_the_signature():
    from fastpath.grouped_gemm_w4 import W4Experts

    def w4(codes):
        return W4Experts("mxfp4", codes, torch.full((2, 4, 1), 127, dtype=torch.uint8), 32, 1, 32)

    codes = torch.zeros((2, 4, 16), dtype=torch.uint8)
    a, b = w4(codes), w4(codes.clone())
    sa, sb = weights_signature(a), weights_signature(b)
    assert sa[2][0] == codes.data_ptr() and sb[2][0] != codes.data_ptr()


@pytest.mark.skipif(DEV != "cpu", reason="CPU tensors run the kernels only under TRITON_INTERPRET=1, which a GPU "
                                         "machine's run does not set (the GPU behaviour: *_gpu.py)")
def test_cpu_calls_are_never_cached_and_give_the_uncached_bits():
    from fastpath.moe import fused_moe, graph_cache_info

    x, fw, tw, ids = _layer_case(2)
    before = graph_cache_info()
    runs = [fused_moe(x, fw, tw, ids, alignment=16, out_dtype=torch.float32) for _ in range(2)]
    want = fused_moe(x, fw, tw, ids, alignment=16, out_dtype=torch.float32, graph_cache=False)
    after = graph_cache_info()
    assert {k: after[k] for k in ("entries", "hits", "misses", "captures")} == \
        {k: before[k] for k in ("entries", "hits", "misses", "captures")}
    assert all(torch.equal(r, want) for r in runs)


class _StandInGraph:
    """What a captured graph does, without CUDA: the captured call again, on the entry's own buffers, its
    result written into the entry's output (the memory the graph's last kernel writes)."""

    def __init__(self, run):
        self.run, self.output, self.replays = run, None, 0

    def replay(self):
        self.output.copy_(self.run())
        self.replays += 1


@pytest.fixture
def stand_in_cache(monkeypatch):
    """fastpath.moe's cache path on CPU tensors: a fresh cache, the key without the CUDA conditions, and a
    capture that stores a :class:`_StandInGraph` running the ``capturable=True`` call."""
    import fastpath.moe as fm

    cache = GraphCache(size=4)
    monkeypatch.setattr(fm, "GRAPH_CACHE", cache)
    monkeypatch.setattr(fm, "_graph_key", lambda h, w, tw, ids, opts: fm.graph_key(h, w, tw, ids, opts, 0))

    def capture(key, hidden, weights, topk_weights, topk_ids, opts, objs):
        bufs = tuple(t.clone() for t in (hidden, topk_weights, topk_ids))
        wref = weakref.ref(weights)  # a graph holds no reference to the weights (it reads their addresses)
        g = _StandInGraph(lambda: fm._fused_moe(bufs[0], wref(), *bufs[1:], expert_map=None, capturable=True,
                                                **opts))
        g.output = g.run()
        n = weights.num_experts if opts["num_experts"] is None else opts["num_experts"]
        cache.put(key, GraphEntry(g, bufs, g.output, n), objs)

    monkeypatch.setattr(fm, "_capture", capture)
    return cache


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_cached_call_logic_copies_in_checks_and_copies_out(stand_in_cache, layout):
    from fastpath.moe import fused_moe

    x, fw, tw, ids = _layer_case(3)
    kw = dict(alignment=16, out_dtype=torch.float32, layout=layout)
    want = fused_moe(x, fw, tw, ids, graph_cache=False, **kw)
    first = fused_moe(x, fw, tw, ids, **kw)  # uncached, counted
    assert len(stand_in_cache) == 0
    second = fused_moe(x, fw, tw, ids, **kw)  # uncached, then captured
    assert len(stand_in_cache) == 1
    entry = next(iter(stand_in_cache._entries.values()))
    third = fused_moe(x, fw, tw, ids, **kw)  # replayed
    assert entry.graph.replays == 1
    assert third is not entry.output and all(torch.equal(r, want) for r in (first, second, third))
    # new inputs of the same shapes: copied into the entry's buffers, replayed
    x2, tw2 = x.flip(0), tw.flip(0)
    ids2 = ids.roll(1, dims=0)
    got = fused_moe(x2, fw, tw2, ids2, **kw)
    assert entry.graph.replays == 2
    assert torch.equal(got, fused_moe(x2, fw, tw2, ids2, graph_cache=False, **kw))
    assert not torch.equal(got, want)
    # the default call still checks the ids on the host before a replay
    bad = ids.clone()
    bad[1, 0] = 9
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, fw, tw, bad, **kw)
    assert entry.graph.replays == 2
    # a token naming one expert twice: the masked call runs uncached (its capacity comes from the counts)
    rep = ids.clone()
    rep[0] = rep[0, 0]
    got = fused_moe(x, fw, tw, rep, **kw)
    assert entry.graph.replays == (2 if layout == "masked" else 3)
    assert torch.equal(got, fused_moe(x, fw, tw, rep, graph_cache=False, **kw))


def test_cached_call_without_the_cache_and_for_other_weights(stand_in_cache):
    from fastpath.moe import fused_moe

    x, fw, tw, ids = _layer_case(4)
    kw = dict(alignment=16, out_dtype=torch.float32)
    for _ in range(3):
        fused_moe(x, fw, tw, ids, graph_cache=False, **kw)
    assert stand_in_cache.info()["misses"] == 0 and len(stand_in_cache) == 0
    for _ in range(2):
        fused_moe(x, fw, tw, ids, **kw)
    fw2 = dataclasses.replace(fw)
    for _ in range(2):
        fused_moe(x, fw2, tw, ids, **kw)
    assert len(stand_in_cache) == 2  # one entry per weights object
    del fw2
    gc.collect()
    assert len(stand_in_cache) == 1


def test_a_failed_capture_is_recorded_warned_once_and_not_retried(monkeypatch):
    """``_capture`` on tensors it cannot capture (CPU tensors: no CUDA stream) records the reason, warns, and the
    key is not captured again; the call's own result is unaffected (returned before the capture)."""
    import warnings

    import fastpath.moe as fm

    cache = GraphCache(size=4)
    monkeypatch.setattr(fm, "GRAPH_CACHE", cache)
    monkeypatch.setattr(fm.torch.cuda, "current_stream", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("no CUDA stream here")))
    x, fw, tw, ids = _layer_case(5)
    opts = _opts()
    key = fm.graph_key(x, fw, tw, ids, opts, 0)
    with pytest.warns(RuntimeWarning, match="could not capture"):
        fm._capture(key, x, fw, tw, ids, opts, (fw,))
    info = cache.info()
    assert info["entries"] == 0 and info["failures"] == ["RuntimeError: no CUDA stream here"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not any(cache.want_capture(key) for _ in range(3))
