"""``dp_mesh_dims``: parameters that are ``DTensor``s on the full SPMD mesh, sharded or
replicated over its data-parallel dimensions (see [Note: SPMD meshes] in
``src/fsdp_core/_spmd_mesh.py``), with fsdp_core's ``fully_shard``/``replicate`` and with the
installed torch's, on four CPU ranks over gloo.

The cases are those of torch's own ``test_fully_shard_dtensor.py`` (FSDP, DDP, HSDP, several
shard or replicate dimensions flattened, FSDP with tensor parallelism, HSDP with tensor
parallelism on a 3-D mesh): each trains five steps like DDP over the data-parallel ranks, and
both engines show the same placements on the same meshes. The errors are torch's too.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

import fsdp_core

# torch 2.13 added dp_mesh_dims; under 2.11 fsdp_core alone is checked against DDP.
TorchDataParallelMeshDims = getattr(torch_fsdp, "DataParallelMeshDims", None)


def _torch_replicate() -> Any:
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:
        return None
    return replicate


class _MLP(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _tp_partition(name: str, module: nn.Module, mesh: Any) -> None:
    """Column-wise ``in_proj``, row-wise ``out_proj`` on the last mesh dim, replicated on the
    others (torch's test's partition)."""
    if not isinstance(module, nn.Linear):
        return
    replicated = [Replicate()] * (mesh.ndim - 1)
    for param_name, param in list(module.named_parameters(recurse=False)):
        if param_name == "weight":
            tp = Shard(0) if "in_proj" in name else Shard(1)
        else:
            tp = Replicate()
        dist_param = nn.Parameter(distribute_tensor(param, mesh, [*replicated, tp]))
        module.register_parameter(param_name, dist_param)


def _avoid_tp_dim(param: nn.Parameter) -> Shard:
    tp_on_0 = any(isinstance(p, Shard) and p.dim == 0 for p in param.placements)  # type: ignore[attr-defined]
    return Shard(1) if tp_on_0 else Shard(0)


# (mesh shape, names, dp_mesh_dims, tensor parallel, reshard_after_forward, DDP group, door)
CASES: dict[str, tuple[Any, ...]] = {
    "fsdp": ((4,), ("fsdp",), {"shard": "fsdp"}, False, True, None, "fully_shard"),
    "fsdp_keep": ((4,), ("fsdp",), {"shard": "fsdp"}, False, False, None, "fully_shard"),
    "ddp_by_fully_shard": ((4,), ("ddp",), {"replicate": "ddp"}, False, True, None, "fully_shard"),
    "ddp_by_replicate": ((4,), ("ddp",), {"replicate": "ddp"}, False, True, None, "replicate"),
    "hsdp": (
        (2, 2), ("rep", "shard"), {"shard": "shard", "replicate": "rep"}, False, True, "world",
        "fully_shard",
    ),
    "two_shard_dims": (
        (2, 2), ("dp0", "dp1"), {"shard": ("dp0", "dp1")}, False, True, "world", "fully_shard"
    ),
    "fsdp_tp": ((2, 2), ("fsdp", "tp"), {"shard": "fsdp"}, True, True, "fsdp", "fully_shard"),
    "fsdp_tp_keep": ((2, 2), ("fsdp", "tp"), {"shard": "fsdp"}, True, False, "fsdp", "fully_shard"),
    "hsdp_tp_3d": (
        (1, 2, 2), ("rep", "fsdp", "tp"), {"shard": "fsdp", "replicate": "rep"}, True, True,
        "fsdp", "fully_shard",
    ),
    "two_replicate_dims": (
        (1, 2, 2), ("ddp1", "ddp2", "fsdp"), {"shard": "fsdp", "replicate": ("ddp1", "ddp2")},
        False, True, "world", "fully_shard",
    ),
}  # fmt: skip


def _train(engine: str, case: tuple[Any, ...], mesh: Any) -> dict[str, Any]:
    """Five Adam steps of the case against DDP over its data-parallel ranks: the largest loss
    and parameter differences, and the sharded parameters' placements and mesh dims."""
    _, _, dims, tp, reshard, ddp_group, door = case
    torch.manual_seed(42)
    model = _MLP()
    ref = copy.deepcopy(model)
    distribute_module(model, mesh, _tp_partition if tp else None)
    if engine == "fsdp_core":
        dp_dims: Any = fsdp_core.DataParallelMeshDims(**dims)
        shard, replicate = fsdp_core.fully_shard, fsdp_core.replicate
    else:
        dp_dims = TorchDataParallelMeshDims(**dims)
        shard, replicate = torch_fully_shard, _torch_replicate()
    if door == "replicate":
        replicate(model, mesh=mesh, dp_mesh_dims=dp_dims)
    else:
        placement = _avoid_tp_dim if tp else None
        shard(
            model,
            mesh=mesh,
            reshard_after_forward=reshard,
            shard_placement_fn=placement,
            dp_mesh_dims=dp_dims,
        )
    if ddp_group is None:
        group = mesh.get_group()
    else:
        group = dist.group.WORLD if ddp_group == "world" else mesh[ddp_group].get_group()
    ddp = nn.parallel.DistributedDataParallel(ref, process_group=group)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    ref_optim = torch.optim.Adam(ddp.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(43 + dist.get_rank(group))
    worst_loss = 0.0
    for step in range(5):
        inp = torch.randn(2, 16, generator=gen)
        ref_optim.zero_grad(set_to_none=step % 2 == 0)
        ref_loss = ddp(inp).sum()
        ref_loss.backward()
        ref_optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        loss = model(DTensor.from_local(inp, mesh, [Replicate()] * mesh.ndim, run_check=False))
        loss = loss.sum()
        loss.backward()
        optim.step()
        worst_loss = max(worst_loss, (loss.full_tensor() - ref_loss).abs().item())
    worst_param = max(
        (p.full_tensor() - r).abs().max().item()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True)
    )
    layout = [
        (n, tuple(p.placements), p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()
    ]
    return {"loss": worst_loss, "params": worst_param, "layout": layout}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.distributed(world_size=4)
def test_trains_like_ddp_and_like_torch(name, rank, process_group):
    case = CASES[name]
    # One mesh object for both: DTensor's caches hand out an equal mesh seen before, which
    # torch's (and fsdp_core's) same-mesh check would refuse.
    mesh = init_device_mesh("cpu", case[0], mesh_dim_names=case[1])
    ours = _train("fsdp_core", case, mesh)
    # Ranks of one DDP group computed the same numbers in another order: fp32 rounding.
    assert ours["loss"] < 1e-5 and ours["params"] < 1e-6, ours
    if TorchDataParallelMeshDims is None:
        return  # this torch has no dp_mesh_dims to compare with
    theirs = _train("torch", case, mesh)
    assert ours["layout"] == theirs["layout"]
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6)


