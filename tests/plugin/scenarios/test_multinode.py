"""Run by tests/plugin/test_multinode.py in a job of 2 nodes x 2 ranks (two torchrun agents on
this host, or four processes with the variables srun sets)."""

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=4)
def test_all_reduce_across_nodes(rank, world_size, process_group):
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=process_group)
    assert t.item() == 6 and world_size == 4


@pytest.mark.distributed(world_size=[2, 3])
def test_smaller_world(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size


@pytest.mark.distributed(world_size=4)
def test_rank_three_fails(rank):
    assert rank != 3, "rank three disagrees"


# 8 s: ranks 0-2 must reach the all-reduce before the timeout on a loaded CI machine (with 3 s
# they once had not, and the report rightly found no rank inside a collective).
@pytest.mark.distributed(world_size=4, timeout=8)
def test_rank_three_hangs(rank):
    if rank == 3:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=4)
def test_after_the_hang(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4


@pytest.mark.distributed(world_size=4)
def test_rank_two_dies(rank):
    if rank == 2:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=4)
def test_after_the_death(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4


@pytest.mark.distributed(world_size=4)
def test_rank_one_breaks_its_reset(rank):
    if rank == 1:
        from fsdp_testing._rank.state_reset import RankState

        def broken(self):
            raise RuntimeError("reset broken on purpose")

        RankState.restore = broken


@pytest.mark.distributed(world_size=4)
def test_after_a_broken_reset(rank):
    dist.all_reduce(torch.ones(1))


@pytest.mark.distributed(world_size=4)
def test_after_the_replacement(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4


@pytest.mark.distributed(world_size=4)
def test_fails_with_a_collective_in_flight(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never waited on
    raise AssertionError("every rank fails")


@pytest.mark.distributed(world_size=4, timeout=30)
def test_after_a_failure_on_every_rank(rank):
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    assert t.item() == 10


@pytest.mark.distributed(world_size=4)
def test_imports_a_module(rank):
    # A small module that nothing imported before (a large one, such as
    # torch.distributed.pipelining, costs each of the four ranks seconds, twice).
    import torch.utils.show_pickle  # noqa: F401


@pytest.mark.distributed(world_size=4)
def test_fails_on_every_rank_after_the_import(rank):
    raise AssertionError("every rank fails: the next test gets new ranks")


@pytest.mark.distributed(world_size=4)
def test_new_ranks_start_with_what_earlier_ranks_imported(rank):
    assert "torch.utils.show_pickle" in sys.modules, "its slot did not preload it"


@pytest.mark.distributed(world_size=8)
def test_needs_eight(rank):
    pass


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread_mode_in_job(rank):
    pass


def test_plain():
    pass
