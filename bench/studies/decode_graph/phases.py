"""The decode sweep's phases on the layer: GEMM tile sweep, ablation, layer sweep, dispatch, act-rows and decode
A/Bs."""
from __future__ import annotations

import contextlib

import torch

from .layer import gemm_fn, layer_fn, record_gemms, record_stages, routed_rows, short, stage_fn, weight_bytes
from .timeline import breakdown
from .timing import Run, err, time_with_roofline


def gemm_sweep(run: Run, fw, case, tiles: list, gemm_calls: int, reps: int) -> dict:
    calls = record_gemms(fw, case)
    wb = weight_bytes(fw, case[2])
    out = {}
    for gi, gname in enumerate(("gemm1", "gemm2")):
        call = calls[gi]
        rows = routed_rows(call)
        cases, meta, ref = {}, {}, None
        default_t = run.default
        order = [default_t] + [t for t in tiles if t != default_t]
        for t in order:
            if run.left() < 40:
                meta[str(t)] = dict(tiles=str(t), short=short(t), skipped="time budget")
                continue
            try:
                replay, res = run.capture(gemm_fn(call, t), gemm_calls)
                got = res[rows]
                if ref is None:
                    ref = got.clone()
                cases[str(t)] = replay
                meta[str(t)] = dict(tiles=str(t), short=short(t), bits_equal_default=bool(torch.equal(got, ref)),
                                    default=t == default_t)
            except Exception as e:  # noqa: BLE001 - recorded, the others run
                meta[str(t)] = dict(tiles=str(t), short=short(t), error=err(e))
        try:
            timed = time_with_roofline(run, cases, wb[gname], gemm_calls, reps)
            meta["copy"] = timed.pop("copy")
            for n, st in timed.items():
                meta[n].update(st)
        except Exception as e:  # noqa: BLE001
            meta["timing_error"] = err(e)
        out[gname] = dict(tokens=int(case[0].shape[0]), touched=wb["touched"], bytes=wb[gname],
                          rows=[v for k, v in meta.items() if k not in ("copy", "timing_error")],
                          copy=meta.get("copy"), timing_error=meta.get("timing_error"))
    return out


def ablation(run: Run, fw, case, tiles: tuple, calls: int, reps: int) -> dict:
    """The layer and the same launches with stages left out, each a graph of ``calls`` repetitions, in the same
    interleaved rounds (with the copy of the touched experts' bytes): ``layer`` (a1 quant + dispatch + the four
    below), ``post-dispatch`` (GEMM1, act+requant, GEMM2, reduce on the recorded operands), ``gemm1+act+gemm2``,
    ``gemm1+gemm2``, ``gemm1``, ``gemm2``. Differences of medians (``derived``): what the a1 quant and the
    dispatch cost the graph (layer - post-dispatch), the reduce (post-dispatch - gemm1+act+gemm2), the
    act+requant (gemm1+act+gemm2 - gemm1+gemm2), and the GEMMs' sum against their pair."""
    st = record_stages(fw, case)
    t1, t2 = tiles
    f = dict(gemm1=stage_fn("gemm1", st["gemm1"], t1), gemm2=stage_fn("gemm2", st["gemm2"], t2),
             act=stage_fn("act", st["act"]), reduce=stage_fn("reduce", st["reduce"]))

    def seq(*names):
        fs = [f[n] for n in names]
        return lambda: [g() for g in fs][-1]

    variants = {"layer": layer_fn(fw, case, tiles), "post-dispatch": seq("gemm1", "act", "gemm2", "reduce"),
                "gemm1+act+gemm2": seq("gemm1", "act", "gemm2"), "gemm1+gemm2": seq("gemm1", "gemm2"),
                "gemm1": f["gemm1"], "gemm2": f["gemm2"]}
    wb = weight_bytes(fw, case[2])
    cases, out = {}, {}
    for name, fn in variants.items():
        try:
            cases[name], _ = run.capture(fn, calls)
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=err(e))
    out.update(time_with_roofline(run, cases, wb["layer"], calls, reps))
    med = {n: out[n]["median_us"] for n in variants if "median_us" in out.get(n, {})}
    pairs = {"a1 quant + dispatch": ("layer", "post-dispatch"), "reduce": ("post-dispatch", "gemm1+act+gemm2"),
             "act+requant": ("gemm1+act+gemm2", "gemm1+gemm2")}
    derived = {k: med[a] - med[b] for k, (a, b) in pairs.items() if a in med and b in med}
    if all(n in med for n in ("gemm1", "gemm2", "gemm1+gemm2")):
        derived["gemm1+gemm2 - (gemm1 + gemm2)"] = med["gemm1+gemm2"] - med["gemm1"] - med["gemm2"]
    return dict(tokens=int(case[0].shape[0]), gemm1=str(t1), gemm2=str(t2), calls_per_graph=calls, cases=out,
                derived_us=derived)


