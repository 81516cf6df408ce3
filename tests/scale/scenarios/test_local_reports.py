"""Run by tests/scale/test_local_reports.py in a child session: local-mode worlds that deadlock,
mismatch, fail or hang."""

import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=3, mode="local")
def test_deadlock(rank):
    if rank != 1:  # rank 1 skips the collective: a real run hangs here
        dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=2, mode="local")
def test_deadlock_any_source(rank):
    if rank == 0:
        dist.recv(torch.empty(2))  # from any rank: rank 1 returns, nobody sends


@pytest.mark.distributed(world_size=3, mode="local")
def test_deadlock_any_source_and_a_peer(rank):
    if rank == 0:
        dist.recv(torch.empty(2))
    elif rank == 1:
        dist.recv(torch.empty(2), 2)  # rank 2 returns


@pytest.mark.distributed(world_size=3, mode="local")
def test_mismatch(rank):
    dist.all_reduce(torch.ones(2 if rank == 1 else 1))


@pytest.mark.distributed(world_size=4, mode="local")
def test_fail(rank):
    if rank == 2:
        raise ValueError("rank two broke")
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=2, mode="local")
def test_slow_peer(rank):
    if rank == 0:
        raise ValueError("rank zero broke")
    time.sleep(1.5)  # past process mode's failure grace (1 s): running, not stuck


@pytest.mark.distributed(world_size=3, mode="local", timeout=2)
def test_hang(rank):
    if rank == 1:
        while True:
            time.sleep(0.02)
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=4, mode="local")
def test_next_test_runs(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
