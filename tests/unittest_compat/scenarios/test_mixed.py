"""A torch-style test class mixing outcomes; run by tests/unittest_compat/test_testcase.py."""

import os
import sys

import torch
import torch.distributed as dist
from parameterized import parameterized

from fsdp_testing.common_distributed import (
    TEST_SKIPS,
    MultiProcessTestCase,
    MultiThreadedTestCase,
    skip_if_lt_x_gpu,
)
from fsdp_testing.common_fsdp import FSDPTest, FSDPTestMultiThread
from fsdp_testing.common_utils import instantiate_parametrized_tests, parametrize, run_tests


class TestMixed(FSDPTest):
    @property
    def world_size(self):
        return 2

    def test_passes(self):
        t = torch.full((1,), float(self.rank), device=self.device)
        dist.all_reduce(t, group=self.process_group)
        assert t.item() == 1 and self.world_size == 2
        assert dist.get_world_size(self.process_group) == 2

    def test_fails_on_rank_one(self):
        # Both ranks in the body first: a rank new to this module imports it (and FSDP) inside
        # the test, and on a loaded machine rank 0 was still importing when the failure grace
        # that rank 1's failure started ran out, so it was reported too (stopped, not passed).
        dist.barrier(group=self.process_group)
        self.assertEqual(self.rank, 0, "rank one is off")

    def test_skips(self):
        self.skipTest("no widgets here")

    def test_torch_exit_code_skip(self):
        # torch 2.15 renamed the key ("multi-gpu-8" before); the mirror has the installed torch's.
        key = "multi-device-8" if "multi-device-8" in TEST_SKIPS else "multi-gpu-8"
        sys.exit(TEST_SKIPS[key].exit_code)

    @skip_if_lt_x_gpu(2)
    def test_gpu_decorated_runs_on_cpu(self):
        dist.barrier()

    @skip_if_lt_x_gpu(2, allow_cpu=False)
    def test_needs_real_gpus(self):
        raise AssertionError("must not run without GPUs")

    def test_subtests(self):
        self.run_subtests({"a": [1, 2], "b": ["x", "y"]}, self._check, limit=2)

    def _check(self, a, b, limit):
        dist.barrier()
        assert not (a == 2 and b == "y"), f"a={a} is over the limit {limit}"

    @parameterized.expand([("small", 1), ("large", 3)])
    def test_expand(self, _name, n):
        assert n < 2, f"n={n} is too large"

    @parametrize("k", [0, 1])
    def test_torch_style(self, k):
        t = torch.full((1,), float(k))
        dist.all_reduce(t)
        assert t.item() == 2 * k


instantiate_parametrized_tests(TestMixed)


class TestRankHooks(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def setUpRank(self):
        if self.rank == 1:
            raise RuntimeError("rank one cannot set up")

    def test_after_setup(self):
        pass


class TestTorchStyleInit(MultiProcessTestCase):
    """Written as for torch: the test joins the process group itself via self.init_method."""

    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_joins_group_itself(self):
        dist.init_process_group(
            "gloo", init_method=self.init_method, rank=self.rank, world_size=self.world_size
        )
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        dist.destroy_process_group()


class TestThreads(FSDPTestMultiThread):
    @property
    def world_size(self):
        return 3

    def perThreadSetUp(self):
        self.hooked = True

    def test_threads(self):
        assert self.hooked
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 3 and os.getpid() == os.getpid()


class TestPlainThreads(MultiThreadedTestCase):
    def test_default_world_size(self):
        assert dist.get_world_size() == 4 == self.world_size


_calls_seen_by_this_process = []


class TestFreshRanks(MultiProcessTestCase):
    """With use_warm_pool = False, every method gets freshly forked ranks: module state set by
    one method is gone in the next."""

    use_warm_pool = False

    @property
    def world_size(self):
        return 2

    def test_first(self):
        _calls_seen_by_this_process.append("first")
        assert _calls_seen_by_this_process == ["first"]

    def test_second(self):
        _calls_seen_by_this_process.append("second")
        assert _calls_seen_by_this_process == ["second"]


if __name__ == "__main__":
    run_tests()
