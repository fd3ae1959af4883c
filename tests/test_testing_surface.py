"""moeref.testing's surface (issue 32): what dir() lists, the report's explanation of allowed flips, the
CLI quiet on a closed pipe, and moeref mutate handing the user's check what the kernel returned."""
from __future__ import annotations

import subprocess
import sys

import moeref.testing


def test_dir_lists_every_export_including_the_lazy_ones():
    listed = dir(moeref.testing)
    for name in ("mutation_score", "draw_cases", "moe_cases"):
        assert name in listed
        assert callable(getattr(moeref.testing, name))
    assert set(moeref.testing.__all__) <= set(listed)
    ns: dict = {}
    exec("from moeref.testing import *", ns)  # every name of __all__ resolves
    assert set(moeref.testing.__all__) <= set(ns)


# ------------------------------------------------------------------ the report explains allowed flips


def test_the_report_explains_intermediate_flips():
    import numpy as np

    from moeref.compare import compare
    from moeref.moe import make_layer, make_tokens
    from moeref.routing import softmax_topk
    from moeref.testing import kernel_inputs

    r = softmax_topk(np.random.default_rng(0).standard_normal((32, 4)), 2, renormalize=True)
    ki = kernel_inputs(make_tokens(32, 128), make_layer(4, 128, 64, seed=0), r.weights, r.ids)
    ref = ki.reference()
    rep = compare(ref.out, ref, "BF16_OUTPUT")  # bf16 GEMM-output and activation stores: some may flip
    assert rep.flips > 0
    line = next(x for x in rep.summary().splitlines() if "flips allowed" in x)
    assert f"intermediate flips allowed: {rep.flips} (" in line and "may round them either way" in line
    rep32 = compare(ref.output, ref, "FP32_ACCUM")  # no declared store: nothing may flip, nothing to explain
    assert rep32.flips == 0 and "flips" not in rep32.summary()


# ------------------------------------------------------------------ a closed pipe ends the CLI quietly


def _run_into_closed_pipe(*args):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.Popen([sys.executable, "-m", "moeref", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=root, env=env)
    p.stdout.close()  # the reader is gone before the command writes anything (`moeref ... | head -0`)
    err = p.stderr.read().decode()
    return p.wait(timeout=300), err


def test_a_closed_pipe_ends_a_command_quietly(tmp_path):
    import numpy as np
    from safetensors.torch import save_file

    from moeref.moe import make_layer, make_tokens
    from moeref.testing import kernel_inputs

    ids = np.array([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], np.int32)
    ki = kernel_inputs(make_tokens(5, 64), make_layer(4, 64, 32, seed=0), np.full((5, 2), 0.5, np.float32), ids)
    save_file(ki.torch(), str(tmp_path / "inputs.safetensors"))
    save_file({"out": ki.torch()["hidden_states"] * 0}, str(tmp_path / "out.safetensors"))  # a failing output
    check = ("check", str(tmp_path / "inputs.safetensors"), str(tmp_path / "out.safetensors"),
             "--profile", "BF16_OUTPUT")
    for args in (("formats", "--json"), ("formats",), ("explain", "mxfp8", "--json"), check + ("--json",), check):
        status, err = _run_into_closed_pipe(*args)
        assert "Traceback" not in err and "BrokenPipeError" not in err, (args, err)
        assert status == 1 and err == "", (args, status, err)


# ------------------------------------------------------------------ moeref mutate and the user's own code

USER_MODULE = '''
from kernels_for_tests import eager_bf16_moe
from moeref.testing import assert_moe_close

SEEN = []


def kernel(ki):
    return eager_bf16_moe(**ki.torch())


def kernel_fp32(ki):
    return eager_bf16_moe(**ki.torch()).float()


def check_types(ki, out):
    SEEN.append((type(out).__name__, out.dtype, out.device.type))
    assert_moe_close(out, ki, "TORCH_EAGER_BF16")


def check_broken(ki, out):
    raise RuntimeError("boom in the user's check")
'''


def _user_module(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)  # moeref mutate imports MODULE:FUNCTION from the working directory
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module(name)


def test_mutation_score_hands_the_check_the_kernels_tensor(tmp_path, monkeypatch):
    import torch

    from moeref.testing import draw_cases, mutation_score

    mod = _user_module(tmp_path, monkeypatch, "user_kernel_types")
    res = mutation_score(mod.kernel, draw_cases(1, max_tokens=24), mod.check_types)
    assert not res.baseline_failures and not res.errors and sum(res.tried.values()) >= 2
    # the unmutated output, each input mutant and each corrupted output: a bf16 CPU tensor, as the kernel returns
    assert len(mod.SEEN) == 1 + sum(res.tried.values())
    assert set(mod.SEEN) == {("Tensor", torch.bfloat16, "cpu")}


def test_moeref_mutate_names_the_users_check_and_prints_its_traceback(tmp_path, monkeypatch, capsys):
    from moeref.cli import main

    _user_module(tmp_path, monkeypatch, "user_kernel_broken")
    status = main(["mutate", "user_kernel_broken:kernel", "--check", "user_kernel_broken:check_broken", "--cases", "1",
                   "--max-tokens", "24"])
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom in the user's check" in err
    assert "raised by your check user_kernel_broken:check_broken on case 0" in err


def test_moeref_mutate_default_check_rejects_a_wider_output_in_one_line(tmp_path, monkeypatch, capsys):
    from moeref.cli import main

    _user_module(tmp_path, monkeypatch, "user_kernel_fp32")
    status = main(["mutate", "user_kernel_fp32:kernel_fp32", "--cases", "1", "--max-tokens", "24"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert err.startswith("moeref mutate: the candidate is float32 but profile BF16_OUTPUT declares a bfloat16")
