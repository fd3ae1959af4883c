"""The two bias placements with their own profiles, and ``assert_grouped_gemm_close(bias=...)``.

Each profile is checked for soundness against a small torch implementation of exactly the arithmetic it
declares (written here, not taken from moeref), over several seeds and shapes, and for power against planted
faults (the bias dropped, the bias added twice, a bf16 accumulator), which must fail:

* ``BF16_OUTPUT_BIAS_AFTER_STORE``: torch ``x @ w.T + b`` on bf16 tensors (the matmul returns bf16 from an
  FP32 accumulator; the add computes in FP32 and returns bf16), as gpt-oss's torch reference writes it;
* ``BF16_OUTPUT_BIAS_INIT``: an FP32 accumulator that starts at the bias (``acc = b; acc += x w``).
"""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from moeref.compare import PROFILES, Profile, compare, layer_bound  # noqa: E402
from moeref.moe import make_layer, make_tokens, run_moe  # noqa: E402
from moeref.moe.weights import MoEWeights  # noqa: E402
from moeref.routing import softmax_topk  # noqa: E402
from moeref.testing import MoEMismatch, assert_grouped_gemm_close  # noqa: E402

BF = torch.bfloat16
SHAPES = [(0, 13, 4, 128, 64, 2), (1, 29, 8, 256, 64, 4), (2, 5, 2, 64, 32, 1), (3, 40, 6, 384, 32, 2)]
"""(seed, tokens, experts, hidden K, intermediate N, top-k)."""
FAULTS = ("bias dropped", "bias added twice", "bf16 accumulation")


def _accumulate(x, w, b, chunk: int, acc_dtype=torch.float32):
    """``x @ w.T`` accumulated over K chunks of ``chunk`` columns (FP32 products of each chunk) into an
    accumulator of ``acc_dtype`` (bf16: the fault) that starts at ``b`` (None: at 0)."""
    acc = torch.zeros(x.shape[0], w.shape[0]) if b is None else b.float().expand(x.shape[0], -1).clone()
    acc = acc.to(acc_dtype)
    for c in range(0, x.shape[1], chunk):
        acc = (acc.float() + x[:, c:c + chunk].float() @ w[:, c:c + chunk].float().T).to(acc_dtype)
    return acc.float()


def _torch_layer(x, w13, w2, b13, b2, tw, ids, bias_add: str, fault=None, chunk: int = 16):
    """A gate_up SiLU MoE layer in torch: per slot and expert GEMM1 with its bias placed as ``bias_add``
    says, ``silu(gate) * up`` in FP32 stored in bf16, GEMM2 likewise, ``out += w * y`` in FP32, bf16 output."""
    m, k = ids.shape
    out = torch.zeros(m, x.shape[1])
    acc_dtype = BF if fault == "bf16 accumulation" else torch.float32
    for j in range(k):  # a loop over slots and experts: the kernel under test, not a reference
        for e in torch.unique(ids[:, j]).tolist():
            rows = (ids[:, j] == e).nonzero().flatten()
            b1 = None if fault == "bias dropped" else b13[e]
            if bias_add == "after_store":
                h = _accumulate(x[rows], w13[e], None, chunk, BF).to(BF) if acc_dtype == BF else x[rows] @ w13[e].T
                h = h if b1 is None else h + b1                      # bf16 + bf16 -> FP32 add, bf16 result
                h = h + b1 if fault == "bias added twice" else h
            else:
                h = _accumulate(x[rows], w13[e], b1, chunk, acc_dtype)
                h = (h + b1.float() if fault == "bias added twice" else h).to(BF)
            gate, up = h.float().chunk(2, dim=-1)
            a = (F.silu(gate) * up).to(BF)
            if bias_add == "after_store":
                y = a @ w2[e].T + b2[e]
            else:
                y = _accumulate(a, w2[e], b2[e], chunk).to(BF)
            out[rows] += tw[rows, j, None] * y.float()
    return out.to(BF)


def _bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _fails(out, ref, bound) -> bool:
    """Some element of ``out`` lies outside ``bound`` (a :func:`layer_bound` of ``ref``; what
    :func:`compare` decides, with the bound computed once for the faults of one case)."""
    err = np.abs(np.asarray(out.float(), np.float64) - np.asarray(ref.output, np.float64))
    return bool(np.any(~(err <= bound.bound)))


