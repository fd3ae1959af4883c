"""Hypothesis properties of expert parallelism over a real torch.distributed group, on every backend world
of :mod:`ep_worlds`: gloo with 4 CPU processes (CI), NCCL with 2 and 4 GPUs (skipped, saying why, on a
machine with fewer GPUs).

One :class:`moeref.distributed.LocalWorld` per backend world serves the whole module; each example runs
on its first 1..R ranks. Expected values come from oracles written here, one token and slot at a
time, from the published contracts (DeepEP ``deep_ep/buffer.py`` dispatch/combine) and from
the per-rank ``expert_map`` of :mod:`moeref.routing` (not from :class:`EPPlacement`), and, for the
layer, from the single-process :func:`moeref.moe.fused_moe`.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ep_worlds
from moeref.distributed import ep_combine, ep_dispatch, ep_fused_moe, ep_placement, local_weights, reduce_local_slots
from moeref.moe import LAYOUTS, MoEQuant, SharedExperts, fused_moe, make_layer, make_tokens, quantize_weights
from moeref.quant import fp8_block, fp8_group, fp8_per_token, mxfp8, quantize
from moeref.routing import EP_STRATEGIES, expert_map
from moeref.strategies import routings

# examples are cheap here (~15 ms a round trip); only the fixture's scope needs the health check off
FEW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=ep_worlds.selected())
def ep_world(request):
    # gloo: one world per test process, shared with the other EP test modules (start-up is the cost)
    yield from ep_worlds.world_fixture(request)


@pytest.fixture
def world(ep_world):
    return ep_world[0]


@st.composite
def ep_cases(draw, max_world: int, *, max_redundant: int = 3):
    """A routing of all ranks' tokens, split into consecutive per-rank slices, and a placement."""
    ranks = draw(st.integers(1, max_world))
    strategy = draw(st.sampled_from(EP_STRATEGIES))
    redundant = draw(st.integers(0, max_redundant))
    r = draw(routings(max_tokens=10, max_experts=7, max_top_k=3, allow_zero_tokens=True))
    cuts = sorted(draw(st.lists(st.integers(0, r.num_tokens), min_size=ranks - 1, max_size=ranks - 1)))
    sizes = np.diff([0, *cuts, r.num_tokens]).tolist()
    ids = r.ids
    if draw(st.booleans()):  # all tokens to one rank: a row's j-th valid slot -> that rank's j-th logical expert
        hot = draw(st.integers(0, ranks - 1))
        mine = np.flatnonzero(expert_map(r.num_experts, ranks, hot, strategy) >= 0)
        if mine.size >= r.top_k:  # ids stay distinct per row (replicas of redundant experts may live elsewhere)
            nth = np.cumsum(ids >= 0, axis=1) - 1
            ids = np.where(ids >= 0, mine[np.maximum(nth, 0)], -1).astype(r.ids.dtype)
    return dict(ranks=ranks, strategy=strategy, redundant=redundant, routing=r, sizes=sizes, ids=ids)


def _slices(sizes):
    ends = np.cumsum(sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends)]


def _owners(num_physical, ranks, strategy):
    """Owner rank and local id of each physical expert, from the per-rank expert maps of moeref.routing."""
    maps = np.stack([expert_map(num_physical, ranks, r, strategy) for r in range(ranks)])
    owner = np.argmax(maps >= 0, axis=0)
    return owner, maps[owner, np.arange(num_physical)]


def _physical(ids, num_logical, redundant):
    """vLLM EPLB's replica choice, written out slot by slot: replicas of l are l, then N + i with i % N == l."""
    out = ids.astype(np.int64).copy()
    t, k = ids.shape
    for tt in range(t):
        for j in range(k):
            l = int(ids[tt, j])
            if l < 0:
                continue
            reps = [l] + [num_logical + i for i in range(redundant) if i % num_logical == l]
            out[tt, j] = reps[(tt * k + j) % len(reps)]
    return out


# ---- rank tasks (module level: pickled to the workers) -----------------------------------------

