"""``Report.suspects`` (:func:`moeref.compare.report._slot_suspects`): per violating token, the top-k slot whose
weighted contribution best correlates with the token's error vector.

The correlation is defined by one formula on both engines (elementwise products, a pairwise-halving sum,
``sqrt``, one division; :func:`moeref.compare.report._slot_correlations`). The oracle here is that formula
written out in Python floats (IEEE float64, one rounding per operation) over the slot rows read from the run,
and the planted faults' slots (hand-known). A device-engine run (CPU torch under ``TRITON_INTERPRET=1``, or
CUDA where present) gives the host run's suspects exactly: the same dict, slot, expert and float64 correlation.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device  # noqa: E402
from moeref.compare import PROFILES, compare  # noqa: E402
from moeref.compare import report as report_module  # noqa: E402
from moeref.compare.report import _halving_sum  # noqa: E402
from moeref.moe import MoEQuant, make_layer, make_tokens, quantize_weights, run_moe  # noqa: E402
from moeref.quant import fp8_block, fp8_group  # noqa: E402
from moeref.routing import expert_map  # noqa: E402

DEV = device()
PROFILE = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]


def _py_halving_sum(v: list) -> float:
    """The documented order in Python floats: h the largest power of two below n, v[i] += v[i + h] for
    i < n - h, then the same over the first h."""
    v = list(v)
    n = len(v)
    while n > 1:
        h = 1 << ((n - 1).bit_length() - 1)
        for i in range(n - h):
            v[i] = v[i] + v[i + h]
        n = h
    return v[0]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 100, 129])
def test_halving_sum_is_the_documented_order_on_numpy_and_torch(n):
    """Values spanning 2^-40..2^40 (the order matters to the last bit): NumPy and torch give the Python oracle's
    float64 bits."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, n)) * np.exp2(rng.integers(-40, 40, (3, n)))
    want = [_py_halving_sum(row.tolist()) for row in x]
    assert _halving_sum(x.copy()).tolist() == want
    assert _halving_sum(torch.as_tensor(x, device=DEV)).cpu().tolist() == want
    if n > 2:  # the data tell this order from a left-to-right sum's (so a different order fails the test)
        assert any(a != sum(row.tolist()) for a, row in zip(want, x))


def _layer():
    """9 tokens, top-3 over 4 global experts; this rank holds experts 0 and 1 (expert map, linear: 2 and 3 are
    another rank's, their slots contribute zero rows); token 0 has a padded slot; chunks of 4 tokens."""
    rng = np.random.default_rng(5)
    m, k, hidden, inter = 9, 3, 64, 32
    ids = np.array([[0, 1, -1],   # a padded slot
                    [1, 2, 0],
                    [2, 0, 1],
                    [0, 2, 3],    # one local slot (j=0), two another rank's
                    [3, 2, -1],   # no local slot: every contribution is a zero row
                    [1, 0, 3],
                    [1, 0, 2],
                    [0, 1, 2],
                    [2, 1, 0]], dtype=np.int32)
    tw = rng.random((m, k)).astype(np.float32)
    w = quantize_weights(make_layer(2, hidden, inter, seed=3), fp8_block())
    x = make_tokens(m, hidden, seed=4)
    kw = dict(quant=MoEQuant(fp8_group(), fp8_group(), "fp8"), gemm1_out_dtype="bfloat16", act_out_dtype="float32",
              num_experts=4, expert_map=expert_map(4, 2, 0), chunk_size=4)
    return x, w, tw, ids, kw


def _contribution(run, t: int, j: int) -> np.ndarray:
    """Slot (t, j)'s weighted row ``w[t, j] * y[row]`` read from the host run (a zero row where no row holds it)."""
    start = 0
    for p, e in run.chunks:
        if t < start + p.num_tokens:
            rows = np.flatnonzero(p.src == (t - start) * p.top_k + j)
            y = np.zeros(e.y.shape[1]) if rows.size == 0 else np.asarray(e.y[rows[0]], dtype=np.float64)
            return y * np.float64(p.topk_weights[t - start, j]) if p.apply_weights else y
        start += p.num_tokens
    raise AssertionError(t)


def _oracle_correlation(run, diff: np.ndarray, t: int, j: int) -> float:
    """The documented correlation of slot (t, j) in Python floats."""
    c = [float(v) for v in _contribution(run, t, j)]
    d = [0.0 if not math.isfinite(v) else float(v) for v in diff[t]]
    nc = math.sqrt(_py_halving_sum([a * a for a in c]))
    nd = math.sqrt(_py_halving_sum([a * a for a in d]))
    dot = _py_halving_sum([a * b for a, b in zip(c, d)])
    den = nc * nd
    return 0.0 if den == 0.0 else dot / den


