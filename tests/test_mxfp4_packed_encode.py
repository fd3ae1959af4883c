"""The packed bf16x2 MXFP4 encode (:mod:`fastpath._packed_fp4`), proven on the CPU by emulating its
exact PTX text, instruction by instruction, in NumPy.

The emulator (:func:`run_ptx`) parses :data:`fastpath._packed_fp4.ENCODE_E2M1X4_PTX` (the string
the kernel hands to ``tl.inline_asm_elementwise``, four words per call) and executes each
instruction on uint32 arrays, per the PTX ISA:

* integer ops (``and/or .b32``, ``lop3.b32`` by its truth table, ``prmt.b32`` (default mode)
  by its byte selectors, ``add/sub .u32`` modulo 2^32, ``shl.b32``, ``shr.u32``, ``mov.b32``)
  on the whole 32-bit word, so a carry or borrow between the two 16-bit lanes would show;
* ``mul.rn.bf16x2`` / ``add.rn.bf16x2`` / ``fma.rn.bf16x2`` per lane: the exact float64 result
  rounded once to bfloat16 with RNE by :func:`rn_bf16` (integer significand, ``np.rint`` = ties-to-even, bf16
  subnormals kept, overflow to Inf). The float64 result is exact for a product of two bfloat16
  (16 significant bits, exponents within float64's range); for a sum it may be rounded once to
  53 bits first, which is innocuous: double rounding to p bits through p' >= 2p + 2 bits gives
  the correctly rounded result for + and x (Figueroa, "When is double rounding innocuous?",
  SIGNUM 1995), and 53 >= 18 (the fma's product must itself be a bfloat16 value, which the
  emulator checks, so its sum is such an addition). A NaN result is the canonical bf16 NaN
  0x7FFF (PTX);
* ``min/max{.NaN}.xorsign.abs.bf16x2`` per lane: ``min/max(|a|, |b|)`` with the sign
  ``sign(a) ^ sign(b)``; without ``.NaN`` a single NaN operand yields the other operand, two
  NaNs the canonical NaN; with ``.NaN`` any NaN gives the canonical NaN (PTX ISA, half
  precision ``min``/``max``). Whether the non-NaN operand comes back with the xor-ed sign or its
  own is not spelled out; both are emulated (``nan_sign``) and must give the same non-NaN lanes.

The expected codes come from :func:`moeref.formats.encode` (``e2m1``, ``rne``, ``saturate``) of
the EXACT product ``x * 2^k`` in float64, for every bfloat16 pattern in both lanes (next to
other patterns, NaN and Inf included) and every power-of-two factor bfloat16 can hold,
``2^-133 .. 2^127`` (E8M0 factors are ``2^-127 .. 2^127``, 0, 1 and NaN), plus 0 and 1.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from moeref.formats import encode

P = pytest.importorskip("fastpath._packed_fp4")

U32 = np.uint32
ALL = np.arange(1 << 16, dtype=np.uint32)


# ---------------------------------------------------------------------------------- the emulator

def bf16_value(bits: np.ndarray) -> np.ndarray:
    """float64 value of bfloat16 bit patterns (exact: bf16 -> float32 -> float64 widen)."""
    with np.errstate(invalid="ignore"):
        return (bits.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def rn_bf16(v: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint32) of float64 ``v`` rounded once, to nearest even, subnormals kept
    (quantum 2^-133), overflow to +-Inf, NaN -> canonical 0x7FFF."""
    v = np.asarray(v, np.float64)
    sign = np.signbit(v).astype(U32) << U32(15)
    a = np.abs(v)
    fin = np.isfinite(a)
    af = np.where(fin, a, 0.0)
    _, ex = np.frexp(af)  # af = f * 2^ex, f in [0.5, 1): binade exponent ex - 1
    q = np.maximum(ex - 1 - 7, -133)  # quantum of the binade (8 significant bits)
    n = np.rint(np.ldexp(af, -q))  # exact scaling; rint = round half to even
    r = np.ldexp(n, q)
    r = np.where(r >= 2.0**128, np.inf, r)
    r = np.where(fin, r, a)
    bits = (r.astype(np.float32).view(U32) >> U32(16)) | sign  # r is a bf16 value: exact
    return np.where(np.isnan(v), U32(0x7FFF), bits).astype(U32)


