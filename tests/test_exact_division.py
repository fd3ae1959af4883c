"""The one-step FMA division of :func:`fastpath.quant._jit_codes._div_exact` gives the codes of
``RN(x / s)``.

The kernel divides each element by its group's float32 scale ``s`` as

    r = RN(1 / s)           (per group)
    q0 = RN(x r)
    q1 = RN(q0 + RN(x - s q0) r)     (two FMAs)

and encodes ``q1`` where the reference encodes the correctly rounded quotient ``RN(x / s)``.
(With the NaN-block policy the kernel forms ``RN(q0 + RN(s q0 - x) (-r))`` instead: the same
values, since RN is symmetric, but a zero x keeps its sign; ``_div_exact``'s docstring.)
The argument (also in ``_div_exact``'s docstring), checked here in exact rational arithmetic:

1. ``q1 = RN(x/s + eta)`` with ``|eta| < 2^-22 ulp(x/s)``, so ``q1 != RN(x/s)`` needs ``x/s``
   within ``2^-22`` ulp of a float32 midpoint ``T`` (never on it: ``T`` has a 25-bit odd
   significand, a quotient of 24-bit floats cannot equal it).
2. The two candidates are then adjacent float32 values; their codes differ only if one of them
   is a rounding boundary of the element format, and every boundary of a format with <= 3
   mantissa bits (midpoints between codes, subnormal ones, the overflow threshold, and, for the
   directed modes, the codes themselves) has at most 5 significant bits. So ``T`` is one of 32
   significand patterns.
3. With ``s = S 2^a`` (``2^23 <= S < 2^24``), ``T = N 2^b`` (``N`` odd in ``[2^24, 2^25)``) and
   ``x = X 2^c``, "within 2^-22 ulp" means ``X 2^k - S N = delta``, ``0 < |delta| < 8``, for an
   integer ``k``; since ``N`` is odd, ``S = -delta N^-1 mod 2^k``: a finite list.
4. Every entry of the list is simulated exactly; ``q1 == RN(x/s)`` for all of them.

The arithmetic is scale-invariant inside the kernel's window (every intermediate a normal
float32), so the list covers every exponent. The Triton helper itself is tested against the
reference's division in property_tests/test_fastpath_rounding.py (interpreter on CPU, hardware
FMA on the GPU).
"""
from __future__ import annotations

from fractions import Fraction

import pytest


def rn32(q: Fraction) -> Fraction:
    """``q`` rounded to the nearest float32, ties to even (normal range), exactly."""
    if q == 0:
        return Fraction(0)
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    n = a / Fraction(2) ** (e - 23)
    fl = n.numerator // n.denominator
    rem = n - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    return sign * fl * Fraction(2) ** (e - 23)


def one_step_quotient(x: Fraction, s: Fraction) -> Fraction:
    """The kernel's sequence on exact float32 inputs (every operation rounded once)."""
    r = rn32(1 / s)
    q0 = rn32(x * r)
    rem = rn32(x - s * q0)
    return rn32(q0 + rem * r)


def boundary_midpoints() -> list[int]:
    """Odd 25-bit significands N of the float32 midpoints adjacent to a value with <= 5 bits."""
    out = set()
    for nb in range(1, 32, 2):
        b = Fraction(nb)
        e = nb.bit_length() - 1
        up = Fraction(2) ** (e - 23)
        down = up / 2 if nb == 1 << e else up
        for t in (b + up / 2, b - down / 2):
            while t < 1 << 24:
                t *= 2
            while t >= 1 << 25:
                t /= 2
            assert t.denominator == 1 and t.numerator % 2 == 1
            out.add(t.numerator)
    return sorted(out)


def near_boundary_cases(x_bits: int, delta_max: int = 7):
    """Every (S, N, X, k) with ``X 2^k - S N = delta``, ``0 < |delta| <= delta_max``, S a 24-bit
    float32 significand and X (odd part) below ``2^x_bits``."""
    cases = []
    for n in boundary_midpoints():
        for k in range(20, 52):
            mod = 1 << k
            inv = pow(n, -1, mod)
            for delta in range(-delta_max, delta_max + 1):
                if delta == 0:
                    continue
                for S in range((-delta * inv) % mod, 1 << 24, mod):
                    if S < 1 << 23:
                        continue
                    X = (S * n + delta) >> k
                    odd = X
                    while odd and odd % 2 == 0:
                        odd //= 2
                    if 0 < odd < 1 << x_bits:
                        cases.append((S, n, X, k))
    return cases


def test_midpoint_patterns():
    pats = boundary_midpoints()
    assert len(pats) == 32 and all((1 << 24) <= p < (1 << 25) and p % 2 for p in pats)
    # 1.0625 = 17/16, an E4M3 midpoint: 17 * 2^20 +- 1 are in the list
    assert 17 * 2**20 + 1 in pats and 17 * 2**20 - 1 in pats


@pytest.mark.parametrize("x_bits", [8, 11, 24])
def test_one_step_division_is_exact_next_to_every_boundary(x_bits):
    """bfloat16 (8), float16 (11) and float32 (24) inputs: no near-boundary quotient is missed."""
    cases = near_boundary_cases(x_bits)
    assert len(cases) > 0  # the search is not vacuous
    for S, n, X, k in cases:
        s = Fraction(S, 1 << 23)
        x = Fraction(X) * Fraction(2) ** (k - 47)  # x/s close to T = n 2^-24, in [1, 2)
        assert abs(x / s - Fraction(n, 1 << 24)) < Fraction(8, 1 << 47)
        assert one_step_quotient(x, s) == rn32(x / s), (S, n, X, k)
