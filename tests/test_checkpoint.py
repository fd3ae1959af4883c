"""Checkpoint conversion on small checkpoints in every real layout (tests/checkpoint_fixtures.py).

Readers are checked against the fixtures' own decoding of the published formats; writers by
reading back with the safetensors library and a LUT decode written here; conversions by their
exact error against the source values (computed here from the fixture oracle).
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")

import checkpoint_fixtures as F  # noqa: E402
from safetensors import safe_open  # noqa: E402

from moeref.checkpoint import (LAYOUTS, CheckpointError, ConvertOptions, SafetensorsCheckpoint,  # noqa: E402
                               ShardWriter, convert_checkpoint, get_layout, plan_conversion)
from moeref.checkpoint import convert as convert_mod  # noqa: E402
from moeref.checkpoint import shard as shard_mod  # noqa: E402
from moeref.cli import main  # noqa: E402


GATE_UP = ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj"]


def _build(tmp_path, layout, seed=0, name="src"):
    path = str(tmp_path / name)
    oracle = F.BUILDERS[layout](path, np.random.default_rng(seed))
    return path, oracle


def _read_all(path) -> dict:
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(path, fn), framework="pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
    return out


def _decode(layout, path) -> dict:
    """{module: exact float64 values} of a written checkpoint, decoded with the library."""
    ck = SafetensorsCheckpoint.open(path)
    L = get_layout(layout)
    out = {}
    for m, roles in L.find_modules(ck).items():
        d = L.read(m, roles, ck)
        out[m] = d.q.dequantize(np.float64) if d.q is not None else d.values.astype(np.float64)
    return out


# ---- readers -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(F.BUILDERS))
def test_reader_decodes_the_published_format(tmp_path, layout):
    src, oracle = _build(tmp_path, layout)
    plan = plan_conversion(src, ConvertOptions(target="bf16"))
    assert plan.source_layout == layout  # detected from config.json / hf_quant_config.json
    got = _decode(layout, src)
    assert set(got) == set(oracle)
    for m in oracle:
        if layout == "ct-nvfp4":
            # the oracle divides by weight_global_scale once; moeref multiplies by its float64
            # reciprocal (QuantizedTensor.global_scale is a decode factor): <= 2 float64 ulps
            np.testing.assert_allclose(got[m], oracle[m], rtol=2.0 ** -51, atol=0)
        else:
            assert np.array_equal(got[m], oracle[m]), m


# ---- writers: bytes read back with safetensors and decoded here -----------------------------

def test_gptoss_writer_bytes_and_lut(tmp_path):
    src, oracle = _build(tmp_path, "deepseek-fp8")
    dst = str(tmp_path / "dst")
    rep = convert_checkpoint(src, dst, ConvertOptions(target="gptoss-mxfp4"))
    t = _read_all(dst)
    for r in rep.modules:
        blocks = t[r.module + "_blocks"].numpy()
        scales = t[r.module + "_scales"].numpy()
        n, k = r.shape
        assert blocks.shape == (n, k // 32, 16) and scales.shape == (n, k // 32)
        lo, hi = blocks & 0xF, blocks >> 4
        codes = np.stack([lo, hi], -1).reshape(n, k // 32, 32)  # low nibble = even element
        vals = np.ldexp(F.E2M1_LUT[codes], scales[..., None].astype(np.int64) - 127).reshape(n, k)
        err = vals - oracle[r.module]
        assert r.max_abs_error == float(np.max(np.abs(err)))
        assert r.rel_l2 == pytest.approx(np.linalg.norm(err) / np.linalg.norm(oracle[r.module]),
                                         rel=1e-12)


def test_modelopt_and_ct_nvfp4_writers_store_decode_factor_and_its_reciprocal(tmp_path):
    src, oracle = _build(tmp_path, "bf16")
    for target in ("modelopt-nvfp4", "ct-nvfp4"):
        dst = str(tmp_path / target)
        rep = convert_checkpoint(src, dst, ConvertOptions(target=target))
        t = _read_all(dst)
        for r in rep.modules:
            m = r.module
            if target == "modelopt-nvfp4":
                w, g = t[m + ".weight"].numpy(), float(t[m + ".weight_scale_2"].float())
                assert t[m + ".weight_scale_2"].shape == ()
            else:
                w, g = t[m + ".weight_packed"].numpy(), 1.0 / float(t[m + ".weight_global_scale"])
                assert t[m + ".weight_global_scale"].shape == (1,)
            bs = t[m + ".weight_scale"]
            assert bs.dtype == torch.float8_e4m3fn and w.dtype == np.uint8
            codes = np.stack([w & 0xF, w >> 4], -1).reshape(w.shape[0], -1)
            vals = F.E2M1_LUT[codes] * np.repeat(bs.float().numpy().astype(np.float64), 16, -1) * g
            assert float(np.max(np.abs(vals - oracle[m]))) == r.max_abs_error
            assert 15 < r.sqnr_db < 40  # FP4 of Gaussian weights: about 20 dB
        cfg = json.load(open(os.path.join(dst, "config.json")))["quantization_config"]
        assert "model.embed_tokens" in cfg["ignore"] and "model.layers.0.mlp.gate" in cfg["ignore"]
    hf = json.load(open(tmp_path / "modelopt-nvfp4" / "hf_quant_config.json"))
    assert hf["quantization"]["quant_algo"] == "NVFP4" and hf["quantization"]["group_size"] == 16
    assert not os.path.exists(tmp_path / "ct-nvfp4" / "hf_quant_config.json")


# ---- round trips and lossless conversions ---------------------------------------------------

@pytest.mark.parametrize("chain", [
    ("gptoss-mxfp4", "ct-mxfp4", "gptoss-mxfp4"),
    ("gptoss-mxfp4", "modelopt-nvfp4", "ct-nvfp4"),
    ("gptoss-mxfp4", "deepseek-fp8-ue8m0", "deepseek-fp8"),
    ("deepseek-fp8", "ct-fp8-block", "deepseek-fp8"),
    ("modelopt-nvfp4", "modelopt-nvfp4"),
])
def test_lossless_round_trips_keep_every_value(tmp_path, chain):
    src, oracle = _build(tmp_path, chain[0])
    prev = src
    for i, target in enumerate(chain[1:]):
        dst = str(tmp_path / f"step{i}")
        rep = convert_checkpoint(prev, dst, ConvertOptions(target=target, verify=True))
        assert rep.lossless, [(m.module, m.method, m.max_abs_error) for m in rep.modules]
        got = _decode(target, dst)
        for m in oracle:
            assert np.array_equal(got[m], oracle[m]), (target, m)
        prev = dst
    # non-module tensors are copied bit for bit
    a, b = _read_all(src), _read_all(prev)
    for k in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight"):
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.float32 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype != torch.float32 else b[k])


def test_static_input_scales_carry_over_modelopt_to_ct(tmp_path):
    src, _ = _build(tmp_path, "modelopt-nvfp4")
    dst = str(tmp_path / "ct")
    convert_checkpoint(src, dst, ConvertOptions(target="ct-nvfp4", verify=True))
    a, b = _read_all(src), _read_all(dst)
    m = "model.layers.0.mlp.experts.0.up_proj"
    assert float(b[m + ".input_global_scale"]) == float(np.float32(1.0 / float(a[m + ".input_scale"])))


# ---- selection, dry run, workers, report ----------------------------------------------------

def test_skip_dequantizes_to_bf16_and_lists_it_in_ignore(tmp_path):
    src, oracle = _build(tmp_path, "deepseek-fp8")
    dst = str(tmp_path / "dst")
    rep = convert_checkpoint(src, dst, ConvertOptions(target="ct-mxfp4", skip=("*experts.1*",)))
    by = {m.module: m for m in rep.modules}
    skipped = "model.layers.0.mlp.experts.1.down_proj"
    assert by[skipped].engine == "dequantize" and by[skipped].target == "bf16"
    t = _read_all(dst)
    assert t[skipped + ".weight"].dtype == torch.bfloat16 and skipped + ".weight_scale_inv" not in t
    want = oracle[skipped].astype(np.float32).astype(ml_dtypes.bfloat16)  # RNE via float32
    assert np.array_equal(t[skipped + ".weight"].view(torch.int16).numpy(), want.view(np.int16))
    assert skipped in json.load(open(os.path.join(dst, "config.json")))["quantization_config"]["ignore"]
    only = convert_checkpoint(src, str(tmp_path / "only"), ConvertOptions(
        target="ct-mxfp4", only=("*experts.1*",), engine="numpy"))
    assert {m.module: m.engine for m in only.modules}[skipped] == "numpy"


def test_dry_run_writes_nothing_and_lists_actions(tmp_path, capsys):
    src, _ = _build(tmp_path, "deepseek-fp8")
    dst = str(tmp_path / "dst")
    rep = convert_checkpoint(src, dst, ConvertOptions(target="modelopt-nvfp4", dry_run=True))
    assert not os.path.exists(dst)
    assert sorted(m.method for m in rep.modules) == ["convert", "convert"]
    assert sum(s.copied for s in rep.shards) == 3
    assert main(["convert", src, dst, "--to", "modelopt-nvfp4", "--dry-run"]) == 0
    assert "dry run" in capsys.readouterr().out and not os.path.exists(dst)


def test_workers_give_the_same_bytes_and_json_report(tmp_path):
    src, _ = _build(tmp_path, "gptoss-mxfp4")
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


# ---- safety ----------------------------------------------------------------------------------

def test_destination_rules(tmp_path):
    src, _ = _build(tmp_path, "ct-mxfp4")
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
    src, oracle = _build(tmp_path, "deepseek-fp8")
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
    assert set(_decode("ct-nvfp4", dst)) == set(oracle) and all(s.verified for s in rep.shards)
    with pytest.raises(CheckpointError, match="other settings"):
        convert_checkpoint(src, dst, ConvertOptions(target="ct-mxfp4", resume=True))


def test_verify_catches_a_tampered_shard(tmp_path):
    src, _ = _build(tmp_path, "ct-mxfp4")
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
    want = {"plan", "read", "quantize", "report", "layout", "group_global", "write", "close", "hash", "record",
            "finish"}
    if report_device == "cpu":  # the pipelined path: the conversion thread's waits
        want |= {"wait_read", "wait_write", "wait_hash"}
    assert want <= set(got["seconds"]) and all(v >= 0 for v in got["seconds"].values())
    assert got["counts"]["quantize"] == got["counts"]["report"] == 3 and got["counts"]["group_global"] == 2
    assert got["counts"]["close"] == got["counts"]["hash"] == 2 and got["counts"]["plan"] == 1


def test_the_host_path_computes_a_fused_groups_global_once(tmp_path, monkeypatch):
    """Per shard, a fused group's global is computed once (the members share it), not once per member."""
    src = str(tmp_path / "src")
    F.deepseek_fp8(src, np.random.default_rng(7), shapes=((128, 256), (128, 256)), names=GATE_UP)
    calls = []
    real = shard_mod._group_global
    monkeypatch.setattr(shard_mod, "_group_global", lambda members, *a, **k: (calls.append(members),
                                                                                real(members, *a, **k))[1])
    convert_checkpoint(src, str(tmp_path / "dst"), ConvertOptions(target="ct-nvfp4", report_device="host"))
    assert calls == [tuple(GATE_UP)]


