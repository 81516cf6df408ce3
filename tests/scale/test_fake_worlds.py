"""Fake mode plays any rank of a world of any size: the rank fixture, every group and mesh
coordinate, and every engine's sharding are the played rank's; each engine builds and takes
optimizer steps there, at a rank whose shards are all empty, in the last replica group of an
8 x 128 mesh, and with the padding of uneven shards. Collectives move no data, so only shapes
and code paths are checked, never values."""

from __future__ import annotations

import math
import unittest

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_testing.engines import get_engine
from fsdp_testing.testcase import MultiProcessTestCase

OUT_FEATURES = (600, 3000, 8)  # rows of the three Linear layers: uneven over 1024 or 128 ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 600), nn.ReLU(), nn.Linear(600, 3000), nn.ReLU(), nn.Linear(3000, 8)
    )


def _rows(total: int, index: int, shards: int) -> int:
    """Rows of a dim-0 chunk of ``total`` rows held by shard ``index`` of ``shards``."""
    chunk = math.ceil(total / shards)
    return max(0, min(chunk, total - chunk * index))


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _steps(model: nn.Module) -> None:
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()


def _assert_rows(model: nn.Module, index: int, shards: int) -> None:
    params = dict(model.named_parameters())
    for layer, rows in zip((0, 2, 4), OUT_FEATURES, strict=True):
        expected = _rows(rows, index, shards)
        assert _local(params[f"{layer}.weight"]).shape[0] == expected, (layer, index)
        assert _local(params[f"{layer}.bias"]).shape == (expected,), (layer, index)


@pytest.mark.distributed(world_size=1024, mode="fake", rank=[0, 517, 1023])
def test_the_played_rank_is_everywhere(rank: int, world_size: int, process_group) -> None:
    assert dist.get_rank() == rank and dist.get_world_size() == world_size == 1024
    assert process_group.rank() == rank and process_group.size() == 1024
    group = dist.new_group(list(range(512, 1024)))
    if rank >= 512:
        assert dist.get_rank(group) == rank - 512


@pytest.mark.parametrize("engine", ["fsdp_core", "fsdp_core_fully_shard", "torch_fsdp2"])
@pytest.mark.distributed(world_size=1024, mode="fake", rank=[0, 517, 1023])
def test_every_engine_shards_and_steps_as_the_played_rank(engine: str, rank: int) -> None:
    # Rank 517 holds 1 row of 600, 3 of 3000 and none of 8; rank 1023 holds none at all.
    model = get_engine(engine).wrap(_model())
    _assert_rows(model, rank, 1024)
    _steps(model)
    _assert_rows(model, rank, 1024)


@pytest.mark.distributed(world_size=1024, mode="fake", rank=[0, 517, 1023])
def test_torch_fsdp1_pads_the_last_ranks_flat_shard(rank: int) -> None:
    model = get_engine("torch_fsdp1").wrap(_model())
    numel = sum(p.numel() for p in _model().parameters())  # 1,837,208
    per_rank = math.ceil(numel / 1024)  # 1795
    (flat,) = model.parameters()
    assert flat.numel() == per_rank
    padding = max(0, min(per_rank, (rank + 1) * per_rank - numel))
    assert flat._shard_numel_padded == padding  # 872 on rank 1023, none before
    _steps(model)


@pytest.mark.parametrize("door", ["composable", "wrapper"])
@pytest.mark.distributed(world_size=1024, mode="fake", rank=[0, 1023])
def test_hybrid_on_an_8_by_128_mesh(door: str, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_core import FullyShardedDataParallel, ShardingStrategy, fully_shard

    mesh = init_device_mesh("cpu", (8, 128), mesh_dim_names=("replicate", "shard"))
    replica, shard = divmod(rank, 128)
    assert tuple(mesh.get_coordinate()) == (replica, shard)  # rank 1023: the last replica group
    replicas = dist.get_process_group_ranks(mesh["replicate"].get_group())
    assert replicas == list(range(shard, 1024, 128))
    model = _model()
    if door == "wrapper":
        model = FullyShardedDataParallel(
            model, device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD
        )
    else:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    _assert_rows(model, shard, 128)  # shard 127 holds none of 600 (5 each) or 3000 (24 each)
    _steps(model)


def test_unittest_class_plays_each_listed_rank() -> None:
    played: list[int] = []

    class TestFake(MultiProcessTestCase):
        world_size = 1024
        dist_mode = "fake"
        fake_rank = (0, 517, 1023)

        def test_plays(self) -> None:
            played.append(self.rank)
            self.assertEqual((dist.get_rank(), dist.get_world_size()), (self.rank, 1024))

        def test_fails_at_517(self) -> None:
            self.assertNotEqual(self.rank, 517)

    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(TestFake).run(result)
    assert played == [0, 517, 1023]
    assert result.testsRun == 2 and not result.errors
    (failure,) = result.failures
    assert failure[0].id().endswith("test_fails_at_517")
    assert "[fake rank 517] rank 517 failed: AssertionError" in failure[1]
    assert "[fake rank 0]" not in failure[1]


@pytest.mark.parametrize("run", [1, 2, 3])
@pytest.mark.distributed(world_size=64, mode="fake")
def test_fake_tensors_in_one_rank_thread_after_another(run: int, rank: int) -> None:
    """Each run's rank thread enters a FakeTensorMode after the previous run's thread did and
    ended: in torch 2.10 and 2.11's CUDA builds on a machine without a GPU that crashed the
    process unless the harness registered CUDA's no-op device guard first (threads.py)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        weight = nn.Linear(8, 30).weight
    assert isinstance(weight, FakeTensor) and weight.shape == (30, 8)
