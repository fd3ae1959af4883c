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


def test_a_closed_pipe_ends_a_command_quietly():
    for args in (("formats", "--json"), ("formats",), ("explain", "mxfp8", "--json")):
        status, err = _run_into_closed_pipe(*args)
        assert "Traceback" not in err and "BrokenPipeError" not in err, (args, err)
        assert status == 1 and err == "", (args, status, err)