def _lanes(w):
    return w & U32(0xFFFF), w >> U32(16)


def _join(lo, hi):
    return (lo.astype(U32) & U32(0xFFFF)) | (hi.astype(U32) << U32(16))


def _minmax_xorsign(a, b, is_max, nan_op, nan_sign):
    out = []
    for x, y in zip(_lanes(a), _lanes(b)):
        sx, sy = x >> U32(15), y >> U32(15)
        mx, my = x & U32(0x7FFF), y & U32(0x7FFF)
        nx, ny = mx > 0x7F80, my > 0x7F80
        # |x|, |y| are non-negative: compare their patterns (order of the values)
        pick = np.where(is_max, np.maximum(mx, my), np.minimum(mx, my))
        r = pick | ((sx ^ sy) << U32(15))
        if nan_op:
            r = np.where(nx | ny, U32(0x7FFF), r)
        else:
            other_x = y if nan_sign == "own" else (my | ((sx ^ sy) << U32(15)))
            other_y = x if nan_sign == "own" else (mx | ((sx ^ sy) << U32(15)))
            r = np.where(nx & ~ny, other_x, r)
            r = np.where(ny & ~nx, other_y, r)
            r = np.where(nx & ny, U32(0x7FFF), r)
        out.append(r)
    return _join(*out)


def _bf16_arith(a, b, op):
    out = []
    for x, y in zip(_lanes(a), _lanes(b)):
        vx, vy = bf16_value(x), bf16_value(y)
        with np.errstate(invalid="ignore", over="ignore"):
            out.append(rn_bf16(vx * vy if op == "mul" else vx + vy))
    return _join(*out)


def _bf16_fma(a, b, c):
    """RN(a * b + c) per lane. The product of two bfloat16 is exact in float64; this emulator
    only accepts products that are bfloat16 values themselves (in the encode: +-2^k * 64), so
    the sum is an addition of two bfloat16, rounded exactly as in _bf16_arith."""
    out = []
    for x, y, z in zip(_lanes(a), _lanes(b), _lanes(c)):
        with np.errstate(invalid="ignore", over="ignore"):
            prod = bf16_value(x) * bf16_value(y)
            fin = np.isfinite(prod)
            assert np.array_equal(bf16_value(rn_bf16(prod))[fin], prod[fin]), \
                "fma product is not a bfloat16 value: the emulator does not model that case"
            out.append(rn_bf16(prod + bf16_value(z)))
    return _join(*out)


_INSN = re.compile(r"^([A-Za-z0-9.]+)\s+(.*);$")


def _minmax_xorsign_f32(a, b, is_max, nan_op, nan_sign):
    """``min/max{.NaN}.xorsign.abs.f32``: as the bf16x2 form, on one 32-bit lane."""
    a, b = np.broadcast_arrays(np.asarray(a, U32), np.asarray(b, U32))
    sx, sy = a >> U32(31), b >> U32(31)
    mx, my = a & U32(0x7FFFFFFF), b & U32(0x7FFFFFFF)
    nx, ny = mx > 0x7F800000, my > 0x7F800000
    sg = (sx ^ sy) << U32(31)
    r = np.where(is_max, np.maximum(mx, my), np.minimum(mx, my)) | sg
    if nan_op:
        return np.where(nx | ny, U32(0x7FFFFFFF), r).astype(U32)
    other_x = b if nan_sign == "own" else (my | sg)
    other_y = a if nan_sign == "own" else (mx | sg)
    r = np.where(nx & ~ny, other_x, r)
    r = np.where(ny & ~nx, other_y, r)
    return np.where(nx & ny, U32(0x7FFFFFFF), r).astype(U32)


