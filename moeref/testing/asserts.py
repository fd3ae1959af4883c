"""Assertions for kernel authors: a kernel's output against moeref's exact reference, within the error
bound of a declared arithmetic (a :class:`~moeref.compare.Profile` or its name).

* :func:`assert_moe_close`: a whole MoE layer (:func:`moeref.compare.compare` with the report in the
  exception).
* :func:`assert_grouped_gemm_close` / :func:`grouped_gemm_report`: one grouped GEMM in any dispatch
  layout (contiguous, masked, batched, standard, torch ``offs``), operands given as the kernel's own
  tensors (dense tensors, ``(elements, scales)`` pairs in the kernel's scale layouts, quantized tensors)
  or as a :class:`moeref.moe.mapping.GroupedGemmCall` from an adapter.

GEMM bound: per expert, :func:`moeref.compare.bounds.gemm_error_bound` under the profile (the
accumulation, with the bias where the profile's ``bias_add`` puts it), plus the rounding of the stored
output ``u_out (|C| + bound)``, with ``u_out`` the larger of the profile's ``gemm_out_unit`` and the unit
roundoff of the candidate's dtype (bf16 ``2^-8``, fp16 ``2^-11``, fp32 ``2^-24``; a float64 candidate adds
only the profile's). ``bias_add="after_store"``: the product without the bias is stored (``u_out``), the
bias added in FP32 (``promote_unit``) and the sum stored again (``u_out``). Padding rows (``row_expert``
-1) are unspecified in every kernel and never compared.
"""
from __future__ import annotations

import numpy as np

from .. import _interop
from ..compare.kernel_profiles import get_profile
from ..compare.report import Report, check_compare_args, compare, conventional_checks, metrics

__all__ = ["MoEMismatch", "assert_moe_close", "assert_grouped_gemm_close", "grouped_gemm_report", "GEMM_LAYOUTS",
           "check_candidate_dtype"]

GEMM_LAYOUTS = ("contiguous", "masked", "batched", "standard", "offsets")

_UNIT = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 0.0}


class MoEMismatch(AssertionError):
    """A kernel's output exceeds the declared bound; ``report`` is the :class:`moeref.compare.Report`;
    ``case`` / ``candidate``: the layer call and output when known (the pytest plugin saves them as a
    reproducer)."""

    def __init__(self, report: Report, case=None, candidate=None):
        self.report = report
        self.case = case
        self.candidate = candidate
        super().__init__(report.summary())


def assert_moe_close(candidate, reference_run, profile=None, *, label: str = "", regime: str | None = None) -> Report:
    """Raise :class:`MoEMismatch` (an ``AssertionError`` carrying the report) unless every element of
    ``candidate`` (``[M, K]``, NumPy or torch on any device, any float dtype) lies within the bound of
    ``profile`` (a :class:`~moeref.compare.Profile` or its name, e.g. ``"BF16_OUTPUT"``) around the
    traced reference ``reference_run`` (:func:`moeref.moe.run_moe`, or a
    :class:`moeref.compare.faults.LayerCase`, or a :class:`moeref.testing.KernelInputs`, whose reference is
    run here). Returns the report when it passes.

    ``TypeError`` before any work when the arguments are of the wrong kind (the output comes first) or the
    candidate's dtype is not the output store ``profile`` declares (:func:`check_candidate_dtype`).

    ``regime="exact"``: no bound, equality (:func:`moeref.regimes.equality.moe_equality_report`: the
    reference rounded once to the candidate's dtype; the report names the differing elements' token,
    experts and slots). Sound for any kernel on exact-regime inputs (a :class:`moeref.regimes.ExactLayer`
    may be passed as ``reference_run``); ``profile`` is then not used. Returns the equality report."""
    from .inputs import KernelInputs

    case = None
    if isinstance(reference_run, KernelInputs):
        reference_run = reference_run.layer_case()
    if regime is not None:
        return _assert_exact(candidate, reference_run, regime, label)
    if profile is None:
        raise TypeError("assert_moe_close needs a profile (or regime='exact')")
    check_compare_args(candidate, reference_run, call="assert_moe_close(candidate, reference_run, profile)",
                       accepted="a KernelInputs (moeref.testing.kernel_inputs), a LayerCase or a traced run "
                                "(moeref.moe.run_moe)")
    profile = get_profile(profile)
    check_candidate_dtype(candidate, profile)
    if not hasattr(reference_run, "chunks"):
        case = reference_run
    report = compare(candidate, reference_run, profile, label=label)
    if not report.passed:
        raise MoEMismatch(report, case, np.array(_interop.to_numpy(candidate), copy=True) if case is not None else None)
    return report