def test_device_suspects_equal_the_host_suspects_and_the_oracle(monkeypatch):
    x, w, tw, ids, kw = _layer()
    host = run_moe(x, w, tw, ids, **kw)
    dev = run_moe(x, w, tw, ids, device=DEV, **kw)
    ref = np.asarray(host.output, dtype=np.float64)
    cand = ref.copy()
    cand[1] += 3.0 * _contribution(host, 1, 2)              # slot 2 counted four times: +1
    cand[2] -= _contribution(host, 2, 1)                    # a dropped slot: -1
    cand[3] -= 0.5 * _contribution(host, 3, 0)              # the token's only local slot, half lost
    cand[4] += np.linspace(-1.0, 1.0, cand.shape[1])        # violates; every slot a zero row: no suspect
    cand[5] = np.nan                                        # a NaN error vector: no suspect
    cand[6] += 2.0 * _contribution(host, 6, 1)              # slot 1, with one NaN column among the rest
    cand[6, 5] = np.nan
    cand[7] += np.cos(np.arange(cand.shape[1]))             # an error no slot explains: some slot, the same on both
    spy = []
    real = report_module._slot_suspects
    monkeypatch.setattr(report_module, "_slot_suspects", lambda r, d, t: spy.append(d) or real(r, d, t))
    hr = compare(cand, host, PROFILE)
    dr = compare(torch.as_tensor(cand, device=DEV), dev, PROFILE)
    # the device compare handed the suspects its device diff, not a host copy
    assert isinstance(spy[0], np.ndarray) and torch.is_tensor(spy[1]) and spy[1].device.type == torch.device(DEV).type
    assert np.flatnonzero(hr.token_violations).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert np.array_equal(hr.token_violations, dr.token_violations)
    # the same dict: slots, experts and the float64 correlations bit for bit
    assert dr.suspects == hr.suspects
    assert all(float(a[2]).hex() == float(b[2]).hex() for a, b in zip(hr.suspects.values(), dr.suspects.values()))
    assert sorted(hr.suspects) == [1, 2, 3, 6, 7]             # 4 (zero rows) and 5 (NaN error) name no slot
    planted = {1: (2, +1), 2: (1, -1), 3: (0, -1), 6: (1, +1)}
    for t, (j, sign) in planted.items():
        got_j, got_e, corr = hr.suspects[t]
        assert (got_j, got_e) == (j, int(ids[t, j])) and sign * corr > 0.99, (t, hr.suspects[t])
    diff = cand - ref
    for t, (j, e, corr) in hr.suspects.items():  # the oracle's value and its largest |corr| slot
        oracle = [_oracle_correlation(host, diff, t, jj) for jj in range(ids.shape[1])]
        assert corr == oracle[j], (t, corr, oracle)
        assert j == int(np.argmax(np.abs(oracle))) and e == int(ids[t, j])


def test_device_suspects_equal_the_host_suspects_on_many_tokens():
    """256 violating tokens, top-8 over 64 experts, K = 300 (not a power of two), rows in expert order with padding
    and a dropped slot per 16 tokens, float32 weights: ``_slot_suspects`` of torch tensors (the device path) gives
    the NumPy path's dict exactly, every token's correlation to the bit (a last-bit difference in any operation of
    the formula, e.g. a library ``sqrt`` that is not correctly rounded, shows on some of the 256)."""
    from types import SimpleNamespace

    rng = np.random.default_rng(11)
    n, k, kdim, e = 256, 8, 300, 64
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    slots = np.argsort(ids.ravel(), kind="stable")
    slots = slots[slots % (16 * k) != 3]                        # slot 3 of every 16th token: no row (dropped)
    src = np.concatenate([slots, np.full(40, -1)])
    rng.shuffle(src)
    y = rng.standard_normal((src.size, kdim)) * np.exp2(rng.integers(-8, 8, (src.size, 1)))
    tw = rng.random((n, k)).astype(np.float32)
    diff = rng.standard_normal((n, kdim))
    diff[5] = np.nan
    diff[9, :7] = np.inf

    def run(on_device):
        w = torch.as_tensor(tw, dtype=torch.float64, device=DEV) if on_device else tw
        p = SimpleNamespace(num_tokens=n, top_k=k, src=src, apply_weights=True, topk_weights=w, topk_ids=ids)
        return SimpleNamespace(chunks=[(p, SimpleNamespace(y=torch.as_tensor(y, device=DEV) if on_device else y))])

    tokens = np.arange(n)
    hs = report_module._slot_suspects(run(False), diff, tokens)
    ds = report_module._slot_suspects(run(True), torch.as_tensor(diff, device=DEV), tokens)
    assert len(hs) == n - 1 and 5 not in hs                     # the NaN token names no slot
    assert ds == hs
    for t in (0, 9, 16, 255):                                   # 9: Inf columns; 16: its slot 3 a zero row
        oracle = [_oracle_correlation(run(False), diff, t, j) for j in range(k)]
        j = int(np.argmax(np.abs(oracle)))
        assert hs[t] == (j, int(ids[t, j]), oracle[j]), (t, hs[t], oracle)
    assert _oracle_correlation(run(False), diff, 16, 3) == 0.0