def _f32_fma(a, b, c, nan_bits=0x7FFFFFFF):
    """``fma.rn.f32`` where the product is exact in float64 (here a power of two times 2^22, or
    a value times 1 for ``add``): the float64 sum of two float32 rounded to float32 is the
    correctly rounded sum (double rounding through 53 >= 2 * 24 + 2 bits is innocuous; see the
    module docstring). A NaN result is ``nan_bits`` (PTX gives the canonical 0x7FFFFFFF; the
    tests also try other NaN patterns)."""
    with np.errstate(invalid="ignore", over="ignore"):
        a, b, c = (np.asarray(v, U32).view(np.float32).astype(np.float64) for v in (a, b, c))
        prod = a * b
        fin = np.isfinite(prod)
        assert np.array_equal(prod[fin].astype(np.float32).astype(np.float64), prod[fin]), \
            "fma product is not a float32 value: the emulator does not model that case"
        r = (prod + c).astype(np.float32).view(U32)
    return np.where(np.isnan(prod + c), np.asarray(nan_bits, U32), r).astype(U32)


def run_ptx(text: str, inputs: dict, nan_sign: str = "own", nan_bits=0x7FFFFFFF) -> np.ndarray:
    """Execute the PTX block ``text`` on uint32 arrays; ``inputs`` maps "$1", "$2"... to arrays.
    Returns "$0". Refuses any instruction it does not model. ``nan_bits``: the pattern of a NaN
    float32 arithmetic result (scalar or per element)."""
    regs = {k: np.asarray(v).astype(U32) for k, v in inputs.items()}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("%") or tok.startswith("$"):
            return regs[tok]
        if tok.startswith("0f"):  # PTX float32 immediate: its bit pattern in hex
            return U32(int(tok[2:], 16))
        return U32(int(tok, 0) & 0xFFFFFFFF)

    for line in text.strip().strip("{}").splitlines():
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        m = _INSN.match(line)
        assert m, f"unparsed PTX line {line!r}"
        op, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
        d = args[0]
        s = [val(t) for t in args[1:]]
        if op == "mov.b32":
            r = np.broadcast_to(s[0], np.shape(regs["$1"])).astype(U32)
        elif op == "and.b32":
            r = s[0] & s[1]
        elif op == "or.b32":
            r = s[0] | s[1]
        elif op == "add.u32":
            r = (s[0].astype(np.uint64) + s[1]).astype(U32)  # modulo 2^32
        elif op == "sub.u32":
            r = (s[0].astype(np.int64) - np.int64(s[1]) if np.ndim(s[1]) == 0
                 else s[0].astype(np.int64) - s[1].astype(np.int64)) & 0xFFFFFFFF
            r = r.astype(U32)
        elif op == "shr.u32":
            r = s[0] >> s[1]
        elif op == "shl.b32":
            r = (s[0].astype(np.uint64) << np.uint64(int(s[1]))).astype(U32)
        elif op == "prmt.b32":  # default mode: byte i of d = byte sel_i & 7 of {b, a} (a = 0-3),
            a, b, sel = s[0], s[1], int(s[2])  # sel_i bit 3: replicate that byte's sign bit
            src = np.broadcast_to(a, np.broadcast(a, b).shape).astype(np.uint64) \
                | (np.broadcast_to(b, np.broadcast(a, b).shape).astype(np.uint64) << np.uint64(32))
            r = np.zeros(src.shape, U32)
            for i in range(4):
                nib = sel >> (4 * i) & 0xF
                byte = ((src >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF)).astype(U32)
                if nib & 8:
                    byte = np.where(byte & U32(0x80), U32(0xFF), U32(0))
                r |= byte << U32(8 * i)
        elif op == "lop3.b32":  # bit i of d = bit (4 a_i + 2 b_i + c_i) of the LUT immediate
            a, b, c, lut = s[0], s[1], s[2], int(s[3])
            r = np.zeros(np.broadcast(a, b, c).shape, U32)
            for idx in range(8):
                if lut >> idx & 1:
                    ma = a if idx & 4 else ~a
                    mb = b if idx & 2 else ~b
                    mc = c if idx & 1 else ~c
                    r |= ma & mb & mc
        elif op in ("mul.rn.bf16x2", "add.rn.bf16x2"):
            r = _bf16_arith(s[0], s[1], op.split(".")[0])
        elif op == "fma.rn.bf16x2":
            r = _bf16_fma(s[0], s[1], s[2])
        elif op.endswith(".xorsign.abs.bf16x2") and op.split(".")[0] in ("min", "max"):
            r = _minmax_xorsign(s[0], s[1], op.startswith("max"), ".NaN." in op, nan_sign)
        elif op.endswith(".xorsign.abs.f32") and op.split(".")[0] in ("min", "max"):
            r = _minmax_xorsign_f32(s[0], s[1], op.startswith("max"), ".NaN." in op, nan_sign)
        elif op == "fma.rn.f32":
            r = _f32_fma(s[0], s[1], s[2], nan_bits)
        elif op == "add.rn.f32":
            r = _f32_fma(s[0], U32(0x3F800000), s[1], nan_bits)
        elif op == "min.u32":
            r = np.minimum(s[0], s[1])
        else:
            raise AssertionError(f"PTX op {op!r} is not modelled by the emulator")
        regs[d] = np.asarray(r).astype(U32)
    return regs["$0"]


