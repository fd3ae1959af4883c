"""The typed layer configuration: one LayerConfig read by both engines and the bounds, one Quantizer type."""
from __future__ import annotations

import numpy as np
import pytest

from moeref.moe import LayerConfig, MoEQuant, Quantizer, fused_moe, make_layer, make_tokens, quantizer, run_moe
from moeref.quant import QuantizedTensor, fp8_group, fp8_per_tensor, quantize


def _case():
    lw = make_layer(3, 16, 8, seed=1)
    x = make_tokens(5, 16, seed=2)
    ids = np.array([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]], dtype=np.int32)
    return lw, x, ids, np.full((5, 2), 0.5, dtype=np.float32)


def test_a_config_object_and_keyword_options_give_the_same_layer():
    lw, x, ids, tw = _case()
    cfg = LayerConfig(activation="gelu_and_mul", layout="contiguous", alignment=4, chunk_size=2)
    a = fused_moe(x, lw, tw, ids, cfg)
    b = fused_moe(x, lw, tw, ids, activation="gelu_and_mul", layout="contiguous", alignment=4, chunk_size=2)
    np.testing.assert_array_equal(a, b)
    run = run_moe(x, lw, tw, ids, cfg, out_dtype="float32")  # options replace the config's fields
    assert run.config.activation == "gelu_and_mul" and run.config.out_dtype == "float32"
    assert run.config.num_experts == 3 and run.weights is lw  # filled in for the bounds


def test_unknown_options_and_bad_values_are_refused_by_name():
    lw, x, ids, tw = _case()
    with pytest.raises(TypeError, match="unknown layer option.*'activaton'"):
        fused_moe(x, lw, tw, ids, activaton="silu_and_mul")
    with pytest.raises(ValueError, match="layout"):
        LayerConfig(layout="ragged")
    with pytest.raises(ValueError, match="num_experts"):
        LayerConfig(expert_map=np.array([0, -1], dtype=np.int32))
    with pytest.raises(TypeError, match="MoEQuant"):
        LayerConfig(quant=fp8_group())


def test_quantizers_are_one_type():
    x = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    s = fp8_per_tensor()
    q = MoEQuant(fp8_group(), quantizer(s, scale=0.25), "mixed")
    assert isinstance(q.a1, Quantizer) and q.a1.scheme == fp8_group() and q.a1.static == {}
    assert q.a2.static == {"scale": 0.25}
    want = quantize(x, s, scale=0.25)
    got = q.a2(x)
    assert np.array_equal(got.codes, want.codes) and np.array_equal(got.scales, want.scales)

    def mine(v):
        return quantize(v, fp8_group())

    f = MoEQuant(mine, None).a1
    assert f.function is mine and f.scheme is None and isinstance(f(x), QuantizedTensor)
    with pytest.raises(TypeError, match="quantizer is None, a Scheme"):
        MoEQuant(3.0)
    with pytest.raises(ValueError, match="exactly one"):
        Quantizer()
