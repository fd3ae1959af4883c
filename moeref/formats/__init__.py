"""Element formats: FP8 (E4M3FN, E5M2, FNUZ), FP6, FP4 (E2M1), E8M0, UE4M3, INT8/INT4.

``encode``/``decode`` are bit-exact and share one generic minifloat codec; ``pack_nibbles`` and
friends pack 4-bit codes. See docs/formats.md for the teaching version.
"""
from .spec import ElementFormat, FORMATS, get_format, format_names
from .codec import (
    ROUNDING_MODES,
    OVERFLOW_MODES,
    encode,
    decode,
    decode_table,
    round_to_format,
    representable_values,
)
from .packing import pack_nibbles, unpack_nibbles, pack_int4_to_int32, unpack_int4_from_int32

__all__ = [
    "ElementFormat", "FORMATS", "get_format", "format_names",
    "ROUNDING_MODES", "OVERFLOW_MODES", "encode", "decode", "decode_table", "round_to_format",
    "representable_values", "pack_nibbles", "unpack_nibbles", "pack_int4_to_int32",
    "unpack_int4_from_int32",
]
