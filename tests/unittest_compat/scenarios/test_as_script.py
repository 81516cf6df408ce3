"""A torch-style file run as a script (``python test_as_script.py``): one class per mode, each
with a passing, a failing and a skipping method; run by tests/unittest_compat/test_as_script.py."""

import torch
import torch.distributed as dist

from fsdp_testing.common_distributed import MultiProcessTestCase, MultiThreadedTestCase
from fsdp_testing.common_utils import run_tests


class _Outcomes:
    def test_all_reduce(self):
        t = torch.full((1,), float(self.rank))
        dist.all_reduce(t)
        assert t.item() == sum(range(self.world_size)), t

    def test_fails_on_last_rank(self):
        dist.barrier()
        self.assertNotEqual(self.rank, self.world_size - 1, "the last rank is off")

    def test_skips(self):
        self.skipTest("not on this world")


class TestProcess(_Outcomes, MultiProcessTestCase):
    @property
    def world_size(self):
        return 2


class TestThread(_Outcomes, MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2


class TestLocal(_Outcomes, MultiProcessTestCase):
    dist_mode = "local"

    @property
    def world_size(self):
        return 4


class TestFake(MultiProcessTestCase):
    dist_mode = "fake"
    fake_rank = 5

    @property
    def world_size(self):
        return 8

    def test_plays_its_rank(self):
        assert (self.rank, dist.get_world_size()) == (5, 8)


if __name__ == "__main__":
    run_tests()
