"""GEMM2 of an emulated profile at the GEMM level: :func:`moeref.compare.device.emulated.device_emulated_gemm`
(uncertain codes enumerated per 128-column block, the promotion of every combination replayed from block
accumulators) against the host's :func:`moeref.compare.emulated_gemm._emulated_gemm` (every combination of a row's codes
emulated over the whole row, NumPy emulator), bit for bit.

Drawn operands put up to four uncertain codes in one block or spread over blocks, rows whose codes are certain but
whose scale is not, certain rows, rows past the enumeration limit (five codes, or two codes that are not
neighbours: the data-dependent fallback), padding rows, a second weight-scale row block and a bias; both promotion
orders. CPU: the Triton kernels under the interpreter.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
import ml_dtypes  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastpath.testing import device, on_gpu  # noqa: E402
from moeref.compare import PROFILES  # noqa: E402
from moeref.compare.bounds import _emulated_gemm  # noqa: E402
from moeref.compare.device.emulated import device_emulated_gemm  # noqa: E402
from moeref.formats import decode_table  # noqa: E402
from moeref.gemm import StackedExperts  # noqa: E402
from moeref.gemm.device import DeviceOperand  # noqa: E402
from moeref.gemm.exact import BlockOperand  # noqa: E402

DEV = device()
TABLE = np.array(decode_table("e4m3fn"), dtype=np.float64)


def _e4m3(mag_code: np.ndarray, sign: np.ndarray) -> np.ndarray:
    return np.where(sign < 0, -1.0, 1.0) * TABLE[mag_code]


def _case(seed: int, e: int, k: int, n: int, rows: int, kinds: list[str]):
    """Codes, scales, weights and the flip-aware codes of GEMM2's operand: row ``i`` of kind ``kinds[i]``."""
    rng = np.random.default_rng(seed)
    nb = k // 128
    codes = rng.integers(0, 126, (rows, k), dtype=np.uint8) | (rng.integers(0, 2, (rows, k), dtype=np.uint8) << 7)
    sa = np.exp2(rng.integers(-9, -5, (rows, nb))).astype(np.float64) * rng.choice([1.0, 1.5, 1.25], (rows, nb))
    vals = TABLE[codes]
    lo, hi = vals.copy(), vals.copy()
    s_lo = np.repeat(sa, 128, axis=1)
    s_hi = s_lo.copy()
    radius = np.zeros((rows, k))
    row_e = rng.integers(0, e, rows).astype(np.int64)
    for i, kind in enumerate(kinds):
        if kind == "pad":
            row_e[i] = -1
            continue
        if kind == "certain":
            continue
        if kind == "scale":  # codes certain, the block's scale not
            b = int(rng.integers(0, nb))
            s_hi[i, b * 128:(b + 1) * 128] *= 1 + 2.0**-10
            radius[i, b * 128] = 2.0**-12
            continue
        if kind.startswith("one_block"):  # up to 4 codes in one block
            m = int(kind[-1])
            b = int(rng.integers(0, nb))
            pos = b * 128 + rng.choice(128, m, replace=False)
        else:  # "spread<m>": m codes anywhere (m = 5: past the limit)
            pos = rng.choice(k, int(kind[-1]), replace=False)
        for p in pos.tolist():
            mag = int(rng.integers(1, 125))
            sgn = 1 if rng.integers(0, 2) else -1
            a_, b_ = _e4m3(np.array(mag), np.array(sgn)), _e4m3(np.array(mag + 1), np.array(sgn))
            lo[i, p], hi[i, p] = min(a_, b_), max(a_, b_)
            c = lo[i, p] if rng.integers(0, 2) else hi[i, p]
            codes[i, p] = np.array(c, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            radius[i, p] = abs(hi[i, p] - lo[i, p]) * s_lo[i, p]
        if kind == "far":  # two codes that are not neighbours: the fallback
            lo[i, pos[0]] = hi[i, pos[0]] - 2 * abs(hi[i, pos[0]]) - 1
    wcodes = rng.integers(0, 126, (e, n, k), dtype=np.uint8) | (rng.integers(0, 2, (e, n, k), dtype=np.uint8) << 7)
    grid = (e, -(-n // 128), nb)
    wsc = np.exp2(rng.integers(-8, -4, grid)).astype(np.float64) * rng.choice([1.0, 1.75], grid)
    bias = rng.standard_normal((e, n))
    det = dict(code_lo=lo, code_hi=hi, scale_lo=s_lo, scale_hi=s_hi)
    return codes, sa, radius, row_e, wcodes, wsc, bias, det


KINDS = ["certain", "scale", "one_block1", "one_block2", "one_block3", "one_block4", "spread2", "spread3", "spread4",
         "spread5", "far2", "pad"]


@settings(deadline=None, max_examples=4 if not on_gpu() else 25, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**16), st.sampled_from(["deepgemm", "a_then_b"]),
       st.lists(st.sampled_from(KINDS), min_size=3, max_size=8), st.booleans())
def test_block_enumeration_equals_host(seed, promotion, kinds, with_bias):
    """Center and radius bits of the device GEMM equal the host's (every combination emulated on the whole row)."""
    e, k, n = 2, 384, 160
    codes, sa, radius, row_e, wcodes, wsc, bias, det = _case(seed, e, k, n, len(kinds), kinds)
    prof = replace(PROFILES["DEEPGEMM_FP8_EXACT"], promotion_order=promotion)
    b = bias if with_bias else None
    a_h = BlockOperand(None, sa, (1, 128), True, codes=codes, table=decode_table("e4m3fn"))
    w_h = StackedExperts(wcodes, wsc, "e4m3fn", (128, 128), (n, k))
    c_h, r_h = _emulated_gemm(a_h, radius, row_e, w_h, b, prof, det)
    t = lambda x: torch.as_tensor(x, device=DEV)  # noqa: E731
    a_d = DeviceOperand(None, t(codes), "e4m3fn", t(sa), (1, 128), True)
    w_d = StackedExperts(t(wcodes), t(wsc), "e4m3fn", (128, 128), (n, k))
    c_d, r_d = device_emulated_gemm(a_d, t(radius), row_e, w_d, b, prof, {k_: t(v) for k_, v in det.items()})
    for name, h, d in (("center", c_h, c_d), ("radius", r_h, r_d)):
        d = d.cpu().numpy()
        assert np.array_equal(h.view(np.int64), d.view(np.int64)), \
            f"{name}: {int(np.sum(h != d))} of {h.size} differ (kinds {kinds})"


def test_block_enumeration_every_kind(monkeypatch):
    """Every kind of row at once (the property may not draw them all together), one seed per promotion; the
    second in chunks of two rows (``_CHUNK_ELEMS``: each chunk's block accumulators and variants of its own)."""
    import moeref.compare.device.emulated as em

    test_block_enumeration_equals_host.hypothesis.inner_test(3, "deepgemm", KINDS, True)
    monkeypatch.setattr(em, "_CHUNK_ELEMS", 2 * 3 * 160)  # K/128 = 3 blocks, N = 160
    test_block_enumeration_equals_host.hypothesis.inner_test(4, "a_then_b", KINDS, True)


def _replay_oracle(acc, variants, vbase, j0, nbit, ncomb, row_e, sa, wsc, ds, s_hi, coef, center, promotion):
    """``max_c (|y_c - center| + st_c)`` written out: per row and combination, the row's block accumulators with
    the varied blocks swapped in, the NumPy promotion (:func:`moeref.gemm.hopper_fp8.promote`) and the scale
    term summed in block order from 0."""
    from moeref.gemm.hopper_fp8 import promote

    r_all, nb, n = acc.shape
    worst = np.zeros((r_all, n))
    for r in range(r_all):  # a plain loop over rows and combinations
        sbr = np.repeat(wsc[row_e[r]], 128, axis=0)[:n]  # [N, NB], the weight scales as given
        for c in range(int(ncomb[r])):
            blocks = acc[r].astype(np.float64).copy()
            for kb in range(nb):
                if vbase[r, kb] >= 0:
                    blocks[kb] = variants[vbase[r, kb] + ((c >> j0[r, kb]) & ((1 << nbit[r, kb]) - 1))]
            y = promote(blocks.T[None], sa[r][None], sbr, promotion)[0]
            t1 = np.zeros(n)
            t2 = np.zeros(n)
            for kb in range(nb):
                m = np.abs(blocks[kb]) * np.abs(sbr[:, kb])
                t1 = t1 + m * ds[r, kb]
                t2 = t2 + m * s_hi[r, kb]
            worst[r] = np.maximum(worst[r], np.abs(y - center[r]) + (t1 + coef * t2))
    return worst


@pytest.mark.parametrize("promotion", ["deepgemm", "a_then_b"])
def test_promote_combinations_equals_plain_loop(promotion):
    """:func:`moeref.gemm.device_hopper_fp8.device_promote_combinations` (rows sorted by combination count and
    first varied block, the blocks before it promoted once) equals a plain loop over every combination, bit for
    bit: rows with no varied block, with one in the first or the last block, with two varied blocks of one and
    two codes; more rows than one program, N not a multiple of the column tile."""
    from moeref.gemm.device_hopper_fp8 import device_promote_combinations

    rng = np.random.default_rng(11)
    e, nb, n = 2, 3, 40
    # (varied blocks, their code counts) per row
    plans = [(), ((0, 1),), ((2, 1),), ((1, 2),), ((0, 1), (2, 2)), ((1, 3),), ((0, 2), (1, 2)), ((2, 4),)] * 3
    r_all = len(plans)
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    acc = f32(rng.standard_normal((r_all, nb, n)) * 100).astype(np.float32)
    vbase = np.full((r_all, nb), -1, dtype=np.int64)
    j0 = np.zeros((r_all, nb), dtype=np.int64)
    nbit = np.zeros((r_all, nb), dtype=np.int64)
    ncomb = np.ones(r_all, dtype=np.int64)
    v = 0
    for r, plan in enumerate(plans):
        j = 0
        for kb, bits in plan:
            vbase[r, kb], j0[r, kb], nbit[r, kb] = v, j, bits
            v += 1 << bits
            j += bits
        ncomb[r] = 1 << j
    variants = f32(rng.standard_normal((v, n)) * 100)
    row_e = rng.integers(0, e, r_all)
    sa = np.exp2(rng.integers(-9, -5, (r_all, nb))) * rng.choice([1.0, 1.5, 1.0 + 2.0**-30], (r_all, nb))
    wsc = np.exp2(rng.integers(-8, -4, (e, 1, nb))) * (1 + rng.random((e, 1, nb)))
    ds = rng.random((r_all, nb)) * 2.0**-12
    s_hi = rng.random((r_all, nb)) * 2.0**-6
    coef = 3.0 * 2.0**-24
    center = f32(rng.standard_normal((r_all, n)))
    want = _replay_oracle(acc, variants, vbase, j0, nbit, ncomb, row_e, sa, wsc, ds, s_hi, coef, center, promotion)
    t = lambda x: torch.as_tensor(x, device=DEV)  # noqa: E731
    w_d = StackedExperts(t(np.zeros((e, n, nb * 128), dtype=np.uint8)), t(wsc), "e4m3fn", (128, 128), (n, nb * 128))
    got = device_promote_combinations(t(acc), t(variants), t(vbase), t(j0), t(nbit), t(ncomb), row_e, t(sa), w_d,
                                      (t(ds), t(s_hi), coef), t(center), promotion=promotion).cpu().numpy()
    assert np.array_equal(want.view(np.int64), got.view(np.int64)), \
        f"{int(np.sum(want != got))} of {want.size} differ"
    assert np.all(want > 0)


def test_block_accumulators_equal_numpy_emulator():
    """:func:`moeref.gemm.device_hopper_fp8.device_block_accumulators` (one 128-column block per row, every
    (expert, K block) pair in one launch, rows in any order, a padding row) equals the NumPy emulator's block
    accumulator (:func:`moeref.gemm.hopper_fp8.deepgemm_block_accumulators`) of that block, bit for bit."""
    from moeref.gemm.device_hopper_fp8 import device_block_accumulators
    from moeref.gemm.hopper_fp8 import deepgemm_block_accumulators

    rng = np.random.default_rng(5)
    e, nb, n, r_all = 3, 3, 40, 13
    wcodes = rng.integers(0, 126, (e, n, nb * 128), dtype=np.uint8) | (rng.integers(0, 2, (e, n, nb * 128),
                                                                                     dtype=np.uint8) << 7)
    codes = rng.integers(0, 126, (r_all, 128), dtype=np.uint8) | (rng.integers(0, 2, (r_all, 128),
                                                                               dtype=np.uint8) << 7)
    vals = TABLE[codes]
    row_e = rng.integers(0, e, r_all)
    row_e[4] = -1
    kb = rng.integers(0, nb, r_all)
    want = np.zeros((r_all, n))
    for r in range(r_all):  # a plain loop over rows: each row's block against its expert's block
        if row_e[r] >= 0:
            w_blk = TABLE[wcodes[row_e[r], :, kb[r] * 128:(kb[r] + 1) * 128]]
            want[r] = deepgemm_block_accumulators(vals[r][None], w_blk)[0, :, 0]
    t = lambda x: torch.as_tensor(x, device=DEV)  # noqa: E731
    w_d = StackedExperts(t(wcodes), t(np.ones((e, 1, nb))), "e4m3fn", (128, 128), (n, nb * 128))
    got = device_block_accumulators(t(vals), row_e, kb, w_d).cpu().numpy()
    assert np.array_equal(want.view(np.int64), got.view(np.int64)), f"{int(np.sum(want != got))} differ"
    assert np.count_nonzero(want) > want.size // 2
    with pytest.raises(ValueError, match=r"k_block\[0\] = 3"):
        device_block_accumulators(t(vals), row_e, np.full(r_all, nb), w_d)
    with pytest.raises(ValueError, match=r"\[R, 128\]"):
        device_block_accumulators(t(vals[:, :64]), row_e, kb, w_d)
