"""The GEMMs of an emulated profile (``accum_model="emulated"``: :data:`moeref.compare.DEEPGEMM_FP8_EXACT` and
its ``promotion_order="a_then_b"`` variant) on a device: :func:`moeref.compare.bounds._emulated_gemm` on torch
tensors, the same ``(center, radius)`` bit for bit.

* center: the kernel's FP32 result on the center operand, predicted by the device emulator
  (:func:`moeref.gemm.device_hopper_fp8.device_deepgemm_rows`, the NumPy emulator's bits);
* GEMM2's uncertain rows (the re-quantized intermediate, ``a_radius > 0``): a row with at most
  :data:`moeref.compare.bounds._MAX_ENUMERATED` uncertain codes, each one of two neighbouring E4M3 values, is
  emulated for every combination of them, plus the scale term ``sum_b |ds_b| |sb_b acc_b| + 2 gamma(S + 2,
  u_fp32) sum_b s_hi_b |sb_b acc_b|`` (computed by the emulator kernel itself, in block order, as the host
  sums it). A row with no uncertain code is its center row: one pass. The host runs, per expert, every
  combination of the expert's largest count on all its rows; the surplus combinations of a row with fewer
  uncertain codes repeat one of its own, so taking only a row's own ``2^n`` combinations gives the same
  maximum. Any other uncertain row: the distance from the center to the exact product, ``|W| a_radius`` and
  the data-dependent bound (:mod:`moeref.compare.device.bounds`, the host's bits);
* the bias: added in float64 after the product, radius ``u_fp32 (|center| + radius)``.

Work: one emulator launch for the centers, one for the rows without an uncertain code, and one per
combination (at most 16) over the rows that have that many.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import bounds as _host
from ..bounds import gamma
from .bounds import device_rows_error_bound

__all__ = ["device_emulated_gemm"]


def _torch():
    import torch

    return torch


def device_emulated_gemm(a, a_radius, row_expert, weights, bias, profile, codes=None):
    """:func:`moeref.compare.bounds._emulated_gemm` on a device: ``a`` a
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
    center = device_deepgemm_rows(a, rows, weights, promotion=promotion)
    radius = torch.zeros_like(center)
    dev = center.device
    if a_radius is not None:
        unsure = ((a_radius.amax(dim=1) > 0).cpu().numpy() if a_radius.shape[1] else np.zeros(rows.size, bool)) \
            & (rows >= 0)
        fallback = unsure.copy()
        if codes is not None and unsure.any():
            done = _enumerate_codes(a, codes, rows, unsure, weights, profile, center, radius)
            fallback &= ~done
        rows_u = np.where(fallback, rows, -1)
        if (rows_u >= 0).any():
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
    """:func:`moeref.compare.bounds._adjacent_e4m3` on tensors: ``lo < hi`` are neighbouring E4M3 values."""
    torch = _torch()

    def mag(v):
        return (v.abs().to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8) & 0x7F).to(torch.int64)

    ml, mh = mag(lo), mag(hi)
    return ((lo >= 0) & (mh - ml == 1)) | ((hi <= 0) & (ml - mh == 1))


def _enumerate_codes(a, codes, rows, unsure, weights, profile, center, radius) -> np.ndarray:
    """Fills ``radius`` (in place) on the rows it can enumerate (module docstring); returns their mask."""
    torch = _torch()
    from ...gemm.device_hopper_fp8 import device_deepgemm_rows

    dev = center.device
    lo, hi = codes["code_lo"], codes["code_hi"]
    var = lo != hi
    nvar = var.sum(dim=1)
    ok_t = (nvar <= _host._MAX_ENUMERATED) & (~var | _adjacent_e4m3(lo, hi)).all(dim=1)
    ok = unsure & ok_t.cpu().numpy()
    if not ok.any():
        return ok
    r, k = a.shape
    nb = k // 128
    ds = (codes["scale_hi"] - codes["scale_lo"]).reshape(r, nb, -1).amax(dim=2)
    s_hi = codes["scale_hi"].reshape(r, nb, -1).amax(dim=2)
    term = (ds, s_hi, 2 * gamma(nb + 2, profile.promote_unit))
    promotion = profile.promotion_order
    nv = nvar.cpu().numpy()
    worst = torch.zeros_like(center)
    zero = ok & (nv == 0)  # the center's own codes: one combination
    if zero.any():
        y, st = device_deepgemm_rows(a, np.where(zero, rows, -1), weights, promotion=promotion, scale_term=term)
        worst = torch.where(torch.as_tensor(zero, device=dev)[:, None], (y - center).abs() + st, worst)
    some = ok & (nv > 0)
    if some.any():
        base = a.decode()
        rank = torch.cumsum(var.to(torch.int64), dim=1) - 1  # the j-th uncertain column of its row has rank j
        for combo in range(1 << int(nv[some].max())):  # <= 2^4 emulations
            sel = some & (combo < (1 << nv))
            bit = ((combo >> rank.clamp(min=0)) & 1) == 1
            vals = torch.where(var, torch.where(bit, hi, lo), base)
            y, st = device_deepgemm_rows(a, np.where(sel, rows, -1), weights, promotion=promotion, values=vals,
                                         scale_term=term)
            cand = torch.maximum(worst, (y - center).abs() + st)
            worst = torch.where(torch.as_tensor(sel, device=dev)[:, None], cand, worst)
    okt = torch.as_tensor(ok, device=dev)[:, None]
    radius.copy_(torch.where(okt, worst, radius))
    return ok
