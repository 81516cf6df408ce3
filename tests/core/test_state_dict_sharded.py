"""The wrapper door's sharded and local state dicts, the state dict settings, and optimizer
state dicts (full and sharded) on both doors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_core import (
    FSDP,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
    fully_shard,
)

from ._models import build, get_input, wrap_model

FULL = StateDictType.FULL_STATE_DICT
SHARDED = StateDictType.SHARDED_STATE_DICT
LOCAL = StateDictType.LOCAL_STATE_DICT


def _step(model, optim, kind, rank, step):
    model(get_input(kind, rank, step)).sum().backward()
    optim.step()
    optim.zero_grad()


def _trained(kind, rank, group, steps=2, **fsdp_kwargs):
    model = wrap_model(kind, build(kind, rank), group, **fsdp_kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        _step(model, optim, kind, rank, step)
    return model, optim


def _zero(model):
    with FSDP.summon_full_params(model), torch.no_grad():
        for param in model.parameters():
            param.zero_()


def _detached_copy(state):
    """A copy of a state dict that does not share storage with the model."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.mark.parametrize("kind", ["transformer", "nested"])
@pytest.mark.distributed(world_size=[2, 3])
def test_sharded_state_dict_is_dtensor_shards_under_the_full_names(kind, rank, process_group):
    """Every parameter is a DTensor (Shard(0) on the group's mesh) whose full tensor equals
    the full state dict's value and whose local part is the parameter's shard (same storage);
    buffers and the keys equal the full state dict's; zeroed parameters load back."""
    model, _ = _trained(kind, rank, process_group)
    full = model.state_dict()
    with FSDP.state_dict_type(model, SHARDED):
        sharded = model.state_dict()
    assert list(sharded) == list(full)
    params = dict(model.named_parameters(remove_duplicate=False))  # the tied proj.weight too
    world = dist.get_world_size(process_group)
    for name, value in sharded.items():
        if name not in params:
            assert not isinstance(value, DTensor) and torch.equal(value, full[name]), name
            continue
        assert isinstance(value, DTensor), name
        assert value.placements == (Shard(0),) and value.device_mesh.size() == world
        assert value.to_local().data_ptr() == params[name].to_local().data_ptr(), name
        assert torch.equal(value.full_tensor(), full[name]), name
    saved = _detached_copy(sharded)
    _zero(model)
    assert not any(v.any() for v in model.state_dict().values() if v.is_floating_point())
    with FSDP.state_dict_type(model, SHARDED):
        result = model.load_state_dict(saved)
    assert list(result.missing_keys) == list(result.unexpected_keys) == []
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in full.items())


@pytest.mark.distributed(world_size=2)
def test_sharded_load_takes_full_tensors_and_other_layouts_and_names_a_wrong_shape(
    rank, process_group
):
    """A sharded load accepts full plain tensors and DTensors of another layout (here
    replicated); a tensor of another shape raises naming the parameter and the fix; missing
    and unexpected keys are reported as for a full state dict."""
    model, _ = _trained("nested", rank, process_group)
    full = _detached_copy(model.state_dict())
    mesh = DeviceMesh.from_group(process_group, "cpu")
    replicated = {
        k: DTensor.from_local(v, mesh, (Replicate(),), run_check=False) for k, v in full.items()
    }
    for incoming in (full, replicated):
        _zero(model)
        with FSDP.state_dict_type(model, SHARDED):
            model.load_state_dict(incoming)
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in full.items())
    wrong = {**full, "block.0.weight": torch.zeros(8, 4)}
    with FSDP.state_dict_type(model, SHARDED):
        with pytest.raises(ValueError, match=r"'block\.0\.weight' has shape \(8, 4\) in the state"):
            model.load_state_dict(wrong)
        with pytest.raises(RuntimeError, match=r"missing keys \['out\.bias'\], unexpected keys"):
            model.load_state_dict({k: v for k, v in full.items() if k != "out.bias"})
        result = model.load_state_dict({**full, "extra": torch.zeros(1)}, strict=False)
    assert list(result.unexpected_keys) == ["extra"]


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
@pytest.mark.distributed(world_size=2)
def test_local_state_dict_is_each_units_flat_shard(rank, process_group, strategy):
    """LOCAL_STATE_DICT holds one ``<module>._flat_param`` per unit (torch's FSDP1 names),
    a DTensor whose local part is the unit's padded flat shard, plus the buffers; it loads
    back, and a flat shard of another size raises naming the key and SHARDED_STATE_DICT."""
    model, _ = _trained("transformer", rank, process_group, sharding_strategy=strategy)
    full = model.state_dict()
    with FSDP.state_dict_type(model, LOCAL, LocalStateDictConfig(offload_to_cpu=True)):
        local = model.state_dict()
    flat_keys = sorted(k for k in local if k.endswith("_flat_param"))
    assert flat_keys == ["_flat_param", "layers.0._flat_param", "layers.1._flat_param"]
    assert sorted(set(local) - set(flat_keys)) == sorted(
        k for k in full if k not in dict(model.named_parameters()) and "proj.weight" != k
    )
    placement = Shard(0) if strategy is ShardingStrategy.FULL_SHARD else Replicate()
    for key, module in zip(flat_keys, FSDP.fsdp_modules(model), strict=True):
        value = local[key]
        assert isinstance(value, DTensor) and value.placements == (placement,)
        assert torch.equal(value.to_local(), module._unit._flat_shard)
    saved = _detached_copy(local)
    _zero(model)
    with FSDP.state_dict_type(model, LOCAL):
        assert model.load_state_dict(saved).missing_keys == []
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in full.items())
    with FSDP.state_dict_type(model, LOCAL):
        with pytest.raises(ValueError, match=r"'layers\.0\._flat_param' holds 3 elements.*"):
            model.load_state_dict({**saved, "layers.0._flat_param": torch.zeros(3)})


