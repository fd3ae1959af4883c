"""fastpath.dispatch's one-program capacity layout (``SMALL_CAPACITY_FUSED``: sort, rank and fill in
``_small_capacity_kernel``, one launch instead of three, for the decode step's masked layout) gives the outputs
of the three launches and the reference's, and runs exactly where it applies: a capacity given (no host sync),
no token rows, ``0 < M * k <= capacity`` slots in at most ``SMALL_SORT_CHUNKS`` chunks. On CPU the kernels run
under Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import moeref.dispatch as ref  # noqa: E402

import fastpath._dispatch_sort as sort_host  # noqa: E402
import fastpath.dispatch as fast  # noqa: E402
from fastpath.testing import poisoned  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interp


def _counted_launches(monkeypatch, name: str) -> list:
    """The grids of every launch of ``fastpath._dispatch_sort``'s kernel ``name`` from now on (each still runs)."""
    calls = []

    class Counted:
        def __getitem__(self, grid, kernel=getattr(sort_host, name)):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(sort_host, name, Counted())
    return calls


@pytest.fixture
def fused_launches(monkeypatch):
    """The grids of ``_small_capacity_kernel`` launches while the fused path is on."""
    calls = _counted_launches(monkeypatch, "_small_capacity_kernel")
    monkeypatch.setattr(sort_host, "SMALL_CAPACITY_FUSED", True)
    monkeypatch.setattr(sort_host, "DECODE_CAPACITY_SLOTS", 0)  # the one-program kernel alone
    return calls


@pytest.fixture
def decode_launches(monkeypatch):
    """The grids of ``_decode_capacity_kernel`` launches (on by default up to ``DECODE_CAPACITY_SLOTS``)."""
    calls = _counted_launches(monkeypatch, "_decode_capacity_kernel")
    monkeypatch.setattr(sort_host, "SMALL_CAPACITY_FUSED", False)
    assert sort_host.DECODE_CAPACITY_SLOTS == 64  # the shipped bound: 8 tokens of top-8
    return calls


def _ids(m, k, e, seed, repeat=False):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    if m > 1:
        ids[rng.random(m) < 0.2, 0] = -1  # padding slots
    if repeat:
        ids[0, :] = ids[0, 1] if ids[0, 1] >= 0 else 3  # one token naming one expert k times
    return ids


def _masked(ids, e, cap, emap=None):
    i = torch.from_numpy(ids).to(DEVICE)
    lay, dst = fast.to_masked(None, i, e, cap, emap, expected_m=1, validate=False, slot_rows=True)
    return lay, dst


@pytest.mark.parametrize("m,k,e,cap,repeat,with_map", [
    (1, 8, 256, 16, False, False),  # the DeepSeek-V3 decode step: 8 slots, 16-row capacity
    (1, 8, 20, 8, True, False),  # all eight slots on one expert: exactly the capacity
    (5, 4, 12, 20, False, True),
    (64, 8, 40, 512, True, False),  # 512 slots: four chunks, the last the fused path takes
])
def test_one_program_gives_the_three_launches_outputs(fused_launches, monkeypatch, m, k, e, cap, repeat, with_map):
    ids = _ids(m, k, e, seed=m * 7 + e, repeat=repeat)
    emap = None
    if with_map:
        emap = np.where(np.arange(e) % 3 == 0, -1, np.cumsum(np.arange(e) % 3 != 0) - 1).astype(np.int32)
    with poisoned():
        lay, dst = _masked(ids, e, cap, emap)
        assert len(fused_launches) == 1
        monkeypatch.setattr(sort_host, "SMALL_CAPACITY_FUSED", False)
        want, want_dst = _masked(ids, e, cap, emap)  # three launches (DECODE_CAPACITY_SLOTS is 0 here)
    assert len(fused_launches) == 1
    for got, exp in ((lay.masked_m, want.masked_m), (lay.src, want.src), (dst, want_dst)):
        assert torch.equal(got.cpu(), exp.cpu())
    # an independent statement: the reference's masked layout (rows in slot order per local expert)
    r = ref.to_masked(None, ids, e, cap, emap)
    np.testing.assert_array_equal(lay.src.cpu().numpy(), r.src)
    np.testing.assert_array_equal(lay.masked_m.cpu().numpy(), r.masked_m)
    flat = lay.src.reshape(-1).cpu().numpy()
    d = dst.cpu().numpy()
    assert np.array_equal(flat[d[d >= 0]], np.flatnonzero(d >= 0))  # dst inverts src


def test_taken_only_where_it_applies(fused_launches):
    i = torch.from_numpy(_ids(4, 8, 64, seed=1)).to(DEVICE)
    fast.to_masked(None, i, 64, 31, expected_m=1, validate=False)  # 32 slots over a capacity of 31
    fast.to_masked(torch.zeros((4, 8), device=DEVICE), i, 64, 32, expected_m=1, validate=False)  # token rows
    fast.to_masked(None, i, 64, 32, validate=False)  # no expected_m: capacity checked on the host
    big = torch.from_numpy(_ids(65, 8, 64, seed=2)).to(DEVICE)  # 520 slots: five chunks
    fast.to_masked(None, big, 64, 520, expected_m=1, validate=False)
    assert fused_launches == []
    fast.to_masked(None, i, 64, 32, expected_m=1, validate=False)
    b = fast.to_batched(None, i, 64, 32, validate=False)  # the batched layout: the same capacity path
    assert len(fused_launches) == 2
    np.testing.assert_array_equal(b.expert_num_tokens.cpu().numpy(),
                                  ref.to_batched(None, i.cpu().numpy(), 64, 32).expert_num_tokens)


