"""The CPU-runnable parts of bench/bench_exact_regimes.py (the GPU proof of the exact regimes): argument parsing,
case generation, and a tiny run whose honest implementations give the reference's bits and whose planted faults
are caught."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from bench import bench_exact_regimes as bench  # noqa: E402  (the repository root is on sys.path: conftest.py)
from bench.exact_regimes.fastpath_runs import shard_weights  # noqa: E402
from bench.exact_regimes.models import TINY  # noqa: E402


def test_arguments():
    a = bench.parse_args(["--models", "deepseek_v3", "--tokens", "16", "--tiny", "--device", "cpu"])
    assert a.models == ["deepseek_v3"] and a.tokens == [16] and a.tiny and a.device == "cpu" and a.draws == 0
    a = bench.parse_args(["--tokens", "128", "512", "--draws", "3"])
    assert a.tokens == [128, 512] and a.draws == 3
    assert {"qwen3_30b_a3b_fp8", "mixtral_8x7b"} <= set(a.models)  # the default models include them
    for bad in (["--models", "llama"], ["--tokens", "0"], ["--draws", "-1"], ["--ep-size", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_tiny_case_is_in_the_regime():
    from moeref.regimes import layer_in_exact_regime

    lay = bench.make_case("deepseek_v3", 12, tiny=True, seed=3)
    assert lay.hidden.shape == (12, TINY["hidden"])
    assert lay.topk_weights[0, 0] != lay.topk_weights[0, 1]  # the swapped-weights fault is a change
    assert layer_in_exact_regime(lay, "hopper_fp8").ok


def test_tiny_run_honest_equal_faults_caught(tmp_path):
    out = tmp_path / "r.json"
    bench.main(["--tiny", "--device", "cpu", "--tokens", "24", "--models", "deepseek_v3", "gpt_oss_120b_mxfp4",
                "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["cuda"] and res["deep_gemm"]  # "absent" when torch has no CUDA / DeepGEMM does not import
    for model in res["models"]:
        assert model["supported"] and model["in_regime"]["ok"], model
        honest = [v for v in model["implementations"].values() if "differing" in v]
        assert honest and all(v["differing"] == 0 for v in honest), model["implementations"]
        assert model["implementations"]["torch eager bf16"]["differing"] == 0
        faults = model["faults"]
        assert set(faults) == set(bench.FAULTS) - {"tanh_gelu"}
        assert all(f.get("caught") for f in faults.values()), faults
        assert np.isfinite(model["reference_seconds"])


def test_fastpath_runs_take_the_layers_activation_and_its_parameters():
    """bench.fastpath_runs hands fastpath.moe the layer's activation and parameters (the GELU model's rows, and
    its ``fastpath_tanh_gelu`` fault through ``activation_params``): on a tiny FP8 GELU layer under the
    interpreter the reference's bits; a bad ``approximate`` reaches the layer's check."""
    import torch

    from moeref.regimes import exact_layer

    lay = exact_layer(8, 256, 256, 4, 2, scheme="fp8_1x128", activation="gelu_and_mul", seed=0)
    dev = torch.device("cpu")
    runs = bench.fastpath_runs(lay, dev)
    assert {"fastpath.moe triton contiguous", "fastpath.moe triton masked capturable"} <= set(runs)
    ref = np.asarray(lay.reference().out, np.float32)
    assert bench._count(ref, runs["fastpath.moe triton contiguous"]()) == 0
    with pytest.raises(ValueError, match="'erf'"):
        bench.fastpath_runs(lay, dev, {"approximate": "erf"})["fastpath.moe triton contiguous"]()


def test_time_check_tiny(tmp_path):
    out = tmp_path / "t.json"
    bench.main(["--time-check", "--tiny", "--device", "cpu", "--tokens", "8", "--models", "deepseek_v3",
                "--time-values", "--out", str(out)])
    (m,) = json.loads(out.read_text())["models"]
    assert m["certificate"] and m["check_passed"] and m["in_regime_from_values_ok"]
    assert m["rounds"] == 7 and m["reference_s"] > 0 and m["check_s"] > 0
    assert 0 < m["in_regime_certificate_s"] < m["in_regime_from_values_s"]


def test_tiny_single_rounding_run(tmp_path):
    out = tmp_path / "s.json"
    bench.main(["--tiny", "--device", "cpu", "--tokens", "24", "--regime", "single_rounding", "--models",
                "deepseek_v3", "gpt_oss_120b_mxfp4", "--out", str(out)])
    fp8, mxfp4 = json.loads(out.read_text())["models"]
    assert not mxfp4["supported"] and "single_rounding_layer" in mxfp4["why"]
    assert fp8["regime"] == "single_rounding" and fp8["in_regime"]["ok"]
    impl = fp8["implementations"]
    assert all(impl[name]["differing"] == 0 for name in impl if name.startswith("torch eager"))
    assert "declares GEMM2's output unstored" in impl["torch._grouped_mm (CUTLASS)"]["error"]
    assert set(fp8["faults"]) == (set(bench.FAULTS) - {"tanh_gelu"}) | set(bench.SINGLE_ROUNDING_FAULTS)
    assert all(f.get("caught") for f in fp8["faults"].values()), fp8["faults"]


def test_tiny_run_two_token_counts_and_draws(tmp_path):
    """Two token counts on one layer build (faults at the first only) and Hypothesis-drawn cases: every honest
    implementation, the EP shards included, gives the reference's bits; every drawn case is in the regime (from
    its values: a drawn case has no certificate)."""
    out = tmp_path / "d.json"
    bench.main(["--tiny", "--device", "cpu", "--tokens", "24", "40", "--draws", "3", "--models", "qwen3_30b_a3b_fp8",
                "mixtral_8x7b", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [(m["model"], m["tokens"]) for m in res["models"]] == [
        ("qwen3_30b_a3b_fp8", 24), ("qwen3_30b_a3b_fp8", 40), ("mixtral_8x7b", 24), ("mixtral_8x7b", 40)]
    assert set(res["model_seconds"]) == {"qwen3_30b_a3b_fp8", "mixtral_8x7b"}
    assert all(s > 0 for s in res["model_seconds"].values())
    for m in res["models"]:
        assert m["in_regime"]["ok"], m["in_regime"]
        impl = m["implementations"]
        assert "torch eager bf16, 4 EP shards (round_robin)" in impl
        assert all(v["differing"] == 0 for v in impl.values()), impl
        assert set(m["faults"]) == (set(bench.FAULTS) - {"tanh_gelu"} if m["tokens"] == 24 else set())
        assert all(f["caught"] for f in m["faults"].values())
    mixtral = res["models"][2]["shape"]
    assert (mixtral["experts"], mixtral["distinct_experts"], mixtral["hidden"]) == (8, 4, TINY["hidden"])
    assert [(d["model"], d["draw"]) for d in res["draws"]] == [(m, j) for m in ("qwen3_30b_a3b_fp8", "mixtral_8x7b")
                                                               for j in range(3)]
    for d in res["draws"]:
        p = d["params"]
        assert d["in_regime"]["ok"] and 1 <= p["tokens"] <= 40 and d["tokens"] == p["tokens"]
        shards = f"{p['ep_size']} EP shard{'s' if p['ep_size'] != 1 else ''} ({p['ep_strategy']})"
        assert f"torch eager bf16, {shards}" in d["implementations"]
        assert all(v["differing"] == 0 for v in d["implementations"].values()), d
        assert d["faults"] == {}


def test_drawn_cases_are_rows_of_the_layer_with_the_drawn_routing():
    from moeref.regimes import layer_in_exact_regime

    draws = bench.drawn_parameters(5, 40, 8)
    assert draws == bench.drawn_parameters(5, 40, 8)  # derandomized
    kinds = [d.routing for d in draws]
    assert len(set(kinds[:3])) == 3  # the first of each kind come first
    base = bench.make_case("qwen3_30b_a3b", 40, tiny=True)
    for d in draws:
        lay = bench.drawn_case(base, d)
        assert lay.hidden.shape == (d.tokens, base.hidden.shape[1]) and lay.weights is base.weights
        assert all(any(np.array_equal(row, b) for b in base.hidden) for row in lay.hidden)  # the layer's tokens
        w = lay.topk_weights[lay.topk_ids >= 0]
        assert np.all(np.isin(w, [1.0, 0.5, 0.25, 0.125]))  # powers of two
        assert np.all(lay.topk_weights[lay.topk_ids < 0] == 0)
        assert (np.all(lay.topk_ids >= 0) or d.padding)
        assert layer_in_exact_regime(lay, "hopper_fp8", from_values=True).ok
    first = bench.first_tokens(base, 7)
    assert np.array_equal(first.hidden, base.hidden[:7]) and np.array_equal(first.topk_ids, base.topk_ids[:7])
    assert bench.first_tokens(base, 40) is base
    with pytest.raises(ValueError, match="40 tokens"):
        bench.first_tokens(base, 41)


def test_fastpath_ep_shards_sum_to_the_reference():
    """fastpath.moe per EP rank (its experts selected on the device, its expert map, FP32 partials) summed in rank
    order gives the reference's bits under the interpreter; one rank's partial alone does not (the shards split
    the slots)."""
    import torch

    from fastpath.moe import fused_moe
    from moeref.distributed import ep_placement
    from moeref.regimes import exact_layer

    lay = exact_layer(8, 256, 256, 4, 2, scheme="fp8_1x128", seed=0)
    dev = torch.device("cpu")
    ref = np.asarray(lay.reference().out, np.float32)
    pl = ep_placement(4, 2, "round_robin")
    fast = bench.fast_layer(lay, dev)
    runs = bench.fastpath_ep_runs(lay, dev, pl, fast=fast)
    assert list(runs) == ["fastpath.moe triton contiguous, 2 EP shards (round_robin)"]
    assert bench._count(ref, next(iter(runs.values()))()) == 0
    fw, _ = fast
    local = torch.as_tensor(pl.local_logical_experts(0))
    shard = shard_weights(fw, local)
    assert torch.equal(shard.w13, fw.w13[local]) and torch.equal(shard.w2_scales, fw.w2_scales[local])
    part = fused_moe(torch.from_numpy(lay.hidden).to(torch.bfloat16), shard, torch.from_numpy(lay.topk_weights),
                     torch.from_numpy(lay.topk_ids), expert_map=pl.expert_map(0), num_experts=4,
                     out_dtype=torch.float32)
    assert bench._count(ref, part.to(torch.bfloat16)) > 0
