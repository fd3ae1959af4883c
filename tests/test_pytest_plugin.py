"""moeref's pytest plugin, run through pytester: the moe_case / moe_profile / moe_check fixtures, the
options, and the reproducer written on failure (replayed by `moeref replay`)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

KERNEL_TEST = """
import pytest
from kernels_for_tests import eager_bf16_moe

BUG = {bug!r}

@pytest.mark.moeref_profile("TORCH_EAGER_BF16")
def test_my_kernel(moe_case, moe_check):
    out = eager_bf16_moe(**moe_case.torch(), bug=BUG)
    moe_check(out, moe_case)
"""


@pytest.fixture
def kernel_dir(pytester, monkeypatch):
    # the inner runs load the plugin with -p; once moeref is installed its pytest11 entry point would load
    # it a second time under another name, so entry-point autoloading is off inside
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.syspathinsert(Path(__file__).parent)
    return pytester


def test_moe_case_draws_cases_and_an_honest_kernel_passes(kernel_dir):
    kernel_dir.makepyfile(test_k=KERNEL_TEST.format(bug=None))
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "--moeref-cases", "4", "-q")
    res.assert_outcomes(passed=4)


def test_failure_writes_a_reproducer_that_replays(kernel_dir, capsys):
    from moeref.cli import main

    kernel_dir.makepyfile(test_k=KERNEL_TEST.format(bug="tail_slot"))
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "--moeref-cases", "6", "--moeref-repro-dir", "repro")
    outcomes = res.parseoutcomes()
    assert outcomes.get("failed", 0) >= 1  # drawn cases with M % 8 != 0 and top-k > 1 lose a slot
    res.stdout.fnmatch_lines(["*moeref replay repro*json*", "*slot j=*-> expert*"])
    files = sorted((kernel_dir.path / "repro").glob("*.json"))
    assert len(files) == outcomes["failed"]
    assert len(list((kernel_dir.path / "repro").glob("*.safetensors"))) == len(files)
    assert main(["replay", str(files[0])]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_profile_option_marker_and_default(kernel_dir):
    kernel_dir.makepyfile(test_p="""
import pytest

def test_default(moe_profile, request):
    assert moe_profile.name == (request.config.getoption("--moeref-profile") or "BF16_OUTPUT").upper()

@pytest.mark.moeref_profile("DEEPGEMM_FP8")
def test_marker(moe_profile, request):
    assert moe_profile.name == (request.config.getoption("--moeref-profile") or "DEEPGEMM_FP8").upper()
""")
    kernel_dir.runpytest("-p", "moeref.testing.plugin").assert_outcomes(passed=2)
    kernel_dir.runpytest("-p", "moeref.testing.plugin", "--moeref-profile", "cublas_fp8").assert_outcomes(passed=2)
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "--moeref-profile", "NOPE")
    assert res.ret != 0
    assert "unknown profile 'NOPE'" in "\n".join(res.stdout.lines + res.stderr.lines)


def test_thorough_mode_draws_more_cases(kernel_dir):
    kernel_dir.makepyfile(test_t="def test_t(moe_case):\n    assert moe_case.hidden.shape[0] >= 1\n")
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "--collect-only", "-q")
    res.stdout.fnmatch_lines(["8 tests collected*"])
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "--moeref-thorough", "--collect-only", "-q")
    res.stdout.fnmatch_lines(["64 tests collected*"])


MIXED_TEST = """
from kernels_for_tests import fp32_sum_bf16_moe

BUG = {bug!r}

def test_my_kernel(moe_case, moe_check):
    moe_check(fp32_sum_bf16_moe(**moe_case.torch(), bug=BUG), moe_case)
