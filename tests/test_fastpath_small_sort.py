"""fastpath.dispatch's one-program sort head (``_small_sort_kernel``, up to ``SMALL_SORT_CHUNKS`` chunks:
decode sizes) gives the same outputs as the three-kernel head (histogram, chunk scan, group starts),
and both the reference's, on routings of 1 to 5 chunks (4 chunks is the last the small head takes),
with and without an expert map, with padding slots. On CPU the kernels run under Triton's
interpreter (conftest sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import moeref.dispatch as ref  # noqa: E402

import fastpath._dispatch_sort as sort_host  # noqa: E402  (the sort's host side, where the head is chosen)
import fastpath.dispatch as fast  # noqa: E402
from fastpath.testing import poisoned  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interp


def _outputs(ids, x, e, emap):
    i, h = torch.from_numpy(ids).to(DEVICE), torch.from_numpy(x).to(DEVICE)
    al = fast.moe_align_block_size(i, 16, e, emap, validate=False)
    p = fast.moe_permute(h, i, e, emap, validate=False)
    c = fast.to_contiguous(h, i, e, 8, emap, m_sum="worst_case", validate=False)
    m = fast.to_masked(h, i, e, ids.shape[0], emap, expected_m=3, validate=False)
    return {"align.sorted": al.sorted_token_ids, "align.blocks": al.expert_ids, "align.post": al.num_tokens_post_padded,
            "perm.hidden": p.hidden, "perm.offsets": p.expert_first_token_offset, "perm.idx": p.permuted_idx,
            "perm.inv": p.inv_permuted_idx, "cont.a": c.a, "cont.m": c.m_indices, "cont.src": c.src, "cont.psum": c.psum,
            "mask.a": m.a, "mask.m": m.masked_m, "mask.src": m.src}


@pytest.mark.parametrize("slots", [3, 128, 400, 512, 520])
@pytest.mark.parametrize("with_map", [False, True])
def test_small_and_three_kernel_sort_heads_agree_with_the_reference(monkeypatch, slots, with_map):
    e, k = 12, 4
    m = -(-slots // k)
    rng = np.random.default_rng(slots)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    ids[rng.random(m) < 0.1, 1:] = -1  # padding slots
    x = rng.standard_normal((m, 6)).astype(np.float32)
    emap = np.where(np.arange(e) % 3 == 0, -1, np.cumsum(np.arange(e) % 3 != 0) - 1).astype(np.int32) if with_map else None
    chunks = -(-(m * k) // fast.CHUNK)
    calls = []

    class Counted:  # the one-program head, counted (so the test knows which head ran)
        def __getitem__(self, grid, kernel=sort_host._small_sort_kernel):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(sort_host, "_small_sort_kernel", Counted())
    with poisoned():
        small = _outputs(ids, x, e, emap)
        n_small = len(calls)
        monkeypatch.setattr(sort_host, "SMALL_SORT_CHUNKS", 0)
        big = _outputs(ids, x, e, emap)
    assert n_small == (4 if chunks <= 4 else 0) and len(calls) == n_small  # 4 calls: one per sort
    for name in small:
        assert torch.equal(small[name].cpu(), big[name].cpu()), f"{name}: the two sort heads differ ({chunks} chunks)"
    want = ref.moe_permute(x, ids, e, emap)
    np.testing.assert_array_equal(small["perm.inv"].cpu().numpy(), want.inv_permuted_idx)
    np.testing.assert_array_equal(small["perm.hidden"].cpu().numpy(), want.hidden)
    wm = ref.to_masked(x, ids, e, m, emap)
    np.testing.assert_array_equal(small["mask.src"].cpu().numpy(), wm.src)
    np.testing.assert_array_equal(small["mask.a"].cpu().numpy(), wm.a)
    wa = ref.moe_align_block_size(ids, 16, e, emap)
    np.testing.assert_array_equal(small["align.sorted"].cpu().numpy(), wa.sorted_token_ids)
    np.testing.assert_array_equal(small["align.blocks"].cpu().numpy(), wa.expert_ids)
