"""MN-major, TMA-aligned scale layout (DeepGEMM SM90 FP32 scales) and the cuBLAS 1x128 scale layout.

DeepGEMM's SM90 FP8 GEMMs read per-token-group FP32 scales ``sf[..., mn, k_groups]`` MN-major: the
``mn`` index moves fastest, and each K-group column starts on a 16-byte boundary, so the stride of
the K-group axis is ``align(mn, 4)`` elements (``get_tma_aligned_size(mn, 4)`` in
deepseek-ai/DeepGEMM ``csrc/jit_kernels/impls/smxx_layout.hpp``, ``get_mn_major_tma_aligned_tensor``).

moeref represents this layout as two NumPy arrays sharing memory:

* the **storage** ``[..., k_groups, align(mn, 4)]``, C-contiguous, the bytes a kernel reads;
  the ``align(mn, 4) - mn`` padding elements at the end of each K-group column are **zero**
  (DeepGEMM allocates them with ``torch.empty`` and never reads them as data; moeref pins zero so
  that two implementations produce identical buffers);
* the **view** ``[..., mn, k_groups]`` into the storage, whose strides (in elements) are
  ``stride(-2) = 1`` and ``stride(-1) = align(mn, 4)``: the tensor DeepGEMM is handed.

``view.base is storage``; :func:`mn_major_storage` returns it after checking.

The same storage is the layout TransformerEngine hands cuBLAS for 1x128 block scales: the scales
transposed to ``[ceil(K/128), roundup(M, 4)]`` (TE ``tests/pytorch/references/
blockwise_quantizer_reference.py``), see
:func:`to_cublas_1x128_scales`.
"""
from __future__ import annotations

import numpy as np

from .._checks import as_float_array, check_positive_int, first_bad_index
from ._common import align, as_array, check_min_ndim

__all__ = [
    "TMA_ALIGN_BYTES",
    "tma_aligned_mn",
    "to_mn_major_tma_aligned",
    "from_mn_major_tma_aligned",
    "mn_major_storage",
    "to_cublas_1x128_scales",
    "from_cublas_1x128_scales",
]

TMA_ALIGN_BYTES = 16
"""TMA needs every K-group column of the scale tensor to start on a 16-byte boundary."""


