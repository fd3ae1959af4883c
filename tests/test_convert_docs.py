"""Runs the `$ moeref convert ...` lines of docs/convert.md on a small DeepSeek-style checkpoint
named ``tiny-v3-fp8`` (tests/checkpoint_fixtures.py), in order, in one directory. A line marked
``# exits N`` must exit with N; every other line with 0."""
from __future__ import annotations

import os
import re
import shlex

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("torch")
pytest.importorskip("rich")

import checkpoint_fixtures as F  # noqa: E402

from moeref.cli import main  # noqa: E402

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "convert.md")


def _doc_commands():
    text = open(DOC).read()
    lines = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        lines += [ln[2:] for ln in block.splitlines() if ln.startswith("$ moeref ")]
    return lines


def test_doc_has_commands():
    cmds = _doc_commands()
    assert len(cmds) >= 4 and all(c.startswith("moeref convert ") for c in cmds)


def test_doc_commands_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    F.deepseek_fp8("tiny-v3-fp8", np.random.default_rng(0), shapes=((256, 192), (128, 256)))
    for cmd in _doc_commands():
        want = 0
        if "# exits" in cmd:
            cmd, note = cmd.split("# exits", 1)
            want = int(note.split(":")[0])
        argv = shlex.split(cmd)[1:]
        assert main(argv) == want, cmd
    assert os.path.exists("tiny-nvfp4/model.safetensors.index.json")
    assert os.path.exists("tiny-mxfp4.json")  # --report
    assert not os.path.exists("tiny-mxfp4/moeref-convert.json.partial")
