"""bench/report_exact_regimes.py renders docs/exact-regimes.md's measured tables from bench_exact_regimes.py's
JSON: run on a small hand-written JSON (an implementation that raised, a fault that was not caught, a model that
failed), the rendered rows are checked cell by cell."""
from __future__ import annotations

from bench import report_exact_regimes as report  # noqa: E402 (the repository root is on sys.path: conftest.py)
from report_pages import rendered  # noqa: E402

SHAPE = {"hidden": 256, "intermediate": 128, "experts": 8, "top_k": 2, "scheme": "fp8_1x128",
         "activation": "silu_and_mul"}
FAKE = {"date": "2026-12-01T09:05:59+00:00", "argv": ["--tokens", "16", "--out", "/x/r.json"], "torch": "9.9.0",
        "gpu": "FakeGPU 9000", "models": [
            {"model": "m1", "supported": True, "tokens": 16, "shape": SHAPE,
             "bf16_reduced_precision_reduction": True,
             "implementations": {"torch eager bf16": {"differing": 0, "of": 4096, "seconds": 0.5},
                                 "bad | kernel": {"differing": 3, "of": 4096, "seconds": 12.25},
                                 "raising": {"error": "ValueError: no\nGPU layer"}},
             "faults": {"skipped_last_k_block": {"differing": 1234, "of": 4096, "seconds": 0.1, "caught": True},
                        "invisible": {"differing": 0, "of": 4096, "seconds": 0.1, "caught": False}}},
            {"model": "m2", "error": "Traceback ...\nRuntimeError: out of memory\n"}]}


def test_report_renders_both_tables(tmp_path):
    lines = rendered(report.main, tmp_path, FAKE, "exact-regimes").splitlines()
    assert ("Measured on an FakeGPU 9000, 2026-12-01 09:05 UTC, torch 9.9.0 (cuBLAS bf16 reduced-precision "
            "reduction allowed, torch's default): `python bench/bench_exact_regimes.py --tokens 16`.") in lines
    assert ("| m1 | hidden 256, intermediate 128, 8 experts, top-2 | fp8_1x128 | silu_and_mul | torch eager bf16 "
            "| **0 of 4,096** | 0.500 |") in lines
    assert "| | | | | bad \\| kernel | 3 of 4,096 | 12.250 |" in lines  # not bold, the separator escaped
    assert "| | | | | raising | not run: ValueError: no GPU layer |  |" in lines
    assert "| m2 | | | | — | not run: RuntimeError: out of memory | |" in lines
    assert "| m1 | last K block of GEMM1 skipped (busiest expert) | 1,234 of 4,096 | yes |" in lines
    assert "|  | invisible | 0 of 4,096 | **no** |" in lines
    assert not any("/x/r.json" in line for line in lines)


def test_caption_names_cuda_and_deep_gemm_when_recorded(tmp_path):
    run = dict(FAKE, cuda="13.0", deep_gemm="2.8.2")
    lines = rendered(report.main, tmp_path, run, "exact-regimes").splitlines()
    assert any(line.startswith("Measured on an FakeGPU 9000, 2026-12-01 09:05 UTC, torch 9.9.0, CUDA 13.0, "
                               "DeepGEMM 2.8.2 (cuBLAS") for line in lines)
    lines = rendered(report.main, tmp_path, dict(FAKE, cuda="13.0", deep_gemm="absent"), "exact-regimes").splitlines()
    assert any("torch 9.9.0, CUDA 13.0, DeepGEMM absent (cuBLAS" in line for line in lines)


