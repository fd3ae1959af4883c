"""The dispatch fast paths' launch plans on a GPU (issue 20): for every dispatch case of
``bench/latency_cases.py`` at M = 1, 64 and 512, with every output buffer poisoned, the recorded call,
the replayed call (``CompiledKernel.run`` with computed addresses) and the ordinary call
(``kernel[grid]``, plans and the launch cache off) give the same bytes. GPU only (compiled kernels);
the CPU test ``test_fastpath_launch_plan.py`` checks the replayed arguments themselves."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import fastpath._launch_plan as P  # noqa: E402
from bench.latency_cases import bits_equal, dispatch_cases, tensors, uncached  # noqa: E402
from fastpath.testing import poisoned  # noqa: E402

pytestmark = pytest.mark.gpu

_NAMES = [c.name for c in dispatch_cases("cpu")]


@pytest.mark.parametrize("M", [1, 64, 512])
@pytest.mark.parametrize("name", _NAMES)
def test_recorded_replayed_and_ordinary_calls_agree(name, M):
    case = next(c for c in dispatch_cases("cuda") if c.name == name)
    state = case.make(M)
    P._PLANS.clear()
    with poisoned():
        first = tensors(case.fast(state))
        n_plans = sum(v != P._NO_PLAN for v in P._PLANS.values())
        second = tensors(case.fast(state))
        with uncached():
            ordinary = tensors(case.fast(state))
    torch.cuda.synchronize()
    assert n_plans >= 1, "the call kept no launch plan: the replay was not exercised"
    assert len(first) == len(second) == len(ordinary) > 0
    for i, (a, b, c) in enumerate(zip(first, second, ordinary)):
        assert bits_equal(a, b), f"{name} M={M}: output {i}: the replay differs from the recorded call"
        assert bits_equal(a, c), f"{name} M={M}: output {i}: the ordinary call differs from the recorded call"
