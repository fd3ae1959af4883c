"""How a checkpoint conversion runs, on small checkpoints in every real layout (tests/checkpoint_fixtures.py):
dry run, workers and the JSON report, the CLI, the destination and resume rules, verification, the
atomic shard writer and its disk writes, stage times, and the fast engines as plug-ins. What is
written, format by format, is tests/test_checkpoint.py.
"""
from __future__ import annotations

import hashlib
import json
import os

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")

import checkpoint_fixtures as F  # noqa: E402
from checkpoint_helpers import GATE_UP, build, decode_written  # noqa: E402
from safetensors import safe_open  # noqa: E402

from moeref.checkpoint import (CheckpointError, ConvertOptions, SafetensorsCheckpoint, ShardWriter,  # noqa: E402
                               convert_checkpoint, get_layout, plan_conversion)
from moeref.checkpoint import convert as convert_mod  # noqa: E402
from moeref.checkpoint import shard as shard_mod  # noqa: E402
from moeref.cli import main  # noqa: E402


# ---- dry run, workers, report, CLI ------------------------------------------------------------

def test_dry_run_writes_nothing_and_lists_actions(tmp_path, capsys):
    src, _ = build(tmp_path, "deepseek-fp8")
    dst = str(tmp_path / "dst")
    rep = convert_checkpoint(src, dst, ConvertOptions(target="modelopt-nvfp4", dry_run=True))
    assert not os.path.exists(dst)
    assert sorted(m.method for m in rep.modules) == ["convert", "convert"]
    assert sum(s.copied for s in rep.shards) == 3
    assert main(["convert", src, dst, "--to", "modelopt-nvfp4", "--dry-run"]) == 0
    assert "dry run" in capsys.readouterr().out and not os.path.exists(dst)


def test_workers_give_the_same_bytes_and_json_report(tmp_path):
    src, _ = build(tmp_path, "gptoss-mxfp4")
    # the host engine pinned: "auto" takes Triton on a GPU machine (its bytes are tested in test_checkpoint_gpu)
    r1 = convert_checkpoint(src, str(tmp_path / "a"), ConvertOptions(target="ct-nvfp4", engine="numpy"))
    r2 = convert_checkpoint(src, str(tmp_path / "b"), ConvertOptions(target="ct-nvfp4", workers=2, engine="numpy"))
    assert [s.sha256 for s in r1.shards] == [s.sha256 for s in r2.shards]
    rec = json.load(open(tmp_path / "b" / "moeref-convert.json"))
    assert rec["complete"] is True
    mods = [m for s in rec["report"]["shards"] for m in s["modules"]]
    assert {m["module"] for m in mods} == {m.module for m in r1.modules}
    assert all(m["lossless"] and m["sqnr_db"] == "inf" and m["engine"] == "numpy" for m in mods)
    assert mods[0]["note"]  # the report says why this engine converted the tensor


