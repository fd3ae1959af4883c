"""Token dispatch on the GPU (Triton): the fast paths of :mod:`moeref.dispatch`, same signatures and results.

Every function here takes and returns torch tensors (CUDA; CPU tensors under ``TRITON_INTERPRET=1``)
and returns the reference's own result classes (:class:`moeref.dispatch.AlignResult`,
:class:`~moeref.dispatch.Permuted`, :class:`~moeref.dispatch.Contiguous`,
:class:`~moeref.dispatch.Masked`, :class:`~moeref.dispatch.Batched`) holding torch tensors. The
results are **bit for bit those of the reference**, order within an expert included: the kernels
implement the reference's one stable sort (``moeref.dispatch.grouping``: slots ``t*k + j`` by
``(local expert, src)``, absent slots after) as a deterministic counting sort, with no atomics:

1. ``_hist_kernel``: the slots are cut into chunks of ``CHUNK`` consecutive slots; one program per
   chunk computes each slot's *key* (its local expert; absent slots get keys after every expert:
   non-local experts by global id, then padding, the golden's order) and the chunk's key histogram.
2. ``_chunk_scan_kernel``: per key, the exclusive prefix sum of the histogram over chunks (how many
   slots with that key precede the chunk), in place, and the key totals (expert counts).
3. ``_group_starts_kernel``: one program turns the totals into each group's first row in the
   layout (unpadded offsets, block- or alignment-padded starts, or ``g * capacity``) and writes the
   layout's metadata (``expert_first_token_offset``, ``num_tokens_post_padded``, ``psum``).
   Up to ``SMALL_SORT_CHUNKS`` chunks (decode sizes), ``_small_sort_kernel`` does steps 1-3 in one
   program, chunk after chunk: the same outputs, one launch instead of three. A capacity layout (masked,
   batched) without token rows and without a host sync, of at most ``DECODE_CAPACITY_SLOTS`` slots (the
   decode step), skips steps 1-5: ``_decode_capacity_kernel`` ranks every slot in registers and each of its
   programs fills its block of the layout from them (one launch, the same outputs).
4. ``_rank_kernel``: one program per chunk gives each slot its rank among the equal-key slots of
   the chunk (a ``CHUNK x CHUNK`` comparison), adds the chunk's prefix and the group's start, and
   writes the slot -> row map (``inv_permuted_idx``) and the row -> slot lists (``sorted_token_ids``,
   ``permuted_idx``, ``src``, ``m_indices``). The rank is the reference's stable order exactly.
5. ``_fill_kernel``: every padding position of a padded layout (align blocks, DeepGEMM alignment,
   masked/batched capacity) gets the sentinel / ``-1`` / zero row, and ``expert_ids`` one label per
   block; with step 4 every output element is written exactly once (no memset needed).
6. ``_scatter_rows_kernel``: data movement, one pass: each token row is read once and written to
   its ``k`` destination rows (bit copies through an integer view: bf16, fp8 codes, scales alike;
   any row stride of ``hidden``; int64 addressing).
7. ``_reduce_kernel``: unpermute-and-reduce / weight-and-reduce: ``out[t] = sum_j w[t,j] *
   row(t*k+j)`` accumulated in float32 in slot order ``j = 0..k-1``; absent slots contribute 0
   whatever their rows hold (masked loads, never ``0 * row``).

Contracts, sources and the meaning of every field: the reference modules
(:mod:`moeref.dispatch.align`, ``.permute``, ``.contiguous``, ``.masked``, ``.batched``,
``.finalize``). Differences, all documented per function:

* ``validate=True`` (default) checks ``topk_ids`` and ``expert_map`` with the reference validators
  on a CPU copy (one device sync); pass ``validate=False`` on hot paths. Invalid ids with
  ``validate=False`` are undefined behaviour (as in vLLM's kernels).
* An ``expert_map`` given as a device tensor costs one sync to count its local experts; pass it as a
  NumPy array or list to avoid it (it is then uploaded).
* ``to_contiguous`` with ``m_sum=None``/"tight" or an int, ``to_masked`` and ``to_batched`` (with
  ``validate=True``) need the expert counts on the host (buffer sizes / capacity check): one sync
  each, as in the reference's API. Sync-free, capturable in a CUDA graph: ``m_sum="worst_case"``,
  ``to_masked(..., expected_m=n)`` with ``max_m >= M``, ``to_batched(..., validate=False)``
  (an overflow, possible only where a token repeats an expert, is then a device-side check).
* Float outputs of the reductions are float32 sums (the reference sums in float64): they agree
  within ``gamma_k * sum_j |w_j x_j|`` plus the output rounding (``property_tests`` prove it).
* Small metadata results (``num_tokens_post_padded``, ``psum``, ``masked_m``,
  ``expert_num_tokens``, :func:`expert_counts`) and the int32/int64 index outputs are views into one
  int32 workspace per call (16-byte-aligned sections, cut by one ``split``), which also holds the
  sort's scratch: one allocation instead of up to six (issue 20: each torch op costs microseconds).
* Host cost at decode sizes (issue 20): a call whose launches do not depend on the data (every
  sync-free path, ``expert_map=None``, CUDA tensors) keeps a *launch plan* per key (shapes,
  strides, dtypes, 16-byte alignment of the inputs, the scalar arguments, the device): the first
  call checks its arguments, computes the layout and launches through ``kernel[grid]``; later calls
  with the same key skip the checks the key already answers (``validate=True`` still checks the
  data) and replay the launches through ``CompiledKernel.run`` with computed addresses
  (:mod:`fastpath._launch_plan`). Results are the same bytes (``tests/test_fastpath_launch_plan*.py``).
* :func:`expert_counts` (int32 slots per local expert) has no reference function of that name: the
  reference is ``moeref.dispatch.group_slots(...).counts``.

Registry: :mod:`fastpath.registry` lists these operations (``DISPATCH_OPERATIONS``) with the
reference and this module's implementation; :func:`supports` is the Triton entries' predicate.

Proof: ``property_tests/test_fastpath_dispatch.py`` (Hypothesis routings incl. empty experts,
all-to-one, EP maps, -1 padding; outputs poisoned before each run). Speed: ``bench/bench_dispatch_gpu.py``;
``docs/fastpaths-dispatch.md``.
"""
from __future__ import annotations

