"""GEMM2 of an emulated profile at the GEMM level: :func:`moeref.compare.device.emulated.device_emulated_gemm`
(uncertain codes enumerated per 128-column block, the promotion of every combination replayed from block
accumulators) against the host's :func:`moeref.compare.bounds._emulated_gemm` (every combination of a row's codes
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
