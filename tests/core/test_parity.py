"""fsdp_core trains like a data-parallel reference across strategies and prefetch modes."""

from __future__ import annotations

import itertools

import pytest

from fsdp_core import BackwardPrefetch, ShardingStrategy

from ._models import build, wrap_model
from ._parity import assert_same, assert_same_losses, full_params, reference, train

KINDS = ["nested", "always_wrap", "frozen", "transformer", "moe"]
CONFIGS = list(
    itertools.product(
        [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST],
        [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
        [False, True],
    )
)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.distributed(world_size=[2, 4])
def test_parity_with_data_parallel(kind, rank, world_size, process_group):
    """Losses and full parameters match the reference after several SGD+momentum steps."""
    ref_losses, ref_params = reference(kind, build(kind, rank), rank, process_group)
    # Two ranks: every gradient element is a sum of two terms, which is order independent, so
    # the results are bitwise equal. See _parity._assert_close for larger worlds.
    exact = world_size == 2
    for backward_prefetch, strategy, forward_prefetch in CONFIGS:
        what = f"{kind} {strategy.name} {backward_prefetch} forward_prefetch={forward_prefetch}"
        model = wrap_model(
            kind,
            build(kind, rank),
            process_group,
            sharding_strategy=strategy,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
        )
        losses = train(model, kind, rank)
        assert_same_losses(losses, ref_losses, exact=exact, what=what)
        assert_same(full_params(model), ref_params, exact=exact, what=what)


@pytest.mark.distributed(world_size=2, mode="thread")
def test_parity_with_thread_ranks(rank, process_group):
    """The engine also runs on thread ranks (torch's threaded process group)."""
    ref_losses, ref_params = reference("nested", build("nested", rank), rank, process_group)
    model = wrap_model("nested", build("nested", rank), process_group)
    losses = train(model, "nested", rank)
    assert_same_losses(losses, ref_losses, exact=True, what="thread ranks")
    assert_same(full_params(model), ref_params, exact=True, what="thread ranks")
