"""Thread mode's failure reports blame the rank whose call differs (issue 41): each rank's call
of a collective is checked against its peers' before any data moves, as in local mode; a peer
stopped in a collective is reported as stopped, never as a test body that called sys.exit. See
[Note: thread mode's call check] in fsdp_testing/_launch/thread_group.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

MISMATCHES = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2, mode="thread")
def test_other_shape(rank):
    t = torch.zeros(5 if rank == 0 else 3)
    dist.broadcast(t, src=0)

@pytest.mark.distributed(world_size=3, mode="thread")
def test_other_op_on_a_subgroup(rank):
    group = dist.new_group([1, 2])
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 2:
        dist.barrier(group=group)
    elif rank == 1:
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MAX, group=group)
"""


def test_the_report_names_what_each_rank_issued(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(MISMATCHES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*mode='thread': the ranks issued different collectives as the 1st collective of "
            "the default group: rank 0 issued broadcast(float32[[]5[]], src 0); rank 1 issued "
            "broadcast(float32[[]3[]], src 0)*"
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*the ranks issued different collectives as the 1st collective of group '*' "
            "(ranks [[]1, 2[]]): rank 1 issued all_reduce(float32[[]1[]], MAX); rank 2 issued "
            "barrier()*"
        ]
    )
    text = result.stdout.str()
    assert "must match the size" not in text  # torch's error on rank 0, which blamed it
    assert "sys.exit" not in text
    # torch's debug record of each rank's failed collective repeats the error: not shown.
    assert "Captured log" not in text


STOPPED_PEER = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2, mode="thread")
def test_peer_fails_while_rank_waits(rank):
    if rank == 0:
        raise ValueError("rank zero broke")
    dist.all_reduce(torch.ones(1))

@pytest.mark.distributed(world_size=2, mode="thread")
def test_matching_calls_still_work(rank):
    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=1)
    dist.barrier()
    assert t.tolist() == [1.0, 1.0, 1.0]
"""


def test_a_stopped_peer_is_not_a_body_that_called_sys_exit(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(STOPPED_PEER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 0 failed: ValueError: rank zero broke*",
            # The peer names the collective it was in and the failed rank's last one.
            "[[]rank 1[]] aborted: its collective (all_reduce #1 [[]raised[]]) broke because "
            "rank 0 failed (last collective of rank 0: no collective)",
        ]
    )
    text = result.stdout.str()
    assert "Test termination event" not in text
    assert "the test body called sys.exit" not in text
    assert "aborted by the harness" not in text


# The single-tensor all-gather as the installed torch spells it: torch 2.11 has
# all_gather_into_tensor only; all_gather_single came later.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

GATHER_OUTPUTS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2, mode="thread")
def test_one_rank_too_big(rank):
    dist.all_gather_single(torch.empty(2 if rank == 0 else 4), torch.ones(1))

@pytest.mark.distributed(world_size=2, mode="thread")
def test_every_rank_too_big(rank):
    dist.all_gather_single(torch.empty(4), torch.ones(1))

@pytest.mark.distributed(world_size=2, mode="thread")
def test_outputs_that_fit(rank):
    out = torch.empty(2)
    dist.all_gather_single(out, torch.full((1,), float(rank)))
    rows = torch.empty(2, 3)
    dist.all_gather_single(rows, torch.full((3,), float(rank)))
    assert out.tolist() == [0.0, 1.0] and rows[1].tolist() == [1.0] * 3
"""


def test_an_all_gather_output_that_cannot_hold_the_inputs_fails(
    pytester: pytest.Pytester,
) -> None:
    # torch's threaded group cuts the output in world-size pieces and copies each rank's input
    # into its piece, broadcasting one element into two: gloo raises, so thread mode does.
    pytester.makepyfile(GATHER_OUTPUTS.replace("all_gather_single", ALL_GATHER))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 0 issued all_gather(float32[[]1[]]); rank 1 issued all_gather(float32[[]1[]], "
            "into float32[[]2[]], float32[[]2[]])*",
            "ranks 0, 1 (2 of 2) failed: RuntimeError: [[]rank 0[]] mode='thread': "
            "all_gather(float32[[]1[]], into float32[[]2[]], float32[[]2[]]): an all-gather's "
            "output must hold one tensor of the input's size and dtype per rank*",
        ]
    )


ALL_TO_ALL_SPLITS = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2, mode="thread")
def test_splits_that_do_not_sum_to_the_input(rank):
    out = torch.empty(4)
    dist.all_to_all_single(out, torch.ones(6), [2, 2], [2, 2])  # planted: the input has 6 rows


@pytest.mark.distributed(world_size=2, mode="thread")
def test_uneven_splits(rank):
    sent = [1, 2] if rank == 0 else [3, 1]  # rank 0 sends 1 row to itself, 2 to rank 1, ...
    got = [1, 3] if rank == 0 else [2, 1]
    out = torch.empty(sum(got))
    dist.all_to_all_single(out, torch.full((sum(sent),), float(rank)), got, sent)
    assert out.tolist() == ([0.0] + [1.0] * 3 if rank == 0 else [0.0] * 2 + [1.0])
"""


def test_all_to_all_splits_that_do_not_fit_fail_every_rank_as_gloo_does(
    pytester: pytest.Pytester,
) -> None:
    # torch's threaded group checks no split and failed in group rank 0's thread on a copy of
    # mismatched sizes: rank 0 blamed, rank 1 aborted. gloo raises on every rank.
    pytester.makepyfile(ALL_TO_ALL_SPLITS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "ranks 0, 1 (2 of 2) failed: RuntimeError: [[]rank ?[]] mode='thread': "
            "all_to_all_single: input_split_sizes [[]2, 2[]] must give one size per rank of the "
            "group's 2 and sum to the input's first dim (6)*",
        ]
    )
