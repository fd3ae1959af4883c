"""The Gluon FP8 grouped GEMM (``GemmTiles(kernel="gluon")``, :mod:`fastpath._grouped_gemm_gluon`, issue 33).

CPU: the options and the operands it refuses, and the kernel compiled for sm_90a with Triton's ptxas (Gluon has no
interpreter, so nothing runs), the default tiles (TMA store epilogue) and the 128 x 192 tiles: warp-specialized, TMA
loads, the wgmma count of two math warpgroups, where the MMAs wait, one fused multiply-add per output and K block
and one FP32 multiply per row (DeepGEMM's promotion ``fma(part, fl(sa * sb), acc)``, the Triton kernel's too). GPU
(Hopper): the bits of :data:`fastpath.grouped_gemm.DEFAULT_TILES` ``["fp8_block"]`` on every routed row for each
Gluon candidate, with N not a multiple of the tile, experts with no rows, a bias, K = 7168 and 2048.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import on_gpu  # noqa: E402

GLUON = "128x128 w4 s6 g8 gluon tmastore"  # the default's candidate in FP8_PREFILL_CANDIDATES
GLUON_192 = "128x192 w4 s4 g8 gluon"
ROOT = os.path.join(os.path.dirname(__file__), "..")


def _fp8(*shape):
    return torch.zeros(shape, dtype=torch.float8_e4m3fn)


def test_gluon_options_are_checked():
    """``kernel`` is one of :data:`~fastpath.grouped_gemm.KERNELS`; the Gluon kernel takes 128 x 128 or 128 x 192
    tiles with 4 warps a math warpgroup and at least two stages, and none of the Triton tile-loop options (its design
    has them); ``epilogue="tma"`` is an option of its 128 x 128 tiles only."""
    from fastpath.grouped_gemm import DEFAULT_TILES, FP8_PREFILL_CANDIDATES, KERNELS, GemmTiles

    assert KERNELS == ("triton", "gluon")
    t = FP8_PREFILL_CANDIDATES[GLUON]
    assert (t.kernel, t.block_m, t.block_n, t.num_warps, t.num_stages, t.group_m, t.epilogue) == \
        ("gluon", 128, 128, 4, 6, 8, "tma")
    assert GemmTiles(128, 192, 128, 4, 4, kernel="gluon").epilogue == "store"
    assert DEFAULT_TILES["fp8_block_contiguous_gluon"] == t
    assert not t.tile_loop  # the Gluon launcher, not the Triton tile-loop kernel
    with pytest.raises(ValueError, match="kernel must be one of"):
        GemmTiles(kernel="cuda")
    for shape in ((64, 128, 128, 4), (128, 128, 128, 8), (128, 256, 128, 4), (128, 64, 128, 4)):
        with pytest.raises(ValueError, match="128 x 192 tiles"):
            GemmTiles(*shape, 4, kernel="gluon")
    for kw in ({"epilogue": "smem", "kernel": "gluon"}, {"epilogue": "tma"}, {"epilogue": "tma", "tma": True}):
        with pytest.raises(ValueError, match="epilogue"):
            GemmTiles(128, 128, 128, 4, 4, **kw)
    with pytest.raises(ValueError, match="block_n 128"):
        GemmTiles(128, 192, 128, 4, 4, kernel="gluon", epilogue="tma")
    for kw in ({"tma": True}, {"persistent": True}, {"promotion": "lagged_pair"}, {"swap_ab": True}):
        with pytest.raises(ValueError, match="not taken with it"):
            GemmTiles(128, 128, 128, 4, 4, kernel="gluon", **kw)
    with pytest.raises(ValueError, match="num_stages >= 2"):
        GemmTiles(128, 128, 128, 4, 1, kernel="gluon")


def test_gluon_refuses_what_it_does_not_run():
    """Float operands, the masked layout, token rows through ``a_src``, an alignment its 128-row tiles do not
    divide, and (here) a machine without a Hopper GPU: each a ``ValueError`` naming what was given."""
    from fastpath.grouped_gemm import FP8_PREFILL_CANDIDATES, grouped_gemm_contiguous, grouped_gemm_masked

    t = FP8_PREFILL_CANDIDATES[GLUON]
    dev = "cuda" if on_gpu() else "cpu"
    a, b = _fp8(256, 256).to(dev), _fp8(2, 128, 256).to(dev)
    sa, sb = torch.ones(256, 2, device=dev), torch.ones(2, 1, 2, device=dev)
    m_idx = torch.zeros(256, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="float32 operands"):
        grouped_gemm_contiguous(a.float(), b.float(), m_idx, impl="triton", tiles=t)
    with pytest.raises(ValueError, match="a_src"):
        grouped_gemm_contiguous(a, b, m_idx, impl="triton", a_scales=sa, b_scales=sb, tiles=t,
                                a_src=torch.arange(256, device=dev), top_k=1)
    with pytest.raises(ValueError, match="masked layout"):
        grouped_gemm_masked(a.reshape(2, 128, 256), b, torch.tensor([3, 5], dtype=torch.int32, device=dev),
                            impl="triton", a_scales=sa.reshape(2, 128, 2), b_scales=sb, tiles=t)
    with pytest.raises(ValueError, match="alignment 64"):
        grouped_gemm_contiguous(a, b, m_idx, impl="triton", a_scales=sa, b_scales=sb, tiles=t, alignment=64)
    if not on_gpu():
        with pytest.raises(ValueError, match="no interpreter"):
            grouped_gemm_contiguous(a, b, m_idx, impl="triton", a_scales=sa, b_scales=sb, tiles=t)


def test_gluon_kernel_compiles_for_hopper(tmp_path):
    """The default tiles' kernel and the 128 x 192 tiles' compile for sm_90a without a GPU
    (bench/studies/triton_fp8_prefill_compile.py in a process of its own) at GEMM2's shape (K = 2048: 16 K blocks),
    warp-specialized with TMA loads, no spills, the math warpgroups given 232 registers. The default: K blocks in
    chunks of ``K_UNROLL``, in the code 2 math warpgroups x ``K_UNROLL`` blocks x 4 wgmma (``m64n128k32``); per
    warpgroup and chunk, a wait that leaves one MMA in flight after each MMA but the last (block k + 1's MMA runs
    while block k is promoted) and one full wait; DeepGEMM's promotion: one FFMA per output and K block, one FMUL
    (``sa * sb``) per row of a thread (2: rows r and r + 8 of an ``m64`` MMA's warp) and K block; a TMA store; shared
    memory for 6 stages of 32 KiB and the 32 KiB of bf16 outputs. 128 x 192: per warpgroup and K block (a loop not
    unrolled) 4 ``m64n128k32`` and 4 ``m64n64k32`` wgmma and one full wait; 96 outputs a thread, one FFMA each, and
    one FMUL per row and product (2 x 2); shared memory for 4 stages of 40 KiB."""
    from fastpath._grouped_gemm_gluon import K_UNROLL

    assert 16 % K_UNROLL == 0  # the counts below: chunks without a tail at K = 2048
    out = tmp_path / "c.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "bench/studies/triton_fp8_prefill_compile.py", "--gemms", "gemm2",
                          "--configs", GLUON, GLUON_192, "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())
    for name in (GLUON, GLUON_192):
        r = res[name]["gemm2"]
        assert r["kernel"] == "_gluon_fp8_grouped_gemm_kernel"
        assert r["warp_specialized"] and r["tma_loads"]
        assert r["stack_bytes"] == 0
        assert 232 in r["math_registers"]
    r = res[GLUON]["gemm2"]
    assert r["wgmma"] == 2 * K_UNROLL * 4
    assert {int(n): c for n, c in r["mma_waits"].items()} == {1: 2 * (K_UNROLL - 1), 0: 2}
    assert r["ffma"] == 2 * K_UNROLL * 64  # 64 outputs a thread (64 x 128 of a warpgroup, 128 threads)
    assert r["fmul"] == 2 * K_UNROLL * 2  # fl(sa * sb) of a thread's 2 rows
    assert r["tma_stores"]
    assert r["shared_bytes"] >= 6 * (128 + 128) * 128 + 128 * 128 * 2
    r = res[GLUON_192]["gemm2"]
    assert r["wgmma"] == 2 * (4 + 4)
    assert {int(n): c for n, c in r["mma_waits"].items()} == {0: 2}
    assert r["ffma"] == 2 * 96
    assert r["fmul"] == 2 * 2 * 2
    assert not r["tma_stores"]
    assert r["shared_bytes"] >= 4 * (128 + 192) * 128


def _operands(k: int, n: int, seed: int, live: int):
    """Random E4M3 codes over the whole finite range, FP32 scales and a bias; a top-4 routing of 61 tokens over
    the first ``live`` of 16 experts (the others get no rows) in the 128-row contiguous layout."""
    from fastpath import dispatch

    g = torch.Generator(device="cuda").manual_seed(seed)
    e, tokens, top_k = 16, 61, 4
    ids = torch.stack([torch.randperm(live, device="cuda", generator=g)[:top_k] for _ in range(tokens)])
    lay = dispatch.to_contiguous(None, ids.to(torch.int32), e, 128)

    def codes(*shape):
        c = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
        c[(c & 0x7F) == 0x7F] -= 1  # no NaN codes
        return c.view(torch.float8_e4m3fn)

    rows, kb = int(lay.m_indices.numel()), -(-k // 128)
    b, sb = codes(e, n, k), torch.rand((e, -(-n // 128), kb), device="cuda", generator=g) * 1e-3
    a, sa = codes(rows, k), torch.rand((rows, kb), device="cuda", generator=g) * 1e-3
    bias = torch.randn((e, n), device="cuda", generator=g)
    return lay, a, sa, b, sb, bias


@pytest.mark.gpu
@pytest.mark.parametrize("name", [GLUON, "128x128 w4 s6 g8 gluon", GLUON_192])
@pytest.mark.parametrize("k, n, live", [(7168, 512, 16), (2048, 384, 16), (2048, 320, 12), (7168, 448, 11)])
def test_gpu_gluon_gives_the_default_bits(name, k, n, live):
    """The Gluon kernel's outputs (TMA and register epilogues, 128 x 192 tiles) equal the Triton default tiles' bit
    for bit on every routed row (N = 320, 448: a partial last column tile, 192-column tiles that start inside a
    weight-scale block; ``live`` < 16: experts with no rows), without and with a bias."""
    if not on_gpu() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU: Gluon kernels have no interpreter (the CPU test compiles it)")
    from fastpath.grouped_gemm import DEFAULT_TILES, FP8_PREFILL_CANDIDATES, grouped_gemm_contiguous

    lay, a, sa, b, sb, bias = _operands(k, n, k + n, live)
    valid = lay.m_indices >= 0
    counts = torch.bincount(lay.m_indices[valid].long(), minlength=16)
    assert (counts[live:] == 0).all() and (counts[:live] > 0).all()
    for bias_or_none in (None, bias):
        kw = dict(impl="triton", a_scales=sa, b_scales=sb, bias=bias_or_none)
        want = grouped_gemm_contiguous(a, b, lay.m_indices, tiles=DEFAULT_TILES["fp8_block"], **kw)
        assert torch.isfinite(want[valid].float()).all() and want[valid].float().abs().max() > 0
        got = grouped_gemm_contiguous(a, b, lay.m_indices, tiles=FP8_PREFILL_CANDIDATES[name], **kw)
        assert torch.equal(got[valid], want[valid]), (name, k, n, live, bias_or_none is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("given_tiles", [False, True], ids=["default tiles", "Gluon tiles given"])
def test_gpu_layer_gemm1_on_gluon_gives_the_gather_bits(monkeypatch, given_tiles):
    """``fastpath.moe.fused_moe`` at a prefill size (FP8, 16 experts, hidden 512, intermediate 256, 1024 tokens of
    top-4: 256 rows an expert on average): with :data:`fastpath._moe_layer.GEMM1_SCATTER_FOR_GLUON` GEMM1 runs the
    Gluon kernel on scattered layout rows (no ``a_src``), without it the TMA tiles on the token rows through
    ``a_src``; the outputs are the same bits and not all zero. Gluon tiles given to ``fused_moe`` for GEMM1 run
    (Gluon loads A by TMA, which has no gather: the rows are scattered for it)."""
    if not on_gpu() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU: Gluon kernels have no interpreter (the CPU test compiles it)")
    import fastpath._moe_layer as ml
    from fastpath.grouped_gemm import DEFAULT_TILES
    from fastpath.moe import fast_weights, fused_moe
    from moeref.moe import make_layer, make_tokens, quantize_weights
    from moeref.quant import fp8_block

    rng = np.random.default_rng(5)
    e, tokens, top_k = 16, 1024, 4
    fw = fast_weights(quantize_weights(make_layer(e, 512, 256, seed=5), fp8_block()), "cuda")
    x = torch.as_tensor(make_tokens(tokens, 512, seed=6)).to(torch.bfloat16).cuda()
    ids = torch.as_tensor(np.stack([rng.choice(e, top_k, replace=False) for _ in range(tokens)]).astype(np.int32),
                          device="cuda")
    tw = torch.as_tensor(rng.random((tokens, top_k)).astype(np.float32), device="cuda")
    calls = []
    real = ml.grouped_gemm_contiguous

    def spy(*args, **kw):
        calls.append((kw["tiles"].kernel, kw.get("a_src") is not None))
        return real(*args, **kw)

    monkeypatch.setattr(ml, "grouped_gemm_contiguous", spy)
    tiles = (DEFAULT_TILES["fp8_block_contiguous_gluon"], None) if given_tiles else None
    outs = []
    for flag in (False, True):
        monkeypatch.setattr(ml, "GEMM1_SCATTER_FOR_GLUON", flag)
        calls.clear()
        if flag or not given_tiles:
            outs.append(fused_moe(x, fw, tw, ids, impl="triton", graph_cache=False, tiles=tiles))
            assert calls[0] == (("gluon", False) if flag else ("triton", True)), calls
            assert calls[1] == ("gluon", False), calls  # GEMM2: layout rows on the Gluon kernel
        else:  # Gluon tiles on gathered rows: refused, naming a_src
            with pytest.raises(ValueError, match="a_src"):
                fused_moe(x, fw, tw, ids, impl="triton", graph_cache=False, tiles=tiles)
    if not given_tiles:
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)) and outs[1].abs().max() > 0
    else:  # against the TMA tiles on gathered rows
        monkeypatch.setattr(ml, "GEMM1_SCATTER_FOR_GLUON", False)
        want = fused_moe(x, fw, tw, ids, impl="triton", graph_cache=False)
        assert calls[-2] == ("triton", True), calls
        assert torch.equal(outs[0].view(torch.int16), want.view(torch.int16)) and want.abs().max() > 0
