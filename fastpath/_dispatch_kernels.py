"""The Triton kernels of :mod:`fastpath.dispatch` (the counting sort, the layout fill, the row scatter
and the weighted reduce); the host code, the algorithm and the public API are in :mod:`fastpath.dispatch`."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_keys(ids_ptr, emap_ptr, offs, mask, E, G, USE_MAP: tl.constexpr):
    """Key of each slot: its group (local expert) in ``[0, G)``; absent slots after: with a map,
    ``G + global id`` for non-local experts and ``G + E`` for padding; without, ``G`` for padding."""
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    if USE_MAP:
        loc = tl.load(emap_ptr + ids, mask=mask & (ids >= 0), other=-1).to(tl.int32)
        key = tl.where(loc >= 0, loc, tl.where(ids >= 0, G + ids, G + E))
    else:
        key = tl.where(ids >= 0, ids, G)
    return key


@triton.jit
def _hist_kernel(ids_ptr, emap_ptr, hist_ptr, N, E, G, NK,
                 USE_MAP: tl.constexpr, S: tl.constexpr, NKP: tl.constexpr):
    c = tl.program_id(0)
    offs = c * S + tl.arange(0, S)
    mask = offs < N
    key = _slot_keys(ids_ptr, emap_ptr, offs, mask, E, G, USE_MAP)
    h = tl.histogram(key, NKP, mask=mask)
    g = tl.arange(0, NKP)
    tl.store(hist_ptr + c * NK + g, h, mask=g < NK)


@triton.jit
def _chunk_scan_kernel(hist_ptr, totals_ptr, C, NK, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    gm = g < NK
    carry = tl.zeros([BLOCK_G], dtype=tl.int32)
    c0 = 0
    while c0 < C:  # a while loop: the interpreter's `range` over a runtime bound fails on NumPy 2.4
        c = c0 + tl.arange(0, BLOCK_C)
        m = (c[:, None] < C) & gm[None, :]
        ptrs = hist_ptr + c[:, None] * NK + g[None, :]
        h = tl.load(ptrs, mask=m, other=0)
        incl = tl.cumsum(h, axis=0)
        tl.store(ptrs, incl - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
        c0 += BLOCK_C
    tl.store(totals_ptr + g, carry, mask=gm)


@triton.jit
def _write_starts(cnt, g, gm, starts_ptr, ends_ptr, offsets_ptr, meta_ptr, psum_ptr, G, PAD, CAP,
                  MODE: tl.constexpr, WRITE_PSUM: tl.constexpr):
    """From the key totals ``cnt[NKP]``: starts[NK] (row of each group's first slot), ends[G] (end
    of each present group's padded region), offsets[G+1] int64 (unpadded exclusive prefix sum of the
    present groups), meta[0] = rows used by present groups (num_tokens_post_padded), meta[1] =
    present slots, meta[2] = 1 if every present group fits its capacity (MODE 1; always 1 else)."""
    present = g < G
    cnt_present = tl.where(present, cnt, 0)
    n_present = tl.sum(cnt_present, axis=0)
    fits = 1
    if MODE == 1:
        start = g * CAP
        end = start + CAP
        used = G * CAP
        fits = (tl.max(cnt_present, axis=0) <= CAP).to(tl.int32)
    else:
        size = tl.where(present, (cnt + PAD - 1) // PAD * PAD, cnt)
        incl = tl.cumsum(size, axis=0)
        start = incl - size
        end = incl
        used = tl.sum(tl.where(present, size, 0), axis=0)
    tl.store(starts_ptr + g, start, mask=gm)
    tl.store(ends_ptr + g, end, mask=present)
    oincl = tl.cumsum(cnt_present, axis=0)
    tl.store(offsets_ptr + g, (oincl - cnt_present).to(tl.int64), mask=present)
    tl.store(offsets_ptr + G, n_present.to(tl.int64))
    tl.store(meta_ptr, used)
    tl.store(meta_ptr + 1, n_present)
    tl.store(meta_ptr + 2, fits)
    if WRITE_PSUM:
        tl.store(psum_ptr + g, start + cnt, mask=present)


@triton.jit
def _group_starts_kernel(totals_ptr, starts_ptr, ends_ptr, offsets_ptr, meta_ptr, psum_ptr,
                         G, NK, PAD, CAP,
                         MODE: tl.constexpr, WRITE_PSUM: tl.constexpr, NKP: tl.constexpr):
    """Step 3 (one program): :func:`_write_starts` from the totals."""
    g = tl.arange(0, NKP)
    gm = g < NK
    cnt = tl.load(totals_ptr + g, mask=gm, other=0)
    _write_starts(cnt, g, gm, starts_ptr, ends_ptr, offsets_ptr, meta_ptr, psum_ptr, G, PAD, CAP,
                  MODE, WRITE_PSUM)


@triton.jit
def _small_sort_kernel(ids_ptr, emap_ptr, hist_ptr, totals_ptr, starts_ptr, ends_ptr, offsets_ptr,
                       meta_ptr, psum_ptr, N, E, G, NK, C, PAD, CAP,
                       USE_MAP: tl.constexpr, S: tl.constexpr, NKP: tl.constexpr, MODE: tl.constexpr,
                       WRITE_PSUM: tl.constexpr):
    """Steps 1-3 in one program, for few chunks (decode sizes: one launch instead of three):
    :func:`_small_sort`."""
    _small_sort(ids_ptr, emap_ptr, hist_ptr, totals_ptr, starts_ptr, ends_ptr, offsets_ptr, meta_ptr, psum_ptr,
                N, E, G, NK, C, PAD, CAP, USE_MAP, S, NKP, MODE, WRITE_PSUM)


@triton.jit
def _small_sort(ids_ptr, emap_ptr, hist_ptr, totals_ptr, starts_ptr, ends_ptr, offsets_ptr,
                meta_ptr, psum_ptr, N, E, G, NK, C, PAD, CAP,
                USE_MAP: tl.constexpr, S: tl.constexpr, NKP: tl.constexpr, MODE: tl.constexpr,
                WRITE_PSUM: tl.constexpr):
    """Steps 1-3 by one program: each chunk's histogram in turn, the running sum before it stored as
    its prefix (what ``_chunk_scan_kernel`` writes), then :func:`_write_starts` from the totals."""
    g = tl.arange(0, NKP)
    gm = g < NK
    carry = tl.zeros([NKP], dtype=tl.int32)
    c = 0
    while c < C:  # a while loop: the interpreter's `range` over a runtime bound fails on NumPy 2.4
        offs = c * S + tl.arange(0, S)
        mask = offs < N
        key = _slot_keys(ids_ptr, emap_ptr, offs, mask, E, G, USE_MAP)
        h = tl.histogram(key, NKP, mask=mask)
        tl.store(hist_ptr + c * NK + g, carry, mask=gm)
        carry += h
        c += 1
    tl.store(totals_ptr + g, carry, mask=gm)
    _write_starts(carry, g, gm, starts_ptr, ends_ptr, offsets_ptr, meta_ptr, psum_ptr, G, PAD, CAP,
                  MODE, WRITE_PSUM)


@triton.jit
def _rank_kernel(ids_ptr, emap_ptr, base_ptr, starts_ptr, dst_ptr, list_ptr, grp_ptr,
                 N, E, G, NK, SENTINEL,
                 USE_MAP: tl.constexpr, S: tl.constexpr,
                 DST_MODE: tl.constexpr, LIST_MODE: tl.constexpr, WRITE_GRP: tl.constexpr):
    """Step 4, one program a chunk: :func:`_rank_chunk`."""
    _rank_chunk(tl.program_id(0), ids_ptr, emap_ptr, base_ptr, starts_ptr, dst_ptr, list_ptr, grp_ptr,
                N, E, G, NK, SENTINEL, USE_MAP, S, DST_MODE, LIST_MODE, WRITE_GRP)


@triton.jit
def _rank_chunk(c, ids_ptr, emap_ptr, base_ptr, starts_ptr, dst_ptr, list_ptr, grp_ptr,
                N, E, G, NK, SENTINEL,
                USE_MAP: tl.constexpr, S: tl.constexpr,
                DST_MODE: tl.constexpr, LIST_MODE: tl.constexpr, WRITE_GRP: tl.constexpr):
    """The rows of chunk ``c``'s slots. DST_MODE 0: none, 1: dst[s] = row (present) or -1, 2: dst[s] = row
    for every slot. LIST_MODE 0: none, 1: list[row] = s (present), 2: list[row] = s (present) or SENTINEL
    (absent). WRITE_GRP: grp[row] = local expert (present)."""
    i = tl.arange(0, S)
    offs = c * S + i
    mask = offs < N
    key = _slot_keys(ids_ptr, emap_ptr, offs, mask, E, G, USE_MAP)
    keyv = tl.where(mask, key, -1)
    same = (keyv[:, None] == keyv[None, :]) & (i[None, :] < i[:, None])
    within = tl.sum(same.to(tl.int32), axis=1)
    before = tl.load(base_ptr + c * NK + key, mask=mask, other=0)
    start = tl.load(starts_ptr + key, mask=mask, other=0)
    row = start + before + within
    present = mask & (key < G)
    if DST_MODE == 1:
        tl.store(dst_ptr + offs, tl.where(present, row, -1), mask=mask)
    if DST_MODE == 2:
        tl.store(dst_ptr + offs, row, mask=mask)
    if LIST_MODE == 1:
        tl.store(list_ptr + row, offs, mask=present)
    if LIST_MODE == 2:
        tl.store(list_ptr + row, tl.where(present, offs, SENTINEL), mask=mask)
    if WRITE_GRP:
        tl.store(grp_ptr + row, key, mask=present)


@triton.jit
def _group_of(ends_ptr, p, G, LOG_G: tl.constexpr):
    """Number of present groups whose padded region ends at or before ``p`` (binary search over the
    nondecreasing ``ends[G]``): the group holding position ``p``, or ``G`` past the last one."""
    lo = tl.zeros_like(p)
    for bb in tl.static_range(LOG_G + 1):
        cand = lo + (1 << (LOG_G - bb))
        ok = cand <= G
        e = tl.load(ends_ptr + cand - 1, mask=ok, other=0)
        lo = tl.where(ok & (e <= p), cand, lo)
    return lo


@triton.jit
def _fill_kernel(starts_ptr, ends_ptr, totals_ptr, meta_ptr, label_ptr,
                 list_ptr, grp_ptr, blk_ptr, rows_ptr,
                 P, NBLK, G, CAP, BS, LIST_PAD, K, stride_rm,
                 MODE: tl.constexpr, LOG_G: tl.constexpr, BLOCK_P: tl.constexpr,
                 WRITE_LIST: tl.constexpr, WRITE_GRP: tl.constexpr, WRITE_BLK: tl.constexpr,
                 HAS_LABEL: tl.constexpr, ZERO_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step 5, one program a block of ``BLOCK_P`` positions: :func:`_fill_block`."""
    _fill_block(tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P), starts_ptr, ends_ptr, totals_ptr, meta_ptr,
                label_ptr, list_ptr, grp_ptr, blk_ptr, rows_ptr, P, NBLK, G, CAP, BS, LIST_PAD, K, stride_rm,
                MODE, LOG_G, BLOCK_P, WRITE_LIST, WRITE_GRP, WRITE_BLK, HAS_LABEL, ZERO_ROWS, BLOCK_K)


