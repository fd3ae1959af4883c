"""Expert parallelism: placements and send plans (hand-derived values), and over a real gloo group
(one 4-process LocalWorld for the module) the bad-input errors, timeouts and kernel validation."""
from __future__ import annotations

import datetime
import os
import time

import numpy as np
import pytest

from moeref.compare import FP32_ACCUM
from moeref.distributed import (
    EPKernelOutput,
    EPPeerError,
    EPPlacement,
    EPTimeoutError,
    LocalWorld,
    RankError,
    dispatch_layout,
    ep_dispatch,
    ep_fused_moe,
    ep_group,
    ep_placement,
    send_plan,
    validate_ep_kernel,
)
from moeref.distributed.group import pack_rows, unpack_rows
from moeref.moe import make_layer, make_tokens
from moeref.routing import expert_map

# ---- placements and plans (no process group) ---------------------------------------------------


def test_linear_and_round_robin_placements():
    pl = ep_placement(10, 4)  # 10 = 4*2 + 2: ranks 0 and 1 own three (vLLM determine_expert_map)
    assert pl.owner.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert pl.local_id.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    rr = ep_placement(10, 4, "round_robin")
    assert rr.owner.tolist() == [g % 4 for g in range(10)]
    assert rr.local_id.tolist() == [g // 4 for g in range(10)]
    for r in range(4):
        np.testing.assert_array_equal(rr.expert_map(r), expert_map(10, 4, r, "round_robin"))
    assert rr.local_experts(2).tolist() == [2, 6] and rr.num_local(2) == 2


def test_redundant_placement_and_replica_choice():
    pl = ep_placement(4, 2, num_redundant=2)  # physical 4, 5 replicate logical 0, 1
    assert (pl.num_physical, pl.num_logical, pl.num_redundant) == (6, 4, 2)
    assert pl.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1]
    assert pl.local_experts(1).tolist() == [3, 4, 5] and pl.local_logical_experts(1).tolist() == [3, 0, 1]
    # slot pos = t*k + j picks replica pos % count: logical 0 has replicas [0, 4], logical 1 [1, 5]
    ids = np.array([[0, 1], [2, 0], [-1, 1]])  # pos 0 -> 0 (0 % 2 = 0), pos 1 -> 5, pos 3 -> 4, pos 5 -> 5
    assert pl.to_physical(ids).tolist() == [[0, 5], [2, 4], [-1, 5]]


def test_from_expert_maps_rejects_overlaps_and_gaps():
    m0 = np.array([0, 1, -1, -1], np.int32)
    with pytest.raises(ValueError, match=r"expert 1 is local on ranks \[0, 1\]"):
        EPPlacement.from_expert_maps([m0, np.array([-1, 0, 1, 2], np.int32)])
    with pytest.raises(ValueError, match=r"expert 3 is local on ranks \[\]"):
        EPPlacement.from_expert_maps([m0, np.array([-1, -1, 0, -1], np.int32)])
    custom = EPPlacement.from_expert_maps([np.array([1, -1, 0, -1]), np.array([-1, 0, -1, 1])])
    assert custom.owner.tolist() == [0, 1, 0, 1] and custom.local_experts(0).tolist() == [2, 0]
    with pytest.raises(ValueError, match="ep_size=2 ranks but the process group has world_size=3"):
        custom.check_world_size(3)