@contextlib.contextmanager
def one_program_dispatch(on: bool):
    """``fastpath._dispatch_sort.SMALL_CAPACITY_FUSED`` set to ``on`` inside (the masked layout's sort, rank and
    fill as one launch), with the decode dispatch kernel off (``DECODE_CAPACITY_SLOTS = 0``: it would take the
    layout either way; ``decode_ab`` times it)."""
    import fastpath._dispatch_sort as ds

    old = ds.SMALL_CAPACITY_FUSED, ds.DECODE_CAPACITY_SLOTS
    ds.SMALL_CAPACITY_FUSED, ds.DECODE_CAPACITY_SLOTS = on, 0
    try:
        yield
    finally:
        ds.SMALL_CAPACITY_FUSED, ds.DECODE_CAPACITY_SLOTS = old


def dispatch_ab(run: Run, fw, case, tiles: tuple, calls: int, reps: int, profile_replays: int) -> dict:
    """The layer with the masked layout's dispatch as three launches and as one (``SMALL_CAPACITY_FUSED``), each
    a graph of ``calls`` calls, interleaved with the copy of the touched experts' bytes; the outputs compared
    bit for bit; the one-launch layer's kernel timeline."""
    from fastpath import dispatch

    x, tw, ids = case
    e = int(fw.w13.shape[0])
    cap = -(-int(x.shape[0]) // 16) * 16  # the layer's masked capacity (Triton: the tokens rounded to 16)
    lays = []
    for on in (False, True):
        with one_program_dispatch(on):
            lay, dst = dispatch.to_masked(None, ids, e, cap, expected_m=1, validate=False, slot_rows=True)
        lays.append((lay.masked_m.clone(), lay.src.clone(), dst.clone()))
    same = all(torch.equal(a, b) for a, b in zip(*lays))
    if not same:
        return dict(layout_equal=False, error="the one-launch masked layout differs from the three launches': not run")
    cases, outs, out = {}, {}, dict(layout_equal=True)
    for on in (False, True):
        name = "one-launch dispatch" if on else "three-launch dispatch"
        try:
            with one_program_dispatch(on):
                cases[name], res = run.capture(layer_fn(fw, case, tiles), calls)
            outs[name] = res.clone()
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=err(e))
    wb = weight_bytes(fw, case[2])
    timed = time_with_roofline(run, cases, wb["layer"], calls, reps)
    del timed["copy"]
    out.update(timed)
    if len(outs) == 2:
        a, b = outs.values()
        out["bits_equal"] = bool(torch.equal(a, b))
    if "one-launch dispatch" in outs and run.left() > 30:
        try:
            with one_program_dispatch(True):
                out["breakdown"] = breakdown(run, layer_fn(fw, case, tiles), profile_replays)
        except Exception as e:  # noqa: BLE001
            out["breakdown"] = dict(error=err(e))
    return out


