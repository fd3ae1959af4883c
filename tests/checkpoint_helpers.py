"""What the checkpoint tests share: a fixture checkpoint built in a folder, its tensors read back with the
safetensors library, and a written checkpoint decoded with moeref's layouts."""
from __future__ import annotations

import os

import numpy as np
from safetensors import safe_open

import checkpoint_fixtures as F
from moeref.checkpoint import SafetensorsCheckpoint, get_layout

GATE_UP = ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj"]


def build(tmp_path, layout, seed=0, name="src"):
    """A checkpoint of ``layout`` (a key of ``checkpoint_fixtures.BUILDERS``) in ``tmp_path / name``:
    ``(path, oracle)``, the oracle ``{module: exact values}``."""
    path = str(tmp_path / name)
    oracle = F.BUILDERS[layout](path, np.random.default_rng(seed))
    return path, oracle


def read_all(path) -> dict:
    """``{name: torch tensor}`` of every ``*.safetensors`` file in ``path``, read with safetensors."""
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(path, fn), framework="pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
    return out


def decode_written(layout, path) -> dict:
    """{module: exact float64 values} of a written checkpoint, decoded with the library."""
    ck = SafetensorsCheckpoint.open(path)
    L = get_layout(layout)
    out = {}
    for m, roles in L.find_modules(ck).items():
        d = L.read(m, roles, ck)
        out[m] = d.q.dequantize(np.float64) if d.q is not None else d.values.astype(np.float64)
    return out
