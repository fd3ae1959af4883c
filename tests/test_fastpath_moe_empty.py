"""``fastpath.moe.fused_moe`` on a batch of no tokens: an empty ``[0, hidden]`` output in the requested dtype, in
both layouts, capturable or not, with or without ``chunk_size``; a ``chunk_size`` below 1 is refused naming it."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.moe import fast_weights, fused_moe  # noqa: E402
from fastpath.testing import device  # noqa: E402
from moeref.moe import make_layer, quantize_weights  # noqa: E402
from moeref.quant import fp8_block  # noqa: E402

DEV = device()


def _empty_case(hidden: int = 32, experts: int = 5, top_k: int = 2, fp8: bool = False):
    layer = make_layer(experts, hidden, 128 if fp8 else 16, seed=0)
    fw = fast_weights(quantize_weights(layer, fp8_block()) if fp8 else layer, DEV)
    x = torch.zeros((0, hidden), dtype=torch.float32, device=DEV)
    tw = torch.zeros((0, top_k), dtype=torch.float32, device=DEV)
    ids = torch.zeros((0, top_k), dtype=torch.int32, device=DEV)
    return x, fw, tw, ids


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_no_tokens_give_an_empty_output(layout, capturable, chunk_size, fp8):
    hidden = 128 if fp8 else 32
    x, fw, tw, ids = _empty_case(hidden, fp8=fp8)
    out = fused_moe(x, fw, tw, ids, layout=layout, capturable=capturable, chunk_size=chunk_size,
                    out_dtype=torch.float32)
    assert tuple(out.shape) == (0, hidden) and out.dtype == torch.float32


@pytest.mark.parametrize("chunk_size", [0, -2])
def test_a_chunk_size_below_one_is_refused(chunk_size):
    x, fw, tw, ids = _empty_case()
    with pytest.raises(ValueError, match=f"chunk_size must be >= 1; got {chunk_size}"):
        fused_moe(x, fw, tw, ids, chunk_size=chunk_size)
