"""The tile-loop variant of the Triton grouped GEMM (``GemmTiles`` with ``group_m``, ``persistent``, ``tma``,
``warp_specialize``, ``flatten``; :mod:`fastpath._grouped_gemm_tiles`, issue 33): the bits of the
one-tile-per-program kernel on every routed row.

CPU (Triton's interpreter): every option, FP8 and float32 operands, token rows read through ``a_src``, bias,
K not a multiple of 128, N not a multiple of the tile, padding-only row tiles. The operands are small
integers, so each 128-column block's dot is exact in FP32 whatever the order of its additions: the
comparison checks the tiling, the tile order and loop bounds, the descriptor loads and the scale indexing,
not the hardware's accumulation (the interpreter's dot is NumPy's). There ``warp_specialize`` and
``flatten`` are accepted and ignored, and a persistent program's loops are ``while`` loops over the same
bounds (:mod:`fastpath._grouped_gemm_tiles`): the ``tl.range`` forms, the Hopper warp specialization and the
TMA engine run only in the GPU test, which runs every tile of :data:`fastpath.grouped_gemm.FP8_PREFILL_CANDIDATES`
on random E4M3 codes over the whole range against :data:`~fastpath.grouped_gemm.DEFAULT_TILES` bit for bit. On
the CPU each of those tiles is compiled for sm_90a (Triton's ptxas) and its IR and SASS inspected.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastpath._grouped_gemm_tiles import _tile_coords  # noqa: E402
from fastpath.testing import on_gpu  # noqa: E402


@triton.jit
def _coords_kernel(out_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    t = tl.program_id(0)
    pm, pn = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
    tl.store(out_ptr + 2 * t, pm)
    tl.store(out_ptr + 2 * t + 1, pn)


def _cpu_only():
    if on_gpu():
        pytest.skip("interpreter case (small integer operands); the GPU case is test_gpu_prefill_candidates_*")


def _variants():
    from fastpath.grouped_gemm import GemmTiles

    return {
        "group_m 3": GemmTiles(16, 32, 128, 1, 1, group_m=3),
        "persistent 2/SM, group_m 2": GemmTiles(16, 32, 128, 1, 1, persistent=True, programs_per_sm=2, group_m=2),
        "tma": GemmTiles(32, 64, 128, 1, 1, tma=True),
        "tma, warp_specialize": GemmTiles(16, 32, 128, 1, 1, tma=True, warp_specialize=True),
        "persistent, tma, warp_specialize, flatten, group_m 2": GemmTiles(
            16, 32, 128, 1, 1, persistent=True, tma=True, warp_specialize=True, flatten=True, group_m=2),
        "block_n 256 (one weight scale per 128 columns), tma": GemmTiles(16, 256, 128, 1, 1, tma=True, group_m=2),
    }


def _case(kind: str, seed: int = 0):
    """Operands of a small contiguous layout: ``(a, b, m_indices, kw)`` with ``kw`` the remaining arguments.
    ``kind``: "fp8" (K = 384, N = 72, 32-row segments, so 16-row padding tiles inside them, plus the padding
    tail of a worst-case buffer), "fp8_gather_bias" (token rows through ``a_src``, a bias), "fp8_odd_k"
    (K = 208, N = 300), "float" (float32 operands, K = 96)."""
    from fastpath import dispatch

    g = torch.Generator().manual_seed(seed)
    e, top_k, tokens = 5, 2, 23
    n, k = {"fp8": (72, 384), "fp8_gather_bias": (72, 256), "fp8_odd_k": (300, 208), "float": (72, 96)}[kind]
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    ids[3] = torch.tensor([4, 0], dtype=torch.int32)  # expert 4 has rows (the last segment)
    lay = dispatch.to_contiguous(None, ids, e, 32, m_sum="worst_case" if kind == "fp8" else None)
    rows = int(lay.m_indices.numel())
    fp8 = kind != "float"
    dt = torch.float8_e4m3fn if fp8 else torch.float32

    def ints(*shape):
        return torch.randint(-8, 9, shape, generator=g).float().to(dt)

    kb = -(-k // 128)
    kw = {"alignment": 32, "out_dtype": torch.float32}
    if kind == "fp8_gather_bias":
        a = ints(tokens, k)
        kw.update(a_src=lay.src, top_k=top_k, a_scales=torch.rand(tokens, kb, generator=g) + 0.25,
                  bias=torch.randn(e, n, generator=g))
    else:
        a = ints(rows, k)
        if fp8:
            kw["a_scales"] = torch.rand(rows, kb, generator=g) + 0.25
    if fp8:
        kw["b_scales"] = torch.rand(e, -(-n // 128), kb, generator=g) + 0.25
    return a, ints(e, n, k), lay, kw


def _float64_rows(a, b, lay, kw):
    """Independent statement of every routed row: ``sum_j (a_j . b_j) * sa_j * sb_j (+ bias)`` in float64."""
    m_idx = lay.m_indices.numpy()
    src = kw.get("a_src")
    top_k = kw.get("top_k", 1)
    a64, b64 = a.float().double().numpy(), b.float().double().numpy()
    n, k = b.shape[1], b.shape[2]
    out = {}
    for r in np.flatnonzero(m_idx >= 0):
        e = int(m_idx[r])
        ar = a64[int(src[r]) // top_k] if src is not None else a64[r]
        if "a_scales" in kw:
            sa = kw["a_scales"].double().numpy()[int(src[r]) // top_k if src is not None else r]
            sb = kw["b_scales"].double().numpy()[e]
            acc = np.zeros(n)
            for j in range(-(-k // 128)):
                ks = slice(j * 128, (j + 1) * 128)
                acc += (b64[e][:, ks] @ ar[ks]) * sa[j] * np.repeat(sb[:, j], 128)[:n]
        else:
            acc = b64[e] @ ar
        if "bias" in kw:
            acc = acc + kw["bias"].double().numpy()[e]
        out[r] = acc
    return out


@pytest.mark.parametrize("kind", ["fp8", "fp8_gather_bias", "fp8_odd_k", "float"])
def test_tile_loop_variants_give_the_one_tile_kernel_bits(kind):
    """Each tile-loop variant writes every routed row (the output starts as NaN) with the bits of the
    one-tile-per-program kernel at the same block sizes, and both are the float64 statement within FP32
    rounding."""
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_contiguous

    _cpu_only()
    a, b, lay, kw = _case(kind)
    valid = lay.m_indices >= 0
    ref = _float64_rows(a, b, lay, kw)
    rows = sorted(ref)
    want_rows = np.stack([ref[r] for r in rows])
    for name, t in _variants().items():
        if kind == "float":
            t = GemmTiles(t.block_m, t.block_n, 32, 1, 1, persistent=t.persistent, programs_per_sm=t.programs_per_sm,
                          tma=t.tma, warp_specialize=t.warp_specialize, flatten=t.flatten, group_m=t.group_m)
        one = GemmTiles(t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages)
        if t.warp_specialize and "a_src" in kw:  # refused on the host, as on the GPU (no pointer loads there)
            with pytest.raises(ValueError, match="a_src"):
                grouped_gemm_contiguous(a, b, lay.m_indices, impl="triton", tiles=t, **kw)
            continue
        outs = []
        for tiles in (one, t):
            out = torch.full((int(valid.numel()), b.shape[1]), float("nan"))
            grouped_gemm_contiguous(a, b, lay.m_indices, impl="triton", tiles=tiles, out=out, **kw)
            outs.append(out)
        want, got = outs
        assert not torch.isnan(got[valid]).any(), f"{name}: rows left unwritten"
        assert torch.equal(got[valid], want[valid]), name
        np.testing.assert_allclose(got[valid].double().numpy(), want_rows, rtol=1e-5, atol=1e-4, err_msg=name)


def test_tile_order_visits_each_tile_once_with_row_tiles_fastest_in_a_group():
    """``_tile_coords`` maps tiles 0..T-1 onto every (row tile, column tile) once; with ``group_m > 1`` the
    consecutive tiles of a group walk its row tiles first (an expert's row tiles share a B tile), the last
    group holding the remaining rows; with 1, column tiles fastest."""
    dev = "cuda" if on_gpu() else "cpu"
    for pm, pn, gm in [(7, 3, 1), (7, 3, 2), (7, 3, 4), (5, 4, 8), (1, 5, 3)]:
        out = torch.full((pm * pn * 2,), -1, dtype=torch.int32, device=dev)
        _coords_kernel[(pm * pn,)](out, pm, pn, gm)
        got = [tuple(x) for x in out.reshape(-1, 2).tolist()]
        assert sorted(got) == [(i, j) for i in range(pm) for j in range(pn)]
        want = []  # the order written out: groups of gm row tiles, each column tile walking the group's rows
        for first in range(0, pm, gm):
            size = min(gm, pm - first)
            want += [(first + i, j) for j in range(pn) for i in range(size)]
        assert got == want, (pm, pn, gm)


def test_tile_loop_options_are_checked():
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_contiguous, grouped_gemm_masked

    with pytest.raises(ValueError, match="swap_ab"):
        GemmTiles(16, 128, 128, 4, 3, swap_ab=True, tma=True)
    with pytest.raises(ValueError, match="persistent"):
        GemmTiles(64, 128, 128, 4, 3, flatten=True)
    with pytest.raises(ValueError, match="persistent"):
        GemmTiles(64, 128, 128, 4, 3, programs_per_sm=2)
    with pytest.raises(ValueError, match="group_m"):
        GemmTiles(64, 128, 128, 4, 3, group_m=0)
    with pytest.raises(TypeError, match="tma"):
        GemmTiles(64, 128, 128, 4, 3, tma=1)
    with pytest.raises(ValueError, match="tma=True"):
        GemmTiles(64, 128, 128, 4, 3, warp_specialize=True)
    with pytest.raises(ValueError, match="block_m <= 64"):
        GemmTiles(128, 128, 128, 4, 3, tma=True, warp_specialize=True)
    assert not GemmTiles().tile_loop and GemmTiles(group_m=2).tile_loop
    from fastpath.grouped_gemm_w4 import _tiles_for

    with pytest.raises(ValueError, match="4-bit kernel"):  # the W4 kernel has no tile loop: refused, not dropped
        _tiles_for(None, None, GemmTiles(64, 128, 64, 4, 3, group_m=2), 128)
    if on_gpu():
        return
    m_idx = torch.zeros(32, dtype=torch.int32)
    a = torch.ones(32, 40, dtype=torch.float8_e4m3fn)  # K = 40 bytes a row: no TMA descriptor
    b = torch.ones(1, 32, 40, dtype=torch.float8_e4m3fn)
    kw = dict(a_scales=torch.ones(32, 1), b_scales=torch.ones(1, 1, 1), alignment=32)
    with pytest.raises(ValueError, match="16-byte"):
        grouped_gemm_contiguous(a, b, m_idx, impl="triton", tiles=GemmTiles(16, 32, 128, 1, 1, tma=True), **kw)
    got = grouped_gemm_contiguous(a, b, m_idx, impl="triton", tiles=GemmTiles(16, 32, 128, 1, 1, group_m=2), **kw)
    assert torch.equal(got.float(), torch.full((32, 32), 40.0))  # the pointer loads take any K
    with pytest.raises(ValueError, match="contiguous layout only"):
        grouped_gemm_masked(torch.ones(1, 32, 32), torch.ones(1, 32, 32), torch.tensor([3], dtype=torch.int32),
                            impl="triton", tiles=GemmTiles(16, 32, 32, 1, 1, group_m=2))


def _gpu_operands(k: int, n: int, seed: int):
    """Random E4M3 codes over the whole finite range and FP32 scales, a top-4 routing of 61 tokens over 16
    experts in the 128-row contiguous layout (segments of 1-2 row tiles of 64, padding tiles among them)."""
    from fastpath import dispatch

    g = torch.Generator(device="cuda").manual_seed(seed)
    e, tokens, top_k = 16, 61, 4
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    lay = dispatch.to_contiguous(None, ids, e, 128)

    def codes(*shape):
        c = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
        c[(c & 0x7F) == 0x7F] -= 1  # no NaN codes
        return c.view(torch.float8_e4m3fn)

    rows, kb = int(lay.m_indices.numel()), -(-k // 128)
    b, sb = codes(e, n, k), torch.rand((e, -(-n // 128), kb), device="cuda", generator=g) * 1e-3
    x, sx = codes(tokens, k), torch.rand((tokens, kb), device="cuda", generator=g) * 1e-3
    a, sa = codes(rows, k), torch.rand((rows, kb), device="cuda", generator=g) * 1e-3
    bias = torch.randn((e, n), device="cuda", generator=g)
    return lay, a, sa, b, sb, x, sx, bias


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["64x128 w4 s4", "64x128 w4 s3", "128x128 w8 s3", "64x128 w4 s4 g4",
                                  "64x128 w4 s4 pers2 g4", "64x128 w4 s4 tma", "64x128 w4 s4 tma g4",
                                  "64x128 w4 s3 tma g4", "64x128 w4 s3 pers3 tma g4", "64x128 w4 s4 pers2 tma g4",
                                  "64x128 w4 s4 pers2 tma flat g4", "64x128 w4 s3 tma ws",
                                  "64x128 w4 s3 pers1 tma ws g4", "128x128 w8 s3 tma g2", "128x128 w8 s3 pers1 tma g2",
                                  "128x64 w4 s4 tma g2", "64x256 w8 s3 tma g4", "64x128 w8 s4 tma",
                                  "64x128 w4 s2 tma lagpair", "64x128 w4 s2 tma g4 lagpair", "64x128 w8 s2 tma lagpair",
                                  "128x128 w8 s2 tma g2 lagpair", "128x128 w4 s6 g8 gluon",
                                  "128x128 w4 s6 g8 gluon tmastore", "128x192 w4 s4 g8 gluon"])
def test_gpu_prefill_candidates_give_the_default_bits(name):
    """Each FP8 prefill candidate (:data:`fastpath.grouped_gemm.FP8_PREFILL_CANDIDATES`) gives the bits of the
    default tiles on every routed row: GEMM1-like (K = 7168, N = 512) and GEMM2-like (K = 2048, N = 384, a
    column tail for 256-wide tiles) on the layout's rows, and token rows through ``a_src`` with a bias (the
    layout's rows with a bias for warp-specialized tiles, which refuse ``a_src``)."""
    if not on_gpu():
        pytest.skip("needs a CUDA GPU (Hopper for TMA and warp specialization): run `pytest -m gpu` on a GPU machine")
    from fastpath.grouped_gemm import DEFAULT_TILES, FP8_PREFILL_CANDIDATES, grouped_gemm_contiguous

    t = FP8_PREFILL_CANDIDATES[name]
    for k, n, seed in ((7168, 512, 0), (2048, 384, 1)):
        lay, a, sa, b, sb, x, sx, bias = _gpu_operands(k, n, seed)
        valid = lay.m_indices >= 0
        want = grouped_gemm_contiguous(a, b, lay.m_indices, impl="triton", a_scales=sa, b_scales=sb,
                                       tiles=DEFAULT_TILES["fp8_block"])
        assert torch.isfinite(want[valid].float()).all() and want[valid].float().abs().max() > 0
        got = grouped_gemm_contiguous(a, b, lay.m_indices, impl="triton", a_scales=sa, b_scales=sb, tiles=t)
        assert torch.equal(got[valid], want[valid]), (name, k, n)
        kw = dict(impl="triton", a_scales=sx, b_scales=sb, bias=bias, a_src=lay.src, top_k=4)
        if t.warp_specialize or t.kernel == "gluon":  # refused: the gathered rows are pointer loads
            with pytest.raises(ValueError, match="a_src"):
                grouped_gemm_contiguous(x, b, lay.m_indices, tiles=t, **kw)
            kw.pop("a_src")
            x, kw["a_scales"] = a, sa  # the layout's rows with the bias instead
        want = grouped_gemm_contiguous(x, b, lay.m_indices, tiles=DEFAULT_TILES["fp8_block"], **kw)
        got = grouped_gemm_contiguous(x, b, lay.m_indices, tiles=t, **kw)
        assert torch.equal(got[valid], want[valid]), (name, k, n, "bias" + ("" if "a_src" not in kw else ", a_src"))


def test_gpu_test_names_every_candidate():
    """The GPU test's parameter list is the candidate table (a candidate added there is checked on the GPU)."""
    from fastpath.grouped_gemm import FP8_PREFILL_CANDIDATES

    mark = next(m for m in test_gpu_prefill_candidates_give_the_default_bits.pytestmark if m.name == "parametrize")
    assert list(mark.args[1]) == list(FP8_PREFILL_CANDIDATES)


@pytest.mark.slow
def test_every_candidate_compiles_for_hopper_with_its_options(tmp_path):
    """Every FP8 prefill candidate compiles for sm_90a on the CPU (Triton's ptxas; bench/studies/
    triton_fp8_prefill_compile.py in a process of its own, the kernels compiled rather than interpreted), at
    GEMM2's shape: warp specialization in the IR exactly where asked (Hopper applies it with 4 warps), TMA loads
    exactly where asked, no spills, fused multiply-adds in the SASS a multiple of a thread's outputs and no fewer
    than its FP32 multiplies (DeepGEMM's promotion ``fma(part, fl(sa * sb), acc)``, as in the default tiles: one
    FFMA an output, one FMUL a row with a scalar weight scale, an output with a vector of them), and a persistent
    grid's programs per SM co-resident (registers and shared memory)."""
    import subprocess
    import sys

    from fastpath.grouped_gemm import FP8_PREFILL_CANDIDATES

    root = os.path.join(os.path.dirname(__file__), "..")
    out = tmp_path / "c.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "bench/studies/triton_fp8_prefill_compile.py", "--gemms", "gemm2",
                          "--out", str(out)], cwd=root, env=env, capture_output=True, text=True, timeout=800)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert list(got) == list(FP8_PREFILL_CANDIDATES)
    for name, t in FP8_PREFILL_CANDIDATES.items():
        if t.kernel == "gluon":  # its own design (warp-specialized, TMA): tests/test_grouped_gemm_gluon.py
            continue
        r = got[name]["gemm2"]
        assert r["warp_specialized"] == t.warp_specialize, name
        assert r["tma_loads"] == t.tma, name
        assert r["stack_bytes"] == 0, name
        outputs_per_thread = t.block_m * t.block_n // (32 * t.num_warps)
        assert r["ffma"] % outputs_per_thread == 0 and r["ffma"] > 0 and r["fmul"] <= r["ffma"], (name, r)
        if t.persistent:
            assert r["programs_per_sm_fit"] >= t.programs_per_sm, name


