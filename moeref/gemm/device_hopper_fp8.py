"""DeepGEMM's FP8 GEMM on Hopper, predicted bit for bit, on torch tensors (a CUDA GPU, or the CPU with the
Triton kernel interpreted): :func:`moeref.gemm.hopper_fp8.deepgemm_engine` at production shapes.

The NumPy emulator (:func:`~moeref.gemm.hopper_fp8.deepgemm_block_accumulators` then
:func:`~moeref.gemm.hopper_fp8.promote`) is the specification; the Triton kernel
(:mod:`moeref.gemm._hopper_fp8_kernel`) performs the same exact steps per output element: per 128-column K
block, four 32-column MMA steps from a cleared accumulator (addends aligned to the largest operand-exponent
sum, cut toward zero to ``2^(e - 13)``, summed exactly, the sum cut to 14 significant bits), then the FP32
promotion (``"deepgemm"``: ``fma(fl(sa*sb), acc, final)``, DeepGEMM's and our Triton and Gluon FP8 block
GEMMs'; ``"a_then_b"``: ``fma(fl(acc*sa), sb, final)``), in K-block order from 0. The result is the FP32
value before the kernel's bf16 store (float64 tensor), as the NumPy engine returns it.

The products are aligned and cut in int32 (:data:`INTEGER_ALIGN`; the float64 cut remains as the kernel's
other form, the same integers), and the block accumulators can be returned (``block_acc``) for
:func:`device_promote_combinations`, which replays the promotion with some blocks replaced by accumulators of
single 128-column blocks (:func:`device_block_accumulators`: the same block step, one launch for any mix of
experts and K blocks).

Memory: the expert weights are read as their uint8 codes through the E4M3 decode table (never decoded to
float64); the operand rows are gathered once, sorted by expert, as float64 values ``[R, K]`` (as uint8 codes
for the tensor cores). One launch covers every expert (work items of up to 16 rows of one expert; 64 for the
tensor cores, :data:`TC_TILE`).

**Where the block accumulators come from** (:data:`ACCUMULATOR_SOURCE`, or the ``source`` keyword). The
emulator is the specification: per 128-column block four 32-column MMA steps with integer alignment and
truncation, a few integer operations per product on the CUDA cores. On Hopper (a CUDA device of capability
exactly (9, 0), kernels compiled, not interpreted) the same kernel takes each block accumulator from the tensor
cores instead: a Triton ``tl.dot`` of the two E4M3 tiles with K = 128 into a cleared FP32 accumulator, which
sm_90 executes as four chained ``wgmma ... k32``, the instruction the model was calibrated on; the FP32
promotion, the scale term and the stores are the same code on the same values. The argument that the result is
still the model's has three parts:

1. the emulator is the specification (the NumPy emulator's bits, checked against DeepGEMM's and our Triton
   kernel's outputs: docs/hopper-fp8-accumulation.md);
2. measured: on an NVIDIA H200 (2026-11-28, ``bench/studies/wgmma_block_accumulators.py --rows 4096 --cols 2048
   --k 7168``, random codes over the whole E4M3 range) the tensor cores' block accumulators equal the emulator's,
   0 differing of 469,762,048 (1.0 ms on the tensor cores, 175 ms emulated);
3. proved on every call: the rows :func:`proof_rows` picks (runs of rows spread evenly over the call's rows in
   expert order, :data:`CHECK_FRACTION` of them and at least :data:`CHECK_ROWS`; ``check_fraction``,
   ``check_rows``) are computed again with the emulator and compared bit for bit with what the tensor cores gave:
   every output, block accumulator (``block_acc``) and scale term of those rows. A difference
   raises :class:`AccumulatorMismatchError` naming the row, the column and both values; nothing falls back
   silently.

Everywhere else (the CPU, Triton's interpreter, whose ``tl.dot`` is not Hopper's adder, any other GPU) and for a
model other than :data:`~moeref.gemm.hopper_fp8.HOPPER_FP8_MMA`, ``"auto"`` runs the emulator on every row.
"""
from __future__ import annotations

import math

import numpy as np

from .hopper_fp8 import HOPPER_FP8_MMA, MmaModel, _PROMOTIONS

__all__ = ["device_deepgemm_rows", "device_block_accumulators", "device_promote_combinations", "check_emulated_operands",
           "ACCUMULATOR_SOURCE", "CHECK_ROWS", "CHECK_FRACTION", "AccumulatorMismatchError", "tensor_cores_available",
           "proof_rows"]


TILES = {"many": (16, 16, 8), "few": (4, 64, 8)}
"""Work items of :func:`device_deepgemm_rows` ``(rows, BLOCK_N, warps)``: ``"many"`` where the experts have more
than 8 rows on average, else ``"few"`` (decode: about one row each)."""

