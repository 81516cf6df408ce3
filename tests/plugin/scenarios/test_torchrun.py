"""Run by tests/plugin/test_launchers.py under torchrun with two ranks."""

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_in_place_all_reduce(rank, world_size, process_group, device):
    t = torch.full((1,), float(rank), device=device)
    dist.all_reduce(t, group=process_group)
    assert t.item() == 1 and world_size == 2


@pytest.mark.distributed(world_size=4)
def test_needs_four(rank):
    pass


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread_mode_in_job(rank):
    pass


@pytest.mark.distributed(world_size=2)
def test_rank_one_fails_in_place(rank):
    assert rank == 0, "rank one disagrees in place"