def dispatch_task(g, x, ids, w, sizes, num_logical, strategy, redundant, mode, alignment):
    sl = _slices(sizes)[g.rank]
    pl = ep_placement(num_logical, g.world_size, strategy, num_redundant=redundant)
    phys = pl.to_physical(ids[sl])
    d = ep_dispatch(x[sl], phys, w[sl], pl, g, mode=mode, max_tokens_per_rank=max(max(sizes), 1),
                    expert_alignment=alignment)
    glob = pl.local_experts(g.rank)
    if mode == "normal":
        # synthetic expert: y(row, slot j) = x_row * (1 + physical id of the slot's expert)
        scale = np.where(d.topk_idx >= 0, 1.0 + glob[np.maximum(d.topk_idx, 0)] if glob.size else 0.0, 0.0)
        y = d.x.astype(np.float64)[:, None, :] * scale[..., None]
        by_slot = ep_combine(y, d, g)
        by_rank = ep_combine(reduce_local_slots(y, d), d, g, order="rank")
        bf16 = ep_combine(y, d, g, combine_dtype="bfloat16")
        c = d.contiguous(alignment)
        # DeepEP num_worst_tokens: the same rows padded to a bound no rank can exceed (all tokens)
        bound = sum(sizes)
        dp = ep_dispatch(x[sl], phys, w[sl], pl, g, max_recv_tokens=bound, pad_to_max_recv=True)
        y_pad = np.concatenate([y, np.full((bound - d.num_recv,) + y.shape[1:], np.nan)])  # padding is never read
        padded = dict(x=dp.x, topk_idx=dp.topk_idx, topk_weights=dp.topk_weights, src_rank=dp.src_rank,
                      src_token=dp.src_token, slot=ep_combine(y_pad, dp, g),
                      rank=ep_combine(reduce_local_slots(np.nan_to_num(y_pad), dp), dp, g, order="rank"))
        return dict(x=d.x, topk_idx=d.topk_idx, m_indices=c.m_indices, contiguous_src=c.src, padded=padded, topk_weights=d.topk_weights, src_rank=d.src_rank,
                    src_token=d.src_token, counts=d.num_recv_tokens_per_expert, prefix=d.rank_prefix_matrix,
                    phys=phys, slot=by_slot, rank=by_rank, bf16=bf16)
    e_loc = d.recv_count.size
    y = d.x.astype(np.float64) * (1.0 + glob.astype(np.float64))[:e_loc, None, None]
    return dict(x=d.x, recv_count=d.recv_count, src_info=d.src_info, src_rank=d.src_rank,
                layout_range=d.layout_range, phys=phys, slot=ep_combine(y, d, g))


def layer_task(g, x, ids, w, sizes, layer, strategy, redundant, mode, layout, quant, qbd, extra):
    sl = _slices(sizes)[g.rank]
    pl = ep_placement(layer.num_experts, g.world_size, strategy, num_redundant=redundant)
    return ep_fused_moe(x[sl], layer, w[sl], ids[sl], pl, g, mode=mode, layout=layout, quant=quant,
                        quantize_before_dispatch=qbd, max_tokens_per_rank=max(max(sizes), 1), **extra)


# ---- dispatch / combine ------------------------------------------------------------------------

