"""The tensor-core source of :func:`moeref.gemm.device_hopper_fp8.device_deepgemm_rows` and its per-call proof.

* CPU (CI): the source switch (``ACCUMULATOR_SOURCE`` / ``source``: the emulator wherever the tensor cores are not
  Hopper's, a clear error when they are asked for there), the proved rows (:func:`proof_rows`, against hand-derived
  indices), a planted disagreement on a proved row raising :class:`AccumulatorMismatchError` with the row, the
  column and both values (the tensor cores' result stood in for by the emulator's with one value changed), and the
  tensor-core form of the kernel run by the interpreter on data where every sum is exact (the interpreter's
  ``tl.dot`` is exact, Hopper's adder too on such data) against the NumPy emulator.
* CPU, compiled for sm_90a without a GPU: the tensor-core form is four chained ``wgmma ... k32`` from a cleared
  accumulator.
* GPU (Hopper only): the tensor-core source equals the emulator bit for bit on every output, block accumulator
  and scale term of moderate shapes at DeepSeek-V3's K (random data of tests/test_hopper_fp8_gpu.py).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device  # noqa: E402
from moeref.gemm import StackedExperts  # noqa: E402
from moeref.gemm.device import DeviceOperand  # noqa: E402
import moeref.gemm.device_hopper_fp8 as dh  # noqa: E402
from moeref.gemm.device_hopper_fp8 import AccumulatorMismatchError, device_deepgemm_rows, proof_rows  # noqa: E402
from moeref.gemm.hopper_fp8 import MmaModel, deepgemm_block_accumulators, promote  # noqa: E402
from tests.test_hopper_fp8_gpu import _values  # noqa: E402

DEV = device()
_TC_HERE = dh.tensor_cores_available(DEV)


def _operands(a, sa, b, sb, dev=DEV):
    n, k = b.shape[1:]
    ad = DeviceOperand(None, torch.as_tensor(np.ascontiguousarray(a).view(np.uint8), device=dev), "e4m3fn",
                       torch.as_tensor(np.asarray(sa, np.float64), device=dev), (1, 128), True)
    w = StackedExperts(torch.as_tensor(np.ascontiguousarray(b).view(np.uint8), device=dev),
                       torch.as_tensor(np.asarray(sb, np.float64), device=dev), "e4m3fn", (128, 128), (n, k))
    return ad, w


def _small(seed=0, r=12, e=3, n=96, k=256, kind="normal"):
    rng = np.random.default_rng(seed)
    a = _values(rng, (r, k), kind)
    b = _values(rng, (e, n, k), kind)
    sa = rng.uniform(0.1, 1, (r, k // 128)).astype(np.float32).astype(np.float64)
    sb = rng.uniform(0.1, 1, (e, -(-n // 128), k // 128)).astype(np.float32).astype(np.float64)
    rows = np.array([1, -1, 0, 2, 0, 1, 1, -1, 2, 0, 0, 1][:r])
    return a, sa, b, sb, rows


@pytest.fixture
def sources(monkeypatch):
    """Records the source of every kernel run (``_rows``'s ``tc``), running the real one."""
    seen = []
    real = dh._rows

    def rows_(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(dh, "_rows", rows_)
    return seen


def test_proof_rows_by_hand():
    """rows [-1, 2, 0, 0, 2, 1, -1, 0, 1, 1, 2, 0]: in expert order S = [2, 3, 7, 11, 5, 8, 9, 1, 4, 10] (V = 10)."""
    rows = np.array([-1, 2, 0, 0, 2, 1, -1, 0, 1, 1, 2, 0])
    assert proof_rows(rows, 1, 0.0).tolist() == [2, 3, 7, 11]                  # one run: S[0:4]
    assert proof_rows(rows, 5, 0.0).tolist() == [1, 2, 3, 4, 7, 8, 9, 11]      # u = 2 runs: S[0:4], S[5:9]
    assert proof_rows(rows, 1, 0.5).tolist() == [1, 2, 3, 4, 7, 8, 9, 11]      # m = ceil(0.5 * 10) = 5
    assert proof_rows(rows, 10, 0.0).tolist() == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]  # m = V: every valid row
    assert proof_rows(rows, 100, 0.0).tolist() == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]
    assert proof_rows(np.full(5, -1), 3, 0.5).size == 0                         # no row to prove


