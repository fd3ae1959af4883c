"""Small checkpoints in every real layout, built from the published formats (not by moeref's
writers), with the exact values each quantized module decodes to (the oracle).

Sources of the encodings: DeepSeek-V3 README_WEIGHTS.md
(F8_E4M3 weight, F32 multiplier per 128x128 block, ceil grid), openai/gpt-oss weights.py
(low nibble = even element, E8M0 bias 127 via ldexp, blocks [.., N, K/32, 16]), ModelOpt
nvfp4_tensor.py (weight_scale_2 = decode factor), compressed-tensors nvfp4 helpers
(weight_global_scale = its reciprocal, a divisor). Values decode with ml_dtypes and a LUT here.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import save_file

E2M1_LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])


def _t(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _pack(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def _save(path, tensors: dict, config: dict | None, shards: int = 1, extra: dict | None = None):
    """Write ``tensors`` (name -> ndarray) into ``shards`` files with an index when shards > 1.
    Tensors are dealt round-robin, so a weight and its scale usually land in different shards."""
    os.makedirs(path, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file({n: _t(tensors[n]) for n in names}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        wm = {}
        for i in range(shards):
            fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: _t(tensors[n]) for n in part}, os.path.join(path, fn),
                      metadata={"format": "pt"})
            wm.update({n: fn for n in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)
    cfg = {"architectures": ["TinyMoE"], "hidden_size": 64}
    if config is not None:
        cfg["quantization_config"] = config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write('{"tiny": true}')
    for name, obj in (extra or {}).items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(obj, f)


def _common(rng) -> dict:
    return {"model.embed_tokens.weight": rng.standard_normal((32, 64)).astype(ml_dtypes.bfloat16),
            "model.norm.weight": np.ones(64, np.float32),
            "model.layers.0.mlp.gate.weight": rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16)}


def deepseek_fp8(path, rng, shapes=((256, 192), (200, 160)), shards=2, ue8m0=False,
                 names=None):
    """DeepSeek FP8: returns {module: exact float64 values}."""
    tensors, oracle = _common(rng), {}
    for i, (n, k) in enumerate(shapes):
        m = names[i] if names else f"model.layers.0.mlp.experts.{i}.down_proj"
        gn, gk = -(-n // 128), -(-k // 128)
        s = np.exp2(rng.integers(-12, -4, (gn, gk))).astype(np.float32) if ue8m0 else \
            (rng.uniform(0.5, 2, (gn, gk)) * 2.0 ** -9).astype(np.float32)
        codes = rng.integers(0, 256, (n, k)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaN codes
        w = codes.view(ml_dtypes.float8_e4m3fn)
        tensors[m + ".weight"] = w
        tensors[m + ".weight_scale_inv"] = s
        full = np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)[:n, :k]
        oracle[m] = w.astype(np.float64) * full
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128]}
    if ue8m0:
        qc["scale_fmt"] = "ue8m0"
    _save(path, tensors, qc, shards)
    return oracle


def gptoss_mxfp4(path, rng, E=2, N=32, K=64, shards=2):
    tensors, oracle = _common(rng), {}
    for name in ("gate_up_proj", "down_proj"):
        m = f"model.layers.0.mlp.experts.{name}"
        codes = rng.integers(0, 16, (E, N, K)).astype(np.uint8)
        sc = rng.integers(120, 130, (E, N, K // 32)).astype(np.uint8)
        tensors[m + "_blocks"] = _pack(codes).reshape(E, N, K // 32, 16)
        tensors[m + "_scales"] = sc
        tensors[m + "_bias"] = rng.standard_normal((E, N)).astype(ml_dtypes.bfloat16)
        oracle[m] = np.ldexp(E2M1_LUT[codes], np.repeat(sc.astype(np.int64) - 127, 32, -1))
    _save(path, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.embed_tokens"]},
          shards)
    return oracle


def nvfp4(path, rng, kind="modelopt", shapes=((32, 64), (16, 96)), shards=2, names=None,
          shared_global=None):
    tensors, oracle = _common(rng), {}
    for i, (n, k) in enumerate(shapes):
        m = names[i] if names else f"model.layers.0.mlp.experts.{i}.up_proj"
        codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
        bs = rng.uniform(1, 448, (n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
        g = np.float32(shared_global if shared_global else rng.uniform(1e-4, 1e-3))
        inp = np.float32(rng.uniform(1e-3, 1e-2))
        full = np.repeat(bs.astype(np.float64), 16, -1)
        if kind == "modelopt":
            tensors.update({m + ".weight": _pack(codes), m + ".weight_scale": bs,
                            m + ".weight_scale_2": np.array(g, np.float32),
                            m + ".input_scale": np.array(inp, np.float32)})
            oracle[m] = E2M1_LUT[codes] * full * float(g)
        else:
            tensors.update({m + ".weight_packed": _pack(codes), m + ".weight_scale": bs,
                            m + ".weight_global_scale": np.array([g], np.float32),
                            m + ".input_global_scale": np.array([inp], np.float32)})
            oracle[m] = E2M1_LUT[codes] * full / float(g)
    if kind == "modelopt":
        hf = {"producer": {"name": "modelopt", "version": "0.0"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}}
        _save(path, tensors, {"quant_method": "modelopt", "quant_algo": "NVFP4"}, shards,
              extra={"hf_quant_config.json": hf})
    else:
        _save(path, tensors, {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
              shards)
    return oracle


def ct_mxfp4(path, rng, N=32, K=64, shards=1):
    tensors, oracle = _common(rng), {}
    m = "model.layers.0.mlp.experts.0.gate_proj"
    codes = rng.integers(0, 16, (N, K)).astype(np.uint8)
    sc = rng.integers(110, 140, (N, K // 32)).astype(np.uint8)
    tensors.update({m + ".weight_packed": _pack(codes), m + ".weight_scale": sc})
    oracle[m] = np.ldexp(E2M1_LUT[codes], np.repeat(sc.astype(np.int64) - 127, 32, -1))
    _save(path, tensors, {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
          shards)
    return oracle


def ct_fp8_block(path, rng, n=256, k=256, shards=1):
    tensors, oracle = _common(rng), {}
    m = "model.layers.0.self_attn.o_proj"
    codes = rng.integers(0, 0x7E, (n, k)).astype(np.uint8)
    s = (rng.uniform(0.5, 2, (n // 128, k // 128)) * 2.0 ** -8).astype(np.float32)
    w = codes.view(ml_dtypes.float8_e4m3fn)
    tensors.update({m + ".weight": w, m + ".weight_scale": s})
    oracle[m] = w.astype(np.float64) * np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)
    _save(path, tensors, {"quant_method": "compressed-tensors", "format": "float-quantized"}, shards)
    return oracle


def bf16(path, rng, shards=2):
    tensors, oracle = _common(rng), {}
    for i in range(2):
        m = f"model.layers.0.mlp.experts.{i}.gate_proj"
        w = (rng.standard_normal((64, 128)) * 0.05).astype(ml_dtypes.bfloat16)
        tensors[m + ".weight"] = w
        oracle[m] = w.astype(np.float64)
    _save(path, tensors, None, shards)
    return oracle


BUILDERS = {
    "deepseek-fp8": deepseek_fp8,
    "deepseek-fp8-ue8m0": lambda p, r: deepseek_fp8(p, r, ue8m0=True),
    "gptoss-mxfp4": gptoss_mxfp4,
    "modelopt-nvfp4": lambda p, r: nvfp4(p, r, "modelopt"),
    "ct-nvfp4": lambda p, r: nvfp4(p, r, "ct"),
    "ct-mxfp4": ct_mxfp4,
    "ct-fp8-block": ct_fp8_block,
    "bf16": bf16,
}


def triton_engine():
    """``engine=`` for the Triton conversion engine: its name where the ``moeref.checkpoint_engines`` entry
    point is installed (what ``moeref convert --engine triton`` finds), else the engine object itself (an
    editable install made before the entry point was declared; ``pip install -e .`` adds it)."""
    from moeref.checkpoint.engines import installed_engines

    if "triton" in installed_engines():
        return "triton"
    from fastpath.checkpoint_engine import ENGINE

    return ENGINE
