"""Write docs/convert.md's DeepSeek-V3-sized conversion table from bench_convert_v3.py's JSON (never edited by hand).

    python bench/report_convert_v3.py [RUN.json ...] [--docs docs/convert.md] [--check]

(no JSON given: the committed runs, ``docs/data/convert_v3_*.json``, in name order). One section per run:
what ran where (meta: GPU, date, torch, CUDA, tree), the disk's measured bandwidth, one row per converted
layer against its disk bound, and the projection to the whole model. Replaces the text between
``<!-- convert-v3:begin -->`` and ``<!-- convert-v3:end -->``; ``--check`` exits 1 when the page differs from
what the JSON gives (tests/test_generated_docs.py runs it on the committed JSON).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main  # noqa: E402

BEGIN, END = "<!-- convert-v3:begin -->", "<!-- convert-v3:end -->"


def default_json() -> list[str]:
    return data_files("convert_v3_*.json")


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


def section(d: dict) -> str:
    m, disk, proj, rows = d["meta"], d["disk"], d["projection"], d["layers"]
    dims = d["dims"]
    what = ("`--tiny`: every dimension shrunk (hidden 256, 4 experts): the mechanics of the run, not a "
            "measurement of DeepSeek-V3. " if d["tiny"] else "")
    read = sum(r["bytes_read"] for r in rows)
    written = sum(r["bytes_written"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    bound = sum(r["disk_bound_seconds"] for r in rows)
    where = {}
    for r in rows:
        for k, v in r["report_on"].items():
            where[k] = where.get(k, 0) + v
    head = (f"**{m['gpu']}**, {m['date']}, torch {m['torch']}, CUDA {m['cuda'] or '-'}, tree `{m['tree']}`, "
            f"{m['cpus']} CPUs. {what}Layers {rows[0]['layer']}-{rows[-1]['layer']} of DeepSeek-V3 "
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
    return "\n".join(out)


def render(runs: list[dict]) -> str:
    """The generated part of the page: one section per run, in order."""
    return "\n\n".join(section(d) for d in runs)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_convert_v3.py", pattern="convert_v3_*.json",
                       pages=("convert.md",), begin=BEGIN, end=END, render=render,
                       json_help="bench_convert_v3.py --json outputs")


if __name__ == "__main__":
    sys.exit(main())