def test_default_tiles_by_layout(monkeypatch):
    """FP8 prefill in the contiguous layout on a Hopper GPU (sm_90) takes the Gluon kernel's tiles, except for
    token rows read through ``a_src`` and an alignment its 128-row tiles do not divide, which take the TMA tiles, as
    does another GPU with TMA; the masked layout (which neither runs), a GPU without TMA, decode sizes and the
    interpreter keep theirs."""
    import fastpath._grouped_gemm_table as table
    import fastpath.grouped_gemm as gg

    monkeypatch.setattr(table, "_has_tma", lambda: True)
    monkeypatch.setattr(table, "_is_sm90", lambda: True)
    t = gg.default_tiles("fp8_block", 64, "cuda", "contiguous")
    assert t == gg.DEFAULT_TILES["fp8_block_contiguous_gluon"] and t.kernel == "gluon" and not t.tile_loop
    for kw in ({"gather": True}, {"alignment": 64}):
        t = gg.default_tiles("fp8_block", 64, "cuda", "contiguous", **kw)
        assert t == gg.DEFAULT_TILES["fp8_block_contiguous_tma"] and t.tma and t.tile_loop, kw
    assert gg.default_tiles("fp8_block", 64, "cuda", "contiguous", alignment=256).kernel == "gluon"
    monkeypatch.setattr(table, "_is_sm90", lambda: False)  # e.g. sm_100: TMA, no wgmma
    t = gg.default_tiles("fp8_block", 64, "cuda", "contiguous")
    assert t == gg.DEFAULT_TILES["fp8_block_contiguous_tma"] and t.tma and t.tile_loop
    assert gg.default_tiles("fp8_block", 64, "cuda", "masked") == gg.DEFAULT_TILES["fp8_block"]
    assert gg.default_tiles("fp8_block", 4, "cuda", "contiguous") == gg.DEFAULT_TILES["fp8_block_decode"]
    assert gg.default_tiles("float", 64, "cuda", "contiguous") == gg.DEFAULT_TILES["float"]
    assert not gg.default_tiles("fp8_block", 64, "cpu", "contiguous").tile_loop
    monkeypatch.setattr(table, "_has_tma", lambda: False)
    assert gg.default_tiles("fp8_block", 64, "cuda", "contiguous") == gg.DEFAULT_TILES["fp8_block"]
    with pytest.raises(ValueError, match="layout"):
        gg.default_tiles("fp8_block", 64, "cuda", "ragged")


