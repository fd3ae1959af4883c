"""Host-side helpers shared by the fast paths (no kernels here).

* :func:`alloc`: every buffer a fast-path kernel writes (outputs and scratch) comes from here,
  uninitialized (``torch.empty``). It is the one hook the tests use to poison those buffers:
  :func:`fastpath.testing.poisoned` swaps :data:`_ALLOCATOR` for an allocator that fills each buffer
  with a poison byte, so an element no kernel wrote is caught by the comparison with the reference.
* :func:`launch`: ``kernel[grid](...)`` through a per-launch-key cache of compiled kernels (the
  host cost of a decode-sized call; see the comment above it).
* :func:`pdl_available`, :func:`pdl_launch`: whether a launch may use Programmatic Dependent Launch here,
  and the launch arguments of a kernel that takes it.
* :func:`next_pow2`, :func:`cdiv`: launch-size arithmetic in plain Python (``triton.cdiv`` is a
  constexpr function: called from host code it unwraps its arguments first, about a microsecond
  per call, and a decode-sized call makes several; issue 20).
"""
from __future__ import annotations

import torch

__all__ = ["alloc", "cdiv", "launch", "next_pow2", "pdl_available", "pdl_launch"]

_ALLOCATOR = torch.empty


def alloc(*shape, **kw) -> torch.Tensor:
    """``torch.empty(*shape, **kw)`` through the swappable :data:`_ALLOCATOR`."""
    return _ALLOCATOR(*shape, **kw)


def pdl_available(dev: torch.device) -> bool:
    """Whether Programmatic Dependent Launch (Triton's ``launch_pdl``, ``griddepcontrol`` in the kernels) runs
    here: a CUDA device of compute capability 9.0 or newer (``griddepcontrol`` is sm_90's), not Triton's
    interpreter (which runs no inline asm)."""
    from moeref._interop import triton_interpreted

    return dev.type == "cuda" and not triton_interpreted() and torch.cuda.get_device_capability(dev)[0] >= 9


def pdl_launch(dev: torch.device, on: bool) -> dict:
    """The launch arguments of a kernel with a ``GDC_WAIT`` constexpr (the decode stages of :mod:`fastpath.moe`:
    the grouped GEMM, the fused act+quant kernel, the reduce) launched with Programmatic Dependent Launch:
    ``launch_pdl`` and ``GDC_WAIT`` where ``on`` and :func:`pdl_available`, else ``GDC_WAIT=False`` (every
    argument of the kernel given: what the launch plans' replay records). Such a kernel's programs
    first let the kernel after them launch (``griddepcontrol.launch_dependents``: it may then start, and waits
    itself) and wait for the kernel before them to complete (``griddepcontrol.wait``) before any load: what
    they compute is unchanged."""
    return {"GDC_WAIT": True, "launch_pdl": True} if on and pdl_available(dev) else {"GDC_WAIT": False}


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


# ------------------------------------------------------------------------------------ launches
# ``kernel[grid](*args, **kw)`` costs tens of microseconds of host time per launch in Triton 3.6
# (binding and specializing every argument, hashing the cache key, knob and hook look-ups, launch
# metadata): at decode sizes that is most of a fast path's time (issue 20, docs/fastpaths-latency.md).
# :func:`launch` keeps, per kernel, the compiled kernel of each *launch key* and launches it through
# its ``CompiledKernel.run`` directly. The key is at least as fine as Triton's own specialization:
# every constexpr and launch option by value; a tensor by dtype and 16-byte alignment of its
# address; an int by (== 1, divisible by 16, fits int32, fits int64); other arguments by type. Two
# calls with the same key are given the same compiled kernel by Triton, so the cached launch runs
# what ``kernel[grid]`` would. The first call of each key goes through ``kernel[grid]`` (compiling
# if needed). Under the interpreter, with launch hooks installed (profilers), pre-run hooks, or an
# argument of a type the key does not know, every call goes through ``kernel[grid]``.

_LAUNCH_CACHE: dict = {}
_CONSTEXPR_POS: dict = {}
LAUNCH_CACHE_ON = True  # False: every launch through kernel[grid] (A/B timing, debugging)


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    t = type(a)
    if t is int:
        return (int, a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), -(1 << 63) <= a < (1 << 63))
    if t is float or t is bool or a is None:
        return t
    raise TypeError(t)


def _kernel_info(kernel):
    """(positions of constexpr parameters, names of runtime parameters) of a ``@triton.jit`` kernel."""
    info = _CONSTEXPR_POS.get(kernel)
    if info is None:
        info = _CONSTEXPR_POS[kernel] = (
            frozenset(i for i, p in enumerate(kernel.params) if p.is_constexpr),
            frozenset(p.name for p in kernel.params if not p.is_constexpr))
    return info


def _launch_key(kernel, args, kwargs):
    pos, runtime_names = _kernel_info(kernel)
    if not runtime_names.isdisjoint(kwargs):
        raise TypeError("a runtime argument given by name")  # keyed by value it would pin tensors
    return (kernel, torch.cuda.current_device(),
            tuple([("c", a) if i in pos else _arg_key(a) for i, a in enumerate(args)]),
            tuple(kwargs.items()))


