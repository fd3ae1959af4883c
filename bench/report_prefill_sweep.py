"""Write the Triton FP8 prefill tile table of docs/moe-gpu.md from bench/studies/triton_fp8_prefill_sweep.py's JSON.

    python bench/report_prefill_sweep.py [docs/data/triton_fp8_prefill_sweep_*.json] [--docs docs/moe-gpu.md] [--check]

Per run (oldest first) a caption naming the GPU, date, torch and Triton versions, tree and command, then one table:
per routing, DeepGEMM's times, the tiles :data:`fastpath.grouped_gemm.DEFAULT_TILES` gives the contiguous layout
(``"fp8_block_contiguous_gluon"`` on Hopper, ``"fp8_block_contiguous_tma"`` on GPUs with TMA, ``"fp8_block"`` elsewhere;
matched by the tiles the JSON records),
the :data:`N_BEST` fastest tiles with the ``"fp8_block"`` tiles' bits (both GEMMs together), the fastest GEMM1 tile
with the fastest GEMM2 tile, and the fastest tile whose bits differ where it beats them all; GEMM1, GEMM2 and both,
median (min-max) in ms and x DeepGEMM (the median of the per-round ratios DeepGEMM / Triton: 1.00 is as fast).
A second table gives GEMM1 with the token rows read through ``a_src``, as the layer runs it. Replaces the text
between ``<!-- prefill-sweep:begin -->`` and ``<!-- prefill-sweep:end -->``; ``--check`` exits 1 when the page
differs from what the JSON gives (a test runs it on the committed JSON).
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.docs_page import data_files, report_main, runs_oldest_first  # noqa: E402
from bench.report_exact_regimes import _command, _date  # noqa: E402

BEGIN, END = "<!-- prefill-sweep:begin -->", "<!-- prefill-sweep:end -->"
PATTERN = "triton_fp8_prefill_sweep_*.json"
SCRIPT = "bench/studies/triton_fp8_prefill_sweep.py"
N_BEST = 3
"""How many of the fastest bit-equal tiles each routing shows (besides the default tiles)."""
DEFAULT_KEYS = ("fp8_block_contiguous_gluon", "fp8_block_contiguous_tma", "fp8_block")
"""The keys of :data:`fastpath.grouped_gemm.DEFAULT_TILES` whose tiles the table names, first match first."""


def _fields(text: str) -> dict:
    """``"GemmTiles(block_m=64, tma=True, ...)"`` -> ``{"block_m": "64", "tma": "True", ...}``."""
    return dict(re.findall(r"(\w+)=([^,()]+)", text))


def default_names(configs: dict) -> dict:
    """The sweep's tile names that are ``DEFAULT_TILES[key]`` for a key of :data:`DEFAULT_KEYS`: ``{name: key}``.
    A recorded tile matches on the fields it records (a field added to ``GemmTiles`` later keeps its default)."""
    from dataclasses import fields

    from fastpath.grouped_gemm import DEFAULT_TILES, GemmTiles

    unrecorded = {f.name: repr(f.default) for f in fields(GemmTiles)}  # what a field the JSON lacks was
    out = {}
    for key in DEFAULT_KEYS:
        want = {k: repr(v) for k, v in vars(DEFAULT_TILES[key]).items()}
        for name, text in configs.items():
            got = _fields(text)
            if name not in out and got and all(got.get(k, unrecorded[k]) == v for k, v in want.items()):
                out[name] = key
                break
    return out


def _num(ms: float) -> str:
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def _ms(r: dict | None) -> str:
    if not r or "median_ms" not in r:
        return "—"
    return f"{_num(r['median_ms'])} ({_num(r['min_ms'])}-{_num(r['max_ms'])})"


def _x(r: dict | None) -> str:
    x = (r or {}).get("x_deep_gemm")
    return "—" if x is None else f"{x:.2f}x"


def _bits(g1: dict, g2: dict) -> str:
    got = [g.get("bits_equal_default") for g in (g1, g2) if g]
    return "—" if not got or None in got else ("yes" if all(got) else "**no**")


def _deep_gemm(grec: dict, group) -> dict | None:
    """DeepGEMM's times in timing group ``group`` (its rounds with those tiles)."""
    by = (grec.get("deep_gemm") or {}).get("by_group", {})
    return by.get(str(group)) if group is not None else None


def _command_of(d: dict) -> str:
    argv = []
    for k, v in d.get("args", {}).items():
        if v is None:
            continue
        argv += [f"--{k.replace('_', '-')}", *(map(str, v) if isinstance(v, list) else [str(v)])]
    return _command(argv, SCRIPT)


