"""Outcomes that differ between ranks, and thread-mode state isolation.

Run in order by tests/plugin/test_partial.py.
"""

import random

import pytest
import torch
import torch.distributed as dist

from fsdp_testing.common_distributed import MultiProcessTestCase, MultiThreadedTestCase


@pytest.mark.distributed(world_size=2)
def test_skips_on_rank_one_only(rank):
    if rank == 1:
        pytest.skip("rank 1 has no widget")


class TestPartialSkip(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def test_skips_on_rank_zero_only(self):
        if self.rank == 0:
            self.skipTest("rank 0 has no widget")


class TestPartialSkipThreads(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def test_thread_skips_on_rank_one_only(self):
        if self.rank == 1:
            self.skipTest("thread rank 1 has no widget")


BASELINE = {}


def _snapshot():
    return {
        "dtype": torch.get_default_dtype(),
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "all_reduce": dist.all_reduce,
        "has_helper": hasattr(dist, "my_helper"),
        "device": torch.empty(0).device,
        "grad": torch.is_grad_enabled(),
    }


def test_record_the_process_state_before_thread_tests():
    BASELINE.update(_snapshot())


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread_test_changes_process_state(rank):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(99)
    random.seed(99)
    torch.set_grad_enabled(False)
    dist.my_helper = "added by a thread test"
    dist.all_reduce = lambda *a, **k: None
    torch.set_default_device("meta")


@pytest.mark.distributed(world_size=2, mode="thread")
def test_next_thread_test_sees_the_state_undone(rank):
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()
    assert not hasattr(dist, "my_helper")
    assert torch.empty(0).device.type == "cpu"
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2, "all_reduce is still patched"


def test_the_parent_process_state_is_back_to_before():
    now = _snapshot()
    assert now["dtype"] == BASELINE["dtype"]
    assert torch.equal(now["rng"], BASELINE["rng"])
    assert now["py_rng"] == BASELINE["py_rng"]
    assert now["all_reduce"] is BASELINE["all_reduce"]
    assert now["has_helper"] is BASELINE["has_helper"] is False
    assert now["device"] == BASELINE["device"]
    assert now["grad"] is BASELINE["grad"] is True
