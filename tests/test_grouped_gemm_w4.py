"""fastpath.grouped_gemm_w4 (MXFP4 / NVFP4 / INT4 weights) against the exact reference, under the interpreter.

CPU (CI): the kernels run under ``TRITON_INTERPRET=1`` with float32 activations: the interpreter's dot of
bf16 inputs is not the hardware's, so the kernel decodes the weights to float32 (the same exact values it
decodes to bf16 on the GPU) and runs an IEEE FP32 dot; the result is checked against
:func:`moeref.gemm.grouped_gemm_contiguous` (exact, float64) within the FP32 accumulation bound of
:func:`moeref.compare.gemm_error_bound` (``FP32_ACCUM``, which also allows the two FP32 scale roundings the
NVFP4 epilogue and the INT4 per-group scaling make) plus the float32 output store. Planted faults (the
neighbouring scale block, swapped nibbles) must exceed it. The whole layer (``fastpath.moe``) likewise
against :func:`moeref.moe.run_moe` with float32 stores. The E2M1 and E8M0 values of the decode oracle are
written here from OCP MX v1.0 (table 3 and section 5.4), not read from moeref. The default tile rule
(:class:`fastpath.grouped_gemm_w4.W4TileRule`) against the measurements it was derived from
(docs/data/moe_device_h100_w4.json), and how the layer feeds it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fastpath.grouped_gemm_w4 import _e2m1_scaled_f32  # noqa: E402
from fastpath.testing import device  # noqa: E402
from moeref.compare import FP32_ACCUM, PROFILES, compare, gemm_error_bound  # noqa: E402
from moeref.gemm import grouped_gemm_contiguous as ref_contiguous  # noqa: E402
from moeref.moe import MoEWeights, make_layer, make_tokens, quantize_weights, run_moe  # noqa: E402
from moeref.quant import int4_group, mxfp4, quantize  # noqa: E402
from moeref.quant.nvfp4 import nvfp4, nvfp4_weight  # noqa: E402

DEV = device()


@triton.jit
def _e2m1_probe(c_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.load(c_ptr + i, mask=i < n, other=0)
    s = tl.load(s_ptr + i, mask=i < n, other=127)
    tl.store(out_ptr + i, _e2m1_scaled_f32(c, (s - 1) << 23), mask=i < n)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX v1.0 table 3, codes 0..7; bit 3 is the sign

SCHEMES = {
    "mxfp4": mxfp4(),
    "nvfp4_te": nvfp4(),
    "nvfp4_16x16": nvfp4_weight(),
    "nvfp4_flashinfer": nvfp4(preset="nvfp4_flashinfer"),
    "nvfp4_torchao": nvfp4(preset="nvfp4_torchao"),
    "int4_sym_g32": int4_group(32),
    "int4_asym_g32": int4_group(32, symmetric=False),
    "int4_sym_g64": int4_group(64),
}


def _block_factors(rng, e, k):
    """``[e, 1, k]`` factors 2^-3..2^3, one per 32-column block: weights whose blocks differ in magnitude,
    so that reading a neighbouring scale block changes the product."""
    return np.exp2(rng.integers(-3, 4, (e, 1, -(-k // 32)))).repeat(32, axis=2)[:, :, :k]


def _weights(rng, e, n, k):
    return (rng.standard_normal((e, n, k)) * _block_factors(rng, e, k)).astype(np.float32)


def _case(rng, e=3, n=40, k=96, alignment=16):
    counts = rng.integers(0, 24, e)
    counts[0] = max(int(counts[0]), 5)
    seg = -(-counts // alignment) * alignment
    m_idx = np.concatenate([np.where(np.arange(s) < c, i, -1) for i, (c, s) in enumerate(zip(counts, seg))])
    a = rng.standard_normal((m_idx.size, k)).astype(np.float32)
    return a, _weights(rng, e, n, k), m_idx.astype(np.int32)


def _bound(a, qs, m_idx, bias, ref):
    out = np.zeros_like(ref)
    for e in np.unique(m_idx[m_idx >= 0]):
        rows = np.flatnonzero(m_idx == e)
        out[rows] = gemm_error_bound(a[rows].astype(np.float64), qs[e], FP32_ACCUM, bias=bias[e])
    return out + 2.0**-24 * np.abs(ref)  # the float32 output store


def _run(a, w4, m_idx, bias, tiles=None):
    from fastpath.grouped_gemm_w4 import grouped_gemm_w4_contiguous

    return grouped_gemm_w4_contiguous(torch.as_tensor(a, device=DEV), w4, torch.as_tensor(m_idx, device=DEV),
                                      alignment=16, out_dtype=torch.float32, tiles=tiles,
                                      bias=torch.as_tensor(bias, device=DEV)).cpu().numpy().astype(np.float64)


@pytest.mark.parametrize("seed,name,swap_ab,block_k", [(i, n, True, 32) for i, n in enumerate(SCHEMES)] +
                         [(9, "mxfp4", False, 32), (10, "nvfp4_16x16", False, 32), (11, "int4_asym_g32", False, 32),
                          (12, "mxfp4", True, 64), (13, "nvfp4_te", False, 64)])
def test_w4_grouped_gemm_within_fp32_bound_and_planted_faults_fail(seed, name, swap_ab, block_k):
    """Both tile orientations (``swap_ab``: the tile computed as ``W @ a^T``, the default; or ``a @ W^T``), and
    a K tile that does not divide K = 96 (the masked K tail; 32 divides it: the unmasked loads)."""
    from fastpath.grouped_gemm_w4 import W4Experts, W4Tiles

    tiles = W4Tiles(16, 32, block_k, 1, 1, swap_ab=swap_ab)

    rng = np.random.default_rng(seed)
    a, w, m_idx = _case(rng)
    qs = [quantize(w[e], SCHEMES[name]) for e in range(w.shape[0])]
    bias = rng.standard_normal((w.shape[0], w.shape[1])).astype(np.float32)
    w4 = W4Experts.from_quantized(qs, DEV)
    ref = ref_contiguous(a, qs, m_idx, bias=bias)
    bound = _bound(a, qs, m_idx, bias, ref)
    valid = m_idx >= 0
    err = np.abs(_run(a, w4, m_idx, bias, tiles) - ref)
    assert np.all(err[valid] <= bound[valid]), float(np.max((err - bound)[valid]))
    # planted faults: the neighbouring K scale block, and the two nibbles of every byte swapped
    bad_scale = replace(w4, scales=w4.scales.roll(1, dims=2))
    assert np.any((np.abs(_run(a, bad_scale, m_idx, bias, tiles) - ref) > bound)[valid])
    swapped = replace(w4, codes=((w4.codes >> 4) | (w4.codes << 4)).to(torch.uint8))
    assert np.any((np.abs(_run(a, swapped, m_idx, bias, tiles) - ref) > bound)[valid])


def test_e2m1_bit_decode_is_exact_for_every_code_and_every_legal_scale():
    """The kernel's bit-built decode ``_e2m1_scaled_f32`` (no float arithmetic) against the OCP MX v1.0
    table times ``2^(s - 127)`` (E8M0 codes 2..252, the range W4Experts accepts, and s = 127: the plain E2M1
    value), all 16 codes, exact and with the sign of zero; also against moeref.formats' E2M1 decode."""
    from moeref.formats import decode

    scales = np.arange(2, 253, dtype=np.int32)
    c, s = (x.reshape(-1) for x in np.meshgrid(np.arange(16, dtype=np.int32), scales, indexing="ij"))
    out = torch.empty(c.size, dtype=torch.float32, device=DEV)
    _e2m1_probe[(triton.cdiv(c.size, 1024),)](torch.as_tensor(c, device=DEV), torch.as_tensor(s, device=DEV), out, c.size,
                                             BLOCK=1024)
    got = out.cpu().numpy().astype(np.float64)
    want = np.array(E2M1)[c & 7] * np.where(c & 8, -1.0, 1.0) * np.exp2(s.astype(np.float64) - 127)
    assert np.array_equal(got, want) and np.array_equal(np.signbit(got), c >= 8)
    formats = np.asarray(decode(np.arange(16, dtype=np.uint8), "e2m1"), np.float64)
    assert np.array_equal(got[s == 127], formats[c[s == 127]])