def short_name(text: str) -> str:
    """A recorded ``GemmTiles(...)`` in :data:`fastpath.grouped_gemm.FP8_PREFILL_CANDIDATES`' naming: ``MxN``,
    ``wN`` warps, ``sN`` stages, ``persN`` persistent with N programs per SM, ``tma``, ``flat``, ``ws``, ``gN``
    group_m, ``swap``, then ``lagpair`` for ``promotion="lagged_pair"`` (another recorded promotion by its
    name), ``gluon`` for ``kernel="gluon"`` and ``tmastore`` for ``epilogue="tma"``."""
    f = _fields(text)
    on = lambda k: f.get(k) == "True"  # noqa: E731
    parts = [f"{f['block_m']}x{f['block_n']}", f"w{f['num_warps']}", f"s{f['num_stages']}"]
    parts += [f"pers{f.get('programs_per_sm', '1')}"] if on("persistent") else []
    parts += [k for k, name in (("tma", "tma"), ("flat", "flatten"), ("ws", "warp_specialize"), ("swap", "swap_ab"))
              if on(name)]
    parts += [f"g{f['group_m']}"] if f.get("group_m", "1") != "1" else []
    promotion = f.get("promotion", "'inline'").strip("'\"")
    parts += [] if promotion == "inline" else [{"lagged_pair": "lagpair"}.get(promotion, promotion)]
    parts += [] if f.get("kernel", "'triton'").strip("'\"") == "triton" else [f.get("kernel").strip("'\"")]
    parts += ["tmastore"] if f.get("epilogue", "'store'").strip("'\"") == "tma" else []
    return " ".join(parts)


def _tile_name(name: str, roles: dict, configs: dict) -> str:
    """The tiles ``name`` of the sweep by their fields (the JSON's ``"default"`` is ``DEFAULT_TILES["fp8_block"]``
    of its tree), and the ``DEFAULT_TILES`` entry they are now."""
    return f"`{short_name(configs[name])}`" + (f" (`DEFAULT_TILES[\"{roles[name]}\"]`)" if name in roles else "")


def routing_rows(rname: str, rec: dict, roles: dict, configs: dict) -> list:
    """The rows of one routing: DeepGEMM, the default tiles, the fastest bit-equal tiles, the best pair, and the
    fastest tile with other bits where it beats them."""
    g1, g2, both = rec["gemms"]["gemm1"], rec["gemms"]["gemm2"], rec.get("together", {})
    rpe = rec["rows_per_expert"]
    label = f"{rname} ({rpe['min']}-{rpe['max']} rows per expert)"
    timed = [n for n in both if n != "best_pair" and "median_ms" in g1.get(n, {}) and "median_ms" in g2.get(n, {})]
    equal = [n for n in timed if _bits(g1[n], g2[n]) == "yes"]
    rank = sorted(equal, key=lambda n: -both[n].get("x_deep_gemm", 0.0))
    shown = [n for n in rank if n in roles or n in rank[:N_BEST]]
    anchor = next((n for key in DEFAULT_KEYS[:-1] for n in shown if roles.get(n) == key),  # the contiguous default
                  shown[0] if shown else None)
    group = g1[anchor].get("group") if anchor else None
    dg1, dg2 = _deep_gemm(g1, group), _deep_gemm(g2, group)
    dg_both = (both.get(anchor) or {}).get("deep_gemm_median_ms")
    rounds_of = _tile_name(anchor, {}, configs) if anchor else "—"
    out = [f"| {label} | DeepGEMM (in the rounds of {rounds_of}) | | {_ms(dg1)} | | {_ms(dg2)} | | "
           f"{_num(dg_both) if dg_both is not None else '—'} | |"]
    for n in shown:
        out.append(f"| | {_tile_name(n, roles, configs)} | yes | {_ms(g1[n])} | {_x(g1[n])} | {_ms(g2[n])} | "
                   f"{_x(g2[n])} | {_ms(both[n])} | **{_x(both[n])}** |")
    pair = both.get("best_pair")
    if pair and (pair["gemm1"] != pair["gemm2"]):
        a, b = g1[pair["gemm1"]], g2[pair["gemm2"]]
        out.append(f"| | GEMM1 {_tile_name(pair['gemm1'], {}, configs)}, GEMM2 "
                   f"{_tile_name(pair['gemm2'], {}, configs)} | yes | {_ms(a)} | {_x(a)} | {_ms(b)} | "
                   f"{_x(b)} | {_ms(pair)} | **{_x(pair)}** |")
    other = sorted((n for n in timed if _bits(g1[n], g2[n]) == "**no**"), key=lambda n: -both[n].get("x_deep_gemm", 0))
    best_equal = max([both[n].get("x_deep_gemm", 0.0) for n in equal] + [(pair or {}).get("x_deep_gemm", 0.0)])
    if other and both[other[0]].get("x_deep_gemm", 0.0) > best_equal:
        n = other[0]
        out.append(f"| | {_tile_name(n, roles, configs)} | **no** | {_ms(g1[n])} | {_x(g1[n])} | {_ms(g2[n])} | "
                   f"{_x(g2[n])} | {_ms(both[n])} | {_x(both[n])} |")
    return out


