"""GEMM2's act prologue (issue 33): the Triton grouped GEMM computes the gated activation of GEMM1's output and its
FP8 1x128 quantization per K block in registers (``act_prologue``, :class:`fastpath.fused.GatedQuant`) instead of
reading the codes and scales the fused act+quant kernel stores; the same bits.

Small cases (run under Triton's interpreter on the CPU, and on a GPU): the interpreter's FP8 dot is not the
hardware's, so the two fast-path variants are compared with each other, bit for bit, and the layer with moeref's
reference under the declared profile; hidden 256, intermediate 256, 8 experts, 1-8 tokens, both layouts, SiLU,
erf/tanh GELU and SwiGLU-OAI with its parameters, rows with Inf and large values, padding rows filled with NaN.
GPU only: the DeepSeek-V3-sized layer, eager and in a CUDA graph, bit for bit against the default path.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastpath.testing import device  # noqa: E402

DEV = device()
ACTS = [("silu_and_mul", {}), ("gelu_and_mul", {}), ("gelu_and_mul", {"approximate": "tanh"}),
        ("swigluoai", {"alpha": 1.5, "limit": 5.0})]
FUSED = {"silu_and_mul": "silu_and_mul_quant_fp8", "gelu_and_mul": "gelu_and_mul_quant_fp8",
         "swigluoai": "swigluoai_quant_fp8"}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bf16 bit patterns, a NaN equal to any NaN (the payload of a NaN output is not a contract)."""
    eq = a.view(torch.int16) == b.view(torch.int16)
    return bool((eq | (torch.isnan(a) & torch.isnan(b))).all())


def _weights(e: int, n: int, k: int, seed: int):
    """FP8 E4M3 codes ``[e, n, k]`` (no NaN codes) and FP32 128x128 block scales."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (e, n, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] -= 1
    s = 2.0 ** torch.randint(-9, -5, (e, -(-n // 128), -(-k // 128)), generator=g).float()
    return codes.view(torch.float8_e4m3fn).to(DEV), s.to(DEV)


def _gated_input(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 ``h [rows, 2k]`` with planted rows: 0 an Inf gate, 1 large finite values (activations near 1e30),
    2 one huge element beside tiny ones (codes flushed to zero and subnormal codes), 3 zeros."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn((rows, 2 * k), generator=g) * 3
    if rows > 3:
        h[0, 5] = float("inf")
        h[1, :] = 1e15 * torch.sign(torch.randn(2 * k, generator=g))
        h[2, :] = 1e-3 * torch.randn(2 * k, generator=g)
        h[2, 7], h[2, 7 + k], h[2, k // 2] = 3e4, 2e4, 1.5e4
        h[3, :] = 0.0
    return h.to(torch.bfloat16).to(DEV)


def _act_args(act: str, params: dict) -> tuple:
    return (params.get("approximate", "none"),) if act == "gelu_and_mul" else \
        ((params["alpha"], params["limit"]) if act == "swigluoai" else ())


def _quantized(h2: torch.Tensor, act: str, params: dict, skip=None):
    """The fused act+quant kernel's codes (as FP8) and scales of ``h2 [rows, 2K]``."""
    import fastpath.fused as F

    fq = getattr(F, FUSED[act])(h2, *_act_args(act, params), skip_rows=skip)
    return fq.codes.view(torch.float8_e4m3fn), fq.scales


