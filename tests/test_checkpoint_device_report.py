"""``moeref convert`` with the report on a device (``ConvertOptions.report_device``) against the host path.

The device path (moeref.quant.device_report and the pipelined shard: reader thread, conversion, writer
thread) must write the same bytes and give the same figures as the NumPy path, which the rest of
tests/test_checkpoint.py checks against the fixtures' oracles. Here on torch CPU tensors (engine "numpy",
and the Triton engine under TRITON_INTERPRET=1); on a CUDA GPU the same run for real (skipped without one).
"""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import checkpoint_fixtures as F  # noqa: E402

from moeref.checkpoint import CheckpointError, ConvertOptions, convert_checkpoint  # noqa: E402
from moeref.checkpoint import convert as convert_mod  # noqa: E402
from moeref.checkpoint import shard as shard_mod  # noqa: E402

GATE_UP = ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj"]
FIELDS = ("module", "shard", "shape", "source", "target", "engine", "method", "lossless", "worst_block")


def bits(v):
    return struct.unpack("<Q", struct.pack("<d", v))[0]


def same_reports(a, b, device):
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]  # the same bytes written
    assert len(a.modules) == len(b.modules) > 0
    for ma, mb in zip(a.modules, b.modules):
        assert [getattr(ma, f) for f in FIELDS] == [getattr(mb, f) for f in FIELDS]
        assert [bits(getattr(ma, f)) for f in ("max_abs_error", "rel_l2", "sqnr_db")] == \
            [bits(getattr(mb, f)) for f in ("max_abs_error", "rel_l2", "sqnr_db")]
        assert "report on" not in ma.note
        if mb.engine not in ("dequantize", "copy"):
            assert f"report on {device}" in mb.note or "report on the host" in mb.note


def _pairs(device):
    src_targets = [("deepseek-fp8", t) for t in ("ct-nvfp4", "modelopt-nvfp4", "ct-mxfp4", "gptoss-mxfp4",
                                                 "deepseek-fp8-ue8m0")]
    src_targets += [("bf16", "ct-nvfp4"), ("gptoss-mxfp4", "modelopt-nvfp4"), ("ct-fp8-block", "ct-mxfp4"),
                    ("modelopt-nvfp4", "ct-nvfp4"), ("ct-mxfp4", "deepseek-fp8"),
                    ("deepseek-fp8-ue8m0", "gptoss-mxfp4")]
    return [(s, t, device) for s, t in src_targets]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the same run on the device")


@pytest.mark.parametrize("source,target,device", _pairs("cpu") + [pytest.param(*p, marks=CUDA)
                                                                   for p in _pairs("cuda")])
def test_device_report_writes_the_host_bytes_and_figures(tmp_path, source, target, device):
    src = str(tmp_path / "src")
    F.BUILDERS[source](src, np.random.default_rng(11))
    a = convert_checkpoint(src, str(tmp_path / "host"), ConvertOptions(target=target, engine="numpy",
                                                                        report_device="host"))
    from moeref.checkpoint.report import StageTimes

    tm = StageTimes()
    b = convert_checkpoint(src, str(tmp_path / "dev"), ConvertOptions(target=target, engine="numpy",
                                                                       report_device=device, verify=True), timings=tm)
    same_reports(a, b, device)  # the host path hashes the files it wrote after closing them
    assert tm.as_json()["counts"].get("hash", 0) == 0  # here every shard was hashed as it was written


