"""Argument checks of the wrapper door ``FullyShardedDataParallel``."""

from __future__ import annotations

from torch import nn

from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["validate_wrapper_args"]


def validate_wrapper_args(
    module: nn.Module,
    strategy: ShardingStrategy,
    cpu_offload: CPUOffload | None,
    backward_prefetch: BackwardPrefetch | None,
    mixed_precision: MixedPrecision | None,
) -> None:
    """Types and supported values of the wrapper's policy arguments; raises naming the fix."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module)!r}.")
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(
            f"sharding_strategy takes a ShardingStrategy, got {strategy!r}; e.g. "
            "ShardingStrategy.FULL_SHARD."
        )
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        raise NotImplementedError(
            f"sharding_strategy={strategy} is not supported yet: hybrid sharding comes in a "
            "later fsdp_core issue. Use FULL_SHARD or SHARD_GRAD_OP."
        )
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(
            f"backward_prefetch takes a BackwardPrefetch or None, got {backward_prefetch!r}."
        )
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"cpu_offload takes a CPUOffload or None, got {cpu_offload!r}.")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision takes a MixedPrecision or None, got {mixed_precision!r}; e.g. "
            "MixedPrecision(param_dtype=torch.bfloat16)."
        )
