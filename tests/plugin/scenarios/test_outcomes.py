"""Scenarios run in a child pytest session by tests/plugin/test_outcomes.py."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=[2, 4])
def test_all_reduce(rank, world_size, process_group, device):
    t = torch.full((1,), float(rank), device=device)
    dist.all_reduce(t, group=process_group)
    assert t.item() == sum(range(world_size))
    assert dist.get_rank() == rank and dist.get_world_size() == world_size


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread_mode(rank, world_size, device, dist_backend):
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    assert t.item() == 3.0 and dist_backend == "threaded" and device == torch.device("cpu")


@pytest.mark.distributed(world_size=256, mode="fake")
def test_fake_mode(rank, world_size, dist_backend):
    t = torch.ones(4)
    dist.all_reduce(t)  # the fake backend communicates nothing
    assert (rank, world_size, dist.get_world_size(), dist_backend) == (0, 256, 256, "fake")


@pytest.mark.distributed(world_size=2)
def test_gloo_backend_on_cpu(dist_backend, device):
    assert dist_backend == "gloo" and device == torch.device("cpu")


@pytest.mark.parametrize("scale", [3])
@pytest.mark.distributed(world_size=2)
def test_fixtures_reach_ranks(rank, tmp_path, scale, widget):
    (tmp_path / f"rank{rank}").write_text(str(scale * widget.n))
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


@pytest.mark.distributed(world_size=2)
def test_tmp_path_factory_reaches_ranks(rank, tmp_path_factory):
    # After test_fixtures_reach_ranks used tmp_path, pytest's factory holds an exit stack and
    # cannot be pickled: the ranks get a stand-in over the same base folder.
    mine = tmp_path_factory.mktemp("ckpt")
    names = [None, None]
    dist.all_gather_object(names, mine.name)
    assert names[0] != names[1] and mine.parent == tmp_path_factory.getbasetemp()


@pytest.mark.distributed(world_size=2)
def test_unpicklable_fixture(rank, unpicklable):
    pass


@pytest.mark.distributed(world_size=2)
def test_one_rank_fails_peer_waits(rank):
    t = torch.ones(1)
    if rank == 1:
        assert t.sum() == 3, "rank one disagrees"
    dist.all_reduce(t)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_thread_rank_fails_peer_waits(rank):
    t = torch.ones(1)
    if rank == 0:
        raise ValueError("thread rank zero broke")
    dist.all_reduce(t)


@pytest.mark.distributed(world_size=3)
def test_only_rank_two_fails(rank):
    assert rank != 2, "rank two is wrong"


@pytest.mark.distributed(world_size=2)
def test_skip_on_ranks(rank):
    pytest.skip("needs a widget factory")


@pytest.mark.distributed(world_size=2)
def test_xfail_on_ranks(rank):
    pytest.xfail("known widget bug")


@pytest.mark.distributed(world_size=2, timeout=2)
def test_timeout_diverging_collectives(rank):
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 0:
        dist.broadcast(t, 0)
    else:
        dist.all_reduce(t)


@pytest.mark.distributed(world_size=2, timeout=2)
def test_timeout_rank_never_enters(rank):
    if rank == 0:
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(2))
    else:
        time.sleep(60)


@pytest.mark.distributed(world_size=2, mode="thread", timeout=2)
def test_thread_timeout(rank):
    t = torch.ones(1)
    if rank == 0:
        dist.all_reduce(t)
    else:
        while True:
            time.sleep(0.01)


@pytest.mark.distributed(world_size=2)
def test_rank_exits(rank):
    print(f"rank {rank} says goodbye")
    if rank == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.distributed(world_size=2)
def test_rank_killed_by_signal(rank):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


@pytest.mark.distributed(world_size=2)
def test_runs_normally_after_crashes(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.distributed(world_size=2)
def test_output_is_captured_per_rank(rank):
    print(f"hello from rank {rank}")


@pytest.mark.distributed(world_size=2, backend="nccl")
def test_nccl_without_gpus(rank):
    pass
