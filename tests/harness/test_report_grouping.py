"""Reports at 64 ranks read like reports at 2 (issue 41): ranks that did the same thing are one
entry with their ranks as ranges, one traceback per distinct error, the first failure on top,
a bounded headline; a rank that returned is said to have returned; a broken collective names
the peer that failed and its call; a crash in a collective shows the collective log. Judged
in-process from real exceptions (``run_task``'s own description of a failure)."""

from __future__ import annotations

import pytest

from fsdp_testing._protocol import Outcome, RankResult
from fsdp_testing._report import failure
from fsdp_testing._report.divergence import describe_divergence, format_records
from fsdp_testing._report.grouping import group_ranks
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.text import rank_ranges, ranks_phrase
from fsdp_testing._report.verdict import HEADLINE_CHARS, judge


class _Tensorish:
    def item(self) -> float:
        return 64.0


def _raise_same(value: _Tensorish) -> None:
    # Like a rewritten ``assert t.item() == 0, msg``: the text names an object's address.
    raise AssertionError(
        f"the sum is not zero\nassert 64.0 == 0\n +  where 64.0 = <method item of {value!r}>()"
    )


def _raise_value(rank: int) -> None:
    raise ValueError(f"bad shard on rank {rank}\nsecond line of the message")


def _failed(rank: int, fn, *args: object, at: float | None = None) -> RankResult:
    try:
        fn(*args)
    except BaseException as exc:
        facts = failure.describe(exc)
        return RankResult(
            rank=rank,
            outcome=Outcome.FAILED,
            summary=facts.summary,
            fingerprint=facts.fingerprint,
            place=facts.place,
            pending=failure.Pending(exc, "long"),
            finished_at=float(rank) if at is None else at,
        )
    raise AssertionError("fn did not raise")


def _world(results: dict[int, RankResult], world: int, **fields: object) -> Observation:
    obs = Observation(world_size=world, timeout=10.0)
    obs.results.update(results)
    for name, value in fields.items():
        setattr(obs, name, value)
    return obs


def _check_size(message: str, lines: int) -> None:
    assert len(message.splitlines()) < lines, message
    assert max(len(line) for line in message.splitlines()) <= 300, message


def test_ranges() -> None:
    assert rank_ranges([0, 1, 2, 3, 5, 7, 8, 9]) == "0-3, 5, 7-9"
    assert rank_ranges([4, 5]) == "4, 5"
    assert ranks_phrase(range(63), of=64) == "ranks 0-62 (63 of 64)"
    assert ranks_phrase([3]) == "rank 3"
    # A list that is no range keeps its ends, the count says how many.
    evens = ranks_phrase(range(0, 128, 2), of=128)
    assert evens.startswith("ranks 0, 2, 4,") and evens.endswith(", ..., 126 (64 of 128)")
    assert len(evens) < 130
    # Ranks a step apart: the first three and the last.
    assert ranks_phrase(range(1, 64, 2), of=64) == "ranks 1, 3, 5, ..., 63 (32 of 64)"
    where = {r: f"node {r // 8}, local rank {r % 8}" for r in range(16)}
    assert ranks_phrase(range(16), where, of=16) == "ranks 0-15 (16 of 16) (nodes 0, 1)"
    assert ranks_phrase([9], where) == "rank 9 (node 1, local rank 1)"


def test_group_ranks_orders_groups_by_their_first_member() -> None:
    keys = {0: "a", 1: "b", 2: "a", 3: "b"}
    assert group_ranks(keys) == [[0, 2], [1, 3]]
    assert group_ranks(keys, {0: 5.0, 1: 1.0, 2: 6.0, 3: 7.0}) == [[1, 3], [0, 2]]


@pytest.mark.parametrize("world", [8, 64])
def test_ranks_failing_alike_are_one_entry_with_one_traceback(world: int) -> None:
    # Each rank's message names another object's address: still the same error.
    results = {
        r: _failed(r, _raise_same, _Tensorish(), at=10.0 + (r + 5) % world) for r in range(world)
    }
    message = judge(_world(results, world)).message
    first = world - 5  # finished first
    assert message.splitlines()[0] == (
        f"ranks 0-{world - 1} ({world} of {world}) failed: AssertionError: the sum is not zero"
    )
    assert f"the traceback of rank {first}, the first to fail" in message
    assert message.count("raise AssertionError(") == 1
    _check_size(message, 100)


