"""Argument checks of the wrapper door ``FullyShardedDataParallel``, and its process groups."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from .._groups import (
    UnitGroups,
    default_hybrid_groups,
    hybrid_groups_from_mesh,
    hybrid_groups_from_pair,
)
from .._init import nested_unit_modules
from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

__all__ = [
    "HYBRID_STRATEGIES",
    "consumed_by_nested",
    "resolve_wrapper_groups",
    "validate_hybrid_agreement",
    "validate_wrapper_args",
]

_API = "FullyShardedDataParallel"

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


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


def resolve_wrapper_groups(
    strategy: ShardingStrategy, process_group: object, device_mesh: Any
) -> UnitGroups:
    """The groups of a wrapper instance. See [Note: unit groups] in ``_groups``.

    Hybrid strategies take ``device_mesh`` (2-D), ``process_group=(shard, replicate)`` or
    neither (shard within a node: ``default_hybrid_groups``); the others one group or a 1-D
    mesh (default: the world).
    """
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            f"{_API}: pass process_group or device_mesh, not both (got {process_group!r} and "
            f"{device_mesh!r}). Pass only the mesh."
        )
    if strategy in HYBRID_STRATEGIES:
        api = f"{_API}(sharding_strategy={strategy.name})"
        if device_mesh is not None:
            return hybrid_groups_from_mesh(api, device_mesh)
        if process_group is None:
            return default_hybrid_groups(api)
        return hybrid_groups_from_pair(api, process_group)
    if isinstance(process_group, tuple):
        raise ValueError(
            f"{_API}: process_group={process_group!r} is a (shard, replicate) pair, which only "
            f"the hybrid strategies take, but sharding_strategy={strategy.name}. Pass "
            "sharding_strategy=ShardingStrategy.HYBRID_SHARD, or a single process group."
        )
    group: dist.ProcessGroup | None
    if device_mesh is not None:
        if getattr(device_mesh, "ndim", None) != 1:
            raise ValueError(
                f"{_API}: sharding_strategy={strategy.name} takes a 1-D device_mesh, got "
                f"{device_mesh!r}. Pass a hybrid strategy (HYBRID_SHARD) for a 2-D mesh, or "
                "mesh['shard'] to shard over one dimension."
            )
        group = device_mesh.get_group()
    else:
        group = process_group if process_group is not None else dist.group.WORLD  # type: ignore[assignment]
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{_API}: process_group takes a ProcessGroup or None, got {group!r}.")
    if strategy is ShardingStrategy.NO_SHARD:
        return UnitGroups(replicate=group)
    return UnitGroups(shard=group)


def validate_hybrid_agreement(
    instances: Sequence[tuple[str, ShardingStrategy, UnitGroups]],
) -> None:
    """Instances with hybrid strategies must use the same groups, among themselves only.

    ``instances``: ``(name, strategy, groups)`` of every wrapper in a tree. Instances of other
    strategies may use any group (e.g. a mixture of experts' per-rank experts), and the two
    hybrid strategies may be mixed, as in torch (seed 002).
    """
    hybrid = [(n, groups.ranks()) for n, s, groups in instances if s in HYBRID_STRATEGIES]
    differing = [(name, ranks) for name, ranks in hybrid if ranks != hybrid[0][1]]
    if differing:
        first_name, (shard, replicate) = hybrid[0]
        name, (other_shard, other_replicate) = differing[0]
        raise ValueError(
            f"{_API}: instances with hybrid sharding strategies must use the same process "
            f"groups, but {first_name!r} shards over ranks {list(shard)} replicated across "
            f"{list(replicate)} and {name!r} over {list(other_shard)} across "
            f"{list(other_replicate)} (on rank {dist.get_rank()}). Pass every hybrid instance "
            "the same device_mesh or process_group pair (auto_wrap_policy does), or use "
            "FULL_SHARD for the instance that needs other groups."
        )


def consumed_by_nested(
    module: nn.Module, specs: Sequence[Any], is_unit: Callable[[nn.Module], bool]
) -> dict[int, weakref.ref[nn.Parameter]]:
    """The original parameters the wrapper instances nested in ``module`` took over, by id
    (weakly: a replaced original may be freed and its id reused, e.g. by ``param_init_fn``).

    Raises:
        ValueError: one of ``specs`` (``module``'s own parameters) is also a nested one's.
    """
    nested = {
        i: ref
        for child in nested_unit_modules(module, is_unit)
        for i, ref in getattr(child, "_consumed_params", {}).items()
    }
    shared = sorted(s.fqn for s in specs if (r := nested.get(id(s.param))) and r() is s.param)
    if shared:
        raise ValueError(
            f"FullyShardedDataParallel: parameters {shared} are shared between a nested "
            "FSDP instance and its parent. Shared (tied) parameters must belong to one "
            "unit: wrap their lowest common ancestor instead (change the auto_wrap_policy "
            "so the modules using them are not wrapped separately), or use fully_shard, "
            "which moves them to that unit."
        )
    return nested