def check_candidate_dtype(candidate, profile, *, store: str = "out_dtype") -> None:
    """``TypeError`` unless ``candidate`` (an array or tensor, or a dtype name) has the dtype of the output
    store ``profile`` declares: :attr:`~moeref.compare.Profile.out_dtype` for a layer, ``store="gemm_out_dtype"``
    for a grouped GEMM. A profile that declares no store (``None``: ``FP32_ACCUM``, ``EXACT``) takes any dtype.
    The bound of a declared bf16 store allows the bf16 rounding of every element (flips included), so an fp16,
    fp32 or float64 output would pass it while no bf16 store could produce it: the kernel's output is checked
    as it stores it, under the profile of that store."""
    from ..compare import PROFILES

    declared = getattr(profile, store)
    if declared is None:
        return
    got = candidate if isinstance(candidate, str) else _dtype_name(candidate)
    if got != declared:
        fits = [n for n, p in PROFILES.items() if getattr(p, store) in (None, got)]
        raise TypeError(f"the candidate is {got} but profile {profile.name} declares a {declared} output store "
                        f"(Profile.{store}={declared!r}): pass the kernel's output as the kernel stores it, or check "
                        f"with a profile that declares a {got} store or none ({', '.join(fits)})")


def _assert_exact(candidate, reference, regime, label: str):
    """``regime="exact"``: equality with the report of :mod:`moeref.regimes.equality`."""
    from ..regimes.equality import moe_equality_report

    if regime != "exact":
        raise ValueError(f"regime must be 'exact' or None; got {regime!r}")
    report = moe_equality_report(candidate, reference, label=label)
    if not report.passed:
        case = None if hasattr(reference, "chunks") else getattr(reference, "case", reference)  # ExactLayer.case
        raise MoEMismatch(report, case, np.array(_interop.to_numpy(candidate), copy=True))
    return report


def _operand(x, name: str):
    from ..gemm.exact import as_operand
    from ..gemm.from_kernel import kernel_operand

    if isinstance(x, (tuple, list)) and len(x) == 2 and not np.isscalar(x[0]):
        return kernel_operand(x[0], x[1], name=name)
    if hasattr(x, "element_values") or type(x).__name__ == "BlockOperand":
        return as_operand(x, name)
    return kernel_operand(x, name=name)


def _experts(w, name: str) -> list:
    from ..gemm.from_kernel import kernel_expert_operands

    if isinstance(w, tuple) and len(w) == 2 and hasattr(w[0], "shape") and len(w[0].shape) == 3:
        return kernel_expert_operands(w[0], w[1], name=name)
    if isinstance(w, (list, tuple)):
        return [_operand(x, f"{name}[{i}]") for i, x in enumerate(w)]
    if hasattr(w, "shape") and len(w.shape) == 3:
        return kernel_expert_operands(w, name=name)
    raise TypeError(f"{name} must be [E, N, K] (tensor or (elements, scales) pair) or a list of per-expert "
                    f"operands; got {type(w).__name__}")


def _rows_from_layout(layout, a_rows: int, num_experts: int, m_indices, masked_m, offs, topk_ids):
    from ..dispatch.grouping import group_slots

    if layout not in GEMM_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(GEMM_LAYOUTS)}; got {layout!r}")
    arr = lambda x: np.asarray(_interop.to_numpy(x)).astype(np.int64).reshape(-1)  # noqa: E731
    if layout == "contiguous":
        if m_indices is None:
            raise ValueError("layout='contiguous' needs m_indices (int [M], -1 padding)")
        rows = arr(m_indices)
    elif layout in ("masked", "batched"):
        if masked_m is None:
            raise ValueError(f"layout={layout!r} needs masked_m (expert_num_tokens), int [E]")
        counts = arr(masked_m)
        if a_rows % max(counts.size, 1):
            raise ValueError(f"a has {a_rows} rows, not a multiple of the {counts.size} experts of masked_m")
        max_m = a_rows // max(counts.size, 1)
        if np.any((counts < 0) | (counts > max_m)):
            raise ValueError(f"masked_m must be in [0, {max_m}]; got {counts.tolist()}")
        rows = np.where(np.arange(max_m)[None, :] < counts[:, None], np.arange(counts.size)[:, None], -1).reshape(-1)
    elif layout == "offsets":
        from ..moe.mapping import _offs_rows

        rows = _offs_rows(offs, a_rows)
    else:
        if topk_ids is None:
            raise ValueError("layout='standard' needs topk_ids (int [M, k]); a holds the M token rows")
        g = group_slots(np.asarray(_interop.to_numpy(topk_ids)), num_experts)
        if g.num_tokens != a_rows:
            raise ValueError(f"topk_ids has {g.num_tokens} tokens but a has {a_rows} rows (layout='standard')")
        return g.local_ids.astype(np.int64)
    if rows.size != a_rows:
        raise ValueError(f"the layout gives {rows.size} rows but a has {a_rows}")
    return rows