import numpy as np
import torch

from moeref._checks import check_positive_int
from moeref.dispatch.align import AlignResult, max_num_tokens_padded
from moeref.dispatch.batched import Batched
from moeref.dispatch.contiguous import Contiguous, contiguous_m_sum
from moeref.dispatch.masked import Masked
from moeref.dispatch.permute import Permuted

from ._dispatch_finalize import (  # noqa: F401 (_reduce: the layer's reduce into its own buffers)
    _reduce,
    apply_router_weight_on_input,
    moe_unpermute,
    weight_and_reduce,
)
from ._dispatch_kernels import _group_starts_kernel
from ._dispatch_sort import (  # noqa: F401 (CHUNK, SMALL_SORT_CHUNKS, ROW_CONFIG: public names of this module)
    _CAPACITY,
    _INT_VIEW,
    _PADDED,
    CHUNK,
    ROW_CONFIG,
    SMALL_SORT_CHUNKS,
    _alloc,
    _bits,
    _check_int,
    _cuda,
    _cuda_key,
    _fill,
    _interpreting,
    _ints,
    _launch,
    _prepare_ids,
    _prepare_map,
    _prepare_routing,
    _rank,
    _scatter_rows,
    _sort,
    _sort_ws,
    _sorted,
    _SortShape,
    _Sorted,
    _tkey,
)
from . import _dispatch_sort as _sort_host  # its knobs read at call time (SMALL_CAPACITY_FUSED)
from . import _launch_plan as _plan
from ._host import cdiv
from ._launch_plan import Layout

__all__ = [
    "OPERATIONS",
    "ROW_CONFIG",
    "apply_router_weight_on_input",
    "expert_counts",
    "expert_first_token_offset",
    "moe_align_block_size",
    "moe_permute",
    "moe_unpermute",
    "supports",
    "to_batched",
    "to_contiguous",
    "to_masked",
    "weight_and_reduce",
]