def test_distinct_errors_each_have_a_traceback_first_failure_on_top() -> None:
    results = {r: _failed(r, _raise_same, _Tensorish(), at=5.0) for r in range(63)}
    results[63] = _failed(63, _raise_value, 63, at=1.0)
    message = judge(_world(results, 64)).message
    headline = message.splitlines()[0]
    # The whole multi-line message of each error, on one line, the first failure first.
    assert headline == (
        "rank 63 failed: ValueError: bad shard on rank 63 second line of the message; "
        "ranks 0-62 (63 of 64) failed: AssertionError: the sum is not zero"
    )
    assert message.index("[rank 63]") < message.index("[ranks 0-62 (63 of 64)]")
    assert message.count("raise AssertionError(") == 1
    assert message.count("raise ValueError(") == 1
    _check_size(message, 100)


def test_the_headline_is_bounded() -> None:
    def long_assert(rank: int) -> None:
        raise AssertionError(f"{rank} " + "x" * 400)

    def other(rank: int) -> None:
        raise KeyError(rank)

    def third(rank: int) -> None:
        raise TypeError(f"wrong type on rank {rank} " + "y" * 200)

    results = {r: _failed(r, [long_assert, other, third][r % 3], r) for r in range(64)}
    message = judge(_world(results, 64)).message
    headline = message.splitlines()[0]
    assert len(headline) <= HEADLINE_CHARS
    assert headline.startswith("ranks 0, 3, 6, ..., 63 (22 of 64) failed")
    assert "failed: AssertionError: 0 xxx" in headline
    assert "more below" in headline
    assert "[ranks 9, 12, 15, ..., 63 (19 of 64)]" in message
    assert len(message.splitlines()) < 100


def test_ranks_failing_at_one_place_with_other_numbers_share_the_traceback() -> None:
    def compare(rank: int) -> None:
        raise AssertionError(f"Tensor-likes are not close!\nGreatest difference: {rank / 7}")

    results = {r: _failed(r, compare, r) for r in range(64)}
    message = judge(_world(results, 64)).message
    assert message.splitlines()[0].startswith(
        "ranks 0-63 (64 of 64) failed: AssertionError: Tensor-likes are not close! Greatest "
        "difference: 0.0 (other messages on ranks 1-63)"
    )
    assert message.count("raise AssertionError(") == 1
    assert "[rank 1] failed at the same place with another message" in message
    assert "[ranks 3-63 (61 of 64)] failed at the same place with other messages" in message
    _check_size(message, 100)


def test_one_rank_more_failing_at_one_place_is_shown_as_the_others() -> None:
    # Ranks 1 and 2 are the variants shown; one rank more is shown alike, not "e.g. rank 3".
    def compare(rank: int) -> None:
        raise AssertionError(f"Tensor-likes are not close!\nGreatest difference: {rank / 7}")

    message = judge(_world({r: _failed(r, compare, r) for r in range(4)}, 4)).message
    assert message.splitlines()[-2:] == [
        "[rank 3] failed at the same place with another message:",
        "  AssertionError: Tensor-likes are not close! Greatest difference: 0.42857142857142855",
    ]
    assert "e.g." not in message
    # The same for ranks failing alike: one message more, shown with all its ranks.
    results = {r: _failed(r, compare, min(r, 3)) for r in range(5)}
    message = judge(_world(results, 5)).message
    assert "[ranks 3, 4 (2 of 5)] failed at the same place with another message:" in message
    assert "e.g." not in message


def test_long_messages_of_ranks_failing_at_one_place_fit_a_line() -> None:
    # check_parity's divergence on every rank: one place, a long message with each rank's loss.
    def diverged(rank: int) -> None:
        raise AssertionError(f"[rank {rank}] loss {rank / 7}" + "\n  w: max abs diff 0.1" * 30)

    message = judge(_world({r: _failed(r, diverged, r) for r in range(64)}, 64)).message
    assert "[ranks 3-63 (61 of 64)] failed at the same place with other messages" in message
    _check_size(message, 100)


