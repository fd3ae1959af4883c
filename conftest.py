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