def test_dispatch_layout_counts_tokens_once_per_rank():
    pl = ep_placement(6, 3)  # rank r: experts 2r, 2r+1
    ids = np.array([[0, 1, 4], [5, -1, 2], [-1, -1, -1], [3, 2, 0]])
    lay = dispatch_layout(ids, pl)
    assert lay.num_tokens_per_rank.tolist() == [2, 2, 2]  # token 0 once on rank 0 although 2 experts there
    assert lay.num_tokens_per_expert.tolist() == [2, 1, 2, 1, 1, 1]
    assert lay.is_token_in_rank.tolist() == [[True, False, True], [False, True, True], [False] * 3,
                                             [True, True, False]]
    plan = send_plan(ids, np.full(ids.shape, 0.5, np.float32), pl)
    assert plan.row_token.tolist() == [0, 3, 1, 3, 0, 1]  # rank 0's rows, then rank 1's, then rank 2's
    assert plan.row_local_ids[0].tolist() == [0, 1, -1] and plan.row_local_ids[2].tolist() == [-1, -1, 0]
    assert plan.row_weights[2].tolist() == [0.0, 0.0, 0.5]
    assert plan.slot_src.tolist() == [0, 1, 11, 5, 9, 10, 2, 3]  # by rank, then flat slot t*k + j
    with pytest.raises(ValueError, match="topk_weights has shape"):
        send_plan(ids, np.ones((4, 2)), pl)


def test_pack_rows_roundtrip_is_bitwise():
    import ml_dtypes

    x = np.array([[1.5, -0.0], [np.nan, 3.0]], dtype=ml_dtypes.bfloat16)
    tok = np.array([7, -1], np.int64)
    w = np.array([[0.25], [np.inf]], np.float32)
    rows = pack_rows(x, tok, w)
    assert rows.shape == (2, 2 * 2 + 8 + 4) and rows.dtype == np.uint8
    bx, bt, bw = unpack_rows(rows, [(x.dtype, (2,)), (np.int64, ()), (np.float32, (1,))])
    assert bx.view(np.uint16).tolist() == x.view(np.uint16).tolist()
    assert bt.tolist() == [7, -1] and bw.view(np.uint32).tolist() == w.view(np.uint32).tolist()
    empty = pack_rows(np.zeros((0, 3), np.float32), np.zeros(0, np.int64))
    assert empty.shape == (0, 20)


def test_ep_group_needs_an_initialized_process_group():
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - pytest never initializes one
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ep_group()


# ---- over a real process group -----------------------------------------------------------------

WORLD = 4


@pytest.fixture(scope="module")
def world():
    # one world per test process, shared with the other EP test module (start-up is the cost)
    return LocalWorld.shared(WORLD, timeout_s=20.0)


def _routing(rank: int, tokens: int, num_experts: int, top_k: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed + 31 * rank)
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)]).astype(np.int64)
    w = rng.integers(1, 64, size=(tokens, top_k)).astype(np.float32) / 64
    return ids.reshape(tokens, top_k), w.reshape(tokens, top_k)


def bad_input_task(g, case, engine="host"):
    n_exp, tokens, hidden, ep_size, strategy = 8, 3, 8, g.world_size, "linear"
    kw = {}
    if case == "world_size":
        ep_size = 3
    elif case == "placement" and g.rank == 1:
        strategy = "round_robin"
    elif case == "hidden" and g.rank == 2:
        hidden = 16
    elif case == "ll_bound":
        kw = dict(mode="low_latency", max_tokens_per_rank=4)
        tokens = 5 if g.rank == 1 else 4
    elif case == "recv_bound":
        kw = dict(max_recv_tokens=6)
    elif case == "rows_layer":
        hidden = H
    ids, w = _routing(g.rank, tokens, n_exp)
    if case == "recv_bound":
        ids[:, 0], ids[:, 1] = 0, 4 + np.arange(tokens)  # every token to expert 0 (rank 0): it receives 4 * 3 rows
    if case == "ids" and g.rank == 3:
        ids[1, 1] = 99
    if case == "ll_repeat":
        kw = dict(mode="low_latency", max_tokens_per_rank=4)
        if g.rank == 2:
            ids[0, 1] = ids[0, 0]
    x = make_tokens(tokens + (case in ("rows", "rows_layer") and g.rank == 2), hidden, seed=g.rank)
    if case == "rows_layer":  # the layer weighs the tokens first (top-1): the row check still reaches every rank
        ep_fused_moe(x, _layer(), w[:, :1], ids[:, :1], ep_placement(n_exp, ep_size, strategy), g,
                     apply_router_weight_on_input=True)
        return "no error"
    ep_dispatch(x, ids, w, ep_placement(n_exp, ep_size, strategy), g, engine=engine, **kw)
    return "no error"


