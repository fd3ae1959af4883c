"""Validate a user's distributed MoE kernel against the EP reference, rank by rank.

:func:`validate_ep_kernel` runs, under the same process group, the reference dispatch and then the
candidate's per-rank function, and checks on every rank:

* **received buffers** (when the candidate reports them, :class:`EPKernelOutput`): per-expert counts
  exactly; the received rows as a set of keys (normal: ``(source rank, source token)``; low-latency:
  ``(local expert, source rank, source token)``, so DeepEP's arrival-dependent order within an expert
  is not a fault) with missing, unexpected and duplicated rows named; for matching keys the top-k
  local ids (normal) and the row values, bitwise (a dispatch moves data, it computes nothing);
* **the final output** with :func:`moeref.compare.compare` under the kernel's declared
  :class:`~moeref.compare.Profile`, against the single-process reference of this rank's tokens (which
  the EP reference equals bit for bit, :mod:`moeref.distributed.layer`).

Every rank's findings are gathered (``all_gather_object``) so each rank returns the same
:class:`EPValidation`, in which a fault is reported with its rank ("rank 2: received token 5 of rank
0, which the reference does not send here").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import _interop
from ..compare import Profile, compare
from ..moe.pipeline import run_moe
from .dispatch import ep_dispatch
from .group import EPGroup, _collective
from .placement import EPPlacement
from .receive import LowLatencyDispatch

__all__ = ["EPKernelOutput", "EPValidation", "RankCheck", "validate_ep_kernel"]

_MAX_LISTED = 4


@dataclass(frozen=True, eq=False)
class EPKernelOutput:
    """What a candidate's per-rank function returns. Only ``out`` is required.

    ``out``: float ``[T, H]``, this rank's tokens' output. Receive buffers, in DeepEP's terms:
    ``recv_x`` (normal ``[N_recv, H]``; low-latency ``[E_local, W, H]``; values, dequantized if the
    dispatch was quantized), ``recv_src_rank`` / ``recv_src_token`` (int, same leading shape: where
    each row came from; DeepEP: rank-prefix matrix + ``recv_src_idx``, or ``layout_range`` +
    ``src_info``), ``recv_topk_idx`` (normal ``[N_recv, k]`` local ids, -1 elsewhere),
    ``recv_counts`` (int ``[E_local]``: normal ``num_recv_tokens_per_expert``, low-latency
    ``recv_count``; low-latency rows past the count are ignored).
    """

    out: object
    recv_x: object = None
    recv_src_rank: object = None
    recv_src_token: object = None
    recv_topk_idx: object = None
    recv_counts: object = None


@dataclass(frozen=True)
class RankCheck:
    """One rank's findings: ``faults`` (messages, empty when it passed) and the output comparison's
    ``metrics`` / ``violations`` (None when the output was not compared)."""

    rank: int
    faults: tuple = ()
    violations: int | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.faults


@dataclass(frozen=True)
class EPValidation:
    """All ranks' :class:`RankCheck`, rank order (the same object on every rank)."""

    ranks: tuple

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.ranks)

    @property
    def faulty_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if not r.passed]

    def summary(self) -> str:
        head = "PASS" if self.passed else f"FAIL on ranks {self.faulty_ranks}"
        lines = [f"EP kernel validation over {len(self.ranks)} ranks: {head}"]
        for r in self.ranks:
            for f in r.faults:
                lines.append(f"  rank {r.rank}: {f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _listed(items) -> str:
    items = list(items)
    more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def _key_text(key, low_latency: bool) -> str:
    if low_latency:
        return f"token {key[2]} of rank {key[1]} for local expert {key[0]}"
    return f"token {key[1]} of rank {key[0]}"


def _rows(d, low_latency: bool):
    """Reference keys -> flat row index, and flat values / ids."""
    if low_latency:
        e, i = np.nonzero(d.src_info >= 0)
        keys = list(zip(e.tolist(), d.src_rank[e, i].tolist(), d.src_info[e, i].tolist()))
        vals = d.x if d.xq is None else d.xq.dequantize(np.float64)
        return dict(zip(keys, (e * d.src_info.shape[1] + i).tolist())), vals.reshape(-1, vals.shape[-1]), None
    real = np.flatnonzero(d.src_rank >= 0)  # not the pad_to_max_recv padding
    keys = list(zip(d.src_rank[real].tolist(), d.src_token[real].tolist()))
    vals = d.x if d.xq is None else d.xq.dequantize(np.float64)
    return dict(zip(keys, real.tolist())), vals, d.topk_idx


def _check_recv(ref, cand: EPKernelOutput, low_latency: bool) -> list[str]:
    faults = []
    ref_counts = ref.recv_count if low_latency else ref.num_recv_tokens_per_expert
    counts = None
    if cand.recv_counts is not None:
        counts = np.asarray(_interop.to_numpy(cand.recv_counts)).astype(np.int64).reshape(-1)
        if counts.shape != ref_counts.shape:
            faults.append(f"per-expert counts have shape {counts.shape}, the reference {ref_counts.shape}")
            counts = None
        else:
            diff = np.flatnonzero(counts != ref_counts)
            if diff.size:
                faults.append("per-expert receive counts differ: " + _listed(
                    f"local expert {e}: {int(counts[e])} (reference {int(ref_counts[e])})" for e in diff.tolist()))
    if cand.recv_src_rank is None or cand.recv_src_token is None:
        return faults
    src_rank = np.asarray(_interop.to_numpy(cand.recv_src_rank)).astype(np.int64)
    src_tok = np.asarray(_interop.to_numpy(cand.recv_src_token)).astype(np.int64)
    if src_rank.shape != src_tok.shape:
        return faults + [f"recv_src_rank {src_rank.shape} and recv_src_token {src_tok.shape} differ in shape"]
    if low_latency:
        if src_rank.ndim != 2 or src_rank.shape[0] != ref.src_info.shape[0]:
            return faults + [f"low-latency source tensors must be [E_local={ref.src_info.shape[0]}, W]; "
                             f"got {src_rank.shape}"]
        valid = (np.arange(src_rank.shape[1])[None, :] < counts[:, None]) if counts is not None else src_tok >= 0
        e, i = np.nonzero(valid)
        keys = list(zip(e.tolist(), src_rank[e, i].tolist(), src_tok[e, i].tolist()))
        flat = (e * src_rank.shape[1] + i).tolist()
    else:
        real = np.flatnonzero(src_rank.reshape(-1) >= 0)  # padding rows (DeepEP num_worst_tokens) are -1
        keys = list(zip(src_rank.reshape(-1)[real].tolist(), src_tok.reshape(-1)[real].tolist()))
        flat = real.tolist()
    ref_index, ref_vals, ref_ids = _rows(ref, low_latency)
    seen: dict = {}
    dups = []
    for k, f in zip(keys, flat):
        if k in seen:
            dups.append(k)
        else:
            seen[k] = f
    missing = [k for k in ref_index if k not in seen]
    extra = [k for k in seen if k not in ref_index]
    if missing:
        faults.append("missing rows: " + _listed(_key_text(k, low_latency) for k in missing))
    if extra:
        faults.append("unexpected rows (sent to the wrong rank or expert?): " + _listed(
            _key_text(k, low_latency) for k in extra))
    if dups:
        faults.append("duplicated rows: " + _listed(_key_text(k, low_latency) for k in dups))
    common = [k for k in ref_index if k in seen]
    if cand.recv_x is not None and common:
        x = np.asarray(_interop.to_numpy(cand.recv_x)).astype(np.float64)
        x = x.reshape(-1, x.shape[-1])
        ci = np.array([seen[k] for k in common])
        ri = np.array([ref_index[k] for k in common])
        if x.shape[1] != ref_vals.shape[-1]:
            faults.append(f"recv_x rows have {x.shape[1]} columns, the reference {ref_vals.shape[-1]}")
        else:
            bad = np.flatnonzero(~np.all((x[ci] == ref_vals[ri]) | (np.isnan(x[ci]) & np.isnan(ref_vals[ri])),
                                        axis=1))
            if bad.size:
                faults.append(f"{bad.size} received rows differ from the sent values: " + _listed(
                    _key_text(common[b], low_latency) for b in bad.tolist()))
    if not low_latency and cand.recv_topk_idx is not None and common:
        ids = np.asarray(_interop.to_numpy(cand.recv_topk_idx)).astype(np.int64)
        ci = np.array([seen[k] for k in common])
        ri = np.array([ref_index[k] for k in common])
        if ids.ndim != 2 or ids.shape[1] != ref_ids.shape[1]:
            faults.append(f"recv_topk_idx has shape {ids.shape}, the reference [N_recv, {ref_ids.shape[1]}]")
        else:
            bad = np.flatnonzero((ids[ci] != ref_ids[ri]).any(axis=1))
            if bad.size:
                faults.append(f"{bad.size} rows have wrong local top-k ids: " + _listed(
                    f"{_key_text(common[b], False)}: {ids[ci[b]].tolist()} (reference {ref_ids[ri[b]].tolist()})"
                    for b in bad.tolist()))
    return faults


def _on_host(d):
    """A dispatch result with every tensor field as a NumPy array (device-engine results; host ones unchanged)."""
    from dataclasses import fields, replace

    changes = {}
    for f in fields(d):
        v = getattr(d, f.name)
        if _interop.is_torch_tensor(v):
            changes[f.name] = np.asarray(_interop.to_numpy(v))
        elif hasattr(v, "to_host"):
            changes[f.name] = v.to_host()
    return replace(d, **changes) if changes else d


def validate_ep_kernel(candidate, hidden, topk_weights, topk_ids, placement: EPPlacement, group: EPGroup, *,
                       weights, profile: Profile, mode: str = "normal", dispatch_quant=None,
                       max_tokens_per_rank: int | None = None, engine: str = "host", **layer_kwargs) -> EPValidation:
    """Run ``candidate(hidden, topk_weights, topk_ids, group) -> EPKernelOutput`` on every rank and check
    it (module docstring). Call on every rank of ``group`` with that rank's tokens.

    ``weights``: the full layer (every rank builds the single-process reference of its tokens);
    ``layer_kwargs``: the layer's arguments for :func:`moeref.moe.run_moe` (``quant``, ``activation``,
    ``out_dtype``, ``shared_experts``, ...); ``topk_ids`` are logical ids; ``mode``,
    ``dispatch_quant`` (the row-local scheme the candidate quantizes with before dispatch, or None),
    ``max_tokens_per_rank``: the dispatch being checked (:func:`~moeref.distributed.ep_dispatch`).
    ``engine``: where the reference dispatch runs (``"device"``: on the group's device, the same bits, fast at
    production sizes; its buffers are then read back to the host for the checks).
    A candidate that raises is a fault of its rank. Returns the same :class:`EPValidation` on every rank.
    """
    import torch.distributed as dist

    ids = placement.to_physical(topk_ids)
    ref = _on_host(ep_dispatch(hidden, ids, topk_weights, placement, group, mode=mode, quant=dispatch_quant,
                               max_tokens_per_rank=max_tokens_per_rank, engine=engine))
    faults: list[str] = []
    violations, metrics = None, {}
    try:
        cand = candidate(hidden, topk_weights, topk_ids, group)
    except Exception as e:  # noqa: BLE001 - a candidate failure is a finding of this rank
        cand = None
        faults.append(f"the candidate raised {type(e).__name__}: {e}")
    if cand is not None:
        if not isinstance(cand, EPKernelOutput):
            faults.append(f"the candidate returned {type(cand).__name__}, not EPKernelOutput")
        else:
            faults += _check_recv(ref, cand, isinstance(ref, LowLatencyDispatch))
            run = run_moe(hidden, weights, topk_weights, topk_ids, **layer_kwargs)
            try:
                rep = compare(cand.out, run, profile)
            except ValueError as e:
                faults.append(f"output: {e}")
            else:
                violations, metrics = rep.num_violations, dict(rep.metrics)
                if not rep.passed:
                    bad = np.flatnonzero(rep.token_violations).tolist()
                    faults.append(f"output: {rep.num_violations} elements outside the {profile.name} bound, on "
                                  f"tokens {_listed(str(t) for t in bad)} (max |err| {rep.metrics['max_abs']:.3g})")
    mine = RankCheck(group.rank, tuple(faults), violations, metrics)
    gathered: list = [None] * group.world_size
    _collective(group, "the validation all_gather_object",
                lambda: dist.all_gather_object(gathered, mine, group=group.group))
    return EPValidation(tuple(gathered))
