"""The persistent FP8-block -> NVFP4 conversion: amax phase, grid-wide barrier and data phase in
ONE launch (``RequantTuning(method="persistent")`` of :func:`fastpath.requant.fp8_block_to_fp4`).

NVFP4 needs the tensor's amax before any block scale, so the default path
(:mod:`fastpath.requant`) is two kernels that read the FP8 codes twice: an amax pass whose last
program computes the factors, then the data pass. Here one persistent grid of co-resident
programs does both: each program takes the amax of its tiles, the programs meet at a grid-wide
barrier (the last to arrive computes the factors), then each converts its data tiles, whose
codes the first phase has just brought into L2 (the 14.7 MB of a 7168 x 2048 weight fit the
H100's 50 MB). :func:`launch` launches it cooperatively (``launch_cooperative_grid``), so the
driver refuses a grid that cannot be resident at once instead of letting the barrier hang, with
at most the SM count x the compiled kernel's occupancy programs (:func:`resident_programs`).

Under Triton's interpreter programs run one after another and a barrier would never open: there
:func:`launch` runs the same kernel's two phases as two launches (``PHASE`` 1 then 2), which
is what the CPU tests check; the GPU runs ``PHASE`` 0, both with the barrier between.

Measured (H100, 2026-11-25; docs/convert.md): the first version, with one counter and one flag
for all programs, took 42 us against 23 us for the two kernels; this version (slot counters,
one flag per 128-byte line, polls ``nanosleep`` apart) is not measured yet, so the default
method stays the two kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton_rounding as R
from ._host import _arg_key, alloc
from ._requant_tiles import _block_scale, _data_tile, _e4m3_times
from .quant import _kernels as KN
from .quant import _preset_map as P


@triton.jit
def _amax_tiles(c_ptr, stride_cm, s_ptr, stride_sm, M, K, NPROG,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SBM: tl.constexpr, SBK: tl.constexpr,
                NONFINITE: tl.constexpr):
    """This program's share of the tensor amax, as non-negative float32 bits (int32): the max
    over the [BLOCK_M, BLOCK_K] tiles ``pid, pid + NPROG, ...`` (row tiles fastest), each inside
    one source block. One scale per tile and ``x -> |fl32(x * s)|`` monotone in ``|x|`` (RNE is
    symmetric), so a tile's amax is the product of its largest code magnitude (E4M3 magnitudes
    order like their 7 bits; 0x7F, the NaN, sorts last) with the scale: the same value, and the
    same NaN, as the maximum over the decoded elements (an infinite scale, whose zeros decode to
    NaN, has no meaning in these layouts). Non-negative float32 bits order like the floats and
    NaN sorts above Inf, so it propagates, unless NONFINITE is 1 ignores it, as
    :mod:`fastpath.quant`'s amax pass does."""
    pid = tl.program_id(0)
    nm = tl.cdiv(M, BLOCK_M)
    nt = nm * tl.cdiv(K, BLOCK_K)
    acc = pid * 0
    t = pid
    while t < nt:  # a while loop: the interpreter's `range` over a runtime bound fails on NumPy 2.4
        pm = t % nm
        pk = t // nm
        rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        kk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        m = (rows < M)[:, None] & (kk < K)[None, :]
        c = tl.load(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + kk[None, :], mask=m, other=0)
        mag = c.to(tl.uint32) & 0x7F
        if NONFINITE == 1:
            mag = tl.where(mag == 0x7F, 0, mag)
        top = tl.max(tl.max(mag, axis=1), axis=0)
        s = _block_scale(s_ptr, stride_sm, pm * BLOCK_M, pk * BLOCK_K, M, K, SBM, SBK)
        a = R.f32_bits(_e4m3_times(top, s)) & 0x7FFFFFFF
        if NONFINITE == 1:
            a = tl.where(a > 0x7F800000, 0, a)
        acc = tl.maximum(acc, a.to(tl.int32, bitcast=True))
        t += NPROG
    return acc


