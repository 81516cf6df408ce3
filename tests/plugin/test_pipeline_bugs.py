"""Pipeline code under the harness (issue 47): point-to-point ops and torch's pipelining schedules
run unchanged in process, thread and local mode; a user's planted bugs (wrong peer, forgotten
gradient scale, an order that deadlocks, both ranks receiving first, sizes that differ, a send
to oneself, a send nobody receives, another tag, a peer busy past the timeout) each fail with a
report naming the ranks, the ops, their peers and the lines, and a wait cycle ends its test long
before the timeout, with the same report in every mode; a message read as another dtype of its
size passes with a warning."""

from __future__ import annotations

import re

import pytest

from .._scenario import Run, line_of, processes_tagged, run_scenario

FILE = "test_pipeline_bugs.py"
#: Every planted test's timeout is 60 s; a certain deadlock ends it about a second in. 20 s
#: leaves room for a loaded CI machine (the looks run every quarter second, and stacks are
#: dumped after) while still proving that nothing waited for the timeout.
EARLY_S = 20.0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_scenario(tmp_path_factory.mktemp("pipeline"), FILE)


def _at(function: str, code: str) -> str:
    return f"{FILE}:{line_of(FILE, function, code)}"


def _plain(text: str) -> str:
    """Reports name a call's place by its folder and file: drop the run's temporary folder."""
    return re.sub(r"[\w.-]+/(" + re.escape(FILE) + ")", r"\1", text)


@pytest.mark.parametrize(
    "name",
    [
        *(f"test_ring_{mode}" for mode in ("process", "thread", "local")),
        *(
            f"test_torch_schedule_{mode}[{schedule}]"
            for mode in ("process", "thread", "local")
            for schedule in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B")
        ),
        "test_gpipe_parity_process",
        "test_gpipe_parity_local",
        "test_after_the_bugs",
    ],
)
def test_correct_code_runs_unchanged(run: Run, name: str) -> None:
    case = run.cases[name]
    assert case.outcome == "passed", case.text


@pytest.mark.parametrize("mode", ["process", "thread", "local"])
def test_a_receive_cycle_ends_the_test_at_once(run: Run, mode: str) -> None:
    case = run.cases[f"test_deadlock_{mode}"]
    at = _at("deadlock", "dist.recv(t, 1 - rank)  # planted: both ranks receive first")
    assert case.outcome == "failed"
    assert _plain(case.message).startswith("deadlock: ranks 0, 1 can never go on"), _plain(
        case.message
    )
    assert (
        f"rank 0 waits in recv #1 from rank 1 (at {at}) while rank 1 waits in recv #1 from "
        f"rank 0 (at {at})"
    ) in _plain(case.text)
    assert "has no matching send: rank 1 sent nothing to rank 0" in _plain(case.text)
    assert _plain(case.text).count("A blocking send waits until its receive is posted") == 1
    assert "stack when the deadlock was found" in _plain(case.text)
    assert case.seconds < EARLY_S, case.seconds


def test_local_mode_reports_a_deadlock_as_the_other_modes_do_once(run: Run) -> None:
    case = run.cases["test_deadlock_local"]
    text = _plain(case.text)
    assert "LocalDeadlock" not in text and "rank 0 failed" not in text
    # Each rank's place once: both stopped at the same line, one stack for both.
    assert "[ranks 0, 1 (2 of 2)] stack when the deadlock was found:" in text, text
    assert text.count("dist.recv(t, 1 - rank)  # planted: both ranks receive first") == 1, text
    # the advice of a collective's deadlock does not fit a point-to-point one
    assert "same collectives in the same order" not in text


@pytest.mark.parametrize("mode", ["process", "thread", "local"])
def test_a_message_to_the_wrong_rank_names_both_ends(run: Run, mode: str) -> None:
    case = run.cases[f"test_wrong_peer_{mode}"]
    send = _at("wrong_peer", "dist.send(t, 2)  # planted: stage 0's neighbour is rank 1")
    assert case.outcome == "failed"
    assert f"rank 0 waits in send #1 to rank 2 (at {send})" in _plain(case.text)
    assert "rank 1 waits in recv #1 from rank 0" in _plain(case.text)
    assert f"its send #1 went to rank 2 instead (at {send})" in _plain(case.text)
    assert "rank 2 finished the test (returned)" in _plain(case.text)
    assert case.seconds < EARLY_S, case.seconds
    # No order of the calls undoes a wrong peer: only the advice about matching them.
    assert "both send first" not in _plain(case.text)
    assert "Each send needs a receive of the same size and tag on its peer." in _plain(case.text)


@pytest.mark.parametrize("mode", ["process", "thread", "local"])
def test_a_tag_mismatch_names_both_tags(run: Run, mode: str) -> None:
    case = run.cases[f"test_tag_{mode}"]
    send = _at("tag_mismatch", "dist.send(t, 1, tag=1)  # planted: the receiver waits for tag 0")
    recv = _at("tag_mismatch", "dist.recv(t, 0, tag=0)")
    assert _plain(case.message).startswith("deadlock: ranks 0, 1 can never go on"), case.message
    assert (
        f"rank 1's recv #1 from rank 0 at {recv} has no matching send: rank 0's send #1 to rank "
        f"1 (at {send}) has tag 1, this recv waits for tag 0"
    ) in _plain(case.text), _plain(case.text)
    assert "sent nothing" not in _plain(case.text)
    assert "both send first" not in _plain(case.text)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_peer_busy_past_the_timeout_is_blamed_where_it_is(run: Run, mode: str) -> None:
    case = run.cases[f"test_busy_{mode}"]
    sleep = _at("busy_peer", "time.sleep(0.1)  # planted: busy past the timeout before its send")
    assert _plain(case.message).startswith("timed out after"), case.message
    assert (
        "rank 1 hangs: it never reached a send to rank 0, which rank 0's recv #1 waits for; "
        f"rank 1 is in time.sleep at {sleep}"
    ) in _plain(case.text), _plain(case.text)
    # Neither a cycle nor a mismatch: rank 1 is late, the advice about them does not fit.
    assert "both send first" not in _plain(case.text)
    assert "Each send needs a receive" not in _plain(case.text)


