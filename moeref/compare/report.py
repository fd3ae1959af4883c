"""``compare(candidate, reference, profile) -> Report``: per-element bound checks, per-token and
per-expert violation groups, and the conventional metrics side by side.

A violation is an element where ``|candidate - reference| > bound`` (NaN counts as a violation unless
the reference is NaN there too). The conventional metrics are reported for orientation only:

* relative L2 ``||c - r|| / ||r||``;
* DeepGEMM ``calc_diff = 1 - 2 sum(c r) / sum(c^2 + r^2)`` (``deep_gemm/testing/numeric.py``);
* SQNR ``20 log10(||r|| / ||r - c||)`` dB (torchao ``compute_error``);
* cosine similarity (1.0 when both tensors are all zero, 0.0 when only one is: torch
  ``cosine_similarity``'s convention, so an all-zero candidate shows no NaN); max abs error;
* vLLM-style checks: ``atol=2e-2, rtol=0`` (``tests/kernels/moe/test_moe.py``) and
  ``atol=rtol=3e-2`` (modular-kernel harness), DeepGEMM ``calc_diff < 1e-3``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import bounds
from .bounds import LayerBound, Profile, _is_device_run, get_profile

__all__ = ["Report", "compare", "conventional_checks", "layer_bound", "metrics"]


def layer_bound(run, profile: Profile | str) -> LayerBound:
    """Per-element bound ``[M, K]`` for a traced reference ``run`` (:func:`moeref.moe.run_moe`) of either
    engine: a NumPy-engine run by the bound's definition (:func:`moeref.compare.bounds.layer_bound`), a
    device-engine run (``run_moe`` with ``device=``) on its device
    (:func:`moeref.compare.device.layer.device_layer_bound`: the same bound, bit for bit, as torch tensors;
    that engine needs torch and Triton and is imported for such a run only). ``profile``: a
    :class:`Profile` or its name in :data:`moeref.compare.PROFILES`."""
    profile = get_profile(profile)
    g2 = getattr(getattr(run, "config", None), "gemm2_out_dtype", None)
    if g2 is not None:  # the bound's model has no GEMM2 store: refuse rather than bound a different layer
        raise ValueError(f"layer_bound does not model a declared GEMM2 store (the run has gemm2_out_dtype={g2!r}); "
                         "check such a run by equality in its regime (moeref.regimes.single_rounding_layer) or run "
                         "the reference without gemm2_out_dtype")
    if _is_device_run(run):
        from .device.layer import device_layer_bound  # torch and triton: imported for a device run only

        if profile.bias_add != "epilogue" and (run.weights.b13 is not None or run.weights.b2 is not None):
            raise ValueError(f"the device engine bounds bias_add='epilogue' only; profile {profile.name} declares "
                             f"bias_add={profile.bias_add!r}: run the reference on the host (run_moe without "
                             "device=) for this profile")
        return device_layer_bound(run, profile)
    return bounds.layer_bound(run, profile)


def metrics(candidate, reference) -> dict:
    """Conventional whole-tensor metrics in float64 (NaN where the candidate has NaN).

    >>> m = metrics(np.array([1.0, 2.0]), np.array([1.0, 2.0]))
    >>> m["rel_l2"], m["calc_diff"], m["cosine"], m["max_abs"]
    (0.0, 0.0, 1.0, 0.0)
    >>> metrics(np.zeros(2), np.array([1.0, 2.0]))["cosine"]   # an all-zero candidate: no NaN
    0.0
    """
    c = np.asarray(candidate, dtype=np.float64).ravel()
    r = np.asarray(reference, dtype=np.float64).ravel()
    d = c - r
    nr, nc, nd = np.linalg.norm(r), np.linalg.norm(c), np.linalg.norm(d)
    return _metric_values(nr, nc, nd, float(np.sum(c * c + r * r)), np.sum(c * r),
                          float(np.max(np.abs(d))) if d.size else 0.0)


def _metric_values(nr, nc, nd, denom, cr, max_abs) -> dict:
    """:func:`metrics` from the norms of the reference, the candidate and their difference, ``sum(c^2 + r^2)``,
    ``sum(c r)`` and the largest ``|c - r|``."""
    nr, nc, nd, cr = (np.float64(x) for x in (nr, nc, nd, cr))
    with np.errstate(divide="ignore", invalid="ignore"):
        return {
            "rel_l2": float(nd / nr) if nr else float(nd),
            "calc_diff": float(1.0 - 2.0 * cr / denom) if denom else 0.0,
            "sqnr_db": float(20 * np.log10(nr / nd)) if nd else float("inf"),
            "cosine": (float(cr / (nr * nc)) if nr and nc
                       else (float("nan") if np.isnan(nr) or np.isnan(nc) else float(nr == nc))),
            "max_abs": float(max_abs),
        }


_TOLERANCES = (("vLLM atol=2e-2 rtol=0", 2e-2, 0.0), ("vLLM modular atol=rtol=3e-2", 3e-2, 3e-2))
"""The ``|c - r| <= atol + rtol |r|`` checks of :func:`conventional_checks`: ``(name, atol, rtol)``."""


def _checks(close, calc_diff: float) -> dict:
    """:func:`conventional_checks`' dict from the :data:`_TOLERANCES` results ``close`` and ``calc_diff``."""
    out = {name: bool(ok) for (name, _, _), ok in zip(_TOLERANCES, close)}
    out["DeepGEMM calc_diff<1e-3"] = bool(calc_diff < 1e-3)
    return out