def test_mxfp4_decode_is_exact_for_every_code_and_scale():
    """One-hot activation rows read the decoded weights back: every E2M1 code (both nibbles) times E8M0
    scales 2..252 comes out exactly ``table[code] * 2^(s - 127)`` (oracle: OCP MX v1.0, written here)."""
    from fastpath.grouped_gemm_w4 import W4Experts

    k, n = 32, 32
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)        # every byte: every (low, high) pair
    codes = np.concatenate([codes, codes[::-1]], axis=0)[None]   # [1, 32 rows, 16 bytes]
    s = np.array([2, 60, 100, 127, 128, 200, 252, 126] * 4, np.uint8).reshape(1, n, 1)
    w4 = W4Experts("mxfp4", torch.as_tensor(codes), torch.as_tensor(s), 32, 1, k).to(DEV)
    a = np.eye(k, dtype=np.float32)
    got = _run(a, w4, np.zeros(k, np.int32), np.zeros((1, n), np.float32))  # [k, n]: got[j, r] = W[r, j]
    nib = np.stack([codes[0] & 15, codes[0] >> 4], axis=-1).reshape(n, k).astype(np.int64)
    val = np.array(E2M1)[nib & 7] * np.where(nib & 8, -1.0, 1.0) * np.exp2(s[0].astype(np.float64) - 127)
    assert np.array_equal(got.T, val)


