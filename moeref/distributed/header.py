"""Step 1 of the dispatch protocol (:mod:`moeref.distributed.dispatch`): this rank's inputs checked, the header
``all_gather``-ed, and the same error raised on every rank for a bad input anywhere. Also the checks shared with
:func:`~moeref.distributed.ep_low_latency_buffer` and :func:`~moeref.distributed.ep_combine` (the float dtypes
accepted, the row-local quantization)."""
from __future__ import annotations

import hashlib

import numpy as np

from .group import EPGroup, all_gather_int64
from .placement import EPPlacement
from .receive import DISPATCH_MODES

_HEAD = 10  # ok, placement fp, ep_size, T, k, H, payload fp, M, bound, mode
_FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


def _digest(*parts) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=7)
    return int.from_bytes(h.digest(), "little")


def _check_quant(quant, x: np.ndarray, quantizer=None):
    """The scheme's checks, then ``quantizer(x)`` (default :func:`moeref.quant.quantize`; the device engine
    passes the fast path's) and the check of what it carries."""
    from ..quant import Scheme, quantize

    if not isinstance(quant, Scheme):
        raise TypeError(f"quant must be a moeref.quant.Scheme or None; got {type(quant).__name__}")
    if any(b != 1 for b in quant.block[:-1]):
        raise ValueError(f"dispatch quantization must be row-local (blocks (1, g)); {quant.name!r} has block "
                         f"{quant.block}")
    qt = quantize(x, quant) if quantizer is None else quantizer(x)
    if any(getattr(qt, name, None) is not None for name in ("global_scale", "channel_scales", "zero_points")):
        raise ValueError(f"dispatch quantization must carry only per-block scales; {quant.name!r} has a global "
                         "scale, channel scales or zero points")
    return qt


def _check_distinct_per_row(topk_ids) -> None:
    """``ValueError`` unless every row of ``topk_ids`` (NumPy or torch, any device) names distinct experts
    (-1 padding aside). Low-latency mode needs it: an expert's masked buffer holds ``R*M`` rows, one per
    token of every rank, so a token sending two slots to one expert could overflow it on the receiver,
    an error only that rank would see after the exchange; checked on the source, before the header, it
    is raised on every rank."""
    if hasattr(topk_ids, "sort") and not isinstance(topk_ids, np.ndarray):  # a torch tensor
        s = topk_ids.sort(dim=1).values
        dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).nonzero()
        first = None if dup.numel() == 0 else (int(dup[0, 0]), s[dup[0, 0]].cpu().numpy())
    else:
        s = np.sort(np.asarray(topk_ids), axis=1)
        dup = np.argwhere((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0))
        first = None if dup.size == 0 else (int(dup[0, 0]), s[dup[0, 0]])
    if first is not None:
        t, row = first
        raise ValueError(f"topk_ids row {t} names an expert twice ({sorted(int(v) for v in row)}): mode='low_latency' "
                         "needs distinct experts per token (each expert's buffer holds one row per token); map "
                         "logical ids with EPPlacement.to_physical, or use mode='normal'")


def _agree(g: EPGroup, local_fn, placement: EPPlacement, mode: str, bound: int):
    """Run the local preparation, exchange the header, raise the same error on every rank."""
    r = g.world_size
    head = np.zeros(_HEAD + 2 * r, dtype=np.int64)
    err, prep = None, None
    try:
        if not isinstance(placement, EPPlacement):
            raise TypeError(f"placement must be an EPPlacement; got {type(placement).__name__}")
        head[1:3] = (placement.fingerprint, placement.ep_size)
        prep = local_fn()
        head[3:7] = (prep["T"], prep["k"], prep["H"], prep["payload"])
        if placement.ep_size == r:
            head[_HEAD:_HEAD + r] = prep["plan"].rows_to
            head[_HEAD + r:] = prep["plan"].slots_to
        head[0] = 1
    except (ValueError, TypeError) as e:
        err = e
    head[7:10] = (prep["M"] if prep else 0, bound, DISPATCH_MODES.index(mode))
    table = all_gather_int64(g, head, "the dispatch header all_gather")
    if err is not None:
        raise type(err)(f"rank {g.rank}: {err}") from err
    bad = np.flatnonzero(table[:, 0] == 0).tolist()
    if bad:
        raise ValueError(f"rank {g.rank}: ranks {bad} rejected their dispatch inputs (see their errors)")
    for col, what in ((9, "mode"), (8, "max_recv_tokens"), (7, "max_tokens_per_rank")):
        if len(set(table[:, col].tolist())) > 1:
            raise ValueError(f"ranks disagree on {what}: {dict(enumerate(table[:, col].tolist()))}")
    if (table[:, 2] != r).any():
        wrong = {i: int(v) for i, v in enumerate(table[:, 2]) if v != r}
        raise ValueError(f"the expert placement of ranks {sorted(wrong)} is for ep_size {sorted(set(wrong.values()))} "
                         f"but the process group has world_size={r}")
    if len(set(table[:, 1].tolist())) > 1:
        raise ValueError("ranks disagree on the expert placement (fingerprints "
                         f"{dict(enumerate(table[:, 1].tolist()))}): build it the same way on every rank")
    for col, what in ((4, "top_k"), (5, "hidden size"), (6, "payload (dtype / quantization)")):
        if len(set(table[:, col].tolist())) > 1:
            raise ValueError(f"ranks disagree on the {what}: {dict(enumerate(table[:, col].tolist()))}")
    return prep, table
