"""Checkpoint conversion: real layouts read and written, streaming, verified (docs/convert.md).

* :mod:`.safetensors_io` — sharded safetensors: lazy reader, streaming atomic shard writer.
* :mod:`.layouts` — DeepSeek FP8 (FP32 and UE8M0 scales), gpt-oss MXFP4, ModelOpt NVFP4,
  compressed-tensors NVFP4 / MXFP4 / FP8 block, BF16: module <-> tensors, configs.
* :mod:`.plan` — the conversion plan from headers and configs alone (:func:`plan_conversion`, ``--dry-run``).
* :mod:`.convert` — the options, and the conversion shard by shard (workers, resume), index and configs.
* :mod:`.shard` — one shard: each module converted with its report, or written as BF16; on the host in turn, or
  with the report on a GPU (:mod:`moeref.quant.device_report`) read, converted and written as a pipeline
  (:mod:`.pipeline`: the reader and writer threads, a fused group's amax on the device; on either path the
  shards hashed in a thread); the written shard verified against the source.
* :mod:`.engines` — NumPy reference or Triton fast path per module (never silently).
* :mod:`.report` — per-module report (lossless, max |err|, rel L2, SQNR, worst block, engine); where the
  time of a conversion went (:class:`.report.StageTimes`).
* :mod:`.cli` — ``moeref convert``.
"""
from __future__ import annotations

from .convert import ConvertOptions, Plan, convert_checkpoint, plan_conversion, verify_shard
from .layouts import LAYOUTS, Layout, ModuleData, detect_layout, get_layout
from .report import ConversionReport, ModuleReport, ShardRecord, StageTimes
from .safetensors_io import CheckpointError, SafetensorsCheckpoint, ShardWriter

__all__ = [
    "CheckpointError", "ConversionReport", "ConvertOptions", "LAYOUTS", "Layout", "ModuleData",
    "ModuleReport", "Plan", "SafetensorsCheckpoint", "ShardRecord", "ShardWriter", "StageTimes",
    "convert_checkpoint", "detect_layout", "get_layout", "plan_conversion", "verify_shard",
]
