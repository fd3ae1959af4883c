"""``fastpath.moe.fused_moe(tiles=...)``: the Triton grouped GEMM's tiles given per GEMM (issue 33, the decode
tile sweep of ``bench/studies/decode_graph_sweep.py``).

CPU: the Triton kernels under the interpreter on a float32 layer; each GEMM's launch is recorded to see which
tiles reached it. (That FP8 tiles give the default's bits is a GPU check: tests/test_grouped_gemm_decode.py.)
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device  # noqa: E402
from tests.test_fastpath_moe_graph_cache import _layer_case as graph_cache_case  # noqa: E402

DEV = device()


def _layer_case():
    """5 tokens of a 6-expert float layer, top-2 (the graph-cache tests' case builder)."""
    return graph_cache_case(0, tokens=5, experts=6)


@pytest.fixture
def launched_tiles(monkeypatch):
    """The tiles of every Triton grouped GEMM launch, in order (``_launch_triton``'s ``t``)."""
    import fastpath.grouped_gemm as gg

    seen = []
    orig = gg._launch_triton

    def record(a, b, d, m_idx, a_scales, b_scales, bias, t, **kw):
        seen.append((int(b.shape[1]), t))  # (N of the GEMM, its tiles)
        return orig(a, b, d, m_idx, a_scales, b_scales, bias, t, **kw)

    monkeypatch.setattr(gg, "_launch_triton", record)
    return seen


@pytest.mark.skipif(DEV != "cpu", reason="the interpreter case (CPU); the GPU's tiles are checked bit for bit in "
                                         "tests/test_grouped_gemm_decode.py")
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_each_gemm_gets_its_own_tiles(launched_tiles, layout):
    """A pair reaches GEMM1 (N = 2 x intermediate = 32) and GEMM2 (N = hidden = 32, K = 16) in that order, one
    ``GemmTiles`` reaches both, a ``None`` entry is the default tile; every variant computes the layer (float32
    sums within FP32 rounding of the default tiles' result)."""
    from fastpath.grouped_gemm import GemmTiles, default_tiles
    from fastpath.moe import fused_moe

    x, fw, tw, ids = _layer_case()
    kw = dict(alignment=16, out_dtype=torch.float32, layout=layout, graph_cache=False)
    want = fused_moe(x, fw, tw, ids, **kw).numpy()
    default = default_tiles("float", 1, "cpu")
    assert [t for _, t in launched_tiles] == [default, default]
    t1, t2 = GemmTiles(16, 16, 16, 1, 1), GemmTiles(16, 16, 16, 1, 1, swap_ab=True)
    assert t1 != default and t2 != default
    for given, expect in (((t1, t2), [t1, t2]), (t2, [t2, t2]), ((None, t1), [default, t1]),
                          ([t2, None], [t2, default])):
        launched_tiles.clear()
        got = fused_moe(x, fw, tw, ids, tiles=given, **kw).numpy()
        assert [t for _, t in launched_tiles] == expect, given
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(want).max() > 0


def test_tiles_are_checked():
    from fastpath.grouped_gemm import GemmTiles
    from fastpath.moe import fused_moe, gemm_tiles

    t = GemmTiles(16, 16, 16, 1, 1)
    assert gemm_tiles(None) == (None, None) and gemm_tiles(t) == (t, t) and gemm_tiles([None, t]) == (None, t)
    with pytest.raises(TypeError, match="GemmTiles"):
        gemm_tiles("16x128")
    with pytest.raises(TypeError, match=r"tiles\[1\]"):
        gemm_tiles((t, (16, 128)))
    with pytest.raises(ValueError, match="pair"):
        gemm_tiles((t, t, t))
    x, fw, tw, ids = _layer_case()
    with pytest.raises(ValueError, match="Triton"):
        fused_moe(x, fw, tw, ids, impl="deep_gemm", tiles=t, graph_cache=False)


def test_tiles_are_in_the_graph_key():
    from fastpath.grouped_gemm import GemmTiles
    from fastpath.moe import gemm_tiles, graph_key

    x, fw, tw, ids = _layer_case()
    opts = dict(impl="triton", activation="silu_and_mul", activation_params=None, layout="masked", alignment=16,
                max_m=None, out_dtype=torch.float32, num_experts=None, chunk_size=None, shared_experts=None,
                apply_router_weight_on_input=False)
    t = GemmTiles(16, 16, 16, 1, 1)
    keys = [graph_key(x, fw, tw, ids, dict(opts, tiles=gemm_tiles(v)), 7) for v in (None, t, (t, None), (None, t))]
    assert len(set(keys)) == 4
    assert graph_key(x, fw, tw, ids, dict(opts, tiles=gemm_tiles(t)), 7) == keys[1]
