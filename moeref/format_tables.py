"""Tables for ``moeref formats [NAME]`` and the demo: element format parameters, every value of the
small formats, and one value walked through encode and decode.

The numbers all come from :mod:`moeref.formats` (``ElementFormat`` fields, ``decode_table``,
``representable_values``, ``encode``); this module only arranges them. Plain-data functions
(:func:`parameter_rows`, :func:`value_rows`, :func:`walk_value_steps`) return lists of strings so
that they can be tested and doctested; the ``rich`` functions (:func:`formats_overview`,
:func:`format_detail`, :func:`walk_value`) wrap them in tables (``rich`` is in the ``cli`` extra).

>>> [r["max"] for r in parameter_rows(["e4m3fn", "e2m1"])]
['448', '6']
>>> value_rows("e2m1")[5]
{'code': '0x5', 'bits': '0.10.1', 'value': '3', 'class': 'normal'}
"""
from __future__ import annotations

import numpy as np

from .formats import FORMATS, decode, decode_table, encode, get_format, representable_values
from .formats.spec import ElementFormat

__all__ = [
    "parameter_rows",
    "value_rows",
    "walk_value_steps",
    "formats_overview",
    "format_detail",
    "walk_value",
]

MAX_LISTED_BITS = 6  # formats this narrow get every value listed


def _num(v) -> str:
    """Short exact-looking text for a format value: powers of two as 2^k when far from 1."""
    if v is None:
        return "-"
    v = float(v)
    if np.isnan(v):
        return "NaN"
    if np.isinf(v):
        return "-Inf" if v < 0 else "Inf"
    if v != 0 and (abs(v) >= 2.0**16 or abs(v) < 2.0**-4):
        m, e = np.frexp(abs(v))
        if m == 0.5:
            return f"{'-' if v < 0 else ''}2^{int(e) - 1}"
        if abs(v) >= 2.0**16 or abs(v) < 2.0**-10:
            return f"{v:.6g}"
    return f"{v:.10g}"


def code_bits(fmt, code: int) -> str:
    """A code's bits grouped as sign.exponent.mantissa (``'0.0110.011'`` for E4M3FN 0x33).

    >>> code_bits("e4m3fn", 0x33), code_bits("e8m0", 0x86), code_bits("int4", 0xF)
    ('0.0110.011', '10000110', '1111')
    """
    f = get_format(fmt)
    b = format(int(code), f"0{f.bits}b")
    if f.kind == "int" or f.man_bits == 0 and not f.signed:
        return b
    parts = []
    if f.signed:
        parts.append(b[0])
        b = b[1:]
    parts.append(b[: f.exp_bits])
    if f.man_bits:
        parts.append(b[f.exp_bits:])
    return ".".join(parts)


def _layout(f: ElementFormat) -> str:
    if f.kind == "int":
        return f"{'S+' if f.signed else ''}{f.bits - (1 if f.signed else 0)} int"
    return f"{'1' if f.signed else '0'}/{f.exp_bits}/{f.man_bits}"


def parameter_rows(names=None) -> list[dict]:
    """One dict of display strings per format: name, layout (S/E/M), bits, bias, max, min normal,
    min subnormal, specials, aliases. ``names`` defaults to every format in ``FORMATS``."""
    rows = []
    for name in names or list(FORMATS):
        f = get_format(name)
        rows.append({
            "name": f.name,
            "layout": _layout(f),
            "bits": str(f.bits),
            "bias": str(f.bias) if f.kind == "float" else "-",
            "max": _num(f.max_finite),
            "min normal": _num(f.min_normal) if f.kind == "float" else "-",
            "min subnormal": _num(f.min_subnormal) if f.kind == "float" else "-",
            "specials": f.specials_text(),
            "aliases": ", ".join(f.aliases) or "-",
        })
    return rows


