"""DCP checkpoints of both doors: saved at one world size, loaded at another (4 -> 2, 4 -> 3
with uneven shards, 2 -> 4), training continues with the uninterrupted run's losses, AdamW
state included; a checkpoint of one door loads into the other; a shape mismatch is named.

Both world sizes run inside one launch of four ranks on subgroups; see [Note: resuming at
another world size] in ``fsdp_testing/parity/_resume.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_core.checkpoint
from fsdp_core import FSDP, ShardingStrategy, StateDictType, fully_shard
from fsdp_testing.parity import check_resume_parity

from ._models import NestedModel, build, wrap_model


def _build() -> nn.Module:
    return build("nested", 0)  # identical on every rank and call


def _wrapper(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    return wrap_model("nested", model, group)


def _composable(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    mesh = DeviceMesh.from_group(group, "cpu")
    assert isinstance(model, NestedModel)
    fully_shard(model.block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(12, 8, generator=torch.Generator().manual_seed(step))


DOORS = {"wrapper": _wrapper, "fully_shard": _composable}


@pytest.mark.parametrize(("from_world", "to_world"), [(4, 2), (4, 3), (2, 4), (4, 4)])
@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.distributed(world_size=4)
def test_resume_at_another_world_size(door, from_world, to_world, process_group, tmp_path):
    """The resumed run holds the saved parameters exactly and continues with the
    uninterrupted run's losses (bitwise at the same world size)."""
    report = check_resume_parity(
        _build,
        DOORS[door],
        _batch,
        process_group=process_group,
        checkpoint_dir=tmp_path,
        from_world=from_world,
        to_world=to_world,
    )
    assert len(report.resumed_losses) == 2 and report.reference_losses[2:] != ()


@pytest.mark.parametrize(
    ("saver", "loader"), [("wrapper", "fully_shard"), ("fully_shard", "wrapper")]
)
@pytest.mark.distributed(world_size=4)
def test_checkpoint_of_one_door_loads_into_the_other(saver, loader, process_group, tmp_path):
    """A wrapper SHARDED_STATE_DICT checkpoint resumes on the composable door and back, also
    across world sizes (4 -> 3)."""
    check_resume_parity(
        _build,
        DOORS[saver],
        _batch,
        process_group=process_group,
        checkpoint_dir=tmp_path,
        from_world=4,
        to_world=3,
        resume_shard=DOORS[loader],
    )


@pytest.mark.distributed(world_size=2)
def test_dcp_state_dict_functions_handle_the_composable_door(rank, process_group):
    """DCP's own get_state_dict returns DTensor model and AdamW state for a fully_shard-ed
    model under the original names; set_state_dict loads them back."""
    model = _composable(_build(), process_group)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_batch(0)[rank * 6 : rank * 6 + 6]).sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    names = [n for n, _ in _build().named_parameters()]
    assert sorted(model_sd) == sorted(names) and sorted(optim_sd["state"]) == sorted(names)
    for name in names:
        assert isinstance(model_sd[name], DTensor) and model_sd[name].placements == (Shard(0),)
        assert isinstance(optim_sd["state"][name]["exp_avg"], DTensor)
    saved = {k: v.full_tensor() for k, v in model_sd.items()}
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    set_state_dict(
        model,
        optim,
        model_state_dict={k: v.clone() for k, v in get_state_dict(model, optim)[0].items()}
        | {k: _from_full(v, model_sd[k]) for k, v in saved.items()},
        optim_state_dict=optim_sd,
    )
    assert all(torch.equal(p.full_tensor(), saved[n]) for n, p in model.named_parameters())


def _from_full(full: torch.Tensor, like: DTensor) -> DTensor:
    rows = full.chunk(like.device_mesh.size())[like.device_mesh.get_local_rank()]
    return DTensor.from_local(rows.clone(), like.device_mesh, like.placements, run_check=False)


@pytest.mark.distributed(world_size=2)
def test_wrapper_sharded_state_dict_through_plain_dcp(rank, process_group, tmp_path):
    """The FSDP1 recipe works: under SHARDED_STATE_DICT, model.state_dict() and
    FSDP.optim_state_dict go through dcp.save/dcp.load and load back with load_state_dict and
    optim_state_dict_to_load."""
    model = _wrapper(_build(), process_group)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_batch(0)[rank * 6 : rank * 6 + 6]).sum().backward()
    optim.step()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.save(state, checkpoint_id=tmp_path)
    expected = {k: v.full_tensor() for k, v in state["model"].items() if isinstance(v, DTensor)}
    fresh = _wrapper(_build(), process_group)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fsdp_core.checkpoint.get_state_dict(fresh, fresh_optim)  # creates AdamW's state tensors
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        target = {"model": fresh.state_dict(), "optim": FSDP.optim_state_dict(fresh, fresh_optim)}
        dcp.load(target, checkpoint_id=tmp_path)
        fresh.load_state_dict(target["model"])
        FSDP.optim_state_dict_to_load(fresh, fresh_optim, target["optim"], load_directly=True)
    with FSDP.summon_full_params(fresh):
        assert all(torch.equal(p, expected[n]) for n, p in fresh.named_parameters())
    for key in ("exp_avg", "exp_avg_sq", "step"):
        mine = [fresh_optim.state[p][key] for p in fresh.parameters()]
        theirs = [optim.state[p][key] for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), key


class _Wider(NestedModel):
    def __init__(self) -> None:
        super().__init__()
        self.block[2] = nn.Linear(16, 16 + 4)
        self.out = nn.Linear(20, 8)


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.distributed(world_size=2)
def test_loading_a_checkpoint_of_other_shapes_names_the_parameter(door, process_group, tmp_path):
    """A checkpoint whose parameter shapes differ from the model's raises a clear error that
    names the parameter, both shapes and the fix."""
    model = DOORS[door](_build(), process_group)
    fsdp_core.checkpoint.save(model, checkpoint_id=tmp_path)
    wider = DOORS[door](_Wider(), process_group)
    with pytest.raises(
        ValueError, match=r"'block\.2\.weight': \(16, 16\) in the checkpoint, \(20, 16\)"
    ):
        fsdp_core.checkpoint.load(wider, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match=r"Build the model with the configuration"):
        fsdp_core.checkpoint.load(wider, checkpoint_id=tmp_path)


def _hybrid(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    assert dist.get_world_size(group) == 4  # the launched world: a 2 x 2 grid
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("replicate", "shard"))
    hybrid = ShardingStrategy.HYBRID_SHARD
    assert isinstance(model, NestedModel)
    model.block = FSDP(model.block, device_mesh=mesh, sharding_strategy=hybrid)
    return FSDP(model, device_mesh=mesh, sharding_strategy=hybrid)


@pytest.mark.distributed(world_size=4)
def test_hybrid_shard_checkpoint_resumes_fully_sharded_at_two_ranks(rank, process_group, tmp_path):
    """HYBRID_SHARD's sharded state dict lays each parameter out on the 2-D mesh
    (Replicate(), Shard(0)); its checkpoint resumes under FULL_SHARD
    at world size 2 with the uninterrupted hybrid run's losses."""
    model = _hybrid(_build(), process_group)
    full = model.state_dict()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    for name, value in sharded.items():
        assert isinstance(value, DTensor) and value.placements == (Replicate(), Shard(0)), name
        assert torch.equal(value.full_tensor(), full[name]), name
    check_resume_parity(
        _build,
        _hybrid,
        _batch,
        process_group=process_group,
        checkpoint_dir=tmp_path,
        from_world=4,
        to_world=2,
        resume_shard=_wrapper,
    )
