"""The operand radius on its grid (moeref.compare.operand_radius) and the aligned-adder bound's steps form.

Oracles: exact rational arithmetic (``fractions.Fraction``) for the rounded radius, the exactness of every chunk's
sum and the one rounding of each chunk times its scale; the grid's bits by hand from the module's formula."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from moeref.compare import PROFILES, gemm_error_bound
from moeref.compare.gemm_bounds import adder_form, adder_operands, adder_setup, adder_step_sums
from moeref.compare.operand_radius import (MIN_GRID_BITS, RADIUS_CHUNK, exact_radius, pow2_exact, radius_dot,
                                           radius_grid_bits, rounded_radius)
from moeref.gemm.exact import as_operand, quantum_and_max
from moeref.quant import fp8_block, fp8_group, mxfp4, quantize

HOP = PROFILES["HOPPER_FP8_DEEPGEMM_DATA"]


def _fp8_pair(rng, m, n, k):
    a = quantize(rng.standard_normal((m, k)).astype(np.float32), fp8_group())
    w = quantize((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), fp8_block())
    return as_operand(a), as_operand(w)


def test_grid_bits_by_hand():
    # L = 45 - ceil(log2(m / q)): E4M3 448 / 2^-9 = 2^17.8 -> 18 -> 27; E2M1 6 / 0.5 = 12 -> 4 -> 41;
    # a power-of-two ratio 2^10 -> 35; all-zero weights -> 45; E5M2 57344 / 2^-16 = 2^31.8 -> 13 < 16 -> None
    assert radius_grid_bits((2.0**-9, 448.0)) == 27
    assert radius_grid_bits((0.5, 6.0)) == 41
    assert radius_grid_bits((1.0, 1024.0)) == 35
    assert radius_grid_bits((float("inf"), 0.0)) == 45
    assert radius_grid_bits((2.0**-16, 57344.0)) is None
    assert MIN_GRID_BITS == 16


def test_pow2_exact_every_exponent():
    e = np.arange(-1074, 1024)
    assert np.array_equal(pow2_exact(e), np.ldexp(1.0, e))  # C ldexp: exact, subnormals included


def test_rounded_radius_is_the_smallest_grid_point_above():
    """``r^ = ceil(r / q) q`` with ``q = 2^(floor(log2 R) - L)``, ``R`` the row's largest radius in the chunk: checked
    element by element in rationals, with radii spanning 60 binades, zeros and subnormals."""
    rng = np.random.default_rng(0)
    k = 300  # three chunks, the last partial
    r = np.abs(rng.standard_normal((3, k))) * np.exp2(rng.integers(-60, 0, (3, k)))
    r[0, :50] = 0.0
    r[1, 200:] = 5e-324 * rng.integers(1, 9, 100)
    r[2, 128:256] = 0.0
    bits = 27
    got = rounded_radius(r, bits)
    for i in range(r.shape[0]):
        for c0 in range(0, k, RADIUS_CHUNK):
            cols = range(c0, min(c0 + RADIUS_CHUNK, k))
            big = max(r[i, j] for j in cols)
            if big == 0:
                assert all(got[i, j] == 0 for j in cols)
                continue
            q = Fraction(2) ** max(int(np.frexp(big)[1]) - 1 - bits, -1074)
            for j in cols:
                x = Fraction(float(r[i, j]))
                want = -((-x) // q) * q  # ceil(x / q) * q, exactly
                assert Fraction(float(got[i, j])) == want, (i, j)
                assert want >= x and want - x < q


def test_chunk_sums_on_the_grid_are_exact():
    """Every partial sum of ``r^ |w|`` over a chunk is exact in float64 (the grid's purpose): the float64 sum in any
    order equals the rational sum."""
    rng = np.random.default_rng(1)
    _, w = _fp8_pair(rng, 1, 5, 256)
    r = np.abs(rng.standard_normal((4, 256))) * np.exp2(rng.integers(-30, 0, (4, 256)))
    bits = radius_grid_bits(quantum_and_max(w.values))
    rh = rounded_radius(r, bits)
    wv = np.abs(np.asarray(w.values, dtype=np.float64))
    for i in range(4):
        for n in range(5):
            for c0 in (0, 128):
                prods = rh[i, c0:c0 + 128] * wv[n, c0:c0 + 128]
                exact = sum(Fraction(float(x)) * Fraction(float(y))
                            for x, y in zip(rh[i, c0:c0 + 128], wv[n, c0:c0 + 128]))
                assert Fraction(float(np.sum(prods))) == exact
                assert Fraction(float(np.sum(prods[::-1]))) == exact
                assert Fraction(float(np.cumsum(prods[rng.permutation(128)])[-1])) == exact


def test_radius_dot_rounds_once_a_chunk():
    """``radius_dot``: per chunk the exact sum times ``|scale_w|`` rounded once, chunks added in order (rationals)."""
    rng = np.random.default_rng(2)
    _, w = _fp8_pair(rng, 1, 3, 200)
    r = np.abs(rng.standard_normal((2, 200))) * 2.0**-9
    got = radius_dot(r, w)
    rh = exact_radius(r, w)
    wv = np.abs(np.asarray(w.values, dtype=np.float64))
    for i in range(2):
        for n in range(3):
            tot = 0.0
            for c, c0 in enumerate((0, 128)):
                cols = slice(c0, min(c0 + 128, 200))
                s = sum(Fraction(float(x)) * Fraction(float(y)) for x, y in zip(rh[i, cols], wv[n, cols]))
                sc = Fraction(float(abs(w.scales[n // w.block[0], c0 // w.block[1]])))
                tot = tot + float(s * sc)  # Fraction -> float: correctly rounded
            assert got[i, n] == tot


def test_radius_dot_keeps_the_ordered_sum_off_the_grid():
    """Weights whose blocks change inside a chunk (MXFP4's 32-column blocks), or a non-finite radius: no grid, the
    ordered sum."""
    from moeref.compare.summation_order import ordered_dot

    rng = np.random.default_rng(3)
    w = as_operand(quantize(rng.standard_normal((4, 128)).astype(np.float32), mxfp4()))
    r = np.abs(rng.standard_normal((2, 128))) * 2.0**-9
    assert exact_radius(r, w) is None
    assert np.array_equal(radius_dot(r, w), ordered_dot(r, np.abs(w.dequantize())))
    _, w8 = _fp8_pair(rng, 1, 4, 128)
    r[0, 3] = np.inf
    assert exact_radius(r, w8) is None


def test_adder_forms_chosen_by_their_conditions():
    rng = np.random.default_rng(4)
    a, w = _fp8_pair(rng, 3, 4, 256)
    st = adder_setup(256, a.block, w.block, HOP)
    r = np.abs(np.asarray(a.dequantize())) * 2.0**-9
    assert adder_form(a, w, st, None)[0] == "exact"
    form, r_hat = adder_form(a, w, st, r)
    assert form == "steps" and np.all(r_hat >= r)
    r[1, 5] = np.nan
    assert adder_form(a, w, st, r)[0] == "scaled"
    am = as_operand(quantize(rng.standard_normal((3, 256)).astype(np.float32), mxfp4()))
    st_m = adder_setup(256, am.block, w.block, HOP)
    assert adder_form(am, w, st_m, np.abs(np.asarray(am.dequantize())) * 2.0**-9)[0] == "scaled"


def test_steps_form_step_sums_are_exact_sums_of_element_values():
    """The steps form's step sums are the exact sums of the element products (and of ``r^ |w|``), rationals."""
    rng = np.random.default_rng(5)
    a, w = _fp8_pair(rng, 2, 3, 128)
    r = np.abs(np.asarray(a.dequantize())) * 2.0**-9
    op = adder_operands(a, w, HOP, r)
    assert op.form == "steps"
    t_s, t_d = adder_step_sums(op, 0, 2)
    av, wv = np.asarray(a.values, dtype=np.float64), np.asarray(w.values, dtype=np.float64)
    rh = exact_radius(r, w)
    for i in range(2):
        for n in range(3):
            for j in range(4):
                cols = range(32 * j, 32 * j + 32)
                assert Fraction(float(t_s[i, n, 0, j])) == sum(Fraction(float(av[i, c])) * Fraction(float(wv[n, c]))
                                                               for c in cols)
                assert Fraction(float(t_d[i, n, 0, j])) == sum(Fraction(float(rh[i, c])) * Fraction(abs(float(wv[n, c])))
                                                               for c in cols)


@pytest.mark.parametrize("seed", range(4))
def test_steps_form_within_rounding_of_the_column_order_form(seed, monkeypatch):
    """The steps form changes how ``|S_j|`` and the radius's sums are rounded (once instead of once a column) and
    rounds the radius up by at most 2^-27 of the chunk's largest: against the scaled (column-order) form of the same
    operands the bound moves by less than 1e-9 relative, and never down by more than that."""
    import moeref.compare.aligned_adder as aa  # where adder_operands looks up adder_form

    rng = np.random.default_rng(seed)
    a, w = _fp8_pair(rng, 3, 5, 256)
    r = np.abs(np.asarray(a.dequantize())) * 2.0**-9 * rng.random((3, 256))
    new = gemm_error_bound(a, w, HOP, a_radius=r)
    monkeypatch.setattr(aa, "adder_form", lambda *args: ("scaled", None))
    old = gemm_error_bound(a, w, HOP, a_radius=r)
    assert not np.array_equal(new, old)  # the forms are different computations
    assert np.all(np.abs(new - old) <= 1e-9 * old)