def _value_class(f: ElementFormat, code: int, v: float) -> str:
    if np.isnan(v):
        return "NaN"
    if np.isinf(v):
        return "Inf"
    if f.kind == "int":
        return "integer"
    if v == 0:
        return "zero" if not np.signbit(v) else "negative zero"
    if f.specials == "e8m0":
        return "power of two"
    e_field = (code & ~f.sign_mask) >> f.man_bits
    return "subnormal" if e_field == 0 else "normal"


def value_rows(fmt) -> list[dict]:
    """Every code of a format of at most 6 bits: code (hex), bits (S.E.M), value, class."""
    f = get_format(fmt)
    if f.bits > MAX_LISTED_BITS:
        raise ValueError(f"value_rows lists formats of at most {MAX_LISTED_BITS} bits; "
                         f"{f.name} has {f.bits} (use parameter_rows)")
    vals = decode_table(f)
    width = (f.bits + 3) // 4
    return [{"code": f"0x{c:0{width}X}".replace("0X", "0x"), "bits": code_bits(f, c),
             "value": _num(vals[c]), "class": _value_class(f, c, float(vals[c]))}
            for c in range(f.num_codes)]


def walk_value_steps(x: float, fmt, *, overflow: str = "saturate", rounding: str = "rne",
                     dtype=np.float32) -> list[tuple[str, str]]:
    """Explain how one number is encoded and decoded, as (step, explanation) pairs.

    The neighbours come from :func:`representable_values`, the code from :func:`encode` (which is
    authoritative; this function only narrates), the value back from :func:`decode`.

    >>> for step, text in walk_value_steps(0.3, "e4m3fn"): print(f"{step}: {text}")
    input: 0.3 as float32 = 0.30000001192092896
    binade: 2^-2 <= |x| < 2^-1; with 3 mantissa bit(s) the step here is 2^-2 / 2^3 = 2^-5
    neighbours: 0.28125 <= |x| <= 0.3125; |x| is 0.6 of the way from the lower one
    rounding: rne picks 0.3125 (nearer)
    code: 0x2a = 0.0101.010 (sign 0, exponent field 5 -> 2^(5-7), mantissa 2 -> 1 + 2/8)
    decode: 0.3125 (error +0.0125, relative +0.0417)
    """
    f = get_format(fmt)
    xv = np.asarray([x], dtype=dtype)
    x64 = float(xv.astype(np.float64)[0])
    steps = [("input", f"{x!r} as {np.dtype(dtype).name} = {x64!r}")]
    code = int(encode(xv, f, overflow=overflow, rounding=rounding)[0])
    back = float(decode(np.array([code], np.uint8), f, np.float64)[0])
    a = abs(x64)
    if np.isfinite(x64):
        grid = representable_values(f)
        grid = grid[grid >= 0]
        j = int(np.searchsorted(grid, a, side="left"))
        if j >= len(grid):
            steps.append(("range", f"|x| = {_num(a)} is above the largest value {_num(grid[-1])}: "
                                   f"overflow={overflow!r} decides"))
        else:
            hi = float(grid[j])
            lo = hi if hi == a else float(grid[max(j - 1, 0)])
            if f.kind == "float" and a > 0:
                e = int(np.frexp(a)[1]) - 1
                eq = max(e, f.emin)
                q = 2.0 ** (eq - f.man_bits)
                where = (f"2^{e} <= |x| < 2^{e + 1}" if e >= f.emin
                         else f"|x| < 2^{f.emin}, the subnormal range")
                steps.append(("binade", f"{where}; with {f.man_bits} mantissa bit(s) the step "
                                        f"here is 2^{eq} / 2^{f.man_bits} = {_num(q)}"))
            if lo == hi:
                steps.append(("neighbours", f"|x| = {_num(a)} is representable"))
            else:
                t = (a - lo) / (hi - lo)
                steps.append(("neighbours", f"{_num(lo)} <= |x| <= {_num(hi)}; |x| is {t:.4g} of the "
                                            "way from the lower one"))
                picked = abs(back)
                why = {"rne": "nearer" if t != 0.5 else "a tie: the even code",
                       "ties_toward_zero": "nearer" if t != 0.5 else "a tie: toward zero",
                       "ties_away": "nearer" if t != 0.5 else "a tie: away from zero",
                       "rtz": "toward zero", "ceil": "toward +Inf", "floor": "toward -Inf",
                       }.get(rounding, rounding)
                steps.append(("rounding", f"{rounding} picks {_num(picked)} ({why})"))
    else:
        steps.append(("special", f"{x64!r} is not finite: see the format's specials ({f.specials_text()})"))
    bits = code_bits(f, code)
    detail = ""
    if f.kind == "float" and not np.isnan(back) and not np.isinf(back):
        mag = code & ~f.sign_mask
        ef, mf = mag >> f.man_bits, mag & ((1 << f.man_bits) - 1)
        sign = f"sign {code >> (f.bits - 1)}, " if f.signed else ""
        if f.specials == "e8m0":
            detail = f" (exponent field {ef} -> 2^({ef}-{f.bias}))"
        elif ef == 0:
            detail = (f" ({sign}exponent field 0: subnormal, {mf}/{1 << f.man_bits} x 2^{f.emin})")
        else:
            detail = (f" ({sign}exponent field {ef} -> 2^({ef}-{f.bias}), mantissa {mf} -> "
                      f"1 + {mf}/{1 << f.man_bits})")
    width = (f.bits + 3) // 4
    steps.append(("code", f"0x{code:0{width}x} = {bits}{detail}"))
    if np.isfinite(back) and np.isfinite(x64):
        err = back - x64
        rel = f", relative {err / x64:+.3g}" if x64 != 0 else ""
        steps.append(("decode", f"{_num(back)} (" + (f"error {err:+.6g}{rel})" if err else "exact)")))
    else:
        steps.append(("decode", _num(back)))
    return steps


