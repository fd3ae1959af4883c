"""Checks by equality (the ``regime="exact"`` of :func:`moeref.testing.assert_moe_close` and
:func:`moeref.testing.assert_grouped_gemm_close`): every element of the candidate must equal the
reference rounded once to the candidate's dtype; the report names the differing elements with their
token, expert and slot.

Sound only on inputs in an exact regime (:func:`moeref.regimes.exact_layer`,
:mod:`moeref.regimes.strategies`, or inputs :func:`moeref.regimes.in_exact_regime` accepts): there every
conforming kernel gives those bits. Zeros compare equal whatever their sign (a sum of ``+0`` and
``-0`` terms has no declared sign), NaN equals NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import _interop
from ..moe.pipeline import round_to_dtype

__all__ = ["EqualityReport", "ExactMismatch", "moe_equality_report", "gemm_equality_report", "reference_run_of"]

_MAX_LISTED = 20


class ExactMismatch(AssertionError):
    """A candidate differs from the reference on exact-regime inputs; ``report`` is the
    :class:`EqualityReport`."""

    def __init__(self, report: "EqualityReport"):
        self.report = report
        super().__init__(report.summary())


@dataclass(frozen=True, eq=False)
class EqualityReport:
    """The result of a check by equality.

    Attributes:
        label: what was compared. num_elements: elements compared (padding rows excluded).
        num_differences: elements that differ. differing: up to 20 of them, each a dict with ``index``
            (output row, column), ``reference``, ``candidate`` and the row's ``token``, ``experts`` and
            ``slots`` (slot ``t * k + j``) where known. by_expert: differing elements per expert (a layer
            output element counts for every expert its token was routed to). mask: bool, True where an
            element differs (output shape).
    """

    label: str
    num_elements: int
    num_differences: int
    differing: list
    by_expert: dict
    mask: np.ndarray = field(repr=False)

    @property
    def passed(self) -> bool:
        return self.num_differences == 0

    def summary(self) -> str:
        if self.passed:
            return f"{self.label}: all {self.num_elements} elements equal the reference (exact regime)"
        lines = [f"{self.label}: {self.num_differences} of {self.num_elements} elements differ from the reference "
                 "(exact regime: every conforming kernel gives the reference's bits)"]
        if self.by_expert:
            top = sorted(self.by_expert.items(), key=lambda kv: -kv[1])[:8]
            lines.append("  by expert: " + ", ".join(f"{e}: {c}" for e, c in top))
        for d in self.differing[:8]:
            where = ", ".join(f"{k} {d[k]}" for k in ("token", "experts", "slots") if d.get(k) is not None)
            lines.append(f"  {tuple(d['index'])}: reference {d['reference']!r}, candidate {d['candidate']!r}"
                         + (f" ({where})" if where else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"label": self.label, "passed": self.passed, "num_elements": self.num_elements,
                "num_differences": self.num_differences, "differing": self.differing,
                "by_expert": {str(k): v for k, v in self.by_expert.items()}}


def _dtype_name(x) -> str:
    if _interop.is_torch_tensor(x):
        return str(x.dtype).replace("torch.", "")
    return np.asarray(x).dtype.name


def _differ(cand: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return ~((cand == ref) | (np.isnan(cand) & np.isnan(ref)))


def _differ_native(cand: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """:func:`_differ` of two arrays of one float dtype, from their bit patterns: only where the bits differ are
    the values compared (``+0`` and ``-0``, two NaNs), so an equal output costs one integer pass."""
    ui = np.dtype(f"u{cand.dtype.itemsize}")
    mask = np.ascontiguousarray(cand).view(ui) != np.ascontiguousarray(ref).view(ui)
    idx = np.nonzero(mask)
    if idx[0].size:
        with np.errstate(invalid="ignore"):  # a NaN cast to float64 stays NaN (ml_dtypes warns)
            mask[idx] = _differ(cand[idx].astype(np.float64), ref[idx].astype(np.float64))
    return mask


def reference_run_of(reference):
    """A traced reference run (:class:`moeref.moe.MoERun`) of ``reference``: a run itself, an
    :class:`moeref.regimes.ExactLayer`, or a :class:`moeref.compare.faults.LayerCase`."""
    if hasattr(reference, "chunks"):
        return reference
    if hasattr(reference, "reference") and hasattr(reference, "config"):
        return reference.reference()
    if hasattr(reference, "hidden") and hasattr(reference, "options"):
        from ..moe import run_moe

        return run_moe(reference.hidden, reference.weights, reference.topk_weights, reference.topk_ids,
                       **reference.options)
    raise TypeError(f"reference must be a traced run (moeref.moe.run_moe), an ExactLayer or a LayerCase; "
                    f"got {type(reference).__name__}")


def _expected(run, dtype_name: str) -> np.ndarray:
    """The reference's output rounded once to the candidate's dtype, as float64."""
    out = np.asarray(_interop.to_numpy(run.out))  # a device run's tensors come to the host
    if run.config.out_dtype is not None and out.dtype.name == dtype_name:
        return out.astype(np.float64)
    output = np.asarray(_interop.to_numpy(run.output), dtype=np.float64)
    if dtype_name in ("bfloat16", "float16", "float32"):
        return round_to_dtype(output, dtype_name)
    return output


def moe_equality_report(candidate, reference, *, label: str = "") -> EqualityReport:
    """:class:`EqualityReport` of a layer output ``candidate`` ``[M, K]`` (NumPy or torch, any device and
    float dtype) against ``reference`` (see :func:`reference_run_of`): equal to the reference rounded once
    to the candidate's dtype. Differing elements name their token and the token's experts and slots.

    >>> from moeref.regimes import exact_layer
    >>> lay = exact_layer(3, 256, 128, 4, 2, seed=0)
    >>> run = lay.reference()
    >>> moe_equality_report(run.out, run).passed
    True
    >>> bad = run.out.copy(); bad[1, 5] = bad[1, 5] * 2 + 1
    >>> r = moe_equality_report(bad, run); r.num_differences, r.differing[0]["token"]
    (1, 1)
    """
    run = reference_run_of(reference)
    name = _dtype_name(candidate)
    cand = np.asarray(_interop.to_numpy(candidate))
    out = np.asarray(_interop.to_numpy(run.out))
    if run.config.out_dtype is not None and out.dtype == cand.dtype and cand.dtype.itemsize in (2, 4, 8):
        ref = out  # the reference's own store: compare the bits (no float64 copies)
        if cand.shape != ref.shape:
            raise ValueError(f"candidate has shape {cand.shape} but the reference output has {ref.shape}")
        mask = _differ_native(cand, ref)
    else:
        cand = cand.astype(np.float64)
        ref = _expected(run, name)
        if cand.shape != ref.shape:
            raise ValueError(f"candidate has shape {cand.shape} but the reference output has {ref.shape}")
        mask = _differ(cand, ref)
    ids = np.concatenate([np.asarray(p.topk_ids) for p, _ in run.chunks], axis=0) if run.chunks else None
    differing, by_expert = [], {}
    if mask.any():
        toks, cols = np.nonzero(mask)
        if ids is not None and ids.size:
            per_token = mask.sum(axis=1)
            k = ids.shape[1]
            routed = ids >= 0
            counts = np.bincount(ids[routed], weights=np.broadcast_to(per_token[:, None], ids.shape)[routed])
            by_expert = {int(e): int(counts[e]) for e in np.flatnonzero(counts)}
        for t, c in zip(toks[:_MAX_LISTED], cols[:_MAX_LISTED]):
            d = {"index": (int(t), int(c)), "reference": float(ref[t, c]), "candidate": float(cand[t, c]),
                 "token": int(t)}
            if ids is not None and ids.size:
                d["experts"] = [int(e) for e in ids[t]]
                d["slots"] = [int(t * k + j) for j in range(k)]
            differing.append(d)
    return EqualityReport(label or "MoE layer", int(cand.size), int(mask.sum()), differing, by_expert, mask)


def gemm_equality_report(candidate: np.ndarray, reference: np.ndarray, row_expert: np.ndarray, dtype_name: str, *,
                         top_k: int | None = None, label: str = "") -> EqualityReport:
    """:class:`EqualityReport` of a grouped GEMM: ``candidate`` and the exact ``reference`` float64 ``[R, N]``,
    ``row_expert`` int ``[R]`` (-1 padding rows, not compared), the candidate's dtype name (the reference is
    rounded once to it). ``top_k``: rows are slots ``t * k + j`` (the standard layout), so the report names
    token and slot.

    >>> ref = np.array([[1.0, 2.0], [3.0, 4.0]])
    >>> r = gemm_equality_report(np.array([[1.0, 2.0], [3.0, 5.0]]), ref, np.array([0, 1]), "float32")
    >>> r.num_differences, r.differing[0]["experts"], r.by_expert
    (1, [1], {1: 1})
    """
    ref = round_to_dtype(reference, dtype_name) if dtype_name in ("bfloat16", "float16", "float32") else reference
    cand = np.asarray(candidate, dtype=np.float64).reshape(ref.shape)
    rows = np.asarray(row_expert).astype(np.int64).reshape(-1)
    mask = _differ(cand, ref) & (rows >= 0)[:, None]
    differing, by_expert = [], {}
    if mask.any():
        r_idx, c_idx = np.nonzero(mask)
        e, cnt = np.unique(rows[r_idx], return_counts=True)
        by_expert = {int(x): int(y) for x, y in zip(e, cnt)}
        for r, c in zip(r_idx[:_MAX_LISTED], c_idx[:_MAX_LISTED]):
            d = {"index": (int(r), int(c)), "reference": float(ref[r, c]), "candidate": float(cand[r, c]),
                 "experts": [int(rows[r])]}
            if top_k:
                d["token"], d["slots"] = int(r) // int(top_k), [int(r)]
            differing.append(d)
    n = int(((rows >= 0)[:, None] & np.ones(ref.shape, bool)).sum())
    return EqualityReport(label or "grouped GEMM", n, int(mask.sum()), differing, by_expert, mask)
