"""A test that skips on some ranks and passes on the others is skipped (pytest-native and unittest
API), and thread mode undoes what a test changed in the process before the next test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .._scenario import SCENARIOS, Run, run_scenario


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_scenario(tmp_path_factory.mktemp("partial"), "test_partial.py")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("test_skips_on_rank_one_only", "rank 1 has no widget"),
        ("test_skips_on_rank_zero_only", "rank 0 has no widget"),
        ("test_thread_skips_on_rank_one_only", "thread rank 1 has no widget"),
    ],
)
def test_a_skip_on_some_ranks_skips_the_test(run: Run, name: str, reason: str) -> None:
    case = run.cases[name]
    assert case.outcome == "skipped", case.text
    assert reason in case.message


def test_thread_mode_undoes_process_state_changes(run: Run) -> None:
    for name in (
        "test_thread_test_changes_process_state",
        "test_next_thread_test_sees_the_state_undone",
        "test_the_parent_process_state_is_back_to_before",
    ):
        assert run.cases[name].outcome == "passed", (name, run.cases[name].text)


def test_python_m_unittest_reports_a_partial_skip_as_a_skip(tmp_path: Path) -> None:
    (tmp_path / "test_partial.py").write_text((SCENARIOS / "test_partial.py").read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", "test_partial.TestPartialSkip"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "test_skips_on_rank_zero_only" in proc.stderr
    assert "skipped 'rank 0 has no widget'" in proc.stderr
    assert "OK (skipped=1)" in proc.stderr