"""


def test_the_default_mix_checks_exact_cases_by_equality_and_general_cases_under_the_bound(kernel_dir, capsys):
    from moeref.cli import main

    kernel_dir.makepyfile(test_m=MIXED_TEST.format(bug=None))
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "-v")
    res.assert_outcomes(passed=8)  # an honest BF16_OUTPUT kernel passes both kinds
    res.stdout.fnmatch_lines(["*case0-bounds-*PASSED*", "*case1-exact-*PASSED*", "*case3-single_rounding-*PASSED*"])
    # one flipped last bit of one output element: equality sees it on every exact-regime and single-rounding case
    kernel_dir.makepyfile(test_m=MIXED_TEST.format(bug="last_bit"))
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "-v", "--moeref-repro-dir", "repro")
    failed = [line for line in res.stdout.lines if line.startswith("FAILED") and "::test_my_kernel[" in line]
    assert sum("-exact-" in line for line in failed) == 2, failed  # every exact-regime case of the eight
    assert sum("-single_rounding-" in line for line in failed) == 2, failed  # and every single-rounding one
    # GEMM2's output stored rounding toward zero: exact sums hide it, the single-rounding cases see it
    kernel_dir.makepyfile(test_m=MIXED_TEST.format(bug="rz_gemm2_store"))
    rz = kernel_dir.runpytest("-p", "moeref.testing.plugin", "-v", "--moeref-repro-dir", "repro_rz")
    rz_failed = [line for line in rz.stdout.lines if line.startswith("FAILED") and "::test_my_kernel[" in line]
    assert sum("-single_rounding-" in line for line in rz_failed) == 2 and not any("-exact-" in x for x in rz_failed)
    res.stdout.fnmatch_lines(["*elements differ from the reference (exact regime*", "*moeref replay repro*json*"])
    files = sorted((kernel_dir.path / "repro").glob("*exact*.json"))
    assert files
    assert main(["replay", str(files[0]), "--json"]) == 1  # replayed by equality in the saved bf16
    assert '"num_differences": 1' in capsys.readouterr().out


def test_a_profile_without_single_rounding_draws_exact_cases_in_their_place_and_says_so(kernel_dir):
    kernel_dir.makepyfile(test_t="""
import pytest

@pytest.mark.moeref_profile("TORCH_EAGER_BF16")
def test_t(moe_case):
    assert moe_case.hidden.shape[0] >= 1
""")
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "--collect-only", "-q")
    ids = [line for line in res.stdout.lines if "test_t[" in line]
    assert len(ids) == 8 and not any("-single_rounding-" in x for x in ids)
    assert sum("-exact-no_single_rounding-" in x for x in ids) == 2, ids


def test_regime_option_draws_one_kind_only(kernel_dir):
    kernel_dir.makepyfile(test_t="def test_t(moe_case):\n    assert moe_case.hidden.shape[0] >= 1\n")
    for regime in ("exact", "bounds"):
        res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "--moeref-regime", regime, "--collect-only", "-q")
        ids = [line for line in res.stdout.lines if "test_t[" in line]
        assert len(ids) == 8 and all(f"-{regime}-" in line for line in ids), ids
    res = kernel_dir.runpytest("-p", "moeref.testing.plugin", "--moeref-regime", "nope")
    assert res.ret != 0


LEAK_TEST = """
import pytest

from moeref.cli import build_parser, main

pytest.importorskip("rich")  # as tests/test_explain.py: only the package is imported at collection
pytest_plugins = ["pytester"]
build_parser()  # the command's modules (numpy, moeref) are imported before pytester's snapshot


def test_first_render_inside_a_pytester_test(pytester):
    assert main(["formats", "e2m1"]) == 0  # rich's console, table and themes imported here


def test_render_after_it():
    assert main(["formats", "e2m1"]) == 0
"""


def test_a_pytester_test_does_not_break_rendering_in_the_tests_after_it(pytester, monkeypatch):
    """pytester restores ``sys.modules`` after its test; without the repository's conftest.py
    (``drop_stale_submodules``) the next render in the same process meets two copies of rich's
    classes and fails (the GPU suite's ``'Style' object has no attribute 'strip'``)."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_leak=LEAK_TEST)
    bare = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    bare.assert_outcomes(passed=1, failed=1)  # the mechanism is real: the second render fails
    assert "'Style' object has no attribute 'strip'" in bare.stdout.str()
    pytester.makeconftest((root / "conftest.py").read_text())
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q").assert_outcomes(passed=2)
