"""GPU proof of the packed bf16x2 MXFP4 path (:mod:`fastpath._packed_fp4`, ``PACKED_BF16``).

The CPU proof (tests/test_mxfp4_packed_encode.py) emulates the PTX text; these tests run the real
instructions on an sm_90+ GPU (skipped elsewhere: Triton's interpreter cannot run inline PTX) and
compare, bit for bit:

1. the encode helper (four words per asm call) on every bfloat16 pattern in both lanes (65536 words, the high lane a
   permutation of the low one) times every E8M0 factor ``2^(127 - code)``, code 0..254 (2^-127 is
   a bf16 subnormal), and the factors 0 and NaN, against the integer helper
   :func:`fastpath._triton_rounding.encode_e2m1` run in the same kernel on the float32 products and
   against :func:`moeref.formats.encode` of the exact product (non-NaN lanes; NaN lanes must give
   code 7 up to the sign, and must not disturb the other lane);
2. the block amax helper on blocks of all kinds (subnormal-only, NaN, Inf, mixed), both NaN
   modes, against the integer max of the |x| bit patterns;
3. :func:`fastpath.quant.quantize` end to end, every MXFP4 preset the packed path serves (each
   NaN policy, zero-block rule and E8M0 rule among them), on all 65536 bf16 patterns placed in
   blocks sorted by magnitude with anchors 2^0..2^8 above the block max (a sweep of block scales
   over every binade): codes and scales equal to the integer path (``hw_fp8=False``) and to
   :func:`moeref.quant.quantize` (row-major scales; the swizzled layout for two presets),
   output buffers poisoned. (Where the reference refuses NaN elements, presets without a NaN code outside the
   NaN-block policy, the reference comparison runs on the input with NaN, and for ``propagate``
   Inf, replaced by +-1; the packed-vs-integer comparison keeps them.)
4. odd shapes and block sizes (few words per thread, partial groups) end to end.
"""
from __future__ import annotations

import numpy as np
import ml_dtypes
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moeref.formats import encode  # noqa: E402
from moeref.quant import mxfp4, quantize as ref_quantize  # noqa: E402

from fastpath import _packed_fp4 as PK  # noqa: E402
from fastpath import _triton_rounding as R  # noqa: E402
from fastpath import quant as Q  # noqa: E402
from fastpath.quant import _preset_map as QP  # noqa: E402
from fastpath.testing import poisoned, to_device  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

U32 = np.uint32
# presets the packed path serves (E8M0, RNE, signed zeros kept); their knobs differ in NaN policy
# (nan_block / ignore_nan / propagate), E8M0 rule and non-finite handling, zero-block rule
def _packed_presets():
    from moeref.quant.scheme import PRESETS
    names = []
    for name in PRESETS:
        s = mxfp4(preset=name)
        ok, why = Q.supports(s)
        env_only = "CUDA" in why or "TRITON_INTERPRET" in why  # (collection without a device)
        if not (ok or env_only):
            continue
        try:
            if QP.constexprs_cached(s, True, False)["PACKED_BF16"]:
                names.append(name)
        except KeyError:  # a preset knob the kernel does not have (supports() refuses it)
            continue
    return names


PACKED_PRESETS = _packed_presets()