def conventional_checks(candidate, reference, *, calc_diff: float | None = None) -> dict:
    """The tolerance checks MoE suites use, as ``name -> passed`` (NaN fails, as torch's). ``calc_diff``:
    :func:`metrics`' value when the caller has it (else computed here)."""
    c = np.asarray(candidate, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    d = np.abs(c - r)
    cd = metrics(c, r)["calc_diff"] if calc_diff is None else calc_diff
    return _checks([np.all(d <= atol + rtol * np.abs(r)) for _, atol, rtol in _TOLERANCES], cd)


@dataclass(frozen=True, eq=False)
class Report:
    """Result of :func:`compare`.

    ``error``/``bound``: float64 ``[M, K]``; ``violations``: bool ``[M, K]``; ``token_violations``:
    int ``[M]`` (violating elements per token); ``expert_violations``: ``{global expert: tokens with a
    violation routed to it}``; ``metrics``/``checks``: :func:`metrics`, :func:`conventional_checks`;
    ``flips``: intermediate elements (the declared GEMM-output and activation stores, the re-quantized
    intermediate) whose exact value lies within the accumulation error of a rounding boundary, so that an
    honest kernel may round them either way; the bound is computed with both roundings (a "flip") allowed,
    and the count is reported so a large one explains a loose bound; ``suspects``:
    ``{token: (slot j, global expert, correlation)}`` for violating tokens, the top-k slot whose weighted
    contribution ``w[t, j] * y[t, j]`` best explains the token's error vector ``candidate[t] - reference[t]``
    (largest ``|cos|``; a dropped slot gives -1, a slot routed to the wrong expert or computed wrong
    correlates with its own contribution; the cosine's sums are taken in one fixed pairwise order, so a run of
    either engine gives the same float64 value: :func:`_slot_correlations`); a GEMM-level report names the row
    and its expert instead.
    """

    profile: Profile
    error: np.ndarray
    bound: np.ndarray
    violations: np.ndarray
    token_violations: np.ndarray
    expert_violations: dict
    metrics: dict
    checks: dict
    flips: int = 0
    label: str = ""
    topk_ids: np.ndarray | None = field(default=None, repr=False)
    suspects: dict = field(default_factory=dict, repr=False)
    row_name: str = "token"

    @property
    def passed(self) -> bool:
        return not bool(self.violations.any())

    @property
    def num_violations(self) -> int:
        return int(self.violations.sum())

    def violations_by_token(self) -> dict:
        """``{token: int array of the violating columns}`` for every violating token."""
        t, c = np.nonzero(self.violations)
        return {int(k): c[t == k] for k in np.unique(t)}

    def violations_by_expert(self) -> dict:
        """``{global expert: int array of violating tokens routed to it}``."""
        if self.topk_ids is None:
            return {}
        bad = np.flatnonzero(self.token_violations)
        out: dict = {}
        for e in np.unique(self.topk_ids[bad][self.topk_ids[bad] >= 0]).tolist():
            out[int(e)] = bad[(self.topk_ids[bad] == e).any(axis=1)]
        return out

    def worst_tokens(self, n: int = 5) -> list[dict]:
        """Up to ``n`` violating tokens, worst ``error / bound`` first."""
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(np.isnan(self.error), np.inf, self.error / np.maximum(self.bound, 1e-300))
        bad = np.flatnonzero(self.token_violations)
        if bad.size == 0:
            return []
        worst = ratio[bad].max(axis=1)
        order = bad[np.argsort(-worst, kind="stable")][:n]
        out = []
        for t in order.tolist():
            col = int(np.argmax(np.where(self.violations[t], ratio[t], -np.inf)))
            experts = [] if self.topk_ids is None else [int(e) for e in self.topk_ids[t] if e >= 0]
            slot, expert, corr = self.suspects.get(t, (None, None, None))
            out.append({"token": t, "elements": int(self.token_violations[t]), "column": col,
                        "error": float(self.error[t, col]), "bound": float(self.bound[t, col]),
                        "ratio": float(ratio[t, col]), "experts": experts, "slot": slot,
                        "slot_expert": expert, "correlation": corr})
        return out

    def to_dict(self, worst: int = 5) -> dict:
        """The report as JSON-ready data (``moeref check|replay --json``): the verdict, label,
        profile, shape, counts, :func:`metrics`, the conventional checks, the ``worst`` rows of
        :meth:`worst_tokens` and the violating rows per expert. Built from Python ints, floats,
        strings and bools only; a non-finite float (a NaN error, an infinite ratio) is written as
        the string ``"nan"``, ``"inf"`` or ``"-inf"``, so the output is strict JSON."""
        m, k = self.error.shape if self.error.ndim == 2 else (self.error.size, 1)
        return _jsonable({
            "passed": self.passed, "label": self.label, "profile": self.profile.name,
            "shape": [m, k], "row_name": self.row_name, "violations": self.num_violations,
            "rows_with_violations": int((self.token_violations > 0).sum()),
            "intermediate_flips_allowed": self.flips, "metrics": self.metrics,
            "conventional_checks": self.checks, "worst": self.worst_tokens(worst),
            "expert_violations": {str(e): c for e, c in self.expert_violations.items()},
        })

    @staticmethod
    def _suspect(w: dict) -> str:
        if w["slot"] is None:
            return f"experts {w['experts']}"
        if w["correlation"] is None:
            return f"expert {w['slot_expert']}"
        return (f"slot j={w['slot']} -> expert {w['slot_expert']} (error corr {w['correlation']:+.2f}); "
                f"experts {w['experts']}")

    def summary(self) -> str:
        """Plain-text report."""
        m, k = self.error.shape if self.error.ndim == 2 else (self.error.size, 1)
        head = f"{'PASS' if self.passed else 'FAIL'} {self.label} [{self.profile.name}] {m}x{k}: "
        head += (f"{self.num_violations} element(s) beyond the bound in {int((self.token_violations > 0).sum())} "
                 f"{self.row_name}(s)")
        lines = [head]
        mt = self.metrics
        lines.append(
            f"  rel_l2={mt['rel_l2']:.3g} calc_diff={mt['calc_diff']:.3g} sqnr={mt['sqnr_db']:.1f}dB "
            f"cosine={mt['cosine']:.6f} max_abs={mt['max_abs']:.3g}"
        )
        if self.flips:
            lines.append(f"  intermediate flips allowed: {self.flips} (GEMM output, activation or re-quantized "
                         "elements so close to a rounding boundary that the declared arithmetic may round them "
                         "either way; the bound covers both)")
        lines.append("  conventional: " + ", ".join(f"{n}: {'pass' if ok else 'FAIL'}" for n, ok in self.checks.items()))
        for w in self.worst_tokens():
            lines.append(
                f"  {self.row_name} {w['token']}: {w['elements']} element(s), worst col {w['column']} "
                f"|err|={w['error']:.3g} > bound {w['bound']:.3g} (x{w['ratio']:.3g}); {self._suspect(w)}"
            )
        if self.expert_violations:
            top = sorted(self.expert_violations.items(), key=lambda kv: -kv[1])[:8]
            lines.append("  experts of violating tokens: " + ", ".join(f"{e}:{c}" for e, c in top))
        return "\n".join(lines)

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        ok = self.passed
        title = Text(f"{'PASS' if ok else 'FAIL'} ", style="bold green" if ok else "bold red")
        title.append(f"{self.label} [{self.profile.name}]: {self.num_violations} element(s) beyond the bound, "
                     f"{int((self.token_violations > 0).sum())} {self.row_name}(s)")
        mt = self.metrics
        conv = Table(title="conventional checks", show_header=True)
        conv.add_column("check")
        conv.add_column("result")
        for n, passed in self.checks.items():
            conv.add_row(n, Text("pass", style="green") if passed else Text("FAIL", style="red"))
        conv.add_row("rel_l2 / calc_diff / SQNR / cosine",
                     f"{mt['rel_l2']:.3g} / {mt['calc_diff']:.3g} / {mt['sqnr_db']:.1f} dB / {mt['cosine']:.5f}")
        parts = [title, conv]
        worst = self.worst_tokens()
        if worst:
            t = Table(title=f"worst {self.row_name}s", show_header=True)
            for c in (self.row_name, "elements", "col", "|err|", "bound", "x bound", "suspect"):
                t.add_column(c)
            for w in worst:
                t.add_row(str(w["token"]), str(w["elements"]), str(w["column"]), f"{w['error']:.3g}",
                          f"{w['bound']:.3g}", Text(f"{w['ratio']:.3g}", style="red"), self._suspect(w))
            parts.append(t)
        return Group(*parts)


def _jsonable(obj):
    """``obj`` with NumPy scalars as Python numbers, tuples as lists, and non-finite floats as
    the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON has no such numbers)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if np.isfinite(v) else ("nan" if np.isnan(v) else ("inf" if v > 0 else "-inf"))
    return obj


_SUSPECT_BATCH_ELEMENTS = {"host": 1 << 18, "device": 1 << 25}
"""Elements of one token batch's ``[T, k, K]`` slot contributions in :func:`_slot_correlations`: on the host a
batch that stays in the CPU's cache (2 MiB of float64; a larger one runs about twice as long), on a device one
large enough that kernel launches do not dominate (256 MiB). The result does not depend on it: each token's
sums are its own."""


def _slot_suspects(reference, diff, tokens: np.ndarray) -> dict:
    """``{token: (slot j, global expert, correlation)}``: per violating token, the slot whose weighted
    contribution has the largest ``|cos|`` with the token's error vector ``diff[t]`` (see :class:`Report`).

    ``diff``: ``candidate - reference`` ``[M, K]``, a NumPy array (a NumPy-engine run) or a tensor on the run's
    device (a device-engine run: the contributions are gathered, weighted and reduced there, and only the
    ``[T, k]`` correlations come back). Either way only the violating ``tokens``' slot rows are read: slot
    ``t*k + j``'s layout row is found by inverting ``p.src`` (a slot no row holds, dropped or mapped to no local
    expert, contributes a zero row), multiplied by ``w[t, j]`` where the chunk applies the weights; the
    correlation is :func:`_slot_correlations`' (one formula on both engines, so the same float64 value)."""
    out: dict = {}
    start = 0
    for p, e in reference.chunks:
        n, k = p.num_tokens, p.top_k
        sel = tokens[(tokens >= start) & (tokens < start + n)]
        if sel.size and k and int(np.prod(e.y.shape)):
            slot_row = np.full(n * k, -1, dtype=np.int64)  # layout row holding slot t*k + j, -1 none
            rows = np.flatnonzero(p.src >= 0)
            slot_row[p.src[rows]] = rows
            corr = _slot_correlations(e.y, slot_row.reshape(n, k)[sel - start],
                                      p.topk_weights if p.apply_weights else None, sel - start, diff, sel)
            corr = np.nan_to_num(corr, nan=0.0)
            j = np.argmax(np.abs(corr), axis=1)
            for t, jj, cc in zip(sel.tolist(), j.tolist(), corr[np.arange(sel.size), j].tolist()):
                if cc != 0.0:  # a NaN/Inf or zero error vector names no slot
                    out[t] = (int(jj), int(p.topk_ids[t - start, jj]), float(cc))
        start += n
    return out


