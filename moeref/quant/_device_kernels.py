"""The one Triton kernel of :mod:`moeref.quant.device`: scaling and element codes in one pass over the input.

:func:`scaled_codes` computes, per element, exactly the torch steps 3 to 5 of
:func:`moeref.quant.device.device_quantize` (its module docstring), fused so the input is read once and the codes
written once:

1. load the element (float16, bfloat16 or float32) and widen it to float32 (exact; bfloat16 by its bits, the high
   half of a float32, since the Triton interpreter's bfloat16 conversion loses subnormals);
2. one IEEE operation with its block's float32 factor: ``x * f`` or ``x / f``, correctly rounded, as the torch
   path's tensor-by-tensor product and quotient (``tl.math.div_rn``: Triton's ``/`` is an approximate
   ``div.full.f32`` on the GPU; a lone product is never contracted, and the kernel is compiled with
   ``enable_fp_fusion=False`` besides; the GPU's float32 ``mul``/``div.rn`` keep subnormals);
3. a NaN result takes the quiet NaN ``0x7FC00000`` of the torch path's sign: the input's sign bit where the input
   is a NaN, else the host NumPy's sign of a NaN the operation creates (``host_negative``);
4. the code from the codec's own table (:func:`moeref.formats.codec.code_table_f32`, copied to the device by the
   caller) at ``(bits >> shift) << 1 | sticky`` of the float32 bits, as ``_lookup`` does;
5. ``signed_zero="drop"``: the negative-zero code becomes 0.

Scope (the caller, :func:`moeref.quant.device.device_quantize`, takes the torch path otherwise): float32 working
dtype and factors (input float16/bfloat16/float32), no NaN-scale block, element formats of more than 4 bits (one
code per byte, unpacked), a block grid over the last one or two axes. A table with error markers (negative
entries: a value the format cannot encode) gives the marker's low byte as the code and a nonzero flag for the
program; the caller then raises the codec's error through the host quantizer.

Shares nothing with :mod:`fastpath` (the reference never runs the kernels it judges): the arithmetic is the two
IEEE operations above, the codes are the codec's table. Runs on CUDA, or on CPU tensors under
``TRITON_INTERPRET=1`` (how ``property_tests/test_quant_device.py`` checks it, bit for bit, against the torch
path and :func:`moeref.quant.quantize`).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["scaled_codes"]

_BLOCK = 1024  # elements of one row per program


@triton.jit
def _scaled_codes_kernel(x_ptr, f_ptr, table_ptr, out_ptr, flag_ptr, N0, N1, n0, n1, B0, B1, n_col_tiles,
                         SHIFT: tl.constexpr, DIV: tl.constexpr, HOST_NEG: tl.constexpr, IN_BITS: tl.constexpr,
                         IN_BF16: tl.constexpr,
                         MARKED: tl.constexpr, DROP_NEG_ZERO: tl.constexpr, SIGN_MASK: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)  # a row of the [L * N0, N1] view
    tile = tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    m = cols < N1
    lead = row // N0
    i = row % N0
    base = row.to(tl.int64) * N1
    x = tl.load(x_ptr + base + cols, mask=m, other=0.0)
    if IN_BITS == 16:
        xi = x.to(tl.int16, bitcast=True)
        in_neg = xi < 0
        if IN_BF16:  # bfloat16 is the high half of float32: the exact widening, subnormals included
            xw = (xi.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            xw = x.to(tl.float32)
    else:
        in_neg = x.to(tl.int32, bitcast=True) < 0
        xw = x.to(tl.float32)
    fidx = (lead.to(tl.int64) * n0 + i // B0) * n1 + cols // B1
    f = tl.load(f_ptr + fidx, mask=m, other=1.0)
    if DIV:
        s = tl.math.div_rn(xw, f)
    else:
        s = xw * f
    u = s.to(tl.int32, bitcast=True)
    neg = tl.where(xw != xw, in_neg, HOST_NEG)
    canon = tl.where(neg, -4194304, 0x7FC00000)  # 0xFFC00000 as int32, or 0x7FC00000
    u = tl.where(s != s, canon, u)
    hi = (u >> SHIFT) & ((1 << (32 - SHIFT)) - 1)  # a logical shift of the uint32 bits
    idx = (hi << 1) | ((u & ((1 << SHIFT) - 1)) != 0).to(tl.int32)
    code = tl.load(table_ptr + idx, mask=m, other=0)
    if MARKED:
        bad = tl.max(tl.where(m & (code < 0), 1, 0), axis=0)
        tl.store(flag_ptr + row.to(tl.int64) * n_col_tiles + tile, bad)
    c8 = code.to(tl.uint8)
    if DROP_NEG_ZERO:
        c8 = tl.where(c8 == SIGN_MASK, 0, c8).to(tl.uint8)
    tl.store(out_ptr + base + cols, c8, mask=m)


def scaled_codes(x, factor, block, op: str, table, shift: int, *, host_negative: bool, drop_negative_zero: bool,
                 sign_mask: int):
    """uint8 element codes of ``x`` scaled by its blocks' factors (module docstring) -> ``(codes, flags)``.

    Args:
        x: float16/bfloat16/float32 tensor, contiguous, at least one axis; codes have its shape.
        factor: float32 tensor, the block grid of ``x`` (its leading axes, then one entry per block of the last
            ``len(block)`` axes), contiguous, on ``x``'s device.
        block: the block shape over the last one or two axes.
        op: ``"mul"`` or ``"div"`` (the scale rule's operation).
        table: the codec's code table on the device: uint8, or int16 with negative error markers.
        shift: the table's shift (:func:`moeref.formats.codec.code_table_f32`).
        host_negative: the sign of a NaN the operation creates (the host NumPy's).
        drop_negative_zero: ``signed_zero="drop"``: the code ``sign_mask`` becomes 0.

    ``flags``: None for an unmarked table, else an int32 tensor, nonzero where a program met a marker (the
    flag pointer of an unmarked launch is ``out``, never written through).
    """
    k = len(block)
    if k not in (1, 2) or x.dim() < k:
        raise ValueError(f"scaled_codes takes blocks over the last one or two axes; got block {tuple(block)} for "
                         f"shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or factor.dtype != torch.float32:
        raise TypeError(f"scaled_codes takes float16/bfloat16/float32 input and float32 factors; got {x.dtype}, "
                        f"{factor.dtype}")
    if op not in ("mul", "div"):
        raise ValueError(f"op must be 'mul' or 'div'; got {op!r}")
    shape = tuple(int(d) for d in x.shape)
    n1_len = shape[-1]
    n0_len = shape[-2] if k == 2 else 1
    b0, b1 = (int(block[0]), int(block[1])) if k == 2 else (1, int(block[0]))
    g0, g1 = -(-n0_len // b0), -(-n1_len // b1)
    rows = x.numel() // max(n1_len, 1)
    out = torch.empty(shape, dtype=torch.uint8, device=x.device)
    marked = table.dtype != torch.uint8
    tiles = -(-n1_len // _BLOCK)
    flags = torch.zeros(rows * tiles, dtype=torch.int32, device=x.device) if marked else None
    if x.numel():
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton launches on
            # the current device
            _scaled_codes_kernel[(rows, tiles)](
                x.contiguous(), factor.contiguous(), table, out, out if flags is None else flags, n0_len, n1_len,
                g0, g1, b0, b1, tiles, SHIFT=int(shift), DIV=op == "div", HOST_NEG=bool(host_negative),
                IN_BITS=8 * x.element_size(), IN_BF16=x.dtype == torch.bfloat16, MARKED=marked,
                DROP_NEG_ZERO=bool(drop_negative_zero), SIGN_MASK=int(sign_mask), BLOCK=_BLOCK,
                enable_fp_fusion=False)
    return out, flags
