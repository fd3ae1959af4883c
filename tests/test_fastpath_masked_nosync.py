"""fastpath.dispatch.to_masked with ``expected_m`` given: no host sync (the counts never come to the
host), the same layout as the NumPy reference, and clear errors where the buffers would depend on the
data, or a device-side check where a token repeating an expert could overflow. On CPU the kernels
run under Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import moeref.dispatch as ref  # noqa: E402

import fastpath.dispatch as fast  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interp


def _no_host_counts(_s):
    raise AssertionError("to_masked brought the expert counts to the host (a sync)")


def _routing(seed, m=13, e=6, k=3, pad_rows=(2,)):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    for r in pad_rows:
        ids[r, 1:] = -1
    x = rng.standard_normal((m, 5)).astype(np.float32)
    return ids, x


@pytest.mark.parametrize("emap", [None, np.array([-1, 0, 1, -1, 2, 3], dtype=np.int32)])
def test_expected_m_given_means_no_host_sync_and_the_reference_layout(monkeypatch, emap):
    ids, x = _routing(0)
    m = ids.shape[0]
    monkeypatch.setattr(fast, "_host_counts", _no_host_counts)
    for max_m in (m, m + 3):
        got = fast.to_masked(torch.from_numpy(x).to(DEVICE), torch.from_numpy(ids).to(DEVICE), 6, max_m, emap,
                             expected_m=7, validate=False)
        want = ref.to_masked(x, ids, 6, max_m, emap)
        np.testing.assert_array_equal(got.a.cpu().numpy(), want.a)
        np.testing.assert_array_equal(got.masked_m.cpu().numpy(), want.masked_m)
        np.testing.assert_array_equal(got.src.cpu().numpy(), want.src)
        assert got.expected_m == 7 and got.max_m == max_m
    # and the sync is really what the default path takes: it reaches _host_counts
    with pytest.raises(AssertionError, match="sync"):
        fast.to_masked(None, torch.from_numpy(ids).to(DEVICE), 6, m, emap, validate=False)


def test_default_path_unchanged():
    ids, _ = _routing(1, pad_rows=())
    got = fast.to_masked(None, torch.from_numpy(ids).to(DEVICE), 6)
    want = ref.to_masked(None, ids, 6)
    assert got.expected_m == want.expected_m == 7  # ceil(13 * 3 / 6): hand count
    np.testing.assert_array_equal(got.src.cpu().numpy(), want.src)


def test_repeated_expert_overflow_is_caught_without_a_host_sync(monkeypatch):
    """A token repeating an expert (accepted by the topk_ids contract) can put more rows on one expert
    than there are tokens: 3 tokens, expert 1 picked twice by tokens 0 and 2 -> 5 rows > max_m = 3.
    On the CPU the device-side check raises RuntimeError; with max_m = 5 (enough) each slot is a row."""
    ids = np.array([[1, 1], [1, 0], [1, 1]], dtype=np.int32)
    monkeypatch.setattr(fast, "_host_counts", _no_host_counts)
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="more rows than max_m=3"):
            fast.to_masked(None, torch.from_numpy(ids).to(DEVICE), 2, 3, expected_m=1, validate=False)
    else:  # a device-side assert ends the CUDA context: triggered in a child process
        _assert_overflow_kills_a_child_process()
    got = fast.to_masked(None, torch.from_numpy(ids).to(DEVICE), 2, 5, expected_m=1, validate=False)
    # each slot t*k+j its own row, in slot order (moeref.routing.ids): hand-derived
    assert got.masked_m.cpu().tolist() == [1, 5]
    assert got.src.cpu().tolist() == [[3, -1, -1, -1, -1], [0, 1, 2, 4, 5]]


_CHILD = """
import sys, torch
sys.path.insert(0, {root!r})
import fastpath.dispatch as fast
ids = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.int32, device="cuda")
fast.to_masked(None, ids, 2, 3, expected_m=1, validate=False)
torch.cuda.synchronize()
print("NO ASSERT")
"""


def _assert_overflow_kills_a_child_process():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _CHILD.format(root=root)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "NO ASSERT" not in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "device-side assert" in r.stderr or "Assertion" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("kw, err, match", [
    (dict(expected_m=4), ValueError, r"needs max_m >= the number of tokens 13.*max_m=None"),
    (dict(expected_m=4, max_m=12), ValueError, r"needs max_m >= the number of tokens 13.*max_m=12"),
    (dict(expected_m=0, max_m=13), ValueError, "expected_m must be > 0; got 0"),
    (dict(expected_m=2.0, max_m=13), TypeError, "expected_m must be an int; got float"),
    (dict(expected_m=True, max_m=13), TypeError, "expected_m must be an int; got bool"),
])
def test_expected_m_errors(monkeypatch, kw, err, match):
    ids, _ = _routing(2)
    monkeypatch.setattr(fast, "_host_counts", _no_host_counts)
    with pytest.raises(err, match=match):
        fast.to_masked(None, torch.from_numpy(ids).to(DEVICE), 6, validate=False, **kw)


@pytest.mark.gpu
def test_gpu_to_masked_with_expected_m_is_captured_in_a_cuda_graph():
    """The sync-free call captured in a CUDA graph, then replayed on new routing ids written into the
    captured input: the replay's layout equals the reference's for the new ids."""
    ids0, x0 = _routing(3, m=64, e=16, k=4)
    ids1, x1 = _routing(4, m=64, e=16, k=4)
    ids_t = torch.from_numpy(ids0).cuda()
    x_t = torch.from_numpy(x0).cuda()
    fast.to_masked(x_t, ids_t, 16, 64, expected_m=16, validate=False)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fast.to_masked(x_t, ids_t, 16, 64, expected_m=16, validate=False)
    ids_t.copy_(torch.from_numpy(ids1))
    x_t.copy_(torch.from_numpy(x1))
    g.replay()
    torch.cuda.synchronize()
    want = ref.to_masked(x1, ids1, 16, 64)
    np.testing.assert_array_equal(out.masked_m.cpu().numpy(), want.masked_m)
    np.testing.assert_array_equal(out.src.cpu().numpy(), want.src)
    np.testing.assert_array_equal(out.a.cpu().numpy(), want.a)


def test_to_batched_without_validation_needs_no_host_sync(monkeypatch):
    """validate=False: the counts never come to the host; the layout is the reference's (distinct
    experts per row: no overflow possible), and a token repeating an expert past the capacity is
    caught on the device (CPU: RuntimeError) instead of the host's ValueError."""
    ids, x = _routing(5)
    m = ids.shape[0]
    monkeypatch.setattr(fast, "_host_counts", _no_host_counts)
    got = fast.to_batched(torch.from_numpy(x).to(DEVICE), torch.from_numpy(ids).to(DEVICE), 6, m, 1, validate=False)
    want = ref.to_batched(x, ids, 6, m, 1)
    for name in ("a", "expert_num_tokens", "src"):
        np.testing.assert_array_equal(getattr(got, name).cpu().numpy(), getattr(want, name))
    rep = np.array([[1, 1], [1, 0], [1, 1]], dtype=np.int32)  # expert 1: 5 rows > capacity 3
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="to_batched: a local expert has more rows than"):
            fast.to_batched(None, torch.from_numpy(rep), 2, 3, 1, validate=False)
    got = fast.to_batched(None, torch.from_numpy(rep).to(DEVICE), 2, 5, 1, validate=False)
    assert got.expert_num_tokens.cpu().tolist() == [1, 5]  # hand count