@triton.jit
def _fill_block(p, starts_ptr, ends_ptr, totals_ptr, meta_ptr, label_ptr,
                list_ptr, grp_ptr, blk_ptr, rows_ptr,
                P, NBLK, G, CAP, BS, LIST_PAD, K, stride_rm,
                MODE: tl.constexpr, LOG_G: tl.constexpr, BLOCK_P: tl.constexpr,
                WRITE_LIST: tl.constexpr, WRITE_GRP: tl.constexpr, WRITE_BLK: tl.constexpr,
                HAS_LABEL: tl.constexpr, ZERO_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Positions ``p`` (``BLOCK_P`` of them): padding positions ``p < P`` of a padded layout: list[p] =
    LIST_PAD, grp[p] = -1, zero rows; and block labels blk[b] for ``b < NBLK`` (block b starts at position
    b*BS)."""
    if MODE == 1:
        g = p // CAP
        inside = g < G
    else:
        g = _group_of(ends_ptr, p, G, LOG_G)
        inside = g < G
    st = tl.load(starts_ptr + g, mask=inside, other=0)
    cnt = tl.load(totals_ptr + g, mask=inside, other=0)
    pad = (p < P) & ((~inside) | (p - st >= cnt))
    if WRITE_LIST:
        tl.store(list_ptr + p, tl.full([BLOCK_P], 0, tl.int32) + LIST_PAD, mask=pad)
    if WRITE_GRP:
        tl.store(grp_ptr + p, tl.full([BLOCK_P], -1, tl.int32), mask=pad)
    if WRITE_BLK:
        used = tl.load(meta_ptr)
        q = p * BS
        gb = _group_of(ends_ptr, q, G, LOG_G)
        real = (q < used) & (gb < G)
        if HAS_LABEL:
            lab = tl.load(label_ptr + gb, mask=real, other=-1).to(tl.int32)
        else:
            lab = gb
        tl.store(blk_ptr + p, tl.where(real, lab, -1), mask=p < NBLK)
    if ZERO_ROWS:
        prow = p.to(tl.int64) * stride_rm
        k_end = tl.where(tl.sum(pad.to(tl.int32), axis=0) > 0, K, 0)  # skip blocks with no padding row
        k0 = 0
        while k0 < k_end:
            k = k0 + tl.arange(0, BLOCK_K)
            z = tl.zeros([BLOCK_P, BLOCK_K], dtype=rows_ptr.dtype.element_ty)
            tl.store(rows_ptr + prow[:, None] + k[None, :], z, mask=pad[:, None] & (k[None, :] < K))
            k0 += BLOCK_K


@triton.jit
def _small_capacity_kernel(ids_ptr, emap_ptr, hist_ptr, totals_ptr, starts_ptr, ends_ptr, offsets_ptr, meta_ptr,
                           dst_ptr, list_ptr, N, E, G, NK, C, CAP, P,
                           USE_MAP: tl.constexpr, S: tl.constexpr, NKP: tl.constexpr, LOG_G: tl.constexpr,
                           BLOCK_P: tl.constexpr):
    """A capacity layout's steps 1-5 in one program (decode sizes, no rows to copy: one launch instead of
    three): :func:`_small_sort` (capacity mode), a barrier (the rank and the fill read the starts, totals and
    chunk prefixes the sort stored, from other threads of this program), each chunk's :func:`_rank_chunk`
    (``dst`` and the row -> slot list), then :func:`_fill_block` over the ``P`` positions (list padding -1).
    The same device functions in the same order as the three launches: the same outputs. The rank and the
    fill write disjoint positions (slots' rows, padding rows)."""
    _small_sort(ids_ptr, emap_ptr, hist_ptr, totals_ptr, starts_ptr, ends_ptr, offsets_ptr, meta_ptr, meta_ptr,
                N, E, G, NK, C, 1, CAP, USE_MAP, S, NKP, 1, False)
    tl.debug_barrier()
    c = 0
    while c < C:
        _rank_chunk(c, ids_ptr, emap_ptr, hist_ptr, starts_ptr, dst_ptr, list_ptr, meta_ptr, N, E, G, NK, 0,
                    USE_MAP, S, 1, 1, False)
        c += 1
    p0 = 0
    while p0 < P:
        _fill_block(p0 + tl.arange(0, BLOCK_P), starts_ptr, ends_ptr, totals_ptr, meta_ptr, meta_ptr, list_ptr,
                    meta_ptr, meta_ptr, meta_ptr, P, 0, G, CAP, 1, -1, 0, 0, 1, LOG_G, BLOCK_P, True, False, False,
                    False, False, 16)
        p0 += BLOCK_P


@triton.jit
def _decode_capacity_kernel(ids_ptr, emap_ptr, totals_ptr, meta_ptr, dst_ptr, list_ptr, N, E, G, CAP, P,
                            USE_MAP: tl.constexpr, NP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    """A capacity layout of at most ``NP`` slots (decode sizes), in registers, one memory round trip: every
    program reads all ``N`` slots' keys (:func:`_slot_keys`) and ranks each present slot among the earlier
    slots of its key (an ``NP x NP`` comparison: the reference's stable order), so slot ``s`` has row
    ``key * CAP + rank``; then ``list[p]`` for its ``BLOCK_P`` positions is the slot whose row is ``p``, else -1
    (a ``BLOCK_P x NP`` comparison; nothing read back from memory). Program 0 also writes ``dst`` (slot -> row,
    -1 absent), the counts of the ``G`` local experts (``totals``, ``BLOCK_G x NP`` comparisons at a time) and
    ``meta`` (rows ``G * CAP``, present slots, 1 if every expert fits its ``CAP`` rows: the flag the host checks
    on the device where ``CAP < N``; a slot past its expert's capacity gets no row, so no other expert's row is
    written). The outputs of
    ``_small_capacity_kernel`` (and of the sort, rank and fill launches) by the same definition; the sort's
    scratch (chunk prefixes, starts, offsets) is not written."""
    s = tl.arange(0, NP)
    sm = s < N
    key = _slot_keys(ids_ptr, emap_ptr, s, sm, E, G, USE_MAP)
    present = sm & (key < G)
    keyv = tl.where(present, key, -1)
    same = (keyv[:, None] == keyv[None, :]) & (s[None, :] < s[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    row = tl.where(present & (rank < CAP), key * CAP + rank, -1)  # an overflowing slot: no row (meta[2] = 0)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    hit = row[None, :] == p[:, None]
    slot = tl.max(tl.where(hit, s[None, :], -1), axis=1)
    tl.store(list_ptr + p, slot.to(tl.int64), mask=p < P)
    if tl.program_id(0) == 0:
        tl.store(dst_ptr + s, row, mask=sm)
        g0 = 0
        while g0 < G:  # counts by comparison, BLOCK_G experts at a time (no tl.histogram of a few slots)
            g = g0 + tl.arange(0, BLOCK_G)
            cnt = tl.sum(((keyv[None, :] == g[:, None]) & present[None, :]).to(tl.int32), axis=1)
            tl.store(totals_ptr + g, cnt, mask=g < G)
            g0 += BLOCK_G
        tl.store(meta_ptr, G * CAP)
        tl.store(meta_ptr + 1, tl.sum(present.to(tl.int32), axis=0))
        tl.store(meta_ptr + 2, (tl.max(tl.where(present, rank, 0), axis=0) < CAP).to(tl.int32))


@triton.jit
def _scatter_rows_kernel(x_ptr, dst_ptr, out_ptr, nvalid_ptr, M, K, stride_xm, stride_xk, stride_om,
                         TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         ZERO_ABSENT: tl.constexpr):
    """out[dst[t*k+j]] = x[t] for every slot with dst >= 0; with ZERO_ABSENT rows dst >= nvalid
    (absent slots of the permuted layout) get zeros instead."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tm = t < M
    km = k < K
    x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_xm + k[None, :] * stride_xk,
                mask=tm[:, None] & km[None, :], other=0)
    if ZERO_ABSENT:
        nv = tl.load(nvalid_ptr).to(tl.int32)
    for j in tl.static_range(TOPK):
        d = tl.load(dst_ptr + t * TOPK + j, mask=tm, other=-1)
        if ZERO_ABSENT:
            v = tl.where((d < nv)[:, None], x, tl.zeros_like(x))
        else:
            v = x
        tl.store(out_ptr + d.to(tl.int64)[:, None] * stride_om + k[None, :], v,
                 mask=(d >= 0)[:, None] & km[None, :])


@triton.jit
def _bf16_bits_rne(x):
    """float32 -> bfloat16 bit pattern (uint16 in int32), round to nearest even; NaN -> 0x7FC0 with
    its sign. Done in integers because the interpreter's float32 -> bfloat16 cast truncates (the
    GPU's ``cvt.rn.bf16.f32`` rounds to nearest even; this gives the same bits on both)."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    r = tl.where(nan, ((b >> 16) & 0x8000) | 0x7FC0, r)
    return r.to(tl.int32)


@triton.jit
def _reduce_kernel(y_ptr, w_ptr, dst_ptr, nvalid_ptr, out_ptr, M, K, NV,
                   stride_ym, stride_yk, stride_wm, stride_wk, stride_om,
                   TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   APPLY_W: tl.constexpr, NV_FROM_PTR: tl.constexpr, OUT_BF16: tl.constexpr,
                   GDC_WAIT: tl.constexpr = False):
    """out[t] = sum_j w[t,j] * y[dst[t*k+j]] in float32, j ascending; slots with dst outside
    [0, nvalid) contribute 0 (their rows are never read). GDC_WAIT (launched with Programmatic Dependent
    Launch): every program first lets the kernel after it launch and waits for the kernel before it
    (:func:`fastpath._host.pdl_launch`)."""
    if GDC_WAIT:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tm = t < M
    km = k < K
    if NV_FROM_PTR:
        nv = tl.load(nvalid_ptr)
    else:
        nv = NV
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        d = tl.load(dst_ptr + t * TOPK + j, mask=tm, other=-1)
        pres = tm & (d >= 0) & (d < nv)
        x = tl.load(y_ptr + d.to(tl.int64)[:, None] * stride_ym + k[None, :] * stride_yk,
                    mask=pres[:, None] & km[None, :], other=0).to(tl.float32)
        if APPLY_W:
            w = tl.load(w_ptr + t.to(tl.int64) * stride_wm + j * stride_wk, mask=tm, other=0).to(tl.float32)
            acc += w[:, None] * x
        else:
            acc += x
    if OUT_BF16:  # out_ptr is an int16 view of the bfloat16 output
        res = _bf16_bits_rne(acc).to(tl.int16)
    else:
        res = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_om + k[None, :], res, mask=tm[:, None] & km[None, :])


@triton.jit
def _invert_kernel(src_ptr, dst_ptr, R, BLOCK: tl.constexpr):
    """dst[src[r]] = r for rows with src >= 0 (slot -> row map of a layout)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(src_ptr + r, mask=r < R, other=-1)
    tl.store(dst_ptr + s, r, mask=(r < R) & (s >= 0))
