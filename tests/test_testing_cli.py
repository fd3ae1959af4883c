"""moeref.testing on the CPU: reproducers (save, load, replay), the ``moeref check|replay|mutate`` subcommands
and the mutation score, on a hand-written torch bf16 MoE kernel (tests/kernels_for_tests.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kernels_for_tests import eager_bf16_moe
from moeref.compare import compare
from moeref.compare.faults import LayerCase
from moeref.gemm.from_kernel import kernel_expert_operands
from moeref.moe import make_layer, make_tokens, run_moe
from moeref.routing import softmax_topk
from moeref.testing import kernel_inputs, load_reproducer, mutation_score, replay, save_reproducer
from testing_api_cases import layer_inputs, replace_weights


# ------------------------------------------------------------------ reproducers


def test_reproducer_round_trip_and_replay(tmp_path):
    ki = layer_inputs()
    out = eager_bf16_moe(**ki.torch(), bug="tail_slot")
    st, js = save_reproducer(tmp_path / "case", ki.layer_case(), out, "TORCH_EAGER_BF16", label="x", extra={"a": 1})
    case, cand, prof, cfg = load_reproducer(js)
    assert prof == "TORCH_EAGER_BF16" and cfg["extra"] == {"a": 1} and isinstance(case, LayerCase)
    assert np.array_equal(cand, out.float().numpy())
    r1 = replay(st)
    r0 = compare(out, ki.reference(), "TORCH_EAGER_BF16")
    assert np.array_equal(r1.violations, r0.violations) and np.array_equal(r1.bound, r0.bound)
    with pytest.raises(ValueError, match="missing"):
        load_reproducer(tmp_path / "nothing.json")


def test_reproducer_keeps_fp8_quantizers(tmp_path):
    from moeref.moe import MoEQuant, quantize_weights, quantizer
    from moeref.quant import fp8_block, fp8_group, fp8_per_tensor

    lw = quantize_weights(make_layer(2, 256, 128, seed=0), fp8_block())
    q = MoEQuant(fp8_group(128), quantizer(fp8_per_tensor(), scale=0.25), "mixed")
    case = LayerCase(make_tokens(3, 256), lw, np.full((3, 1), 1.0, np.float32), np.array([[0], [1], [0]]),
                     dict(quant=q, out_dtype="bfloat16"))
    ref = run_moe(case.hidden, lw, case.topk_weights, case.topk_ids, quant=q, out_dtype="bfloat16")
    save_reproducer(tmp_path / "q", case, ref.out, "BF16_OUTPUT")
    r = replay(tmp_path / "q.json")
    assert r.passed and np.array_equal(r.error, np.abs(ref.out.astype(np.float64) - ref.output))


# ------------------------------------------------------------------ the check and replay subcommands


def test_cli_check_and_replay(tmp_path, capsys):
    from safetensors.torch import save_file

    from moeref.cli import main

    ki = layer_inputs()
    t = ki.torch()
    save_file({k: v.contiguous() for k, v in t.items()}, str(tmp_path / "in.safetensors"))
    save_file({"out": eager_bf16_moe(**t)}, str(tmp_path / "good.safetensors"))
    save_file({"out": eager_bf16_moe(**t, bug="tail_slot")}, str(tmp_path / "bad.safetensors"))
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "good.safetensors"),
                 "--kernel", "torch"]) == 0
    assert "profile TORCH_EAGER_BF16: suggested" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "bad.safetensors"),
                 "--profile", "TORCH_EAGER_BF16"]) == 1
    assert "FAIL" in capsys.readouterr().out
    save_reproducer(tmp_path / "r", ki.layer_case(), eager_bf16_moe(**t, bug="tail_slot"), "TORCH_EAGER_BF16")
    assert main(["replay", str(tmp_path / "r.json")]) == 1
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "none.npy")]) == 2


def test_cli_check_and_replay_json(tmp_path, capsys):
    """``--json``: one strict-JSON object with the verdict, the profile and the worst rows; the
    exit status as without it."""
    import json

    from safetensors.torch import save_file

    from moeref.cli import main

    ki = layer_inputs()
    t = ki.torch()
    save_file({k: v.contiguous() for k, v in t.items()}, str(tmp_path / "in.safetensors"))
    save_file({"out": eager_bf16_moe(**t)}, str(tmp_path / "good.safetensors"))
    bad = eager_bf16_moe(**t, bug="tail_slot")
    save_file({"out": bad}, str(tmp_path / "bad.safetensors"))
    capsys.readouterr()
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "good.safetensors"),
                 "--kernel", "torch", "--json"]) == 0
    good = json.loads(capsys.readouterr().out)
    assert good["passed"] is True and good["violations"] == 0 and good["worst"] == []
    assert good["profile"] == "TORCH_EAGER_BF16" and good["profile_choice"].startswith("suggested")
    assert good["shape"] == list(ki.hidden.shape) and set(good["metrics"]) >= {"rel_l2", "cosine"}
    assert main(["check", str(tmp_path / "in.safetensors"), str(tmp_path / "bad.safetensors"),
                 "--profile", "TORCH_EAGER_BF16", "--json"]) == 1
    out = capsys.readouterr().out
    failed = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert failed["passed"] is False and failed["violations"] > 0
    assert failed["profile_choice"] == "given" and failed["rows_with_violations"] >= len(failed["worst"]) > 0
    worst = failed["worst"][0]
    assert worst["ratio"] == "inf" or worst["ratio"] > 1  # beyond its bound
    assert worst["token"] in range(ki.hidden.shape[0]) and worst["slot"] is not None
    save_reproducer(tmp_path / "r", ki.layer_case(), bad, "TORCH_EAGER_BF16")
    assert main(["replay", str(tmp_path / "r.json"), "--json"]) == 1
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["passed"] is False and replayed["violations"] == failed["violations"]


def test_cli_check_fp8_block_weights_and_flashinfer_names(tmp_path, capsys):
    from safetensors.torch import save_file

    from moeref.cli import main
    from moeref.moe import MoEQuant
    from moeref.quant import fp8_group

    lw = make_layer(3, 256, 128, seed=2)
    w1 = torch.from_numpy(np.stack(lw.w13)).to(torch.float8_e4m3fn)
    w2 = torch.from_numpy(np.stack(lw.w2)).to(torch.float8_e4m3fn)
    s1, s2 = torch.full((3, 2, 2), 1 / 64), torch.full((3, 2, 1), 1 / 32)
    x = torch.from_numpy(make_tokens(4, 256)).bfloat16()
    tw, ids = torch.full((4, 2), 0.5), torch.tensor([[0, 2]] * 4, dtype=torch.int32)
    weights = replace_weights(lw, kernel_expert_operands(w1, s1, block=(128, 128)),
                              kernel_expert_operands(w2, s2, block=(128, 128)))
    q = fp8_group(128, preset="vllm")
    out = run_moe(x, weights, tw.numpy(), ids.numpy(), quant=MoEQuant(q, q), out_dtype="bfloat16").out
    save_file(dict(hidden_states=x, w1=w1, w2=w2, topk_weights=tw, topk_ids=ids, w1_scale=s1, w2_scale=s2),
              str(tmp_path / "fp8.safetensors"))
    save_file({"out": torch.from_numpy(out.astype(np.float32)).bfloat16()}, str(tmp_path / "out.safetensors"))
    assert main(["check", str(tmp_path / "fp8.safetensors"), str(tmp_path / "out.safetensors"),
                 "--block-shape", "128,128"]) == 0
    assert "profile DEEPGEMM_FP8: suggested from the dtypes (weights float8_e4m3fn" in capsys.readouterr().out
    ki = layer_inputs()
    t = ki.torch()
    w31 = torch.cat([t["w1"][:, 64:], t["w1"][:, :64]], dim=1)
    save_file(dict(input=t["hidden_states"], fc1_expert_weights=w31, fc2_expert_weights=t["w2"],
                   token_final_scales=t["topk_weights"], token_selected_experts=t["topk_ids"]),
              str(tmp_path / "fi.safetensors"))
    save_file({"out": eager_bf16_moe(**t)}, str(tmp_path / "fi_out.safetensors"))
    assert main(["check", str(tmp_path / "fi.safetensors"), str(tmp_path / "fi_out.safetensors"),
                 "--profile", "TORCH_EAGER_BF16"]) == 0
    save_file(dict(x=t["hidden_states"]), str(tmp_path / "bad.safetensors"))
    assert main(["check", str(tmp_path / "bad.safetensors"), str(tmp_path / "fi_out.safetensors")]) == 2
    assert "has no hidden tensor (looked for hidden_states" in capsys.readouterr().err


# ------------------------------------------------------------------ mutation score


def _torch_kernel(ki):
    return eager_bf16_moe(**ki.torch(), w13_layout=ki.w13_layout)


def test_mutation_score_of_bound_check_and_of_a_loose_tolerance():
    cases = [layer_inputs(seed=s) for s in range(3)]
    strong = mutation_score(_torch_kernel, cases, profile="TORCH_EAGER_BF16")
    assert not strong.baseline_failures and not strong.errors
    assert strong.score == 1.0 and strong.tried["top-k slot dropped"] == 3
    assert strong.tried["scale from the neighbouring block"] == 0  # float weights: one scale, not applicable

    # vLLM's test scale (hidden randn/10, weights /15: outputs below 1e-2) under its atol=2e-2, rtol=0 check
    from dataclasses import replace

    lw = make_layer(6, 128, 64, seed=0)
    r = softmax_topk(np.random.default_rng(5).standard_normal((13, 6)), 3, renormalize=True)
    small = kernel_inputs(make_tokens(13, 128, seed=1) / 10, replace(lw, w2=[w / 15 for w in lw.w2]), r.weights, r.ids)

    def vllm_check(ki, out):  # out: the kernel's bf16 tensor, as mutation_score hands it over
        ref = torch.from_numpy(ki.reference().out.astype(np.float32))
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)

    weak = mutation_score(_torch_kernel, [small], vllm_check)
    assert weak.caught["output row 0 unwritten (NaN)"] == 1 and weak.caught["all-zero output"] == 0
    assert weak.score < 0.5
    assert mutation_score(_torch_kernel, [small], profile="TORCH_EAGER_BF16").score == 1.0
    assert "mutation score" in weak.summary()


def test_equivalent_mutants_are_not_counted():
    ki = layer_inputs(top_k=1)
    ki = ki.with_(topk_weights=np.ones_like(ki.topk_weights))   # weight 1: applying it twice changes nothing
    res = mutation_score(_torch_kernel, [ki], profile="TORCH_EAGER_BF16")
    assert res.equivalent == 1 and res.tried["router weights applied twice"] == 0 and res.score == 1.0


def test_cli_mutate(tmp_path, monkeypatch, capsys):
    from moeref.cli import main

    (tmp_path / "mykernel.py").write_text(
        "from kernels_for_tests import eager_bf16_moe\n"
        "def run(ki):\n    return eager_bf16_moe(**ki.torch())\n")
    monkeypatch.chdir(tmp_path)
    assert main(["mutate", "mykernel:run", "--cases", "2", "--profile", "TORCH_EAGER_BF16", "--min-score", "1.0"]) == 0
    assert "mutation score" in capsys.readouterr().out
    assert main(["mutate", "mykernel:run", "--cases", "2", "--profile", "TORCH_EAGER_BF16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["score"] == 1.0 and res["caught"] == res["tried"] == sum(f["tried"] for f in res["faults"]) > 0
    assert res["baseline_failures"] == [] and res["errors"] == []