def _case(seed, m, num_experts, k, n, top_k, bias_add: str, bias_scale: float = 1.0):
    """The reference run of a biased bf16 layer and the torch tensors the kernel reads (bf16 biases for
    ``after_store``, torch's bf16 ``+ b``; FP32 biases for the accumulator's initial value)."""
    lw = make_layer(num_experts, k, n, seed=seed, bias=True)
    w13, w2 = np.stack([_bf16(w) for w in lw.w13]), np.stack([_bf16(w) for w in lw.w2])
    b13, b2 = lw.b13 * np.float32(bias_scale), lw.b2 * np.float32(bias_scale)
    if bias_add == "after_store":
        b13, b2 = _bf16(b13), _bf16(b2)
    x = _bf16(make_tokens(m, k, seed=seed + 1))
    r = softmax_topk(np.random.default_rng(seed).standard_normal((m, num_experts)), top_k, renormalize=True)
    tw, ids = np.asarray(r.weights, np.float32), np.asarray(r.ids)
    ref = run_moe(x, MoEWeights(list(w13), list(w2), "gate_up", b13, b2), tw, ids, out_dtype="bfloat16")
    t = lambda v: torch.from_numpy(np.ascontiguousarray(v))  # noqa: E731
    tb = (lambda v: t(v).to(BF)) if bias_add == "after_store" else t
    return ref, (t(x).to(BF), t(w13).to(BF), t(w2).to(BF), tb(b13), tb(b2), t(tw), t(ids).long())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{1}-E{2}-K{3}-N{4}-k{5}".format(*s))
def test_bias_after_store_profile_is_sound_and_catches_faults(shape):
    ref, args = _case(*shape, "after_store")
    honest = _torch_layer(*args, "after_store")
    assert compare(honest, ref, "BF16_OUTPUT_BIAS_AFTER_STORE").passed
    bound = layer_bound(ref, "BF16_OUTPUT_BIAS_AFTER_STORE")
    assert not _fails(honest, ref, bound)
    for fault in FAULTS:
        assert _fails(_torch_layer(*args, "after_store", fault), ref, bound), fault


def test_bias_after_store_is_another_arithmetic_than_the_epilogue_bias():
    """The second rounding is real: BF16_OUTPUT (bias added before the one store) rejects the honest
    torch layer on every shape here."""
    for shape in SHAPES:
        ref, args = _case(*shape, "after_store")
        assert _fails(_torch_layer(*args, "after_store"), ref, layer_bound(ref, "BF16_OUTPUT"))


@pytest.mark.parametrize("shape, bias_scale", [(s, 1.0) for s in SHAPES] + [(SHAPES[0], 30.0), (SHAPES[2], 30.0)],
                         ids=lambda v: "M{1}-E{2}-K{3}-N{4}-k{5}".format(*v) if isinstance(v, tuple) else f"bias-x{v:g}")
def test_bias_as_accumulator_init_profile_is_sound_and_catches_faults(shape, bias_scale):
    ref, args = _case(*shape, "accumulator_init", bias_scale)
    assert compare(_torch_layer(*args, "accumulator_init"), ref, "BF16_OUTPUT_BIAS_INIT").passed
    bound = layer_bound(ref, "BF16_OUTPUT_BIAS_INIT")
    for chunk in (1, 16):  # a sequential FP32 chain and chunked FP32 products
        assert not _fails(_torch_layer(*args, "accumulator_init", chunk=chunk), ref, bound), chunk
    for fault in FAULTS:
        assert _fails(_torch_layer(*args, "accumulator_init", fault), ref, bound), fault


def test_bias_profiles_are_bf16_output_on_a_layer_without_bias():
    """Where no bias is added, the placement does not matter: the same bound, bit for bit."""
    lw = make_layer(4, 128, 64, seed=3)
    r = softmax_topk(np.random.default_rng(3).standard_normal((11, 4)), 2)
    run = run_moe(make_tokens(11, 128, seed=4), lw, r.weights, r.ids, out_dtype="bfloat16")
    base = layer_bound(run, "BF16_OUTPUT").bound
    for name in ("BF16_OUTPUT_BIAS_AFTER_STORE", "BF16_OUTPUT_BIAS_INIT"):
        assert np.array_equal(layer_bound(run, name).bound, base)


def test_bias_add_is_validated():
    assert PROFILES["BF16_OUTPUT_BIAS_AFTER_STORE"].bias_add == "after_store"
    assert PROFILES["BF16_OUTPUT_BIAS_INIT"].bias_add == "accumulator_init"
    with pytest.raises(ValueError, match="bias_add must be one of 'epilogue', 'after_store', 'accumulator_init'; "
                                         "got 'before'"):
        Profile("p", bias_add="before")
    with pytest.raises(ValueError, match="needs a declared GEMM output store"):
        Profile("p", bias_add="after_store")
    with pytest.raises(ValueError, match="accum_model='emulated'"):
        replace(PROFILES["DEEPGEMM_FP8_EXACT"], bias_add="accumulator_init")


# ---------------------------------------------------------------------------------- grouped GEMM with a bias


def _grouped(seed: int, bias_scale: float = 1.0, bias_dtype=torch.float32):
    rng = np.random.default_rng(seed)
    a = torch.from_numpy(rng.standard_normal((20, 256)).astype(np.float32)).bfloat16()
    w = torch.from_numpy(rng.standard_normal((3, 48, 256)).astype(np.float32)).bfloat16()
    b = torch.from_numpy((rng.standard_normal((3, 48)) * bias_scale).astype(np.float32)).to(bias_dtype)
    rows = np.array([0] * 7 + [2] * 10 + [-1] * 3)  # contiguous, an empty expert, 3 padding rows
    return a, w, b, rows