def _dtype_name(x) -> str:
    if _interop.is_torch_tensor(x):
        return str(x.dtype).replace("torch.", "")
    return np.asarray(x).dtype.name


def _expert_bias(bias, num_experts: int, n: int):
    """``bias`` (NumPy or torch, any device) as float64 ``[E, N]``, or None."""
    if bias is None:
        return None
    b = np.asarray(_interop.to_numpy(bias))
    if b.dtype.kind not in "fV" and b.dtype.name != "bfloat16":
        raise TypeError(f"bias must be a float tensor [E, N]; got dtype {b.dtype}")
    b = b.astype(np.float64)
    if b.shape != (num_experts, n):
        raise ValueError(f"bias must be per expert, shape [E, N] = ({num_experts}, {n}); got {b.shape}")
    return b


def grouped_gemm_report(candidate=None, a=None, weights=None, profile="FP32_ACCUM", *, layout: str = "contiguous",
                        m_indices=None, masked_m=None, offs=None, topk_ids=None, bias=None, label: str = "",
                        regime: str | None = None) -> Report:
    """The :class:`~moeref.compare.Report` of a grouped GEMM ``out[r] = a[r] @ W[e(r)].T (+ bias[e(r)])``.

    ``candidate``: the kernel's output (``[R, N]``; masked/batched ``[E, max_m, N]``; standard ``[M, k, N]``),
    or a :class:`moeref.moe.mapping.GroupedGemmCall` (then ``a``, ``weights`` and the layout come from it).
    ``a``: ``[R, K]`` (masked/batched ``[E, max_m, K]``; standard: the ``[M, K]`` tokens) as a tensor, an
    ``(elements, scales)`` pair, a quantized tensor or an operand. ``weights``: ``[E, N, K]`` tensor or pair
    or a list of per-expert operands. ``bias``: optional per-expert float ``[E, N]`` (NumPy or torch), added
    where ``profile.bias_add`` says (module docstring). Rows are reported as ``row`` with their expert. The
    candidate's dtype must be the GEMM output store ``profile`` declares (``gemm_out_dtype``;
    :func:`check_candidate_dtype`)."""
    from ..compare.bounds import _rows_error_bound
    from ..gemm.exact import BlockOperand
    from ..gemm.grouped import expert_rows_gemm
    from ..moe.mapping import GroupedGemmCall

    profile = get_profile(profile)
    if isinstance(candidate, GroupedGemmCall):
        call = candidate
        if call.out is None:
            raise ValueError("the GroupedGemmCall holds no output (pass the kernel's d/out to the adapter)")
        op, ws, rows, cand, layout = call.a, call.weights, call.row_expert, call.out, call.layout
        cand_dtype = np.asarray(cand).dtype.name
    else:
        if candidate is None or a is None or weights is None:
            raise ValueError("give candidate, a and weights (or a GroupedGemmCall as candidate)")
        if not (isinstance(candidate, np.ndarray) or _interop.is_torch_tensor(candidate)):
            raise TypeError(f"grouped_gemm_report: candidate must be the kernel's output, a NumPy array or a torch "
                            f"tensor (or a GroupedGemmCall); got {type(candidate).__name__}")
        cand_dtype = _dtype_name(candidate)
        cand = np.asarray(_interop.to_numpy(candidate))
        if isinstance(a, (tuple, list)) and len(a) == 2 and hasattr(a[0], "shape") and len(a[0].shape) == 3:
            e, mm, k = (int(v) for v in a[0].shape)
            sc = a[1]
            a = (a[0].reshape(e * mm, k), None if sc is None else sc.reshape(e * mm, -1))
        elif hasattr(a, "shape") and len(a.shape) == 3 and not isinstance(a, BlockOperand):
            a = a.reshape(-1, a.shape[-1])
        op = _operand(a, "a")
        ws = _experts(weights, "weights")
        rows = _rows_from_layout(layout, op.shape[0], len(ws), m_indices, masked_m, offs, topk_ids)
        if layout == "standard":
            k = rows.size // max(op.shape[0], 1)
            op = op.take_rows(np.arange(rows.size) // max(k, 1))
        cand = cand.reshape(rows.size, -1)
    check_candidate_dtype(cand_dtype, profile, store="gemm_out_dtype")
    c = cand.astype(np.float64).reshape(rows.size, -1)
    b = _expert_bias(bias, len(ws), ws[0].shape[0] if len(ws) else 0)
    if b is not None and profile.accum_model == "emulated":
        raise ValueError(f"profile {profile.name} predicts a bias-free GEMM bit for bit; a bias needs a bound "
                         "profile (accum_model 'worst_case', 'contiguous_tree' or 'data_dependent')")
    ref = expert_rows_gemm(op, rows, ws, b)
    if ref.shape != c.shape:
        raise ValueError(f"candidate has {c.shape[1]} columns per row but the reference has {ref.shape[1]}")
    if regime is not None:  # equality (moeref.regimes.equality); the report names row, expert, token and slot
        from ..regimes.equality import gemm_equality_report

        if regime != "exact":
            raise ValueError(f"regime must be 'exact' or None; got {regime!r}")
        top_k = None if topk_ids is None or layout != "standard" else int(np.shape(_interop.to_numpy(topk_ids))[1])
        return gemm_equality_report(c, ref, rows, cand_dtype, top_k=top_k, label=label or f"grouped GEMM ({layout})")
    valid = rows >= 0
    err = np.where(valid[:, None], np.abs(c - ref), 0.0)
    if profile.accum_model == "emulated":  # a known kernel: its output predicted bit for bit, compared by equality
        from ..gemm.hopper_fp8 import deepgemm_engine
        from ..moe.pipeline import round_to_dtype

        pred = expert_rows_gemm(op, rows, ws, gemm=deepgemm_engine(promotion=profile.promotion_order))
        pred = round_to_dtype(pred, cand_dtype if cand_dtype in _UNIT else None)
        bound = np.where(valid[:, None], np.abs(pred - ref), 0.0)  # the error the kernel must make, exactly
        ok = (c == pred) | ~valid[:, None]
    else:
        u_out = max(profile.gemm_out_unit, _UNIT.get(cand_dtype, 0.0))
        if b is not None and profile.bias_add == "after_store":  # stored, the bias added in FP32, stored again
            bound = _rows_error_bound(op, None, rows, ws, None, profile)
            bound = bound + u_out * (np.abs(expert_rows_gemm(op, rows, ws)) + bound)
            bound = bound + profile.promote_unit * (np.abs(ref) + bound)
        else:
            bound = _rows_error_bound(op, None, rows, ws, b, profile)
        bound = bound + u_out * (np.abs(ref) + bound)
        ok = (err <= bound) | (np.isnan(c) & np.isnan(ref)) | ~valid[:, None]
    viol = ~ok
    tok = viol.sum(axis=1)
    experts: dict = {}
    if tok.any():
        e, cnt = np.unique(rows[tok > 0], return_counts=True)
        experts = {int(x): int(y) for x, y in zip(e, cnt)}
    suspects = {int(r): (0, int(rows[r]), None) for r in np.flatnonzero(tok)}
    cv, rv = c[valid], ref[valid]
    return Report(profile, err, bound, viol, tok, experts, metrics(cv, rv), conventional_checks(cv, rv), 0,
                  label or f"grouped GEMM ({layout})", rows[:, None], suspects, "row")


def assert_grouped_gemm_close(candidate=None, a=None, weights=None, profile="FP32_ACCUM", **kw) -> Report:
    """Raise :class:`MoEMismatch` unless the grouped GEMM ``candidate`` lies within ``profile``'s bound
    (:func:`grouped_gemm_report`, same arguments; ``regime="exact"``: equal to the exact product rounded
    once to the candidate's dtype, for inputs in an exact regime). Returns the report when it passes.

    >>> w = np.stack([np.eye(2), 2 * np.eye(2)]).astype(np.float32)
    >>> a = np.array([[1.0, 3.0], [2.0, 5.0]], np.float32)
    >>> r = assert_grouped_gemm_close(np.array([[1.0, 3.0], [4.0, 10.0]]), a, w, "FP32_ACCUM",
    ...                               layout="contiguous", m_indices=np.array([0, 1]))
    >>> r.passed
    True
    """
    report = grouped_gemm_report(candidate, a, weights, profile, **kw)
    if not report.passed:
        raise MoEMismatch(report)
    return report
