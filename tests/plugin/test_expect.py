"""``faults.expect``: a test that must fail passes only when the named rank fails with a matching
report; a wrong rank, another report or no failure at all fails, saying what was expected."""

from __future__ import annotations

import pytest

from fsdp_testing import faults

from .._scenario import Run, run_scenario


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_scenario(tmp_path_factory.mktemp("expect"), "test_expect.py")


def test_expected_failure_passes_and_keeps_its_report(run: Run) -> None:
    for name in (
        "test_kill_as_expected",
        "test_local_ranks_fail_as_expected",
        "test_thread_fault_as_expected",
        "test_rank_zero_fails_as_expected",
    ):
        assert run.cases[name].outcome == "passed", (name, run.cases[name].text)
    assert "expected failure: rank 1 to fail with a report matching" in run.stdout


def test_wrong_rank_fails_naming_the_ranks_that_failed(run: Run) -> None:
    case = run.cases["test_wrong_rank_blamed"]
    assert case.outcome == "failed"
    assert case.message.startswith(
        "expected rank 0 to fail with a report matching 'SIGKILL', but rank 0 did not fail "
        "(ranks that failed: 1)"
    ), case.message
    assert "rank 1 killed by SIGKILL at all_reduce #1" in case.text  # the report, below


def test_other_report_fails_with_the_report(run: Run) -> None:
    case = run.cases["test_other_report"]
    assert case.outcome == "failed"
    assert "but the report does not match 'SIGSEGV'" in case.message
    assert "killed by SIGKILL" in case.text


def test_a_pass_is_a_failure(run: Run) -> None:
    case = run.cases["test_passes_unexpectedly"]
    assert case.message == "expected rank 1 to fail, but the test passed on every rank"
    case = run.cases["test_rank_one_does_not_fail"]
    assert case.outcome == "failed"
    assert "expected rank 1 to fail, but rank 1 did not fail (ranks that failed: 0)" in case.text


def test_misuse_is_named(run: Run) -> None:
    case = run.cases["test_rank_outside_the_world"]
    assert "rank 5 is not a rank of this world of 2" in case.message
    case = run.cases["test_not_distributed"]
    assert case.outcome == "failed"
    assert "faults.expect(...) judges the report of a distributed test" in case.message


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"rank": -1}, "rank must be a rank number"),
        ({"rank": []}, "rank must be a rank number"),
        ({"match": "("}, "is not a regular expression"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, error: str) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        faults.expect(**kwargs)
