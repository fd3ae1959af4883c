"""The EP dispatch/combine reference on the device (``engine="device"``) equals the NumPy engine bit for
bit, on every backend world of :mod:`ep_worlds` (gloo on CPU tensors; NCCL on GPUs).

Each example runs both engines on the same rank inputs in the same process group and compares every
field of the receive buffers (payload, FP8 codes and scales, ids, weights, sources, counts, prefix
matrix, masked layout) and every combine (slot and rank order, travel and output dtypes, weights on
input) by their bits; a NaN must be a NaN in the same place (CUDA writes one canonical NaN, so its
payload bits are not compared). Errors must be the same on both engines. Routings: every kind of
:func:`moeref.strategies.routings` (skew, a hot expert, all tokens to the same experts, padding, NaN
weights, repeated experts), empty ranks, and all tokens sent to one rank.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ep_worlds
from moeref import _interop
from moeref.distributed import ep_combine, ep_dispatch, ep_placement, reduce_local_slots
from moeref.quant import fp8_group, mxfp8
from moeref.routing import EP_STRATEGIES
from moeref.strategies import OPT_IN_KINDS, ROUTING_KINDS, routings

FEW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
H = 128
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float64": np.float64}
QUANTS = {None: None, "fp8 1x128": fp8_group(128), "mxfp8": mxfp8(), "fp8 1x128 deepep": fp8_group(128, preset="deepep")}


@pytest.fixture(scope="module", params=ep_worlds.selected())
def world(request):
    yield from ep_worlds.world_fixture(request)


def _slices(sizes):
    ends = np.cumsum(sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends)]


@st.composite
def values(draw, shape, dtype, *, specials: bool):
    """Floats of ``shape``: a seeded normal draw, with NaN / inf / -0.0 planted at drawn places."""
    seed = draw(st.integers(0, 2**16))
    a = np.random.default_rng(seed).standard_normal(shape) * 4.0
    if specials and a.size:
        for v in draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf, -0.0, 0.0]), max_size=3)):
            a.reshape(-1)[draw(st.integers(0, a.size - 1))] = v
    return a.astype(DTYPES[dtype])


@st.composite
def cases(draw, max_world: int):
    ranks = draw(st.integers(1, max_world))
    strategy = draw(st.sampled_from(EP_STRATEGIES))
    redundant = draw(st.integers(0, 2))
    r = draw(routings(max_tokens=10, max_experts=7, max_top_k=3, allow_zero_tokens=True,
                      kinds=ROUTING_KINDS + OPT_IN_KINDS))
    ids = r.ids.astype(np.int64)
    pl = ep_placement(r.num_experts, ranks, strategy, num_redundant=redundant)
    phys = pl.to_physical(ids) if ids.size else ids
    if draw(st.booleans()):  # all tokens to one rank: every slot's expert replaced by one of that rank's
        hot = draw(st.integers(0, ranks - 1))
        mine = pl.local_experts(hot)
        if mine.size:
            phys = np.where(phys >= 0, mine[np.maximum(phys, 0) % mine.size], -1)
    cuts = sorted(draw(st.lists(st.integers(0, r.num_tokens), min_size=ranks - 1, max_size=ranks - 1)))
    sizes = np.diff([0, *cuts, r.num_tokens]).tolist()
    dtype = draw(st.sampled_from(list(DTYPES)))
    x = draw(values((r.num_tokens, H), dtype, specials=True))
    return dict(ranks=ranks, num_logical=r.num_experts, strategy=strategy, redundant=redundant, ids=phys,
                weights=r.weights, sizes=sizes, x=x)


def _host(v):
    """A result field as NumPy (tensors through moeref._interop)."""
    if v is None:
        return None
    if _interop.is_torch_tensor(v):
        return np.asarray(_interop.to_numpy(v))
    return np.asarray(v)


def _run(fn):
    try:
        return ("ok", fn())
    except (ValueError, TypeError) as e:
        return ("error", f"{type(e).__name__}: {e}")


def engines_task(g, case, mode, quant, alignment, pad, y_dtype, y_seed, combine_dtype, out_dtype, on_input):
    """Both engines on this rank's slice; every field and combine as NumPy."""
    sl = _slices(case["sizes"])[g.rank]
    pl = ep_placement(case["num_logical"], g.world_size, case["strategy"], num_redundant=case["redundant"])
    x, ids, w = case["x"][sl], case["ids"][sl], case["weights"][sl]
    m = max(max(case["sizes"]), 1)
    bound = sum(case["sizes"]) if pad else None
    out = {}
    for engine in ("host", "device"):
        if engine == "device":  # the device engine's inputs live on the group's device
            import torch

            x_in = _interop.to_torch(np.ascontiguousarray(x)).to(g.device)
            ids_in, w_in = torch.from_numpy(ids).to(g.device), torch.from_numpy(np.ascontiguousarray(w)).to(g.device)
        else:
            x_in, ids_in, w_in = x, ids, w
        got = _run(lambda: ep_dispatch(x_in, ids_in, w_in, pl, g, mode=mode, quant=QUANTS[quant],
                                       max_tokens_per_rank=m, expert_alignment=alignment,
                                       max_recv_tokens=bound, pad_to_max_recv=pad, engine=engine))
        if got[0] == "error":
            out[engine] = got
            continue
        d = got[1]
        fields = {name: _host(getattr(d, name)) for name in
                  (("topk_idx", "topk_weights", "src_rank", "src_token", "rank_prefix_matrix",
                    "num_recv_tokens_per_expert") if mode == "normal" else
                   ("recv_count", "src_info", "src_rank", "layout_range"))}
        fields["x"] = _host(d.x)
        if d.xq is not None:
            fields["codes"], fields["scales"] = _host(d.xq.codes), _host(d.xq.scales)
        fields["return_index"] = _host(d.handle.return_index)
        fields["return_counts"] = np.asarray(d.handle.return_counts)
        fields["rows_from"] = np.asarray(d.handle.rows_from)
        # the expert outputs: drawn values of the received layout (the same on both engines)
        rng = np.random.default_rng(y_seed)
        lead = (d.num_recv, d.topk_idx.shape[1]) if mode == "normal" else tuple(d.src_info.shape)
        y = (rng.standard_normal(lead + (H,)) * 3).astype(DTYPES[y_dtype])
        kw = dict(combine_dtype=combine_dtype, out_dtype=out_dtype, apply_weights=not on_input)
        fields["slot"] = _run(lambda: _host(ep_combine(y, d, g, **kw)))
        if mode == "normal":
            y_rank = reduce_local_slots(y, d if engine == "host" else _as_host_rows(d))
            fields["rank"] = _run(lambda: _host(ep_combine(y_rank, d, g, order="rank", **kw)))
        out[engine] = ("ok", fields)
    return out


