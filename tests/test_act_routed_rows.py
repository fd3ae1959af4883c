"""The act+quant launch over the routed rows only (issue 33): at decode sizes the MoE layer gives the fused
act+quant kernel the slot -> row map (``rows=``, :data:`fastpath._moe_layer.ACT_ROUTED_ROWS_AT_DECODE`) instead
of the layout's row labels (``skip_rows=``), so its grid covers ``m * top_k`` rows instead of the layout's
(4096 at 1 token of a 256-expert masked layout). Each listed row gets the whole-x launch's codes and scales.

Small cases under Triton's interpreter on the CPU (and on a GPU): the kernel with ``rows`` against the launch
over all rows, on the listed rows; the layer's output with the option on and off, bit for bit (masked and
contiguous layouts, 1-8 tokens, SiLU, erf/tanh GELU, SwiGLU-OAI, an expert map); and that the option sends
``rows`` at decode sizes only. GPU only: the DeepSeek-V3-sized layer in a CUDA graph.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device  # noqa: E402

DEV = device()
ACTS = [("silu_and_mul", {}), ("gelu_and_mul", {}), ("gelu_and_mul", {"approximate": "tanh"}),
        ("swigluoai", {"alpha": 1.5, "limit": 5.0})]
FUSED = {"silu_and_mul": "silu_and_mul_quant_fp8", "gelu_and_mul": "gelu_and_mul_quant_fp8",
         "swigluoai": "swigluoai_quant_fp8"}


def _act_args(act: str, params: dict) -> tuple:
    return (params.get("approximate", "none"),) if act == "gelu_and_mul" else \
        ((params["alpha"], params["limit"]) if act == "swigluoai" else ())


def _gated(rows: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """``h [rows, 2k]`` with planted rows: 0 an Inf gate, 1 large values, 2 tiny values and one huge one, 3 zeros."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn((rows, 2 * k), generator=g) * 3
    h[0, 5] = float("inf")
    h[1, :] = 1e15 * torch.sign(torch.randn(2 * k, generator=g))
    h[2, :] = 1e-3 * torch.randn(2 * k, generator=g)
    h[2, 7], h[2, 7 + k] = 3e4, 2e4
    h[3, :] = 0.0
    return h.to(dtype).to(DEV)


MARK = 0x5A


@pytest.fixture
def marked(monkeypatch):
    """fastpath.fused's allocations filled with the byte 0x5A (codes 0x5A, scales 0x5A5A5A5A), so a row the kernel
    does not write keeps the marker."""
    import fastpath.fused as F

    orig = F._alloc

    def alloc(*a, **kw):
        t = orig(*a, **kw)
        t.view(torch.uint8).fill_(MARK)
        return t

    monkeypatch.setattr(F, "_alloc", alloc)