@pytest.mark.parametrize("target", ["ct-nvfp4", "modelopt-nvfp4"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_fused_group_shares_the_host_global_with_the_triton_engine(tmp_path, target, device):
    """gate/up of one expert share one NVFP4 global (the max of their amax, computed on the device from
    the members read once); the Triton engine takes the values as a device tensor. Same bytes, same
    figures as the host path with the NumPy engine."""
    src = str(tmp_path / "src")
    F.deepseek_fp8(src, np.random.default_rng(4), shapes=((256, 192), (256, 192)), names=GATE_UP, shards=1)
    a = convert_checkpoint(src, str(tmp_path / "host"), ConvertOptions(target=target, engine="numpy",
                                                                        report_device="host"))
    b = convert_checkpoint(src, str(tmp_path / "dev"), ConvertOptions(target=target, engine=F.triton_engine(),
                                                                       report_device=device))
    assert all("shared with" in m.note for m in b.modules)
    for m in b.modules:
        m.engine = "numpy"  # the engine differs by design; everything else must not
    same_reports(a, b, device)


def test_a_failing_pipeline_leaves_no_shard(tmp_path, monkeypatch):
    """An error in the conversion stops the reader and the writer and removes the partial files."""
    src = str(tmp_path / "src")
    F.deepseek_fp8(src, np.random.default_rng(2), shards=1)

    def boom(*a, **k):
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(shard_mod, "_convert_module", boom)
    dst = tmp_path / "dst"
    with pytest.raises(RuntimeError, match="conversion failed"):
        convert_checkpoint(src, str(dst), ConvertOptions(target="ct-mxfp4", report_device="cpu"))
    assert not [f for f in os.listdir(dst) if f.endswith((".safetensors", ".data", ".partial"))]


def test_report_device_is_checked():
    with pytest.raises(ValueError, match="report_device must be"):
        ConvertOptions(target="ct-mxfp4", report_device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="no CUDA GPU"):
            convert_mod.report_device(ConvertOptions(target="ct-mxfp4", report_device="cuda"))
        assert convert_mod.report_device(ConvertOptions(target="ct-mxfp4")) is None  # auto: the host
    assert convert_mod.report_device(ConvertOptions(target="ct-mxfp4", report_device="host")) is None


@pytest.mark.parametrize("reserve", [0, 8, 4096])
def test_shard_writer_reserve_writes_a_file_safetensors_reads(tmp_path, reserve):
    """``reserve``: the header written in place (padded with spaces), or, when it does not fit (8 bytes),
    the exact header in a second file; safetensors reads every tensor back either way."""
    from safetensors.numpy import load_file

    from moeref.checkpoint import ShardWriter

    arrays = {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.uint8)}
    path = str(tmp_path / "x.safetensors")
    w = ShardWriter(path, reserve=reserve)
    for n, a in arrays.items():
        w.add(n, a)
    w.close()
    got = load_file(path)
    assert set(got) == set(arrays) and all(np.array_equal(got[n], arrays[n]) for n in arrays)
    assert os.listdir(tmp_path) == ["x.safetensors"]
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    assert n == (4096 if reserve == 4096 else n) and n % 8 == 0
    assert (n == 4096) == (reserve == 4096)


def test_a_failing_writer_stops_the_pipeline(tmp_path, monkeypatch):
    """The writer thread's error reaches the caller (the conversion does not wait on a full queue)."""
    from moeref.checkpoint import ShardWriter

    src = str(tmp_path / "src")
    F.deepseek_fp8(src, np.random.default_rng(2), shards=1)

    def broken_add(self, name, array):
        raise OSError("disk full")

    monkeypatch.setattr(ShardWriter, "add", broken_add)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(src, str(tmp_path / "dst"), ConvertOptions(target="ct-mxfp4", report_device="cpu"))
    assert not [f for f in os.listdir(tmp_path / "dst") if f.endswith((".safetensors", ".data", ".partial"))]


def test_read_into_gives_what_read_gives_read_only(tmp_path):
    """SafetensorsCheckpoint.read_into (the pipelined reader's os.preadv reads) against the safetensors library's
    read, for every kind of tensor a checkpoint holds; a file cut short is named."""
    import hashlib

    import ml_dtypes

    from moeref.checkpoint.safetensors_io import SafetensorsCheckpoint, ShardWriter

    rng = np.random.default_rng(3)
    arrays = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
              "e4m3": rng.integers(0, 256, (4, 64), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
              "bf16": rng.standard_normal((2, 7)).astype(ml_dtypes.bfloat16),
              "scalar": np.array(1.5, np.float32), "empty": np.zeros((0, 3), np.int16),
              "u8": rng.integers(0, 256, 1001, dtype=np.uint8)}
    w = ShardWriter(str(tmp_path / "model.safetensors"))
    for k, v in arrays.items():
        w.add(k, v)
    w.close()
    ck = SafetensorsCheckpoint.open(str(tmp_path))
    sizes = []
    for k, v in arrays.items():
        got = ck.read_into(k, lambda n: sizes.append(n) or np.empty(n + 5, np.uint8))  # a larger buffer is fine
        want = ck.read(k)
        assert got.dtype == v.dtype == want.dtype and got.shape == v.shape == want.shape
        assert got.tobytes() == v.tobytes() == want.tobytes()
        assert not got.flags.writeable
        if k == "u8":  # read-only down to the buffer: a QuantizedTensor keeps it without a copy
            from moeref.quant import QuantizedTensor, fp8_block

            q = QuantizedTensor(codes=got.reshape(1, 1001), scales=np.ones((1, 8), np.float32),
                                scheme=fp8_block((128, 128), "fp32"), shape=(1, 1001))
            assert np.shares_memory(q.codes, got)
    assert sizes == [v.nbytes for v in arrays.values()]
    ck.close()
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-600])  # u8's last 600 bytes gone
    ck = SafetensorsCheckpoint.open(str(tmp_path))
    with pytest.raises(CheckpointError, match="'u8'.*ends before byte"):
        ck.read_into("u8", lambda n: np.empty(n, np.uint8))
    ck.close()
    assert hashlib.sha256(data[:-600]).hexdigest() == shard_mod.sha256_file(str(path))