def test_from_gptoss_equals_from_quantized_and_codes_out_of_bf16_range_are_refused():
    from fastpath.grouped_gemm_w4 import W4Experts
    from moeref.layouts import to_gptoss_mxfp4

    rng = np.random.default_rng(5)
    w = _weights(rng, 2, 8, 64)
    qs = [quantize(w[e], mxfp4()) for e in range(2)]
    blocks, scales = to_gptoss_mxfp4(np.stack([q.codes for q in qs]), np.stack([q.scales for q in qs]))
    a, b = W4Experts.from_quantized(qs, DEV), W4Experts.from_gptoss(blocks, scales, DEV)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    bad = scales.copy()
    bad[1, 3, 0] = 253  # 6 * 2^126 overflows bf16
    with pytest.raises(ValueError, match="normal range"):
        W4Experts.from_gptoss(blocks, bad, DEV)
    zero = np.zeros_like(blocks)
    ok = W4Experts.from_gptoss(zero, np.full_like(scales, 255), DEV)  # all-zero blocks: any code, stored as 127
    assert int(ok.scales.min()) == int(ok.scales.max()) == 127


def test_w4_supports_says_why_not():
    from fastpath.grouped_gemm_w4 import W4Experts, grouped_gemm_w4_contiguous, w4_supports

    qs = [quantize(np.ones((8, 32), np.float32), mxfp4())]
    w4 = W4Experts.from_quantized(qs, DEV)
    ok, why = w4_supports("deep_gemm", None, w4)
    assert not ok and "only the 'triton'" in why
    a16 = torch.zeros((16, 32), dtype=torch.float16, device=DEV)
    ok, why = w4_supports("triton", a16, w4)
    assert not ok and "float16" in why
    with pytest.raises(ValueError, match="cannot run"):
        grouped_gemm_w4_contiguous(a16, w4, torch.zeros(16, dtype=torch.int32, device=DEV), alignment=16)
    with pytest.raises(ValueError, match="no W4A16 kernel"):
        from moeref.quant import fp8_block

        W4Experts.from_quantized([quantize(np.ones((8, 32), np.float32), fp8_block())], DEV)