@contextlib.contextmanager
def act_routed_rows(on: bool, tile=None):
    """``fastpath._moe_layer.ACT_ROUTED_ROWS_AT_DECODE`` set to ``on`` and ``ACT_ROUTED_ROWS_TILE`` to ``tile``
    inside."""
    import fastpath._moe_layer as ml

    old = ml.ACT_ROUTED_ROWS_AT_DECODE, ml.ACT_ROUTED_ROWS_TILE
    ml.ACT_ROUTED_ROWS_AT_DECODE, ml.ACT_ROUTED_ROWS_TILE = on, tile
    try:
        yield
    finally:
        ml.ACT_ROUTED_ROWS_AT_DECODE, ml.ACT_ROUTED_ROWS_TILE = old


def _captured_and_timed(run: Run, fw, case, tiles: tuple, settings: dict, calls: int, reps: int) -> tuple:
    """``(row, outputs, weight bytes)``: the layer of ``case`` captured under each of ``settings`` (name -> a
    callable giving the context manager that sets it; a graph keeps the setting it was captured with), a graph of
    ``calls`` calls and a one-call graph each, timed interleaved with the copy of the touched experts' bytes
    (:func:`time_with_roofline`); ``row[name]`` holds the timing (``one_call_graph`` inside) or the capture's
    error, ``row["timing_error"]`` a timing failure; ``outputs[name]`` the graph's output."""
    row, outs, graphs, ones = {}, {}, {}, {}
    for name, setting in settings.items():
        try:
            with setting():
                graphs[name], res = run.capture(layer_fn(fw, case, tiles), calls)
                outs[name] = res.clone()
                ones[name], _ = run.capture(layer_fn(fw, case, tiles), 1)
        except Exception as e:  # noqa: BLE001
            row[name] = dict(error=err(e))
    wb = weight_bytes(fw, case[2])
    try:
        timed = time_with_roofline(run, graphs, wb["layer"], calls, reps)
        del timed["copy"]
        row.update(timed)
        one = time_with_roofline(run, ones, wb["layer"], 1, run.reps(20))
        del one["copy"]
        for n, st in one.items():
            row[n]["one_call_graph"] = st
    except Exception as e:  # noqa: BLE001
        row["timing_error"] = err(e)
    return row, outs, wb


ACT_ROWS_AB = {"act over layout tiles": (False, None), "act over routed rows": (True, None),
               "act over routed rows, 2-group tiles": (True, dict(block_m=1, groups_per_program=2, num_warps=1))}
"""The act-rows A/B's cases: name -> (``ACT_ROUTED_ROWS_AT_DECODE``, ``ACT_ROUTED_ROWS_TILE``): the last one
splits each row's 16 groups over 8 programs of one warp (64 programs at 1 token instead of 16 with the H200's
fused tile of 8 groups)."""


def act_rows_ab(run: Run, fw, cases: dict, tiles: tuple, calls: int, reps: int, profile_replays: int) -> dict:
    """At each token count of ``cases``: the layer with the fused act+quant launch over the layout's row tiles
    and over the routed rows only (:data:`ACT_ROWS_AB`), each a graph of ``calls`` calls and a one-call graph,
    interleaved with the copy of the touched experts' bytes; the outputs compared bit for bit (``bits_equal``: all
    equal), ``saved_us`` the tiles' median less the routed rows'; at 1 token the routed-rows layer's kernel
    timeline (``breakdown``)."""
    out: dict = {}
    for m, case in sorted(cases.items()):
        if run.left() < 15:
            out[m] = dict(skipped="time budget")
            continue
        settings = {name: (lambda on=on, tile=tile: act_routed_rows(on, tile))
                    for name, (on, tile) in ACT_ROWS_AB.items()}
        row, outs, wb = _captured_and_timed(run, fw, case, tiles, settings, calls, reps)
        base = outs.get("act over layout tiles")
        if base is not None and len(outs) > 1:
            row["bits_equal"] = all(bool(torch.equal(base, o)) for o in outs.values())
        med = {n: row[n]["median_us"] for n in ACT_ROWS_AB if "median_us" in row.get(n, {})}
        if "act over layout tiles" in med and "act over routed rows" in med:
            row["saved_us"] = med["act over layout tiles"] - med["act over routed rows"]
        out[m] = dict(row, tokens=m, bytes=wb, calls_per_graph=calls)
    if 1 in cases and run.left() > 30:
        try:
            with act_routed_rows(True):
                out["breakdown"] = breakdown(run, layer_fn(fw, cases[1], tiles), profile_replays)
        except Exception as e:  # noqa: BLE001
            out["breakdown"] = dict(error=err(e))
    return out