# ----------------------------------------------------------------------------------------------
# Public API (same signatures as moeref.dispatch, plus validate=)
# ----------------------------------------------------------------------------------------------
def moe_align_block_size(topk_ids, block_size: int, num_experts: int, expert_map=None,
                         pad_sorted_ids: bool = False, ignore_invalid_experts: bool = False,
                         *, validate: bool = True) -> AlignResult:
    """vLLM ``moe_align_block_size`` on the GPU; contract: :func:`moeref.dispatch.moe_align_block_size`.

    Returns :class:`~moeref.dispatch.AlignResult` of torch tensors: ``sorted_token_ids`` int32
    ``[max_num_tokens_padded]`` (sentinel ``M*k``), ``expert_ids`` int32 (``-1`` for unused and
    non-local blocks), ``num_tokens_post_padded`` int32 ``[1]`` (a view of a device buffer). The
    order within an expert is ascending ``t*k+j``, as in the reference (vLLM's CUDA kernel leaves it
    unspecified).
    """
    key = None
    if expert_map is None and _ints(block_size, num_experts) and _cuda(topk_ids):
        key = _cuda_key("align", _tkey(topk_ids), block_size, num_experts, bool(pad_sorted_ids),
                        bool(ignore_invalid_experts))
    plan = _plan.lookup(key)
    emap = label = ss = None
    if plan is None:
        block_size = check_positive_int(block_size, "block_size")
        num_experts = check_positive_int(num_experts, "num_experts")
        if ignore_invalid_experts and expert_map is None:
            raise ValueError("ignore_invalid_experts=True needs an expert_map")
        topk_ids = _prepare_ids(topk_ids, num_experts, validate)
        emap, n_local = (None, 0) if expert_map is None else _prepare_map(expert_map, num_experts, topk_ids.device, validate)
        n = topk_ids.numel()
        size = max_num_tokens_padded(n, num_experts, block_size, pad_sorted_ids)
        nblk = cdiv(size, block_size)
        ss = _SortShape.of(n, num_experts, n_local if ignore_invalid_experts else num_experts, ignore_invalid_experts)
        lay = Layout([("sorted", size), ("blk", nblk), *ss.spec("meta")],
                     outs=[("sorted", 0, size), ("blk", 0, nblk), ("meta", 0, 1)])
        label = emap if (emap is not None and not ignore_invalid_experts) else None
        layout = (lay, size)
    else:
        if validate:
            _prepare_ids(topk_ids, num_experts, validate)
        lay, size = layout = plan.layout
        n = topk_ids.numel()
    ws = _alloc(lay.total, torch.int32, topk_ids.device)
    sorted_ids, expert_ids, post = lay.outputs(ws)

    def launches():
        s = _sort(topk_ids, emap if ignore_invalid_experts else None, ss, ws, lay, pad=block_size)
        _rank(s, lst=sorted_ids, list_mode=1)
        _fill(s, size, lst=sorted_ids, list_pad=n, blk=expert_ids, block_size=block_size, label=label)
    _plan.execute(key, plan, (topk_ids, ws), key and key[-1], launches, layout)
    return AlignResult(sorted_ids, expert_ids, post, n, block_size)


def _sort_only(kind, topk_ids, num_experts, emap_in, n_global, validate, first, outs_of):
    """Shared by :func:`expert_counts` and :func:`expert_first_token_offset`: the sort alone, its
    outputs cut from the workspace (``outs_of(ss)``)."""
    key = None
    if emap_in is None and _ints(num_experts) and _cuda(topk_ids):
        key = _cuda_key(kind, _tkey(topk_ids), num_experts)
    plan = _plan.lookup(key)
    emap = ss = None
    if plan is None:
        topk_ids = _prepare_ids(topk_ids, n_global, validate)
        emap, n_local = (None, n_global) if emap_in is None else _prepare_map(emap_in, n_global, topk_ids.device, validate)
        ss = _SortShape.of(topk_ids.numel(), n_global, n_local, emap is not None)
        lay = Layout(ss.spec(first), outs=[(first, 0, outs_of(ss))])
    else:
        if validate:
            _prepare_ids(topk_ids, n_global, validate)
        lay = plan.layout
    ws = _alloc(lay.total, torch.int32, topk_ids.device)
    (out,) = lay.outputs(ws)
    _plan.execute(key, plan, (topk_ids, ws), key and key[-1], lambda: _sort(topk_ids, emap, ss, ws, lay), lay)
    return out, (ss.G if ss is not None else None)


