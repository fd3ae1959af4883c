"""compare.device._activation_kernels: the fused stage-3 kernel equals, bit for bit, the three torch lines of
:func:`moeref.compare.device.layer._chunk_interval` (activation, its error bound, the ``act_unit`` term) on
CPU tensors under TRITON_INTERPRET=1 (the conftest sets it without a GPU), on a GPU for real. NaN results
must be NaN at the same places (their payload bits are not compared); every other result is compared as
int64 bits."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from moeref import elementary  # noqa: E402
from moeref.compare.device._activation_kernels import gated_silu_stage_t  # noqa: E402
from moeref.compare.stage_bounds import _CRITICAL, activation_error, activation_magnitude  # noqa: E402
from moeref.moe.pipeline import _activation  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy overflow/NaN
DEV = "cuda" if torch.cuda.is_available() else "cpu"
UNIT = 2.0**-24
CASES = [  # (activation, w13 layout, params)
    ("silu_and_mul", "gate_up", {}),
    ("silu_and_mul", "up_gate", None),
    ("mul_and_silu", "gate_up", {}),  # always up_gate, whatever the weights' layout
    ("silu_and_mul", "interleaved", {}),
    ("silu_and_mul", "gate_up", {"layout": "up_gate"}),
    ("swigluoai", "interleaved", {}),
    ("swiglu_bias", "gate_up", {"layout": "up_gate", "alpha": 1.702, "beta": -0.5, "limit": 7.0}),
    ("swiglu_bias", "gate_up", {"layout": "gate_up", "alpha": 0.5}),
    ("swiglustep", "gate_up", {"limit": 3.5}),
]
IDS = [f"{a}-{lay}-{sorted((p or {}).items())}" for a, lay, p in CASES]


def _reference(h, dh, act, lay, params, unit):
    """The three lines of device.layer._chunk_interval, stage 3."""
    x_pre = _activation(act, h, lay, params)
    dx = activation_error(act, h, dh, lay, params)
    dx = dx + unit * (x_pre.abs() + activation_magnitude(act, h.abs() + dh, lay, params) + dx)
    return x_pre, dx


def _assert_same_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float64, what
    gn, wn = got.isnan(), want.isnan()
    assert torch.equal(gn, wn), f"{what}: NaN at different places"
    gb = torch.where(gn, 0.0, got).view(torch.int64)
    wb = torch.where(wn, 0.0, want).view(torch.int64)
    bad = (gb != wb).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: "
                              f"{got[tuple(bad[0])].item()!r} vs {want[tuple(bad[0])].item()!r}")


def _check(h, dh, act, lay, params, unit=UNIT):
    want = _reference(h, dh, act, lay, params, unit)
    got = gated_silu_stage_t(h, dh, act, lay, params, unit)
    assert got is not None, f"{act}/{lay}/{params} should be supported"
    _assert_same_bits(got[0], want[0], "x_pre")
    _assert_same_bits(got[1], want[1], "dx")
    return want


def _pack(g, u, act, lay, params):
    """``[rows, 2n]`` fused rows of gate/up ``[rows, n]`` in the layout the activation reads."""
    lay = "up_gate" if act == "mul_and_silu" else (params or {}).get("layout", lay)
    if lay == "interleaved":
        return np.stack([g, u], axis=-1).reshape(g.shape[0], -1)
    return np.concatenate([g, u] if lay == "gate_up" else [u, g], axis=1)


def _half_ties(kmax=60):
    """Arguments x > 0 with fl(x * INV_LN2) exactly k + 0.5 (k < kmax): exp(-x)'s reduction ``torch.round``
    meets a tie and rounds it to even (rounding it away from zero gives other bits for some, e.g. k = 20)."""
    out = []
    for k in range(1, kmax):
        x0 = (k + 0.5) / elementary._INV_LN2
        for cand in (x0, np.nextafter(x0, 0.0), np.nextafter(x0, np.inf)):
            if cand * elementary._INV_LN2 == k + 0.5:
                out.append(float(cand))
                break
    return out


def _gates(rng, n):
    """Gate/up values: log-uniform magnitudes 1e-300..1e3 with signs, O(1) values, exp's over/underflow and
    subnormal ranges, ties of the exp reduction, the critical points, and specials."""
    mags = 10.0 ** rng.uniform(-300, 3, n)
    v = np.where(rng.random(n) < 0.5, -mags, mags)
    v[: n // 4] = rng.uniform(-12, 12, n // 4)
    specials = [0.0, -0.0, np.nan, np.inf, -np.inf, 745.2, -745.2, 746.0, -800.0, 709.8, -708.5, -740.0, 1e-310,
                -5e-324, *(x for c, _ in _CRITICAL["silu"] for x in (c, np.nextafter(c, 0), np.nextafter(c, 9)))]
    specials += [-t for t in _half_ties(30)]
    v[n // 4: n // 4 + len(specials)] = specials
    return v


def _radii(rng, v):
    n = v.size
    kind = rng.integers(0, 6, n)
    d = np.select([kind == 0, kind == 1, kind == 2, kind == 3, kind == 4],
                  [0.0, 1e-300 * rng.random(n), np.abs(v) * 2.0**-8, rng.uniform(0, 3, n), 1e300 * rng.random(n)],
                  np.inf)
    d[:3] = [np.nan, np.inf, 0.0]
    return d


def _data(rows, n, seed):
    """h, dh ``[rows, 2n]``: gate and up drawn independently (shuffled over rows/columns)."""
    rng = np.random.default_rng(seed)
    h = np.stack([rng.permutation(_gates(rng, rows * n)) for _ in range(2)], axis=0)  # [2, rows * n]
    dh = np.stack([rng.permutation(_radii(rng, h[i])) for i in range(2)], axis=0)
    half = lambda a: a.reshape(2, rows, n).transpose(1, 0, 2).reshape(rows, 2 * n)  # noqa: E731
    return torch.tensor(half(h), device=DEV), torch.tensor(half(dh), device=DEV)


@pytest.mark.parametrize("act,lay,params", CASES, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_and_special_values(act, lay, params, seed):
    h, dh = _data(8, 40, seed)
    x_pre, dx = _check(h, dh, act, lay, params)
    # the data reaches the cases it is meant to: NaN, inf, zero and many finite results; exp out of range
    assert x_pre.isnan().any() and dx.isinf().any() and dx.isfinite().sum() > 100 and (x_pre == 0).any()
    assert (h.abs() > 745.2).any() and ((h.abs() > 708) & (h.abs() < 745)).any() and (dh == 0).any()


@pytest.mark.parametrize("act,lay,params", CASES[:5], ids=IDS[:5])
def test_critical_points_inside_and_outside_the_interval(act, lay, params):
    """Gates at, just inside and just outside ``g -+ dg`` of silu's critical points, so both branches of
    ``lipschitz_on``'s ``where`` are taken; and intervals ending exactly on a critical point."""
    rows, n = 4, 48
    rng = np.random.default_rng(7)
    cs = [c for c, _ in _CRITICAL["silu"]]
    g = np.array([c + s * o for c in cs for s in (-1, 1) for o in (0.0, 0.25, 0.5, 0.5000001, 1.0, 3.0)])
    g = np.resize(g, rows * n)
    dg = np.resize(np.array([0.0, 0.5, 0.25, 1e-9, 2.0]), rows * n)
    # intervals [c, c + 2d] and [c - 2d, c] exactly (lo or hi == c)
    d = 0.125
    g[:4], dg[:4] = [cs[0] + d, cs[1] - d, cs[0] - d, cs[1] + d], d
    u = rng.uniform(-4, 4, rows * n)
    du = rng.uniform(0, 0.01, rows * n)
    h = torch.tensor(_pack(g.reshape(rows, n), u.reshape(rows, n), act, lay, params), device=DEV)
    dh = torch.tensor(_pack(dg.reshape(rows, n), du.reshape(rows, n), act, lay, params), device=DEV)
    _check(h, dh, act, lay, params)
    gt, dgt = torch.tensor(g, device=DEV), torch.tensor(dg, device=DEV)
    lo, hi = gt - dgt, gt + dgt
    inside = torch.zeros_like(gt, dtype=torch.bool)
    for c in cs:
        inside |= (lo <= c) & (c <= hi)
    assert inside.any() and (~inside).any()
    assert ((lo == cs[0]) | (hi == cs[1]) | (lo == cs[1]) | (hi == cs[0])).any()


