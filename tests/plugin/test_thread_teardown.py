"""Thread mode cannot deadlock in teardown (issue 23): a rank that dies holding one of torch's
threaded-group locks, or a teardown that never ends, becomes a named failure within the test's
deadline, and the next test runs. (The stress run is ``scripts/thread_stress.py``;
``test_thread_stress.py`` is its short version.)"""

from __future__ import annotations

import pytest

from .._scenario import Run, run_scenario


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    # Before the fix the first scenario never ended: the child pytest sat idle until killed.
    return run_scenario(tmp_path_factory.mktemp("teardown"), "test_thread_teardown.py", timeout=120)


def test_a_lock_left_held_by_a_failed_rank_does_not_block_the_launcher(run: Run) -> None:
    case = run.cases["test_rank_fails_holding_the_groups_event_lock"]
    assert case.outcome == "failed"
    assert case.message.startswith("rank 0 failed: ValueError: rank zero broke holding the lock")
    assert case.seconds < 30  # the test's timeout is 5 s; stopping takes at most 2 s more


def test_a_teardown_that_never_ends_is_a_named_failure(run: Run) -> None:
    case = run.cases["test_teardown_never_ends"]
    assert case.outcome == "failed"
    assert "did not finish tearing down its process group within the test's deadline (3 s)" in (
        case.message
    )
    assert "destroy_forever" in case.text  # where it was stuck


def test_the_next_test_runs(run: Run) -> None:
    assert run.cases["test_next_test_runs"].outcome == "passed", run.cases[
        "test_next_test_runs"
    ].text
