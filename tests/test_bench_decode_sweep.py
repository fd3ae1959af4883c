"""bench/studies/decode_graph_sweep.py: the per-replay kernel timeline it reads from the profiler's records
(CPU; the GPU run is the study itself)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")


def _replay(t0, kernels):
    return [(n, t0 + s, t0 + e) for n, s, e in kernels]


def test_timeline_cuts_replays_labels_stages_and_measures_gaps():
    from bench.studies.decode_graph_sweep import timeline

    # one replay: a1 quant on its branch overlapping the dispatch, then GEMM1, act, GEMM2, reduce
    one = [("_quant_kernel", 0.0, 3.0), ("_small_sort_kernel", 1.0, 2.0), ("_rank_kernel", 4.0, 5.0),
           ("_fill_kernel", 6.0, 7.5), ("_grouped_gemm_kernel", 9.0, 59.0), ("_quant_kernel", 60.0, 63.0),
           ("_grouped_gemm_kernel", 65.0, 95.0), ("_reduce_kernel", 97.0, 99.0)]
    # the second replay 1000 us later, every kernel after the first ending 1 us later (the median of two: +0.5)
    two = [(n, s, e + (1.0 if i else 0.0)) for i, (n, s, e) in enumerate(one)]
    t = timeline(_replay(0.0, one) + _replay(1000.0, two)[::-1])
    assert t["kernels_per_replay"] == 8 and t["replays"] == 2 and t["dropped"] == 0 and t["consistent"]
    assert [k["stage"] for k in t["kernels"]] == ["a1 quant", "dispatch", "dispatch", "dispatch", "GEMM1",
                                                  "act+requant", "GEMM2", "finalize"]
    # idle gaps, first replay: rank 4-3, fill 6-5, GEMM1 9-7.5, act 60-59, GEMM2 65-63, reduce 97-95: 8.5 us;
    # second: rank 4-3, fill 0, GEMM1 9-8.5, act 0, GEMM2 65-64, reduce 97-96: 3.5 us
    assert [k["gap_before_us"] for k in t["kernels"]] == pytest.approx([0, 0, 1, 0.5, 1, 0.5, 1.5, 1.5])
    assert t["span_us"] == pytest.approx((99.0 + 100.0) / 2)
    assert t["idle_us"] == pytest.approx((8.5 + 3.5) / 2)
    assert t["kernels"][4]["dur_us"] == pytest.approx(50.5)
    assert t["stage_us"]["dispatch"] == pytest.approx(1.0 + 1.0 + 1.5 + 1.5)
    # a replay with a kernel missing is dropped; one whose kernels come in another order is flagged
    t = timeline(_replay(0.0, one)[:-1] + _replay(1000.0, two) + _replay(2000.0, one))
    assert (t["replays"], t["dropped"], t["consistent"], t["span_us"]) == (2, 1, True, pytest.approx(99.5))
    # the branch starting the other way round in one replay: the same rows; another kernel: flagged
    swapped = [("_small_sort_kernel", 0.0, 1.0), ("_quant_kernel", 0.5, 3.0)] + one[2:]
    t = timeline(_replay(0.0, one) + _replay(1000.0, swapped) + _replay(2000.0, one))
    assert t["consistent"] and [k["stage"] for k in t["kernels"][:2]] == ["a1 quant", "dispatch"]
    assert [k["start_us"] for k in t["kernels"][:2]] == [0.0, 1.0]
    renamed = one[:3] + [("_other_fill_kernel", 6.0, 7.5)] + one[4:]
    assert not timeline(_replay(0.0, one) + _replay(1000.0, renamed))["consistent"]
    assert timeline(_replay(0.0, one[:1]) + _replay(50.0, one[:1]))["replays"] == 1  # 47 us apart: one replay