def test_single_rounding_models_are_marked(tmp_path):
    m = dict(FAKE["models"][0], regime="single_rounding",
             faults={"second_gemm2_store": {"differing": 7, "of": 4096, "seconds": 0.1, "caught": True}})
    lines = rendered(report.main, tmp_path, dict(FAKE, models=[m]), "exact-regimes").splitlines()
    assert any(line.startswith("Models marked *(single rounding)* run `moeref.regimes.single_rounding_layer`")
               for line in lines)
    assert ("| m1 *(single rounding)* | hidden 256, intermediate 128, 8 experts, top-2 | fp8_1x128 | silu_and_mul "
            "| torch eager bf16 | **0 of 4,096** | 0.500 |") in lines
    assert ("| m1 *(single rounding)* | GEMM2 output stored in bf16 before the top-k sum (two stores) | 7 of 4,096 "
            "| yes |") in lines


def test_two_token_counts_draws_skipped_rows_and_model_seconds(tmp_path):
    """A run with two token counts (one column pair each), a DeepGEMM row skipped, a pooled layer, drawn cases
    (one with a differing and a raising implementation) and the per-model wall time."""
    shape = dict(SHAPE, experts=8, distinct_experts=4)
    impl = {"torch eager bf16": {"differing": 0, "of": 4096, "seconds": 0.5}}
    m16 = {"model": "m1", "supported": True, "tokens": 16, "shape": shape, "implementations": dict(impl),
           "skipped": {"fastpath.moe deep_gemm": "deep_gemm does not import (DeepGEMM absent)"},
           "faults": {"skipped_last_k_block": {"differing": 9, "of": 4096, "seconds": 0.1, "caught": True}}}
    m64 = dict(m16, tokens=64, implementations={"torch eager bf16": {"differing": 2, "of": 16384, "seconds": 1.0}},
               faults={})
    draws = [{"model": "m1", "draw": 0, "tokens": 3,
              "params": {"tokens": 3, "routing": "zipf", "seed": 7, "padding": True, "ep_size": 2,
                         "ep_strategy": "linear"},
              "implementations": {"a": {"differing": 0, "of": 768, "seconds": 0.1},
                                  "b | c": {"differing": 5, "of": 768, "seconds": 0.1},
                                  "d": {"error": "RuntimeError: boom"}}},
             {"model": "m1", "draw": 1, "tokens": 1,
              "params": {"tokens": 1, "routing": "uniform", "seed": 0, "padding": False, "ep_size": 1,
                         "ep_strategy": "round_robin"},
              "implementations": {"a": {"differing": 0, "of": 256, "seconds": 0.1}}},
             {"model": "m2", "error": "ModuleNotFoundError: No module named 'hypothesis'"}]
    run = dict(FAKE, models=[m16, m64], draws=draws, model_seconds={"m1": 12.34})
    lines = rendered(report.main, tmp_path, run, "exact-regimes").splitlines()
    assert any(line.endswith("Wall time per model (layer construction, weight uploads, references and every call): "
                             "m1 12.3 s; 12.3 s in all.") for line in lines)
    assert ("| model | shape | scheme | activation | implementation | 16 tokens: differing outputs | seconds | "
            "64 tokens: differing outputs | seconds |") in lines
    assert ("| m1 | hidden 256, intermediate 128, 8 experts (4 distinct), top-2 | fp8_1x128 | silu_and_mul | "
            "torch eager bf16 | **0 of 4,096** | 0.500 | 2 of 16,384 | 1.000 |") in lines
    assert ("| | | | | fastpath.moe deep_gemm | skipped: deep_gemm does not import (DeepGEMM absent) |  | "
            "skipped: deep_gemm does not import (DeepGEMM absent) |  |") in lines
    assert "| m1 | last K block of GEMM1 skipped (busiest expert) | 9 of 4,096 | yes |" in lines  # the first count's
    assert ("| m1 | 0 | 3 | zipf, 7 | yes | 2 (linear) | 2 | b \\| c: 5 of 768; not run: d (RuntimeError: boom) |"
            in lines)
    assert "|  | 1 | 1 | uniform, 0 | no | 1 (round_robin) | 1 | **0** in each |" in lines
    assert "| m2 |  | | | | | — | not run: ModuleNotFoundError: No module named 'hypothesis' |" in lines
