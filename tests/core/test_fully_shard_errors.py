"""``fully_shard``'s answers to bad input (each names the API, the value and the fix) and the
root's default ``reshard_after_forward``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_core import FSDP, fully_shard

from ._models import NestedModel

# (group, mesh): a warm rank builds its 3-D mesh once (each build makes new groups).
_meshes_3d: list[tuple[dist.ProcessGroup, DeviceMesh]] = []


def _mesh(group: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(group, "cpu")


def _mesh_3d(group: dist.ProcessGroup) -> DeviceMesh:
    for known, mesh in _meshes_3d:
        if known is group:
            return mesh
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(1, 1, -1)
    mesh = DeviceMesh("cpu", ranks)
    _meshes_3d.append((group, mesh))
    return mesh


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.distributed(world_size=2)
def test_bad_input_raises_naming_the_value_and_the_fix(rank, process_group):
    """Twice on one module, top-down application, a 3-D mesh, an int reshard_after_forward
    that does not divide the world, a wrapper-door module inside, a scalar parameter."""
    mesh = _mesh(process_group)

    model = NestedModel()
    fully_shard(model.block, mesh=mesh)
    with pytest.raises(
        ValueError, match=r"fully_shard was already applied to FSDPSequential.*once"
    ):
        fully_shard(model.block, mesh=mesh)

    model = NestedModel()
    fully_shard(model, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"fully_shard\(Sequential\) was applied top-down: its parameters \['0.weight', "
        r"'0.bias', '2.weight', '2.bias'\] are already sharded .* Apply fully_shard bottom-up",
    ):
        fully_shard(model.block, mesh=mesh)

    with pytest.raises(ValueError, match=r"mesh must be 1-D \(FSDP\) or 2-D \(HSDP\), got a 3-D"):
        fully_shard(NestedModel(), mesh=_mesh_3d(process_group))

    with pytest.raises(
        ValueError,
        match=r"fully_shard: reshard_after_forward=3 must divide the shard world size 2; pass "
        r"one of \[1, 2\], or True/False",
    ):
        fully_shard(NestedModel(), mesh=mesh, reshard_after_forward=3)
    model = fully_shard(NestedModel(), mesh=mesh)
    with pytest.raises(ValueError, match=r"set_reshard_after_forward: reshard_after_forward=0"):
        model.set_reshard_after_forward(0)

    model = NestedModel()
    model.block = FSDP(model.block, process_group)
    with pytest.raises(
        ValueError, match=r"contains FullyShardedDataParallel instances \['block'\].*do not nest"
    ):
        fully_shard(model, mesh=mesh)

    with pytest.raises(
        ValueError,
        match=r"fully_shard doesn't support scalar parameters \['scale'\].*Change scale to a 1D "
        r"tensor with numel equal to 1",
    ):
        fully_shard(_Scaled(), mesh=mesh)


@pytest.mark.distributed(world_size=2)
def test_the_root_keeps_its_parameters_after_forward_by_default(rank, process_group):
    """Left at the default (None), the root's unit stays gathered after forward and the
    blocks reshard; the root's set_reshard_after_forward(True), or an explicit True, makes it
    reshard too."""
    mesh = _mesh(process_group)
    model = NestedModel()
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(2, 8)
    loss = model(x).sum()
    assert not isinstance(model.inp.weight, DTensor)  # root: still gathered
    assert isinstance(model.block[0].weight, DTensor)  # block: resharded
    loss.backward()
    assert isinstance(model.inp.weight, DTensor)

    model.set_reshard_after_forward(True, recurse=False)
    loss = model(x).sum()
    assert isinstance(model.inp.weight, DTensor)
    loss.backward()

    # An explicit True reshards the root too (torch 2.13: only the default None keeps it).
    model = NestedModel()
    fully_shard(model.block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    loss = model(x).sum()
    assert isinstance(model.inp.weight, DTensor)
    loss.backward()


class _TwoDtypes(nn.Module):
    """``lin`` in float32 and ``scale`` in float16 (frozen or not): one unit, two dtypes."""

    def __init__(self, half_trains: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float16), requires_grad=half_trains)


@pytest.mark.distributed(world_size=2)
def test_parameters_of_several_dtypes_in_one_unit_raise_naming_the_door(rank, process_group):
    """Trainable parameters of two dtypes: FSDP2's AssertionError (also a ValueError) with its
    words, naming the door called (the unit's error named the wrapper for every door). A frozen
    parameter of another dtype is FSDP2's and the composable doors' (tests/core/
    test_mixed_dtypes.py); the wrapper keeps FSDP1's ValueError for it."""
    from fsdp_core import replicate

    mesh = _mesh(process_group)
    for door, shard in (("fully_shard", fully_shard), ("replicate", replicate)):
        with pytest.raises(AssertionError, match=rf"^{door}: FSDP expects uniform original param"):
            shard(_TwoDtypes(half_trains=True), mesh=mesh)
        with pytest.raises(ValueError, match=r"torch.float16"):
            shard(_TwoDtypes(half_trains=True), mesh=mesh)
    with pytest.raises(ValueError, match=r"^FullyShardedDataParallel needs one dtype and device"):
        FSDP(_TwoDtypes(half_trains=False), process_group)
