"""The GEMMs of an emulated profile (``accum_model="emulated"``: :data:`moeref.compare.DEEPGEMM_FP8_EXACT`,
:data:`~moeref.compare.TRITON_FP8_BLOCK_EXACT`, or a profile with ``promotion_order="a_then_b"``) on a device:
:func:`moeref.compare.emulated_gemm._emulated_gemm` on torch tensors, the same ``(center, radius)`` bit for bit.

* center: the kernel's FP32 result on the center operand, predicted by the device emulator
  (:func:`moeref.gemm.device_hopper_fp8.device_deepgemm_rows`, the NumPy emulator's bits; on a Hopper GPU its
  block accumulators come from the tensor cores, proved against the emulator on a sample of rows every call);
* GEMM2's uncertain rows (the re-quantized intermediate, ``a_radius > 0``): a row with at most
  :data:`moeref.compare.emulated_gemm._MAX_ENUMERATED` uncertain codes, each one of two neighbouring E4M3 values, takes
  the largest, over every combination of them, of the distance from the center plus the scale term
  ``sum_b |ds_b| |sb_b acc_b| + 2 gamma(S + 2, u_fp32) sum_b s_hi_b |sb_b acc_b|`` (a row with no uncertain
  code: its one combination, the center, so the scale term alone). Any other uncertain row: the distance from
  the center to the exact product, ``|W| a_radius`` and the data-dependent bound
  (:mod:`moeref.compare.device.bounds`, the host's bits);
* the bias: added in float64 after the product, radius ``u_fp32 (|center| + radius)``.

How the combinations are formed without emulating a row once per combination: each 128-column block's
accumulator starts cleared, so it depends on that block's codes only. The enumerated rows are emulated once,
keeping every block accumulator (:func:`~moeref.gemm.device_hopper_fp8.device_deepgemm_rows` with
``block_acc=True``); each block that holds uncertain codes is emulated alone for each combination of *its* codes
(``2^n_b`` emulations of 128 columns: :func:`~moeref.gemm.device_hopper_fp8.device_block_accumulators`, every
block of a chunk in one call); then
:func:`~moeref.gemm.device_hopper_fp8.device_promote_combinations` replays, per combination of the row, the FP32
promotion and the scale term over the blocks, the same operations in the same order as the emulator, with the
varied blocks' accumulators swapped in (the blocks before the row's first varied block promoted once for all its
combinations). Same accumulators, same promotion: the bits of emulating every combination over the whole row
(``tests/test_device_emulated_blocks.py`` checks them against the host's enumeration). A row with no uncertain
code (its scale alone is uncertain) has one combination, the center: its radius is the scale term the center's
emulation returns with it (``scale_term``), the same operations on the same accumulators, so it keeps no block
accumulator and takes no replay. Work: one emulation of every row (GEMM2's center), plus one 128-column block per
combination of each uncertain block; the rows with uncertain codes are taken in chunks so that their block
accumulators stay under :data:`_CHUNK_ELEMS` float32 values.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import emulated_gemm as _host
from ..bounds import gamma
from .bounds import device_rows_error_bound

__all__ = ["device_emulated_gemm"]


def _torch():
    import torch

    return torch


def device_emulated_gemm(a, a_radius, row_expert, weights, bias, profile, codes=None):
    """:func:`moeref.compare.emulated_gemm._emulated_gemm` on a device: ``a`` a
    :class:`moeref.gemm.device.DeviceOperand` ``[R, K]`` (E4M3, 1x128 scales), ``a_radius`` float64 ``[R, K]``
    or None, ``row_expert`` int ``[R]`` (NumPy), ``weights`` a device :class:`moeref.gemm.StackedExperts` (E4M3,
    128x128 scales), ``bias`` float64 ``[E, N]`` or None, ``codes`` the dict of
    :func:`moeref.compare.device.requant.device_requant` with ``detail=True`` (float64 ``[R, K]`` tensors).
    Returns ``(center, radius)``, float64 ``[R, N]`` tensors."""
    torch = _torch()
    from ...gemm.device import device_expert_rows_gemm
    from ...gemm.device_hopper_fp8 import device_deepgemm_rows

    rows = np.asarray(row_expert, dtype=np.int64)
    promotion = profile.promotion_order
    unsure = ok = varied = np.zeros(rows.size, dtype=bool)
    if a_radius is not None:
        unsure = ((a_radius.amax(dim=1) > 0).cpu().numpy() if a_radius.shape[1] else np.zeros(rows.size, bool)) \
            & (rows >= 0)
        if codes is not None and unsure.any():
            nvar, adjacent = _code_counts(codes)
            ok = unsure & (nvar <= _host._MAX_ENUMERATED) & adjacent
            varied = ok & (nvar > 0)
    one = ok & ~varied  # enumerated rows of one combination, the center: their radius is its scale term
    if one.any():  # the center with its scale term (computed on every row of the call, kept on these)
        center, st = device_deepgemm_rows(a, np.where(varied, -1, rows), weights, promotion=promotion,
                                          scale_term=_scale_term(codes, profile))
        radius = torch.where(torch.as_tensor(one, device=st.device)[:, None], st, torch.zeros_like(st))
    else:
        center = device_deepgemm_rows(a, np.where(varied, -1, rows), weights, promotion=promotion)
        radius = torch.zeros_like(center)
    dev = center.device
    if varied.any():  # their center and radius: below
        _enumerate_codes(a, codes, rows, varied, weights, profile, center, radius)
    fallback = unsure & ~ok
    if fallback.any():
        rows_u = np.where(fallback, rows, -1)
        exact = device_expert_rows_gemm(a, rows_u, weights)
        data = replace(profile, accum_model="data_dependent")
        rad, bnd = device_rows_error_bound(a, a_radius, rows_u, weights, None, data, radius_term=True)
        far = (center - exact).abs() + rad + bnd
        radius = torch.where(torch.as_tensor(fallback, device=dev)[:, None], far, radius)
    if bias is not None:
        valid = np.flatnonzero(rows >= 0)
        vt = torch.as_tensor(valid, device=dev)
        b = torch.as_tensor(bias, device=dev).to(torch.float64)
        center[vt] += b.index_select(0, torch.as_tensor(rows[valid], device=dev))
        radius = radius + profile.promote_unit * (center.abs() + radius)
    return center, radius


def _adjacent_e4m3(lo, hi):
    """:func:`moeref.compare.emulated_gemm._adjacent_e4m3` on tensors: ``lo < hi`` are neighbouring E4M3 values."""
    torch = _torch()

    def mag(v):
        return (v.abs().to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8) & 0x7F).to(torch.int64)

    ml, mh = mag(lo), mag(hi)
    return ((lo >= 0) & (mh - ml == 1)) | ((hi <= 0) & (ml - mh == 1))


def _code_counts(codes) -> tuple[np.ndarray, np.ndarray]:
    """Per row, its number of uncertain codes (``code_lo != code_hi``; NumPy int64 ``[R]``) and whether each is one
    of two neighbouring E4M3 values (NumPy bool ``[R]``)."""
    torch = _torch()
    lo, hi = codes["code_lo"], codes["code_hi"]
    var = lo != hi
    both = torch.stack([var.sum(dim=1), (~var | _adjacent_e4m3(lo, hi)).all(dim=1).to(torch.int64)]).cpu().numpy()
    return both[0], both[1].astype(bool)


def _enumerable(codes) -> np.ndarray:
    """Rows whose uncertain codes are at most :data:`moeref.compare.emulated_gemm._MAX_ENUMERATED`, each one of two
    neighbouring E4M3 values (NumPy bool ``[R]``)."""
    nvar, adjacent = _code_counts(codes)
    return (nvar <= _host._MAX_ENUMERATED) & adjacent


def _scale_term(codes, profile):
    """``(ds, s_hi, coef)`` of the scale term (module docstring) as
    :func:`moeref.gemm.device_hopper_fp8.device_deepgemm_rows` takes it: per row and 128-column block the largest
    scale difference and the largest scale (float64 ``[R, K/128]``), ``coef = 2 gamma(K/128 + 2, u_fp32)``."""
    r, k = codes["scale_hi"].shape
    nb = k // 128
    ds = (codes["scale_hi"] - codes["scale_lo"]).reshape(r, nb, -1).amax(dim=2)
    s_hi = codes["scale_hi"].reshape(r, nb, -1).amax(dim=2)
    return ds, s_hi, 2 * gamma(nb + 2, profile.promote_unit)


_CHUNK_ELEMS = 1 << 29
"""Block accumulators (float32) held at once by :func:`_enumerate_codes`: rows are taken in chunks of
``_CHUNK_ELEMS // (K/128 * N)``."""


