"""DCP's own state dict functions (``torch.distributed.checkpoint.state_dict``) on the wrapper
door, with no fsdp_core helper in between: a run saved at four ranks with ``dcp.save`` resumes
at two and at three ranks (uneven shards, a rank without rows) with the uninterrupted run's
losses, for FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD, with the model state full (the
wrapper's default state dict type) or sharded (``SHARDED_STATE_DICT``), and with DCP's sharded
or full (``full_state_dict=True``) values.

Both world sizes run inside one launch of four ranks on subgroups; see [Note: resuming at
another world size] in ``fsdp_testing/parity/_resume.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_core import FSDP, ShardingStrategy, StateDictType
from fsdp_testing.parity import FP32_TOLERANCE, check_resume_parity

from ._models import NestedModel, build, wrap_model

FULL_SHARD = ShardingStrategy.FULL_SHARD
SHARD_GRAD_OP = ShardingStrategy.SHARD_GRAD_OP
HYBRID_SHARD = ShardingStrategy.HYBRID_SHARD
FULL_VALUES = StateDictOptions(full_state_dict=True)


def _build() -> nn.Module:
    return build("nested", 0)  # identical on every rank and call


def _batch(step: int) -> torch.Tensor:
    return torch.randn(12, 8, generator=torch.Generator().manual_seed(step))


def _shard(strategy: ShardingStrategy, model_layout: str):
    """``shard(model, group)`` wrapping with ``strategy`` (HYBRID_SHARD: a 2 x 2 grid of the
    four launched ranks); ``model_layout="sharded"`` sets SHARDED_STATE_DICT, so DCP gets
    DTensor shards of the model too."""

    def shard(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        if strategy is HYBRID_SHARD:
            assert dist.get_world_size(group) == 4
            mesh = DeviceMesh(
                "cpu", torch.arange(4).view(2, 2), mesh_dim_names=("replicate", "shard")
            )
            assert isinstance(model, NestedModel)
            model.block = FSDP(model.block, device_mesh=mesh, sharding_strategy=strategy)
            wrapped = FSDP(model, device_mesh=mesh, sharding_strategy=strategy)
        else:
            wrapped = wrap_model("nested", model, group, sharding_strategy=strategy)
        if model_layout == "sharded":
            FSDP.set_state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT)
        return wrapped

    return shard


CASES = [
    # (strategy, model layout, DCP options, resumed at, resumed with FULL_SHARD)
    pytest.param(FULL_SHARD, "full", None, 2, id="full_shard-full-4to2"),
    pytest.param(FULL_SHARD, "full", FULL_VALUES, 3, id="full_shard-full-full_values-4to3"),
    pytest.param(FULL_SHARD, "sharded", None, 3, id="full_shard-sharded-4to3"),
    pytest.param(FULL_SHARD, "sharded", FULL_VALUES, 2, id="full_shard-sharded-full_values-4to2"),
    pytest.param(SHARD_GRAD_OP, "sharded", None, 2, id="shard_grad_op-sharded-4to2"),
    pytest.param(SHARD_GRAD_OP, "full", None, 3, id="shard_grad_op-full-4to3"),
    pytest.param(HYBRID_SHARD, "sharded", None, 3, id="hybrid-sharded-4to3"),
    pytest.param(HYBRID_SHARD, "full", FULL_VALUES, 2, id="hybrid-full-full_values-4to2"),
]


@pytest.mark.parametrize(("strategy", "model_layout", "options", "to_world"), CASES)
@pytest.mark.distributed(world_size=4)
def test_dcp_get_set_state_dict_resume_the_wrapper_at_another_world_size(
    strategy, model_layout, options, to_world, process_group, tmp_path
):
    """dcp.save of DCP's get_state_dict at four ranks; at two or three ranks dcp.load into
    DCP's get_state_dict of a fresh model and DCP's set_state_dict: the parameters are the
    saved ones bitwise and training continues with the uninterrupted run's losses (AdamW
    state included: without it the losses would differ). A hybrid run resumes under
    FULL_SHARD (a 2-D grid needs four ranks)."""
    resume_strategy = FULL_SHARD if strategy is HYBRID_SHARD else strategy
    report = check_resume_parity(
        _build,
        _shard(strategy, model_layout),
        _batch,
        process_group=process_group,
        checkpoint_dir=tmp_path,
        from_world=4,
        to_world=to_world,
        resume_shard=_shard(resume_strategy, model_layout),
        options=options,
    )
    assert len(report.resumed_losses) == 2


@pytest.mark.parametrize(
    ("strategy", "placements"),
    [(FULL_SHARD, (Shard(0),)), (HYBRID_SHARD, (Replicate(), Shard(0)))],
)
@pytest.mark.distributed(world_size=4)
def test_dcp_optimizer_state_of_the_wrapper_is_laid_out_like_its_parameters(
    strategy, placements, rank, process_group
):
    """The sharded parameters and DCP's optimizer state of the wrapper are DTensors with the
    strategy's placements on the same mesh; with full_state_dict=True DCP gathers them into
    full tensors equal on every rank."""
    model = _shard(strategy, "full")(_build(), process_group)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optim, 0, process_group)
    osd = get_optimizer_state_dict(model, optim)
    full = get_optimizer_state_dict(model, optim, options=FULL_VALUES)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and tuple(param.placements) == placements, name
        exp_avg = osd["state"][name]["exp_avg"]
        assert isinstance(exp_avg, DTensor) and exp_avg.device_mesh == param.device_mesh
        assert tuple(exp_avg.placements) == placements, name
        gathered = full["state"][name]["exp_avg"]
        assert not isinstance(gathered, DTensor) and gathered.shape == param.shape
        assert torch.equal(gathered, exp_avg.full_tensor()), name
        everyone = [torch.empty_like(gathered) for _ in range(4)]
        dist.all_gather(everyone, gathered, group=process_group)
        assert all(torch.equal(other, gathered) for other in everyone), name


@pytest.mark.parametrize("options", [None, FULL_VALUES], ids=["sharded_values", "full_values"])
@pytest.mark.distributed(world_size=4)
def test_dcp_model_and_optimizer_halves_resume_the_wrapper_at_three_ranks(
    options, rank, process_group, tmp_path
):
    """get_model_state_dict and get_optimizer_state_dict saved with dcp.save at four ranks;
    at three ranks dcp.load into the fresh model's and optimizer's own state dicts, then
    set_model_state_dict and set_optimizer_state_dict: the model and optimizer state are the
    saved ones bitwise and the next steps' losses are the uninterrupted run's."""
    three = dist.new_group(ranks=[0, 1, 2])  # every rank takes part in making it
    shard = _shard(FULL_SHARD, "sharded")
    model = shard(_build(), process_group)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        _train_step(model, optim, step, process_group)
    state = {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, optim, options=options),
    }
    dcp.save(state, checkpoint_id=tmp_path, process_group=process_group)
    saved = _full_states(model, optim)
    reference = [_train_step(model, optim, step, process_group) for step in (2, 3)]
    dist.barrier(group=process_group)
    if rank < 3:
        fresh = shard(_build(), three)
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        target = {
            "model": get_model_state_dict(fresh, options=options),
            "optim": get_optimizer_state_dict(fresh, fresh_optim, options=options),
        }
        dcp.load(target, checkpoint_id=tmp_path, process_group=three)
        set_model_state_dict(fresh, target["model"], options=options)
        set_optimizer_state_dict(fresh, fresh_optim, target["optim"], options=options)
        loaded = _full_states(fresh, fresh_optim)
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[k], v) for k, v in saved.items()), [
            k for k, v in saved.items() if not torch.equal(loaded[k], v)
        ]
        resumed = [_train_step(fresh, fresh_optim, step, three) for step in (2, 3)]
        assert torch.allclose(
            torch.tensor(resumed, dtype=torch.float64),
            torch.tensor(reference, dtype=torch.float64),
            rtol=FP32_TOLERANCE.rtol,
            atol=FP32_TOLERANCE.atol,
        ), (resumed, reference)


def _train_step(
    model: nn.Module, optim: torch.optim.Optimizer, step: int, group: dist.ProcessGroup
) -> float:
    """One step on this rank's rows of the global batch; the global mean loss."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    loss = model(_batch(step).chunk(size)[rank]).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total, group=group)
    return float(total.item()) / size


def _full_states(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of the full model and AdamW state by name, from DCP's full_state_dict option
    (``step`` is the optimizer's own tensor there, which later steps change in place)."""
    model_sd = get_model_state_dict(model, options=FULL_VALUES)
    osd = get_optimizer_state_dict(model, optim, options=FULL_VALUES)
    found = {f"model.{k}": v.clone() for k, v in model_sd.items()}
    for name, per_param in osd["state"].items():
        for key, value in per_param.items():
            found[f"optim.{name}.{key}"] = torch.as_tensor(value).clone()
    return found


def test_fsdp_core_never_looks_at_its_callers_frames():
    """Behaviour never depends on who calls (STYLE.md): no frame inspection in fsdp_core,
    where the wrapper once walked the stack to refuse DCP's functions."""
    import pathlib

    import fsdp_core

    root = pathlib.Path(fsdp_core.__file__).parent
    found = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if "_getframe" in line or "inspect.stack" in line or "inspect.currentframe" in line
    ]
    assert found == []