def expert_first_token_offset(topk_ids, num_local_experts: int, expert_map=None, *, num_experts=None,
                              validate: bool = True) -> torch.Tensor:
    """int64 ``[E_local+1]`` offsets of the permuted layout (no padding); contract:
    :func:`moeref.dispatch.expert_first_token_offset`."""
    if expert_map is None:
        if not _ints(num_local_experts):
            num_local_experts = check_positive_int(num_local_experts, "num_local_experts")
        elif num_local_experts <= 0:
            check_positive_int(num_local_experts, "num_local_experts")
        n_global = num_local_experts
    else:
        num_local_experts = check_positive_int(num_local_experts, "num_local_experts", allow_zero=True)
        n_global = int(expert_map.shape[0]) if num_experts is None else check_positive_int(num_experts, "num_experts")
    out, G = _sort_only("offsets", topk_ids, n_global, expert_map, n_global, validate, "offsets",
                        lambda ss: 2 * (ss.G + 1))
    if G is not None and G != num_local_experts:
        raise ValueError(f"num_local_experts={num_local_experts} but expert_map has {G} local experts")
    return out.view(torch.int64)


def expert_counts(topk_ids, num_experts: int, expert_map=None, *, validate: bool = True) -> torch.Tensor:
    """int32 ``[E_local]``: slots per local expert (padding and non-local slots not counted); the
    reference is ``moeref.dispatch.group_slots(...).counts``."""
    if not _ints(num_experts) or num_experts <= 0:
        num_experts = check_positive_int(num_experts, "num_experts")
    return _sort_only("counts", topk_ids, num_experts, expert_map, num_experts, validate, "totals",
                      lambda ss: ss.G)[0]


def moe_permute(hidden, topk_ids, num_experts: int, expert_map=None, *, validate: bool = True) -> Permuted:
    """vLLM ``moe_permute`` on the GPU; contract: :func:`moeref.dispatch.moe_permute`.

    ``hidden``: ``[M, K]`` tensor of any dtype and row stride (rows are copied bit for bit), or None
    for indices only. Returns :class:`~moeref.dispatch.Permuted` of torch tensors: ``hidden``
    ``[M*k, K]`` (rows ``>= offset[-1]`` zero, as in the reference), ``expert_first_token_offset``
    int64, ``permuted_idx`` and ``inv_permuted_idx`` int32, equal to the reference element for
    element (absent slots' rows too: non-local by global id, then padding, each in slot order).
    """
    key = None
    if expert_map is None and _ints(num_experts) and _cuda(topk_ids, hidden):
        key = _cuda_key("permute", _tkey(topk_ids), _tkey(hidden), num_experts)
    plan = _plan.lookup(key)
    emap = ss = None
    m, k = topk_ids.shape if plan is not None else _check_int(topk_ids, "topk_ids", 2).shape
    n = m * k
    if plan is None:
        num_experts = check_positive_int(num_experts, "num_experts")
        topk_ids, emap, n_local = _prepare_routing(topk_ids, num_experts, expert_map, hidden, validate)
        ss = _SortShape.of(n, num_experts, n_local, emap is not None)
        lay = Layout([("perm", n), ("inv", n), *ss.spec("offsets")],
                     outs=[("perm", 0, n), ("inv", 0, n), ("offsets", 0, 2 * (ss.G + 1))])
        layout = (lay, ss.G)
    else:
        if validate:
            _prepare_ids(topk_ids, num_experts, validate)
        lay, _ = layout = plan.layout
    device = topk_ids.device
    ws = _alloc(lay.total, torch.int32, device)
    perm, inv, offsets = lay.outputs(ws)
    offsets = offsets.view(torch.int64)
    out = None if hidden is None else _alloc((n, hidden.shape[1]), hidden.dtype, device)

    def launches():
        s = _sort(topk_ids, emap, ss, ws, lay)
        _rank(s, dst=inv, dst_mode=2, lst=perm, list_mode=2, sentinel=n)
        if out is not None:
            _scatter_rows(hidden, inv, out, k, nvalid=s.offsets[s.G:])
    bases = (topk_ids, ws) if out is None else (topk_ids, ws, hidden, out)
    _plan.execute(key, plan, bases, key and key[-1], launches, layout)
    return Permuted(out, offsets, perm, inv, m, k)