INTEGER_ALIGN = True
"""Align and cut the products in int32 (``m << 14 >> shift`` of the significands' product ``m < 2^8``) rather
than in float64 (``(p * 2^-q).to(int64)``): the same integers (module :mod:`moeref.gemm._hopper_fp8_kernel`),
fewer and narrower operations per product."""


ACCUMULATOR_SOURCE = "auto"
"""Where :func:`device_deepgemm_rows` takes the block accumulators from when its ``source`` is None:
``"tensor_cores"`` (a Hopper GPU: :func:`tensor_cores_available`; else ``ValueError``), ``"emulator"`` (the
integer emulation, everywhere) or ``"auto"``: the tensor cores where available and the model is
:data:`~moeref.gemm.hopper_fp8.HOPPER_FP8_MMA`, else the emulator (module docstring)."""

SOURCES = ("auto", "tensor_cores", "emulator")
"""The values :data:`ACCUMULATOR_SOURCE` and ``source`` accept."""

CHECK_ROWS = 32
"""The fewest rows of a call that :func:`device_deepgemm_rows` proves with the emulator when the tensor cores
compute it (all of them when the call has fewer); the ``check_rows`` keyword overrides it per call."""

CHECK_FRACTION = 1 / 128
"""The share of a call's rows proved with the emulator when that is more than :data:`CHECK_ROWS`
(:func:`proof_rows`); the ``check_fraction`` keyword overrides it per call. At DeepSeek-V3's 4096 tokens GEMM1's
32,768 rows prove 256, so the proof costs 1/128 of emulating the GEMM."""

PROOF_RUN = 4
"""The proved rows come in runs of this many consecutive rows in expert order: whole work items of the
emulator (:data:`TILES` ``"few"``), so that proving costs what the rows cost."""

TC_TILE = (64, 64, 8)
"""Work items of the tensor-core form ``(rows, BLOCK_N, warps)``: 64 rows of one expert (``wgmma``'s M) by 64
columns, two warpgroups (``m64n32k32`` each). The FP32 promotion runs in float64 on the accumulator's registers;
of the tiles compiled for sm_90a (Triton 3.6, ptxas), this one spills least inside the K-block loop (34 local
memory operations per block, against 137 for 64 x 64 on 4 warps and 236 for 128 x 128 on 8)."""


class AccumulatorMismatchError(RuntimeError):
    """The tensor cores' result differs from the emulator's on a proved row (:func:`device_deepgemm_rows`): the
    Hopper FP8 accumulation model does not hold there. Nothing is returned; ``source="emulator"`` computes the
    model without the tensor cores."""


def tensor_cores_available(device) -> bool:
    """Whether :func:`device_deepgemm_rows` can take block accumulators from the tensor cores on ``device`` (a
    torch device or its name): a CUDA device of capability exactly (9, 0) (Hopper: H100, H200, H800, GH200),
    with Triton's kernels compiled (``TRITON_INTERPRET`` not ``1``: the interpreter's ``tl.dot`` is not Hopper's
    adder)."""
    from .._interop import triton_interpreted

    torch = _torch()
    dev = torch.device(device)
    if dev.type != "cuda" or triton_interpreted() or not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability(dev)) == (9, 0)


def _use_tensor_cores(source, model: MmaModel, dev) -> bool:
    """``source`` (None: :data:`ACCUMULATOR_SOURCE`) resolved for ``model`` on ``dev``."""
    src = ACCUMULATOR_SOURCE if source is None else source
    if not isinstance(src, str) or src not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES} (or None: ACCUMULATOR_SOURCE); got {src!r}")
    if src == "emulator":
        return False
    if src == "auto":
        return model == HOPPER_FP8_MMA and tensor_cores_available(dev)
    if not tensor_cores_available(dev):
        torch = _torch()
        where = (f"{torch.cuda.get_device_name(dev)} (capability {tuple(torch.cuda.get_device_capability(dev))})"
                 if torch.device(dev).type == "cuda" and torch.cuda.is_available() else str(dev))
        raise ValueError(f"source='tensor_cores' needs a Hopper GPU (CUDA capability (9, 0)) with compiled Triton "
                         f"kernels (TRITON_INTERPRET not 1); the weights are on {where}: use 'auto' or 'emulator'")
    if model != HOPPER_FP8_MMA:
        raise ValueError(f"the tensor cores compute the calibrated model HOPPER_FP8_MMA only; got {model}: use "
                         f"source='emulator'")
    return True


