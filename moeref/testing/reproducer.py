"""Reproducers: one failing layer call saved as ``<stem>.safetensors`` (inputs, expert operands and the
kernel's output, exact) and ``<stem>.json`` (the configuration), and loaded back to re-run the check.

Tensors (float64 unless noted, so every value is kept exactly): ``hidden``, ``topk_weights``,
``topk_ids`` (int64), ``candidate`` (the kernel output), per expert ``w13.<e>.values`` / ``w13.<e>.scales``
and ``w2.<e>...`` (each weight as its exact :class:`~moeref.gemm.exact.BlockOperand`: element values and
block scales, the block in the JSON), optional ``b13``/``b2``, ``expert_map``. JSON: ``format``
(``"moeref-reproducer/1"``), ``profile``, ``label``, the run_moe options (activation, layout, out_dtype,
w13_layout, quant as scheme dicts ...), the weight blocks, and free ``extra`` fields (test id, seed).
``moeref replay <file>`` (either file) re-runs the reference and prints the report.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from .. import _interop

__all__ = ["FORMAT", "save_reproducer", "load_reproducer", "replay"]

FORMAT = "moeref-reproducer/1"
_OPTION_KEYS = ("activation", "activation_params", "layout", "out_dtype", "num_experts", "alignment", "max_m",
                "apply_router_weight_on_input", "chunk_size", "gemm1_out_dtype", "act_out_dtype",
                "gemm2_out_dtype")


def _scheme_to_json(q):
    """A quantizer as JSON: a Scheme as its fields; a :class:`moeref.moe.Quantizer` of a scheme as its scheme
    and static arguments (a quantizer function cannot be saved)."""
    from ..moe import Quantizer
    from ..quant import PRESETS, Scheme

    if q is None:
        return None
    static = {}
    if not isinstance(q, Scheme):
        if not isinstance(q, Quantizer) or q.scheme is None:
            raise ValueError(f"cannot save quantizer {q!r}: give a Scheme or a moeref.moe.quantizer(...)")
        static = {k: float(np.asarray(v, dtype=np.float64).reshape(-1)[0]) for k, v in q.static.items()}
        q = q.scheme
    d = {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}
    p = d.pop("preset")
    d["preset"] = p.name if PRESETS.get(p.name) == p else dataclasses.asdict(p)
    d["block"] = list(d["block"]) if d["block"] is not None else None
    return {"scheme": d, "static": static}


def _scheme_from_json(d):
    from ..moe import quantizer
    from ..quant import Preset, Scheme

    if d is None:
        return None
    s = dict(d["scheme"])
    p = s.pop("preset")
    if isinstance(p, dict):
        p = dict(p)
        p["options"] = tuple(tuple(o) for o in p.get("options", ()))
        p["e8m0_clamp"] = tuple(p["e8m0_clamp"])
        p = Preset(**p)
    s["block"] = tuple(s["block"]) if s["block"] is not None else None
    if s.get("channel_block") is not None:
        s["channel_block"] = tuple(s["channel_block"])
    scheme = Scheme(preset=p, **s)
    return quantizer(scheme, **d["static"]) if d.get("static") else scheme


def _stem(path) -> Path:
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".json", ".safetensors") else p


def _files(stem: Path) -> tuple[Path, Path]:
    """``(<stem>.safetensors, <stem>.json)``; dots inside the stem are kept (not taken as a suffix)."""
    return stem.parent / (stem.name + ".safetensors"), stem.parent / (stem.name + ".json")


def _f64(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(_interop.to_numpy(x)).astype(np.float64))


def save_reproducer(path, case, candidate, profile, *, label: str = "", extra: dict | None = None) -> tuple[Path, Path]:
    """Write ``case`` (a :class:`moeref.compare.faults.LayerCase`) and ``candidate`` (its kernel's output)
    to ``<path stem>.safetensors`` + ``<path stem>.json``; returns both paths."""
    from safetensors.numpy import save_file

    from ..compare.kernel_profiles import get_profile
    from ..gemm.exact import as_operand
    from ..moe import MoEQuant

    stem = _stem(path)
    stem.parent.mkdir(parents=True, exist_ok=True)
    w = case.weights
    tensors = {"hidden": _f64(case.hidden), "topk_weights": _f64(case.topk_weights),
               "topk_ids": np.ascontiguousarray(np.asarray(_interop.to_numpy(case.topk_ids)).astype(np.int64)),
               "candidate": _f64(candidate)}
    blocks = {"w13": [], "w2": []}
    for name, ops in (("w13", w.w13), ("w2", w.w2)):
        for e, x in enumerate(ops):
            op = as_operand(x, f"{name}[{e}]")
            tensors[f"{name}.{e}.values"] = np.ascontiguousarray(op.values, dtype=np.float64)
            tensors[f"{name}.{e}.scales"] = np.ascontiguousarray(op.scales, dtype=np.float64)
            blocks[name].append([list(op.block), bool(op.quantized)])
    for name in ("b13", "b2"):
        if getattr(w, name) is not None:
            tensors[name] = _f64(getattr(w, name))
    opts = dict(case.options)
    if opts.get("expert_map") is not None:
        tensors["expert_map"] = np.asarray(opts.pop("expert_map")).astype(np.int64)
    quant = opts.pop("quant", MoEQuant())
    unknown = sorted(set(opts) - set(_OPTION_KEYS) - {"expert_map"})
    if unknown:
        raise ValueError(f"cannot save run_moe options {unknown}; savable: {', '.join(_OPTION_KEYS)}")
    for k in ("out_dtype", "gemm1_out_dtype", "act_out_dtype", "gemm2_out_dtype"):
        if opts.get(k) is not None:
            dt = opts[k]
            opts[k] = str(getattr(dt, "__name__", getattr(dt, "name", dt))).replace("torch.", "")
    config = {"format": FORMAT, "profile": get_profile(profile).name, "label": label, "options": opts,
              "quant": {"a1": _scheme_to_json(quant.a1), "a2": _scheme_to_json(quant.a2), "name": quant.name},
              "w13_layout": w.w13_layout, "blocks": blocks, "extra": dict(extra or {})}
    st, js = _files(stem)
    save_file(tensors, str(st))
    js.write_text(json.dumps(config, indent=1, default=str))
    return st, js


def load_reproducer(path):
    """``(case, candidate, profile_name, config)`` from either file of a reproducer."""
    from safetensors.numpy import load_file

    from ..compare.faults import LayerCase
    from ..gemm.exact import BlockOperand
    from ..moe import MoEQuant, MoEWeights

    st, js = _files(_stem(path))
    for p in (js, st):
        if not p.exists():
            raise ValueError(f"reproducer file {p} is missing (a reproducer is <stem>.json + <stem>.safetensors)")
    config = json.loads(js.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{js} is not a moeref reproducer (format {config.get('format')!r}, expected {FORMAT!r})")
    t = load_file(str(st))

    def ops(name):
        return [BlockOperand(t[f"{name}.{e}.values"], t[f"{name}.{e}.scales"], tuple(blk), q)
                for e, (blk, q) in enumerate(config["blocks"][name])]

    weights = MoEWeights(ops("w13"), ops("w2"), config["w13_layout"], t.get("b13"), t.get("b2"))
    opts = dict(config["options"])
    q = config["quant"]
    opts["quant"] = MoEQuant(_scheme_from_json(q["a1"]), _scheme_from_json(q["a2"]), q.get("name", "none"))
    if "expert_map" in t:
        opts["expert_map"] = t["expert_map"]
    case = LayerCase(t["hidden"], weights, t["topk_weights"], t["topk_ids"], opts)
    return case, t["candidate"], config["profile"], config


def replay(path, profile=None):
    """Re-run a reproducer: the :class:`moeref.compare.Report` of its candidate against the reference
    computed from its inputs, under its profile (or ``profile``). A reproducer of an exact-regime case
    (``extra["regime"] == "exact"``, written by the pytest plugin) is replayed by equality: the
    :class:`moeref.regimes.EqualityReport` of the candidate in its saved dtype (``profile`` overrides that)."""
    from ..compare import compare
    from ..compare.faults import reference

    case, cand, prof, config = load_reproducer(path)
    extra = config.get("extra", {})
    if profile is None and extra.get("regime") == "exact":
        from ..regimes.equality import moe_equality_report
        from .inputs import as_kernel_sees

        return moe_equality_report(as_kernel_sees(cand.astype(np.float32), extra.get("candidate_dtype", "bfloat16")),
                                   reference(case), label=config.get("label", ""))
    return compare(cand, reference(case), profile or prof, label=config.get("label", ""))