def encode4(words, f2, mask=None, fill=None, nan_sign="own", text=None):
    """The FP4 byte of each word through the 4-word PTX (words split into the four slots)."""
    w = np.asarray(words, U32)
    n = w.size
    pad = (-n) % 4
    wp = np.concatenate([w, np.zeros(pad, U32)]).reshape(-1, 4)

    def slots(v):
        v = np.broadcast_to(np.asarray(v, U32), (n,))
        return np.concatenate([v, np.zeros(pad, U32)]).reshape(-1, 4)
    fp, mp, vp = slots(f2), slots(0 if mask is None else mask), slots(0 if fill is None else fill)
    ins = {}
    for j in range(4):
        ins[f"${1 + j}"], ins[f"${5 + j}"] = wp[:, j], fp[:, j]
        ins[f"${9 + j}"], ins[f"${13 + j}"] = mp[:, j], vp[:, j]
    out = run_ptx(text or P.ENCODE_E2M1X4_PTX, ins, nan_sign)
    b = (out[:, None] >> (U32(8) * np.arange(4, dtype=U32))[None, :]) & U32(0xFF)
    return b.reshape(-1)[:n]


# ---------------------------------------------------------------------------------- the oracle

def reference_byte(lo_bits, hi_bits, k):
    """FP4 byte per moeref: encode(x * 2^k) of each lane (k None: the factor is 0)."""
    codes = []
    for b in (lo_bits, hi_bits):
        x = bf16_value(b)
        with np.errstate(invalid="ignore"):
            y = x * (0.0 if k is None else np.ldexp(1.0, k))
        codes.append(encode(y, "e2m1", rounding="rne", overflow="saturate", nan_code=0).astype(U32))
    return codes[0] | (codes[1] << U32(4))


def _factor_word(bits16: int) -> np.ndarray:
    return U32(bits16 | (bits16 << 16))


def _pow2_bf16(k: int) -> int:
    """bfloat16 bits of 2^k, k in [-133, 127]."""
    if k >= -126:
        return (k + 127) << 7
    return 1 << (k + 133)


def _words(perm_seed: int):
    """Every pattern in the low lane, and (another order) in the high lane."""
    hi = np.random.default_rng(perm_seed).permutation(ALL).astype(U32)
    return ALL, hi, _join(ALL, hi)


# ---------------------------------------------------------------------------------- the tests

def test_emulator_rounding_matches_ml_dtypes():
    """rn_bf16 equals ml_dtypes' float32 -> bfloat16 cast (RNE) on float32 values, where one
    rounding is all there is, including bf16 subnormals, ties and overflow."""
    rng = np.random.default_rng(1)
    u = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(U32)
    u[:1000] = (np.arange(1000, dtype=U32) << 15) | U32(0x8000)  # exact ties
    x = u.view(np.float32)
    x = x[np.isfinite(x)]
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16).astype(U32)
    got = rn_bf16(x.astype(np.float64))
    assert np.array_equal(got, want)


