"""Sharding over a subgroup whose ranks' group ranks differ from their global ranks.

World size 4 split into two groups of two, e.g. ``[2, 3]`` and ``[0, 1]``, or ``[1, 3]`` and
``[0, 2]``: global rank 3 is group rank 1, global rank 2 (or 1) is group rank 0. A unit must
shard, gather and reduce by group rank, and broadcast from the group's first rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_core import ShardingStrategy

from ._models import build, wrap_model
from ._parity import assert_same, assert_same_losses, full_params, reference, train

# Each split lists both groups; every rank calls new_group for each, in the same order.
SPLITS = {"[2,3]": ([0, 1], [2, 3]), "[1,3]": ([0, 2], [1, 3])}
KINDS = ["nested", "transformer"]


def _my_group(split: str, rank: int) -> tuple[dist.ProcessGroup, list[int]]:
    """Create the split's groups; return this rank's group and its members."""
    mine = None
    for ranks in SPLITS[split]:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group, ranks
    assert mine is not None
    return mine


def _expected_shard(full: torch.Tensor, group_rank: int, group_size: int) -> torch.Tensor:
    rows = full.shape[0]
    chunk = -(-rows // group_size)
    start = min(group_rank * chunk, rows)
    return full[start : min(start + chunk, rows)]


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.distributed(world_size=4)
def test_subgroup_shards_by_group_rank_and_matches_ddp(rank, kind, split):
    """Each rank holds its *group* rank's dim-0 shard, before and after training, and training
    over the subgroup equals DDP over the same subgroup for every strategy (two ranks per
    group: two-term sums, bitwise equal)."""
    group, members = _my_group(split, rank)
    group_rank = members.index(rank)
    assert group_rank == dist.get_rank(group)  # rank 3 is group rank 1, rank 2 or 1 is 0
    ref_losses, ref_params = reference(kind, build(kind, rank), rank, group)
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        what = f"{kind} {split} {strategy.name}"
        model = wrap_model(kind, build(kind, rank), group, sharding_strategy=strategy)
        initial = dict(build(kind, rank).named_parameters())
        for name, param in model.named_parameters():
            assert torch.equal(param.to_local(), _expected_shard(initial[name], group_rank, 2))
        losses = train(model, kind, rank)
        assert_same_losses(losses, ref_losses, tolerance=None, what=what)
        for name, param in model.named_parameters():
            expected = _expected_shard(ref_params[name], group_rank, 2)
            assert torch.equal(param.to_local().detach(), expected), (what, name)
        assert_same(full_params(model), ref_params, tolerance=None, what=what)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.distributed(world_size=4)
def test_subgroup_sync_module_states_broadcasts_from_the_groups_first_rank(rank, split):
    """sync_module_states takes every parameter from the group's first member (global rank 0 is
    not in every group): each rank then holds its group rank's shard of that member's model."""
    group, members = _my_group(split, rank)
    source = build("nested", rank)
    with torch.no_grad():
        for i, param in enumerate(source.parameters()):
            param.fill_(100 * members[0] + i)  # what the group's first rank holds
    model = build("nested", rank)
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            # The first member holds the source values; every other rank its own.
            param.fill_(100 * members[0] + i if rank == members[0] else -1.0 - rank)
    model = wrap_model("nested", model, group, sync_module_states=True)
    full = dict(source.named_parameters())
    for name, param in model.named_parameters():
        expected = _expected_shard(full[name], members.index(rank), 2)
        assert torch.equal(param.to_local().detach(), expected), name