def test_the_same_message_with_other_values_says_so_and_shows_them() -> None:
    def rewritten(rank: int) -> None:  # pytest's rewrite of assert rank == 5, "first\nsecond"
        raise AssertionError(f"first line\nsecond line\nassert {rank} == 5\n +  where")

    message = judge(_world({r: _failed(r, rewritten, r) for r in range(2)}, 2)).message
    lines = message.splitlines()
    assert lines[0] == (
        "ranks 0, 1 (2 of 2) failed: AssertionError: first line second line (other values on "
        "rank 1)"
    )
    assert lines[-2:] == [
        "[rank 1] failed at the same place with other values:",
        "  AssertionError: first line second line (assert 1 == 5)",
    ]


def test_the_summary_keeps_the_whole_assertion_message_not_pytests_explanation() -> None:
    facts = failure.describe(AssertionError("first line\nsecond line\nassert 0 == 5\n +  where"))
    assert facts.summary == "AssertionError: first line second line"
    assert failure.describe(AssertionError("assert 0 == 5\n +  where 0 = f()")).summary == (
        "AssertionError: assert 0 == 5"
    )


def _rec(op: str, seq: int, state: str) -> dict:
    return {
        "seq": seq,
        "op": op,
        "group": "default",
        "shapes": [[1]],
        "dtype": "float32",
        "state": state,
        "t": 0.0,
    }


def test_hang_stacks_and_logs_of_ranks_stopped_alike_are_shown_once() -> None:
    world = 64
    stack = 'Current thread 0x{:012x} (most recent call first):\n  File "/t/test_x.py", line 9 in test_x\n'
    obs = _world(
        {63: RankResult(rank=63, outcome=Outcome.PASSED)},
        world,
        timed_out=True,
        stragglers=set(range(63)),
        stacks={r: stack.format(0x7F0000 + r) for r in range(63)},
        records={**{r: [_rec("all_reduce", 1, "entered")] for r in range(63)}, 63: []},
    )
    message = judge(obs).message
    assert message.splitlines()[:2] == [
        "timed out after 10 s: ranks 0-62 still running (of world size 64)",
        "rank 63 finished the test (returned) without entering all_reduce #1, which ranks 0-62 "
        "wait in",
    ]
    assert "hangs" not in message  # it returned: it does not hang
    assert "[ranks 0-62 (63 of 64)] stack when the timeout hit:" in message
    assert message.count("line 9 in test_x") == 1
    assert "  ranks 0-62 wait in all_reduce #1 but rank 63 never entered it" in message
    _check_size(message, 100)


def test_a_rank_still_running_outside_the_collective_hangs() -> None:
    obs = _world(
        {},
        2,
        timed_out=True,
        stragglers={0, 1},
        records={0: [_rec("all_reduce", 1, "entered")], 1: []},
    )
    assert (
        "rank 1 hangs: it never entered all_reduce #1, which rank 0 waits in" in judge(obs).message
    )


def test_divergence_lines_and_logs_are_grouped() -> None:
    records = {r: [_rec("all_reduce", 1, "entered")] for r in range(60)}
    records.update({r: [_rec("broadcast", 1, "entered")] for r in range(60, 64)})
    lines = describe_divergence(records)
    assert lines == ["ranks 0-59 wait in all_reduce #1 while ranks 60-63 wait in broadcast #1"]
    assert format_records(records) == [
        "  ranks 0-59:",
        "    all_reduce #1 shapes=[[1]] dtype=float32 [entered]",
        "  ranks 60-63:",
        "    broadcast #1 shapes=[[1]] dtype=float32 [entered]",
    ]


def test_a_broken_collective_names_the_peer_that_failed_and_its_call() -> None:
    cause = _failed(0, _raise_value, 0)
    broken = {
        r: RankResult(
            rank=r,
            outcome=Outcome.FAILED,
            summary=f"RuntimeError: Connection closed by peer [127.0.0.1]:{5000 + r}",
            comm_error=True,
            finished_at=2.0,
        )
        for r in range(1, 4)
    }
    records = {0: [_rec("broadcast", 1, "completed")]}
    records.update({r: [_rec("all_reduce", 2, "raised")] for r in range(1, 4)})
    message = judge(_world({0: cause, **broken}, 4, records=records)).message
    assert (
        "[ranks 1-3 (3 of 4)] aborted: their collective (all_reduce #2 [raised]) broke because "
        "rank 0 failed (last collective of rank 0: broadcast #1 [completed]): RuntimeError: "
        "Connection closed by peer"
    ) in message