def test_factor_word_is_exact():
    """bf16x2_factor's rule (float32 bits >> 16, both halves) keeps every E8M0 factor exact."""
    for k in range(-127, 128):
        f32 = np.float32(np.ldexp(1.0, k))
        b = int(f32.view(U32)) >> 16
        assert bf16_value(np.array([b], U32))[0] == np.ldexp(1.0, k)
        assert b == _pow2_bf16(k)


@pytest.mark.parametrize("nan_sign", ["own", "xor"])
def test_packed_encode_exhaustive_every_pattern_every_factor(nan_sign):
    """All 65536 patterns (both lanes) x factors 2^-133..2^127 and 0: the emulated PTX equals moeref's
    encoder on every non-NaN lane (sign, -0 -> 0x8, tiny negatives -> 0x8, saturation, Inf),
    whatever is in the other lane; NaN lanes give a code in {0x7, 0xF} (replaced by the caller)."""
    lo, hi, w = _words(7 if nan_sign == "own" else 8)
    ks = list(range(-133, 128)) + [None]
    bad = 0
    for k in ks:
        # NaN products: NaN x, and Inf * 0 (factor 0 belongs to all-zero blocks: no Inf there)
        nan_lo = (lo & U32(0x7FFF)) >= (0x7F80 if k is None else 0x7F81)
        nan_hi = (hi & U32(0x7FFF)) >= (0x7F80 if k is None else 0x7F81)
        f = _factor_word(0 if k is None else _pow2_bf16(k))
        byte = encode4(w, f, nan_sign=nan_sign)
        want = reference_byte(lo, hi, k)
        ok_lo = ((byte & U32(0xF)) == (want & U32(0xF))) | nan_lo
        ok_hi = ((byte >> U32(4)) == (want >> U32(4))) | nan_hi
        bad += int((~ok_lo).sum() + (~ok_hi).sum())
        assert bad == 0, f"factor 2^{k}: {int((~ok_lo).sum())} low / {int((~ok_hi).sum())} high lanes differ"
        assert (byte[nan_lo] & U32(0x7) == 7).all() and (byte[nan_hi] >> U32(4) & U32(0x7) == 7).all()
    assert bad == 0


def test_packed_encode_hand_values():
    """Hand-derived bytes (OCP E2M1: 0 0.5 1 1.5 2 3 4 6; RNE ties to the even code)."""
    def bf(v):
        return int(np.float32(v).view(U32)) >> 16
    cases = [  # (lo value, hi value, factor exponent, byte)
        (0.25, 0.75, 0, 0x20),     # 0.25 -> 0 (tie, even 0); 0.75 -> 1.0 (tie, even code 2)
        (1.75, 2.5, 0, 0x44),      # 1.75 -> 2 (code 4); 2.5 -> 2 (code 4)
        (3.5, 5.0, 0, 0x66),       # 3.5 -> 4 (code 6); 5 -> 4 (code 6)
        (-0.0, -0.1, 0, 0x88),     # signed zeros
        (7.0, float("-inf"), 0, 0xF7),  # saturation
        (12.0, -1.5, -1, 0xA7),    # 12 * 2^-1 = 6 -> 7; -1.5 * 2^-1 = -0.75 -> tie, code 2 | sign
    ]
    w = np.array([bf(lo) | (bf(hi) << 16) for lo, hi, _, _ in cases], U32)
    f = np.array([_factor_word(_pow2_bf16(k)) for _, _, k, _ in cases], U32)
    got = encode4(w, f)
    assert [hex(int(b)) for b in got] == [hex(b) for _, _, _, b in cases]


