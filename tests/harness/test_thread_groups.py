"""Groups made on the ranks of thread mode (torch's threaded process group)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from fsdp_testing._launch.spec import DistSpec, Mode
from fsdp_testing._protocol import Task
from fsdp_testing.launcher import run_distributed

# torch's own barrier hung both ranks within 18 to 973 such groups in five trials (two threads,
# no harness): see [Note: the threaded group's barrier] in fsdp_testing/_launch/thread_group.py.
GROUPS = 3000


# 3000 groups take about 3 s here; the default timeout leaves a loaded CI room. With torch's
# barrier the ranks hang and the test fails at the timeout.
@pytest.mark.distributed(world_size=2, mode="thread", timeout=120)
def test_each_rank_making_a_group_of_its_own_does_not_hang(rank):
    # torch's MixtureOfExperts makes its experts' group this way: new_group([rank]) on each rank.
    for _ in range(GROUPS):
        group = dist.new_group([rank])
        assert dist.get_world_size(group) == 1
        assert dist.get_rank(group) == 0


@pytest.mark.distributed(world_size=4, mode="thread", timeout=60)
def test_collectives_over_groups_of_one_stay_on_their_rank(rank):
    # The ranks' groups share a name; torch's threaded group joined their collectives into one.
    for _ in range(20):
        group = dist.new_group([rank])
        t = torch.full((2,), float(rank))
        dist.all_reduce(t, group=group)
        out = [torch.empty(2)]
        dist.all_gather(out, t, group=group)
        assert t.tolist() == out[0].tolist() == [rank, rank]


@pytest.mark.distributed(world_size=4, mode="thread")
def test_groups_made_by_every_rank_still_reduce_over_their_members(rank):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=pairs[rank // 2])
    assert t.item() == {0: 1.0, 1: 5.0}[rank // 2]


def _check_barrier_is_ours() -> None:
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    from fsdp_testing._launch.thread_group import _threaded_group_barrier

    assert mtpg._store_based_barrier is _threaded_group_barrier


def test_torchs_barrier_is_back_after_a_thread_mode_run():
    from torch.distributed.distributed_c10d import _store_based_barrier
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    verdict = run_distributed(
        Task(_check_barrier_is_ours, {}, "ours while the ranks run"), DistSpec(2, mode=Mode.THREAD)
    )
    assert verdict.outcome == "passed", verdict.message
    assert mtpg._store_based_barrier is _store_based_barrier


def test_a_rank_woken_in_torchs_collective_is_stopped_not_exited():
    # torch's collectives leave a woken rank with sys.exit("Test termination event occurs."),
    # which the report read as a body that called sys.exit: thread mode raises Aborted.
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    from fsdp_testing._launch.rank_threads import Aborted
    from fsdp_testing._launch.thread_group import _Arrival, _Calls

    class Woken:
        def join(self, rank, data):
            mtpg.ProcessLocalGroup._terminate = terminate
            raise SystemExit("Test termination event occurs.")

    terminate = threading.Event()
    terminate.set()
    saved = mtpg.ProcessLocalGroup._terminate
    try:
        with pytest.raises(Aborted):
            _Arrival(Woken(), _Calls(1, 1, "the default group"), 0, None).join(0, [])
    finally:
        mtpg.ProcessLocalGroup._terminate = saved


def test_a_rank_woken_after_its_collective_completed_goes_on():
    # Rank 0 moved the data and failed at once; the harness woke the waits before rank 1 left
    # its own: the collective completed, so rank 1 runs on to its own outcome (it was reported
    # aborted, or failed, depending on which thread was faster).
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    from fsdp_testing._launch.thread_group import _Arrival, _Calls

    class CompletedThenWoken:
        _done = True

        def join(self, rank, data):
            mtpg.ProcessLocalGroup._terminate = terminate
            raise SystemExit("Test termination event occurs.")

    terminate = threading.Event()
    terminate.set()
    saved = mtpg.ProcessLocalGroup._terminate
    try:
        work = _Arrival(CompletedThenWoken(), _Calls(1, 1, "the default group"), 0, None).join(
            1, [torch.ones(2)]
        )
    finally:
        mtpg.ProcessLocalGroup._terminate = saved
    assert work.wait()
