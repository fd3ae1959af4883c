"""The decode step's launch switches of :mod:`fastpath.moe` (issue 33): the decode dispatch kernel
(``fastpath._dispatch_sort.DECODE_CAPACITY_SLOTS``), the decode reduce tile (``REDUCE_DECODE_TOKENS``), the a1
quantization branch (``fastpath._moe_layer.A1_QUANT_BRANCH``) and Programmatic Dependent Launch
(``fastpath._moe_layer.DECODE_PDL``: ``GemmTiles.pdl``, ``pdl=`` of the fused act+quant kernels, ``pdl=`` of the
reduce). None of them changes what is computed: the layer's output bits are compared with each on and off.

On the CPU (Triton's interpreter) PDL never runs (``fastpath._host.pdl_available`` is False there: the
interpreter runs no inline asm) and the reduce takes the interpreter's tile, so those tests check the plumbing:
with ``pdl_available`` forced True, which launches carry ``launch_pdl`` and ``GDC_WAIT`` (stripped before the
interpreted launch). The kernels with ``GDC_WAIT`` are compiled for sm_90a by ``bench/sass_report.py``-style
checks, and timed on a GPU by ``bench/studies/decode_graph_sweep.py --only decode_ab``.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device  # noqa: E402

DEV = device()


def _layer(seed: int, tokens: int, experts: int = 8, top_k: int = 2):
    """An FP8 layer (hidden 256, intermediate 256, ``experts`` experts) and ``tokens`` routed tokens, as torch
    arguments of ``fused_moe``."""
    from fastpath.moe import fast_weights
    from moeref.moe import make_layer, make_tokens, quantize_weights
    from moeref.quant import fp8_block

    rng = np.random.default_rng(seed)
    q = quantize_weights(make_layer(experts, 256, 256, seed=seed), fp8_block())
    x = make_tokens(tokens, 256, seed=seed + 1)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    tw = rng.random((tokens, top_k)).astype(np.float32)
    return (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fast_weights(q, DEV), torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))


def _run(args, layout="masked"):
    from fastpath.moe import fused_moe

    return fused_moe(*args, layout=layout, alignment=16, capturable=True, graph_cache=False)


@pytest.fixture
def launches(monkeypatch):
    """``(kernel name, launch_pdl, GDC_WAIT)`` of every launch of the dispatch, the reduce, the grouped GEMM and
    the planned quantize / fused launches, in order; ``launch_pdl`` and ``GDC_WAIT`` are taken out before the
    launch (the interpreter runs no ``griddepcontrol``); ``pdl_available`` forced True where the layer's stages
    read it."""
    import fastpath._dispatch_sort as ds
    import fastpath._host as host
    import fastpath.grouped_gemm as gg

    seen = []

    def spy(orig):
        def call(kernel, grid, *a, **kw):
            name = getattr(kernel, "fn", kernel).__name__
            seen.append((name, kw.pop("launch_pdl", False), kw.pop("GDC_WAIT", False)))
            return orig(kernel, grid, *a, **kw)
        return call

    monkeypatch.setattr(host, "LAUNCH_CACHE_ON", False)  # a GPU too: every launch through these, once each
    monkeypatch.setattr(ds, "launch", spy(ds.launch))
    monkeypatch.setattr(gg, "launch", spy(gg.launch))
    monkeypatch.setattr(host, "launch_for_replay", spy(host.launch_for_replay))
    monkeypatch.setattr(host, "pdl_available", lambda dev: True)  # what fastpath._host.pdl_launch asks
    return seen


def _marked(seen) -> dict:
    """Stage -> [launch_pdl and GDC_WAIT of each of its launches] (the layer's kernels by name and order)."""
    out: dict = {}
    gemms = 0
    for name, pdl, wait in seen:
        assert pdl == wait, (name, pdl, wait)  # the kernel waits exactly when it is launched with PDL
        if name == "_grouped_gemm_kernel":
            gemms += 1
            stage = f"gemm{gemms}"
        elif name == "_quant_kernel":
            stage = "a1 quant" if gemms == 0 else "act"
        elif name == "_reduce_kernel":
            stage = "reduce"
        else:
            stage = "dispatch"
        out.setdefault(stage, []).append(pdl)
    return out


@pytest.mark.parametrize("stages", [("gemm1", "act", "gemm2", "reduce"), ("reduce",), ("act", "gemm2")])
def test_decode_pdl_marks_exactly_the_named_stages_and_keeps_the_bits(monkeypatch, launches, stages):
    """1 token of top-2 over 8 experts (masked, capturable): with ``DECODE_PDL`` naming ``stages`` (and PDL
    forced available) those stages' launches, and only they, carry ``launch_pdl`` and ``GDC_WAIT``; the a1
    quantization and the dispatch never do; the output bits are those of the layer without PDL."""
    import fastpath._moe_layer as ml

    args = _layer(3, 1)
    monkeypatch.setattr(ml, "DECODE_PDL", ())  # the layer without PDL (the default names all four stages)
    want = _run(args)
    assert _marked(launches).keys() >= {"a1 quant", "dispatch", "gemm1", "act", "gemm2", "reduce"}
    assert not any(p for _, p, _ in launches)
    launches.clear()
    monkeypatch.setattr(ml, "DECODE_PDL", stages)
    got = _run(args)
    marked = _marked(launches)
    for stage, flags in marked.items():
        assert flags == [stage in stages] * len(flags), (stage, flags)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and want.abs().max() > 0


def test_decode_pdl_only_at_decode_sizes(monkeypatch, launches):
    """More than ``DECODE_ROWS_PER_EXPERT`` rows per expert on average (72 tokens of top-2 over 8 experts: 18):
    no launch carries PDL whatever ``DECODE_PDL`` names."""
    import fastpath._moe_layer as ml
    from fastpath.grouped_gemm import DECODE_ROWS_PER_EXPERT

    assert 72 * 2 // 8 > DECODE_ROWS_PER_EXPERT
    monkeypatch.setattr(ml, "DECODE_PDL", ("gemm1", "act", "gemm2", "reduce"))
    _run(_layer(5, 72))
    assert launches and not any(p or w for _, p, w in launches)


def test_decode_pdl_refuses_an_unknown_stage(monkeypatch):
    import fastpath._moe_layer as ml

    monkeypatch.setattr(ml, "DECODE_PDL", ("gemm1", "finalize"))
    with pytest.raises(ValueError, match=r"DECODE_PDL names stages \['finalize'\]"):
        _run(_layer(3, 1))


@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_decode_dispatch_and_switches_keep_the_layer_bits(monkeypatch, tokens):
    """The layer (masked, capturable, 1/4/8 tokens of top-8 over 16 experts: 8 to 64 slots, the 4 and 8 token
    layouts over a 16-row capacity) with the decode dispatch kernel and the decode reduce tile (the defaults)
    against the three dispatch launches and the wide reduce tile, and with the a1 quantization in line: the same
    output bits. (The a1 branch exists only in a CUDA graph capture, and the interpreter takes its own reduce
    tile: on the CPU the dispatch is the switch that changes the launches.)"""
    import fastpath._dispatch_sort as ds
    import fastpath._moe_layer as ml

    args = _layer(7 + tokens, tokens, experts=16, top_k=8)
    got = _run(args)
    monkeypatch.setattr(ds, "DECODE_CAPACITY_SLOTS", 0)
    monkeypatch.setattr(ds, "REDUCE_DECODE_TOKENS", 0)
    want = _run(args)
    monkeypatch.setattr(ml, "A1_QUANT_BRANCH", False)
    inline = _run(args)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and want.abs().max() > 0
    assert torch.equal(inline.view(torch.int16), want.view(torch.int16))


def test_reduce_decode_tile_is_taken_up_to_its_token_count(monkeypatch):
    """``_row_config`` off the interpreter: the reduce of at most ``REDUCE_DECODE_TOKENS`` rows takes
    ``ROW_CONFIG["reduce_decode"]`` (1 KB of a row per program: 512 bf16 columns, 14 programs a token at 7168),
    more rows and the other row kernels the 8 KB tile."""
    import fastpath._dispatch_sort as ds

    monkeypatch.setattr(ds, "_interpreting", lambda: False)
    assert ds.REDUCE_DECODE_TOKENS == 16
    assert ds._row_config("reduce", 7168, 2, 1) == (1, 512, 2)
    assert ds._row_config("reduce", 7168, 2, 16) == (1, 512, 2)
    assert ds._row_config("reduce", 7168, 2, 17) == (1, 4096, 8)
    assert ds._row_config("reduce", 7168, 4, 1) == (1, 256, 2)  # float32 rows: 1 KB is 256 columns
    assert ds._row_config("scatter", 7168, 2, 1) == (1, 4096, 8)
    monkeypatch.setattr(ds, "REDUCE_DECODE_TOKENS", 0)
    assert ds._row_config("reduce", 7168, 2, 1) == (1, 4096, 8)


def test_pdl_options_are_checked():
    import fastpath.fused as F
    from fastpath.grouped_gemm import GemmTiles
    from moeref.quant import fp8_per_tensor

    assert GemmTiles(16, 128, 128, 4, 3, swap_ab=True, pdl=True).pdl
    with pytest.raises(TypeError, match="GemmTiles.pdl must be a bool"):
        GemmTiles(pdl=1)
    with pytest.raises(ValueError, match="pdl is an option of the one-tile-per-program kernel"):
        GemmTiles(64, 128, 128, 4, 4, tma=True, pdl=True)
    h = torch.zeros((4, 256), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(TypeError, match="pdl must be a bool"):
        F.silu_and_mul_quant_fp8(h, pdl="yes")
    with pytest.raises(ValueError, match="pdl applies to per-token and 1xG schemes"):
        F.silu_and_mul_quant_fp8(h, fp8_per_tensor(), pdl=True)
    # where PDL does not run (the interpreter, a GPU before sm_90) pdl=True launches as without it
    a = F.silu_and_mul_quant_fp8(h + 1, hw_fp8=False, pdl=True)
    b = F.silu_and_mul_quant_fp8(h + 1, hw_fp8=False)
    if DEV == "cpu":
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_decode_switches_in_a_cuda_graph_give_the_same_bits(monkeypatch, tokens):
    """On a GPU, in a CUDA graph (the a1 quantization on its branch, PDL launched for real where the device has it):
    the layer with every stage launched with PDL, with the a1 quantization in line, and with the three dispatch
    launches and the wide reduce tile, each captured and replayed on new routing ids and weights written into the
    captured inputs: the output bits of the eager layer without PDL on the new inputs."""
    import fastpath._dispatch_sort as ds
    import fastpath._moe_layer as ml
    from bench.latency_cases import capture

    x, fw, tw, ids = _layer(31 + tokens, tokens, experts=16, top_k=8)
    _, _, tw2, ids2 = _layer(47 + tokens, tokens, experts=16, top_k=8)
    with monkeypatch.context() as mp:
        mp.setattr(ml, "DECODE_PDL", ())  # the default names all four stages
        want = _run((x, fw, tw2, ids2)).clone()
    cases = {"pdl": dict(DECODE_PDL=("gemm1", "act", "gemm2", "reduce")),
             "pdl, a1 in line": dict(DECODE_PDL=("gemm1", "act", "gemm2", "reduce"), A1_QUANT_BRANCH=False),
             "three launches, wide reduce": dict(DECODE_CAPACITY_SLOTS=0, REDUCE_DECODE_TOKENS=0)}
    for name, kv in cases.items():
        with monkeypatch.context() as mp:
            for k, v in kv.items():
                mp.setattr(ds if hasattr(ds, k) else ml, k, v)
            ids_in, tw_in = ids.clone(), tw.clone()
            g, out = capture(lambda: _run((x, fw, tw_in, ids_in)))
            ids_in.copy_(ids2)
            tw_in.copy_(tw2)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), name
