"""Run by tests/plugin/test_multinode.py as four processes with the variables srun sets (2 nodes
x 2 tasks); rank 3's slot process is killed by its own test, so it cannot be recovered."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=4)
def test_all_reduce_over_srun_tasks(rank, world_size):
    t = torch.full((1,), float(rank))
    dist.all_reduce(t)
    assert t.item() == 6


@pytest.mark.distributed(world_size=4, timeout=2)
def test_rank_three_loses_its_slot(rank):
    if rank == 3:
        os.kill(os.getppid(), signal.SIGKILL)  # the process srun started for rank 3
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=4)
def test_needs_rank_three(rank):
    pass


@pytest.mark.distributed(world_size=3)
def test_three_ranks_still_run(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 3
