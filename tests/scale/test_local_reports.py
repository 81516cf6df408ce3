"""What local mode reports when ranks disagree: a deadlock (no rank can go on) fails at once
with the deadlock report of the other modes (what every rank waits in, each rank's place once);
mismatched collectives
fail on every rank naming what each issued; a failed rank's peers are aborted; a rank that
never yields gives the usual hang report; the next test runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .._scenario import Run, run_scenario

SCENARIOS = Path(__file__).parent / "scenarios"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_scenario(
        tmp_path_factory.mktemp("reports"), "test_local_reports.py", scenarios=SCENARIOS
    )


def test_deadlock_fails_at_once_naming_every_rank(run: Run) -> None:
    case = run.cases["test_deadlock"]
    assert case.outcome == "failed"
    # The headline and lines of process and thread mode's deadlock report.
    assert re.match(
        r"deadlock: ranks 0, 2 can never go on \(of world size 3\); found \d+\.\d s into the "
        r"test and ended there, before the timeout \(120 s\)",
        case.message,
    ), case.message
    assert re.search(
        r"\nranks 0, 2 wait in all_reduce #1 \(at [\w.-]+/test_local_reports\.py:14\) for rank "
        r"1 to enter it, and rank 1 finished the test \(returned\)\n",
        case.text,
    ), case.text
    # One place for the ranks stopped at the same line.
    assert "[ranks 0, 2 (2 of 3)] stack when the deadlock was found:" in case.text
    assert case.text.count("dist.all_reduce(torch.ones(1))") == 1
    assert "LocalDeadlock" not in case.text
    assert case.seconds < 10  # no timeout is waited for (the default is 120 s)


def test_a_deadlock_the_logs_cannot_show_is_worded_from_the_scheduler(run: Run) -> None:
    # A receive from any rank waits on nobody in particular: the logs never call it stuck (see
    # [Note: a certain deadlock]), but local mode's scheduler knows no rank can send to it.
    case = run.cases["test_deadlock_any_source"]
    assert case.message.startswith("deadlock: rank 0 can never go on (of world size 2)"), case.text
    assert re.search(r"\nrank 0 waits in recv #1 from any rank \(at \S+:\d+\)\n", case.text)
    assert "\nrank 1 finished the test (returned)\n" in case.text
    # The logs' words for the ranks they show, the scheduler's for the rest.
    case = run.cases["test_deadlock_any_source_and_a_peer"]
    assert case.message.startswith("deadlock: ranks 0, 1 can never go on (of world size 3)")
    assert re.search(
        r"\nrank 1 waits in recv #1 from rank 2 \(at \S+:\d+\), and rank 2 finished the test "
        r"\(returned\)\nrank 0 waits in recv #1 from any rank \(at \S+:\d+\)\n",
        case.text,
    ), case.text


def test_mismatch_names_what_each_rank_issued(run: Run) -> None:
    case = run.cases["test_mismatch"]
    assert case.outcome == "failed"
    assert (
        "the ranks issued different collectives as the 1st collective of the default group: "
        "rank 1 issued all_reduce(float32[2], SUM); ranks 0, 2 issued all_reduce(float32[1], "
        "SUM)"
    ) in case.message
    assert case.message.startswith("ranks 0-2 (3 of 3) failed: RuntimeError: [rank 0] mode='local'")


def test_a_failed_ranks_peers_are_aborted(run: Run) -> None:
    case = run.cases["test_fail"]
    assert case.outcome == "failed"
    assert case.message.startswith("rank 2 failed: ValueError: rank two broke")
    assert "ranks 0, 1, 3 aborted" in case.message


def test_a_failed_ranks_running_peer_is_not_cut_short(run: Run) -> None:
    # Local mode aborts a failed rank's peers itself once none can run; a peer that still runs
    # (sleeping here, formatting its traceback on a loaded machine) is not stuck, so process
    # mode's failure grace does not apply to it: only the timeout does.
    case = run.cases["test_slow_peer"]
    assert case.outcome == "failed"
    assert case.message.startswith("rank 0 failed: ValueError: rank zero broke")
    assert "rank 1" not in case.text


def test_a_rank_that_never_yields_is_a_hang_report(run: Run) -> None:
    case = run.cases["test_hang"]
    assert case.outcome == "failed"
    assert case.message.startswith("timed out after 2 s")
    assert "rank 0 waits in all_reduce #1 but ranks 1, 2 never entered it" in case.text
    assert "time.sleep(0.02)" in case.text  # where rank 1 was


def test_the_next_test_runs(run: Run) -> None:
    case = run.cases["test_next_test_runs"]
    assert case.outcome == "passed", case.text