def _as_host_rows(d):
    """What :func:`reduce_local_slots` reads of a device dispatch (its local ids and weights), on the host."""
    from types import SimpleNamespace

    return SimpleNamespace(topk_idx=_host(d.topk_idx), topk_weights=_host(d.topk_weights))


def assert_same_bits(a, b, what):
    """Equal dtype, shape and bits; NaN in the same places (payload not compared)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} (host) vs {b.dtype} (device)"
    assert a.shape == b.shape, f"{what}: shape {a.shape} (host) vs {b.shape} (device)"
    if a.dtype.kind in "iub":
        assert np.array_equal(a, b), f"{what}: host {a.tolist()} vs device {b.tolist()}"
        return
    na, nb = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    assert np.array_equal(na, nb), f"{what}: NaN at {np.argwhere(na != nb)[:4].tolist()} in one engine only"
    ua = a.view(f"u{a.dtype.itemsize}")
    ub = b.view(f"u{b.dtype.itemsize}")
    bad = np.argwhere((ua != ub) & ~na)
    assert bad.size == 0, f"{what}: bits differ at {bad[:4].tolist()}: host {a[tuple(bad[0])]!r} vs device " \
                          f"{b[tuple(bad[0])]!r}"


def assert_same_fields(a: dict, b: dict, what: str, *, combine_errors: bool = True) -> None:
    """Two engines' (or two runs') result fields equal: the same names; per field the same bits
    (:func:`assert_same_bits`), both None, or for a combine (``("ok", array)`` / ``("error", message)``) the same
    outcome and bits or message (``combine_errors`` False: both must be ``"ok"``)."""
    assert sorted(a) == sorted(b)
    for name in a:
        av, bv = a[name], b[name]
        if isinstance(av, tuple):
            if combine_errors:
                assert av[0] == bv[0], f"{what} {name}: {av} vs {bv}"
            else:
                assert av[0] == bv[0] == "ok", f"{what} {name}"
            if av[0] == "error":
                assert av[1] == bv[1]
            else:
                assert_same_bits(av[1], bv[1], f"{what} {name}")
        elif av is None or bv is None:
            assert av is None and bv is None, f"{what} {name}: one side gave None"
        else:
            assert_same_bits(av, bv, f"{what} {name}")


@FEW
@given(data=st.data(), mode=st.sampled_from(["normal", "low_latency"]), quant=st.sampled_from(list(QUANTS)),
       alignment=st.sampled_from([1, 4]), pad=st.booleans(), y_dtype=st.sampled_from(list(DTYPES)),
       y_seed=st.integers(0, 2**16), combine_dtype=st.sampled_from([None, "bfloat16", "float16", "float32"]),
       out_dtype=st.sampled_from([None, "bfloat16", "float32"]), on_input=st.booleans())
def test_device_engine_is_bit_identical_to_host_engine(world, data, mode, quant, alignment, pad, y_dtype, y_seed,
                                                       combine_dtype, out_dtype, on_input):
    world, max_ranks = world
    case = data.draw(cases(max_ranks))
    pad = pad and mode == "normal"
    if quant is not None and case["x"].dtype == np.float64:
        case["x"] = case["x"].astype(np.float32)  # the quantizers take float32/bf16/f16
    res = world.run(engines_task, case, mode, quant, alignment, pad, y_dtype, y_seed, combine_dtype, out_dtype,
                    on_input, world_size=case["ranks"])
    for rank, per in enumerate(res):
        host, dev = per["host"], per["device"]
        event(f"{mode}, {'quantized' if quant else 'bf16/float'}: dispatch {host[0]}")
        assert host[0] == dev[0], f"rank {rank}: host {host} vs device {dev}"
        if host[0] == "error":
            assert host[1] == dev[1]
            continue
        assert_same_fields(host[1], dev[1], f"rank {rank} (host vs device)")


def test_assert_same_bits_sees_one_bit_and_a_moved_nan():
    """The comparison is not vacuous: one ulp, a NaN moved, a dtype change all fail."""
    a = np.array([1.0, np.nan, 2.0], np.float32)
    assert_same_bits(a, a.copy(), "same")
    b = a.copy()
    b[0] = np.nextafter(np.float32(1.0), np.float32(2.0))
    with pytest.raises(AssertionError, match="bits differ"):
        assert_same_bits(a, b, "ulp")
    with pytest.raises(AssertionError, match="NaN"):
        assert_same_bits(a, np.array([np.nan, 1.0, 2.0], np.float32), "nan")
    with pytest.raises(AssertionError, match="dtype"):
        assert_same_bits(a, a.astype(np.float64), "dtype")


@st.composite
def buffer_sequences(draw, max_world: int):
    """Two or three routings over one placement (the world, experts and top-k fixed), each split over the ranks:
    what one reusable low-latency buffer receives in a row."""
    ranks = draw(st.integers(1, max_world))
    num_experts = draw(st.integers(1, 7))
    top_k = draw(st.integers(1, min(3, num_experts)))
    strategy = draw(st.sampled_from(EP_STRATEGIES))
    redundant = draw(st.integers(0, 2))
    pl = ep_placement(num_experts, ranks, strategy, num_redundant=redundant)
    steps = []
    for _ in range(draw(st.integers(2, 3))):
        r = draw(routings(max_tokens=10, num_experts=num_experts, top_k=top_k, allow_zero_tokens=True,
                          kinds=ROUTING_KINDS + OPT_IN_KINDS))
        ids = r.ids.astype(np.int64)
        cuts = sorted(draw(st.lists(st.integers(0, r.num_tokens), min_size=ranks - 1, max_size=ranks - 1)))
        steps.append(dict(ids=pl.to_physical(ids) if ids.size else ids, weights=r.weights,
                          sizes=np.diff([0, *cuts, r.num_tokens]).tolist(),
                          x=draw(values((r.num_tokens, H), "float32", specials=True))))
    m = max(max(max(s["sizes"]) for s in steps), 1)
    return dict(ranks=ranks, num_logical=num_experts, strategy=strategy, redundant=redundant, steps=steps, M=m)


def buffer_task(g, seq, dtype, quant):
    """Each routing of ``seq`` dispatched into fresh buffers and through one reusable buffer, in a row; every
    field (read before the next dispatch), whether the result is the buffer's tensors, and the slot combine."""
    import torch

    from moeref.distributed import ep_low_latency_buffer

    pl = ep_placement(seq["num_logical"], g.world_size, seq["strategy"], num_redundant=seq["redundant"])
    buf = ep_low_latency_buffer(pl, g, max_tokens_per_rank=seq["M"], hidden_size=H, dtype=dtype, quant=QUANTS[quant])
    out = []
    for step in seq["steps"]:
        sl = _slices(step["sizes"])[g.rank]
        x = _interop.to_torch(np.ascontiguousarray(step["x"][sl].astype(DTYPES[dtype]))).to(g.device)
        ids = torch.from_numpy(np.ascontiguousarray(step["ids"][sl])).to(g.device)
        w = torch.from_numpy(np.ascontiguousarray(step["weights"][sl])).to(g.device)
        per = {}
        for name, kw in (("fresh", {}), ("buffer", {"recv_buffer": buf})):
            got = _run(lambda: ep_dispatch(x, ids, w, pl, g, mode="low_latency", quant=QUANTS[quant],
                                           max_tokens_per_rank=seq["M"], engine="device", **kw))
            if got[0] == "error":
                per[name] = got
                continue
            d = got[1]
            copy = lambda v: None if v is None else np.array(_host(v), copy=True)  # noqa: E731 (not a view: the
            # buffer's next dispatch overwrites its tensors)
            fields = {f: copy(getattr(d, f)) for f in ("x", "recv_count", "src_info", "src_rank", "layout_range")}
            if d.xq is not None:
                fields["codes"], fields["scales"] = copy(d.xq.codes), copy(d.xq.scales)
            fields["return_index"] = copy(d.handle.return_index)
            first = d.x if d.xq is None else d.xq.codes
            fields["is_buffer"] = bool(first is buf.parts[0])
            y = (np.random.default_rng(7).standard_normal(tuple(d.src_info.shape) + (H,)) * 3).astype(np.float32)
            fields["slot"] = _run(lambda: _host(ep_combine(y, d, g)))
            per[name] = ("ok", fields)
        out.append(per)
    return out


