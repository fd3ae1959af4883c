"""Checkpoint conversion on small checkpoints in every real layout (tests/checkpoint_fixtures.py): what is
written.

Readers are checked against the fixtures' own decoding of the published formats; writers by
reading back with the safetensors library and a LUT decode written here; conversions by their
exact error against the source values (computed here from the fixture oracle). How a conversion
runs (dry run, workers, report, resume, verify, the shard writer, engines, the CLI) is
tests/test_checkpoint_run.py.
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
from checkpoint_helpers import GATE_UP, build, decode_written, read_all  # noqa: E402

from moeref.checkpoint import (LAYOUTS, CheckpointError, ConvertOptions, convert_checkpoint,  # noqa: E402
                               plan_conversion)
from moeref.checkpoint import shard as shard_mod  # noqa: E402


# ---- readers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(F.BUILDERS))
def test_reader_decodes_the_published_format(tmp_path, layout):
    src, oracle = build(tmp_path, layout)
    plan = plan_conversion(src, ConvertOptions(target="bf16"))
    assert plan.source_layout == layout  # detected from config.json / hf_quant_config.json
    got = decode_written(layout, src)
    assert set(got) == set(oracle)
    for m in oracle:
        if layout == "ct-nvfp4":
            # the oracle divides by weight_global_scale once; moeref multiplies by its float64
            # reciprocal (QuantizedTensor.global_scale is a decode factor): <= 2 float64 ulps
            np.testing.assert_allclose(got[m], oracle[m], rtol=2.0 ** -51, atol=0)
        else:
            assert np.array_equal(got[m], oracle[m]), m


# ---- writers: bytes read back with safetensors and decoded here -------------------------------

def test_gptoss_writer_bytes_and_lut(tmp_path):
    src, oracle = build(tmp_path, "deepseek-fp8")
    dst = str(tmp_path / "dst")
    rep = convert_checkpoint(src, dst, ConvertOptions(target="gptoss-mxfp4"))
    t = read_all(dst)
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
    src, oracle = build(tmp_path, "bf16")
    for target in ("modelopt-nvfp4", "ct-nvfp4"):
        dst = str(tmp_path / target)
        rep = convert_checkpoint(src, dst, ConvertOptions(target=target))
        t = read_all(dst)
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


# ---- round trips and lossless conversions -----------------------------------------------------

@pytest.mark.parametrize("chain", [
    ("gptoss-mxfp4", "ct-mxfp4", "gptoss-mxfp4"),
    ("gptoss-mxfp4", "modelopt-nvfp4", "ct-nvfp4"),
    ("gptoss-mxfp4", "deepseek-fp8-ue8m0", "deepseek-fp8"),
    ("deepseek-fp8", "ct-fp8-block", "deepseek-fp8"),
    ("modelopt-nvfp4", "modelopt-nvfp4"),
])
def test_lossless_round_trips_keep_every_value(tmp_path, chain):
    src, oracle = build(tmp_path, chain[0])
    prev = src
    for i, target in enumerate(chain[1:]):
        dst = str(tmp_path / f"step{i}")
        rep = convert_checkpoint(prev, dst, ConvertOptions(target=target, verify=True))
        assert rep.lossless, [(m.module, m.method, m.max_abs_error) for m in rep.modules]
        got = decode_written(target, dst)
        for m in oracle:
            assert np.array_equal(got[m], oracle[m]), (target, m)
        prev = dst
    # non-module tensors are copied bit for bit
    a, b = read_all(src), read_all(prev)
    for k in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight"):
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.float32 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype != torch.float32 else b[k])


def test_static_input_scales_carry_over_modelopt_to_ct(tmp_path):
    src, _ = build(tmp_path, "modelopt-nvfp4")
    dst = str(tmp_path / "ct")
    convert_checkpoint(src, dst, ConvertOptions(target="ct-nvfp4", verify=True))
    a, b = read_all(src), read_all(dst)
    m = "model.layers.0.mlp.experts.0.up_proj"
    assert float(b[m + ".input_global_scale"]) == float(np.float32(1.0 / float(a[m + ".input_scale"])))


# ---- selection --------------------------------------------------------------------------------

def test_skip_dequantizes_to_bf16_and_lists_it_in_ignore(tmp_path):
    src, oracle = build(tmp_path, "deepseek-fp8")
    dst = str(tmp_path / "dst")
    rep = convert_checkpoint(src, dst, ConvertOptions(target="ct-mxfp4", skip=("*experts.1*",)))
    by = {m.module: m for m in rep.modules}
    skipped = "model.layers.0.mlp.experts.1.down_proj"
    assert by[skipped].engine == "dequantize" and by[skipped].target == "bf16"
    t = read_all(dst)
    assert t[skipped + ".weight"].dtype == torch.bfloat16 and skipped + ".weight_scale_inv" not in t
    want = oracle[skipped].astype(np.float32).astype(ml_dtypes.bfloat16)  # RNE via float32
    assert np.array_equal(t[skipped + ".weight"].view(torch.int16).numpy(), want.view(np.int16))
    assert skipped in json.load(open(os.path.join(dst, "config.json")))["quantization_config"]["ignore"]
    only = convert_checkpoint(src, str(tmp_path / "only"), ConvertOptions(
        target="ct-mxfp4", only=("*experts.1*",), engine="numpy"))
    assert {m.module: m.engine for m in only.modules}[skipped] == "numpy"


# ---- bad input --------------------------------------------------------------------------------

def _tamper(src, drop=None, replace=None):
    """Rewrite a single-file checkpoint without ``drop`` / with ``replace`` tensors."""
    path = os.path.join(src, "model.safetensors")
    t = read_all(src)
    for k in drop or ():
        del t[k]
    t.update(replace or {})
    from safetensors.torch import save_file
    save_file(t, path)
    return path


def test_missing_scale_names_tensor_and_file(tmp_path):
    src, _ = build(tmp_path, "ct-fp8-block")
    path = _tamper(src, drop=["model.layers.0.self_attn.o_proj.weight_scale"])
    with pytest.raises(CheckpointError, match=r"o_proj\.weight.*model\.safetensors.*no scale"):
        convert_checkpoint(src, str(tmp_path / "d"), ConvertOptions(target="deepseek-fp8"))
    assert path.endswith("model.safetensors")


def test_shape_mismatch_and_wrong_dtype_name_tensor_and_file(tmp_path):
    src, _ = build(tmp_path, "ct-fp8-block")
    m = "model.layers.0.self_attn.o_proj"
    _tamper(src, replace={m + ".weight_scale": torch.ones(3, 2)})
    with pytest.raises(CheckpointError, match=rf"{m}.*model\.safetensors.*scales shape \(3, 2\)"):
        convert_checkpoint(src, str(tmp_path / "d"), ConvertOptions(target="deepseek-fp8"))
    _tamper(src, replace={m + ".weight_scale": torch.ones(2, 2, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=rf"{m}\.weight_scale.*model\.safetensors.*dtype I32"):
        convert_checkpoint(src, str(tmp_path / "e"), ConvertOptions(target="deepseek-fp8"))


def test_unknown_layout_and_unsupported_target_shape(tmp_path):
    src, _ = build(tmp_path, "ct-mxfp4")
    cfg = os.path.join(src, "config.json")
    json.dump({"quantization_config": {"quant_method": "awq"}}, open(cfg, "w"))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        plan_conversion(src, ConvertOptions(target="bf16"))
    with pytest.raises(ValueError, match="unknown checkpoint layout"):
        ConvertOptions(target="nvfp4-swizzled")
    src2, _ = build(tmp_path, "bf16", name="bf")
    _tamper_shape = os.path.join(src2, "config.json")
    assert os.path.exists(_tamper_shape)
    with pytest.raises(ValueError, match="preset"):
        ConvertOptions(target="ct-mxfp4", preset="no-such-preset")


def test_layout_table_is_complete():
    assert set(LAYOUTS) == set(F.BUILDERS)


def test_quantized_tensors_without_a_quantization_config_are_refused(tmp_path):
    src, _ = build(tmp_path, "deepseek-fp8")
    cfg = os.path.join(src, "config.json")
    json.dump({"architectures": ["TinyMoE"]}, open(cfg, "w"))  # the quantization_config is lost
    with pytest.raises(CheckpointError, match=r"F8_E4M3.*no quantization_config.*--from"):
        plan_conversion(src, ConvertOptions(target="ct-nvfp4"))
    plan = plan_conversion(src, ConvertOptions(target="ct-nvfp4", source_layout="deepseek-fp8"))
    assert plan.source_layout == "deepseek-fp8" and len(plan.modules) == 2


# ---- fused gate/up globals --------------------------------------------------------------------

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
    t = read_all(dst)
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
    ta = read_all(str(tmp_path / "alone"))
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
    t = read_all(str(tmp_path / "mo"))
    assert float(t[GATE_UP[0] + ".weight_scale_2"]) == float(t[GATE_UP[1] + ".weight_scale_2"]) \
        == float(np.float32(3e-4))
    got = decode_written("modelopt-nvfp4", str(tmp_path / "mo"))
    assert all(np.array_equal(got[m], oracle[m]) for m in GATE_UP)


# ---- --scale-layout swizzled ------------------------------------------------------------------

@pytest.mark.parametrize("target", ["modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4"])
def test_swizzled_scale_layout_writes_the_layouts_swizzle_and_reads_back(tmp_path, target):
    from moeref.layouts import swizzle_128x4, swizzled_shape_128x4

    src, _ = build(tmp_path, "deepseek-fp8")  # 256 x 192 and 200 x 160: padded rows and groups
    lin, swz = str(tmp_path / "lin"), str(tmp_path / "swz")
    convert_checkpoint(src, lin, ConvertOptions(target=target, engine="numpy"))
    rep = convert_checkpoint(src, swz, ConvertOptions(target=target, engine="numpy",
                                                      scale_layout="swizzled", verify=True))
    assert all(s.verified for s in rep.shards)
    a, b = read_all(lin), read_all(swz)
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
    ra, rb = read_all(back_l), read_all(back_s)
    assert all(torch.equal(ra[n], rb[n]) for n in ra)


def test_swizzled_scale_layout_is_refused_where_there_is_no_block_scale_to_swizzle():
    for target in ("gptoss-mxfp4", "deepseek-fp8", "bf16"):
        with pytest.raises(ValueError, match="scale_layout 'swizzled'"):
            ConvertOptions(target=target, scale_layout="swizzled")
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        ConvertOptions(target="ct-nvfp4", scale_layout="128x4")
