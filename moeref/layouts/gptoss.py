"""gpt-oss MXFP4 checkpoint layout (``*_blocks`` / ``*_scales``) <-> flat packed row-major MXFP4.

The openai/gpt-oss checkpoints (and HF transformers ``integrations/mxfp4.py``,
``convert_moe_packed_tensors``) store each MoE weight ``W[..., rows, K]`` (rows = output channels;
K = input dim, a multiple of 32) as:

* ``<name>_blocks`` uint8 ``[..., rows, K/32, 16]``: block ``b`` holds elements ``32b .. 32b+31`` of
  the row, two FP4 E2M1 codes per byte, element ``32b + 2i`` in the LOW nibble of byte ``i`` and
  ``32b + 2i + 1`` in the high nibble (the same nibble order as torchao/TE/DeepGEMM/FlashInfer);
* ``<name>_scales`` uint8 ``[..., rows, K/32]``: the E8M0 code of each block, bias 127
  (``2^(code - 127)``).

gpt-oss-120b: ``gate_up_proj_blocks [128, 5760, 90, 16]``, ``gate_up_proj_scales [128, 5760, 90]``,
``down_proj_blocks [128, 2880, 90, 16]`` (K = 2880 = 90 * 32); gpt-oss-20b has 32 experts. The
gate_up rows are INTERLEAVED (gate = even rows, up = odd rows: use
:func:`moeref.activations.convert_w13` with ``axis=-3`` on blocks and ``axis=-2`` on scales).
HF's dequantized ``gate_up_proj`` is the transpose ``[E, K, 2N]``; this module keeps ``[.., rows, K]``.

The flat layout is what moeref's MXFP4 quantizers produce: packed codes ``uint8 [..., rows, K/2]``
(low nibble = even element) and scale codes ``uint8 [..., rows, K/32]``. The conversion is a
reshape: the checkpoint is the flat layout with the K/2 bytes cut into 16-byte blocks.
"""
from __future__ import annotations

import numpy as np

from ._common import as_byte_codes, check_min_ndim

__all__ = ["GPTOSS_BLOCK", "GPTOSS_BYTES_PER_BLOCK", "to_gptoss_mxfp4", "from_gptoss_mxfp4"]

GPTOSS_BLOCK = 32
"""FP4 elements per E8M0 scale (OCP MX block size)."""
GPTOSS_BYTES_PER_BLOCK = 16
"""Bytes per block: 32 FP4 codes, two per byte."""


def to_gptoss_mxfp4(codes_packed, scale_codes) -> tuple[np.ndarray, np.ndarray]:
    """Flat packed MXFP4 -> gpt-oss ``(blocks [..., rows, K/32, 16], scales [..., rows, K/32])``.

    Args:
        codes_packed: uint8 ``[..., rows, K/2]``, two E2M1 codes per byte, low nibble = even element;
            ``K/2`` must be a multiple of 16.
        scale_codes: E8M0 codes ``[..., rows, K/32]`` (uint8 or ``float8_e8m0fnu``), same leading shape.

    Returns:
        ``(blocks, scales)`` as new C-contiguous uint8 arrays (the checkpoint dtypes).

    >>> import numpy as np
    >>> blocks, scales = to_gptoss_mxfp4(np.zeros((2, 64), np.uint8), np.full((2, 4), 127, np.uint8))
    >>> blocks.shape, scales.shape
    ((2, 4, 16), (2, 4))
    """
    codes = as_byte_codes(codes_packed, "codes_packed")
    scales = as_byte_codes(scale_codes, "scale_codes")
    check_min_ndim(codes, 1, "codes_packed", "[..., rows, K/2]")
    nbytes = codes.shape[-1]
    if nbytes % GPTOSS_BYTES_PER_BLOCK:
        raise ValueError(
            f"codes_packed last dimension (K/2 bytes) must be a multiple of {GPTOSS_BYTES_PER_BLOCK} "
            f"(K a multiple of {GPTOSS_BLOCK}); got shape {codes.shape}"
        )
    n_blocks = nbytes // GPTOSS_BYTES_PER_BLOCK
    want = (*codes.shape[:-1], n_blocks)
    if scales.shape != want:
        raise ValueError(f"scale_codes must have shape {want} (one code per 32 elements); got {scales.shape}")
    blocks = np.ascontiguousarray(codes).reshape(*want, GPTOSS_BYTES_PER_BLOCK)
    return blocks.copy() if np.shares_memory(blocks, codes) else blocks, np.array(scales, copy=True)


def from_gptoss_mxfp4(blocks, scales) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss ``(*_blocks [..., rows, n_blocks, 16], *_scales [..., rows, n_blocks])`` -> flat
    ``(codes_packed uint8 [..., rows, 16 * n_blocks], scale_codes uint8 [..., rows, n_blocks])``.

    Exact inverse of :func:`to_gptoss_mxfp4`; both outputs are new C-contiguous arrays.

    >>> import numpy as np
    >>> b = np.arange(32, dtype=np.uint8).reshape(1, 2, 16)
    >>> codes, sc = from_gptoss_mxfp4(b, np.array([[127, 128]], np.uint8))
    >>> codes.shape, int(codes[0, 16]), sc.tolist()
    ((1, 32), 16, [[127, 128]])
    """
    b = as_byte_codes(blocks, "blocks")
    s = as_byte_codes(scales, "scales")
    check_min_ndim(b, 2, "blocks", "[..., rows, n_blocks, 16]")
    if b.shape[-1] != GPTOSS_BYTES_PER_BLOCK:
        raise ValueError(f"blocks must have last dimension {GPTOSS_BYTES_PER_BLOCK}; got shape {b.shape}")
    if s.shape != b.shape[:-1]:
        raise ValueError(f"scales must have shape blocks.shape[:-1] = {b.shape[:-1]}; got {s.shape}")
    codes = np.array(b, copy=True).reshape(*b.shape[:-2], b.shape[-2] * GPTOSS_BYTES_PER_BLOCK)
    return codes, np.array(s, copy=True)
