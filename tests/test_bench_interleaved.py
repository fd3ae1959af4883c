"""bench/interleaved.py: the statistics, the per-round ratios, the flagging and the round order,
checked with a deterministic fake clock (each case advances fake time by a scripted duration).
Expected values are worked out by hand from the scripted durations."""
from __future__ import annotations

import json

import pytest

from bench import interleaved  # the repository root is on sys.path (conftest.py)


class FakeTime:
    def __init__(self):
        self.t = 0.0
        self.log: list[str] = []

    def now(self) -> float:
        return self.t

    def case(self, name: str, durations):
        """A callable that, at its i-th call, advances fake time by durations[i] and logs its name."""
        it = iter(durations)

        def fn():
            self.log.append(name)
            self.t += next(it)
        return fn


def _run(script, baselines, **kw):
    ft = FakeTime()
    cases = {n: ft.case(n, d) for n, d in script.items()}
    res = interleaved.time_interleaved(cases, baselines=baselines, clock=interleaved.WallClock(ft.now), **kw)
    return res, ft


def test_statistics_ratios_and_flag():
    # warm-up call first (100: must not count), then one duration per round (integers: exact floats)
    kernel = [100, 10, 11, 9, 10, 12, 10, 10]       # median 10, min 9, max 12, spread 0.3 -> flagged
    copy = [100, 20, 20, 20, 20, 20, 20, 20]        # spread 0
    eager = [100, 40, 44, 36, 40, 48, 40, 40]       # slow exactly when the kernel is: ratio 4 each round
    res, _ = _run({"kernel": kernel, "copy": copy, "eager": eager}, ["copy", "eager"])
    k = res.cases["kernel"]
    assert k.seconds == (10, 11, 9, 10, 12, 10, 10)
    assert (k.median_s, k.min_s, k.max_s) == (10, 9, 12)
    assert k.spread == pytest.approx(0.3, abs=0) and k.flagged
    c = res.cases["copy"]
    assert (c.median_s, c.spread, c.flagged) == (20, 0, False)
    assert res.cases["eager"].flagged  # (48 - 36) / 40 = 0.3
    assert res.flagged == ["kernel", "eager"]
    r_copy = res.ratios["kernel"]["copy"]
    assert r_copy.per_round == (2, 20 / 11, 20 / 9, 2, 20 / 12, 2, 2) and r_copy.median == 2
    r_eager = res.ratios["kernel"]["eager"]
    assert r_eager.per_round == (4,) * 7 and r_eager.median == 4
    assert set(res.ratios) == {"kernel"}  # baselines get no ratios of their own
    assert res.rounds == 7 and res.clock == "perf_counter"


def test_per_round_ratio_differs_from_ratio_of_medians():
    # rounds 5-7 are a slow moment for both (x2); the baseline is also slow in round 4 alone.
    # Per-round ratios 2, 2, 2, 4, 2, 2, 2 -> median 2; the ratio of the medians would say 40 / 10 = 4.
    kernel = [0, 10, 10, 10, 10, 20, 20, 20]
    base = [0, 20, 20, 20, 40, 40, 40, 40]
    res, _ = _run({"k": kernel, "b": base}, ["b"])
    assert res.ratios["k"]["b"].per_round == (2, 2, 2, 4, 2, 2, 2)
    assert res.ratios["k"]["b"].median == 2
    assert res.cases["k"].median_s == 10 and res.cases["b"].median_s == 40
    assert res.cases["k"].spread == 1.0 and res.cases["k"].flagged


def test_flag_threshold_is_strict_and_configurable():
    at = [0] + [10] * 6 + [11]          # spread exactly 0.1: not flagged
    above = [0] + [10] * 6 + [12]       # spread 0.2
    res, _ = _run({"at": at, "above": above}, [])
    assert res.cases["at"].spread == 0.1 and not res.cases["at"].flagged
    assert res.cases["above"].flagged
    res, _ = _run({"at": at, "above": above}, [], flag_spread=0.25)
    assert res.flagged == []


def test_rounds_rotate_the_order_and_calls_per_round_average():
    script = {"a": [1] * 100, "b": [1] * 100, "c": [3] * 100}
    res, ft = _run(script, ["c"], rounds=7, calls_per_round={"a": 2, "b": 1, "c": 1}, warmup=1)
    timed = ft.log[3:]  # after one warm-up call each
    expected = []
    for r in range(7):
        for n in (["a", "b", "c"] * 2)[r % 3: r % 3 + 3]:
            expected += [n] * (2 if n == "a" else 1)
    assert timed == expected
    assert res.cases["a"].seconds == (1,) * 7  # two calls of 1 each: 1 per call
    assert res.ratios["a"]["c"].median == 3 and res.calls_per_round == {"a": 2, "b": 1, "c": 1}


def test_result_is_json_serialisable():
    res, _ = _run({"k": [1] * 8, "b": [2] * 8}, ["b"])
    back = json.loads(json.dumps(res.to_json()))
    assert back["cases"]["k"]["median_s"] == 1 and back["ratios"]["k"]["b"]["median"] == 2
    assert back["cases"]["k"]["flagged"] is False and back["rounds"] == 7


@pytest.mark.parametrize("kw, match", [
    (dict(rounds=6), "rounds must be an int >= 7"),
    (dict(baselines=["nope"]), r"baselines \['nope'\] are not among the cases"),
    (dict(calls_per_round=0), "calls_per_round must be positive"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        interleaved.time_interleaved({"k": lambda: None}, clock=interleaved.WallClock(lambda: 0.0), **kw)
    with pytest.raises(ValueError, match="cases is empty"):
        interleaved.time_interleaved({})


def test_layer_benchmark_refuses_too_few_rounds_before_setup(capsys):
    """bench_moe_device's layer timings run on time_interleaved: --rounds below MIN_ROUNDS is an argument
    error at parse time (no GPU needed), not a crash after minutes of setup."""
    from bench import bench_moe_device as bench
    with pytest.raises(SystemExit) as e:
        bench.main(["--fast-only", "--rounds", str(interleaved.MIN_ROUNDS - 1)])
    assert e.value.code == 2 and f"at least {interleaved.MIN_ROUNDS} rounds" in capsys.readouterr().err