@FEW
@given(data=st.data(), dtype=st.sampled_from(["bfloat16", "float32"]), quant=st.sampled_from([None, "fp8 1x128"]))
def test_low_latency_buffer_reuse_equals_fresh_buffers(world, data, dtype, quant):
    """Dispatches in a row through one :func:`ep_low_latency_buffer` (different routings, some refused) equal
    fresh-buffer dispatches field for field, bit for bit; a buffered result is the buffer's tensors."""
    world, max_ranks = world
    seq = data.draw(buffer_sequences(max_ranks))
    res = world.run(buffer_task, seq, dtype, quant, world_size=seq["ranks"])
    for rank, steps in enumerate(res):
        for i, per in enumerate(steps):
            fresh, reused = per["fresh"], per["buffer"]
            event(f"step: {fresh[0]}")
            assert fresh[0] == reused[0], f"rank {rank} step {i}: fresh {fresh} vs buffer {reused}"
            if fresh[0] == "error":
                assert fresh[1] == reused[1]
                continue
            ff, bf = fresh[1], reused[1]
            assert ff.pop("is_buffer") is False and bf.pop("is_buffer") is True, f"rank {rank} step {i}: aliasing"
            assert_same_fields(ff, bf, f"rank {rank} step {i} (fresh vs buffer)", combine_errors=False)


