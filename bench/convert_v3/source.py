"""The DeepSeek-V3-sized conversion's source: the tensors of a DeepSeek-V3 671B decoder layer and of the whole
model (:func:`layer_tensors`, :func:`global_tensors`: names, kinds and shapes as in the Hugging Face checkpoint),
their bytes (:func:`source_bytes`, :func:`model_source_bytes`), and the random source checkpoint in DeepSeek's FP8
layout (:func:`write_source`, with the random arrays of :func:`_arrays`; :func:`rename_source` gives a written one
the next layer's names in place)."""
from __future__ import annotations

import json
import os

import numpy as np

from bench.convert_v3.disk import drop_cache

V3 = dict(hidden=7168, moe_inter=2048, dense_inter=18432, experts=256, shared=1, q_lora=1536, kv_lora=512,
          heads=128, nope=128, rope=64, v_head=128, vocab=129280, layers=61, dense_layers=3)
"""DeepSeek-V3 671B (deepseek-ai/DeepSeek-V3 inference/configs/config_671B.json)."""

TINY = dict(hidden=256, moe_inter=128, dense_inter=384, experts=4, shared=1, q_lora=128, kv_lora=128,
            heads=2, nope=64, rope=64, v_head=64, vocab=512, layers=61, dense_layers=3)
"""Every dimension shrunk (multiples of 128 and 16: the same blocks), for the CPU test."""


def layer_tensors(layer: int, d: dict) -> list:
    """``(name, kind, shape)`` of one decoder layer in the DeepSeek-V3 Hugging Face checkpoint, kind ``"fp8"``
    (a quantized linear: ``.weight`` F8_E4M3 + ``.weight_scale_inv`` F32), ``"bf16"`` or ``"f32"``."""
    H, p = d["hidden"], f"model.layers.{layer}."
    out = [(p + "input_layernorm.weight", "bf16", (H,)),
           (p + "self_attn.q_a_proj", "fp8", (d["q_lora"], H)),
           (p + "self_attn.q_a_layernorm.weight", "bf16", (d["q_lora"],)),
           (p + "self_attn.q_b_proj", "fp8", (d["heads"] * (d["nope"] + d["rope"]), d["q_lora"])),
           (p + "self_attn.kv_a_proj_with_mqa", "fp8", (d["kv_lora"] + d["rope"], H)),
           (p + "self_attn.kv_a_layernorm.weight", "bf16", (d["kv_lora"],)),
           (p + "self_attn.kv_b_proj", "fp8", (d["heads"] * (d["nope"] + d["v_head"]), d["kv_lora"])),
           (p + "self_attn.o_proj", "fp8", (H, d["heads"] * d["v_head"])),
           (p + "post_attention_layernorm.weight", "bf16", (H,))]
    if layer < d["dense_layers"]:
        inter = d["dense_inter"]
        return out + [(p + f"mlp.{w}", "fp8", (inter, H) if w != "down_proj" else (H, inter))
                      for w in ("gate_proj", "up_proj", "down_proj")]
    out += [(p + "mlp.gate.weight", "bf16", (d["experts"], H)),
            (p + "mlp.gate.e_score_correction_bias", "f32", (d["experts"],))]
    inter = d["moe_inter"]
    for e in [f"experts.{i}" for i in range(d["experts"])] + ["shared_experts"] * d["shared"]:
        out += [(p + f"mlp.{e}.{w}", "fp8", (inter, H) if w != "down_proj" else (H, inter))
                for w in ("gate_proj", "up_proj", "down_proj")]
    return out


def global_tensors(d: dict) -> list:
    return [("model.embed_tokens.weight", "bf16", (d["vocab"], d["hidden"])),
            ("model.norm.weight", "bf16", (d["hidden"],)), ("lm_head.weight", "bf16", (d["vocab"], d["hidden"]))]


