"""fastpath._host.launch: the cached launch runs what ``kernel[grid](...)`` runs (issue 20).

The cache key must separate every launch Triton would compile differently (constexprs and options by
value, tensors by dtype and 16-byte alignment, ints by == 1, divisibility by 16 and width), so the
GPU test launches one kernel with arguments that cross each of those lines, twice each (the second
launch is a cache hit), and compares with ``kernel[grid]`` element for element; it also checks that
the second call of a key was served from the cache. The CPU tests check the key and the interpreter's
fallback."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fastpath import _host as H  # noqa: E402


@triton.jit
def _axpb_kernel(x_ptr, o_ptr, n, a, b, BLOCK: tl.constexpr, NEG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0).to(tl.float32) * a + b
    if NEG:
        v = -v
    tl.store(o_ptr + offs, v.to(o_ptr.dtype.element_ty), mask=m)


def test_key_separates_what_triton_specializes():
    k = H._arg_key
    assert k(1) != k(2) and k(16) != k(17) and k(2) == k(3)  # == 1, % 16
    assert k(2**31) != k(2**31 - 16) and k(2**63) != k(2**63 - 16)  # int32 / int64 / wider
    assert k(1.0) != k(1) and k(True) != k(1) and k(None) != k(0)
    x = torch.zeros(8, dtype=torch.float32)
    assert k(x) != k(x.to(torch.float16)) and k(x) != k(x[1:])  # dtype, 16-byte alignment
    with pytest.raises(TypeError):
        k(object())


def test_without_device_caches_every_call_goes_through_kernel_getitem():
    calls = []

    class Fake:  # an interpreted kernel has no device caches
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    H.launch(Fake(), (3,), 1, 2, BLOCK=4)
    H.launch(Fake(), (3,), 1, 2, BLOCK=4)
    assert calls == [((3,), (1, 2), {"BLOCK": 4})] * 2


def test_first_launch_of_a_key_is_kept_and_a_hit_runs_the_compiled_kernel(monkeypatch):
    """The cached path without a GPU: a fake jit kernel (device caches, parameters) whose ``kernel[grid]``
    returns a fake compiled kernel. The first call of a key launches through ``kernel[grid]`` and keeps
    the compiled kernel with the values of the parameters after the positional ones (given by name or
    defaulted); the second calls its ``run`` with the grid, the stream and those values; with a launch
    hook installed nothing is kept."""
    from types import SimpleNamespace as NS

    runs, getitems = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            runs.append(a)

    class Kernel:
        device_caches = {}
        params = [NS(name="x", is_constexpr=False, default=None), NS(name="n", is_constexpr=False, default=None),
                  NS(name="BLOCK", is_constexpr=True, default=None), NS(name="NEG", is_constexpr=True, default=False)]

        def __getitem__(self, grid):
            def call(*a, **kw):
                getitems.append((grid, a, kw))
                return Compiled()
            return call

    class Stream:
        @staticmethod
        def get_current_stream(device):
            return "stream"

    hooks = NS(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(H, "_RUNTIME", [hooks, NS(active=Stream)])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(H, "_LAUNCH_CACHE", {})
    kernel, x = Kernel(), torch.zeros(4)
    H.launch(kernel, (3,), x, 4, BLOCK=8)  # a miss: kernel[grid], the compiled kernel kept
    assert getitems == [((3,), (x, 4), {"BLOCK": 8})] and runs == []
    H.launch(kernel, (3,), x, 4, BLOCK=8)  # a hit: run(grid, stream, ..., args, BLOCK, NEG default)
    assert len(getitems) == 1 and runs == [(3, 1, 1, "stream", "fn", "meta", None, None, None, x, 4, 8, False)]
    hooks.launch_enter_hook = lambda *a: None  # a profiler: every launch through kernel[grid], none kept
    H._LAUNCH_CACHE.clear()
    H.launch(kernel, (3,), x, 4, BLOCK=8)
    H.launch(kernel, (3,), x, 4, BLOCK=8)
    assert len(getitems) == 3 and len(runs) == 1 and not H._LAUNCH_CACHE


@pytest.mark.gpu
def test_cached_launch_equals_kernel_getitem():
    base = torch.randn(4096 + 8, device="cuda")
    cases = []
    for off in (0, 1, 4):  # 16-byte aligned, not, aligned again
        for n in (1, 17, 32, 4096):  # == 1, odd, % 16
            for neg in (False, True):
                for a, b in ((2.0, 0.5), (-1.0, 3.0)):
                    cases.append((off, n, neg, a, b))
    H._LAUNCH_CACHE.clear()
    for off, n, neg, a, b in cases:
        x = base[off: off + n]
        want = torch.full((n,), float("nan"), device="cuda")
        _axpb_kernel[(triton.cdiv(n, 128),)](x, want, n, a, b, BLOCK=128, NEG=neg)
        for _ in range(2):  # the second launch of a key is served from the cache
            got = torch.full((n,), float("nan"), device="cuda")
            H.launch(_axpb_kernel, (triton.cdiv(n, 128),), x, got, n, a, b, BLOCK=128, NEG=neg)
            assert torch.equal(got, want), (off, n, neg, a, b)
    keys = [k_ for k_ in H._LAUNCH_CACHE if k_[0] is _axpb_kernel]
    # keys: alignment (2 classes) x n (== 1, odd, % 16 twice: 3 classes) x NEG (2); a, b are floats
    assert len(keys) == 2 * 3 * 2
    # half precision output: another dtype, another key and kernel
    y = torch.empty(32, device="cuda", dtype=torch.float16)
    H.launch(_axpb_kernel, (1,), base[:32], y, 32, 2.0, 0.5, BLOCK=128, NEG=False)
    assert torch.equal(y, (base[:32] * 2.0 + 0.5).half())
