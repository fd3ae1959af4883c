"""Search for a lossless encoding of exact values in a target scheme (used by ``requantize``).

A target scheme can hold values ``x`` losslessly when some scale per target block (representable in
the scheme's scale format) makes every ``x / s`` an element value. The scheme's own scale rule does
not always find it (``amax / 448`` for FP32 scales, or RCEIL, put the block maximum at the top of the
element range while the values may sit on the grid of another scale), so :func:`find_lossless`
searches the scales that can work:

* It suffices to try scales that put the block maximum ``a`` in the element format's top binade
  ``(M/2, M]``: if ``s`` is lossless, so is ``s / 2^j`` while ``a / (s / 2^j) <= M``, because twice a
  representable value that is at most ``M`` is representable (floats and integers alike).
* UE8M0: one candidate per block, ``2^k`` with the smallest ``k`` such that ``a <= M 2^k``.
* FP32: ``s = a / v`` for each element value ``v`` of the top binade (E2M1: 4, 6; E4M3: 240 ... 448),
  kept only where ``s`` is a float32 and ``v s == a`` exactly.
* UE4M3 blocks times one global factor ``G`` (NVFP4): the block holding the tensor maximum ``A``
  has ``A = v u G`` for its maximum's element value ``v`` and its UE4M3 scale ``u``, so ``G`` is one
  of ``A / (v u)`` over every element value and every UE4M3 value; the candidates that make that
  block exact are found in one vectorised check, and ``G`` must be storable as the float32 of the
  preset's convention (:func:`global_storable`: checkpoints store it that way). With ``G`` fixed,
  each block takes ``u_b = a_b / (v_b G)`` for the first element value ``v_b`` (from the top) whose
  ``u_b`` is a UE4M3 value and whose elements are exact: every case is tried, so the search is
  complete.

Each candidate is checked on one slab of blocks first (index 0 of the leading axes and of the first
blocked axis), so a lossy tensor is rejected after a few hundred elements; a candidate is accepted
only after the exact check ``decode(code) * s == x`` of every element (float64, exact: at most
4 + 24 + 24 significant bits). Non-finite values: no search (None).
"""
from __future__ import annotations

import numpy as np

from ..formats import decode_table, encode, pack_nibbles
from .blocks import block_amax, block_view, broadcast_to_blocks, expand_to_elements
from .quantized import QuantizedTensor
from .scheme import Scheme

__all__ = ["find_lossless", "top_binade_values", "global_storable", "sample_blocks_representable", "sample_blocks",
           "sample_block_representable"]


def global_storable(g: float, target: Scheme) -> bool:
    """Whether the float32 the target's global-scale convention stores gives back the decode
    factor ``g`` exactly (``decode_scale``: ``fl32(g) == g``; ``encode_scale``:
    ``1 / fl32(1/g) == g``; ``amax``: ``fl32(2688 g) / 2688 == g``), so a checkpoint can hold it."""
    conv = target.preset.option("global_convention", "decode_scale")
    with np.errstate(over="ignore", divide="ignore"):
        if conv == "encode_scale":
            return 1.0 / float(np.float32(1.0 / g)) == g
        if conv == "amax":
            return float(np.float32(g * 2688.0)) / 2688.0 == g
        return float(np.float32(g)) == g


def top_binade_values(element) -> np.ndarray:
    """Positive element values ``v`` with ``M/2 < v <= M`` (float64, descending)."""
    vals = decode_table(element.name)
    vals = np.unique(vals[np.isfinite(vals) & (vals > 0)])
    M = float(element.max_finite)
    return vals[(vals > M / 2) & (vals <= M)][::-1]


def _elements_exact(xb: np.ndarray, s: np.ndarray, k: int, element) -> np.ndarray:
    """Per block: does every ``x / s`` decode back to ``x`` exactly (s > 0 per block, grid shape)?"""
    sb = broadcast_to_blocks(s, k)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = xb / sb
        y = np.where(np.isfinite(y), y, 0.0)
        codes = encode(y, element, overflow="saturate", rounding="rne")
        back = decode_table(element.name)[codes] * sb
    ok = back == xb
    axes = tuple(ok.ndim - 2 * k + 2 * i + 1 for i in range(k))
    return np.all(ok, axis=axes) & (s > 0) & np.isfinite(s)


def _slab(a: np.ndarray, nlead: int) -> tuple:
    """Index of the sample slab: 0 on every leading axis and on the first blocked axis."""
    return (0,) * nlead + (slice(0, 1),)


