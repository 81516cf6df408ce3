"""requires_grad changes made after wrapping: the units follow them.

See [Note: requires_grad changes after wrapping] in ``fsdp_core._unit``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from fsdp_core import FSDP, BackwardPrefetch, ShardingStrategy, events

from ._models import build, get_input, wrap_model
from ._parity import assert_same, assert_same_losses, full_params, reference, train

STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]


def _is_frozen(name: str) -> bool:
    """The parameters ``FrozenNestedModel`` freezes (``_models``)."""
    return name.startswith("inp.") or name == "block.0.bias"


def _freeze(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if _is_frozen(name):
            param.requires_grad_(False)


def _padded_numel(shape: torch.Size, world: int) -> int:
    """Numel of a gradient in the reduce buffer of a unit sharded over ``world`` ranks."""
    rows = shape[0]
    return -(-rows // world) * world * (shape.numel() // rows)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.distributed(world_size=2)
def test_parameters_frozen_after_wrapping_match_ddp(rank, world_size, process_group, strategy):
    """Freezing after wrapping trains like DDP on a model frozen before: the frozen parameters
    get no gradient and do not move, and each unit still reduces once, trainable bytes only."""
    ref_losses, ref_params = reference("frozen", build("frozen", rank), rank, process_group)
    model = wrap_model(
        "nested",
        build("nested", rank),
        process_group,
        sharding_strategy=strategy,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    )
    _freeze(model)
    losses = train(model, "nested", rank)
    # Two ranks: the same arithmetic and two-term sums, so bitwise equal (see test_parity).
    assert_same_losses(losses, ref_losses, tolerance=None, what=strategy.name)
    assert_same(full_params(model), ref_params, tolerance=None, what=strategy.name)

    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        model(get_input("nested", rank, 0)).sum().backward()
    for name, param in model.named_parameters():
        assert (param.grad is None) is _is_frozen(name), name
    reductions = [
        e
        for e in seen
        if e.rank == rank
        and isinstance(e, events.Collective)
        and e.op.startswith(("reduce", "all_reduce"))
    ]
    assert sorted(e.unit for e in reductions) == ["", "block"]  # one collective per unit
    shard_world = 1 if strategy is ShardingStrategy.NO_SHARD else world_size
    shapes = {n: p.shape for n, p in build("nested", rank).named_parameters()}
    for e in reductions:
        trainable = [
            shape
            for n, shape in shapes.items()
            if not _is_frozen(n) and n.startswith("block.") == (e.unit == "block")
        ]
        # Plus the order tag: two elements per rank after each row (see [Note: order check]).
        tag = shard_world * 2 * world_size
        assert e.bytes == (sum(_padded_numel(s, shard_world) for s in trainable) + tag) * 4, e


@pytest.mark.distributed(world_size=2)
def test_parameters_unfrozen_after_wrapping_match_ddp(rank, process_group):
    """Unfreezing after wrapping trains the parameters, like DDP on a model never frozen (the
    post-backward hooks of the newly trainable parameters are registered at the forward)."""
    ref_losses, ref_params = reference("nested", build("nested", rank), rank, process_group)
    model = wrap_model("frozen", build("frozen", rank), process_group)
    model.requires_grad_(True)
    losses = train(model, "nested", rank)
    assert_same_losses(losses, ref_losses, tolerance=None, what="unfrozen")
    assert_same(full_params(model), ref_params, tolerance=None, what="unfrozen")


@pytest.mark.distributed(world_size=2)
def test_freezing_between_steps(rank, process_group):
    """A parameter frozen after a step keeps the value that step gave it."""
    model = wrap_model("nested", build("nested", rank), process_group)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(get_input("nested", rank, 0)).sum().backward()
    optim.step()
    optim.zero_grad()
    _freeze(model)
    after_first = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(get_input("nested", rank, 1)).sum().backward()
    optim.step()
    for name, param in model.named_parameters():
        assert torch.equal(param, after_first[name]) is _is_frozen(name), name


@pytest.mark.distributed(world_size=2)
def test_backward_prefetch_skips_units_without_backward(rank, process_group):
    """A unit whose forward output needs no gradient (frozen, with no trainable layer before
    it) runs no backward, so BACKWARD_PRE does not gather it again."""
    model = wrap_model(
        "nested",
        build("nested", rank),
        process_group,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    )
    model.inp.requires_grad_(False)
    model.block.requires_grad_(False)
    assert FSDP.fsdp_modules(model)[1] is model.block
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        model(get_input("nested", rank, 0)).sum().backward()
    unshards = Counter(
        (e.unit, e.reason) for e in seen if e.rank == rank and isinstance(e, events.Unshard)
    )
    assert unshards == {("", "forward"): 1, ("block", "forward"): 1}