def _host_counts(s: _Sorted) -> np.ndarray:
    return s.totals[: s.G].cpu().numpy().astype(np.int64)


def _place(s: _Sorted, x, a, dst, src, *, grp=None, mode=_PADDED, cap=0) -> None:
    """Rank every slot into its row (``dst``: slot -> row, ``src``: row -> slot, ``grp``: row ->
    group), fill the padding positions, copy the token rows into ``a`` (rows of a 2-D ``[P, K]``
    view): steps 4-6 for the contiguous and capacity layouts."""
    P = src.numel()
    _rank(s, dst=dst, dst_mode=1, lst=src, list_mode=1, grp=grp)
    rows = None if a is None else _bits(a).view(P, x.shape[1])
    _fill(s, P, mode=mode, cap=cap, lst=src, list_pad=-1, grp=grp, rows=rows)
    if a is not None:
        _scatter_rows(x, dst, a.view(P, x.shape[1]), s.top_k)


def to_contiguous(hidden, topk_ids, num_experts: int, alignment: int, expert_map=None, *, m_sum=None,
                  validate: bool = True, slot_rows: bool = False):
    """DeepGEMM contiguous layout on the GPU; contract: :func:`moeref.dispatch.to_contiguous`.

    ``a [M_sum, K]`` (padding rows zero), ``m_indices`` int32 (-1 padding), ``src`` int64 (-1
    padding), ``psum`` int32. Any positive ``alignment`` (DeepGEMM SM100 uses 224). ``m_sum``:
    None/"tight" (one sync for the counts), "worst_case" (vLLM's buffer; no sync) or an int (one sync
    to check it is large enough). ``slot_rows=True`` returns ``(layout, dst)`` with ``dst`` int32
    ``[M * k]``, each slot's row (-1: padding or non-local slot), the inverse of ``src`` that the
    placement computes anyway (:mod:`fastpath.moe` reduces through it)."""
    worst = isinstance(m_sum, str) and m_sum == "worst_case"
    key = None
    if worst and expert_map is None and _ints(num_experts, alignment) and _cuda(topk_ids, hidden):
        key = _cuda_key("contiguous", _tkey(topk_ids), _tkey(hidden), num_experts, alignment)
    plan = _plan.lookup(key)
    emap = ss = None
    if plan is None:
        num_experts = check_positive_int(num_experts, "num_experts")
        alignment = check_positive_int(alignment, "alignment")
        topk_ids, emap, n_local = _prepare_routing(topk_ids, num_experts, expert_map, hidden, validate)
        m, k = topk_ids.shape
        ss = _SortShape.of(m * k, num_experts, n_local, emap is not None, want_psum=True)
        if not worst:
            out, dst = _to_contiguous_sized(hidden, topk_ids, emap, ss, alignment, m_sum)
            return (out, dst) if slot_rows else out
        size = contiguous_m_sum(np.zeros(ss.G), alignment, "worst_case", num_slots=m * k)
        lay = Layout([("m_indices", size), ("src", 2 * size), ("psum", max(ss.G, 1)), ("dst", m * k),
                      *ss.spec("psum")[1:]],
                     outs=[("m_indices", 0, size), ("src", 0, 2 * size), ("psum", 0, ss.G)])
        layout = (lay, size)
    else:
        if validate:
            _prepare_ids(topk_ids, num_experts, validate)
        lay, size = layout = plan.layout
    m, k = topk_ids.shape
    device = topk_ids.device
    ws = _alloc(lay.total, torch.int32, device)
    m_indices, src, psum = lay.outputs(ws)
    src = src.view(torch.int64)
    a = None if hidden is None else _alloc((size, hidden.shape[1]), hidden.dtype, device)

    def launches():
        s = _sort(topk_ids, emap, ss, ws, lay, pad=alignment)
        _place(s, hidden, a, lay.view(ws, "dst"), src, grp=m_indices)
    bases = (topk_ids, ws) if a is None else (topk_ids, ws, hidden, a)
    _plan.execute(key, plan, bases, key and key[-1], launches, layout)
    out = Contiguous(a, m_indices, src, psum, alignment, m, k)
    return (out, lay.view(ws, "dst")) if slot_rows else out