@pytest.mark.distributed(world_size=2)
def test_errors_are_torchs(rank, process_group):
    """The checks of torch's test file, with its messages."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    shard_dims = fsdp_core.DataParallelMeshDims(shard="fsdp")

    def spmd_mlp(on: Any) -> nn.Module:
        return distribute_module(_MLP(), on)

    with pytest.raises(ValueError, match="must be DTensors"):
        fsdp_core.fully_shard(_MLP(), mesh=mesh, dp_mesh_dims=shard_dims)
    sharded_weight = nn.Linear(16, 32)
    sharded_weight.weight = nn.Parameter(
        distribute_tensor(sharded_weight.weight.data, mesh, [Shard(0)])
    )
    sharded_weight.bias = nn.Parameter(
        distribute_tensor(sharded_weight.bias.data, mesh, [Replicate()])
    )
    with pytest.raises(ValueError, match="Expected Replicate"):
        fsdp_core.fully_shard(sharded_weight, mesh=mesh, dp_mesh_dims=shard_dims)
    with pytest.raises(ValueError, match=r"not found in mesh\.mesh_dim_names"):
        missing = fsdp_core.DataParallelMeshDims(shard="nonexistent")
        fsdp_core.fully_shard(spmd_mlp(mesh), mesh=mesh, dp_mesh_dims=missing)
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        fsdp_core.DataParallelMeshDims()
    with pytest.raises(NotImplementedError, match="reshard_after_forward as int"):
        fsdp_core.fully_shard(
            spmd_mlp(mesh), mesh=mesh, reshard_after_forward=2, dp_mesh_dims=shard_dims
        )
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    elsewhere = nn.Linear(16, 32)
    elsewhere.weight = nn.Parameter(distribute_tensor(elsewhere.weight.data, mesh, [Replicate()]))
    elsewhere.bias = nn.Parameter(distribute_tensor(elsewhere.bias.data, mesh, [Replicate()]))
    assert elsewhere.weight.device_mesh is mesh and mesh is not other
    with pytest.raises(ValueError, match="same mesh"):
        fsdp_core.fully_shard(elsewhere, mesh=other, dp_mesh_dims=shard_dims)