def _pow2_exponent(amax: np.ndarray, M: float) -> np.ndarray:
    """Smallest integer ``k`` with ``amax <= M * 2^k`` (exact comparisons), int64 grid."""
    with np.errstate(divide="ignore", invalid="ignore"):
        _, e = np.frexp(np.where(amax > 0, amax / M, 1.0))
    k = e.astype(np.int64)
    for _ in range(2):  # amax / M was rounded: correct by exact comparisons
        k = np.where(amax > np.ldexp(M, k), k + 1, k)
        k = np.where(amax <= np.ldexp(M, k - 1), k - 1, k)
    return np.where(amax > 0, k, 0)


def _choose(xb, k, element, candidates):
    """First candidate grid (list order) that makes each block exact; None if a block has none."""
    chosen = np.full(candidates[0].shape, np.nan)
    for s in candidates:
        todo = np.isnan(chosen)
        if not todo.any():
            break
        ok = _elements_exact(xb, s, k, element) & todo
        chosen = np.where(ok, s, chosen)
    return None if np.isnan(chosen).any() else chosen


def _per_block_candidates(amax, target: Scheme, glob: float | None = None):
    """Candidate decode-scale grids (float64) for every block, best first."""
    el = target.element_format
    fmt = target.scale_format
    zero = amax == 0
    if fmt == "ue8m0":
        kk = _pow2_exponent(amax, float(el.max_finite))
        if np.any(kk > 127):
            return []
        return [np.where(zero, 1.0, np.ldexp(1.0, np.maximum(kk, -127)))]
    out = []
    if fmt == "fp32":
        for v in top_binade_values(el):
            with np.errstate(invalid="ignore", over="ignore", under="ignore"):
                s = amax / v
                s32 = s.astype(np.float32).astype(np.float64)
            good = (s32 == s) & (s * v == amax) & (s > 0)
            out.append(np.where(zero, 1.0, np.where(good, s, np.nan)))
        return out
    # ue4m3 blocks times the global factor glob: every element value, from the top
    vals = decode_table(el.name)
    for v in np.unique(vals[np.isfinite(vals) & (vals > 0)])[::-1]:
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            u = amax / (v * glob)
            ucode = encode(np.where(np.isfinite(u) & (u <= 448), u, 0.0), "ue4m3",
                           overflow="saturate", rounding="rne")
            good = (decode_table("ue4m3")[ucode] == u) & (u > 0) & (u * glob * v == amax)
        out.append(np.where(zero, glob, np.where(good, u * glob, np.nan)))
    return out


def _global_candidates(xb: np.ndarray, amax: np.ndarray, target: Scheme) -> list[float]:
    """Global factors ``G = A / (v u)`` that make the block holding the tensor maximum ``A``
    exact, for every element value ``v`` and every UE4M3 value ``u`` (one vectorised check of
    that block), storable in the preset's convention; largest ``u`` first."""
    A = float(amax.max()) if amax.size else 0.0
    if A == 0:
        return [1.0]
    el = target.element_format
    k = xb.ndim - amax.ndim
    top = np.unravel_index(int(np.argmax(amax)), amax.shape)
    nl = amax.ndim - k
    idx = top[:nl] + tuple(v for t in top[nl:] for v in (t, slice(None)))
    xt = xb[idx].reshape(-1)
    ue = decode_table("ue4m3")
    ue = np.unique(ue[np.isfinite(ue) & (ue > 0)])[::-1]
    vals = decode_table(el.name)
    vals = np.unique(vals[np.isfinite(vals) & (vals > 0)])[::-1]
    uu, vv = np.meshgrid(ue, vals, indexing="ij")
    uu, vv = uu.ravel(), vv.ravel()
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        g = A / (vv * uu)
        ok = (g > 0) & np.isfinite(g) & (g * vv * uu == A)
        y = xt[None, :] / (uu * g)[:, None]
        y = np.where(np.isfinite(y), y, 0.0)
        codes = encode(y, el, overflow="saturate", rounding="rne")
        ok &= np.all(decode_table(el.name)[codes] * (uu * g)[:, None] == xt[None, :], axis=1)
    out = [float(x) for x in g[ok] if global_storable(float(x), target)]
    return list(dict.fromkeys(out))


def _searchable(x: np.ndarray, target: Scheme) -> bool:
    if target.family not in ("blockwise", "nvfp4") or target.zero_point or target.channel_block:
        return False
    if target.static_scale is not None:
        return False
    return target.scale_format != "ue4m3" or bool(target.global_scale)