@FEW
@given(data=st.data(), mode=st.sampled_from(["normal", "low_latency"]), alignment=st.sampled_from([1, 4]))
def test_dispatch_and_combine_match_deepep_contract(ep_world, data, mode, alignment):
    world, max_world = ep_world
    case = data.draw(ep_cases(max_world))
    r, ranks = case["routing"], case["ranks"]
    n, k = r.num_experts, r.top_k
    x = make_tokens(r.num_tokens, 8, seed=r.num_tokens)
    res = world.run(dispatch_task, x, case["ids"], r.weights, case["sizes"], n, case["strategy"], case["redundant"], mode,
                    alignment, world_size=ranks)
    sl = _slices(case["sizes"])
    owner, local = _owners(n + case["redundant"], ranks, case["strategy"])
    phys = [_physical(case["ids"][s], n, case["redundant"]) for s in sl]
    for src in range(ranks):
        np.testing.assert_array_equal(res[src]["phys"], phys[src])
    for dst in range(ranks):
        got = res[dst]
        n_local = int((owner == dst).sum())
        if mode == "normal":
            rows = []  # (src rank, token, local ids, weights), source rank then token ascending
            for src in range(ranks):
                for t in range(phys[src].shape[0]):
                    here = [j for j in range(k) if phys[src][t, j] >= 0 and owner[phys[src][t, j]] == dst]
                    if here:
                        lid = [int(local[phys[src][t, j]]) if j in here else -1 for j in range(k)]
                        wt = [float(r.weights[sl[src]][t, j]) if j in here else 0.0 for j in range(k)]
                        rows.append((src, t, lid, wt))
            assert got["src_rank"].tolist() == [a for a, _, _, _ in rows]
            assert got["src_token"].tolist() == [b for _, b, _, _ in rows]
            assert got["topk_idx"].tolist() == [c for _, _, c, _ in rows]
            want_w = np.array([d for _, _, _, d in rows], np.float32).reshape(-1, k)
            np.testing.assert_array_equal(got["topk_weights"], want_w)
            np.testing.assert_array_equal(got["x"], np.array([x[sl[a]][b] for a, b, _, _ in rows]).reshape(-1, 8))
            counts = np.zeros(n_local, np.int64)
            for _, _, lid, _ in rows:
                for e in lid:
                    if e >= 0:
                        counts[e] += 1
            assert got["counts"].tolist() == (-(-counts // alignment) * alignment).tolist()
            pad, n_real, bound = got["padded"], len(rows), sum(case["sizes"])
            assert pad["x"].shape == (bound, 8) and pad["topk_idx"].shape == (bound, k)
            np.testing.assert_array_equal(pad["x"][:n_real], got["x"])
            assert (pad["x"][n_real:] == 0).all() and (pad["topk_idx"][n_real:] == -1).all()
            assert (pad["topk_weights"][n_real:] == 0).all()
            assert (pad["src_rank"][n_real:] == -1).all() and (pad["src_token"][n_real:] == -1).all()
            assert pad["topk_idx"][:n_real].tolist() == got["topk_idx"].tolist()
            # DeepGEMM contiguous layout of the received rows: every (row, slot) once, under its expert
            m_idx, csrc = got["m_indices"], got["contiguous_src"]
            flat_ids = np.array([c for _, _, c, _ in rows], np.int64).reshape(-1)
            assert sorted(csrc[csrc >= 0].tolist()) == np.flatnonzero(flat_ids >= 0).tolist()
            assert (flat_ids[csrc[csrc >= 0]] == m_idx[csrc >= 0]).all() and (m_idx[csrc < 0] == -1).all()
            per_src = [sum(1 for a, _, _, _ in rows if a == s) for s in range(ranks)]
            assert got["prefix"][:, dst].tolist() == np.cumsum(per_src).tolist()
        else:
            cap = ranks * max(max(case["sizes"]), 1)
            assert got["x"].shape == (n_local, cap, 8)
            for e in range(n_local):
                g_id = int(np.flatnonzero((owner == dst) & (local == e))[0])
                entries = [(src, t) for src in range(ranks) for t in range(phys[src].shape[0])
                           if g_id in phys[src][t].tolist()]
                c = len(entries)
                assert got["recv_count"][e] == c
                assert got["src_rank"][e, :c].tolist() == [a for a, _ in entries]
                assert got["src_info"][e, :c].tolist() == [b for _, b in entries]
                assert (got["src_info"][e, c:] == -1).all() and (got["src_rank"][e, c:] == -1).all()
                lr = got["layout_range"][e]
                begins, cnts = (lr >> 32).tolist(), (lr & 0xFFFFFFFF).tolist()
                for src in range(ranks):
                    block = [i for i, (a, _) in enumerate(entries) if a == src]
                    assert cnts[src] == len(block)
                    if block:
                        assert begins[src] == block[0]
                want_x = np.array([x[sl[a]][b] for a, b in entries]).reshape(-1, 8)
                np.testing.assert_array_equal(got["x"][e, :c], want_x)
    # combine oracle: y(t, j) = x[t] * (1 + physical id); slot order, float64, from +0.0
    for src in range(ranks):
        xs, ws, ps = x[sl[src]].astype(np.float64), r.weights[sl[src]].astype(np.float64), phys[src]
        want_slot = np.zeros_like(xs)
        want_rank = np.zeros_like(xs)
        want_bf16 = np.zeros_like(xs)
        import ml_dtypes

        for t in range(xs.shape[0]):
            for j in range(k):
                if ps[t, j] >= 0:
                    y = xs[t] * (1.0 + ps[t, j])
                    want_slot[t] += ws[t, j] * y
                    want_bf16[t] += ws[t, j] * y.astype(ml_dtypes.bfloat16).astype(np.float64)
            for dst in range(ranks):
                part = np.zeros(xs.shape[1])
                for j in range(k):
                    if ps[t, j] >= 0 and owner[ps[t, j]] == dst:
                        part += ws[t, j] * (xs[t] * (1.0 + ps[t, j]))
                if any(ps[t, j] >= 0 and owner[ps[t, j]] == dst for j in range(k)):
                    want_rank[t] += part
        np.testing.assert_array_equal(res[src]["slot"], want_slot)
        if mode == "normal":
            np.testing.assert_array_equal(res[src]["padded"]["slot"], want_slot)
            np.testing.assert_array_equal(res[src]["padded"]["rank"], want_rank)
            np.testing.assert_array_equal(res[src]["rank"], want_rank)
            np.testing.assert_array_equal(res[src]["bf16"], want_bf16)


# ---- the distributed layer equals the single-process layer bit for bit ---------------------------

QUANTS = {
    "float": None,
    "fp8 1x128 x 128x128": (fp8_group(128), fp8_group(128), fp8_block((128, 128))),
    "fp8 1x128 / per-token x 128x128": (fp8_group(128), fp8_per_token(), fp8_block((128, 128))),
    "mxfp8": (mxfp8(), mxfp8(), mxfp8()),
    "fp8 1x128 deepep cast x 128x128": (fp8_group(128, preset="deepep"), fp8_per_token(), fp8_block((128, 128))),
}


@FEW
@given(data=st.data(), quant=st.sampled_from(list(QUANTS)), mode=st.sampled_from(["normal", "low_latency"]),
       layout=st.sampled_from(LAYOUTS), qbd=st.booleans(), shared=st.booleans(), weight_on_input=st.booleans(),
       seed=st.integers(0, 2**16))
def test_ep_fused_moe_is_bit_identical_to_single_process(ep_world, data, quant, mode, layout, qbd, shared,
                                                        weight_on_input, seed):
    world, max_world = ep_world
    case = data.draw(ep_cases(max_world))
    r = case["routing"]
    spec = QUANTS[quant]
    redundant = case["redundant"]
    layer = make_layer(r.num_experts, 128, 32, seed=seed)
    q = MoEQuant()
    if spec is not None:
        layer = quantize_weights(layer, spec[2])
        q = MoEQuant(spec[0], spec[1], quant)
    x = make_tokens(r.num_tokens, 128, seed=seed + 1)
    extra = {}
    if shared:
        sh = make_layer(1, 128, 16, seed=seed + 2)
        extra["shared_experts"] = SharedExperts(sh.w13[0], sh.w2[0], sh.w13_layout)
    if r.top_k == 1 and weight_on_input:
        extra["apply_router_weight_on_input"] = True
    want = fused_moe(x, layer, r.weights, case["ids"], quant=q, **extra)
    outs = world.run(layer_task, x, case["ids"], r.weights, case["sizes"], layer, case["strategy"], redundant, mode, layout,
                     q, qbd and spec is not None, extra, world_size=case["ranks"])
    got = np.concatenate(outs, axis=0)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@settings(max_examples=min(settings.default.max_examples, 10), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_fp8_dispatch_codes_arrive_bitwise(ep_world, data, seed):
    """Quantized dispatch moves codes and scales unchanged: the receiver's dequantized rows equal the
    sender's quantize() of its tokens, row for row."""
    world, max_world = ep_world
    case = data.draw(ep_cases(max_world, max_redundant=0))
    r = case["routing"]
    x = make_tokens(r.num_tokens, 256, seed=seed)
    res = world.run(fp8_dispatch_task, x, case["ids"], r.weights, case["sizes"], r.num_experts, case["strategy"],
                    world_size=case["ranks"])
    sl = _slices(case["sizes"])
    deq = [quantize(x[s], fp8_group(128)).dequantize(np.float64) for s in sl]
    for got_rows, src_rank, src_tok in res:
        want = np.array([deq[a][b] for a, b in zip(src_rank.tolist(), src_tok.tolist())]).reshape(-1, 256)
        np.testing.assert_array_equal(got_rows, want)


def fp8_dispatch_task(g, x, ids, w, sizes, n, strategy):
    sl = _slices(sizes)[g.rank]
    d = ep_dispatch(x[sl], ids[sl], w[sl], ep_placement(n, g.world_size, strategy), g, quant=fp8_group(128))
    assert d.x is None
    return d.xq.dequantize(np.float64), d.src_rank, d.src_token


@pytest.mark.parametrize("redundant", [0, 1])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_float_layer_with_shared_expert_on_one_row_per_rank(world, mode, redundant):
    """The case a random draw found (2026-11-28): float operands, a shared expert, 2 ranks holding one
    token each. Each rank runs the shared expert on one row where the single-process layer runs it on
    two; a BLAS call rounds a one-row product differently from a two-row one, so the float GEMM's K-sum
    has a fixed order per output element instead (moeref.gemm.block_gemm) and the layer is bit-identical,
    with a redundant replica too."""
    n = 1
    ids = np.zeros((2, 1), dtype=np.int32)
    w = np.full((2, 1), 0.015625, dtype=np.float32)
    layer = make_layer(n, 128, 32, seed=0)
    sh = make_layer(1, 128, 16, seed=2)
    extra = dict(shared_experts=SharedExperts(sh.w13[0], sh.w2[0], sh.w13_layout))
    x = make_tokens(2, 128, seed=1)
    want = fused_moe(x, layer, w, ids, **extra)
    outs = world.run(layer_task, x, ids, w, [1, 1], layer, "linear", redundant, mode, "standard", MoEQuant(), False,
                     extra, world_size=2)
    np.testing.assert_array_equal(np.concatenate(outs, axis=0), want)


# ---- EP shards of the fast layer (fastpath.moe) ----------------------------------------------------

def fast_shard_task(g, x, ids, w, sizes, layer, out_dtype_name):
    """This rank's share of an expert-parallel fast layer: the device-engine low-latency dispatch sends one
    message per (token, slot) to the expert's rank; there ``fastpath.moe.fused_moe`` (the rank's experts, its
    ``expert_map``) computes each message as a top-1 token of weight 1 in float32, i.e. the slot's expert
    output as the layer stores it; the rows travel back by the combine's transport (the rows of
    ``handle.return_index``, ``all_to_all_single``) and the source reduces its slots with the fast layer's own
    kernel (``fastpath.dispatch.weight_and_reduce``: FP32, slot order)."""
    import torch

    from fastpath.dispatch import weight_and_reduce
    from fastpath.moe import fast_weights, fused_moe
    from moeref import _interop
    from moeref.distributed.group import all_to_all_rows

    sl = _slices(sizes)[g.rank]
    dev = g.device
    pl = ep_placement(layer.num_experts, g.world_size)
    t, k, h = sl.stop - sl.start, ids.shape[1], x.shape[1]
    d = ep_dispatch(torch.from_numpy(x[sl]).to(dev), torch.from_numpy(ids[sl]).to(dev), torch.from_numpy(w[sl]).to(dev),
                    pl, g, mode="low_latency", max_tokens_per_rank=max(max(sizes), 1), engine="device")
    e_loc, cap = d.src_info.shape
    y = torch.zeros((e_loc * cap, h), dtype=torch.float32, device=dev)
    if e_loc and bool((d.src_info >= 0).any()):
        glob = torch.from_numpy(pl.local_experts(g.rank)).to(dev)
        msg_ids = torch.where(d.src_info >= 0, glob[:, None], -1).reshape(-1, 1)
        emap = torch.from_numpy(pl.expert_map(g.rank)).to(dev)
        y = fused_moe(d.x.reshape(-1, h), fast_weights(local_weights(layer, pl, g.rank), dev),
                      torch.ones((e_loc * cap, 1), dtype=torch.float32, device=dev), msg_ids, alignment=16,
                      out_dtype=torch.float32, expert_map=emap, num_experts=layer.num_experts)
    hd = d.handle
    back = all_to_all_rows(g, y[hd.return_index].contiguous(), hd.return_counts, hd.plan.slots_to, "fast combine")
    out = weight_and_reduce(back, hd.plan.slot_src, torch.from_numpy(w[sl]).to(dev), t,
                            out_dtype=getattr(torch, out_dtype_name))
    return _interop.to_numpy(out.cpu()).copy()


@settings(max_examples=min(settings.default.max_examples, 25 if ep_worlds.gpus() else 4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), seed=st.integers(0, 2**16), out_dtype=st.sampled_from(["float32", "bfloat16"]))
def test_ep_shards_of_the_fast_layer_are_the_single_gpu_fast_layer(ep_world, data, seed, out_dtype):
    """EP shards of ``fastpath.moe`` (:func:`fast_shard_task`), combined, equal the fast layer run on one device
    over all tokens bit for bit (every per-row step of the fast layer is independent of the other rows, and the
    reduce is the same kernel in the same slot order), and pass its declared profile against the
    single-process reference (float32 layer: ``FP32_ACCUM``, TF32 products on a GPU). CPU: the kernels under
    TRITON_INTERPRET at tiny shapes (few examples: the interpreter is slow); GPU: NCCL ranks, one GPU each."""
    pytest.importorskip("triton")
    import torch

    from dataclasses import replace

    from fastpath.moe import fast_weights
    from fastpath.moe import fused_moe as fast_fused_moe
    from fastpath.testing import device, on_gpu
    from moeref.compare import PROFILES, compare
    from moeref.moe import run_moe

    world, max_world = ep_world
    case = data.draw(ep_cases(max_world, max_redundant=0))
    r = case["routing"]
    assume(r.num_tokens > 0)  # fastpath.moe.fused_moe refuses 0 tokens (chunk_size None -> 0)
    layer = make_layer(r.num_experts, 32, 16, seed=seed)
    x = make_tokens(r.num_tokens, 32, seed=seed + 1)
    ids, w = case["ids"].astype(np.int64), np.ascontiguousarray(r.weights, dtype=np.float32)
    outs = world.run(fast_shard_task, x, ids, w, case["sizes"], layer, out_dtype, world_size=case["ranks"])
    got = np.concatenate(outs, axis=0)
    dev = device()
    one = fast_fused_moe(torch.from_numpy(x).to(dev), fast_weights(layer, dev), torch.from_numpy(w).to(dev),
                         torch.from_numpy(ids).to(dev), alignment=16, out_dtype=getattr(torch, out_dtype))
    want = one.cpu()
    want = want.view(torch.int16).numpy() if out_dtype == "bfloat16" else want.numpy()
    got_bits = got.view(np.int16) if out_dtype == "bfloat16" else got
    np.testing.assert_array_equal(got_bits, want)
    run = run_moe(x, layer, w, ids, gemm1_out_dtype="float32", act_out_dtype="float32", out_dtype=out_dtype)
    prof = PROFILES["FP32_ACCUM"] if out_dtype == "float32" else PROFILES["BF16_OUTPUT"]
    if on_gpu():  # fp32 tl.dot is TF32 on the GPU
        prof = replace(prof, accum_unit=2.0**-10)
    rep = compare(got.astype(np.float32) if out_dtype == "float32" else got, run, prof)
    assert rep.passed, rep
