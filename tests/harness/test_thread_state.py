"""Thread mode's ranks each own the process state a rank process owns (issue 41): torch's CPU
generator, Python's and NumPy's global generators, the default dtype and the
deterministic-algorithms switch. See [Note: thread mode's turns] in
fsdp_testing/_launch/thread_turns.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fsdp_testing._launch.spec import DistSpec, Mode
from fsdp_testing._protocol import RankFixture, Task
from fsdp_testing.launcher import run_distributed


def _gathered(x: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return out


@pytest.mark.distributed(world_size=2, mode="thread")
def test_ranks_seeded_alike_draw_alike(rank):
    torch.manual_seed(0)
    dist.barrier()
    x = torch.randn(4)
    first, second = _gathered(x)
    assert torch.equal(first, second)
    assert torch.equal(x, torch.randn(4, generator=torch.Generator().manual_seed(0)))


@pytest.mark.distributed(world_size=3, mode="thread")
def test_each_rank_draws_from_its_own_generators(rank):
    torch.manual_seed(rank)
    random.seed(rank)
    np.random.seed(rank)
    dist.barrier()  # the other ranks run, and draw, in between
    x = torch.randn(4)
    drawn = (random.random(), float(np.random.rand()))
    dist.barrier()
    y = torch.rand(3)
    expected = torch.Generator().manual_seed(rank)
    assert torch.equal(x, torch.randn(4, generator=expected))
    assert torch.equal(y, torch.rand(3, generator=expected))
    assert drawn == (random.Random(rank).random(), float(np.random.RandomState(rank).rand()))


@pytest.mark.distributed(world_size=2, mode="thread")
def test_default_dtype_and_determinism_are_the_ranks_own(rank):
    if rank == 1:
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
    dist.barrier()
    expected = torch.float64 if rank == 1 else torch.float32
    assert torch.get_default_dtype() == expected
    assert torch.ones(1).dtype == expected
    assert torch.are_deterministic_algorithms_enabled() is (rank == 1)
    t = torch.ones(2, dtype=torch.float32)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
    assert torch.get_default_dtype() == expected


def _change_the_process_state(rank: int) -> None:
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)
    dist.barrier()


def test_the_process_state_is_back_after_a_thread_mode_test():
    np.random.seed(7)
    torch.manual_seed(7)
    numpy_before, torch_before = np.random.get_state()[1].copy(), torch.get_rng_state()
    verdict = run_distributed(
        Task(_change_the_process_state, {"rank": RankFixture("rank")}, "changes"),
        DistSpec(2, mode=Mode.THREAD),
    )
    assert verdict.outcome == "passed", verdict.message
    assert torch.get_default_dtype() == torch.float32
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert (np.random.get_state()[1] == numpy_before).all()
    assert torch.equal(torch.get_rng_state(), torch_before)
