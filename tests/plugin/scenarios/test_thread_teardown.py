"""Scenarios run in a child pytest session by tests/plugin/test_thread_teardown.py: thread-mode
worlds whose ranks leave torch's threaded group or the harness's teardown stuck."""

import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=4, mode="thread", timeout=5)
def test_rank_fails_holding_the_groups_event_lock(rank):
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    if rank == 0:
        # What a rank stopped by an asynchronous exception inside Event.set() leaves behind.
        mtpg.ProcessLocalGroup._terminate._cond.acquire()
        raise ValueError("rank zero broke holding the lock")
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=2, mode="thread", timeout=3)
def test_teardown_never_ends(rank):
    def destroy_forever(*args, **kwargs):
        while True:
            time.sleep(0.05)

    dist.destroy_process_group = destroy_forever
    dist.barrier()


@pytest.mark.distributed(world_size=2, mode="thread")
def test_next_test_runs(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