def sample_blocks(shape: tuple, target: Scheme) -> list:
    """Where :func:`sample_blocks_representable` looks: the first, middle and last blocks of the target's grid
    for a tensor of ``shape``, each as ``(index, block)``: ``index`` a tuple of ints (leading axes) and
    slices (blocked axes) of the tensor, ``block`` the block extents (the slices may be shorter at the end
    of an axis; :func:`sample_block_representable` pads them with zeros, as the block view does)."""
    block = tuple(int(b) for b in target.resolve_block(tuple(shape)))
    k = len(block)
    nlead = len(shape) - k
    grid = tuple(shape[:nlead]) + tuple(-(-d // b) for d, b in zip(shape[nlead:], block))
    n = int(np.prod(grid))
    out = []
    for flat in sorted({0, (n - 1) // 2, n - 1}):
        g = np.unravel_index(flat, grid)
        out.append((tuple(int(i) for i in g[:nlead]) + tuple(
            slice(int(i) * b, min((int(i) + 1) * b, d)) for i, b, d in zip(g[nlead:], block, shape[nlead:])),
            block))
    return out


def sample_block_representable(xs: np.ndarray, block: tuple, target: Scheme) -> bool:
    """Whether the one block ``xs`` (float64, the tensor's elements at an index of :func:`sample_blocks`) can
    be held exactly with some scale of its candidate set (True for a block with NaN or Inf: undecided)."""
    k = len(block)
    xp = np.zeros(tuple(block), np.float64)
    xp[tuple(slice(0, d) for d in xs.shape)] = xs
    xs = xp.reshape(tuple(v for b in block for v in (1, b)))
    if not np.all(np.isfinite(xs)):
        return True  # NaN/Inf blocks: undecided here (the candidates handle them)
    a = block_amax(xs, k)
    if target.scale_format == "ue4m3":
        vals = decode_table(target.element)
        cands = [np.where(a == 0, 1.0, a / v)
                 for v in np.unique(vals[np.isfinite(vals) & (vals > 0)])]
    else:
        cands = _per_block_candidates(a, target)
    return bool(cands) and _choose(xs, k, target.element_format, cands) is not None


def sample_blocks_representable(x: np.ndarray, target: Scheme) -> bool:
    """A cheap necessary condition for any lossless encoding of ``x`` in ``target``: the first,
    middle and last target blocks (:func:`sample_blocks`) can each be held exactly with some scale of the
    block's candidate set (FP32 / UE8M0: the complete sets above; UE4M3 x global: ``a / v`` for every
    element value ``v``, the global left free). False means no lossless encoding exists;
    True means nothing. A few blocks: microseconds, so lossy tensors skip the search. (The device report,
    :mod:`moeref.quant.device_report`, copies the same blocks to the host and asks
    :func:`sample_block_representable` the same question.)"""
    if not _searchable(x, target) or x.size == 0:
        return False
    return all(sample_block_representable(np.asarray(x[idx], np.float64), block, target)
               for idx, block in sample_blocks(x.shape, target))


def find_lossless(x: np.ndarray, target: Scheme, global_factor: float | None = None):
    """A lossless :class:`~moeref.quant.tensor.QuantizedTensor` of the exact values ``x``
    (float64, logical shape) in ``target``, or None when none exists (module docstring).

    Covers block-scaled schemes without zero points or channel scales: FP32, UE8M0, and UE4M3
    with a global factor (NVFP4); ``global_factor`` fixes that factor (decode multiplier). The codes are RNE encodings of ``x / s``; ``x / s`` is an
    element value there, so any rounding mode gives the same codes.
    """
    if not _searchable(x, target) or not np.all(np.isfinite(x)):
        return None
    if not sample_blocks_representable(x, target):
        return None
    el = target.element_format
    block = target.resolve_block(x.shape)
    k = len(block)
    nlead = x.ndim - k
    xb = block_view(x, block)
    amax = block_amax(xb, k)
    sl = _slab(amax, nlead)
    xs = xb[(0,) * nlead + (slice(0, 1),)] if x.ndim > 0 else xb

    if target.scale_format != "ue4m3":
        globs = [None]
    elif global_factor is not None:  # the caller fixed it (a group sharing one global)
        globs = [float(global_factor)] if global_factor > 0 else []
    else:
        globs = _global_candidates(xb, amax, target)
    chosen = glob = None
    for g in globs:
        cands = _per_block_candidates(amax[sl], target, g)
        if not cands or _choose(xs, k, el, cands) is None:
            continue  # the sample slab already fails
        full = _choose(xb, k, el, _per_block_candidates(amax, target, g))
        if full is not None:
            chosen, glob = full, g
            break
    if chosen is None:
        return None
    fmt = target.scale_format
    if fmt == "fp32":
        stored = chosen.astype(np.float32)
    elif fmt == "ue8m0":
        stored = encode(chosen, "e8m0", overflow="error", rounding="rne")
    else:
        stored = encode(chosen / glob, "ue4m3", overflow="error", rounding="rne")
    sv = expand_to_elements(chosen, block, x.shape)
    codes = encode(x / sv, el, overflow="error", rounding="rne")
    if el.bits == 4:
        if x.shape[-1] % 2:
            codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
        codes = pack_nibbles(codes)
    return QuantizedTensor(codes=codes, scales=stored, scheme=target, shape=x.shape,
                           global_scale=glob)
