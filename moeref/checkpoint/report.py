"""The conversion report: one row per converted module, as a table and as JSON.

Every figure is measured against the EXACT source values (the source codes times its scales, in
float64), whatever precision the target's rule ran in (:func:`moeref.quant.requantize`):

* ``lossless``: every element of the written tensor decodes to exactly the source value.
* ``max_abs_error``: max |written - source|.
* ``rel_l2``: ||written - source||_2 / ||source||_2.
* ``sqnr_db``: 10 log10(||source||^2 / ||written - source||^2) (``inf`` when lossless).
* ``worst_block``: index on the target's block grid of the block with the largest max |error|.
* ``engine``: what computed the codes: ``"numpy"`` (the moeref reference) or ``"triton"``
  (:mod:`fastpath.quant` on a CUDA GPU, bit-identical to the reference: tested), with the reason
  the other one was not used; ``"copy"``/``"dequantize"`` for modules that were not requantized.

:class:`StageTimes` is not part of the report: where the time of a conversion went (read, quantize, report,
write, close and fsync, hash, index), for a caller that asks for it (``convert_checkpoint(..., timings=)``).
"""
from __future__ import annotations

import json
import math
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

__all__ = ["ModuleReport", "ShardRecord", "ConversionReport", "StageTimes", "timed"]


@dataclass
class ModuleReport:
    """One module's conversion."""

    module: str
    shard: str
    shape: list
    source: str
    target: str
    engine: str
    method: str
    lossless: bool
    max_abs_error: float
    rel_l2: float
    sqnr_db: float
    worst_block: list | None
    seconds: float
    note: str = ""

    def as_json(self) -> dict:
        d = asdict(self)
        for k in ("max_abs_error", "rel_l2", "sqnr_db"):
            if not math.isfinite(d[k]):
                d[k] = "inf" if d[k] > 0 else ("-inf" if d[k] < 0 else "nan")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModuleReport":
        d = dict(d)
        for k in ("max_abs_error", "rel_l2", "sqnr_db"):
            d[k] = float(d[k])
        return cls(**d)


@dataclass
class ShardRecord:
    """A written shard: its file, byte size, SHA-256 and whether ``--verify`` checked it."""

    shard: str
    nbytes: int
    sha256: str
    verified: bool
    copied: int
    modules: list = field(default_factory=list)

    def as_json(self) -> dict:
        d = asdict(self)
        d["modules"] = [m.as_json() if isinstance(m, ModuleReport) else m for m in self.modules]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ShardRecord":
        d = dict(d)
        d["modules"] = [ModuleReport.from_json(m) for m in d.get("modules", [])]
        return cls(**d)


