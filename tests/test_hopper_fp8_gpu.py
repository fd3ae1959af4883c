"""The Hopper FP8 emulator (:mod:`moeref.gemm.hopper_fp8`) equals the hardware bit for bit (``gpu`` marker:
skipped on CPU machines, saying so; on a Hopper GPU they run for real).

* one FP8 ``wgmma`` chain (a Triton ``tl.dot`` on E4M3, raw FP32 accumulator out; K = 32, 64, 128, with
  and without an FP32 ``C``) against :func:`~moeref.gemm.hopper_fp8.mma_accumulate`;
* DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` (bf16 out) against
  :func:`~moeref.gemm.hopper_fp8.deepgemm_grouped_contiguous` and under the equality profile
  ``DEEPGEMM_FP8_EXACT`` (:func:`moeref.testing.grouped_gemm_report`);
* our Triton and Gluon FP8 grouped GEMMs (:mod:`fastpath.grouped_gemm`, each default tile kind) against the same
  ``"deepgemm"`` promotion, and against DeepGEMM's outputs themselves where DeepGEMM is installed.

Data are Hypothesis-drawn: shapes (DeepSeek-V3's K = 2048 and 7168 among them), Gaussian data with
per-block magnitudes, outlier columns, same-sign rows, random codes over the whole E4M3 range, and
non-power-of-two FP32 scales. Every comparison is by equality; the number of elements compared is
printed (``-s``).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from property_tests.test_fastpath_moe import fp8_block_layer  # noqa: E402 (the same layers as the fast-path suite)
from moeref.gemm.hopper_fp8 import deepgemm_grouped_contiguous, mma_accumulate  # noqa: E402

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn


def _hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"the emulator models Hopper (sm_90); this GPU is {torch.cuda.get_device_name()}")


def _e4m3(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.clip(x, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)


def _values(rng, shape, kind: str) -> np.ndarray:
    """E4M3 values (ml_dtypes) of ``kind``: Gaussian with per-128-column-block magnitudes, outlier
    columns, same-sign rows, or uniformly random codes (every exponent, subnormals included)."""
    import ml_dtypes

    if kind == "codes":
        c = rng.integers(0, 256, size=shape, dtype=np.uint8)
        return np.where((c & 0x7F) == 0x7F, c & 0xF0, c).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    x = rng.standard_normal(shape)
    k = shape[-1]
    x *= 2.0 ** rng.integers(-4, 4, size=shape[:-1] + (-(-k // 128),)).repeat(128, axis=-1)[..., :k]
    if kind == "outliers":
        x[..., rng.choice(k, size=min(4, k), replace=False)] *= 30.0
    elif kind == "positive":
        x = np.abs(x)
    return _e4m3(x / np.abs(x).max() * 448.0)


def _cuda_f8(x: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).cuda().view(FP8)


_KERNELS = {}


def _probe_kernel():
    if "probe" not in _KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def probe(a_ptr, b_ptr, c_ptr, d_ptr, K: tl.constexpr, USE_C: tl.constexpr):
            rm = tl.arange(0, 64)
            rk = tl.arange(0, K)
            a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
            b = tl.load(b_ptr + rm[None, :] * K + rk[:, None])
            offs = rm[:, None] * 64 + rm[None, :]
            if USE_C:
                acc = tl.dot(a, b, tl.load(c_ptr + offs))
            else:
                acc = tl.dot(a, b)
            tl.store(d_ptr + offs, acc)

        _KERNELS["probe"] = probe
    return _KERNELS["probe"]


def test_wgmma_accumulator_is_emulated_bit_for_bit():
    _hopper()
    kernel = _probe_kernel()
    seen = []

    @settings(max_examples=60, deadline=None)
    @given(st.integers(0, 2**31), st.sampled_from([32, 64, 128]),
           st.sampled_from(["normal", "outliers", "positive", "codes"]), st.booleans())
    def run(seed, k, kind, use_c):
        rng = np.random.default_rng(seed)
        a, b = _values(rng, (64, k), kind), _values(rng, (64, k), kind)
        c = (rng.standard_normal((64, 64)) * 2.0 ** rng.integers(-6, 18, size=(64, 64))).astype(np.float32)
        d = torch.full((64, 64), float("nan"), device="cuda")
        ct = torch.from_numpy(c).cuda() if use_c else d
        h = kernel[(1,)](_cuda_f8(a), _cuda_f8(b), ct, d, K=k, USE_C=use_c, num_warps=4)
        torch.cuda.synchronize()
        assert "wgmma.mma_async" in h.asm["ptx"], "tl.dot did not lower to wgmma: not the unit under test"
        pred = mma_accumulate(a.astype(np.float64)[:, None, :], b.astype(np.float64)[None, :, :],
                              c=c.astype(np.float64) if use_c else None)
        got = d.cpu().numpy().astype(np.float64)
        seen.append(got.size)
        assert np.array_equal(got, pred), f"{int(np.sum(got != pred))} of {got.size} accumulators differ"

    run()
    print(f"\n[wgmma] {sum(seen)} FP32 accumulators, all equal to the emulator")


def _deepgemm_case(data, align: int):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    k = data.draw(st.sampled_from([128, 256, 512, 2048, 7168]))
    large = k >= 2048  # DeepSeek-V3's K: fewer rows, to keep the CPU emulation to seconds
    e = data.draw(st.integers(1, 2 if large else 3))
    counts = [data.draw(st.integers(0, align if large else 2 * align)) for _ in range(e)]
    n = data.draw(st.sampled_from([128, 256] if large else [128, 256, 384]))
    kind = data.draw(st.sampled_from(["normal", "outliers", "positive", "codes"]))
    seg = [-(-max(c, 1) // align) * align for c in counts]
    m_idx = np.concatenate([np.r_[np.full(c, i), np.full(s - c, -1)] for i, (c, s) in enumerate(zip(counts, seg))])
    a = _values(rng, (m_idx.size, k), kind)
    sa = (2.0 ** rng.uniform(-12, 0, size=(m_idx.size, k // 128))).astype(np.float32)
    b = _values(rng, (e, n, k), "normal")
    sb = (2.0 ** rng.uniform(-14, -6, size=(e, -(-n // 128), k // 128))).astype(np.float32)
    return a, sa, b, sb, m_idx.astype(np.int32)


def _check_grouped(impl: str, promotion: str, profile: str | None, max_examples: int, tiles=None,
                   against_deep_gemm: bool = False):
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    align = 128
    seen = []

    @settings(max_examples=max_examples, deadline=None)
    @given(st.data())
    def run(data):
        a, sa, b, sb, m_idx = _deepgemm_case(data, align)
        at, bt = _cuda_f8(a), _cuda_f8(b)
        sat, sbt = torch.from_numpy(sa).cuda(), torch.from_numpy(sb).cuda()
        mi = torch.from_numpy(m_idx).cuda()
        d = grouped_gemm_contiguous(at, bt, mi, impl=impl, a_scales=sat, b_scales=sbt, alignment=align, tiles=tiles)
        torch.cuda.synchronize()
        valid = m_idx >= 0
        if against_deep_gemm:  # DeepGEMM's own outputs, bit for bit
            dg = grouped_gemm_contiguous(at, bt, mi, impl="deep_gemm", a_scales=sat, b_scales=sbt, alignment=align)
            vt = torch.from_numpy(valid).cuda()
            assert torch.equal(d[vt], dg[vt]), f"{int((d[vt] != dg[vt]).sum())} outputs differ from DeepGEMM's"
        got = d.float().cpu().numpy().astype(np.float64)
        pred = deepgemm_grouped_contiguous(a, sa, b, sb, m_idx, promotion=promotion).astype(np.float64)
        mism = int(np.sum(got[valid] != pred[valid]))
        seen.append(int(valid.sum()) * got.shape[1])
        assert mism == 0, f"{mism} of {seen[-1]} outputs differ from the emulation"
        if profile is not None:
            from moeref.moe.mapping import from_deepgemm_contiguous
            from moeref.testing import grouped_gemm_report

            rep = grouped_gemm_report(from_deepgemm_contiguous((at, sat), (bt, sbt), d, mi), profile=profile)
            assert rep.passed, rep.summary()

    run()
    print(f"\n[{impl} {tiles}] {sum(seen)} bf16 outputs, all equal to the emulator ({promotion} promotion)"
          f"{' and to DeepGEMM' if against_deep_gemm else ''}")


def test_deepgemm_grouped_contiguous_equals_the_emulator():
    _hopper()
    pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (source .gpu/deep_gemm/install.sh builds it)")
    _check_grouped("deep_gemm", "deepgemm", "DEEPGEMM_FP8_EXACT", 40)


TILE_KINDS = ("fp8_block", "fp8_block_decode", "fp8_block_contiguous_tma", "fp8_block_contiguous_gluon")


@pytest.mark.parametrize("kind", TILE_KINDS)
def test_triton_fp8_grouped_gemm_equals_the_emulator(kind):
    """Each default tile kind promotes as DeepGEMM does: ``fma(part, fl(sa * sb), acc)``."""
    from fastpath.grouped_gemm import DEFAULT_TILES

    _hopper()
    _check_grouped("triton", "deepgemm", "TRITON_FP8_BLOCK_EXACT", 25, tiles=DEFAULT_TILES[kind])


@pytest.mark.parametrize("kind", TILE_KINDS)
def test_triton_fp8_grouped_gemm_equals_deep_gemm(kind):
    """Our FP8 grouped GEMM's outputs are DeepGEMM's, bit for bit, on the same Hypothesis-drawn cases."""
    from fastpath.grouped_gemm import DEFAULT_TILES

    _hopper()
    pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (source .gpu/deep_gemm/install.sh builds it)")
    _check_grouped("triton", "deepgemm", None, 15, tiles=DEFAULT_TILES[kind], against_deep_gemm=True)


def _exact_layer_profile(cfg):
    """DEEPGEMM_FP8_EXACT with the stores fastpath.moe declares (its reference_config)."""
    from dataclasses import replace

    from moeref.compare import PROFILES

    return replace(PROFILES["DEEPGEMM_FP8_EXACT"], act_out_dtype=cfg["act_out_dtype"])


def _run_layer(weights, x, tw, ids, fw=None, layout="contiguous"):
    from fastpath.moe import fast_weights, fused_moe, reference_config
    from moeref.moe import run_moe

    fw = fw or fast_weights(weights, "cuda")
    got = fused_moe(torch.as_tensor(x, device="cuda").to(torch.bfloat16), fw, torch.as_tensor(tw, device="cuda"),
                    torch.as_tensor(ids, device="cuda"), impl="deep_gemm", layout=layout)
    cfg = reference_config(fast_weights(weights, "cuda"))
    cfg.pop("profile")
    run = run_moe(torch.as_tensor(x).to(torch.bfloat16).float().numpy(), weights, tw, ids, **cfg)
    return got.float().cpu(), run, cfg


def test_real_deepgemm_layer_passes_the_exact_profile():
    """fastpath.moe's FP8 layer through real DeepGEMM (K = 512, N = 256) passes DEEPGEMM_FP8_EXACT: no
    false alarm of the equality-level profile on the real kernel, over Hypothesis routings."""
    _hopper()
    pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (source .gpu/deep_gemm/install.sh builds it)")
    from moeref.compare import compare
    from moeref.moe import make_tokens
    from moeref.strategies import routings

    ratios = []

    @settings(max_examples=20, deadline=None)
    @given(routings(max_tokens=160, max_experts=6, max_top_k=4), st.integers(0, 2**16),
           st.sampled_from(["contiguous", "masked"]))
    def run(r, seed, layout):
        rng = np.random.default_rng(seed)
        weights = fp8_block_layer(rng, r.num_experts, 512, 256)
        x = make_tokens(r.num_tokens, 512, seed=seed)
        got, ref, cfg = _run_layer(weights, x, r.weights, r.ids, layout=layout)
        rep = compare(got, ref, _exact_layer_profile(cfg))
        valid = rep.bound > 0
        ratios.append(float((rep.error[valid] / rep.bound[valid]).max()) if valid.any() else 0.0)
        assert rep.passed, rep.summary()

    run()
    print(f"\n[layer] real DeepGEMM layer under DEEPGEMM_FP8_EXACT: worst |err|/bound {max(ratios):.3f}")


def test_exact_profile_catches_one_weight_code_off_by_one_on_real_deepgemm():
    """A subtle corruption of the real kernel's input: one GEMM2 weight code of one expert moved to its
    neighbouring E4M3 value. DEEPGEMM_FP8_EXACT must catch it; the data-dependent Hopper profile is
    printed for comparison."""
    _hopper()
    pytest.importorskip("deep_gemm", reason="DeepGEMM is not installed (source .gpu/deep_gemm/install.sh builds it)")
    from fastpath.moe import fast_weights
    from moeref.compare import PROFILES, compare
    from moeref.moe import make_tokens

    rng = np.random.default_rng(5)
    weights = fp8_block_layer(rng, 4, 512, 256)
    x = make_tokens(64, 512, seed=6)
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(64)]).astype(np.int32)
    tw = rng.random((64, 2)).astype(np.float32)
    fw = fast_weights(weights, "cuda")
    w2 = fw.w2.clone()
    codes = w2.view(torch.uint8)
    row = codes[0, 0]
    j = int(torch.nonzero(((row & 0x7F) >= 0x10) & ((row & 0x7F) <= 0x70))[0, 0])  # a normal value, not 448
    codes[0, 0, j] = row[j] ^ 1  # one code, its lowest mantissa bit: the neighbouring E4M3 value
    bad = type(fw)(fw.w13, w2, fw.w13_layout, fw.w13_scales, fw.w2_scales)
    got, ref, cfg = _run_layer(weights, x, tw, ids, fw=bad)
    exact = compare(got, ref, _exact_layer_profile(cfg))
    data = compare(got, ref, PROFILES["HOPPER_FP8_DEEPGEMM_DATA"])
    print(f"\n[fault] one weight code off by one: DEEPGEMM_FP8_EXACT passed={exact.passed}, "
          f"HOPPER_FP8_DEEPGEMM_DATA passed={data.passed}")
    assert not exact.passed