def _grouped_candidate(a, w, b, rows, kernel: str, fault=None):
    """A grouped GEMM with a bias: ``"epilogue"`` (FP32 accumulation, bias added in FP32, one bf16 store),
    ``"after_store"`` (torch bf16 ``a @ w.T + b``), ``"init"`` (FP32 sequential chain from the bias, FP32 out)."""
    out = torch.full((rows.size, w.shape[1]), 7.0)  # padding rows: unspecified
    for e in np.unique(rows[rows >= 0]).tolist():
        r = torch.from_numpy(np.flatnonzero(rows == e))
        be = {None: b[e], "bias dropped": 0 * b[e], "bias added twice": 2 * b[e], "wrong expert's bias": b[e - 1]}[fault]
        if kernel == "after_store":
            out[r] = (a[r] @ w[e].T + be).float()
        elif kernel == "init":
            out[r] = _accumulate(a[r], w[e], be, 1)
        else:
            out[r] = (_accumulate(a[r], w[e], None, 32) + be.float()).to(BF).float()
    return out.to(BF) if kernel != "init" else out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kernel, profile", [
    ("epilogue", "BF16_OUTPUT"), ("after_store", "BF16_OUTPUT_BIAS_AFTER_STORE"),
    ("init", replace(PROFILES["FP32_ACCUM"], name="FP32_ACCUM_BIAS_INIT", bias_add="accumulator_init"))])
def test_assert_grouped_gemm_close_with_a_bias(seed, kernel, profile):
    a, w, b, rows = _grouped(seed, 3000.0 if kernel == "init" else 1.0,
                             BF if kernel == "after_store" else torch.float32)
    rep = assert_grouped_gemm_close(_grouped_candidate(a, w, b, rows, kernel), a, w, profile, m_indices=rows, bias=b)
    assert rep.passed and rep.violations.sum() == 0
    for fault in ("bias dropped", "bias added twice", "wrong expert's bias"):
        with pytest.raises(MoEMismatch) as exc:
            assert_grouped_gemm_close(_grouped_candidate(a, w, b, rows, kernel, fault), a, w, profile,
                                      m_indices=rows, bias=b)
        bad_rows = np.flatnonzero(exc.value.report.token_violations)
        assert set(rows[bad_rows].tolist()) <= {0, 2} and bad_rows.size > 0, fault
    with pytest.raises(MoEMismatch):  # the bias left out of the check: the honest output fails
        assert_grouped_gemm_close(_grouped_candidate(a, w, b, rows, kernel), a, w, profile, m_indices=rows)


def test_grouped_bias_at_init_needs_its_profile():
    """A large bias as the accumulator's initial value rounds with every add: the epilogue's one bias
    rounding (FP32_ACCUM) does not cover the honest chain, the accumulator_init bound does."""
    a, w, b, rows = _grouped(0, 3000.0)
    out = _grouped_candidate(a, w, b, rows, "init")
    with pytest.raises(MoEMismatch):
        assert_grouped_gemm_close(out, a, w, "FP32_ACCUM", m_indices=rows, bias=b)
    assert assert_grouped_gemm_close(out, a, w, replace(PROFILES["FP32_ACCUM"], bias_add="accumulator_init"),
                                     m_indices=rows, bias=b).passed


def test_grouped_bias_is_validated():
    a, w, b, rows = _grouped(0)
    out = _grouped_candidate(a, w, b, rows, "epilogue")
    with pytest.raises(ValueError, match=r"bias must be per expert, shape \[E, N\] = \(3, 48\); got \(48,\)"):
        assert_grouped_gemm_close(out, a, w, "BF16_OUTPUT", m_indices=rows, bias=b[0])
    with pytest.raises(TypeError, match="bias must be a float tensor"):
        assert_grouped_gemm_close(out, a, w, "BF16_OUTPUT", m_indices=rows, bias=np.zeros((3, 48), np.int32))
    with pytest.raises(ValueError, match="predicts a bias-free GEMM bit for bit"):
        assert_grouped_gemm_close(out, a, w, "DEEPGEMM_FP8_EXACT", m_indices=rows, bias=b)


def test_device_engine_refuses_a_bias_placement_it_does_not_bound():
    """The device engine bounds the epilogue bias only: a biased layer under another placement raises,
    naming the profile and the way out, instead of a bound of another arithmetic."""
    pytest.importorskip("triton")
    lw = make_layer(2, 64, 32, seed=1, bias=True)
    r = softmax_topk(np.random.default_rng(0).standard_normal((5, 2)), 1)
    run = run_moe(make_tokens(5, 64), lw, r.weights, r.ids, device="cpu")
    with pytest.raises(ValueError, match="device engine bounds bias_add='epilogue' only; profile BF16_OUTPUT_BIAS_INIT"):
        layer_bound(run, "BF16_OUTPUT_BIAS_INIT")
    assert layer_bound(run, "BF16_OUTPUT").bound.shape == (5, 64)
