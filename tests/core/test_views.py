"""``fsdp_core.unit_views``: one frozen view per unit, for both doors (the wrapper, ``fully_shard``,
``replicate``), 1-D and hybrid (2-D), checked field by field against hand counts, before and
after the first forward (``is_root`` and the root's ``reshard_after_forward`` are decided
there), and on a fake world of 1024 ranks with the model on the meta device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_core import (
    FSDP,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    ParamView,
    ShardedState,
    ShardingStrategy,
    TrainingState,
    UnitView,
    fully_shard,
    replicate,
    unit_views,
)
from fsdp_core._composable._api import reduce_follows_grad_dtype
from fsdp_core.wrap import ModuleWrapPolicy


class _Two(nn.Module):
    """``a``: Linear(5, 3) (3 rows: uneven over 2 ranks); the rest, ``b``: Linear(3, 2)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _param(view: UnitView, fqn: str) -> ParamView:
    found = [p for p in view.params if p.fqn == fqn]
    assert len(found) == 1, [p.fqn for p in view.params]
    return found[0]


def _by_fqn(model: nn.Module) -> dict[str, UnitView]:
    return {view.fqn: view for view in unit_views(model)}


@pytest.mark.distributed(world_size=2)
def test_wrapper_door_views_before_and_after_the_first_forward(rank, process_group):
    model = FSDP(
        _Two(),
        process_group,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float16),
    )
    # The policy wraps both Linears; the root owns no parameter, so it has no unit.
    views = _by_fqn(model)
    assert sorted(views) == ["a", "b"]
    a = views["a"]
    assert (a.door, a.is_root, a.module_fqns) == ("FullyShardedDataParallel", None, ("a",))
    assert [p.fqn for p in a.params] == ["a.weight", "a.bias"]
    weight = _param(a, "a.weight")
    # 3 rows over 2 ranks: 2 per rank after padding; rank 1 holds 1 row and 1 row of padding.
    assert (weight.shape, weight.dtype, weight.shard_dim, weight.padded_rows) == (
        (3, 5), torch.float32, 0, 2,
    )  # fmt: skip
    assert (weight.start_row, weight.local_shape, weight.padding_numel) == (
        ((0, (2, 5), 0), (2, (1, 5), 5))[rank]
    )
    assert weight.local_rows == (2, 1)[rank] and weight.requires_grad
    assert (a.shard_size, a.shard_rank, a.shard_ranks) == (2, rank, (0, 1))
    assert (a.shard_group is not None, a.replicate_group) == (True, None)
    assert (a.replicate_size, a.replicate_rank, a.replicate_ranks) == (1, 0, (rank,))
    assert a.world == 2
    # The policy's param_dtype; reduce in it, as nothing else was given.
    assert (a.param_dtype, a.reduce_dtype, a.output_dtype, a.buffer_dtype) == (
        torch.bfloat16, torch.bfloat16, None, torch.float16,
    )  # fmt: skip
    assert a.gather_dtype(weight) is torch.bfloat16
    assert a.grad_reduce_dtype(weight) is torch.bfloat16
    assert (a.offload_params, a.compute_device) == (False, torch.device("cpu"))
    assert (a.sharding_strategy, a.reshard_after_forward, a.order_check) == (
        ShardingStrategy.FULL_SHARD, True, True,
    )  # fmt: skip
    assert (a.state, a.training_state) == (ShardedState.SHARDED, TrainingState.IDLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.fqn = "x"  # type: ignore[misc]

    model(torch.randn(4, 5)).sum().backward()
    after = _by_fqn(model)
    assert [v.is_root for v in after.values()] == [False, False]
    assert all(v.reshard_after_forward is True for v in after.values())


@pytest.mark.distributed(world_size=2)
def test_wrapper_root_keeps_its_parameters_and_no_shard_replicates(rank, process_group):
    model = FSDP(_Two(), process_group, auto_wrap_policy=ModuleWrapPolicy({_Leaf}))
    assert [(v.fqn, v.reshard_after_forward) for v in unit_views(model)] == [("", True)]
    model(torch.randn(2, 5)).sum().backward()
    (root,) = unit_views(model)
    assert (root.is_root, root.reshard_after_forward, root.param_dtype, root.reduce_dtype) == (
        True, False, None, None,
    )  # fmt: skip
    assert [p.fqn for p in root.params] == ["a.weight", "a.bias", "b.weight", "b.bias"]

    replicated = FSDP(_Two(), process_group, sharding_strategy=ShardingStrategy.NO_SHARD)
    (view,) = unit_views(replicated)
    assert (view.shard_group, view.shard_size, view.shard_ranks) == (None, 1, (rank,))
    assert (view.replicate_size, view.replicate_rank, view.replicate_ranks) == (2, rank, (0, 1))
    weight = _param(view, "a.weight")
    assert (weight.padded_rows, weight.local_shape, weight.padding_numel) == (3, (3, 5), 0)
    assert (view.sharding_strategy, view.reshard_after_forward) == (
        ShardingStrategy.NO_SHARD,
        False,
    )


class _Leaf(nn.Module):
    """Never instantiated: a policy that wraps nothing below the root."""


@pytest.mark.distributed(world_size=2)
def test_composable_door_views(rank, process_group):
    mesh = DeviceMesh.from_group(process_group, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    replicate(model[0], mesh=mesh)
    fully_shard(
        [model[1], model[2]],
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(pin_memory=False),
        reshard_after_forward=False,
    )
    fully_shard(model, mesh=mesh)
    views = _by_fqn(model)
    assert list(views) == ["", "0", "1"]
    rep, pair, root = views["0"], views["1"], views[""]
    assert (rep.door, rep.shard_size, rep.replicate_size, rep.replicate_ranks) == (
        "replicate", 1, 2, (0, 1),
    )  # fmt: skip
    assert (rep.reshard_after_forward, rep.sharding_strategy) == (False, None)
    assert (pair.door, pair.module_fqns) == ("fully_shard", ("1", "2"))
    assert [p.fqn for p in pair.params] == ["1.weight", "1.bias", "2.weight", "2.bias"]
    # reduce_dtype=None: bf16 like param_dtype up to torch 2.14; from 2.15 the gradients' own
    # dtype (fp32 here), which the view shows as None.
    reduce = None if reduce_follows_grad_dtype() else torch.bfloat16
    assert (pair.param_dtype, pair.reduce_dtype, pair.output_dtype) == (
        torch.bfloat16, reduce, torch.float32,
    )  # fmt: skip
    assert (pair.offload_params, pair.reshard_after_forward) == (True, False)
    assert [p.fqn for p in root.params] == ["3.weight", "3.bias"]
    # The root's default reshard_after_forward keeps its parameters, once it is the root.
    assert (root.is_root, root.reshard_after_forward) == (None, True)
    model[0].weight.requires_grad_(False)
    assert not _param(_by_fqn(model)["0"], "0.weight").requires_grad
    model.unshard()  # type: ignore[operator]
    assert _by_fqn(model)[""].state is ShardedState.UNSHARDED
    model.reshard()  # type: ignore[operator]
    model(torch.randn(2, 4)).sum().backward()
    root = _by_fqn(model)[""]
    assert (root.is_root, root.reshard_after_forward, root.state) == (
        True, False, ShardedState.SHARDED,
    )  # fmt: skip


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("door", ["fully_shard", "HYBRID_SHARD"])
def test_hybrid_views_name_both_groups(rank, process_group, door):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model: nn.Module = _Two()
    if door == "fully_shard":
        fully_shard(model, mesh=mesh)
    else:
        model = FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    (view,) = unit_views(model)
    shard_ranks = ((0, 1), (2, 3))[rank // 2]
    replicate_ranks = ((0, 2), (1, 3))[rank % 2]
    assert (view.shard_size, view.shard_rank, view.shard_ranks) == (2, rank % 2, shard_ranks)
    assert (view.replicate_size, view.replicate_rank, view.replicate_ranks) == (
        2, rank // 2, replicate_ranks,
    )  # fmt: skip
    assert view.world == 4 and view.shard_group is not None and view.replicate_group is not None
    assert dist.get_process_group_ranks(view.replicate_group) == list(replicate_ranks)
    # Sharded inside the group of 2 only: rows are padded to a multiple of 2, not 4.
    assert _param(view, "a.weight").padded_rows == 2
    expected = None if door == "fully_shard" else ShardingStrategy.HYBRID_SHARD
    assert view.sharding_strategy is expected


@pytest.mark.distributed(world_size=1024, mode="fake")
def test_views_of_a_meta_model_on_a_fake_world(rank, world_size):
    """The sharding math of rank 0 of 1024, with no parameter allocated."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 3000), nn.Linear(3000, 10))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner, root = _by_fqn(model)["0"], _by_fqn(model)[""]
    weight = _param(inner, "0.weight")
    assert (weight.padded_rows, weight.local_shape, weight.padding_numel) == (3, (3, 64), 0)
    # 10 rows over 1024 ranks: rank 0 holds one, the padding of every rank is the rest.
    out = _param(root, "1.weight")
    assert (out.padded_rows, out.local_shape, out.padding_numel) == (1, (1, 3000), 0)
    assert (root.shard_size, len(root.shard_ranks), root.shard_rank) == (1024, 1024, 0)
    assert all(p.is_meta for p in model.parameters())
