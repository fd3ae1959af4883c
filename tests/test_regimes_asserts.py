"""``regime="exact"`` in the user's hands: assert_moe_close / assert_grouped_gemm_close check by equality
and report the differing elements with token, expert and slot."""
from __future__ import annotations

import numpy as np
import pytest

from moeref.regimes import exact_layer, exact_operand, in_exact_regime
from moeref.testing import MoEMismatch, assert_grouped_gemm_close, assert_moe_close


def test_assert_moe_close_exact_passes_and_names_the_token():
    lay = exact_layer(6, 256, 128, 4, 2, seed=4)
    run = lay.reference()
    rep = assert_moe_close(run.out, lay, regime="exact")
    assert rep.passed and rep.num_elements == 6 * 256
    bad = run.out.copy()
    bad[3, 7] = -bad[3, 7] + 1  # one element changed (hand-made fault)
    with pytest.raises(MoEMismatch) as exc:
        assert_moe_close(bad, run, regime="exact")
    r = exc.value.report
    assert r.num_differences == 1
    d = r.differing[0]
    assert d["index"] == (3, 7) and d["token"] == 3
    assert d["experts"] == lay.topk_ids[3].tolist() and d["slots"] == [6, 7]
    assert set(r.by_expert) == set(lay.topk_ids[3].tolist())
    assert "token 3" in str(exc.value)
    with pytest.raises(MoEMismatch) as exc2:  # given the layer, the failure keeps its case (for reproducers)
        assert_moe_close(bad, lay, regime="exact")
    from moeref.compare.faults import LayerCase

    assert isinstance(exc2.value.case, LayerCase) and exc2.value.candidate.shape == bad.shape


def test_assert_moe_close_exact_sees_one_bf16_ulp():
    """The next bf16 value in one output element is a difference."""
    lay = exact_layer(6, 256, 128, 4, 2, seed=4)
    run = lay.reference()
    out = run.out.astype(np.float32)
    i = np.flatnonzero(out.reshape(-1) != 0)[0]
    bits = out.reshape(-1).view(np.uint32)
    bits[i] += 1 << 16  # the next bf16 value
    import ml_dtypes

    cand = out.astype(ml_dtypes.bfloat16)
    with pytest.raises(MoEMismatch):
        assert_moe_close(cand, run, regime="exact")


def test_regime_argument_checked():
    lay = exact_layer(2, 256, 128, 2, 1, seed=0)
    with pytest.raises(ValueError, match="regime"):
        assert_moe_close(lay.reference().out, lay, regime="sound")
    with pytest.raises(TypeError, match="profile"):
        assert_moe_close(lay.reference().out, lay.reference())


def test_assert_grouped_gemm_close_exact():
    a = exact_operand((6, 256), "bfloat16", seed=1, max_abs=4)
    w = np.stack([exact_operand((16, 256), "bfloat16", seed=s, max_abs=4) for s in (2, 3)])
    m_indices = np.array([0, 0, 1, 1, 1, -1])
    assert in_exact_regime((a, list(w), m_indices), "fp32").ok
    af, wf = a.astype(np.float64), w.astype(np.float64)
    exact = np.stack([af[r] @ wf[max(e, 0)].T for r, e in enumerate(m_indices)])  # independent float64 product
    import ml_dtypes

    cand = exact.astype(np.float32).astype(ml_dtypes.bfloat16)
    rep = assert_grouped_gemm_close(cand, a, w, regime="exact", layout="contiguous", m_indices=m_indices)
    assert rep.passed
    cand2 = cand.copy()
    cand2[3, 2] = cand2[3, 2] + ml_dtypes.bfloat16(64.0)
    with pytest.raises(MoEMismatch) as exc:
        assert_grouped_gemm_close(cand2, a, w, regime="exact", layout="contiguous", m_indices=m_indices)
    r = exc.value.report
    assert r.num_differences == 1 and r.differing[0]["experts"] == [1] and r.by_expert == {1: 1}


def test_grouped_gemm_exact_standard_layout_names_token_and_slot():
    x = exact_operand((3, 128), "float32", seed=5, max_abs=3)
    w = np.stack([exact_operand((8, 128), "float32", seed=s, max_abs=3) for s in (6, 7, 8)])
    ids = np.array([[0, 2], [1, 0], [2, 1]])
    exact = np.stack([x[t].astype(np.float64) @ w[ids[t, j]].T.astype(np.float64) for t in range(3) for j in range(2)])
    cand = exact.astype(np.float32).reshape(3, 2, 8).copy()
    cand[2, 1, 4] += 1.0
    with pytest.raises(MoEMismatch) as exc:
        assert_grouped_gemm_close(cand, x, w, regime="exact", layout="standard", topk_ids=ids)
    d = exc.value.report.differing[0]
    assert d["token"] == 2 and d["slots"] == [5] and d["experts"] == [1]