def _slot_correlations(y, slot_rows: np.ndarray, weights, local: np.ndarray, diff, tokens: np.ndarray) -> np.ndarray:
    """float64 ``[T, k]``: ``cos(c[t, j], d[t]) = sum(c d) / (sqrt(sum(c c)) sqrt(sum(d d)))`` (NaN where a norm
    is zero or a value is not finite; the caller maps NaN to 0) of the slot contributions ``c[t, j] = y[slot_rows[t,
    j]]`` (a zero row where ``slot_rows`` is -1), times ``weights[local[t], j]`` unless ``weights`` is None, and
    the error vectors ``d[t] = diff[tokens[t]]`` with NaN and +-Inf set to 0.

    One formula on NumPy arrays and on torch tensors (``y``, ``weights`` and ``diff`` on one device): the
    elementwise products and the sums by :func:`_halving_sum` where the data are (multiplications and additions
    only: correctly rounded float64 operations in both libraries, on any device), then the three ``[T, k]`` /
    ``[T]`` sums on the host, where NumPy takes the square roots and the quotient. So a device-engine run's
    correlations are the NumPy engine's bit for bit: a library reduction (``einsum``, ``norm``, ``torch.sum``)
    would sum in its own order, and torch's CPU ``sqrt`` is not correctly rounded (torch 2.13, AVX-512: one
    result in about a hundred differs from NumPy's in the last bit)."""
    from .. import _interop

    if _interop.is_torch_tensor(diff):
        import torch

        dev = diff.device
        lib, batch_elements = torch, _SUSPECT_BATCH_ELEMENTS["device"]

        def take(a, idx):  # float64 rows idx of a (idx [T] or [T, k], host) on the device
            return a.index_select(0, _interop.to_device(idx.ravel(), dev)).view(*idx.shape, -1).to(torch.float64)

        def clear(c, rows):  # zero the slots rows [T, k] (host) of c (no mask indexing: it would wait for the device)
            c.masked_fill_(_interop.to_device(rows, dev)[:, :, None], 0.0)
    else:
        lib, batch_elements = np, _SUSPECT_BATCH_ELEMENTS["host"]
        y, weights = _host(y), None if weights is None else _host(weights)

        def take(a, idx):  # a float64 copy of the rows idx of a
            return np.asarray(a[idx], dtype=np.float64)

        def clear(c, rows):
            c[rows] = 0.0
    t_all, k = slot_rows.shape
    batch = max(1, batch_elements // max(k * int(y.shape[1]), 1))
    dots, squares = [], []
    with np.errstate(all="ignore"):  # overflow, 0 * Inf: the NaN/Inf conventions above
        d = lib.nan_to_num(take(diff, tokens), nan=0.0, posinf=0.0, neginf=0.0)    # [T, K]
        d_squares = _halving_sum(d * d)
        for b0 in range(0, t_all, batch):
            b1 = min(b0 + batch, t_all)
            missing = slot_rows[b0:b1] < 0
            c = take(y, np.where(missing, 0, slot_rows[b0:b1]))                     # [Tb, k, K], written below
            if missing.any():
                clear(c, missing)
            if weights is not None:
                c *= take(weights, local[b0:b1])[:, :, None]
            dots.append(_halving_sum(c * d[b0:b1, None, :]))
            c *= c
            squares.append(_halving_sum(c))
    if lib is np:
        dot, c_squares = np.concatenate(dots, axis=0), np.concatenate(squares, axis=0)
    else:
        dot, c_squares, d_squares = _to_host(torch.cat(dots, dim=0), torch.cat(squares, dim=0), d_squares)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return dot / (np.sqrt(c_squares) * np.sqrt(d_squares)[:, None])


def _halving_sum(x):
    """``x`` summed over its last axis (n > 0 elements) in one fixed order, the same for a NumPy array and a torch
    tensor on any device: with ``h`` the largest power of two below ``n``, element ``i < n - h`` gets element
    ``i + h`` added, and so on over the first ``h`` elements until one is left (a pairwise sum: its rounding
    error grows with ``log2 n``, as NumPy's). ``x`` is overwritten (a fresh array or tensor of the caller's)."""
    n = int(x.shape[-1])
    while n > 1:
        h = 1 << ((n - 1).bit_length() - 1)
        a, b = x[..., :n - h], x[..., h:n]
        if isinstance(x, np.ndarray):
            np.add(a, b, out=a)
        else:
            a.add_(b)
        n = h
    return x[..., 0].copy() if isinstance(x, np.ndarray) else x[..., 0].clone()


def _host(x) -> np.ndarray:
    """A NumPy array of ``x`` (a device tensor of a device-engine run is copied to the host)."""
    from .. import _interop

    return np.asarray(_interop.to_numpy(x.cpu() if hasattr(x, "cpu") else x))


def compare(candidate, reference, profile, *, label: str = "") -> Report:
    """Check ``candidate`` (float ``[M, K]``, any dtype incl. bf16/torch on any device) against a traced
    reference run (:func:`moeref.moe.run_moe`), or the inputs of one (a
    :class:`moeref.compare.faults.LayerCase`, run here), under the arithmetic ``profile`` declares (a
    :class:`Profile` or its name in :data:`moeref.compare.PROFILES`, e.g. ``"FP32_ACCUM"``)."""
    from .. import _interop

    check_compare_args(candidate, reference)
    profile = get_profile(profile)

    if not hasattr(reference, "chunks"):
        from .faults import reference as run_reference

        reference = run_reference(reference)
    if _interop.is_torch_tensor(reference.output):  # a device-engine run: checks and metrics on its device
        return _compare_on_device(candidate, reference, profile, label)
    c = np.asarray(_interop.to_numpy(candidate)).astype(np.float64)
    r = np.asarray(_host(reference.output), dtype=np.float64)
    if c.shape != r.shape:
        raise ValueError(f"candidate has shape {c.shape} but the reference output has {r.shape}")
    lb = layer_bound(reference, profile)
    err = np.abs(c - r)
    ok = err <= lb.bound
    if np.isnan(err).any():  # NaN in both passes
        ok |= np.isnan(c) & np.isnan(r)
    m = metrics(c, r)
    return _report(profile, reference, err, lb.bound, ~ok, m, conventional_checks(c, r, calc_diff=m["calc_diff"]),
                   lb.flips, label, lambda: c - r)


def check_compare_args(candidate, reference, *, call: str = "compare(candidate, reference, profile)",
                       accepted: str = "a traced run (moeref.moe.run_moe) or a moeref.compare.faults.LayerCase"):
    """``TypeError`` unless ``candidate`` is an output (a NumPy array or a torch tensor, on any device) and
    ``reference`` one of ``accepted`` (a run has ``chunks``), naming the call and saying when the two look
    swapped, instead of an ``AttributeError`` from deep inside the reference."""
    from .. import _interop
    from .faults import LayerCase

    def is_output(x):
        return isinstance(x, np.ndarray) or _interop.is_torch_tensor(x)

    if not is_output(candidate):
        swapped = " (the arguments swapped? the kernel's output comes first)" if is_output(reference) else ""
        raise TypeError(f"{call}: candidate must be the kernel's output, a NumPy array or a torch tensor; got "
                        f"{type(candidate).__name__}{swapped}")
    if not (hasattr(reference, "chunks") or isinstance(reference, LayerCase)):
        array = " (an output array: give the run or the layer's inputs it is computed from)" if is_output(reference) \
            else ""
        raise TypeError(f"{call}: the reference must be {accepted}; got {type(reference).__name__}{array}")


def _report(profile, reference, err, bound, viol, m, checks, flips, label, diff, tok=None) -> Report:
    """The :class:`Report` of the element checks (NumPy arrays); ``diff()``: ``candidate - reference`` (a NumPy
    array, or a tensor on a device-engine run's device, never copied whole to the host), asked for only when a
    token violates (the suspects: :func:`_slot_suspects`); ``tok``: the violations per token when the caller
    counted them (on the device), else counted here."""
    if tok is None:
        tok = viol.sum(axis=1) if viol.ndim == 2 else viol.astype(np.int64)
    ids = [p.topk_ids for p, _ in reference.chunks]
    topk_ids = np.concatenate(ids, axis=0) if ids else None
    experts: dict = {}
    if topk_ids is not None and topk_ids.size and tok.any():
        sel = topk_ids[tok > 0]
        e, cnt = np.unique(sel[sel >= 0], return_counts=True)
        experts = {int(a): int(b) for a, b in zip(e, cnt)}
    suspects = _slot_suspects(reference, diff(), np.flatnonzero(tok)) if tok.any() else {}
    return Report(profile, err, bound, viol, tok, experts, m, checks, flips, label, topk_ids, suspects)


def _compare_on_device(candidate, reference, profile, label: str) -> Report:
    """:func:`compare` of a device-engine run on its device: the bound (:func:`layer_bound` there), the element
    checks, :func:`metrics` and :func:`conventional_checks` in float64 torch operations on the device (the
    same formulas; the sums in torch's order, not NumPy's: metrics are for orientation); the Report's
    arrays are host copies of the device results (one copy each, into one page-locked buffer: :func:`_to_host`)."""
    import torch

    from .. import _interop

    r = reference.output.to(torch.float64)
    c = (candidate if _interop.is_torch_tensor(candidate)
         else torch.as_tensor(np.asarray(_interop.to_numpy(candidate)).astype(np.float64)))
    c = c.detach().to(device=r.device, dtype=torch.float64)
    if tuple(c.shape) != tuple(r.shape):
        raise ValueError(f"candidate has shape {tuple(c.shape)} but the reference output has {tuple(r.shape)}")
    lb = layer_bound(reference, profile)
    d = c - r
    err = d.abs()
    viol = ~((err <= lb.bound) | (torch.isnan(c) & torch.isnan(r)))  # NaN in both passes
    nr, nc, nd = (torch.linalg.vector_norm(x) for x in (r, c, d))
    denom = torch.sum(c * c + r * r)
    cr = torch.sum(c * r)
    ar = r.abs()
    close = [torch.all(err <= atol + rtol * ar) for _, atol, rtol in _TOLERANCES]
    mx = err.max() if err.numel() else torch.zeros((), dtype=torch.float64, device=r.device)
    host = torch.stack([nr, nc, nd, denom, cr, mx, *(x.to(torch.float64) for x in close)]).cpu().numpy()
    nr, nc, nd, denom, cr, mx = (float(x) for x in host[:6])
    m = _metric_values(nr, nc, nd, denom, cr, mx)
    checks = _checks([bool(x) for x in host[6:]], m["calc_diff"])
    tok = viol.sum(dim=1) if viol.dim() == 2 else viol.to(torch.int64)  # int64, as NumPy's sum of bools
    err_h, bound_h, viol_h, tok_h = _to_host(err, lb.bound, viol, tok)
    return _report(profile, reference, err_h, bound_h, viol_h, m, checks, lb.flips, label, lambda: d,
                   tok_h)


def _to_host(*tensors) -> list:
    """NumPy copies of device ``tensors``: on a CUDA device through one page-locked buffer that
    the copies fill queued on the stream (no pageable staging), one wait at the end; the arrays are views of
    that buffer (it lives as long as they do). Elsewhere ``Tensor.numpy()`` of ``.cpu()``."""
    import torch

    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu().numpy() for t in tensors]
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = np.concatenate([[0], np.cumsum([-(-n // 8) * 8 for n in sizes])]).tolist()  # 8-byte aligned
    buf = torch.empty(int(starts[-1]), dtype=torch.uint8, pin_memory=True)
    out = []
    for t, s0, n in zip(tensors, starts, sizes):
        view = buf[s0:s0 + n].view(t.dtype).view(t.shape)
        view.copy_(t, non_blocking=True)
        out.append(view)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [v.numpy() for v in out]