@pytest.mark.parametrize("act,params", ACTS)
@pytest.mark.parametrize("swap_ab", [True, False])
def test_masked_gemm2_prologue_gives_the_fused_kernels_bits(act, params, swap_ab):
    """Masked layout, 5 experts x 16 rows (held counts 5, 0, 1, 16, 2: the whole-tile and the row-by-row forms of
    the prologue, ``ACT_ROWS_ONE_BY_ONE``), K = 256 (two K blocks), N = 256: the rows the layout holds are the bits
    of GEMM2 on the fused kernel's codes and scales; NaN in the rows past each count (the layout's padding, never
    written by GEMM1) changes nothing."""
    from fastpath.fused import GatedQuant
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_masked

    e, cap, k, n = 5, 16, 256, 256
    b, sb = _weights(e, n, k, seed=1)
    h = _gated_input(e * cap, k, seed=2).reshape(e, cap, 2 * k)
    counts = torch.tensor([5, 0, 1, 16, 2], dtype=torch.int32, device=DEV)
    tiles = GemmTiles(16, 128, 128, 4, 1, swap_ab=swap_ab)
    xq, sx = _quantized(h.reshape(e * cap, 2 * k), act, params)
    want = grouped_gemm_masked(xq.reshape(e, cap, k), b, counts, impl="triton", a_scales=sx.reshape(e, cap, -1),
                               b_scales=sb, tiles=tiles)
    gq = GatedQuant(act, **params)
    got = grouped_gemm_masked(h, b, counts, impl="triton", b_scales=sb, tiles=tiles, act_prologue=gq)
    poisoned = h.clone()
    for i, c in enumerate(counts.tolist()):
        poisoned[i, c:] = float("nan")
    got_p = grouped_gemm_masked(poisoned, b, counts, impl="triton", b_scales=sb, tiles=tiles, act_prologue=gq)
    for i, c in enumerate(counts.tolist()):
        assert same_bits(got[i, :c], want[i, :c]), (i, c)
        assert same_bits(got_p[i, :c], want[i, :c]), (i, c)
    # row 0's Inf gate: a NaN block (SwiGLU-OAI clamps the gate to its limit: finite)
    assert torch.isnan(want[0, 0]).any() == (act != "swigluoai") and not torch.isnan(want[0, 2]).any()
    assert torch.isfinite(want[0, 1]).all() and want[0, 1].abs().max() > 0  # the large row stays finite


@pytest.mark.parametrize("act,params", [ACTS[0], ACTS[3]])
def test_contiguous_gemm2_prologue_gives_the_fused_kernels_bits(act, params):
    """Contiguous layout, alignment 16: experts 2 (3 rows), 0 (16 rows), 5 (1 row), 1 (2 rows), 4 (rows 0 and 2 of
    its tile, a -1 row between), with -1 rows (padding, NaN in h) inside the segments and a whole padding tile;
    K = 384 (three K blocks), N = 128."""
    from fastpath.fused import GatedQuant
    from fastpath.grouped_gemm import grouped_gemm_contiguous

    k, n = 384, 128
    b, sb = _weights(6, n, k, seed=3)
    labels = [2] * 3 + [-1] * 13 + [0] * 16 + [-1] * 16 + [5] + [-1] * 15 + [1] * 2 + [-1] * 14 + [4, -1, 4] + [-1] * 13
    m_idx = torch.tensor(labels, dtype=torch.int32, device=DEV)
    h = _gated_input(len(labels), k, seed=4)
    held = m_idx >= 0
    xq, sx = _quantized(h, act, params, skip=m_idx)
    want = grouped_gemm_contiguous(xq, b, m_idx, impl="triton", a_scales=sx, b_scales=sb, alignment=16)
    h[~held] = float("nan")
    got = grouped_gemm_contiguous(h, b, m_idx, impl="triton", b_scales=sb, alignment=16,
                                  act_prologue=GatedQuant(act, **params))
    assert same_bits(got[held], want[held])


def _layer(seed: int, tokens: int, act: str, experts: int = 8, top_k: int = 2):
    """An FP8 layer (hidden 256, intermediate 256, ``experts`` experts) and ``tokens`` routed tokens."""
    from fastpath.moe import fast_weights
    from moeref.activations import convert_w13
    from moeref.moe import MoEWeights, make_layer, make_tokens, quantize_weights
    from moeref.quant import fp8_block

    rng = np.random.default_rng(seed)
    lw = make_layer(experts, 256, 256, seed=seed)
    if act == "swigluoai":
        lw = MoEWeights([convert_w13(w, "gate_up", "interleaved") for w in lw.w13], lw.w2, "interleaved")
    q = quantize_weights(lw, fp8_block())
    x = make_tokens(tokens, 256, seed=seed + 1)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    tw = rng.random((tokens, top_k)).astype(np.float32)
    return q, fast_weights(q, DEV), x, tw, ids