def _promotion_case(k: int, gather: bool, seed: int = 0):
    """FP8 operands of a small contiguous layout: 6 experts with ragged row counts (16-row padding tiles inside the
    32-row segments, an expert with none), N = 200 (two weight-scale blocks, a column tail), ``k`` columns; small
    integer codes (each 128-column block's dot exact in FP32) and random FP32 scales over [0.25, 1.25) (the FP32
    rounding of the promotions depends on their order). ``gather``: token rows through ``a_src``."""
    from fastpath import dispatch

    g = torch.Generator().manual_seed(seed)
    e, top_k, tokens, n = 6, 2, 11, 200
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    ids[ids == 2] = 5  # expert 2 has no rows; expert 5 (the last segment) has some
    lay = dispatch.to_contiguous(None, ids, e, 32)
    rows, kb = int(lay.m_indices.numel()), -(-k // 128)

    def ints(*shape):
        return torch.randint(-8, 9, shape, generator=g).float().to(torch.float8_e4m3fn)

    kw = {"alignment": 32, "out_dtype": torch.float32, "b_scales": torch.rand(e, 2, kb, generator=g) + 0.25}
    if gather:
        a = ints(tokens, k)
        kw.update(a_src=lay.src, top_k=top_k, a_scales=torch.rand(tokens, kb, generator=g) + 0.25)
    else:
        a = ints(rows, k)
        kw["a_scales"] = torch.rand(rows, kb, generator=g) + 0.25
    return a, ints(e, n, k), lay, kw


def _float32_promotions(a, b, lay, kw):
    """Independent statement of the promotion's FP32 arithmetic on every routed row, per output: ``acc = 0``, then
    for each 128-column block in K order ``acc = fl(acc + fl(part * fl(sa * sb)))`` (DeepGEMM's order; on the GPU
    the last two fused, ``fma(part, fl(sa * sb), acc)``) with ``part`` the block's exact dot and ``sb`` the weight
    scale of the output's 128-column block, all in float32 (the interpreter's NumPy does no fused multiply-add)."""
    m_idx = lay.m_indices.numpy()
    src = kw.get("a_src")
    top_k = kw.get("top_k", 1)
    a64, b64 = a.float().double().numpy(), b.float().double().numpy()
    sa_all, sb_all = kw["a_scales"].numpy(), kw["b_scales"].numpy()
    n, k = b.shape[1], b.shape[2]
    out = {}
    for r in np.flatnonzero(m_idx >= 0):
        e = int(m_idx[r])
        t = int(src[r]) // top_k if src is not None else r
        acc = np.zeros(n, dtype=np.float32)
        for j in range(-(-k // 128)):
            ks = slice(j * 128, (j + 1) * 128)
            part = (b64[e][:, ks] @ a64[t][ks]).astype(np.float32)  # exact: small integers
            sb = np.repeat(sb_all[e][:, j], 128)[:n].astype(np.float32)
            acc = (acc + part * (np.float32(sa_all[t][j]) * sb)).astype(np.float32)
        out[r] = acc
    return out


@pytest.mark.parametrize("gather", [False, True], ids=["layout rows", "token rows via a_src"])
@pytest.mark.parametrize("k", [128, 256, 384, 448, 640], ids=lambda k: f"K{k}")
def test_promotion_orders_give_the_inline_bits(k, gather):
    """``promotion="lagged_pair"`` (the same promotions, the MMAs issued earlier) writes
    every routed row with the bits of ``"inline"`` tiles of the same sizes and of the one-tile-per-program kernel,
    and those bits are the float32 statement of the promotions in K-block order: 1 to 5 K blocks (odd and even
    counts: the loops' tails), K = 448 a partial last block, pointer and TMA loads, persistent programs (padding
    tiles run no K block), 256-column tiles (a weight scale per 128 columns)."""
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_contiguous

    _cpu_only()
    a, b, lay, kw = _promotion_case(k, gather)
    valid = lay.m_indices >= 0
    ref = _float32_promotions(a, b, lay, kw)
    want_rows = torch.from_numpy(np.stack([ref[r] for r in sorted(ref)]))
    for base in (GemmTiles(16, 32, 128, 1, 1), GemmTiles(16, 32, 128, 1, 1, tma=True),
                 GemmTiles(16, 32, 128, 1, 1, persistent=True, programs_per_sm=2, group_m=2),
                 GemmTiles(32, 256, 128, 1, 1, tma=True)):
        one = GemmTiles(base.block_m, base.block_n, 128, 1, 1)
        for promotion in ("inline", "lagged_pair"):
            t = replace(base, promotion=promotion)
            out = torch.full((int(valid.numel()), b.shape[1]), float("nan"))
            grouped_gemm_contiguous(a, b, lay.m_indices, impl="triton", tiles=t, out=out, **kw)
            assert torch.equal(out[valid], want_rows), (t, k, gather)
        out = grouped_gemm_contiguous(a, b, lay.m_indices, impl="triton", tiles=one, **kw)
        assert torch.equal(out[valid], want_rows), (one, k, gather)


def test_promotion_option_is_checked():
    from fastpath.grouped_gemm import PROMOTIONS, GemmTiles, grouped_gemm_contiguous

    assert PROMOTIONS == ("inline", "lagged_pair")
    with pytest.raises(TypeError, match="promotion"):
        GemmTiles(64, 128, 128, 4, 3, promotion=1)
    for dropped in ("lag", "lagged", "pair"):
        with pytest.raises(ValueError, match="'lagged_pair'"):
            GemmTiles(64, 128, 128, 4, 3, promotion=dropped)
    with pytest.raises(ValueError, match="swap_ab"):
        GemmTiles(16, 128, 128, 4, 3, swap_ab=True, promotion="lagged_pair")
    assert GemmTiles(promotion="lagged_pair").tile_loop and not GemmTiles(promotion="inline").tile_loop
    if on_gpu():
        return
    m_idx = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(ValueError, match="promotion='inline'"):  # float operands have no promotion to reorder
        grouped_gemm_contiguous(torch.ones(32, 32), torch.ones(1, 32, 32), m_idx, impl="triton", alignment=32,
                                tiles=GemmTiles(16, 32, 32, 1, 1, promotion="lagged_pair"))
