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
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

__all__ = ["ModuleReport", "ShardRecord", "ConversionReport"]


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