def test_packed_encode_subnormal_input_and_factor():
    """bf16 subnormal inputs times 2^127 and normal inputs times the subnormal factor 2^-127 (the
    E8M0 code 254) are exact products: x = 2^-127 * 2^127 = 1.0 -> code 2; 3 * 2^-128 * 2^127 =
    1.5 -> 3; 2^127 * 2^-127 = 1 -> 2."""
    w = np.array([0x0040 | (0x0060 << 16), _pow2_bf16(127) | (0xFF00 << 16)], U32)
    f = np.array([_factor_word(_pow2_bf16(127)), _factor_word(0x0040)], U32)
    assert encode4(w, f).tolist() == [0x32, 0xA2]  # (2^-127, 1.5 * 2^-127) * 2^127; (2^127, -2^127) * 2^-127


def test_packed_encode_overwrite_masks():
    """mask/fill: lanes under a 0xFFFF mask take the fill lane (lanes_of_code(c)), whole words
    under ~0 take it in both lanes, other lanes keep their code; every code c in 0..15."""
    rng = np.random.default_rng(9)
    n = 4096
    w = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(U32)
    f = _factor_word(_pow2_bf16(-100))
    plain = encode4(w, f)
    sel = rng.integers(0, 4, n)  # 0 none, 1 low lane, 2 high lane, 3 both
    mask = np.choose(sel, [U32(0), U32(0xFFFF), U32(0xFFFF0000), U32(0xFFFFFFFF)]).astype(U32)
    codes = rng.integers(0, 16, n)
    fill = np.array([P.lanes_of_code(int(c)) for c in codes], U32) & mask
    got = encode4(w, f, mask, fill)
    want_lo = np.where(sel & 1, codes, plain & 0xF)
    want_hi = np.where(sel & 2, codes, plain >> 4)
    assert np.array_equal(got, (want_lo | (want_hi << 4)).astype(U32))


def test_emulator_rejects_unknown_instructions():
    with pytest.raises(AssertionError, match="not modelled"):
        run_ptx("{\ncvt.rn.f32.f16 $0, $1;\n}", {"$1": np.zeros(1, U32)})


@pytest.mark.parametrize("ignore_nan", [False, True])
def test_amax_combine_emulated(ignore_nan):
    """amax_bf16x2's combine (max{.NaN}.xorsign.abs.bf16x2, any reduction order) then the
    final lane step equals the integer amax of |x| over 32-element blocks: NaN if any NaN (NaN
    policy) or NaN left out (ignore_nan; all-NaN -> 0), subnormal-only blocks kept exact."""
    rng = np.random.default_rng(3)
    nblk = 4096
    x = rng.choice(ALL, size=(nblk, 32)).astype(U32)
    x[: 256] = rng.integers(0, 0x80, size=(256, 32)) | (rng.integers(0, 2, (256, 32)) << 15)  # subnormals
    x[256:512] = np.where(rng.random((256, 32)) < 0.9, 0x7FC1, x[256:512])  # mostly NaN
    x[512:520] = 0xFFC0  # all NaN
    x[520:600] = np.where(rng.random((80, 32)) < 0.5, 0x7F80 | (rng.integers(0, 2, (80, 32)) << 15),
                          x[520:600])  # Inf
    words = _join(x[:, 0::2], x[:, 1::2])  # [nblk, 16]
    op = "max.xorsign.abs.bf16x2 $0, $1, $2;" if ignore_nan else "max.NaN.xorsign.abs.bf16x2 $0, $1, $2;"
    assert op.split()[0] in (P._MAX_ABS_PTX if ignore_nan else P._MAX_ABS_NAN_PTX)
    # a reduction tree in a shuffled order: pairwise combine of a random permutation
    acc = words[:, rng.permutation(16)]
    while acc.shape[1] > 1:
        acc = run_ptx("{\n" + op + "\n}", {"$1": acc[:, 0::2], "$2": acc[:, 1::2]})
    r = acc[:, 0] & U32(0x7FFF7FFF)
    lo, hi = r & U32(0xFFFF), r >> U32(16)
    if ignore_nan:
        lo = np.where(lo > 0x7F80, 0, lo)
        hi = np.where(hi > 0x7F80, 0, hi)
    got = np.maximum(lo, hi).astype(U32)
    a = x & U32(0x7FFF)
    if ignore_nan:
        want = np.where(a > 0x7F80, 0, a).max(axis=1)
        assert np.array_equal(got, want)
    else:
        has_nan = (a > 0x7F80).any(axis=1)
        assert np.array_equal(got > 0x7F80, has_nan)
        assert np.array_equal(got[~has_nan], a.max(axis=1)[~has_nan])


