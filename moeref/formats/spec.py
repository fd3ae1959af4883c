"""Element formats as data: one :class:`ElementFormat` per format, one registry, no per-format code.

A minifloat is described by its exponent bits, mantissa bits, bias, whether it has a sign bit, and
its special-value policy (``specials``):

``"ieee"``   all-ones exponent is Inf (mantissa 0) or NaN (E5M2, OFP8 "E5M2").
``"fn"``     finite + NaN: only S.1111.111 is NaN, the rest of the top binade is finite
             (E4M3FN, OFP8 "E4M3"; UE4M3 is its unsigned use as an NVFP4 block scale).
``"fnuz"``   finite + NaN, unsigned zero: 0x80 is the only NaN, there is no -0 and no Inf
             (AMD E4M3FNUZ/E5M2FNUZ, as ml_dtypes and torch define them).
``"none"``   every code is a finite number (E2M1, E2M3, E3M2: OCP MX v1.0 elements).
``"e8m0"``   exponent only, unsigned, no zero, 0xFF is NaN (OCP MX v1.0 §5.4.1 scale).

Integers (INT8, INT4 signed two's complement; UINT8, UINT4 unsigned, used with a zero point) use
``kind="int"``. Codes of every format are unsigned bit patterns held in ``uint8``.

Constants are derived from the fields, and checked against ml_dtypes/torch decoders by the tests
(``tests/test_formats.py``; the values are those of the OCP 8-bit floating point
specification (OFP8) and OCP MX v1.0 tables).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ElementFormat", "FORMATS", "get_format", "format_names"]

SPECIALS = ("ieee", "fn", "fnuz", "none", "e8m0")


@dataclass(frozen=True)
class ElementFormat:
    """Parameters of one element format.

    Attributes:
        name: registry key (``"e4m3fn"``, ``"e2m1"``, ``"int4"`` ...).
        kind: ``"float"`` or ``"int"``.
        bits: storage width of one code.
        exp_bits, man_bits, bias: minifloat fields (0 for integers).
        signed: whether the top bit is a sign bit.
        specials: special-value policy, see the module docstring (``"int"`` for integers).
        aliases: other names it is known by (ml_dtypes, torch, OCP).
        description: one line for tables.
    """

    name: str
    kind: str
    bits: int
    exp_bits: int = 0
    man_bits: int = 0
    bias: int = 0
    signed: bool = True
    specials: str = "none"
    aliases: tuple[str, ...] = ()
    description: str = ""
    ml_dtypes_name: str | None = None
    torch_name: str | None = None
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived constants -------------------------------------------------------------------
    @property
    def num_codes(self) -> int:
        return 1 << self.bits

    @property
    def sign_mask(self) -> int:
        return (1 << (self.bits - 1)) if self.signed else 0

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade (unbiased)."""
        if self.specials == "e8m0":
            return -self.bias
        return 1 - self.bias

    @property
    def max_exp_field(self) -> int:
        """Largest exponent field that holds finite normal numbers.

        IEEE-like formats reserve the all-ones field for Inf/NaN; so does E8M0, whose 0xFF is NaN
        (its largest value is 0xFE = 2^127).
        """
        top = (1 << self.exp_bits) - 1
        return top - 1 if self.specials in ("ieee", "e8m0") else top

    @property
    def emax(self) -> int:
        return self.max_exp_field - self.bias

    @property
    def max_man_at_emax(self) -> int:
        """Largest mantissa field that is finite in the top finite binade."""
        full = (1 << self.man_bits) - 1
        if self.specials == "fn":
            return full - 1  # S.1111.111 is NaN
        return full

    @property
    def max_code(self) -> int:
        """Positive code of the largest finite value."""
        if self.kind == "int":
            return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1
        if self.specials == "e8m0":
            return 0xFE
        return (self.max_exp_field << self.man_bits) | self.max_man_at_emax

    @property
    def max_finite(self) -> float:
        if self.kind == "int":
            return float(self.max_code)
        return _code_magnitude(self, self.max_code)

    @property
    def min_value(self) -> float:
        """Most negative finite value (0 or smallest positive for unsigned formats)."""
        if self.kind == "int":
            return float(-(1 << (self.bits - 1))) if self.signed else 0.0
        if not self.signed:
            return self.min_normal if self.specials == "e8m0" else 0.0
        return -self.max_finite

    @property
    def min_normal(self) -> float:
        if self.kind == "int":
            return 1.0
        return 2.0 ** self.emin

    @property
    def min_subnormal(self) -> float | None:
        if self.kind == "int":
            return 1.0
        if self.specials == "e8m0" or self.man_bits == 0:
            return None
        return 2.0 ** (self.emin - self.man_bits)

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.specials in ("ieee", "fn", "fnuz", "e8m0")

    @property
    def has_negative_zero(self) -> bool:
        return self.kind == "float" and self.signed and self.specials != "fnuz"

    @property
    def nan_code(self) -> int | None:
        """Canonical positive NaN code (what encode produces for +NaN)."""
        if self.specials == "ieee":
            return (((1 << self.exp_bits) - 1) << self.man_bits) | (1 << (self.man_bits - 1))
        if self.specials == "fn":
            return (1 << (self.bits - 1 if self.signed else self.bits)) - 1
        if self.specials == "fnuz":
            return 1 << (self.bits - 1)
        if self.specials == "e8m0":
            return 0xFF
        return None

    @property
    def inf_code(self) -> int | None:
        if self.specials == "ieee":
            return ((1 << self.exp_bits) - 1) << self.man_bits
        return None

    def specials_text(self) -> str:
        """Human description of special values (for tables and docs)."""
        if self.kind == "int":
            lo, hi = int(self.min_value), int(self.max_finite)
            return f"integers {lo}..{hi}; no Inf, no NaN"
        s = {
            "ieee": "Inf = S.11..1.00, NaN = S.11..1.xx (xx != 0), -0",
            "fn": "no Inf; NaN = S.1111.111 only; -0",
            "fnuz": "no Inf; NaN = 0x80 only (the -0 code); no -0",
            "none": "no Inf, no NaN; -0 exists",
            "e8m0": "unsigned, no zero; 0x00 = 2^-127, 0xFF = NaN",
        }[self.specials]
        if not self.signed and self.specials == "fn":
            s = "unsigned (sign bit must be 0); no Inf; NaN = 0x7F"
        return s