def buffer_misuse_task(g):
    import torch

    from moeref.distributed import ep_low_latency_buffer

    pl = ep_placement(4, g.world_size)
    x = torch.ones((2, H), dtype=torch.bfloat16, device=g.device)
    ids = torch.tensor([[0, 1], [2, 3]], device=g.device) % pl.num_physical
    w = torch.full((2, 2), 0.5, device=g.device)
    buf = ep_low_latency_buffer(pl, g, max_tokens_per_rank=2, hidden_size=H, dtype="float32")
    out = [_run(lambda: ep_dispatch(x, ids, w, pl, g, mode="low_latency", max_tokens_per_rank=2, engine="device",
                                    recv_buffer=buf)),
           _run(lambda: ep_dispatch(x, ids, w, pl, g, mode="normal", engine="device", recv_buffer=buf)),
           _run(lambda: ep_dispatch(x, ids, w, pl, g, mode="low_latency", max_tokens_per_rank=2, engine="device",
                                    recv_buffer="buffer"))]
    return [o if o[0] == "error" else ("ok", None) for o in out]


def test_low_latency_buffer_misuse_raises_on_every_rank(world):
    """A buffer of another dtype, a buffer in normal mode, not a buffer: every rank raises, naming it."""
    world, max_ranks = world
    for rank, (dtype_err, mode_err, type_err) in enumerate(world.run(buffer_misuse_task, world_size=max_ranks)):
        assert dtype_err[0] == "error" and "ValueError" in dtype_err[1] and "recv_buffer holds" in dtype_err[1] \
            and "bfloat16" in dtype_err[1], dtype_err
        assert mode_err[0] == "error" and "recv_buffer is for mode='low_latency'" in mode_err[1], mode_err
        assert type_err[0] == "error" and "TypeError" in type_err[1] and "LowLatencyBuffer" in type_err[1], type_err