def _w4_layer(kind, rng, e, k, n, layout, bias):
    lw = make_layer(e, k, n, seed=int(rng.integers(2**16)), w13_layout=layout, bias=bias)
    vary = (lambda w: (w * _block_factors(rng, 1, w.shape[1])[0] / 2).astype(np.float32))
    lw = MoEWeights([vary(w) for w in lw.w13], [vary(w) for w in lw.w2], lw.w13_layout, lw.b13, lw.b2)
    return quantize_weights(lw, SCHEMES[kind])


@pytest.mark.parametrize("kind,activation,layout", [("mxfp4", "swigluoai", "masked"), ("mxfp4", "swigluoai", "contiguous"),
                                                    ("nvfp4_te", "silu_and_mul", "contiguous"),
                                                    ("int4_sym_g32", "silu_and_mul", "masked")])
def test_fastpath_moe_w4_layer_within_fp32_bound(kind, activation, layout):
    """The whole layer with 4-bit weights and float32 hidden states (the CI path: float32 stores,
    ``FP32_ACCUM``): gpt-oss's swigluoai with interleaved w13 and biases, NVFP4 and INT4 with SiLU; a layer
    whose w2 nibbles are swapped fails."""
    from fastpath.moe import FastMoEWeights, fast_weights, fused_moe, profile_of

    rng = np.random.default_rng(7)
    gated_layout = "interleaved" if activation == "swigluoai" else "gate_up"
    weights = _w4_layer(kind, rng, 4, 64, 32, gated_layout, bias=activation == "swigluoai")
    m, top = 9, 2
    x = make_tokens(m, 64, seed=3)
    ids = np.stack([rng.choice(4, top, replace=False) for _ in range(m)]).astype(np.int32)
    tw = rng.random((m, top)).astype(np.float32)
    fw = fast_weights(weights, DEV)
    assert fw.w4 and profile_of("triton", fw) == "BF16_OUTPUT"
    kw = dict(activation=activation, layout=layout, alignment=16, out_dtype=torch.float32)
    got = fused_moe(torch.as_tensor(x, device=DEV), fw, torch.as_tensor(tw, device=DEV),
                    torch.as_tensor(ids, device=DEV), **kw)
    run = run_moe(x, weights, tw, ids, activation=activation, gemm1_out_dtype="float32", act_out_dtype="float32",
                  out_dtype="float32")
    prof = PROFILES["FP32_ACCUM"]
    rep = compare(got.cpu(), run, prof)
    assert rep.passed, rep
    bad = FastMoEWeights(fw.w13, replace(fw.w2, codes=((fw.w2.codes >> 4) | (fw.w2.codes << 4)).to(torch.uint8)),
                         fw.w13_layout, b13=fw.b13, b2=fw.b2)
    got_bad = fused_moe(torch.as_tensor(x, device=DEV), bad, torch.as_tensor(tw, device=DEV),
                        torch.as_tensor(ids, device=DEV), **kw)
    assert not compare(got_bad.cpu(), run, prof).passed


def test_fastpath_moe_w4_refuses_deep_gemm_with_the_reason():
    from fastpath.moe import fast_weights, fused_moe

    rng = np.random.default_rng(1)
    fw = fast_weights(_w4_layer("mxfp4", rng, 2, 64, 32, "gate_up", False), DEV)
    x = torch.zeros((2, 64), device=DEV)
    with pytest.raises(ValueError, match="only the 'triton'"):
        fused_moe(x, fw, torch.ones((2, 1), device=DEV), torch.zeros((2, 1), dtype=torch.int32, device=DEV),
                  impl="deep_gemm")



