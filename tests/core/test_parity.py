"""fsdp_core trains like a data-parallel reference across strategies, prefetch modes, CPU
offload, state dict round trips and mixed precision."""

from __future__ import annotations

import itertools

import pytest
import torch

from fsdp_core import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

from ._models import build, wrap_model
from ._parity import (
    FP32_TOLERANCE,
    LOSS_TOLERANCE,
    PARAM_TOLERANCE,
    assert_same,
    assert_same_losses,
    full_params,
    precision_reference,
    reference,
    train,
)

KINDS = ["nested", "always_wrap", "frozen", "transformer", "moe"]
PREFETCHES = [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST]
STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]
CONFIGS = list(itertools.product(PREFETCHES, STRATEGIES, [False, True]))
POLICIES = [
    MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    MixedPrecision(param_dtype=torch.bfloat16),  # reduces in bf16
    MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
    MixedPrecision(param_dtype=torch.float16),  # reduces in fp16
]


# At four ranks (four-term sums, uneven shards) the default suite runs the models whose layouts
# differ most: the nested one and the transformer (tied weights, uneven flat shards); the other
# kinds run there under --run-slow (each also runs at two ranks by default).
KINDS_AT_FOUR = ["nested", "transformer"]


def _at_four() -> list:
    return [k if k in KINDS_AT_FOUR else pytest.param(k, marks=pytest.mark.slow) for k in KINDS]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.distributed(world_size=2)
def test_parity_with_data_parallel(kind, rank, world_size, process_group):
    """Losses and full parameters match DDP after several SGD+momentum steps.

    The whole matrix (backward prefetch x strategy x forward prefetch) runs twice: as is, and
    with CPU offload and a save/zero/load of the full state dict after every step.
    """
    _parity_with_data_parallel(kind, rank, world_size, process_group)


@pytest.mark.parametrize("kind", _at_four())
@pytest.mark.distributed(world_size=4)
def test_parity_with_data_parallel_at_four_ranks(kind, rank, world_size, process_group):
    _parity_with_data_parallel(kind, rank, world_size, process_group)


def _parity_with_data_parallel(kind, rank, world_size, process_group):
    ref_losses, ref_params = reference(kind, build(kind, rank), rank, process_group)
    # Two ranks: every gradient element is a sum of two terms, which is order independent, so
    # the results are bitwise equal. See _parity.FP32_TOLERANCE for larger worlds.
    tolerance = None if world_size == 2 else FP32_TOLERANCE
    for offload in (False, True):
        for backward_prefetch, strategy, forward_prefetch in CONFIGS:
            what = (
                f"{kind} {strategy.name} {backward_prefetch} forward_prefetch={forward_prefetch} "
                f"offload+save_load={offload}"
            )
            model = wrap_model(
                kind,
                build(kind, rank),
                process_group,
                sharding_strategy=strategy,
                backward_prefetch=backward_prefetch,
                forward_prefetch=forward_prefetch,
                cpu_offload=CPUOffload(offload_params=offload),
            )
            losses = train(model, kind, rank, save_load=offload)
            assert_same_losses(losses, ref_losses, tolerance=tolerance, what=what)
            assert_same(full_params(model), ref_params, tolerance=tolerance, what=what)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.distributed(world_size=2)
def test_mixed_precision_parity(kind, rank, world_size, process_group):
    """bf16/fp16 parameters, reduced in fp32 or in the parameter dtype, match a reference that
    runs the same precision by hand (see ``precision_reference``).

    Every policy runs with every strategy; the prefetch modes rotate over the runs, and CPU
    offload and the state dict round trip are on for every other run.
    """
    _mixed_precision_parity(kind, rank, world_size, process_group)


@pytest.mark.parametrize("kind", _at_four())
@pytest.mark.distributed(world_size=4)
def test_mixed_precision_parity_at_four_ranks(kind, rank, world_size, process_group):
    _mixed_precision_parity(kind, rank, world_size, process_group)


def _mixed_precision_parity(kind, rank, world_size, process_group):
    # World size 2: the same arithmetic and two-term sums, so bitwise equal (see
    # test_parity_with_data_parallel); larger worlds: see the tolerances in _parity.
    exact = world_size == 2
    rotation = itertools.cycle(itertools.product(PREFETCHES, [False, True]))
    for i, (policy, strategy) in enumerate(itertools.product(POLICIES, STRATEGIES)):
        if strategy is STRATEGIES[0]:
            ref_losses, ref_params = precision_reference(
                kind, build(kind, rank), rank, process_group, policy
            )
        backward_prefetch, forward_prefetch = next(rotation)
        offload = i % 2 == 1
        what = (
            f"{kind} {policy} {strategy.name} {backward_prefetch} "
            f"forward_prefetch={forward_prefetch} offload+save_load={offload}"
        )
        model = wrap_model(
            kind,
            build(kind, rank),
            process_group,
            sharding_strategy=strategy,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            cpu_offload=CPUOffload(offload_params=offload),
            mixed_precision=policy,
        )
        losses = train(model, kind, rank, save_load=offload)
        assert all(loss.dtype == policy.param_dtype for loss in losses), what
        reduce_dtype = policy.reduce_dtype or policy.param_dtype
        loss_tolerance = None if exact else LOSS_TOLERANCE[policy.param_dtype]
        param_tolerance = None if exact else PARAM_TOLERANCE.get(reduce_dtype, FP32_TOLERANCE)
        assert_same_losses(losses, ref_losses, tolerance=loss_tolerance, what=what)
        params = full_params(model)
        assert all(p.dtype == torch.float32 for p in params.values()), what
        assert_same(params, ref_params, tolerance=param_tolerance, what=what)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_parity_with_thread_ranks(rank, process_group):
    """The engine also runs on thread ranks (torch's threaded process group)."""
    ref_losses, ref_params = reference("nested", build("nested", rank), rank, process_group)
    model = wrap_model("nested", build("nested", rank), process_group)
    losses = train(model, "nested", rank)
    assert_same_losses(losses, ref_losses, tolerance=None, what="thread ranks")
    assert_same(full_params(model), ref_params, tolerance=None, what="thread ranks")
