"""Real checkpoint layouts: which tensors make one quantized module, read and written.

Every layout maps a *module* (``model.layers.3.mlp.experts.7.down_proj``) to its tensors, reads
them into a :class:`~moeref.quant.QuantizedTensor` (or a float array for unquantized layouts)
and writes one back. Module names are the layout-independent key: converting between layouts
keeps them and changes only the suffixes (gpt-oss ``<module>_blocks`` becomes
``<module>.weight`` and so on, keeping the stacked ``[E, N, K]`` shape and the gate/up row
interleave). Semantics and sources (the last column; docs/convert.md):

==================  ======================================================  =====================
layout              tensors of module ``m`` (decode: ``w = q x scale``)      source
==================  ======================================================  =====================
deepseek-fp8        ``m.weight`` F8_E4M3 ``[N, K]``, ``m.weight_scale_inv``  DeepSeek-V3
                    F32 ``[ceil(N/128), ceil(K/128)]`` (a MULTIPLIER)         README_WEIGHTS.md
deepseek-fp8-ue8m0  the same, every scale a power of two; config             DeepSeek-V3.1 configs,
                    ``scale_fmt: ue8m0``                                      vLLM fp8_utils.py
gptoss-mxfp4        ``m_blocks`` U8 ``[..., N, K/32, 16]``, ``m_scales`` U8   openai/gpt-oss
                    E8M0 bias 127 ``[..., N, K/32]``                         weights.py
modelopt-nvfp4      ``m.weight`` U8 ``[N, K/2]``, ``m.weight_scale`` F8_E4M3  ModelOpt
                    ``[N, K/16]`` (linear), ``m.weight_scale_2`` F32 decode  nvfp4_tensor.py
                    factor ``amax/2688``, ``m.input_scale`` F32 (optional)
ct-nvfp4            ``m.weight_packed`` U8, ``m.weight_scale`` F8_E4M3,       compressed-tensors
                    ``m.weight_global_scale`` F32 ``[1]`` = ``2688/amax``      nvfp4 compressor
                    (a DIVISOR), ``m.input_global_scale`` (optional)
ct-mxfp4            ``m.weight_packed`` U8 ``[N, K/2]``, ``m.weight_scale`` U8  compressed-tensors
                    E8M0 bias 127 ``[N, K/32]``                               mxfp4 compressor
ct-fp8-block        ``m.weight`` F8_E4M3, ``m.weight_scale`` F32 128x128     compressed-tensors
                    grid (a multiplier)                                      FP8_BLOCK preset
bf16                ``m.weight`` BF16 (unquantized)                           -
==================  ======================================================  =====================

FP4 codes: even element in the low nibble in every layout (moeref's packing). NVFP4 global
scales: ModelOpt stores the decode factor, compressed-tensors its reciprocal; a writer refuses a
tensor whose global factor the layout's float32 cannot hold exactly (use the layout's default
preset, which computes in that quantity).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..layouts import from_gptoss_mxfp4, to_gptoss_mxfp4
from ..quant import QuantizedTensor, Scheme, fp8_block, mxfp4
from ..quant.nvfp4 import global_scale_as, nvfp4
from .safetensors_io import CheckpointError

__all__ = ["Layout", "LAYOUTS", "get_layout", "detect_layout", "ModuleData", "DEFAULT_UNQUANTIZED"]

DEFAULT_UNQUANTIZED = ("*embed_tokens", "*lm_head", "*.mlp.gate", "*.router", "*norm",
                       "*shared_expert_gate", "*.gate.e_score_correction_bias")
"""Modules a bf16 source never quantizes (ModelOpt ``_default_disabled_quantizer_cfg``: lm_head,
routers, ``mlp.gate``; embeddings and norms get no quantizer in any producer)."""

_FLOAT = ("F32", "F16", "BF16")


@dataclass
class ModuleData:
    """One module read from a checkpoint.

    Attributes:
        module: module name.
        tensors: role -> tensor name in the source checkpoint.
        q: the quantized weight, or None for unquantized layouts.
        values: the float weight (unquantized layouts), or None.
        input_scale: static activation DECODE scale (ModelOpt ``input_scale``,
            ``1 / input_global_scale`` of compressed-tensors), or None.
    """

    module: str
    tensors: dict
    q: QuantizedTensor | None = None
    values: np.ndarray | None = None
    input_scale: float | None = None

    @property
    def shape(self) -> tuple:
        return self.q.shape if self.q is not None else tuple(self.values.shape)


def _where(ck, module, tensors) -> str:
    files = sorted({ck.file(ck.shard_of(t)) for t in tensors.values() if t in ck.weight_map})
    return f"module {module!r} (tensors {', '.join(sorted(tensors.values()))} in {', '.join(files)})"


def _need(ck, name, dtypes, module, what) -> np.ndarray:
    if name not in ck.weight_map:
        raise CheckpointError(f"module {module!r}: missing {what} tensor {name!r} "
                              f"(checkpoint {ck.path})")
    dt, _ = ck.info(name)
    if dt not in dtypes:
        raise CheckpointError(f"tensor {name!r} in {ck.file(ck.shard_of(name))}: dtype {dt}, "
                              f"but the {what} must be {' or '.join(dtypes)}")
    return ck.read(name)


def _scalar(a: np.ndarray, name: str) -> float:
    a = np.asarray(a, np.float64)
    if a.size != 1:
        raise CheckpointError(f"tensor {name!r}: a per-tensor scale must hold one value; got shape "
                              f"{a.shape}")
    return float(a.reshape(()))


@dataclass(frozen=True)
class Layout:
    """One checkpoint layout (module docstring table).

    Attributes:
        name: CLI name (``--to``/``--from``).
        key: the tensor suffix whose presence marks a module (``.weight_scale_inv`` ...).
        description: one line.
        default_preset: the preset the target scheme uses unless ``--preset`` says otherwise.
    """

    name: str
    key: str
    description: str
    default_preset: str | None

    # ---- finding modules ------------------------------------------------------------------
    def find_modules(self, ck) -> dict:
        """``{module: {role: tensor name}}`` for every module of this layout in ``ck``."""
        out = {}
        for n in ck.weight_map:
            if n.endswith(self.key):
                m = n[: -len(self.key)]
                out[m] = self.roles(m, ck)
        self.check_unclaimed(ck, out)
        return out

    def roles(self, m: str, ck) -> dict:
        raise NotImplementedError

    def check_unclaimed(self, ck, modules) -> None:
        """Refuse 1-byte weights no module claims (a quantized weight without its scale)."""
        claimed = {t for r in modules.values() for t in r.values()}
        for n in ck.weight_map:
            if n in claimed or not n.endswith((".weight", ".weight_packed", "_blocks")):
                continue
            dt, _ = ck.info(n)
            if dt in ("F8_E4M3", "F8_E5M2", "U8"):
                raise CheckpointError(
                    f"tensor {n!r} in {ck.file(ck.shard_of(n))} is {dt} but has no scale tensor "
                    f"of the {self.name} layout (expected {n.rsplit('.', 1)[0] + self.key!r}); "
                    "a quantized weight cannot be read without its scales")

    # ---- reading / writing ----------------------------------------------------------------
    def scheme(self, preset: str | None = None) -> Scheme:
        raise NotImplementedError

    def read(self, m: str, roles: dict, ck) -> ModuleData:
        try:
            return self._read(m, roles, ck)
        except CheckpointError:
            raise
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{_where(ck, m, roles)}: {e}") from None

    def _read(self, m, roles, ck) -> ModuleData:
        raise NotImplementedError

    def write(self, m: str, data: ModuleData) -> list:
        """``[(tensor name, array)]`` of module ``m`` in this layout (``data.q`` in its scheme)."""
        raise NotImplementedError

    def check_scheme(self, q: QuantizedTensor, m: str, scale_formats=None) -> None:
        """Refuse a tensor whose element format, block or scale format this layout cannot hold."""
        want = self.scheme()
        s = q.scheme
        formats = scale_formats or (want.scale_format,)
        if (s.element != want.element or s.scale_format not in formats
                or tuple(q.block_shape) != tuple(want.resolve_block(q.shape))
                or bool(s.global_scale) != bool(want.global_scale)):
            raise CheckpointError(f"module {m!r}: the {self.name} layout holds {want.description}; "
                                  f"got {s.description or s.name} with blocks {q.block_shape}")

    def stored_input_scale(self, v: float | None) -> float | None:
        """The static input scale a reader gets back after writing ``v`` (None: the layout has no
        slot for it, and the converter warns that it was dropped)."""
        return None

    def quantization_config(self, ignore: list, has_input_scales: bool = False):
        """``(config.json quantization_config or None, {extra file: json})``."""
        raise NotImplementedError


class _DeepSeekFP8(Layout):
    def roles(self, m, ck):
        return {"weight": m + ".weight", "scale": m + self.key}

    def scheme(self, preset=None):
        scale = "ue8m0" if self.name == "deepseek-fp8-ue8m0" else "fp32"
        return fp8_block((128, 128), scale, preset or self.default_preset)

    def _read(self, m, roles, ck):
        w = _need(ck, roles["weight"], ("F8_E4M3",), m, "FP8 weight")
        s = _need(ck, roles["scale"], _FLOAT, m, "block scale")
        q = QuantizedTensor(codes=w.view(np.uint8), scales=s.astype(np.float32),
                            scheme=fp8_block((128, 128), "fp32"), shape=w.shape)
        return ModuleData(m, roles, q=q)

    def write(self, m, data):
        q = data.q
        self.check_scheme(q, m, ("fp32", "ue8m0"))
        if self.name.endswith("ue8m0"):
            sv = q.scale_values()
            if not np.all(np.frexp(sv)[0] == 0.5):
                raise CheckpointError(f"module {m!r}: the {self.name} layout needs power-of-two "
                                      "block scales; quantize with scale='ue8m0'")
        return [(m + ".weight", q.codes.view(ml_dtypes.float8_e4m3fn)),
                (m + self.key, q.scale_values().astype(np.float32))]

    def quantization_config(self, ignore, has_input_scales=False):
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
        if self.name == "deepseek-fp8-ue8m0":
            qc["scale_fmt"] = "ue8m0"
        if ignore:
            qc["ignored_layers"] = list(ignore)
        return qc, {}


class _GptOss(Layout):
    def roles(self, m, ck):
        return {"blocks": m + "_blocks", "scales": m + "_scales"}

    def scheme(self, preset=None):
        return mxfp4(preset=preset or self.default_preset)

    def _read(self, m, roles, ck):
        b = _need(ck, roles["blocks"], ("U8",), m, "MXFP4 blocks")
        s = _need(ck, roles["scales"], ("U8", "F8_E8M0"), m, "E8M0 scales")
        codes, sc = from_gptoss_mxfp4(b, s.view(np.uint8))
        shape = codes.shape[:-1] + (2 * codes.shape[-1],)
        return ModuleData(m, roles, q=QuantizedTensor(codes=codes, scales=sc, scheme=mxfp4(),
                                                      shape=shape))

    def write(self, m, data):
        q = data.q
        self.check_scheme(q, m)
        if q.shape[-1] % 32:
            raise CheckpointError(f"module {m!r}: gpt-oss MXFP4 needs K % 32 == 0; shape {q.shape}")
        blocks, scales = to_gptoss_mxfp4(q.codes, q.scales)
        return [(m + "_blocks", blocks), (m + "_scales", scales)]

    def quantization_config(self, ignore, has_input_scales=False):
        return {"quant_method": "mxfp4", "modules_to_not_convert": list(ignore)}, {}


class _NVFP4(Layout):
    """ModelOpt (``weight``/``weight_scale_2``, decode factor) or compressed-tensors
    (``weight_packed``/``weight_global_scale``, its reciprocal)."""

    @property
    def ct(self) -> bool:
        return self.name == "ct-nvfp4"

    def roles(self, m, ck):
        if self.ct:
            r = {"weight": m + ".weight_packed", "scale": m + ".weight_scale", "global": m + self.key}
            inp = m + ".input_global_scale"
        else:
            r = {"weight": m + ".weight", "scale": m + ".weight_scale", "global": m + self.key}
            inp = m + ".input_scale"
        if inp in ck.weight_map:
            r["input"] = inp
        return r

    def scheme(self, preset=None):
        return nvfp4("activation", preset=preset or self.default_preset)

    def _read(self, m, roles, ck):
        w = _need(ck, roles["weight"], ("U8",), m, "packed FP4 weight")
        s = _need(ck, roles["scale"], ("F8_E4M3",), m, "UE4M3 block scale")
        g = _scalar(_need(ck, roles["global"], _FLOAT, m, "global scale"), roles["global"])
        inp = None
        if "input" in roles:
            inp = _scalar(_need(ck, roles["input"], _FLOAT, m, "input scale"), roles["input"])
            inp = 1.0 / inp if self.ct else inp
        glob = 1.0 / g if self.ct else g
        shape = w.shape[:-1] + (2 * w.shape[-1],)
        q = QuantizedTensor(codes=w, scales=s.view(np.uint8), scheme=self.scheme(),
                            shape=shape, global_scale=glob)
        return ModuleData(m, roles, q=q, input_scale=inp)

    def write(self, m, data):
        q = data.q
        self.check_scheme(q, m)
        if q.shape[-1] % 16:
            raise CheckpointError(f"module {m!r}: {self.name} needs K % 16 == 0 (ModelOpt asserts "
                                  f"it; vLLM reads whole blocks); shape {q.shape}")
        g = float(q.global_scale)
        if self.ct:
            stored = global_scale_as(q, "encode_scale")
            if 1.0 / float(stored) != g:
                raise CheckpointError(f"module {m!r}: the global decode factor {g!r} is not the "
                                      "reciprocal of a float32, which weight_global_scale must "
                                      "hold; quantize with an encode-scale preset (vllm, "
                                      "flashinfer, te)")
            out = [(m + ".weight_packed", q.codes), (m + ".weight_scale",
                   q.scales.view(ml_dtypes.float8_e4m3fn)),
                   (m + self.key, np.array([stored], np.float32))]
            if data.input_scale is not None:
                out.append((m + ".input_global_scale", np.array([1.0 / data.input_scale], np.float32)))
            return out
        if float(np.float32(g)) != g:
            raise CheckpointError(f"module {m!r}: the global decode factor {g!r} is not a float32, "
                                  "which weight_scale_2 must hold; quantize with a decode-scale "
                                  "preset (torchao)")
        out = [(m + ".weight", q.codes), (m + ".weight_scale", q.scales.view(ml_dtypes.float8_e4m3fn)),
               (m + self.key, np.array(g, np.float32))]
        if data.input_scale is not None:
            out.append((m + ".input_scale", np.array(data.input_scale, np.float32)))
        return out

    def stored_input_scale(self, v: float | None) -> float | None:
        """The input decode scale a reader gets back after :meth:`write` stored ``v``
        (ModelOpt: ``fl32(v)``; compressed-tensors stores the reciprocal: ``1 / fl32(1/v)``,
        as its ModelOpt converter does)."""
        if v is None:
            return None
        return 1.0 / float(np.float32(1.0 / v)) if self.ct else float(np.float32(v))

    def quantization_config(self, ignore, has_input_scales=False):
        if self.ct:
            w = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                 "symmetric": True, "dynamic": False, "scale_dtype": "float8_e4m3fn"}
            a = dict(w, dynamic="local") if has_input_scales else None
            return _ct_config("nvfp4-pack-quantized", w, a, ignore), {}
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "float", "group_size": 16},
                  "input_activations": ({"num_bits": 4, "type": "float", "group_size": 16}
                                        if has_input_scales else None)}},
              "ignore": list(ignore), "kv_cache_scheme": None}
        hf = {"producer": {"name": "moeref", "version": "0.1.0"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                               "kv_cache_quant_algo": None, "exclude_modules": list(ignore)}}
        return qc, {"hf_quant_config.json": hf}


def _ct_config(fmt, weights, acts, ignore):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts, "format": fmt}},
            "ignore": list(ignore)}


class _CTMXFP4(Layout):
    def roles(self, m, ck):
        return {"weight": m + self.key, "scale": m + ".weight_scale"}

    def scheme(self, preset=None):
        return mxfp4(preset=preset or self.default_preset)

    def _read(self, m, roles, ck):
        w = _need(ck, roles["weight"], ("U8",), m, "packed FP4 weight")
        s = _need(ck, roles["scale"], ("U8", "F8_E8M0"), m, "E8M0 scale")
        shape = w.shape[:-1] + (2 * w.shape[-1],)
        return ModuleData(m, roles, q=QuantizedTensor(codes=w, scales=s.view(np.uint8),
                                                      scheme=mxfp4(), shape=shape))

    def write(self, m, data):
        self.check_scheme(data.q, m)
        if data.q.shape[-1] % 32:
            raise CheckpointError(f"module {m!r}: {self.name} needs K % 32 == 0; shape "
                                  f"{data.q.shape}")
        return [(m + self.key, data.q.codes), (m + ".weight_scale", data.q.scales)]

    def quantization_config(self, ignore, has_input_scales=False):
        w = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
             "symmetric": True, "dynamic": False, "scale_dtype": "uint8"}
        return _ct_config("mxfp4-pack-quantized", w, None, ignore), {}


class _CTFP8Block(_DeepSeekFP8):
    def roles(self, m, ck):
        return {"weight": m + ".weight", "scale": m + self.key}

    def scheme(self, preset=None):
        return fp8_block((128, 128), "fp32", preset or self.default_preset)

    def quantization_config(self, ignore, has_input_scales=False):
        w = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
             "symmetric": True, "dynamic": False}
        a = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
             "symmetric": True, "dynamic": True}
        return _ct_config("float-quantized", w, a, ignore), {}


class _BF16(Layout):
    def find_modules(self, ck):
        out = {}
        for n in ck.weight_map:
            if not n.endswith(".weight"):
                continue
            dt, shape = ck.info(n)
            m = n[: -len(".weight")]
            if dt in ("F8_E4M3", "F8_E5M2", "U8"):
                raise CheckpointError(
                    f"tensor {n!r} in {ck.file(ck.shard_of(n))} is {dt}, but config.json has no "
                    "quantization_config saying how it is quantized; pass --from LAYOUT")
            if dt in _FLOAT and len(shape) >= 2 and not any(
                    fnmatch.fnmatchcase(m, p) for p in DEFAULT_UNQUANTIZED):
                out[m] = {"weight": n}
        return out

    def scheme(self, preset=None):
        return None

    def _read(self, m, roles, ck):
        return ModuleData(m, roles, values=_need(ck, roles["weight"], _FLOAT, m, "weight"))

    def write(self, m, data):
        v = data.values if data.q is None else data.q.dequantize(ml_dtypes.bfloat16)
        return [(m + ".weight", np.asarray(v).astype(ml_dtypes.bfloat16))]

    def quantization_config(self, ignore, has_input_scales=False):
        return None, {}


LAYOUTS = {L.name: L for L in (
    _DeepSeekFP8("deepseek-fp8", ".weight_scale_inv", "DeepSeek-V3/R1 FP8, 128x128 FP32 "
                 "weight_scale_inv", "deepgemm"),
    _DeepSeekFP8("deepseek-fp8-ue8m0", ".weight_scale_inv", "DeepSeek-V3.1 FP8 with power-of-two "
                 "(UE8M0) block scales, scale_fmt ue8m0", "deepgemm"),
    _GptOss("gptoss-mxfp4", "_scales", "gpt-oss MXFP4 *_blocks / *_scales (stacked experts)", "ocp"),
    _NVFP4("modelopt-nvfp4", ".weight_scale_2", "NVIDIA ModelOpt NVFP4 (weight_scale_2 = "
           "amax/2688, hf_quant_config.json)", "nvfp4_torchao"),
    _NVFP4("ct-nvfp4", ".weight_global_scale", "compressed-tensors nvfp4-pack-quantized "
           "(weight_global_scale = 2688/amax)", "nvfp4_vllm"),
    _CTMXFP4("ct-mxfp4", ".weight_packed", "compressed-tensors mxfp4-pack-quantized", "ocp"),
    _CTFP8Block("ct-fp8-block", ".weight_scale", "compressed-tensors float-quantized FP8 128x128 "
                "block", "deepgemm"),
    _BF16("bf16", ".weight", "unquantized BF16 weights", None),
)}


def get_layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"unknown checkpoint layout {name!r}; accepted: {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def detect_layout(config: dict, hf_quant_config: dict | None = None) -> Layout:
    """The source layout from ``config.json`` (and ModelOpt's ``hf_quant_config.json``)."""
    qc = (config or {}).get("quantization_config")
    if hf_quant_config is not None and not qc:
        qc = {"quant_method": "modelopt", **hf_quant_config.get("quantization", {})}
    if not qc:
        return LAYOUTS["bf16"]
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size") not in ([128, 128], None):
            raise ValueError(f"config.json: fp8 weight_block_size {qc.get('weight_block_size')} "
                             "is not supported; accepted: [128, 128]")
        return LAYOUTS["deepseek-fp8-ue8m0" if qc.get("scale_fmt") == "ue8m0" else "deepseek-fp8"]
    if method == "mxfp4":
        return LAYOUTS["gptoss-mxfp4"]
    if method == "modelopt":
        if qc.get("quant_algo") != "NVFP4":
            raise ValueError(f"ModelOpt quant_algo {qc.get('quant_algo')!r} is not supported; "
                             "accepted: 'NVFP4'")
        return LAYOUTS["modelopt-nvfp4"]
    if method == "compressed-tensors":
        fmt = qc.get("format")
        table = {"nvfp4-pack-quantized": "ct-nvfp4", "mxfp4-pack-quantized": "ct-mxfp4",
                 "float-quantized": "ct-fp8-block"}
        if fmt not in table:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported; accepted: "
                             f"{', '.join(table)}")
        return LAYOUTS[table[fmt]]
    raise ValueError(f"config.json quant_method {method!r} is not supported; accepted: fp8, mxfp4, "
                     "modelopt, compressed-tensors (or no quantization_config for BF16)")
