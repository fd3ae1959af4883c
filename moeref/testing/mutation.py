"""Mutation score: how many of the library's planted faults a user's own check catches, run through the
user's own kernel wrapper.

For each drawn case, the kernel wrapper runs on the case made faulty (a dropped top-k slot, gate and up
swapped, a token routed to a wrong expert, router weights applied twice, a weight scale from the
neighbouring block: :data:`moeref.compare.faults.FAULTY_INPUTS`), or its output is corrupted (all zero,
row 0 NaN: :data:`~moeref.compare.faults.FAULTY_OUTPUTS`), and the user's check judges the output against
the ORIGINAL case. A check that raises ``AssertionError`` caught the mutant. The unmutated kernel must
pass the check first (else the score means nothing: it is reported as ``baseline_failures``). Faults a
case cannot express (no free expert for token 0, one scale per expert) are skipped for that case, and so
are equivalent mutants, whose output is bit for bit the unmutated output (router weights of 1 squared,
a dropped slot whose weight is 0): no check can tell them apart, so they are counted in ``equivalent``.
Faults inside a kernel (skipped re-quantization, off-by-one offsets) cannot be planted from outside:
they are what the checks exist to find.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import _interop

__all__ = ["MutationResult", "mutation_score", "default_check"]


@dataclass
class MutationResult:
    """``caught[fault]`` / ``tried[fault]``: cases in which the check caught that fault (of those where it
    applied); ``errors``: ``(fault, case index, message)`` where the wrapper or check raised something
    other than AssertionError; ``baseline_failures``: case indices where the unmutated kernel already
    failed the check."""

    caught: dict = field(default_factory=dict)
    tried: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    baseline_failures: list = field(default_factory=list)
    equivalent: int = 0

    @property
    def score(self) -> float:
        """Caught mutants / tried mutants (NaN when nothing was tried)."""
        t = sum(self.tried.values())
        return sum(self.caught.values()) / t if t else float("nan")

    def to_dict(self) -> dict:
        """The result as JSON-ready data (``moeref mutate --json``): caught and tried counts per
        fault, the score (None when nothing was tried), equivalent mutants skipped, the cases the
        unmutated kernel failed, and the errors as ``{"fault", "case", "message"}``."""
        t = sum(self.tried.values())
        return {"score": self.score if t else None, "caught": sum(self.caught.values()), "tried": t,
                "equivalent": int(self.equivalent),
                "faults": [{"fault": n, "caught": int(self.caught.get(n, 0)), "tried": int(v)}
                           for n, v in self.tried.items()],
                "baseline_failures": [int(i) for i in self.baseline_failures],
                "errors": [{"fault": f, "case": int(i), "message": str(m)} for f, i, m in self.errors]}

    def summary(self) -> str:
        lines = [f"mutation score {sum(self.caught.values())}/{sum(self.tried.values())} = {self.score:.0%}"
                 + (f" ({self.equivalent} equivalent mutant(s) skipped)" if self.equivalent else "")]
        for name in self.tried:
            lines.append(f"  {self.caught[name]}/{self.tried[name]}  {name}")
        if self.baseline_failures:
            lines.append(f"  the unmutated kernel FAILED the check on cases {self.baseline_failures}")
        for f, i, msg in self.errors[:5]:
            lines.append(f"  error in {f!r} case {i}: {msg}")
        return "\n".join(lines)


def default_check(profile):
    """The check ``(case, output) -> None`` that :func:`moeref.testing.assert_moe_close` makes with ``profile``."""
    from .asserts import assert_moe_close

    def check(case, out):
        assert_moe_close(out, case, profile)

    return check


def _as_inputs(case, dtype: str):
    """A LayerCase with float weights -> KernelInputs (values kept: the case is already in the kernel's dtype)."""
    from ..gemm.exact import as_operand
    from .inputs import KernelInputs, as_kernel_sees

    w = case.weights
    w13 = np.stack([as_operand(x).dequantize() for x in w.w13])
    w2 = np.stack([as_operand(x).dequantize() for x in w.w2])
    return KernelInputs(as_kernel_sees(np.asarray(case.hidden, np.float64), dtype), as_kernel_sees(w13, dtype),
                        as_kernel_sees(w2, dtype), np.asarray(case.topk_weights, np.float32),
                        np.asarray(case.topk_ids).astype(np.int32), w.w13_layout, dtype)


def mutation_score(kernel, cases, check=None, *, profile="BF16_OUTPUT") -> MutationResult:
    """Run every planted fault through ``kernel`` on every case and count what ``check`` catches.

    ``kernel``: ``KernelInputs -> output [M, K]`` (NumPy or torch); it must honour ``w13_layout``
    (``gate_up`` for every drawn case) and read the inputs only (:meth:`KernelInputs.torch` gives the
    tensors). ``cases``: :class:`~moeref.testing.KernelInputs` (e.g. :func:`moeref.testing.draw_cases`).
    ``check``: ``(case: KernelInputs, output) -> None``, raising ``AssertionError`` on a mismatch; default
    :func:`default_check` with ``profile``. The check is given the output as the kernel returned it (a torch
    kernel's check gets a torch tensor of the kernel's dtype and device, as in the user's own tests); a
    corrupted output (:data:`~moeref.compare.faults.FAULTY_OUTPUTS`) is handed over in that same type.

    An exception other than ``AssertionError`` from the wrapper or the check on an unmutated case propagates
    (the score would mean nothing) with ``moeref_origin`` set on it: ``(what, case index)``, ``what`` being
    ``"kernel"`` or ``"check"`` (``moeref mutate`` prints the traceback and names your function).
    """
    from ..compare.faults import FAULTY_INPUTS, FAULTY_OUTPUTS

    check = default_check(profile) if check is None else check
    res = MutationResult()
    names = list(FAULTY_INPUTS) + list(FAULTY_OUTPUTS)
    for name in names:
        res.caught[name] = 0
        res.tried[name] = 0
    for i, ki in enumerate(cases):
        out = _blame(kernel, "kernel", i, ki)
        out_np = _host(out)
        try:
            _blame(check, "check", i, ki, out)
        except AssertionError:
            res.baseline_failures.append(i)
            continue
        lc = ki.layer_case()
        for name in names:
            bad = None
            if name in FAULTY_INPUTS:
                try:
                    bad = _as_inputs(FAULTY_INPUTS[name](lc), ki.dtype).with_(meta=ki.meta)
                except ValueError:  # the fault does not apply to this case
                    continue
            try:
                mutant = kernel(bad) if bad is not None else _like(FAULTY_OUTPUTS[name](out_np), out)
                mutant_np = _host(mutant)
            except Exception as exc:  # noqa: BLE001 - the wrapper failed on the mutant: reported
                res.tried[name] += 1
                res.errors.append((name, i, f"the kernel wrapper raised {type(exc).__name__}: {exc}"))
                continue
            if mutant_np.shape == out_np.shape and np.array_equal(mutant_np, out_np, equal_nan=True):
                res.equivalent += 1
                continue
            res.tried[name] += 1
            try:
                check(ki, mutant)
            except AssertionError:
                res.caught[name] += 1
            except Exception as exc:  # noqa: BLE001 - reported, never swallowed silently
                res.errors.append((name, i, f"the check raised {type(exc).__name__}: {exc}"))
    return res


def _host(out) -> np.ndarray:
    """The kernel's output as a NumPy array (ml_dtypes for bf16), for comparing mutants with it."""
    return np.asarray(_interop.to_numpy(out))


def _like(values: np.ndarray, out):
    """``values`` in the type of the kernel's output ``out``: a torch tensor of its dtype on its device when the
    kernel returned one, else the NumPy array."""
    if _interop.is_torch_tensor(out):
        return _interop.to_torch(values, out.device).to(out.dtype)
    return values


def _blame(fn, what: str, case: int, *args):
    """``fn(*args)``; an exception other than ``AssertionError`` leaves with ``moeref_origin = (what, case)``."""
    try:
        return fn(*args)
    except AssertionError:
        raise
    except Exception as exc:
        exc.moeref_origin = (what, case)
        raise