@pytest.mark.parametrize("layout,act,params,tokens,capturable", [
    ("masked", "silu_and_mul", {}, 1, True), ("contiguous", "silu_and_mul", {}, 8, False),
    ("masked", "gelu_and_mul", {"approximate": "tanh"}, 4, False), ("contiguous", "gelu_and_mul", {}, 2, True),
    ("masked", "swigluoai", {"alpha": 1.5, "limit": 5.0}, 8, True)])
def test_layer_with_the_prologue_gives_the_default_bits(layout, act, params, tokens, capturable):
    """``fused_moe(act_prologue=True)`` against the default (the fused act+quant kernel): the same bits, and both
    within the declared profile of moeref's reference (``reference_config``)."""
    from fastpath.grouped_gemm import GemmTiles
    from fastpath.moe import fused_moe, reference_config
    from moeref.compare import PROFILES, compare
    from moeref.moe import run_moe

    q, fw, x, tw, ids = _layer(11, tokens, act)
    xb = torch.as_tensor(x).to(torch.bfloat16).to(DEV)
    kw = dict(layout=layout, alignment=16, capturable=capturable, graph_cache=False, activation=act,
              activation_params=params, tiles=(None, GemmTiles(16, 128, 128, 4, 1, swap_ab=True)))
    args = (xb, fw, torch.as_tensor(tw, device=DEV), torch.as_tensor(ids, device=DEV))
    want = fused_moe(*args, act_prologue=False, **kw)
    got = fused_moe(*args, act_prologue=True, **kw)
    assert same_bits(got, want) and want.abs().max() > 0
    cfg = reference_config(fw)
    prof = PROFILES[cfg.pop("profile")]
    run = run_moe(xb.float().cpu().numpy(), q, tw, ids, activation=act, activation_params=params, **cfg)
    rep = compare(got.float().cpu().numpy(), run, prof)
    assert rep.passed, rep


