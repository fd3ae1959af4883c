"""Launch plans of the dispatch fast paths (``fastpath._launch_plan``, issue 20).

On the CPU no compiled kernel exists (the interpreter), so the replay is checked on what it would
launch: ``launch_for_replay`` is replaced by one that hands out a fake compiled kernel whose ``run``
logs its arguments. For every dispatch case of ``bench/latency_cases.py`` at M = 1, 64 and 512 (one
sort program, its last size, the three-kernel sort head), a call is recorded, a second call
replayed, and the same second call made the ordinary way (``kernel[grid]`` path, plans off) on the
very same buffers: each launch must match, kernel by kernel, grid, scalars and constexprs, and every
pointer the replay computes (``base.data_ptr() + offset``) must equal the ``data_ptr()`` of the
tensor the ordinary path passes. The GPU test (``test_fastpath_launch_plan_gpu.py``) runs the kernels.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import fastpath._host as H  # noqa: E402
import fastpath._dispatch_finalize as D  # noqa: E402
import fastpath._dispatch_sort as S  # noqa: E402
import fastpath._launch_plan as P  # noqa: E402
import fastpath.dispatch as F  # noqa: E402
from bench.latency_cases import dispatch_cases  # noqa: E402
from fastpath._launch_plan import Layout  # noqa: E402

pytestmark = pytest.mark.interp


def test_layout_sections_are_16_byte_aligned_and_outputs_are_their_slices():
    lay = Layout([("a", 5), ("b", 3), ("c", 8), ("d", 1)], outs=[("a", 0, 5), ("c", 2, 3)])
    assert lay.secs == {"a": (0, 5), "b": (8, 3), "c": (12, 8), "d": (20, 1)}  # offsets by hand: 5->8, 3->4
    assert lay.total == 24
    ws = torch.arange(lay.total, dtype=torch.int32)
    a, c = lay.outputs(ws)
    assert a.tolist() == [0, 1, 2, 3, 4] and c.tolist() == [14, 15, 16]
    assert lay.view(ws, "d").tolist() == [20]
    assert lay.view(ws, "c", torch.int64).numel() == 4
    with pytest.raises(ValueError, match="out of order"):
        Layout([("a", 4), ("b", 4)], outs=[("b", 0, 1), ("a", 0, 1)])
    with pytest.raises(ValueError, match="out of its section"):
        Layout([("a", 4)], outs=[("a", 2, 3)])


class _Fake:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.function = self.packed_metadata = None

    def run(self, g0, g1, g2, stream, function, meta, lm, enter, exit_, *args):
        self.log.append((self.name, (g0, g1, g2), args))


def _norm(args):
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def _names(kernel):
    return kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__


@pytest.fixture
def fake_replay(monkeypatch):
    """Plans on CPU tensors, with fake compiled kernels (their ``run`` logs into ``log``)."""
    log = []
    pool = {"take": None, "given": []}

    def launch_for_replay(kernel, grid, *args, **kwargs):
        names = [p for p in kernel.fn.__code__.co_varnames[:kernel.fn.__code__.co_argcount]]
        tail = tuple(kwargs[n] for n in names[len(args):])
        return _Fake(_names(kernel), log), tail

    def ordinary(kernel, grid, *args, **kwargs):
        names = [p for p in kernel.fn.__code__.co_varnames[:kernel.fn.__code__.co_argcount]]
        tail = tuple(kwargs[n] for n in names[len(args):])
        g = tuple(grid) + (1, 1)
        log.append((_names(kernel), g[:3], _norm(args + tail)))

    def alloc(*shape, **kw):  # ones: the capacity check's flag reads "fits"; reused buffers on request
        if pool["take"] is not None:
            return pool["take"].pop(0)
        t = torch.ones(*shape, **kw)
        pool["given"].append(t)
        return t

    class _Driver:
        class active:
            @staticmethod
            def get_current_stream(device):
                return 0

    monkeypatch.setattr(H, "launch_for_replay", launch_for_replay)
    monkeypatch.setattr(S, "launch", ordinary)  # the launches of fastpath.dispatch go through S._launch
    for mod in (F, S, D):  # the public functions (F, D: finalize) and the sort's host side (S) read these
        monkeypatch.setattr(mod, "_cuda", lambda *ts: all(t is None or isinstance(t, torch.Tensor) for t in ts))
    for mod in (S, D):
        monkeypatch.setattr(mod, "_full", lambda shape, value, dtype, device:
                            alloc(shape, dtype=dtype, device=device).fill_(value))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(H, "_hooks_installed", lambda: False)
    monkeypatch.setattr(H, "_ALLOCATOR", alloc)
    monkeypatch.setattr(H, "_RUNTIME", [H._runtime()[0], _Driver])
    monkeypatch.setattr(P, "_PLANS", {})
    return log, pool


_CASES = {c.name: c for c in dispatch_cases("cpu", K=16)}


@pytest.mark.parametrize("M", [1, 64, 512])
@pytest.mark.parametrize("name", list(_CASES))
def test_replay_launches_what_the_ordinary_path_launches(fake_replay, monkeypatch, name, M):
    log, pool = fake_replay
    case = _CASES[name]
    state = case.make(M)
    P._PLANS.clear()
    case.fast(state)  # recorded
    assert any(v != P._NO_PLAN for v in P._PLANS.values()), "no plan was kept"
    log.clear()
    pool["given"].clear()
    case.fast(state)  # replayed
    replayed = list(log)
    given = list(pool["given"])
    assert replayed and given
    log.clear()
    pool["take"] = list(given)
    monkeypatch.setattr(H, "LAUNCH_CACHE_ON", False)  # plans off: the ordinary path, same buffers
    case.fast(state)
    assert pool["take"] == [], "the ordinary path allocated other buffers"
    ordinary = list(log)
    assert [r[:2] for r in replayed] == [o[:2] for o in ordinary]
    for (kname, _, got), (_, _, want) in zip(replayed, ordinary):
        assert len(got) == len(want), kname
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"{name} M={M}: {kname} argument {i}: replay {g!r}, ordinary {w!r}"