_KNOBS = {"DECODE_CAPACITY_SLOTS": "fastpath._dispatch_sort", "SMALL_CAPACITY_FUSED": "fastpath._dispatch_sort",
          "REDUCE_DECODE_TOKENS": "fastpath._dispatch_sort", "A1_QUANT_BRANCH": "fastpath._moe_layer",
          "DECODE_PDL": "fastpath._moe_layer", "ACT_ROUTED_ROWS_TILE": "fastpath._moe_layer"}


@contextlib.contextmanager
def knobs(**values):
    """The layer's module switches (:data:`_KNOBS`: name -> module) set to ``values`` inside."""
    import importlib

    mods = {n: importlib.import_module(_KNOBS[n]) for n in values}
    old = {n: getattr(m, n) for n, m in mods.items()}
    try:
        for n, v in values.items():
            setattr(mods[n], n, v)
        yield
    finally:
        for n, v in old.items():
            setattr(mods[n], n, v)


_PDL_ALL = ("gemm1", "act", "gemm2", "reduce")
DECODE_AB = {
    "three-launch dispatch, wide reduce": dict(DECODE_CAPACITY_SLOTS=0, REDUCE_DECODE_TOKENS=0, DECODE_PDL=()),
    "decode dispatch": dict(REDUCE_DECODE_TOKENS=0, DECODE_PDL=()),
    "decode reduce": dict(DECODE_CAPACITY_SLOTS=0, DECODE_PDL=()),
    "defaults": dict(DECODE_PDL=()),
    "defaults, a1 quant in line": dict(A1_QUANT_BRANCH=False, DECODE_PDL=()),
    "defaults + pdl after gemm1": dict(DECODE_PDL=("act", "gemm2", "reduce")),
    "defaults + pdl": dict(DECODE_PDL=_PDL_ALL),
    "defaults + pdl, a1 quant in line": dict(DECODE_PDL=_PDL_ALL, A1_QUANT_BRANCH=False),
    "defaults + pdl, act 2-group tiles": dict(DECODE_PDL=_PDL_ALL,
                                              ACT_ROUTED_ROWS_TILE=dict(block_m=1, groups_per_program=2, num_warps=1)),
}
"""The decode A/B's cases: name -> the switches (:data:`_KNOBS`) it sets. ``defaults``: the shipped
``DECODE_CAPACITY_SLOTS`` and ``REDUCE_DECODE_TOKENS`` with PDL off and the a1 branch on; ``defaults + pdl`` is the
shipped layer (``DECODE_PDL`` names all four stages). The first is the layer before the decode dispatch kernel and the decode reduce tile, every output compared with it."""