def _to_contiguous_sized(hidden, topk_ids, emap, ss, alignment, m_sum):
    """:func:`to_contiguous` with ``m_sum`` None/"tight" or an int: the counts come to the host (one
    sync) to size or check the buffers. Returns (layout, slot -> row map)."""
    device = topk_ids.device
    m, k = topk_ids.shape
    s = _sort_ws(topk_ids, emap, ss, device, pad=alignment)
    tight = contiguous_m_sum(_host_counts(s), alignment)
    if m_sum is None or m_sum == "tight":
        size = tight
    else:
        size = check_positive_int(m_sum, "m_sum", allow_zero=True)
        if size < tight:
            raise ValueError(f"m_sum={size} is smaller than the rows the routing needs ({tight})")
    m_indices = _alloc(size, torch.int32, device)
    src = _alloc(size, torch.int64, device)
    a = None if hidden is None else _alloc((size, hidden.shape[1]), hidden.dtype, device)
    dst = _alloc(m * k, torch.int32, device)
    _place(s, hidden, a, dst, src, grp=m_indices)
    return Contiguous(a, m_indices, src, s.psum, alignment, m, k), dst


def _to_capacity(kind, hidden, topk_ids, num_experts, expert_map, validate, capacity_of, *, bound=None,
                 what="to_masked", bound_name="max_m"):
    """Rows per local expert in ``[G, cap]`` buffers: (masked_m / expert_num_tokens view, cap, a,
    src, M, k, host counts or None, slot -> row map). ``capacity_of(host counts) -> cap`` costs the one host sync;
    ``bound``: the capacity without a host sync (counts None). Below the number of slots ``M * k``
    (a token may repeat an expert, :mod:`moeref.routing.ids`) it is checked on the device with
    ``torch._assert_async`` (a CUDA device-side assert, a ``RuntimeError`` on the CPU) after the sort
    and before any row is placed."""
    key = None
    if bound is not None and expert_map is None and _ints(num_experts, bound) and _cuda(topk_ids, hidden):
        key = _cuda_key(kind, _tkey(topk_ids), _tkey(hidden), num_experts, bound)
    fused = _sort_host._capacity_fused(topk_ids, hidden, bound)  # sort and placement in one launch
    plan = _plan.lookup(key and (key, 0))  # sort (fused: and placement), then placement
    plan1 = None if fused else _plan.lookup(key and (key, 1))
    emap = ss = None
    if plan is None or (plan1 is None and not fused):
        plan = plan1 = None
        num_experts = check_positive_int(num_experts, "num_experts")
        topk_ids, emap, n_local = _prepare_routing(topk_ids, num_experts, expert_map, hidden, validate)
        m, k = topk_ids.shape
        ss = _SortShape.of(m * k, num_experts, n_local, emap is not None)
        if bound is None:
            return _to_capacity_counted(hidden, topk_ids, emap, ss, capacity_of)
        lay = Layout([("totals", ss.NKP), ("meta", 3), ("dst", m * k), *ss.spec("totals", "meta")[2:]],
                     outs=[("totals", 0, ss.G), ("meta", 2, 1)])
        layout = (lay, ss.G)
    else:
        if validate:
            _prepare_ids(topk_ids, num_experts, validate)
        lay, _ = layout = plan.layout
    G, cap = layout[1], bound
    m, k = topk_ids.shape
    device = topk_ids.device
    ws = _alloc(lay.total, torch.int32, device)
    counts, fits = lay.outputs(ws)
    src = _alloc((G, cap), torch.int64, device)
    a = None if hidden is None else _alloc((G, cap, hidden.shape[1]), hidden.dtype, device)
    bases = (topk_ids, ws, src) if a is None else (topk_ids, ws, src, hidden, a)
    dev = key and key[-1]
    if fused:  # one launch; an overflow (cap < M * k) is checked after it (the decode kernel drops such rows)
        _plan.execute(key and (key, 0), plan, bases, dev,
                      lambda: _sort_host._small_capacity(topk_ids, emap, ss, ws, lay, cap, lay.view(ws, "dst"), src),
                      layout)
        if cap < m * k:
            torch._assert_async(fits, f"{what}: a local expert has more rows than {bound_name}={cap}")
        return counts, cap, a, src, m, k, None, lay.view(ws, "dst")
    _plan.execute(key and (key, 0), plan, bases, dev,
                  lambda: _sort(topk_ids, emap, ss, ws, lay, mode=_CAPACITY, cap=cap), layout)
    if cap < m * k:  # a token repeating an expert can overflow: checked on the device, no sync
        # meta[2]: 1 if every local expert fits (written by the sort head in capacity mode)
        torch._assert_async(fits, f"{what}: a local expert has more rows than {bound_name}={cap}")
    _plan.execute(key and (key, 1), plan1, bases, dev,
                  lambda: _place(_sorted(topk_ids, emap, ss, ws, lay), hidden, a, lay.view(ws, "dst"), src,
                                 mode=_CAPACITY, cap=cap))
    return counts, cap, a, src, m, k, None, lay.view(ws, "dst")


