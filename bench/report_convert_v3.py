"""Write docs/convert.md's DeepSeek-V3-sized conversion table from bench_convert_v3.py's JSON (never edited by hand).

    python bench/report_convert_v3.py [RUN.json ...] [--docs docs/convert.md] [--check]

(no JSON given: the committed runs, ``docs/data/convert_v3_*.json``, in name order). One section per run:
what ran where (meta: GPU, date, torch, CUDA, tree), the disk's measured bandwidth, one row per converted
layer against its disk bound, the projection to the whole model from the layers converted (a run stopped by
``--max-seconds`` or a time limit gives the layers it finished and says how many of how many), and, where the
JSON has them, the seconds per layer of each stage (the source written, ``moeref convert``'s own stages). Replaces the text between
``<!-- convert-v3:begin -->`` and ``<!-- convert-v3:end -->``; ``--check`` exits 1 when the page differs from
what the JSON gives (tests/test_generated_docs.py runs it on the committed JSON).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main  # noqa: E402

BEGIN, END = "<!-- convert-v3:begin -->", "<!-- convert-v3:end -->"
PATTERN = "convert_v3_*.json"


def default_json() -> list[str]:
    return data_files(PATTERN)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _rate(nbytes: float, seconds: float) -> str:
    r = nbytes / seconds
    return f"{r / 1e9:.2f} GB/s" if r >= 1e8 else f"{r / 1e6:.2f} MB/s"


def _secs(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 600 else f"{s:.1f} s" if s >= 1 else f"{s * 1e3:.0f} ms"


def _fs(disk: dict) -> str:
    fs = disk.get("filesystem")
    return f"{fs['type']} on `{fs['mount']}`, " if fs else ""


_CONVERT_STAGES = (("read", "read the source"), ("quantize", "quantize (the engine)"),
                   ("report", "report (source decoded, error measured)"), ("group_global", "fused group's global"),
                   ("layout", "layout and bookkeeping"), ("dequantize", "written as BF16"),
                   ("write", "write to the page cache"), ("close", "close: header, fsync, rename"),
                   ("hash", "SHA-256 of the shards"), ("record", "record (moeref-convert.json)"),
                   ("plan", "plan"), ("finish", "index and configs"),
                   ("wait_read", "conversion waited for the reader"),
                   ("wait_write", "conversion waited for the writer"), ("wait_hash", "waited for the last hash"))


def stage_table(rows: list) -> list[str]:
    """Lines of the table of seconds per layer (mean over ``rows``) of each stage: the source written (generated,
    written, fsync'd), the conversion's wall time and ``moeref convert``'s stages; [] for a JSON without them."""
    rows = [r for r in rows if "stages" in r and "convert_stages" in r]
    if not rows:
        return []
    n = len(rows)

    def mean(get):
        return sum(get(r) for r in rows) / n

    hashed_after = any("hash" in r["convert_stages"]["seconds"] for r in rows)
    how = ("A shard's SHA-256 is taken in a thread while the next shard converts; with the report on a device the "
           "reads and the writes run in threads of their own too" if hashed_after else
           "The report on a device: the reads and the writes run in threads of their own, and the writer takes each "
           "shard's SHA-256 as it writes it (in `write`; no shard is read back)")
    out = [f"Seconds per layer (mean of {n}) of each stage. {how}, overlapped with the conversion (the stages' sum "
           "then exceeds its time); the `waited` rows are the conversion thread's waits.", "",
           "| stage | seconds per layer |", "|---|---|"]
    out.append(f"| source written (untimed): generated / written / fsync'd / headers renamed | "
               f"{mean(lambda r: r['stages'].get('source', 0)):.2f} ("
               + " / ".join(f"{mean(lambda r: r['source_stages']['seconds'].get(k, 0)):.2f}"
                            for k in ("generate", "write", "fsync", "rename")) + ") |")
    out.append(f"| **conversion (timed)** | **{mean(lambda r: r['seconds']):.2f}** |")
    for key, label in _CONVERT_STAGES:
        if key == "write" and not hashed_after:
            label += ", SHA-256 as written"
        if any(key in r["convert_stages"]["seconds"] for r in rows):
            out.append(f"| {label} | {mean(lambda r: r['convert_stages']['seconds'].get(key, 0)):.2f} |")
    out.append(f"| directories deleted (untimed) | {mean(lambda r: r['stages'].get('delete', 0)):.2f} |")
    return out


def section(d: dict) -> str:
    m, disk, proj, rows = d["meta"], d["disk"], d["projection"], d["layers"]
    dims = d["dims"]
    what = ("`--tiny`: every dimension shrunk (hidden 256, 4 experts): the mechanics of the run, not a "
            "measurement of DeepSeek-V3. " if d["tiny"] else
            f"Scaled (`--experts`, `--heads`): {dims['experts']} routed experts, {dims['heads']} heads; the projection "
            "is to a model of these dimensions. " if d.get("scaled") else "")
    if d.get("same_weights"):
        what += ("`--same-weights`: the first layer's random source, given each next layer's names (shard headers "
                 "rewritten in place, fsync'd, dropped from the page cache), so every conversion reads it from the "
                 "disk. ")
    asked = d.get("layers_asked", len(rows))
    if len(rows) < asked:
        what += (f"**{len(rows)} of the {asked} layers asked for were converted** "
                 f"({d.get('stopped') or 'the run did not finish'})" + ("; the figures are from those. " if rows else
                                                                       ". "))
    if not rows:
        cur = d.get("current") or {}
        done = cur.get("shards_done") or []
        return (f"**{m['gpu'] if m else '?'}**, {m['date'] if m else '?'}: {what}No layer finished; "
                + (f"layer {cur.get('layer')}: {len(done)} shards converted, the last after "
                   f"{done[-1]['seconds']:.1f} s." if done else "nothing converted."))
    read = sum(r["bytes_read"] for r in rows)
    written = sum(r["bytes_written"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    bound = sum(r["disk_bound_seconds"] for r in rows)
    where = {}
    for r in rows:
        for k, v in r["report_on"].items():
            where[k] = where.get(k, 0) + v
    head = (f"**{m['gpu']}**, {m['date']}, torch {m['torch']}, CUDA {m['cuda'] or '-'}, tree `{m['tree']}`, "
            f"{m['cpus']} CPUs. {what}"
            + (f"Layers {rows[0]['layer']}-{rows[-1]['layer']}" if len(rows) > 1 else f"Layer {rows[0]['layer']}")
            + " of DeepSeek-V3 "
            f"({dims['experts']} routed + {dims['shared']} shared experts of {dims['moe_inter']} x "
            f"{dims['hidden']}, MLA attention), FP8 128x128 -> `{d['target']}`, `--engine {d['engine']}`, "
            f"`--report-device {d['report_device']}`; report computed on: "
            + ", ".join(f"{k} ({v} modules)" for k, v in sorted(where.items()))
            + f". Disk: {_fs(disk)}{disk['write_GBps']:.2f} GB/s write, {disk['read_GBps']:.2f} GB/s read "
            f"({disk['bytes'] / 2**30:.1f} GiB file, fsync'd, page cache dropped before the read). Disk bound: "
            "bytes read / read bandwidth + bytes written / write bandwidth."
            + (f" The kernels were compiled by an untimed warm-up ({_secs(d['warm_up_seconds'])})."
               if "warm_up_seconds" in d else ""))
    out = [head, "",
           "| layer | modules | read | written | time | read / time | disk bound | time / disk bound |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['layer']} | {r['modules']} | {_gb(r['bytes_read'])} | {_gb(r['bytes_written'])} | "
                   f"{_secs(r['seconds'])} | {_rate(r['bytes_read'], r['seconds'])} | "
                   f"{_secs(r['disk_bound_seconds'])} | {r['seconds'] / r['disk_bound_seconds']:.2f}x |")
    out.append(f"| **all {len(rows)}** | {sum(r['modules'] for r in rows)} | {_gb(read)} | {_gb(written)} | "
               f"**{_secs(secs)}** | {_rate(read, secs)} | {_secs(bound)} | **{secs / bound:.2f}x** |")
    out += ["", f"Whole model ({_gb(proj['model_source_bytes'])} of source, {100 * proj['fraction_converted']:.1f}% "
            f"converted here): **{_secs(proj['seconds'])}** projected (time per source byte as measured), "
            f"against a disk bound of {_secs(proj['disk_bound_seconds'])} "
            f"({_secs(proj['disk_bound_overlapped_seconds'])} for a disk that reads and writes at once)."]
    stages = stage_table(rows)
    if stages:
        out += [""] + stages
    return "\n".join(out)


def render(runs: list[dict]) -> str:
    """The generated part of the page: one section per run, in order."""
    return "\n\n".join(section(d) for d in runs)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_convert_v3.py", pattern=PATTERN,
                       pages=("convert.md",), begin=BEGIN, end=END, render=render,
                       json_help="bench_convert_v3.py --json outputs")


if __name__ == "__main__":
    sys.exit(main())