def tma_aligned_mn(mn: int, itemsize: int = 4) -> int:
    """Padded MN extent: ``align(mn, 16 // itemsize)`` (DeepGEMM ``get_tma_aligned_size``).

    >>> tma_aligned_mn(5), tma_aligned_mn(8), tma_aligned_mn(0)
    (8, 8, 0)
    """
    mn = check_positive_int(mn, "mn", allow_zero=True)
    if itemsize not in (1, 2, 4, 8):
        raise ValueError(f"itemsize must be 1, 2, 4 or 8 bytes; got {itemsize!r}")
    return align(mn, max(TMA_ALIGN_BYTES // itemsize, 1))


def _mn_major_padded(x: np.ndarray) -> np.ndarray:
    """Dtype-agnostic core: copy ``x[..., mn, k]`` into zeroed storage ``[..., k, align(mn, 16/itemsize)]``
    and return the ``[..., mn, k]`` view (its ``base`` is the storage)."""
    *lead, mn, k = x.shape
    storage = np.zeros((*lead, k, tma_aligned_mn(mn, x.dtype.itemsize)), dtype=x.dtype)
    storage[..., :mn] = np.swapaxes(x, -1, -2)
    return np.swapaxes(storage[..., :mn], -1, -2)


def to_mn_major_tma_aligned(scales) -> np.ndarray:
    """Lay ``scales[..., mn, k_groups]`` out MN-major with the K-group stride aligned to 16 bytes.

    Args:
        scales: floating array ``[..., mn, k_groups]`` (DeepGEMM passes float32; other float dtypes
            keep their dtype and align to ``16 / itemsize`` elements). Leading axes (groups/experts)
            are kept; each leading index owns ``k_groups * align(mn, 4)`` contiguous elements.

    Returns:
        A view ``[..., mn, k_groups]`` equal to ``scales`` element-wise, with (float32) element strides
        ``stride(-2) = 1``, ``stride(-1) = align(mn, 4)``. Its ``base`` is the zero-padded storage
        ``[..., k_groups, align(mn, 4)]`` (see :func:`mn_major_storage`); padding is ``0.0``.

    Source: deepseek-ai/DeepGEMM ``get_mn_major_tma_aligned_tensor`` (SM90 FP32 SF layout).

    >>> import numpy as np
    >>> v = to_mn_major_tma_aligned(np.arange(10, dtype=np.float32).reshape(5, 2))
    >>> v.shape, [s // 4 for s in v.strides]
    ((5, 2), [1, 8])
    >>> mn_major_storage(v)
    array([[0., 2., 4., 6., 8., 0., 0., 0.],
           [1., 3., 5., 7., 9., 0., 0., 0.]], dtype=float32)
    """
    x = as_float_array(scales, "scales")
    check_min_ndim(x, 2, "scales", "[..., mn, k_groups]")
    return _mn_major_padded(x)


def mn_major_storage(view: np.ndarray) -> np.ndarray:
    """The padded storage ``[..., k_groups, align(mn, 16/itemsize)]`` behind an MN-major view.

    ``view`` must come from :func:`to_mn_major_tma_aligned` or
    :func:`moeref.layouts.pack_ue8m0` (its ``base`` is a C-contiguous array of that shape);
    anything else raises ``ValueError``: a copy would lose the layout.
    """
    if not isinstance(view, np.ndarray):
        raise TypeError(f"view must be a NumPy array returned by to_mn_major_tma_aligned; got {type(view).__name__}")
    check_min_ndim(view, 2, "view", "[..., mn, k_groups]")
    *lead, mn, k = view.shape
    base = view.base
    want = (*lead, k, tma_aligned_mn(mn, view.dtype.itemsize))
    if (
        base is None
        or base.shape != want
        or base.dtype != view.dtype
        or not base.flags.c_contiguous
        or view.__array_interface__["data"][0] != base.__array_interface__["data"][0]
    ):
        got = None if base is None else (base.shape, str(base.dtype))
        raise ValueError(
            f"view is not an MN-major TMA-aligned view: expected a base of shape {want} "
            f"({view.dtype}, C-contiguous); got base {got}"
        )
    return base


def from_mn_major_tma_aligned(x, mn: int | None = None, *, check_padding: bool = True) -> np.ndarray:
    """Inverse of :func:`to_mn_major_tma_aligned`: a C-contiguous ``[..., mn, k_groups]`` copy.

    Args:
        x: either the MN-major view ``[..., mn, k_groups]`` (any strides; ``mn`` must be None), or,
            with ``mn`` given, the storage buffer ``[..., k_groups, align(mn, 4)]`` a kernel wrote.
        mn: logical MN extent when ``x`` is the storage buffer.
        check_padding: with a storage buffer, raise ``ValueError`` if any padding element is not
            zero (the moeref contract; pass False for buffers from ``torch.empty`` allocators).

    >>> import numpy as np
    >>> s = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> v = to_mn_major_tma_aligned(s)
    >>> bool((from_mn_major_tma_aligned(v) == s).all())
    True
    >>> bool((from_mn_major_tma_aligned(mn_major_storage(v), mn=3) == s).all())
    True
    """
    a = as_array(x, "x")
    if mn is None:
        check_min_ndim(a, 2, "x", "[..., mn, k_groups]")
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(np.swapaxes(_crop_storage(a, mn, "x", check_padding), -1, -2))


def _crop_storage(a: np.ndarray, mn: int, name: str, check_padding: bool) -> np.ndarray:
    """``a[..., k, align(mn)]`` -> ``a[..., k, :mn]`` after shape and padding checks."""
    mn = check_positive_int(mn, "mn", allow_zero=True)
    check_min_ndim(a, 2, name, "[..., k_groups, align(mn, 4)]")
    want = tma_aligned_mn(mn, a.dtype.itemsize)
    if a.shape[-1] != want:
        raise ValueError(
            f"{name} must have last dimension align(mn={mn}) = {want} for dtype {a.dtype}; got shape {a.shape}"
        )
    if check_padding:
        pad = a[..., mn:]
        bad = first_bad_index(pad != 0)
        if bad is not None:
            idx = (*bad[:-1], bad[-1] + mn)
            raise ValueError(
                f"{name}{list(idx)} = {a[idx].item()!r} is MN padding and must be zero "
                f"(pass check_padding=False for buffers allocated with torch.empty)"
            )
    return a[..., :mn]


def to_cublas_1x128_scales(scales) -> np.ndarray:
    """1x128 block scales ``[..., M, ceil(K/128)]`` -> the cuBLAS/TE layout ``[..., ceil(K/128), roundup(M, 4)]``.

    The scales are transposed and M is padded with zeros to a multiple of 4 (16 bytes of float32).
    This is exactly the storage of :func:`to_mn_major_tma_aligned` (TE and DeepGEMM agree),
    returned as a C-contiguous array. Source: TransformerEngine
    ``blockwise_quantizer_reference.py`` (``(ceil(N/128), roundup(M, 4))``).

    >>> import numpy as np
    >>> to_cublas_1x128_scales(np.ones((3, 2), np.float32))
    array([[1., 1., 1., 0.],
           [1., 1., 1., 0.]], dtype=float32)
    """
    return mn_major_storage(to_mn_major_tma_aligned(scales))


def from_cublas_1x128_scales(buf, m: int, *, check_padding: bool = True) -> np.ndarray:
    """Inverse of :func:`to_cublas_1x128_scales`: ``[..., kb, roundup(m, 4)]`` -> ``[..., m, kb]``."""
    return from_mn_major_tma_aligned(buf, mn=m, check_padding=check_padding)
