"""Warm ranks as clean as fresh ones (issue 49): tests that leak process state through pytest's
fixtures (monkeypatch: environment, attributes, items, sys.path, cwd) and around them
(os.environ, sys.path, torch's switches, a signal handler, a thread), run in random order among
tests that check a clean rank, never leak into a check; pytest's caplog, capsys and recwarn
work on process-mode ranks; a thread left running replaces the ranks, with a warning."""

from __future__ import annotations

import pytest

from .._scenario import Run, run_scenario

FILE = "test_leaks_in_random_order.py"


@pytest.fixture(scope="module", params=[1, 2, 3])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    seed = request.param
    # run_scenario turns pytest-randomly off; "-p randomly" after it turns it on again.
    folder = tmp_path_factory.mktemp(f"leaks{seed}")
    return run_scenario(folder, FILE, "-p", "randomly", f"--randomly-seed={seed}")


def test_no_check_sees_a_leak_in_any_order(run: Run) -> None:
    assert run.cases, run.stdout[-3000:]
    assert "random" in run.stdout  # pytest-randomly shuffled the file
    failed = {name: case.message for name, case in run.cases.items() if case.outcome != "passed"}
    assert failed == {}
    assert len(run.cases) == 16


def test_a_thread_left_running_replaces_the_ranks_with_a_warning(run: Run) -> None:
    assert (
        "fsdp_testing: ranks 0, 1: the test left 1 thread(s) running (leaked-thread); its ranks "
        "were replaced, so the next test runs on fresh ones"
    ) in run.stdout
