"""The host side of :mod:`fastpath.dispatch`'s counting sort and row kernels: argument checks, the sort's
shapes and workspace sections, the launches of steps 1-6 (the module docstring of :mod:`fastpath.dispatch`
numbers them) and the row-kernel tiles. :mod:`fastpath.dispatch` builds its public functions from these;
nothing here is public API (``ROW_CONFIG``, ``CHUNK`` and ``SMALL_SORT_CHUNKS`` are re-exported there)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeref import _interop
from moeref.routing.expert_map import check_expert_map
from moeref.routing.ids import check_topk_ids

from ._dispatch_kernels import (
    _chunk_scan_kernel,
    _decode_capacity_kernel,
    _fill_kernel,
    _group_starts_kernel,
    _hist_kernel,
    _rank_kernel,
    _scatter_rows_kernel,
    _small_capacity_kernel,
    _small_sort_kernel,
)
from . import _launch_plan as _plan
from ._host import alloc, cdiv, launch, next_pow2
from ._launch_plan import Layout

CHUNK = 128
"""Slots per program of the counting sort (the rank step compares ``CHUNK x CHUNK`` keys)."""

SMALL_SORT_CHUNKS = 4
"""Up to this many chunks (``M * k <= 512`` slots: decode sizes), steps 1-3 run as one program
(``_small_sort_kernel``): two launches fewer, whose host cost dominates a decode-sized call (issue 20)."""

SMALL_CAPACITY_FUSED = False
"""Capacity layouts (masked, batched) built without a host sync, with no token rows to copy, at most
``SMALL_SORT_CHUNKS`` chunks and a capacity of at least ``M * k`` (no expert can overflow it): the sort, the
rank and the fill as one program (``_small_capacity_kernel``: one launch, one CUDA-graph node, instead of
three; the same device functions, the same outputs). Off by default until measured on a GPU
(``bench/studies/decode_graph_sweep.py`` times both)."""

DECODE_CAPACITY_SLOTS = 64
"""Capacity layouts (masked, batched) built without a host sync and with no token rows to copy, of at most this
many slots (8 tokens of top-8): built by ``_decode_capacity_kernel`` in one launch whose programs each hold every slot in registers (their keys, their ranks among the earlier slots of
their expert: an ``M*k x M*k`` comparison) and fill their own block of the ``[G, capacity]`` row -> slot list
from them, with one read of ``topk_ids`` and no scratch read back: against the three launches (or the one
program of :data:`SMALL_CAPACITY_FUSED`), each a chain of dependent memory round trips, the decode step's
dispatch is one short kernel. The outputs (``masked_m`` / ``expert_num_tokens``, ``src``, the slot -> row map)
are the same integers by definition (the reference's stable order), checked against the reference and the three
launches by ``tests/test_fastpath_small_capacity.py``. 0 turns it off. Takes precedence over
:data:`SMALL_CAPACITY_FUSED` where both apply."""

# Layout modes of _group_starts_kernel / _fill_kernel.
_PADDED = 0  # group g starts at the sum of round_up(count, PAD) of the groups before it
_CAPACITY = 1  # group g starts at g * CAP


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
def _launch(kernel, grid, *args, **kwargs):
    """:func:`fastpath._host.launch` (cached launch), skipped for an empty grid; while a launch plan
    is being recorded (:mod:`fastpath._launch_plan`), through its recorder."""
    if min(grid) > 0:
        rec = _plan.recording()
        if rec is None:
            launch(kernel, grid, *args, **kwargs)
        else:
            rec.launch(kernel, grid, args, kwargs)


def _tkey(t):
    """A tensor's part of a plan key: all its launches depend on (shape, strides, dtype, device,
    16-byte alignment of its address)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _cuda(*ts) -> bool:
    """Every tensor given (None skipped) a CUDA tensor: launch plans apply (not to CPU tensors, which
    run under the interpreter)."""
    return all(t is None or (isinstance(t, torch.Tensor) and t.is_cuda) for t in ts)