@triton.jit
def _partials_max(part_ptr, n):
    """The max of the ``n`` int32 partials at ``part_ptr`` (float32 amax bits)."""
    acc = tl.zeros((1024,), tl.int32)
    i = n * 0
    while i < n:
        idx = i + tl.arange(0, 1024)
        acc = tl.maximum(acc, tl.load(part_ptr + idx, mask=idx < n, other=0))
        i += 1024
    return tl.max(acc, axis=0)


@triton.jit
def _grid_wait(flag_ptr, SLEEP_NS: tl.constexpr):
    """Wait until the flag at ``flag_ptr`` is set (the factors are written), then acquire: every
    thread of the program reads what the setting program wrote before its release. Polls with
    volatile loads (strong L2 reads, not atomics) ``SLEEP_NS`` apart (``nanosleep``), then one
    acquire read of the flag, whose value (1) is returned: the caller uses it, else the
    compiler drops an atomic whose result nothing reads (seen in the SASS)."""
    flag = tl.load(flag_ptr, volatile=True)
    while flag == 0:
        if SLEEP_NS > 0:
            slept = tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.b32 $0, $1;", "=r,r",
                                              [flag + SLEEP_NS], dtype=tl.int32, is_pure=False,
                                              pack=1)
            flag = tl.load(flag_ptr + (slept - SLEEP_NS), volatile=True)  # slept - SLEEP_NS == 0
        else:
            flag = tl.load(flag_ptr, volatile=True)
    go = tl.atomic_add(flag_ptr, 0, sem="acquire")
    tl.debug_barrier()
    return go