@pytest.mark.parametrize("name", ["mxfp4", "int4_sym_g32"])
def test_w4a8_fp8_activations_within_fp32_bound(name):
    """FP8 E4M3 activations with 1x128 FP32 scales (W4A8). Under the interpreter the codes are widened to
    float32 (IEEE dot; on the GPU to bf16, also exact); a neighbouring activation scale block fails."""
    from fastpath.grouped_gemm_w4 import W4Experts, grouped_gemm_w4_contiguous
    from moeref.gemm.exact import as_operand
    from moeref.quant import fp8_group

    rng = np.random.default_rng(11)
    a, w, m_idx = _case(rng, k=256)
    a = (a * _block_factors(rng, 1, 256)[0]).astype(np.float32)
    qa = quantize(a, fp8_group())
    qs = [quantize(w[e], SCHEMES[name]) for e in range(w.shape[0])]
    ref = ref_contiguous(qa, qs, m_idx)
    op = as_operand(qa)
    bound = np.zeros_like(ref)
    for e in np.unique(m_idx[m_idx >= 0]):
        rows = np.flatnonzero(m_idx == e)
        bound[rows] = gemm_error_bound(op.take_rows(rows), qs[e], FP32_ACCUM)
    bound += 2.0**-24 * np.abs(ref)
    w4 = W4Experts.from_quantized(qs, DEV)
    codes = torch.as_tensor(qa.codes, device=DEV).view(torch.float8_e4m3fn)
    sa = torch.as_tensor(np.asarray(qa.scales, np.float32), device=DEV)
    run = (lambda s: grouped_gemm_w4_contiguous(codes, w4, torch.as_tensor(m_idx, device=DEV), a_scales=s,
                                                alignment=16, out_dtype=torch.float32).cpu().numpy())
    valid = m_idx >= 0
    assert np.all((np.abs(run(sa) - ref) <= bound)[valid])
    assert np.any((np.abs(run(sa.roll(1, dims=1)) - ref) > bound)[valid])


def test_registry_lists_the_w4_grouped_gemms_and_says_why_not():
    from fastpath.grouped_gemm_w4 import W4Experts, grouped_gemm_w4_contiguous
    from fastpath.registry import ImplementationUnavailable, get_implementation

    w4 = W4Experts.from_quantized([quantize(np.ones((8, 32), np.float32), mxfp4())], DEV)
    a = torch.zeros((16, 32), dtype=torch.bfloat16, device=DEV)
    assert get_implementation("grouped_gemm_w4_contiguous", "triton", a=a, w=w4) is grouped_gemm_w4_contiguous
    with pytest.raises(ImplementationUnavailable, match="float16"):
        get_implementation("grouped_gemm_w4_masked", "triton", a=a.half(), w=w4)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_fastpath_moe_w4a8_layer_within_fp32_bound(layout):
    """The MXFP4 gpt-oss layer with FP8 1x128 activations (W4A8: a1 and a2 quantized by fastpath.quant and the
    fused swigluoai + FP8 kernel) and float32 hidden states and stores under the interpreter, against
    run_moe with the same quantizers (FP32_ACCUM with the activation not stored); a neighbouring weight
    scale block in w2 fails. On the GPU the declared profile is BF16_OUTPUT_FP32_ACT (bf16 stores)."""
    from fastpath.moe import FastMoEWeights, fast_weights, fused_moe, profile_of, reference_config

    rng = np.random.default_rng(17)
    weights = _w4_layer("mxfp4", rng, 4, 256, 128, "interleaved", bias=True)
    m, top = 7, 2
    x = make_tokens(m, 256, seed=5)
    ids = np.stack([rng.choice(4, top, replace=False) for _ in range(m)]).astype(np.int32)
    tw = rng.random((m, top)).astype(np.float32)
    fw = fast_weights(weights, DEV, w4_activations="float8_e4m3fn")
    cfg = reference_config(fw)
    assert cfg.pop("profile") == profile_of("triton", fw) == "BF16_OUTPUT_FP32_ACT"
    kw = dict(activation="swigluoai", layout=layout, alignment=16, out_dtype=torch.float32)
    got = fused_moe(torch.as_tensor(x, device=DEV), fw, torch.as_tensor(tw, device=DEV),
                    torch.as_tensor(ids, device=DEV), **kw)
    run = run_moe(x, weights, tw, ids, activation="swigluoai", quant=cfg["quant"], gemm1_out_dtype="float32",
                  act_out_dtype="float32", out_dtype="float32")
    prof = replace(PROFILES["FP32_ACCUM"], act_unit=PROFILES["BF16_OUTPUT_FP32_ACT"].act_unit)
    rep = compare(got.cpu(), run, prof)
    assert rep.passed, rep
    bad = FastMoEWeights(fw.w13, replace(fw.w2, scales=fw.w2.scales.roll(1, dims=2)), fw.w13_layout, b13=fw.b13,
                         b2=fw.b2, w4_activations="float8_e4m3fn")
    got_bad = fused_moe(torch.as_tensor(x, device=DEV), bad, torch.as_tensor(tw, device=DEV),
                        torch.as_tensor(ids, device=DEV), **kw)
    assert not compare(got_bad.cpu(), run, prof).passed