@pytest.mark.parametrize("act,lay,params", CASES, ids=IDS)
def test_special_combinations(act, lay, params):
    """Every combination of special gate, gate radius, up and up radius (signed zeros, NaN, infinities,
    subnormals, interval ends that overflow to inf while the other stays finite, the critical points)."""
    c0, c1 = (c for c, _ in _CRITICAL["silu"])
    gs = [0.0, -0.0, np.nan, np.inf, -np.inf, 1.5e308, -1.5e308, c0, c1, 1.0, -1000.0, 5e-324, -30.0]
    dgs = [0.0, 5e-324, 1.0, 1e308, np.inf, np.nan]
    us = [1.0, -0.0, np.inf, -np.nan, 8.5]
    dus = [0.0, np.inf, 0.25]
    g, dg, u, du = (a.ravel() for a in np.meshgrid(gs, dgs, us, dus, indexing="ij"))
    h, dh = _pack(g[None], u[None], act, lay, params), _pack(dg[None], du[None], act, lay, params)
    _check(torch.tensor(h, device=DEV), torch.tensor(dh, device=DEV), act, lay, params)
    with np.errstate(over="ignore", invalid="ignore"):
        lo, hi = g - dg, g + dg
    assert (np.isfinite(lo) & (hi == np.inf)).any() and (np.isfinite(hi) & (lo == -np.inf)).any()