def source_bytes(tensors: list) -> int:
    """Bytes of the source tensors (FP8 weights with their F32 block scales, BF16, F32)."""
    n = 0
    for _, kind, shape in tensors:
        size = int(np.prod(shape))
        if kind == "fp8":
            n += size + 4 * (-(-shape[0] // 128)) * (-(-shape[1] // 128))
        else:
            n += size * (2 if kind == "bf16" else 4)
    return n


def model_source_bytes(d: dict) -> int:
    return sum(source_bytes(layer_tensors(i, d)) for i in range(d["layers"])) + source_bytes(global_tensors(d))


RANDOM_CHUNK = 16 << 20
"""Bytes of random codes one generator thread makes at a time."""


def _random_codes(n: int, seed: tuple, pool) -> np.ndarray:
    """``n`` random E4M3 codes (uint8), uniform over the 254 finite codes but for 0x7E and 0xFE (+-448), which
    also take the NaN codes' share (0x7F, 0xFF become them): random bytes from PCG64 (``random_raw``, which
    releases the GIL, so ``pool``'s threads each fill a chunk), the NaN codes moved down by one in place."""
    out = np.empty(-(-n // 8) * 8, np.uint8)
    chunks = [(lo, min(lo + RANDOM_CHUNK, out.size)) for lo in range(0, out.size, RANDOM_CHUNK)]

    def fill(i):
        lo, hi = chunks[i]
        bits = np.random.PCG64(np.random.SeedSequence(seed + (i,))).random_raw((hi - lo) // 8)
        c = bits.view(np.uint8)
        np.subtract(c, (c & 0x7F) == 0x7F, out=c, casting="unsafe")  # a NaN code -> the largest finite one
        out[lo:hi] = c

    list(pool.map(fill, range(len(chunks))))
    return out[:n]


def _arrays(name, kind, shape, seed: tuple, pool):
    """``[(tensor name, host array)]`` of one tensor of :func:`layer_tensors`, random: an FP8 weight's codes
    uniform over the finite E4M3 codes (:func:`_random_codes`; magnitudes from 2^-9 to 448), its 128x128 block
    scales uniform in [0.5, 2] x 2^-9 (float32), BF16 and F32 tensors N(0, 1)."""
    import ml_dtypes

    size = int(np.prod(shape))
    if kind == "fp8":
        w = _random_codes(size, seed, pool).reshape(shape).view(ml_dtypes.float8_e4m3fn)
        rng = np.random.default_rng(np.random.SeedSequence(seed + (1 << 20,)))
        grid = (-(-shape[0] // 128), -(-shape[1] // 128))
        s = ((rng.random(grid, dtype=np.float32) * 1.5 + 0.5) * 2.0 ** -9).astype(np.float32)
        return [(name + ".weight", w), (name + ".weight_scale_inv", s)]
    t = np.random.default_rng(np.random.SeedSequence(seed)).standard_normal(shape, dtype=np.float32)
    return [(name, t.astype(ml_dtypes.bfloat16) if kind == "bf16" else t)]


def write_source(path: str, tensors: list, shard_bytes: int, seed: int, times=None) -> int:
    """The DeepSeek FP8 checkpoint of ``tensors`` in ``path`` (shards of at most ``shard_bytes``, index,
    config), every shard fsync'd and dropped from the page cache. Returns the bytes written. ``times``: a
    :class:`moeref.checkpoint.report.StageTimes` that receives ``generate`` (the random arrays), ``write``
    (handed to the files), ``fsync`` (a shard's close: header, fsync, rename) and ``drop_cache``."""
    from concurrent.futures import ThreadPoolExecutor

    from moeref.checkpoint import ShardWriter
    from moeref.checkpoint.report import timed

    os.makedirs(path)
    groups, cur, size = [], [], 0
    for t in tensors:
        b = source_bytes([t])
        if cur and size + b > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += b
    groups.append(cur)
    wm, total, k = {}, 0, 0
    with ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 1) // 2)), thread_name_prefix="convert-v3-random") \
            as pool:
        for i, group in enumerate(groups):
            shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            fn = os.path.join(path, shard)
            w = ShardWriter(fn, {"format": "pt"}, reserve=1024 + 256 * 2 * len(group))
            for name, kind, shape in group:
                with timed(times, "generate"):
                    arrays = _arrays(name, kind, shape, (seed, k), pool)
                k += 1
                with timed(times, "write"):
                    for tname, arr in arrays:
                        w.add(tname, arr)
                        wm[tname] = shard
            with timed(times, "fsync"):
                w.close()
            with timed(times, "drop_cache"):
                drop_cache(fn)
            total += os.path.getsize(fn)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]}}, f)
    return total


def rename_source(path: str, old: int, new: int, times=None) -> int:
    """Give the source checkpoint in ``path`` (:func:`write_source`'s, of layer ``old``) the tensor names of layer
    ``new``, its bytes unchanged: each shard's header rewritten in place (the same data offsets; the header
    padded with spaces to the length the writer reserved, as the safetensors format allows), the index
    rewritten; each shard fsync'd and dropped from the page cache, so the next read comes from the disk. Returns
    the bytes of the shards. ``times`` receives ``rename`` and ``drop_cache``."""
    from moeref.checkpoint.report import timed

    a, b = f"model.layers.{old}.", f"model.layers.{new}."

    def name(k):
        return b + k[len(a):] if k.startswith(a) else k

    idx = os.path.join(path, "model.safetensors.index.json")
    with open(idx) as f:
        index = json.load(f)
    total = 0
    for shard in dict.fromkeys(index["weight_map"].values()):
        fn = os.path.join(path, shard)
        with timed(times, "rename"):
            with open(fn, "r+b") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                text = json.dumps({name(k): v for k, v in header.items()}, separators=(",", ":")).encode()
                if len(text) > n:
                    raise ValueError(f"{fn}: the header of layer {new} ({len(text)} bytes) does not fit the "
                                     f"{n} bytes reserved")
                f.seek(8)
                f.write(text + b" " * (n - len(text)))
                f.flush()
                os.fsync(f.fileno())
        with timed(times, "drop_cache"):
            drop_cache(fn)
        total += os.path.getsize(fn)
    index["weight_map"] = {name(k): v for k, v in index["weight_map"].items()}
    with open(idx, "w") as f:
        json.dump(index, f)
    return total