@triton.jit
def _encode_both_kernel(w_ptr, f_ptr, hw_ptr, int_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    fid = tl.program_id(1)
    m = i < N
    w = tl.load(w_ptr + i, mask=m, other=0)
    f = tl.zeros([BLOCK], tl.float32) + tl.load(f_ptr + fid)
    hw = PK.encode_e2m1x4_rne(w, PK.bf16x2_factor(f), 0, 0)
    u = w.to(tl.uint32, bitcast=True)
    lo = (u << 16).to(tl.float32, bitcast=True) * f
    hi = (u & 0xFFFF0000).to(tl.float32, bitcast=True) * f
    ci = R.encode_e2m1(lo, 0, 0, False) | (R.encode_e2m1(hi, 0, 0, False) << 4)
    tl.store(hw_ptr + fid * N + i, hw, mask=m)
    tl.store(int_ptr + fid * N + i, ci.to(tl.uint8), mask=m)


def _bf16_value(bits):
    with np.errstate(invalid="ignore"):
        return (bits.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def test_gpu_packed_encode_every_pattern_every_factor():
    lo = np.arange(1 << 16, dtype=U32)
    hi = np.random.default_rng(11).permutation(lo).astype(U32)
    words = (lo | (hi << U32(16))).view(np.int32)
    codes = np.arange(255)
    factors = np.concatenate([np.ldexp(1.0, 127 - codes), [0.0, np.nan]]).astype(np.float32)
    n, nf = words.size, factors.size
    hw = torch.empty(nf * n, dtype=torch.uint8, device="cuda")
    it = torch.empty(nf * n, dtype=torch.uint8, device="cuda")
    _encode_both_kernel[(triton.cdiv(n, 1024), nf)](torch.from_numpy(words).cuda(),
                                                     torch.from_numpy(factors).cuda(), hw, it, n,
                                                     BLOCK=1024)
    hw = hw.cpu().numpy().reshape(nf, n).astype(U32)
    it = it.cpu().numpy().reshape(nf, n).astype(U32)
    xl, xh = _bf16_value(lo), _bf16_value(hi)
    for j, f in enumerate(factors.astype(np.float64)):
        with np.errstate(invalid="ignore"):
            yl, yh = xl * f, xh * f
        nl, nh = np.isnan(yl), np.isnan(yh)
        want = (encode(yl, "e2m1", rounding="rne", overflow="saturate", nan_code=0).astype(U32)
                | (encode(yh, "e2m1", rounding="rne", overflow="saturate", nan_code=0).astype(U32) << 4))
        for name, got in (("packed", hw[j]), ("integer", it[j])):
            bad_lo = ((got & 0xF) != (want & 0xF)) & ~nl
            bad_hi = ((got >> 4) != (want >> 4)) & ~nh
            assert not bad_lo.any() and not bad_hi.any(), (
                f"{name} path, factor {f!r}: {int(bad_lo.sum())} low / {int(bad_hi.sum())} high "
                f"lanes differ from moeref; first low word {words.view(U32)[bad_lo][:1]}")
        assert np.array_equal(hw[j] & np.where(nl, 0, 0xF) | hw[j] & np.where(nh, 0, 0xF0),
                              it[j] & np.where(nl, 0, 0xF) | it[j] & np.where(nh, 0, 0xF0))
        assert ((hw[j][nl] & 0x7) == 7).all() and (((hw[j][nh] >> 4) & 0x7) == 7).all()


@triton.jit
def _amax_kernel(w_ptr, o_ptr, IGNORE_NAN: tl.constexpr, NB: tl.constexpr):
    b = tl.program_id(0) * NB + tl.arange(0, NB)
    j = tl.arange(0, 16)
    w = tl.load(w_ptr + b[:, None] * 16 + j[None, :])
    tl.store(o_ptr + b, PK.amax_bf16x2(w, IGNORE_NAN))


@pytest.mark.parametrize("ignore_nan", [False, True])
def test_gpu_packed_amax(ignore_nan):
    rng = np.random.default_rng(5)
    nb = 4096
    x = rng.integers(0, 1 << 16, size=(nb, 32)).astype(U32)
    x[:512] = rng.integers(0, 0x80, size=(512, 32)) | (rng.integers(0, 2, (512, 32)) << 15)
    x[512:768] = np.where(rng.random((256, 32)) < 0.9, 0xFFC1, x[512:768])
    x[768:776] = 0x7FC0
    x[776:900] = np.where(rng.random((124, 32)) < 0.5, 0xFF80, x[776:900] & 0x3FFF)
    x[900:1000] = rng.integers(0, 2, (100, 32)) << 15  # +-0 only
    words = (x[:, 0::2] | (x[:, 1::2] << U32(16))).view(np.int32)
    out = torch.empty(nb, dtype=torch.float32, device="cuda")
    _amax_kernel[(nb // 64,)](torch.from_numpy(np.ascontiguousarray(words)).cuda(), out,
                              IGNORE_NAN=ignore_nan, NB=64)
    got = out.cpu().numpy().view(U32) >> U32(16)
    a = x & U32(0x7FFF)
    if ignore_nan:
        assert np.array_equal(got, np.where(a > 0x7F80, 0, a).max(axis=1))
    else:
        has_nan = (a > 0x7F80).any(axis=1)
        assert np.array_equal(got > 0x7F80, has_nan)
        assert np.array_equal(got[~has_nan], a.max(axis=1)[~has_nan])


def _sweep_input():
    """All 65536 bf16 patterns in 31-element runs sorted by magnitude, each run completed by an
    anchor 2^j (j = 0, 1, 2, 3, 5, 8; or none: a 32nd pattern) above the run's max, so every
    pattern is quantized at several block scales; positions shuffled within each block."""
    rng = np.random.default_rng(3)
    pats = np.arange(1 << 16, dtype=U32)
    srt = pats[np.argsort(pats & 0x7FFF, kind="stable")]
    blocks = []
    runs = np.concatenate([srt, srt[: (-srt.size) % 31]]).reshape(-1, 31)
    for j in (None, 0, 1, 2, 3, 5, 8):
        if j is None:
            b = np.concatenate([srt, srt[: (-srt.size) % 32]]).reshape(-1, 32)
        else:
            top = runs & 0x7FFF
            top = np.where(top > 0x7F80, 0x3F80, top).max(axis=1)  # a NaN run keeps a finite anchor
            anchor = np.minimum(top + (j << 7), 0x7F7F) | (rng.integers(0, 2, top.size) << 15).astype(U32)
            b = np.concatenate([runs, anchor[:, None].astype(U32)], axis=1)
        b = np.take_along_axis(b, rng.random(b.shape).argsort(axis=1), axis=1)
        blocks.append(b)
    x = np.concatenate(blocks).astype(np.uint16)
    nblk = x.shape[0] - x.shape[0] % 32
    return x[:nblk].reshape(-1, 32 * 32).view(ml_dtypes.bfloat16)  # rows of 1024 elements


@pytest.mark.parametrize("preset,layout", [(p, "row_major") for p in PACKED_PRESETS]
                         + [("default", "swizzled_128x4"), ("te_mxfp8", "swizzled_128x4")])
def test_gpu_packed_quantize_equals_integer_path_and_reference(preset, layout):
    scheme = mxfp4(preset=preset)
    assert QP.constexprs(scheme, True)["PACKED_BF16"], "the packed path must be selected here"
    assert not QP.constexprs(scheme, False)["PACKED_BF16"]
    xn = _sweep_input()
    x = to_device(xn)
    with poisoned():
        hwq = Q.quantize(x, scheme, scale_layout=layout, hw_fp8=True)
        inq = Q.quantize(x, scheme, scale_layout=layout, hw_fp8=False)
    assert torch.equal(hwq.codes, inq.codes), f"{preset}: packed and integer codes differ"
    assert torch.equal(hwq.scales.view(torch.uint8), inq.scales.view(torch.uint8))
    # the reference refuses to encode a NaN element where the preset has no NaN code and no
    # NaN-block policy (moeref.formats.encode); compare it on an input without those
    p = scheme.preset
    if p.nan_code is None and p.nonfinite != "nan_block":
        bits = xn.view(np.uint16)
        bad = (bits & 0x7FFF) > (0x7F80 if p.nonfinite == "ignore_nan" else 0x7F7F)
        xn = np.where(bad, (bits & 0x8000) | 0x3F80, bits).astype(np.uint16).view(ml_dtypes.bfloat16)
        with poisoned():
            hwq = Q.quantize(to_device(xn), scheme, scale_layout=layout, hw_fp8=True)
    ref = ref_quantize(xn, scheme)
    got = hwq.codes.cpu().numpy()
    if not np.array_equal(got, ref.codes):
        i = tuple(np.argwhere(got != ref.codes)[0])
        raise AssertionError(f"{preset}: {int((got != ref.codes).sum())} codes differ from moeref; "
                             f"first at {i}: {got[i]:#04x} vs {ref.codes[i]:#04x}")
    assert np.array_equal(hwq.scales_logical(), ref.scales)


@pytest.mark.parametrize("M,K,block,preset", [
    (1, 2, 32, "default"), (3, 34, 32, "default"), (5, 64, 32, "te_mxfp8"), (7, 96, 16, "default"),
    (2, 8, 2, "default"), (2, 12, 4, "vllm"), (9, 4096, 32, "vllm"), (333, 2880, 32, "ocp"),
    (4096, 7168, 32, "default"),
])
def test_gpu_packed_quantize_odd_shapes(M, K, block, preset):
    """Tiles where a thread holds few words (the pack=4 asm groups four elements per call),
    partial groups and rows: packed == integer path == moeref (random data, NaN-free for the
    presets whose reference refuses NaN)."""
    scheme = mxfp4(preset=preset, block_size=block)
    rng = np.random.default_rng(M * K + block)
    xn = (rng.standard_normal((M, K)) * np.exp2(rng.integers(-20, 20, (M, 1)))).astype(ml_dtypes.bfloat16)
    x = to_device(xn)
    with poisoned():
        hwq = Q.quantize(x, scheme, hw_fp8=True)
        inq = Q.quantize(x, scheme, hw_fp8=False)
    assert torch.equal(hwq.codes, inq.codes) and torch.equal(hwq.scales, inq.scales)
    ref = ref_quantize(xn, scheme)
    assert np.array_equal(hwq.codes.cpu().numpy(), ref.codes)
    assert np.array_equal(hwq.scales_logical(), ref.scales)