def _to_capacity_counted(hidden, topk_ids, emap, ss, capacity_of):
    """:func:`_to_capacity` without a bound: the counts come to the host (one sync) for the capacity."""
    device = topk_ids.device
    m, k = topk_ids.shape
    s = _sort_ws(topk_ids, emap, ss, device)
    counts = _host_counts(s)  # the one host sync
    cap = capacity_of(counts)
    over = np.flatnonzero(counts > cap)
    if over.size:
        e = int(over[0])
        raise ValueError(f"local expert {e} has {int(counts[e])} rows, more than the capacity {cap}")
    # Rewrite the group starts as g * cap (the counts, offsets and chunk prefixes stay).
    _launch(_group_starts_kernel, (1,), s.totals, s.starts, s.ends, s.offsets, s.meta, s.meta,
            s.G, s.NK, 1, cap, MODE=_CAPACITY, WRITE_PSUM=False, NKP=s.totals.numel())
    src = _alloc((s.G, cap), torch.int64, device)
    a = None if hidden is None else _alloc((s.G, cap, hidden.shape[1]), hidden.dtype, device)
    dst = _alloc(m * k, torch.int32, device)
    _place(s, hidden, a, dst, src, mode=_CAPACITY, cap=cap)
    return s.totals[: s.G], cap, a, src, m, k, counts, dst


