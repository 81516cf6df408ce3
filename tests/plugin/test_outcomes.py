"""The pytest-native API end to end: a child session runs scenarios/test_outcomes.py once and each
test here checks one documented behaviour (docs/pytest-api.md) in its report."""

from __future__ import annotations

import pytest
import torch

from .._scenario import Run, line_of, processes_tagged, run_scenario


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_scenario(tmp_path_factory.mktemp("outcomes"), "test_outcomes.py")


def test_world_size_list_parametrizes_and_passes(run: Run) -> None:
    assert run.cases["test_all_reduce[ws2]"].outcome == "passed"
    assert run.cases["test_all_reduce[ws4]"].outcome == "passed"


def test_thread_and_fake_modes_run(run: Run) -> None:
    assert run.cases["test_thread_mode"].outcome == "passed", run.cases["test_thread_mode"].text
    assert run.cases["test_fake_mode"].outcome == "passed", run.cases["test_fake_mode"].text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice made where no GPU exists")
def test_gloo_is_picked_without_gpus(run: Run) -> None:
    assert run.cases["test_gloo_backend_on_cpu"].outcome == "passed"


def test_fixtures_and_parameters_reach_the_ranks(run: Run) -> None:
    case = run.cases["test_fixtures_reach_ranks[3]"]
    assert case.outcome == "passed", case.text


def test_tmp_path_factory_reaches_the_ranks(run: Run) -> None:
    case = run.cases["test_tmp_path_factory_reaches_ranks"]
    assert case.outcome == "passed", case.text


def test_unpicklable_fixture_is_named(run: Run) -> None:
    case = run.cases["test_unpicklable_fixture"]
    assert case.outcome == "failed"
    assert "fixture or parameter 'unpicklable'" in case.text
    assert "cannot be sent to the rank processes" in case.text
    # The test's error, the message alone: none of the harness's source above it.
    assert case.text.startswith(
        "test_outcomes.py::test_unpicklable_fixture: fixture or parameter 'unpicklable' "
        "(function) cannot be sent to the rank processes: "
    ), case.text
    assert case.text.rstrip().endswith("or use mode='thread'."), case.text
    assert "\n" not in case.text.strip(), case.text  # one line: no chain, no frames
    assert "build_task" not in case.text and "pytest_runtest_call" not in case.text


def test_failing_rank_named_and_waiting_peer_aborted_promptly(run: Run) -> None:
    case = run.cases["test_one_rank_fails_peer_waits"]
    assert case.outcome == "failed"
    assert case.message.startswith("rank 1 failed: AssertionError: rank one disagrees")
    assert "(rank 0 aborted)" in case.message
    assert "[rank 1]\n" in case.text and "assert t.sum() == 3" in case.text
    assert "[rank 0] aborted: still running after rank 1 failed" in case.text
    assert "dist.all_reduce(t)" not in case.text.split("[rank 0] aborted")[0].split("[rank 1]")[0]
    assert case.seconds < 3.0, (
        f"took {case.seconds:.2f} s: the failure must not wait for the timeout"
    )


def test_thread_rank_failure_aborts_peers_promptly(run: Run) -> None:
    case = run.cases["test_thread_rank_fails_peer_waits"]
    assert case.outcome == "failed"
    assert case.message.startswith("rank 0 failed: ValueError: thread rank zero broke")
    assert "rank 1 aborted" in case.message
    assert case.seconds < 3.0


def test_only_failing_ranks_are_reported(run: Run) -> None:
    case = run.cases["test_only_rank_two_fails"]
    assert case.outcome == "failed"
    assert case.message.startswith("rank 2 failed: AssertionError: rank two is wrong")
    assert "[rank 0]" not in case.text and "[rank 1]" not in case.text


def test_skip_on_ranks_is_a_skip_with_the_reason(run: Run) -> None:
    case = run.cases["test_skip_on_ranks"]
    assert case.outcome == "skipped"
    assert "needs a widget factory" in case.message