@pytest.mark.parametrize("act,lay,params", [CASES[0], CASES[5]], ids=[IDS[0], IDS[5]])
def test_exp_reduction_ties(act, lay, params):
    """Gates (and interval ends) whose exp reduction meets a rounding tie: half to even, as torch.round."""
    ties = np.array(_half_ties(1075))
    assert ties.size > 800
    g = np.concatenate([-ties, ties])
    n = g.size
    rng = np.random.default_rng(5)
    u = rng.uniform(-2, 2, n)
    dg = np.where(np.arange(n) % 2 == 0, 0.5, 0.0)  # every other gate: interval ends off the ties
    h = torch.tensor(_pack(g[None], u[None], act, lay, params), device=DEV)
    dh = torch.tensor(_pack(dg[None], np.zeros((1, n)), act, lay, params), device=DEV)
    _check(h, dh, act, lay, params)


@pytest.mark.parametrize("unit", [0.0, 2.0**-8, 1.0 / 3.0 * 2.0**-20])
def test_act_unit_values_and_float32_rounding_is_caught(unit):
    h, dh = _data(8, 40, 3)
    _check(h, dh, "silu_and_mul", "gate_up", {}, unit)
    if unit == 1.0 / 3.0 * 2.0**-20:  # a float32-rounded constant gives other bits: the comparison would see it
        got = gated_silu_stage_t(h, dh, "silu_and_mul", "gate_up", {}, float(np.float32(unit)))
        want = _reference(h, dh, "silu_and_mul", "gate_up", {}, unit)[1]
        fin = want.isfinite() & (want != 0)
        assert (got[1][fin].view(torch.int64) != want[fin].view(torch.int64)).any()


@pytest.mark.parametrize("shape", [(40, 80), (3, 2 * 1100), (2, 3, 2 * 24), (1, 2)])
def test_shapes_and_tiles(shape):
    """Several row tiles (masked), several column tiles (I > 1024), leading batch axes, I = 1."""
    rng = np.random.default_rng(11)
    h = torch.tensor(rng.standard_normal(shape) * 6, device=DEV)
    dh = torch.tensor(rng.uniform(0, 0.5, shape), device=DEV)
    for act, lay in (("silu_and_mul", "gate_up"), ("mul_and_silu", "up_gate")):
        x_pre, _ = _check(h, dh, act, lay, {})
        assert x_pre.shape == (*shape[:-1], shape[-1] // 2)


def test_no_rows():
    h = torch.zeros((0, 80), dtype=torch.float64, device=DEV)
    x_pre, dx = gated_silu_stage_t(h, h.clone(), "silu_and_mul", "gate_up", {}, UNIT)
    assert x_pre.shape == dx.shape == (0, 40)


@pytest.mark.parametrize("act,lay,params", [
    ("gelu_and_mul", "gate_up", {}), ("relu2_no_mul", "gate_up", {}), ("silu_no_mul", "gate_up", {}),
    ("gelu_no_mul", "gate_up", {}), ("swish", "gate_up", {}),
    ("silu_and_mul", "concatenated", {}), ("silu_and_mul", "gate_up", {"layout": "concatenated"}),
    ("silu_and_mul", "sideways", {}), ("silu_and_mul", "gate_up", {"alpha": 2.0}),
    ("mul_and_silu", "gate_up", {"layout": "gate_up"}), ("swiglustep", "gate_up", {"limit": np.array([1.0, 2.0])}),
    ("swiglustep", "gate_up", {"limit": None}), ("swigluoai", "interleaved", {"limit": 0.0}),
    ("swigluoai", "interleaved", {"limit": math.nan}), ("swiglu_bias", "gate_up", {}),  # layout is required
])
def test_unsupported_returns_none(act, lay, params):
    h = torch.ones((2, 8), dtype=torch.float64, device=DEV)
    assert gated_silu_stage_t(h, h.clone(), act, lay, params, UNIT) is None


def test_concatenated_is_none_because_the_torch_path_raises():
    """``"concatenated"`` is an alias for the activation but not for the bounds' split: no kernel result."""
    h = torch.ones((2, 8), dtype=torch.float64, device=DEV)
    with pytest.raises(ValueError):
        _reference(h, h.clone(), "silu_and_mul", "concatenated", {}, UNIT)
    assert gated_silu_stage_t(h, h.clone(), "silu_and_mul", "concatenated", {}, UNIT) is None


def test_unsupported_inputs_return_none():
    h = torch.ones((2, 8), dtype=torch.float64, device=DEV)
    assert gated_silu_stage_t(h.float(), h.float(), "silu_and_mul", "gate_up", {}, UNIT) is None
    assert gated_silu_stage_t(h, torch.ones((2, 6), dtype=torch.float64, device=DEV), "silu_and_mul", "gate_up",
                              {}, UNIT) is None
    assert gated_silu_stage_t(h[:, :7], h[:, :7], "silu_and_mul", "gate_up", {}, UNIT) is None
    got = gated_silu_stage_t(h, h.clone(), "silu_and_mul", "gate_up", {}, UNIT)
    assert got is not None and got[0].shape == (2, 4)


def test_non_contiguous_input():
    h, dh = _data(8, 40, 5)
    ht, dht = h.t().contiguous().t(), dh.t().contiguous().t()  # column-major views
    assert not ht.is_contiguous()
    _check(ht, dht, "silu_and_mul", "up_gate", {})
