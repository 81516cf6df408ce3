"""The point-to-point analysis and the certain-deadlock rule, in-process on hand-written logs
(``_report/p2p.py``, ``_report/deadlock.py``; see [Note: a certain deadlock])."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_testing._protocol import Outcome, RankResult
from fsdp_testing._report.deadlock import find_deadlock
from fsdp_testing._report.hang_report import timeout_report
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.p2p import describe_p2p, dtype_mismatches, unmatched
from fsdp_testing._report.verdict import judge


def _p2p(
    family: str, n: int, peer: int | None, state: str, *, seq: int | None = None, tag: int = 0
) -> dict[str, Any]:
    op = "send" if family == "send" else "recv"
    entry: dict[str, Any] = {
        "op": op,
        "family": family,
        "n": n,
        "group": "default",
        "shapes": [[4]],
        "dtype": "float32",
        "bytes": 16,
        "state": state,
        "p2p": True,
        "tag": tag,
        "blocking": True,
        "at": f"/x/tests/test_pipe.py:{10 + n}",
        "t": 0.0,
    }
    if peer is not None:
        entry["peer"] = peer
        entry["seq"] = seq if seq is not None else n
    return entry


def _coll(op: str, n: int, seq: int, state: str, ranks: str = "0-1") -> dict[str, Any]:
    return {
        "op": op,
        "family": op,
        "n": n,
        "seq": seq,
        "c": seq,
        "group": "default",
        "ranks": ranks,
        "shapes": [[1]],
        "dtype": "float32",
        "bytes": 4,
        "state": state,
        "t": 0.0,
    }


def test_two_receives_from_each_other_are_a_certain_deadlock() -> None:
    records = {0: [_p2p("recv", 1, 1, "waiting")], 1: [_p2p("recv", 1, 0, "waiting")]}
    found = find_deadlock(records, {0: {}, 1: {}}, frozenset())
    assert found is not None and found.ranks == (0, 1)
    assert found.lines() == [
        "rank 0 waits in recv #1 from rank 1 (at tests/test_pipe.py:11) while rank 1 waits in "
        "recv #1 from rank 0 (at tests/test_pipe.py:11)"
    ]


def test_a_receive_whose_send_was_issued_is_not_stuck() -> None:
    # Rank 1 issued its isend to rank 0 before blocking in its own receive: both complete.
    records = {
        0: [_p2p("recv", 1, 1, "waiting")],
        1: [_p2p("send", 1, 0, "issued"), _p2p("recv", 1, 0, "waiting")],
    }
    channels = {0: {"default|1>0|0": 0}, 1: {"default|1>0|0": 1, "default|0>1|0": 1}}
    assert find_deadlock(records, channels, frozenset()) is None


def test_a_receive_waiting_on_a_running_rank_is_not_stuck() -> None:
    records = {0: [_p2p("recv", 1, 1, "waiting")], 1: [_coll("all_reduce", 1, 1, "completed")]}
    assert find_deadlock(records, {0: {}, 1: {}}, frozenset()) is None


def test_a_send_to_a_rank_that_finished_is_stuck() -> None:
    records = {0: [_p2p("send", 1, 2, "waiting")], 1: [_p2p("recv", 1, 0, "waiting")], 2: []}
    found = find_deadlock(records, {0: {}, 1: {}, 2: {}}, frozenset({2}))
    assert found is not None and found.ranks == (0, 1)
    lines = found.lines({2: "returned"})
    assert lines == [
        "rank 0 waits in send #1 to rank 2 (at tests/test_pipe.py:11), and rank 2 finished the "
        "test (returned)",
        "rank 1 waits in recv #1 from rank 0 (at tests/test_pipe.py:11), and rank 0 is stuck too",
    ]


def test_a_collective_and_a_receive_can_wait_on_each_other() -> None:
    # Rank 0 all-reduces while rank 1 waits for a message rank 0 would send after it.
    records = {
        0: [_coll("all_reduce", 1, 1, "waiting")],
        1: [_p2p("recv", 1, 0, "waiting")],
    }
    found = find_deadlock(records, {0: {}, 1: {}}, frozenset())
    assert found is not None
    assert "rank 0 waits in all_reduce #1 for rank 1 to enter it" in found.lines()[0]


@pytest.mark.parametrize(
    ("records", "channels"),
    [
        pytest.param(
            {0: [_p2p("recv", 1, None, "waiting")], 1: [_p2p("recv", 1, 0, "waiting")]},
            {0: {}, 1: {}},
            id="a-receive-from-any-rank",
        ),
        pytest.param(
            {0: [_coll("all_reduce", 1, 1, "waiting")], 1: [_coll("broadcast", 1, 1, "waiting")]},
            {0: {}, 1: {}},
            id="mismatched-collectives-are-left-to-the-timeout",
        ),
        pytest.param(
            {0: [_p2p("recv", 1, 1, "waiting")], 1: [_p2p("recv", 40, 0, "waiting", seq=40)] * 32},
            {0: {}, 1: None},
            id="a-log-that-cannot-tell",
        ),
    ],
)
def test_what_the_logs_cannot_prove_is_never_called_a_deadlock(
    records: dict[int, list[dict[str, Any]]], channels: dict[int, Any]
) -> None:
    assert find_deadlock(records, channels, frozenset()) is None


def test_sizes_that_differ_name_both_ranks_shapes_and_lines() -> None:
    send = {**_p2p("send", 1, 1, "completed"), "bytes": 32, "shapes": [[8]]}
    records = {0: [send], 1: [_p2p("recv", 1, 0, "waiting")]}
    assert describe_p2p(records, {0: {}, 1: {}})[0] == (
        "size mismatch: rank 0's send #1 to rank 1 at tests/test_pipe.py:11 sends 32 bytes "
        "(float32[8]) but rank 1's recv #1 from rank 0 at tests/test_pipe.py:11 receives 16 "
        "bytes (float32[4])"
    )


def test_a_receive_nobody_sends_names_where_the_peer_sent_instead() -> None:
    records = {
        0: [_p2p("send", 1, 2, "waiting")],
        1: [_p2p("recv", 1, 0, "waiting")],
        2: [],
    }
    channels = {0: {"default|0>2|0": 1}, 1: {"default|0>1|0": 1}, 2: {}}
    lines = describe_p2p(records, channels, finished={2: "returned"})
    assert lines == [
        "rank 0's send #1 to rank 2 at tests/test_pipe.py:11 has no matching recv: rank 2 "
        "posted none from rank 0, and it returned",
        "rank 1's recv #1 from rank 0 at tests/test_pipe.py:11 has no matching send: rank 0 "
        "sent nothing to rank 1; its send #1 went to rank 2 instead (at tests/test_pipe.py:11)",
    ]


def test_message_counts_outlive_the_ring() -> None:
    # Rank 1's log lost its sends to rank 0, but its counts keep them: the receive is matched.
    records = {0: [_p2p("recv", 7, 1, "waiting", seq=7)], 1: []}
    assert not unmatched(records, {1: {"default|1>0|0": 7}}, 0, records[0][0])
    assert unmatched(records, {1: {"default|1>0|0": 6}}, 0, records[0][0])


def test_a_send_and_a_receive_that_differ_only_in_tag_name_both_tags() -> None:
    # Rank 0 sent to rank 1 with tag 1; rank 1 waits for tag 0: "sent nothing" would be false.
    records = {0: [_p2p("send", 1, 1, "waiting", tag=1)], 1: [_p2p("recv", 1, 0, "waiting")]}
    channels = {0: {"default|0>1|1": 1}, 1: {"default|0>1|0": 1}}
    assert describe_p2p(records, channels) == [
        "rank 0's send #1 to rank 1 (tag 1) at tests/test_pipe.py:11 has no matching recv: "
        "rank 1's recv #1 from rank 0 (at tests/test_pipe.py:11) waits for tag 0, this send "
        "has tag 1",
        "rank 1's recv #1 from rank 0 at tests/test_pipe.py:11 has no matching send: rank 0's "
        "send #1 to rank 1 (at tests/test_pipe.py:11) has tag 1, this recv waits for tag 0",
    ]


def _hang(records: dict[int, list[dict[str, Any]]], stacks: dict[int, str]) -> str:
    """The report of a test whose ranks ``0..n-1`` all ran until the timeout."""
    obs = Observation(
        world_size=len(records),
        timeout=10,
        stragglers=set(records),
        timed_out=True,
        records=records,
        channels={r: {} for r in records},
        stacks=stacks,
        sources={1: {"/x/tests/test_hang.py:14": "time.sleep(60)  # busy computing"}},
    )
    return timeout_report(obs)


BUSY_STACK = (
    "Thread 0x00007f0000000001 (most recent call first):\n"
    '  File "/x/tests/test_hang.py", line 14 in test_busy\n'
    '  File "/x/fsdp_testing/_rank/run_task.py", line 103 in run_task\n'
)


def test_a_receive_whose_peer_is_busy_blames_the_peer_and_its_place() -> None:
    # Rank 1 is running, in no call: it has not reached its send yet. Not a cycle.
    report = _hang({0: [_p2p("recv", 1, 1, "waiting")], 1: []}, {0: "", 1: BUSY_STACK})
    assert (
        "rank 1 hangs: it never reached a send to rank 0, which rank 0's recv #1 waits for; "
        "rank 1 is in time.sleep at tests/test_hang.py:14"
    ) in report.splitlines(), report
    assert "both send first" not in report
    assert "Each send needs a receive" not in report  # nothing is mismatched, rank 1 is late


def test_only_a_cycle_gets_the_advice_about_order() -> None:
    cycle = _hang({0: [_p2p("recv", 1, 1, "waiting")], 1: [_p2p("recv", 1, 0, "waiting")]}, {})
    assert "two ranks that both send first, or both receive first" in cycle
    assert "Each send needs a receive" not in cycle  # they match, once ordered
    # Rank 0 sends to rank 2 instead of 1: a cycle (0 on 2, 2 on 1, 1 on 0) of a send and
    # receives, a wrong peer that no order of the calls undoes.
    wrong = _hang(
        {
            0: [_p2p("send", 1, 2, "waiting")],
            1: [_p2p("recv", 1, 0, "waiting")],
            2: [_p2p("recv", 1, 1, "waiting")],
        },
        {},
    )
    assert "both send first" not in wrong
    assert "Each send needs a receive of the same size and tag on its peer." in wrong


def test_a_cycle_of_sends_whose_receives_wait_under_another_tag_gets_the_tag_advice() -> None:
    # A ring of isend/irecv pairs: each rank waits in its isend, and its peer's irecv for it is
    # posted, with another tag. Ordering the calls would not help; the tags would.
    def ring_rank(rank: int) -> list[dict[str, Any]]:
        send = _p2p("send", 1, 1 - rank, "waiting", tag=rank)
        recv = _p2p("recv", 1, 1 - rank, "issued", tag=9)
        return [send, recv]

    report = _hang({0: ring_rank(0), 1: ring_rank(1)}, {})
    assert "Each send needs a receive of the same size and tag on its peer." in report, report
    assert "both send first" not in report


def test_a_message_received_as_another_dtype_of_its_size_is_a_warning() -> None:
    # float32[4] received into float64[2]: gloo copies the 16 bytes; correct code may mean it.
    send = _p2p("send", 1, 1, "completed")
    recv = {**_p2p("recv", 1, 0, "completed"), "dtype": "float64", "shapes": [[2]]}
    obs = Observation(
        world_size=2,
        timeout=10,
        results={r: RankResult(r, Outcome.PASSED, p2p=True) for r in (0, 1)},
        records={0: [send, {**send, "n": 2, "seq": 2}], 1: [recv, {**recv, "n": 2, "seq": 2}]},
    )
    verdict = judge(obs)
    assert verdict.outcome == "passed"
    assert verdict.notes == [
        "dtype mismatch: rank 0's send #1 to rank 1 at tests/test_pipe.py:11 sends float32[4] "
        "but rank 1's recv #1 from rank 0 at tests/test_pipe.py:11 receives float64[2]: the same "
        "16 bytes, read as another dtype (gloo copies a message's bytes without converting "
        "them). Give both ends one dtype, or filter this warning if the reinterpretation is "
        "meant (and 1 more like it)"
    ]
    # The same dtype, or another size (an error of its own), is no such note.
    same = {**recv, "dtype": "float32", "shapes": [[4]]}
    assert dtype_mismatches({0: [send], 1: [same]}) == []
    assert dtype_mismatches({0: [send], 1: [{**recv, "bytes": 8}]}) == []