def to_masked(hidden, topk_ids, num_experts: int, max_m=None, expert_map=None, *, expected_m=None,
              validate: bool = True, slot_rows: bool = False):
    """DeepGEMM masked layout on the GPU; contract: :func:`moeref.dispatch.to_masked` (``a [E_local,
    max_m, K]`` zero past ``masked_m``; ``src`` int64 -1 fill).

    ``expected_m=None`` (the reference's behaviour): one host sync for the counts, which size
    ``max_m`` when it is None, check it otherwise, and give ``expected_m = max(1, ceil(present
    slots / E_local))``.

    ``expected_m`` given (a positive int; DeepGEMM's scheduling hint, any positive value gives the
    same GEMM result): no host sync, so the call can be captured in a CUDA graph. The buffers
    must then not depend on the data: ``max_m`` is required and must be at least the number of
    tokens ``M`` (DeepEP's low-latency buffers, ``num_max_dispatch_tokens_per_rank * num_ranks``,
    satisfy it); otherwise ``ValueError``. A routing without repeated experts in a row then never
    overflows; one that repeats an expert can, and below ``M * k`` rows the capacity is checked on
    the device instead of the host: a CUDA device-side assert (fatal to the CUDA context, as any
    device assert) or, on the CPU, a ``RuntimeError``; never a truncation. ``expected_m`` is
    returned as given. ``validate=True`` and an ``expert_map`` given as a device tensor still cost
    their own syncs (module docstring): pass ``validate=False`` and a host ``expert_map``.
    ``slot_rows=True`` returns ``(layout, dst)``: int32 ``[M * k]``, each slot's row of the
    ``[E_local * max_m]`` rows (-1: padding or non-local slot), as :func:`to_contiguous`."""
    if max_m is not None:
        max_m = check_positive_int(max_m, "max_m")
    bound = None
    if expected_m is not None:
        expected_m = check_positive_int(expected_m, "expected_m")
        num_tokens = _check_int(topk_ids, "topk_ids", 2).shape[0]
        if max_m is None or max_m < num_tokens:
            raise ValueError(f"to_masked with expected_m given (no host sync) needs max_m >= the number of "
                             f"tokens {num_tokens} (no buffer size from the data); got max_m={max_m}")
        bound = max_m
    masked_m, cap, a, src, m, k, counts, dst = _to_capacity(
        "masked", hidden, topk_ids, num_experts, expert_map, validate,
        lambda c: max_m if max_m is not None else max(1, int(c.max()) if c.size else 0), bound=bound)
    if expected_m is None:
        n_present = int(counts.sum())
        expected_m = max(1, -(-n_present // counts.size)) if counts.size else 1
    out = Masked(a, masked_m, int(expected_m), src, m, k)
    return (out, dst) if slot_rows else out


def to_batched(hidden, topk_ids, num_experts: int, max_tokens_per_dispatcher: int, num_dispatchers: int = 1,
               expert_map=None, *, validate: bool = True) -> Batched:
    """vLLM BatchedExperts layout on the GPU; contract: :func:`moeref.dispatch.to_batched`.

    The capacity ``max_tokens_per_dispatcher * num_dispatchers`` does not depend on the data. With
    ``validate=True`` the counts come to the host (one sync) and an expert over the capacity is the
    reference's ``ValueError``. With ``validate=False`` nothing comes to the host (the call can be
    captured in a CUDA graph): only a token repeating an expert can overflow (the tokens are at most
    the capacity), and where the capacity is below ``M * k`` that is checked on the device, as in
    :func:`to_masked` with ``expected_m`` (a device-side assert on CUDA, ``RuntimeError`` on the CPU)."""
    t = check_positive_int(max_tokens_per_dispatcher, "max_tokens_per_dispatcher")
    d = check_positive_int(num_dispatchers, "num_dispatchers")
    _check_int(topk_ids, "topk_ids", 2)
    if topk_ids.shape[0] > t * d:
        raise ValueError(f"{topk_ids.shape[0]} tokens exceed max_tokens_per_dispatcher * num_dispatchers = {t * d}")
    counts, cap, a, src, m, k, _, _ = _to_capacity("batched", hidden, topk_ids, num_experts, expert_map, validate,
                                                lambda c: t * d, bound=None if validate else t * d, what="to_batched",
                                                bound_name="max_tokens_per_dispatcher * num_dispatchers")
    return Batched(a, counts, src, m, k, t, d)
# ----------------------------------------------------------------------------------------------
# Registry (fastpath.registry): ``supports`` is what the registry's triton entries call
# ----------------------------------------------------------------------------------------------
from .registry import DISPATCH_OPERATIONS as OPERATIONS  # noqa: E402  (one list, in the registry)


def supports(topk_ids=None, hidden=None, **_) -> tuple[bool, str]:
    """Whether the dispatch kernels can run here on these tensors, and why not.

    Needs a CUDA device, or CPU tensors with ``TRITON_INTERPRET=1`` (set before triton is imported).
    ``topk_ids`` must be an int32/int64 torch tensor ``[M, k]``; ``hidden`` any real dtype ``[M, K]``
    on the same device.
    """
    interp = _interpreting()
    for name, t in (("topk_ids", topk_ids), ("hidden", hidden)):
        if t is None:
            continue
        if not torch.is_tensor(t):
            return False, f"{name} must be a torch tensor; got {type(t).__name__}"
        if t.device.type == "cpu" and not interp:
            return False, f"{name} is a CPU tensor and TRITON_INTERPRET=1 is not set (no GPU to run on)"
        if t.device.type not in ("cpu", "cuda"):
            return False, f"{name} is on {t.device}; the kernels run on CUDA (or CPU under the interpreter)"
    if topk_ids is not None and (topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.ndim != 2):
        return False, f"topk_ids must be int32/int64 [M, k]; got {topk_ids.dtype} {tuple(topk_ids.shape)}"
    if hidden is not None and (hidden.ndim != 2 or hidden.is_complex() or hidden.element_size() not in _INT_VIEW):
        return False, f"hidden must be a real [M, K] tensor; got {hidden.dtype} {tuple(hidden.shape)}"
    if topk_ids is None and hidden is None and not torch.cuda.is_available() and not interp:
        return False, "no CUDA device and TRITON_INTERPRET is not 1"
    return True, "ok"


