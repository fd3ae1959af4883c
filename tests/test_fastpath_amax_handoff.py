"""Issue 20's two-pass kernels: the activation kernel emits the tensor amax (atomic max), so per-tensor FP8
and dynamic NVFP4 quantize the activation in one read (``quantize(a, scheme, amax=amax)``).

The handed-over amax must be the amax the quantizer's own pass reduces, bit for bit (NaN payloads
included), and the codes, scales and global scale must equal the two-pass result bit for bit; the
amax pass must not run. Inputs include NaN and Inf (the NaN policy of each preset). On CPU the kernels
run under Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from moeref.quant import fp8_group, fp8_per_tensor  # noqa: E402
from moeref.quant.nvfp4 import nvfp4  # noqa: E402

import fastpath.fused as F  # noqa: E402
import fastpath.quant as Q  # noqa: E402
from fastpath.quant import _launch as QL  # noqa: E402
from fastpath.quant import _preset_map as QP  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interp

SCHEMES = {"fp8 per-tensor (default: nan_block)": fp8_per_tensor(),
           "fp8 per-tensor (vllm: propagate)": fp8_per_tensor(preset="vllm"),
           "nvfp4 (default)": nvfp4(), "nvfp4 (vllm)": nvfp4(preset="nvfp4_vllm")}


def _x(seed, m=6, n=64, specials=False):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, 2 * n)) * 3).astype(np.float32)
    if specials:
        x[1, 3] = np.nan
        x[4, n + 7] = np.inf
    return torch.from_numpy(x).to(torch.bfloat16).to(DEVICE)


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("act", ["silu_and_mul", "swigluoai"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_handed_over_amax_gives_the_two_pass_result(monkeypatch, name, act, specials):
    scheme = SCHEMES[name]
    x = _x(7, specials=specials)
    f = getattr(F, act)
    a = f(x)
    a2, amax = f(x, amax_for=scheme)
    assert torch.equal(_bits(a2), _bits(a))  # the activation itself is unchanged
    nonfinite = QP.constexprs(scheme, False)["NONFINITE"]
    want_amax = QL._tensor_amax(a.unsqueeze(0), nonfinite, per_matrix=Q._kind(scheme) == "per_tensor")
    assert torch.equal(_bits(amax), _bits(want_amax)), (amax, want_amax)
    if not specials:  # independent of the kernels: the float32 max of |a|
        assert float(amax) == float(np.abs(a.float().cpu().numpy()).max())
    want = Q.quantize(a, scheme)

    def no_amax_pass(*_a, **_k):
        raise AssertionError("the amax pass ran although amax= was given")

    monkeypatch.setattr(QL, "_tensor_amax", no_amax_pass)
    got = Q.quantize(a2, scheme, amax=amax)
    assert torch.equal(_bits(got.codes), _bits(want.codes))
    assert torch.equal(_bits(got.scales), _bits(want.scales))
    if want.global_scale is not None:
        assert torch.equal(_bits(got.global_scale), _bits(want.global_scale))


def test_errors_name_what_is_wrong():
    x = _x(1)
    a, amax = F.silu_and_mul(x, amax_for=fp8_per_tensor())
    with pytest.raises(ValueError, match="amax= is for per-tensor FP8"):
        Q.quantize(a, fp8_group(128), amax=amax)
    with pytest.raises(ValueError, match="amax= is for per-tensor FP8"):
        Q.quantize(a, fp8_per_tensor(2.0), amax=amax)
    with pytest.raises(TypeError, match="amax must be a float32 torch tensor"):
        Q.quantize(a, fp8_per_tensor(), amax=amax.double())
    with pytest.raises(ValueError, match=r"amax must hold 1 value\(s\)"):
        Q.quantize(a, fp8_per_tensor(), amax=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="amax_for must be a per-tensor FP8 or an NVFP4 scheme"):
        F.silu_and_mul(x, amax_for=fp8_group(128))
    with pytest.raises(ValueError, match="needs one per matrix"):
        F.silu_and_mul(torch.stack([x, x]), amax_for=fp8_per_tensor())
