"""``moeref replay | check | mutate``: the kernel-validation subcommands of the ``moeref`` command
(registered by :func:`add_subcommands`; this module parses arguments and prints, the work is done by
:mod:`moeref.testing`).

* ``moeref replay FILE``: re-run a reproducer (either file) and print the report; exit 1 if it fails.
* ``moeref check INPUTS CANDIDATE``: the reference from saved inputs (a ``.safetensors`` of
  ``hidden_states``/``hidden``, ``w1``/``w13``, ``w2``, ``topk_weights``, ``topk_ids`` in vLLM's names,
  or FlashInfer's ``input``, ``fc1_expert_weights``, ``fc2_expert_weights``, ``token_final_scales``,
  ``token_selected_experts``; FP8 weights with ``w1_scale``/``w2_scale`` and ``--block-shape``) against a
  saved output (``.safetensors`` with one tensor or ``out``/``output``, or ``.npy``); the profile is
  ``--profile`` or suggested from the dtypes (:func:`moeref.compare.suggest_profile`). ``--regime``
  (:data:`moeref.testing.regime.REGIMES`): ``mixed`` (default) checks the bound, and equality as well when the
  inputs are in an exact regime, or in the single-rounding regime of the profile's stores (equality against the
  reference replayed with them); ``exact`` equality only; ``bounds`` the bound only. Exit 1 if it fails.
* ``moeref mutate MODULE:FUNCTION``: the mutation score of a kernel wrapper (``KernelInputs -> output``)
  under ``--check MODULE:FUNCTION`` (default: the bound check with ``--profile``, else the profile
  :func:`moeref.compare.suggest_profile` gives for the cases' dtype).

``--json`` on each prints one JSON object instead of the tables, for scripts and CI: the report
(:meth:`moeref.compare.Report.to_dict`; ``check`` adds the profile and why it was chosen) or the
mutation result (:meth:`moeref.testing.mutation.MutationResult.to_dict`); the exit status is the same.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np

from .._console import seed_argument

__all__ = ["add_subcommands"]

_KEYS = {
    "hidden": ("hidden_states", "hidden", "input", "a1"),
    "w13": ("w1", "w13", "fc1_expert_weights"),
    "w2": ("w2", "fc2_expert_weights"),
    "topk_weights": ("topk_weights", "token_final_scales"),
    "topk_ids": ("topk_ids", "token_selected_experts"),
}


def _print(obj) -> None:
    try:
        import rich  # noqa: F401 - the cli extra
    except ImportError:  # pragma: no cover - rich is in the cli extra
        print(obj.summary() if hasattr(obj, "summary") else obj)
        return
    from .._console import console

    console().print(obj if hasattr(obj, "__rich__") or not hasattr(obj, "summary") else obj.summary())


def _print_json(data) -> None:
    json.dump(data, sys.stdout, indent=1, allow_nan=False)
    sys.stdout.write("\n")


def _load_tensors(path: Path) -> dict:
    """All tensors of a ``.safetensors`` file (bf16/fp8 through torch when installed) or one ``.npy``."""
    from .. import _interop

    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if path.suffix == ".npy":
        return {"out": np.load(path)}
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: expected a .safetensors or .npy file")
    from safetensors import safe_open

    try:
        import torch  # noqa: F401

        framework = "pt"
    except ImportError:  # pragma: no cover
        framework = "numpy"
    with safe_open(str(path), framework=framework) as f:
        return {k: np.asarray(_interop.to_numpy(f.get_tensor(k))) for k in f.keys()}


def _pick(t: dict, what: str, path: Path):
    for k in _KEYS[what]:
        if k in t:
            return k, t[k]
    raise ValueError(f"{path} has no {what} tensor (looked for {', '.join(_KEYS[what])}; found {', '.join(t)})")


def _cmd_replay(args) -> int:
    from .reproducer import replay

    report = replay(args.file, profile=args.profile)
    if args.json:
        _print_json(report.to_dict())
    else:
        _print(report)
    return 0 if report.passed else 1


def _cmd_check(args) -> int:
    from types import SimpleNamespace

    from ..compare import compare, get_profile, suggest_profile
    from ..moe import run_moe
    from ..moe.mapping import from_flashinfer_cutlass, from_vllm_fused_experts
    from .asserts import check_candidate_dtype

    inputs, cand_path = Path(args.inputs), Path(args.candidate)
    t = _load_tensors(inputs)
    c = _load_tensors(cand_path)
    key = next((k for k in ("out", "output", "candidate") if k in c), None)
    if key is None and len(c) != 1:
        raise ValueError(f"{cand_path} holds {len(c)} tensors ({', '.join(c)}); name the output 'out'")
    cand = c[key] if key is not None else next(iter(c.values()))
    hk, hidden = _pick(t, "hidden", inputs)
    wk, w13 = _pick(t, "w13", inputs)
    _, w2 = _pick(t, "w2", inputs)
    _, tw = _pick(t, "topk_weights", inputs)
    _, ids = _pick(t, "topk_ids", inputs)
    if wk == "fc1_expert_weights":
        kw = from_flashinfer_cutlass(hidden, ids, tw, w13, w2, output_dtype=cand.dtype.name,
                                     activation=args.activation)
    else:
        qc = None
        if "w1_scale" in t:
            block = None if args.block_shape is None else [int(b) for b in args.block_shape.split(",")]
            qc = SimpleNamespace(quant_dtype="float8_e4m3fn", block_shape=block, w1_scale=t["w1_scale"],
                                 w2_scale=t.get("w2_scale"), per_act_token_quant=args.per_token,
                                 per_out_ch_quant=args.per_token, a1_scale=t.get("a1_scale"),
                                 a2_scale=t.get("a2_scale"))
        kw = from_vllm_fused_experts(hidden, w13, w2, tw, ids, args.activation.replace("_and_mul", ""), qc)
        kw["out_dtype"] = {"bfloat16": "bfloat16", "float16": np.float16}.get(cand.dtype.name, np.float32)
        if args.w13_layout != "gate_up":
            from dataclasses import replace

            kw["weights"] = replace(kw["weights"], w13_layout=args.w13_layout)
    if args.profile:
        profile = get_profile(args.profile)
        why = "given"
    else:
        profile = suggest_profile(w13.dtype.name, cand.dtype.name, kernel=args.kernel)
        why = f"suggested from the dtypes (weights {w13.dtype.name}, output {cand.dtype.name}); --profile to choose"
    check_candidate_dtype(cand, profile)
    run = run_moe(**kw)
    label = f"{cand_path.name} vs {inputs.name}"
    equality, regime_why = _regime_check(args.regime, cand, run, kw, profile, label)
    report = compare(cand, run, profile, label=label) if args.regime != "exact" else None
    passed = (report is None or report.passed) and (equality is None or equality.passed)
    if args.json:
        data = dict(report.to_dict(), profile_choice=why) if report is not None else {"profile_choice": why}
        data.update(passed=passed, regime=args.regime, regime_choice=regime_why,
                    equality=None if equality is None else equality.to_dict())
        _print_json(data)
    else:
        print(f"profile {profile.name}: {why}")
        print(f"regime {args.regime}: {regime_why}")
        for r in (equality, report):
            if r is not None:
                _print(r)
    return 0 if passed else 1


def _regime_check(regime: str, cand, run, kw: dict, profile, label: str):
    """``(equality report or None, why)`` of ``moeref check --regime``: ``bounds``: none; ``exact``: always
    (the user states the inputs are in an exact regime); ``mixed``: when the inputs are in the exact regime of
    the profile's accumulator (:func:`moeref.regimes.layer_in_exact_regime`) and equality applies to the
    profile (:func:`moeref.testing.regime.equality_applies`), or else are single-rounding inputs of the profile
    (:func:`_single_rounding_replay`), besides the bound."""
    from ..regimes.equality import moe_equality_report
    from .regime import equality_applies

    if regime == "bounds":
        return None, "the profile's bound only"
    if regime == "exact":
        return moe_equality_report(cand, run, label=label), "equality (the inputs are declared exact-regime)"
    from ..moe import LayerConfig
    from ..regimes.layer import ExactLayer, layer_in_exact_regime

    applies, why_not = equality_applies(profile)
    if not applies:
        return None, f"the profile's bound only: {why_not}"
    arithmetic = "hopper_fp8" if profile.promote_every else "fp32"
    opts = {k: v for k, v in kw.items() if k not in ("hidden", "weights", "topk_weights", "topk_ids")}
    for store, declared in (("gemm1_out_dtype", profile.gemm_out_dtype), ("act_out_dtype", profile.act_out_dtype)):
        if opts.get(store) is None and declared is not None:  # the profile's declared stores are the kernel's
            opts[store] = declared
    lay = ExactLayer(kw["hidden"], kw["weights"], kw["topk_weights"], kw["topk_ids"], LayerConfig.build(**opts),
                     "given")
    check = layer_in_exact_regime(lay, arithmetic)
    if check.ok:
        return (moe_equality_report(cand, run, label=label),
                f"equality (inputs in the {arithmetic} exact regime) and the bound")
    single = _single_rounding_replay(cand, kw, opts, profile, arithmetic, label)
    if single is not None:
        return single
    return None, (f"the profile's bound only: the inputs are not in the {arithmetic} exact regime "
                  f"({check.reasons[0]}), nor in its single-rounding regime under the profile's stores")


def _single_rounding_replay(cand, kw: dict, opts: dict, profile, arithmetic: str, label: str):
    """``(equality report, why)`` when the inputs are single-rounding inputs of ``profile``
    (:func:`moeref.regimes.single_rounding_layer`; the pytest plugin's mix checks these cases the same way,
    :func:`moeref.testing.regime.check_case`), else None. The profile must admit a single-rounding layer
    (:func:`moeref.regimes.single_rounding_stores`: its GEMM1, activation and output stores bf16, GEMM2's store
    the one it declares); the routed top-k weights must be powers of two, as the construction's (a GEMM2
    epilogue that weights before its store, which the profiles it admits may declare, commutes with the rounding
    only then); and the inputs, with those stores declared, must be in the ``arithmetic`` regime
    (:func:`moeref.regimes.layer_in_exact_regime` from the values: every partial sum exact, every declared store
    one rounding of an exact value). The candidate is then compared by equality with the reference replayed
    with those stores."""
    from ..moe import LayerConfig, run_moe
    from ..regimes import significant_bits, single_rounding_stores
    from ..regimes.equality import moe_equality_report
    from ..regimes.layer import ExactLayer, layer_in_exact_regime

    ids = np.asarray(kw["topk_ids"])
    w = np.asarray(kw["topk_weights"], np.float64)[ids >= 0]
    w = w[w != 0]
    if not np.all(np.isfinite(w)) or np.any(significant_bits(w) != 1):
        return None
    quant = opts.get("quant")
    scheme = "bf16" if quant is None or quant.a2 is None else "fp8_1x128"  # bf16 needs the activation store
    stores, _ = single_rounding_stores(profile, scheme)
    if stores is None:
        return None
    declared = dict(opts, gemm2_out_dtype=stores["gemm2_store"])
    lay = ExactLayer(kw["hidden"], kw["weights"], kw["topk_weights"], kw["topk_ids"], LayerConfig.build(**declared),
                     "given")
    if not layer_in_exact_regime(lay, arithmetic).ok:
        return None
    replay = run_moe(**dict(kw, **{k: declared[k] for k in ("gemm1_out_dtype", "act_out_dtype", "gemm2_out_dtype")}))
    names = ", ".join(f"{k.split('_out')[0]} {declared[k]}" for k in ("gemm1_out_dtype", "act_out_dtype",
                                                                      "gemm2_out_dtype"))
    return (moe_equality_report(cand, replay, label=label),
            f"equality against the single-rounding replay (inputs in the {arithmetic} regime with the profile's "
            f"stores: {names}) and the bound")


def _import(spec: str):
    if ":" not in spec:
        raise ValueError(f"expected MODULE:FUNCTION (e.g. my_kernels:run_moe); got {spec!r}")
    mod, fn = spec.split(":", 1)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    obj = importlib.import_module(mod)
    for part in fn.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} is not callable")
    return obj


def _cmd_mutate(args) -> int:
    from .cases import draw_cases
    from .mutation import mutation_score

    kernel = _import(args.kernel)
    check = _import(args.check) if args.check else None
    cases = draw_cases(args.cases, seed=args.seed, max_tokens=args.max_tokens)
    try:
        res = mutation_score(kernel, cases, check, profile=args.profile)
    except Exception as exc:  # noqa: BLE001 - re-raised unless it came from the user's own code
        status = _user_code_failed(exc, args)
        if status is None:
            raise
        return status
    if args.json:
        _print_json(res.to_dict())
    else:
        print(res.summary())
    if res.baseline_failures:
        return 1
    return 0 if args.min_score is None or res.score >= args.min_score else 1


def _user_code_failed(exc, args) -> int | None:
    """When ``exc`` came from the user's kernel wrapper or ``--check`` on an unmutated case
    (:func:`moeref.testing.mutation_score` sets ``moeref_origin``): print its traceback and say whose it is;
    status 2. None for any other error (the default check's errors are moeref's: one line, from ``main``)."""
    import traceback

    what, case = getattr(exc, "moeref_origin", (None, None))
    if what is None or (what == "check" and not args.check):
        return None
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    if what == "kernel":
        role, spec, rule = "kernel wrapper", args.kernel, "it must return the output [M, K] of the case it is given"
    else:
        role, spec, rule = "check", args.check, "it must return None or raise AssertionError (a mismatch)"
    print(f"moeref mutate: the error above was raised by your {role} {spec} on case {case} (unmutated inputs), "
          f"not by moeref: {rule}", file=sys.stderr)
    return 2


def add_subcommands(sub) -> None:
    """Register ``replay``, ``check`` and ``mutate`` on the ``moeref`` command's subparsers."""
    from .cases import DEFAULT_MAX_TOKENS

    p = sub.add_parser("replay", help="re-run a saved failing case (reproducer) and print its report")
    p.add_argument("file", help="<stem>.json or <stem>.safetensors written by the pytest plugin")
    p.add_argument("--profile", help="check under this profile instead of the saved one")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser("check", help="compare a saved kernel output with the reference of saved inputs")
    p.add_argument("inputs", help=".safetensors of the layer's inputs (vLLM or FlashInfer argument names)")
    p.add_argument("candidate", help=".safetensors (one tensor, or 'out') or .npy of the kernel's output")
    p.add_argument("--profile", help="profile name (default: suggested from the dtypes)")
    p.add_argument("--kernel", choices=("vllm", "torch", "cutlass", "deepgemm", "cublas"),
                   help="kernel family, for the profile suggestion")
    p.add_argument("--activation", default="silu_and_mul", help="moeref activation name (default silu_and_mul)")
    p.add_argument("--w13-layout", default="gate_up", choices=("gate_up", "up_gate", "interleaved"),
                   help="row order of w1/w13 in vLLM-named inputs: gate rows then up rows "
                        "(gate_up, vLLM; the default), up then gate (up_gate), or alternating "
                        "(interleaved, gpt-oss checkpoints); FlashInfer's fc1_expert_weights is "
                        "always up then gate")
    p.add_argument("--block-shape", help="FP8 weight block 'bn,bk' (e.g. 128,128) when w1_scale is given")
    p.add_argument("--per-token", action="store_true", help="FP8 per-token activations / per-channel weights")
    p.add_argument("--regime", choices=("mixed", "exact", "bounds"), default="mixed",
                   help="mixed (default): the profile's bound, and equality too when the inputs are in an exact "
                        "regime or the single-rounding regime of the profile's stores (moeref.regimes); exact: "
                        "equality only; bounds: the bound only")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("mutate", help="mutation score of your kernel wrapper under your check")
    p.add_argument("kernel", help="MODULE:FUNCTION, a wrapper KernelInputs -> output [M, K]")
    p.add_argument("--check", help="MODULE:FUNCTION, (KernelInputs, output) -> None, raising AssertionError")
    p.add_argument("--profile", help="profile of the default check (default: suggested from the cases' dtype, "
                   "BF16_OUTPUT for the drawn bf16 cases)")
    p.add_argument("--cases", type=int, default=8, help="cases from moeref.testing.draw_cases (default 8)")
    p.add_argument("--seed", type=seed_argument, default=0,
                   help="seed of the drawn cases (>= 0; each seed gives another set)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"largest token count of the drawn cases (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--min-score", type=float, help="exit 1 if the score is below this fraction")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_mutate)