# ---- bad input ------------------------------------------------------------------------------

def _tamper(src, drop=None, replace=None):
    """Rewrite a single-file checkpoint without ``drop`` / with ``replace`` tensors."""
    path = os.path.join(src, "model.safetensors")
    t = _read_all(src)
    for k in drop or ():
        del t[k]
    t.update(replace or {})
    from safetensors.torch import save_file
    save_file(t, path)
    return path


def test_missing_scale_names_tensor_and_file(tmp_path):
    src, _ = _build(tmp_path, "ct-fp8-block")
    path = _tamper(src, drop=["model.layers.0.self_attn.o_proj.weight_scale"])
    with pytest.raises(CheckpointError, match=r"o_proj\.weight.*model\.safetensors.*no scale"):
        convert_checkpoint(src, str(tmp_path / "d"), ConvertOptions(target="deepseek-fp8"))
    assert path.endswith("model.safetensors")


def test_shape_mismatch_and_wrong_dtype_name_tensor_and_file(tmp_path):
    src, _ = _build(tmp_path, "ct-fp8-block")
    m = "model.layers.0.self_attn.o_proj"
    _tamper(src, replace={m + ".weight_scale": torch.ones(3, 2)})
    with pytest.raises(CheckpointError, match=rf"{m}.*model\.safetensors.*scales shape \(3, 2\)"):
        convert_checkpoint(src, str(tmp_path / "d"), ConvertOptions(target="deepseek-fp8"))
    _tamper(src, replace={m + ".weight_scale": torch.ones(2, 2, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=rf"{m}\.weight_scale.*model\.safetensors.*dtype I32"):
        convert_checkpoint(src, str(tmp_path / "e"), ConvertOptions(target="deepseek-fp8"))


def test_unknown_layout_and_unsupported_target_shape(tmp_path):
    src, _ = _build(tmp_path, "ct-mxfp4")
    cfg = os.path.join(src, "config.json")
    json.dump({"quantization_config": {"quant_method": "awq"}}, open(cfg, "w"))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        plan_conversion(src, ConvertOptions(target="bf16"))
    with pytest.raises(ValueError, match="unknown checkpoint layout"):
        ConvertOptions(target="nvfp4-swizzled")
    src2, _ = _build(tmp_path, "bf16", name="bf")
    _tamper_shape = os.path.join(src2, "config.json")
    assert os.path.exists(_tamper_shape)
    with pytest.raises(ValueError, match="preset"):
        ConvertOptions(target="ct-mxfp4", preset="no-such-preset")


def test_layout_table_is_complete():
    assert set(LAYOUTS) == set(F.BUILDERS)


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


def test_quantized_tensors_without_a_quantization_config_are_refused(tmp_path):
    src, _ = _build(tmp_path, "deepseek-fp8")
    cfg = os.path.join(src, "config.json")
    json.dump({"architectures": ["TinyMoE"]}, open(cfg, "w"))  # the quantization_config is lost
    with pytest.raises(CheckpointError, match=r"F8_E4M3.*no quantization_config.*--from"):
        plan_conversion(src, ConvertOptions(target="ct-nvfp4"))
    plan = plan_conversion(src, ConvertOptions(target="ct-nvfp4", source_layout="deepseek-fp8"))
    assert plan.source_layout == "deepseek-fp8" and len(plan.modules) == 2


def test_cli_with_progress_bar_and_table(tmp_path, capsys):
    src, _ = _build(tmp_path, "gptoss-mxfp4")
    dst = str(tmp_path / "dst")
    assert main(["convert", src, dst, "--to", "modelopt-nvfp4", "--verify"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps to the terminal width
    assert "2 modules converted (2 lossless)" in out and "gptoss-mxfp4 -> modelopt-nvfp4" in out
    rec = json.load(open(os.path.join(dst, "moeref-convert.json")))
    assert rec["complete"] is True
    assert {m["method"] for s in rec["report"]["shards"] for m in s["modules"]} == {"exact_rescale"}


def test_resume_with_verify_checks_shards_written_without_it(tmp_path, monkeypatch):
    src, _ = _build(tmp_path, "deepseek-fp8")
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


@pytest.mark.parametrize("target", ["modelopt-nvfp4", "ct-nvfp4"])
def test_fused_gate_up_share_one_global_from_the_max_amax(tmp_path, target):
    """ModelOpt preprocess_linear_fusion: gate/up of one expert get one weight_scale_2 =
    max(amax) / 2688 (vLLM loads w1's for both; TensorRT-LLM asserts equality)."""
    src = str(tmp_path / "src")
    oracle = F.deepseek_fp8(src, np.random.default_rng(7), shapes=((128, 256), (128, 256)),
                            names=GATE_UP)
    amax = [float(np.max(np.abs(oracle[m].astype(np.float32)))) for m in GATE_UP]
    assert amax[0] != amax[1]
    dst = str(tmp_path / "dst")
    rep = convert_checkpoint(src, dst, ConvertOptions(target=target, verify=True))
    t = _read_all(dst)
    if target == "modelopt-nvfp4":
        g = [float(t[m + ".weight_scale_2"]) for m in GATE_UP]
        want = float(np.float32(max(amax)) / np.float32(2688))  # torchao: fl32(A / 2688)
    else:
        g = [float(t[m + ".weight_global_scale"][0]) for m in GATE_UP]
        want = float(np.float32(2688) / np.float32(max(amax)))  # vLLM: fl32(2688 / A)
    assert g[0] == g[1] == want
    assert all("shared with" in m.note for m in rep.modules)
    alone = convert_checkpoint(src, str(tmp_path / "alone"),
                               ConvertOptions(target=target, share_global=False))
    ta = _read_all(str(tmp_path / "alone"))
    key = ".weight_scale_2" if target == "modelopt-nvfp4" else ".weight_global_scale"
    assert float(ta[GATE_UP[0] + key].reshape(-1)[0]) != float(ta[GATE_UP[1] + key].reshape(-1)[0])
    top = GATE_UP[int(np.argmax(amax))]  # the member holding the max is quantized as alone
    assert torch.equal(t[top + ".weight_scale"].view(torch.uint8),
                       ta[top + ".weight_scale"].view(torch.uint8))


def test_a_shared_source_global_is_kept_and_stays_lossless(tmp_path):
    src = str(tmp_path / "src")
    oracle = F.nvfp4(src, np.random.default_rng(8), "modelopt", shapes=((32, 64), (32, 64)),
                     names=GATE_UP, shared_global=3e-4)
    rep = convert_checkpoint(src, str(tmp_path / "mo"), ConvertOptions(target="modelopt-nvfp4",
                                                                       verify=True))
    assert rep.lossless and all("source's shared global" in m.note for m in rep.modules)
    t = _read_all(str(tmp_path / "mo"))
    assert float(t[GATE_UP[0] + ".weight_scale_2"]) == float(t[GATE_UP[1] + ".weight_scale_2"]) \
        == float(np.float32(3e-4))
    got = _decode("modelopt-nvfp4", str(tmp_path / "mo"))
    assert all(np.array_equal(got[m], oracle[m]) for m in GATE_UP)


# ---- --scale-layout swizzled ---------------------------------------------------------------

@pytest.mark.parametrize("target", ["modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4"])
def test_swizzled_scale_layout_writes_the_layouts_swizzle_and_reads_back(tmp_path, target):
    from moeref.layouts import swizzle_128x4, swizzled_shape_128x4

    src, _ = _build(tmp_path, "deepseek-fp8")  # 256 x 192 and 200 x 160: padded rows and groups
    lin, swz = str(tmp_path / "lin"), str(tmp_path / "swz")
    convert_checkpoint(src, lin, ConvertOptions(target=target, engine="numpy"))
    rep = convert_checkpoint(src, swz, ConvertOptions(target=target, engine="numpy",
                                                      scale_layout="swizzled", verify=True))
    assert all(s.verified for s in rep.shards)
    a, b = _read_all(lin), _read_all(swz)
    assert set(a) == set(b)
    scales = [n for n in a if n.endswith(".weight_scale")]
    assert len(scales) == 2 and any(b[n].shape != a[n].shape for n in scales)  # padded and not
    for n in a:
        if n not in scales:
            assert torch.equal(a[n], b[n]), n
            continue
        x, y = a[n].view(torch.uint8).numpy(), b[n].view(torch.uint8).numpy()
        if n in scales:
            assert y.shape == swizzled_shape_128x4(*x.shape)
            assert np.array_equal(y, swizzle_128x4(x, out="2d")) and not np.array_equal(
                y[:x.shape[0], :x.shape[1]], x)
    qc = json.load(open(os.path.join(swz, "config.json")))["quantization_config"]
    assert qc["moeref_scale_layout"] == "swizzled_128x4"
    assert "moeref_scale_layout" not in json.load(open(os.path.join(lin, "config.json")))["quantization_config"]
    if target == "modelopt-nvfp4":
        hf = json.load(open(os.path.join(swz, "hf_quant_config.json")))
        assert hf["quantization"]["moeref_scale_layout"] == "swizzled_128x4"
    # the swizzled checkpoint as a source: read through the unswizzle, the same values
    back_l, back_s = str(tmp_path / "bl"), str(tmp_path / "bs")
    convert_checkpoint(lin, back_l, ConvertOptions(target="bf16", engine="numpy"))
    convert_checkpoint(swz, back_s, ConvertOptions(target="bf16", engine="numpy"))
    ra, rb = _read_all(back_l), _read_all(back_s)
    assert all(torch.equal(ra[n], rb[n]) for n in ra)


def test_swizzled_scale_layout_is_refused_where_there_is_no_block_scale_to_swizzle():
    for target in ("gptoss-mxfp4", "deepseek-fp8", "bf16"):
        with pytest.raises(ValueError, match="scale_layout 'swizzled'"):
            ConvertOptions(target=target, scale_layout="swizzled")
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        ConvertOptions(target="ct-nvfp4", scale_layout="128x4")
