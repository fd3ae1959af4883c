"""moeref's pytest plugin (entry point ``pytest11``: loaded by every pytest run once moeref is installed;
``-p no:moeref`` turns it off; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, ``-p moeref.testing.plugin``
loads it explicitly).

Fixtures:

* ``moe_case``: parametrizes the test over layer calls drawn deterministically from
  :func:`moeref.testing.moe_cases` (a :class:`~moeref.testing.KernelInputs`, already in bf16): 8 cases,
  64 with ``--moeref-thorough`` (or ``MOEREF_HYPOTHESIS_PROFILE=thorough``), ``--moeref-cases N`` to set;
  token counts up to 256, ``--moeref-max-tokens N`` to set (:func:`moeref.testing.draw_cases`).
  For Hypothesis shrinking use ``@given(moe_cases())`` instead.
* ``moe_profile``: the :class:`~moeref.compare.Profile` to check with: ``--moeref-profile NAME``, else the
  test's ``@pytest.mark.moeref_profile("NAME")``, else ``BF16_OUTPUT``.
* ``moe_check``: ``moe_check(output, case, profile=None)``: :func:`moeref.testing.assert_moe_close`
  with ``moe_profile`` by default.

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


def pytest_generate_tests(metafunc):
    if "moe_case" not in metafunc.fixturenames:
        return
    from .cases import draw_cases

    cases = draw_cases(_num_cases(metafunc.config), **_max_tokens(metafunc.config))
    ids = [f"case{i}-M{c.hidden.shape[0]}-E{c.w13.shape[0]}-k{c.topk_ids.shape[1]}-{c.meta.get('routing', '')}"
           for i, c in enumerate(cases)]
    metafunc.parametrize("moe_case", cases, ids=ids)


@pytest.fixture
def moe_profile(request):
    """The profile to check with (option > marker > BF16_OUTPUT)."""
    from ..compare.kernel_profiles import get_profile

    name = request.config.getoption("--moeref-profile")
    if name is None:
        mark = request.node.get_closest_marker("moeref_profile")
        name = mark.args[0] if mark is not None and mark.args else "BF16_OUTPUT"
    try:
        return get_profile(name)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.fixture
def moe_check(moe_profile):
    """``moe_check(output, case, profile=None)``: assert_moe_close under ``moe_profile`` (or ``profile``)."""
    from .asserts import assert_moe_close

    def check(output, case, profile=None, *, label: str = ""):
        return assert_moe_close(output, case, moe_profile if profile is None else profile, label=label)

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
    try:
        st, js = save_reproducer(path, exc.case, exc.candidate, exc.report.profile, label=item.nodeid,
                                 extra={"test": item.nodeid})
        text = f"{exc.report.summary()}\nreproducer: {js} (+ {st.name})\nreplay: moeref replay {js}"
    except (ValueError, TypeError, OSError) as err:
        text = f"{exc.report.summary()}\n(no reproducer: {err})"
    rep.sections.append(("moeref", text))
