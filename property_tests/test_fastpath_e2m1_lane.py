"""GPU proof of the float32 lane E2M1 encode (:func:`fastpath._packed_fp4.e2m1_lane_f32`,
``E2M1_PTX``: NVFP4, and MXFP4 from float16/float32 input).

The CPU proof (tests/test_mxfp4_packed_encode.py) emulates the PTX text against
:func:`moeref.formats.encode`; here the real instructions run on an sm_90+ GPU (skipped
elsewhere: Triton's interpreter cannot run inline PTX) over EVERY float32 bit pattern (2^32),
in both variants (signed zeros kept; TE's +0), against the integer helper
:func:`fastpath._triton_rounding.encode_e2m1` in the same kernel (itself equal to the reference
on every bfloat16 pattern and random float32 values, property_tests/test_fastpath_rounding.py): every
non-NaN lane has that code (bits 0-2, sign bit 9, bits 3-8 and 10+ zero), every NaN lane is
``NAN_LANE``. End to end, the quantizer with the lane encode equals the integer path
(``hw_fp8=False``) and the reference: :mod:`property_tests.test_fastpath_quant` (NVFP4 every
order, MXFP4 float16/float32 input) and :mod:`property_tests.test_fastpath_nvfp4_static`, plus
the sweep below.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from moeref.quant import mxfp4  # noqa: E402
from moeref.quant.nvfp4 import nvfp4  # noqa: E402

from fastpath import _packed_fp4 as PK  # noqa: E402
from fastpath import _triton_rounding as R  # noqa: E402
from fastpath import quant as Q  # noqa: E402
from fastpath.quant import _preset_map as QP  # noqa: E402
from fastpath.testing import poisoned  # noqa: E402

pytestmark = [pytest.mark.gpu]


@triton.jit
def _lane_vs_integer_kernel(bad_ptr, base, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    i = base + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    y = i.to(tl.uint32).to(tl.float32, bitcast=True)
    lane = PK.e2m1_lane_f32(y, ZERO)
    code = (lane & 7) | (((lane >> 9) & 1) << 3)
    want = R.encode_e2m1_nonnan(y, 0, False)
    if ZERO:
        want = tl.where(y == 0.0, 0, want)
    nan = y != y
    bad = tl.where(nan, lane != PK.NAN_LANE,
                   (code != want) | ((lane & 0x1F8) != 0) | (lane >= 0x400))
    tl.atomic_add(bad_ptr, tl.sum(bad.to(tl.int32)))


@pytest.mark.parametrize("zero", [False, True])
def test_gpu_lane_encode_every_float32_pattern(zero):
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    block, chunk = 1024, 1 << 30
    for base in range(0, 1 << 32, chunk):
        _lane_vs_integer_kernel[(chunk // block,)](bad, base, ZERO=zero, BLOCK=block)
    assert int(bad.item()) == 0, f"{int(bad.item())} float32 patterns differ from the integer encode"


@pytest.mark.parametrize("scheme,dtype", [
    (nvfp4(preset="nvfp4_te"), torch.bfloat16), (nvfp4(preset="nvfp4_vllm"), torch.bfloat16),
    (nvfp4(preset="nvfp4_torchao"), torch.float16), (nvfp4(preset="nvfp4_flashinfer"), torch.float32),
    (mxfp4(), torch.float16), (mxfp4(), torch.float32), (mxfp4(preset="te_mxfp8"), torch.float32),
])
def test_gpu_lane_path_quantize_equals_integer_path(scheme, dtype):
    """Codes and scales through E2M1_PTX equal the integer path's (hw_fp8=False) on a sweep of
    magnitudes (every block of 16/32 elements drawn at its own scale, zeros and -0.0 mixed in;
    MXFP4 also NaN and +-Inf)."""
    assert QP.constexprs(scheme, True)["E2M1_PTX"] and not QP.constexprs(scheme, False)["E2M1_PTX"]
    g = torch.Generator(device="cuda").manual_seed(5)
    M, K = 512, 1024
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.float32)
    x = x * torch.exp2(torch.randint(-30, 30, (M, K // 16, 1), device="cuda", generator=g)
                       .float()).repeat_interleave(16, 1).reshape(M, K)
    x[:, ::7] = 0.0
    x[:, 3::11] = -0.0
    if scheme.family != "nvfp4":
        x[5, 100], x[9, 7], x[11, 64] = float("nan"), float("inf"), float("-inf")
    x = x.to(dtype)
    layout = "swizzled_128x4"
    with poisoned():
        a = Q.quantize(x, scheme, scale_layout=layout, hw_fp8=True)
        b = Q.quantize(x, scheme, scale_layout=layout, hw_fp8=False)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
