"""The project's ``slow`` marker (root ``conftest.py``): skipped by default, run with
``--run-slow``."""

from pathlib import Path

ROOT_CONFTEST = Path(__file__).resolve().parents[2] / "conftest.py"


def _run(pytester, *args):
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.slow
        def test_long():
            pass

        def test_short():
            pass
        """
    )
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", *args)


def test_slow_tests_are_skipped_by_default(pytester):
    result = _run(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*slow: run with --run-slow*"])


def test_run_slow_runs_them(pytester):
    _run(pytester, "--run-slow").assert_outcomes(passed=2)
