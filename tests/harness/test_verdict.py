"""The fast tier of the verdict logic: judging rank results in-process, one row per rule, with no
rank started (as pytest-xdist tests its scheduling without processes)."""

from __future__ import annotations

import pytest

from fsdp_testing._protocol import Outcome, RankResult
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.verdict import VerdictOutcome, judge

P, F, S, X = Outcome.PASSED, Outcome.FAILED, Outcome.SKIPPED, Outcome.XFAILED


def _obs(outcomes: dict[int, Outcome], **fields: object) -> Observation:
    obs = Observation(world_size=len(outcomes) + len(fields.get("dead", ())), timeout=10.0)
    for rank, outcome in outcomes.items():
        obs.results[rank] = RankResult(
            rank=rank,
            outcome=outcome,
            message=f"message of rank {rank}",
            summary=f"RuntimeError: boom on rank {rank}" if outcome is F else "",
            finished_at=float(rank),
        )
    for name, value in fields.items():
        setattr(obs, name, value)
    return obs


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        ({0: P, 1: P}, VerdictOutcome.PASSED),
        ({0: P, 1: F}, VerdictOutcome.FAILED),
        ({0: S, 1: S}, VerdictOutcome.SKIPPED),
        ({0: P, 1: S}, VerdictOutcome.SKIPPED),  # a skip on some ranks skips the test
        ({0: S, 1: F}, VerdictOutcome.FAILED),  # a failure outweighs a skip
        ({0: X, 1: P}, VerdictOutcome.XFAILED),
        ({0: X, 1: S}, VerdictOutcome.SKIPPED),
        ({0: P}, VerdictOutcome.PASSED),
    ],
    ids=lambda v: ",".join(o.value for o in v.values()) if isinstance(v, dict) else str(v.value),
)
def test_outcome_table(outcomes: dict[int, Outcome], expected: VerdictOutcome) -> None:
    assert judge(_obs(outcomes)).outcome is expected


def test_outcome_is_a_string_enum_comparable_to_pytest_words() -> None:
    verdict = judge(_obs({0: P, 1: P}))
    assert verdict.outcome == "passed"


def test_skip_reason_is_the_first_skipping_ranks() -> None:
    obs = _obs({0: P, 1: S, 2: S})
    assert judge(obs).message == "message of rank 1"


def test_failed_rank_is_named_with_its_traceback_and_peers_not_blamed() -> None:
    verdict = judge(_obs({0: P, 1: F}))
    assert verdict.message.startswith("rank 1 failed: RuntimeError: boom on rank 1")
    assert "\n[rank 1]\nmessage of rank 1" in verdict.message
    assert "[rank 0]" not in verdict.message


def test_when_every_failure_is_a_broken_collective_the_first_to_fail_is_blamed() -> None:
    obs = _obs({0: F, 1: F, 2: F})
    for rank, finished in ((0, 5.0), (1, 2.0), (2, 9.0)):
        obs.results[rank].comm_error = True
        obs.results[rank].finished_at = finished
    message = judge(obs).message
    assert message.splitlines()[0] == (
        "rank 1 failed: RuntimeError: boom on rank 1 (ranks 0, 2 aborted)"
    )
    assert "[ranks 0, 2 (2 of 3)] aborted: their collective broke because rank 1 failed" in message


def test_a_real_failure_is_blamed_over_earlier_broken_collectives() -> None:
    obs = _obs({0: F, 1: F})
    obs.results[0].comm_error = True
    obs.results[0].finished_at = 0.0
    obs.results[1].finished_at = 1.0
    assert judge(obs).message.startswith("rank 1 failed:")


def test_dead_rank_is_the_cause_and_stuck_peer_is_aborted_with_its_stack(tmp_path) -> None:
    test_file = tmp_path / "test_a.py"  # the stack's source lines are read from the file
    test_file.write_text("def test_a():\n    x = 1\n    dist.barrier()\n")
    obs = _obs(
        {},
        world_size=2,
        dead={1},
        stragglers={0},
        exit_status={1: "killed by SIGKILL"},
        last_output={1: "last words"},
        stacks={0: f'Traceback:\n  File "{test_file}", line 3, in test_a\n    dist.barrier()'},
    )
    verdict = judge(obs)
    assert verdict.outcome is VerdictOutcome.FAILED
    lines = verdict.message.splitlines()
    assert lines[0] == "rank 1 killed by SIGKILL (rank 0 aborted)"
    assert "last words" in verdict.message
    assert "[rank 0] aborted: still running after rank 1 failed" in verdict.message
    assert "dist.barrier()" in verdict.message


def test_timeout_report_puts_divergence_on_top_of_stacks() -> None:
    entered = {"seq": 2, "op": "all_reduce", "group": "default", "shapes": [[1]], "dtype": "f32"}
    obs = _obs(
        {},
        world_size=2,
        timed_out=True,
        stragglers={0, 1},
        stacks={0: "stack of rank 0", 1: "stack of rank 1"},
        records={
            0: [{**entered, "state": "entered"}],
            1: [{**entered, "seq": 1, "state": "completed"}],
        },
    )
    message = judge(obs).message
    assert message.startswith("timed out after 10 s: ranks 0, 1 still running (of world size 2)")
    divergence = message.index("collective divergence:")
    assert divergence < message.index("[rank 0] stack when the timeout hit:")
    assert "rank 0 waits in all_reduce #2 but rank 1 never entered it" in message


def test_each_ranks_output_is_a_report_section() -> None:
    obs = _obs({0: P, 1: P})
    obs.results[1].stdout = "hello from 1\n"
    assert judge(obs).sections == [("output [rank 1]", "hello from 1\n")]


def test_outcome_prints_as_pytests_word() -> None:
    assert f"{VerdictOutcome.SKIPPED}" == "skipped"


def _dead_rank(output: str) -> str:
    obs = _obs(
        {},
        world_size=2,
        dead={1},
        stragglers={0},
        exit_status={1: "killed by SIGSEGV"},
        last_output={1: output},
    )
    return judge(obs).message


_DUMP = (
    "Fatal Python error: Segmentation fault\n\n"
    "{current} 0x00007f8e8d533b80 (most recent call first):\n"
    '  File "/t/_ops.py", line 875 in __call__\n'
    '  File "/t/test_x.py", line 3 in test_x\n'
)


def test_a_crashed_ranks_report_keeps_faulthandlers_whole_dump() -> None:
    # A long preamble (warnings, prints) must not push the dump out of the report; the lines
    # just before it (what a native crash printed first) stay.
    preamble = "noise\n" * 2000 + "terminate called after throwing an instance of 'gloo::X'\n"
    message = _dead_rank(preamble + _DUMP.format(current="Current thread"))
    assert "Fatal Python error: Segmentation fault" in message
    assert 'File "/t/test_x.py", line 3 in test_x' in message
    section = message.split("its last output:\n")[1]
    assert section.startswith("noise\n") and section.count("noise") == 9
    assert "terminate called after throwing an instance of 'gloo::X'\nFatal Python" in section
    assert "no thread as current" not in message


def test_a_fault_in_a_native_thread_is_said_so() -> None:
    message = _dead_rank(_DUMP.format(current="Thread"))
    assert "faulthandler marks no thread as current: the fault was in a thread that runs no " in (
        message
    )


def test_a_dead_rank_without_a_dump_shows_the_end_of_its_output() -> None:
    message = _dead_rank("x" * 5000 + "last words")
    section = message.split("its last output:\n")[1].split("\n\n[rank 0]")[0]
    assert section == ("x" * 5000 + "last words")[-3000:]