def _code_magnitude(fmt: ElementFormat, code: int) -> float:
    """Magnitude of a non-special positive code, from the fields (independent of the codec)."""
    e = code >> fmt.man_bits
    m = code & ((1 << fmt.man_bits) - 1)
    if fmt.specials == "e8m0":
        return 2.0 ** (e - fmt.bias)
    if e == 0:
        return m * 2.0 ** (fmt.emin - fmt.man_bits)
    return (1 + m / (1 << fmt.man_bits)) * 2.0 ** (e - fmt.bias)


def _f(name, e, m, bias, specials, *, signed=True, aliases=(), desc="", ml=None, torch=None):
    return ElementFormat(
        name=name, kind="float", bits=e + m + (1 if signed else 0), exp_bits=e, man_bits=m,
        bias=bias, signed=signed, specials=specials, aliases=aliases, description=desc,
        ml_dtypes_name=ml, torch_name=torch,
    )


def _i(name, bits, signed, desc, ml=None, torch=None):
    return ElementFormat(name=name, kind="int", bits=bits, signed=signed, specials="int",
                         description=desc, ml_dtypes_name=ml, torch_name=torch)


FORMATS: dict[str, ElementFormat] = {
    f.name: f
    for f in (
        _f("e4m3fn", 4, 3, 7, "fn", aliases=("e4m3", "fp8_e4m3", "float8_e4m3fn"),
           desc="OFP8 E4M3 (FP8 weights/activations)", ml="float8_e4m3fn", torch="float8_e4m3fn"),
        _f("e5m2", 5, 2, 15, "ieee", aliases=("fp8_e5m2", "float8_e5m2"),
           desc="OFP8 E5M2 (FP8 gradients)", ml="float8_e5m2", torch="float8_e5m2"),
        _f("e2m1", 2, 1, 1, "none", aliases=("fp4", "fp4_e2m1", "float4_e2m1fn", "e2m1fn"),
           desc="FP4 element of MXFP4/NVFP4", ml="float4_e2m1fn", torch=None),
        _f("e2m3", 2, 3, 1, "none", aliases=("fp6_e2m3", "float6_e2m3fn"),
           desc="FP6 element of MXFP6", ml="float6_e2m3fn"),
        _f("e3m2", 3, 2, 3, "none", aliases=("fp6_e3m2", "float6_e3m2fn"),
           desc="FP6 element of MXFP6", ml="float6_e3m2fn"),
        _f("e8m0", 8, 0, 127, "e8m0", signed=False, aliases=("ue8m0", "float8_e8m0fnu"),
           desc="MX block scale (power of two)", ml="float8_e8m0fnu", torch="float8_e8m0fnu"),
        _f("ue4m3", 4, 3, 7, "fn", signed=False, aliases=("e4m3_scale",),
           desc="NVFP4 block scale (E4M3, sign unused)"),
        _f("e4m3fnuz", 4, 3, 8, "fnuz", aliases=("float8_e4m3fnuz",),
           desc="AMD FP8 E4M3 (MI300)", ml="float8_e4m3fnuz", torch="float8_e4m3fnuz"),
        _f("e5m2fnuz", 5, 2, 16, "fnuz", aliases=("float8_e5m2fnuz",),
           desc="AMD FP8 E5M2 (MI300)", ml="float8_e5m2fnuz", torch="float8_e5m2fnuz"),
        _i("int8", 8, True, "signed 8-bit integer", ml="int8", torch="int8"),
        _i("int4", 4, True, "signed 4-bit integer (W4A16/W4A8 weights)", ml="int4"),
        _i("uint8", 8, False, "unsigned 8-bit integer (with zero point)", ml="uint8", torch="uint8"),
        _i("uint4", 4, False, "unsigned 4-bit integer (with zero point)", ml="uint4"),
    )
}

_ALIASES = {a: f.name for f in FORMATS.values() for a in f.aliases}


def format_names() -> list[str]:
    return list(FORMATS)


def get_format(fmt) -> ElementFormat:
    """Look a format up by name or alias (case-insensitive); pass an ElementFormat through.

    >>> get_format("E4M3FN").max_finite
    448.0
    >>> get_format("fp4").name
    'e2m1'
    """
    if isinstance(fmt, ElementFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a name or ElementFormat; got {type(fmt).__name__}")
    key = fmt.lower()
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise ValueError(
            f"unknown element format {fmt!r}; accepted: {', '.join(FORMATS)} "
            f"(aliases: {', '.join(sorted(_ALIASES))})"
        )
    return FORMATS[key]
