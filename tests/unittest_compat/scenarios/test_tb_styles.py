"""A unittest-class failure and the same failure as a marker test; run by
tests/unittest_compat/test_tb_styles.py under each --tb style."""

import pytest
import torch.distributed as dist

from fsdp_testing.common_distributed import MultiThreadedTestCase


def check(rank):
    value = rank + 1
    assert value == 0, f"rank {rank} computed {value}"


class TestStyles(MultiThreadedTestCase):
    world_size = 2

    def test_unittest_class(self):
        dist.barrier()
        check(self.rank)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_marker(rank):
    dist.barrier()
    check(rank)