def _enumerate_codes(a, codes, rows, ok, weights, profile, center, radius) -> None:
    """Fills ``center`` and ``radius`` (in place) on the rows ``ok`` (module docstring; the caller passes the rows
    with uncertain codes), a chunk of rows at a time:
    the rows' block accumulators (one emulation), every combination of each uncertain block's codes (one
    emulation of that 128-column block each), then the promotion of every combination of the row
    (:func:`moeref.gemm.device_hopper_fp8.device_promote_combinations`)."""
    torch = _torch()
    from ...gemm.device_hopper_fp8 import device_deepgemm_rows, device_promote_combinations

    dev = center.device
    lo, hi = codes["code_lo"], codes["code_hi"]
    r, k = a.shape
    n = int(weights.shape[0])
    nb = k // 128
    ds, s_hi, coef = _scale_term(codes, profile)
    promotion = profile.promotion_order
    idx_all = np.flatnonzero(ok)
    step = max(1, _CHUNK_ELEMS // max(1, nb * n))
    for c0 in range(0, idx_all.size, step):
        idx = idx_all[c0:c0 + step]
        it = torch.as_tensor(idx, device=dev)
        sub = a.take_rows(it)
        rows_c = rows[idx]
        y, _, acc = device_deepgemm_rows(sub, rows_c, weights, promotion=promotion, block_acc=True)
        variants, vbase, j0, nbit, nvar = _block_variants(sub, lo.index_select(0, it), hi.index_select(0, it),
                                                         rows_c, weights)
        worst = device_promote_combinations(acc, variants, vbase, j0, nbit, 1 << nvar, rows_c, sub.scales, weights,
                                            (ds.index_select(0, it), s_hi.index_select(0, it), coef), y,
                                            promotion=promotion)
        center[it] = y
        radius[it] = worst


def _block_variants(sub, lo, hi, rows_c, weights):
    """The block accumulators of every combination of each uncertain block's codes: ``(variants [V, N],
    vbase, j0, nbit [Rc, NB] int64, nvar [Rc] int64)`` as
    :func:`moeref.gemm.device_hopper_fp8.device_promote_combinations` reads them. The row's uncertain codes are
    ranked in column order (the ``j``-th takes bit ``j`` of a combination, as the host enumerates them); block
    ``kb`` holds ranks ``j0 .. j0 + nbit - 1``, so its sub-combination is ``(c >> j0) & (2^nbit - 1)``; its
    ``2^nbit`` accumulators are variant rows ``vbase ..``, each the block's 128 columns alone against the
    weights' same block (:func:`moeref.gemm.device_hopper_fp8.device_block_accumulators`: one launch for every
    block of the chunk, the accumulator itself, neither scaled nor promoted)."""
    torch = _torch()
    from ...gemm.device_hopper_fp8 import device_block_accumulators

    dev = lo.device
    rc, k = (int(d) for d in lo.shape)
    nb = k // 128
    n = int(weights.shape[0])
    var = lo != hi
    per_block = var.reshape(rc, nb, 128).sum(dim=2)                       # uncertain codes of each block
    j0 = torch.cumsum(per_block, dim=1) - per_block
    count = torch.where(per_block > 0, torch.ones_like(per_block) << per_block, torch.zeros_like(per_block))
    flat = count.reshape(-1)
    vbase = torch.where(per_block > 0, (torch.cumsum(flat, 0) - flat).reshape(rc, nb), torch.full_like(per_block, -1))
    nvar = per_block.sum(dim=1)
    total = int(flat.sum())
    if total == 0:
        return torch.zeros((0, n), dtype=torch.float64, device=dev), vbase, j0, per_block, nvar
    pr, pb = torch.nonzero(per_block > 0, as_tuple=True)                # (row, block) pairs with uncertain codes
    pair = torch.repeat_interleave(torch.arange(pr.numel(), device=dev), count[pr, pb])
    t = torch.arange(total, device=dev) - vbase[pr, pb].index_select(0, pair)   # the block's sub-combination
    vr, vk = pr.index_select(0, pair), pb.index_select(0, pair)
    cols = vk[:, None] * 128 + torch.arange(128, device=dev)[None, :]
    take = lambda x: x[vr[:, None], cols]  # noqa: E731 - [V, 128]: the variant's block of its row
    vvar = take(var)
    local = torch.cumsum(vvar.to(torch.int64), dim=1) - 1                 # rank of the code within its block
    bit = ((t[:, None] >> local.clamp(min=0)) & 1) == 1
    vals = torch.where(vvar, torch.where(bit, take(hi), take(lo)), take(sub.decode()))
    e_all = np.asarray(rows_c, dtype=np.int64)[vr.cpu().numpy()]
    variants = device_block_accumulators(vals, e_all, vk, weights)
    return variants, vbase, j0, per_block, nvar