def test_packed_path_selection():
    """PACKED_BF16 is on only for E2M1 + E8M0 + RNE + signed zeros kept, single level, with the
    hardware paths on and outside Triton's interpreter (which cannot run inline PTX)."""
    QP = pytest.importorskip("fastpath.quant._preset_map")
    from moeref.quant import mxfp4, mxfp8
    from moeref.quant.nvfp4 import nvfp4

    def sel(scheme, hw, interp):
        return QP.constexprs_cached(scheme, hw, interp)["PACKED_BF16"]

    assert sel(mxfp4(), True, False) and sel(mxfp4(preset="ocp"), True, False)
    assert sel(mxfp4(preset="te_mxfp8"), True, False)  # ignore_nan: per-lane NaN codes
    assert not sel(mxfp4(), True, True)  # interpreter
    assert not sel(mxfp4(), False, False)  # hw_fp8=False: the integer path
    assert not sel(mxfp4(preset="deepgemm"), True, False)  # ties toward zero, -0 dropped
    assert not sel(mxfp4(preset="microxcaling"), True, False)  # ties away
    assert not sel(mxfp8(), True, False)
    assert not sel(nvfp4(), True, False)  # UE4M3 scales, two levels


# ------------------------------------------------------------- the float32 lane encode (NVFP4)

def lane_code(lane: np.ndarray) -> np.ndarray:
    """The 4-bit code of a lane-form word (code bits 0-2, sign bit 9)."""
    return (lane & U32(7)) | ((lane >> U32(9) & U32(1)) << U32(3))


def _f32_probe_values() -> np.ndarray:
    """float32 patterns: every bfloat16-derived one (both signs, all binades, NaN, Inf), a
    million random ones, and every E2M1 midpoint and grid value with its neighbours within 4
    ulps (the ties and the values one ulp off them)."""
    rng = np.random.default_rng(11)
    grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8],
                    np.float32).view(U32).astype(np.int64)
    near = (grid[:, None] + np.arange(-4, 5)[None, :]).clip(0, 0x7FFFFFFF).astype(U32).reshape(-1)
    near = np.concatenate([near, near | U32(0x80000000)])
    rand = rng.integers(0, 1 << 32, 1_000_000, dtype=np.uint64).astype(U32)
    small = (rng.integers(0, 1 << 23, 200_000) | (rng.integers(120, 131, 200_000) << 23)).astype(U32)
    return np.concatenate([ALL << U32(16), near, rand, small, small | U32(0x80000000)])


@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("nan_sign", ["own", "xor"])
def test_f32_lane_encode_matches_reference(zero, nan_sign):
    """The float32 lane encode (E2M1_LANE_F32{,_ZERO}_PTX) equals moeref's encoder (RNE,
    saturating) on every probe value: code bits 0-2, sign in bit 9, bits 3-8 zero; NaN ->
    NAN_LANE; the ZERO variant writes code 0 for both zeros and is the same elsewhere."""
    y = _f32_probe_values()
    text = P.E2M1_LANE_F32_ZERO_PTX if zero else P.E2M1_LANE_F32_PTX
    lane = run_ptx(text, {"$1": y}, nan_sign)
    v = y.view(np.float32)
    nan = np.isnan(v)
    assert (lane[nan] == P.NAN_LANE).all()
    good = lane[~nan]
    assert (good & U32(0x1F8) == 0).all() and (good >> U32(10) == 0).all()
    want = encode(v[~nan].astype(np.float64), "e2m1", rounding="rne", overflow="saturate").astype(U32)
    if zero:
        want = np.where(v[~nan] == 0, U32(0), want)
    got = lane_code(good)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} values differ, e.g. {v[~nan][bad[:5]]}: {got[bad[:5]]} vs {want[bad[:5]]}"


