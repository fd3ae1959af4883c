"""moeref's pytest plugin (entry point ``pytest11``: loaded by every pytest run once moeref is installed;
``-p no:moeref`` turns it off; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, ``-p moeref.testing.plugin``
loads it explicitly).

Fixtures:

* ``moe_case``: parametrizes the test over layer calls drawn deterministically by
  :func:`moeref.testing.draw_cases` (a :class:`~moeref.testing.KernelInputs`, already in bf16): 8 cases,
  64 with ``--moeref-thorough`` (or ``MOEREF_HYPOTHESIS_PROFILE=thorough``), ``--moeref-cases N`` to set;
  token counts up to 256, ``--moeref-max-tokens N`` to set. ``--moeref-regime`` (a
  :class:`moeref.testing.regime.CheckMix`): ``mixed`` (the default) draws one case in four in the exact regime
  (:func:`moeref.testing.cases.exact_case`, checked by equality), one in four in the single-rounding regime
  with the stores of the test's profile (:func:`moeref.testing.cases.single_rounding_case`, checked by
  equality; where the profile admits none, an exact-regime case instead, its id ending ``-no_single_rounding``)
  and the others general (checked under the profile's bound), ``exact`` only exact-regime cases, ``bounds``
  only general ones. The profile is known when the cases are drawn from ``--moeref-profile`` or the test's
  marker, else the package's default for bf16. The test id names each case's regime. For Hypothesis shrinking
  use ``@given(moe_cases())`` instead.
* ``moe_profile``: the :class:`~moeref.compare.Profile` to check with: ``--moeref-profile NAME``, else the
  test's ``@pytest.mark.moeref_profile("NAME")``, else the package's default for the case's dtype
  (:func:`moeref.compare.suggest_profile`, the decision table's row: ``BF16_OUTPUT`` for the bf16 cases).
* ``moe_check``: ``moe_check(output, case, profile=None)``: :func:`moeref.testing.regime.check_case`:
  equality for an exact-regime case, :func:`moeref.testing.assert_moe_close` under ``moe_profile`` (or
  ``profile``) for a general one.
* ``moe_regime``: the run's :class:`~moeref.testing.regime.CheckMix`.

On failure: when the exception is a :class:`~moeref.testing.MoEMismatch` that knows its case (the
reference was given as a ``KernelInputs`` or ``LayerCase``), the plugin writes a reproducer
(``<dir>/<test id>.safetensors`` + ``.json``, :mod:`moeref.testing.reproducer`; ``--moeref-repro-dir``,
default ``moeref-repro``), and adds the report and ``moeref replay <file>`` to the test's output.
"""
from __future__ import annotations

import os
import re

import pytest

DEFAULT_CASES = 8
THOROUGH_CASES = 64


def pytest_addoption(parser):
    group = parser.getgroup("moeref", "moeref: validate MoE kernels against the exact reference")
    group.addoption("--moeref-profile", default=None, help="profile name for the moe_profile fixture "
                    "(moeref.compare.PROFILES: BF16_OUTPUT, DEEPGEMM_FP8, CUBLAS_FP8_FAST_ACCUM, ...)")
    group.addoption("--moeref-thorough", action="store_true", default=False,
                    help=f"draw {THOROUGH_CASES} moe_case cases instead of {DEFAULT_CASES}")
    group.addoption("--moeref-cases", type=int, default=None, help="number of moe_case cases")
    group.addoption("--moeref-max-tokens", type=int, default=None,
                    help="largest token count of the moe_case cases (default 256; thousands where the kernel "
                         "and the reference are fast)")
    group.addoption("--moeref-regime", default=None, choices=("mixed", "exact", "bounds"),
                    help="which cases moe_case draws: mixed (default: exact-regime cases checked by equality and "
                         "general cases checked under the profile's bound), exact (equality only) or bounds")
    group.addoption("--moeref-repro-dir", default="moeref-repro", help="where failing cases are saved")


def pytest_configure(config):
    config.addinivalue_line("markers", "moeref_profile(name): the profile moe_profile gives this test")


