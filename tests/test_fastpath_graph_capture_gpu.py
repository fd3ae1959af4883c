"""Every fast path is capturable in a CUDA graph (issue 20): each case of ``bench/latency_cases.py``
(every quantization and dispatch kernel, called as a decode step calls it: ``validate=False``) is
captured once, replayed, and the replay's outputs equal an eager call's bit for bit. Then new input
values are written into the captured inputs and the replay must follow them (equal to an eager call
on the new values): a graph that baked a host-side value of the data in would fail here.
GPU only: CUDA graphs need a CUDA device (skipped with the reason on the CPU)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from bench.latency_cases import all_cases, bits_equal, capture, tensors  # noqa: E402

pytestmark = pytest.mark.gpu

_NAMES = [c.name for c in all_cases("cpu")]


def _case(name):
    return next(c for c in all_cases("cuda") if c.name == name)


def _refill(state):
    """New values, same buffers: float inputs redrawn, routing ids rolled along each row (each token
    keeps its distinct experts, in another order: other slots, other rows)."""
    if isinstance(state, dict) and "ids" in state:
        state["ids"].copy_(torch.roll(state["ids"], 1, dims=1))
    items = state.values() if isinstance(state, dict) else state
    for t in items:
        if not torch.is_tensor(t):
            continue
        if t.is_floating_point() and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
            t.copy_(torch.randn_like(t) * 3)


@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("name", _NAMES)
def test_capture_and_replay_equal_eager_bit_for_bit(name, M):
    case = _case(name)
    state = case.make(M)
    fn = lambda: case.fast(state)  # noqa: E731
    g, out = capture(fn)
    g.replay()
    torch.cuda.synchronize()
    want = tensors(fn())
    got = tensors(out)
    assert len(got) == len(want) > 0
    for i, (a, b) in enumerate(zip(want, got)):
        assert bits_equal(a, b), f"{name} M={M}: output {i} of the replay differs from the eager call"
    # new data in the same buffers: the replay computes on it (nothing data-dependent was baked in)
    _refill(state)
    g.replay()
    torch.cuda.synchronize()
    want2 = tensors(fn())
    for i, (a, b) in enumerate(zip(want2, tensors(out))):
        assert bits_equal(a, b), f"{name} M={M}: output {i} of the replay on new data differs from eager"