def test_expert_stacks_refuse_what_cannot_be_stacked():
    """Both expert stacks (the reference's StackedExperts and the fast path's W4Experts) refuse an empty
    list, a non-QuantizedTensor and experts of different schemes or shapes, naming the expert."""
    from fastpath.grouped_gemm_w4 import W4Experts
    from moeref.gemm import StackedExperts

    rng = np.random.default_rng(0)
    a = quantize(rng.standard_normal((8, 64)).astype(np.float32), mxfp4())
    other_shape = quantize(rng.standard_normal((8, 32)).astype(np.float32), mxfp4())
    other_scheme = quantize(rng.standard_normal((8, 64)).astype(np.float32), int4_group())
    for stack in (StackedExperts.from_quantized, lambda ts: W4Experts.from_quantized(ts, DEV)):
        with pytest.raises(ValueError, match="at least one expert"):
            stack([])
        with pytest.raises(TypeError, match="expert 1 is a ndarray"):
            stack([a, np.zeros((8, 64))])
        with pytest.raises(ValueError, match="expert 1 has scheme"):
            stack([a, other_shape])
        with pytest.raises(ValueError, match="expert 1 has scheme"):
            stack([a, other_scheme])


# --------------------------------------------------------------------------- the tile rule (DEFAULT_W4_TILE_RULE)

def _measured_gemm_times():
    """``{(gemm, kind, rows per expert): {W4Tiles: ms}}`` from docs/data/moe_device_h100_w4.json (H100,
    2026-11-24, gpt-oss-120b: 128 experts; kernel labels "kind BMxBNxBK wW sS [swap]")."""
    import json
    import pathlib

    from fastpath.grouped_gemm_w4 import W4Tiles

    data = json.loads((pathlib.Path(__file__).parents[1] / "docs/data/moe_device_h100_w4.json").read_text())
    out = {}
    for row in data["w4"]:
        parts = row["kernel"].split()
        if parts[0] == "bf16":
            continue
        bm, bn, bk = (int(v) for v in parts[1].split("x"))
        t = W4Tiles(bm, bn, bk, int(parts[2][1:]), int(parts[3][1:]), swap_ab=parts[-1] == "swap")
        out.setdefault((row["gemm"], parts[0], row["rows"] / 128), {})[t] = row["ms"]
    return out