@pytest.mark.parametrize("case, everyone, own", [
    ("world_size", r"placement of ranks \[0, 1, 2, 3\] is for ep_size \[3\] but the process group has world_size=4",
     None),
    ("placement", "ranks disagree on the expert placement", None),
    ("hidden", "ranks disagree on the hidden size: {0: 8, 1: 8, 2: 16, 3: 8}", None),
    ("ll_bound", r"ranks \[1\] rejected their dispatch inputs", (1, "5 tokens on this rank, more than "
                                                                    "max_tokens_per_rank=4")),
    ("ll_repeat", r"ranks \[2\] rejected their dispatch inputs", (2, r"rank 2: topk_ids row 0 names an expert twice")),
    ("recv_bound", r"rank 0 would receive 12 tokens \(from ranks \[3, 3, 3, 3\]\), more than the declared bound "
                   r"max_recv_tokens=6", None),
    ("ids", r"ranks \[3\] rejected their dispatch inputs", (3, r"rank 3: topk_ids\[1, 1\] = 99")),
    ("rows", r"ranks \[2\] rejected their dispatch inputs", (2, r"rank 2: hidden has 4 rows \(shape \(4, 8\)\) but "
                                                                 r"topk_weights has 3")),
    ("rows_layer", r"ranks \[2\] rejected their dispatch inputs", (2, r"rank 2: hidden has 4 rows \(shape \(4, 16\)\) "
                                                                       r"but topk_weights has 3")),
])
@pytest.mark.parametrize("engine", ["host", "device"])
def test_bad_input_raises_the_same_clear_error_on_every_rank(world, case, everyone, own, engine):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        world.run(bad_input_task, case, engine)
    assert time.monotonic() - t0 < 10.0  # an error, not a timeout
    fails = info.value.failures
    assert sorted(fails) == list(range(WORLD))  # every rank raised, none is left waiting
    for r, (type_name, message, _) in fails.items():
        assert type_name == "ValueError"
        import re

        pattern = own[1] if own is not None and r == own[0] else everyone
        assert re.search(pattern, message), (r, message)
    assert isinstance(info.value.exceptions[0], ValueError)


def silent_peer_task(g, timeout_s):
    """Ranks 0 and 1 form a group with a short timeout; rank 1 never joins the dispatch."""
    import torch.distributed as dist

    pg = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s))
    if g.rank != 0:
        return None
    sub = ep_group(pg, timeout_s=timeout_s)
    ids, w = _routing(0, 2, 4)
    t0 = time.monotonic()
    try:
        ep_dispatch(make_tokens(2, 8), ids, w, ep_placement(4, 2), sub)
    except EPTimeoutError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def test_a_silent_peer_gives_a_timeout_error_not_a_hang(world):
    name, message, seconds = world.run(silent_peer_task, 2.0)[0]
    assert name == "EPTimeoutError"
    assert "rank 0 of 2: the dispatch header all_gather did not complete within the process group's timeout (2 s)" \
        in message
    assert 1.5 <= seconds < 8.0


def exiting_peer_task(g):
    if g.rank == 1:
        os._exit(3)
    ids, w = _routing(0, 2, 4)
    ep_dispatch(make_tokens(2, 8), ids, w, ep_placement(4, 2), g)
    return "no error"