@pytest.mark.parametrize("act,params", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_give_the_whole_launchs_bits_on_the_listed_rows(marked, act, params, dtype):
    """64 rows of ``h [64, 2*384]`` (three 1x128 groups), 11 entries (the planted rows, -1 entries, the last row,
    rows in the first and the last tile of entries): each listed row's codes and scales are the launch over all
    64 rows' bits; the rows not listed are not written."""
    import fastpath.fused as F

    h = _gated(64, 384, 3, dtype)
    fn = getattr(F, FUSED[act])
    full = fn(h, *_act_args(act, params), hw_fp8=False)
    rows = torch.tensor([0, -1, 63, 1, 2, 3, 40, -1, 17, 9, 30], dtype=torch.int32, device=DEV)
    got = fn(h, *_act_args(act, params), hw_fp8=False, rows=rows)
    r = rows[rows >= 0].long()
    assert got.codes.shape == full.codes.shape and got.scales.shape == full.scales.shape
    assert torch.equal(got.codes[r], full.codes[r])
    assert torch.equal(got.scales[r].view(torch.int32), full.scales[r].view(torch.int32))
    assert bool((full.scales[r] > 0).any()) and not bool((full.codes[r] == MARK).all())
    rest = torch.ones(64, dtype=torch.bool, device=DEV)
    rest[r] = False
    assert bool((got.codes[rest] == MARK).all()) and bool((got.scales[rest].view(torch.uint8) == MARK).all())


def test_rows_with_no_row_listed_write_nothing(marked):
    """Entries all < 0 (every slot routed to another rank's experts): nothing is written."""
    import fastpath.fused as F

    h = _gated(16, 128, 4)
    got = F.silu_and_mul_quant_fp8(h, hw_fp8=False, rows=torch.full((8,), -1, dtype=torch.int32, device=DEV))
    assert tuple(got.codes.shape) == (16, 128) and tuple(got.scales.shape) == (16, 1)
    assert bool((got.codes == MARK).all()) and bool((got.scales.view(torch.uint8) == MARK).all())


def test_rows_refuse_what_they_cannot_run():
    import fastpath.fused as F
    from moeref.quant import fp8_per_tensor

    h = _gated(16, 128, 5)
    r = torch.zeros(4, dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="rows"):
        F.silu_and_mul_quant_fp8(h, rows=r.float())
    with pytest.raises(TypeError, match="rows"):
        F.silu_and_mul_quant_fp8(h, rows=r.reshape(2, 2))
    with pytest.raises(ValueError, match="not both"):
        F.silu_and_mul_quant_fp8(h, rows=r, skip_rows=torch.zeros(16, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="row-major"):
        F.silu_and_mul_quant_fp8(h, rows=r, scale_layout="mn_major")
    with pytest.raises(ValueError, match="2-D"):
        F.silu_and_mul_quant_fp8(h.reshape(2, 8, 256), rows=r)
    with pytest.raises(ValueError, match="per-tensor"):
        F.silu_and_mul_quant_fp8(h, fp8_per_tensor(), rows=r)
    with pytest.raises(ValueError, match="at least one"):
        F.silu_and_mul_quant_fp8(h, rows=r[:0])


def _layer(seed: int, tokens: int, act: str, experts: int = 8, top_k: int = 2, local=None):
    """An FP8 layer (hidden 256, intermediate 256, ``experts`` experts; of them the experts ``local`` only, if
    given) and ``tokens`` routed tokens."""
    from fastpath.moe import fast_weights
    from moeref.activations import convert_w13
    from moeref.moe import MoEWeights, make_layer, make_tokens, quantize_weights
    from moeref.quant import fp8_block

    rng = np.random.default_rng(seed)
    lw = make_layer(experts, 256, 256, seed=seed)
    if act == "swigluoai":
        lw = MoEWeights([convert_w13(w, "gate_up", "interleaved") for w in lw.w13], lw.w2, "interleaved")
    q = quantize_weights(lw if local is None else lw.select(local), fp8_block())
    x = make_tokens(tokens, 256, seed=seed + 1)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    tw = rng.random((tokens, top_k)).astype(np.float32)
    return fast_weights(q, DEV), x, tw, ids


@pytest.fixture
def act_calls(monkeypatch):
    """The ``rows`` / ``skip_rows`` keyword of every fused act+quant call the layer makes, in order."""
    import fastpath.fused as F

    seen = []
    for name in FUSED.values():
        orig = getattr(F, name)

        def spy(*a, _orig=orig, **kw):
            seen.append("rows" if kw.get("rows") is not None else "skip_rows" if kw.get("skip_rows") is not None
                        else "none")
            return _orig(*a, **kw)

        monkeypatch.setattr(F, name, spy)
    return seen


def _both(monkeypatch, act_calls, args, **kw):
    """The layer with ACT_ROUTED_ROWS_AT_DECODE off, then on; the launch form of each."""
    import fastpath._moe_layer as ml
    from fastpath.moe import fused_moe

    outs, forms = [], []
    for flag in (False, True):
        monkeypatch.setattr(ml, "ACT_ROUTED_ROWS_AT_DECODE", flag)
        act_calls.clear()
        outs.append(fused_moe(*args, graph_cache=False, **kw))
        forms.append(list(act_calls))
    return outs, forms


@pytest.mark.parametrize("layout,act,params,tokens,capturable", [
    ("masked", "silu_and_mul", {}, 1, True), ("masked", "silu_and_mul", {}, 8, False),
    ("contiguous", "silu_and_mul", {}, 1, True), ("contiguous", "gelu_and_mul", {}, 8, True),
    ("masked", "gelu_and_mul", {"approximate": "tanh"}, 4, True), ("contiguous", "gelu_and_mul", {}, 2, False),
    ("masked", "swigluoai", {"alpha": 1.5, "limit": 5.0}, 8, True),
    ("contiguous", "swigluoai", {"alpha": 1.5, "limit": 5.0}, 3, True)])
def test_layer_with_routed_rows_gives_the_same_bits(monkeypatch, act_calls, layout, act, params, tokens, capturable):
    """``fused_moe`` with the act+quant launch over the routed rows and over the layout's tiles: the same output
    bits (bf16 bit patterns), a nonzero output, and the routed-rows form is the one launched when on."""
    fw, x, tw, ids = _layer(11, tokens, act)
    args = (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fw, torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    (off, on), forms = _both(monkeypatch, act_calls, args, layout=layout, alignment=16, capturable=capturable,
                             activation=act, activation_params=params)
    assert forms == [["skip_rows"], ["rows"]]
    assert torch.equal(off.view(torch.int16), on.view(torch.int16)) and off.abs().max() > 0


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_layer_with_routed_rows_and_an_expert_map_gives_the_same_bits(monkeypatch, act_calls, layout):
    """An expert map (global experts 0..7, this rank holds 1, 4, 6 as local 0..2; slots routed elsewhere have no
    row: ``-1`` in the slot -> row map, skipped by the kernel): the same bits on and off, 5 tokens of top-3."""
    fw, x, tw, ids = _layer(23, 5, "silu_and_mul", top_k=3, local=[1, 4, 6])
    emap = np.full(8, -1, dtype=np.int32)
    emap[[1, 4, 6]] = [0, 1, 2]
    args = (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fw, torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    (off, on), forms = _both(monkeypatch, act_calls, args, layout=layout, alignment=16, capturable=False,
                             expert_map=emap, num_experts=8)
    assert forms == [["skip_rows"], ["rows"]]
    assert torch.equal(off.view(torch.int16), on.view(torch.int16)) and off.abs().max() > 0


@pytest.mark.parametrize("tile", [dict(block_m=1, groups_per_program=1, num_warps=1),
                                  dict(block_m=2, groups_per_program=2, num_warps=2)])
def test_layer_with_routed_rows_on_another_tile_gives_the_same_bits(monkeypatch, act_calls, tile):
    """``ACT_ROUTED_ROWS_TILE`` (smaller programs over the routed rows): the same bits, 3 tokens of top-2, masked
    (2 groups of 128 per row: 1 or 2 groups a program)."""
    import fastpath._moe_layer as ml

    monkeypatch.setattr(ml, "ACT_ROUTED_ROWS_TILE", tile)
    fw, x, tw, ids = _layer(29, 3, "silu_and_mul")
    args = (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fw, torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    (off, on), forms = _both(monkeypatch, act_calls, args, layout="masked", capturable=True)
    assert forms == [["skip_rows"], ["rows"]]
    assert torch.equal(off.view(torch.int16), on.view(torch.int16)) and off.abs().max() > 0


def test_routed_rows_are_for_decode_sizes_only(monkeypatch, act_calls):
    """48 tokens of top-4 over 8 experts (24 rows per expert on average, above ``DECODE_ROWS_PER_EXPERT``): the
    layout's tiles are launched with the option on, the same bits."""
    fw, x, tw, ids = _layer(17, 48, "silu_and_mul", top_k=4)
    args = (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fw, torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    (off, on), forms = _both(monkeypatch, act_calls, args, layout="masked", capturable=True)
    assert forms == [["skip_rows"], ["skip_rows"]]
    assert torch.equal(off.view(torch.int16), on.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("act,params", [ACTS[0], ACTS[2], ACTS[3]])
def test_gpu_layer_with_routed_rows_gives_the_same_bits(monkeypatch, layout, act, params):
    """The DeepSeek-V3-sized FP8 layer (top-8 of 256 experts, random routing) at 1, 4 and 8 tokens,
    ``capturable=True``: the output with the routed-rows launch equals the tiles launch's bit for bit, eager and
    replayed from a CUDA graph. (The experts' codes are read as interleaved w13 for SwiGLU-OAI.)"""
    import fastpath._moe_layer as ml
    from fastpath.moe import FastMoEWeights, fused_moe

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, n, e = 7168, 2048, 256

    def experts(rows, cols):
        codes = torch.randint(0, 256, (e, rows, cols), dtype=torch.uint8, device="cuda", generator=gen)
        codes[(codes & 0x7F) == 0x7F] -= 1
        s = 1e-4 * (1.0 + torch.rand((e, -(-rows // 128), -(-cols // 128)), device="cuda", generator=gen))
        return codes.view(torch.float8_e4m3fn), s.float()

    w13, s13 = experts(2 * n, h)
    w2, s2 = experts(h, n)
    fw = FastMoEWeights(w13, w2, "interleaved" if act == "swigluoai" else "gate_up", s13, s2)
    for m in (1, 4, 8):
        x = torch.randn((m, h), device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand((m, e), device="cuda", generator=gen).topk(8, dim=1).indices.to(torch.int32)
        tw = torch.rand((m, 8), device="cuda", generator=gen)
        kw = dict(impl="triton", layout=layout, capturable=True, graph_cache=False, activation=act,
                  activation_params=params)
        monkeypatch.setattr(ml, "ACT_ROUTED_ROWS_AT_DECODE", False)
        want = fused_moe(x, fw, tw, ids, **kw)
        monkeypatch.setattr(ml, "ACT_ROUTED_ROWS_AT_DECODE", True)
        got = fused_moe(x, fw, tw, ids, **kw)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, layout, act)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused_moe(x, fw, tw, ids, **kw)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out = fused_moe(x, fw, tw, ids, **kw)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (m, layout, act, "graph")

