"""Run by tests/scale/test_local_exact.py in a child session: the same bodies on gloo ranks
(process mode) and in local mode at world size 4, each rank saving what it computed under
$EXACT_OUT/<mode>/, for the parent to compare bit for bit."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

SIZES = (1, 7, 1000, 65_537, 2_500_001)  # the last one spans several 1 MiB segments per rank
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OPS = ("SUM", "AVG", "PRODUCT", "MAX")


def _save(mode, name, rank, value):
    path = os.path.join(os.environ["EXACT_OUT"], mode, name)
    os.makedirs(path, exist_ok=True)
    torch.save(value, os.path.join(path, f"rank{rank}.pt"))


def _data(seed, rank, n, dtype):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    scale = 10.0 ** torch.randint(-3, 4, (1,), generator=gen).item()
    return (torch.randn(n, generator=gen) * scale).to(dtype)


def collectives(rank, world_size, mode):
    out = {}
    for i, (n, dtype) in enumerate((n, d) for n in SIZES for d in DTYPES):
        if n > 100_000 and dtype is not torch.float32:
            continue
        for op in OPS:
            if op == "PRODUCT" and n > 1000:
                continue
            t = _data(i, rank, n, dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"all_reduce {op} {dtype} {n}"] = t
        full = _data(i + 500, rank, n * world_size, dtype)
        shard = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(shard, full)
        out[f"reduce_scatter_tensor {dtype} {n}"] = shard
        gathered = torch.empty(n * world_size, dtype=dtype)
        dist.all_gather_into_tensor(gathered, _data(i + 900, rank, n, dtype))
        out[f"all_gather_into_tensor {dtype} {n}"] = gathered
    pieces = [_data(7000 + r, rank, 33, torch.float32) for r in range(world_size)]
    listed = torch.empty(33)
    dist.reduce_scatter(listed, pieces)
    out["reduce_scatter list"] = listed
    tensors = [_data(8000, rank, 5, torch.float32), _data(8001, rank, 300, torch.float32)]
    dist.all_reduce_coalesced(tensors)
    out["all_reduce_coalesced"] = tensors
    reduced = _data(8100, rank, 1001, torch.float32)
    dist.reduce(reduced, dst=1)
    if rank == 1:
        out["reduce"] = reduced
    b = _data(8200, rank, 17, torch.float32)
    dist.broadcast(b, src=2)
    out["broadcast"] = b
    return out


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 33), nn.ReLU(), nn.Linear(33, 5)
    )


def _batch(step, rank):
    torch.manual_seed(1000 * step + rank)  # per rank, from that rank's own generator
    return torch.randn(6, 12)


def train(door, rank, world_size):
    from fsdp_core import FullyShardedDataParallel, ShardingStrategy, fully_shard

    model = _model()
    if door == "wrapper":
        model = FullyShardedDataParallel(model)
    elif door == "hybrid_wrapper":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world_size // 2))
        model = FullyShardedDataParallel(
            model, device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD
        )
    else:
        mesh = None
        if door == "hybrid":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                "cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")
            )
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        loss = model(_batch(step, rank)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    local = [p.detach().clone() for p in model.parameters()]
    local = [getattr(p, "_local_tensor", p) for p in local]
    return {"losses": losses, "local": local}


@pytest.mark.distributed(world_size=4, timeout=300)
def test_collectives_gloo(rank, world_size):
    _save("process", "collectives", rank, collectives(rank, world_size, "process"))


@pytest.mark.distributed(world_size=4, mode="local", timeout=300)
def test_collectives_local(rank, world_size):
    _save("local", "collectives", rank, collectives(rank, world_size, "local"))


@pytest.mark.parametrize("door", ["composable", "wrapper", "hybrid", "hybrid_wrapper"])
@pytest.mark.distributed(world_size=4, timeout=300)
def test_train_gloo(door, rank, world_size):
    _save("process", f"train_{door}", rank, train(door, rank, world_size))


@pytest.mark.parametrize("door", ["composable", "wrapper", "hybrid", "hybrid_wrapper"])
@pytest.mark.distributed(world_size=4, mode="local", timeout=300)
def test_train_local(door, rank, world_size):
    _save("local", f"train_{door}", rank, train(door, rank, world_size))