def test_cli_with_progress_bar_and_table(tmp_path, capsys):
    src, _ = build(tmp_path, "gptoss-mxfp4")
    dst = str(tmp_path / "dst")
    assert main(["convert", src, dst, "--to", "modelopt-nvfp4", "--verify"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps to the terminal width
    assert "2 modules converted (2 lossless)" in out and "gptoss-mxfp4 -> modelopt-nvfp4" in out
    rec = json.load(open(os.path.join(dst, "moeref-convert.json")))
    assert rec["complete"] is True
    assert {m["method"] for s in rec["report"]["shards"] for m in s["modules"]} == {"exact_rescale"}


# ---- safety -----------------------------------------------------------------------------------

def test_destination_rules(tmp_path):
    src, _ = build(tmp_path, "ct-mxfp4")
    opts = ConvertOptions(target="gptoss-mxfp4")
    for bad in (src, os.path.join(src, "sub"), str(tmp_path)):
        with pytest.raises(CheckpointError, match="outside the source"):
            convert_checkpoint(src, bad, opts)
    dst = str(tmp_path / "dst")
    os.makedirs(dst)
    with pytest.raises(CheckpointError, match="--overwrite"):
        convert_checkpoint(src, dst, opts)
    open(os.path.join(dst, "stale.txt"), "w").close()
    convert_checkpoint(src, dst, ConvertOptions(target="gptoss-mxfp4", overwrite=True))
    assert not os.path.exists(os.path.join(dst, "stale.txt"))
    assert main(["convert", src, dst, "--to", "gptoss-mxfp4", "--quiet"]) == 2


def test_a_dying_run_leaves_no_complete_looking_file_and_resume_finishes(tmp_path, monkeypatch):
    src, oracle = build(tmp_path, "deepseek-fp8")
    dst = str(tmp_path / "dst")
    ck = SafetensorsCheckpoint.open(src)
    assert len(ck.shards) == 2
    real = shard_mod._convert_module
    calls = []

    def dies_on_second_shard(data, job, ck_):
        if job.shard == ck.shards[1]:
            raise RuntimeError("killed")
        calls.append(job.shard)
        return real(data, job, ck_)

    monkeypatch.setattr(shard_mod, "_convert_module", dies_on_second_shard)
    opts = ConvertOptions(target="ct-nvfp4", verify=True)
    with pytest.raises(RuntimeError, match="killed"):
        convert_checkpoint(src, dst, opts)
    left = sorted(os.listdir(dst))
    assert ck.shards[1] not in left and not any(f.endswith((".partial", ".data")) for f in left)
    assert "model.safetensors.index.json" not in left and "config.json" not in left
    rec = json.load(open(os.path.join(dst, "moeref-convert.json")))
    assert rec["complete"] is False and list(rec["shards"]) == [ck.shards[0]]
    with pytest.raises(CheckpointError, match="--overwrite"):
        convert_checkpoint(src, dst, opts)
    monkeypatch.setattr(shard_mod, "_convert_module", lambda d, j, c: (calls.append(j.shard), real(d, j, c))[1])
    calls.clear()
    rep = convert_checkpoint(src, dst, ConvertOptions(target="ct-nvfp4", verify=True, resume=True))
    assert ck.shards[0] not in calls and ck.shards[1] in calls  # the finished shard was skipped
    assert json.load(open(os.path.join(dst, "moeref-convert.json")))["complete"] is True
    assert set(decode_written("ct-nvfp4", dst)) == set(oracle) and all(s.verified for s in rep.shards)
    with pytest.raises(CheckpointError, match="other settings"):
        convert_checkpoint(src, dst, ConvertOptions(target="ct-mxfp4", resume=True))


def test_verify_catches_a_tampered_shard(tmp_path):
    src, _ = build(tmp_path, "ct-mxfp4")
    dst = str(tmp_path / "dst")
    rep = convert_checkpoint(src, dst, ConvertOptions(target="gptoss-mxfp4"))
    path = os.path.join(dst, "model.safetensors")
    raw = bytearray(open(path, "rb").read())
    raw[-40] ^= 0x11  # a code byte of the last tensor written (the MXFP4 blocks)
    open(path, "wb").write(bytes(raw))
    opts = ConvertOptions(target="gptoss-mxfp4")
    job = convert_mod._job(src, dst, "model.safetensors", opts, plan_conversion(src, opts))
    with pytest.raises(CheckpointError, match="verification"):
        convert_mod.verify_shard(src, dst, rep.shards[0], job)


def test_resume_with_verify_checks_shards_written_without_it(tmp_path, monkeypatch):
    src, _ = build(tmp_path, "deepseek-fp8")
    dst = str(tmp_path / "dst")
    first = convert_checkpoint(src, dst, ConvertOptions(target="ct-mxfp4"))
    assert not any(s.verified for s in first.shards)
    converted = []
    real = shard_mod._convert_module
    monkeypatch.setattr(shard_mod, "_convert_module",
                        lambda d, j, c: (converted.append(d.module), real(d, j, c))[1])
    again = convert_checkpoint(src, dst, ConvertOptions(target="ct-mxfp4", verify=True, resume=True))
    assert converted == [] and all(s.verified for s in again.shards)
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in first.shards]


# ---- the shard writer and stage times ---------------------------------------------------------

def test_shard_writer_is_atomic_and_readable(tmp_path):
    path = str(tmp_path / "x.safetensors")
    w = ShardWriter(path)
    w.add("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add("b", np.array([1, 2], np.uint8).view(ml_dtypes.float8_e4m3fn))
    assert not os.path.exists(path)  # nothing under the final name before close
    w.close()
    with safe_open(path, framework="pt") as f:
        assert f.get_tensor("a").tolist() == [[0, 1, 2], [3, 4, 5]]
        assert f.get_tensor("b").dtype == torch.float8_e4m3fn
    w2 = ShardWriter(str(tmp_path / "y.safetensors"))
    w2.add("a", np.zeros(3, np.float32))
    w2.abort()
    assert os.listdir(tmp_path) == ["x.safetensors"]


def test_shard_writer_starts_the_disk_writes_as_it_goes_and_writes_the_same_bytes(tmp_path, monkeypatch):
    """Every WRITEBACK_BYTES of data the writer asks for the write-out of exactly the data written since the last
    request (offsets in the file: after the 8-byte length and the reserved header); the file is the one the
    writer gives without it."""
    from moeref.checkpoint import safetensors_io as S

    calls = []
    monkeypatch.setattr(S, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(S, "start_writeback", lambda fd, off, n: calls.append((off, n)) or True)
    arrays = [np.arange(n, dtype=np.uint8) for n in (600, 600, 2500, 10)]
    w = ShardWriter(str(tmp_path / "a.safetensors"), reserve=1024)
    for i, a in enumerate(arrays):
        w.add(f"t{i}", a)
    w.close()
    assert calls == [(8 + 1024, 1200), (8 + 1024 + 1200, 2500)]
    monkeypatch.setattr(S, "WRITEBACK_BYTES", 1 << 40)
    w = ShardWriter(str(tmp_path / "b.safetensors"), reserve=1024)
    for i, a in enumerate(arrays):
        w.add(f"t{i}", a)
    w.close()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert f.get_tensor("t2").numpy().tolist() == (np.arange(2500) % 256).tolist()


def test_start_writeback_on_a_real_file(tmp_path):
    """The system call itself (Linux): accepted on a file being written; nothing else to observe but that."""
    from moeref.checkpoint.safetensors_io import _sync_file_range, start_writeback

    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 8192)
        f.flush()
        assert start_writeback(f.fileno(), 0, 8192) == (_sync_file_range() is not None)
        assert start_writeback(f.fileno(), 0, 0) is False


@pytest.mark.parametrize("report_device", ["host", "cpu"])
def test_stage_times_change_nothing_written_and_name_the_stages(tmp_path, report_device):
    """convert_checkpoint(timings=StageTimes()): the same files (and report figures) as without; every stage of
    the path that ran is there, with one run per module for the per-module stages."""
    from moeref.checkpoint.report import StageTimes

    src = str(tmp_path / "src")
    F.deepseek_fp8(src, np.random.default_rng(3), shapes=((128, 256), (128, 256), (256, 128)),
                   names=GATE_UP + ["model.layers.0.mlp.experts.0.down_proj"], shards=2)
    opts = ConvertOptions(target="ct-nvfp4", report_device=report_device)
    plain = convert_checkpoint(src, str(tmp_path / "plain"), opts)
    tm = StageTimes()
    timed_rep = convert_checkpoint(src, str(tmp_path / "timed"), opts, timings=tm)
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (tmp_path / "plain" / shard).read_bytes() == (tmp_path / "timed" / shard).read_bytes()
    assert [(m.module, m.max_abs_error, m.sqnr_db) for m in plain.modules] == \
        [(m.module, m.max_abs_error, m.sqnr_db) for m in timed_rep.modules]
    got = tm.as_json()
    want = {"plan", "read", "quantize", "report", "layout", "group_global", "write", "close", "record", "finish"}
    if report_device == "cpu":  # the pipelined path: the conversion thread's waits; the writer hashes the files
        want |= {"wait_read", "wait_write"}
    else:  # the host path hashes each file after it is closed
        want |= {"hash"}
    assert want <= set(got["seconds"]) and all(v >= 0 for v in got["seconds"].values())
    assert got["counts"]["quantize"] == got["counts"]["report"] == 3 and got["counts"]["group_global"] == 2
    assert got["counts"]["close"] == 2 and got["counts"]["plan"] == 1
    assert got["counts"].get("hash", 0) == (0 if report_device == "cpu" else 2)
    for s in timed_rep.shards:  # hashed as written or read back: the file's SHA-256
        assert s.sha256 == hashlib.sha256((tmp_path / "timed" / s.shard).read_bytes()).hexdigest()


# ---- engines ----------------------------------------------------------------------------------

@pytest.mark.interp
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on padding lanes
def test_triton_engine_under_the_interpreter_writes_the_numpy_bytes(tmp_path):
    """engine='triton' runs fastpath.quant (here under TRITON_INTERPRET=1) and writes exactly the
    reference's bytes; the report names the engine. The GPU run is tests/test_checkpoint_gpu.py."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (conftest sets it on CPU machines)")
    pytest.importorskip("triton")
    src = str(tmp_path / "src")
    F.nvfp4(src, np.random.default_rng(3), "modelopt", shapes=((16, 32),), shards=1)
    a = convert_checkpoint(src, str(tmp_path / "np"), ConvertOptions(target="ct-nvfp4", engine="numpy"))
    b = convert_checkpoint(src, str(tmp_path / "tr"),
                           ConvertOptions(target="ct-nvfp4", engine=F.triton_engine()))
    assert [m.engine for m in b.modules] == ["triton"] and [m.engine for m in a.modules] == ["numpy"]
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
    # a fused gate/up pair: the static shared global goes through the kernel's global_scale
    src2 = str(tmp_path / "src2")
    F.deepseek_fp8(src2, np.random.default_rng(4), shapes=((16, 32), (16, 32)), names=GATE_UP)
    a = convert_checkpoint(src2, str(tmp_path / "np2"), ConvertOptions(target="modelopt-nvfp4", engine="numpy"))
    b = convert_checkpoint(src2, str(tmp_path / "tr2"),
                           ConvertOptions(target="modelopt-nvfp4", engine=F.triton_engine()))
    assert all("shared with" in m.note for m in b.modules)
    assert all("fused FP8-block decode" in m.note for m in b.modules)  # fastpath.requant
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
    with pytest.raises(CheckpointError, match="cannot quantize"):  # 128x128 blocks: no kernel
        convert_checkpoint(src, str(tmp_path / "x"),
                           ConvertOptions(target="deepseek-fp8", engine=F.triton_engine()))


def test_fast_engines_are_plug_ins_found_by_name(tmp_path, monkeypatch):
    """moeref finds the Triton engine through the entry point pyproject.toml declares (group
    moeref.checkpoint_engines), never by importing fastpath; without one, "auto" is the reference
    (saying why) and a name asked for is an error naming the group."""
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import EntryPoint

    from moeref.checkpoint import engines as E

    meta = tomllib.load(open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb"))
    declared = meta["project"]["entry-points"][E.ENTRY_POINT_GROUP]
    assert declared == {"triton": "fastpath.checkpoint_engine:ENGINE"}
    ep = EntryPoint(name="triton", value=declared["triton"], group=E.ENTRY_POINT_GROUP)
    monkeypatch.setattr(E, "installed_engines", lambda: {"triton": ep})
    engine, why, quantizer = E.choose_engine("numpy", None, (16, 32))
    assert (engine, quantizer) == ("numpy", None)
    fast, _ = E.find_engine("triton")
    assert fast is ep.load() and fast.name == "triton" and callable(fast.choose)
    monkeypatch.setattr(E, "installed_engines", dict)
    engine, why, quantizer = E.choose_engine("auto", get_layout("ct-nvfp4").scheme(), (16, 32))
    assert engine == "numpy" and quantizer is None and E.ENTRY_POINT_GROUP in why
    with pytest.raises(CheckpointError, match="no engine 'triton' is installed"):
        E.choose_engine("triton", get_layout("ct-nvfp4").scheme(), (16, 32))
    with pytest.raises(ValueError, match="engine must be"):
        ConvertOptions(target="ct-nvfp4", engine="cutlass")
    with pytest.raises(ValueError, match="engine must be"):
        ConvertOptions(target="ct-nvfp4", engine=object())


def test_the_installed_triton_engine_is_fastpaths():
    """Where moeref's installed metadata has the entry point (an install from this pyproject.toml),
    ``--engine triton`` resolves to fastpath's engine object."""
    from moeref.checkpoint.engines import find_engine, installed_engines

    if "triton" not in installed_engines():
        pytest.skip("the installed moeref metadata predates the moeref.checkpoint_engines entry point "
                    "(pip install -e . adds it)")
    pytest.importorskip("triton")
    from fastpath.checkpoint_engine import ENGINE

    assert find_engine("triton")[0] is ENGINE
