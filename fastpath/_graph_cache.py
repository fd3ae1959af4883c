"""Per-shape CUDA graphs of eager calls: the graph cache of :func:`fastpath.moe.fused_moe` (issue 33).

At decode sizes an eager call of the MoE layer is host-bound: Python and torch work per launch and per
buffer cost about ten times the GPU's work (docs/moe-gpu.md, "Eager calls at decode sizes"). The cache
records the call once per *key* as a CUDA graph of its capturable form and replays it: the inputs are
copied into the graph's own input buffers, the graph is launched, and its output is copied into a fresh
tensor that the call returns. One graph launch and four small copies replace the call's launches,
allocations and checks.

What this module holds is the bookkeeping, with no CUDA in it (so the CPU tests run it):

* :func:`weights_signature`: a weights object's part of the key: its identity and, for every tensor it
  holds (nested dataclasses included), the address, shape, strides and dtype; its other fields by value.
  A tensor written in place keeps the signature (the graph reads the same addresses, so a replay sees the
  new values, as the eager call does); a new object, or a tensor re-bound to other memory, is a new key.
* :class:`GraphCache`: the entries, least recently used first, at most ``size`` (0: the cache is off). A
  key is captured on its ``capture_after``-th call (default the second: one-off shapes, such as tests
  that draw a new layer per call, never pay a capture). An entry keeps weak references to the weights
  objects of its key: when one is collected its entries go (its graph would read freed memory), and a
  hit checks that the objects are the ones the key names (an id can be reused after collection). A key
  whose capture failed is not tried again (:meth:`GraphCache.fail`; the reason is in :meth:`info`).
  The cache's ``lock`` guards its dictionaries and serialises a replay's copy-in, launch and copy-out, so
  two threads sharing one entry do not interleave their inputs.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict

__all__ = ["GraphCache", "GraphEntry", "weights_signature"]

_FIELDS: dict = {}  # dataclass type -> its field names
_PLAIN = frozenset((str, int, float, bool, type(None)))


def weights_signature(obj) -> tuple | None:
    """``(id(obj), per field: (data_ptr, shape, strides, dtype) of a tensor | the signature of a nested
    dataclass | the value)`` of a dataclass of tensors (:class:`fastpath.moe.FastMoEWeights`,
    :class:`fastpath.grouped_gemm_w4.W4Experts`); None for None. ``TypeError`` for an object that is not a
    dataclass instance."""
    if obj is None:
        return None
    t = type(obj)
    names = _FIELDS.get(t)
    if names is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"weights_signature takes a dataclass of tensors; got {t.__name__}")
        names = _FIELDS[t] = tuple(f.name for f in dataclasses.fields(obj))
    out = [id(obj)]
    for n in names:
        v = getattr(obj, n)
        if type(v) in _PLAIN:
            out.append(v)
        elif hasattr(v, "data_ptr") and hasattr(v, "stride"):
            out.append((v.data_ptr(), v.shape, v.stride(), v.dtype))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out.append(weights_signature(v))
        else:
            out.append(v)
    return tuple(out)


class GraphEntry:
    """One captured call: ``graph`` (a ``torch.cuda.CUDAGraph``, or anything with ``replay()``), its input
    buffers ``inputs`` (the call's inputs are copied into them), its ``output`` (rewritten by each replay),
    and ``extra`` (what the caller needs per hit, e.g. the resolved expert count)."""

    __slots__ = ("graph", "inputs", "output", "extra", "refs")

    def __init__(self, graph, inputs, output, extra=None):
        self.graph, self.inputs, self.output, self.extra = graph, tuple(inputs), output, extra
        self.refs = ()


class GraphCache:
    """LRU cache of :class:`GraphEntry` by key (module docstring)."""

    def __init__(self, size: int = 16, capture_after: int = 2):
        self.size = int(size)
        self.capture_after = int(capture_after)
        self.lock = threading.RLock()
        self._entries: OrderedDict = OrderedDict()
        self._seen: OrderedDict = OrderedDict()  # key -> calls so far, for keys not (yet) captured
        self._failed: dict = {}  # key -> why its capture failed
        self.hits = self.misses = self.captures = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key, objs=()) -> GraphEntry | None:
        """The entry of ``key`` (now the most recently used), or None (a miss). ``objs``: the weights
        objects the key names, in the order given to :meth:`put`; an entry whose objects are not these
        (collected, their ids reused) is dropped and the call is a miss."""
        with self.lock:
            e = self._entries.get(key)
            if e is not None and (len(e.refs) != len(objs) or any(r() is not o for r, o in zip(e.refs, objs))):
                self._entries.pop(key, None)
                e = None
            if e is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return e

    def want_capture(self, key) -> bool:
        """Count one uncached call of ``key``: True when this call should capture it (its
        ``capture_after``-th call; never for a key whose capture failed, or with ``size`` 0)."""
        with self.lock:
            if self.size <= 0 or key in self._failed:
                return False
            n = self._seen.pop(key, 0) + 1
            if n >= self.capture_after:
                return True
            self._seen[key] = n
            while len(self._seen) > max(64, 4 * self.size):
                self._seen.popitem(last=False)
            return False

    def put(self, key, entry: GraphEntry, objs=()) -> None:
        """Store ``entry`` under ``key``, weakly referencing ``objs`` (``TypeError`` if one cannot be
        weakly referenced; nothing is stored then); evict the least recently used beyond ``size``."""
        entry.refs = tuple(weakref.ref(o, self._dropper(key)) for o in objs)
        with self.lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            self._seen.pop(key, None)
            self.captures += 1
            while len(self._entries) > max(self.size, 0):
                self._entries.popitem(last=False)
                self.evictions += 1

    def _dropper(self, key):
        me = weakref.ref(self)

        def drop(_ref):  # a weights object of the key was collected: its graph would read freed memory
            cache = me()
            if cache is not None:
                cache._entries.pop(key, None)
        return drop

    def fail(self, key, reason: str) -> None:
        """Record that capturing ``key`` failed (it is not tried again; :meth:`info` gives the reason)."""
        with self.lock:
            self._seen.pop(key, None)
            if len(self._failed) >= 256:
                self._failed.clear()
            self._failed[key] = reason

    def clear(self) -> None:
        """Drop every entry (their graphs and memory), the call counts and the failure records."""
        with self.lock:
            self._entries.clear()
            self._seen.clear()
            self._failed.clear()

    def info(self) -> dict:
        """``entries``, ``size``, ``hits``, ``misses``, ``captures``, ``evictions`` and ``failures`` (the
        reasons of the failed captures)."""
        return dict(entries=len(self._entries), size=self.size, hits=self.hits, misses=self.misses,
                    captures=self.captures, evictions=self.evictions, failures=list(self._failed.values()))