def test_f32_lane_encode_any_nan_pattern_reaches_the_nan_lane():
    """Step 6's claim: whatever NaN pattern the FMA leaves (every one of the 2^24 NaN
    patterns) and whatever step 2 leaves (+-1, or +-Inf should the max return NaN), the
    integer steps give at least 0x35000001, above every non-NaN lane (<= 519), so min.u32 maps
    it to NAN_LANE."""
    mant = np.arange(1, 1 << 23, dtype=U32)
    nans = np.concatenate([U32(0x7F800000) | mant, U32(0xFF800000) | mant])
    for c in (0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000):
        r = (nans.astype(np.int64) - c + (c >> 22) - 0x0B0000FE) & 0xFFFFFFFF
        assert r.min() >= 0x35000001 > 519
    # and end to end through the emulated text, with non-canonical NaN results of the FMA
    y = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], U32)
    for nb in (0x7FFFFFFF, 0x7F800001, 0xFFC00000, 0xFFFFFFFF):
        assert (run_ptx(P.E2M1_LANE_F32_PTX, {"$1": y}, nan_bits=nb) == P.NAN_LANE).all()


def test_bytes_of_lanes_packs_every_lane_pair():
    """bytes_of_lanes (Triton, run by the interpreter) over every pair of lane-form values (16
    codes and NAN_LANE in each nibble): the codes' nibbles, NAN_LANE as code 0."""
    triton = pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    import os
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, as CI) or a CUDA GPU")
    import triton.language as tl

    @triton.jit
    def k(le_ptr, lo_ptr, o_ptr, N, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = i < N
        le = tl.load(le_ptr + i, mask=m, other=0).to(tl.uint32)
        lo = tl.load(lo_ptr + i, mask=m, other=0).to(tl.uint32)
        tl.store(o_ptr + i, P.bytes_of_lanes(le, lo), mask=m)

    lanes = np.array([P.lanes_of_code(c) & 0xFFFF for c in range(16)] + [P.NAN_LANE], np.int64)
    codes = np.array(list(range(16)) + [0], np.int64)
    le, lo = np.meshgrid(np.arange(17), np.arange(17), indexing="ij")
    le, lo = le.reshape(-1), lo.reshape(-1)
    out = torch.zeros(le.size, dtype=torch.uint8, device=dev)
    k[(1,)](torch.tensor(lanes[le], dtype=torch.int32, device=dev),
            torch.tensor(lanes[lo], dtype=torch.int32, device=dev), out, le.size, BLOCK=512)
    assert out.cpu().numpy().tolist() == (codes[le] | (codes[lo] << 4)).tolist()


def test_f32_lane_path_selection():
    """E2M1_PTX is on for the E2M1 RNE presets that keep signed zeros (NVFP4 and MXFP4), on a
    GPU with the hardware paths only (never in the interpreter, never with hw_fp8=False)."""
    QP = pytest.importorskip("fastpath.quant._preset_map")
    from moeref.quant import mxfp4, mxfp8
    from moeref.quant.nvfp4 import nvfp4

    def sel(scheme, hw, interp):
        return QP.constexprs_cached(scheme, hw, interp)["E2M1_PTX"]

    for order in ("te", "flashinfer", "vllm", "torchao"):
        assert sel(nvfp4(preset=f"nvfp4_{order}"), True, False)
        assert not sel(nvfp4(preset=f"nvfp4_{order}"), True, True)
        assert not sel(nvfp4(preset=f"nvfp4_{order}"), False, False)
    assert sel(mxfp4(), True, False)
    assert not sel(mxfp4(preset="deepgemm"), True, False)  # ties toward zero, -0 dropped
    assert not sel(mxfp4(preset="microxcaling"), True, False)  # ties away
    assert not sel(mxfp8(), True, False)
