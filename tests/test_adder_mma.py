"""The float64 tensor-core bound's tables (:mod:`moeref.compare.device._adder_mma`) and the per-stack expert statistics the
device bound reads (:func:`moeref.compare.device.operands._stack_expert_stats`), against independent computations:
the kernel's own ``_power`` applied to the decoded values (Triton; the interpreter on the CPU), and
:func:`moeref.gemm.exact.quantum_and_max` and NumPy over each expert's values."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from moeref.compare.device._adder_mma import _power, power_tables
from moeref.formats import decode_table
from moeref.gemm import StackedExperts
from moeref.gemm.exact import quantum_and_max

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _power_kernel(v_ptr, o_ptr, out_ptr, T: tl.constexpr, TP: tl.constexpr, LAM: tl.constexpr):
    g = tl.program_id(0)
    i = tl.arange(0, TP)
    v = tl.load(v_ptr + i, mask=i < T, other=0.0)
    o = tl.load(o_ptr + g)
    tl.store(out_ptr + g * T + i, _power(v, o, LAM), mask=i < T)


@pytest.mark.parametrize("element", ["e4m3fn", "e5m2", "e2m1"])
@pytest.mark.parametrize("lam", [5, 6, 8, 9])
def test_power_tables_equal_the_kernels_power(element, lam):
    """Entry ``[g, c]`` is, bit for bit, the power the kernel computes from the decoded value of code ``c`` with
    group ``g``'s weight offset, for every finite code (subnormals included) and offsets from far below to above the
    format's exponents (the clamp at -100 reached); codes without a finite value hold 0."""
    table = torch.as_tensor(np.array(decode_table(element), dtype=np.float64), device=DEV)
    offsets = torch.as_tensor([-30, -9, 0, 3, 8, 15, 40], dtype=torch.int32, device=DEV)
    got = power_tables(table, offsets, lam)
    finite = torch.isfinite(table)
    vals = torch.where(finite, table, torch.zeros_like(table)).contiguous()
    t = int(table.numel())
    want = torch.empty((offsets.numel(), t), dtype=torch.float64, device=DEV)
    _power_kernel[(offsets.numel(),)](vals, offsets, want, T=t, TP=triton.next_power_of_2(t), LAM=lam)
    assert got.shape == want.shape
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    assert bool((got[:, ~finite] == 0).all())
    assert bool((got[:, vals == 0] == 0).all())


def test_stack_expert_stats_equal_per_expert_values():
    """Finiteness, ``(quantum, max)`` and bf16-representability per expert from the codes-present histogram equal
    those computed over each expert's decoded values: experts holding NaN codes, only zeros, only subnormals, and
    random codes."""
    from moeref.compare.device.operands import _stack_expert_stats

    rng = np.random.default_rng(3)
    e, n, k = 5, 8, 64
    codes = rng.integers(0, 256, (e, n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] -= 1
    codes[1, 0, 0] = 0x7F                                   # a NaN
    codes[2] = 0                                            # only zeros
    codes[3] = rng.integers(1, 8, (n, k), dtype=np.uint8)   # only subnormals
    w = StackedExperts(torch.as_tensor(codes, device=DEV), torch.ones((e, 1, 1), dtype=torch.float64, device=DEV),
                       "e4m3fn", (128, 128), (n, k))
    finite, qm, bf16 = _stack_expert_stats(w)
    table = decode_table("e4m3fn")
    for x in range(e):
        vals = table[codes[x]].astype(np.float64)
        fin = bool(np.isfinite(vals).all())
        assert finite[x] == fin
        if fin:
            q, m = quantum_and_max(vals)
            assert (qm[x, 0], qm[x, 1]) == (q, m)
            rt = vals.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
            assert bf16[x] == bool((rt == vals).all())
        else:
            assert not bf16[x]
    assert qm[2, 0] == math.inf and qm[2, 1] == 0.0
    assert _stack_expert_stats(w) is _stack_expert_stats(w)   # cached on the codes tensor