def _cuda_key(*parts):
    """A plan key (:mod:`fastpath._launch_plan`): ``parts`` plus the module's knobs and the current
    CUDA device (the last element)."""
    return parts + (SMALL_SORT_CHUNKS, SMALL_CAPACITY_FUSED, DECODE_CAPACITY_SLOTS, ROW_CONFIG["scatter"],
                    ROW_CONFIG["reduce"], ROW_CONFIG["reduce_decode"], REDUCE_DECODE_TOKENS,
                    torch.cuda.current_device())


def _ints(*xs) -> bool:
    return all(type(x) is int for x in xs)


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view (copies rows bit for bit: NaN payloads, fp8 codes, scales)."""
    return t.view(_INT_VIEW[t.element_size()])


def _check_int(x, name: str, ndim: int | None) -> torch.Tensor:
    if not torch.is_tensor(x):
        raise TypeError(f"{name} must be a torch tensor; got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64; got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(x.shape)}")
    return x


def _check_hidden(hidden, num_tokens: int, device) -> torch.Tensor:
    if not torch.is_tensor(hidden):
        raise TypeError(f"hidden must be a torch tensor or None; got {type(hidden).__name__}")
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be 2-D [M, K]; got shape {tuple(hidden.shape)}")
    if hidden.shape[0] != num_tokens:
        raise ValueError(f"hidden must have {num_tokens} rows (one per token); got shape {tuple(hidden.shape)}")
    if hidden.device != device:
        raise ValueError(f"hidden is on {hidden.device} but topk_ids is on {device}")
    if hidden.element_size() not in _INT_VIEW or hidden.is_complex():
        raise TypeError(f"hidden must be a real numeric tensor; got {hidden.dtype}")
    return hidden


@dataclass(frozen=True)
class _SortShape:
    """Sizes of the counting sort (steps 1-3) for ``n`` slots: ``G`` groups (local experts), ``NK``
    keys, ``C`` chunks; its int32 scratch sections (:meth:`spec`) live in the call's one workspace."""

    n: int
    E: int
    G: int
    NK: int
    NKP: int
    C: int
    use_map: bool
    want_psum: bool

    @classmethod
    def of(cls, n: int, num_experts: int, n_local: int, use_map: bool, want_psum: bool = False) -> "_SortShape":
        G = n_local if use_map else num_experts
        NK = G + num_experts + 1 if use_map else G + 1
        return cls(n, num_experts, G, NK, next_pow2(NK), max(1, cdiv(n, CHUNK)), use_map, want_psum)

    def spec(self, *first) -> list:
        """Workspace sections ``(name, int32 count)``: those named in ``first``, then the others."""
        n_g = max(self.G, 1)
        secs = {"totals": self.NKP, "meta": 3, "offsets": 2 * (self.G + 1), "psum": n_g if self.want_psum else 0,
                "base": self.C * self.NK, "starts": self.NKP, "ends": n_g}
        return [(f, secs[f]) for f in first] + [(f, c) for f, c in secs.items() if f not in first]


@dataclass
class _Sorted:
    """Device state of the counting sort (see the module docstring): views of the workspace."""

    ids: torch.Tensor  # flat int32/int64 [N]
    emap: torch.Tensor  # int32 [E] (dummy when unused)
    use_map: bool
    num_tokens: int
    top_k: int
    E: int
    G: int
    NK: int
    C: int
    base: torch.Tensor  # int32 [C * NK], chunk prefix per key
    totals: torch.Tensor  # int32 [NKP]
    starts: torch.Tensor  # int32 [NKP]
    ends: torch.Tensor  # int32 [max(G,1)]
    offsets: torch.Tensor  # int64 [G+1]
    meta: torch.Tensor  # int32 [3]: rows used, present slots, every group fits (capacity mode)
    psum: torch.Tensor | None

    @property
    def N(self) -> int:
        return self.num_tokens * self.top_k