def test_failed_ranks_with_the_same_last_collective_are_named_once() -> None:
    # Half of 64 local-mode ranks raise in a backward hook; the harness stops the other half.
    failed = {r: _failed(r, _raise_value, r) for r in range(1, 64, 2)}
    stopped = {
        r: RankResult(r, Outcome.FAILED, summary="Aborted: aborted by the harness", comm_error=True)
        for r in range(0, 64, 2)
    }
    records = {r: [_rec("broadcast", 4, "completed")] for r in failed}
    records.update({r: [_rec("reduce_scatter", 5, "raised")] for r in stopped})
    message = judge(_world({**failed, **stopped}, 64, records=records)).message
    assert (
        "[ranks 0, 2, 4, ..., 62 (32 of 64)] aborted: their collective (reduce_scatter #5 "
        "[raised]) broke because ranks 1, 3, 5, ..., 63 failed (last collective of ranks 1, 3, "
        "5, ..., 63: broadcast #4 [completed])\n"
    ) in message + "\n"
    _check_size(message, 100)


def test_a_crash_in_a_collective_shows_the_collective_log() -> None:
    obs = _world(
        {},
        2,
        dead={1},
        stragglers={0},
        exit_status={1: "killed by SIGABRT"},
        last_output={1: "terminate called after throwing an instance of 'gloo::EnforceNotMet'"},
        records={0: [_rec("all_reduce", 1, "entered")], 1: [_rec("broadcast", 1, "entered")]},
    )
    message = judge(obs).message
    assert message.startswith("rank 1 killed by SIGABRT")
    assert (
        "collective divergence:\n  rank 0 waits in all_reduce #1 while rank 1 waits in broadcast #1"
        in message
    )
    assert "last communication per rank:" in message
    assert "gloo::EnforceNotMet" in message


def test_dead_ranks_that_died_alike_are_one_entry() -> None:
    world = 64
    obs = _world(
        {},
        world,
        dead=set(range(world)),
        exit_status=dict.fromkeys(range(world), "killed by SIGSEGV"),
        last_output={
            r: f'Fatal Python error: Segmentation fault\n\nThread 0x{r:x} (most recent call first):\n  File "/t/x.py", line 3 in f\n'
            for r in range(world)
        },
    )
    message = judge(obs).message
    assert message.splitlines()[0] == "ranks 0-63 (64 of 64) killed by SIGSEGV"
    assert message.count("Segmentation fault") == 1
    _check_size(message, 100)


def test_aborted_peers_stacks_read_as_hang_stacks(tmp_path) -> None:
    # A peer still running after rank 0 failed is stopped; its faulthandler dump is shown as a
    # hang report shows a stack: outermost call first, sources, torch's frames folded, the
    # harness's dropped.
    import os

    import torch

    test_file = tmp_path / "test_x.py"
    test_file.write_text("def test_x():\n    dist.all_reduce(t)\n")
    c10d = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    logger = os.path.join(os.path.dirname(torch.__file__), "distributed", "c10d_logger.py")
    dump = (
        "Current thread 0x{:012x} (most recent call first):\n"
        f'  File "{c10d}", line 4000 in all_reduce\n'
        f'  File "{logger}", line 81 in wrapper\n'
        f'  File "{test_file}", line 2 in test_x\n'
        '  File "/site/fsdp_testing/_rank/run_task.py", line 80 in run_task\n'
    )
    obs = _world(
        {0: _failed(0, _raise_value, 0)},
        4,
        stragglers={1, 2, 3},
        stacks={r: dump.format(0x7F0000 + r) for r in range(1, 4)},
    )
    message = judge(obs).message
    assert message.split("\n\n")[-1].splitlines() == [
        "[ranks 1-3 (3 of 4)] aborted: still running after rank 0 failed; they were stopped. "
        "Where they were (the stack of rank 1):",
        "Current thread 0x0000007f0001 (most recent call last):",
        f'  File "{test_file}", line 2 in test_x',
        "    dist.all_reduce(t)",
        "  ... 2 frames in torch: wrapper (c10d_logger.py:81) -> all_reduce "
        "(distributed_c10d.py:4000)",
    ]