def test_xfail_on_ranks_is_an_xfail(run: Run) -> None:
    case = run.cases["test_xfail_on_ranks"]
    assert case.outcome == "xfailed" and "known widget bug" in case.message


def test_timeout_reports_stacks_and_divergence(run: Run) -> None:
    case = run.cases["test_timeout_diverging_collectives"]
    assert case.outcome == "failed"
    assert case.message.startswith("timed out after 2 s")
    assert "rank 0 waits in broadcast #1 while rank 1 waits in all_reduce #2" in case.text
    assert "[rank 0] stack when the timeout hit:" in case.text
    fn = "test_timeout_diverging_collectives"
    rank0_line = line_of("test_outcomes.py", fn, "dist.broadcast(t, 0)")
    rank1_line = line_of("test_outcomes.py", fn, "else:") + 1
    assert f'test_outcomes.py", line {rank0_line} in {fn}' in case.text.split("[rank 1] stack")[0]
    assert f'test_outcomes.py", line {rank1_line} in {fn}' in case.text.split("[rank 1] stack")[1]
    assert "fsdp_testing/_" not in case.text, "harness frames must be trimmed"
    # Readable at a glance: the source line under the frame, torch's own frames folded, and the
    # divergence above the stacks.
    rank0 = case.text.split("[rank 0] stack when the timeout hit:")[1].split("[rank 1]")[0]
    assert f"line {rank0_line} in {fn}\n    dist.broadcast(t, 0)\n" in rank0
    assert "frames in torch:" in rank0 and "distributed_c10d.py" not in rank0.split("frames in")[0]
    assert case.text.index("collective divergence:") < case.text.index("[rank 0] stack")
    assert case.seconds < 2 + 5, "the report must arrive within 5 s of the timeout"


def test_timeout_names_the_rank_that_never_entered(run: Run) -> None:
    case = run.cases["test_timeout_rank_never_enters"]
    assert "rank 0 waits in all_gather_into_tensor #1 but rank 1 never entered it" in case.text
    fn = "test_timeout_rank_never_enters"
    assert f"line {line_of('test_outcomes.py', fn, 'time.sleep(60)')} in {fn}" in case.text


def test_thread_timeout_stops_the_threads(run: Run) -> None:
    case = run.cases["test_thread_timeout"]
    assert case.message.startswith("timed out after 2 s")
    assert "rank 0 waits in all_reduce #1 but rank 1 never entered it" in case.text
    assert "could not be stopped" not in case.text


def test_exit_code_names_the_dead_rank(run: Run) -> None:
    case = run.cases["test_rank_exits"]
    assert case.message.startswith("rank 1 exited with code 3 (rank 0 aborted)")
    assert "rank 1 says goodbye" in case.text


def test_signal_names_the_dead_rank(run: Run) -> None:
    case = run.cases["test_rank_killed_by_signal"]
    assert case.message.startswith("rank 0 killed by SIGSEGV (rank 1 aborted)")


def test_next_test_runs_normally_after_crashes(run: Run) -> None:
    assert run.cases["test_runs_normally_after_crashes"].outcome == "passed"


def test_output_is_shown_per_rank(run: Run) -> None:
    section = run.stdout.split("PASSED test_output_is_captured_per_rank")[0]
    section = section.split("test_output_is_captured_per_rank ___")[-1]
    assert "Captured output [rank 0] call" in section and "hello from rank 0" in section
    assert "Captured output [rank 1] call" in section and "hello from rank 1" in section


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip made where no GPU exists")
def test_nccl_without_gpus_is_skipped_in_the_parent(run: Run) -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs: nccl runs")
    case = run.cases["test_nccl_without_gpus"]
    assert case.outcome == "skipped"
    assert "nccl with world_size=2 needs 2 CUDA devices" in case.message


def test_nothing_is_left_running(run: Run) -> None:
    assert run.returncode == 1
    assert processes_tagged(run.tag) == []
