"""Local mode: every rank of a world in this process, one rank thread at a time, each with its
own process state (RNGs, default dtype), exact collectives, fsdp_core training in parity with a
single-process reference, parity helpers and torch-style assertions working on full tensors.
(Failure reports are in ``test_local_reports.py``; bitwise equality with gloo in
``test_local_exact.py``.)"""

from __future__ import annotations

import copy
import random
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_testing.testcase import MultiProcessTestCase


@pytest.mark.distributed(world_size=16, mode="local")
def test_every_rank_has_its_own_process_state(rank: int) -> None:
    # In thread mode the ranks share one generator: seeded on 16 threads at once, each draws
    # from whatever the others left. Here each rank gets what its own process would have.
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    if rank % 2:
        torch.set_default_dtype(torch.float64)
    before = torch.rand(3), random.random(), np.random.rand()
    dist.barrier()  # every other rank runs (seeds and draws) here
    after = torch.rand(3), random.random(), np.random.rand()
    expected = torch.rand(6, generator=torch.Generator().manual_seed(0)).to(before[0].dtype)
    assert torch.equal(torch.cat([before[0], after[0]]), expected)
    python = random.Random(0)
    assert [before[1], after[1]] == [python.random(), python.random()]
    assert [before[2], after[2]] == list(np.random.RandomState(0).rand(2))
    assert torch.get_default_dtype() == (torch.float64 if rank % 2 else torch.float32)


@pytest.fixture
def shared() -> dict[str, list]:
    """One object every rank of a local world sees (fixtures are computed once)."""
    return {"turns": [], "running": []}


@pytest.mark.distributed(world_size=8, mode="local")
def test_ranks_take_turns_in_a_fixed_order(rank: int, world_size: int, shared: dict) -> None:
    for step in range(2):
        shared["running"].append(rank)
        assert len(shared["running"]) == 1, f"ranks {shared['running']} run at once"
        shared["turns"].append((rank, step))
        shared["running"].pop()
        dist.barrier()
    # Ranks start lowest first; the last to reach a collective goes on, then the lowest waiting.
    last = world_size - 1
    expected = [(r, 0) for r in range(world_size)] + [(last, 1)]
    expected += [(r, 1) for r in range(last)]
    assert shared["turns"] == expected


@pytest.mark.distributed(world_size=8, mode="local")
def test_rank_dependent_control_flow_and_subgroups(rank: int, world_size: int) -> None:
    evens = dist.new_group([0, 2, 4, 6])
    odds = dist.new_group([1, 3, 5, 7])
    t = torch.tensor([float(rank)])
    if rank % 2 == 0:
        dist.all_reduce(t, group=evens)
        assert t.item() == 0 + 2 + 4 + 6
    else:
        work = dist.all_reduce(t, group=odds, async_op=True)
        work.wait()
        assert t.item() == 1 + 3 + 5 + 7
    assert threading.current_thread().name == f"fsdp-testing-rank{rank}"


@pytest.mark.distributed(world_size=4, mode="local")
def test_every_collective(rank: int, world_size: int) -> None:
    ws = world_size
    chunks = [torch.empty(2) for _ in range(ws)]
    dist.all_gather(chunks, torch.full((2,), float(rank)))
    assert torch.equal(torch.stack(chunks)[:, 0], torch.arange(float(ws)))
    out = torch.empty(2)
    dist.reduce_scatter(out, [torch.full((2,), float(r)) for r in range(ws)])
    assert out.tolist() == [float(rank * ws)] * 2
    scattered = torch.empty(1)
    dist.scatter(scattered, [torch.tensor([10.0 * r]) for r in range(ws)] if rank == 1 else None, 1)
    assert scattered.item() == 10.0 * rank
    gathered = [torch.empty(1) for _ in range(ws)] if rank == 2 else None
    dist.gather(torch.tensor([float(rank)]), gathered, dst=2)
    if rank == 2:
        assert [g.item() for g in gathered] == list(range(ws))
    outs = [torch.empty(1) for _ in range(ws)]
    dist.all_to_all(outs, [torch.tensor([100.0 * rank + d]) for d in range(ws)])
    assert [o.item() for o in outs] == [100.0 * s + rank for s in range(ws)]
    single = torch.empty(ws)
    dist.all_to_all_single(single, torch.arange(ws, dtype=torch.float32) + 100 * rank)
    assert single.tolist() == [100.0 * s + rank for s in range(ws)]
    objects = [None] * ws
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(ws)]
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=3)
    assert box == ["from 3"]
    if rank == 0:  # waits (rank 3 has not run yet), then sends on
        got = torch.empty(2)
        dist.recv(got, src=3)
        assert got.tolist() == [3.0, 3.0]
        dist.send(torch.full((2,), 0.5), dst=1)
    elif rank == 1:
        got = torch.empty(2)
        dist.recv(got, src=0)
        assert got.tolist() == [0.5, 0.5]
    elif rank == 3:
        dist.send(torch.full((2,), 3.0), dst=0)
    dist.barrier()