@triton.jit(do_not_specialize=["NPROG"])  # one compiled kernel whatever the grid
def _persistent_kernel(
    c_ptr, stride_cm, w_ptr, stride_wm, s_ptr, stride_sm, q_ptr, stride_qm,
    o_ptr, stride_om, stride_og, dummy_ptr, p_ptr, part_ptr, nv_ptr, glob_ptr,
    M, K, NG, M_PAD, NG_PAD, NPROG,
    PHASE: tl.constexpr, BMA: tl.constexpr, BKA: tl.constexpr, GLOB: tl.constexpr,
    NSLOT: tl.constexpr, NFLAG: tl.constexpr, LINE: tl.constexpr, SLEEP_NS: tl.constexpr,
    SBM: tl.constexpr, SBK: tl.constexpr,
    GS: tl.constexpr, GB: tl.constexpr, GPP: tl.constexpr, BLOCK_M: tl.constexpr,
    ELEM_MAX: tl.constexpr, INV_M: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
    SCALE_KIND: tl.constexpr, FP32_RULE: tl.constexpr, FP32_POW2: tl.constexpr,
    E8_RULE: tl.constexpr, E8_LO: tl.constexpr, E8_HI: tl.constexpr, E8_NF: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, ZERO_BLOCK: tl.constexpr, NONFINITE: tl.constexpr,
    APPLY: tl.constexpr, SATURATE: tl.constexpr, ROUND: tl.constexpr,
    DROP_NEG_ZERO: tl.constexpr, NAN_CODE: tl.constexpr, FILL_CODE: tl.constexpr,
    SF_LAYOUT: tl.constexpr, TWO_LEVEL: tl.constexpr, NV_ORDER: tl.constexpr,
    DIV: tl.constexpr, E2M1_PTX: tl.constexpr, HW_SCALE: tl.constexpr, HW_DECODE: tl.constexpr,
):
    """The conversion's phases, program ``pid`` of ``NPROG`` taking tiles ``pid, pid + NPROG, ...``.

    PHASE 1 (NVFP4's amax): :func:`_amax_tiles`, stored as the program's partial
    ``part[pid]``; then the program counts itself in one of ``NSLOT`` slot counters
    (acquire-release, after its store), the last of a slot counts the slot in ``p[0]``, and the
    last of those has seen every partial: it reduces them into ``p[1]`` and runs
    :func:`fastpath.quant._kernels._nvfp4_factors` on it (``nv`` and ``glob`` as that kernel
    writes them). Counters and flags lie ``LINE`` int32 apart (their own 128-byte lines): one
    counter for thousands of programs, next to the flag they poll, serialized them (a 1-warp
    program per tile, 3584 programs: 42 us against 23 us for two kernels; H100, 2026-11-25).
    ``p`` (int32, ``LINE * (1 + NSLOT + NFLAG)``) is zeroed by the caller for every conversion.

    PHASE 2 (the data): :func:`_data_tile` over the data tiles (row tiles fastest), reading the
    factors from ``nv``.

    PHASE 0 (both in one launch, GPU only): PHASE 1, then a grid-wide barrier: the last program
    sets ``NFLAG`` flags (release) after writing the factors, every program waits for one of
    them (:func:`_grid_wait`), then PHASE 2, whose codes are the ones phase 1 just read (the 14.7 MB
    of a 7168 x 2048 weight are read from HBM once and again from the 50 MB L2). The barrier
    needs every program resident at once: the host launches it cooperatively
    (``launch_cooperative_grid``: the driver refuses a grid that cannot be co-resident rather
    than letting it hang) with at most the SM count x the compiled kernel's occupancy. Under
    Triton's interpreter programs run one after another, so a barrier would never open there:
    :func:`launch` runs PHASE 1 and PHASE 2 as two launches of this same code instead."""
    pid = tl.program_id(0)
    go = 1
    if PHASE != 2:
        a = _amax_tiles(c_ptr, stride_cm, s_ptr, stride_sm, M, K, NPROG, BMA, BKA, SBM, SBK,
                        NONFINITE)
        tl.store(part_ptr + pid, a)
        slot = pid % NSLOT
        c = tl.atomic_add(p_ptr + LINE * (1 + slot), 1, sem="acq_rel")
        if c == (NPROG - slot + NSLOT - 1) // NSLOT - 1:  # the slot's last program
            d = tl.atomic_add(p_ptr, 1, sem="acq_rel")
            if d == tl.minimum(NPROG, NSLOT) - 1:  # the last slot: every partial is visible
                tl.debug_barrier()  # the whole program reads after the counting thread's acquire
                tl.store(p_ptr + 1, _partials_max(part_ptr, NPROG))
                tl.debug_barrier()
                KN._nvfp4_factors((p_ptr + 1).to(tl.pointer_type(tl.float32), bitcast=True),
                                  p_ptr, nv_ptr, glob_ptr, 0, True, NV_ORDER, GLOB, 0)
                if PHASE == 0:
                    tl.debug_barrier()  # every thread's factor stores before the release
                    f = tl.arange(0, NFLAG)
                    tl.atomic_xchg(p_ptr + LINE * (1 + NSLOT + f), f * 0 + 1, sem="release")
        if PHASE == 0:
            go = _grid_wait(p_ptr + LINE * (1 + NSLOT + pid % NFLAG), SLEEP_NS)  # 1
    if PHASE != 1:
        nm = tl.cdiv(M_PAD, BLOCK_M)
        nt = nm * tl.cdiv(NG_PAD, GPP)
        t = pid * go
        while t < nt:
            _data_tile(w_ptr, stride_wm, s_ptr, stride_sm, q_ptr, stride_qm, o_ptr, stride_om,
                       stride_og, dummy_ptr, nv_ptr, M, K, NG, M_PAD, NG_PAD, t % nm, t // nm,
                       SBM, SBK, GS, GB, GPP, BLOCK_M, ELEM_MAX, INV_M, EMAX, MBITS,
                       SCALE_KIND, FP32_RULE, FP32_POW2, E8_RULE, E8_LO, E8_HI, E8_NF,
                       AMAX_FLOOR, ZERO_BLOCK, NONFINITE, APPLY, SATURATE, ROUND,
                       DROP_NEG_ZERO, NAN_CODE, FILL_CODE, SF_LAYOUT, TWO_LEVEL, NV_ORDER,
                       DIV, E2M1_PTX, HW_SCALE, HW_DECODE)
            t += NPROG


