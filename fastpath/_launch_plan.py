"""Per-shape launch plans: a fast path's whole launch sequence replayed with new buffers (issue 20).

At decode sizes a dispatch call's host time is Python per launch (binding, keying) and torch ops per
buffer (allocations, views), not device work (docs/fastpaths-latency.md). A *plan* is recorded the
first time a call with a given key runs: the call's launches go through ``kernel[grid]`` as usual
(:func:`fastpath._host.launch_for_replay`) and each launch is stored as its compiled kernel, its grid
and its argument values, with every tensor argument rewritten as ``(base, byte offset)``: which of
the call's *bases* (the caller's input tensors and the call's own allocations) it lies in, and where.
A later call with the same key allocates its bases and replays the launches through
``CompiledKernel.run`` with plain integer addresses (``base.data_ptr() + offset``): no views, no
binding, no per-argument keying, no driver pointer query.

Why a replay runs what ``kernel[grid]`` would: the caller's key holds everything the launch sequence
depends on (shapes, dtypes, strides, 16-byte alignment of every input address, the scalar arguments,
the device, the module's tuning knobs), so the grids, scalars and constexprs are the same; the
offsets are the same, and a base is allocated 16-byte aligned (checked), so every address has the
alignment Triton specialised the compiled kernel on. A plan is not kept (the key is marked and runs
the ordinary way) where a tensor argument lies in no base or in more than one, or where
:func:`~fastpath._host.launch_for_replay` declines (the interpreter, launch hooks installed, the
launch cache off). Replays stop while launch hooks are installed or ``_host.LAUNCH_CACHE_ON`` is off.
"""
from __future__ import annotations

import threading

import torch

from . import _host

__all__ = ["Layout", "execute", "lookup", "recording"]

PLANS_ON = True  # False: every call the ordinary way, through fastpath._host.launch (A/B timing, debugging)
_PLANS: dict = {}
_NO_PLAN = "no plan"  # marker: this key runs the ordinary way
_TLS = threading.local()


_A = 4  # int32 elements per 16 bytes


class Layout:
    """One int32 workspace carved into sections, each 16-byte aligned: ``spec`` lists ``(name, int32
    count)`` (an int64 section counts two per element). ``outs`` lists ``(name, skip, count)``: the
    pieces a call returns, ``ws[off + skip : off + skip + count]`` of named sections in spec order;
    one ``ws.split(split_sizes)`` cuts all of them (``out_index``: their positions in the split)."""

    __slots__ = ("secs", "total", "split_sizes", "out_index")

    def __init__(self, spec, outs=()):
        self.secs, off = {}, 0
        for name, n in spec:
            self.secs[name] = (off, n)
            off += -(-n // _A) * _A
        self.total = max(off, _A)
        sizes, idx, pos = [], [], 0
        for name, skip, count in outs:
            start = self.secs[name][0] + skip
            if start < pos or skip + count > self.secs[name][1]:
                raise ValueError(f"output {name} out of order or out of its section")
            if start > pos:
                sizes.append(start - pos)
            idx.append(len(sizes))
            sizes.append(count)
            pos = start + count
        if self.total > pos:
            sizes.append(self.total - pos)
        self.split_sizes, self.out_index = sizes, tuple(idx)

    def outputs(self, ws: torch.Tensor) -> list[torch.Tensor]:
        pieces = ws.split_with_sizes(self.split_sizes)
        return [pieces[i] for i in self.out_index]

    def view(self, ws: torch.Tensor, name: str, dtype=torch.int32) -> torch.Tensor:
        off, n = self.secs[name]
        v = ws[off:off + n]
        return v if dtype == torch.int32 else v.view(dtype)


class Plan:
    __slots__ = ("layout", "steps", "nbases")

    def __init__(self, layout, steps, nbases):
        self.layout, self.steps, self.nbases = layout, steps, nbases

    def replay(self, bases, device: int) -> None:
        ptrs = [b.data_ptr() for b in bases]
        stream = _host._runtime()[1].active.get_current_stream(device)
        for compiled, g0, g1, g2, template, slots in self.steps:
            a = list(template)
            for pos, bi, off in slots:
                a[pos] = ptrs[bi] + off
            compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *a)


class _Recorder:
    def __init__(self, bases):
        self.ranges = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in bases]
        self.ok = all(lo % 16 == 0 and hi > lo for lo, hi in self.ranges)
        self.steps = []

    def launch(self, kernel, grid, args, kwargs) -> None:
        h = _host.launch_for_replay(kernel, grid, *args, **kwargs)
        if not self.ok:
            return
        if h is None:
            self.ok = False
            return
        compiled, tail = h
        vals = list(args) + list(tail)
        slots = []
        for i, a in enumerate(vals):
            if isinstance(a, torch.Tensor):
                p = a.data_ptr()
                hits = [j for j, (lo, hi) in enumerate(self.ranges) if lo <= p < hi]
                if len(hits) != 1:
                    self.ok = False
                    return
                slots.append((i, hits[0], p - self.ranges[hits[0]][0]))
                vals[i] = None
        g = tuple(grid) + (1, 1)
        self.steps.append((compiled, g[0], g[1], g[2], tuple(vals), tuple(slots)))


def recording():
    """The recorder of the call being recorded on this thread, or None."""
    return getattr(_TLS, "rec", None)


def _replayable() -> bool:
    return PLANS_ON and _host.LAUNCH_CACHE_ON and not _host._hooks_installed()


def lookup(key):
    """The plan of ``key`` if one is kept and replays may run now, else None."""
    if key is None:
        return None
    plan = _PLANS.get(key)
    if plan is None or plan is _NO_PLAN or not _replayable():
        return None
    return plan


def execute(key, plan, bases, device, launches, layout=None) -> None:
    """Run the call's launches: ``plan.replay(bases)`` where ``plan`` (from :func:`lookup`) is given;
    else ``launches()`` (the ordinary path, launching through :func:`fastpath._host.launch`), recorded
    into a plan for ``key`` where ``key`` is not None and has none yet."""
    if plan is not None:
        plan.replay(bases, device)
        return
    if key is None or key in _PLANS or not _replayable() or recording() is not None:
        launches()
        return
    rec = _Recorder(bases)
    _TLS.rec = rec
    try:
        launches()
    finally:
        _TLS.rec = None
    _PLANS[key] = Plan(layout, rec.steps, len(bases)) if rec.ok else _NO_PLAN