def test_layer_with_the_prologue_above_decode_rows_gives_the_default_bits(launched):
    """48 tokens, top-4 of 8 experts (24 rows per expert on average: not the decode tiles), default tiles: GEMM2 with
    the prologue runs the one-tile-per-program kernel's default tiles (those of the masked layout; the contiguous
    layout's may be TMA tile-loop tiles, which refuse the prologue) on whole tiles of rows, the same bits as the
    default layer."""
    from fastpath.grouped_gemm import default_tiles
    from fastpath.moe import fused_moe

    q, fw, x, tw, ids = _layer(17, 48, "silu_and_mul", top_k=4)
    args = (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fw, torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    kw = dict(layout="contiguous", alignment=16, capturable=False, graph_cache=False)
    want = fused_moe(*args, act_prologue=False, **kw)
    launched.clear()
    got = fused_moe(*args, act_prologue=True, **kw)
    assert same_bits(got, want) and want.abs().max() > 0
    assert launched[-1] == default_tiles("fp8_block", 24, DEV, "masked") and not launched[-1].tile_loop


@pytest.fixture
def launched(monkeypatch):
    """The tiles of every Triton grouped GEMM launch, in order."""
    import fastpath.grouped_gemm as gg

    seen = []
    orig = gg._launch_triton

    def record(a, b, d, m_idx, a_scales, b_scales, bias, t, **kw):
        seen.append(t)
        return orig(a, b, d, m_idx, a_scales, b_scales, bias, t, **kw)

    monkeypatch.setattr(gg, "_launch_triton", record)
    return seen


def test_the_prologue_takes_the_act_launch_out_and_the_module_default_picks_it(monkeypatch):
    """With the prologue no fused act+quant call is made (the launch is gone); ``act_prologue=None`` follows
    ``ACT_PROLOGUE_AT_DECODE`` at decode sizes (False: the fused kernel; True: the prologue)."""
    import fastpath._moe_layer as ml
    import fastpath.fused as F
    from fastpath.moe import fused_moe

    calls = []
    orig = F.silu_and_mul_quant_fp8

    def counted(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    monkeypatch.setattr(F, "silu_and_mul_quant_fp8", counted)
    q, fw, x, tw, ids = _layer(5, 1, "silu_and_mul", experts=4)
    args = (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fw, torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    kw = dict(layout="masked", graph_cache=False)
    seen = []
    for flag, given in ((False, None), (True, None), (True, False), (False, True)):
        monkeypatch.setattr(ml, "ACT_PROLOGUE_AT_DECODE", flag)
        calls.clear()
        seen.append(fused_moe(*args, act_prologue=given, **kw))
        assert len(calls) == (0 if (given if given is not None else flag) else 1), (flag, given)
    assert all(same_bits(s, seen[0]) for s in seen[1:])


def test_the_prologue_refuses_what_it_cannot_run():
    from fastpath.fused import GatedQuant
    from fastpath.grouped_gemm import GemmTiles, grouped_gemm_contiguous, grouped_gemm_masked
    from fastpath.moe import fused_moe
    from moeref.quant import fp8_group

    with pytest.raises(ValueError, match="1x128"):
        GatedQuant(scheme=fp8_group(128, "ue8m0"))
    with pytest.raises(ValueError, match="activation"):
        GatedQuant("relu")
    with pytest.raises(ValueError, match="approximate"):
        GatedQuant("gelu_and_mul", approximate="exact")
    b, sb = _weights(2, 128, 128, seed=0)
    h = torch.zeros((2, 16, 256), dtype=torch.bfloat16, device=DEV)
    mm = torch.tensor([1, 1], dtype=torch.int32, device=DEV)
    gq = GatedQuant()
    with pytest.raises(ValueError, match="2K = 256"):
        grouped_gemm_masked(h[..., :128], b, mm, impl="triton", b_scales=sb, act_prologue=gq)
    with pytest.raises(ValueError, match="a_scales must be None"):
        grouped_gemm_masked(h, b, mm, impl="triton", b_scales=sb, a_scales=sb, act_prologue=gq)
    with pytest.raises(ValueError, match="Triton-kernel option"):
        grouped_gemm_masked(h, b, mm, impl="deep_gemm", b_scales=sb, act_prologue=gq)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        grouped_gemm_masked(h, b.float(), mm, impl="triton", b_scales=sb, act_prologue=gq)
    with pytest.raises(TypeError, match="GatedQuant"):
        grouped_gemm_masked(h, b, mm, impl="triton", b_scales=sb, act_prologue=True)
    m_idx = torch.zeros(32, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="tile-loop"):
        grouped_gemm_contiguous(h.reshape(32, 256), b, m_idx, impl="triton", b_scales=sb, alignment=16,
                                tiles=GemmTiles(16, 128, 128, 4, 1, group_m=2), act_prologue=gq)
    q, fw, x, tw, ids = _layer(3, 1, "silu_and_mul", experts=4)
    args = (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fw, torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    with pytest.raises(ValueError, match="impl='triton' only"):
        fused_moe(*args, impl="deep_gemm", act_prologue=True, graph_cache=False)
    with pytest.raises(TypeError, match="act_prologue"):
        fused_moe(*args, act_prologue="yes", graph_cache=False)


def test_the_prologue_is_in_the_graph_key():
    from fastpath.moe import gemm_tiles, graph_key

    q, fw, x, tw, ids = _layer(3, 1, "silu_and_mul", experts=4)
    args = (torch.as_tensor(x).to(torch.bfloat16).to(DEV), fw, torch.as_tensor(tw, device=DEV),
            torch.as_tensor(ids, device=DEV))
    opts = dict(impl="triton", activation="silu_and_mul", activation_params=None, layout="masked", alignment=16,
                max_m=None, out_dtype=torch.bfloat16, num_experts=None, chunk_size=None, shared_experts=None,
                apply_router_weight_on_input=False, tiles=gemm_tiles(None))
    keys = {graph_key(*args, dict(opts, act_prologue=v), 7) for v in (None, True, False)}
    assert len(keys) == 3


@pytest.fixture(scope="module")
def deepseek_experts():
    """Random FP8 experts of the DeepSeek-V3 layer's shapes (hidden 7168, intermediate 2048, 256 experts; no NaN
    codes, FP32 block scales 1e-4..2e-4), as bench/studies/decode_graph_sweep.py builds them: (w13, s13, w2, s2)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, n, e = 7168, 2048, 256

    def experts(rows, cols):
        codes = torch.randint(0, 256, (e, rows, cols), dtype=torch.uint8, device="cuda", generator=gen)
        codes[(codes & 0x7F) == 0x7F] -= 1
        s = 1e-4 * (1.0 + torch.rand((e, -(-rows // 128), -(-cols // 128)), device="cuda", generator=gen))
        return codes.view(torch.float8_e4m3fn), s.float()

    return experts(2 * n, h) + experts(h, n)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("act,params", [ACTS[0], ACTS[2], ACTS[3]])
def test_gpu_layer_with_the_prologue_gives_the_default_bits(deepseek_experts, layout, act, params):
    """The DeepSeek-V3-sized FP8 layer (top-8 of 256 experts, random routing) at 1, 4 and 8 tokens,
    ``capturable=True``: the prologue's output equals the default's bit for bit, eager and replayed from a CUDA
    graph. (The experts' codes are read as interleaved w13 for SwiGLU-OAI.)"""
    from fastpath.moe import FastMoEWeights, fused_moe

    w13, s13, w2, s2 = deepseek_experts
    fw = FastMoEWeights(w13, w2, "interleaved" if act == "swigluoai" else "gate_up", s13, s2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 4, 8):
        x = torch.randn((m, 7168), device="cuda", generator=gen).to(torch.bfloat16)
        x[0, :3] = torch.tensor([3e4, -1e4, 6e4], device="cuda")  # large inputs: large activations
        ids = torch.rand((m, 256), device="cuda", generator=gen).topk(8, dim=1).indices.to(torch.int32)
        tw = torch.rand((m, 8), device="cuda", generator=gen)
        kw = dict(impl="triton", layout=layout, capturable=True, graph_cache=False, activation=act,
                  activation_params=params)
        want = fused_moe(x, fw, tw, ids, act_prologue=False, **kw)
        got = fused_moe(x, fw, tw, ids, act_prologue=True, **kw)
        assert same_bits(got, want), (m, layout, act)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused_moe(x, fw, tw, ids, act_prologue=True, **kw)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            out = fused_moe(x, fw, tw, ids, act_prologue=True, **kw)
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(out, want), (m, layout, act, "graph")


def test_the_prologue_launch_caps_registers_on_the_gpu_only(monkeypatch):
    """The GPU form of the launch carries ``ACT_PROLOGUE_MAXNREG`` (None: no cap); the interpreter's none."""
    import fastpath._grouped_gemm_tiles as gt
    import fastpath.grouped_gemm as gg
    from fastpath.fused import GatedQuant

    gq = GatedQuant("swigluoai")
    monkeypatch.setattr(gt, "_INTERPRETED", False)
    knobs = gg._act_launch_knobs(gq, torch.device("cuda"), 1)
    assert knobs["maxnreg"] == 128 and knobs["ACT"] == 2 and knobs["ACT_IN16"] == 1
    assert (knobs["ACT_ALPHA"], knobs["ACT_LIMIT"]) == (1.702, 7.0) and knobs["Q_HW_FP8"]
    monkeypatch.setattr(gg, "ACT_PROLOGUE_MAXNREG", None)
    assert "maxnreg" not in gg._act_launch_knobs(gq, torch.device("cuda"))
    monkeypatch.setattr(gt, "_INTERPRETED", True)
    monkeypatch.setattr(gg, "ACT_PROLOGUE_MAXNREG", 128)
    assert "maxnreg" not in gg._act_launch_knobs(gq, torch.device("cpu"))
