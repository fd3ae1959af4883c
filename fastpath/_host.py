"""Host-side helpers shared by the fast paths (no kernels here).

* :func:`alloc`: every buffer a fast-path kernel writes (outputs and scratch) comes from here,
  uninitialized (``torch.empty``). It is the one hook the tests use to poison those buffers:
  :func:`fastpath.testing.poisoned` swaps :data:`_ALLOCATOR` for an allocator that fills each buffer
  with a poison byte, so an element no kernel wrote is caught by the comparison with the reference.
* :func:`next_pow2`, :func:`cdiv`: launch-size arithmetic in plain Python (``triton.cdiv`` is a
  constexpr function: called from host code it unwraps its arguments first, about a microsecond
  per call, and a decode-sized call makes several; issue 20).
"""
from __future__ import annotations

import torch

__all__ = ["alloc", "cdiv", "next_pow2"]

_ALLOCATOR = torch.empty


def alloc(*shape, **kw) -> torch.Tensor:
    """``torch.empty(*shape, **kw)`` through the swappable :data:`_ALLOCATOR`."""
    return _ALLOCATOR(*shape, **kw)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``).

    >>> [next_pow2(n) for n in (1, 2, 3, 128, 129)]
    [1, 2, 4, 128, 256]
    """
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0`` (``triton.cdiv``'s value without its host cost).

    >>> [cdiv(n, 4) for n in (0, 1, 4, 5)]
    [0, 1, 1, 2]
    """
    return -(-a // b)