def test_proof_rows_spread_and_share():
    """1000 rows of 10 experts (100 each, in order): 1/128 of them is 8 < 32, so 32 rows in 8 runs of 4 starting
    at floor(j * 1000 / 8) = 125 j."""
    rows = np.repeat(np.arange(10), 100)
    want = (125 * np.arange(8)[:, None] + np.arange(4)[None, :]).reshape(-1)
    assert proof_rows(rows, 32, 1 / 128).tolist() == want.tolist()
    big = np.repeat(np.arange(256), 128)  # DeepSeek-V3 at 4096 tokens: 32,768 rows, 1/128 of them = 256
    assert proof_rows(big, 32, 1 / 128).size == 256


def test_proof_rows_refuses_bad_sizes():
    rows = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="check_rows must be >= 1"):
        proof_rows(rows, 0, 0.5)
    with pytest.raises(ValueError, match="check_fraction"):
        proof_rows(rows, 4, 1.5)
    with pytest.raises(TypeError, match="check_rows must be an int"):
        proof_rows(rows, 2.0)
    with pytest.raises(TypeError, match="check_fraction must be a float"):
        proof_rows(rows, 2, "all")


@pytest.mark.skipif(_TC_HERE, reason="this machine has Hopper tensor cores: the next test covers it")
def test_source_switch_on_cpu(sources, monkeypatch):
    """Here (no Hopper GPU) ``"auto"`` runs the emulator; ``"tensor_cores"`` is refused naming what it needs; an
    unknown source is refused; the module switch is read when ``source`` is None."""
    a, sa, b, sb, rows = _small()
    ad, w = _operands(a, sa, b, sb)
    assert not dh.tensor_cores_available(DEV)
    device_deepgemm_rows(ad, rows, w)
    device_deepgemm_rows(ad, rows, w, source="emulator")
    assert sources == [False, False]
    with pytest.raises(ValueError, match=r"capability \(9, 0\)"):
        device_deepgemm_rows(ad, rows, w, source="tensor_cores")
    with pytest.raises(ValueError, match="source must be one of"):
        device_deepgemm_rows(ad, rows, w, source="wgmma")
    monkeypatch.setattr(dh, "ACCUMULATOR_SOURCE", "tensor_cores")
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        device_deepgemm_rows(ad, rows, w)


def test_source_switch_where_tensor_cores_are_available(sources, monkeypatch):
    """With the tensor cores available (patched: the interpreter stands in), ``"auto"`` takes them for the
    calibrated model only, and the emulator proves the call (one more run, on the emulator); ``"emulator"`` and
    the module switch keep the emulator; another model with ``"tensor_cores"`` is refused."""
    a, sa, b, sb, rows = _small(kind="codes")
    a = (np.abs(a.astype(np.float64)) > 0).astype(a.dtype)  # ones and zeros: every sum exact (see the kernel test)
    b = np.sign(b.astype(np.float64)).astype(b.dtype)
    ad, w = _operands(a, sa, b, sb)
    monkeypatch.setattr(dh, "tensor_cores_available", lambda dev: True)
    device_deepgemm_rows(ad, rows, w)
    assert sources == [True, False]                       # the tensor cores, then the proof on the emulator
    sources.clear()
    device_deepgemm_rows(ad, rows, w, source="emulator")
    device_deepgemm_rows(ad, rows, w, model=MmaModel(align_bits=14))
    monkeypatch.setattr(dh, "ACCUMULATOR_SOURCE", "emulator")
    device_deepgemm_rows(ad, rows, w)
    assert sources == [False, False, False]
    with pytest.raises(ValueError, match="HOPPER_FP8_MMA only"):
        device_deepgemm_rows(ad, rows, w, model=MmaModel(align_bits=14), source="tensor_cores")