def test_quantized_tensor_keeps_a_read_only_array_and_copies_what_can_change():
    """The reader's read-only arrays go into a QuantizedTensor without a copy; an array that can still be
    written through NumPy (itself, or a base of a read-only view) is copied, as before."""
    from moeref.quant import QuantizedTensor, fp8_block

    def make(codes):
        return QuantizedTensor(codes=codes, scales=np.ones((1, 1), np.float32), scheme=fp8_block((128, 128), "fp32"),
                               shape=(4, 8))

    ro = np.arange(32, dtype=np.uint8).reshape(4, 8).copy()  # owns its memory
    ro.setflags(write=False)
    assert make(ro).codes is ro
    base = np.arange(32, dtype=np.uint8).reshape(4, 8)
    view = base[:]
    view.setflags(write=False)
    q = make(view)
    assert not np.shares_memory(q.codes, base)
    base[0, 0] = 200
    assert q.codes[0, 0] == 0 and not q.codes.flags.writeable
    q2 = make(base)
    assert not np.shares_memory(q2.codes, base) and q2.codes[0, 0] == 200


def test_sha256_file_is_hashlibs_over_piece_boundaries(tmp_path):
    import hashlib

    rng = np.random.default_rng(4)
    for n in (0, 1, (16 << 20) - 1, (16 << 20), (32 << 20) + 12345):
        p = tmp_path / f"f{n}"
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        p.write_bytes(data)
        assert shard_mod.sha256_file(str(p)) == hashlib.sha256(data).hexdigest()


def test_shard_writer_hashes_as_it_writes_only_what_was_predicted(tmp_path):
    """ShardWriter(expect=...): the SHA-256 of the file when every tensor is the predicted one; None (the caller
    hashes the file) for a wrong dtype, shape, name or count, or a header longer than the room left for it. The
    bytes written never depend on the prediction."""
    import hashlib

    from moeref.checkpoint.safetensors_io import ShardWriter

    tensors = [("a", np.arange(6, dtype=np.float32).reshape(2, 3)), ("b", np.arange(5, dtype=np.uint8)),
               ("c", np.array(2.0, np.float32))]
    right = [("a", "F32", [2, 3]), ("b", "U8", [5]), ("c", "F32", [])]
    cases = {"right": (right, 4096), "dtype": ([right[0], ("b", "I8", [5]), right[2]], 4096),
             "shape": ([right[0], ("b", "U8", [1, 5]), right[2]], 4096), "name": (right[:2] + [("d", "F32", [])], 4096),
             "fewer": (right[:2], 4096), "more": (right + [("d", "F32", [])], 4096), "no room": (right, 64)}
    files = {}
    for case, (expect, reserve) in cases.items():
        path = str(tmp_path / f"{case}.safetensors")
        w = ShardWriter(path, reserve=reserve, expect=expect)
        for name, arr in tensors:
            w.add(name, arr)
        w.close()
        data = open(path, "rb").read()
        files[case] = data
        want = hashlib.sha256(data).hexdigest() if case == "right" else None
        assert w.sha256 == want, case
    assert all(files[c] == files["right"] for c in cases if c != "no room")
