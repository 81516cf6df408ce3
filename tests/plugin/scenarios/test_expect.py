"""Tests that must fail with a given report (faults.expect); run by tests/plugin/test_expect.py."""

import pytest
import torch
import torch.distributed as dist

from fsdp_testing import faults
from fsdp_testing.common_distributed import MultiProcessTestCase


def _all_reduce(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t


@faults.expect(rank=1, match=r"rank 1 killed by SIGKILL at all_reduce #1")
@pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=1)])
def test_kill_as_expected(rank):
    _all_reduce(rank)


@faults.expect(rank=0, match="SIGKILL")
@pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=1)])
def test_wrong_rank_blamed(rank):
    _all_reduce(rank)


@faults.expect(rank=1, match="SIGSEGV")
@pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=1)])
def test_other_report(rank):
    _all_reduce(rank)


@faults.expect(rank=1)
@pytest.mark.distributed(world_size=2)
def test_passes_unexpectedly(rank):
    _all_reduce(rank)


@faults.expect(rank=[1, 2], match="the sum is off")
@pytest.mark.distributed(world_size=4, mode="local")
def test_local_ranks_fail_as_expected(rank):
    t = _all_reduce(rank)
    assert rank in (0, 3) or t.item() == 0, "the sum is off"


@faults.expect(rank=1, match="injected failure at all_reduce #1")
@pytest.mark.distributed(world_size=2, mode="thread", faults=[faults.fail(rank=1, at=1)])
def test_thread_fault_as_expected(rank):
    _all_reduce(rank)


@faults.expect(rank=5)
@pytest.mark.distributed(world_size=2)
def test_rank_outside_the_world(rank):
    raise AssertionError("fails")


@faults.expect(rank=0)
def test_not_distributed():
    pass


class TestUnittestExpect(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    @faults.expect(rank=0, match="rank 0 .*not the last")
    def test_rank_zero_fails_as_expected(self):
        dist.barrier()
        assert self.rank == 1, "not the last"

    @faults.expect(rank=1)
    def test_rank_one_does_not_fail(self):
        dist.barrier()
        assert self.rank == 1, "not the last"