@pytest.mark.distributed(world_size=8, mode="local")
def test_dtensor_and_functional_collectives(rank: int, world_size: int) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    full = torch.arange(64.0).reshape(8, 8)
    sharded = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    assert sharded.to_local().shape == (2, 8)
    assert torch.equal(sharded.redistribute(mesh, [Shard(1), Shard(0)]).full_tensor(), full)
    summed = funcol.all_reduce(torch.ones(3), "sum", mesh["tp"])
    assert summed.tolist() == [4.0] * 3


@pytest.mark.distributed(world_size=8, mode="local")
def test_ddp_trains_in_step(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(6, 3))
    torch.manual_seed(rank)
    model(torch.randn(4, 6)).sum().backward()
    grads = [torch.empty(3) for _ in range(8)]
    dist.all_gather(grads, model.module.bias.grad)
    assert all(torch.equal(g, grads[0]) for g in grads)


def _mlp(dim: int = 24) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(4)])


def _train_in_parity(door: str, rank: int, world_size: int) -> None:
    """The parity body a new user writes: seed, build, copy, shard, train on a per-rank slice
    of one batch, compare each full parameter with the single-process copy trained on all of
    it. Tolerance: the copy sums the batch's gradient in another order."""
    from fsdp_core import FullyShardedDataParallel, fully_shard

    model = _mlp()
    reference = copy.deepcopy(model)
    if door == "wrapper":
        model = FullyShardedDataParallel(model)
    else:
        mesh = None
        if door == "hybrid":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                "cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")
            )
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(100 + step)
        batch = torch.randn(2 * world_size, 24)
        model(batch[2 * rank : 2 * rank + 2]).square().mean().backward()
        reference(batch).square().mean().backward()
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
    if door == "wrapper":
        with FullyShardedDataParallel.summon_full_params(model):
            full = [p.detach().clone() for p in model.parameters()]
    else:
        full = [p.full_tensor() for p in model.parameters()]
    for got, ref in zip(full, reference.parameters(), strict=True):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("door", ["composable", "wrapper", "hybrid"])
@pytest.mark.distributed(world_size=16, mode="local")
def test_fsdp_core_trains_in_parity_with_a_single_process(
    door: str, rank: int, world_size: int
) -> None:
    _train_in_parity(door, rank, world_size)


@pytest.mark.distributed(world_size=8, mode="local")
def test_parity_helpers_work() -> None:
    from fsdp_testing.models import DEVICEInitMode, FSDPInitMode, NestedWrappedModule
    from fsdp_testing.parity import check_fsdp_parity

    check_fsdp_parity(
        NestedWrappedModule,
        FSDPInitMode.RECURSIVE,
        DEVICEInitMode.DEVICE_BEFORE,
        engine="fsdp_core",
        num_iters=2,
    )


class TestLocalClass(MultiProcessTestCase):
    world_size = 8
    dist_mode = "local"

    def test_assert_equal_on_full_tensors(self) -> None:
        from fsdp_core import fully_shard

        model = _mlp()
        reference = copy.deepcopy(model)
        fully_shard(model)
        for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
            self.assertEqual(param.full_tensor(), ref)
        self.assertEqual(dist.get_world_size(), 8)
        self.assertEqual(dist.get_backend(), "local")
