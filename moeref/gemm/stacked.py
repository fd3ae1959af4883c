"""Expert weights stacked on a leading expert axis, as grouped-GEMM kernels hold them.

DeepGEMM's ``m_grouped_fp8_gemm_nt_*`` takes ``(b_fp8 [E, N, K], b_scales [E, N/128, K/128])``;
vLLM's ``w1``/``w1_scale`` and FlashInfer's ``fc1_expert_weights`` are the same stacks. A
:class:`StackedExperts` is that pair with the element format and block shape that say how to read it:
``value[e, n, k] = table[codes[e, n, k]] * scales[e, n // bn, k // bk]``. It serves both engines of the
reference: indexing it gives one expert's :class:`moeref.gemm.BlockOperand` (NumPy, decoded block by
block by :func:`moeref.gemm.block_gemm`), and :meth:`StackedExperts.to` puts the codes and scales on a
torch device for the CUDA engine (:mod:`moeref.gemm.device`), which reads them directly. A layer of 256
DeepSeek-V3 experts is 11.3 GB of codes: it is never decoded whole on either engine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .exact import BlockOperand

__all__ = ["StackedExperts", "experts_to_stack"]


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def experts_to_stack(tensors) -> list:
    """``tensors`` as a list after checking they can be stacked: at least one, each a
    :class:`moeref.quant.QuantizedTensor`, all of one scheme and one 2-D shape; ``TypeError`` /
    ``ValueError`` naming the first expert that is not. Shared by every expert stack (this one and the
    fast paths' :class:`fastpath.grouped_gemm_w4.W4Experts`)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("from_quantized needs at least one expert")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not hasattr(t, "scale_values") or not hasattr(t, "codes"):
            raise TypeError(f"expert {i} is a {type(t).__name__}, not a QuantizedTensor")
        if t.scheme != first.scheme or tuple(t.shape) != tuple(first.shape) or len(t.shape) != 2:
            raise ValueError(f"expert {i} has scheme {t.scheme.name} and shape {t.shape}; stacking needs "
                             f"one 2-D shape and scheme ({first.scheme.name}, {first.shape})")
    return tensors


@dataclass(frozen=True, eq=False)
class StackedExperts:
    """Quantized expert weights ``[E, N, K]`` with block scales.

    Attributes:
        codes: uint8 ``[E, N, K]`` for formats of 5-8 bits, ``[E, N, ceil(K/2)]`` for 4-bit formats
            (two codes a byte, element ``2i`` in the low nibble, as :func:`moeref.formats.pack_nibbles`);
            NumPy or torch.
        scales: float64 ``[E, ceil(N/bn), ceil(K/bk)]``: each block's decode multiplier (block scale
            times any global or per-channel factor, :meth:`moeref.quant.QuantizedTensor.scale_values`).
        element: the element format's name (``"e4m3fn"``, ``"e2m1"``, ``"int4"`` ...).
        block: ``(bn, bk)``.
        shape: logical ``(N, K)`` of one expert.
        magnitude: True for ``|value|`` (the absolute table and scales: error-bound sums).
    """

    codes: object
    scales: object
    element: str
    block: tuple
    shape: tuple
    magnitude: bool = False

    def __post_init__(self):
        from ..formats import get_format

        fmt = get_format(self.element)
        object.__setattr__(self, "element", fmt.name)
        e = int(self.codes.shape[0]) if self.codes.ndim == 3 else -1
        n, k = (int(d) for d in self.shape)
        kc = (k + 1) // 2 if self.packed else k
        if self.codes.ndim != 3 or tuple(self.codes.shape[1:]) != (n, kc):
            raise ValueError(f"codes must be uint8 [E, {n}, {kc}] for {fmt.name} experts of shape {(n, k)}; "
                             f"got {tuple(self.codes.shape)}")
        bn, bk = (int(b) for b in self.block)
        grid = (e, -(-n // bn), -(-k // bk))
        if tuple(self.scales.shape) != grid:
            raise ValueError(f"scales must have the block grid {grid} of blocks {(bn, bk)}; got "
                             f"{tuple(self.scales.shape)}")
        object.__setattr__(self, "block", (bn, bk))
        object.__setattr__(self, "shape", (n, k))

    @property
    def packed(self) -> bool:
        """Two codes per byte (4-bit element formats)."""
        from ..formats import get_format

        return get_format(self.element).bits <= 4

    @property
    def table(self) -> np.ndarray:
        """float64 value of every code (absolute values when :attr:`magnitude`)."""
        from ..formats import decode_table

        t = decode_table(self.element)
        return np.abs(t) if self.magnitude else t

    @property
    def device(self) -> str:
        return str(self.codes.device) if _is_torch(self.codes) else "cpu"

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    def __getitem__(self, e: int) -> BlockOperand:
        """Expert ``e`` as a host :class:`BlockOperand` (codes and a decode table: nothing decoded)."""
        if not 0 <= int(e) < len(self):
            raise ValueError(f"StackedExperts has {len(self)} experts; expert {e} requested")
        codes, scales = self.codes[int(e)], self.scales[int(e)]
        if _is_torch(codes):
            codes, scales = codes.cpu().numpy(), scales.cpu().numpy()
        if self.packed:
            from ..formats import unpack_nibbles

            codes = np.ascontiguousarray(unpack_nibbles(codes)[:, : self.shape[1]])
        return BlockOperand(None, np.asarray(scales, dtype=np.float64), self.block, True, codes=codes,
                            table=self.table)

    def abs(self) -> "StackedExperts":
        """``|value|``: absolute table and scales."""
        s = self.scales.abs() if _is_torch(self.scales) else np.abs(self.scales)
        return replace(self, scales=s, magnitude=True)

    def select(self, experts: Sequence[int]) -> "StackedExperts":
        """The experts ``experts`` (an EP shard), in that order."""
        idx = [int(e) for e in experts]
        if _is_torch(self.codes):
            import torch

            t = torch.tensor(idx, dtype=torch.long, device=self.codes.device)
            return replace(self, codes=self.codes.index_select(0, t), scales=self.scales.index_select(0, t))
        return replace(self, codes=self.codes[idx], scales=self.scales[idx])

    def to(self, device) -> "StackedExperts":
        """Codes and scales as torch tensors on ``device`` (float64 scales)."""
        import torch

        def move(x, dtype):
            t = x if _is_torch(x) else torch.from_numpy(np.ascontiguousarray(x))
            return t.to(device=device, dtype=dtype)

        return replace(self, codes=move(self.codes, torch.uint8), scales=move(self.scales, torch.float64))

    @classmethod
    def from_quantized(cls, tensors: Sequence) -> "StackedExperts":
        """Stack per-expert :class:`moeref.quant.QuantizedTensor` s of one scheme and shape (2-D, no zero
        points), e.g. :func:`moeref.moe.quantize_weights`' output."""
        tensors = experts_to_stack(tensors)
        first = tensors[0]
        for i, t in enumerate(tensors):
            if getattr(t, "zero_points", None) is not None:
                raise ValueError(f"expert {i} has zero points: asymmetric INT weights cannot be stacked")
        n, k = first.shape
        blk = tuple(int(b) for b in first.block_shape)
        blk = (1,) * (2 - len(blk)) + blk if len(blk) < 2 else blk
        bn = blk[0] if blk[0] > 0 else n
        bk = blk[1] if blk[1] > 0 else k
        scales = np.stack([np.asarray(t.scale_values(), dtype=np.float64).reshape(-(-n // bn), -(-k // bk))
                           for t in tensors])
        codes = np.stack([np.asarray(t.codes) for t in tensors])
        return cls(codes, scales, first.scheme.element, (bn, bk), (n, k))