def test_a_dead_peer_is_reported_with_its_rank():
    w = LocalWorld(2, timeout_s=5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            w.run(exiting_peer_task)
        assert time.monotonic() - t0 < 30.0
        fails = info.value.failures
        assert fails[1][0] == "ProcessExit" and "exit code 3" in fails[1][1]
        # gloo notices the closed connection at once: rank 0 gets EPPeerError, not a timeout
        assert fails[0][0] == "EPPeerError"
        assert fails[0][1].startswith("rank 0 of 2: the dispatch header all_gather failed, a peer's connection closed")
        assert isinstance(info.value.exceptions[0], EPPeerError)
        with pytest.raises(RuntimeError, match="closed"):
            w.run(exiting_peer_task)
    finally:
        w.close(force=True)


# ---- validation of a candidate kernel ----------------------------------------------------------

E, H, N, T = 8, 16, 8, 5


def _layer():
    return make_layer(E, H, N, seed=3)


def candidate(hidden, topk_weights, topk_ids, group, *, fault: str = "none", mode: str = "normal"):
    """A 'kernel' built on the reference, with one planted fault."""
    pl = ep_placement(E, group.world_size)
    ids = np.array(topk_ids)
    if fault == "wrong_rank" and group.rank == 0:
        ids[0] = [(e + E // group.world_size) % E for e in ids[0]]  # token 0 to the next rank's experts
    d = ep_dispatch(hidden, ids, topk_weights, pl, group, mode=mode, max_tokens_per_rank=T)
    out = ep_fused_moe(hidden, _layer(), topk_weights, ids, pl, group, mode=mode, max_tokens_per_rank=T)
    if fault == "output" and group.rank == 2:
        out = out.copy()
        out[1] += 1e-3  # far above an FP32-accumulation bound (~1e-6 here) on every element of token 1
    if fault == "raises" and group.rank == 3:
        raise RuntimeError("kernel launch failed")
    if mode == "normal":
        counts = d.num_recv_tokens_per_expert.copy()
        if fault == "count" and group.rank == 1:
            counts[0] += 1
        return EPKernelOutput(out, d.x, d.src_rank, d.src_token, d.topk_idx, counts)
    # low-latency: reverse each expert's valid rows (DeepEP's order within an expert follows arrival)
    x, sr, si = d.x.copy(), d.src_rank.copy(), d.src_info.copy()
    for e, c in enumerate(d.recv_count.tolist()):
        x[e, :c], sr[e, :c], si[e, :c] = x[e, :c][::-1], sr[e, :c][::-1], si[e, :c][::-1]
    return EPKernelOutput(out, x, sr, si, None, d.recv_count)


def validate_task(g, fault, mode, engine="host"):
    import functools

    ids, w = _routing(g.rank, T, E, seed=5)
    x = make_tokens(T, H, seed=10 + g.rank)
    kernel = functools.partial(candidate, fault=fault, mode=mode)
    v = validate_ep_kernel(kernel, x, w, ids, ep_placement(E, g.world_size), g, weights=_layer(), profile=FP32_ACCUM,
                           mode=mode, max_tokens_per_rank=T, engine=engine)
    return v


def _run_validation(world, fault, mode="normal", engine="host"):
    results = world.run(validate_task, fault, mode, engine)
    assert all(r.summary() == results[0].summary() for r in results)  # the same report on every rank
    return results[0]


@pytest.mark.parametrize("engine", ["host", "device"])
def test_validation_passes_an_honest_kernel_in_both_modes(world, engine):
    for mode in ("normal", "low_latency"):
        v = _run_validation(world, "none", mode, engine)
        assert v.passed, v.summary()
        assert all(r.violations == 0 for r in v.ranks)


def test_validation_names_the_ranks_of_a_token_sent_to_the_wrong_rank(world):
    v = _run_validation(world, "wrong_rank")
    assert not v.passed
    text = v.summary()
    # token 0 of rank 0 went to the next rank's experts: missing where it belongs, unexpected where it landed
    ids, _ = _routing(0, T, E, seed=5)
    right = sorted({int(e) // (E // WORLD) for e in ids[0]})
    wrong = sorted({(int(e) // (E // WORLD) + 1) % WORLD for e in ids[0]})
    for r in right:
        if r not in wrong:
            assert f"rank {r}: missing rows: token 0 of rank 0" in text, text
    for r in wrong:
        if r not in right:
            assert f"rank {r}: unexpected rows (sent to the wrong rank or expert?): token 0 of rank 0" in text, text
    assert "rank 0: output:" in text  # and the source's output is wrong


@pytest.mark.parametrize("engine", ["host", "device"])
def test_validation_reports_a_count_off_by_one_on_its_rank_only(world, engine):
    v = _run_validation(world, "count", engine=engine)
    assert v.faulty_ranks == [1]
    assert "per-expert receive counts differ: local expert 0:" in v.ranks[1].faults[0]


def test_validation_reports_an_output_fault_with_the_bound(world):
    v = _run_validation(world, "output")
    assert v.faulty_ranks == [2]
    assert v.ranks[2].faults[0].startswith(f"output: {H} elements outside the FP32_ACCUM bound, on tokens 1")
    assert v.ranks[2].violations == H


def test_validation_reports_a_candidate_that_raises(world):
    v = _run_validation(world, "raises")
    assert v.faulty_ranks == [3]
    assert v.ranks[3].faults == ("the candidate raised RuntimeError: kernel launch failed",)


def local_weights_task(g, out_dtype):
    ids, w = _routing(g.rank, T, E, seed=7)
    x = make_tokens(T, H, seed=20 + g.rank)
    pl = ep_placement(E, g.world_size, "round_robin")
    full = ep_fused_moe(x, _layer(), w, ids, pl, g, out_dtype=out_dtype)
    mine = _layer().select(pl.local_experts(g.rank))
    local = ep_fused_moe(x, mine, w, ids, pl, g, out_dtype=out_dtype, weights_are_local=True)
    return full, local, x, ids, w


def test_local_weights_and_output_dtype(world):
    import ml_dtypes

    from moeref.moe import fused_moe

    res = world.run(local_weights_task, "bfloat16", world_size=3)
    x = np.concatenate([r[2] for r in res])
    want = fused_moe(x, _layer(), np.concatenate([r[4] for r in res]), np.concatenate([r[3] for r in res]),
                     out_dtype="bfloat16")
    for part, (full, local, *_) in zip(np.split(want, 3), res):
        assert full.dtype == np.dtype(ml_dtypes.bfloat16)
        assert full.view(np.uint16).tolist() == part.view(np.uint16).tolist()
        assert local.view(np.uint16).tolist() == part.view(np.uint16).tolist()


def disagreeing_bound_task(g):
    ids, w = _routing(g.rank, 2, 8)
    ep_dispatch(make_tokens(2, 8), ids, w, ep_placement(8, g.world_size), g, mode="low_latency",
                max_tokens_per_rank=4 if g.rank else 2)


def test_ranks_must_agree_on_max_tokens_per_rank(world):
    with pytest.raises(RankError) as info:
        world.run(disagreeing_bound_task, world_size=2)
    for r in (0, 1):
        assert info.value.failures[r][1] == "ranks disagree on max_tokens_per_rank: {0: 2, 1: 4}"


def test_deepep_preset_is_deepeps_fp8_cast():
    """The ``deepep`` preset against DeepEP's low-latency FP8 cast written out here in float32
    (internode_ll.cu: fmaxf amax, floor 1e-4, scale = 448/amax, scale_inv = amax * fl(1/448),
    x * scale cast satfinite RNE)."""
    import ml_dtypes

    from moeref.quant import fp8_group, quantize

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 256)) * rng.choice([1e-3, 1.0, 300.0], (6, 1))).astype(ml_dtypes.bfloat16)
    x[1, :128] = 0  # zero block: amax floored at 1e-4
    x[2, 5] = np.nan  # fmaxf ignores NaN in the amax; the element itself stays NaN
    x[3, 200] = 1e-6
    q = quantize(x, fp8_group(128, preset="deepep"))
    xf = x.astype(np.float32).reshape(6, 2, 128)
    amax = np.maximum(np.fmax.reduce(np.abs(xf), axis=2), np.float32(1e-4))
    scale = np.float32(448) / amax
    scale_inv = amax * (np.float32(1) / np.float32(448))
    codes = np.clip(xf * scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert q.scales.view(np.uint32).tolist() == scale_inv.view(np.uint32).tolist()
    assert q.codes.tolist() == codes.reshape(6, 256).tolist()
    assert (q.codes[2, 5] & 0x7F) == 0x7F  # NaN
    # fl(amax * fl(1/448)) is not fl(amax / 448) for every amax: the preset keeps DeepEP's product
    a = np.float32(np.arange(1, 4000, dtype=np.float32) * np.float32(0.37))
    assert ((a * (np.float32(1) / np.float32(448))) != (a / np.float32(448))).any()


def test_padding_needs_normal_mode_and_a_bound():
    x, ids, w = make_tokens(2, 8), np.array([[0], [1]]), np.ones((2, 1), np.float32)
    for kw in (dict(), dict(mode="low_latency", max_tokens_per_rank=2, max_recv_tokens=4)):
        with pytest.raises(ValueError, match="pad_to_max_recv=True needs mode='normal' and max_recv_tokens"):
            ep_dispatch(x, ids, w, ep_placement(2, 1), None, pad_to_max_recv=True, **kw)


def test_shared_world_is_reused_and_serves_smaller_world_sizes(world):
    assert LocalWorld.shared(WORLD, timeout_s=20.0) is world
    assert world.run(rank_and_size) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert world.run(rank_and_size, world_size=2) == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="world_size=5 is larger than this LocalWorld"):
        world.run(rank_and_size, world_size=5)


def rank_and_size(g):
    return g.rank, g.world_size


def test_placement_constructor_validates():
    with pytest.raises(ValueError, match=r"owner\[1\] = 2 is not a rank in \[0, 2\)"):
        EPPlacement(np.array([0, 2]), np.array([0, 0]), 2, np.array([0, 1]))
    with pytest.raises(ValueError, match=r"the local ids of rank 0 are \[0, 2\]; they must be 0..1 once each"):
        EPPlacement(np.array([0, 0, 1]), np.array([0, 2, 0]), 2, np.array([0, 1, 2]))
    with pytest.raises(TypeError, match="owner must have dtype"):
        EPPlacement(np.array([0.0]), np.array([0]), 1, np.array([0]))


def transport_task(g, p2p: bool):
    """A dispatch and a combine of both engines, with the point-to-point transport forced or not."""
    from moeref.distributed import ep_combine, group as group_module

    ids, w = _routing(g.rank, 4, 8, seed=9)
    x = make_tokens(4, 8, seed=20 + g.rank)
    pl = ep_placement(8, g.world_size)
    saved = dict(group_module._P2P_FALLBACK)
    group_module._P2P_FALLBACK[g.backend] = p2p
    try:
        out = {}
        for engine in ("host", "device"):
            d = ep_dispatch(x, ids, w, pl, g, mode="low_latency", max_tokens_per_rank=4, engine=engine)
            y = np.asarray(d.x if engine == "host" else d.x.numpy(), np.float64) * 3.0
            got = ep_combine(y, d, g)
            out[engine] = (np.asarray(d.src_info), np.asarray(d.x), np.asarray(got))
        return out
    finally:
        group_module._P2P_FALLBACK.clear()
        group_module._P2P_FALLBACK.update(saved)


def test_point_to_point_fallback_moves_the_same_rows(world):
    """A backend without ``all_to_all_single`` gets batch_isend_irecv per peer: the same blocks at the same offsets,
    so both engines' results are the same with either transport (and the combine returns 3 x the tokens' sums)."""
    a2a = world.run(transport_task, False)
    p2p = world.run(transport_task, True)
    for rank in range(WORLD):
        for engine in ("host", "device"):
            for u, v in zip(a2a[rank][engine], p2p[rank][engine]):
                np.testing.assert_array_equal(u, v)
        ids, w = _routing(rank, 4, 8, seed=9)
        want = make_tokens(4, 8, seed=20 + rank).astype(np.float64) * 3.0 * w.astype(np.float64).sum(axis=1)[:, None]
        np.testing.assert_allclose(p2p[rank]["device"][2], want, rtol=1e-12)


def test_moeref_and_the_ep_device_engine_import_without_torch():
    """``import moeref.distributed`` (and its device engine module) never imports torch: the engine imports it on use."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"  # an import of torch now raises ImportError
            "import moeref, moeref.distributed, moeref.distributed.device\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') and sys.modules[m]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