def section(d: dict) -> list:
    m = d["meta"]
    s = d["shape"]
    roles = default_names(d["configs"])
    not_run = sorted({n for rec in d["routings"].values() for g in rec["gemms"].values() for n, v in g.items()
                      if n != "deep_gemm" and v.get("status") != "ok"})
    rounds = d.get("args", {}).get("rounds", "?")
    out = [f"Measured on an {m['gpu']}, {_date(m['date'])}, torch {m.get('torch', '?')}, "
           f"triton {m.get('triton', '?')}, tree {m.get('tree', '?')}: `{_command_of(d)}`. DeepSeek-V3 at "
           f"{d['tokens']} tokens (top-{s['top_k']} of "
           f"{s['experts']} experts, 128-row contiguous layout; GEMM1 N {2 * s['inter']}, K {s['hidden']}; GEMM2 "
           f"N {s['hidden']}, K {s['inter']}), FP8 1x128 x 128x128. Median (min-max) of {rounds} interleaved rounds "
           "in ms, each tile timed in the same rounds as DeepGEMM; *both*: the per-round sums of the two GEMMs; "
           "*x DeepGEMM*: the median of the per-round ratios DeepGEMM / Triton (1.00x: as fast); *same bits*: every "
           "routed output row equals the `DEFAULT_TILES[\"fp8_block\"]` tiles' bit for bit. Shown: the default "
           f"tiles, the {N_BEST} fastest tiles with the same bits (both GEMMs), the fastest GEMM1 tile with the "
           f"fastest GEMM2 tile, and the fastest tile of all where its bits differ; {len(d['configs'])} tiles "
           f"were timed" + (f" ({len(not_run)} did not run: {', '.join(not_run)})" if not_run else "") + ".",
           "", "| routing | kernel, tiles | same bits | GEMM1, ms | x DeepGEMM | GEMM2, ms | x DeepGEMM | both, ms "
           "| x DeepGEMM |", "|---|---|---|---|---|---|---|---|---|"]
    for rname, rec in d["routings"].items():
        out += routing_rows(rname, rec, roles, d["configs"])
    out += ["", "GEMM1 as the Triton layer runs it, the token rows read through `a_src` (no scatter; *same bits*: "
            "equal to the same tiles on the scattered rows), against DeepGEMM on the scattered rows in the same "
            "rounds:", "", "| routing | kernel, tiles | same bits | GEMM1, ms | x DeepGEMM |", "|---|---|---|---|---|"]
    for rname, rec in d["routings"].items():
        src = rec.get("gemm1_a_src", {})
        if "deep_gemm" in src:
            out.append(f"| {rname} | DeepGEMM (scattered rows) | | {_ms(src['deep_gemm'])} | |")
        for n, r in src.items():
            if n == "deep_gemm":
                continue
            same = {True: "yes", False: "**no**"}.get(r.get("bits_equal_scattered_rows"), "—")
            out.append(f"| | {_tile_name(n, roles, d['configs'])} | {same} | {_ms(r)} | {_x(r)} |")
    return out


def table(runs: list) -> str:
    """The markdown of ``runs`` (triton_fp8_prefill_sweep.py JSON documents, any order), oldest run first."""
    return runs_oldest_first(runs, section, date=lambda d: d["meta"]["date"])


def default_json() -> list:
    """The committed benchmark JSON (what the docs tests check)."""
    return data_files(PATTERN)


def main(argv=None) -> int:
    return report_main(argv, description=__doc__.splitlines()[0], script="report_prefill_sweep.py",
                       pattern=PATTERN, pages=("moe-gpu.md",), begin=BEGIN, end=END,
                       render=table, json_help="triton_fp8_prefill_sweep.py --out files")


if __name__ == "__main__":
    sys.exit(main())