def proof_rows(row_expert, check_rows: int = CHECK_ROWS, check_fraction: float = CHECK_FRACTION) -> np.ndarray:
    """The rows :func:`device_deepgemm_rows` proves with the emulator when the tensor cores compute them: sorted
    int64 indices into ``row_expert`` (int ``[R]``, -1 padding), never a padding row, deterministic.

    With ``S`` the ``V`` non-padding rows sorted by expert (index order within an expert), ``m = min(V,
    max(check_rows, ceil(check_fraction V)))`` and ``u = ceil(m / PROOF_RUN)`` runs: run ``j`` is ``S[p]`` for
    ``p = floor(j V / u) + t``, ``t = 0 .. PROOF_RUN - 1``, ``p < V``. So the runs are spread evenly from the first
    row in expert order, at least ``m`` rows are proved (``m = V``: every row), and fewer than ``m + PROOF_RUN``;
    ``check_rows >= 1``, so a call with a row always proves one.
    """
    if isinstance(check_rows, bool) or not isinstance(check_rows, (int, np.integer)):
        raise TypeError(f"check_rows must be an int; got {type(check_rows).__name__}")
    if isinstance(check_fraction, bool) or not isinstance(check_fraction, (int, float, np.floating, np.integer)):
        raise TypeError(f"check_fraction must be a float; got {type(check_fraction).__name__}")
    if check_rows < 1 or not 0 <= check_fraction <= 1:
        raise ValueError(f"check_rows must be >= 1 (every call proves a row) and check_fraction in [0, 1]; got "
                         f"{check_rows} and {check_fraction}")
    rows = np.asarray(row_expert).reshape(-1)
    valid = np.flatnonzero(rows >= 0)
    v = valid.size
    m = min(v, max(int(check_rows), math.ceil(float(check_fraction) * v)))
    if m == 0:  # no row to compute
        return np.zeros(0, dtype=np.int64)
    srt = valid[np.argsort(rows[valid], kind="stable")]
    u = -(-m // PROOF_RUN)
    pos = ((np.arange(u, dtype=np.int64) * v) // u)[:, None] + np.arange(PROOF_RUN)[None, :]
    return np.sort(srt[np.unique(pos[pos < v])]).astype(np.int64)


def _integer_table(dev):
    """int32 ``[2, 256]``: per E4M3 code, the magnitude's significand as an integer (``|x| 2^(3 - e)``: 8..15
    normal, 1..7 subnormal, 0 for a zero) and the operand exponent ``e``
    (:func:`moeref.gemm.hopper_fp8.operand_exponents`: -6 for subnormals, -1000 for zeros; NaN codes as
    zeros: the operands never hold them)."""
    from ..formats import decode_table
    from .hopper_fp8 import operand_exponents

    v = np.abs(np.array(decode_table("e4m3fn"), dtype=np.float64))
    v = np.where(np.isfinite(v), v, 0.0)
    e = operand_exponents(v)
    m = np.where(v != 0, v * np.exp2(3.0 - np.where(v != 0, e, 0)), 0.0)
    return _torch().as_tensor(np.stack([m, e]).astype(np.int32), device=dev)


def _decode_table(dev):
    """float64 ``[256]``: the E4M3 value of every code on ``dev``, NaN codes as 0 (the operands never hold them)."""
    from ..formats import decode_table

    torch = _torch()
    table = torch.as_tensor(np.array(decode_table("e4m3fn")), dtype=torch.float64, device=dev)
    return torch.where(torch.isfinite(table), table, torch.zeros((), dtype=torch.float64, device=dev))


def _torch():
    import torch

    return torch


def _check_model(model: MmaModel) -> None:
    if (model.group != model.inst_k or model.align_rounding != "trunc" or model.norm_rounding != "trunc"
            or model.align_exponent != "operands"):
        raise ValueError(f"the device emulator runs the calibrated family of models (one group per MMA of inst_k "
                         f"columns, truncating alignment and normalisation, operand exponents); got {model}")
    if model.align_bits > 20:
        raise ValueError(f"the device emulator sums aligned addends as int64 below 2^(align_bits + 9); "
                         f"align_bits must be <= 20, got {model.align_bits}")


def check_emulated_operands(a, weights) -> None:
    """The contract of :func:`moeref.gemm.hopper_fp8.deepgemm_engine`, for a device operand ``a``
    (:class:`moeref.gemm.device.DeviceOperand`) and a device :class:`moeref.gemm.StackedExperts`: E4M3
    elements, ``a`` with 1x128 scale blocks, the weights with 128x128 blocks, K a multiple of 128, no NaN
    code in the weights. ``ValueError``/``TypeError`` naming what is wrong."""
    _check_emulated_weights(weights)
    k = weights.shape[1]
    if not a.quantized or (a.codes is not None and a.element != "e4m3fn"):
        raise ValueError("the emulated DeepGEMM GEMM needs quantized E4M3 operands "
                         f"(got element {a.element!r}, quantized={a.quantized})")
    if a.block[1] != 128 or (a.block[0] != 1 and a.shape[0] > 1):
        raise ValueError(f"a must have 1x128 scale blocks (DeepGEMM's activations); got blocks {a.block}")
    if a.shape[1] != k:
        raise ValueError(f"a has K={a.shape[1]} but the experts have K={k}")


def _check_emulated_weights(weights) -> None:
    """:func:`check_emulated_operands`' part on the weights: a device :class:`moeref.gemm.StackedExperts` of E4M3
    codes with 128x128 scale blocks, K a multiple of 128, no NaN code (checked once per codes tensor)."""
    from .device import _has_nan_codes
    from .stacked import StackedExperts

    if not isinstance(weights, StackedExperts):
        raise TypeError(f"the emulated DeepGEMM GEMM takes StackedExperts FP8 weights; got {type(weights).__name__}")
    n, k = weights.shape
    if weights.element != "e4m3fn" or weights.magnitude:
        raise ValueError(f"the emulated DeepGEMM GEMM needs E4M3 (e4m3fn) weights; got {weights.element!r}")
    if tuple(weights.block) not in ((128, 128), (min(128, n), 128)):
        raise ValueError(f"w must have 128x128 scale blocks (DeepGEMM's weights); got blocks {weights.block}")
    if k % 128:
        raise ValueError(f"DeepGEMM's FP8 GEMM needs K to be a multiple of 128; got K={k}")
    if _has_nan_codes(weights.codes, "e4m3fn"):
        raise ValueError("w holds NaN codes; E4M3 operands must be finite")


def _check_values(v) -> None:
    torch = _torch()
    if not bool(torch.isfinite(v).all()):
        raise ValueError("a holds NaN or inf; E4M3 operands must be finite")
    if not bool((v.to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64) == v).all()):
        raise ValueError("a holds values that are not E4M3 (float8_e4m3fn) values")


def _fp32(x):
    torch = _torch()
    return x.to(torch.float32).to(torch.float64)


def device_deepgemm_rows(a, row_expert, weights, *, promotion: str = "deepgemm", model: MmaModel = HOPPER_FP8_MMA,
                         values=None, scale_term=None, block_acc: bool = False, source: str | None = None,
                         check_rows: int | None = None, check_fraction: float | None = None):
    """``out[r] = a[r] @ W[row_expert[r]].T`` as DeepGEMM's FP8 GEMM computes it before its output store:
    :func:`moeref.gemm.expert_rows_gemm` with ``gemm=deepgemm_engine(model, promotion)``, bit for bit, on the
    weights' device. 0 on rows with ``row_expert == -1``.

    Args:
        a: ``[R, K]`` E4M3 operand with 1x128 scales (:func:`moeref.gemm.device.device_operand` input).
        row_expert: int ``[R]`` (NumPy or torch), -1 padding.
        weights: a :class:`moeref.gemm.StackedExperts` of E4M3 codes with 128x128 scales on the device.
        promotion: ``"deepgemm"`` or ``"a_then_b"`` (:func:`moeref.gemm.hopper_fp8.promote`).
        values: optional float64 ``[R, K]`` E4M3 values used instead of ``a``'s elements (``a``'s scales
            kept): the enumeration of uncertain codes (:mod:`moeref.compare.device.emulated`).
        scale_term: optional ``(ds, s_hi, coef)``: float64 ``[R, K/128]`` tensors and a float; then also
            returns ``st[r, n] = sum_b m_b ds[r, b] + coef * sum_b m_b s_hi[r, b]``, ``m_b = |acc_b| |sb_b|``
            (block accumulator ``acc_b``, weight scale ``sb_b`` as given, not rounded to FP32), sums in block
            order from 0 (:func:`moeref.compare.emulated_gemm._emulated_gemm`'s scale term).
        block_acc: also return every block accumulator, float32 ``[R, K/128, N]``.
        source: where the block accumulators come from: ``"tensor_cores"``, ``"emulator"`` or ``"auto"``; None:
            :data:`ACCUMULATOR_SOURCE` (module docstring). The result is the same bits either way.
        check_rows, check_fraction: with the tensor cores, at least ``max(check_rows, ceil(check_fraction V))``
            of the call's ``V`` rows (all when fewer) are computed again with the emulator and compared bit for bit
            (:func:`proof_rows`); None: :data:`CHECK_ROWS`, :data:`CHECK_FRACTION`.

    Returns: float64 ``[R, N]`` tensor of FP32 values (and ``st`` with ``scale_term``; ``(out, st, acc)`` with
    ``block_acc``, ``st`` None without ``scale_term``).

    Raises:
        AccumulatorMismatchError: the tensor cores' result differs from the emulator's on a proved row.
    """
    torch = _torch()
    from .device import device_operand
    from .grouped import check_row_expert

    if promotion not in ("deepgemm", "a_then_b"):
        raise ValueError(f"promotion must be 'deepgemm' or 'a_then_b' on the device (of {_PROMOTIONS}); "
                         f"got {promotion!r}")
    _check_model(model)
    dev = weights.codes.device if hasattr(weights, "codes") else None
    a = device_operand(a, dev)
    check_emulated_operands(a, weights)
    rows = check_row_expert(row_expert.cpu().numpy() if torch.is_tensor(row_expert) else row_expert, a.shape[0],
                            len(weights))
    tc = _use_tensor_cores(source, model, dev)
    proved = proof_rows(rows, CHECK_ROWS if check_rows is None else check_rows,
                        CHECK_FRACTION if check_fraction is None else check_fraction) if tc else None
    got = _rows(a, rows, weights, promotion, model, values, scale_term, block_acc, tc)
    if tc:
        _prove(got, a, rows, proved, weights, promotion, values, scale_term, block_acc)
    return got


def _prove(got, a, rows, proved, weights, promotion, values, scale_term, block_acc) -> None:
    """Computes the rows ``proved`` again with the emulator and compares every returned tensor on them bit for
    bit with ``got`` (the tensor cores' result); :class:`AccumulatorMismatchError` at the first difference."""
    torch = _torch()
    if proved.size == 0:
        return
    dev = weights.codes.device
    it = torch.as_tensor(proved, device=dev)
    sub_values = None if values is None else values.index_select(0, it)
    sub_st = None if scale_term is None else (scale_term[0].index_select(0, it), scale_term[1].index_select(0, it),
                                              scale_term[2])
    want = _rows(a.take_rows(it), rows[proved], weights, promotion, HOPPER_FP8_MMA, sub_values, sub_st, block_acc,
                 False)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    _compare_proved(zip(("output", "scale term", "block accumulator"), got, want), proved, rows)


def _compare_proved(named, proved, rows) -> None:
    """``named``: ``(name, got, want)``, ``got`` the tensor cores' tensor over the call's rows and ``want`` the
    emulator's over the rows ``proved``; :class:`AccumulatorMismatchError` at the first difference (block
    accumulators first)."""
    torch = _torch()
    for name, g, w in sorted(named, key=lambda t: t[0] != "block accumulator"):
        if g is None:
            continue
        g = g.index_select(0, torch.as_tensor(proved, device=g.device))
        bits = torch.int64 if g.dtype == torch.float64 else torch.int32
        diff = g.view(bits) != w.view(bits)
        if bool(diff.any()):
            pos = [int(x) for x in torch.nonzero(diff)[0].tolist()]
            row = int(proved[pos[0]])
            where = f"column {pos[-1]}" + (f", K block {pos[1]}" if len(pos) == 3 else "")
            raise AccumulatorMismatchError(
                f"the tensor cores' {name} differs from the emulator's at row {row} (expert {int(rows[row])}), "
                f"{where}: {float(g[tuple(pos)])!r} != {float(w[tuple(pos)])!r} ({int(diff.sum())} of "
                f"{diff.numel()} values of the {proved.size} proved rows differ): the Hopper FP8 accumulation model "
                f"does not hold here; source='emulator' computes the model without the tensor cores")


def _rows(a, rows, weights, promotion, model, values, scale_term, block_acc, tc):
    """:func:`device_deepgemm_rows` on checked arguments, the block accumulators from the tensor cores (``tc``)
    or the emulator."""
    torch = _torch()
    import triton

    from ._hopper_fp8_kernel import hopper_fp8_kernel, hopper_fp8_kernel_interpreted
    from .device import _items

    dev = weights.codes.device
    n, k = weights.shape
    nb = k // 128
    r_all = rows.size
    out = torch.zeros((r_all, n), dtype=torch.float64, device=dev)
    st_out = torch.zeros_like(out) if scale_term is not None else None
    acc_out = torch.zeros((r_all, nb, n), dtype=torch.float32, device=dev) if block_acc else None

    def result():
        if block_acc:
            return out, st_out, acc_out
        return (out, st_out) if scale_term is not None else out

    order = np.argsort(rows, kind="stable")
    first = int(np.searchsorted(rows[order], 0))
    order = order[first:]
    if order.size == 0 or n == 0:
        return result()
    experts, starts, counts = np.unique(rows[order], return_index=True, return_counts=True)
    order_t = torch.as_tensor(order, device=dev)
    if tc and values is None and a.codes is not None:  # the codes themselves (E4M3: check_emulated_operands)
        av = a.codes.index_select(0, order_t)
        av = av & 0x7F if a.magnitude else av
    else:
        av = (a.decode() if values is None else values.to(device=dev, dtype=torch.float64)).index_select(0, order_t)
        if values is not None:
            if tuple(values.shape) != a.shape:
                raise ValueError(f"values must have a's shape {a.shape}; got {tuple(values.shape)}")
            _check_values(av)
        elif a.values is not None:
            _check_values(av)
        if tc:  # E4M3 values (checked): their codes, exactly
            av = av.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    sa = a.scales if a.scales.shape[0] == a.shape[0] else a.scales.expand(a.shape[0], -1)
    sa = _fp32(sa.index_select(0, order_t)).contiguous()
    sb_raw = weights.scales.to(torch.float64).contiguous()
    sb = _fp32(sb_raw)
    table = _decode_table(dev)
    codes = weights.codes
    if codes.stride(2) != 1:
        codes = codes.contiguous()
    rows_per, block_n, warps = TC_TILE if tc else TILES["many" if float(counts.mean()) > 8 else "few"]
    per, first_row, cnt = _items(starts, counts, rows_per)
    items = torch.as_tensor(np.stack([np.repeat(experts, per), first_row, cnt], axis=1).astype(np.int32), device=dev)
    res = torch.empty((order.size, n), dtype=torch.float64, device=dev)
    if scale_term is not None:
        ds, s_hi, coef = scale_term
        ds = ds.to(torch.float64).index_select(0, order_t).contiguous()
        s_hi = s_hi.to(torch.float64).index_select(0, order_t).contiguous()
        if tuple(ds.shape) != (order.size, nb) or tuple(s_hi.shape) != (order.size, nb):
            raise ValueError(f"scale_term's ds and s_hi must be [R, {nb}]")
        st = torch.empty_like(res)
        coef_t = torch.tensor([float(coef)], dtype=torch.float64, device=dev)
    else:
        ds = s_hi = st = coef_t = res  # dummy pointers (SCALE_TERM is False)
    acc = torch.empty((order.size, nb, n), dtype=torch.float32, device=dev) if block_acc else res
    grid = (int(items.shape[0]), triton.cdiv(n, block_n))
    kernel = hopper_fp8_kernel if dev.type == "cuda" else hopper_fp8_kernel_interpreted
    kernel[grid](av.contiguous(), sa, codes, table, _integer_table(dev), sb, sb_raw, items, res, ds, s_hi, st, coef_t,
                 acc, n, k, nb,
                 codes.stride(0), codes.stride(1), sb.stride(0), sb.stride(1), n, nb, NB=nb,
                 W_BN=int(weights.block[0]), ROWS=rows_per, BLOCK_N=block_n, PROMO=0 if promotion == "deepgemm" else 1,
                 SCALE_TERM=scale_term is not None, ALIGN=int(model.align_bits), NORM=int(model.norm_bits),
                 STEPS=128 // model.inst_k, INST=int(model.inst_k), STORE_ACC=block_acc,
                 INTEGER=bool(INTEGER_ALIGN), TC=bool(tc), num_warps=warps,
                 enable_fp_fusion=False)
    out[order_t] = res
    if scale_term is not None:
        st_out[order_t] = st
    if block_acc:
        acc_out[order_t] = acc
    return result()


def device_block_accumulators(values, row_expert, k_block, weights, *, model: MmaModel = HOPPER_FP8_MMA,
                              source: str | None = None, check_rows: int | None = None,
                              check_fraction: float | None = None):
    """``acc[r, n]``: the accumulator of one 128-column K block, row ``r``'s E4M3 values ``values[r]`` against the
    columns ``128 k_block[r] ..`` of expert ``row_expert[r]``'s weights, from a cleared accumulator: the block
    accumulator :func:`device_deepgemm_rows` returns (``block_acc``) for block ``k_block[r]`` of a whole row whose
    block holds these values (a block's accumulator depends on its own columns alone), bit for bit. 0 on rows with
    ``row_expert == -1``. One launch for every (expert, block) pair; the weights' codes are read in place.

    Args:
        values: float64 ``[R, 128]`` E4M3 values (unscaled).
        row_expert: int ``[R]`` (NumPy or torch), -1 padding.
        k_block: int ``[R]`` (NumPy or torch), each row's K block of the weights, ``0 <= k_block < K/128``.
        weights: a device :class:`moeref.gemm.StackedExperts` of E4M3 codes with 128x128 scales (the scales are
            not read).
        model, source, check_rows, check_fraction: as :func:`device_deepgemm_rows` (with the tensor cores, the
            proved rows are computed again with the emulator and compared bit for bit).

    Returns: float64 ``[R, N]`` tensor of FP32 values.

    Raises:
        AccumulatorMismatchError: the tensor cores' result differs from the emulator's on a proved row.
    """
    torch = _torch()
    from .grouped import check_row_expert

    _check_model(model)
    _check_emulated_weights(weights)
    dev = weights.codes.device
    nb = int(weights.shape[1]) // 128
    if not torch.is_tensor(values):
        raise TypeError(f"values must be a float64 [R, 128] tensor; got {type(values).__name__}")
    if values.ndim != 2 or int(values.shape[1]) != 128:
        raise ValueError(f"values must be a float64 [R, 128] tensor; got shape {tuple(values.shape)}")
    values = values.to(device=dev, dtype=torch.float64)
    rows = check_row_expert(row_expert.cpu().numpy() if torch.is_tensor(row_expert) else row_expert,
                            int(values.shape[0]), len(weights))
    kb = np.asarray(k_block.cpu().numpy() if torch.is_tensor(k_block) else k_block).reshape(-1)
    if kb.shape != rows.shape or not np.issubdtype(kb.dtype, np.integer):
        raise ValueError(f"k_block must be int [{rows.size}]; got {kb.dtype} {kb.shape}")
    bad = np.flatnonzero((rows >= 0) & ((kb < 0) | (kb >= nb)))
    if bad.size:
        raise ValueError(f"k_block must be in [0, {nb}) (K/128) on non-padding rows; got k_block[{int(bad[0])}] = "
                         f"{int(kb[bad[0]])}")
    kb = kb.astype(np.int64)
    _check_values(values)
    tc = _use_tensor_cores(source, model, dev)
    got = _block_rows(values, rows, kb, weights, model, tc)
    if tc:
        proved = proof_rows(rows, CHECK_ROWS if check_rows is None else check_rows,
                            CHECK_FRACTION if check_fraction is None else check_fraction)
        if proved.size:
            want = _block_rows(values.index_select(0, torch.as_tensor(proved, device=dev)), rows[proved],
                               kb[proved], weights, HOPPER_FP8_MMA, False)
            _compare_proved([("block accumulator", got, want)], proved, rows)
    return got


def _block_rows(values, rows, kb, weights, model, tc):
    """:func:`device_block_accumulators` on checked arguments: the rows sorted by (expert, K block), work items of
    one pair each (:func:`moeref.gemm._hopper_fp8_kernel.hopper_fp8_block_kernel`)."""
    torch = _torch()
    import triton

    from ._hopper_fp8_kernel import hopper_fp8_block_kernel
    from .device import _items

    dev = weights.codes.device
    n, k = weights.shape
    nb = k // 128
    out = torch.zeros((rows.size, n), dtype=torch.float64, device=dev)
    valid = np.flatnonzero(rows >= 0)
    if valid.size == 0 or n == 0:
        return out
    key = rows[valid] * nb + kb[valid]
    order = valid[np.argsort(key, kind="stable")]
    pairs, starts, counts = np.unique(rows[order] * nb + kb[order], return_index=True, return_counts=True)
    order_t = torch.as_tensor(order, device=dev)
    av = values.index_select(0, order_t)
    if tc:  # E4M3 values (checked): their codes, exactly
        av = av.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = weights.codes
    if codes.stride(2) != 1:
        codes = codes.contiguous()
    rows_per, block_n, warps = TC_TILE if tc else TILES["many" if float(counts.mean()) > 8 else "few"]
    per, first_row, cnt = _items(starts, counts, rows_per)
    items = torch.as_tensor(np.stack([np.repeat(pairs // nb, per), first_row, cnt, np.repeat(pairs % nb, per)],
                                     axis=1).astype(np.int32), device=dev)
    res = torch.empty((order.size, n), dtype=torch.float64, device=dev)
    grid = (int(items.shape[0]), triton.cdiv(n, block_n))
    hopper_fp8_block_kernel[grid](av.contiguous(), codes, _decode_table(dev), _integer_table(dev), items, res, n, 128,
                                  codes.stride(0), codes.stride(1), n, ROWS=rows_per, BLOCK_N=block_n,
                                  ALIGN=int(model.align_bits), NORM=int(model.norm_bits), STEPS=128 // model.inst_k,
                                  INST=int(model.inst_k), INTEGER=bool(INTEGER_ALIGN), TC=bool(tc), num_warps=warps,
                                  enable_fp_fusion=False)
    out[order_t] = res
    return out


def device_promote_combinations(acc, variants, vbase, j0, nbit, ncomb, row_expert, sa, weights, scale_term, center, *,
                                promotion: str = "deepgemm"):
    """``worst[r, n] = max_c (|y_c[r, n] - center[r, n]| + st_c[r, n])`` over the combinations ``c < ncomb[r]``
    of row ``r``'s uncertain codes, where ``y_c`` and ``st_c`` are what :func:`device_deepgemm_rows` (with
    ``scale_term``) returns for the row's operand under combination ``c``, bit for bit, computed from block
    accumulators instead of emulating the row again: a block's accumulator depends only on that block's codes
    (each block starts from a cleared accumulator), so only the blocks holding uncertain codes are emulated per
    combination (by the caller, once per distinct block content), and the FP32 promotion and the scale term are
    replayed here with the same operations in block order. The blocks before a row's first varied block are the
    same under every combination: they are promoted once, and each combination continues the chain from there.
    The rows are taken in order of combination count, then first varied block, so that on a GPU each program of
    rows loops to its own largest count and from its own smallest first block (the interpreter: to the call's
    largest count, the steps outside a row's own bounds masked off); a row with one combination costs one pass
    over its blocks.

    Args:
        acc: float32 ``[R, NB, N]``, the center's block accumulators (``device_deepgemm_rows(block_acc=True)``).
        variants: float64 ``[V, N]`` block accumulators of the uncertain blocks' combinations.
        vbase, j0, nbit: int32 ``[R, NB]``: block ``kb`` of row ``r`` takes, under combination ``c``, the
            variant row ``vbase + ((c >> j0) & (2^nbit - 1))`` where ``vbase >= 0``, else ``acc[r, kb]``.
        ncomb: int32 ``[R]``, the row's number of combinations (``2^(uncertain codes)``).
        row_expert: int ``[R]`` (>= 0), sa: the rows' scales ``[R, NB]`` as the operand holds them,
        weights: the device :class:`moeref.gemm.StackedExperts` (its scales are read),
        scale_term: ``(ds, s_hi, coef)`` as :func:`device_deepgemm_rows` takes it,
        center: float64 ``[R, N]``.

    Returns: float64 ``[R, N]``.
    """
    torch = _torch()
    import triton

    from ._hopper_fp8_kernel import combos_kernel, combos_kernel_interpreted

    if promotion not in ("deepgemm", "a_then_b"):
        raise ValueError(f"promotion must be 'deepgemm' or 'a_then_b' on the device; got {promotion!r}")
    r, nb, n = (int(d) for d in acc.shape)
    dev = acc.device
    worst = torch.zeros((r, n), dtype=torch.float64, device=dev)
    if r == 0 or n == 0:
        return worst
    ds, s_hi, coef = scale_term
    sb_raw = weights.scales.to(torch.float64).contiguous()
    sb = _fp32(sb_raw)
    i32 = lambda t: torch.as_tensor(t, device=dev).to(torch.int32).contiguous()  # noqa: E731
    vbase_t, ncomb_t = i32(vbase), i32(ncomb)
    # each row's first varied block (NB: none), and the rows' order: by combination count, then first varied
    # block, so that the rows of a program share their loop bounds (the compiled kernel reads them per program)
    blk = torch.arange(nb, device=dev, dtype=torch.int32)
    first = torch.where(vbase_t >= 0, blk[None, :], torch.full_like(vbase_t, nb)).amin(dim=1).to(torch.int32)
    order = torch.argsort(ncomb_t.to(torch.int64) * (nb + 1) + first, stable=True).to(torch.int32)
    rows_per, block_n = 16, 32
    grid = (triton.cdiv(r, rows_per), triton.cdiv(n, block_n))
    var = variants if variants.numel() else torch.zeros((1, n), dtype=torch.float64, device=dev)
    args = (acc.contiguous(), var.contiguous(), vbase_t, i32(j0), i32(nbit), ncomb_t, first.contiguous(), order,
            i32(row_expert), _fp32(sa.to(torch.float64)).contiguous(), sb, sb_raw, ds.to(torch.float64).contiguous(),
            s_hi.to(torch.float64).contiguous(), torch.tensor([float(coef)], dtype=torch.float64, device=dev),
            center.contiguous(), worst, r, n, sb.stride(0), sb.stride(1), nb)
    meta = dict(W_BN=int(weights.block[0]), ROWS=rows_per, BLOCK_N=block_n, PROMO=0 if promotion == "deepgemm" else 1,
                num_warps=4, enable_fp_fusion=False)
    if dev.type == "cuda":
        combos_kernel[grid](*args, **meta)
    else:  # the interpreter's loops: constexpr bounds (the launch's largest ncomb, NB)
        cmax = int(ncomb_t.max())
        combos_kernel_interpreted[grid](*args, CMAX=cmax, **meta)
    return worst