def _prepare_map(expert_map, num_experts: int, device, validate: bool):
    """(int32 device map, number of local experts)."""
    if torch.is_tensor(expert_map):
        if validate:
            _, n_local = check_expert_map(_interop.to_numpy(expert_map), num_experts)
        else:
            if expert_map.ndim != 1 or expert_map.shape[0] != num_experts:
                raise ValueError(f"expert_map must have length num_experts={num_experts}; got shape {tuple(expert_map.shape)}")
            n_local = int((expert_map >= 0).sum().item())
        return expert_map.to(device=device, dtype=torch.int32).contiguous(), n_local
    emap, n_local = check_expert_map(np.asarray(expert_map), num_experts)
    return torch.from_numpy(np.ascontiguousarray(emap, dtype=np.int32)).to(device), n_local


def _prepare_ids(topk_ids, num_experts: int, validate: bool) -> torch.Tensor:
    _check_int(topk_ids, "topk_ids", 2)
    if validate:
        check_topk_ids(_interop.to_numpy(topk_ids), num_experts)
    return topk_ids


def _prepare_routing(topk_ids, num_experts: int, expert_map, hidden, validate: bool):
    """The argument checks the layouts share: ``(ids, device expert map or None, local experts)``
    (every expert local without a map), ``hidden`` checked against the ids' tokens and device."""
    topk_ids = _prepare_ids(topk_ids, num_experts, validate)
    emap, n_local = (None, num_experts) if expert_map is None else \
        _prepare_map(expert_map, num_experts, topk_ids.device, validate)
    if hidden is not None:
        _check_hidden(hidden, int(topk_ids.shape[0]), topk_ids.device)
    return topk_ids, emap, n_local


def _sorted(topk_ids, emap, ss: _SortShape, ws: torch.Tensor, lay: Layout) -> _Sorted:
    """The sort's views of the workspace ``ws`` (sections of ``lay``); no launch."""
    m, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    meta = lay.view(ws, "meta")
    return _Sorted(ids, meta if emap is None else emap, ss.use_map, m, k, ss.E, ss.G, ss.NK, ss.C,
                   lay.view(ws, "base"), lay.view(ws, "totals"), lay.view(ws, "starts"), lay.view(ws, "ends"),
                   lay.view(ws, "offsets", torch.int64), meta, lay.view(ws, "psum")[: ss.G] if ss.want_psum else None)


def _sort(topk_ids, emap, ss: _SortShape, ws: torch.Tensor, lay: Layout, *, mode: int = _PADDED, pad: int = 1,
          cap: int = 0) -> _Sorted:
    """Steps 1-3 of the counting sort into the workspace (keys by local expert through ``emap`` where
    ``ss.use_map``, else by global id)."""
    s = _sorted(topk_ids, emap, ss, ws, lay)
    psum = s.psum if ss.want_psum else s.meta
    if s.C <= SMALL_SORT_CHUNKS:
        _launch(_small_sort_kernel, (1,), s.ids, s.emap, s.base, s.totals, s.starts, s.ends, s.offsets, s.meta, psum,
                ss.n, ss.E, ss.G, ss.NK, ss.C, pad, cap, USE_MAP=ss.use_map, S=CHUNK, NKP=ss.NKP,
                MODE=mode, WRITE_PSUM=ss.want_psum)
    else:
        _launch(_hist_kernel, (s.C,), s.ids, s.emap, s.base, ss.n, ss.E, ss.G, ss.NK, USE_MAP=ss.use_map, S=CHUNK,
                NKP=ss.NKP)
        block_g = 32
        _launch(_chunk_scan_kernel, (cdiv(ss.NK, block_g),), s.base, s.totals, s.C, ss.NK, BLOCK_C=32, BLOCK_G=block_g)
        _launch(_group_starts_kernel, (1,), s.totals, s.starts, s.ends, s.offsets, s.meta, psum,
                ss.G, ss.NK, pad, cap, MODE=mode, WRITE_PSUM=ss.want_psum, NKP=ss.NKP)
    return s