def _emap(e):
    return np.where(np.arange(e) % 3 == 0, -1, np.cumsum(np.arange(e) % 3 != 0) - 1).astype(np.int32)


@pytest.mark.parametrize("m,k,e,cap,repeat,with_map", [
    (1, 8, 256, 16, False, False),  # the DeepSeek-V3 decode step: 8 slots, 16-row capacity
    (1, 8, 20, 8, True, False),  # all eight slots on one expert: exactly the capacity
    (5, 4, 12, 20, False, True),  # an expert map: non-local slots absent
    (8, 8, 256, 64, True, True),  # 64 slots, the bound; a token repeating an expert
    (3, 8, 7, 24, False, False),  # more slots than experts: full experts
    (2, 1, 5, 2, False, False),  # top-1, 2 slots
    (8, 8, 256, 16, False, False),  # the layer at 8 tokens: 64 slots over a 16-row capacity (checked on the device)
])
def test_decode_kernel_gives_the_three_launches_and_the_reference(decode_launches, monkeypatch, m, k, e, cap,
                                                                    repeat, with_map):
    ids = _ids(m, k, e, seed=m * 11 + e + k, repeat=repeat)
    if m == 3:
        ids = np.random.default_rng(5).integers(-1, e, size=(m, k)).astype(np.int32)  # repeats, padding
    emap = _emap(e) if with_map else None
    with poisoned():  # every output element must be written
        lay, dst = _masked(ids, e, cap, emap)
        assert len(decode_launches) == 1
        monkeypatch.setattr(sort_host, "DECODE_CAPACITY_SLOTS", 0)
        want, want_dst = _masked(ids, e, cap, emap)  # the sort, rank and fill launches
    assert len(decode_launches) == 1
    for got, exp in ((lay.masked_m, want.masked_m), (lay.src, want.src), (dst, want_dst)):
        assert got.dtype == exp.dtype and torch.equal(got.cpu(), exp.cpu())
    r = ref.to_masked(None, ids, e, cap, emap)  # the independent statement
    np.testing.assert_array_equal(lay.src.cpu().numpy(), r.src)
    np.testing.assert_array_equal(lay.masked_m.cpu().numpy(), r.masked_m)
    flat = lay.src.reshape(-1).cpu().numpy()
    d = dst.cpu().numpy()
    assert np.array_equal(flat[d[d >= 0]], np.flatnonzero(d >= 0))  # dst inverts src
    assert (d >= 0).sum() == r.masked_m.sum()  # absent slots: -1


def test_decode_kernel_taken_only_where_it_applies(decode_launches):
    i = torch.from_numpy(_ids(4, 8, 64, seed=1)).to(DEVICE)
    fast.to_masked(torch.zeros((4, 8), device=DEVICE), i, 64, 32, expected_m=1, validate=False)  # token rows
    fast.to_masked(None, i, 64, 32, validate=False)  # no expected_m: capacity checked on the host
    nine = torch.from_numpy(_ids(9, 8, 64, seed=3)).to(DEVICE)  # 72 slots: over the bound
    got = fast.to_masked(None, nine, 64, 80, expected_m=1, validate=False)
    assert decode_launches == []
    np.testing.assert_array_equal(got.src.cpu().numpy(), ref.to_masked(None, nine.cpu().numpy(), 64, 80).src)
    fast.to_masked(None, i, 64, 32, expected_m=1, validate=False)
    b = fast.to_batched(None, i, 64, 32, validate=False)  # the batched layout: the same capacity path
    assert len(decode_launches) == 2
    want = ref.to_batched(None, i.cpu().numpy(), 64, 32)
    np.testing.assert_array_equal(b.expert_num_tokens.cpu().numpy(), want.expert_num_tokens)
    np.testing.assert_array_equal(b.src.cpu().numpy(), want.src)


@pytest.mark.skipif(DEVICE != "cpu", reason="a device-side assert ends the CUDA context (test_fastpath_masked_nosync "
                                            "checks it in a child process)")
def test_decode_kernel_overflow_is_caught_on_the_device(decode_launches):
    """3 tokens naming expert 1 five times in all, capacity 3: the decode kernel runs, its fits flag is 0 and the
    device-side check raises (CPU: RuntimeError); with capacity 5 every slot has its row, in slot order
    (hand-derived)."""
    rep = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="more rows than max_m=3"):
        fast.to_masked(None, rep, 2, 3, expected_m=1, validate=False)
    assert len(decode_launches) == 1
    got = fast.to_masked(None, rep, 2, 5, expected_m=1, validate=False)
    assert got.masked_m.tolist() == [1, 5] and got.src.tolist() == [[3, -1, -1, -1, -1], [0, 1, 2, 4, 5]]
