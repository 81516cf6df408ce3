"""Faults injected on purpose, each followed by a test that must pass on recovered ranks.

Run in order by tests/plugin/test_faults.py.
"""

import time

import pytest
import torch
import torch.distributed as dist

from fsdp_testing import faults


def _collectives(n):
    """n all-gathers then one all-reduce, on this rank."""
    t = torch.ones(4)
    out = torch.empty(4 * dist.get_world_size())
    for _ in range(n):
        dist.all_gather_into_tensor(out, t)
    dist.all_reduce(t)
    return t


@pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=3)])
def test_kill(rank):
    _collectives(5)


@pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=1, op="all_reduce")])
def test_kill_after_other_collectives(rank):
    t = torch.ones(2)
    dist.broadcast(t, 0)
    dist.barrier()
    dist.all_reduce(t)


@pytest.mark.distributed(world_size=2)
def test_after_kill(rank):
    assert _collectives(2).sum().item() == 8


@pytest.mark.distributed(world_size=2, faults=[faults.fail(rank=0, at=2, op="all_reduce")])
def test_fail_on_second_all_reduce(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.barrier()
    dist.all_reduce(t)


@pytest.mark.distributed(world_size=2)
def test_after_fail(rank):
    assert _collectives(1).sum().item() == 8


@pytest.mark.distributed(world_size=2, faults=[faults.delay(rank=0, at=1, ms=300)])
def test_delay(rank):
    start = time.monotonic()
    assert _collectives(1).sum().item() == 8
    # rank 1 waited for rank 0 in the first all-gather; rank 0 slept before it.
    assert time.monotonic() - start >= 0.25


@pytest.mark.distributed(
    world_size=2, timeout=3, faults=[faults.hang(rank=1, at=2, op="all_gather")]
)
def test_hang(rank):
    _collectives(3)


@pytest.mark.distributed(world_size=2)
def test_after_hang(rank):
    assert _collectives(1).sum().item() == 8


@pytest.mark.distributed(world_size=2)
def test_inject_in_the_body(rank):
    _collectives(1)  # not counted: before the block
    with faults.inject(faults.fail(rank=1, at=1, op="broadcast", exc=KeyError("injected key"))):
        dist.all_reduce(torch.ones(1))
        dist.broadcast(torch.ones(1), src=0)


@pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=2, op="recv")])
def test_kill_at_a_receive(rank):
    # Point-to-point ops are numbered apart: the all-reduce does not count, the 2nd recv does.
    dist.all_reduce(torch.ones(1))
    for _ in range(3):
        if rank == 0:
            dist.send(torch.ones(2), 1)
        else:
            dist.recv(torch.empty(2), 0)


@pytest.mark.distributed(world_size=2, mode="local", faults=[faults.fail(rank=0, at=1, op="send")])
def test_fail_at_a_send_in_local_mode(rank):
    if rank == 0:
        dist.send(torch.ones(2), 1)
    else:
        dist.recv(torch.empty(2), 0)


@pytest.mark.distributed(world_size=2)
def test_after_point_to_point_faults(rank):
    assert _collectives(1).sum().item() == 8


@pytest.mark.distributed(world_size=2, mode="thread", faults=[faults.fail(rank=1, at=2)])
def test_thread_fail(rank):
    _collectives(3)


@pytest.mark.distributed(world_size=2, mode="thread", faults=[faults.delay(rank=1, at=1, ms=200)])
def test_thread_delay(rank):
    assert _collectives(1).sum().item() == 8


@pytest.mark.distributed(world_size=2, mode="thread", timeout=2, faults=[faults.hang(rank=0, at=1)])
def test_thread_hang(rank):
    _collectives(1)


@pytest.mark.distributed(world_size=2, mode="thread", faults=[faults.kill(rank=1, at=1)])
def test_thread_kill_is_refused(rank):
    _collectives(1)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread_kill_in_the_body_is_refused(rank):
    with faults.inject(faults.kill(rank=1, at=1)):
        _collectives(1)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread_after_faults(rank):
    assert _collectives(1).sum().item() == 8
