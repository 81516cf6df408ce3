"""Tensor parallelism and FSDP sharding the same tensor dimension (issue 48, point 5): a
column-wise linear's weight and bias are split on dim 0 by tensor parallelism, and FSDP, over
the data-parallel dim of a 2x2 mesh, splits the same dim 0 of each rank's piece. The rows a rank
holds are then a strided piece of the global tensor, ``_StridedShard(0, split_factor=2)`` on the
data-parallel dim, as torch's ``fully_shard`` places them; with a plain ``Shard(0)``
``full_tensor()`` and the state dict would interleave the rows wrongly.

Both ways of composing the two, with fsdp_core's ``fully_shard`` and the installed torch's side
by side on the same four gloo ranks:

- ``spmd``: every parameter a DTensor on the full ``(dp, tp)`` mesh (the column-wise layout on
  ``tp``: ``[Replicate(), Shard(0)]``), then ``fully_shard(mesh=mesh,
  dp_mesh_dims=DataParallelMeshDims(shard="dp"))`` (see [Note: SPMD meshes]);
- ``2d``: ``parallelize_module(model, mesh["tp"], ColwiseParallel / RowwiseParallel)``, then
  ``fully_shard(mesh=mesh["dp"])`` (see [Note: tensor-parallel parameters]).

Each checks the placements and meshes against torch's, ``full_tensor()`` of every parameter
against torch's and the unsharded model's (``torch.equal``: the same rows), the state dicts, and
three SGD steps of losses and parameters against torch's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_core

# torch 2.13 added dp_mesh_dims; under older torches the SPMD case has nothing to compare with.
TorchDataParallelMeshDims = getattr(torch_fsdp, "DataParallelMeshDims", None)
WAYS = ("spmd", "2d")


class _ColwiseMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)  # column-wise: weight (16, 8) and bias (16,) split on dim 0
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _distinct_rows(model: nn.Module) -> None:
    """Every row of every parameter different, so a row in the wrong place shows."""
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            param.copy_(torch.arange(param.numel(), dtype=param.dtype).view_as(param) / 100 + i)


def _colwise_on_full_mesh(name: str, module: nn.Module, mesh: Any) -> None:
    """ColwiseParallel's layout on the ``tp`` dim of the full mesh, replicated on ``dp``;
    everything else replicated."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        tp = Shard(0) if name == "up" else Replicate()
        placed = nn.Parameter(distribute_tensor(param, mesh, [Replicate(), tp]))
        module.register_parameter(param_name, placed)


def _shard(engine: str, way: str, model: nn.Module, mesh: Any) -> None:
    if way == "spmd":
        distribute_module(model, mesh, _colwise_on_full_mesh)
    else:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
    if engine == "fsdp_core":
        dims: Any = fsdp_core.DataParallelMeshDims(shard="dp")
        shard = fsdp_core.fully_shard
    else:
        dims, shard = (
            (TorchDataParallelMeshDims(shard="dp") if way == "spmd" else None),
            (torch_fully_shard),
        )
    if way == "spmd":
        shard(model, mesh=mesh, dp_mesh_dims=dims)
    else:
        shard(model, mesh=mesh["dp"])


def _batch(way: str, mesh: Any, step: int) -> Any:
    """Each data-parallel rank its own batch, the same on both tensor-parallel ranks."""
    gen = torch.Generator().manual_seed(100 * step + mesh.get_local_rank("dp"))
    x = torch.randn(4, 8, generator=gen)
    if way == "spmd":
        return DTensor.from_local(x, mesh, [Replicate(), Replicate()], run_check=False)
    return x


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _run(engine: str, way: str, mesh: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _ColwiseMLP()
    _distinct_rows(model)
    unsharded = copy.deepcopy(model)
    _shard(engine, way, model, mesh)
    layout = {
        n: (tuple(p.placements), p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()
    }
    full = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    state = {
        k: (tuple(v.placements), _full(v).detach().clone()) for k, v in model.state_dict().items()
    }
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = _full(model(_batch(way, mesh, step)).sum())
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().clone())
    trained = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    return {
        "layout": layout,
        "full": full,
        "unsharded": dict(unsharded.named_parameters()),
        "state": state,
        "losses": losses,
        "trained": trained,
    }


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.distributed(world_size=4)
def test_tp_and_fsdp_on_dim_0_like_torch(way, rank, process_group):
    if way == "spmd" and TorchDataParallelMeshDims is None:
        pytest.skip(f"torch {torch.__version__} has no dp_mesh_dims to compare with")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours = _run("fsdp_core", way, mesh)
    theirs = _run("torch", way, mesh)

    for name, value in ours["full"].items():
        assert torch.equal(value, ours["unsharded"][name].detach()), name
        assert torch.equal(value, theirs["full"][name]), name

    # The column-wise parameters are strided on dp, as torch's; the others plain Shard(0).
    assert ours["layout"] == theirs["layout"]
    strided = _StridedShard(0, split_factor=2)
    assert ours["layout"]["up.weight"][0][0] == strided
    assert ours["layout"]["up.bias"][0][0] == strided
    assert ours["layout"]["down.weight"][0][0] == Shard(0)

    assert ours["state"].keys() == theirs["state"].keys()
    for key, (placements, value) in ours["state"].items():
        assert placements == theirs["state"][key][0], key
        assert torch.equal(value, theirs["state"][key][1]), key

    # The same arithmetic but for the order of the gradient reductions (gloo's reduce-scatter
    # against FSDP2's): fp32 rounding only.
    for step, (mine, torchs) in enumerate(zip(ours["losses"], theirs["losses"], strict=True)):
        torch.testing.assert_close(mine, torchs, rtol=1e-6, atol=1e-6, msg=f"loss of step {step}")
    for name, value in ours["trained"].items():
        torch.testing.assert_close(value, theirs["trained"][name], rtol=1e-6, atol=1e-6)
