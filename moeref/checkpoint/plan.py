"""The conversion plan: what ``moeref convert`` will do with every tensor, decided from the headers and configs
alone (:func:`plan_conversion`; ``--dry-run`` prints it), and the fused groups that share a global scale. Nothing
is read or converted here; :mod:`.convert` carries the plan out."""
from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field

from .layouts import detect_layout, get_layout
from .safetensors_io import SafetensorsCheckpoint
from .scale_layout import scale_layout_of

__all__ = ["Plan", "plan_conversion"]


@dataclass
class Plan:
    """What a conversion will do, per shard (``--dry-run`` prints it).

    ``actions[shard]`` is a list of ``(tensor or module, action, shape)`` with action
    ``"convert"`` (module requantized), ``"dequantize"`` (module written as BF16), ``"copy"``.
    """

    source: str
    source_layout: str
    target_layout: str
    shards: list
    modules: dict
    actions: dict
    ignore: list
    has_input_scales: bool
    groups: dict = field(default_factory=dict)
    source_scale_layout: str = "linear"

    def rows(self):
        for shard in self.shards:
            for name, action, shape in self.actions[shard]:
                yield shard, name, action, shape


def _load_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _selected(module: str, opts: ConvertOptions) -> bool:
    if opts.only and not any(fnmatch.fnmatchcase(module, p) for p in opts.only):
        return False
    return not any(fnmatch.fnmatchcase(module, p) for p in opts.skip)


def plan_conversion(src: str, opts: ConvertOptions) -> Plan:
    """Read headers and configs only; decide every tensor's fate (nothing is converted)."""
    ck = SafetensorsCheckpoint.open(src)
    config = _load_json(os.path.join(src, "config.json")) or {}
    hfq = _load_json(os.path.join(src, "hf_quant_config.json"))
    sl = get_layout(opts.source_layout) if opts.source_layout else detect_layout(config, hfq)
    tl = get_layout(opts.target)
    modules = sl.find_modules(ck)
    if sl.name == "bf16":  # unselected float modules are plain copies
        modules = {m: r for m, r in modules.items() if _selected(m, opts) and tl.name != "bf16"}
    owner = {t: m for m, roles in modules.items() for t in roles.values()}
    actions = {s: [] for s in ck.shards}
    ignore, has_input = [], False
    order = {n: i for i, n in enumerate(ck.names())}
    position = {}
    for m, roles in modules.items():
        primary = next(iter(roles.values()))
        position[m] = order[primary]
        if _selected(m, opts) and tl.name != "bf16":
            act = "convert"
            has_input |= "input" in roles
        else:
            act = "dequantize"
            ignore.append(m)
        actions[ck.shard_of(primary)].append((m, act, _module_shape(sl, m, roles, ck)))
    for shard in ck.shards:
        for n in ck.names(shard):
            if n in owner:
                continue
            dt, shape = ck.info(n)
            position[n] = order[n]
            actions[shard].append((n, "copy", shape))
            if n.endswith(".weight") and len(shape) >= 2 and dt in ("F32", "F16", "BF16"):
                ignore.append(n[: -len(".weight")])
    if tl.name == "bf16":
        ignore = []
    for shard in ck.shards:  # file order: a module at its first tensor's place
        actions[shard].sort(key=lambda r: position[r[0]])
    groups = {}
    if opts.share_global and tl.scheme(opts.preset) is not None and tl.scheme(opts.preset).global_scale:
        converted = {n for shard in ck.shards for n, a, _ in actions[shard] if a == "convert"}
        for m in converted:
            for fused in _FUSED:
                for suffix in fused:
                    if m.endswith(suffix):
                        base = m[: -len(suffix)]
                        members = tuple(base + x for x in fused if base + x in converted)
                        if len(members) > 1:
                            groups[m] = members
    return Plan(src, sl.name, tl.name, list(ck.shards), modules, actions, sorted(set(ignore)),
                has_input, groups, scale_layout_of(config, hfq))


_FUSED = ((".gate_proj", ".up_proj"), (".w1", ".w3"), (".q_proj", ".k_proj", ".v_proj"))
"""Linears that read one input and that ModelOpt gives one global scale (its fused groups)."""


def _module_shape(layout, m, roles, ck) -> tuple:
    dt, shape = ck.info(next(iter(roles.values())))
    if layout.name == "gptoss-mxfp4":
        return tuple(shape[:-2]) + (shape[-2] * 32,)
    if dt == "U8":  # packed FP4 along K
        return tuple(shape[:-1]) + (2 * shape[-1],)
    return tuple(shape)
