"""moeref.compare.device._requant_kernels: the Triton path of :func:`moeref.compare.device.requant.device_requant` equals
its torch lines (``_device_requant(..., kernels=False)``) bit for bit: the operand's codes, scales and block, the
uncertainty's float64 bits and the flip count; the amax grids (NaN included) and the rounding / FP8 encoding
helpers alone. On CPU tensors under TRITON_INTERPRET=1 (the conftest sets it without a GPU), on a GPU for real."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moeref.compare.device import _requant_kernels as K  # noqa: E402
from moeref.compare.device import requant as D  # noqa: E402
from moeref.formats import FORMATS, decode_table  # noqa: E402
from moeref.quant import fp8_block, fp8_group, fp8_per_token  # noqa: E402
from moeref.quant.scheme import get_preset  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy on Inf / NaN lanes
SCHEMES = {
    "1x128 fp32": lambda: fp8_group(),
    "1x128 ue8m0": lambda: fp8_group(128, "ue8m0", "deepgemm"),
    "1x32 e5m2": lambda: fp8_group(32, element="e5m2"),
    "per token vllm": lambda: fp8_per_token(preset="vllm"),
    "2x64 te": lambda: fp8_block((2, 64), preset="te_fp8_block"),
    "1x128 drop -0": lambda: fp8_group(128, preset=get_preset("default").with_(name="drop0", signed_zero="drop")),
}
SHAPES = [(1, 128), (2, 77), (3, 200), (5, 300), (7, 256), (9, 520)]


def _ties(el, rng, size):
    """Values of ``el``'s range scaled at most to ``max_finite``: midpoints of neighbours (ties, normal and
    subnormal), the representable values, and neighbours of the midpoints (one float64 ulp off)."""
    t = decode_table(el.name)
    v = np.unique(np.abs(t[np.isfinite(t)]))
    mid = (v[:-1] + v[1:]) / 2
    pool = np.concatenate([mid, v, np.nextafter(mid, 0), np.nextafter(mid, np.inf)])
    return pool[rng.integers(0, pool.size, size)] * rng.choice([-1.0, 1.0], size)


def _data(scheme, shape, seed, special=None):
    """``(x, dx)`` float64 (module docstring of the test): magnitudes over ~2^-60..2^20, signed zeros, an all-zero
    block, a block of FP8 ties / subnormal results / values at ``max_finite`` (its amax ``max_finite * 2^j``, so
    its scale is a power of two), dx of 0, the smallest subnormal, relative and huge; ``special``: one Inf or
    NaN in ``x`` or ``dx``."""
    rng = np.random.default_rng(seed)
    r, n = shape
    el = scheme.element_format
    br, bk = (int(b) for b in scheme.resolve_block(shape))
    x = rng.standard_normal((r, n)) * np.exp2(rng.integers(-40, 20, (r, 1))) * np.exp2(rng.integers(-14, 1, (r, n)))
    x[:, ::2] = x[:, ::2].astype(np.float32)
    x[:, ::11] = 0.0
    x[:, 5::13] = -0.0
    x[:br, : min(n, bk)] = 0.0                       # an all-zero block (with a -0)
    x[0, min(n, bk) - 1] = -0.0
    if r > br:                                        # block (1, 0): ties at a power-of-two scale
        j = int(rng.integers(-30, 20))
        rows, cols = slice(br, min(r, 2 * br)), slice(0, min(n, bk))
        blk = _ties(el, rng, x[rows, cols].shape) * 2.0**j
        sub = 2.0 ** (el.emin - el.man_bits)          # the smallest subnormal: it, and ties at 0.5, 1.5 of it
        blk.flat[: min(4, blk.size)] = (np.array([el.max_finite, sub, -1.5 * sub, 0.5 * sub]) * 2.0**j)[: blk.size]
        x[rows, cols] = blk
    dx = np.abs(x) * np.exp2(rng.integers(-30, 0, (r, n))) + np.exp2(rng.integers(-70, -20, (r, n)))
    dx[rng.random((r, n)) < 0.2] = 0.0
    dx[rng.random((r, n)) < 0.05] = 5e-324
    if r > 2:
        dx[2, rng.integers(0, n)] = 1e300             # a huge bound: scales far up, codes saturate
    if special is not None:
        where, val = special
        (x if where == "x" else dx)[r - 1, n - 1] = val
    return torch.as_tensor(x, device=DEV), torch.as_tensor(dx, device=DEV)


def _bits(t):
    return t.contiguous().view(torch.int64)


def _assert_same(got, want):
    assert (got is None) == (want is None)
    if want is None:
        return
    (op, unc, flips), (op_w, unc_w, flips_w) = got, want[:3]
    assert op.codes.dtype == torch.uint8 and torch.equal(op.codes, op_w.codes), \
        f"codes differ in {int((op.codes != op_w.codes).sum())} elements"
    assert op.scales.dtype == op_w.scales.dtype and torch.equal(_bits(op.scales), _bits(op_w.scales))
    assert (op.element, tuple(op.block), op.quantized, op.values) == (op_w.element, tuple(op_w.block), True, None)
    assert unc.dtype == torch.float64 and unc.shape == unc_w.shape
    assert torch.equal(_bits(unc), _bits(unc_w)), f"unc differs in {int((_bits(unc) != _bits(unc_w)).sum())} elements"
    assert flips.dtype == torch.int64 and flips.ndim == 0 and int(flips) == int(flips_w)


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_equal_the_torch_lines(name, shape):
    scheme = SCHEMES[name]()
    assert D.device_requant_unavailable(scheme) is None
    x, dx = _data(scheme, shape, seed=100 * sorted(SCHEMES).index(name) + SHAPES.index(shape))
    want = D._device_requant(x, dx, scheme, kernels=False)
    got = D._device_requant(x, dx, scheme, kernels=True)
    assert want is not None
    _assert_same(got, want)
    if shape[0] > 2:  # the data reaches what it means to: flips, zero and subnormal codes, a saturated bound
        codes = want[0].codes & 0x7F
        assert int(want[2]) > 0 and bool((codes == 0).any())
        assert bool(((codes > 0) & (codes < (1 << scheme.element_format.man_bits))).any())


@pytest.mark.parametrize("name", ["1x128 fp32", "1x128 ue8m0", "per token vllm", "2x64 te"])
@pytest.mark.parametrize("special", [("x", np.inf), ("x", -np.inf), ("dx", np.inf), ("x", np.nan), ("dx", np.nan),
                                     ("x", -1e308), ("dx", 1.7e308)])
def test_non_finite_and_extreme_input(name, special):
    """Inf / NaN / near-overflow in ``x`` or ``dx``: both paths give the same result, or both None (a NaN block
    scale: the host runs the stage)."""
    scheme = SCHEMES[name]()
    x, dx = _data(scheme, (5, 200), seed=7, special=special)
    want = D._device_requant(x, dx, scheme, kernels=False)
    got = D._device_requant(x, dx, scheme, kernels=True)
    _assert_same(got, want)
    if special[1] != special[1] and name == "1x128 fp32":  # NaN in a block: NaN amax, NaN decode scale
        assert want is None


@pytest.mark.parametrize("name,val,inf_scale", [("per token vllm", np.inf, True), ("1x128 ue8m0", np.nan, False),
                                                ("1x128 ue8m0", -np.nan, False), ("2x64 te", np.nan, False)])
def test_nan_codes(name, val, inf_scale):
    """Not all None above: an Inf ``x`` under vLLM per-token scales (an Inf scale, ``x / Inf`` NaN), a NaN ``x``
    of either sign under scale rules that give a NaN amax a finite scale: NaN codes; the kernels agree there."""
    scheme = SCHEMES[name]()
    x, dx = _data(scheme, (5, 200), seed=7, special=("x", val))
    want = D._device_requant(x, dx, scheme, kernels=False)
    assert want is not None and bool(torch.isinf(want[0].scales).any()) == inf_scale
    assert int(want[0].codes[-1, -1]) & 0x7F == 0x7F and bool(torch.isinf(want[1][-1, -1]))
    _assert_same(D._device_requant(x, dx, scheme, kernels=True), want)


@pytest.mark.parametrize("name", ["1x128 fp32", "per token vllm", "2x64 te", "1x32 e5m2"])
@pytest.mark.parametrize("shape", [(1, 5), (3, 130), (9, 300)])
def test_amax_grids_equal_torch_amax(name, shape):
    """The three grids of one kernel against ``_amax_grid`` of the torch tensors; NaN where torch has NaN."""
    scheme = SCHEMES[name]()
    block = tuple(int(b) for b in scheme.resolve_block(shape))
    x, dx = _data(scheme, shape, seed=3)
    x[shape[0] - 1, 0] = np.nan
    dx[0, shape[1] - 1] = np.nan
    dx[shape[0] // 2, shape[1] // 2] = np.inf
    mag = x.abs()
    want = [D._amax_grid(mag, block), D._amax_grid(mag + dx, block),
            D._amax_grid(torch.clamp(mag - dx, min=0.0), block)]
    got = K.amax_grids_t(x, dx, block)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float64
        assert torch.equal(g.isnan(), w.isnan()) and bool(w.isnan().any())
        assert torch.equal(_bits(torch.nan_to_num(g, nan=0.0)), _bits(torch.nan_to_num(w, nan=0.0)))


@triton.jit
def _round_encode_kernel(v_ptr, c_ptr, r_ptr, code_ptr, n, EMIN: tl.constexpr, MB: tl.constexpr, DROP: tl.constexpr,
                         B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < n
    r = K._round(tl.load(v_ptr + i, mask=m, other=0.0), c_ptr, EMIN, MB)
    tl.store(r_ptr + i, r, mask=m)
    tl.store(code_ptr + i, K._encode(r, c_ptr, EMIN, MB, DROP).to(tl.uint8), mask=m)


@pytest.mark.parametrize("el_name,drop", [("e4m3fn", False), ("e4m3fn", True), ("e5m2", False)])
def test_round_and_encode_equal_round_float_rne_and_the_fp8_cast(el_name, drop):
    """Every binade's values, ties and their neighbours, subnormals, float64 subnormals, +-0, past max_finite,
    +-Inf, NaN: ``_round`` is ``round_float_rne`` (bits, sign of zero) and ``_encode`` the torch FP8 cast."""
    el = FORMATS[el_name]
    rng = np.random.default_rng(2)
    m = el.max_finite
    base = np.concatenate([_ties(el, rng, 3000), rng.standard_normal(2000) * np.exp2(rng.integers(-30, 30, 2000)),
                           np.arange(-2 * m, 2 * m, m / 256.0)])
    special = [0.0, -0.0, 5e-324, -5e-324, 1e-310, 1e308, -1e308, np.inf, -np.inf, np.nan, -np.nan]
    v = np.concatenate([base, -base, special])
    vt = torch.as_tensor(v, device=DEV)
    r = torch.empty_like(vt)
    codes = torch.empty(vt.shape, dtype=torch.uint8, device=DEV)
    c = K._consts(vt.device, float(m), 2.0 ** (el.man_bits - el.emin))
    _round_encode_kernel[(triton.cdiv(v.size, 1024),)](vt, c, r, codes, v.size, EMIN=el.emin, MB=el.man_bits,
                                                       DROP=drop, B=1024, enable_fp_fusion=False)
    want = D.round_float_rne(vt, el)
    assert torch.equal(r.isnan(), want.isnan())
    assert torch.equal(_bits(torch.nan_to_num(r, nan=0.0)), _bits(torch.nan_to_num(want, nan=0.0)))
    want_codes = want.to(torch.float32).to(getattr(torch, D._TORCH_FP8[el_name])).view(torch.uint8)
    if drop:
        want_codes = torch.where(want_codes == el.sign_mask, torch.zeros_like(want_codes), want_codes)
    assert torch.equal(codes, want_codes)
    assert bool((want_codes == 0x80).any()) != drop


def test_device_requant_takes_the_kernels_unless_detail(monkeypatch):
    """The public function runs the kernels where :func:`_requant_kernels.usable` (here: CPU under the
    interpreter, or CUDA) and the torch lines for ``detail=True``; the same first three results."""
    scheme = SCHEMES["1x128 fp32"]()
    x, dx = _data(scheme, (3, 300), seed=5)
    calls = []
    real = K.requant_t
    monkeypatch.setattr(K, "requant_t", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = D.device_requant(x, dx, scheme)
    assert calls == [1]
    det = D.device_requant(x, dx, scheme, detail=True)
    assert calls == [1] and len(det) == 4 and set(det[3]) == {"code_lo", "code_hi", "scale_lo", "scale_hi", "scale_ref"}
    _assert_same(got, det)
    assert not K.usable(x.float(), dx.float()) and not K.usable(x[:0], dx[:0])
    with pytest.raises(ValueError):
        D._device_requant(x, dx, scheme, detail=True, kernels=True)