_RUNTIME = []  # [triton.knobs.runtime, triton.runtime.driver], imported on first use


def _runtime():
    if not _RUNTIME:
        from triton import knobs
        from triton.runtime import driver

        _RUNTIME.extend((knobs.runtime, driver))
    return _RUNTIME


def _hooks_installed() -> bool:
    r = _runtime()[0]
    return bool(getattr(r.launch_enter_hook, "calls", r.launch_enter_hook)) or \
        bool(getattr(r.launch_exit_hook, "calls", r.launch_exit_hook))


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, through the per-key cache of compiled kernels (above)."""
    if not LAUNCH_CACHE_ON or not hasattr(kernel, "device_caches") or getattr(kernel, "pre_run_hooks", None) \
            or callable(grid):
        kernel[grid](*args, **kwargs)  # the interpreter's kernels have no device caches
        return
    try:
        key = _launch_key(kernel, args, kwargs)
        hit = _LAUNCH_CACHE.get(key)
    except TypeError:  # an argument the key does not know, a runtime one by name, an unhashable constexpr
        kernel[grid](*args, **kwargs)
        return
    if hit is None or _hooks_installed():
        got = launch_for_replay(kernel, grid, *args, **kwargs)  # launches now
        if got is not None:
            _LAUNCH_CACHE[key] = got
        return
    compiled, tail = hit
    g = tuple(grid) + (1, 1)
    stream = _runtime()[1].active.get_current_stream(key[1])
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)


def launch_for_replay(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` (it launches now), returning ``(compiled kernel, values of the
    parameters after args)``: what replays the same launch through ``CompiledKernel.run`` (a per-shape
    launch plan, :mod:`fastpath._launch_plan`); None where no replay is possible: the cache off, the
    interpreter, launch or pre-run hooks installed, a callable grid."""
    if not LAUNCH_CACHE_ON or not hasattr(kernel, "device_caches") or getattr(kernel, "pre_run_hooks", None) \
            or callable(grid) or _hooks_installed():
        kernel[grid](*args, **kwargs)
        return None
    compiled = kernel[grid](*args, **kwargs)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    if compiled is None:
        return None
    names = [p.name for p in kernel.params]
    return compiled, tuple(kwargs[n] if n in kwargs else p.default
                           for n, p in zip(names[len(args):], kernel.params[len(args):]))


# ------------------------------------------------------------------------------- planned launches
# A fast path's per-call *plan* (issue 20) fixes a launch's grid, constexprs, options and every
# non-tensor argument for one (shape, dtype, strides, layout, device, options) key; only some tensor
# arguments change from call to call. :class:`PlannedLaunch` is such a launch: its first call goes
# through ``kernel[grid]`` (compiling if needed) and keeps the compiled kernel; later calls launch it
# through ``CompiledKernel.run`` after O(1) checks (launch cache on, no launch hooks, same current
# device, the per-call tensors' 16-byte alignment unchanged), with no argument binding or key hashing.
# That runs what ``kernel[grid]`` would: every argument Triton specializes on is fixed by the plan
# except the per-call tensors, whose dtypes the plan's key fixes and whose alignment is checked.
# :func:`launch` above is unchanged (its API is kept for the dispatch fast paths).

SLOT = object()  # placeholder of a per-call tensor argument in a PlannedLaunch's arguments


class PlannedLaunch:
    """``kernel[grid](*args, **kwargs)`` with the arguments that are :data:`SLOT` given per call:
    ``p(t0, t1, ...)`` fills the slots in order (see the comment above)."""

    __slots__ = ("kernel", "grid", "args", "kwargs", "slots", "_hit")

    def __init__(self, kernel, grid, *args, **kwargs):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.args = list(args)
        self.kwargs = kwargs
        self.slots = tuple(i for i, a in enumerate(args) if a is SLOT)
        self._hit = None  # (compiled, device, alignments of the slot tensors, tail, grid3)

    def __call__(self, *tensors) -> None:
        a = self.args.copy()
        for i, t in zip(self.slots, tensors):
            a[i] = t
        hit = self._hit
        if hit is not None and LAUNCH_CACHE_ON:
            compiled, dev, align, tail, g = hit
            if dev == torch.cuda.current_device() and align == tuple(t.data_ptr() % 16 == 0 for t in tensors) \
                    and not _hooks_installed():
                compiled.run(g[0], g[1], g[2], _runtime()[1].active.get_current_stream(dev), compiled.function,
                             compiled.packed_metadata, None, None, None, *a, *tail)
                return
        self._first(a, tensors)

    def _first(self, a, tensors) -> None:
        got = launch_for_replay(self.kernel, self.grid, *a, **self.kwargs)  # launches now, whatever it returns
        if got is None:  # no replay possible (the interpreter, hooks, the cache off): kernel[grid] each time
            return
        compiled, tail = got
        self._hit = (compiled, torch.cuda.current_device(), tuple(t.data_ptr() % 16 == 0 for t in tensors),
                     tail, self.grid + (1,) * (3 - len(self.grid)))
