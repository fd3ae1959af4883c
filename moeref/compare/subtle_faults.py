"""Honest variants with declared bf16 stores, and the subtle faults planted into them.

:data:`HONEST_BF16`, :data:`HONEST_HOPPER` and :data:`HONEST_DEEPGEMM` compute the layer of a
:class:`moeref.compare.faults.LayerCase` with other legal arithmetic for the bf16-store profiles (tensor-core
adders of other widths, other chunkings, the emulated DeepGEMM GEMMs). :data:`SUBTLE_FAULTS` are the bugs
that move the output by about as much as the declared roundings do (bf16 accumulators, an FP8
intermediate, a bf16 top-k sum, a dropped last column, a bias added twice, truncating stores, one wrong
scale block, a tile-boundary bug ...): the measure of an oracle's power (bench/bench_oracle_power.py);
:func:`subtle_faults` plants them into another honest base (e.g. the emulated DeepGEMM layer).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..gemm.exact import BlockOperand, as_operand
from ..moe.pipeline import MoEQuant
from .faults import LayerCase, _busiest, _truncate, fp32_gemm, hopper_fp8_gemm, reference, torch_bf16_gemm

__all__ = ["tensor_core_gemm", "stored_gemm", "bf16_accumulator_gemm", "finalize_in", "bf16_candidate",
           "HONEST_BF16", "HONEST_HOPPER", "HONEST_DEEPGEMM", "SUBTLE_FAULTS", "subtle_faults"]


# ---------------------------------------------------------------------------------- bf16-store variants


def stored_gemm(gemm=None, dtype="bfloat16", rounding: str = "nearest"):
    """``gemm`` (default: :func:`moeref.gemm.block_gemm`) with its output stored in ``dtype``: round to
    nearest-even (``"nearest"``, what every kernel's epilogue does) or toward zero (``"zero"``, a fault)."""
    from ..gemm.exact import block_gemm
    from ..moe.pipeline import round_to_dtype

    inner = block_gemm if gemm is None else gemm

    def run(a, w):
        c = np.asarray(inner(a, w), dtype=np.float64)
        return round_to_dtype(c, dtype) if rounding == "nearest" else _truncate_to(c, dtype)

    return run


def _truncate_to(x: np.ndarray, dtype) -> np.ndarray:
    """Round toward zero to bf16 (cut the low 16 bits of the FP32 pattern) or FP32."""
    f = np.asarray(x, dtype=np.float32)
    if str(dtype) in ("bfloat16", "bf16"):
        return (f.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    return f.astype(np.float64)


def tensor_core_gemm(bits: int = 24, mma_k: int = 16, promote: int | None = None, headroom: int = 0):
    """An adversarial tensor-core GEMM (the aligned-adder model of Fasi, Higham, Mikaitis and Pranesh,
    PeerJ CS 2021): per ``mma_k``-column MMA the exact products and the incoming accumulator are aligned
    to the largest addend's exponent ``e`` and cut toward zero to the grid ``2^(e - bits + 1 + headroom)``,
    summed exactly and truncated to ``bits`` significant bits; every ``promote`` columns (None: never)
    the accumulator is scaled and added to an FP32 sum (also at every scale block boundary along K).
    ``bits=24, headroom=0``: an FP32 accumulator
    (honest for :data:`moeref.compare.BF16_OUTPUT` and ``FP32_ACCUM``); ``bits=14, headroom=1, mma_k=32,
    promote=128``: the Hopper FP8 model."""

    def gemm(a, w):
        a, w = as_operand(a), as_operand(w)
        m, k = a.values.shape
        n = w.values.shape[0]
        step = min(k if promote is None else promote, a.block[1], w.block[1])  # one scale per chunk
        out = np.zeros((m, n), dtype=np.float32)
        ra, rw = np.arange(m) // a.block[0], np.arange(n) // w.block[0]
        for s in range(0, k, max(step, 1)):  # loops over promotion chunks and MMA steps (K / mma_k)
            acc = np.zeros((m, n))
            for j, t in enumerate(range(s, min(s + step, k), mma_k)):
                e = min(t + mma_k, s + step, k)
                prods = a.values[:, None, t:e].astype(np.float64) * w.values[None, :, t:e].astype(np.float64)
                addends = np.concatenate([prods, acc[..., None]], axis=-1) if j else prods
                big = np.abs(addends).max(axis=-1)
                _, ex = np.frexp(np.where(big > 0, big, 1.0))
                grid = np.ldexp(1.0, ex - bits + headroom)[..., None]
                acc = _truncate((np.trunc(addends / grid) * grid).sum(axis=-1), bits)
            sc = (a.scales[ra, s // a.block[1]][:, None] * w.scales[rw, s // w.block[1]][None, :]).astype(np.float32)
            out = out + acc.astype(np.float32) * sc
        return out

    return gemm


def bf16_accumulator_gemm(chunk: int = 32, inner=None):
    """A fault: FP32 partial products of ``chunk`` columns added into a bf16 accumulator (rounded to
    bf16 after every add). ``inner``: the FP32 engine of each chunk (:func:`fp32_gemm`)."""
    from ..moe.pipeline import round_to_dtype

    def gemm(a, w):
        a, w = as_operand(a), as_operand(w)
        k = a.values.shape[1]
        acc = np.zeros((a.values.shape[0], w.values.shape[0]))
        for s in range(0, k, chunk):  # a loop over K chunks
            cols = slice(s, min(s + chunk, k))
            part = _column_slice(a, cols), _column_slice(w, cols)
            acc = round_to_dtype(acc + np.asarray((inner or fp32_gemm(chunk))(*part), np.float64), "bfloat16")
        return acc

    return gemm


def _column_slice(op: BlockOperand, cols: slice) -> BlockOperand:
    """Columns ``cols`` of ``op`` as a float operand: dequantized elementwise (element times its block
    scale, in float64), so any column range works whatever the scale blocks."""
    vals = op.dequantize()[:, cols]
    return BlockOperand(vals, np.ones((1, 1)), (max(vals.shape[0], 1), max(vals.shape[1], 1)), False)


def finalize_in(run, b2=None, gemm_out_dtype="bfloat16", gemm_out_rounding: str = "nearest",
                acc_dtype="float32", reverse: bool = False, out_dtype="bfloat16",
                weight_before_store: bool = False) -> np.ndarray:
    """GEMM2's epilogue and the top-k weighted sum of a traced ``run`` recomputed as a kernel does.

    ``run`` must be traced with weights without ``b2`` and an FP32 GEMM engine: each GEMM2 row gets its
    expert's bias ``b2`` (float ``[E, K]`` or None) added in FP32 and is stored in ``gemm_out_dtype``
    (``gemm_out_rounding``: ``"nearest"``-even, or ``"zero"``, a fault); then ``acc = rnd(acc +
    rnd32(w_j y_j))`` over the slots (``reverse``: last slot first), ``rnd`` to ``acc_dtype``; the result
    stored in ``out_dtype``. FP32 sums are honest for every profile; a bf16 one is a fault.
    ``weight_before_store``: the epilogue multiplies by the top-k weight in FP32 before the store and the
    sum adds the stored products (vLLM Triton ``MUL_ROUTED_WEIGHT`` + ``moe_sum``). No shared experts."""
    from ..moe.pipeline import round_to_dtype

    if run.shared is not None:
        raise ValueError("finalize_in does not handle shared experts")
    outs = []
    for p, e in run.chunks:  # a loop over chunks
        m, k = p.num_tokens, p.top_k
        ok = p.src >= 0
        y = e.y.astype(np.float32)
        if b2 is not None:
            y[ok] = y[ok] + np.asarray(b2, dtype=np.float32)[p.row_expert[ok]]
        w = np.asarray(p.topk_weights, dtype=np.float32).astype(np.float64) if p.apply_weights else np.ones((m, k))
        if weight_before_store:
            y[ok] = (y[ok].astype(np.float64) * w.reshape(-1)[p.src[ok]][:, None]).astype(np.float32)
            w = np.ones((m, k))
        y = y.astype(np.float64)
        if gemm_out_dtype is not None:
            y = round_to_dtype(y, gemm_out_dtype) if gemm_out_rounding == "nearest" else _truncate_to(y, gemm_out_dtype)
        slot_y = np.zeros((m * k, y.shape[1]))
        slot_y[p.src[ok]] = y[ok]
        slot_y = slot_y.reshape(m, k, -1)
        acc = np.zeros((m, slot_y.shape[2]))
        for j in (range(k - 1, -1, -1) if reverse else range(k)):  # a loop over the k slots
            acc = round_to_dtype(acc + round_to_dtype(w[:, j, None] * slot_y[:, j], "float32"), acc_dtype)
        outs.append(acc)
    return round_to_dtype(np.concatenate(outs, axis=0), out_dtype)


def bf16_candidate(case: LayerCase, gemm=None, finalize: dict | None = None, **overrides) -> np.ndarray:
    """``case`` computed with the arithmetic :data:`moeref.compare.BF16_OUTPUT` declares: FP32 GEMMs
    (``gemm``, default :func:`fp32_gemm` in chunks of 32), GEMM1's output (bias included) stored in
    bf16, the activation stored in bf16, GEMM2's output plus ``b2`` stored in bf16, an FP32 top-k sum and
    a bf16 output (:func:`finalize_in` with ``finalize`` keywords). ``overrides`` go to :func:`reference`."""
    lw = case.weights
    opts = dict(gemm=gemm or fp32_gemm(32), gemm1_out_dtype="bfloat16", act_out_dtype="bfloat16")
    opts.update(overrides)
    run = reference(case.with_(weights=replace(lw, b2=None)), **opts)
    return finalize_in(run, b2=lw.b2, **(finalize or {}))


def _bf16_layer_only(case: LayerCase, gemm):
    """``gemm`` for a layer without biases: an engine that stores its own output (torch's bf16 matmul)
    would round before the bias add, a second rounding the profile does not declare."""
    if case.weights.b13 is not None or case.weights.b2 is not None:
        raise ValueError("the engine rounds its output before the bias add: use it on a layer without biases")
    q = case.options.get("quant", MoEQuant())
    if q.a1 is not None or q.a2 is not None or any(as_operand(w).quantized for w in case.weights.w13):
        raise ValueError("the engine rounds scaled operands to bf16: use it on a bf16 layer")
    return gemm


HONEST_BF16 = {
    "fp32 chunks of 32": lambda case: bf16_candidate(case),
    "fp32 chunks of 128, reversed": lambda case: bf16_candidate(case, fp32_gemm(128, reverse=True)),
    "fp32 one chunk (BLAS)": lambda case: bf16_candidate(case, fp32_gemm(1 << 30)),
    "torch bf16 matmul": lambda case: bf16_candidate(case, _bf16_layer_only(case, torch_bf16_gemm())),
    "tensor-core FP32 adder, truncating": lambda case: bf16_candidate(case, tensor_core_gemm()),
    "top-k sum in reverse slot order": lambda case: bf16_candidate(case, fp32_gemm(64), dict(reverse=True)),
}
"""Honest variants for :data:`moeref.compare.BF16_OUTPUT` (bf16 GEMM outputs, bf16 activation, FP32 top-k
sum, bf16 output): FP32 GEMMs in other chunkings and orders, torch's CPU bf16 matmul, an adversarial
truncating tensor-core FP32 adder, the top-k slots summed in reverse."""

HONEST_HOPPER = {
    "emulated 14-bit WGMMA": lambda case: bf16_candidate(case, hopper_fp8_gemm()),
    "adversarial aligned adder (14 bits, headroom)": lambda case: bf16_candidate(
        case, tensor_core_gemm(14, 32, 128, headroom=1)),
}
"""Honest variants for :data:`moeref.compare.HOPPER_FP8_DEEPGEMM_DATA` on an FP8 1x128 x 128x128 layer."""


def _deepgemm_candidate(case: LayerCase, promotion: str = "deepgemm", **finalize) -> np.ndarray:
    from ..gemm.hopper_fp8 import deepgemm_engine

    return bf16_candidate(case, deepgemm_engine(promotion=promotion), finalize or None)


HONEST_DEEPGEMM = {
    "emulated DeepGEMM (bit-exact)": _deepgemm_candidate,
    "emulated DeepGEMM, top-k sum in reverse": lambda case: _deepgemm_candidate(case, reverse=True),
}
"""Honest variants for :data:`moeref.compare.DEEPGEMM_FP8_EXACT`: the layer with DeepGEMM's GEMMs as
:func:`moeref.gemm.hopper_fp8.deepgemm_engine` predicts them (bf16 GEMM outputs and activation, FP32
top-k sum in either slot order, bf16 output)."""


# ---------------------------------------------------------------------------------- subtle faults


def _intermediate_size(case: LayerCase) -> int:
    return int(as_operand(case.weights.w2[0]).shape[1])


def _per_gemm(case: LayerCase, gemm1=None, gemm2=None, base=None):
    """A GEMM engine that runs ``gemm1`` for GEMM1 and ``gemm2`` for GEMM2 (told apart by K: GEMM2
    reduces over the intermediate size); the default is ``base`` (None: :func:`fp32_gemm` (32))."""
    inter = _intermediate_size(case)
    base = base or fp32_gemm(32)

    def gemm(a, w):
        second = as_operand(a).shape[1] == inter
        return ((gemm2 if second else gemm1) or base)(a, w)

    return gemm


def _drop_last_column(which: int, base=None):
    def fault(case: LayerCase) -> np.ndarray:
        inner = base or fp32_gemm(32)

        def cut(a, w):
            a = as_operand(a)
            if base is not None:  # keep the block structure (an engine such as DeepGEMM's needs it)
                vals = np.array(a.values, dtype=np.float64)
                vals[:, -1] = 0.0
                return inner(BlockOperand(vals, a.scales, a.block, a.quantized), w)
            vals = a.dequantize().copy()
            vals[:, -1] = 0.0
            return inner(BlockOperand(vals, np.ones((1, 1)), (max(vals.shape[0], 1), vals.shape[1]), False), w)

        g = _per_gemm(case, gemm1=cut, base=base) if which == 1 else _per_gemm(case, gemm2=cut, base=base)
        return bf16_candidate(case, g)

    return fault


def _bias_twice(case: LayerCase, base=None) -> np.ndarray:
    lw = case.weights
    if lw.b2 is None:
        raise ValueError("the layer has no b2 bias")
    return bf16_candidate(case.with_(weights=replace(lw, b2=np.asarray(lw.b2) * 2)), base)


def _k_blocks(op: BlockOperand, s: int, e: int) -> BlockOperand:
    """Columns ``[s, e)`` of ``op`` on its scale-block boundaries, the blocks kept."""
    bk = op.block[1]
    if s % bk or (e % bk and e != op.shape[1]):
        raise ValueError(f"columns [{s}, {e}) do not lie on the scale blocks of {bk} columns")
    return BlockOperand(op.values[:, s:e], op.scales[:, s // bk:-(-e // bk)], op.block, op.quantized)


def _tile_bug(case: LayerCase, engine=None) -> np.ndarray:
    """Rows 16 and beyond of each expert's segment skip GEMM1's last 128 K columns (a tile-boundary bug)."""
    base = engine or fp32_gemm(32)
    inter = _intermediate_size(case)
    ids = np.asarray(case.topk_ids)
    if np.bincount(ids[ids >= 0]).max(initial=0) <= 16:
        raise ValueError("no expert has more than 16 rows: the tile bug does not show")

    def g1(a, w):
        a = as_operand(a)
        full = np.asarray(base(a, w), dtype=np.float64)
        if a.shape[0] <= 16 or a.shape[1] == inter:
            return full
        k = a.shape[1]
        if engine is not None:  # the kernel itself on the first K - 128 columns
            head = np.asarray(base(_k_blocks(a, 0, k - 128), _k_blocks(as_operand(w), 0, k - 128)), dtype=np.float64)
            full[16:] = head[16:]
            return full
        tail = np.asarray(base(_column_slice(a, slice(k - 128, k)), _column_slice(as_operand(w), slice(k - 128, k))),
                          dtype=np.float64)
        full[16:] -= tail[16:]
        return full

    return bf16_candidate(case, gemm=g1)


def _one_scale_block(case: LayerCase, base=None) -> np.ndarray:
    """One 128x128 block of GEMM1's weight scales of the busiest expert read from its K neighbour."""
    lw = case.weights
    e0 = _busiest(case)
    op = as_operand(lw.w13[e0])
    sc = op.scales.copy()
    if sc.shape[1] < 2:
        raise ValueError("the weights have one scale block along K: no neighbouring block")
    sc[0, 0] = sc[0, 1]
    w13 = list(lw.w13)
    w13[e0] = BlockOperand(op.values, sc, op.block, op.quantized)
    return bf16_candidate(case.with_(weights=replace(lw, w13=w13)), base)


def _router_weights_bf16(case: LayerCase, base=None) -> np.ndarray:
    from ..moe.pipeline import round_to_dtype

    w = round_to_dtype(np.asarray(case.topk_weights, dtype=np.float64), "bfloat16").astype(np.float32)
    return bf16_candidate(case.with_(topk_weights=w), base)


def _tanh_gelu(case: LayerCase, base=None) -> np.ndarray:
    if case.options.get("activation") != "gelu_and_mul":
        raise ValueError("the layer's activation is not gelu_and_mul")
    params = dict(case.options.get("activation_params") or {})
    params["approximate"] = "tanh"
    return bf16_candidate(case, base, activation_params=params)


def _fp8_intermediate(case: LayerCase, base=None) -> np.ndarray:
    import ml_dtypes

    if case.options.get("quant", MoEQuant()).a2 is not None:
        raise ValueError("the layer re-quantizes its intermediate: an FP8 store is its declared arithmetic")
    return bf16_candidate(case, base, act_out_dtype=ml_dtypes.float8_e4m3fn)


def _deepgemm_bf16_accumulator():
    """A fault for a DeepGEMM base: the block accumulators (exact emulation) promoted into a bf16
    accumulator (``final = bf16(final + fl32(fl32(sa sb) acc))`` per 128-column block)."""
    from ..gemm.hopper_fp8 import _check_deepgemm_operands, deepgemm_block_accumulators
    from ..moe.pipeline import round_to_dtype

    def gemm(a, w):
        a, w = _check_deepgemm_operands(a, w)
        acc = deepgemm_block_accumulators(a.values, w.values)
        sa = np.asarray(a.scales, dtype=np.float64)
        sb = np.repeat(np.asarray(w.scales, dtype=np.float64), w.block[0], axis=0)[: w.shape[0]]
        out = np.zeros(acc.shape[:2])
        for j in range(acc.shape[2]):  # a loop over K blocks
            s = (sa[:, None, j] * sb[None, :, j]).astype(np.float32).astype(np.float64)
            out = round_to_dtype(out + (s * acc[..., j]).astype(np.float32), "bfloat16")
        return out

    return gemm


def subtle_faults(base=None) -> dict:
    """:data:`SUBTLE_FAULTS` planted into a layer whose GEMMs run on ``base`` (a GEMM engine; None:
    :func:`fp32_gemm` (32), the arithmetic of :data:`moeref.compare.BF16_OUTPUT`). With
    ``base=moeref.gemm.hopper_fp8.deepgemm_engine()`` the faults sit in the emulated DeepGEMM layer
    (:data:`HONEST_DEEPGEMM`), so that an equality-level profile is measured on faults, not on the
    difference between two arithmetics; the bf16-accumulator faults then accumulate DeepGEMM's
    128-column blocks in bf16."""
    if base is None:
        acc_both, acc_2 = bf16_accumulator_gemm(32), bf16_accumulator_gemm(32)
        trunc_inner = fp32_gemm(32)
    else:
        acc_both = acc_2 = _deepgemm_bf16_accumulator()
        trunc_inner = base
    return {
        "bf16 accumulator in both GEMMs": lambda case: bf16_candidate(case, gemm=acc_both),
        "bf16 accumulator in GEMM2": lambda case: bf16_candidate(case, _per_gemm(case, gemm2=acc_2, base=base)),
        "intermediate stored as FP8 e4m3 instead of bf16": lambda case: _fp8_intermediate(case, base),
        "top-k weighted sum accumulated in bf16": lambda case: bf16_candidate(case, base,
                                                                                finalize=dict(acc_dtype="bfloat16")),
        "GEMM2 ignores the last intermediate column": _drop_last_column(2, base),
        "GEMM1 ignores the last K column": _drop_last_column(1, base),
        "bias b2 applied twice": lambda case: _bias_twice(case, base),
        "GEMM2 output truncated to bf16 (round toward zero)": lambda case: bf16_candidate(
            case, base, finalize=dict(gemm_out_rounding="zero")),
        "GEMM1 accumulator truncated to bf16 before the bias": lambda case: bf16_candidate(
            case, _per_gemm(case, gemm1=stored_gemm(trunc_inner, rounding="zero"), base=base)),
        "output truncated to bf16": lambda case: _truncate_to(bf16_candidate(case, base, finalize=dict(out_dtype=None)),
                                                              "bfloat16"),
        "router weights rounded to bf16": lambda case: _router_weights_bf16(case, base),
        "rows past 16 skip GEMM1's last K tile": lambda case: _tile_bug(case, base),
        "one GEMM1 weight-scale block from its K neighbour": lambda case: _one_scale_block(case, base),
        "tanh GELU instead of erf GELU": lambda case: _tanh_gelu(case, base),
    }


SUBTLE_FAULTS = subtle_faults()
"""Subtle planted faults, each computed otherwise like :func:`bf16_candidate` (the arithmetic of
:data:`moeref.compare.BF16_OUTPUT`); a fault raises ValueError where the layer cannot express it (no
bias, unquantized weights, another activation)."""