def _num_cases(config) -> int:
    n = config.getoption("--moeref-cases")
    if n is not None:
        if n < 1:
            raise pytest.UsageError(f"--moeref-cases must be >= 1; got {n}")
        return n
    thorough = config.getoption("--moeref-thorough") or os.environ.get("MOEREF_HYPOTHESIS_PROFILE") == "thorough"
    return THOROUGH_CASES if thorough else DEFAULT_CASES


def _max_tokens(config) -> dict:
    n = config.getoption("--moeref-max-tokens")
    if n is not None and n < 1:
        raise pytest.UsageError(f"--moeref-max-tokens must be >= 1; got {n}")
    return {} if n is None else {"max_tokens": n}


def _mix(config):
    from .regime import DEFAULT_REGIME, CheckMix

    return CheckMix(config.getoption("--moeref-regime") or DEFAULT_REGIME)


def pytest_generate_tests(metafunc):
    if "moe_case" not in metafunc.fixturenames:
        return
    from .cases import draw_cases
    from .regime import case_regime

    name = metafunc.config.getoption("--moeref-profile")
    mark = metafunc.definition.get_closest_marker("moeref_profile")
    if name is None and mark is not None and mark.args:
        name = mark.args[0]
    try:
        cases = draw_cases(_num_cases(metafunc.config), mix=_mix(metafunc.config), profile=name,
                           **_max_tokens(metafunc.config))
    except ValueError as exc:  # an unknown profile name
        raise pytest.UsageError(str(exc)) from None
    ids = [f"case{i}-{case_regime(c)}{'-no_single_rounding' if c.meta.get('single_rounding') else ''}-"
           f"M{c.hidden.shape[0]}-E{c.w13.shape[0]}-k{c.topk_ids.shape[1]}-{c.meta.get('routing', '')}"
           for i, c in enumerate(cases)]
    metafunc.parametrize("moe_case", cases, ids=ids)


@pytest.fixture
def moe_profile(request):
    """The profile to check with (option > marker > :func:`moeref.compare.suggest_profile` of the
    ``moe_case`` dtype, bf16 when the test draws no case)."""
    from ..compare.kernel_profiles import get_profile, suggest_profile

    name = request.config.getoption("--moeref-profile")
    if name is None:
        mark = request.node.get_closest_marker("moeref_profile")
        if mark is not None and mark.args:
            name = mark.args[0]
        else:
            case = request.getfixturevalue("moe_case") if "moe_case" in request.fixturenames else None
            return suggest_profile(getattr(case, "dtype", "bfloat16"))
    try:
        return get_profile(name)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.fixture
def moe_regime(request):
    """The run's :class:`~moeref.testing.regime.CheckMix` (``--moeref-regime``, default mixed)."""
    return _mix(request.config)


@pytest.fixture
def moe_check(moe_profile):
    """``moe_check(output, case, profile=None)``: :func:`moeref.testing.regime.check_case` (equality for an
    exact-regime case, assert_moe_close under ``moe_profile`` or ``profile`` for a general one)."""
    from .regime import check_case

    def check(output, case, profile=None, *, label: str = ""):
        return check_case(output, case, moe_profile if profile is None else profile, label=label)

    return check


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if call.excinfo is None or rep.when != "call":
        return
    from .asserts import MoEMismatch

    exc = call.excinfo.value
    if not isinstance(exc, MoEMismatch) or exc.case is None:
        return
    from .reproducer import save_reproducer

    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", item.nodeid)[-150:]
    path = os.path.join(str(item.config.getoption("--moeref-repro-dir")), stem)
    extra = {"test": item.nodeid}
    profile = getattr(exc.report, "profile", None)
    if profile is None:  # an equality report (exact regime): replayed by equality in the candidate's dtype
        extra.update(regime="exact", candidate_dtype=str(exc.candidate.dtype))
        profile = "EXACT"
    try:
        st, js = save_reproducer(path, exc.case, exc.candidate, profile, label=item.nodeid, extra=extra)
        text = f"{exc.report.summary()}\nreproducer: {js} (+ {st.name})\nreplay: moeref replay {js}"
    except (ValueError, TypeError, OSError) as err:
        text = f"{exc.report.summary()}\n(no reproducer: {err})"
    rep.sections.append(("moeref", text))