@dataclass
class ConversionReport:
    """The whole conversion: settings, shards, and the per-module rows."""

    source: str
    destination: str
    source_layout: str
    target_layout: str
    preset: str | None
    precision: str
    dry_run: bool = False
    shards: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def modules(self) -> list:
        return [m for s in self.shards for m in s.modules]

    @property
    def lossless(self) -> bool:
        return all(m.lossless for m in self.modules)

    def as_json(self) -> dict:
        return {"source": self.source, "destination": self.destination,
                "source_layout": self.source_layout, "target_layout": self.target_layout,
                "preset": self.preset, "precision": self.precision, "dry_run": self.dry_run,
                "seconds": self.seconds, "warnings": list(self.warnings),
                "modules_converted": len(self.modules),
                "lossless_modules": sum(m.lossless for m in self.modules),
                "shards": [s.as_json() for s in self.shards]}

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.as_json(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def table(self, limit: int | None = 50):
        """A ``rich`` renderable of the modules (the first ``limit``; None = all); for a dry run,
        the plan (module, shard, shape, action, target layout). Where the table is wider than the
        console (an 80-column terminal), a compact one with the module names wrapped
        (:class:`moeref._console.Fit`)."""
        from rich.table import Table

        from .._console import Fit, compact_table

        rows = self.modules if limit is None else self.modules[:limit]
        more = (f"{len(self.modules) - limit} more modules in the JSON report"
                if limit is not None and len(self.modules) > limit else None)
        if self.dry_run:
            title = f"{self.source_layout} -> {self.target_layout} (dry run: nothing written)"
            cols = ("module", "shard", "shape", "action", "written as")
            cells = [(m.module, m.shard, "x".join(map(str, m.shape)), m.method, m.target)
                     for m in rows]
            right = ()
        else:
            title = f"{self.source_layout} -> {self.target_layout}"
            cols = ("module", "shape", "engine", "method", "lossless", "max |err|", "rel L2",
                    "SQNR dB", "worst block")
            cells = [(m.module, "x".join(map(str, m.shape)), m.engine, m.method,
                      "yes" if m.lossless else "no", f"{m.max_abs_error:.3g}", f"{m.rel_l2:.3g}",
                      f"{m.sqnr_db:.1f}", "-" if m.worst_block is None else str(tuple(m.worst_block)))
                     for m in rows]
            right = ("shape", "lossless", "max |err|", "rel L2", "SQNR dB", "worst block")
        wide = Table(title=title)
        narrow = compact_table(title=title)
        for col in cols:
            justify = "right" if col in right else "left"
            wide.add_column(col, justify=justify)
            if col == "module":  # long names wrap (fold) rather than being cut
                narrow.add_column(col, overflow="fold", ratio=1)
            else:  # two-word headers over two lines; the values never wrap
                narrow.add_column(col.replace(" ", "\n", 1) if " " in col else col,
                                  justify=justify, no_wrap=True)
        for c in cells:
            wide.add_row(*c)
            narrow.add_row(*c)
        wide.caption = narrow.caption = more
        return Fit(wide, narrow)


class StageTimes:
    """Wall-clock seconds spent in each stage of a conversion, summed over modules and shards, with the number of
    times each stage ran; ``convert_checkpoint(src, dst, opts, timings=StageTimes())`` fills it as it goes (it is
    thread-safe: a caller may read :meth:`as_json` from another thread while the conversion runs). Nothing of
    the conversion depends on it.

    The stages :func:`moeref.checkpoint.convert_checkpoint` records:

    * ``plan``: headers and configs read, the plan made; ``record``: ``moeref-convert.json`` written (after
      each shard); ``finish``: the index, configs and other files, at the end;
    * ``read``: source tensors read (safetensors) into host arrays; ``group_global``: a fused group's
      shared NVFP4 global (its members' amax); ``quantize``: the rule step (the engine's quantizer, or the
      NumPy one), the device-to-host copy of its codes included; ``report``: the rest of the requantization:
      the source decoded, the error report (host or device), the lossless candidates where they are tried;
      ``layout``: the engine chosen, the target tensors laid out (:meth:`Layout.write`), the module's row;
      ``dequantize``: modules written as BF16, with their report;
    * ``write``: tensor bytes handed to the shard file (:meth:`ShardWriter.add`: the page cache);
      ``close``: a shard's header written, the file fsync'd (its bytes reach the disk) and renamed;
      ``hash``: its SHA-256 (the file read back), in a thread while the next shard converts, and ``wait_hash``:
      the wait for a hash (the last shard's); on the pipelined path the writer hashes a shard as it writes it,
      inside ``write``, where the shard's tensors were predicted from the plan (:func:`.shard.expected_entries`),
      and ``hash`` counts only the shards that were not; ``verify``: ``--verify``;
    * the pipelined path (the report on a device) runs ``read`` in a reader thread and ``write`` in a writer
      thread, overlapped with the conversion: there the stages' sum exceeds the wall time, and ``wait_read``
      (the conversion waited for the reader) and ``wait_write`` (for room in the writer's queue) say what the
      conversion thread waited for.

    On a GPU the work is queued: a stage that waits for a result (a copy to the host, a number) also waits for
    the device work queued before it, so ``quantize`` (which ends with its codes copied to the host) holds part
    of the device time of the source's decoding. With ``workers > 1`` the shards converted in worker
    processes are not timed (only ``plan``, ``record`` and ``finish``)."""

    def __init__(self):
        self.seconds: dict = {}
        self.counts: dict = {}
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float, count: int = 1) -> None:
        """Add ``seconds`` (and ``count`` runs) to ``stage``."""
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
            self.counts[stage] = self.counts.get(stage, 0) + count

    @contextmanager
    def stage(self, name: str):
        """Time the ``with`` block as one run of stage ``name`` (added even when the block raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def as_json(self) -> dict:
        """``{"seconds": {stage: s}, "counts": {stage: n}}``, a copy."""
        with self._lock:
            return {"seconds": {k: round(v, 6) for k, v in self.seconds.items()}, "counts": dict(self.counts)}

    def __getstate__(self):  # picklable (a job sent to a worker process); the lock is not
        return {"seconds": dict(self.seconds), "counts": dict(self.counts)}

    def __setstate__(self, state):
        self.__init__()
        self.seconds, self.counts = state["seconds"], state["counts"]


def timed(timings: StageTimes | None, stage: str):
    """``timings.stage(stage)``, or a context that does nothing where ``timings`` is None."""
    return nullcontext() if timings is None else timings.stage(stage)
