"""bench/report_decode_ab.py, bench/report_gluon_probe.py and bench/report_layer_bound_cpu.py render their docs tables
from the benchmark JSON: every case measured is a row, in the JSON's order, a case whose bits differ says so, and
ratios are the medians and ranges of the rounds' own ratios."""
from __future__ import annotations

from bench import report_decode_ab, report_gluon_probe, report_layer_bound_cpu  # noqa: E402 (the repository root is on sys.path: conftest.py)


def _case(us: float, equal: bool) -> dict:
    return dict(median_us=us, min_us=us - 1, max_us=us + 1, of_roofline=80.0 / us, bits_equal=equal,
                one_call_graph=dict(median_us=us + 2, of_roofline=80.0 / (us + 2)))


def test_decode_ab_rows_follow_the_json_and_flag_other_bits():
    doc = dict(meta=dict(gpu="GPU X", date="2026-01-01 00:00 UTC", torch="t", triton="3.6.0", tree="abc"),
               args=dict(rounds=3, calls=4),
               decode_ab={"1": {"layout_equal": True, "first": _case(100.0, True), "second": _case(90.0, False),
                                "all_bits_equal": False, "calls_per_graph": 4},
                          "breakdown": {}})
    text = report_decode_ab.render([doc])
    rows = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert rows == ["| 1 | first | 100.0 (99.0-101.0) | 80% | 102.0 | 78% | yes |",
                    "| 1 | second | 90.0 (89.0-91.0) | 89% | 92.0 | 87% | **no** |"]
    assert "GPU X, 2026-01-01 00:00 UTC" in text and "graph of 4" in text


def test_gluon_probe_shows_the_newest_file_with_per_round_ratios_and_every_bit():
    def t(ms, equal_tma=True, equal_dg=False):
        return dict(median_ms=ms[1], ms=ms, tflops_routed_rows=100.0 / ms[1], bits_equal_tma=equal_tma,
                    bits_equal_deep_gemm=equal_dg, x_deep_gemm=0.5)  # x_deep_gemm: the probe's own median, shown

    dg1, dg2 = [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]
    v1 = (t([4.0, 4.0, 4.0], equal_dg=True), t([2.0, 2.0, 2.0], equal_dg=True))
    v2 = (t([2.0, 3.0, 4.0]), t([1.0, 1.0, 2.0]))  # rounds: 3/3, 3/4, 3/6 of DeepGEMM's 3 -> median 0.75
    run = dict(gpu="GPU X", date="2026-01-02", torch="t", head="abc", command="python3 probe.py", note="A note",
               bits={"v1: k7168 n512": True, "v2: k7168 n512": False},
               times=dict(gemm1={"v1": v1[0], "v2": v2[0], "deep_gemm": t(dg1)},
                          gemm2={"v1": v1[1], "v2": v2[1], "deep_gemm": t(dg2)}))
    older = dict(runs=[dict(run, gpu="GPU OLD")])
    text = report_gluon_probe.render([older, dict(runs=[run])])
    rows = [line for line in text.splitlines() if line.startswith(("| v1", "| v2", "| DeepGEMM"))]
    assert rows == ["| v1 | 4.00 (4.00-4.00) | 25 | 0.50x | 2.00 (2.00-2.00) | 50 | 0.50x | 0.50x | = TMA, = DeepGEMM |",
                    "| v2 | 3.00 (2.00-4.00) | 33 | 0.50x | 1.00 (1.00-2.00) | 100 | 0.50x | 0.75x | **neither** |",
                    "| DeepGEMM | 2.00 (2.00-2.00) | 50 | 1.00x | 1.00 (1.00-1.00) | 100 | 1.00x | 1.00x |  |"]
    assert text.count("Measured on") == 1 and "GPU OLD" not in text and "A note." in text


def test_layer_bound_cpu_shows_the_last_tree_with_per_round_ratios():
    def rnd(ref, bound):
        return {"8:64:32": dict(ref_wall=ref, ref_cpu=ref, bound_wall=bound, bound_cpu=bound)}

    base = [rnd(1.0, 9.0), rnd(1.0, 9.0), rnd(1.0, 9.0)]
    this = [rnd(1.0, 2.0), rnd(2.0, 3.0), rnd(1.0, 4.0)]  # ratios 2.0, 1.5, 4.0: median 2.0, range 1.5-4.0
    summary = {"base": {"8:64:32": dict(ref_wall=1.0, ref_cpu=1.0, bound_wall=9.0, bound_cpu=9.0, ratio_wall=9.0,
                                        ratio_cpu=9.0)},
               "this": {"8:64:32": dict(ref_wall=1.0, ref_cpu=1.0, bound_wall=3.0, bound_cpu=3.0, ratio_wall=2.0,
                                        ratio_cpu=2.0)}}
    doc = dict(meta=dict(date="2026-01-01T00:00:00+00:00", machine="x86_64", cpus=2, profile="BF16_OUTPUT",
                         cases=["8:64:32"], rounds=3),
               rounds={"base": base, "this": this}, summary=summary)
    rows = [line for line in report_layer_bound_cpu.render([doc]).splitlines() if line.startswith("| 8 tokens")]
    assert rows == ["| 8 tokens, hidden 64, intermediate 32, 32 experts, top-4 | 1.00 s (1.00 s) | 3.00 s (3.00 s) "
                    "| 2.0x (2.0x) | 1.5-4.0x (1.5-4.0x) |"]