@pytest.mark.distributed(world_size=2)
def test_state_dict_settings_follow_torch(rank, process_group):
    """set/get_state_dict_type return StateDictSettings with the matching default configs,
    the context restores the previous settings, a config of the wrong kind raises."""
    model = wrap_model("nested", build("nested", rank), process_group)
    default = FSDP.get_state_dict_type(model)
    assert default == StateDictSettings(FULL, FullStateDictConfig(), FullOptimStateDictConfig())
    previous = FSDP.set_state_dict_type(model, SHARDED, ShardedStateDictConfig(offload_to_cpu=True))
    assert previous == default
    now = FSDP.get_state_dict_type(model)
    assert now.state_dict_config == ShardedStateDictConfig(offload_to_cpu=True)
    assert now.optim_state_dict_config == ShardedOptimStateDictConfig()
    with FSDP.state_dict_type(model, LOCAL):
        assert FSDP.get_state_dict_type(model.block).state_dict_type is LOCAL
    assert FSDP.get_state_dict_type(model) == now
    with pytest.raises(TypeError, match="takes a ShardedOptimStateDictConfig"):
        FSDP.set_state_dict_type(model, SHARDED, None, FullOptimStateDictConfig())
    with pytest.raises(TypeError, match="takes a bool"):
        FullStateDictConfig(rank0_only=1)  # type: ignore[arg-type]
    FSDP.set_state_dict_type(model.block, FULL)
    with pytest.raises(ValueError, match="disagree"):
        FSDP.get_state_dict_type(model)


def _ddp_adamw(kind, rank, group, steps):
    ddp = DDP(build(kind, rank), process_group=group)
    optim = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for step in range(steps):
        _step(ddp, optim, kind, rank, step)
    names = [n for n, _ in ddp.module.named_parameters()]
    return {names[i]: s for i, s in optim.state_dict()["state"].items()}


