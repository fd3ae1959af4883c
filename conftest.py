"""Repository-wide pytest configuration.

* Triton: on a machine without a CUDA GPU the fast paths run under Triton's interpreter, which
  must be switched on before ``triton`` is first imported; this file does it at collection start.
* Hypothesis profiles: ``ci`` (chosen when CI is set: deterministic, no deadline, no database),
  ``dev`` (the default for local runs), ``thorough`` (many more examples; nightly) and ``gpu`` (for
  the GPU suite). ``MOEREF_HYPOTHESIS_PROFILE=<name>`` picks one explicitly.
* ``gpu``-marked tests skip on machines without CUDA, saying so; they run for real on a GPU.
"""
from __future__ import annotations

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
HYPOTHESIS_PROFILE = os.environ.get("MOEREF_HYPOTHESIS_PROFILE") or (
    "ci" if os.environ.get("CI") else ("gpu" if HAS_CUDA else "dev"))

collect_ignore_glob = ["docs/figures/*.py", "docs/_site/*", "bench/*", "build/*", ".gpu/*", ".venv/*"]

try:
    from hypothesis import HealthCheck, settings

    _common = dict(deadline=None, print_blob=True)
    settings.register_profile(
        "ci", derandomize=True, database=None, max_examples=100,
        suppress_health_check=[HealthCheck.too_slow], **_common,
    )
    settings.register_profile("dev", max_examples=60, **_common)
    settings.register_profile(
        "thorough", max_examples=2000,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **_common,
    )
    settings.register_profile(
        "gpu", max_examples=200, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow], **_common,
    )
    settings.load_profile(HYPOTHESIS_PROFILE)
except ImportError:  # pragma: no cover - hypothesis is part of the test extra
    pass


def pytest_report_header(config):
    mode = "CUDA" if HAS_CUDA else "CPU (Triton kernels under TRITON_INTERPRET=1)"
    return [f"moeref: device {mode}; hypothesis profile {HYPOTHESIS_PROFILE!r}"]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `bash bench/run_gpu.sh` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def drop_stale_submodules() -> list[str]:
    """Unbind, from every package still imported, the submodules no longer in ``sys.modules``.

    pytester (tests/test_pytest_plugin.py) snapshots ``sys.modules`` and restores it when its test
    ends, so every module first imported during that test is dropped, but a package imported before
    (``rich`` alone, imported by ``pytest.importorskip("rich")`` at collection) keeps its
    attributes pointing at the dropped submodules. A later ``import rich.console`` then runs afresh
    while its ``from . import themes`` picks up the stale ``rich.themes`` attribute: two copies of
    rich's classes in one worker, and the theme's ``Style`` objects fail rich's ``isinstance``
    checks (``AttributeError: 'Style' object has no attribute 'strip'``). Unbinding the stale
    attributes makes the next import load every dropped submodule afresh and consistently.
    """
    import sys
    import types

    dropped = []
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, types.ModuleType) or not hasattr(mod, "__path__"):
            continue
        for attr, val in list(vars(mod).items()):
            if (issubclass(type(val), types.ModuleType)  # type(): no attribute hooks run
                    and val.__name__ == f"{name}.{attr}" and val.__name__ not in sys.modules):
                delattr(mod, attr)
                dropped.append(val.__name__)
    return dropped


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test that used pytester has been torn down (its ``sys.modules`` restored), drop the
    stale submodule attributes it leaves (:func:`drop_stale_submodules`), so that the tests after
    it do not depend on whether a pytester test ran first in the same process."""
    try:
        return (yield)
    finally:
        if "pytester" in getattr(item, "fixturenames", ()):
            drop_stale_submodules()