LINE = 32  # int32 words per 128-byte line: counters and flags one per line
PART = 13  # the position of part_ptr in the kernel's arguments
_RESIDENT: dict = {}
RESIDENT_LOG: list = []  # what each new key of resident_programs found (the benchmark prints it)


def resident_programs(kernel, args, kw, dev: torch.device) -> int:
    """How many programs of this launch of ``kernel`` can be resident at once on ``dev``: the SM
    count times the driver's occupancy of the compiled kernel
    (``cuOccupancyMaxActiveBlocksPerMultiprocessor``: its registers, shared memory and warps).
    Cached per device, launch options and argument specialization (what selects the compiled
    kernel); the first call of a key compiles the kernel without launching it."""
    key = (dev.index, tuple(sorted(kw.items())), tuple(_arg_key(a) for a in args))
    n = _RESIDENT.get(key)
    if n is None:
        import ctypes

        compiled = kernel.warmup(*args, 1, grid=(1,), **kw)
        compiled._init_handles()
        per_sm = ctypes.c_int(0)
        err = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(per_sm), ctypes.c_void_p(compiled.function),
            ctypes.c_int(32 * compiled.metadata.num_warps), ctypes.c_size_t(compiled.metadata.shared))
        if err != 0 or per_sm.value < 1:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed (CUresult "
                               f"{err}, {per_sm.value} blocks per SM) for {compiled.name}")
        n = _RESIDENT[key] = per_sm.value * torch.cuda.get_device_properties(dev).multi_processor_count
        RESIDENT_LOG.append({"PHASE": kw.get("PHASE"), "BLOCK_M": kw["BLOCK_M"], "GPP": kw["GPP"],
                             "BMA": kw["BMA"], "BKA": kw["BKA"], "num_warps": kw["num_warps"],
                             "registers": compiled.n_regs, "spills": compiled.n_spills,
                             "shared": compiled.metadata.shared, "per_sm": per_sm.value,
                             "programs": n})
    return n


def launch(args, kw, tiles_a, tiles_d, amax_phase, tuning, dev) -> None:
    """Run :func:`_persistent_kernel` with :func:`fastpath.requant.fp8_block_to_fp4`'s arguments
    ``args`` (``part_ptr`` at :data:`PART`, a placeholder) and constexprs ``kw``: on a GPU one
    launch (``PHASE`` 0 with NVFP4's amax phase, cooperative; else ``PHASE`` 2 alone), under
    the interpreter ``PHASE`` 1 then 2 (with an amax phase) as two launches."""
    args = list(args)
    if dev.type != "cuda" or P._INTERPRETED:
        if amax_phase:
            n = tuning.programs or tiles_a
            args[PART] = alloc(n, dtype=torch.int32, device=dev)
            _persistent_kernel[(n,)](*args, n, PHASE=1, **kw)
        n = tuning.programs or tiles_d
        _persistent_kernel[(n,)](*args, n, PHASE=2, **kw)
        return
    phase, coop = (0, True) if amax_phase else (2, False)
    kw = dict(kw, PHASE=phase, launch_cooperative_grid=coop)
    most = resident_programs(_persistent_kernel, args, kw, dev)
    tiles = max(tiles_a if amax_phase else 0, tiles_d)
    n = tuning.programs or -(-tiles // -(-tiles // most))  # the fewest with the same trips
    if n > most:
        raise ValueError(f"RequantTuning.programs={n} exceeds the {most} programs that can be "
                         f"resident at once on {torch.cuda.get_device_name(dev)} (a persistent "
                         f"launch takes at most those: its grid barrier needs all resident)")
    n = min(n, tiles)
    if amax_phase:
        args[PART] = alloc(n, dtype=torch.int32, device=dev)
    _persistent_kernel[(n,)](*args, n, **kw)