def _numpy(a, sa, b, sb, rows, promotion):
    """The specification (NumPy emulator): outputs ``[R, N]`` and block accumulators ``[R, K/128, N]``, 0 on
    padding rows."""
    n, k = b.shape[1:]
    out = np.zeros((rows.size, n))
    accs = np.zeros((rows.size, k // 128, n))
    for e in np.unique(rows[rows >= 0]):  # a loop over a few experts
        idx = np.flatnonzero(rows == e)
        acc = deepgemm_block_accumulators(a[idx].astype(np.float64), b[e].astype(np.float64))
        out[idx] = promote(acc, sa[idx], np.repeat(sb[e], 128, axis=0)[:n], promotion)
        accs[idx] = acc.transpose(0, 2, 1)
    return out, accs


@pytest.mark.parametrize("promotion", ["deepgemm", "a_then_b"])
def test_tensor_core_kernel_on_exact_data(monkeypatch, promotion):
    """The kernel's tensor-core form under the interpreter (forced available) on E4M3 integers in [-4, 4]: every
    product and every block sum (|.| <= 2048 < 2^14) is exact in the interpreter's ``tl.dot`` and in Hopper's
    adder, so the outputs and block accumulators equal the NumPy emulator's, and every row is proved; also with
    ``values`` (float64 E4M3 values given instead of the codes) and on an operand held as float64 values."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    r, e, n, k = 12, 3, 80, 256
    f8 = ml_dtypes.float8_e4m3fn
    a = rng.integers(-4, 5, (r, k)).astype(np.float32).astype(f8)
    b = rng.integers(-4, 5, (e, n, k)).astype(np.float32).astype(f8)
    sa = rng.uniform(0.1, 1, (r, k // 128)).astype(np.float32).astype(np.float64)
    sb = rng.uniform(0.1, 1, (e, 1, k // 128)).astype(np.float32).astype(np.float64)
    rows = np.array([1, -1, 0, 2, 0, 1, 1, -1, 2, 0, 0, 1])
    ad, w = _operands(a, sa, b, sb)
    monkeypatch.setattr(dh, "tensor_cores_available", lambda dev: True)
    want, want_acc = _numpy(a, sa, b, sb, rows, promotion)
    exact = np.einsum("rbk,rnbk->rbn", a.astype(np.float64).reshape(r, 2, 128),
                      b.astype(np.float64)[np.maximum(rows, 0)].reshape(r, n, 2, 128))
    assert np.array_equal(want_acc[rows >= 0], exact[rows >= 0])  # the data are what the test says they are
    got, _, acc = device_deepgemm_rows(ad, rows, w, promotion=promotion, block_acc=True, source="tensor_cores")
    assert np.array_equal(got.cpu().numpy(), want)
    assert np.array_equal(acc.cpu().numpy().astype(np.float64), want_acc)
    vals = torch.as_tensor(a.astype(np.float64), device=DEV)
    zeros = DeviceOperand(None, torch.zeros((r, k), dtype=torch.uint8, device=DEV), "e4m3fn", ad.scales, (1, 128),
                          True)
    got_v = device_deepgemm_rows(zeros, rows, w, promotion=promotion, values=vals, source="tensor_cores")
    assert np.array_equal(got_v.cpu().numpy(), want)
    as_values = DeviceOperand(vals, None, None, ad.scales, (1, 128), True)
    got_f = device_deepgemm_rows(as_values, rows, w, promotion=promotion, source="tensor_cores")
    assert np.array_equal(got_f.cpu().numpy(), want)


def _planted(monkeypatch, row, col, block=None):
    """The tensor cores stood in for by the emulator (its bits), with the value at ``row``, ``col`` (of the
    output, or of block accumulator ``block``) moved one FP32 ulp up."""
    real = dh._rows
    monkeypatch.setattr(dh, "tensor_cores_available", lambda dev: True)

    def rows_(a, rows, weights, promotion, model, values, scale_term, block_acc, tc):
        got = real(a, rows, weights, promotion, model, values, scale_term, block_acc, False)
        if tc:
            t = got[2][row, block] if block is not None else (got[0] if isinstance(got, tuple) else got)[row]
            t[col] = float(np.nextafter(np.float32(float(t[col])), np.float32(np.inf)))
        return got

    monkeypatch.setattr(dh, "_rows", rows_)


def test_planted_disagreement_on_a_proved_row_raises(monkeypatch):
    """One output value moved on a proved row: AccumulatorMismatchError naming the row, its expert, the column and
    both values; nothing returned."""
    a, sa, b, sb, rows = _small(kind="codes")
    ad, w = _operands(a, sa, b, sb)
    ref = device_deepgemm_rows(ad, rows, w, source="emulator").cpu().numpy()
    proved = proof_rows(rows, 1, 0.0)             # one run of 4 rows: [2, 4, 9, 10] (expert 0)
    assert proved.tolist() == [2, 4, 9, 10]
    _planted(monkeypatch, 9, 17)
    moved = float(np.nextafter(np.float32(ref[9, 17]), np.float32(np.inf)))
    with pytest.raises(AccumulatorMismatchError) as err:
        device_deepgemm_rows(ad, rows, w, check_rows=1, check_fraction=0.0)
    msg = str(err.value)
    assert "output" in msg and "row 9 (expert 0)" in msg and "column 17" in msg
    assert repr(moved) in msg and repr(float(ref[9, 17])) in msg


def test_planted_disagreement_in_a_block_accumulator_raises(monkeypatch):
    """A block accumulator moved (``block_acc=True``): the error names the row, the column and the K block."""
    a, sa, b, sb, rows = _small(kind="normal")
    ad, w = _operands(a, sa, b, sb)
    _planted(monkeypatch, 4, 60, block=1)
    with pytest.raises(AccumulatorMismatchError,
                       match=r"block accumulator .* row 4 \(expert 0\), column 60, K block 1"):
        device_deepgemm_rows(ad, rows, w, block_acc=True, check_rows=1, check_fraction=0.0)


def test_planted_disagreement_outside_the_proved_rows_is_returned(monkeypatch):
    """The proof is a sample: a value moved on a row it does not cover (row 5, expert 1) comes back unchanged by
    it; with every row proved (``check_rows >= rows``) the same plant raises."""
    a, sa, b, sb, rows = _small(kind="normal")
    ad, w = _operands(a, sa, b, sb)
    ref = device_deepgemm_rows(ad, rows, w, source="emulator").cpu().numpy()
    _planted(monkeypatch, 5, 3)
    got = device_deepgemm_rows(ad, rows, w, check_rows=1, check_fraction=0.0).cpu().numpy()
    assert got[5, 3] != ref[5, 3] and np.array_equal(np.delete(got, 5, 0), np.delete(ref, 5, 0))
    with pytest.raises(AccumulatorMismatchError, match="row 5"):
        device_deepgemm_rows(ad, rows, w, check_rows=rows.size)


@pytest.mark.gpu
def test_tensor_cores_equal_emulator_on_full_data():
    """Hopper only: the tensor-core source against the emulator on every output, block accumulator and scale term
    (bit for bit) at K = 2048 and 7168, 600 rows over 5 experts with padding, N = 960 (a partial column tile),
    both promotions, the data of tests/test_hopper_fp8_gpu.py."""
    if not torch.cuda.is_available() or not dh.tensor_cores_available("cuda"):
        pytest.skip("needs a Hopper GPU (CUDA capability (9, 0)) with compiled Triton kernels; elsewhere "
                    "device_deepgemm_rows runs the emulator only")
    total = 0
    for i, (k, kind, promotion) in enumerate([(7168, "normal", "deepgemm"), (7168, "codes", "a_then_b"),
                                              (2048, "outliers", "deepgemm"), (2048, "positive", "a_then_b")]):
        rng = np.random.default_rng(100 + i)
        r, e, n = 600, 5, 960
        a, b = _values(rng, (r, k), kind), _values(rng, (e, n, k), kind)
        sa = (2.0 ** rng.uniform(-12, 0, (r, k // 128))).astype(np.float32).astype(np.float64)
        sb = (2.0 ** rng.uniform(-14, -6, (e, -(-n // 128), k // 128))).astype(np.float32).astype(np.float64)
        rows = rng.integers(-1, e, r)
        ad, w = _operands(a, sa, b, sb, "cuda")
        st_in = (torch.rand((r, k // 128), dtype=torch.float64, device="cuda") * 2.0**-20,
                 torch.rand((r, k // 128), dtype=torch.float64, device="cuda"), 3.0 * 2.0**-24)
        kw = dict(promotion=promotion, block_acc=True, scale_term=st_in)
        tc = device_deepgemm_rows(ad, rows, w, source="tensor_cores", **kw)
        em = device_deepgemm_rows(ad, rows, w, source="emulator", **kw)
        for name, x, y in zip(("output", "scale term", "block accumulator"), tc, em):
            bits = torch.int64 if x.dtype == torch.float64 else torch.int32
            differ = int((x.view(bits) != y.view(bits)).sum())
            assert differ == 0, f"{differ} of {x.numel()} {name} values differ (K={k}, {kind}, {promotion})"
        total += tc[2].numel()
    print(f"\n[tensor cores] {total} block accumulators at K = 2048/7168, all equal to the emulator")


_COMPILE_SM90 = r'''
import json, os, re
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from moeref.gemm._hopper_fp8_kernel import hopper_fp8_kernel as fn
from moeref.gemm.device_hopper_fp8 import TC_TILE
ptrs = dict(a_ptr="*u8", sa_ptr="*fp64", codes_ptr="*u8", table_ptr="*fp64", itab_ptr="*i32", sb_ptr="*fp64",
            sbr_ptr="*fp64", item_ptr="*i32", out_ptr="*fp64", ds_ptr="*fp64", shi_ptr="*fp64", st_ptr="*fp64",
            coef_ptr="*fp64", acc_ptr="*fp32")
rows, bn, warps = TC_TILE
const = dict(W_BN=128, ROWS=rows, BLOCK_N=bn, PROMO=0, SCALE_TERM=False, ALIGN=13, NORM=14, STEPS=4, INST=32,
             STORE_ACC=True, INTEGER=True, TC=True)
sig = {a: ("constexpr" if a in const else ptrs.get(a, "i32")) for a in fn.arg_names}
src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, enable_fp_fusion=False))
from moeref.gemm._hopper_fp8_kernel import hopper_fp8_block_kernel as fb  # the uncertain blocks' accumulators
cb = dict(ROWS=rows, BLOCK_N=bn, ALIGN=13, NORM=14, STEPS=4, INST=32, INTEGER=True, TC=True)
sb = {a: ("constexpr" if a in cb else ptrs.get(a, "i32")) for a in fb.arg_names}
kb = triton.compile(triton.compiler.ASTSource(fn=fb, signature=sb, constexprs=cb), target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=warps, enable_fp_fusion=False))
print(json.dumps([re.findall(r"wgmma\.mma_async\S*[^;]*;", x.asm["ptx"]) for x in (k, kb)]))
'''


def test_tensor_core_form_compiles_to_four_chained_wgmma_k32():
    """Compiled for sm_90a (no GPU needed: Triton's NVIDIA backend and its ptxas), a block accumulator of the
    tensor-core form (the GEMM's kernel, and the one-block kernel of the uncertain blocks) is four
    ``wgmma.mma_async ... k32.f32.e4m3.e4m3`` on one accumulator, the first with ``scale-d = 0`` (a cleared
    accumulator), the others accumulating: the instruction sequence the emulator's model was calibrated on. (A
    Triton that split the K = 128 dot, e.g. promoting partial sums on fp8 dots, fails
    here.)"""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
    if proc.returncode and ("ptxas" in proc.stderr and "not found" in proc.stderr.lower()):
        pytest.skip(f"Triton's NVIDIA toolchain is not installed here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mma in json.loads(proc.stdout.strip().splitlines()[-1]):  # the GEMM's kernel, the one-block kernel
        assert len(mma) == 4 and all(re.search(r"\.m64n\d+k32\.f32\.e4m3\.e4m3 ", m) for m in mma), mma
        accs = {re.search(r"\{[^}]*\}", m).group(0) for m in mma}
        assert len(accs) == 1, "the four MMAs must chain on one accumulator"
        scale_d = [re.split(r",\s*", m.rstrip(";"))[-3].strip() for m in mma]
        assert scale_d[0] == "0" and all(s != "0" for s in scale_d[1:]), scale_d
