"""The GEMM interval of a known kernel (``accum_model="emulated"``): DeepGEMM's FP8 GEMM emulated bit for bit."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..gemm.exact import as_operand
from ..gemm.grouped import ExpertOperands, expert_rows_gemm
from .gemm_bounds import gamma
from .gemm_intervals import _rows_error_bound, _rows_radius_term

_MAX_ENUMERATED = 4
"""Rows of GEMM2's operand with at most this many elements of uncertain code are emulated for every
combination of their codes; rows with more fall back to the data-dependent bound."""


def _emulated_gemm(a, a_radius, row_expert, weights, bias, profile, codes=None):
    """``(center, radius)`` of a GEMM of a known kernel (``accum_model="emulated"``): the center is the
    kernel's FP32 result on the center operand, predicted bit for bit
    (:func:`moeref.gemm.hopper_fp8.deepgemm_engine`), plus the bias in FP32 (radius ``u_fp32 |center|``
    for that add, 0 without a bias).

    Where the operand is uncertain (GEMM2: ``a_radius > 0``, the re-quantized intermediate; ``codes`` from
    :func:`requant_uncertainty` with ``detail=True``): the tensor cores see only the element codes, the
    scales enter in the FP32 promotion. A row whose uncertain codes are at most :data:`_MAX_ENUMERATED`,
    each one of two neighbours, is emulated for every combination of them (block accumulators exact);
    the scale range adds ``sum_b |ds_b| |sb_b acc_b| + 2 gamma(S + 2, u_fp32) sum_b s_hi_b |sb_b acc_b|`` (the
    scale difference, and both kernels' promotion roundings). Any other uncertain row gets the distance
    from the center to the exact product, ``|W| a_radius`` and the data-dependent arithmetic bound."""
    from ..gemm.hopper_fp8 import deepgemm_block_accumulators, deepgemm_engine, promote

    eng = deepgemm_engine(promotion=profile.promotion_order)
    center = expert_rows_gemm(a, row_expert, weights, None, gemm=eng)
    radius = np.zeros_like(center)
    rows_all = np.asarray(row_expert)
    if a_radius is not None:
        unsure = (np.asarray(a_radius).max(axis=1, initial=0.0) > 0) & (rows_all >= 0)
        fallback = unsure.copy()
        if codes is not None and unsure.any():
            done = _enumerate_codes(a, codes, rows_all, unsure, weights, profile, center, radius,
                                    deepgemm_block_accumulators, promote)
            fallback &= ~done
        rows_u = np.where(fallback, rows_all, -1)
        if (rows_u >= 0).any():
            exact = expert_rows_gemm(a, rows_u, weights, None)
            data = replace(profile, accum_model="data_dependent")
            far = (np.abs(center - exact) + _rows_radius_term(a_radius, rows_u, weights)
                   + _rows_error_bound(a, a_radius, rows_u, weights, None, data))
            radius = np.where(fallback[:, None], far, radius)
    if bias is not None:
        valid = rows_all >= 0
        center[valid] += np.asarray(bias, dtype=np.float64)[rows_all[valid]]
        radius = radius + profile.promote_unit * (np.abs(center) + radius)
    return center, radius


def _adjacent_e4m3(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``lo < hi`` are neighbouring E4M3 values (no value between them)."""
    import ml_dtypes

    mag = lambda v: (np.abs(v).astype(ml_dtypes.float8_e4m3fn).view(np.uint8) & 0x7F).astype(np.int64)  # noqa: E731
    ml, mh = mag(lo), mag(hi)
    return (((lo >= 0) & (mh - ml == 1)) | ((hi <= 0) & (ml - mh == 1)))


def _enumerate_codes(a, codes, rows_all, unsure, weights, profile, center, radius, block_acc, promote) -> np.ndarray:
    """Fills ``radius`` of the uncertain rows it can enumerate (see :func:`_emulated_gemm`); returns
    their mask."""
    a = as_operand(a, "a")
    w = ExpertOperands(weights)
    lo, hi = codes["code_lo"], codes["code_hi"]
    var = lo != hi
    nvar = var.sum(axis=1)
    ok = unsure & (nvar <= _MAX_ENUMERATED) & np.all(~var | _adjacent_e4m3(lo, hi), axis=1)
    base = a.values  # the center's element values (codes), unscaled
    for e in np.unique(rows_all[ok]).tolist():  # a loop over experts
        idx = np.flatnonzero(ok & (rows_all == e))
        we = w[e]
        k = a.shape[1]
        nb = k // 128
        sa = a.scales[idx] if a.scales.shape[0] == a.shape[0] else np.repeat(a.scales, idx.size, axis=0)
        sb = np.repeat(np.asarray(we.scales, dtype=np.float64), we.block[0], axis=0)[: we.shape[0]]
        ds = (codes["scale_hi"][idx] - codes["scale_lo"][idx]).reshape(idx.size, nb, -1).max(axis=2)
        s_hi = codes["scale_hi"][idx].reshape(idx.size, nb, -1).max(axis=2)
        pos = [np.flatnonzero(var[r]) for r in idx]
        worst = np.zeros((idx.size, we.shape[0]))
        for combo in range(1 << int(nvar[idx].max())):  # <= 2^4 emulations of these rows
            vals = np.array(base[idx], dtype=np.float64)
            for i, p_ in enumerate(pos):  # a loop over this expert's enumerated rows (a few uncertain codes each)
                for j, col in enumerate(p_):
                    vals[i, col] = hi[idx[i], col] if (combo >> j) & 1 else lo[idx[i], col]
            acc = block_acc(vals, we.values)
            y = promote(acc, sa, sb, profile.promotion_order)
            mag = np.abs(acc) * np.abs(sb)[None, :, :]
            scale_term = (_block_sum(mag, ds) + 2 * gamma(nb + 2, profile.promote_unit) * _block_sum(mag, s_hi))
            worst = np.maximum(worst, np.abs(y - center[idx]) + scale_term)
        radius[idx] = worst
    return ok


def _block_sum(mag: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``sum_b mag[r, n, b] * w[r, b]`` in block order from 0 (the order the device emulator sums in,
    :mod:`moeref.compare.device.emulated`: the same bits)."""
    out = np.zeros(mag.shape[:2])
    for b in range(mag.shape[2]):  # a loop over K blocks
        out = out + mag[:, :, b] * w[:, None, b]
    return out