def test_w4_tile_rule_is_within_6_percent_of_the_fastest_measured_tile():
    """At every measured point (both GEMMs, MXFP4/NVFP4/INT4, 2, 32 and 256 rows per expert) the rule's tile is
    one of those measured and at most 6% slower than the fastest there (the former switch, the 16-row swap tile
    up to E x alignment rows, took 2.898 ms for MXFP4 GEMM1 at 32 rows per expert against 1.796)."""
    from fastpath.grouped_gemm_w4 import DEFAULT_W4_TILE_RULE

    measured = _measured_gemm_times()
    assert {r for _, _, r in measured} == {2.0, 32.0, 256.0} and len(measured) == 18
    for (gemm, kind, r), times in measured.items():
        t = DEFAULT_W4_TILE_RULE.tiles(r, kind)
        assert t in times and times[t] <= 1.06 * min(times.values()), (gemm, kind, r, t, times)
    assert [DEFAULT_W4_TILE_RULE.tiles(r, "mxfp4").block_m for r in (1, 16, 17, 32, 33, 64, 65)] == \
        [16, 16, 32, 32, 64, 64, 128]


def test_w4_tile_rule_reads_rows_per_expert_from_shapes_only():
    """The average rows per expert: ``expected_m`` when given, else the least the contiguous layout allows
    (a capturable layer's worst-case buffer gives M*k/E); the kernel is handed the rule's tile (meta tensors:
    shapes only, no data); a rule out of order or an unknown kind is refused."""
    from fastpath.grouped_gemm_w4 import DEFAULT_W4_TILE_RULE, W4TileRule, W4Tiles, _tiles_for, rows_per_expert

    assert rows_per_expert(16384, 128, 128, expected_m=32) == 32.0
    assert rows_per_expert(16384, 128, 128) == 1.0  # every expert one aligned segment: as few as 1 row each
    m, k, e, al = 1024, 4, 128, 128
    worst = -(-(m * k + e * (al - 1)) // al) * al
    assert 32 <= rows_per_expert(worst, e, al) < 33
    w = type("W", (), {"num_experts": 128, "kind": "nvfp4", "group": 16})()
    a = torch.empty((16384, 2880), device="meta")
    assert _tiles_for(w, a, None, 128, expected_m=32) == W4Tiles(32, 128, 64, 4, 4)
    assert _tiles_for(w, a, None, 128, expected_m=256) == W4Tiles(128, 128, 64, 8, 3, swap_ab=False)
    assert DEFAULT_W4_TILE_RULE.tiles(256, "int4") == W4Tiles(128, 128, 64, 8, 3, swap_ab=True)
    assert _tiles_for(w, a, None, 32, expected_m=256).block_m == 16  # the row tile divides the alignment
    with pytest.raises(ValueError, match="increasing block_m"):
        W4TileRule(swap_tiles=(W4Tiles(32, 128, 64, 4, 4), W4Tiles(16, 128, 64, 4, 4)))
    with pytest.raises(ValueError, match="kind"):
        DEFAULT_W4_TILE_RULE.tiles(4, "fp8")


def test_layer_hands_the_w4_gemms_its_rows_per_expert(monkeypatch):
    """fastpath.moe passes ceil(M*k/E) (host ints) to both 4-bit GEMMs, in both layouts."""
    import fastpath.grouped_gemm_w4 as g
    from fastpath.moe import fast_weights, fused_moe

    seen = []
    real = g._tiles_for
    monkeypatch.setattr(g, "_tiles_for", lambda w, a, t, al, em=None: seen.append(em) or real(w, a, t, al, em))
    rng = np.random.default_rng(1)
    fw = fast_weights(_w4_layer("mxfp4", rng, 4, 64, 32, "gate_up", False), DEV)
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(9)]).astype(np.int32)
    for layout in ("contiguous", "masked"):
        fused_moe(torch.as_tensor(make_tokens(9, 64, seed=2), device=DEV), fw, torch.ones((9, 2), device=DEV),
                  torch.as_tensor(ids, device=DEV), alignment=16, out_dtype=torch.float32, layout=layout)
    assert seen == [5, 5, 5, 5]  # ceil(9 * 2 / 4)
