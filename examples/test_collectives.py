"""A tour of the pytest-native API: each test body runs once on every rank."""

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=[2, 4])
def test_all_reduce_sums_ranks(rank, world_size, process_group, device):
    t = torch.full((1,), float(rank), device=device)
    dist.all_reduce(t, group=process_group)
    assert t.item() == sum(range(world_size))


@pytest.mark.distributed(world_size=2)
def test_all_gather_into_tensor(rank, world_size, device):
    out = torch.empty(world_size * 2, device=device)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=device))
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.distributed(world_size=2)
def test_parameters_and_tmp_path_reach_ranks(rank, n, tmp_path):
    (tmp_path / f"{rank}.txt").write_text(str(n * rank))
    dist.barrier()
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0", str(n)]


@pytest.mark.distributed(world_size=4, mode="thread")
def test_threads_are_cheap_ranks(rank, world_size):
    t = torch.ones(1) * rank
    dist.broadcast(t, src=3)
    assert t.item() == 3


@pytest.mark.distributed(world_size=1024, mode="fake")
def test_sharding_math_at_a_large_world_size(world_size):
    shard = torch.empty(-(-4099 // world_size))  # ceil-divided dim-0 shard, as FSDP pads
    assert shard.numel() * world_size >= 4099 and dist.get_world_size() == 1024


if __name__ == "__main__":  # `python examples/test_collectives.py` runs this file under pytest
    raise SystemExit(pytest.main([__file__, "-q"]))