@pytest.mark.parametrize("door", ["wrapper", "fully_shard"])
@pytest.mark.distributed(world_size=2)
def test_full_optim_state_dict_equals_ddp_and_round_trips(door, rank, process_group):
    """The full optimizer state dict is keyed by parameter name and holds AdamW's full
    exp_avg/exp_avg_sq, equal to DDP's; rank0_only leaves the other ranks empty; loaded into
    a fresh model and optimizer, training continues exactly as the original."""
    model, optim = _model_and_optim(door, rank, process_group)
    for step in range(2):
        _step(model, optim, "nested", rank, step)
    expected = _ddp_adamw("nested", rank, process_group, 2)
    osd = FSDP.optim_state_dict(model, optim)
    assert sorted(osd["state"]) == sorted(expected)
    assert osd["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
    for name, state in expected.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(osd["state"][name][key], state[key]), (name, key)
    config = FullOptimStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(model, FULL, None, config):
        only0 = FSDP.optim_state_dict(model, optim)
    assert (only0 == {}) == (rank != 0)
    _assert_resumes(door, model, optim, osd, FSDP.state_dict_type(model, FULL), rank, process_group)


@pytest.mark.parametrize("door", ["wrapper", "fully_shard"])
@pytest.mark.distributed(world_size=[2, 3])
def test_sharded_optim_state_dict_is_dtensors_and_round_trips(door, rank, process_group):
    """Under SHARDED_STATE_DICT the optimizer state is DTensors laid out like the parameters
    (whose full tensors equal the full optimizer state dict's) and round trips exactly."""
    model, optim = _model_and_optim(door, rank, process_group)
    for step in range(2):
        _step(model, optim, "nested", rank, step)
    full = FSDP.optim_state_dict(model, optim)
    config = ShardedOptimStateDictConfig(offload_to_cpu=False)
    with FSDP.state_dict_type(model, SHARDED, ShardedStateDictConfig(), config):
        osd = FSDP.optim_state_dict(model, optim)
    for name, state in osd["state"].items():
        assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == (Shard(0),)
        assert torch.equal(state["exp_avg"].full_tensor(), full["state"][name]["exp_avg"])
        assert not isinstance(state["step"], DTensor)
    states = {n: _detached_copy(s) for n, s in osd["state"].items()}
    osd = {"state": states, "param_groups": osd["param_groups"]}
    _assert_resumes(
        door, model, optim, osd, FSDP.state_dict_type(model, SHARDED), rank, process_group
    )


def _model_and_optim(door, rank, group):
    if door == "wrapper":
        model = wrap_model("nested", build("nested", rank), group)
    else:
        model = build("nested", rank)
        mesh = DeviceMesh.from_group(group, "cpu")
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _assert_resumes(door, model, optim, osd, context, rank, group):
    """A fresh model loaded with ``model``'s parameters and the optimizer state ``osd`` trains
    two more steps exactly as ``model`` does; without the optimizer state it does not."""
    results = []
    for load_optim in (True, False):
        fresh, fresh_optim = _model_and_optim(door, rank, group)
        fresh.load_state_dict(model.state_dict() if door == "wrapper" else _full_sd(model))
        if load_optim:
            with context:
                FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd, load_directly=True)
        for step in range(2, 4):
            _step(fresh, fresh_optim, "nested", rank, step)
        results.append(_full_sd(fresh))
    for step in range(2, 4):
        _step(model, optim, "nested", rank, step)
    expected = _full_sd(model)
    assert all(torch.equal(results[0][k], v) for k, v in expected.items())
    assert not all(torch.equal(results[1][k], v) for k, v in expected.items())


def _full_sd(model):
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }


@pytest.mark.distributed(world_size=2)
def test_dcp_state_dict_functions_take_the_wrapper_as_they_are(rank, process_group):
    """DCP's own get_state_dict on the wrapper: the model state is what state_dict() gives
    (full tensors by default, DTensor shards under SHARDED_STATE_DICT), the AdamW state is
    DTensors laid out like the parameters under the original names; set_state_dict loads both
    back into a zeroed model and a fresh optimizer (it finds the optimizer's parameters by
    those names: the wrapper tells DCP to leave out its own level)."""
    from torch.distributed.checkpoint import state_dict as dcp_sd

    model, optim = _trained("nested", rank, process_group)
    full = model.state_dict()
    model_sd, optim_sd = dcp_sd.get_state_dict(model, optim)
    assert list(model_sd) == list(full)
    assert all(not isinstance(v, DTensor) and torch.equal(v, full[k]) for k, v in model_sd.items())
    names = [n for n, _ in model.named_parameters()]
    assert sorted(optim_sd["state"]) == sorted(names)
    assert optim_sd["param_groups"][0]["params"] == names
    for name, param in model.named_parameters():
        exp_avg = optim_sd["state"][name]["exp_avg"]
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
        assert isinstance(exp_avg, DTensor) and exp_avg.placements == (Shard(0),), name
        assert exp_avg.device_mesh == param.device_mesh
        assert exp_avg.to_local().shape == param.to_local().shape, name
    with FSDP.state_dict_type(model, SHARDED):
        sharded_sd = dcp_sd.get_model_state_dict(model)
    assert all(torch.equal(sharded_sd[k].full_tensor(), full[k]) for k in names)
    saved_optim = {n: _detached_copy(s) for n, s in optim_sd["state"].items()}
    expected_optim = {n: s["exp_avg"].full_tensor() for n, s in optim_sd["state"].items()}
    _zero(model)
    fresh_optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dcp_sd.set_state_dict(
        model,
        fresh_optim,
        model_state_dict=_detached_copy(full),
        optim_state_dict={"state": saved_optim, "param_groups": optim_sd["param_groups"]},
    )
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in full.items())
    loaded = dcp_sd.get_optimizer_state_dict(model, fresh_optim)
    for name, exp_avg in expected_optim.items():
        assert torch.equal(loaded["state"][name]["exp_avg"].full_tensor(), exp_avg), name
