"""The decode paths of fastpath.grouped_gemm and fastpath.moe (issue 13, performance at 1-128 tokens).

* swapped tiles (``GemmTiles.swap_ab``: each tile computed as ``B @ a^T``, the rows the MMA's narrow side);
* the Triton kernel's masked mode (``grouped_gemm_masked(impl="triton")``: program row ``p`` finds the
  ``p``-th expert with rows from ``masked_m``, so ``max_groups`` sizes the grid without a host sync);
* the layer's bound on the rows a contiguous layout can use (:func:`fastpath._moe_layer._used_rows_bound`), which
  cuts vLLM's worst-case buffer;
* the dispatch's slot -> row map (``slot_rows=True``), the inverse of ``src``.

CPU: the Triton kernel under the interpreter with float32 operands (the interpreter's low-precision dot is
not the hardware's), against the float64 product within the FP32 accumulation bound. GPU: the FP8 kernel's
decode tiles and masked mode give the same bits as its default tiles on the contiguous layout.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device, on_gpu, poisoned  # noqa: E402
from moeref.compare import FP32_ACCUM, gemm_error_bound  # noqa: E402

DEV = device()


def _tiles():
    from fastpath.grouped_gemm import GemmTiles

    if on_gpu():  # tf32 would need its own bound: the GPU cases below use FP8
        pytest.skip("the float32 kernel cases run under the interpreter (CPU); the GPU ones use FP8")
    return [GemmTiles(16, 32, 32, 1, 1), GemmTiles(16, 32, 32, 1, 1, swap_ab=True),
            GemmTiles(32, 16, 16, 1, 1, swap_ab=True)]


def _check_rows(got, a, b, rows_of):
    """Every listed row ``(r, e)`` of ``got`` is ``a[r] @ b[e].T`` within the FP32 accumulation bound."""
    for r, e in rows_of:
        ref = a[r].astype(np.float64) @ b[e].astype(np.float64).T
        bound = gemm_error_bound(a[r:r + 1].astype(np.float64), b[e].astype(np.float64), FP32_ACCUM)[0]
        bound = bound + 2.0**-24 * np.abs(ref)  # the float32 output store
        assert np.all(np.abs(got[r] - ref) <= bound), (r, e)


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_mode_finds_each_present_expert(seed):
    """Empty experts between present ones, a capacity (20) that is not a multiple of the row tile, an expert
    filling its capacity, and ``max_groups`` exactly the number of present experts: every present expert's
    rows are computed, by each tile shape."""
    from fastpath.grouped_gemm import grouped_gemm_masked

    rng = np.random.default_rng(seed)
    e, cap, k, n = 6, 20, 48, 40
    masked = np.array([3, 0, 20, 0, 0, 7], np.int32) if seed == 0 else np.array([0, 0, 1, 0, 0, 20], np.int32)
    a = rng.standard_normal((e, cap, k)).astype(np.float32)
    b = (rng.standard_normal((e, n, k)) / np.sqrt(k)).astype(np.float32)
    present = int((masked > 0).sum())
    for t in _tiles():
        with poisoned():
            got = grouped_gemm_masked(torch.as_tensor(a, device=DEV), torch.as_tensor(b, device=DEV),
                                      torch.as_tensor(masked, device=DEV), impl="triton", tiles=t,
                                      out_dtype=torch.float32, max_groups=present)
        got = got.cpu().numpy().reshape(e * cap, n)
        rows = [(g * cap + i, g) for g in range(e) for i in range(int(masked[g]))]
        _check_rows(got, a.reshape(e * cap, k), b, rows)


def test_masked_mode_planted_short_group_bound_misses_the_last_expert():
    """Planted fault: ``max_groups`` one below the present experts leaves the last present expert's rows
    uncomputed (their poison stays), so the bound is what sizes the grid."""
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_masked

    if on_gpu():
        pytest.skip("interpreter case (float32 operands)")
    e, cap, k, n = 4, 16, 32, 32
    masked = torch.tensor([0, 5, 0, 9], dtype=torch.int32)
    a = torch.randn(e, cap, k)
    b = torch.randn(e, n, k)
    with poisoned():
        got = grouped_gemm_masked(a, b, masked, impl="triton", tiles=GemmTiles(16, 32, 32, 1, 1, swap_ab=True),
                                  out_dtype=torch.float32, max_groups=1)
    want = a[1, :5].double() @ b[1].double().T
    assert torch.allclose(got[1, :5].double(), want, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got[3, :9].double(), a[3, :9].double() @ b[3].double().T, rtol=1e-3, atol=1e-2)


def test_swapped_tiles_on_the_contiguous_layout():
    """Swapped tiles on the contiguous layout: segments of 16 rows, padding tiles skipped, rows within bound."""
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    rng = np.random.default_rng(5)
    k, n = 48, 40
    m_idx = np.array([0] * 3 + [-1] * 13 + [2] * 16 + [2] * 4 + [-1] * 12, np.int32)
    a = rng.standard_normal((m_idx.size, k)).astype(np.float32)
    b = (rng.standard_normal((3, n, k)) / np.sqrt(k)).astype(np.float32)
    for t in _tiles():
        got = grouped_gemm_contiguous(torch.as_tensor(a, device=DEV), torch.as_tensor(b, device=DEV),
                                      torch.as_tensor(m_idx, device=DEV), impl="triton", tiles=t, alignment=16,
                                      out_dtype=torch.float32).cpu().numpy().astype(np.float64)
        _check_rows(got, a, b, [(r, int(g)) for r, g in enumerate(m_idx) if g >= 0])


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_token_rows_read_through_src_give_the_scattered_bits(layout):
    """``a_src``: the kernel reads token row ``src[r] // top_k`` for layout row ``r``; the same bits as the
    token rows scattered into the layout first (whose padding rows hold poison)."""
    from fastpath import dispatch
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_contiguous, grouped_gemm_masked

    if on_gpu():
        pytest.skip("interpreter case (float32 operands); the GPU case is the FP8 test below")
    rng = np.random.default_rng(7)
    e, k, n, top_k = 5, 32, 48, 2
    ids = torch.as_tensor(np.stack([rng.choice(e, top_k, replace=False) for _ in range(9)]).astype(np.int32))
    x = torch.randn(9, k)
    t = GemmTiles(16, 32, 32, 1, 1, swap_ab=True)
    b = torch.randn(e, n, k)
    if layout == "contiguous":
        with poisoned():
            lay = dispatch.to_contiguous(x, ids, e, 16)
        src = lay.src
        want = grouped_gemm_contiguous(lay.a, b, lay.m_indices, impl="triton", tiles=t, alignment=16,
                                       out_dtype=torch.float32)
        got = grouped_gemm_contiguous(x, b, lay.m_indices, impl="triton", tiles=t, alignment=16,
                                      out_dtype=torch.float32, a_src=src, top_k=top_k)
    else:
        with poisoned():
            lay = dispatch.to_masked(x, ids, e, 16, expected_m=1, validate=False)
        src = lay.src
        want = grouped_gemm_masked(lay.a, b, lay.masked_m, impl="triton", tiles=t, out_dtype=torch.float32)
        got = grouped_gemm_masked(x, b, lay.masked_m, impl="triton", tiles=t, out_dtype=torch.float32,
                                  a_src=src, top_k=top_k)
    valid = (src >= 0).reshape(got.shape[:-1])
    assert int(valid.sum()) == ids.numel()
    assert torch.equal(got[valid], want[valid])


def test_used_rows_bound_covers_every_routing_and_is_attained():
    """The tight contiguous size of any routing of ``slots`` slots is at most the bound (random, skewed,
    all-to-one and -1-padded routings), and at decode sizes (slots <= experts) a routing of distinct experts
    with one slot each attains it."""
    from fastpath._moe_layer import _used_rows_bound
    from moeref.dispatch.contiguous import contiguous_m_sum

    rng = np.random.default_rng(0)
    for e, m, k, align in [(256, 1, 8, 128), (256, 8, 8, 128), (16, 5, 3, 16), (4, 40, 2, 64), (300, 2, 8, 128)]:
        slots = m * k
        bound = _used_rows_bound(slots, e, align)
        assert bound <= contiguous_m_sum(np.zeros(e), align, "worst_case", num_slots=slots)
        for trial in range(50):
            if trial == 0:
                ids = np.zeros(slots, np.int64)  # all to one expert
            else:
                ids = rng.integers(-1, e, slots) if trial % 2 else rng.integers(0, min(e, 3), slots)
            counts = np.bincount(ids[ids >= 0], minlength=e)
            assert contiguous_m_sum(counts, align) <= bound
        if slots <= e:
            distinct = np.zeros(e, np.int64)
            distinct[:slots] = 1
            assert contiguous_m_sum(distinct, align) == bound


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("capturable", [False, True])
def test_slot_rows_is_the_inverse_of_src(layout, capturable):
    """``slot_rows=True``: each slot's row, -1 for padding slots, the inverse of ``src`` (sync-free and sized
    paths)."""
    from fastpath import dispatch

    rng = np.random.default_rng(2)
    ids = np.stack([rng.choice(6, 3, replace=False) for _ in range(7)]).astype(np.int32)
    ids[1, 2] = -1
    t = torch.as_tensor(ids, device=DEV)
    if layout == "contiguous":
        lay, dst = dispatch.to_contiguous(None, t, 6, 16, m_sum="worst_case" if capturable else None,
                                          validate=False, slot_rows=True)
    else:
        lay, dst = dispatch.to_masked(None, t, 6, 7 if capturable else None, expected_m=3 if capturable else None,
                                      validate=False, slot_rows=True)
    src = lay.src.reshape(-1).cpu().numpy()
    dst = dst.cpu().numpy()
    want = np.full(ids.size, -1)
    rows = np.flatnonzero(src >= 0)
    want[src[rows]] = rows
    np.testing.assert_array_equal(dst, want)
    assert dst[1 * 3 + 2] == -1


@pytest.mark.gpu
def test_gpu_fp8_decode_tiles_and_masked_mode_give_the_default_bits():
    """FP8 1x128 x 128x128 on the GPU: the decode tiles (swapped, 16 rows), other swapped tiles and the masked
    mode give the bits of the default tiles on every routed row (the same products, the same K order)."""
    if not on_gpu():
        pytest.skip("needs a CUDA GPU: run `bash bench/run_gpu.sh` on a GPU machine")
    from fastpath import dispatch
    from fastpath.grouped_gemm import DEFAULT_TILES, GemmTiles, grouped_gemm_contiguous, grouped_gemm_masked

    g = torch.Generator(device="cuda").manual_seed(0)
    e, n, k = 12, 384, 512
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:4] for _ in range(37)]).to(torch.int32)
    b = (torch.randn((e, n, k), device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
    sb = torch.rand((e, n // 128, k // 128), device="cuda", generator=g) + 0.25
    lay = dispatch.to_contiguous(None, ids, e, 128)
    rows = int(lay.m_indices.numel())
    a = (torch.randn((rows, k), device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
    sa = torch.rand((rows, k // 128), device="cuda", generator=g) + 0.25
    valid = lay.m_indices >= 0
    want = grouped_gemm_contiguous(a, b, lay.m_indices, impl="triton", a_scales=sa, b_scales=sb,
                                   tiles=DEFAULT_TILES["fp8_block"])
    assert torch.isfinite(want[valid].float()).all()
    for t in (DEFAULT_TILES["fp8_block_decode"], GemmTiles(16, 64, 128, 4, 6, swap_ab=True),
              GemmTiles(32, 128, 128, 4, 4, swap_ab=True), GemmTiles(64, 128, 128, 4, 4, swap_ab=True)):
        got = grouped_gemm_contiguous(a, b, lay.m_indices, impl="triton", a_scales=sa, b_scales=sb, tiles=t)
        assert torch.equal(got[valid], want[valid]), t
    # token rows read through src (a_src) against the same rows scattered into the layout
    xt = (torch.randn((37, k), device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
    st = torch.rand((37, k // 128), device="cuda", generator=g) + 0.25
    lay_x = dispatch.to_contiguous(xt.view(torch.uint8), ids, e, 128)
    lay_s = dispatch.to_contiguous(st, ids, e, 128)
    for t in (DEFAULT_TILES["fp8_block"], DEFAULT_TILES["fp8_block_decode"]):
        scat = grouped_gemm_contiguous(lay_x.a.view(torch.float8_e4m3fn), b, lay_x.m_indices, impl="triton",
                                       a_scales=lay_s.a, b_scales=sb, tiles=t)
        gath = grouped_gemm_contiguous(xt, b, lay_x.m_indices, impl="triton", a_scales=st, b_scales=sb, tiles=t,
                                       a_src=lay_x.src, top_k=4)
        assert torch.equal(gath[valid], scat[valid]), t
    # the same rows in the masked layout (capacity 128): row i of expert x is the contiguous row psum start + i
    mk = dispatch.to_masked(None, ids, e, 128, expected_m=1, validate=False)
    am = torch.zeros((e, 128, k), device="cuda", dtype=torch.float8_e4m3fn)
    sam = torch.ones((e, 128, k // 128), device="cuda")
    starts = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"),
                        torch.cumsum((mk.masked_m.long() + 127) // 128 * 128, 0)[:-1]])
    for x in range(e):
        c = int(mk.masked_m[x])
        am[x, :c] = a[starts[x]:starts[x] + c]
        sam[x, :c] = sa[starts[x]:starts[x] + c]
    got = grouped_gemm_masked(am, b, mk.masked_m, impl="triton", a_scales=sam, b_scales=sb,
                              max_groups=int((mk.masked_m > 0).sum()))
    for x in range(e):
        c = int(mk.masked_m[x])
        assert torch.equal(got[x, :c], want[starts[x]:starts[x] + c]), x


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "deep_gemm"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_gpu_fp8_layer_captured_in_a_graph_gives_the_default_bits(impl, layout):
    """The FP8 layer with ``capturable=True`` captured in a CUDA graph (the decode step of vLLM / SGLang: the
    cut contiguous layout, the masked capacity of the row tile, the quantization branch beside the dispatch)
    replays to the bits of the default call, then follows new tokens and a new routing in the same buffers."""
    if not on_gpu():
        pytest.skip("needs a CUDA GPU: run `bash bench/run_gpu.sh` on a GPU machine")
    from fastpath.grouped_gemm import grouped_gemm_supports
    from fastpath.moe import FastMoEWeights, fused_moe

    if not grouped_gemm_supports(impl)[0]:
        pytest.skip(grouped_gemm_supports(impl)[1])
    g = torch.Generator(device="cuda").manual_seed(1)
    e, k, n, top_k = 16, 512, 256, 4
    fw = FastMoEWeights((torch.randn((e, 2 * n, k), device="cuda", generator=g) * 40).to(torch.float8_e4m3fn),
                        (torch.randn((e, k, n), device="cuda", generator=g) * 40).to(torch.float8_e4m3fn), "gate_up",
                        torch.rand((e, 2 * n // 128, k // 128), device="cuda", generator=g) * 1e-3,
                        torch.rand((e, k // 128, n // 128), device="cuda", generator=g) * 1e-3)
    for tokens in (1, 5, 40):
        x = torch.randn((tokens, k), device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
        tw = torch.rand((tokens, top_k), device="cuda", generator=g)
        fn = lambda: fused_moe(x, fw, tw, ids, impl=impl, layout=layout, capturable=True)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        for step in range(2):
            if step:  # new values in the captured buffers
                x.copy_(torch.randn(x.shape, device="cuda", generator=g))
                ids.copy_(torch.roll(ids, 1, dims=1) if tokens == 1 else torch.roll(ids, 1, dims=0))
            graph.replay()
            torch.cuda.synchronize()
            want = fused_moe(x, fw, tw, ids, impl=impl, layout=layout)
            assert torch.isfinite(want.float()).all() and want.abs().max() > 0
            assert torch.equal(out, want), (tokens, step)