def _capacity_fused(topk_ids, hidden, bound) -> bool:
    """Whether a capacity layout of these arguments is built in one launch: a capacity ``bound`` given (no host
    sync), no ``hidden`` rows, ``M * k > 0`` slots, and either at most :data:`DECODE_CAPACITY_SLOTS` slots
    (``_decode_capacity_kernel``; below ``M * k`` rows the caller checks the capacity on the device after it)
    or :data:`SMALL_CAPACITY_FUSED` on, at most ``bound`` slots (no expert can overflow) in at most
    ``SMALL_SORT_CHUNKS`` chunks (``_small_capacity_kernel``)."""
    if bound is None or hidden is not None or not torch.is_tensor(topk_ids):
        return False
    n = int(topk_ids.numel())
    if n <= 0:
        return False
    return n <= DECODE_CAPACITY_SLOTS or (SMALL_CAPACITY_FUSED and n <= bound
                                          and cdiv(n, CHUNK) <= SMALL_SORT_CHUNKS)


def _small_capacity(topk_ids, emap, ss: _SortShape, ws: torch.Tensor, lay: Layout, cap: int, dst, src) -> None:
    """Steps 1-5 of a capacity layout in one launch (:func:`_capacity_fused` holds): ``dst`` (slot -> row,
    -1 absent) and ``src`` (``[G, cap]`` row -> slot, -1 padding), the counts in the workspace; by
    ``_decode_capacity_kernel`` up to :data:`DECODE_CAPACITY_SLOTS` slots, else ``_small_capacity_kernel``."""
    s = _sorted(topk_ids, emap, ss, ws, lay)
    if ss.n <= DECODE_CAPACITY_SLOTS:
        n_pos = int(src.numel())
        np_ = max(16, next_pow2(ss.n))
        block_p = max(128, min(1024, 8192 // np_))  # a block_p x np_ comparison per program
        _launch(_decode_capacity_kernel, (cdiv(n_pos, block_p),), s.ids, s.emap, s.totals, s.meta, dst, src,
                ss.n, ss.E, ss.G, cap, n_pos, USE_MAP=ss.use_map, NP=np_, BLOCK_G=max(16, 2048 // np_),
                BLOCK_P=block_p)
        return
    _launch(_small_capacity_kernel, (1,), s.ids, s.emap, s.base, s.totals, s.starts, s.ends, s.offsets, s.meta,
            dst, src, ss.n, ss.E, ss.G, ss.NK, s.C, cap, int(src.numel()), USE_MAP=ss.use_map, S=CHUNK,
            NKP=ss.NKP, LOG_G=max(0, int(ss.G).bit_length()), BLOCK_P=1024)


def _sort_ws(topk_ids, emap, ss: _SortShape, device, **kw) -> _Sorted:
    """:func:`_sort` into a workspace of its own (the paths that size their outputs from the counts)."""
    lay = Layout(ss.spec())
    return _sort(topk_ids, emap, ss, _alloc(lay.total, torch.int32, device), lay, **kw)


def _rank(s: _Sorted, *, dst=None, dst_mode=0, lst=None, list_mode=0, grp=None, sentinel=0):
    dummy = s.meta
    _launch(_rank_kernel, (cdiv(s.N, CHUNK),), s.ids, s.emap, s.base, s.starts,
            dst if dst is not None else dummy, lst if lst is not None else dummy,
            grp if grp is not None else dummy, s.N, s.E, s.G, s.NK, sentinel,
            USE_MAP=s.use_map, S=CHUNK, DST_MODE=dst_mode, LIST_MODE=list_mode, WRITE_GRP=grp is not None)


def _fill(s: _Sorted, positions: int, *, mode=_PADDED, cap=0, lst=None, list_pad=0, grp=None,
          blk=None, block_size=1, label=None, rows=None):
    nblk = blk.numel() if blk is not None else 0
    span = max(positions, nblk)
    block_p = 128
    dummy = s.meta
    K = rows.shape[-1] if rows is not None else 0
    _launch(_fill_kernel, (cdiv(span, block_p),), s.starts, s.ends, s.totals, s.meta,
            label if label is not None else dummy,
            lst if lst is not None else dummy, grp if grp is not None else dummy,
            blk if blk is not None else dummy, rows if rows is not None else dummy,
            positions, nblk, s.G, cap, block_size, list_pad, K, K,
            MODE=mode, LOG_G=max(0, int(s.G).bit_length()), BLOCK_P=block_p,
            WRITE_LIST=lst is not None, WRITE_GRP=grp is not None, WRITE_BLK=blk is not None,
            HAS_LABEL=label is not None, ZERO_ROWS=rows is not None,
            BLOCK_K=min(256, next_pow2(max(K, 1))))


ROW_CONFIG: dict[str, tuple[int, int, int]] = {
    # kernel -> (BLOCK_T tokens, bytes of a row per program, num_warps) on the GPU, from the sweep
    # of bench/bench_dispatch_gpu.py --sweep on an H200 (2026-11-21): every configuration from
    # 2 KB to 16 KB per program and 4 to 16 warps was within 2% at 16384 x 7168 bf16, and
    # evict-first loads with streaming (.cs) stores were 2% slower, so they are not used. Under the
    # interpreter a program costs ~ms whatever its size: BLOCK_T 32, whole rows up to 256 elements.
    "scatter": (1, 8192, 8),
    "reduce": (1, 8192, 8),
    # the reduce of at most REDUCE_DECODE_TOKENS tokens: at 1 token x 7168 the 8 KB tile above is 2 programs,
    # each reading 8 rows of 4096 elements on one SM; 1 KB (512 bf16 columns) on 2 warps is 14 programs
    "reduce_decode": (1, 1024, 2),
}

REDUCE_DECODE_TOKENS = 16
"""Up to this many tokens the weighted reduce takes ``ROW_CONFIG["reduce_decode"]`` (more, smaller column
blocks: at decode sizes the kernel's time is its latency, spread over more SMs); 0: always ``"reduce"``. Each
output element's sum is the same operations in the same order with any tile (``_reduce_kernel``): the same
bits."""



def _interpreting() -> bool:
    return _interop.triton_interpreted()


def _row_config(kind: str, K: int, elem: int, rows: int | None = None):
    """(BLOCK_T, BLOCK_K, num_warps) for the row kernels (the reduce of at most :data:`REDUCE_DECODE_TOKENS`
    ``rows``: ``ROW_CONFIG["reduce_decode"]``)."""
    if _interpreting():
        return 32, min(next_pow2(max(K, 1)), 256), 4
    if kind == "reduce" and rows is not None and rows <= REDUCE_DECODE_TOKENS:
        kind = "reduce_decode"
    bt, row_bytes, nw = ROW_CONFIG[kind]
    return bt, min(next_pow2(max(K, 1)), max(16, row_bytes // elem)), nw


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Every buffer the kernels write (outputs and scratch): :func:`fastpath._host.alloc`, the one
    allocator the tests poison (:func:`fastpath.testing.poisoned`)."""
    return alloc(shape, dtype=dtype, device=device)


def _full(shape, value, dtype, device) -> torch.Tensor:
    """A buffer filled with ``value`` on the host side (``torch.full``; the tests swap it)."""
    return torch.full(shape if isinstance(shape, tuple) else (shape,), value, dtype=dtype, device=device)


def _scatter_rows(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor, top_k: int, nvalid=None):
    m, K = x.shape
    xb, ob = _bits(x), _bits(out)
    bt, bk, nw = _row_config("scatter", K, x.element_size())
    _launch(_scatter_rows_kernel, (cdiv(m, bt), cdiv(K, bk)), xb, dst, ob,
            nvalid if nvalid is not None else dst, m, K, xb.stride(0), xb.stride(1), K,
            TOPK=top_k, BLOCK_T=bt, BLOCK_K=bk, ZERO_ABSENT=nvalid is not None, num_warps=nw)