def decode_ab(run: Run, fw, cases: dict, tiles: tuple, calls: int, reps: int, profile_replays: int) -> dict:
    """At each token count of ``cases``: the masked layouts of the three-launch and the decode dispatch compared
    first (the layers run only if equal: a wrong layout could fault the GEMMs); then the layer with each of
    :data:`DECODE_AB`, a graph of ``calls`` calls and a one-call graph each, interleaved with the copy of the
    touched experts' bytes; outputs compared bit for bit with the first case (``bits_equal``: each case,
    ``all_bits_equal``); at 1 token the kernel timelines of ``defaults`` and ``defaults + pdl``."""
    from fastpath import dispatch

    out: dict = {}
    e = int(fw.w13.shape[0])
    for m, case in sorted(cases.items()):
        if run.left() < 20:
            out[m] = dict(skipped="time budget")
            continue
        ids = case[2]
        cap = -(-int(ids.shape[0]) // 16) * 16  # the layer's masked capacity (Triton: the tokens rounded to 16)
        lays = []
        for slots in (0, 64):
            with knobs(DECODE_CAPACITY_SLOTS=slots):
                lay, dst = dispatch.to_masked(None, ids, e, cap, expected_m=1, validate=False, slot_rows=True)
            lays.append((lay.masked_m.clone(), lay.src.clone(), dst.clone()))
        if not all(torch.equal(a, b) for a, b in zip(*lays)):
            out[m] = dict(tokens=m, layout_equal=False, error="the decode dispatch's layout differs: not run")
            continue
        settings = {name: (lambda kv=kv: knobs(**kv)) for name, kv in DECODE_AB.items()}
        row, outs, wb = _captured_and_timed(run, fw, case, tiles, settings, calls, reps)
        row = dict(layout_equal=True, **row)
        base_name = next(iter(DECODE_AB))
        base = outs.get(base_name)
        if base is not None:
            for n, o in outs.items():
                row.setdefault(n, {})["bits_equal"] = bool(torch.equal(base, o))
            row["all_bits_equal"] = len(outs) == len(DECODE_AB) and all(torch.equal(base, o) for o in outs.values())
        med = {n: row[n]["median_us"] for n in DECODE_AB if "median_us" in row.get(n, {})}
        if base_name in med:
            row["saved_us"] = {n: med[base_name] - v for n, v in med.items() if n != base_name}
        out[m] = dict(row, tokens=m, bytes=wb, calls_per_graph=calls)
    if 1 in cases:
        out["breakdown"] = {}
        for name in ("defaults", "defaults + pdl"):
            if run.left() < 30:
                break
            try:
                with knobs(**DECODE_AB[name]):
                    out["breakdown"][name] = breakdown(run, layer_fn(fw, cases[1], tiles), profile_replays)
            except Exception as e_:  # noqa: BLE001
                out["breakdown"][name] = dict(error=err(e_))
    return out


def ranked(rows: list, top: int) -> list:
    ok = [r for r in rows if "median_us" in r and r.get("bits_equal_default")]
    return sorted(ok, key=lambda r: r["median_us"])[:top]


def layer_sweep(run: Run, fw, case, combos: dict, calls: int, reps: int, ref_out=None) -> dict:
    """``combos``: name -> (gemm1 tiles, gemm2 tiles); a graph of ``calls`` layer calls each, interleaved with
    the copy of the touched experts' bytes."""
    wb = weight_bytes(fw, case[2])
    cases, meta, ref = {}, {}, ref_out
    for name, (t1, t2) in combos.items():
        if run.left() < 15:
            meta[name] = dict(skipped="time budget")
            continue
        try:
            replay, res = run.capture(layer_fn(fw, case, (t1, t2)), calls)
            if ref is None:
                ref = res.clone()
            cases[name] = replay
            meta[name] = dict(gemm1=str(t1), gemm2=str(t2), bits_equal_default=bool(torch.equal(res, ref)))
        except Exception as e:  # noqa: BLE001
            meta[name] = dict(gemm1=str(t1), gemm2=str(t2), error=err(e))
    try:
        timed = time_with_roofline(run, cases, wb["layer"], calls, reps)
        meta["copy"] = timed.pop("copy")
        for n, st in timed.items():
            meta[n].update(st)
    except Exception as e:  # noqa: BLE001
        meta["timing_error"] = err(e)
    return dict(tokens=int(case[0].shape[0]), bytes=wb, calls_per_graph=calls, cases=meta), ref