# ---- rich renderables (the cli extra) ----------------------------------------------------------
def _table(title: str, columns: list[str], rows: list[list[str]]):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c in ("bits", "bias", "code", "value") else "left")
    for r in rows:
        t.add_row(*r)
    return t


def formats_overview(names=None):
    """rich renderable of every format's parameters (``moeref formats``): one table, or where that
    is wider than the console (80 columns), the numbers and the specials in two tables."""
    from rich.console import Group

    from ._console import Fit

    rows = parameter_rows(names)
    title = "Element formats (layout = sign/exponent/mantissa bits)"
    cols = ["name", "layout", "bits", "bias", "max", "min normal", "min subnormal", "specials"]
    wide = _table(title, cols, [[r[c] for c in cols] for r in rows])
    nums = cols[:-1]
    narrow = Group(_table(title, nums, [[r[c] for c in nums] for r in rows]),
                   _table("Special values (S = sign bit)", ["name", "specials"],
                          [[r["name"], r["specials"]] for r in rows]))
    return Fit(wide, narrow)


def format_detail(fmt):
    """rich Group for ``moeref formats NAME``: the parameters, and every value if <= 6 bits."""
    from rich.console import Group
    from rich.text import Text

    f = get_format(fmt)
    r = parameter_rows([f.name])[0]
    params = _table(f"{f.name}: {f.description}", ["parameter", "value"],
                    [[k, v] for k, v in r.items() if k != "name"])
    if f.bits <= MAX_LISTED_BITS:
        rows = value_rows(f)
        values = _table(f"Every {f.name} code", ["code", "bits", "value", "class"],
                        [[v["code"], v["bits"], v["value"], v["class"]] for v in rows])
        return Group(params, values)
    note = Text(f"{f.num_codes} codes; list them with moeref.formats.decode_table({f.name!r}).")
    return Group(params, note)


def walk_value(x: float, fmt, *, overflow: str = "saturate", rounding: str = "rne", dtype=np.float32):
    """rich Table of :func:`walk_value_steps` (the demo's "one value through encode and decode")."""
    f = get_format(fmt)
    steps = walk_value_steps(x, f, overflow=overflow, rounding=rounding, dtype=dtype)
    return _table(f"{x!r} -> {f.name} (rounding={rounding}, overflow={overflow})",
                  ["step", "what happens"], [list(s) for s in steps])