@pytest.mark.parametrize("mode", ["process", "thread", "local"])
def test_a_message_read_as_another_dtype_passes_with_a_warning(run: Run, mode: str) -> None:
    assert run.cases[f"test_dtype_{mode}"].outcome == "passed"
    send = _at("dtype_mismatch", "dist.send(torch.ones(D, dtype=torch.float32), 1)")
    recv = _at(
        "dtype_mismatch", "dist.recv(got, 0)  # planted: the sender's 16 bytes, read as float64"
    )
    message = (
        f"RuntimeWarning: fsdp_testing: dtype mismatch: rank 0's send #1 to rank 1 at {send} "
        f"sends float32[4] but rank 1's recv #1 from rank 0 at {recv} receives float64[2]: the "
        "same 16 bytes, read as another dtype"
    )
    # pytest's warnings summary: the test's id, then the warning at the test's line.
    warning = re.escape(f"{FILE}::test_dtype_{mode}") + r"\n  \S+:\d+: " + re.escape(message)
    assert re.search(warning, _plain(run.stdout)), _plain(run.stdout)


def test_correct_code_gets_no_dtype_warning(run: Run) -> None:
    # Only the three planted tests: the ring and torch's schedules send what they receive.
    assert run.stdout.count("RuntimeWarning: fsdp_testing: dtype mismatch") == 3, run.stdout


@pytest.mark.parametrize("mode", ["process", "local"])
def test_an_order_where_both_ranks_send_first_deadlocks(run: Run, mode: str) -> None:
    case = run.cases[f"test_order_{mode}"]
    send = _at(
        "order",
        "dist.send(a, 1 - rank)  # planted: the ranks' first ops must pair a send with a recv",
    )
    assert case.outcome == "failed"
    assert (
        f"rank 0 waits in send #1 to rank 1 (at {send}) while rank 1 waits in send #1 to "
        f"rank 0 (at {send})"
    ) in _plain(case.text)
    assert "two ranks that both send first, or both receive first" in _plain(case.text)
    assert case.seconds < EARLY_S, case.seconds


@pytest.mark.parametrize("mode", ["process", "local"])
def test_a_forgotten_gradient_scale_is_a_parity_failure(run: Run, mode: str) -> None:
    case = run.cases[f"test_grad_scale_{mode}"]
    assert case.outcome == "failed"
    assert "diverged from the reference" in _plain(case.message), _plain(case.message)
    assert "at step 1 of 2" in _plain(case.message) and "1.weight" in _plain(case.text)


@pytest.mark.parametrize("mode", ["process", "local"])
def test_a_receive_of_another_size_names_both_ranks_shapes_and_lines(run: Run, mode: str) -> None:
    case = run.cases[f"test_size_{mode}"]
    send = _at(
        "size_mismatch", "dist.send(torch.ones(2 * D), 1)  # planted: twice the receiver's buffer"
    )
    recv = _at("size_mismatch", "dist.recv(torch.empty(D), 0)")
    expected = (
        f"rank 0's send #1 to rank 1 (at {send}) sends 32 bytes (float32[8]) but rank 1's recv "
        f"#1 from rank 0 (at {recv}) receives 16 bytes (float32[4])"
    )
    if mode == "process":  # gloo aborts the receiver: the headline says why
        expected = expected.replace(" (at ", " at ").replace(") sends", " sends")
        expected = expected.replace(") receives", " receives")
        assert _plain(case.message).startswith("rank 1 killed by SIGABRT: size mismatch: "), _plain(
            case.message
        )
    assert expected in _plain(case.text), _plain(case.text)


@pytest.mark.parametrize("mode", ["process", "local"])
def test_a_send_to_oneself_is_an_error_naming_it(run: Run, mode: str) -> None:
    case = run.cases[f"test_self_send_{mode}"]
    assert case.outcome == "failed"
    assert "isend #1 to rank 0 names the rank itself as its peer" in _plain(case.text)
    assert "Pair is not connected" in _plain(case.text)  # gloo's own words, quoted
    assert "enforce fail" not in _plain(case.message)


@pytest.mark.parametrize("mode", ["process", "local"])
def test_a_send_nobody_receives_fails_the_test(run: Run, mode: str) -> None:
    case = run.cases[f"test_unmet_{mode}"]
    at = _at("unmet", "dist.isend(torch.ones(D), 2)  # planted: sent to a rank that never receives")
    assert _plain(case.message).startswith(
        f"rank 0 failed: rank 0 ended its test with isend #1 to rank 2 (at {at}) never received: "
        "rank 2 posted no matching receive"
    ), _plain(case.message)


def test_nothing_is_left_running(run: Run) -> None:
    assert processes_tagged(run.tag) == []
